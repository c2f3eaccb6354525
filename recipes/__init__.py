"""Recipe registry: one module per recipe, looked up by name."""

from __future__ import annotations

from quantcli.errors import RecipeError

from quantcli.recipes import fp8, fp8_block, fp8_channel, int8_channel, mxfp4, mxfp8, nvfp4
from quantcli.recipes.base import QuantizedTensor, Recipe

RECIPES: dict[str, Recipe] = {m.RECIPE.name: m.RECIPE for m in (fp8, fp8_channel, fp8_block, mxfp8, mxfp4, nvfp4,
                                                          int8_channel)}

# Plain dtypes a quantized checkpoint can be decoded to (convert --recipe bf16).
DENSE_RECIPES = ("bf16", "fp16", "fp32")

__all__ = ["DENSE_RECIPES", "RECIPES", "QuantizedTensor", "Recipe", "get_recipe"]


def get_recipe(name: str, scale_rule: str | None = None) -> Recipe:
    try:
        recipe = RECIPES[name]
    except KeyError:
        raise RecipeError(f"unknown recipe {name!r}; choose one of: {', '.join(RECIPES)}") from None
    return recipe.with_scale_rule(scale_rule)
