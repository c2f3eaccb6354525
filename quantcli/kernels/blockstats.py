"""How a decoded quantized tensor differs from its source, block by block, in one streaming pass.

verify judges a checkpoint block by block (quantcli/verify/judge.py), from sums per block of the
source s, the error e = decode - s and h, the most a nearest rounding of s to the block's stored
scale can err (half the element grid's step at |s| / scale, or what saturation clips, plus
2^-8 |s| for producers that round the quotient to BF16 first): sum s^2, s*e, e^2, |s|*h, h^2 and
max |s|. From them follow the block's gain (1 + se / ss: how much the decode scales the source),
the most any nearest rounding could move it (sum |s| h / ss), the part of its error along the
source and across it, and the tensor's relative error, SQNR and cosine, without ever holding a
second FP32 copy of the tensor.

The tensor is walked in bands of whole blocks (kernels/decode.py), on the chunk pool on the CPU
(each thread in its own workspace, as convert's quantizer) and as one band on a GPU. The judging
blocks are the scale blocks (1 x group, a row, a 128 x 128 tile); a per-tensor scale is judged
row by row. Each band may also quantize its source rows with other specs ("yardsticks", such as
quantcli's own recipe) and return the squared error each gives.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from quantcli.kernels import quantize  # the dispatcher (a band is one chunk: it runs inline)
from quantcli.kernels.chunks import _map
from quantcli.kernels.cpu import _WS
from quantcli.kernels.decode import Band, band_of, bands, decode_band, scale_values
from quantcli.kernels.spec import BLOCK, FP8_BLOCK, GROUP, QuantResult, QuantSpec


@dataclass(frozen=True)
class Yardstick:
    """Another quantization of the same source, for comparison: quantized band by band with
    `spec` (a fused group's `global_amax`, a search's `channel_weight`), or `result` decoded."""

    spec: QuantSpec
    global_amax: torch.Tensor | None = None
    channel_weight: torch.Tensor | None = None
    result: QuantResult | None = None
    dtype: torch.dtype | None = None  # quantize the source cast to this (a weight-dtype scale's)


@dataclass
class BlockStats:
    """Per judging block, in the scale tensor's order (FP32, or FP64 for values past 2^PRESCALE_TOP;
    sum them in FP64), of the source and the error."""

    ss: torch.Tensor
    se: torch.Tensor
    ee: torch.Tensor
    sh: torch.Tensor  # sum |s| h
    # derived per block (0 for an all-zero source block): the norm of the error along the source
    # beyond what rounding can put there, (|se / ss| - sh / ss)+ sqrt(ss); the norm across it,
    # sqrt(ee - se^2 / ss); the block amax over the largest value its scale decodes
    along: torch.Tensor
    across: torch.Tensor
    clip: torch.Tensor
    hh: float = 0.0  # sum h^2 over the tensor
    fh2: float = 0.0  # sum (|s| h)^2 over the tensor: the spread of se under unbiased nearest rounding
    max_abs: float = 0.0  # max |decode - source|
    nonfinite: int = 0  # decoded values that are NaN or Inf
    yard: list[float] = field(default_factory=list)  # sum of squared errors per yardstick

    @property
    def blocks(self) -> int:
        return int(self.ss.numel())


def _buffer(name: str, numel: int, device: torch.device) -> torch.Tensor:
    """An FP32 scratch of `numel`: the thread's workspace on the CPU, a fresh tensor elsewhere."""
    if device.type == "cpu":
        return _WS.get(name, numel, torch.float32)
    return torch.empty(numel, dtype=torch.float32, device=device)


def _per_block(t: torch.Tensor, spec: QuantSpec, reduce: str) -> torch.Tensor:
    """`t` [rows, K] reduced (sum or amax) over each judging block, flattened in scale order.
    Sums are products with a vector of ones (one BLAS pass; torch's reduction over a 16- or
    32-wide last dim is several times slower), maxima a max-pool, as the quantizer's block amax."""
    rows, k = t.shape
    if spec.geometry == GROUP:
        if reduce == "sum":
            return torch.mv(t.view(-1, spec.group), _ones(spec.group, t.device, t.dtype))
        return F.max_pool1d(t.unsqueeze(1), spec.group).reshape(-1)
    if spec.geometry != BLOCK:
        return torch.mv(t, _ones(k, t.device, t.dtype)) if reduce == "sum" else t.amax(-1)
    nb, kb = -(-rows // FP8_BLOCK), -(-k // FP8_BLOCK)
    if rows % FP8_BLOCK or k % FP8_BLOCK:  # a ragged edge: zeros pad it (neither sum nor |max| moves)
        t = F.pad(t, (0, kb * FP8_BLOCK - k, 0, nb * FP8_BLOCK - rows))
    v = t.reshape(nb, FP8_BLOCK, kb, FP8_BLOCK)
    return (v.sum((1, 3)) if reduce == "sum" else v.amax(dim=(1, 3))).reshape(-1)


@functools.cache
def _ones(n: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.ones(n, dtype=dtype, device=device)


# element -> (smallest, largest) FP32 exponent field whose binade sets the grid step, and how many
# binades below the value the half step lies: E2M1 steps 0.5 / 1 / 2 below 2 / 4 / beyond, E4M3
# 2^(e-3) with subnormals below 2^-6; integers (INT8, INT4) a step of 1 everywhere.
_HALF_STEP = {"e2m1": (127, 129, 2), "e4m3": (121, 135, 4)}
QUOTIENT_SLACK = 2.0**-8  # a quotient rounded to BF16 (8 bits) before the element cast


def _max_error(a: torch.Tensor, scale: torch.Tensor, spec: QuantSpec, out: torch.Tensor) -> torch.Tensor:
    """h for the magnitudes `a` [rows, K] under their blocks' `scale`, into `out` (`a` is kept)."""
    v = _per_element(torch.div, a, scale, spec, out)  # the magnitude in grid units
    name, top = spec.element.name, spec.element.max
    if name in _HALF_STEP:
        lo, hi, below = _HALF_STEP[name]
        h = _WS_or_new("vh", v)
        bits = h.view(torch.int32)
        torch.bitwise_and(v.view(torch.int32), 0x7F800000, out=bits)
        bits.clamp_(lo << 23, hi << 23).sub_(below << 23)
    else:
        h = _WS_or_new("vh", v).fill_(0.5)
    units = h.add_(v, alpha=QUOTIENT_SLACK)
    h = _per_element(torch.mul, units, scale, spec, out)  # v (in `out`) is no longer needed
    # beyond the largest code: what saturation clips, a - top x scale (exact, unlike (a / scale - top) x
    # scale, whose two roundings can put a clipped value's own error a hair above its bound)
    clipped = _per_element(torch.sub, a, scale * top, spec, units)
    return torch.maximum(h, clipped, out=h)


def _WS_or_new(name: str, like: torch.Tensor) -> torch.Tensor:
    return _buffer(name, like.numel(), like.device).view(like.shape)


def _per_element(op, t: torch.Tensor, scale: torch.Tensor, spec: QuantSpec, out: torch.Tensor) -> torch.Tensor:
    """op(t, its block's scale) into `out` [rows, K]; `scale` per judging block (flat)."""
    rows, k = t.shape
    if spec.geometry == GROUP:
        g = spec.group
        return op(t.view(rows, k // g, g), scale.view(rows, k // g, 1), out=out.view(rows, k // g, g)).view(rows, k)
    if spec.geometry != BLOCK:
        return op(t, scale.view(rows, 1), out=out)
    nb, kb = -(-rows // FP8_BLOCK), -(-k // FP8_BLOCK)
    full = scale.view(nb, kb).repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:rows, :k]
    return op(t, full, out=out)


def _block_scale(band: Band, global_scale, spec: QuantSpec, rows: int) -> torch.Tensor:
    s = scale_values(band.scale, global_scale, spec).to(torch.float32)
    return s.reshape(1).expand(rows) if s.dim() == 0 else s.reshape(-1)


def _yard_error(y: Yardstick, x: torch.Tensor, f: torch.Tensor, band: Band, shape) -> float:
    """Sum of squared errors of the yardstick on this band's rows."""
    if y.result is not None:
        yb = band_of(y.result, y.spec, shape, band.matrix, band.start, band.stop)
        g = y.result.global_scale
    else:
        r = quantize(x if y.dtype is None else x.to(y.dtype), y.spec, y.global_amax, channel_weight=y.channel_weight)
        yb, g = Band(band.matrix, 0, x.shape[0], r.codes, r.scale), r.global_scale
    o = decode_band(yb, g, y.spec, _buffer("vo", f.numel(), f.device).view(f.shape))
    o.sub_(f)
    return float(torch.dot(o.view(-1), o.view(-1)))


ROWS = ("ss", "se", "ee", "sh", "along", "across", "clip")  # the table's rows
# Values below 2^48 have their squares summed over a band (2^20 elements) finite in FP32.
PRESCALE_TOP = 48


def _derived(put: dict, scale: torch.Tensor, amax: torch.Tensor, top: float) -> None:
    """The derived rows (see BlockStats) from the sums, on the band's own thread."""
    ss, se = put["ss"], put["se"]
    inv = torch.where(ss > 0, 1 / ss, torch.zeros_like(ss))
    gain = se * inv  # gain - 1
    torch.mul(gain.abs().sub_(put["sh"] * inv).clamp_min_(0), ss.sqrt(), out=put["along"])
    torch.sub(put["ee"], se * gain, out=put["across"]).clamp_min_(0).sqrt_()
    limit = scale * top
    put["clip"].copy_(torch.where(limit > 0, amax / limit, torch.zeros_like(limit)))


def _band_stats(x: torch.Tensor, band: Band, global_scale, spec: QuantSpec, yardsticks, shape,
                table: torch.Tensor) -> dict:
    """Fill `table` [len(ROWS), this band's blocks]; returns the band's scalars. The products and
    sums are in the table's dtype: FP64 for a tensor whose values reach past 2^PRESCALE_TOP."""
    rows, k = x.shape
    dev = x.device
    f = _buffer("vf", rows * k, dev).view(rows, k).copy_(x)
    e = decode_band(band, global_scale, spec, _buffer("vd", rows * k, dev).view(rows, k)).sub_(f)
    lo, hi = torch.aminmax(e)
    max_abs = float(torch.maximum(-lo, hi))  # NaN propagates: finite here means every value is
    nonfinite = 0 if math.isfinite(max_abs) else int((~torch.isfinite(e)).sum())
    yard = [_yard_error(y, x, f, band, shape) for y in yardsticks]
    scale = _block_scale(band, global_scale, spec, rows)
    put = dict(zip(ROWS, table))
    wide = table.dtype == torch.float64  # squares of values near FP32 max stay finite, those of small ones nonzero
    f32 = f
    f, e, p = (f.double(), e.double(), None) if wide else (f, e, _buffer("vp", rows * k, dev).view(rows, k))
    put["ee"].copy_(_per_block(torch.mul(e, e, out=p) if p is not None else e * e, spec, "sum"))
    put["se"].copy_(_per_block(torch.mul(f, e, out=p) if p is not None else f * e, spec, "sum"))
    put["ss"].copy_(_per_block(torch.mul(f, f, out=p) if p is not None else f * f, spec, "sum"))
    a = torch.abs(f32, out=p) if p is not None else f32.abs()
    amax = _per_block(a, spec, "amax")
    h = _max_error(a, scale, spec, _buffer("vd", rows * k, dev).view(rows, k))  # e is no longer needed
    h, a = (h.double(), a.double()) if wide else (h, a)
    hh = float(torch.dot(h.view(-1), h.view(-1)))
    put["sh"].copy_(_per_block(a.mul_(h), spec, "sum"))
    fh2 = _sum_squares(a)
    _derived(put, scale, amax, spec.element.max)
    return {"yard": yard, "max_abs": max_abs, "nonfinite": nonfinite, "hh": hh, "fh2": fh2}


def _sum_squares(t: torch.Tensor) -> float:
    """sum t^2, in FP64 where FP32 overflows ((|s| h)^2 of large values can pass 2^128)."""
    flat = t.view(-1)
    total = float(torch.dot(flat, flat))
    return total if math.isfinite(total) else float(torch.dot(flat.double(), flat.double()))


def _wide(q: QuantResult, spec: QuantSpec) -> bool:
    """Whether the largest value the scales can decode passes 2^PRESCALE_TOP, where FP32 sums of
    squares over a band could overflow: such a tensor's sums are taken in FP64 (a power-of-two
    prescale into FP32 range would flush its small blocks' squares to zero and leave them
    unjudged). Non-finite scales are the finiteness check's."""
    scales = scale_values(q.scale, q.global_scale, spec)
    top = float(scales.abs().max()) * spec.element.max if scales.numel() else 0.0
    return math.isfinite(top) and top >= 2.0**PRESCALE_TOP


def _blocks_in(band: Band, spec: QuantSpec, k: int) -> int:
    rows = band.stop - band.start
    if spec.geometry == GROUP:
        return rows * (k // spec.group)
    if spec.geometry == BLOCK:
        return -(-rows // FP8_BLOCK) * -(-k // FP8_BLOCK)
    return rows


def block_stats(x: torch.Tensor, q: QuantResult, spec: QuantSpec, yardsticks: tuple[Yardstick, ...] = (),
                elements: int | None = None) -> BlockStats:
    """The per-block sums of `q` decoded against its source `x` ([..., N, K], any float dtype and
    strides, on q's device). Yardsticks of the tensor geometry must come as a `result` (a band
    would see only its own amax)."""
    shape = tuple(x.shape)
    n, k = shape[-2], shape[-1]
    tall = FP8_BLOCK if BLOCK in (spec.geometry, *(y.spec.geometry for y in yardsticks)) else 1
    if x.device.type != "cpu":
        elements = max(x.numel(), 1)  # a GPU takes each matrix whole
    mats = x.reshape(max(x.numel() // max(n * k, 1), 1) if x.numel() else 1, n, k)  # -1 is ambiguous when empty
    work = list(bands(q, spec, shape, elements, tall))
    sizes = [_blocks_in(b, spec, k) for b in work]
    table = torch.empty(len(ROWS), sum(sizes), dtype=torch.float64 if _wide(q, spec) else torch.float32,
                        device=x.device)
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + size)

    def one(i: int) -> dict:
        b = work[i]
        return _band_stats(mats[b.matrix, b.start:b.stop], b, q.global_scale, spec, yardsticks, shape,
                           table[:, starts[i]:starts[i + 1]])

    parts = list(_map(one, list(range(len(work)))))
    return BlockStats(*table.cpu(), hh=sum(p["hh"] for p in parts), fh2=sum(p["fh2"] for p in parts),
                      max_abs=max((p["max_abs"] for p in parts), default=0.0),
                      nonfinite=sum(p["nonfinite"] for p in parts),
                      yard=[sum(p["yard"][i] for p in parts) for i in range(len(yardsticks))])
