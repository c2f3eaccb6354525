"""Command bodies: call the library, render tables or JSON, return the exit code."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from rich.table import Table

from .errors import QuantcliError
from .render import console as _console
from .render import emit_json, human_bytes, render_inspect, render_verify


# ---------------------------------------------------------------- convert


def run_convert(src: str, dst: Path, *, recipe: str | None, layout: str | None, ignore: list[str],
                config: Path | None, scale_rule: str | None, revision: str | None, device: str, backend: str,
                dry_run: bool, resume: bool, overwrite: bool, quiet: bool, json_out: bool,
                calibrate: dict | None = None) -> int:
    from .convert import RunOptions, check_destination, check_run_options, convert
    from .planner import plan_conversion
    from .recipe_file import conversion_options
    from .source import open_source

    opts = conversion_options(recipe=recipe, layout=layout, ignore=ignore, config=config, scale_rule=scale_rule,
                              calibrate=calibrate)
    run = RunOptions(device=device, backend=backend, resume=resume, overwrite=overwrite)
    local_src = Path(src) if Path(src).exists() else None
    if not dry_run:  # device, backend and destination problems before anything is read or written
        check_run_options(run)
        check_destination(local_src, dst, run)
    plan = plan_conversion(open_source(src, revision), opts)
    if dry_run:
        return _print_plan(plan, json_out)
    for w in plan.warnings:  # before the work starts, on stderr (stdout stays JSON with --json)
        _console(stderr=True).print(f"warning: {w}")
    if not quiet and not json_out and sys.stderr.isatty():
        result = _with_progress(lambda progress: convert(plan, dst, run, progress), plan)
    else:
        result = convert(plan, dst, run)
    for w in result.warnings[len(plan.warnings):]:  # found while finishing (the plan's were printed above)
        _console(stderr=True).print(f"warning: {w}")
    if json_out:
        emit_json(_convert_summary(plan, result))
        return 0
    _print_convert_result(plan, result, src)
    return 0


def _convert_summary(plan, result) -> dict:
    """The --json document of a finished conversion."""
    return {
        "destination": str(result.dst), "layout": plan.target, "recipes": sorted(plan.recipes),
        "tensors_quantized": result.quantized, "tensors_total": len(plan.tensors),
        "bytes_in": result.bytes_in, "bytes_out": result.bytes_out, "seconds": round(result.seconds, 3),
        "shards_written": result.shards_written, "shards_resumed": result.shards_resumed,
        "excluded": plan.excluded_names(), "warnings": result.warnings,
        "lossless": plan.lossless, "notes": result.notes,
        "requantize_rel_err_vs_decoded_source": result.requantize_errors,
        "already_complete": result.already_complete,
    }


def _print_convert_result(plan, result, src: str) -> None:
    con = _console()
    if result.already_complete:
        con.print(f"{result.dst}: already complete (a finished quantcli output of the same source headers, recipe "
                  f"and options); nothing to resume, nothing written. Use --overwrite to convert again")
        return
    if plan.lossless:
        con.print("lossless re-layout: every code and block-scale value carried over unchanged")
    for n in result.notes:
        con.print(f"note: {n}")
    if result.requantize_errors:
        errs = result.requantize_errors
        worst = max(errs, key=errs.get)
        con.print(f"re-quantized {len(errs)} modules; relative error vs the decoded source: mean "
                  f"{sum(errs.values()) / len(errs):.4g}, worst {errs[worst]:.4g} ({worst}); check it with "
                  f"`quantcli verify {shlex.quote(str(result.dst))} --reference {shlex.quote(src)}`")
    rate = result.bytes_in / max(result.seconds, 1e-9) / 1e9
    what = (f"{sum(t.action == 'dequantize' for t in plan.tensors)} modules dequantized to {plan.dense_dtype}"
            if plan.layout is None else
            f"{result.quantized} of {len(plan.tensors)} tensors quantized "
            f"({', '.join(sorted(plan.recipes)) or 'none'} -> {plan.target})")
    con.print(f"wrote {result.dst}: {what}, "
              f"{human_bytes(result.bytes_in)} -> {human_bytes(result.bytes_out)} in {result.seconds:.1f} s "
              f"({rate:.2f} GB/s)" + (f", {result.shards_resumed} shard(s) resumed" if result.shards_resumed else ""))


def _with_progress(convert, plan):
    """Run `convert(progress)` under a progress bar on stderr (bytes of the source done)."""
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    columns = [TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn()]
    with Progress(*columns, console=_console(stderr=True), transient=True) as bar:
        task = bar.add_task("converting", total=plan.bytes_in)

        def advance(n: int, shard: str) -> None:
            bar.update(task, advance=n, description=shard)

        return convert(advance)


def _print_plan(plan, json_out: bool) -> int:
    from .convert import fingerprint

    rows = []
    for t in plan.tensors:
        rows.append({"name": t.name, "shard": t.shard, "dtype": t.dtype, "shape": list(t.shape),
                     "recipe": t.recipe, "action": t.action, "bytes_in": t.bytes_in, "bytes_out": t.bytes_out,
                     "bits_per_param": round(8 * t.bytes_out / max(1, t.numel), 3),
                     "fused_group": t.fused_group, "outputs": [o.name for o in t.outputs]})
    largest = max((t.bytes_in + t.bytes_out for t in plan.tensors), default=0)
    # One source tensor, its FP32 upcast and its outputs are alive at once (plus the transposed view).
    peak = max((t.bytes_in + 4 * t.numel * 2 + t.bytes_out for t in plan.tensors if t.quantized),
               default=largest)
    params_q = plan.params(quantized=True)
    total_params = plan.params()
    doc = {"source": plan.source.label, "layout": plan.target, "recipes": sorted(plan.recipes),
           "tensors": rows, "excluded": [{"module": e.module, "reason": e.reason} for e in plan.exclusions],
           "exclusion_key": plan.layout.exclusion_key if plan.layout else None,
           "exclusion_list": plan.excluded_names() if plan.layout else [],
           "warnings": plan.warnings, "bytes_in": plan.bytes_in, "bytes_out": plan.bytes_out,
           "params": total_params, "params_quantized": params_q,
           "bits_per_param": round(8 * plan.bytes_out / max(1, total_params), 3),
           "estimated_peak_memory_bytes": peak, "fingerprint": fingerprint(plan)}
    if json_out:
        emit_json(doc)
        return 0
    con = _console()
    table = Table(title=f"plan: {plan.source.label} -> {plan.target}", show_lines=False)
    for col in ("tensor", "dtype", "shape", "recipe", "in", "out", "bits/param"):
        table.add_column(col, justify="right" if col in ("in", "out", "bits/param") else "left")
    for r in rows:
        table.add_row(r["name"], r["dtype"], "x".join(map(str, r["shape"])), r["recipe"] or "-",
                      human_bytes(r["bytes_in"]), human_bytes(r["bytes_out"]), f"{r['bits_per_param']:.2f}")
    con.print(table)
    for e in plan.exclusions:
        con.print(f"excluded {e.module}: {e.reason}")
    for w in plan.warnings:
        con.print(f"warning: {w}")
    con.print(f"total {human_bytes(plan.bytes_in)} -> {human_bytes(plan.bytes_out)}, {doc['bits_per_param']:.2f} "
              f"bits/param over {total_params:,} params ({params_q:,} quantized); estimated peak memory "
              f"{human_bytes(peak)}; nothing written (--dry-run)")
    return 0


# ---------------------------------------------------------------- inspect


def run_inspect(path: str, *, revision: str | None, tensors: str | None, stats: bool, kv_cache: bool,
                kv_budget: str | None, json_out: bool) -> int:
    from .inspect_report import inspect_checkpoint, kv_cache_account, parse_size

    if kv_budget is not None and not kv_cache:
        raise QuantcliError(f"--kv-budget {kv_budget}: only used by the KV-cache account; add --kv-cache")
    budget = parse_size("80GiB" if kv_budget is None else kv_budget)
    report = inspect_checkpoint(path, revision=revision, pattern=tensors, stats=stats)
    if kv_cache:
        report.kv_cache = kv_cache_account(report.config, budget)
    if json_out:
        emit_json(report)  # the config it read is not part of the document
    else:
        render_inspect(report, _console())
    return 0


# ---------------------------------------------------------------- verify


def run_verify(quant: str, *, reference: str | None, revision: str | None, tensors: str | None, top: int,
               exact: bool, tp: int | None, thresholds: list[str], device: str, json_out: bool,
               calibration: str | None = None) -> int:
    from .verify import parse_thresholds, verify_checkpoint

    limits = parse_thresholds(thresholds)
    if exact and reference is None:
        raise QuantcliError("--exact needs --reference SRC: it re-quantizes the reference and compares bytes")
    if tp is not None and tp < 1:
        raise QuantcliError(f"--tp {tp}: must be a positive number of ranks")
    report = verify_checkpoint(quant, reference=reference, revision=revision, pattern=tensors, exact=exact,
                               tp=tp, limits=limits, device=device, calibration=calibration)
    if json_out:
        emit_json(report)
    else:
        render_verify(report, _console(), top)
    return 0 if report.passed else 1
