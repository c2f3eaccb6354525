"""`quantcli eval`'s body: the option checks, the ranks, the report on the terminal or as JSON;
and `eval SRC --auto R1,R2 --target-bits B --calibration DATA`, the preview of convert --auto:
the choice convert would make (the same function on the same options and scores), then that
mix emulated on SRC and measured against SRC, with the choice's predicted error beside the
measured one. Nothing is written."""

from __future__ import annotations

import sys
from typing import Any, Callable

from quantcli.cli.render import console as _console
from quantcli.cli.render import emit_json
from quantcli.cli.render_auto import print_auto_lines
from quantcli.errors import QuantcliError
from quantcli.reports import OMITTED, envelope


def run_eval(checkpoint: str, *, reference: str | None, data: str, samples: int, seq_len: int, batch: int,
             kv_cache: str, top: int, revision: str | None, device: str, quiet: bool, verbose: bool, json_out: bool,
             emulate: dict, sensitivity: str | None = None, workers: int = 1, argv: list[str] | None = None,
             entry: Callable[[list[str]], Any] | None = None, auto: dict | None = None,
             calibrate: dict | None = None) -> int:
    from quantcli.cli.eval_view import LayerBar
    from quantcli.cli.launch import rank_world
    from quantcli.evaluate import ALL, EvalOptions, evaluate

    planned = auto_options(emulate, auto or {}, calibrate or {}, reference)
    _check_sides(emulate, reference, planned is not None)
    opts = EvalOptions(checkpoint, reference or checkpoint, data, samples=samples, seq_len=seq_len, batch=batch,
                       device=device, kv_cache=kv_cache, revision=revision, top=top,
                       sensitivity=ALL if sensitivity == "all" else int(sensitivity or 0), **emulate)
    # One process, or the ranks --workers / torchrun started: each walks its share of the batches,
    # rank 0 shows the progress of its own share and prints the merged report.
    with rank_world(device, workers, argv, entry) as world:
        opts.device = world.rank_device(device)
        if planned is not None:  # --auto: rank 0 scores and chooses, the other ranks receive the choice
            opts.planned = _choose(world, planned, checkpoint, revision, opts.device, quiet or json_out)
        show = sys.stderr.isatty() and not quiet and not json_out and world.lead
        with LayerBar(_console(stderr=True), show, verbose and world.lead) as bar:
            report = evaluate(opts, bar, world)
    if not world.lead:
        return 0
    if opts.planned is not None:
        report.auto = preview(opts.planned, report)
        report.notes.extend(not_emulated(opts.planned))
    _show(report, quiet, json_out, top, opts.planned.auto_choice if opts.planned is not None else None)
    return 0


def _check_sides(emulate: dict, reference: str | None, auto: bool) -> None:
    """What DST is measured against: --reference SRC, or DST itself with a recipe emulated on it."""
    emulating = auto or emulate["recipe"] or emulate["config"]
    if emulating and reference:
        given = "--auto" if auto else "--recipe" if emulate["recipe"] else "--config"
        raise QuantcliError(f"{given} with --reference: {given} emulates a recipe on DST itself (a dense model, "
                            f"its own reference); drop one of them")
    if not emulating and not reference:
        given = [f"--{k.replace('_', '-')}" for k, v in emulate.items() if v]
        raise QuantcliError(f"{' '.join(given) + ' need --recipe or --config; ' if given else ''}give --reference "
                            f"SRC (the model DST was made from), or --recipe RECIPE (or --config FILE) to emulate a "
                            f"recipe on DST in memory")


def auto_options(emulate: dict, auto: dict, calibrate: dict, reference: str | None):
    """The conversion options of `eval --auto` before the choice, read exactly as convert reads
    them (conversion_options: the same refusals, the --config file's auto keys); None: no --auto."""
    from quantcli.planning.options_file import conversion_options

    given = [k for k, v in {**auto, **calibrate}.items() if v is not None]
    if not given and emulate["config"] is None:
        return None
    if reference and auto.get("auto") is not None:  # before the options' own checks: the pairing is what is wrong
        raise QuantcliError("--auto with --reference: --auto previews its choice emulated on DST itself (a dense "
                            "model, its own reference); drop --reference")
    if auto.get("auto") is None and emulate["config"] is None and calibrate.get("calibration") is not None:
        _calibration_alone(calibrate)
    opts = conversion_options(recipe=emulate["recipe"], layout=emulate["layout"], ignore=emulate["ignore"],
                              config=emulate["config"], scale_rule=emulate["scale_rule"],
                              scale_search=emulate["scale_search"], calibrate=calibrate, auto=auto)
    if opts.auto is not None:
        return opts
    if calibrate.get("calibration") is not None:
        _calibration_alone(calibrate)
    return None


def _calibration_alone(calibrate: dict) -> None:
    raise QuantcliError(f"--calibration {calibrate['calibration']}: eval uses it only with --auto R1,R2 (the data "
                        f"the choice is scored on; the measurement runs on --data); add --auto or drop it")


def _choose(world, opts, checkpoint: str, revision: str | None, device: str, quiet: bool):
    """The choice convert --auto makes on these options (choose_formats), once for all ranks."""
    from quantcli.checkpoint.source import open_source
    from quantcli.evaluate.auto_scores import choose_formats, choose_once

    say = None if quiet else (lambda line: _console(stderr=True).print(line, markup=False))
    return choose_once(world, opts, lambda o: choose_formats(open_source(checkpoint, revision), o, device, say))


def preview(planned, report) -> dict:
    """The choice (convert --dry-run's record) and its predicted error beside the one measured:
    the scores' metric on --data (KL mean for a causal LM, 1 - pooled cosine mean for an encoder)."""
    choice = planned.auto_choice
    causal = report.causal is not OMITTED
    measured = report.causal.kl_mean if causal else 1.0 - report.encoder.cosine_mean
    return {"metric": "kl_mean" if causal else "1 - cosine_mean", "predicted_error": choice.predicted_error,
            "measured_error": measured, "choice": choice.record()}


def not_emulated(planned) -> list[str]:
    """What the conversion would do that the preview does not (the choice does not depend on it)."""
    said = [what for what, on in (("GPTQ rounding (the preview rounds to nearest, as the scores do)",
                                   planned.rounding.data_aware), ("--rotate", planned.rotate),
                                  ("static activation scales", planned.activations),
                                  ("the FP8 KV cache", planned.kv_cache)) if on]
    return [f"--auto: not emulated: {', '.join(said)}; the conversion's own output measures it "
            f"(eval DST --reference SRC)"] if said else []


def _show(report, quiet: bool, json_out: bool, top: int, choice) -> None:
    from quantcli.cli.eval_view import render_eval, render_eval_brief
    from quantcli.evaluate.sides import MISMATCH_TAIL

    auto = report.auto if report.auto is not OMITTED else None
    if quiet or json_out:  # the notes are in the table (and the JSON); this one must not go unseen
        for note in report.notes:
            if note.endswith(MISMATCH_TAIL):
                _console(stderr=True).print(f"warning: {note}")
    if json_out:  # quantcli/schemas/eval.json
        emit_json(envelope("eval", report, source=report.reference))
        return
    con = _console()
    if quiet:
        render_eval_brief(report, con, f"  predicted {auto['predicted_error']:.4g}" if auto else "")
        return
    if choice is not None:
        print_auto_lines(con, choice)
    render_eval(report, con, top)
    if auto:
        con.print(f"auto: measured {auto['metric']} {auto['measured_error']:.6g} on --data, predicted "
                  f"{auto['predicted_error']:.6g} on --calibration (the sum of each module's error alone "
                  f"quantized: an additive model)", markup=False, highlight=False)
