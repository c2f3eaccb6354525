"""Where each parameter of the transformers model comes from in the source checkpoint.

Dense decoders need no mapping: the model's parameter names are the checkpoint's. MoE experts
differ. transformers 5 holds a layer's experts as two fused 3-D parameters,
`mlp.experts.gate_up_proj` [E, 2*I, H] (each expert's gate rows, then its up rows) and
`mlp.experts.down_proj` [E, H, I], while checkpoints store one Linear per expert: Mixtral
`block_sparse_moe.experts.{e}.w1 / w3 / w2` (gate / up / down), Qwen-MoE and OLMoE
`mlp.experts.{e}.gate_proj / up_proj / down_proj` (the same facts as transformers'
conversion_mapping.py). Calibration statistics are recorded under the checkpoint's module names,
because those are what the plan quantizes and what the scales are written next to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection

import torch

from quantcli.errors import QuantcliError

# (gate, up, down) Linear names of one expert, by checkpoint convention.
EXPERT_ROLES = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))
# The model's block name -> the checkpoint's, where they differ (Mixtral's MoE block).
BLOCK_RENAMES = ((".mlp.", ".block_sparse_moe."),)
FUSED_PARAMS = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class ExpertModules:
    """The checkpoint modules one experts block's statistics go to: per expert e, `gate[e]`,
    `up[e]` (both see the block's input) and `down[e]` (sees act(gate) * up). A checkpoint that
    already stores the fused 3-D parameters has one module each, shared by every expert."""

    gate: tuple[str, ...]
    up: tuple[str, ...]
    down: tuple[str, ...]

    def of(self, expert: int) -> tuple[str, str, str]:
        def pick(names: tuple[str, ...]) -> str:
            return names[expert] if len(names) > 1 else names[0]

        return pick(self.gate), pick(self.up), pick(self.down)

    @property
    def all(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((*self.gate, *self.up, *self.down)))


class WeightMap:
    """Source tensor(s) for each model parameter, from the checkpoint's tensor names."""

    def __init__(self, names: Collection[str]):
        self.names = set(names)

    def _renamed(self, name: str) -> str | None:
        if name in self.names:
            return name
        for model_part, source_part in BLOCK_RENAMES:
            other = name.replace(model_part, source_part)
            if other in self.names:
                return other
        return None

    def checkpoint_module(self, path: str) -> str:
        """The checkpoint's name of the model module at `path` (a Linear, an attention block)."""
        for suffix in (".weight", ".q_proj.weight"):
            source = self._renamed(path + suffix)
            if source is not None:
                return source[: -len(suffix)]
        return path

    def experts(self, path: str, count: int) -> ExpertModules | None:
        """The checkpoint modules of the experts block at model path `path` (count experts)."""
        fused = [self._renamed(f"{path}.{p}") for p in FUSED_PARAMS]
        if all(fused):
            return ExpertModules((fused[0],), (fused[0],), (fused[1],))
        for roles in EXPERT_ROLES:
            for base in {path, *(path.replace(a, b) for a, b in BLOCK_RENAMES)}:
                mods = [[f"{base}.{e}.{r}" for e in range(count)] for r in roles]
                if all(f"{m}.weight" in self.names for ms in mods for m in ms):
                    return ExpertModules(*(tuple(ms) for ms in mods))
        return None

    def tensor(self, param: str, get: Callable[[str], torch.Tensor], experts: dict[str, ExpertModules]) -> torch.Tensor:
        """The model parameter `param` built from the source (FP32 conversion is the caller's)."""
        names = self.sources(param, experts)
        if not names:
            raise QuantcliError(f"--calibration: the checkpoint has no tensor for the model's {param} (nor a known "
                                f"renaming of it); it does not match its config.json architecture")
        tensors = [get(n) for n in names]
        path, _, leaf = param.rpartition(".")
        if path not in experts or leaf not in FUSED_PARAMS or len(experts[path].gate) == 1:
            return tensors[0]  # a plain parameter, or the checkpoint's own fused 3-D tensor
        if leaf == "gate_up_proj":  # sources(): every expert's gate, then every expert's up
            count = len(tensors) // 2
            return torch.stack([torch.cat(pair) for pair in zip(tensors[:count], tensors[count:])])
        return torch.stack(tensors)

    def sources(self, param: str, experts: dict[str, ExpertModules]) -> list[str]:
        """The checkpoint tensor names `param` is built from (empty: none)."""
        path, _, leaf = param.rpartition(".")
        if path in experts and leaf in FUSED_PARAMS:
            mods = experts[path]
            if len(mods.gate) == 1:
                return [mods.gate[0] if leaf == "gate_up_proj" else mods.down[0]]
            picked = (*mods.gate, *mods.up) if leaf == "gate_up_proj" else mods.down
            return [f"{m}.weight" for m in picked]
        source = self._renamed(param)
        return [source] if source else []


def mixtral_shaped(block) -> bool:
    """Whether an experts block is transformers' Mixtral-style one (gate and up rows concatenated,
    [E, out, in], no biases), the shape whose per-expert inputs a walk can record and quantize."""
    return bool(getattr(block, "has_gate", False) and getattr(block, "is_concatenated", False)
                and not getattr(block, "is_transposed", True) and not getattr(block, "has_bias", True)
                and not getattr(block, "has_post_expert_norm", False))


def experts_blocks(layer, prefix: str, weights: WeightMap, whole: bool = False) -> dict[str, ExpertModules]:
    """{model path of an experts block in `layer`: its checkpoint modules}. An experts block of a
    shape the walk cannot record (transposed, interleaved, biased, gateless) is refused, unless
    `whole` (eval): a checkpoint that stores the block's own 3-D parameters under its names
    (gpt-oss) is then loaded as it is and run by transformers' own forward."""
    out = {}
    for sub, mod in layer.named_modules():
        if not isinstance(getattr(mod, "gate_up_proj", None), torch.nn.Parameter):
            continue
        path = prefix + sub
        found = weights.experts(path, mod.gate_up_proj.shape[0]) if mixtral_shaped(mod) or whole else None
        if found is not None and not mixtral_shaped(mod) and len(found.gate) > 1:
            found = None  # per-expert Linears of a block of another shape: no mapping known
        if found is None:
            raise QuantcliError(f"--calibration: cannot map the experts block {path} ({type(mod).__name__}) to "
                                f"the checkpoint's expert tensors; this MoE architecture is not supported")
        out[path] = found
    return out
