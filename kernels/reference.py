"""Pure-torch quantizers and dequantizers: the reference every Triton kernel must match bit for bit.

Numerics follow FORMATS.md A.2: FP32 arithmetic, clamp before every narrowing cast, RNE for
E4M3 (PyTorch's cast) and E2M1 (ties to the even code, saturating at 6), low nibble first,
NVFP4 with ModelOpt's op order, MX scale exponents from the FP32 bit pattern per `scale_rule`.
Inputs are `[..., N, K]`; blocks always run along the last (input) dimension.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .spec import (
    E2M1_MAX,
    E4M3_MAX,
    E4M3_MIN_SUBNORMAL,
    E8M0_MAX_FINITE_BYTE,
    EMAX_ELEM,
    FP8_BLOCK,
    FP8_BLOCK_KIND,
    FP8_CHANNEL,
    FP8_TENSOR,
    FP32_MIN_NORMAL,
    MAX_ELEM,
    MX,
    NVFP4,
    NVFP4_GLOBAL_DIVISOR,
    NonFiniteInput,
    QuantResult,
    QuantSpec,
)

# E2M1 magnitudes by 3-bit code; bit 3 of a nibble is the sign.
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


# ---------------------------------------------------------------- element codecs


def encode_e4m3(v: torch.Tensor) -> torch.Tensor:
    """FP32 -> E4M3FN bytes: clamp to +-448 first (an unclamped cast gives NaN on some torch
    versions), then PyTorch's RNE cast. The sign of zero is kept."""
    return v.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def decode_e4m3(codes: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.float8_e4m3fn).to(torch.float32)


def encode_e2m1(v: torch.Tensor) -> torch.Tensor:
    """FP32 -> 4-bit E2M1 codes (uint8, one per element, not packed).

    Round to nearest, ties to the even code, saturate at 6. Each comparison is one step of the
    magnitude ladder 0, .5, 1, 1.5, 2, 3, 4, 6: at a midpoint `>` rounds down (the lower code is
    even) and `>=` rounds up (the upper code is even). Negative values keep sign bit 0x8, also
    when they round to zero (compressed-tensors' signbit convention)."""
    a = v.abs()
    mag = (a > 0.25).to(torch.uint8)
    for bound, tie_up in ((0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False)):
        mag += (a >= bound) if tie_up else (a > bound)  # in place: no new tensor per step
    return mag | (torch.signbit(v).to(torch.uint8) << 3)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    mag = E2M1_VALUES.to(codes.device)[(codes & 0x7).long()]
    return torch.where((codes & 0x8) != 0, -mag, mag)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """`byte[j] = code[2j] | code[2j+1] << 4` along the last dim (even index low)."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    out = torch.stack((packed & 0x0F, packed >> 4), dim=-1)
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


# ---------------------------------------------------------------- E8M0 scales


def e8m0_byte(amax: torch.Tensor, element: str, rule: str) -> torch.Tensor:
    """Shared-exponent byte (= e + 127, clamped to [0, 254]) from a block amax, FP32 bit math.

    floor: floor(log2 amax) - emax_elem            (OCP MX v1.0)
    even:  floor(log2 R(amax)) - emax_elem, R rounds the FP32 mantissa at the FP4 mantissa width
           (adds 1 << 21 to the bits), as compressed-tensors does for MXFP4 and MXFP8 alike
    rceil: ceil(log2(amax / max_elem))              (ModelOpt, triton_kernels, gpt-oss)
    An all-zero block gives byte 0 under every rule; 255 (NaN) is never produced."""
    bits = amax.to(torch.float32).view(torch.int32)
    if rule == "floor":
        biased = (bits >> 23) - EMAX_ELEM[element]
    elif rule == "even":
        biased = ((bits + (1 << 21)) >> 23) - EMAX_ELEM[element]
    elif rule == "rceil":
        q = (amax.to(torch.float32) / MAX_ELEM[element]).view(torch.int32)
        biased = (q + 0x7FFFFF) >> 23
    else:
        raise ValueError(f"unknown scale rule {rule!r}")
    return biased.clamp(0, 254).to(torch.uint8)


def e8m0_to_float(byte: torch.Tensor) -> torch.Tensor:
    """2^(byte - 127) exactly in FP32; byte 0 is the FP32 subnormal 2^-127."""
    b = byte.to(torch.int32)
    bits = torch.where(b == 0, torch.full_like(b, 0x00400000), b << 23)
    return bits.view(torch.float32)


# ---------------------------------------------------------------- quantizers


def _check_finite(amax: torch.Tensor) -> torch.Tensor:
    """amax propagates NaN and Inf, so a finite amax proves its whole block finite: the check
    costs nothing beyond the amax every quantizer computes anyway."""
    if not bool(torch.isfinite(amax).all()):
        raise NonFiniteInput()
    return amax


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """Max |x| as an FP32 0-d tensor (0 for an empty tensor). One aminmax pass in the source
    dtype: a max is exact in any float format, and NaN/Inf propagate into it."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    lo, hi = torch.aminmax(x)
    return _check_finite(torch.maximum(-lo, hi).to(torch.float32))


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """`amax / 448`, and 1.0 for an all-zero block (never a zero scale); at least the smallest
    normal FP32, so that an FP32-subnormal amax cannot give a zero scale (x / 0: NaN codes)."""
    scale = (amax / E4M3_MAX).clamp_min(FP32_MIN_NORMAL)
    return torch.where(amax == 0, torch.ones_like(scale), scale)


def _fp8_channel(x: torch.Tensor) -> QuantResult:
    amax = _check_finite(x.abs().amax(dim=-1) if x.shape[-1] else x.new_zeros(x.shape[:-1]))
    scale = fp8_scale(amax)
    return QuantResult(encode_e4m3(x / scale.unsqueeze(-1)), scale)


def _fp8_block(x: torch.Tensor) -> QuantResult:
    *lead, n, k = x.shape
    nb, kb = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    # Zero padding affects only the amax of edge blocks; the output is cropped back.
    padded = F.pad(x, (0, kb * FP8_BLOCK - k, 0, nb * FP8_BLOCK - n))
    tiles = padded.reshape(*lead, nb, FP8_BLOCK, kb, FP8_BLOCK)
    amax = _check_finite(tiles.abs().amax(dim=(-3, -1)) if tiles.numel() else tiles.new_zeros(*lead, nb, kb))
    scale = fp8_scale(amax)
    expanded = scale.repeat_interleave(FP8_BLOCK, -2).repeat_interleave(FP8_BLOCK, -1)
    codes = encode_e4m3(x / expanded[..., :n, :k])
    return QuantResult(codes, scale)


def _groups(x: torch.Tensor, group: int) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // group, group)


def _mx(x: torch.Tensor, spec: QuantSpec) -> QuantResult:
    g = _groups(x, spec.group)
    amax = _check_finite(g.abs().amax(dim=-1) if g.numel() else g.new_zeros(g.shape[:-1]))
    # Saturate: no byte whose largest code would decode to Inf (see E8M0_MAX_FINITE_BYTE).
    byte = e8m0_byte(amax, spec.element, spec.scale_rule).clamp_max(E8M0_MAX_FINITE_BYTE[spec.element])
    scaled = (g / e8m0_to_float(byte).unsqueeze(-1)).reshape(x.shape)
    if spec.element == "e4m3":
        return QuantResult(encode_e4m3(scaled), byte)
    return QuantResult(pack_nibbles(encode_e2m1(scaled)), byte)


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """`weight_scale_2 = amax / 2688` in FP32; an all-zero tensor counts as amax 1.0.

    At least the smallest normal FP32: an amax below 2688 * 2^-126 (an all-subnormal tensor)
    would give a zero or subnormal s2, hence NaN block scales (0 / 0) or an Inf 1 / s2. At the
    top no bound is needed: e2m1 <= 6 and sb <= 448, so a decode is at most 2688 * s2, which
    stays finite for every finite amax (FP32 rounding of amax / 2688 never overshoots enough)."""
    amax = _check_finite(amax.to(torch.float32))
    amax = torch.where(amax == 0, torch.ones_like(amax), amax)
    return (amax / NVFP4_GLOBAL_DIVISOR).clamp_min(FP32_MIN_NORMAL)


def _nvfp4(x: torch.Tensor, global_amax: torch.Tensor | None) -> QuantResult:
    s2 = nvfp4_global_scale(tensor_amax(x) if global_amax is None else global_amax)
    g = _groups(x, 16)
    amax_b = _check_finite(g.abs().amax(dim=-1) if g.numel() else g.new_zeros(g.shape[:-1]))
    block = amax_b / (E2M1_MAX * s2)  # ModelOpt: 6 * s2 first, then the division
    block = torch.where(block == 0, torch.ones_like(block), block)
    sb = encode_e4m3(block.clamp(E4M3_MIN_SUBNORMAL, E4M3_MAX))
    denom = decode_e4m3(sb) * s2  # the product first, in FP32, then the division
    codes = encode_e2m1(g / denom.unsqueeze(-1)).reshape(x.shape)
    return QuantResult(pack_nibbles(codes), sb, s2)


# Rows are quantized in chunks of about this many elements: big enough to amortize torch's
# per-op overhead, small enough that the FP32 temporaries stay a few MB whatever the tensor
# (2^20 was fastest of 2^16..2^21 on a 2-core CPU, scripts/bench_convert.py). Every block lies
# inside one chunk (chunks hold whole rows, and whole 128-row bands for fp8-block), so chunking
# never changes a byte.
CHUNK_ELEMENTS = 1 << 20


def _chunked(x: torch.Tensor, band: int, fn) -> QuantResult:
    """Apply `fn` to bands of whole rows (`band` rows at a time, e.g. 128 for fp8-block) and join.

    Row-wise kinds (band 1) see `[rows, K]` with leading dims flattened; fp8-block sees one
    expert matrix at a time."""
    *lead, n, k = x.shape
    if band > 1 and lead:
        parts = [_chunked(m, band, fn) for m in x.reshape(-1, n, k)]
        if not parts:
            return fn(x)
        r = _join(parts, torch.stack)
        return QuantResult(r.codes.reshape(x.shape), r.scale.reshape(*lead, *r.scale.shape[1:]), r.global_scale)
    rows = x.reshape(-1, k) if band == 1 else x
    step = max(band, (CHUNK_ELEMENTS // max(band * k, 1)) * band)
    if rows.shape[0] <= step:
        r = fn(rows)
    else:
        r = _join([fn(rows[i:i + step]) for i in range(0, rows.shape[0], step)], torch.cat)
    if band == 1:
        scale = r.scale if r.scale.dim() == 0 else r.scale.reshape(*lead, n, *r.scale.shape[1:])
        r = QuantResult(r.codes.reshape(*lead, n, r.codes.shape[-1]), scale, r.global_scale)
    return r


def _join(parts: list[QuantResult], join) -> QuantResult:
    scales = [p.scale for p in parts]
    scale = scales[0] if scales[0].dim() == 0 else join(scales)
    return QuantResult(join([p.codes for p in parts]), scale, parts[0].global_scale)


def empty_result(x: torch.Tensor, spec: QuantSpec, global_amax: torch.Tensor | None = None) -> QuantResult:
    """A tensor with a zero-size dimension: empty codes of the right shape, and every scale (a
    row of K = 0 still has one) set as for an all-zero block. Both backends use this."""
    *lead, n, k = x.shape
    dev = x.device
    codes = torch.empty(*lead, n, k // 2 if spec.element == "e2m1" and spec.kind in (MX, NVFP4) else k,
                        dtype=torch.uint8, device=dev)
    ones = lambda *shape: torch.ones(shape, dtype=torch.float32, device=dev)  # noqa: E731
    if spec.kind == FP8_TENSOR:
        return QuantResult(codes, ones())
    if spec.kind == FP8_CHANNEL:
        return QuantResult(codes, ones(*lead, n))
    if spec.kind == FP8_BLOCK_KIND:
        return QuantResult(codes, ones(*lead, -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)))
    if spec.kind == MX:
        return QuantResult(codes, torch.zeros(*lead, n, k // spec.group, dtype=torch.uint8, device=dev))
    if spec.kind == NVFP4:
        amax = torch.zeros((), device=dev) if global_amax is None else global_amax.to(dev)
        sb = torch.full((*lead, n, k // spec.group), 0x38, dtype=torch.uint8, device=dev)  # 1.0
        return QuantResult(codes, sb, nvfp4_global_scale(amax).reshape(()))
    raise ValueError(f"unknown quantizer kind {spec.kind!r}")


def quantize(x: torch.Tensor, spec: QuantSpec, global_amax: torch.Tensor | None = None) -> QuantResult:
    """Quantize `x [..., N, K]` (any float dtype; upcast to FP32 chunk by chunk) per `spec`.

    `global_amax` (NVFP4 only) overrides the tensor's own amax, so that fused groups share one
    `weight_scale_2`."""
    if x.numel() == 0:
        return empty_result(x, spec, global_amax)
    f32 = lambda t: t.to(torch.float32)  # noqa: E731
    if spec.kind == FP8_TENSOR:
        scale = fp8_scale(tensor_amax(x))
        return _chunked(x, 1, lambda c: QuantResult(encode_e4m3(f32(c) / scale), scale))
    if spec.kind == FP8_CHANNEL:
        return _chunked(x, 1, lambda c: _fp8_channel(f32(c)))
    if spec.kind == FP8_BLOCK_KIND:
        return _chunked(x, FP8_BLOCK, lambda c: _fp8_block(f32(c)))
    if spec.kind == MX:
        return _chunked(x, 1, lambda c: _mx(f32(c), spec))
    if spec.kind == NVFP4:
        amax = tensor_amax(x) if global_amax is None else global_amax
        return _chunked(x, 1, lambda c: _nvfp4(f32(c), amax))
    raise ValueError(f"unknown quantizer kind {spec.kind!r}")


# ---------------------------------------------------------------- dequantizers


def dequantize(q: QuantResult, spec: QuantSpec, shape: tuple[int, ...]) -> torch.Tensor:
    """Decode to FP32 `[..., N, K]` = `shape`."""
    if math.prod(shape) == 0:
        return torch.zeros(shape, dtype=torch.float32, device=q.codes.device)
    if spec.kind in (FP8_TENSOR, FP8_CHANNEL, FP8_BLOCK_KIND):
        values = decode_e4m3(q.codes)
        scale = q.scale.to(torch.float32)
        if spec.kind == FP8_CHANNEL:
            scale = scale.unsqueeze(-1)
        elif spec.kind == FP8_BLOCK_KIND:
            n, k = shape[-2], shape[-1]
            scale = scale.repeat_interleave(FP8_BLOCK, -2).repeat_interleave(FP8_BLOCK, -1)
            scale = scale[..., :n, :k]
        return values * scale
    if spec.element == "e2m1":
        values = decode_e2m1(unpack_nibbles(q.codes))
    else:
        values = decode_e4m3(q.codes)
    g = _groups(values, spec.group)
    if spec.kind == MX:
        block = e8m0_to_float(q.scale)
    else:
        block = decode_e4m3(q.scale) * q.global_scale.to(torch.float32)
    return (g * block.unsqueeze(-1)).reshape(shape)
