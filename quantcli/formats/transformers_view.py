"""What transformers makes of a checkpoint's modules, read from transformers' own code on a
meta-device model of the checkpoint's architecture (no weights, no data read):

- the names its loader gives them: transformers 5 renames checkpoint keys through its conversion
  mapping (`conversion_mapping.get_model_conversion_mapping`, applied by
  `core_model_loading.rename_source_key`), e.g. Qwen2-VL's `visual.blocks.0.attn.qkv` becomes
  `model.visual.blocks.0.attn.qkv` and GPT-NeoX's `embed_out` becomes `lm_head`; compressed-tensors
  matches its `ignore` and `targets` against these module names (`apply_quantization_config`
  walks `model.named_modules()`), so an exclusion list needs them beside the checkpoint's;
- the output head, `get_output_embeddings()`, whatever it is called and also when it is tied;
- the per-expert Linears it merges into 3-D parameters (a converter with `MergeModulelist`),
  where transformers 5.24 drops an NVFP4 expert's `weight_global_scale`
  (docs/formats.md, "Which engine loads which pair");
- whether the model's own `_init_weights` reads `.weight` of a Linear, which compressed-tensors'
  packed formats replace by `weight_packed` (then only `run_compressed=False` loads it).

transformers is an optional dependency: without it, or for an architecture it cannot build (a
custom-code model, a config it refuses), `view` returns None and callers keep to quantcli's
name rules (quantcli/formats/module_kinds.py)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import torch

_CACHE: dict[tuple[str, frozenset[str]], TransformersView | None] = {}


@dataclass(frozen=True)
class TransformersView:
    architecture: str
    renamed: Mapping[str, str]  # checkpoint module -> the Linear transformers loads it into, where they differ
    heads: tuple[str, ...]  # the output head: its checkpoint and transformers names (one if they agree)
    merged_experts: frozenset[str]  # per-expert checkpoint modules merged into 3-D parameters
    model: torch.nn.Module = field(repr=False, compare=False)

    def spellings(self, module: str) -> list[str]:
        """`module` and, where it differs, the name transformers gives it."""
        other = self.renamed.get(module)
        return [module, other] if other else [module]

    def init_reads_weight(self, modules: Iterable[str]) -> str | None:
        """Where the model's own weight initialization reads `.weight` of one of `modules`
        (checkpoint names), which compressed-tensors' packed formats remove, or None. transformers
        runs `initialize_weights` on every module after loading (`_initialize_missing_keys`);
        `PreTrainedModel._init_weights` guards the read, some models' overrides do not."""
        removed = []
        for module in modules:
            try:
                sub = self.model.get_submodule(self.renamed.get(module, module))
            except AttributeError:
                continue  # a module transformers does not build (merged experts, dropped heads)
            if isinstance(sub, torch.nn.Linear) and "weight" in sub._parameters:
                removed.append((sub, sub._parameters.pop("weight")))
        try:
            self.model.initialize_weights()
        except AttributeError as exc:
            return _where(exc)
        finally:
            for sub, weight in removed:
                sub._parameters["weight"] = weight
        return None


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
    model = _meta_model(config)
    if model is None:
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
    return TransformersView(type(model).__name__, renamed, _heads(model, renamed), frozenset(merged), model)


def _meta_model(config: Mapping) -> torch.nn.Module | None:
    """The class `architectures` names, built on the meta device, or None."""
    try:
        import transformers
    except ImportError:
        return None
    archs = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    cls = getattr(transformers, archs[0], None) if archs else None
    if cls is None or not isinstance(config.get("model_type"), str):
        return None
    cfg = {k: v for k, v in config.items() if k not in ("model_type", "quantization_config", "hf_quant_config")}
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # its config and init warnings are about training, not this
    try:
        with torch.device("meta"):
            return cls(transformers.AutoConfig.for_model(config["model_type"], **cfg))
    except Exception:  # noqa: BLE001 (any failure to build means: no view, the name rules apply)
        return None
    finally:
        transformers.logging.set_verbosity(verbosity)


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


def _where(exc: AttributeError) -> str:
    """`FalconPreTrainedModel._init_weights (models/falcon/modeling_falcon.py) reads FalconLinear.weight`."""
    tb, frame = exc.__traceback__, None
    while tb is not None:
        if "transformers" in tb.tb_frame.f_code.co_filename:
            frame = tb.tb_frame
        tb = tb.tb_next
    owner = re.match(r"'(\w+)' object", str(exc))
    what = f"{owner.group(1) if owner else 'a Linear'}.weight"
    if frame is None:
        return f"the model's weight initialization reads {what}"
    path = frame.f_code.co_filename.replace("\\", "/").rpartition("/transformers/")[2]
    return f"{frame.f_code.co_qualname.split('.<locals>')[0]} ({path}) reads {what}"


__all__ = ["TransformersView", "view"]
