"""The quantized side's run of one block: each module's input quantized as the checkpoint
declares (fake_quant.ActQuant), and each module's own output error measured against the
reference weights on the same input.

A module's own error is ||m_q(x) - m_ref(x)|| / ||m_ref(x)|| over every token, where x is the
module's input in the quantized run, m_q its decoded weights with its input quantization and
m_ref the reference's weights without: the error the module adds by itself, apart from what
the blocks before it passed on. A Linear is hooked; an MoE experts block (transformers' fused
3-D `gate_up_proj` / `down_proj`) runs `experts_forward`, the same loop as transformers'
experts with each expert's inputs quantized as its gate / up / down Linears declare."""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from quantcli.evaluate.declared import NotEmulated
from quantcli.model.weights import ExpertModules, WeightMap, mixtral_shaped


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
    stash: list[torch.Tensor] = []

    def before(m, args):
        stash.append(args[0])
        return None if step is None else (step(args[0]), *args[1:])

    def after(m, args, out):
        err.add(out, F.linear(stash.pop(), w_ref, b_ref))

    return [mod.register_forward_pre_hook(before), mod.register_forward_hook(after)]


def experts_forward(block, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                    gate_up: torch.Tensor, down: torch.Tensor,
                    steps: Callable[[int], tuple[Step, Step, Step]] | None = None) -> torch.Tensor:
    """transformers' MoE experts loop (MixtralExperts.forward) with the weights given and,
    with `steps(e)` = (gate, up, down input quantization of expert e), each expert's inputs
    quantized; gate and up are then two products, one per declared input."""
    out = torch.zeros_like(hidden)
    experts = gate_up.shape[0]
    mask = F.one_hot(top_k_index, num_classes=experts + 1).permute(2, 1, 0)
    for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
        e = int(e[0])
        if e == experts:
            continue
        top_k_pos, token_idx = torch.where(mask[e])
        x = hidden[token_idx]
        g_step, u_step, d_step = steps(e) if steps is not None else (None, None, None)
        if g_step is None and u_step is None:
            gate, up = F.linear(x, gate_up[e]).chunk(2, dim=-1)
        else:
            w_gate, w_up = gate_up[e].chunk(2, dim=0)
            gate = F.linear(g_step(x) if g_step else x, w_gate)
            up = F.linear(u_step(x) if u_step else x, w_up)
        h = block.act_fn(gate) * up
        h = F.linear(d_step(h) if d_step else h, down[e])
        h = h * top_k_weights[token_idx, top_k_pos, None]
        out.index_add_(0, token_idx, h.to(out.dtype))
    return out


def quantize_expert_inputs(block, modules: ExpertModules, steps: dict) -> None:
    """Each expert's inputs quantized as its Linears declare (when any does); `detach` undoes it."""
    if any(m in steps for m in modules.all):
        if not mixtral_shaped(block):
            raise NotEmulated(f"{experts_name(modules)}: quantized inputs declared for an experts block of "
                              f"{type(block).__name__}'s shape (transposed or biased), which quantcli eval "
                              f"cannot emulate exactly; nothing was run")
        def per_expert(e: int):
            return tuple(steps.get(m) for m in modules.of(e))

        def emulated(hidden, top_k_index, top_k_weights):
            return experts_forward(block, hidden, top_k_index, top_k_weights, block.gate_up_proj, block.down_proj,
                                   per_expert)

        block.forward = emulated  # the loaded instance only; it goes back to meta after the block


def own_forward(block, params: dict[str, torch.Tensor], args: tuple, kwargs: dict) -> torch.Tensor:
    """The block's own class forward (transformers' experts code, whatever its shape) run with
    `params` in place of its parameters, which are then put back."""
    saved = {n: block._parameters[n] for n in params}
    try:
        block._parameters.update(params)
        return type(block).forward(block, *args, **kwargs)
    finally:
        block._parameters.update(saved)


def _experts_hooks(block, modules: ExpertModules, steps: dict, ref: dict[str, torch.Tensor], err: ErrorSum) -> list:
    """Quantized inputs per expert (when any of its Linears declares them) and the block's own error."""
    quantize_expert_inputs(block, modules, steps)
    if not mixtral_shaped(block):  # gpt-oss: transformers' own forward with the reference's parameters
        def own(m, args, kwargs, out):
            err.add(out, own_forward(m, ref, args, kwargs))

        return [block.register_forward_hook(own, with_kwargs=True)]
    ref_weights = (ref["gate_up_proj"], ref["down_proj"])

    def after(m, args, kwargs, out):
        call = dict(zip(("hidden", "top_k_index", "top_k_weights"), args))
        call.update({k if k != "hidden_states" else "hidden": v for k, v in kwargs.items()})
        err.add(out, experts_forward(block, call["hidden"], call["top_k_index"], call["top_k_weights"], *ref_weights))

    return [block.register_forward_hook(after, with_kwargs=True)]


def experts_name(modules: ExpertModules) -> str:
    """The checkpoint's name of an experts block: its per-expert Linears' parent."""
    first = modules.gate[0]
    return first.rsplit(".", 2)[0] if len(modules.gate) > 1 else first.rsplit(".", 1)[0]


def attach(layer, prefix: str, weights: WeightMap, experts: dict[str, ExpertModules], ref: dict[str, torch.Tensor],
           steps: dict, errors: dict[str, ErrorSum]) -> list:
    """Hooks on the loaded quantized block (removable handles); `ref`: the reference's parameters
    of the block by their name in it; `errors` gains one ErrorSum per module."""
    handles = []
    for sub, mod in layer.named_modules():
        path = prefix + sub
        if isinstance(mod, torch.nn.Linear):
            module = weights.checkpoint_module(path)
            err = errors.setdefault(module, ErrorSum())
            handles += _linear_hooks(mod, steps.get(module), ref[f"{sub}.weight"], ref.get(f"{sub}.bias"), err)
        elif path in experts:
            err = errors.setdefault(experts_name(experts[path]), ErrorSum())
            own = {n: ref[f"{sub}.{n}"] for n, _ in mod.named_parameters(recurse=False)}
            handles += _experts_hooks(mod, experts[path], steps, own, err)
    return handles


def detach(layer, handles: list) -> None:
    for h in handles:
        h.remove()
    for mod in layer.modules():
        mod.__dict__.pop("forward", None)  # an emulated experts forward set on the instance
