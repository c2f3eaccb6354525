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
3. Hinv = the upper Cholesky factor of H^-1 (the paper's H^-1; FP64, then FP32 as the loop runs);
4. columns in blocks of 128 (the paper's lazy batch updates): column j rounds to q with the
   recipe's own quantizer given its scales (rounding/spans.py), err = (w_j - q) / Hinv_jj updates
   the block's remaining columns at once and, at the block's end, every later column
   (W[:, later] -= Err @ Hinv[block, later]);
5. scales: `updated` (the default) chooses a span's scales (a 1 x 16 NVFP4 block, 1 x 32 MX
   block, 1 x 128 INT4 group, 128 x 128 FP8 tile) when the loop first reaches one of its
   columns, from the span's weights as updated so far (those in later blocks with the current
   block's lazy update added, as an eager loop would see them), the usual GPTQ practice;
   `original` chooses every scale from the original weights before the loop (then GPTQ changes
   only codes: scales equal round to nearest's). Per-tensor and per-row scales are chosen
   before the loop either way. The NVFP4 global scale is always the original weights' (the
   fused group's, shared as engines require);
6. `act_order = static` (the default, as llm-compressor's): columns in decreasing H_jj order; a
   span's columns stay together on disk whatever the order (no g_idx, which no layout here
   stores). `none` keeps the natural order.

The codes written are the recipe's encoding of the values each column was rounded from, with
the scales chosen: the bytes the loop's rounding decoded (tests/test_gptq.py). The result is
kept only if its layer-output error on the calibration inputs, ||(W - Q) X||^2 / ||W X||^2 =
tr((W-Q) H (W-Q)^T) / tr(W H W^T), is below round to nearest's; else round to nearest is
written and the reason recorded (a safeguard; on real models it has not triggered). GPTQ's
error comes from its own loop (loop_output_error), so the safeguard takes two N x K x K
products, not three; they run in FP32, and all three again in FP64 where the two errors are
within TIE of each other, so it decides as FP64 would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantcli.formats.facts import ModuleFacts
from quantcli.kernels import tensor_amax
from quantcli.recipes import QuantizedTensor, Recipe
from quantcli.rounding.settings import MAX_DAMPENING, GptqSettings
from quantcli.rounding.spans import Spans

TIE = 1e-3  # relative: FP32 moved the ratios by at most 1.8e-5, the closest pair was 14% apart (docs/gptq.md)


@dataclass(frozen=True)
class Outcome:
    q: QuantizedTensor
    method: str  # gptq | nearest (the fallback)
    error: float  # layer-output relative error of what is written, on the calibration inputs
    nearest_error: float  # that of round to nearest
    dampening: float | None  # the dampening that factorized H (None: not factorized)
    reason: str | None = None  # why round to nearest was written instead


def output_errors(w: torch.Tensor, qs: list[torch.Tensor], h: torch.Tensor,
                  dtype: torch.dtype = torch.float64) -> tuple[float, list[float]]:
    """(||W X||^2, [||(W - Q) X||^2 of each Q]) from H = X^T X, the products in `dtype`, their
    sums in FP64."""
    w_, h_ = w.to(dtype), h.to(dtype)
    den = float(((w_ @ h_) * w_).sum(dtype=torch.float64))
    out = []
    for q in qs:
        d = w_ - q.to(dtype)
        out.append(float(((d @ h_) * d).sum(dtype=torch.float64)))
    return den, out


def relative_output_errors(w: torch.Tensor, qs: list[torch.Tensor], h: torch.Tensor,
                           dtype: torch.dtype = torch.float64) -> list[float]:
    """||(W - Q) X||^2 / ||W X||^2 of each Q from H = X^T X, its products in `dtype` and their
    sums in FP64 (0 when W X is 0)."""
    den, errors = output_errors(w, qs, h, dtype)
    return [e / den if den > 0 else 0.0 for e in errors]


def safeguard_errors(w: torch.Tensor, nearest: torch.Tensor, rounded: torch.Tensor, h: torch.Tensor,
                     loop_error: float | None = None) -> tuple[float, float]:
    """(round to nearest's, GPTQ's) relative output errors, ordered as FP64 orders them: the
    products in FP32 (half the time of FP64's), GPTQ's ||(W - Q) X||^2 from its column loop where
    given (`loop_error`: one N x K x K product fewer), again all in FP64 where the two are within
    TIE of each other, closer than FP32's error in them could be trusted to order."""
    if loop_error is None:
        errors = relative_output_errors(w, [nearest, rounded], h, torch.float32)
    else:
        den, (rtn,) = output_errors(w, [nearest], h, torch.float32)
        errors = [rtn / den, loop_error / den] if den > 0 else [0.0, 0.0]
    if abs(errors[0] - errors[1]) <= TIE * max(errors):
        errors = relative_output_errors(w, [nearest, rounded], h)
    return errors[0], errors[1]


def loop_output_error(w: torch.Tensor, rounded: torch.Tensor, h: torch.Tensor, squared_errors: float,
                      ridge: float) -> float | None:
    """||(W - Q) X||^2 = tr(E H E^T), E = W - Q, from the column loop's sum of err_j^2: with U the
    loop's upper factor of H_d^-1, E = Err U, so tr(E H_d E^T) = ||Err||^2 exactly, where H_d is H
    with dead channels' H_jj = 1 and `ridge` (the dampening's d x mean diag) on the diagonal; the
    two are taken off: on the tests' inputs 1/8 to 2/3 of it, and the difference within ~1e-5 of
    the FP64 product, as close as the FP32 product. GPTQ moves error where H is small, so on a
    nearly low-rank H (fewer tokens than K, act order static) they can be over 99% of it: None
    where they are over 9/10 (the difference would lose more than a digit), and the product is
    computed as before."""
    e = (w.float() - rounded.float()).double()
    dead = torch.diagonal(h) == 0
    added = ridge * float(e.square().sum()) + float(e[:, dead].square().sum())
    return squared_errors - added if added <= 0.9 * squared_errors else None


LEAF = 512  # lower_inverse: blocks up to this size are inverted by one triangular solve against I


def lower_inverse(low: torch.Tensor) -> torch.Tensor:
    """L^-1 of a lower-triangular `low` by halves, as LAPACK's blocked trtri: for L = [[A, 0],
    [B, C]], L^-1 = [[A^-1, 0], [-C^-1 B A^-1, C^-1]], the corner two matrix products: K^3 / 3
    multiply-adds against K^3 / 2 for a triangular solve against I, and no I: 1.7 s against 2.5 s
    at K 5632 on one thread, the same values to ~1e-16 relative."""
    k = low.shape[0]
    if k <= LEAF:
        return torch.linalg.solve_triangular(low, torch.eye(k, dtype=low.dtype, device=low.device), upper=False)
    m = k // 2
    out = torch.zeros_like(low)
    out[:m, :m] = lower_inverse(low[:m, :m])
    out[m:, m:] = lower_inverse(low[m:, m:])
    out[m:, :m] = out[m:, m:] @ (low[m:, :m] @ out[:m, :m]).neg_()
    return out


def upper_inverse_factor(h: torch.Tensor, dampening: float,
                         order: torch.Tensor | None = None) -> tuple[torch.Tensor | None, float, float]:
    """U (FP32) with H_damped^-1 = U^T U (upper Cholesky factor of the inverse) for H with its rows
    and columns in `order` (None: as they are), the dampening that worked, raised x10 up to
    MAX_DAMPENING while the factorization fails, and what it added to the diagonal (d x its
    mean, loop_output_error's ridge); (None, last, its ridge) if none did.

    With J the reversal of rows and columns, L the lower Cholesky factor of J H J and A = L^-1
    (lower): H^-1 = J (J H J)^-1 J = J A^T A J = (J A J)^T (J A J), and J A J is upper with a
    positive diagonal, so it is U (the factor is unique). One Cholesky and one triangular
    inverse: half the time of inverting H (`cholesky_solve` against I) and factorizing the
    inverse again. J H J in `order` is one gather of H's rows and columns in the reversed order."""
    h = h.double()  # the caller's H where it is FP64 already: read, never written
    k = h.shape[0]
    order = torch.arange(k, device=h.device) if order is None else order.to(h.device)
    diagonal = torch.diagonal(h)[order]
    diagonal[diagonal == 0] = 1.0  # dead input channels
    mean_diag = float(diagonal.mean())  # summed in `order`, not reversed: its bits, and the dampening's
    reverse, diagonal = order.flip(0), diagonal.flip(0)  # J H J's
    d = dampening
    while True:  # besides H at most two and a half K x K FP64 matrices at a time: J H J and L, then L and L^-1
        damped = h[reverse][:, reverse]
        damped.diagonal().copy_(diagonal).add_(d * mean_diag)
        low, info = torch.linalg.cholesky_ex(damped)
        del damped
        if int(info) == 0:
            inverse = lower_inverse(low).float()  # FP32, as the loop reads it
            del low
            low_end, high_end = torch.aminmax(inverse)  # NaN propagates: both finite iff every value is
            if bool(torch.isfinite(low_end)) and bool(torch.isfinite(high_end)):
                return inverse.flip(0, 1), d, d * mean_diag
            del inverse
        if d >= MAX_DAMPENING:
            return None, d, d * mean_diag
        d = min(d * 10, MAX_DAMPENING)


@dataclass(frozen=True)
class Factor:
    """H's share of the solve: the loop order, Hinv in it (FP32; None: H did not factorize) and
    the dampening used, and what that dampening added to H's diagonal (d x its mean). Modules that
    read one input (q/k/v, gate/up) share one H, hence one Factor."""
    perm: torch.Tensor | None
    hinv: torch.Tensor | None
    dampening: float
    ridge: float  # required: a Factor without it would leave the ridge in GPTQ's error (loop_output_error)


def factorize(h: torch.Tensor, settings: GptqSettings) -> Factor:
    """The Factor of H = X^T X `h` [K, K] (FP64) under `settings` (act order, dampening)."""
    perm = torch.argsort(torch.diagonal(h), descending=True, stable=True) if settings.act_order == "static" else None
    return Factor(perm, *upper_inverse_factor(h, settings.dampening, perm))


def gptq_quantize(name: str, w: torch.Tensor, h: torch.Tensor, recipe: Recipe, facts: ModuleFacts,
                  settings: GptqSettings, backend: str = "auto", factor: Factor | None = None) -> Outcome:
    """GPTQ of weight `w` [N, K] (source dtype) with H = X^T X `h` [K, K] (FP64), in `recipe`;
    `factor`: factorize(h, settings) when the caller already has it (another module's of one H)."""
    nearest = recipe.quantize(name, w, backend=backend, facts=facts)
    factor = factorize(h, settings) if factor is None else factor
    if factor.hinv is None:
        (rtn_error,) = relative_output_errors(w, [recipe.dequantize(nearest, backend=backend)], h)
        return Outcome(nearest, "nearest", rtn_error, rtn_error, None,
                       f"H is not positive definite even with dampening {factor.dampening:g} (or its inverse's "
                       f"factor overflows FP32: inputs near FP32's smallest numbers)")
    q, squared_errors = _rounded(w, factor.hinv, factor.perm, recipe, facts, settings, backend)
    near, rounded = [recipe.dequantize(x, backend=backend) for x in (nearest, q)]
    rtn_error, error = safeguard_errors(w, near, rounded, h,
                                        loop_output_error(w, rounded, h, squared_errors, factor.ridge))
    used = factor.dampening
    if error >= rtn_error and rtn_error > 0:
        return Outcome(nearest, "nearest", rtn_error, rtn_error, used,
                       f"GPTQ's output error {error:.4g} was not below round to nearest's {rtn_error:.4g}")
    return Outcome(q, "gptq", error, rtn_error, used)


def _rounded(w: torch.Tensor, hinv: torch.Tensor, perm: torch.Tensor | None, recipe: Recipe, facts: ModuleFacts,
             settings: GptqSettings, backend: str) -> tuple[QuantizedTensor, float]:
    """The codes and scales GPTQ writes for `w`, `hinv` being the paper's H^-1 (the upper
    Cholesky factor of the damped inverse) with its columns in loop order (`perm`), and the
    loop's sum of err_j^2 (loop_output_error)."""
    spec = recipe.spec
    n, k = w.shape
    amax = facts.group_amax if facts.group_amax is not None else tensor_amax(w)
    weight = facts.input_channel_ms if spec.scale_search.active else None
    spans = Spans(spec, n, k, w.dtype, amax.to(w.device) if recipe.has_global_scale else None,
                  None if weight is None else weight.to(w.device), backend)
    order = torch.arange(k, device=w.device) if perm is None else perm
    fixed = None if spans.chosen_per_span and settings.scales == "updated" else spans.choose_all(w.float())
    # columns contiguous in memory (W stored as W^T): a column's update is one row, 10x faster on the CPU
    cols = w.float()[:, order].T.contiguous().T
    source, divisor, scales, squared_errors = _columns(cols, hinv, order, spans, fixed, settings.block_columns)
    codes = spans.encode(source, divisor)
    return QuantizedTensor(recipe.name, (n, k), codes, scales, spans.global_scale, spec.scale_rule), squared_errors


def _columns(W: torch.Tensor, hinv: torch.Tensor, order: torch.Tensor, spans: Spans,  # noqa: N803 (the paper's W)
             fixed: tuple[torch.Tensor, torch.Tensor] | None, block: int):
    """The paper's Algorithm 1 on W [N, K], whose column j is the weight's column `order[j]`,
    in place: returns, in the weight's own column order, the values each column was rounded
    from and their scales' divisors [N, K], the stored scales and the sum of the loop's err^2
    (FP64: loop_output_error). `fixed`: the scales and
    divisors chosen before the loop, or None to choose each span's when the loop first reaches
    one of its columns, from its values as updated so far (`_span_values`)."""
    n, k = W.shape
    at = torch.empty_like(order)
    at[order] = torch.arange(k, device=order.device)  # loop position of each column of the weight
    source = torch.empty_like(W)
    scales: dict[int, torch.Tensor] = {}  # by the span's first column, as the loop chooses them
    D = torch.empty_like(W) if fixed is None else fixed[1][:, order].T.contiguous().T  # noqa: N806
    squared_errors = 0.0
    for i0 in range(0, k, block):
        i1 = min(i0 + block, k)
        E = torch.empty(i1 - i0, n, dtype=W.dtype, device=W.device).T  # noqa: N806 (columns contiguous, as W's)
        for j in range(i0, i1):
            first = int(order[j]) // spans.width * spans.width
            if fixed is None and first not in scales:
                span = at[first:first + spans.width]
                scales[first], d = spans.choose(_span_values(W, span, hinv, E, i0, j, i1), first)
                D.T[span] = d.T  # rows of the contiguous D^T: a copy of rows, not a column scatter
            source[:, j] = W[:, j]
            q = spans.round(W[:, j], D[:, j])
            E[:, j - i0] = (W[:, j] - q) / hinv[j, j]
            W[:, j:i1].addmm_(E[:, j - i0, None], hinv[None, j, j:i1], alpha=-1)  # a BLAS call: addr_ is 15x slower
        W[:, i1:].addmm_(E, hinv[i0:i1, i1:], alpha=-1)  # the lazy block update
        squared_errors += float(torch.linalg.vector_norm(E, dtype=torch.float64)) ** 2
    stored = fixed[0] if fixed is not None else Spans.scale_tensor([scales[s] for s in sorted(scales)])
    # columns back in the weight's order
    return source.T[at].T.contiguous(), D.T[at].T.contiguous(), stored, squared_errors


def _span_values(W: torch.Tensor, span: torch.Tensor, hinv: torch.Tensor, E: torch.Tensor,  # noqa: N803
                 i0: int, j: int, i1: int) -> torch.Tensor:
    """The values [N, width] of the span at loop positions `span` as updated so far by columns
    before j: those past the current block [i0, i1) still lack its lazy update, added here."""
    values = W.T[span].T.contiguous()  # W's columns are rows of the contiguous W^T: gathered as rows
    later = span >= i1
    if j > i0 and bool(later.any()):
        values[:, later] -= E[:, :j - i0] @ hinv[i0:j, span[later]]
    return values
