"""The JSON files of a checkpoint (config.json, hf_quant_config.json, the index), read and
type-checked in one place: a key of the wrong type is refused naming the file and the key
instead of being misread later (a string `ignore` iterated character by character)."""

from __future__ import annotations

import json
from pathlib import Path

from quantcli.checkpoint.safetensors_io import open_regular_file
from quantcli.errors import CheckpointError


def _load_json(path: Path) -> dict:
    """A JSON object file (config.json, the index); {} when absent."""
    try:
        with open_regular_file(str(path)) as f:
            text = f.read().decode("utf-8")
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{path}: is not UTF-8 text; the file is corrupt") from None
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: cannot parse JSON ({exc}); the file is corrupt") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: holds a JSON {type(obj).__name__}, but it must be a JSON object; "
                              f"the file is corrupt")
    return obj


# ---------------------------------------------------------------- the quantization keys quantcli reads
#
# Checked once, when a source's config.json (or hf_quant_config.json) is loaded, so every reader
# (detect, the layouts, inspect, verify, convert) may rely on the types below. A key that is
# absent or null is "not set"; any other value of the wrong JSON type is refused, naming the file
# and the key, instead of being read character by character or crashing a reader.

EXCLUSION_KEYS = ("ignore", "exclude_modules", "ignored_layers", "modules_to_not_convert")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_str_list(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _is_int_pair(value: object) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(_is_int(v) and v > 0 for v in value)


KIND_CHECKS = {  # expected type (as said in the message) -> the check
    "a JSON object": lambda v: isinstance(v, dict),
    "a string": lambda v: isinstance(v, str),
    "an integer": _is_int,
    "a list of strings": _is_str_list,
    "a list of 2 positive integers": _is_int_pair,
}
# key -> expected type, for the sections that hold quantization settings
SECTION_KEYS = {"quant_method": "a string", "quant_algo": "a string", "kv_cache_quant_algo": "a string",
                "format": "a string", "group_size": "an integer", "weight_block_size": "a list of 2 positive integers",
                "config_groups": "a JSON object", **{k: "a list of strings" for k in EXCLUSION_KEYS}}
# compressed-tensors config_groups.<group> and its weights, as CompressedTensorsLayout reads them
GROUP_KEYS = {"targets": "a list of strings", "weights": "a JSON object"}
NOT_NULLABLE = ("targets",)  # read as `group.get("targets", [])`: absent is fine, null is not
WEIGHTS_KEYS = {"num_bits": "an integer", "type": "a string", "strategy": "a string", "group_size": "an integer"}


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def _require(section: dict, keys: dict[str, str], file: str, where: str) -> None:
    for key, kind in keys.items():
        value = section.get(key)
        if key not in section or (value is None and key not in NOT_NULLABLE):
            continue
        if not KIND_CHECKS[kind](value):
            raise CheckpointError(f"{file}: {where}{key} is {_json_type(value)} ({json.dumps(value)[:60]}), but it "
                                  f"must be {kind}; the quantization config is malformed (fix or remove the key)")


def _require_object(value: object, file: str, key: str, nullable: bool = True) -> dict:
    """`value` as a section ({} when absent or null, if `nullable`), or one line naming the key."""
    if value is None and nullable:
        return {}
    if not isinstance(value, dict):
        raise CheckpointError(f"{file}: {key} is {_json_type(value)} ({json.dumps(value)[:60]}), but it must be a "
                              f"JSON object; the quantization config is malformed (fix or remove the key)")
    return value


def _check_section(section: dict, file: str, where: str) -> None:
    _require(section, SECTION_KEYS, file, where)
    for name, group in (section.get("config_groups") or {}).items():
        group = _require_object(group, file, f"{where}config_groups.{name}", nullable=False)
        _require(group, GROUP_KEYS, file, f"{where}config_groups.{name}.")
        weights = group.get("weights") or {}
        _require(weights, WEIGHTS_KEYS, file, f"{where}config_groups.{name}.weights.")


def check_quantization_keys(obj: dict, file: str) -> dict:
    """`obj` (config.json or hf_quant_config.json, already a JSON object) with the types of every
    quantization key quantcli reads checked; one line naming the file and key otherwise."""
    if file.endswith("hf_quant_config.json"):
        _check_section(_require_object(obj.get("quantization"), file, "quantization"), file, "quantization.")
    else:
        _check_section(_require_object(obj.get("quantization_config"), file, "quantization_config"), file,
                       "quantization_config.")
    return obj


def load_config(path: Path) -> dict:
    """config.json or hf_quant_config.json: a JSON object ({} when absent) whose quantization keys
    have the types quantcli reads them as."""
    return check_quantization_keys(_load_json(path), str(path))
