"""The Recipe type: what a quantization recipe computes, independent of on-disk names."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from quantcli.errors import RecipeError
from quantcli.facts import NO_FACTS, ModuleFacts
from quantcli.kernels import NonFiniteInput, QuantResult, QuantSpec
from quantcli.kernels import dequantize as kernel_dequantize
from quantcli.kernels import quantize as kernel_quantize

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class QuantizedTensor:
    """A quantized weight in quantcli's canonical form (see kernels/spec.py for the encodings).

    `shape` is the logical `[..., N, K]` shape; codes and scales are linear, row-major."""

    recipe: str
    shape: tuple[int, ...]
    codes: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor | None = None
    scale_rule: str | None = None

    @property
    def result(self) -> QuantResult:
        return QuantResult(self.codes, self.scale, self.global_scale)

    def to(self, device: torch.device | str) -> "QuantizedTensor":
        g = None if self.global_scale is None else self.global_scale.to(device)
        return replace(self, codes=self.codes.to(device), scale=self.scale.to(device), global_scale=g)


@dataclass(frozen=True)
class Recipe:
    name: str
    spec: QuantSpec
    element_bits: int
    block: tuple[int, int]  # (rows, cols) of W per scale; 0 means "the whole dimension"
    scale_encoding: str  # f32 | e8m0_bias127 | e4m3fn
    k_multiple: int = 1  # K must be a multiple of this (group size)
    has_global_scale: bool = False
    scale_rules: tuple[str, ...] = field(default=())

    @property
    def scale_rule(self) -> str | None:
        return self.spec.scale_rule

    def with_scale_rule(self, rule: str | None) -> "Recipe":
        if rule is None or rule == self.spec.scale_rule:
            return self
        if rule not in self.scale_rules:
            allowed = ", ".join(self.scale_rules) or "none"
            raise RecipeError(f"recipe {self.name}: --scale-rule {rule!r} is not valid (choose: {allowed})")
        return replace(self, spec=replace(self.spec, scale_rule=rule))

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        *lead, n, k = shape
        br, bc = self.block
        if br == 0 and bc == 0:
            return ()
        rows = n if br == 1 else -(-n // br)
        cols = 1 if bc == 0 else -(-k // bc)
        return (*lead, rows) if bc == 0 else (*lead, rows, cols)

    def codes_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (*shape[:-1], shape[-1] * self.element_bits // 8)

    def storage_bytes(self, shape: tuple[int, ...]) -> int:
        """Bytes on disk: codes, block scales and the global scale (counted once per tensor)."""
        scale_bytes = 4 if self.scale_encoding == "f32" else 1
        return (math.prod(self.codes_shape(shape)) + math.prod(self.scale_shape(shape)) * scale_bytes
                + (4 if self.has_global_scale else 0))

    def check(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Raise RecipeError naming the tensor and the fix if this recipe cannot take it."""
        if dtype not in FLOAT_DTYPES:
            raise RecipeError(
                f"{name}: dtype {dtype} cannot be quantized with {self.name} (needs a float "
                f"weight: bf16, fp16 or fp32); add it to --ignore")
        if len(shape) < 2:
            raise RecipeError(f"{name}: shape {list(shape)} is {len(shape)}-D; {self.name} quantizes "
                              f"2-D Linear weights and 3-D expert stacks; add it to --ignore")
        k = shape[-1]
        if k % self.k_multiple:
            raise RecipeError(
                f"{name}: input dim K={k} is not a multiple of {self.k_multiple}, which {self.name} "
                f"needs for its 1x{self.k_multiple} blocks; add it to --ignore or use fp8-block")

    def quantize(self, name: str, w: torch.Tensor, *, backend: str = "auto",
                 facts: ModuleFacts = NO_FACTS) -> QuantizedTensor:
        global_amax = facts.group_amax if self.has_global_scale else None
        self.check(name, tuple(w.shape), w.dtype)
        try:
            r = kernel_quantize(w, self.spec, global_amax=global_amax, backend=backend)
        except NonFiniteInput:
            raise NonFiniteInput(name) from None
        return QuantizedTensor(self.name, tuple(w.shape), r.codes, r.scale, r.global_scale,
                               self.spec.scale_rule)

    def dequantize(self, q: QuantizedTensor, *, backend: str = "auto") -> torch.Tensor:
        return kernel_dequantize(q.result, self.spec, q.shape, backend=backend)
