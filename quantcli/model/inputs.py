"""What reaches each Linear of a loaded decoder layer, under the checkpoint's module names: the
one observer every pass over the layer walk uses (calibration's maxima and sums of squares, a
weight pass's per-batch statistics), so that they all see the same inputs of the same modules.

A dense Linear's input is its forward pre-hook's argument. transformers runs a MoE layer's
experts as one block with fused 3-D parameters, so an expert's inputs are recomputed from the
block's: the tokens the router sent it (its gate and up inputs) and act(gate) * up (its down
input), computed as the block computes them."""

from __future__ import annotations

from typing import Callable

import torch

from quantcli.model.weights import ExpertModules, WeightMap

Record = Callable[[str, torch.Tensor], None]  # (checkpoint module, its input [..., in_features])


def input_hooks(layer, prefix: str, weights: WeightMap, experts: dict[str, ExpertModules], record: Record) -> list:
    """Forward pre-hooks (removable handles) on the loaded `layer` that call `record(module, x)`
    with each Linear's input and, per expert, the input of each of its Linears (an expert the
    router did not choose in a batch is not recorded for that batch)."""
    hooks = []
    for sub, mod in layer.named_modules():
        if isinstance(mod, torch.nn.Linear):
            module = weights.checkpoint_module(prefix + sub)
            hooks.append(mod.register_forward_pre_hook(_linear_recorder(record, module)))
        elif prefix + sub in experts:
            hooks.append(mod.register_forward_pre_hook(_expert_recorder(record, experts[prefix + sub]),
                                                       with_kwargs=True))
    return hooks


def _linear_recorder(record: Record, module: str):
    def hook(mod, args):
        record(module, args[0])
    return hook


def _expert_recorder(record: Record, modules: ExpertModules):
    def hook(block, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        index = args[1] if len(args) > 1 else kwargs["top_k_index"]
        for e in range(block.gate_up_proj.shape[0]):
            tokens = (index == e).any(-1)
            if not bool(tokens.any()):
                continue
            x = hidden[tokens]
            gate, up = torch.nn.functional.linear(x, block.gate_up_proj[e]).chunk(2, dim=-1)
            gate_mod, up_mod, down_mod = modules.of(e)
            record(gate_mod, x)
            if up_mod != gate_mod:  # a checkpoint storing the fused 3-D tensor has one module for both
                record(up_mod, x)
            record(down_mod, block.act_fn(gate) * up)
    return hook
