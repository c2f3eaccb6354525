"""Reports are typed data: the dataclasses that inspect and verify return serialize to the
`--json` documents with `to_json`; only the command layer (quantcli/cli/commands.py, render.py) prints them.

Every command's document starts with the same envelope (`envelope`): quantcli_version,
schema_version, command, and source / destination where they apply; the JSON Schema of each
command's document is in quantcli/schemas/ (docs/cli.md explains the fields).

A field holding OMITTED is left out of the document (the key is absent, as when a check did not
run or a value does not apply to this entry); None is written as JSON null. A field whose metadata
says json=False (e.g. the config inspect read) is for the command layer only.
"""

from __future__ import annotations

import json
import math
from dataclasses import fields, is_dataclass
from importlib.resources import files

from quantcli import __version__

# Bumped when a field is removed or changes meaning; adding a field keeps the version.
SCHEMA_VERSION = 1


class _Omitted:
    """The marker for a field that is left out of the JSON document."""

    def __repr__(self) -> str:
        return "OMITTED"

    def __bool__(self) -> bool:
        return False


OMITTED = _Omitted()
NOT_IN_JSON = {"json": False}


def to_json(obj: object) -> object:
    """Dataclasses -> dicts (field order, OMITTED fields dropped), recursively through dicts,
    lists and tuples; other values as they are."""
    if is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_json(getattr(obj, f.name)) for f in fields(obj)
                if f.metadata.get("json", True) and getattr(obj, f.name) is not OMITTED}
    if isinstance(obj, dict):
        return {k: to_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_json(v) for v in obj]
    return obj


def given(value: object) -> bool:
    """Whether a field holds a value (not OMITTED, not None)."""
    return value is not OMITTED and value is not None


def envelope(command: str, report: object, *, source: object = OMITTED, destination: object = OMITTED,
             **extra: object) -> dict:
    """The --json document of `command`: the envelope (version, schema version, the command, its
    source and destination where they apply), then the report's own fields, then `extra`."""
    head: dict = {"quantcli_version": __version__, "schema_version": SCHEMA_VERSION, "command": command}
    for key, value in (("source", source), ("destination", destination)):
        if value is not OMITTED:
            head[key] = None if value is None else str(value)
    body = to_json(report)
    if not isinstance(body, dict):
        raise TypeError(f"a {command} report must serialize to a JSON object, not {type(body).__name__}")
    return _finite({**head, **body, **to_json(extra)})


def _finite(obj: object) -> object:
    """Strict JSON: a non-finite float (an identical tensor's SQNR, a corrupt scale) is written as
    the string "Infinity", "-Infinity" or "NaN", which every JSON parser reads."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def excluded_entries(exclusions) -> list[dict]:
    """`excluded`, one shape in every document: [{module, reason}] from objects with .module and .reason."""
    return [{"module": e.module, "reason": e.reason} for e in exclusions]


def json_schema(name: str) -> dict:
    """The JSON Schema of one command's document (quantcli/schemas/NAME.json, shipped with the
    package): convert, convert-dry-run, inspect, verify, push; common holds the shared parts."""
    return json.loads(files("quantcli").joinpath("schemas", f"{name}.json").read_text(encoding="utf-8"))


def block_label(block) -> str:
    """`tensor`, `1xK` (a scale per row), `128x128`, `1x16`: how recipes, inspect and the docs
    name a scale's block."""
    rows, cols = block
    if rows == 0 and cols == 0:
        return "tensor"
    return f"{rows}x{cols or 'K'}"
