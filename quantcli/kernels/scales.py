"""Scale codecs: how a block amax becomes a stored scale and the FP32 divisor its elements are
scaled by, and back. Each codec is one object that owns its torch encoder and decoder (the
reference; kernels/cpu.py calls the same), its scale-search window, and the id of its Triton
twin (kernels/triton_codecs.py `_encode_scale` / `_decode_scale`, selected by that constexpr).

Stored scales (`QuantResult.scale`): FP32 values (F32, multiply on dequant); uint8 E8M0 bytes
(bias 127); uint8 E4M3FN bit patterns times an FP32 global (NVFP4); values of the weight's own
dtype (INT4, compressed-tensors' W4A16 `weight_scale`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch

from quantcli.kernels.elements import E4M3_MAX, ELEMENTS, ElementCodec, decode_e4m3, encode_e4m3
from quantcli.kernels.finite import check_finite

E4M3_MIN_SUBNORMAL = 2.0**-9
NVFP4_GLOBAL_DIVISOR = E4M3_MAX * 6.0  # 2688 = E4M3 max x E2M1 max
# Smallest normal FP32. FP32 scales and the NVFP4 global scale never go below it: a tensor whose
# amax is FP32-subnormal would otherwise get a zero scale (0/0 = NaN codes) or a subnormal one
# whose reciprocal (compressed-tensors' `weight_global_scale`) is Inf. Real weights never reach it.
FP32_MIN_NORMAL = 2.0**-126


# ---------------------------------------------------------------- E8M0 exponent rules


class ScaleRule(StrEnum):
    """How an E8M0 exponent is chosen from a block amax (the CLI's and TOML's `scale_rule`):

    floor: floor(log2 amax) - emax_elem            (OCP MX v1.0)
    even:  floor(log2 R(amax)) - emax_elem, R rounds the FP32 mantissa at the FP4 mantissa width
           (adds 1 << 21 to the bits), as compressed-tensors does for MXFP4 and MXFP8 alike
    rceil: ceil(log2(amax / max_elem))              (ModelOpt, triton_kernels, gpt-oss)"""

    FLOOR = "floor"
    EVEN = "even"
    RCEIL = "rceil"

    def __repr__(self) -> str:  # messages quote it as the user typed it: 'floor'
        return repr(self.value)

    @property
    def triton_id(self) -> int:
        return list(ScaleRule).index(self)

    def biased_exponent(self, amax: torch.Tensor, element: ElementCodec) -> torch.Tensor:
        """e + 127 as int32, before any clamp."""
        return _BIASED[self](amax.to(torch.float32), element)


_BIASED = {
    ScaleRule.FLOOR: lambda a, el: (a.view(torch.int32) >> 23) - el.emax,
    ScaleRule.EVEN: lambda a, el: ((a.view(torch.int32) + (1 << 21)) >> 23) - el.emax,
    ScaleRule.RCEIL: lambda a, el: ((a / el.max).view(torch.int32) + 0x7FFFFF) >> 23,
}


def e8m0_byte(amax: torch.Tensor, element: ElementCodec | str, rule: ScaleRule | str) -> torch.Tensor:
    """Shared-exponent byte (= e + 127, clamped to [0, 254]) from a block amax, FP32 bit math,
    per ScaleRule. An all-zero block gives byte 0 under every rule; 255 (NaN) is never produced."""
    codec = ELEMENTS[element] if isinstance(element, str) else element
    return ScaleRule(rule).biased_exponent(amax, codec).clamp(0, 254).to(torch.uint8)


def e8m0_max_finite_byte(element: ElementCodec) -> int:
    """Largest E8M0 byte whose every code decodes finitely: max_elem * 2^(byte - 127) < 2^128
    needs byte <= 254 - emax_elem (E2M1 6 * 2^125 = 2.6e38, E4M3 448 * 2^119 = 3.0e38; one more
    and 6 * 2^126 or 448 * 2^120 is Inf). The `even` and `rceil` rules ask for more only when the
    block amax is above that, and then the block saturates, as `floor` saturates every block up
    to 8 / 6."""
    return 254 - element.emax


def e8m0_to_float(byte: torch.Tensor) -> torch.Tensor:
    """2^(byte - 127) exactly in FP32; byte 0 is the FP32 subnormal 2^-127."""
    b = byte.to(torch.int32)
    bits = torch.where(b == 0, torch.full_like(b, 0x00400000), b << 23)
    return bits.view(torch.float32)


# ---------------------------------------------------------------- FP32 scales


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
    amax = check_finite(amax.to(torch.float32))
    amax = torch.where(amax == 0, torch.ones_like(amax), amax)
    return (amax / NVFP4_GLOBAL_DIVISOR).clamp_min(FP32_MIN_NORMAL)


def round_to_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP32 `t` rounded (RNE) to `dtype` and back: exactly what torch's BF16/FP16 arithmetic
    does to an FP32 result (CPU and GPU compute those ops in FP32 and round once)."""
    return t if dtype == torch.float32 else t.to(dtype).to(torch.float32)


# ---------------------------------------------------------------- the codecs


@dataclass(frozen=True)
class ScaleCodec:
    """How a block scale is stored: its encoding (the manifest's name), bytes per scale, the
    safetensors dtype, the value a scale takes for an all-zero block, and whether a second FP32
    global scale multiplies it; the subclasses own the arithmetic.

    The search fields are the candidate codes the scale search (kernels/search.py) tries after
    the absmax one, in order, and those it evaluates only where they might win; a codec without
    a window does not search."""

    encoding: str  # f32 | e8m0_bias127 | e4m3fn | weight_dtype
    nbytes: int
    safetensors_dtype: str
    zero_block_policy: str
    has_global: bool = False
    rules: tuple[ScaleRule, ...] = ()  # E8M0: the exponent rules a recipe may choose from
    triton_id: int = 0
    dtype: torch.dtype | None = torch.float32  # of QuantResult.scale; None: the weight's dtype
    disk_view: torch.dtype | None = None  # how 1-byte scales are viewed on disk, when not as `dtype`
    power_of_two: bool = False  # inspect reports an exponent histogram instead of min / max
    search_window: tuple[int, ...] = ()
    search_pruned: tuple[int, ...] = ()

    @property
    def searchable(self) -> bool:
        return bool(self.search_window)

    def raw_dtype_for(self, source: torch.dtype) -> torch.dtype:
        """The dtype of `QuantResult.scale` for a weight of dtype `source`."""
        return source if self.dtype is None else self.dtype

    @property
    def raw_dtype(self) -> torch.dtype:
        """The dtype of `QuantResult.scale`: FP32 values or uint8 bit patterns."""
        if self.dtype is None:
            raise ValueError(f"{self.encoding} scales take the weight's dtype: use raw_dtype_for(weight dtype)")
        return self.dtype

    @property
    def disk_dtype(self) -> torch.dtype:
        """How 1-byte scales are viewed on disk (E8M0 as U8, E4M3 as F8_E4M3)."""
        return self.disk_view or self.raw_dtype

    def encode(self, amax: torch.Tensor, element: ElementCodec, rule: ScaleRule | None, s2: torch.Tensor | None,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Block amax (FP32) -> (the stored scale, the FP32 divisor the elements are scaled by).
        `dtype` is the weight's; `s2` the FP32 global scale of two-level codecs."""
        raise NotImplementedError

    def values(self, raw: torch.Tensor) -> torch.Tensor:
        """Stored scales -> their FP32 values (before any global scale)."""
        return raw.to(torch.float32)

    def decode(self, raw: torch.Tensor, global_scale: torch.Tensor | None) -> torch.Tensor:
        """Stored scales -> the FP32 multipliers of the decoded elements."""
        return self.values(raw)

    def scaled(self, x: torch.Tensor, denom: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The FP32 values the element codec encodes: x / denom (one IEEE division)."""
        return x / denom

    def round_quotient_(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """In place, what `scaled` does after its division (kernels/cpu.py divides in place)."""
        return t

    def global_scale(self, amax: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{self.encoding} scales have no global scale")

    def describe_rule(self, element: ElementCodec, rule: ScaleRule | None) -> str:
        """The manifest's `scale_rule`."""
        return f"amax/{element.scale_divisor:g}"

    def code_range(self, element: ElementCodec) -> tuple[int, int]:
        """The scale codes a search candidate may take."""
        raise NotImplementedError(f"{self.encoding} scales are not searched")

    def decode_code(self, code: torch.Tensor, s2: torch.Tensor | None) -> torch.Tensor:
        """The FP32 divisor of an int32 scale code, the value `encode` forms for it."""
        raise NotImplementedError(f"{self.encoding} scales are not searched")


class F32Scale(ScaleCodec):
    def encode(self, amax, element, rule, s2, dtype):
        scale = f32_scale(amax, element.scale_divisor, element.scale_cap)
        return scale, scale


class E8M0Scale(ScaleCodec):
    def encode(self, amax, element, rule, s2, dtype):
        # Saturate: no byte whose largest code would decode to Inf (see e8m0_max_finite_byte).
        byte = e8m0_byte(amax, element, rule).clamp_max(e8m0_max_finite_byte(element))
        return byte, e8m0_to_float(byte)

    def values(self, raw):
        return e8m0_to_float(raw.view(torch.uint8))

    def describe_rule(self, element, rule):
        return str(rule)

    def code_range(self, element):
        return 0, e8m0_max_finite_byte(element)

    def decode_code(self, code, s2):
        return e8m0_to_float(code)


class E4M3GlobalScale(ScaleCodec):
    """NVFP4: an E4M3 block scale times the tensor's FP32 global scale s2 (ModelOpt's order)."""

    def encode(self, amax, element, rule, s2, dtype):
        block = amax / (element.max * s2)  # ModelOpt: 6 * s2 first, then the division
        block = torch.where(block == 0, torch.ones_like(block), block)
        sb = encode_e4m3(block.clamp(E4M3_MIN_SUBNORMAL, E4M3_MAX))
        return sb, decode_e4m3(sb) * s2  # the product first, in FP32, then the division

    def values(self, raw):
        return decode_e4m3(raw)

    def decode(self, raw, global_scale):
        return decode_e4m3(raw) * global_scale.to(torch.float32)

    def global_scale(self, amax):
        return nvfp4_global_scale(amax)

    def describe_rule(self, element, rule):
        return f"amax/{NVFP4_GLOBAL_DIVISOR:g}"

    def code_range(self, element):
        return 1, 0x7E  # 2^-9 .. 448; code 0 would be a zero scale, 0x7F is NaN

    def decode_code(self, code, s2):
        """By bits: code << 20 is an FP32 with the code's exponent and mantissa fields (a
        subnormal for exponent 0), and 2^120 rebiases it exactly (decode_e4m3 casts, several
        times slower)."""
        raw = (code << 20).view(torch.float32)
        rebias = float(s2) * 2.0**120  # exact (a power of two times an FP32) unless it overflows
        if rebias < 2.0**127:
            return raw.mul_(rebias)  # one rounding of the same real product as decode_e4m3 * s2
        return raw.mul_(2.0**120).mul_(s2)


class WeightDtypeScale(ScaleCodec):
    """A scale of the weight's own dtype, with compressed-tensors' eager arithmetic (W4A16):
    `calculate_qparams` divides the amax in that dtype (torch: in FP32, one rounding to BF16 or
    FP16), a zero scale becomes that dtype's eps, and `_quantize` divides x by the stored scale
    in that dtype too, so the quotient is rounded to it before the element rounds."""

    def encode(self, amax, element, rule, s2, dtype):
        scale = amax / element.scale_divisor
        if element.scale_cap is not None:
            scale = scale.clamp_max(element.scale_cap)
        stored = scale.to(dtype)
        stored = torch.where(stored == 0, torch.full_like(stored, torch.finfo(dtype).eps), stored)
        return stored, stored.to(torch.float32)

    def scaled(self, x, denom, dtype):
        return round_to_dtype(x / denom, dtype)

    def round_quotient_(self, t, dtype):
        return t if dtype == torch.float32 else t.copy_(t.to(dtype))


F32_SCALE = F32Scale("f32", 4, "F32", "scale 1.0", triton_id=0)
E8M0_SCALE = E8M0Scale("e8m0_bias127", 1, "U8", "byte 0", rules=tuple(ScaleRule), triton_id=1, dtype=torch.uint8,
                       power_of_two=True, search_window=(1, -1), search_pruned=(-1,))
# The NVFP4 window: the absmax code, then codes -3..-1 and +1..+7 around it (E4M3 codes of
# positive values are monotone, so code + d is the d-th neighbouring scale).
E4M3_GLOBAL_SCALE = E4M3GlobalScale("e4m3fn", 1, "F8_E4M3", "block scale 1.0 (0x38)", has_global=True, triton_id=2,
                                    dtype=torch.uint8, disk_view=torch.float8_e4m3fn,
                                    search_window=(-3, -2, -1, 1, 2, 3, 4, 5, 6, 7))
# nbytes: BF16 / FP16, the dtypes W4A16 checkpoints are made from (FP32 weights give 4).
WEIGHT_DTYPE_SCALE = WeightDtypeScale("weight_dtype", 2, "weight dtype", "scale eps of the weight dtype", triton_id=3,
                                      dtype=None)
