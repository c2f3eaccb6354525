"""Layout registry: on-disk naming conventions, one module each."""

from __future__ import annotations

from quantcli.errors import LayoutError
from quantcli.formats.layouts.base import DiskTensor, Layout, module_of
from quantcli.formats.layouts.compressed_tensors import CompressedTensorsLayout
from quantcli.formats.layouts.fp8 import Fp8Layout
from quantcli.formats.layouts.gpt_oss import GptOssLayout
from quantcli.formats.layouts.modelopt import ModelOptLayout
from quantcli.recipes import RECIPES

LAYOUTS: dict[str, Layout] = {
    layout.name: layout for layout in (ModelOptLayout(), CompressedTensorsLayout(), Fp8Layout(), GptOssLayout())
}

# The layout each recipe is written in unless --layout says otherwise (the recipe says; docs/formats.md,
# "Layouts: how it is named on disk").
DEFAULT_LAYOUT = {name: recipe.default_layout for name, recipe in RECIPES.items()}

__all__ = ["DEFAULT_LAYOUT", "DiskTensor", "LAYOUTS", "Layout", "get_layout", "layouts_for", "layouts_holding",
           "module_of"]


def get_layout(name: str) -> Layout:
    try:
        return LAYOUTS[name]
    except KeyError:
        raise LayoutError(f"unknown layout {name!r}; choose one of: {', '.join(LAYOUTS)}") from None


def layouts_for(recipe: str) -> list[str]:
    return [name for name, layout in LAYOUTS.items() if layout.supports(recipe)]


def layouts_holding(recipes: set[str]) -> list[str]:
    """The layouts that hold every recipe of `recipes` and the mix of them in one checkpoint."""
    return [name for name, layout in LAYOUTS.items()
            if all(layout.supports(r) for r in recipes) and layout.mix_problem(recipes) is None]


def layout_for(recipe: str, requested: str | None) -> Layout:
    layout = get_layout(requested or DEFAULT_LAYOUT[recipe])
    layout.require(recipe, layouts_for(recipe))
    return layout
