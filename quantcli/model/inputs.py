"""What reaches each Linear of a loaded layer, under the checkpoint's module names: the one
observer every pass over the layer walk uses (calibration's maxima and sums of squares, a weight
pass's per-batch statistics, verify's output errors), so that they all see the same inputs of
the same modules.

A Linear's input is its forward pre-hook's argument, recorded for each checkpoint module its
weight comes from (model/names.py). An experts block's 3-D parameters hold every expert's
Linears: each expert's input is taken where the block's own code multiplies by that expert's
weights (model/expert_calls.py), so the routed tokens reach its gate and up and the block's own
activation of them its down, for any routing and activation."""

from __future__ import annotations

from typing import Callable

import torch

from quantcli.errors import QuantcliError
from quantcli.model.expert_calls import ExpertCalls, ExpertParam, OnInput
from quantcli.model.names import CheckpointMap

# (checkpoint module, its input [..., in_features], the expert index or None for a plain Linear)
Record = Callable[[str, torch.Tensor, "int | None"], None]


def experts_params(layer, prefix: str, names: CheckpointMap) -> dict[str, list[ExpertParam]]:
    """{model path of an experts block in the loaded `layer`: its 3-D parameters the checkpoint
    maps}, empty for a layer without experts."""
    out: dict[str, list[ExpertParam]] = {}
    for sub, mod in layer.named_modules():
        for leaf, p in mod.named_parameters(recurse=False):
            if p.dim() != 3:
                continue
            name = f"{prefix}{sub}.{leaf}" if sub else f"{prefix}{leaf}"
            owner = names.expert_owner(name)
            if owner is not None:
                out.setdefault(prefix + sub, []).append(ExpertParam(name, p, owner))
    return out


class _Traced:
    """A handle that puts back the experts block's forward it replaced (`remove`: the class's, or
    another tracer's), and checks it was traced."""

    def __init__(self, block, path: str, calls: ExpertCalls):
        self.block, self.path, self.calls = block, path, calls
        self.previous = block.__dict__.get("forward")  # another pass's tracer on the same block, or None
        self.ran = False

    def remove(self) -> None:
        if self.previous is None:
            self.block.__dict__.pop("forward", None)
        else:
            self.block.forward = self.previous
        if self.ran and self.calls.calls == 0:
            raise QuantcliError(f"{self.path} ({type(self.block).__name__}): its experts ran without a matmul on "
                                f"their 3-D weights quantcli could see, so their inputs are unknown; this experts "
                                f"implementation is not supported")


def trace_experts(block, path: str, params: list[ExpertParam], on_input: OnInput) -> _Traced:
    """Run `block` (an experts module) under ExpertCalls from now on; the handle undoes it. Several
    passes may trace one block (calibration's statistics and verify's output errors): their modes
    nest, and each sees every call."""
    calls = ExpertCalls(params, on_input)
    handle = _Traced(block, path, calls)
    inner = handle.previous or (lambda *args, **kwargs: type(block).forward(block, *args, **kwargs))

    def forward(*args, **kwargs):
        handle.ran = True
        with calls:
            return inner(*args, **kwargs)

    block.forward = forward
    return handle


def input_hooks(layer, prefix: str, names: CheckpointMap, record: Record) -> list:
    """Hooks (removable handles) on the loaded `layer` that call `record(module, x, expert)` with
    each Linear's input and each expert's inputs to its Linears (an expert the router did not
    choose in a batch is not recorded for that batch)."""
    hooks = []
    for sub, mod in layer.named_modules():
        if isinstance(mod, torch.nn.Linear):
            modules = names.linear_modules(prefix + sub)
            if modules:
                hooks.append(mod.register_forward_pre_hook(_linear_recorder(record, modules)))
    for path, params in experts_params(layer, prefix, names).items():
        block = layer.get_submodule(path[len(prefix):]) if path != prefix else layer

        def on_input(module: str, expert: int, x: torch.Tensor) -> None:
            record(module, x, expert)
        hooks.append(trace_experts(block, path, params, on_input))
    return hooks


def _linear_recorder(record: Record, modules: list[str]):
    def hook(mod, args):
        for module in modules:
            record(module, args[0], None)
    return hook
