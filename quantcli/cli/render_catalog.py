"""`quantcli recipes` and `quantcli layouts` as text: the registries (quantcli/formats/catalog.py)
and the engines table (quantcli/formats/engines.py); --json prints the same data."""

from __future__ import annotations

import textwrap

from rich.console import Console
from rich.table import Table

from quantcli.cli.name_tables import Column, fitted_table
from quantcli.formats.schemes import recipe_label, scheme_infos
from quantcli.recipes import RECIPES

# ---------------------------------------------------------------- recipes, layouts


def render_recipes(infos, con: Console) -> None:
    columns = [Column(h, justify="right" if h.startswith("bits") else "left")
               for h in ("element", "block", "block scale", "global", "bits/param*", "default layout", "layouts")]
    cells = [[_element_label(r), r.block, r.block_scale, r.global_scale or "-",
              f"{r.bits_per_param:.3f}", r.default_layout, ", ".join(r.layouts)] for r in infos]
    # one card per recipe where the table is too wide (80 columns), never a name broken mid-word
    con.print(fitted_table(con, "recipe", [r.name for r in infos], cells, columns, title="recipes"))
    con.print("* on a 4096x4096 weight, scales included; 1xK: one scale per row")
    render_schemes(con)


def _element_label(r) -> str:
    """`e4m3fn`; a packed element with how many share a word on disk: `e2m1 x2/byte` (U8),
    `int4 x8/I32` (compressed-tensors' `weight_packed` words)."""
    if not r.packed:
        return r.element
    element = RECIPES[r.name].element
    word_bytes = element.storage_dtype.itemsize
    word = "byte" if word_bytes == 1 else element.safetensors_dtype
    return f"{r.element} x{8 * word_bytes // element.bits}/{word}"


def render_schemes(con: Console) -> None:
    """llm-compressor's scheme names and the convert options that write the same config."""
    infos = scheme_infos()
    columns = [Column("quantcli convert options"), Column("note")]
    cells = [[i.options if i.available else recipe_label(i), i.note or "-"] for i in infos]
    con.print(fitted_table(con, "llm-compressor", [i.scheme for i in infos], cells, columns,
                           title="from llm-compressor (its scheme names; layout compressed-tensors)"))


def render_layouts(infos, matrix: dict[str, dict[str, str]], con: Console) -> None:
    t = Table(title="layouts")
    t.add_column("layout", no_wrap=True)  # names and keys whole; the engines wrap between words
    t.add_column("engines")
    t.add_column("exclusion key", no_wrap=True)
    for i in infos:
        t.add_row(i.name, ", ".join(i.engines) + ("; MoE experts only" if i.experts_only else ""), i.exclusion_key)
    con.print(t)
    # one row per recipe, one column per layout: four layout columns fit 80 columns, ten recipes do not
    recipes = list(next(iter(matrix.values()), {}))
    m = Table(title="which engines load each recipe in each layout")
    m.add_column("recipe", no_wrap=True)
    for layout in matrix:
        m.add_column(layout, justify="center", no_wrap=True)
    engines = {i.name: i.loads_in for i in infos}
    static = {(i.name, r) for i in infos for r in i.static_only}
    verdicts = {(i.name, r): {v.engine: v.status for v in vs} for i in infos for r, vs in i.verdicts.items()}
    for r in recipes:
        m.add_row(r, *(_engine_marks(engines[layout].get(r, []), verdicts.get((layout, r), {}))
                       + ("*" if (layout, r) in static else "")
                       if row[r] == "loads" else "read" if row[r] == "read only" else "-"
                       for layout, row in matrix.items()))
    con.print(m)
    con.print("V vLLM, S SGLang, T TensorRT-LLM, H transformers")
    con.print("lower case: loads only if a condition holds (inspect checks it on a checkpoint):")
    for i in infos:
        for r, text in i.statements.items():
            if any(v.status == "loads if" for v in i.verdicts[r]):
                con.print(textwrap.fill(f"{r} in {i.name}: {text}", width=min(con.width, 100), initial_indent="  ",
                                        subsequent_indent="      ", break_on_hyphens=False), markup=False)
    if static:
        con.print("*: written only with calibrated activation scales (--activations static)")
    con.print("read: quantcli reads it, no engine loads it; -: not written in that layout")
    con.print("the loader code each verdict rests on: quantcli layouts --json, docs/formats.md")


_ENGINE_MARKS = {"vLLM": "V", "SGLang": "S", "TensorRT-LLM": "T", "transformers": "H"}


def _engine_marks(engines: list[str], status: dict[str, str]) -> str:
    return " ".join(_ENGINE_MARKS[e].lower() if status.get(e) == "loads if" else _ENGINE_MARKS[e] for e in engines)
