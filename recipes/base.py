"""The Recipe type: what a quantization recipe computes, independent of on-disk names."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from quantcli.errors import RecipeError
from quantcli.formats.facts import NO_FACTS, ModuleFacts
from quantcli.kernels import NonFiniteInput, QuantResult, QuantSpec
from quantcli.kernels import dequantize as kernel_dequantize
from quantcli.kernels import quantize as kernel_quantize
from quantcli.kernels.spec import SCALE_SEARCHES, ElementCodec, ScaleCodec, ScaleRule, ScaleSearch

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
    """A quantization scheme: a name and a `QuantSpec` (geometry + element codec + scale codec).

    Everything else a caller asks (bits, block, storage dtype, manifest fields, scale checks and
    stats) is derived from the spec here, so that a new recipe is one `Recipe(...)` line and no
    caller switches on recipe names."""

    name: str
    spec: QuantSpec
    # the layout this recipe is written in unless --layout says otherwise (docs/formats.md,
    # "Layouts: how it is named on disk")
    default_layout: str = "compressed-tensors"

    # --- facts derived from the scheme (stated once, in the spec)

    @property
    def element(self) -> ElementCodec:
        return self.spec.element

    @property
    def scale_codec(self) -> ScaleCodec:
        return self.spec.scale

    @property
    def element_bits(self) -> int:
        return self.spec.element.bits

    @property
    def block(self) -> tuple[int, int]:
        """(rows, cols) of W per scale; 0 means "the whole dimension"."""
        return self.spec.block

    @property
    def k_multiple(self) -> int:
        """K must be a multiple of this (the group size)."""
        return self.spec.k_multiple

    @property
    def scale_encoding(self) -> str:
        return self.spec.scale.encoding  # f32 | e8m0_bias127 | e4m3fn

    @property
    def has_global_scale(self) -> bool:
        return self.spec.scale.has_global

    @property
    def scale_rules(self) -> tuple[ScaleRule, ...]:
        return self.spec.scale.rules

    @property
    def codes_dtype(self) -> torch.dtype:
        """Storage dtype of the element codes on disk: F8_E4M3, I8, or U8 for FP4 pairs."""
        return self.spec.element.storage_dtype

    @property
    def element_max(self) -> float:
        return self.spec.element.max

    @property
    def scale_rule(self) -> ScaleRule | None:
        return self.spec.scale_rule

    def with_scale_rule(self, rule: str | None) -> "Recipe":
        if rule is None or rule == self.spec.scale_rule:
            return self
        if rule not in self.scale_rules:
            allowed = ", ".join(self.scale_rules) or "none"
            raise RecipeError(f"recipe {self.name}: --scale-rule {rule!r} is not valid (choose: {allowed})")
        return replace(self, spec=replace(self.spec, scale_rule=rule))

    @property
    def scale_search(self) -> ScaleSearch:
        return self.spec.scale_search

    @property
    def searches(self) -> bool:
        """Whether `mse` scale search applies: block scales with a code to choose (NVFP4, MX).
        FP8/INT8 F32 scales do not: a search gained too little to offer (measured in
        docs/formats.md, "FP8 / INT8 recipes do not search"); INT4's are compressed-tensors' absmax."""
        return self.spec.searchable

    def with_scale_search(self, search: str | None) -> "Recipe":
        """This recipe with `search` (none | mse); recipes that cannot search stay as they are."""
        if search is None or search == self.spec.scale_search or not self.searches:
            return self
        if search not in SCALE_SEARCHES:
            raise RecipeError(f"recipe {self.name}: --scale-search {search!r} is not valid "
                              f"(choose: {', '.join(SCALE_SEARCHES)})")
        return replace(self, spec=replace(self.spec, scale_search=search))

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return self.spec.scale_shape(tuple(shape))

    def codes_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return self.spec.codes_shape(tuple(shape))

    def storage_bytes(self, shape: tuple[int, ...]) -> int:
        """Bytes on disk: codes, block scales and the global scale (counted once per tensor)."""
        return (math.prod(self.codes_shape(shape)) + math.prod(self.scale_shape(shape)) * self.spec.scale.nbytes
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
        weight = facts.input_channel_ms if self.spec.scale_search.active else None
        try:
            r = kernel_quantize(w, self.spec, global_amax=global_amax, backend=backend, channel_weight=weight)
        except NonFiniteInput:
            raise NonFiniteInput(name) from None
        return QuantizedTensor(self.name, tuple(w.shape), r.codes, r.scale, r.global_scale,
                               self.spec.scale_rule)

    def dequantize(self, q: QuantizedTensor, *, backend: str = "auto") -> torch.Tensor:
        return kernel_dequantize(q.result, self.spec, q.shape, backend=backend)

    # --- what the manifest, inspect and verify say about a module of this recipe

    def manifest_fields(self) -> dict:
        """The scheme's part of a manifest ModuleEntry (docs/formats.md, "The manifest")."""
        e, s = self.spec.element, self.spec.scale
        rule = s.describe_rule(e, self.scale_rule)
        fields = {"block": self.block, "axis": -1, "element": e.manifest_name, "packing": e.packing,
                  "nibble_order": "low_first" if e.packed else None, "scale_rule": rule,
                  "element_rounding": "rne_sat", "zero_block_policy": s.zero_block_policy, "scale_layout": "linear"}
        if self.scale_search.active:  # absent for absmax, so those manifests keep their bytes
            fields["scale_search"] = str(self.scale_search)
        return fields

    def scale_values(self, q: QuantizedTensor) -> torch.Tensor:
        """The block scales of `q` as FP32 values (before any global scale)."""
        return self.spec.scale.values(q.scale)

    def scale_stats(self, q: QuantizedTensor) -> dict:
        """inspect --stats: min/max of the scales, or the exponent histogram of power-of-two
        (E8M0) scales."""
        if self.spec.scale.power_of_two:
            hist = torch.bincount(q.scale.reshape(-1).long(), minlength=256)
            return {"e8m0_histogram": {str(int(i) - 127): int(hist[i]) for i in torch.nonzero(hist).flatten()},
                    "e8m0_255_count": int(hist[255])}
        s = self.scale_values(q)
        if not s.numel():  # a module with a zero-size dimension has no scales
            return {"scale_min": 0.0, "scale_max": 0.0, "scale_nonfinite": 0}
        return {"scale_min": float(s.min()), "scale_max": float(s.max()),
                "scale_nonfinite": int((~torch.isfinite(s)).sum())}

    def decoded_amax_bound(self, q: QuantizedTensor) -> float:
        """max |w| the scales allow: element max x largest block scale x global (verify's
        direction check compares it across modules)."""
        g = float(q.global_scale) if q.global_scale is not None else 1.0
        scales = self.scale_values(q)
        return self.element_max * float(scales.max()) * g if scales.numel() else 0.0

    def saturated_fraction(self, q: QuantizedTensor) -> float:
        """Share of codes at the element's largest magnitude (E2M1 6, E4M3 448, INT8 127/-128,
        INT4 7/-8)."""
        hit = self.element.saturated(q.codes)
        return float(hit.float().mean()) if hit.numel() else 0.0
