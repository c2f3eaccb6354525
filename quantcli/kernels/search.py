"""Scale search (`QuantSpec.scale_search = "mse"`), the pure-torch reference; the Triton twin is
the candidate loop in triton_quant._group_kernel, byte for byte.

The on-disk formats leave one freedom that absmax producers do not use: which scale code each
block gets. Here each block tries a few codes around the absmax one and keeps the one whose
dequantized block is closest to the weights (squared error, each input channel weighted by its
mean squared activation when calibration statistics are given). The element codes are then the
ordinary RNE codes given the chosen scale, so every decoder reproduces the values.

- NVFP4 (E4M3 block scale x FP32 global): the absmax code, then codes -3..-1 and +1..+7 around it
  (E4M3 codes of positive values are monotone, so code + d is the d-th neighbouring scale);
  the global scale stays amax / 2688, shared across fused groups.
- MX (E8M0): the layout rule's exponent e, then e + 1, then e - 1.

The error criterion is defined op by op so both backends compute the same FP32 numbers (and so
pick the same code): y = |x| / den; r = y on the element grid (E2M1: floor(y * inv + 0.5) / inv
with inv = 2, 1, 1/2 below 2, 4, 6, then at most 6; E4M3: decode(encode(y))); d = r * den - |x|;
e = d * d (* w); the block sum adds halves (e[:h] + e[h:]) until one value is left. A candidate
replaces the best only if strictly smaller, so ties keep the absmax code, then the earlier
candidate. An all-zero block errs 0 everywhere and keeps the absmax code.

How this file computes it on a CPU (tests/test_scale_search.py keeps the definition written
out as its oracle and checks the two agree): all candidates of a few rows are one batch laid out
[position in block, candidate, row, block], so every op is contiguous, the halves sum adds
contiguous slabs and the batch stays in cache; `r` comes from a few float and integer ops (the
element codec's `on_grid_`: e2m1_grid_x2_, e4m3_grid_ in kernels/elements.py) instead of
comparisons, selects, casts or lookups, equal to the definition for every non-negative FP32
value (checked exhaustively when they were written).
"""

from __future__ import annotations

import torch

from quantcli.kernels import reference as R
from quantcli.kernels.elements import ElementCodec, e2m1_grid_x2_, e4m3_grid_  # noqa: F401 (the grids, importable from here)
from quantcli.kernels.spec import E4M3_GLOBAL_SCALE, E8M0_SCALE, QuantResult, QuantSpec

# Each scale codec's window (kernels/scales.py), tried after the absmax code, in this order: the
# window a full 126-code sweep never left.
NVFP4_WINDOW = E4M3_GLOBAL_SCALE.search_window
MX_WINDOW = E8M0_SCALE.search_window
# Steps below the absmax scale clip the block's largest element; the codecs' `search_pruned`
# steps are evaluated only on the blocks where that element's error does not already exceed
# absmax's (clipped_errors), which skips most blocks (Laplace weights: NVFP4 -3 / -2 ~90 % /
# ~55 %, MXFP4 -1 ~80 %, MXFP8 -1 93-100 %); NVFP4 -1 skips ~10 %, too few to pay for the gather.
NVFP4_PRUNED = E4M3_GLOBAL_SCALE.search_pruned
MX_PRUNED = E8M0_SCALE.search_pruned
# (element, candidate) pairs evaluated per batch: big enough that torch's per-op overhead is
# small, small enough to stay in cache (2^19 was fastest of 2^15..2^20 on a 2-core CPU).
BATCH_ELEMENTS = 1 << 19
# NVFP4 divisors are halved exactly (for the doubled E2M1 grid) when s2 is at least this.
EXACT_HALF_S2 = 2.0**-116


def window(spec: QuantSpec) -> tuple[int, ...]:
    return spec.scale.search_window


def code_range(spec: QuantSpec) -> tuple[int, int]:
    """The scale codes a candidate may take: E4M3 1..126, E8M0 0..the last finite byte."""
    return spec.scale.code_range(spec.element)


def decode_code(code: torch.Tensor, spec: QuantSpec, s2: torch.Tensor | None) -> torch.Tensor:
    """The FP32 divisor of an int32 scale code, the value reference.encode_scale forms."""
    return spec.scale.decode_code(code, s2)


def rounded_products(ax: torch.Tensor, den: torch.Tensor, half: torch.Tensor | None, element: ElementCodec,
                     buf: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """fl(r * den) for every element and candidate, in `buf`. The codec's grid works on
    t = grid_scale * y (E2M1: t = 2y = ax / (den / 2), r2 = 2r, so fl(r2 * den / 2) = fl(r * den):
    the same numbers, two ops fewer); `half` is den / grid_scale when that is exact, else None
    (then t = grid_scale * (ax / den), r = r_t / grid_scale)."""
    if half is not None:
        return element.on_grid_(torch.div(ax, half, out=buf), scratch).mul_(half)
    t = torch.div(ax, den, out=buf)
    if element.grid_scale == 1.0:
        return element.on_grid_(t, scratch).mul_(den)
    return element.on_grid_(t.mul_(element.grid_scale), scratch).mul_(1.0 / element.grid_scale).mul_(den)


def candidate_errors(ax: torch.Tensor, den: torch.Tensor, half: torch.Tensor | None, element: ElementCodec,
                     weight: torch.Tensor | None, buf: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """Squared error [n, C, B] of the blocks `ax` [n, G, B] (magnitudes, each row's blocks
    transposed: position in block, then block) under each candidate divisor `den` [n, C, B];
    `weight` [G, 1, B] or None; `buf` and `scratch` (FP32, int32) hold [n, G, C, B]."""
    ax = ax.unsqueeze(2)
    d = rounded_products(ax, den.unsqueeze(1), None if half is None else half.unsqueeze(1), element, buf,
                         scratch).sub_(ax)
    e = d.mul_(d)
    if weight is not None:
        e = e.mul_(weight)
    while e.shape[1] > 1:  # the definition's halves: positions [:h] + [h:]
        h = e.shape[1] // 2
        e = e[:, :h].add_(e[:, h:])
    return e[:, 0]


def candidates(code0: torch.Tensor, den0: torch.Tensor, spec: QuantSpec, s2: torch.Tensor | None):
    """(divisors [n, C, B], valid [n, C - 1, B] or None when all are) for the absmax codes `code0`
    [n, B]: the absmax code first, then the window in order; a code outside the scale codec's
    range is clamped and marked invalid."""
    lo, hi = code_range(spec)
    steps = window(spec)
    base = code0.to(torch.int32).unsqueeze(1)
    cand = base + torch.tensor((0, *steps), dtype=torch.int32, device=base.device).view(1, -1, 1)
    valid = None  # the mask costs more than the search's other block-sized steps: only when needed
    if int(base.min()) + min(steps) < lo or int(base.max()) + max(steps) > hi:
        valid = (cand[:, 1:] >= lo) & (cand[:, 1:] <= hi)
        cand = cand.clamp_(lo, hi)
    return decode_code(cand, spec, s2), valid  # the absmax code's divisor is den0, bit for bit


def first_smallest(err: torch.Tensor, valid: torch.Tensor | None, weighted: bool) -> torch.Tensor:
    """The candidate index [n, B] (0 = absmax) the definition's loop keeps from `err` [n, C, B]:
    in order, a candidate replaces the best only if its error is strictly smaller, i.e. the first
    candidate with the smallest error. An invalid or NaN error never replaces (inf), a NaN
    absmax error is never replaced (-inf); NaN needs weights (0 * inf). The first smallest is
    the largest (C - index) where err == min (float ops throughout: torch's boolean outputs
    cost several times more on the CPU)."""
    c = err.shape[1]
    if weighted:  # without weights every term is finite or +inf: no NaN
        err[:, 0] = torch.nan_to_num(err[:, 0], nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
        err[:, 1:] = torch.nan_to_num(err[:, 1:], nan=float("inf"), posinf=float("inf"), neginf=float("-inf"))
    if valid is not None:
        err[:, 1:] = torch.where(valid, err[:, 1:], float("inf"))
    rank = torch.arange(c, 0, -1, dtype=torch.float32, device=err.device).view(1, c, 1)
    is_min = torch.eq(err, err.amin(1, keepdim=True), out=torch.empty_like(err))
    return c - is_min.mul_(rank).amax(1).to(torch.int32)


def pruned_steps(spec: QuantSpec) -> tuple[int, ...]:
    """Window steps evaluated only on the blocks they might win (see clipped_errors)."""
    return spec.scale.search_pruned


def batched_errors(ax: torch.Tensor, den: torch.Tensor, half: torch.Tensor | None, element: ElementCodec,
                   weight: torch.Tensor | None) -> torch.Tensor:
    """candidate_errors [n, C, B] of `ax` [n, G, B] under `den` [n, C, B], a few rows at a time."""
    n, g, nb = ax.shape
    c = den.shape[1]
    rows = max(1, BATCH_ELEMENTS // (g * nb * c))
    buf = torch.empty(min(rows, n) * g * c * nb, dtype=torch.float32, device=ax.device)
    scratch = torch.empty(buf.shape, dtype=torch.int32, device=ax.device)
    err = torch.empty((n, c, nb), dtype=torch.float32, device=ax.device)
    for i in range(0, n, rows):
        part = slice(i, i + rows)
        shape = (min(rows, n - i), g, c, nb)
        size = shape[0] * g * c * nb
        err[part] = candidate_errors(ax[part], den[part], None if half is None else half[part], element, weight,
                                     buf[:size].view(shape), scratch[:size].view(shape))
    return err


def clipped_errors(ax: torch.Tensor, amax: torch.Tensor, err0: torch.Tensor, den: torch.Tensor,
                   half: torch.Tensor | None, element: ElementCodec, weight: torch.Tensor | None) -> torch.Tensor:
    """candidate_errors [n, B] of a scale below the absmax one (`den` [n, B]), inf where it cannot
    win. Such a scale clips the block's largest element; the block sum is at least that one
    element's term (FP32 sums of non-negative terms never decrease; with weights, at least its
    term under the block's smallest weight), so where that term already reaches the absmax
    error `err0` the candidate is never strictly better, and only the other blocks are evaluated."""
    n, g, nb = ax.shape
    scratch = torch.empty(amax.shape, dtype=torch.int32, device=ax.device)
    d = rounded_products(amax, den, half, element, torch.empty_like(amax), scratch).sub_(amax)
    bound = d.mul_(d)
    if weight is not None:
        bound = bound.mul_(weight.amin(dim=1))
    rows, blocks = (bound < err0).nonzero(as_tuple=True)
    out = torch.full((n, nb), float("inf"), device=ax.device)
    if rows.numel():
        k = rows.numel()
        w = None if weight is None else weight[blocks].t().reshape(g, 1, k)
        e = candidate_errors(ax[rows, :, blocks].t().unsqueeze(0), den[rows, blocks].view(1, 1, k),
                             None if half is None else half[rows, blocks].view(1, 1, k), element, w,
                             torch.empty((1, g, 1, k), device=ax.device),
                             torch.empty((1, g, 1, k), dtype=torch.int32, device=ax.device))
        out[rows, blocks] = e.view(k)
    return out


def search_codes(ax: torch.Tensor, amax: torch.Tensor, code0: torch.Tensor, den0: torch.Tensor, spec: QuantSpec,
                 s2: torch.Tensor | None, weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(best scale code, its divisor) [n, B] for the magnitudes `ax` [n, G, B] (each row's
    blocks transposed) with block maxima `amax`, from the absmax codes `code0` [n, B];
    `weight` [B, G] or None."""
    n, g, nb = ax.shape
    steps = (0, *window(spec))
    den, valid = candidates(code0, den0, spec, s2)
    grid = spec.element.grid_scale
    halving = grid != 1.0 and (s2 is None or float(s2) >= EXACT_HALF_S2)
    half = den * (1.0 / grid) if halving else None
    w = None if weight is None else weight.t().reshape(g, 1, nb)
    pruned = [i for i, step in enumerate(steps) if step in pruned_steps(spec)]
    full = [i for i in range(len(steps)) if i not in pruned]
    if not pruned:
        err = batched_errors(ax, den, half, spec.element, w)
    else:
        err = torch.empty((n, len(steps), nb), dtype=torch.float32, device=ax.device)
        err[:, full] = batched_errors(ax, den[:, full], None if half is None else half[:, full], spec.element, w)
    for i in pruned:
        err[:, i] = clipped_errors(ax, amax, err[:, 0], den[:, i], None if half is None else half[:, i],
                                   spec.element, weight)
    offsets = torch.tensor(steps, dtype=torch.int32, device=ax.device)
    code = code0.to(torch.int32) + offsets[first_smallest(err, valid, weight is not None)]
    return code.to(torch.uint8), decode_code(code, spec, s2)


def _group_chunk(x: torch.Tensor, spec: QuantSpec, s2, weight: torch.Tensor | None) -> QuantResult:
    g = R._groups(x, spec.group)
    # |x| with each row's blocks transposed, in one pass (contiguous ops for the search)
    ax = torch.abs(g.transpose(1, 2), out=torch.empty((g.shape[0], g.shape[2], g.shape[1]), device=x.device))
    amax = R._check_finite(ax.amax(dim=1))
    code0, den0 = R.encode_scale(amax, spec, s2)
    stored, den = search_codes(ax, amax, code0, den0, spec, s2, weight)
    return QuantResult(spec.element.encode((g / den.unsqueeze(-1)).reshape(x.shape)), stored)


def channel_weight_groups(weight: torch.Tensor | None, k: int, group: int, device) -> torch.Tensor | None:
    """Per input channel weights [K] (mean squared activation) as [K / G, G] FP32, or None."""
    if weight is None:
        return None
    weight = weight.reshape(-1)
    if weight.numel() != k:
        raise ValueError(f"channel weights have {weight.numel()} entries, the weight has K = {k}")
    return weight.to(device=device, dtype=torch.float32).reshape(k // group, group)


def quantize(x: torch.Tensor, spec: QuantSpec, global_amax: torch.Tensor | None = None,
             channel_weight: torch.Tensor | None = None) -> QuantResult:
    """reference.quantize with the searched block scales (group geometry)."""
    if x.numel() == 0:
        return R.empty_result(x, spec, global_amax)
    s2 = R.global_scale_for(x, spec, global_amax)
    w = channel_weight_groups(channel_weight, x.shape[-1], spec.group, x.device)
    r = R._chunked(x, 1, lambda c: _group_chunk(c.to(torch.float32), spec, s2, w))
    return QuantResult(r.codes, r.scale, s2)
