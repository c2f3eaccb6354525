"""Whether a decoded module is a quantization of its reference: judged by what makes one wrong,
never by how close its error comes to quantcli's own.

A checkpoint is a quantization of the source when its codes are *a* rounding of source / scale
under its stored scales. Round-to-nearest in any of its variants (ties either way, BF16 or FP32
quotients, scales rounded to BF16 or E4M3, the MX exponent rules, saturation, scale searches)
leaves each element within h of its source: half the element grid's step at that magnitude, or
what saturation clips (kernels/blockstats.py sums it per block). Error-feedback producers (GPTQ)
move codes further, but their moves are noise across the block, not a rescaling of it. So, per
module:

1. Gain: the decode is g x the source plus noise; |g - 1| must stay within sum |s| h / sum s^2,
   the most that any nearest rounding can move it. A scale x2 or /2 (an MX exponent off by one),
   an inverted global, another tensor's or swapped codes land far outside.
2. Error: at most ERROR_FACTOR x ||h|| (round-to-nearest gives at most 1 x, 0.42-0.61 x measured;
   GPTQ's weight error, 1.2-2x round-to-nearest's, up to 1 x): scrambled codes give errors of the
   order of the values.
3. Blocks: a block whose gain leaves its own rounding bound by an amount that is both large
   against the module's typical block error (x BLOCK_Z) and mostly along its source (x BLOCK_T
   the error across it) has a wrong scale: how a transposed, shifted or overwritten block scale
   shows. GPTQ blocks whose gain strays do so with errors mostly across the source (measured:
   at most 0.15 of the threshold; 16 NVFP4 block scales halved score 1.3 and more). Also a block
   whose excess along its source is more than block_z(blocks) standard deviations of its cross
   error spread over its n elements (block_excess): a few scales a little too large.
4. Scales: a block's amax at most SCALE_CLIP x the largest value its scale decodes (the MX floor
   rule clips 8/6, a scale search 2.7x at most, GPTQ's updated-weight scales 1.6x measured).

Measured with scripts/measure_verify.py on compressed-tensors' arithmetic (ModelOpt's MXFP4 in
tests/test_faults_verify.py), quantcli's own (every recipe, MX rule and scale search), a GPTQ on
correlated inputs and the corruptions; the results are in that script's docstring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from quantcli.kernels.blockstats import BlockStats
from quantcli.kernels.spec import BLOCK, FP8_BLOCK, GROUP, TENSOR

ERROR_FACTOR = 1.5
# --calibration: a Linear's layer-output error at most this much above that of the reference
# rounded to nearest under the checkpoint's own scales (outputs.py; ties and BF16 quotients: ~1 %)
OUTPUT_MARGIN = 0.25
BLOCK_Z = 1.5
BLOCK_T = 3.0
SCALE_CLIP = 4.0
# Module signed excess se / sqrt(sum (|s| h)^2): Hoeffding on terms in +-|s| h (docs/formats.md,
# "How verify judges a rounding").
EXCESS_Z = 6.0
# A block's excess along its source over its cross error / sqrt(n): Gaussian tail, Bonferroni over
# the module's blocks at this false-alarm rate (same section).
BLOCK_ALPHA = 1e-6


@dataclass
class Verdict:
    """One module's judgement: the numbers a TensorRow shows and the fault reasons."""

    rel_err: float
    sqnr_db: float
    cosine: float
    gain: float
    gain_allowed: float  # the rounding bound W on |gain - 1|
    error_limit: float  # ERROR_FACTOR x the rounding bound on the relative error
    blocks: int
    blocks_off: int
    reasons: list[str] = field(default_factory=list)
    output_rel_err: float | None = None  # --calibration: layer-output error of the checkpoint
    output_rounded_rel_err: float | None = None  # ... and of the reference rounded to its scales


def tensor_metrics(st: BlockStats) -> tuple[float, float, float]:
    """(rel_err, sqnr_db, cosine) of the whole decode, from the block sums."""
    ss, se, ee = (float(t.double().sum()) for t in (st.ss, st.se, st.ee))
    dd = max(ss + 2 * se + ee, 0.0)
    if not math.isfinite(ee):
        return math.inf, -math.inf, math.nan
    rel = math.sqrt(ee / ss) if ss > 0 else math.sqrt(ee)
    sqnr = 10 * math.log10(ss / ee) if ee > 0 and ss > 0 else math.inf
    cos = (ss + se) / math.sqrt(ss * dd) if ss > 0 and dd > 0 else 1.0
    return rel, sqnr, min(1.0, max(-1.0, cos)) if math.isfinite(cos) else cos


def judge(st: BlockStats, recipe, shape: tuple[int, ...], output: tuple[float, float] | None = None) -> Verdict:
    """`output` (--calibration): the module's layer-output error and that of the reference rounded
    to nearest under its stored scales; it replaces the weight-error rule."""
    rel, sqnr, cos = tensor_metrics(st)
    ss, sh, se = (float(t.double().sum()) for t in (st.ss, st.sh, st.se))
    hh = st.hh
    gain_allowed = sh / ss if ss > 0 else 0.0
    bound = math.sqrt(hh / ss) if ss > 0 else 0.0
    gain = 1 + se / ss if ss > 0 else 1.0
    v = Verdict(rel, sqnr, cos, gain, gain_allowed, ERROR_FACTOR * bound, st.blocks, 0)
    if st.nonfinite:
        return v  # the caller files it under FINITE; nothing else is meaningful
    if ss == 0:
        if float(st.ee.double().sum()) > 0:
            v.reasons.append(f"the reference is all zero but the module decodes to values up to {st.max_abs:.4g}")
        return v
    if not abs(se) <= sh:  # the sums themselves: 1 + se / ss - 1 rounds, and a clipped block sits on its bound
        v.reasons.append(f"decodes to {gain:.4g} x its reference overall; rounding to the stored scales allows "
                         f"1 +- {gain_allowed:.3g}: {_gain_cause(gain)}")
    excess = se / math.sqrt(st.fh2) if st.fh2 > 0 else 0.0
    if excess > EXCESS_Z:
        v.reasons.append(f"decodes {gain:.4g} x its reference, {excess:.3g} x the spread nearest rounding gives "
                         f"(at most {EXCESS_Z:g} x): its scales are too large (a scale code off, a wrong global)")
    if output is not None:
        v.output_rel_err, v.output_rounded_rel_err = output
        v.reasons += _output_reasons(*output)
    elif not rel <= v.error_limit:
        v.reasons.append(f"relative error {rel:.4g} is above {v.error_limit:.4g}, {ERROR_FACTOR:g} x the most that "
                         f"rounding to the stored scales can give: the codes do not encode the reference (scrambled, "
                         f"swapped nibbles, another tensor's, or quantized from other weights)")
    v.blocks_off, block_reason = _blocks(st, recipe, shape)
    v.reasons += [r for r in (block_reason, _scales(st, recipe, shape)) if r]
    return v


class OutputReason(str):
    """A fault of the layer-output rule (--calibration), filed under its own check."""


def output_limit(rounded: float) -> float:
    """The most a module's layer-output error may be: rounding's to the stored scales + OUTPUT_MARGIN."""
    return (1 + OUTPUT_MARGIN) * rounded + 1e-6


def _output_reasons(checkpoint: float, rounded: float) -> list[str]:
    limit = output_limit(rounded)
    if checkpoint <= limit:
        return []
    return [OutputReason(f"layer-output error {checkpoint:.4g} on the calibration data is above {limit:.4g}, that "
                         f"of the reference rounded to nearest under the stored scales ({rounded:.4g}) plus "
                         f"{OUTPUT_MARGIN:.0%}: the codes do not encode the reference")]


def _gain_cause(gain: float) -> str:
    if gain <= 0.05:
        return "the codes do not follow the reference (scrambled, swapped nibbles or another tensor's codes)"
    return "a scale is wrong (an MX exponent off by one, an inverted or mis-scaled global or block scale)"


def _blocks(st: BlockStats, recipe, shape) -> tuple[int, str | None]:
    """Blocks whose gain leaves their rounding bound, by much and along their source (an
    all-zero source block has no gain: it is left out)."""
    typical = math.sqrt(max(_median(st.ee, st.ss > 0), 0.0))
    off = (st.along > BLOCK_Z * typical) & (st.along > BLOCK_T * st.across)
    off |= block_excess(st, shape) > block_z(st.blocks)
    count = int(off.sum())
    if not count:
        return 0, None
    worst = int(torch.argmax(torch.where(off, st.along / st.ss.sqrt(), torch.zeros_like(st.ss))))
    ss = float(st.ss[worst])
    g, a = 1 + float(st.se[worst]) / ss, float(st.sh[worst]) / ss
    return count, (f"{count} of {st.blocks} blocks decode to a multiple of their reference that rounding does not "
                   f"explain (worst: {block_name(worst, recipe, shape)} at {g:.3g} x, rounding allows "
                   f"{1 - a:.3g}-{1 + a:.3g}): their scales are wrong")


def block_z(blocks: int) -> float:
    """The most a block's excess (block_excess) reaches under unbiased moves, over `blocks` blocks."""
    return math.sqrt(2 * math.log(2 * max(blocks, 1) / BLOCK_ALPHA))


def block_excess(st: BlockStats, shape: tuple[int, ...]) -> torch.Tensor:
    """Per block, along / (across / sqrt(n)): how many standard deviations of its own cross error,
    spread over its n elements, its error along the source exceeds rounding's bound (0 within it;
    nearest rounding never leaves it, GPTQ's moves leave it as noise)."""
    n = max(math.prod(shape) // max(st.blocks, 1), 1)
    ratio = st.along * math.sqrt(n) / st.across
    moved = st.along > 2.0**-20 * st.ss.sqrt()  # past the sums' FP32 rounding (a clipped block sits on its bound)
    return torch.where(moved, ratio.nan_to_num(nan=0.0), torch.zeros_like(ratio))


def _median(t: torch.Tensor, keep: torch.Tensor, most: int = 1 << 16) -> float:
    """The median of `t` where `keep`, over an even spread of at most `most` of its values (a
    typical block's error needs no more, and sorting millions of blocks costs more than the pass)."""
    step = max(1, t.numel() // most)
    t = t[::step][keep[::step]]
    return float(torch.kthvalue(t, (t.numel() + 1) // 2).values) if t.numel() else 0.0


def _scales(st: BlockStats, recipe, shape) -> str | None:
    """Blocks whose stored scale is far too small for their reference amax (values clipped away)."""
    count = int((st.clip > SCALE_CLIP).sum())
    if not count:
        return None
    worst = int(torch.argmax(st.clip))
    return (f"{count} block scale(s) too small for the reference: {block_name(worst, recipe, shape)} has an amax "
            f"{float(st.clip[worst]):.3g} x the largest value its scale decodes (producers clip at most "
            f"{SCALE_CLIP:g} x)")


def block_name(index: int, recipe, shape: tuple[int, ...]) -> str:
    """Where judging block `index` is: 'row 3, columns 16-31' (with the expert for a stack)."""
    *lead, n, k = shape
    geometry = recipe.spec.geometry
    if geometry == GROUP:
        per_row = k // recipe.spec.group
        row, col = divmod(index, per_row)
        cols = f", columns {col * recipe.spec.group}-{(col + 1) * recipe.spec.group - 1}"
    elif geometry == BLOCK:
        nb, kb = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
        matrix, rest = divmod(index, nb * kb)
        tile_row, tile_col = divmod(rest, kb)
        where = f"tile ({tile_row}, {tile_col})"
        return f"expert {matrix} {where}" if lead else where
    else:
        row, cols = index, "" if geometry == TENSOR else ""
    matrix, row = divmod(row, n)
    return (f"expert {matrix} " if lead else "") + f"row {row}{cols}"
