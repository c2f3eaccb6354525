"""The face: everything that turns a report into text. Rich consoles and tables, byte sizes,
the inspect and verify reports. The library returns dataclasses (quantcli/reports.py); only
the command layer (commands.py and this module) prints."""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from quantcli.cli.grouping import group_names
from quantcli.cli.name_tables import SCALE, Column, counted, named_table, total, value_range
from quantcli.cli.render_catalog import render_layouts, render_recipes  # noqa: F401 (commands.py imports them here)
from quantcli.cli.render_rounding import render_rounding
from quantcli.cli.render_verify import render_verify, render_verify_brief  # noqa: F401 (as render_catalog's)
from quantcli.formats.layouts.base import Role
from quantcli.formats.module_kinds import DEFAULT_EXCLUDES
from quantcli.planning.plan import EMPTY_TENSOR
from quantcli.reports import OMITTED, block_label, to_json


class _Console(Console):
    def on_broken_pipe(self) -> None:
        # Rich turns a closed stdout into SystemExit(1), which a pipeline would read as
        # "verify found a problem"; let main() end it quietly with 141 instead.
        raise BrokenPipeError

    def _render_buffer(self, buffer) -> str:
        # Rich pads grid cells (the cards, wrapped text) to the full width; no printed line keeps
        # trailing spaces (before an end-of-line style code too), so a pipe or a diff sees the text.
        return _TRAILING.sub(r"\1", super()._render_buffer(buffer))


_TRAILING = re.compile(r"[ \t]+((?:\x1b\[[0-9;]*m)*)$", re.MULTILINE)


def console(stderr: bool = False) -> Console:
    # soft_wrap: a line of text (a message, a FAIL line) is never broken, so grep and the "one
    # line" promise hold in a pipe; tables still fit the width.
    # Piped output is 160 columns wide unless COLUMNS says otherwise (rich reads it when width is None).
    piped = not sys.stdout.isatty() and not os.environ.get("COLUMNS", "").isdigit()
    return _Console(stderr=stderr, highlight=False, soft_wrap=True, width=160 if piped else None)


_json_written: list[bool] = [False]  # whether this process has started a --json document on stdout


def start_json() -> None:
    """A new command: no document written yet."""
    _json_written[0] = False


def json_was_written() -> bool:
    return _json_written[0]


def emit_json(obj: object) -> None:
    """A report (dataclass) or a plain document as indented JSON on stdout."""
    text = json.dumps(to_json(obj), indent=2, default=str) + "\n"
    _json_written[0] = True
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


# ---------------------------------------------------------------- convert --dry-run


# A group's in/out are the bytes of all its tensors; dtype, shape, recipe and bits/param agree.
_PLAN_COLUMNS = [Column("dtype"), Column("shape"), Column("recipe"), Column("action"),
                 Column("in", justify="right", merge=total(human_bytes)),
                 Column("out", justify="right", merge=total(human_bytes)), Column("bits/param", justify="right")]


def plan_table(rows: list[dict], title: str, con: Console, per_tensor: bool):
    """The dry run's tensors (the --json rows), one row per layer pattern unless `per_tensor`."""
    cells = [[r["dtype"], "x".join(map(str, r["shape"])), r["recipe"] or "-", r["action"], r["bytes_in"],
              r["bytes_out"], f"{r['bits_per_param']:.2f}"] for r in rows]
    return named_table(con, "tensor", [r["name"] for r in rows], cells, _PLAN_COLUMNS, per_tensor=per_tensor,
                       title=title)


def excluded_lines(exclusions, per_tensor: bool) -> list[str]:
    """`excluded PATTERN (N): REASON` per layer pattern and reason (per module with `per_tensor`)."""
    if per_tensor:
        return [f"excluded {e.module}: {e.reason}" for e in exclusions]
    groups = group_names([e.module for e in exclusions], [e.reason for e in exclusions])
    return [f"excluded {g.pattern}" + (f" ({g.count})" if g.count > 1 else "") + f": {exclusions[g.members[0]].reason}"
            for g in groups]


# exclusion reasons that name a kind of module (`2 norms`); those that read after a count as they
# are (`2 --ignore`, `3 already dense in the source`); any other (a sentence, such as `gpt-oss layout
# quantizes MoE experts only`) is the reason of a count of modules (`8 modules (gpt-oss layout ...)`)
NOUN_REASONS = frozenset({kind for kind, _ in DEFAULT_EXCLUDES} | {EMPTY_TENSOR})
AFTER_COUNT = ("--ignore", "not in ", "already dense", "fused with ")


def dense_reasons(exclusions) -> str:
    """'8 modules (gpt-oss layout quantizes MoE experts only), 2 MoE routers/gates, 1 output head':
    how many modules were left dense for each reason."""
    counts: dict[str, int] = {}
    for e in exclusions:
        reason = "already dense in the source" if e.reason == "dense in the source" else e.reason
        counts[reason] = counts.get(reason, 0) + 1
    return ", ".join(_dense_count(n, reason) for reason, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _dense_count(n: int, reason: str) -> str:
    if reason in NOUN_REASONS:
        return counted(n, reason)
    if reason.startswith(AFTER_COUNT):
        return f"{n} {reason}"
    return f"{counted(n, 'module')} ({reason})"


# ---------------------------------------------------------------- inspect


def _dims(shape) -> str:
    return "x".join(map(str, shape or []))


def _module_cells(m) -> list:
    block_scales = [e for e in m.tensors if e.role == Role.BLOCK_SCALE]
    scales = ", ".join(f"{e.name.rsplit('.', 1)[-1]} {e.dtype}" for e in block_scales)
    values = [e for e in m.tensors if e.value is not OMITTED]
    # an undescribable module has no logical/storage facts: '?' as before
    logical_dtype = "?" if m.logical_dtype is OMITTED else m.logical_dtype
    storage_dtype = "?" if m.storage_dtype is OMITTED else m.storage_dtype
    block = [] if m.block is OMITTED else m.block
    if isinstance(m.scale_rule, str) and m.scale_rule.endswith(" search"):  # --scale-search mse
        scales = f"{scales} ({m.scale_rule.rsplit(' + ', 1)[-1]})"
    return [m.recipe, f"{logical_dtype} {_dims(m.logical_shape)}", f"{storage_dtype} {_dims(m.storage_shape)}",
            block_label(block) if len(block) == 2 else "x".join(map(str, block)), scales or "-",
            values[0].value if values else None, _direction(block_scales, values[:1]),
            f"{m.bits_per_param:.3f}" if m.bits_per_param else "-"]


def _direction(block_scales, global_scales) -> str:
    """How the scales apply, said once: 'multiply', or each kind's where the two differ."""
    block = {e.direction for e in block_scales}
    glob = {e.direction for e in global_scales}
    if len(block | glob) <= 1:
        return next(iter(block | glob), "-")
    return f"block {'/'.join(sorted(block))}, global {'/'.join(sorted(glob))}"


# The global scale is the one column that differs within a layer pattern: a group shows its range.
# Storage follows from logical, recipe and bits/param: the first column left out where space is short.
_MODULE_COLUMNS = [Column("recipe"), Column("logical"), Column("storage", optional=True), Column("block"),
                   Column("scales"), Column("global", merge=value_range(SCALE)), Column("direction"),
                   Column("bits/param", justify="right")]


def _modules_table(modules, con: Console, per_tensor: bool) -> Table:
    return named_table(con, "module", [m.module for m in modules], [_module_cells(m) for m in modules],
                       _MODULE_COLUMNS, per_tensor=per_tensor)


def _fraction(values: list) -> str:
    present = [v for v in values if v is not None]
    return f"{max(present):.2%}" if present else "-"


def _exponents(histograms: list) -> str:
    """The E8M0 exponents (biased, as stored) the group's scales use, as a min..max range."""
    present = [int(k) for h in histograms if h for k in h]
    return f"{min(present)}..{max(present)}" if present else "-"


def _count(values: list) -> str:
    present = [v for v in values if v is not None]
    return f"{sum(present):g}" if present else "-"


def _saturation(values: list) -> str:
    """The worst share of codes at the element max, and beside it what absmax scaling saturates
    by construction (NVFP4: one code per 16-block, 6.25 %), so 11 % reads against 6.25 %."""
    present = [v for v in values if v[0] is not None]
    if not present:
        return "-"
    worst, inherent = max(present, key=lambda v: v[0])
    return f"{worst:.2%}" + (f" ({inherent:.2%} inherent)" if inherent is not None else "")


# --stats per group: the scale range over all members, counts summed, fractions at their worst.
_STATS_COLUMNS = [Column("recipe"), Column("scale range", merge=lambda v: _span(v)),
                  Column("bad scales", justify="right", merge=_count),
                  Column("E8M0 exp", merge=_exponents),
                  Column("E8M0 255", justify="right", merge=_count),
                  Column("NaN/Inf", justify="right", merge=_count),
                  Column("zero blocks (max)", justify="right", merge=_fraction),
                  Column("saturated (max)", justify="right", merge=_saturation)]
_E8M0 = ("E8M0 exp", "E8M0 255")


def _span(pairs: list) -> str:
    lows = [lo for lo, _ in pairs if lo is not None]
    highs = [hi for _, hi in pairs if hi is not None]
    return f"{SCALE.format(min(lows))}..{SCALE.format(max(highs))}" if lows and highs else "-"


def _stats_table(modules, con: Console, per_tensor: bool) -> Table:
    with_stats = [m for m in modules if m.stats is not OMITTED]

    def given(v, default=None):
        return default if v is OMITTED else v

    rows = [[m.recipe, (given(s.scale_min), given(s.scale_max)), given(s.scale_nonfinite), given(s.e8m0_histogram),
             given(s.e8m0_255_count), given(s.nonfinite_values, 0), given(s.zero_block_fraction),
             (given(s.saturated_fraction), given(s.saturated_inherent))] for s, m in ((m.stats, m) for m in with_stats)]
    keep = list(range(len(_STATS_COLUMNS)))
    if not any(m.stats.e8m0_histogram is not OMITTED for m in with_stats):  # no MX recipe: no E8M0 columns
        keep = [i for i in keep if _STATS_COLUMNS[i].header not in _E8M0]
    if not any(m.stats.scale_min is not OMITTED for m in with_stats):  # only MX recipes: no scale range
        keep = [i for i in keep if _STATS_COLUMNS[i].header not in ("scale range", "bad scales")]
    return named_table(con, "module", [m.module for m in with_stats], [[r[i] for i in keep] for r in rows],
                       [_STATS_COLUMNS[i] for i in keep], per_tensor=per_tensor, title="data (--stats)")


def _totals_table(by_format) -> Table:
    t = Table(title="totals")
    for col in ("format", "modules", "params", "bytes"):
        t.add_column(col)
    for fmt, f in sorted(by_format.items()):
        t.add_row(fmt, str(f.modules or "-"), f"{f.params:,}" if f.params else "-", human_bytes(f.bytes))
    return t


def _kv_table(kv) -> Table:
    t = Table(title=f"KV cache: {counted(kv.layers, 'layer')} x {kv.per_layer}, budget {human_bytes(kv.budget_bytes)}")
    for col in ("format", "bits/elem", "per token", "tokens in budget"):
        t.add_column(col)
    for r in kv.formats:
        t.add_row(r.format, f"{r.bits_per_element:g}", human_bytes(r.bytes_per_token), f"{r.tokens_in_budget:,}")
    return t


# One row per layer pattern, as the modules table (one per tensor with --per-tensor): a real MoE
# has thousands of input scales. The direction is part of the key; values merge to min..max.
_INPUT_COLUMNS = [Column("value", merge=value_range(SCALE)), Column("direction"),
                  Column("implied amax", merge=value_range(SCALE))]
_KV_COLUMNS = [Column("k_scale", merge=lambda v: _missing_or(value_range(SCALE), v)),
               Column("v_scale", merge=lambda v: _missing_or(value_range(SCALE), v))]


def _missing_or(merge, values: list) -> str:
    missing = sum(v is None for v in values)
    text = merge(values)
    return text if not missing else ("missing" if text == "-" else f"{text}, {missing} missing")


def _scales_tables(cal, con: Console, per_tensor: bool = False) -> None:
    """The activation scheme, the static input scales and the KV-cache scales per layer pattern."""
    con.print(f"activations: {cal.activation_scheme}"
              + (f"; FP8 KV cache declared ({cal.kv_cache})" if cal.kv_cache else ""))
    if cal.inputs:
        con.print(named_table(con, "tensor", [s.tensor for s in cal.inputs],
                              [[s.value, s.direction, s.amax] for s in cal.inputs], _INPUT_COLUMNS,
                              per_tensor=per_tensor, title="input scales"))
    if cal.kv:
        con.print(named_table(con, "attention", [r.attention for r in cal.kv], [[r.k_scale, r.v_scale] for r in cal.kv],
                              _KV_COLUMNS, per_tensor=per_tensor, title="KV-cache scales"))


def _inspect_headline(report) -> str:
    return (f"{report.source}: layout [bold]{report.layout}[/bold] (loads in {escape(report.consumers)})"
            + ("; quantcli manifest present" if report.has_manifest else ""))


def _bits_line(report) -> str:
    return (f"{counted(report.params, 'param', spec=',')} in {human_bytes(report.bytes)}: {report.bits_per_param:.3f} "
            f"bits/param, {report.size_vs_bf16:.3f}x the BF16 size")


def _inspect_problems(report, con: Console) -> None:
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


def render_inspect_brief(report, con: Console, err: Console) -> None:
    """inspect -q: the headline and bits/param on stdout; problems and warnings on stderr."""
    con.print(_inspect_headline(report))
    if report.params:
        con.print(_bits_line(report))
    _inspect_problems(report, err)


def _engines_lines(report, con: Console) -> None:
    """Each engine's verdict on the checkpoint, from quantcli/formats/engines.py (its conditions
    settled on these files; `quantcli layouts` lists the conditions, docs/formats.md the loader code)."""
    if not report.engines:
        return
    con.print("engines (checked on this checkpoint):")
    width = max(len(j.engine) for j in report.engines)
    for j in report.engines:  # wrapped under the verdict, not at the margin
        line = f"  {j.engine:<{width}}  {j.loads}" + (f": {j.reason}" if j.reason else "")
        con.print(textwrap.fill(line, width=con.width, subsequent_indent=" " * (width + 4), break_on_hyphens=False),
                  markup=False)


def render_inspect(report, con: Console, per_tensor: bool = False) -> None:
    con.print(_inspect_headline(report))
    _engines_lines(report, con)
    if report.modules:
        con.print(_modules_table(report.modules, con, per_tensor))
        if any(m.stats is not OMITTED for m in report.modules):
            con.print(_stats_table(report.modules, con, per_tensor))
    render_rounding(report, con, per_tensor)
    if report.calibrated is not OMITTED:
        _scales_tables(report.calibrated, con, per_tensor)
    con.print(_totals_table(report.by_format))
    if report.params:
        con.print(_bits_line(report))
    if report.exclusion_list:
        con.print("excluded: " + ", ".join(report.exclusion_list))
    _inspect_problems(report, con)
    if report.kv_cache is not OMITTED:
        con.print(_kv_table(report.kv_cache))


__all__ = ["console", "dense_reasons", "emit_json", "excluded_lines", "human_bytes", "plan_table", "render_inspect",
           "render_inspect_brief", "render_layouts", "render_recipes", "render_verify", "render_verify_brief"]
