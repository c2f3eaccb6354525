"""Reports are typed data: the dataclasses that inspect and verify return serialize to the
`--json` documents with `to_json`; only the command layer (commands.py, render.py) prints them.

A field holding OMITTED is left out of the document (the key is absent, as when a check did not
run or a value does not apply to this entry); None is written as JSON null. A field whose metadata
says json=False (e.g. the config inspect read) is for the command layer only.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass


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
