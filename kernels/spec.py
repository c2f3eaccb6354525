"""What a quantizer computes, independent of how (torch reference or Triton kernel).

Both backends take the same `QuantSpec` and return the same `QuantResult`, byte for byte.
Everything is stored as raw bytes or FP32 so that byte comparisons are trivial:

- `codes`: uint8. FP8 elements are the E4M3FN bit patterns (view them as float8_e4m3fn);
  FP4 elements are packed two per byte along the last dim, even index in the low nibble.
- `scale`: FP32 for the fp8 family (multiply on dequant); uint8 E8M0 bytes (bias 127) for MX;
  uint8 E4M3FN bit patterns for NVFP4 block scales.
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
# Smallest normal FP32. FP8 scales and the NVFP4 global scale never go below it: a tensor whose
# amax is FP32-subnormal would otherwise get a zero scale (0/0 = NaN codes) or a subnormal one
# whose reciprocal (compressed-tensors' `weight_global_scale`) is Inf. Real weights never reach it.
FP32_MIN_NORMAL = 2.0**-126
FP8_BLOCK = 128

# Quantizer kinds. A recipe maps onto exactly one kind plus its parameters.
FP8_TENSOR = "fp8_tensor"
FP8_CHANNEL = "fp8_channel"
FP8_BLOCK_KIND = "fp8_block"
MX = "mx"
NVFP4 = "nvfp4"

SCALE_RULES = ("floor", "even", "rceil")
# Largest power-of-two exponent of the element format (OCP emax_elem): E2M1 2, E4M3 8.
EMAX_ELEM = {"e2m1": 2, "e4m3": 8}
MAX_ELEM = {"e2m1": E2M1_MAX, "e4m3": E4M3_MAX}
# Largest E8M0 byte whose every code decodes finitely: max_elem * 2^(byte - 127) < 2^128 needs
# byte <= 254 - emax_elem (E2M1 6 * 2^125 = 2.6e38, E4M3 448 * 2^119 = 3.0e38; one more and
# 6 * 2^126 or 448 * 2^120 is Inf). The `even` and `rceil` rules ask for more only when the block
# amax is above that, and then the block saturates, as `floor` saturates every block up to 8 / 6.
E8M0_MAX_FINITE_BYTE = {e: 254 - emax for e, emax in EMAX_ELEM.items()}


@dataclass(frozen=True)
class QuantSpec:
    kind: str
    element: str = "e4m3"  # "e4m3" or "e2m1"
    group: int = 0  # elements per scale along K (MX 32, NVFP4 16); 0 when not grouped
    scale_rule: str | None = None  # MX only: floor | even | rceil

    def __post_init__(self) -> None:
        if self.kind == MX and self.scale_rule not in SCALE_RULES:
            raise ValueError(f"MX scale_rule must be one of {SCALE_RULES}, got {self.scale_rule!r}")


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
