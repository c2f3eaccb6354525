"""Element codecs: how a scaled FP32 value becomes a code, and back. Each codec is one object
that owns its torch encoder and decoder (the reference), its in-place CPU twin (kernels/cpu.py
calls it), its search grid (kernels/search.py) and the id of its Triton twin
(kernels/triton_codecs.py `_encode` / `_decode`, which Triton selects by that constexpr id).

Codes are uint8 bytes: E4M3FN bit patterns, INT8 two's complement bytes; 4-bit codes (E2M1,
INT4) packed two per byte along the last dim, even index in the low nibble.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0
FP32_MAX = torch.finfo(torch.float32).max
# E2M1 magnitudes by 3-bit code; bit 3 of a nibble is the sign.
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])

# scratch(name, numel, dtype): a reusable flat buffer (kernels/cpu.py's per-thread workspace).
Scratch = Callable[[str, int, torch.dtype], torch.Tensor]


# ---------------------------------------------------------------- E4M3


def encode_e4m3(v: torch.Tensor) -> torch.Tensor:
    """FP32 -> E4M3FN bytes: clamp to +-448 first (an unclamped cast gives NaN on some torch
    versions), then PyTorch's RNE cast. The sign of zero is kept."""
    return v.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def decode_e4m3(codes: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.float8_e4m3fn).to(torch.float32)


def e4m3_grid_(y: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """decode_e4m3(encode_e4m3(y)) for y >= 0, in place: saturate at 448, then round to nearest
    even at the E4M3 spacing s = max(2^-9, 2^(exponent - 3)) by adding and subtracting s * 2^23
    (their FP32 sum has ulp s); s * 2^23 is y's exponent bits times 2^20, at least 2^14."""
    y = y.clamp_max_(448.0)
    magic = torch.bitwise_and(y.view(torch.int32), 0x7F800000, out=scratch).view(torch.float32)
    magic = magic.mul_(2.0**20).clamp_min_(2.0**14)
    return y.add_(magic).sub_(magic)


# ---------------------------------------------------------------- E2M1


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


def nearest_e2m1(v: torch.Tensor) -> torch.Tensor:
    """decode_e2m1(encode_e2m1(v)) as FP32 values, without the codes: the same one FPU rounding
    (|v| + M, M = 2^22 * step from |v|'s binade, RNE), then (|v| + M) - M, exact, is |v| rounded
    to its step; saturate at 6 and take v's sign (also on a zero: -0.0 as code 0x8 decodes). Half
    the ops of encoding and decoding: GPTQ's loop rounds one column at a time with it.
    tests/test_fast_codecs.py checks it against decode(encode) bit for bit."""
    binade = (v.view(torch.int32) & 0x7F800000).clamp_(127 << 23, 130 << 23)
    magic = binade.add_(22 << 23).view(torch.float32)
    return (v.abs() + magic).sub_(magic).clamp_max_(6.0).copysign_(v)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    mag = E2M1_VALUES.to(codes.device)[(codes & 0x7).long()]
    return torch.where((codes & 0x8) != 0, -mag, mag)


def encode_e2m1_into(mag: torch.Tensor, signed: torch.Tensor, codes: torch.Tensor, scratch: Scratch) -> None:
    """encode_e2m1 + pack_nibbles into `codes`, from the scaled magnitudes `mag` and any FP32
    tensor `signed` with their signs (both overwritten; `mag` contiguous).

    The reference encodes v = x / d with d > 0, taking the magnitude from |v|'s bits and bit 3
    from v's sign; here `mag` = |x| / d, which is |v| exactly (IEEE division is sign-symmetric),
    and `signed` = x, whose sign is v's (also when v underflows to -0). The reference's
    `k -= magic; k += twice; k -= 254` is one `k += (twice - magic - 254)`: int32 arithmetic is
    modular, and no step overflows either way (|k|, magic < 2^31)."""
    n = mag.numel()
    bits = mag.view(-1).view(torch.int32)
    sign = signed.view(-1).view(torch.int32).bitwise_right_shift_(28).bitwise_and_(0x8)
    magic, offset = scratch("t", n, torch.int32), scratch("s", n, torch.int32)
    torch.bitwise_and(bits, 0x7F800000, out=magic).clamp_(127 << 23, 130 << 23)  # the binade
    torch.bitwise_right_shift(magic, 22, out=offset)  # twice
    magic.add_(22 << 23)
    offset.sub_(magic).sub_(2 * 127)
    mag.view(-1).add_(magic.view(torch.float32))  # the one FPU rounding (RNE) of the reference
    bits.add_(offset).clamp_(max=7).bitwise_or_(sign)
    pack_int32_pairs_into(bits, codes, magic)


def e2m1_grid_x2_(t: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """2 * (the search definition's E2M1 rounding of y) from t = 2 * y >= 0, in place (`scratch`:
    an int32 tensor of t's shape). Below y = 2 it is the definition's own floor(2y + 0.5), at most
    4; from y = 2 up the grid 2, 3, 4, 6 is FP32 rounded to one mantissa bit, ties up (add half of
    the dropped bits, mask them), which equals floor(y + 0.5) and 2 * floor(y / 2 + 0.5) there;
    the two parts add as low + high - 4 (in the doubled units)."""
    high = torch.add(t.view(torch.int32), 0x200000, out=scratch).bitwise_and_(-0x400000)
    high = high.view(torch.float32).clamp_(4.0, 12.0)
    return t.add_(0.5).floor_().clamp_max_(4.0).add_(high).sub_(4.0)


# ---------------------------------------------------------------- nibble packing


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


def pack_int32_pairs_into(ints: torch.Tensor, codes: torch.Tensor, scratch: torch.Tensor) -> None:
    """pack_nibbles of the flat int32 codes `ints` (each 0..15, an even count) into `codes`,
    using `scratch` (int32, at least as long). Each pair read as one little-endian int64 is
    `p = c0 | c1 << 32`: since c0 < 16, the low byte of `p | p >> 28` is `c0 | c1 << 4`, which the
    narrowing copy to uint8 keeps (a cast to an unsigned type is modulo 256)."""
    n = ints.numel()
    pairs = ints.view(torch.int64)
    packed = torch.bitwise_right_shift(pairs, 28, out=scratch.view(torch.int64)[:n // 2]).bitwise_or_(pairs)
    codes.view(-1).copy_(packed)


# ---------------------------------------------------------------- integers


def encode_int(v: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """FP32 -> integer codes as FP32: round half to even (torch.round), clamp to [lo, hi], as
    compressed-tensors' `round_to_quantized_type_args` (it clamps first; clamp and round commute
    for integer bounds)."""
    return torch.round(v).clamp(lo, hi)


# ---------------------------------------------------------------- the codecs


@dataclass(frozen=True)
class ElementCodec:
    """One element type: how many bits, the largest magnitude, how it is stored, and (in the
    subclasses) how it encodes and decodes.

    `scale_divisor` is what a block amax is divided by to give a scale (E4M3 448; INT8 127.5 and
    INT4 7.5, compressed-tensors' symmetric `amax / (bit_range / 2)`); `emax` is OCP's emax_elem
    for the E8M0 rules. `code_min`/`code_max` bound integer codes. `triton_id` selects the twin
    in triton_codecs.py (`_encode`, `_decode`, `_on_grid`)."""

    name: str  # e4m3 | e2m1 | int8 | int4
    bits: int
    max: float
    scale_divisor: float
    emax: int
    storage_dtype: torch.dtype  # how the codes tensor is stored on disk
    safetensors_dtype: str
    manifest_name: str  # the manifest's `element`
    disk_encoding: str  # the manifest's codes `encoding`
    code_min: int = 0
    code_max: int = 0
    # Largest FP32 scale whose every code decodes finitely (INT8: -128 * scale <= FP32 max), for
    # codecs where amax / scale_divisor can exceed it; None when it never can (E4M3: 448 * amax/448).
    scale_cap: float | None = None
    packing: str | None = None  # the manifest's `packing` of 4-bit codes, two per byte
    triton_id: int = 0
    # The CPU path scales |x| and takes signs from x (E2M1's encoder works on magnitudes).
    sign_magnitude: bool = False
    # The search grid works on t = grid_scale * y (E2M1: doubled, so its steps are integers).
    grid_scale: float = 1.0

    @property
    def packed(self) -> bool:
        return self.bits == 4

    def codes_cols(self, k: int) -> int:
        return k * self.bits // 8

    def encode(self, v: torch.Tensor) -> torch.Tensor:
        """Scaled FP32 values -> code bytes (4-bit codes packed two per byte along the last dim)."""
        raise NotImplementedError

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Code bytes -> FP32 element values (before any scale)."""
        raise NotImplementedError

    def nearest(self, v: torch.Tensor) -> torch.Tensor:
        """decode(encode(v)) element by element, unpacked, so any shape (one column at a time:
        GPTQ's loop rounds with exactly the codes `encode` writes)."""
        raise NotImplementedError

    def encode_into(self, scaled: torch.Tensor, signs: torch.Tensor, codes: torch.Tensor, scratch: Scratch) -> None:
        """encode(scaled) written into `codes`, in place (kernels/cpu.py): `scaled` is contiguous
        and overwritten; `signs` is x (sign-magnitude codecs take the signs from it, the others
        get `scaled` itself)."""
        raise NotImplementedError

    def saturated(self, codes: torch.Tensor) -> torch.Tensor:
        """Per element: is the code at the largest magnitude (inspect's saturation share)."""
        raise NotImplementedError

    def on_grid_(self, t: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
        """The scale search's element rounding of t = grid_scale * y >= 0, in grid_scale units,
        in place (kernels/search.py; `scratch` an int32 tensor of t's shape)."""
        raise NotImplementedError(f"{self.name} elements have no scale search grid")


class E4M3Codec(ElementCodec):
    def encode(self, v: torch.Tensor) -> torch.Tensor:
        return encode_e4m3(v)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return decode_e4m3(codes)

    def nearest(self, v: torch.Tensor) -> torch.Tensor:
        return decode_e4m3(encode_e4m3(v))

    def encode_into(self, scaled, signs, codes, scratch) -> None:
        scaled.clamp_(-E4M3_MAX, E4M3_MAX)
        codes.view(torch.float8_e4m3fn).copy_(scaled)

    def saturated(self, codes: torch.Tensor) -> torch.Tensor:
        return (codes.view(torch.uint8) & 0x7F) == 0x7E

    def on_grid_(self, t, scratch):
        return e4m3_grid_(t, scratch)


class E2M1Codec(ElementCodec):
    def encode(self, v: torch.Tensor) -> torch.Tensor:
        return pack_nibbles(encode_e2m1(v))

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return decode_e2m1(unpack_nibbles(codes))

    def nearest(self, v: torch.Tensor) -> torch.Tensor:
        return nearest_e2m1(v)

    def encode_into(self, scaled, signs, codes, scratch) -> None:
        encode_e2m1_into(scaled, signs, codes, scratch)

    def saturated(self, codes: torch.Tensor) -> torch.Tensor:
        return (unpack_nibbles(codes) & 7) == 7

    def on_grid_(self, t, scratch):
        return e2m1_grid_x2_(t, scratch)


class IntCodec(ElementCodec):
    """Symmetric integers, code_min..code_max: 8-bit codes are two's complement bytes; 4-bit
    codes are offset binary (code - code_min, 0..15) two per byte, which is compressed-tensors'
    `pack_to_int32` (+8, element 8w + i in bits 4i.. of int32 word w) read as little-endian bytes."""

    def encode(self, v: torch.Tensor) -> torch.Tensor:
        q = encode_int(v, self.code_min, self.code_max)
        if self.packed:
            return pack_nibbles(q.sub_(self.code_min).to(torch.uint8))
        return q.to(torch.int8).view(torch.uint8)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return unpack_nibbles(codes).to(torch.float32).add_(self.code_min)
        return codes.view(torch.int8).to(torch.float32)

    def nearest(self, v: torch.Tensor) -> torch.Tensor:
        return encode_int(v, self.code_min, self.code_max)

    def encode_into(self, scaled, signs, codes, scratch) -> None:
        torch.round(scaled, out=scaled).clamp_(self.code_min, self.code_max)
        if not self.packed:
            codes.view(torch.int8).copy_(scaled)
            return
        n = scaled.numel()
        ints = scratch("t", n, torch.int32)
        ints.copy_(scaled.view(-1).sub_(self.code_min))  # exact: small integers
        pack_int32_pairs_into(ints, codes, scratch("s", n, torch.int32))

    def saturated(self, codes: torch.Tensor) -> torch.Tensor:
        v = self.decode(codes)
        return (v == self.code_min) | (v == self.code_max)


E4M3 = E4M3Codec("e4m3", 8, E4M3_MAX, E4M3_MAX, 8, torch.float8_e4m3fn, "F8_E4M3", "e4m3fn", "e4m3fn",
                 triton_id=0)
E2M1 = E2M1Codec("e2m1", 4, E2M1_MAX, E2M1_MAX, 2, torch.uint8, "U8", "e2m1", "e2m1x2", packing="e2m1x2",
                 triton_id=1, sign_magnitude=True, grid_scale=2.0)
INT8 = IntCodec("int8", 8, 127.0, 127.5, 0, torch.int8, "I8", "int8", "int8", -128, 127, FP32_MAX / 128,
                triton_id=2)
# INT4: stored on disk as int32 words (compressed-tensors' `weight_packed`), eight codes each.
# Cap: the largest BF16 value whose -8 * scale stays finite in FP32 and BF16 ((2 - 2^-7) * 2^124;
# FP32_MAX / 8 itself would round up to 2^125 in BF16); only an amax above ~3.18e38 reaches it.
INT4 = IntCodec("int4", 4, 7.0, 7.5, 0, torch.int32, "I32", "int4", "int4x2_offset8", -8, 7,
                (2 - 2**-7) * 2.0**124, packing="int4x2_offset8", triton_id=3)
ELEMENTS = {c.name: c for c in (E4M3, E2M1, INT8, INT4)}
