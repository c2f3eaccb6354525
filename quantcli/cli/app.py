"""The command line: one Typer app, one function per command. Commands only turn result objects
into text and exit codes; the command bodies are in quantcli/cli/commands.py and the work in the
jobs below (quantcli/convert/, inspect/, verify/).

Every way a run can end goes through `main()` and quantcli/cli/exits.py, which prints at most one
line on stderr (see EXIT_CODES). Shared option types and value checks: quantcli/cli/options.py;
how usage and --help look: quantcli/cli/usage.py.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, NoReturn, Optional

import typer

from quantcli import __version__
from quantcli.checkpoint.hub import hub_access
from quantcli.cli.convert_options import (
    Activations,
    Auto,
    Backend,
    Calibration,
    CalibrationBatch,
    CalibrationSamples,
    CalibrationSeqLen,
    ConfigFile,
    DryRun,
    Ignore,
    KvCache,
    Layout,
    MaxSize,
    Overwrite,
    PerTensor,
    Quiet,
    Recipe,
    Resume,
    Rotate,
    RoundingMethod,
    ScaleRule,
    ScaleSearch,
    TargetBits,
    Verbose,
    Workers,
)
from quantcli.cli.declared_options import with_settings
from quantcli.cli.eval_options import (
    EvalBatch,
    EvalCalibration,
    EvalCheckpoint,
    EvalConfig,
    EvalData,
    EvalIgnore,
    EvalKvCache,
    EvalLayout,
    EvalQuiet,
    EvalRecipe,
    EvalReference,
    EvalRevision,
    EvalSamples,
    EvalScaleRule,
    EvalScaleSearch,
    EvalSensitivity,
    EvalSeqLen,
    EvalTop,
    EvalVerbose,
    EvalWorkers,
)
from quantcli.cli.exits import (
    ARGV,
    DESTINATION,
    EXIT_CODES,
    INTERRUPT_LINE,
    RESUME_LINE,
    STARTED,
    process_started,
    run,
    sigterm_raises_terminated,
)
from quantcli.cli.options import (
    BACKEND_NAMES,
    LAYOUT_NAMES,
    RECIPE_NAMES,
    SCALE_RULE_NAMES,
    CacheDir,
    Device,
    JsonOut,
    Revision,
    Tensors,
    Token,
)
from quantcli.cli.push_command import Private, PushRevision, PushToHub, push_command
from quantcli.cli.usage import Command, Commands, examples
from quantcli.planning.rounding import GPTQ_SETTINGS

__all__ = ["BACKEND_NAMES", "LAYOUT_NAMES", "RECIPE_NAMES", "SCALE_RULE_NAMES", "app", "main"]

app = typer.Typer(cls=Commands, add_completion=True, pretty_exceptions_enable=False, no_args_is_help=False,
                  rich_markup_mode=None, context_settings={"help_option_names": ["-h", "--help"]},
                  help="Quantize and convert Hugging Face safetensors checkpoints (FP8, MXFP8, MXFP4, NVFP4, INT8, "
                       "INT4). Run 'quantcli help COMMAND' (or 'quantcli COMMAND --help') for a command's options.",
                  epilog=EXIT_CODES)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"quantcli {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", "-V", callback=_version, is_eager=True,
                                                help="Print the version and exit.")] = False) -> None:
    """quantcli: convert, inspect and verify quantized checkpoints."""


@app.command(cls=Command, epilog=examples("convert"))
@with_settings(GPTQ_SETTINGS, after="rounding", into="gptq")
def convert(
    ctx: typer.Context,
    src: Annotated[str, typer.Argument(
        metavar="SRC", help="Source: checkpoint folder, .safetensors file or Hub repo id.")],
    dst: Annotated[Path, typer.Argument(metavar="DST", help="Destination folder (created; written atomically).")],
    recipe: Recipe = None,
    layout: Layout = None,
    ignore: Ignore = None,
    config: ConfigFile = None,
    scale_rule: ScaleRule = None, scale_search: ScaleSearch = None,
    rounding: RoundingMethod = None,
    gptq: dict | None = None,  # the --gptq-* options (planning/rounding.py GPTQ_SETTINGS), added after --rounding
    rotate: Rotate = None,
    auto: Auto = None, target_bits: TargetBits = None, max_size: MaxSize = None,
    activations: Activations = None,
    kv_cache: KvCache = None,
    calibration: Calibration = None,
    calibration_samples: CalibrationSamples = None,
    calibration_seq_len: CalibrationSeqLen = None,
    calibration_batch: CalibrationBatch = None,
    revision: Revision = None,
    device: Device = "auto",
    backend: Backend = "auto",
    dry_run: DryRun = False,
    resume: Resume = False,
    overwrite: Overwrite = False,
    per_tensor: PerTensor = False,
    quiet: Quiet = False,
    workers: Workers = 1,
    verbose: Verbose = False,
    push_to_hub: PushToHub = None, private: Private = False, push_revision: PushRevision = None,
    token: Token = None, cache_dir: CacheDir = None,
    json_out: JsonOut = False,
) -> None:
    """Quantize, re-layout or dequantize a checkpoint.

    Values are case-insensitive."""
    from quantcli.cli.commands import run_convert

    if not dry_run:
        ctx.meta[INTERRUPT_LINE] = RESUME_LINE
        ctx.meta[DESTINATION] = Path(dst).absolute()
    with hub_access(token, cache_dir):
        code = run_convert(src, dst, recipe=recipe, layout=layout, ignore=ignore or [], config=config,
                           scale_rule=scale_rule, scale_search=scale_search,
                           rounding=dict(rounding=rounding, **(gptq or {})),
                           rotate=rotate, auto=dict(auto=auto, target_bits=target_bits, max_size=max_size),
                           calibrate=dict(
                               activations=activations, kv_cache=kv_cache, calibration=calibration,
                               calibration_samples=calibration_samples, calibration_seq_len=calibration_seq_len,
                               calibration_batch=calibration_batch), revision=revision, device=device,
                           backend=backend, dry_run=dry_run, resume=resume, overwrite=overwrite, quiet=quiet,
                           json_out=json_out, per_tensor=per_tensor or verbose, verbose=verbose, workers=workers,
                           argv=ctx.meta.get(ARGV), entry=main, started=ctx.meta.get(STARTED),
                           push_to_hub=push_to_hub and dict(repo_id=push_to_hub, private=private,
                                                            revision=push_revision))
    raise typer.Exit(code)


@app.command(cls=Command, epilog=examples("inspect"))
def inspect(
    path: Annotated[str, typer.Argument(metavar="PATH", help="Checkpoint folder, .safetensors file or Hub repo id.")],
    revision: Revision = None,
    tensors: Tensors = None,
    stats: Annotated[bool, typer.Option(
        "--stats", help="Read the data: scale ranges, zero blocks, saturation, NaN/Inf.")] = False,
    kv_cache: Annotated[bool, typer.Option(
        "--kv-cache", help="Print the KV-cache byte account from config.json.")] = False,
    kv_budget: Annotated[Optional[str], typer.Option(
        metavar="SIZE", help="Memory for the KV cache in --kv-cache, e.g. 40GiB.  [default: 80GiB]")] = None,
    per_tensor: Annotated[bool, typer.Option(
        "--per-tensor", help="One row per module instead of one per layer pattern.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help=(
        "No progress bar; stdout gets only the layout and bits/param lines "
        "(problems and warnings on stderr)."))] = False,
    verbose: Annotated[bool, typer.Option(
        "--verbose", "-v", help="Per-tensor detail: one row per module (as --per-tensor).")] = False,
    token: Token = None, cache_dir: CacheDir = None,
    json_out: JsonOut = False,
) -> None:
    """Explain a checkpoint from its headers.

    Layout, recipes, scales, bits per parameter."""
    from quantcli.cli.commands import run_inspect

    with hub_access(token, cache_dir):
        code = run_inspect(path, revision=revision, tensors=tensors, stats=stats, kv_cache=kv_cache,
                           kv_budget=kv_budget, json_out=json_out, per_tensor=per_tensor or verbose, quiet=quiet)
    raise typer.Exit(code)


@app.command(cls=Command, epilog=examples("verify"))
def verify(
    quant: Annotated[str, typer.Argument(metavar="QUANT", help="The quantized checkpoint.")],
    reference: Annotated[Optional[str], typer.Option(
        metavar="SRC", help="The source checkpoint to compare against.")] = None,
    revision: Annotated[Optional[str], typer.Option(metavar="REV", help=(
        "Hub revision (branch, tag or commit) of a --reference repo id; QUANT is read as given."))] = None,
    tensors: Tensors = None,
    top: Annotated[int, typer.Option(metavar="N", min=0, help="How many worst tensors to list.")] = 10,
    exact: Annotated[bool, typer.Option(
        "--exact", help=("Re-quantize the reference and compare codes and scales byte for byte (GPTQ-rounded "
                         "modules: rerun with --calibration's data)."))] = False,
    tp: Annotated[Optional[int], typer.Option(
        metavar="N", help="Check that quantized dims split into whole blocks across N ranks.")] = None,
    threshold: Annotated[Optional[list[str]], typer.Option(
        metavar="METRIC=VALUE", help="Override a limit: METRIC=VALUE (rel_err, sqnr_db, cosine, margin).")] = None,
    calibration: Annotated[Optional[str], typer.Option(metavar="DATA", help=(
        "Rerun the calibration on --reference with this data (the manifest's amounts) "
        "and check every static activation and KV-cache scale; with --exact, rerun GPTQ."))] = None,
    device: Device = "auto",
    quiet: Annotated[bool, typer.Option(
        "--quiet", "-q", help="No progress bar; stdout gets only PASS or FAIL (each fault on stderr).")] = False,
    verbose: Annotated[bool, typer.Option(
        "--verbose", "-v", help="Per-tensor detail: every compared tensor's row, not only the --top worst.")] = False,
    token: Token = None, cache_dir: CacheDir = None,
    json_out: JsonOut = False,
) -> None:
    """Decode a quantized checkpoint and check it.

    Proves it is what it should be. Exit 0 pass, 1 fail, 2 usage."""
    from quantcli.cli.commands import run_verify

    with hub_access(token, cache_dir):  # for a --reference repo id and a --calibration Hub dataset
        code = run_verify(quant, reference=reference, revision=revision, tensors=tensors, top=top, exact=exact, tp=tp,
                          thresholds=threshold or [], device=device, json_out=json_out, calibration=calibration,
                          quiet=quiet, verbose=verbose)
    raise typer.Exit(code)


@app.command(cls=Command, epilog=examples("recipes"))
def recipes(json_out: JsonOut = False) -> None:
    """List the recipes and their formats.

    Element, block, scale format, bits per parameter, the layouts that hold each."""
    from quantcli.cli.commands import run_recipes

    raise typer.Exit(run_recipes(json_out))


@app.command(cls=Command, epilog=examples("layouts"))
def layouts(json_out: JsonOut = False) -> None:
    """List the layouts and the engines that load them.

    The engines that load each, and which recipe each layout holds (the loadability matrix)."""
    from quantcli.cli.commands import run_layouts

    raise typer.Exit(run_layouts(json_out))


@app.command(name="eval", cls=Command, epilog=examples("eval"))
def eval_command(
    ctx: typer.Context,
    checkpoint: EvalCheckpoint,
    data: EvalData,
    reference: EvalReference = None,
    samples: EvalSamples = 32, seq_len: EvalSeqLen = 256, batch: EvalBatch = 1,
    kv_cache: EvalKvCache = "auto",
    top: EvalTop = 3,
    recipe: EvalRecipe = None, layout: EvalLayout = None, ignore: EvalIgnore = None, config: EvalConfig = None,
    scale_rule: EvalScaleRule = None, scale_search: EvalScaleSearch = None,
    sensitivity: EvalSensitivity = None,
    auto: Auto = None, target_bits: TargetBits = None, max_size: MaxSize = None,
    calibration: EvalCalibration = None, calibration_samples: CalibrationSamples = None,
    calibration_seq_len: CalibrationSeqLen = None, calibration_batch: CalibrationBatch = None,
    revision: EvalRevision = None,
    device: Device = "auto",
    workers: EvalWorkers = 1,
    quiet: EvalQuiet = False,
    verbose: EvalVerbose = False,
    token: Token = None, cache_dir: CacheDir = None,
    json_out: JsonOut = False,
) -> None:
    """Measure what quantization costs the model, end to end.

    Runs the reference and the quantized checkpoint layer by layer on the same samples, emulating
    the checkpoint's weights, activations and KV cache; nothing is written. With --auto: the mix
    convert --auto would choose, emulated on DST (a dense model) and measured against it."""
    from quantcli.cli.eval_command import run_eval

    with hub_access(token, cache_dir):  # for Hub repo ids (DST, --reference) and a --data Hub dataset
        code = run_eval(checkpoint, reference=reference, data=data, samples=samples, seq_len=seq_len,
                        batch=batch, kv_cache=kv_cache, top=top, revision=revision, device=device,
                        quiet=quiet, verbose=verbose, json_out=json_out, workers=workers,
                        argv=ctx.meta.get(ARGV), entry=main, sensitivity=sensitivity,
                        emulate=dict(recipe=recipe, layout=layout, scale_rule=scale_rule, scale_search=scale_search,
                                     ignore=ignore or [], config=config),
                        auto=dict(auto=auto, target_bits=target_bits, max_size=max_size),
                        calibrate=dict(calibration=calibration, calibration_samples=calibration_samples,
                                       calibration_seq_len=calibration_seq_len, calibration_batch=calibration_batch))
    raise typer.Exit(code)


app.command(name="push", cls=Command, epilog=examples("push"))(push_command)  # quantcli/cli/push_command.py


def main(argv: Sequence[str] | None = None, started: float | None = None) -> NoReturn:
    """Run the command line and exit with its code (see EXIT_CODES). `started`: when the program
    started (time.time(); default now), where convert's summary counts its time from."""
    started = time.time() if started is None else started
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["help"]:  # `quantcli help [COMMAND]` is `quantcli [COMMAND] --help`
        args = [*args[1:], "--help"]
    with sigterm_raises_terminated():
        code = _run(args, started)
    sys.exit(code)


def entry() -> NoReturn:
    """The `quantcli` program (console script and `python -m quantcli`): main(), and once the
    command is done Ctrl-C is ignored, so that one landing while the interpreter tears down (a
    few hundred ms after a finished run printed its summary) cannot turn its exit code into 130.
    Callers that embed main() keep their own SIGINT handling."""
    try:
        main(started=process_started())  # the summary's time counts Python's and the imports' start-up
    except SystemExit:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise


def _run(args: list[str], started: float | None = None) -> int:
    return run(typer.main.get_command(app), args, started)


if __name__ == "__main__":
    main()
