"""Build transformers' view of a checkpoint (quantcli/formats/transformers_view.py says what it
holds and why): the checkpoint's architecture built on the meta device by model/build.py, the
one place quantcli builds a transformers model, then its loader's renamings and merges read off
it with transformers' own functions."""

from __future__ import annotations

import json
from typing import Iterable, Mapping

import torch

from quantcli.errors import QuantcliError
from quantcli.formats.transformers_view import TransformersView
from quantcli.model.build import meta_model

# transformers (optional: the calibrate extra) is imported after meta_model has found it installed.

_CACHE: dict[tuple[str, frozenset[str]], TransformersView | None] = {}


def view(config: Mapping, modules: Iterable[str]) -> TransformersView | None:
    """transformers' view of a checkpoint of `config` whose 2-D weights are `modules` (checkpoint
    module names), or None when transformers cannot build its model class."""
    names = frozenset(modules)
    key = (json.dumps(config, sort_keys=True, default=str), names)
    if key not in _CACHE:
        if len(_CACHE) >= 4:
            _CACHE.clear()
        _CACHE[key] = _build(config, names)
    return _CACHE[key]


def _build(config: Mapping, names: frozenset[str]) -> TransformersView | None:
    try:
        model = meta_model(dict(config), "transformers' view", quiet=True, as_loaded=True)
    except QuantcliError:  # not installed, remote code, a config it refuses: the name rules apply
        return None
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import MergeModulelist, WeightConverter, WeightRenaming, rename_source_key

    conversions = get_model_conversion_mapping(model)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    merging = {p for c in converters if any(isinstance(op, MergeModulelist) for op in c.operations)
               for p in c.source_patterns}
    params = model.state_dict()
    renamed, merged = {}, set()
    for module in sorted(names, key=_natural):  # in the loader's order (GroupWeightRename guards)
        key, pattern = rename_source_key(f"{module}.weight", renamings, converters, model.base_model_prefix, params)
        if pattern in merging:
            merged.add(module)
        elif key.endswith(".weight") and key in params and key[: -len(".weight")] != module:
            if isinstance(model.get_submodule(key[: -len(".weight")]), torch.nn.Linear):
                renamed[module] = key[: -len(".weight")]  # what compressed-tensors' `Linear` target meets
    return TransformersView(type(model).__name__, renamed, _heads(model, renamed), frozenset(merged), model,
                            frozenset(m for m in names if _is_conv1d(model, renamed.get(m, m))))


def _is_conv1d(model: torch.nn.Module, module: str) -> bool:
    try:
        return type(model.get_submodule(module)).__name__ == "Conv1D"  # transformers.pytorch_utils.Conv1D
    except AttributeError:
        return False


def _heads(model: torch.nn.Module, renamed: Mapping[str, str]) -> tuple[str, ...]:
    """The output head's names: transformers' and the checkpoint's (a tied head has no tensor;
    its checkpoint name is the one the checkpoint would have, by the reverse renaming)."""
    try:
        head = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        head = None
    name = next((n for n, m in model.named_modules() if m is head), None) if head is not None else None
    if not name:
        return ()
    checkpoint = next((c for c, t in renamed.items() if t == name), None) or _reverse_name(model, name)
    return tuple(dict.fromkeys((checkpoint, name)))


def _reverse_name(model: torch.nn.Module, name: str) -> str:
    """The checkpoint name transformers would save `name` under (its reverse renamings)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange, WeightRenaming, rename_source_key

    reverse = [c.reverse_transform() for c in get_model_conversion_mapping(model)[::-1]
               if isinstance(c, WeightRenaming) and not isinstance(c, PrefixChange)]
    key, _ = rename_source_key(f"{name}.weight", reverse, [], reverse=True)
    return key[: -len(".weight")] if key.endswith(".weight") else name


def _natural(name: str) -> list:
    return [int(p) if p.isdigit() else p for p in name.split(".")]
