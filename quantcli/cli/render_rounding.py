"""The rounding a checkpoint's manifest records (`convert --rounding gptq`), as text: a line with
the method and its parameters, a line with the modules by method and the mean layer-output error
round to nearest -> GPTQ (convert's summary says the same), and a table per layer pattern (per
module with --per-tensor) of each module's method, calibration tokens and layer-output error
round to nearest -> written, with the reason wherever round to nearest was written instead."""

from __future__ import annotations

from rich.console import Console

from quantcli.cli.name_tables import ERROR, Column, counted, named_table, value_range
from quantcli.reports import OMITTED

REASONS_SHOWN = 5  # without --per-tensor: the modules rounded to nearest instead that are named


def rounding_summary(records: list, where: str | None = None) -> str:
    """`14 modules by GPTQ, 2 to nearest (WHERE); layer-output error on the calibration data
    0.0092 -> 0.0063 (mean, round to nearest -> GPTQ)`, from the manifest's per-module records."""
    gptq = [r for r in records if r["method"] == "gptq"]
    line = f"{counted(len(gptq), 'module')} by GPTQ"
    if len(records) > len(gptq):
        line += f", {len(records) - len(gptq)} to nearest" + (f" ({where})" if where else "")
    if gptq:
        before = sum(r["nearest_output_error"] for r in gptq) / len(gptq)
        after = sum(r["output_error"] for r in gptq) / len(gptq)
        line += (f"; layer-output error on the calibration data {before:.3g} -> {after:.3g} "
                 f"(mean, round to nearest -> GPTQ)")
    return line


def settings_line(r: dict) -> str:
    """`GPTQ (dampening 0.01, act order none, scales updated, 128-column blocks, at least 32
    tokens a module, inputs from the quantized layers); default gptq`, from the manifest."""
    inputs = "the quantized layers" if r.get("inputs") == "quantized" else f"the {r.get('inputs')} model"
    line = (f"{str(r.get('method', '?')).upper()} (dampening {r.get('dampening')}, act order {r.get('act_order')}, "
            f"scales {r.get('scales')}, {r.get('block_columns')}-column blocks, at least "
            f"{_tokens(r.get('min_tokens'))} a module, inputs from {inputs}{_forward(r)}); default {r.get('default')}")
    overrides = r.get("overrides") or []
    if overrides:
        line += ", overrides " + ", ".join(f"{p} -> {m}" for p, m in overrides)
    return line


def _forward(r: dict) -> str:
    """', forward in bfloat16' where --gptq-forward was not float32 (an old manifest: float32)."""
    forward = r.get("forward", "float32")
    return "" if forward == "float32" else f", forward in {forward}"


def _tokens(n) -> str:
    return counted(n, "token") if isinstance(n, int) else f"{n} tokens"  # an old manifest may lack it


def _errors(pairs: list) -> str:
    """`0.008889 -> 0.006058`, or ranges over a group; `-` where no error was recorded (too few tokens)."""
    present = [p for p in pairs if p[0] is not None]
    if not present:
        return "-"
    fmt = value_range(ERROR)
    return f"{fmt([p[0] for p in present])} -> {fmt([p[1] for p in present])}"


_COLUMNS = [Column("method"), Column("tokens", justify="right", merge=value_range("{:,}")),
            Column("output error, nearest -> written", merge=_errors)]


def render_rounding(report, con: Console, per_tensor: bool = False) -> None:
    """inspect's rounding lines and table (nothing when the manifest records no rounding)."""
    if report.rounding is OMITTED:
        return
    con.print(f"rounding: {settings_line(report.rounding)}", markup=False)
    modules = [m for m in report.modules if m.rounding is not OMITTED]
    if not modules:
        return
    records = [m.rounding for m in modules]
    con.print(f"rounded: {rounding_summary(records)}", markup=False)
    rows = [[r["method"], r.get("tokens"), (r.get("nearest_output_error"), r.get("output_error"))] for r in records]
    con.print(named_table(con, "module", [m.module for m in modules], rows, _COLUMNS, per_tensor=per_tensor,
                          title="rounding"))
    fallbacks = [m for m in modules if m.rounding.get("reason")]
    shown = fallbacks if per_tensor else fallbacks[:REASONS_SHOWN]
    for m in shown:
        con.print(f"nearest instead of GPTQ: {m.module}: {m.rounding['reason']}", markup=False)
    if len(shown) < len(fallbacks):
        con.print(f"... and {len(fallbacks) - len(shown)} more rounded to nearest instead (--per-tensor lists "
                  f"them, --json has each reason)", markup=False)
