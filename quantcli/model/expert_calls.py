"""Each expert's inputs, seen where transformers' own experts code multiplies by that expert's
weights, whatever the architecture's routing, activation or layout.

transformers holds a layer's experts as 3-D parameters (`gate_up_proj` [E, out, in] or [E, in,
out], `down_proj`, Llama 4's and gpt-oss's [E, in, out]) and its eager experts loop multiplies
the tokens routed to expert e by a view of slice e (`F.linear(x, w[e])`, `x @ w[e]`), or every
expert at once by the whole parameter (`torch.bmm(x, w)`, x [E, tokens, in]). A TorchFunctionMode
active while the experts block runs sees those calls: the weight argument shares the
parameter's storage, its offset names the expert and the rows (output features) it covers, and
the other argument is exactly what reaches that expert's Linear in the checkpoint: the routed
tokens for gate/up, the block's own activation of them for down (gpt-oss's clamped SwiGLU with
biases included). Nothing is recomputed here, so nothing can drift from the model's code.

A callback may also replace an expert's input (eval's input quantization), per checkpoint
module: a matmul covering modules whose replacements differ (gate and up declaring different
input quantization) is computed as one product per module's rows, put back in place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# (weight argument's index, the weight's output-feature dimension counted from the end: F.linear's
# weight is [out, in], a matmul's right operand [..., in, out])
_LINEAR = {F.linear: -2}
_MATMUL = {torch.matmul: -1, torch.Tensor.matmul: -1, torch.Tensor.__matmul__: -1, torch.mm: -1,
           torch.Tensor.mm: -1, torch.bmm: -1, torch.Tensor.bmm: -1}


@dataclass(frozen=True)
class ExpertParam:
    """One 3-D parameter of an experts block: `owner(e, start, count)` names the checkpoint
    modules whose rows (output features) of expert e the range covers, in order, with their
    row ranges: [(module, first, count), ...] relative to `start`."""

    name: str  # the model parameter (e.g. model.layers.0.mlp.experts.gate_up_proj)
    tensor: torch.Tensor  # the loaded parameter
    owner: Callable[[int, int, int], list[tuple[str, int, int]]]


# on_input(module, expert, x) -> None, or the input to use instead of x for `module`'s rows
OnInput = Callable[[str, int, torch.Tensor], torch.Tensor | None]


class ExpertCalls(TorchFunctionMode):
    """While active, calls `on_input` with each expert's input to each checkpoint module (all-zero
    rows, Llama 4's unrouted tokens, left out), and applies the replacements it returns."""

    def __init__(self, params: list[ExpertParam], on_input: OnInput):
        super().__init__()
        self.by_storage = {p.tensor.untyped_storage().data_ptr(): p for p in params}
        self.on_input = on_input
        self.calls = 0  # matmuls seen on the parameters: 0 after a run means the block was not traced

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out_dim = _LINEAR.get(func, _MATMUL.get(func))
        if out_dim is None or len(args) < 2 or not all(isinstance(a, torch.Tensor) for a in args[:2]):
            return func(*args, **kwargs)
        param = self.by_storage.get(_storage(args[1]))
        if param is None:
            return func(*args, **kwargs)
        self.calls += 1
        x, w = args[0], args[1]
        # every expert at once (w the whole [E, ...] parameter, x [E, tokens, in]), or one
        pieces = [(x[e], w[e]) for e in range(w.shape[0])] if w.dim() == 3 else [(x, w)]
        planned = [self._inputs(param, xe, we, out_dim) for xe, we in pieces]
        if all(new is None for *_, news, _ in planned for new in news):
            return func(*args, **kwargs)  # the model's own call, untouched: its numerics exactly
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        outs = [_by_segments(func in _LINEAR, xe, we, bias, out_dim, *plan)
                for (xe, we), plan in zip(pieces, planned)]
        return outs[0] if w.dim() == 2 else torch.stack(outs)

    def _inputs(self, param: ExpertParam, x: torch.Tensor, w: torch.Tensor, out_dim: int):
        """(the checkpoint modules the 2-D weight view `w` covers, with their row ranges; each
        one's replacement input or None; the mask of live rows of x)."""
        expert, start = _located(param.tensor, w, out_dim)
        segments = param.owner(expert, start, w.shape[out_dim])
        flat = x.reshape(-1, x.shape[-1])
        live = flat.ne(0).any(-1)
        rows = flat[live]
        news = [self.on_input(module, expert, rows) if rows.shape[0] else None for module, _, _ in segments]
        return segments, news, live


def _storage(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _located(param: torch.Tensor, w: torch.Tensor, out_dim: int) -> tuple[int, int]:
    """(expert, first output row) of the 2-D view `w` of the 3-D `param`."""
    offset = w.storage_offset() - param.storage_offset()
    expert, inner = divmod(offset, param.stride(0))
    return expert, inner // max(1, w.stride(out_dim))


def _by_segments(linear: bool, x, w, bias, out_dim: int, segments, replaced, live):
    """The product of x and the 2-D weight view `w` computed one checkpoint module's rows at a
    time, each with its own input (its replacement on the live rows, the zero rows kept), put
    back together in row order."""
    flat = x.reshape(-1, x.shape[-1])
    parts = []
    for (module, first, count), new in zip(segments, replaced):
        xs = flat
        if new is not None:
            xs = torch.zeros_like(flat)
            xs[live] = new.to(flat.dtype)
        xs = xs.reshape(x.shape)
        ws = w.narrow(w.dim() + out_dim, first, count)
        if linear:
            parts.append(F.linear(xs, ws, None if bias is None else bias.narrow(-1, first, count)))
        else:
            parts.append(torch.matmul(xs, ws))
    return torch.cat(parts, dim=-1)
