"""The face: everything that turns a report into text. Rich consoles and tables, byte sizes,
the inspect and verify reports. The library returns dataclasses (quantcli/reports.py); only
the command layer (commands.py and this module) prints."""

from __future__ import annotations

import json
import sys

from rich.console import Console
from rich.table import Table

from .reports import OMITTED, to_json


class _Console(Console):
    def on_broken_pipe(self) -> None:
        # Rich turns a closed stdout into SystemExit(1), which a pipeline would read as
        # "verify found a problem"; let main() end it quietly with 141 instead.
        raise BrokenPipeError


def console(stderr: bool = False) -> Console:
    # soft_wrap: a line of text (a message, a FAIL line) is never broken, so grep and the "one
    # line" promise hold in a pipe; tables still fit the width.
    return _Console(stderr=stderr, highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)


def emit_json(obj: object) -> None:
    """A report (dataclass) or a plain document as indented JSON on stdout."""
    text = json.dumps(to_json(obj), indent=2, default=str) + "\n"
    # In pieces, each flushed: a reader that stopped early (`| head -1`) surfaces here as a
    # BrokenPipeError (main exits 141). One large write can lose it: Python's buffered writer
    # drops the EPIPE that follows the kernel's partial write of a big block, and reports success.
    for start in range(0, len(text), JSON_CHUNK):
        sys.stdout.write(text[start:start + JSON_CHUNK])
        sys.stdout.flush()


JSON_CHUNK = 1 << 16


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


# ---------------------------------------------------------------- inspect


def _dims(shape) -> str:
    return "x".join(map(str, shape or []))


def _modules_table(modules) -> Table:
    t = Table(show_lines=False)
    for col in ("module", "recipe", "logical", "storage", "block", "scales", "global", "bits/param"):
        t.add_column(col)
    for m in modules:
        scales = ", ".join(f"{e.name.rsplit('.', 1)[-1]} {e.dtype} {e.direction}"
                           for e in m.tensors if e.role == "block_scale")
        glob = ", ".join(f"{e.value:.6g} ({e.direction})" for e in m.tensors if e.value is not OMITTED)
        # an undescribable module has no logical/storage facts: '?' as before
        logical_dtype = "?" if m.logical_dtype is OMITTED else m.logical_dtype
        storage_dtype = "?" if m.storage_dtype is OMITTED else m.storage_dtype
        block = [] if m.block is OMITTED else m.block
        t.add_row(m.module, m.recipe, f"{logical_dtype} {_dims(m.logical_shape)}",
                  f"{storage_dtype} {_dims(m.storage_shape)}", "x".join(str(b) if b else "all" for b in block),
                  scales, glob or "-", f"{m.bits_per_param:.3f}" if m.bits_per_param else "-")
    return t


def _totals_table(by_format) -> Table:
    t = Table(title="totals")
    for col in ("format", "modules", "params", "bytes"):
        t.add_column(col)
    for fmt, f in sorted(by_format.items()):
        t.add_row(fmt, str(f.modules or "-"), f"{f.params:,}", human_bytes(f.bytes))
    return t


def _kv_table(kv) -> Table:
    t = Table(title=f"KV cache: {kv.layers} layers x {kv.per_layer}, budget {human_bytes(kv.budget_bytes)}")
    for col in ("format", "bits/elem", "per token", "tokens in budget"):
        t.add_column(col)
    for r in kv.formats:
        t.add_row(r.format, f"{r.bits_per_element:g}", human_bytes(r.bytes_per_token), f"{r.tokens_in_budget:,}")
    return t


def _scales_tables(cal, con: Console) -> None:
    """The activation scheme, each module's static input scale, the KV-cache scales per layer."""
    con.print(f"activations: {cal.activation_scheme}"
              + (f"; FP8 KV cache declared ({cal.kv_cache})" if cal.kv_cache else ""))
    if cal.inputs:
        t = Table(title="input scales")
        for col in ("tensor", "value", "direction", "implied amax"):
            t.add_column(col)
        for s in cal.inputs:
            t.add_row(s.tensor, f"{s.value:.6g}", s.direction, f"{s.amax:.6g}")
        con.print(t)
    if cal.kv:
        t = Table(title="KV-cache scales")
        for col in ("attention", "k_scale", "v_scale"):
            t.add_column(col)
        for r in cal.kv:
            t.add_row(r.attention, *("missing" if v is None else f"{v:.6g}" for v in (r.k_scale, r.v_scale)))
        con.print(t)


def render_inspect(report, con: Console) -> None:
    con.print(f"{report.source}: layout [bold]{report.layout}[/bold] (loads in {report.consumers})"
              + ("; quantcli manifest present" if report.has_manifest else ""))
    if report.modules:
        con.print(_modules_table(report.modules))
        for m in report.modules:
            if m.stats is not OMITTED:
                con.print(f"  {m.module}: {to_json(m.stats)}")
    if report.calibrated is not OMITTED:
        _scales_tables(report.calibrated, con)
    con.print(_totals_table(report.by_format))
    if report.params:
        con.print(f"{report.params:,} params in {human_bytes(report.bytes)}: {report.bits_per_param:.3f} "
                  f"bits/param, {report.size_vs_bf16:.3f}x the BF16 size")
    if report.exclusion_list:
        con.print("excluded: " + ", ".join(report.exclusion_list))
    for u in report.unlisted_linears:
        con.print(f"[red]problem[/red]: {u} is neither quantized nor in the exclusion list; vLLM/SGLang will try "
                  f"to load its dense weight into a quantized slot")
    for f in report.fused_mismatches:
        con.print(f"[red]problem[/red]: fused group {f.group} has different global scales {f.global_scales} "
                  f"(TensorRT-LLM asserts; vLLM silently uses one for all)")
    for p in report.problems:
        con.print(f"[red]problem[/red]: {p}")
    for w in report.warnings:
        con.print(f"[yellow]warning[/yellow]: {w}")
    if report.kv_cache is not OMITTED:
        con.print(_kv_table(report.kv_cache))


# ---------------------------------------------------------------- verify


def _limit_text(row) -> str:
    """The limit and what it is made of: '0 (identical ...)', '0.1234 = (nvfp4 0.09 + re-quantize 0.02) x 1.19'."""
    basis = row.limit_basis
    if not basis:
        return f"{row.limit_rel_err:.4g}"
    if row.limit_rel_err == 0:
        return f"0 ({basis})"
    if basis.startswith("(quantcli's own)"):
        return f"{row.limit_rel_err:.4g}"
    return f"{row.limit_rel_err:.4g} = {basis}"


def _rows_table(rows, top: int) -> Table:
    t = Table(title=f"worst {min(top, len(rows))} tensors")
    for col in ("tensor", "recipe", "rel err", "ours", "limit", "SQNR dB", "cosine", "max abs", "exact"):
        t.add_column(col)
    for r in rows[:top]:
        exact = r.exact_identical_fraction
        t.add_row(r.tensor, r.recipe, f"{r.rel_err:.4g}", f"{r.baseline_rel_err:.4g}", _limit_text(r),
                  f"{r.sqnr_db:.2f}", f"{r.cosine:.6f}", f"{r.max_abs:.3g}",
                  "-" if exact is OMITTED or exact is None else f"{exact:.2%}")
    return t


def _layer_bars(layers: dict[str, float], con: Console) -> None:
    worst = max(layers.values()) or 1.0
    con.print("relative error by layer (worst tensor):")
    for layer, v in sorted(layers.items(), key=lambda kv: (kv[0] == "other", int(kv[0]) if kv[0].isdigit() else 0)):
        con.print(f"  {layer:>5} {'█' * max(1, int(40 * v / worst))} {v:.4g}")


def render_verify(report, con: Console, top: int) -> None:
    reference, kind = report.reference, report.reference_kind
    con.print(f"{report.checkpoint}: layout {report.layout}, {report.modules} quantized modules"
              + (f", reference {reference}" + (f" ({kind})" if kind else "") if reference else ""))
    for note in report.notes:
        con.print(f"  {note}")
    for c in report.checks:
        status = "[green]ok[/green]  " if c.passed else f"[red]FAIL[/red] ({c.faults})"
        con.print(f"  {status} {c.check}")
    if report.tensors:
        con.print(_rows_table(report.tensors, top))
        _layer_bars(report.layers, con)
    for w in report.warnings:
        con.print(f"[yellow]warning[/yellow]: {w}")
    for f in report.faults:
        con.print(f"[red]FAIL[/red] {f.tensor}: {f.fault}")
    con.print("[green]PASS[/green]" if report.passed else f"[red]FAIL[/red]: {len(report.faults)} fault(s)")


__all__ = ["console", "emit_json", "human_bytes", "render_inspect", "render_verify"]
