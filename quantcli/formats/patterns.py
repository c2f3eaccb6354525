"""Module-name patterns: the one matcher behind `--ignore`, `targets`, `[[override]]`,
`--tensors`, and the exclusion lists that inspect and verify read from a checkpoint's config.

A pattern covers a name (a module such as `model.layers.0.self_attn.q_proj`, or a tensor name)
by the first of these rules that applies:

| rule          | pattern form                      | covers                                            |
|---------------|-----------------------------------|---------------------------------------------------|
| `regex`       | `re:REGEX`                        | `re.match(REGEX, name)`: anchored at the start, not at the end |
| `exact`       | `a.b.c`                           | the name `a.b.c` itself                           |
| `glob`        | `*`, `?` or `[...]` in it         | `fnmatchcase(name, pattern)`; `*` crosses dots    |
| `parent`      | `a.b` (exact or glob)             | every name below a module the pattern names: `model.layers.*.self_attn` covers `model.layers.0.self_attn.q_proj` |
| `segment`     | `a.b` (no wildcard)               | a run of whole dot-separated parts anywhere in the name: `self_attn`, `mlp.gate`, `lm_head` |
| `fused`       | `<parent>.qkv_proj`, `qkv_proj`   | the shards fused into it: `<parent>.q_proj`, `.k_proj`, `.v_proj` |

The fused name (`<parent>.qkv_proj`) is matched by the rules above, so a bare `qkv_proj` covers
every layer's q/k/v. Matching is always on whole dot-separated parts except for `regex` and `glob`, so
`model.layers.1` never covers `model.layers.10`, and `mlp.gate` never covers `mlp.gate_up_proj`.

Which consumer honours which rule (read from their sources; see docs/formats.md,
"What is never quantized by default" and "Exclusion lists and how consumers match them"):

| consumer (config key)                                   | regex | exact | glob | parent | segment | fused |
|---------------------------------------------------------|-------|-------|------|--------|---------|-------|
| compressed-tensors `targets`/`ignore` (`utils/match.py::_match_name`; `targets` also take a class name such as `Linear`) | re.match | yes | - | - | - | - |
| vLLM compressed-tensors (`compressed_tensors/utils.py::should_ignore_layer`, `find_matched_target`) | re.match | yes | - | - | - | exact fused name |
| vLLM modelopt `exclude_modules` (`modelopt.py::is_layer_excluded`: exact with fused shards, substring, `fnmatch`) | - | yes | fnmatch | via `name*` | plain substring | yes |
| vLLM `fp8` `ignored_layers` (`quant_utils.py::is_layer_skipped`) | - | yes | - | - | substring (some models) | shards |
| SGLang `modules_to_not_convert` / `ignored_layers` (`quantization/utils.py::_module_path_match`) | - | yes | - | yes | yes (dot-bounded) | shards |
| SGLang modelopt `exclude_modules` (`is_layer_excluded`: `*` -> `.*`, fullmatch) | - | yes | `*` only | via `name*` | - | - |
| transformers `modules_to_not_convert` (`quantizers_utils.py::should_convert_module`: entry as a regex, re.match, or name.endswith(entry)) | implicit | yes | regex-like | yes | suffix | - |
| vLLM / SGLang `quant_method: mxfp4` (gpt-oss) | - | - | - | - | - | - (every Linear stays dense; only MoE experts are MXFP4) |

quantcli applies the union of these rules, on dot boundaries where a consumer uses a plain
substring (vLLM modelopt, older SGLang) because a substring match (`layers.1` inside `layers.16`)
is a consumer bug, not a convention a producer relies on. `regex` follows compressed-tensors and
vLLM (`re.match`, so `re:.*q_proj` also covers `...q_proj_extra`; end it with `$` to stop there).
`match_rule` says which rule matched, so a caller can tell a pattern that only some consumers
honour from one that all do.
"""  # noqa: E501 (markdown tables: a row cannot be wrapped)

from __future__ import annotations

import fnmatch
import re
from functools import lru_cache
from typing import Iterable

from quantcli.errors import QuantcliError

REGEX_PREFIX = "re:"
GLOB_CHARS = frozenset("*?[")
# Engine module name -> the checkpoint modules fused into it (vLLM/SGLang packed_modules_mapping).
FUSED_SHARDS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "fused_qkv_a_proj_with_mqa": ("q_a_proj", "kv_a_proj_with_mqa"),
    "in_proj_ba": ("in_proj_b", "in_proj_a"),
    "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
}


def _fused_names_by_shard() -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {}
    for fused, shards in FUSED_SHARDS.items():
        for shard in shards:
            out[shard] = (*out.get(shard, ()), fused)
    return out


_FUSED_OF_SHARD = _fused_names_by_shard()


REGEX_HINT = "write re:REGEX with a Python regular expression, or a glob such as '*q_proj'"


@lru_cache(maxsize=1024)
def _regex(pattern: str) -> re.Pattern:
    """The compiled `re:` pattern; an invalid one is a usage error wherever it is first used."""
    try:
        return re.compile(pattern[len(REGEX_PREFIX):])
    except re.error as exc:
        raise QuantcliError(f"pattern {pattern!r}: not a valid regex ({exc}); {REGEX_HINT}") from None


def validate(pattern: object, option: str) -> str:
    """The pattern, checked where the user gave it; raises one line naming `option`."""
    if not isinstance(pattern, str):
        raise QuantcliError(f"{option} {pattern!r}: a pattern must be a string (a module name, a glob or re:REGEX), "
                            f"not {type(pattern).__name__}")
    if not pattern.strip() or pattern == REGEX_PREFIX:
        raise QuantcliError(f"{option} {pattern!r}: an empty pattern matches nothing; give a module name, a glob "
                            f"such as '*q_proj' or re:REGEX")
    if pattern.startswith(REGEX_PREFIX):
        try:
            re.compile(pattern[len(REGEX_PREFIX):])
        except re.error as exc:
            raise QuantcliError(f"{option} {pattern!r}: not a valid regex ({exc}); {REGEX_HINT}") from None
    return pattern


def _is_glob(pattern: str) -> bool:
    return any(c in GLOB_CHARS for c in pattern)


def _ancestors(name: str) -> Iterable[str]:
    """`a.b.c` -> `a`, `a.b` (the modules that hold it)."""
    parts = name.split(".")
    for i in range(1, len(parts)):
        yield ".".join(parts[:i])


def _plain_rule(pattern: str, name: str) -> str | None:
    """exact, glob, parent or segment (no regex, no fused names)."""
    if pattern == name:
        return "exact"
    if _is_glob(pattern):
        if fnmatch.fnmatchcase(name, pattern):
            return "glob"
        if any(fnmatch.fnmatchcase(a, pattern) for a in _ancestors(name)):
            return "parent"
        return None
    if name.startswith(pattern + "."):
        return "parent"
    if f".{pattern}." in f".{name}.":
        return "segment"
    return None


def match_rule(pattern: str, name: str) -> str | None:
    """Which rule (see the module docstring) makes `pattern` cover `name`, or None."""
    if pattern.startswith(REGEX_PREFIX):
        return "regex" if _regex(pattern).match(name) else None
    rule = _plain_rule(pattern, name)
    if rule is not None:
        return rule
    parent, _, leaf = name.rpartition(".")
    for fused in _FUSED_OF_SHARD.get(leaf, ()):  # the engine's fused name, matched as any name is
        fused_name = f"{parent}.{fused}" if parent else fused
        if _plain_rule(pattern, fused_name) is not None:
            return "fused"
    return None


def matches(pattern: str, name: str) -> bool:
    return match_rule(pattern, name) is not None


def matches_any(patterns: Iterable[str], name: str) -> bool:
    return any(match_rule(p, name) is not None for p in patterns)


def matches_target(target: str, module: str, module_class: str = "Linear") -> bool:
    """A compressed-tensors `targets` entry: a class name (every quantized module is a Linear to
    quantcli) or a name pattern."""
    return target == module_class or matches(target, module)


__all__ = ["FUSED_SHARDS", "match_rule", "matches", "matches_any", "matches_target", "validate"]
