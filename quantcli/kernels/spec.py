"""What a quantizer computes, independent of how (torch reference, in-place CPU, or Triton).

A `QuantSpec` is a scheme: a geometry (which elements share a scale), an element codec (how a
scaled value becomes a code; kernels/elements.py) and a scale codec (how a block amax becomes a
stored scale; kernels/scales.py). The kernels dispatch on the geometry alone; each codec is an
object that owns its arithmetic, so a new element type (INT8, INT4) or scale type is a new codec,
not a new branch in every kernel.

Both backends take the same `QuantSpec` and return the same `QuantResult`, byte for byte.
Everything is stored as raw bytes, FP32 or the weight's dtype so that byte comparisons are trivial:

- `codes`: uint8 raw bytes. FP8 elements are the E4M3FN bit patterns, INT8 elements the two's
  complement bytes; 4-bit elements are packed two per byte along the last dim, even index low
  (E2M1 sign-magnitude nibbles; INT4 offset-binary nibbles, code + 8).
- `scale`: FP32 for the F32 codec (multiply on dequant); uint8 E8M0 bytes (bias 127); uint8
  E4M3FN bit patterns for the E4M3 block scale of the E4M3-with-FP32-global codec; values of the
  weight's dtype (BF16, FP16 or FP32) for the weight-dtype codec (INT4).
- `global_scale`: FP32 0-d multiplier (NVFP4 `weight_scale_2 = amax / 2688`), else None.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch

from quantcli.kernels.elements import E2M1, E2M1_MAX, E4M3, E4M3_MAX, ELEMENTS, FP32_MAX, INT4, INT8, ElementCodec  # noqa: F401
from quantcli.kernels.finite import NonFiniteInput, check_finite  # noqa: F401
from quantcli.kernels.scales import (  # noqa: F401
    E4M3_GLOBAL_SCALE,
    E4M3_MIN_SUBNORMAL,
    E8M0_SCALE,
    F32_SCALE,
    FP32_MIN_NORMAL,
    NVFP4_GLOBAL_DIVISOR,
    WEIGHT_DTYPE_SCALE,
    ScaleCodec,
    ScaleRule,
    e8m0_max_finite_byte,
)

FP8_BLOCK = 128  # the side of a `block` geometry tile (DeepSeek-V3 128 x 128)


class ScaleSearch(StrEnum):
    """How a block's scale is chosen (the CLI's and TOML's `scale_search`): `none` is the
    producers' absmax rule; `mse` tries the scale codec's neighbouring codes and keeps the one
    with the smallest (optionally activation-weighted) squared error of the dequantized block
    (kernels/search.py). Only searchable scale codecs on the group geometry search."""

    NONE = "none"
    MSE = "mse"

    def __repr__(self) -> str:  # messages quote it as the user typed it: 'mse'
        return repr(self.value)

    @property
    def active(self) -> bool:
        return self is not ScaleSearch.NONE


class Geometry(StrEnum):
    TENSOR = "tensor"  # one scale for the whole tensor (a 3-D expert stack shares it)
    ROW = "row"  # one scale per output row
    BLOCK = "block"  # FP8_BLOCK x FP8_BLOCK tiles
    GROUP = "group"  # 1 x group along K

    def __repr__(self) -> str:
        return repr(self.value)


TENSOR, ROW, BLOCK, GROUP = Geometry
GEOMETRIES = tuple(Geometry)
# The CLI's and TOML's vocabularies, as plain strings.
SCALE_RULES = tuple(r.value for r in ScaleRule)
SCALE_SEARCHES = tuple(s.value for s in ScaleSearch)
# Largest finite E8M0 byte per element name (kernels/scales.py e8m0_max_finite_byte).
E8M0_MAX_FINITE_BYTE = {e.name: e8m0_max_finite_byte(e) for e in (E2M1, E4M3)}


@dataclass(frozen=True)
class QuantSpec:
    geometry: Geometry
    element: ElementCodec = E4M3
    scale: ScaleCodec = F32_SCALE
    group: int = 0  # elements per scale along K for the group geometry (MX 32, NVFP4 16, INT4 128)
    scale_rule: ScaleRule | None = None  # E8M0 only: floor | even | rceil
    scale_search: ScaleSearch = ScaleSearch.NONE

    def __post_init__(self) -> None:
        if self.geometry not in GEOMETRIES:
            raise ValueError(f"unknown geometry {self.geometry!r}; choose one of {', '.join(GEOMETRIES)}")
        object.__setattr__(self, "geometry", Geometry(self.geometry))
        if (self.geometry == GROUP) != (self.group > 0):
            raise ValueError(f"a group size is given exactly for the group geometry, got {self}")
        if self.scale_rule in SCALE_RULES:
            object.__setattr__(self, "scale_rule", ScaleRule(self.scale_rule))
        if self.scale.rules and self.scale_rule not in self.scale.rules:
            raise ValueError(f"{self.scale.encoding} scale_rule must be one of {', '.join(self.scale.rules)}, "
                             f"got {self.scale_rule!r}")
        if self.scale_search not in SCALE_SEARCHES:
            raise ValueError(f"unknown scale_search {self.scale_search!r}; choose one of {', '.join(SCALE_SEARCHES)}")
        object.__setattr__(self, "scale_search", ScaleSearch(self.scale_search))
        if self.scale_search.active and not self.searchable:
            raise ValueError(f"scale_search {self.scale_search} needs the group geometry and a searchable "
                             f"scale codec; got {self}")

    @property
    def searchable(self) -> bool:
        """Whether a scale search applies: block scales with a code to choose (NVFP4, MX)."""
        return self.geometry == GROUP and self.scale.searchable

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
