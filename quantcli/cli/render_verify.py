"""The verify report as text: the checks, the worst tensors with their limits, the error by
layer and the verdict (quantcli/cli/render.py re-exports these for commands.py)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from quantcli.cli.name_tables import ERROR, Column, counted, fitted_table
from quantcli.reports import OMITTED
from quantcli.verify.judge import OUTPUT_MARGIN, output_limit


def _limit_text(row) -> str:
    """The limit and what it is made of: '0 (identical ...)', '0.1234 = (nvfp4 0.09 + re-quantize 0.02) x 1.19';
    for a module judged by its layer outputs (--calibration), the limit on its output error."""
    if row.output_rel_err is not OMITTED and row.output_rounded_rel_err is not OMITTED:
        return f"output {ERROR.format(output_limit(row.output_rounded_rel_err))} = {1 + OUTPUT_MARGIN:g} x rounding's"
    basis = row.limit_basis
    if not basis:
        return ERROR.format(row.limit_rel_err)
    if row.limit_rel_err == 0:
        return f"0 ({basis})"
    if basis.startswith("(quantcli's own)"):
        return ERROR.format(row.limit_rel_err)
    return f"{ERROR.format(row.limit_rel_err)} = {basis}"


def _rows_table(rows, top: int, con: Console) -> Table:
    """The worst tensors, worst first; names whole (a common prefix is cut, never the tail)."""
    outputs = any(r.output_rel_err is not OMITTED for r in rows[:top])  # --calibration judged some by outputs
    headers = ("recipe", "rel err", *(("output err",) if outputs else ()), "ours", "limit", "SQNR dB", "cosine",
               "max abs", "exact")
    columns = [Column(h) for h in headers]
    cells = []
    for r in rows[:top]:
        exact = r.exact_identical_fraction
        ours = "-" if r.baseline_rel_err is OMITTED else ERROR.format(r.baseline_rel_err) + (
            "" if r.absmax_rel_err is OMITTED else f" (absmax {ERROR.format(r.absmax_rel_err)})") + (
            "" if r.baseline_rounding is OMITTED else f" ({r.baseline_rounding})")  # a GPTQ module: not GPTQ's figure
        output = ["-" if r.output_rel_err is OMITTED else ERROR.format(r.output_rel_err)] if outputs else []
        cells.append([r.recipe, ERROR.format(r.rel_err), *output, ours, _limit_text(r), f"{r.sqnr_db:.2f}",
                      f"{r.cosine:.6f}", ERROR.format(r.max_abs),
                      "-" if exact is OMITTED or exact is None else f"{exact:.2%}"])
    return fitted_table(con, "tensor", [r.tensor for r in rows[:top]], cells, columns,
                        title=f"worst {counted(min(top, len(rows)), 'tensor')}")


def _layer_bars(layers: dict[str, float], con: Console) -> None:
    worst = max(layers.values()) or 1.0
    con.print("relative error by layer (worst tensor):")
    for layer, v in sorted(layers.items(), key=lambda kv: (kv[0] == "other", int(kv[0]) if kv[0].isdigit() else 0)):
        con.print(f"  {layer:>5} {'█' * max(1, int(40 * v / worst))} {ERROR.format(v)}")


def render_verify(report, con: Console, top: int) -> None:
    reference, kind = report.reference, report.reference_kind
    con.print(f"{report.checkpoint}: layout {report.layout}, {counted(report.modules, 'quantized module')}"
              + (f", reference {reference}" + (f" ({kind})" if kind else "") if reference else ""))
    for note in report.notes:
        con.print(f"  {note}")
    for c in report.checks:
        status = "[green]ok[/green]  " if c.passed else f"[red]FAIL[/red] ({c.faults})"
        con.print(f"  {status} {c.check}")
    if report.loads_in is not OMITTED:
        con.print(f"  loads in: {report.loads_in}", markup=False)
    if report.tensors:
        con.print(_rows_table(report.tensors, top, con))
        if any(r.baseline_rounding is not OMITTED for r in report.tensors[:top]):
            con.print("ours (nearest): quantcli's own quantization rounded to nearest, for GPTQ modules too; their "
                      "bytes are held to the GPTQ rerun instead (exact, with --calibration)")
        _layer_bars(report.layers, con)
    _verdict(report, con, con)


def _verdict(report, con: Console, err: Console) -> None:
    for w in report.warnings:
        err.print(f"[yellow]warning[/yellow]: {w}")
    for f in report.faults:
        err.print(f"[red]FAIL[/red] {f.tensor}: {f.fault}")
    unchecked = len(report.not_byte_checked)  # -q shows no notes: the verdict line says what it did not check
    gap = f" ({unchecked} module(s) not byte-checked: need --calibration)" if unchecked else ""
    con.print(("[green]PASS[/green]" if report.passed else f"[red]FAIL[/red]: {len(report.faults)} fault(s)") + gap)


def render_verify_brief(report, con: Console, err: Console) -> None:
    """verify -q: PASS or FAIL on stdout; each warning and fault on stderr."""
    _verdict(report, con, err)


__all__ = ["render_verify", "render_verify_brief"]
