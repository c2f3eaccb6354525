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

The view is built by quantcli/model/transformers_view.py (the model layer builds models);
transformers is an optional dependency: without it, or for an architecture it cannot build (a
custom-code model, a config it refuses), there is no view and callers keep to quantcli's
name rules (quantcli/formats/module_kinds.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import torch


@dataclass(frozen=True)
class TransformersView:
    architecture: str
    renamed: Mapping[str, str]  # checkpoint module -> the Linear transformers loads it into, where they differ
    heads: tuple[str, ...]  # the output head: its checkpoint and transformers names (one if they agree)
    merged_experts: frozenset[str]  # per-expert checkpoint modules merged into 3-D parameters
    model: torch.nn.Module = field(repr=False, compare=False)
    # Checkpoint modules transformers builds as its Conv1D (GPT-2, OpenAI GPT, ImageGPT, CLVP, ...),
    # whose weight is stored [in, out], the transpose of a Linear's.
    transposed: frozenset[str] = frozenset()

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


__all__ = ["TransformersView"]
