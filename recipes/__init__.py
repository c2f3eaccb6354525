"""Recipe registry: one module per recipe, looked up by name."""

from __future__ import annotations

from quantcli.errors import RecipeError
from quantcli.recipes import fp8, fp8_block, fp8_channel, int4, int8_channel, mxfp4, mxfp8, nvfp4
from quantcli.recipes.base import QuantizedTensor, Recipe

RECIPES: dict[str, Recipe] = {m.RECIPE.name: m.RECIPE for m in (fp8, fp8_channel, fp8_block, mxfp8, mxfp4, nvfp4,
                                                          int8_channel, int4)}
# Recipes whose numerics are done but that no layout writes yet: get_recipe finds them, while
# RECIPES (what the CLI, the layouts, the catalog and the tests' registry loops offer) does not.
# A recipe moves to RECIPES with its layout row and its CLI name (int4 did).
UNLISTED_RECIPES: dict[str, Recipe] = {}

# Plain dtypes a quantized checkpoint can be decoded to (convert --recipe bf16).
DENSE_RECIPES = ("bf16", "fp16", "fp32")

__all__ = ["DENSE_RECIPES", "RECIPES", "UNLISTED_RECIPES", "QuantizedTensor", "Recipe", "get_recipe"]


def get_recipe(name: str, scale_rule: str | None = None) -> Recipe:
    recipe = RECIPES.get(name) or UNLISTED_RECIPES.get(name)
    if recipe is None:
        raise RecipeError(f"unknown recipe {name!r}; choose one of: {', '.join(RECIPES)}")
    return recipe.with_scale_rule(scale_rule)
