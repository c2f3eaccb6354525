"""The module names a plan writes into a config (the exclusion list, compressed-tensors'
`targets`), as each consumer matches them (docs/formats.md, "Exclusion lists and how consumers
match them"):

- vLLM and SGLang read the checkpoint's names and map them through their model's own name mapper
  (vLLM `model_loader/utils.py::configure_quant_config` and `SupportsQuant.__new__` call
  `quant_config.apply_vllm_mapper(hf_to_vllm_mapper)`; SGLang `model_loader/loader.py::
  _get_quantization_config` calls `apply_weight_name_mapper(hf_to_sglang_mapper)`);
- transformers (compressed-tensors' `apply_quantization_config`, FineGrainedFP8's
  `modules_to_not_convert`) matches the names of the modules it builds, which its checkpoint
  conversion mapping may rename (a VLM's `visual.` becomes `model.visual.`).

So every name is listed as the checkpoint spells it and, where transformers builds the module
under another name, that one too (quantcli/formats/transformers_view.py). The output head is
found by transformers' `get_output_embeddings()` (GPT-NeoX's is `embed_out`); without
transformers, by name (`lm_head` for a generative architecture, module_kinds.has_lm_head)."""

from __future__ import annotations

import re
from typing import Callable, Iterable, Mapping

from quantcli.formats.module_kinds import has_lm_head
from quantcli.formats.transformers_view import TransformersView
from quantcli.model.transformers_view import view

MULTIMODAL_KEYS = ("vision_config", "audio_config", "vision_tower")


def source_view(config: Mapping, shapes: Mapping[str, tuple[int, ...]]) -> TransformersView | None:
    """transformers' view of a source whose tensors have these shapes (its 2-D `.weight` modules)."""
    return view(config, [n[: -len(".weight")] for n, s in shapes.items() if n.endswith(".weight") and len(s) == 2])


# Model types whose attention and MLP weights are transformers' Conv1D, for when transformers is
# not installed (with it, the built model says: TransformersView.transposed).
CONV1D_MODEL_TYPES = ("gpt2", "openai-gpt", "imagegpt", "decision_transformer", "clvp")
CONV1D_NAMES = re.compile(r"(^|\.)(c_attn|c_proj|c_fc|q_attn)$")


# transformers' Conv1D (GPT-2 and kin) stores its weight [in, out]; every recipe's blocks run along
# a Linear's input dimension, and vLLM's GPT-2 transposes the weight as it loads it, so a
# quantized one would be read across the wrong axis.
TRANSPOSED_LINEAR = "stored transposed, [in, out] (transformers' Conv1D): no engine reads it quantized"


def transposed_modules(config: Mapping, found: TransformersView | None) -> Callable[[str], bool]:
    """Whether a module's weight is stored [in, out] (transformers' Conv1D: GPT-2 and kin)."""
    if found is not None:
        return found.transposed.__contains__
    if config.get("model_type") in CONV1D_MODEL_TYPES:
        return lambda module: bool(CONV1D_NAMES.search(module))
    return lambda module: False


def output_heads(config: Mapping, found: TransformersView | None) -> tuple[str, ...]:
    """The output head's module names: transformers', and the checkpoint's where they differ."""
    if found is not None:
        return found.heads
    return ("lm_head",) if has_lm_head(dict(config)) else ()


def spelled(modules: Iterable[str], found: TransformersView | None) -> list[str]:
    """`modules` with transformers' name of each beside the checkpoint's, sorted, no repeats."""
    names = set(modules)
    if found is not None:
        names |= {s for m in names for s in found.spellings(m)}
    return sorted(names)


def unnamed_warning(config: Mapping, found: TransformersView | None) -> list[str]:
    """A multimodal source transformers could not build here: its exclusion list keeps the
    checkpoint's names only, which transformers 5 may not match."""
    if found is not None or not any(k in config for k in MULTIMODAL_KEYS):
        return []
    archs = ", ".join(str(a) for a in config.get("architectures") or []) or f"model_type {config.get('model_type')!r}"
    return [f"transformers could not build {archs} here (not installed, or too old for it), so the exclusion list "
            f"names the checkpoint's modules only; transformers 5 loads a multimodal model's towers under other "
            f"names (e.g. model.visual...) and would then quantize them: install transformers and convert again "
            f"if the output is to load in transformers"]


__all__ = ["output_heads", "source_view", "spelled", "unnamed_warning"]
