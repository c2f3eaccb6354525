"""What exists, read from the registries (recipes/, quantcli/formats/layouts/): `quantcli recipes` and
`quantcli layouts`. Nothing here is written out by hand: a new recipe or a new row in a layout's
table shows up in both listings and in the loadability matrix by itself. Which engines load a
pair comes from one place, quantcli/formats/engines.py (also inspect, the model card and the docs)."""

from __future__ import annotations

from dataclasses import dataclass, field

from quantcli.formats.engines import ENGINES, loads_in, statement, verdicts
from quantcli.formats.layouts import DEFAULT_LAYOUT, LAYOUTS, layouts_for
from quantcli.recipes import RECIPES
from quantcli.reports import block_label

# bits/param are measured on a shape this size (a per-tensor or per-row scale costs less on larger ones)
REFERENCE_SHAPE = (4096, 4096)


@dataclass
class RecipeInfo:
    name: str
    element: str  # the manifest's element name (e4m3fn, e2m1, int8)
    packed: bool  # two elements per byte
    block: str  # "tensor", "1xK" (one scale per row), "128x128", "1x16"
    block_scale: str  # the scale's encoding (f32, e8m0_bias127, e4m3fn)
    global_scale: str | None  # "f32" when a second, per-tensor scale multiplies the block scales
    bits_per_param: float  # on REFERENCE_SHAPE, scales included
    default_layout: str
    layouts: list[str]  # every layout quantcli writes it in


@dataclass
class EngineVerdict:
    """One engine on one (recipe, layout) pair, as quantcli/formats/engines.py says."""

    engine: str
    status: str  # loads | loads if | no | not checked
    condition: str  # loads if: what must hold; no / not checked: why
    rules: list[str]  # the loader code the verdict rests on (repo version path::function)
    note: str = ""


@dataclass
class LayoutInfo:
    name: str
    engines: list[str]  # who loads it (e.g. vLLM, SGLang, TensorRT-LLM): any recipe of `loads_in`
    writes: list[str]  # recipes quantcli writes in this layout, and the engines load
    reads_only: list[str]  # recipes a producer writes in it that no engine loads: read, never written
    exclusion_key: str  # the config key that lists modules left dense
    experts_only: bool  # the layout names MoE expert stacks only
    loads_in: dict[str, list[str]]  # recipe of `writes` -> the engines that load it in this layout
    static_only: list[str] = field(default_factory=list)  # recipes written only with --activations static
    statements: dict[str, str] = field(default_factory=dict)  # recipe -> `vLLM, SGLang (if ...)`
    verdicts: dict[str, list[EngineVerdict]] = field(default_factory=dict)  # recipe -> every engine's verdict


def recipes() -> list[RecipeInfo]:
    out = []
    for name, r in RECIPES.items():
        numel = REFERENCE_SHAPE[0] * REFERENCE_SHAPE[1]
        out.append(RecipeInfo(
            name=name, element=r.element.manifest_name, packed=r.element.packed, block=block_label(r.block),
            block_scale=r.scale_codec.encoding, global_scale="f32" if r.has_global_scale else None,
            bits_per_param=round(8 * r.storage_bytes(REFERENCE_SHAPE) / numel, 3), default_layout=DEFAULT_LAYOUT[name],
            layouts=layouts_for(name)))
    return out


def layouts() -> list[LayoutInfo]:
    out = []
    for name, layout in LAYOUTS.items():
        writes = [r for r in RECIPES if r in layout.recipes]
        engines = {r: list(loads_in(r, name)) for r in writes}
        out.append(LayoutInfo(name=name, engines=[e for e in ENGINES if any(e in got for got in engines.values())],
                              writes=writes, reads_only=[r for r in RECIPES if r in layout.unservable],
                              exclusion_key=layout.exclusion_key, experts_only=layout.experts_only, loads_in=engines,
                              static_only=[r for r in writes if r in layout.needs_static],
                              statements={r: statement(r, name) for r in writes},
                              verdicts={r: _verdicts(r, name) for r in writes}))
    return out


def _verdicts(recipe: str, layout: str) -> list[EngineVerdict]:
    found = verdicts(recipe, layout)
    return [EngineVerdict(e, found[e].status, found[e].condition, [r.cite() for r in found[e].rules], found[e].note)
            for e in ENGINES]


def loadability(infos: list[LayoutInfo]) -> dict[str, dict[str, str]]:
    """layout -> recipe -> 'loads' (written by quantcli, loaded by the engines in `loads_in`),
    'read only' (a producer writes it, no engine loads it) or 'no'."""
    return {i.name: {r: "loads" if i.loads_in.get(r) else "read only" if r in i.reads_only else "no" for r in RECIPES}
            for i in infos}


__all__ = ["EngineVerdict", "LayoutInfo", "RecipeInfo", "layouts", "loadability", "recipes"]
