"""GPTQ (Frantar et al., 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers"): round a Linear's weight column by column, each column's rounding
error spread over the columns not yet rounded through the inverse Hessian of the layer-output
error, so that W X, not W, is what the codes preserve on the calibration inputs X.

For W [N, K] and H = X^T X [K, K] (summed over every calibration token that reached the module):
1. dead input channels (H_jj = 0: no token had a nonzero value there) get H_jj = 1, so their
   columns round to nearest and feed no error to the others; their weights are kept (llm-compressor
   zeroes them, which is exact on the calibration data but not on inputs that use the channel);
2. dampening: H + d * mean(diag H) * I (d = 0.01 as in the GPTQ paper and llm-compressor's
   `dampening_frac`); where the Cholesky factorization fails, d x 10 and again, up to 1.0; if it
   still fails the module is rounded to nearest and the reason recorded;
3. U = the upper Cholesky factor of H^-1 (FP64, then FP32 as the loop runs);
4. columns in blocks of 128 (lazy batch updates): column j rounds with the recipe's own quantizer
   given its scales (rounding/spans.py), err = (w_j - q_j) / U_jj updates the block's remaining
   columns at once and, at the block's end, every later column (err_block @ U[block, later]);
5. scales: `updated` (the default) chooses a span's scales (a 1 x 16 NVFP4 block, 1 x 32 MX
   block, 1 x 128 INT4 group, 128 x 128 FP8 tile) when the loop first reaches one of its
   columns, from the span's weights as updated so far (with a pending lazy update applied to
   those in later blocks), the usual GPTQ practice; `original` chooses every scale from
   the original weights before the loop (then GPTQ changes only codes: scales equal round to
   nearest's). Per-tensor and per-row scales are chosen before the loop either way. The NVFP4
   global scale is always the original weights' (the fused group's, shared as engines require);
6. `act_order = static` (the default, as llm-compressor's): columns in decreasing H_jj order; a
   span's columns stay together on disk whatever the order (no g_idx, which no layout here
   stores). `none` keeps the natural order.

The codes written are the recipe's encoding of the values each column was rounded from, with
the scales chosen: the bytes the loop's rounding decoded (tests/test_gptq.py). The result is
kept only if its layer-output error on the calibration inputs, ||(W - Q) X||^2 / ||W X||^2 =
tr((W-Q) H (W-Q)^T) / tr(W H W^T), is below round to nearest's; else round to nearest is
written and the reason recorded (a safeguard; on real models it has not triggered).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantcli.formats.facts import ModuleFacts
from quantcli.kernels import tensor_amax
from quantcli.recipes import QuantizedTensor, Recipe
from quantcli.rounding.spans import Spans

DAMPENING = 0.01  # GPTQ paper, llm-compressor's dampening_frac
BLOCK_COLUMNS = 128  # lazy batch updates (GPTQ paper, llm-compressor's block_size)
MAX_DAMPENING = 1.0
ACT_ORDERS = ("none", "static")
SCALE_CHOICES = ("updated", "original")


@dataclass(frozen=True)
class GptqSettings:
    dampening: float = DAMPENING
    act_order: str = "static"  # static | none (measured on all-MiniLM-L6-v2: docs/gptq.md)
    scales: str = "updated"  # updated | original (block formats; see the module docstring)
    block_columns: int = BLOCK_COLUMNS


@dataclass(frozen=True)
class Outcome:
    q: QuantizedTensor
    method: str  # gptq | nearest (the fallback)
    error: float  # layer-output relative error of what is written, on the calibration inputs
    nearest_error: float  # that of round to nearest
    dampening: float | None  # the dampening that factorized H (None: not factorized)
    reason: str | None = None  # why round to nearest was written instead


def relative_output_errors(w: torch.Tensor, qs: list[torch.Tensor], h: torch.Tensor) -> list[float]:
    """||(W - Q) X||^2 / ||W X||^2 of each Q from H = X^T X, in FP64 (0 when W X is 0)."""
    w64 = w.double()
    den = float(((w64 @ h) * w64).sum())
    out = []
    for q in qs:
        d = w64 - q.double()
        out.append(float(((d @ h) * d).sum()) / den if den > 0 else 0.0)
    return out


def upper_inverse_factor(h: torch.Tensor, dampening: float) -> tuple[torch.Tensor | None, float]:
    """U with H_damped^-1 = U^T U (upper Cholesky factor of the inverse) and the dampening that
    worked, raised x10 up to MAX_DAMPENING while the factorization fails; (None, last) if none did."""
    h = h.double().clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    mean_diag = float(torch.diagonal(h).mean())
    d = dampening
    while True:  # at most three K x K FP64 matrices at a time (H, and two working ones)
        damped = h.clone()
        damped.diagonal().add_(d * mean_diag)
        low, info = torch.linalg.cholesky_ex(damped)
        del damped
        if int(info) == 0:  # H^-1 by cholesky_solve: 6x faster than cholesky_inverse on the CPU
            inv = torch.cholesky_solve(torch.eye(h.shape[0], dtype=h.dtype, device=h.device), low)
            del low
            up, info = torch.linalg.cholesky_ex(inv, upper=True)
            del inv
            if int(info) == 0 and bool(torch.isfinite(up).all()):
                return up, d
        if d >= MAX_DAMPENING:
            return None, d
        d = min(d * 10, MAX_DAMPENING)


def gptq_quantize(name: str, w: torch.Tensor, h: torch.Tensor, recipe: Recipe, facts: ModuleFacts,
                  settings: GptqSettings, backend: str = "auto") -> Outcome:
    """GPTQ of weight `w` [N, K] (source dtype) with H = X^T X `h` [K, K] (FP64), in `recipe`."""
    nearest = recipe.quantize(name, w, backend=backend, facts=facts)
    perm = torch.argsort(torch.diagonal(h), descending=True, stable=True) if settings.act_order == "static" else None
    up, used = upper_inverse_factor(h if perm is None else h[perm][:, perm], settings.dampening)
    if up is None:
        (rtn_error,) = relative_output_errors(w, [recipe.dequantize(nearest, backend=backend)], h)
        return Outcome(nearest, "nearest", rtn_error, rtn_error, None,
                       f"H is not positive definite even with dampening {used:g}")
    q = _rounded(w, up.float(), perm, recipe, facts, settings, backend)
    rtn_error, error = relative_output_errors(w, [recipe.dequantize(x, backend=backend) for x in (nearest, q)], h)
    if error >= rtn_error and rtn_error > 0:
        return Outcome(nearest, "nearest", rtn_error, rtn_error, used,
                       f"GPTQ's output error {error:.4g} was not below round to nearest's {rtn_error:.4g}")
    return Outcome(q, "gptq", error, rtn_error, used)


def _rounded(w: torch.Tensor, up: torch.Tensor, perm: torch.Tensor | None, recipe: Recipe, facts: ModuleFacts,
             settings: GptqSettings, backend: str) -> QuantizedTensor:
    """The codes and scales GPTQ writes for `w`, `up` being the factor in loop order (`perm`)."""
    spec = recipe.spec
    n, k = w.shape
    amax = facts.group_amax if facts.group_amax is not None else tensor_amax(w)
    weight = facts.input_channel_ms if spec.scale_search.active else None
    spans = Spans(spec, n, k, w.dtype, amax.to(w.device) if recipe.has_global_scale else None,
                  None if weight is None else weight.to(w.device), backend)
    wf = w.float()
    order = torch.arange(k, device=w.device) if perm is None else perm
    divisor = None if spans.chosen_per_span and settings.scales == "updated" else spans.choose_all(wf)
    src, divisor = _loop(wf[:, order].T.contiguous(), up, order, spans, divisor, settings.block_columns)
    codes = spans.encode(src, divisor)
    return QuantizedTensor(recipe.name, (n, k), codes, spans.scale_tensor(), spans.s2, spec.scale_rule)


def _loop(wt: torch.Tensor, up: torch.Tensor, order: torch.Tensor, spans: Spans, divisor: torch.Tensor | None,
          block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The column loop on `wt` = W^T [K, N] in loop order (`order[c]`: the column of W at loop
    position c), in place; returns, in W's own order, the value each column was rounded from and
    the divisors [N, K]. `divisor`: the scales' divisors, or None to choose each span's scales
    when the loop first reaches one of its columns, from the span's values as updated so far
    (`_current`). On W^T a column is a contiguous row (10x faster on the CPU than strided)."""
    k, n = wt.shape
    src = torch.empty_like(wt)
    at = torch.empty_like(order)
    at[order] = torch.arange(k, device=order.device)  # loop position of each column of W
    dt = torch.empty_like(wt) if divisor is None else divisor.T[order].contiguous()  # in loop order
    chosen: set[int] = set()
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        u = up[b0:b1, b0:b1]
        errors = torch.empty(b1 - b0, n, dtype=wt.dtype, device=wt.device)
        for i in range(b1 - b0):
            c = b0 + i
            first = int(order[c]) // spans.width * spans.width
            if divisor is None and first not in chosen:
                chosen.add(first)
                where = at[first:first + spans.width]
                values = _current(wt, where, up, errors[:i], b0, b1)
                dt[where] = spans.choose(values.T.contiguous(), first).T
            col = wt[c]
            src[c] = col
            e = errors[i]
            torch.sub(col, spans.round(col, dt[c]), out=e).div_(u[i, i])
            wt[c:b1].addmm_(u[i, i:, None], e[None], alpha=-1)  # a BLAS call: addr_ is 15x slower
        wt[b1:].addmm_(up[b0:b1, b1:].T, errors, alpha=-1)
    return src[at].T, dt[at].T


def _current(wt: torch.Tensor, where: torch.Tensor, up: torch.Tensor, errors: torch.Tensor, b0: int,
             b1: int) -> torch.Tensor:
    """Rows `where` of W^T as updated so far: rows in the current block have every update; rows
    after it still lack the block's pending one (errors so far @ up[block rows, row])."""
    values = wt[where]
    later = where >= b1
    if bool(later.any()) and errors.shape[0]:
        rows = where[later]
        values[later] -= (up[b0:b0 + errors.shape[0], rows].T @ errors)
    return values
