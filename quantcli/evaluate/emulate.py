"""The quantized side's run of one block: each module's input quantized as the checkpoint
declares (fake_quant.ActQuant), and each module's own output error measured against the
reference weights on the same input.

A module's own error is ||m_q(x) - m_ref(x)|| / ||m_ref(x)|| over every token, where x is the
module's input in the quantized run, m_q its decoded weights with its input quantization and
m_ref the reference's weights without: the error the module adds by itself, apart from what
the blocks before it passed on. A Linear is hooked; an MoE experts block (transformers' 3-D
expert parameters, any layout) runs its own code with each expert's inputs quantized where it
multiplies by that expert's weights (model/expert_calls.py), and its own error is its output
against the same code run with the reference's parameters on the same input."""

from __future__ import annotations

import math
from typing import Callable

import torch

from quantcli.evaluate.declared import NotEmulated
from quantcli.model.inputs import experts_params, trace_experts
from quantcli.model.names import CheckpointMap


class ErrorSum:
    """Sums of squared differences and squared reference values: a relative L2 error."""

    def __init__(self) -> None:
        self.d2 = 0.0
        self.r2 = 0.0

    def add(self, out: torch.Tensor, ref: torch.Tensor) -> None:
        out, ref = out.detach().double(), ref.detach().double()
        self.d2 += float((out - ref).square().sum())
        self.r2 += float(ref.square().sum())

    @staticmethod
    def of(sums: list[float]) -> ErrorSum:
        """From [d2, r2] (a split run's ranks send their sums as JSON)."""
        err = ErrorSum()
        err.d2, err.r2 = sums
        return err

    @property
    def sums(self) -> list[float]:
        return [self.d2, self.r2]

    @property
    def rel(self) -> float:
        if self.r2 > 0:
            return math.sqrt(self.d2 / self.r2)
        return 0.0 if self.d2 == 0 else math.inf


Step = Callable[[torch.Tensor], torch.Tensor] | None


def _linear_hooks(mod: torch.nn.Linear, step: Step, w_ref: torch.Tensor, b_ref, err: ErrorSum) -> list:
    """The module's own forward (a Linear, or a subclass with its own: Falcon's, Llama 4's router)
    run again with the reference's weight on the same, unquantized input."""
    stash: list[tuple] = []
    ref = {"weight": w_ref, **({"bias": b_ref} if b_ref is not None else {})}

    def before(m, args):
        stash.append(args)
        return None if step is None else (step(args[0]), *args[1:])

    def after(m, args, out):
        err.add(_first(out), _first(own_forward(m, ref, stash.pop(), {})))

    return [mod.register_forward_pre_hook(before), mod.register_forward_hook(after)]


def _first(out):
    """A module's output tensor (the first of a tuple: Llama 4's router returns scores and logits)."""
    return out[0] if isinstance(out, tuple) else out


def own_forward(block, params: dict[str, torch.Tensor], args: tuple, kwargs: dict) -> torch.Tensor:
    """The block's own class forward (transformers' experts code, whatever its shape) run with
    `params` in place of its parameters, which are then put back."""
    saved = {n: block._parameters[n] for n in params}
    try:
        block._parameters.update(params)
        return type(block).forward(block, *args, **kwargs)
    finally:
        block._parameters.update(saved)


def experts_name(names: CheckpointMap, params) -> str:
    """The checkpoint's name of an experts block: its per-expert Linears' parent (or its 3-D stacks')."""
    first = names.sources(params[0].name)[0]
    first = first[: -len(".weight")] if first.endswith(".weight") else first
    return first.rsplit(".", 2)[0] if len(names.sources(params[0].name)) > 1 else first.rsplit(".", 1)[0]


def expert_modules(names: CheckpointMap, params) -> list[str]:
    """The checkpoint modules an experts block's parameters are built from."""
    return [k[: -len(".weight")] if k.endswith(".weight") else k for p in params for k in names.sources(p.name)]


def quantize_expert_inputs(block, path: str, names: CheckpointMap, params, steps: dict):
    """Each expert's inputs quantized as its Linears declare, where the block's own code multiplies
    by that expert's weights; a removable handle, or None when no expert Linear declares any."""
    if not any(m in steps for m in expert_modules(names, params)):
        return None

    def on_input(module: str, expert: int, x: torch.Tensor):
        step = steps.get(module)
        return None if step is None else step(x)
    try:
        return trace_experts(block, path, params, on_input)
    except NotImplementedError as exc:
        raise NotEmulated(f"{experts_name(names, params)}: {exc}, which quantcli eval cannot emulate exactly; "
                          f"nothing was run") from None


def _experts_hooks(block, path: str, names: CheckpointMap, params, steps: dict, ref: dict[str, torch.Tensor],
                   err: ErrorSum) -> list:
    """Quantized inputs per expert (when any of its Linears declares them) and the block's own error."""
    traced = quantize_expert_inputs(block, path, names, params, steps)

    def own(m, args, kwargs, out):
        err.add(out, own_forward(m, ref, args, kwargs))

    return [h for h in (traced, block.register_forward_hook(own, with_kwargs=True)) if h is not None]


def attach(layer, prefix: str, names: CheckpointMap, ref: dict[str, torch.Tensor], steps: dict,
           errors: dict[str, ErrorSum]) -> list:
    """Hooks on the loaded quantized block (removable handles); `ref`: the reference's parameters
    of the block by their name in it; `errors` gains one ErrorSum per module."""
    handles = []
    for sub, mod in layer.named_modules():
        if isinstance(mod, torch.nn.Linear):
            modules = names.linear_modules(prefix + sub)
            if not modules:
                continue
            err = errors.setdefault(modules[0], ErrorSum())
            handles += _linear_hooks(mod, _one_step(steps, modules), ref[f"{sub}.weight"], ref.get(f"{sub}.bias"), err)
    for path, params in experts_params(layer, prefix, names).items():
        sub = path[len(prefix):]
        block = layer.get_submodule(sub) if sub else layer
        err = errors.setdefault(experts_name(names, params), ErrorSum())
        own = {n: ref[f"{sub}.{n}" if sub else n] for n, _ in block.named_parameters(recurse=False)}
        handles += _experts_hooks(block, path, names, params, steps, own, err)
    return handles


def _one_step(steps: dict, modules: list[str]):
    """The input quantization of a Linear the checkpoint stores as `modules` (one, or several it
    fuses into one model Linear: then they must declare the same)."""
    declared = {id(steps.get(m)): steps.get(m) for m in modules}
    if len(declared) > 1:
        raise NotEmulated(f"{', '.join(modules)}: one Linear in the model, declaring different input quantization, "
                          f"which quantcli eval cannot emulate exactly; nothing was run")
    return next(iter(declared.values()))


def detach(layer, handles: list) -> None:
    for h in reversed(handles):  # last in, first out: nested expert tracers unwind in order
        h.remove()
