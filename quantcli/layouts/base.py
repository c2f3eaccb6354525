"""The Layout type: how a recipe's codes and scales are named, typed and shaped on disk.

On-disk names live only in the layout modules. A layout turns a QuantizedTensor into the tensors
it writes (`to_disk`), reads them back (`from_disk`), describes each one for the manifest
(`describe`), and writes the config keys its consumers need (`quantization_config`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from quantcli.errors import LayoutError
from quantcli.recipes import QuantizedTensor, Recipe, get_recipe

# Reads one on-disk tensor by name (from a checkpoint, or a dict in tests).
GetTensor = Callable[[str], torch.Tensor]


@dataclass(frozen=True)
class DiskTensor:
    """One on-disk tensor of a quantized module, as the manifest records it."""

    name: str
    role: str  # codes | block_scale | global_scale
    encoding: str  # e4m3fn | e2m1x2 | f32 | e8m0_bias127
    direction: str | None  # multiply | divide (scales only)


def module_of(param: str) -> str:
    """`a.b.weight` -> `a.b`; a 3-D expert parameter without `.weight` names itself."""
    return param[: -len(".weight")] if param.endswith(".weight") else param


class Layout:
    name: str = ""
    consumers: str = ""
    recipes: tuple[str, ...] = ()  # what quantcli writes in this layout
    # Recipes a producer writes in this layout that no serving engine loads: read (inspect,
    # verify, convert from them), never written, and verify fails them.
    unservable: tuple[str, ...] = ()
    default_scale_rule: str | None = None  # for MX recipes
    exclusion_key: str = ""

    def supports(self, recipe: str) -> bool:
        return recipe in self.recipes

    def require(self, recipe: str, layouts_that_do: list[str]) -> None:
        if not self.supports(recipe):
            raise LayoutError(
                f"--layout {self.name} cannot hold recipe {recipe} (no engine loads that pair); "
                f"layouts that do: {', '.join(layouts_that_do) or 'none'}")

    def recipe_for(self, recipe: str, scale_rule: str | None = None) -> Recipe:
        r = get_recipe(recipe)
        if r.scale_rules:
            return r.with_scale_rule(scale_rule or self.default_scale_rule or r.scale_rule)
        return r

    def check_shape(self, name: str, recipe: Recipe, shape: tuple[int, ...]) -> None:
        """Layout-specific shape limits beyond the recipe's own (raise LayoutError)."""
        if len(shape) != 2:
            raise LayoutError(
                f"{name}: {len(shape)}-D tensors have no {self.name} names for recipe "
                f"{recipe.name}; use --layout gpt-oss with mxfp4 for 3-D experts, or --ignore it")

    # --- tensors

    def to_disk(self, module: str, q: QuantizedTensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def from_disk(self, module: str, recipe: Recipe, get: GetTensor, names: Mapping[str, object]) -> QuantizedTensor:
        raise NotImplementedError

    def describe(self, module: str, recipe: Recipe) -> list[DiskTensor]:
        raise NotImplementedError

    def detect(self, config: Mapping, extra_files: Mapping[str, Mapping]) -> bool:
        raise NotImplementedError

    def module_recipe(self, module: str, names: Mapping[str, object], config: Mapping) -> str | None:
        """Which recipe a module in a checkpoint of this layout was written with, or None."""
        raise NotImplementedError

    # --- config

    def quantization_config(self, groups: Mapping[str, list[str]], excluded: list[str]) -> dict:
        raise NotImplementedError

    def extra_files(self, groups: Mapping[str, list[str]], excluded: list[str]) -> dict[str, dict]:
        return {}


def scalar_f32(value: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return value.to(torch.float32).reshape(shape).contiguous()


def logical_k(codes: torch.Tensor, recipe: Recipe) -> int:
    return codes.shape[-1] * 8 // recipe.element_bits


def codes_dtype(recipe: Recipe) -> torch.dtype:
    """Storage dtype of the element codes: FP8 recipes as F8_E4M3, FP4 pairs as U8."""
    return torch.float8_e4m3fn if recipe.element_bits == 8 else torch.uint8


def as_codes(codes: torch.Tensor, recipe: Recipe) -> torch.Tensor:
    return codes.contiguous().view(codes_dtype(recipe))


def require_8bit(name: str, t: torch.Tensor) -> torch.Tensor:
    if t.element_size() != 1:
        raise LayoutError(f"{name}: stored as {t.dtype}, expected an 8-bit type (F8_E4M3 or U8)")
    return t.view(torch.uint8)
