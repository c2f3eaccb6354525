"""Pure-torch quantizers and dequantizers: the reference every Triton kernel must match bit for bit.

Numerics follow docs/formats.md, "Numerics": FP32 arithmetic, clamp before every narrowing cast, RNE for
E4M3 (PyTorch's cast) and E2M1 (ties to the even code, saturating at 6), low nibble first,
NVFP4 with ModelOpt's op order, MX scale exponents from the FP32 bit pattern per `scale_rule`.
Inputs are `[..., N, K]`; blocks always run along the last (input) dimension.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F

from quantcli.kernels.chunks import CHUNK_ELEMENTS, _chunked, cpu_workers  # noqa: F401 (search.py and callers use them here)
from quantcli.kernels.spec import (
    BLOCK,
    E4M3_MAX,
    E4M3_MIN_SUBNORMAL,
    E8M0_MAX_FINITE_BYTE,
    EMAX_ELEM,
    FP8_BLOCK,
    FP32_MIN_NORMAL,
    MAX_ELEM,
    NVFP4_GLOBAL_DIVISOR,
    ROW,
    TENSOR,
    ElementCodec,
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

    Round to nearest, ties to the even code, saturate at 6; negative values keep sign bit 0x8,
    also when they round to zero (compressed-tensors' signbit convention). NaN never reaches an
    encoder (quantizers refuse non-finite input first).

    Integer arithmetic on the FP32 bits, one rounding by the FPU: E2M1's grid has step 0.5 below
    2, 1 in [2, 4) and 2 from 4 on, so |v| + M with M = 2^22 * step (from |v|'s exponent) rounds
    |v| to its step, ties to the even multiple, which is the even code; the multiple k is the low
    bits of the sum, and the code is k + 2 * (binade of M). Fourteen cheap integer passes instead
    of a ladder of seven compares (a bool compare costs about four integer ops on the CPU) and
    adds: about 4x faster. tests/test_fast_codecs.py checks it against that ladder on every value
    near each rounding boundary; a one-off sweep of all 2^32 FP32 patterns found no difference."""
    bits = v.view(torch.int32)
    binade = (bits & 0x7F800000).clamp_(127 << 23, 130 << 23)  # |v|'s exponent field, in [1, 8]
    twice = binade >> 22  # 2 * (E2M1 binade + 127)
    magic = binade.add_(22 << 23)  # 2^22 * step: its ulp is the step
    k = ((bits & 0x7FFFFFFF).view(torch.float32) + magic.view(torch.float32)).view(torch.int32)  # RNE
    k -= magic  # the step count; at or above 8.0 it is at least 2, so the code saturates below
    k += twice
    k -= 2 * 127
    k.clamp_(max=7)
    k |= (bits >> 28) & 0x8  # the sign bit, moved to bit 3
    return k.to(torch.uint8)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    mag = E2M1_VALUES.to(codes.device)[(codes & 0x7).long()]
    return torch.where((codes & 0x8) != 0, -mag, mag)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """`byte[j] = code[2j] | code[2j+1] << 4` along the last dim (even index low).

    On a little-endian host a contiguous pair of codes read as one int16 is `c0 | c1 << 8`, so
    `(pair | pair >> 4)` holds the packed byte in its low 8 bits: one pass instead of two strided
    ones (codes are at most 15, so the shift never drags a high bit down)."""
    if sys.byteorder == "little" and codes.is_contiguous() and codes.shape[-1] % 2 == 0:
        pairs = codes.view(torch.int16)
        return (pairs | (pairs >> 4)).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    out = torch.stack((packed & 0x0F, packed >> 4), dim=-1)
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def encode_int8(v: torch.Tensor) -> torch.Tensor:
    """FP32 -> INT8 two's complement bytes: round half to even (torch.round), then clamp to
    [-128, 127], as compressed-tensors' `round_to_quantized_type_args` does (clamp and round
    commute for integer bounds)."""
    return torch.round(v).clamp(-128, 127).to(torch.int8).view(torch.uint8)


def decode_int8(codes: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.int8).to(torch.float32)


def encode_elements(v: torch.Tensor, element: ElementCodec) -> torch.Tensor:
    """Scaled FP32 values -> code bytes (4-bit codes packed two per byte along the last dim)."""
    if element.name == "e2m1":
        return pack_nibbles(encode_e2m1(v))
    return encode_int8(v) if element.name == "int8" else encode_e4m3(v)


def decode_elements(codes: torch.Tensor, element: ElementCodec) -> torch.Tensor:
    if element.name == "e2m1":
        return decode_e2m1(unpack_nibbles(codes))
    return decode_int8(codes) if element.name == "int8" else decode_e4m3(codes)


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
    """amax propagates NaN and Inf, so a finite amax proves its whole block finite, and the max
    of the block amaxes (NaN propagates through max too) proves every block: one small reduction
    and a Python float, instead of an isfinite pass and an all() over the block amaxes."""
    if amax.numel() and not math.isfinite(float(amax.max())):
        raise NonFiniteInput()
    return amax


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """Max |x| as an FP32 0-d tensor (0 for an empty tensor). One aminmax pass in the source
    dtype: a max is exact in any float format, and NaN/Inf propagate into it."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    lo, hi = torch.aminmax(x)
    return _check_finite(torch.maximum(-lo, hi).to(torch.float32))




# ---------------------------------------------------------------- scale codecs


def f32_scale(amax: torch.Tensor, divisor: float, cap: float | None = None) -> torch.Tensor:
    """`amax / divisor`, and 1.0 for an all-zero block (never a zero scale); at least the
    smallest normal FP32, so that an FP32-subnormal amax cannot give a zero scale (x / 0: NaN
    codes). At the top E4M3's 448 * (amax / 448) stays finite; INT8's -128 * (amax / 127.5)
    does not for amax above ~3.39e38 (bf16 max included), so its scale is capped at
    FP32_MAX / 128 (`cap`) and such a row saturates like an MX block."""
    scale = (amax / divisor).clamp_min(FP32_MIN_NORMAL)
    if cap is not None:
        scale = scale.clamp_max(cap)
    return torch.where(amax == 0, torch.ones_like(scale), scale)


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """The F32 scale of an E4M3 block: `amax / 448` (see f32_scale)."""
    return f32_scale(amax, E4M3_MAX)


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """`weight_scale_2 = amax / 2688` in FP32; an all-zero tensor counts as amax 1.0.

    At least the smallest normal FP32: an amax below 2688 * 2^-126 (an all-subnormal tensor)
    would give a zero or subnormal s2, hence NaN block scales (0 / 0) or an Inf 1 / s2. At the
    top no bound is needed: e2m1 <= 6 and sb <= 448, so a decode is at most 2688 * s2, which
    stays finite for every finite amax (FP32 rounding of amax / 2688 never overshoots enough)."""
    amax = _check_finite(amax.to(torch.float32))
    amax = torch.where(amax == 0, torch.ones_like(amax), amax)
    return (amax / NVFP4_GLOBAL_DIVISOR).clamp_min(FP32_MIN_NORMAL)


def encode_scale(amax: torch.Tensor, spec: QuantSpec, s2: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Block amax -> (the stored scale, the FP32 divisor the elements are scaled by)."""
    encoding = spec.scale.encoding
    if encoding == "f32":
        scale = f32_scale(amax, spec.element.scale_divisor, spec.element.scale_cap)
        return scale, scale
    if encoding == "e8m0_bias127":
        # Saturate: no byte whose largest code would decode to Inf (see E8M0_MAX_FINITE_BYTE).
        name = spec.element.name
        byte = e8m0_byte(amax, name, spec.scale_rule).clamp_max(E8M0_MAX_FINITE_BYTE[name])
        return byte, e8m0_to_float(byte)
    block = amax / (spec.element.max * s2)  # ModelOpt: 6 * s2 first, then the division
    block = torch.where(block == 0, torch.ones_like(block), block)
    sb = encode_e4m3(block.clamp(E4M3_MIN_SUBNORMAL, E4M3_MAX))
    return sb, decode_e4m3(sb) * s2  # the product first, in FP32, then the division


def decode_scale(scale: torch.Tensor, global_scale: torch.Tensor | None, spec: QuantSpec) -> torch.Tensor:
    encoding = spec.scale.encoding
    if encoding == "f32":
        return scale.to(torch.float32)
    if encoding == "e8m0_bias127":
        return e8m0_to_float(scale)
    return decode_e4m3(scale) * global_scale.to(torch.float32)


# ---------------------------------------------------------------- one chunk, per geometry


def _amax_last(x: torch.Tensor) -> torch.Tensor:
    return _check_finite(x.abs().amax(dim=-1) if x.shape[-1] else x.new_zeros(x.shape[:-1]))


def _groups(x: torch.Tensor, group: int) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // group, group)


def _tensor_chunk(x: torch.Tensor, spec: QuantSpec, amax: torch.Tensor, s2) -> QuantResult:
    stored, denom = encode_scale(amax, spec, s2)
    return QuantResult(encode_elements(x / denom, spec.element), stored)


def _row_chunk(x: torch.Tensor, spec: QuantSpec, s2) -> QuantResult:
    stored, denom = encode_scale(_amax_last(x), spec, s2)
    return QuantResult(encode_elements(x / denom.unsqueeze(-1), spec.element), stored)


def _group_amax(x: torch.Tensor, group: int) -> torch.Tensor:
    """Max |x| of each 1 x `group` block of rows `[R, K]`: a max-pool with kernel = stride =
    group is one vectorized pass where `amax(-1)` over a 16-wide last dim is several times slower;
    both are exact and both propagate NaN (checked by tests/test_fast_codecs.py)."""
    if x.dim() == 2 and x.shape[-1]:
        return _check_finite(F.max_pool1d(x.abs().unsqueeze(1), group).squeeze(1))
    return _amax_last(_groups(x, group))


def _group_chunk(x: torch.Tensor, spec: QuantSpec, s2) -> QuantResult:
    g = _groups(x, spec.group)
    stored, denom = encode_scale(_group_amax(x, spec.group), spec, s2)
    return QuantResult(encode_elements((g / denom.unsqueeze(-1)).reshape(x.shape), spec.element), stored)


def _block_chunk(x: torch.Tensor, spec: QuantSpec, s2) -> QuantResult:
    *lead, n, k = x.shape
    nb, kb = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    # Zero padding affects only the amax of edge blocks; the output is cropped back.
    padded = F.pad(x, (0, kb * FP8_BLOCK - k, 0, nb * FP8_BLOCK - n))
    tiles = padded.reshape(*lead, nb, FP8_BLOCK, kb, FP8_BLOCK)
    amax = _check_finite(tiles.abs().amax(dim=(-3, -1)) if tiles.numel() else tiles.new_zeros(*lead, nb, kb))
    stored, denom = encode_scale(amax, spec, s2)
    expanded = _expand_blocks(denom, n, k)
    return QuantResult(encode_elements(x / expanded, spec.element), stored)


def _expand_blocks(scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    return scale.repeat_interleave(FP8_BLOCK, -2).repeat_interleave(FP8_BLOCK, -1)[..., :n, :k]


# ---------------------------------------------------------------- entry points


def global_scale_for(x: torch.Tensor, spec: QuantSpec, global_amax: torch.Tensor | None) -> torch.Tensor | None:
    """The FP32 global scale of a two-level scale codec (NVFP4), from the fused group's amax when
    given, else the tensor's own; None for single-level codecs."""
    if not spec.scale.has_global:
        return None
    return nvfp4_global_scale(tensor_amax(x) if global_amax is None else global_amax)


def empty_result(x: torch.Tensor, spec: QuantSpec, global_amax: torch.Tensor | None = None) -> QuantResult:
    """A tensor with a zero-size dimension: empty codes of the right shape, and every scale (a
    row of K = 0 still has one) set as for an all-zero block. Both backends use this."""
    dev = x.device
    codes = torch.empty(spec.codes_shape(tuple(x.shape)), dtype=torch.uint8, device=dev)
    zero = torch.zeros(spec.scale_shape(tuple(x.shape)), dtype=torch.float32, device=dev)
    s2 = None
    if spec.scale.has_global:
        amax = torch.zeros((), device=dev) if global_amax is None else global_amax.to(dev)
        s2 = nvfp4_global_scale(amax).reshape(())
    return QuantResult(codes, encode_scale(zero, spec, s2)[0], s2)


def quantize(x: torch.Tensor, spec: QuantSpec, global_amax: torch.Tensor | None = None) -> QuantResult:
    """Quantize `x [..., N, K]` (any float dtype; upcast to FP32 chunk by chunk) per `spec`.

    `global_amax` (two-level scales only) overrides the tensor's own amax, so that fused groups
    share one `weight_scale_2`."""
    if x.numel() == 0:
        return empty_result(x, spec, global_amax)
    s2 = global_scale_for(x, spec, global_amax)
    f32 = lambda t: t.to(torch.float32)  # noqa: E731
    if spec.geometry == TENSOR:
        amax = tensor_amax(x)
        r = _chunked(x, 1, lambda c: _tensor_chunk(f32(c), spec, amax, s2))
    elif spec.geometry == BLOCK:
        r = _chunked(x, FP8_BLOCK, lambda c: _block_chunk(f32(c), spec, s2))
    else:
        chunk = _row_chunk if spec.geometry == ROW else _group_chunk
        r = _chunked(x, 1, lambda c: chunk(f32(c), spec, s2))
    return QuantResult(r.codes, r.scale, s2)


def dequantize(q: QuantResult, spec: QuantSpec, shape: tuple[int, ...]) -> torch.Tensor:
    """Decode to FP32 `[..., N, K]` = `shape`."""
    if math.prod(shape) == 0:
        return torch.zeros(shape, dtype=torch.float32, device=q.codes.device)
    values = decode_elements(q.codes, spec.element)
    scale = decode_scale(q.scale, q.global_scale, spec)
    if spec.geometry == TENSOR:
        return values * scale
    if spec.geometry == ROW:
        return values * scale.unsqueeze(-1)
    if spec.geometry == BLOCK:
        return values * _expand_blocks(scale, shape[-2], shape[-1])
    return (_groups(values, spec.group) * scale.unsqueeze(-1)).reshape(shape)
