"""What a quantizer computes, independent of how (torch reference or Triton kernel).

A `QuantSpec` is a scheme: a geometry (which elements share a scale), an element codec (how a
scaled value becomes a code) and a scale codec (how a block amax becomes a stored scale). The
kernels dispatch on the geometry alone; element and scale codecs are parameters, so a new
element type (INT8) or scale type is a new codec, not a new branch in every kernel.

Both backends take the same `QuantSpec` and return the same `QuantResult`, byte for byte.
Everything is stored as raw bytes or FP32 so that byte comparisons are trivial:

- `codes`: uint8 raw bytes. FP8 elements are the E4M3FN bit patterns, INT8 elements the two's
  complement bytes; FP4 elements are packed two per byte along the last dim, even index low.
- `scale`: FP32 for the F32 codec (multiply on dequant); uint8 E8M0 bytes (bias 127); uint8
  E4M3FN bit patterns for the E4M3 block scale of the E4M3-with-FP32-global codec.
- `global_scale`: FP32 0-d multiplier (NVFP4 `weight_scale_2 = amax / 2688`), else None.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantcli.errors import RecipeError

E4M3_MAX = 448.0
E2M1_MAX = 6.0
NVFP4_GLOBAL_DIVISOR = E4M3_MAX * E2M1_MAX  # 2688
E4M3_MIN_SUBNORMAL = 2.0**-9
# Smallest normal FP32. FP32 scales and the NVFP4 global scale never go below it: a tensor whose
# amax is FP32-subnormal would otherwise get a zero scale (0/0 = NaN codes) or a subnormal one
# whose reciprocal (compressed-tensors' `weight_global_scale`) is Inf. Real weights never reach it.
FP32_MIN_NORMAL = 2.0**-126
FP8_BLOCK = 128  # the side of a `block` geometry tile (DeepSeek-V3 128 x 128)

SCALE_RULES = ("floor", "even", "rceil")
# How a block's scale is chosen: `none` is the producers' absmax rule; `mse` tries neighbouring
# scale codes and keeps the one with the smallest (optionally activation-weighted) squared error
# of the dequantized block (kernels/search.py). Only the group geometry (NVFP4, MX) searches.
SCALE_SEARCHES = ("none", "mse")


# ---------------------------------------------------------------- element codecs


@dataclass(frozen=True)
class ElementCodec:
    """One element type: how many bits, the largest magnitude, and how it is stored.

    `scale_divisor` is what a block amax is divided by to give an FP32 scale (E4M3 448; INT8
    127.5, compressed-tensors' symmetric `amax / (bit_range / 2)`); `emax` is OCP's emax_elem
    for the E8M0 rules. `code_min`/`code_max` bound integer codes (INT8 only)."""

    name: str  # e4m3 | e2m1 | int8
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

    @property
    def packed(self) -> bool:
        return self.bits == 4

    @property
    def packing(self) -> str | None:
        return "e2m1x2" if self.packed else None

    def codes_cols(self, k: int) -> int:
        return k * self.bits // 8


E4M3 = ElementCodec("e4m3", 8, E4M3_MAX, E4M3_MAX, 8, torch.float8_e4m3fn, "F8_E4M3", "e4m3fn", "e4m3fn")
E2M1 = ElementCodec("e2m1", 4, E2M1_MAX, E2M1_MAX, 2, torch.uint8, "U8", "e2m1", "e2m1x2")
FP32_MAX = torch.finfo(torch.float32).max
INT8 = ElementCodec("int8", 8, 127.0, 127.5, 0, torch.int8, "I8", "int8", "int8", -128, 127, FP32_MAX / 128)

# Largest power-of-two exponent of the element format (OCP emax_elem): E2M1 2, E4M3 8.
EMAX_ELEM = {"e2m1": E2M1.emax, "e4m3": E4M3.emax}
MAX_ELEM = {"e2m1": E2M1_MAX, "e4m3": E4M3_MAX}
# Largest E8M0 byte whose every code decodes finitely: max_elem * 2^(byte - 127) < 2^128 needs
# byte <= 254 - emax_elem (E2M1 6 * 2^125 = 2.6e38, E4M3 448 * 2^119 = 3.0e38; one more and
# 6 * 2^126 or 448 * 2^120 is Inf). The `even` and `rceil` rules ask for more only when the block
# amax is above that, and then the block saturates, as `floor` saturates every block up to 8 / 6.
E8M0_MAX_FINITE_BYTE = {e: 254 - emax for e, emax in EMAX_ELEM.items()}


# ---------------------------------------------------------------- scale codecs


@dataclass(frozen=True)
class ScaleCodec:
    """How a block scale is stored: its encoding (the manifest's name), bytes per scale, the
    safetensors dtype, the value a scale takes for an all-zero block, and whether a second FP32
    global scale multiplies it."""

    encoding: str  # f32 | e8m0_bias127 | e4m3fn
    nbytes: int
    safetensors_dtype: str
    zero_block_policy: str
    has_global: bool = False
    rules: tuple[str, ...] = ()  # E8M0: the exponent rules a recipe may choose from

    @property
    def raw_dtype(self) -> torch.dtype:
        """The dtype of `QuantResult.scale`: FP32 values or uint8 bit patterns."""
        return torch.float32 if self.encoding == "f32" else torch.uint8

    @property
    def disk_dtype(self) -> torch.dtype:
        return {"f32": torch.float32, "e8m0_bias127": torch.uint8, "e4m3fn": torch.float8_e4m3fn}[self.encoding]


F32_SCALE = ScaleCodec("f32", 4, "F32", "scale 1.0")
E8M0_SCALE = ScaleCodec("e8m0_bias127", 1, "U8", "byte 0", rules=SCALE_RULES)
E4M3_GLOBAL_SCALE = ScaleCodec("e4m3fn", 1, "F8_E4M3", "block scale 1.0 (0x38)", has_global=True)


# ---------------------------------------------------------------- geometry

TENSOR, ROW, BLOCK, GROUP = "tensor", "row", "block", "group"
GEOMETRIES = (TENSOR, ROW, BLOCK, GROUP)


@dataclass(frozen=True)
class QuantSpec:
    geometry: str  # tensor | row | block (FP8_BLOCK x FP8_BLOCK) | group (1 x group along K)
    element: ElementCodec = E4M3
    scale: ScaleCodec = F32_SCALE
    group: int = 0  # elements per scale along K for the group geometry (MX 32, NVFP4 16)
    scale_rule: str | None = None  # E8M0 only: floor | even | rceil
    scale_search: str = "none"  # none | mse (group geometry only)

    def __post_init__(self) -> None:
        if self.geometry not in GEOMETRIES:
            raise ValueError(f"unknown geometry {self.geometry!r}; choose one of {GEOMETRIES}")
        if (self.geometry == GROUP) != (self.group > 0):
            raise ValueError(f"a group size is given exactly for the group geometry, got {self}")
        if self.scale.rules and self.scale_rule not in self.scale.rules:
            raise ValueError(f"{self.scale.encoding} scale_rule must be one of {self.scale.rules}, "
                             f"got {self.scale_rule!r}")
        if self.scale_search not in SCALE_SEARCHES or (self.scale_search != "none" and self.geometry != GROUP):
            raise ValueError(f"scale_search {self.scale_search!r} needs the group geometry; got {self}")

    @property
    def block(self) -> tuple[int, int]:
        """(rows, cols) of W per scale; 0 means "the whole dimension"."""
        return {TENSOR: (0, 0), ROW: (1, 0), BLOCK: (FP8_BLOCK, FP8_BLOCK), GROUP: (1, self.group)}[self.geometry]

    @property
    def k_multiple(self) -> int:
        """K must be a multiple of this: whole groups only."""
        return self.group if self.geometry == GROUP else 1

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        *lead, n, k = shape
        if self.geometry == TENSOR:
            return ()
        if self.geometry == ROW:
            return (*lead, n)
        if self.geometry == BLOCK:
            return (*lead, -(-n // FP8_BLOCK), -(-k // FP8_BLOCK))
        return (*lead, n, -(-k // self.group))

    def codes_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (*shape[:-1], self.element.codes_cols(shape[-1]))


@dataclass(frozen=True)
class QuantResult:
    codes: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor | None = None


class NonFiniteInput(RecipeError, ValueError):
    """The tensor to quantize holds NaN or Inf. The kernels raise it unnamed (they do not know
    the name), as the bare fact "holds NaN or Inf values" that a caller may put in its own
    sentence; `NonFiniteInput(name)` is the whole one-line error naming the tensor and the fix.
    Unnamed it still exits 2 with one line (a RecipeError)."""

    def __init__(self, name: str | None = None) -> None:
        self.name = name
        fact = "holds NaN or Inf values"
        super().__init__(fact if name is None else
                         f"{name}: {fact}; quantizing would corrupt it. Fix the source weight or add it to --ignore")
