"""A recipe's quantizer taken apart for data-aware rounding: which columns share a scale (a
*span*), how a span's scales are chosen, and how values round given scales already chosen, one
column at a time. Every piece is the recipe's own arithmetic (kernels/), so codes written from
the values GPTQ rounded are exactly the codes its loop rounded with.

Spans along K: the group geometry's 1 x group blocks (NVFP4 16, MX 32, INT4 128), the block
geometry's 128 x 128 tiles (all their 128-row bands at once), and for per-tensor and per-row
scales the whole K (one scale per tensor or row, chosen before the loop).

A span's scales are the recipe quantizer's scales of that slice of the weight (absmax, or the
scale search with its activation weights), with the NVFP4 global scale pinned to the one of the
original weights (`global_amax`: the fused group's amax, shared across q/k/v as engines need).
Given scales, a column rounds as the recipe encodes: q = element.nearest(scaled(x, d)) and
decodes to q * d, d being the scale codec's decoded scale (kernels/scales.py: what `encode`
divides by is what `decode` multiplies by, for every codec; tests/test_gptq.py checks it).
"""

from __future__ import annotations

import torch

from quantcli.kernels import quantize as kernel_quantize
from quantcli.kernels.spec import BLOCK, FP8_BLOCK, GROUP, QuantSpec


def scales_per_span(spec: QuantSpec) -> bool:
    """Whether GPTQ can choose the scales span by span as its loop goes (block and group
    geometries), which `--gptq-scales` decides; per-tensor and per-row scales are chosen once,
    from the original weights."""
    return spec.geometry in (GROUP, BLOCK)


class Spans:
    """How the scales of one weight `[N, K]` (source dtype `dtype`) are chosen, span by span:
    configuration only, so that `choose` is a pure function of the values it is given."""

    def __init__(self, spec: QuantSpec, n: int, k: int, dtype: torch.dtype, global_amax: torch.Tensor | None,
                 channel_weight: torch.Tensor | None, backend: str):
        self.spec, self.n, self.k, self.dtype = spec, n, k, dtype
        self.global_amax, self.channel_weight, self.backend = global_amax, channel_weight, backend
        self.width = {GROUP: spec.group, BLOCK: FP8_BLOCK}.get(spec.geometry, k)
        # the NVFP4 global scale is the original weights' (the fused group's), whatever GPTQ updates
        self.global_scale = None if global_amax is None else spec.scale.global_scale(global_amax)

    @property
    def chosen_per_span(self) -> bool:
        """Whether scales can be chosen as the loop reaches each span (else once, up front)."""
        return scales_per_span(self.spec)

    def choose(self, block: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored scales of the span at column `start`, chosen from its values `block`
        [N, width] (FP32), and their FP32 divisors [N, width]."""
        if self.spec.scale.dtype is None:  # scales of the weight's dtype (INT4): as its quantizer sees it
            block = block.to(self.dtype)
        weight = None if self.channel_weight is None else self.channel_weight[start:start + block.shape[-1]]
        r = kernel_quantize(block, self.spec, global_amax=self.global_amax, backend=self.backend,
                            channel_weight=weight)
        return r.scale, self.divisor(r.scale, block.shape[-1])

    def choose_all(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every span's scales chosen from `w` [N, K] (the original weights), as one stored-scale
        tensor and the divisors [N, K]."""
        chosen = [self.choose(w[:, s:s + self.width], s) for s in range(0, self.k, self.width)]
        return self.scale_tensor([s for s, _ in chosen]), torch.cat([d for _, d in chosen], dim=1)

    def divisor(self, stored: torch.Tensor, width: int) -> torch.Tensor:
        """[N, width] FP32 divisors of a span's stored scales."""
        d = self.spec.scale.decode(stored, self.global_scale)
        if self.spec.geometry == BLOCK:  # [N / 128 bands, 1] -> a row each
            d = d.repeat_interleave(FP8_BLOCK, 0)[: self.n]
        elif d.dim() == 1:  # per row
            d = d.unsqueeze(-1)
        elif d.dim() == 0:  # per tensor
            d = d.reshape(1, 1)
        return d.expand(self.n, width)

    @staticmethod
    def scale_tensor(parts: list[torch.Tensor]) -> torch.Tensor:
        """The stored scales of the whole weight from each span's, in column order, as the
        recipe's quantizer returns them."""
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def round(self, x: torch.Tensor, divisor: torch.Tensor) -> torch.Tensor:
        """The decoded values the recipe writes for `x` (FP32) given its scales' divisors."""
        spec = self.spec
        return spec.element.nearest(spec.scale.scaled(x, divisor, self.dtype)) * divisor

    def encode(self, x: torch.Tensor, divisor: torch.Tensor) -> torch.Tensor:
        """The code bytes of `x` [N, K] given its divisors [N, K] (what `round` decodes from)."""
        spec = self.spec
        return spec.element.encode(spec.scale.scaled(x, divisor, self.dtype))
