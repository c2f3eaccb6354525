"""Command bodies: call the library, render tables or JSON, return the exit code."""

from __future__ import annotations

import sys
import time
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Callable

from quantcli.cli.bars import ConvertBar, PhaseBar, counting_bar
from quantcli.cli.convert_summary import convert_summary as _convert_summary
from quantcli.cli.convert_summary import print_convert_result as _print_convert_result
from quantcli.cli.name_tables import counted
from quantcli.cli.render import console as _console
from quantcli.cli.render import (
    emit_json,
    excluded_lines,
    human_bytes,
    plan_table,
    render_inspect,
    render_inspect_brief,
    render_layouts,
    render_recipes,
    render_verify,
    render_verify_brief,
)
from quantcli.cli.render_auto import print_auto_lines
from quantcli.errors import QuantcliError
from quantcli.reports import envelope, excluded_entries, to_json

# Each command imports the library parts it runs inside its body: `quantcli recipes`, a usage
# error or an inspect does not load the converter, the evaluator, transformers or huggingface_hub.

# ---------------------------------------------------------------- convert

# The dry run's peak memory: PROCESS_BYTES plus the largest quantized tensor's working set, with
# CHUNK_BYTES_PER_ELEMENT for each chunk the CPU threads quantize at once; the constants are
# measured (docs/cli.md, "The dry run's memory estimate").
PROCESS_BYTES = 340 * 2**20
CHUNK_BYTES_PER_ELEMENT = 24
# Where transformers is installed planning imports it (planning/consumer_names.py): its measured cost.
TRANSFORMERS_BYTES = 240 * 2**20


def process_bytes() -> int:
    """PROCESS_BYTES, plus TRANSFORMERS_BYTES where transformers is installed (it is then imported)."""
    return PROCESS_BYTES + (TRANSFORMERS_BYTES if find_spec("transformers") else 0)


def run_convert(src: str, dst: Path, *, recipe: str | None, layout: str | None, ignore: list[str],
                config: Path | None, scale_rule: str | None, revision: str | None, device: str, backend: str,
                scale_search: str | None = None, rounding: dict | None = None, rotate: str | None = None,
                auto: dict | None = None, dry_run: bool, resume: bool, overwrite: bool, quiet: bool, json_out: bool,
                calibrate: dict | None = None, per_tensor: bool = False, verbose: bool = False,
                workers: int = 1, argv: list[str] | None = None, push_to_hub: dict | None = None,
                entry: Callable[[list[str]], Any] | None = None,  # entry: what --workers ranks run
                started: float | None = None) -> int:  # when the process started: the summary's wall time
    from quantcli.checkpoint.source import open_source
    from quantcli.cli.launch import launched, rank_world
    from quantcli.convert import RunOptions, check_destination, check_run_options, convert
    from quantcli.planning.conversion import plan_conversion
    from quantcli.planning.options_file import conversion_options

    opts = _chosen(src, revision, conversion_options(  # a rank of torchrun or --workers: later, from rank 0
        recipe=recipe, layout=layout, ignore=ignore, config=config, scale_rule=scale_rule, calibrate=calibrate,
        scale_search=scale_search, rounding=rounding, rotate=rotate, auto=auto), device, quiet or json_out,
        later=launched() and not dry_run)
    run = RunOptions(device=device, backend=backend, resume=resume, overwrite=overwrite)
    local_src = Path(src) if Path(src).exists() else None
    hub_api = _check_push(push_to_hub, dry_run) if push_to_hub else None  # login and network before the work
    if dry_run:
        return _print_plan(plan_conversion(open_source(src, revision), opts), json_out, dst, per_tensor, device, quiet)
    check_run_options(run)  # device, backend and destination problems before anything is read or written
    plan = None
    if workers > 1 and not launched():  # refusals before any rank is spawned
        check_destination(local_src, dst, run)
        plan = plan_conversion(open_source(src, revision), opts)
        workers = _workers_for(plan, workers)
    # One process or the ranks torchrun/--workers started: rank 0 checks DST, all plan alike, rank 0 prints.
    with rank_world(device, workers, argv, entry) as world:
        run.device = world.rank_device(device)
        world.settle(lambda: check_destination(local_src, dst, run) if world.lead else None)
        opts = _chosen(src, revision, opts, run.device, quiet or json_out, world)
        plan = world.settle(lambda: plan or plan_conversion(open_source(src, revision), opts))
        for w in plan.all_warnings if world.lead else []:  # before the work starts, on stderr (stdout stays JSON)
            _console(stderr=True).print(f"warning: {w}")
        show_bar = not quiet and not json_out and sys.stderr.isatty()
        if world.lead and (show_bar or verbose):
            with ConvertBar(plan, _console(stderr=True), show_bar, verbose) as bar:
                result = convert(plan, dst, run, bar, world)
        else:
            result = convert(plan, dst, run, None, world)
    if not world.lead:
        return 0
    result.wall_seconds = time.time() - (started or time.time() - result.seconds)  # before any upload
    for w in result.warnings[len(plan.all_warnings):]:  # found while finishing (the plan's were printed above)
        _console(stderr=True).print(f"warning: {w}")
    pushed = _push(result.dst, push_to_hub, hub_api, quiet or json_out) if push_to_hub else None
    if json_out:
        emit_json({**_convert_summary(plan, result), **({"pushed": to_json(pushed)} if pushed else {})})
        return 0
    if quiet:  # the one line a script needs on stdout: where the output is
        if result.already_complete:
            _console(stderr=True).print(f"{result.dst}: already complete; nothing written")
        _console().print(str(result.dst))
        return 0
    _print_convert_result(plan, result, src, overwrite)
    return 0


def _chosen(src: str, revision: str | None, opts, device: str, quiet: bool, world=None, later: bool = False):
    """--auto's choice, before anything else (every later step plans what it chose); else `opts`.
    With `world`: the choice made once for all its ranks (auto_scores.choose_once); `later`: not
    yet (a rank that another rank hands the choice to, once their world is open)."""
    if later or opts.auto is None and (world is None or opts.auto_choice is None):
        return opts
    from quantcli.checkpoint.source import open_source
    from quantcli.evaluate.auto_scores import choose_formats, choose_once

    say = None if quiet else (lambda line: _console(stderr=True).print(line, markup=False))

    def choose(o):
        return choose_formats(open_source(src, revision), o, device, say)

    return choose(opts) if world is None else choose_once(world, opts, choose)


def _workers_for(plan, workers: int) -> int:
    """A rank per shard at most (a worker converts whole shards): more would only start idle
    processes, so run fewer and say so."""
    shards = len(plan.source.shards)
    if workers > shards:
        _console(stderr=True).print(f"warning: --workers {workers}: {plan.source.label} has {shards} shard(s), and a "
                                    f"worker converts whole shards; converting on {shards}")
    return min(workers, shards)


def _print_plan(plan, json_out: bool, dst: Path, per_tensor: bool = False, device: str = "auto",
                quiet: bool = False) -> int:
    from quantcli.convert import fingerprint

    rows = []
    for t in plan.tensors:
        rows.append({"name": t.name, "shard": t.shard, "dtype": t.dtype, "shape": list(t.shape),
                     "recipe": t.recipe, "action": t.action, "bytes_in": t.bytes_in, "bytes_out": t.bytes_out,
                     "bits_per_param": round(8 * t.bytes_out / max(1, t.numel), 3),
                     "fused_group": t.fused_group, "outputs": [o.name for o in t.outputs]})
    working_set = _working_set(plan)
    peak = process_bytes() + working_set
    params_q = plan.params(quantized=True)
    total_params = plan.params()
    doc = {"layout": plan.target, "recipes": sorted(plan.recipes),
           "tensors": rows, "excluded": excluded_entries(plan.exclusions),
           "exclusion_key": plan.layout.exclusion_key if plan.layout else None,
           "exclusion_list": plan.excluded_names() if plan.layout else [],
           "warnings": plan.all_warnings, "bytes_in": plan.bytes_in, "bytes_out": plan.bytes_out,
           "params": total_params, "params_quantized": params_q,
           "bits_per_param": round(8 * plan.bytes_out / max(1, total_params), 3),
           "estimated_peak_memory_bytes": peak, "fingerprint": fingerprint(plan)}
    calibration = _calibration_estimate(plan, device)
    doc["calibration_estimate"] = calibration.to_json() if calibration else None
    choice = plan.options.auto_choice
    doc["auto"] = choice.record() if choice is not None else None
    if json_out:  # quantcli/schemas/convert-dry-run.json
        emit_json(envelope("convert", doc, source=plan.source.label, destination=dst, dry_run=True))
        return 0
    con = _console()
    if not quiet:  # -q: only the total line on stdout, warnings on stderr
        target = f"{plan.target} layout" if plan.layout is not None else plan.target  # a layout, or a dense dtype
        con.print(plan_table(rows, f"plan: {plan.source.label} -> {dst} ({target})", con, per_tensor))
        for line in excluded_lines(plan.exclusions, per_tensor):
            con.print(line)
    for w in plan.all_warnings:
        (_console(stderr=True) if quiet else con).print(f"warning: {w}")
    if choice is not None and not quiet:
        print_auto_lines(con, choice)
    con.print(f"total {human_bytes(plan.bytes_in)} -> {human_bytes(plan.bytes_out)}, {doc['bits_per_param']:.2f} "
              f"bits/param over {counted(total_params, 'param', spec=',')} ({params_q:,} quantized); estimated peak "
              f"memory "
              f"{human_bytes(peak)} (process {human_bytes(process_bytes())} + largest tensor's working set "
              f"{human_bytes(working_set)}); nothing written (--dry-run)")
    if calibration:
        c = calibration
        where = "memory-mapped from a temporary file" if c.spilled else "in memory"
        con.print(f"calibration: {counted(c.samples, 'sample')}, {counted(c.tokens, 'token', spec=',')} through "
                  f"{counted(c.layers, 'layer')}; estimated peak "
                  f"memory {human_bytes(c.peak_memory_bytes)} (largest layer {human_bytes(c.layer_weight_bytes)} in "
                  f"FP32, activations {human_bytes(c.activation_bytes)} {where}), about {c.seconds:.0f} s at "
                  f"{c.measured_flops_per_s / 1e9:.0f} GFLOP/s (FP32 matmul measured here)"
                  + (f"; GPTQ's statistics and solve {human_bytes(c.rounding_bytes)} of it" if c.rounding_bytes
                     else ""))
    return 0


def _working_set(plan) -> int:
    """The largest tensor's working set (see PROCESS_BYTES): a copied tensor's bytes in and out,
    a quantized one's with its FP32 decode (quantized source) and the chunks quantized at once."""
    import torch

    from quantcli.kernels.chunks import CHUNK_ELEMENTS

    def one(t) -> int:
        chunks = -(-t.numel // CHUNK_ELEMENTS)
        at_once = min(max(1, torch.get_num_threads()), chunks) * min(t.numel, CHUNK_ELEMENTS)
        decoded = 4 * t.numel if t.source_recipe is not None else 0
        return t.bytes_in + t.bytes_out + decoded + CHUNK_BYTES_PER_ELEMENT * at_once

    largest = max((t.bytes_in + t.bytes_out for t in plan.tensors), default=0)
    return max((one(t) for t in plan.tensors if t.quantized), default=largest)


def _calibration_estimate(plan, device: str):
    """What the calibration pass will cost (None without --calibration, or when --auto's scores,
    already taken, are all the data was for)."""
    from quantcli.calibrate.scales import needs_walk

    opts = plan.options
    if opts.calibration is None or (opts.auto_choice is not None and not needs_walk(plan)
                                    and not opts.rounding.data_aware):
        return None
    from quantcli.calibrate.estimate import estimate
    from quantcli.convert import resolve_device

    return estimate(plan, resolve_device(device))


# ---------------------------------------------------------------- inspect


def run_inspect(path: str, *, revision: str | None, tensors: str | None, stats: bool, kv_cache: bool,
                kv_budget: str | None, json_out: bool, per_tensor: bool = False, quiet: bool = False) -> int:
    from quantcli.inspect import account_kv_cache, inspect_checkpoint, parse_size

    if kv_budget is not None and not kv_cache:
        raise QuantcliError(f"--kv-budget {kv_budget}: only used by the KV-cache account; add --kv-cache")
    budget = parse_size("80GiB" if kv_budget is None else kv_budget)
    show_bar = stats and sys.stderr.isatty() and not json_out and not quiet
    context, advance = counting_bar(_console(stderr=True), show_bar, "reading")
    with context:
        report = inspect_checkpoint(path, revision=revision, pattern=tensors, stats=stats, progress=advance)
    if kv_cache:  # an encoder gets a warning instead: it caches nothing
        account_kv_cache(report, budget)
    if json_out:  # the config it read is not part of the document; quantcli/schemas/inspect.json
        emit_json(envelope("inspect", report, source=report.source,
                           excluded=[{"module": m, "reason": "in the config's exclusion list"}
                                     for m in report.exclusion_list]))
    elif quiet:
        render_inspect_brief(report, _console(), _console(stderr=True))
    else:
        render_inspect(report, _console(), per_tensor)
    return 0


# ---------------------------------------------------------------- verify


def run_verify(quant: str, *, reference: str | None, revision: str | None, tensors: str | None, top: int,
               exact: bool, tp: int | None, thresholds: list[str], device: str, json_out: bool,
               calibration: str | None = None, quiet: bool = False, verbose: bool = False) -> int:
    from quantcli.verify import parse_thresholds, verify_checkpoint

    limits = parse_thresholds(thresholds)
    if exact and reference is None:
        raise QuantcliError("--exact needs --reference SRC: it re-quantizes the reference and compares bytes")
    if tp is not None and tp < 1:
        raise QuantcliError(f"--tp {tp}: must be a positive number of ranks")
    with PhaseBar(_console(stderr=True), sys.stderr.isatty() and not json_out and not quiet, "verifying") as bar:
        report = verify_checkpoint(quant, reference=reference, revision=revision, pattern=tensors, exact=exact,
                                   tp=tp, limits=limits, device=device, calibration=calibration, progress=bar)
    if json_out:  # verify DST --reference SRC: the same source and destination as convert SRC DST
        emit_json(envelope("verify", report, source=reference, destination=quant,
                           thresholds=applied_thresholds(limits)))
    elif quiet:
        render_verify_brief(report, _console(), _console(stderr=True))
    else:
        render_verify(report, _console(), len(report.tensors) if verbose else top)
    return 0 if report.passed else 1


def applied_thresholds(limits) -> dict:
    """verify's tolerance as applied: the margin over quantcli's own error (--threshold margin=,
    for every module), else the rule in words: no such margin, each module judged as a rounding
    of the reference (verify/judge.py), and the size rule of verify/limits.py on the two
    quantizations' errors of a module re-quantized from a quantized source (verify/compare.py);
    and the absolute limits (null: not set)."""
    from quantcli.verify.judge import ERROR_FACTOR, OUTPUT_MARGIN
    from quantcli.verify.limits import TOLERANCE_FLOOR, TOLERANCE_NOISE

    rule = (f"none over quantcli's own error: a module must be a rounding of the reference to its stored scales "
            f"(error at most {ERROR_FACTOR:g} x the most rounding gives, or with --calibration a layer-output error "
            f"at most {OUTPUT_MARGIN:.0%} above that of rounding to those scales); a module re-quantized from a "
            f"quantized source: both quantizations' errors x (1 + {TOLERANCE_FLOOR:g} + {TOLERANCE_NOISE:g} / "
            f"sqrt(max(1, numel / 128)))")
    return {"margin": limits.margin, "margin_rule": rule if limits.margin is None else None,
            "rel_err": limits.rel_err, "sqnr_db": limits.sqnr_db, "cosine": limits.cosine}


# ---------------------------------------------------------------- recipes, layouts


def run_recipes(json_out: bool) -> int:
    from quantcli.formats.catalog import recipes

    infos = recipes()
    if json_out:  # quantcli/schemas/recipes.json
        from quantcli.formats.schemes import scheme_infos

        emit_json(envelope("recipes", {"recipes": infos, "llm_compressor": scheme_infos()}))
    else:
        render_recipes(infos, _console())
    return 0


def run_layouts(json_out: bool) -> int:
    from quantcli.formats.catalog import layouts, loadability

    infos = layouts()
    if json_out:
        emit_json(envelope("layouts", {"layouts": infos, "loadability": loadability(infos)}))  # schemas/layouts.json
    else:
        render_layouts(infos, loadability(infos), _console())
    return 0


# ---------------------------------------------------------------- push


def _check_push(hub: dict, dry_run: bool = False):
    if dry_run:
        raise QuantcliError("--push-to-hub with --dry-run: a dry run writes nothing to push; drop one of them")
    from quantcli.cli.push import check_can_push

    return check_can_push(hub["repo_id"])


def _push(folder: Path, hub: dict, api, quiet: bool):
    from quantcli.cli.push import push

    # huggingface_hub shows its own upload progress on stderr
    pushed = push(folder, hub["repo_id"], private=hub["private"], revision=hub["revision"], api=api)
    if not quiet:
        _console(stderr=True).print(f"pushed {pushed.files} files ({human_bytes(pushed.bytes)}) to {pushed.url}")
    return pushed
