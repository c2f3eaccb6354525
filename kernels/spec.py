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

E4M3_MAX = 448.0
E2M1_MAX = 6.0
NVFP4_GLOBAL_DIVISOR = E4M3_MAX * E2M1_MAX  # 2688
E4M3_MIN_SUBNORMAL = 2.0**-9
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


class NonFiniteInput(ValueError):
    """The tensor to quantize holds NaN or Inf; callers add the tensor's name."""
