"""quantcli eval on the terminal: the per-layer table, the model-level metrics and the progress
bar (one row per block as it finishes: `evaluating ━━━━  12/32 0:00:41 3.4 s/layer`)."""

from __future__ import annotations

import re

from rich.console import Console
from rich.table import Table

from quantcli.cli.bars import PhaseBar
from quantcli.cli.name_tables import ERROR, counted
from quantcli.reports import OMITTED


class LayerBar(PhaseBar):
    """The eval progress callback `bar(done, total, seconds_per_layer)`; with `verbose` one stderr
    line per block (also without a terminal)."""

    def __init__(self, stderr: Console, show: bool, verbose: bool):
        super().__init__(stderr, show, "evaluating")
        self.verbose = verbose

    def __call__(self, done: int, total: int, per_layer: float,  # type: ignore[override]
                 phase: str | None = None) -> None:
        """`phase`: None for the main walk, else what a later walk (--sensitivity) is doing."""
        said = f"{per_layer:.2f} s/layer"
        super().__call__(phase or "evaluating layers", done, total, said)
        if self.verbose:
            self.stderr.print(f"{phase + ': ' if phase else ''}layer {done}/{total} done ({said})")


def _short(module: str) -> str:
    """A module's name within its block: `model.layers.3.self_attn.q_proj` -> `self_attn.q_proj`."""
    return re.sub(r"^.*?\blayers?\.\d+\.", "", module)


def _modules_cell(rows, top: int) -> str:
    return ", ".join(f"{_short(m.module)} {ERROR.format(m.rel_err)}" for m in rows[:top])


def _layers_table(report, top: int) -> Table:
    table = Table(title="per layer: hidden-state error and the modules adding the most error themselves",
                  title_justify="left")
    table.add_column("layer", justify="right")
    table.add_column("hidden rel err", justify="right")
    table.add_column(f"worst modules (own output rel err), top {top}")
    for row in report.layers:
        table.add_row(str(row.layer), ERROR.format(row.hidden_rel_err), _modules_cell(row.worst_modules, top))
    return table


def _metrics_table(report) -> Table:
    table = Table(title="model output", title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    c, e = report.causal, report.encoder
    if c is not OMITTED:
        rows = [("tokens scored", str(c.tokens)), ("perplexity, reference", f"{c.perplexity_reference:.4f}"),
                ("perplexity, quantized", f"{c.perplexity_quantized:.4f}"),
                ("perplexity ratio", f"{c.perplexity_quantized / c.perplexity_reference:.5f}"),
                ("KL(ref || quant) mean", ERROR.format(c.kl_mean)), ("KL p99", ERROR.format(c.kl_p99)),
                ("KL max", ERROR.format(c.kl_max)), ("top-1 agreement", f"{c.top1_agreement:.2%}"),
                ("logits rel err", ERROR.format(c.logits_rel_err))]
    else:
        rows = [("samples", str(e.samples)), ("pooling", f"{'+'.join(e.pooling)} ({e.pooling_source})"),
                ("embedding cosine mean", f"{e.cosine_mean:.6f}"), ("embedding cosine min", f"{e.cosine_min:.6f}")]
    for k, v in rows:
        table.add_row(k, v)
    return table


def _sensitivity_table(report) -> Table:
    causal = report.causal is not OMITTED
    table = Table(title="sensitivity: the model output error with each module alone quantized, largest first",
                  title_justify="left")
    table.add_column("rank", justify="right")
    table.add_column("module")
    table.add_column("KL mean" if causal else "1 - cosine", justify="right")
    if causal:
        table.add_column("top-1 agreement", justify="right")
    table.add_column("own rel err", justify="right")
    for k, row in enumerate(report.sensitivity, 1):
        top1 = [f"{row.top1_agreement:.2%}"] if causal else []
        table.add_row(str(k), row.module, ERROR.format(row.output_error), *top1, ERROR.format(row.own_rel_err))
    return table


def render_eval(report, con: Console, top: int) -> None:
    recipes = ", ".join(f"{n} {r}" for r, n in report.recipes.items()) or "no quantized module"
    against = f"the dense {report.reference}" if report.emulating else f"--reference {report.reference}"
    con.print(f"{report.checkpoint} vs {against}: {report.model_kind}, "
              f"layout {report.layout or 'dense'} ({recipes})")
    acts = "; ".join(f"{a.scheme} on {counted(a.modules, 'module')}" for a in report.activations) or \
        "none declared (weight-only)"
    con.print(f"  activations emulated: {acts}")
    con.print(f"  KV cache: {report.kv_cache}")
    con.print(f"  {_samples(report)}, {_tokens(report)} (at most {report.seq_len} "
              f"each) on {report.device}, {report.seconds:.1f} s")
    for note in report.notes:
        con.print(f"  note: {note}")
    con.print(_layers_table(report, top))
    con.print(_metrics_table(report))
    if report.sensitivity:
        con.print(_sensitivity_table(report))


def _samples(report) -> str:
    """`32 of 64 samples (the first 32: --samples)`, `64 of 64 samples`, or for a Hub dataset read
    only as far as --samples, `the first 32 samples of the dataset`."""
    n, held = report.samples, report.samples_in_data
    if held is None:
        return f"the first {counted(n, 'sample')} of the dataset"
    return f"{n} of {counted(held, 'sample')}" + (f" (the first {n}: --samples)" if n < held else "")


def _tokens(report) -> str:
    """`192 tokens`, or where --samples or --seq-len left some out, `192 of 384 tokens`."""
    held = report.tokens_in_data
    if held is None or held == report.tokens:
        return counted(report.tokens, "token", spec=",")
    return f"{report.tokens:,} of {counted(held, 'token', spec=',')}"


def render_eval_brief(report, con: Console, extra: str = "") -> None:
    """eval -q: the headline numbers on one line (`extra`: eval --auto's predicted error)."""
    c, e = report.causal, report.encoder
    if c is not OMITTED:
        con.print(f"ppl {c.perplexity_reference:.4f} -> {c.perplexity_quantized:.4f}  "
                  f"KL mean {ERROR.format(c.kl_mean)} p99 {ERROR.format(c.kl_p99)}  top-1 {c.top1_agreement:.2%}"
                  + extra)
    else:
        con.print(f"cosine mean {e.cosine_mean:.6f} min {e.cosine_min:.6f}" + extra)
