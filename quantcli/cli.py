"""The command line: one Typer app, one function per command. Commands only turn result objects
into text and exit codes; the work lives in convert.py, inspect.py and verify.py.

Every way a run can end goes through `main()`, which prints at most one line on stderr:
usage mistakes and bad input exit 2, bugs exit 3, Ctrl-C 130 and SIGTERM 143; tracebacks only
with QUANTCLI_DEBUG=1.
"""

from __future__ import annotations

import difflib
import errno
import os
import re
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, NoReturn, Optional

import typer
import typer.core

from . import __version__
from .errors import QuantcliError, UsageError, did_you_mean, pick
from .hub_command import Private, PushRevision, PushToHub, push_command

try:  # newer typer carries its own copy of click and raises that copy's exception classes
    from typer._click import exceptions as click_errors
except ImportError:  # older typer raises click's own
    from click import exceptions as click_errors

# Names shown in --help. They are written out here because the registries they come from import
# torch (1-2 s), which --help and --version should not wait for; values are checked against the
# registries themselves, and tests/test_faults_cli.py checks that these lists equal them.
RECIPE_NAMES = ("fp8", "fp8-channel", "fp8-block", "mxfp8", "mxfp4", "nvfp4", "int8-channel", "bf16", "fp16", "fp32")
LAYOUT_NAMES = ("modelopt", "compressed-tensors", "fp8", "gpt-oss")
BACKEND_NAMES = ("auto", "torch", "triton")
SCALE_RULE_NAMES = ("floor", "even", "rceil")

EXIT_CODES = ("Exit codes: 0 done (verify: passed), 1 verify found a problem, 2 bad input or usage, "
              "3 internal error (a bug: please report it), 130 interrupted (143 on SIGTERM).")

# Key in the click context's meta (shared by every nested context): the line printed when the
# run is interrupted or runs out of disk. `convert` sets it, because its staging folder is kept.
INTERRUPT_LINE = "quantcli.interrupt_line"
RESUME_LINE = "interrupted; rerun with --resume to continue"
ARGV = "quantcli.argv"  # key in the context's meta: the arguments main() was given


class _Commands(typer.core.TyperGroup):
    """The top-level group, with one-line messages for a missing or misspelled command."""

    def _visible(self, ctx) -> list[str]:
        return [name for name in self.list_commands(ctx) if not self.get_command(ctx, name).hidden]

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        if not args:
            raise UsageError(f"missing command; choose one of: {', '.join(self._visible(ctx))} "
                             f"(see '{ctx.command_path} --help')")
        return super().parse_args(ctx, args)

    def resolve_command(self, ctx, args: list[str]):
        name = args[0] if args else ""
        if name and not name.startswith("-") and self.get_command(ctx, name) is None:
            commands = self._visible(ctx)
            raise UsageError(f"no such command {name!r}{did_you_mean(name, commands)} "
                             f"(commands: {', '.join(commands)}; see '{ctx.command_path} --help')")
        return super().resolve_command(ctx, args)


class _WordArgument(typer.core.TyperArgument):
    """An argument shown as its word, SRC or [SRC], without typer's {SRC} and <str>."""

    def _usage_display_name(self) -> str:
        return self.display_name_raw if self.required else f"[{self.display_name_raw}]"

    def display_type_rich(self, ctx) -> None:
        return None


class _Command(typer.core.TyperCommand):
    """A command whose arguments are shown as words (see _WordArgument)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for p in self.params:
            if type(p) is typer.core.TyperArgument:
                p.__class__ = _WordArgument


app = typer.Typer(cls=_Commands, add_completion=True, pretty_exceptions_enable=False, no_args_is_help=False,
                  rich_markup_mode=None, context_settings={"help_option_names": ["-h", "--help"]},
                  help="Quantize and convert Hugging Face safetensors checkpoints (FP8, MXFP8, MXFP4, NVFP4). "
                       "Run 'quantcli help COMMAND' (or 'quantcli COMMAND --help') for a command's options.",
                  epilog=EXIT_CODES)


# ---------------------------------------------------------------- option values


def _recipe_names() -> list[str]:
    from .recipes import DENSE_RECIPES, RECIPES

    return [*RECIPES, *DENSE_RECIPES]


def _layout_names() -> list[str]:
    from .layouts import LAYOUTS

    return list(LAYOUTS)


def _backend_names() -> list[str]:
    from quantcli.kernels import BACKENDS

    return list(BACKENDS)


def _scale_rule_names() -> list[str]:
    from quantcli.kernels.spec import SCALE_RULES

    return list(SCALE_RULES)


def _one_of(option: str, kind: str, names: Callable[[], list[str]]) -> Callable[[Optional[str]], Optional[str]]:
    """A parse callback: the value matched case-insensitively against the registry's names."""

    def check(value: Optional[str]) -> Optional[str]:
        return None if value is None else pick(option, kind, value, names())

    return check


def _device(value: str) -> str:
    """auto, cpu, cuda or cuda:N (whether CUDA is there is checked when the device is opened)."""
    if re.fullmatch(r"auto|cpu|cuda(:\d+)?", value.lower()):
        return value.lower()
    raise UsageError(f"--device {value!r}: not a device{did_you_mean(value, ['auto', 'cpu', 'cuda'])} "
                     "(use auto, cpu, cuda or cuda:N)")


Revision = Annotated[Optional[str], typer.Option(metavar="REV", help="Hub revision (branch, tag or commit) of a repo id.")]
JsonOut = Annotated[bool, typer.Option("--json", help="Print a machine-readable JSON document instead of tables.")]
Tensors = Annotated[Optional[str], typer.Option(metavar="PATTERN", help="Only tensors/modules matching PATTERN: a name, a parent module, a glob or re:REGEX.")]
Device = Annotated[str, typer.Option(metavar="DEVICE", callback=_device, help="auto, cpu, cuda or cuda:N.")]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"quantcli {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="Print the version and exit.")] = False) -> None:
    """quantcli: convert, inspect and verify quantized checkpoints."""


@app.command(cls=_Command)
def convert(
    ctx: typer.Context,
    src: Annotated[str, typer.Argument(metavar="SRC", help="Source: checkpoint folder, .safetensors file or Hub repo id.")],
    dst: Annotated[Path, typer.Argument(metavar="DST", help="Destination folder (created; written atomically).")],
    recipe: Annotated[Optional[str], typer.Option(
        metavar="RECIPE", callback=_one_of("--recipe", "recipe", _recipe_names),
        help=f"One of: {', '.join(RECIPE_NAMES)} (bf16/fp16/fp32 dequantize a quantized source).")] = None,
    layout: Annotated[Optional[str], typer.Option(
        metavar="LAYOUT", callback=_one_of("--layout", "layout", _layout_names),
        help=f"One of: {', '.join(LAYOUT_NAMES)} (default per recipe).")] = None,
    ignore: Annotated[Optional[list[str]], typer.Option(metavar="PATTERN", help="Leave modules matching PATTERN unquantized: a name, a parent module, a glob or re:REGEX (repeatable).")] = None,
    config: Annotated[Optional[Path], typer.Option(metavar="FILE", help="TOML recipe file: recipe, layout, scale_rule, scale_search, targets, ignore, [[override]].")] = None,
    scale_rule: Annotated[Optional[str], typer.Option(
        metavar="RULE", callback=_one_of("--scale-rule", "MX scale rule", _scale_rule_names),
        help=f"MX scale exponent rule: {', '.join(SCALE_RULE_NAMES)} (default: the layout's producer).")] = None,
    scale_search: Annotated[Optional[str], typer.Option(metavar="METHOD", callback=_one_of("--scale-search", "scale search", lambda: ["none", "mse"]), help="none: absmax block scales; mse: per block the scale code with the smallest error (nvfp4, mxfp4, mxfp8; activation-weighted with --calibration).")] = None,
    activations: Annotated[Optional[str], typer.Option(
        metavar="MODE", callback=_one_of("--activations", "activation scheme", lambda: ["static", "dynamic"]),
        help="static: calibrated activation scales (nvfp4 W4A4, fp8); needs --calibration.")] = None,
    kv_cache: Annotated[Optional[str], typer.Option(
        metavar="DTYPE", callback=_one_of("--kv-cache", "KV-cache dtype", lambda: ["fp8", "none"]),
        help="fp8: write calibrated k_scale/v_scale; needs --calibration.")] = None,
    calibration: Annotated[Optional[str], typer.Option(metavar="DATA", help="Calibration samples: .txt or .jsonl (text, messages or input_ids).")] = None,
    calibration_samples: Annotated[Optional[int], typer.Option(metavar="N", help="Samples to use.  [default: 128]")] = None,
    calibration_seq_len: Annotated[Optional[int], typer.Option(metavar="L", help="Tokens per sample, at most.  [default: 512]")] = None,
    calibration_batch: Annotated[Optional[int], typer.Option(metavar="B", help="Samples per forward.  [default: 1]")] = None,
    revision: Revision = None,
    device: Device = "auto",
    backend: Annotated[str, typer.Option(
        metavar="BACKEND", callback=_one_of("--backend", "backend", _backend_names),
        help=f"One of: {', '.join(BACKEND_NAMES)} (auto: Triton on CUDA).")] = "auto",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan and write nothing.")] = False,
    resume: Annotated[bool, typer.Option("--resume", help="Continue an interrupted run with the same inputs.")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a non-empty destination.")] = False,
    per_tensor: Annotated[bool, typer.Option("--per-tensor", help="--dry-run: one row per tensor instead of one per layer pattern.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar; stdout gets only the destination path (errors and warnings go to stderr).")] = False,
    workers: Annotated[int, typer.Option(metavar="N", min=1, help="Convert on N processes on this machine (torch.distributed; under torchrun the ranks come from torchrun).")] = 1,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Per-tensor detail: each tensor as it is written (stderr), the dry run per tensor.")] = False,
    push_to_hub: PushToHub = None, private: Private = False, push_revision: PushRevision = None,
    json_out: JsonOut = False,
) -> None:
    """Quantize (or re-layout, or dequantize) a checkpoint. Values are case-insensitive."""
    from .commands import run_convert

    if not dry_run:
        ctx.meta[INTERRUPT_LINE] = RESUME_LINE
    code = run_convert(src, dst, recipe=recipe, layout=layout, ignore=ignore or [], config=config,
                       scale_rule=scale_rule, scale_search=scale_search, calibrate=dict(
                           activations=activations, kv_cache=kv_cache, calibration=calibration,
                           calibration_samples=calibration_samples, calibration_seq_len=calibration_seq_len,
                           calibration_batch=calibration_batch), revision=revision, device=device, backend=backend,
                       dry_run=dry_run, resume=resume, overwrite=overwrite, quiet=quiet, json_out=json_out,
                       per_tensor=per_tensor or verbose, verbose=verbose, workers=workers, argv=ctx.meta.get(ARGV),
                       push_to_hub=push_to_hub and dict(repo_id=push_to_hub, private=private, revision=push_revision))
    raise typer.Exit(code)


@app.command(cls=_Command)
def inspect(
    path: Annotated[str, typer.Argument(metavar="PATH", help="Checkpoint folder, .safetensors file or Hub repo id.")],
    revision: Revision = None,
    tensors: Tensors = None,
    stats: Annotated[bool, typer.Option("--stats", help="Read the data: scale ranges, zero blocks, saturation, NaN/Inf.")] = False,
    kv_cache: Annotated[bool, typer.Option("--kv-cache", help="Print the KV-cache byte account from config.json.")] = False,
    kv_budget: Annotated[Optional[str], typer.Option(metavar="SIZE", help="Memory for the KV cache in --kv-cache, e.g. 40GB.  [default: 80GiB]")] = None,
    per_tensor: Annotated[bool, typer.Option("--per-tensor", help="One row per module instead of one per layer pattern.")] = False,
    json_out: JsonOut = False,
) -> None:
    """Explain a checkpoint from its headers: layout, recipes, scales, bits per parameter."""
    from .commands import run_inspect

    raise typer.Exit(run_inspect(path, revision=revision, tensors=tensors, stats=stats, kv_cache=kv_cache,
                                 kv_budget=kv_budget, json_out=json_out, per_tensor=per_tensor))


@app.command(cls=_Command)
def verify(
    quant: Annotated[str, typer.Argument(metavar="QUANT", help="The quantized checkpoint.")],
    reference: Annotated[Optional[str], typer.Option(metavar="SRC", help="The source checkpoint to compare against.")] = None,
    revision: Revision = None,
    tensors: Tensors = None,
    top: Annotated[int, typer.Option(metavar="N", min=0, help="How many worst tensors to list.")] = 10,
    exact: Annotated[bool, typer.Option("--exact", help="Re-quantize the reference and compare codes and scales byte for byte.")] = False,
    tp: Annotated[Optional[int], typer.Option(metavar="N", help="Check that quantized dims split into whole blocks across N ranks.")] = None,
    threshold: Annotated[Optional[list[str]], typer.Option(metavar="METRIC=VALUE", help="Override a limit: METRIC=VALUE (rel_err, sqnr_db, cosine, margin).")] = None,
    calibration: Annotated[Optional[str], typer.Option(metavar="DATA", help="Rerun the calibration on --reference with this data (the manifest's amounts) and check every static activation and KV-cache scale.")] = None,
    device: Device = "auto",
    json_out: JsonOut = False,
) -> None:
    """Decode a quantized checkpoint and prove it is what it should be. Exit 0 pass, 1 fail, 2 usage."""
    from .commands import run_verify

    raise typer.Exit(run_verify(quant, reference=reference, revision=revision, tensors=tensors, top=top,
                                exact=exact, tp=tp, thresholds=threshold or [], device=device, json_out=json_out,
                                calibration=calibration))


@app.command(cls=_Command)
def recipes(json_out: JsonOut = False) -> None:
    """List the recipes: element, block, scale format, bits per parameter, the layouts that hold each."""
    from .commands import run_recipes

    raise typer.Exit(run_recipes(json_out))


@app.command(cls=_Command)
def layouts(json_out: JsonOut = False) -> None:
    """List the layouts, the engines that load each, and which recipe each layout holds (the loadability matrix)."""
    from .commands import run_layouts

    raise typer.Exit(run_layouts(json_out))


app.command(name="push")(push_command)  # quantcli/hub_command.py
# ---------------------------------------------------------------- the one error path


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Run the command line and exit with its code (see EXIT_CODES)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["help"]:  # `quantcli help [COMMAND]` is `quantcli [COMMAND] --help`
        args = [*args[1:], "--help"]
    with _sigterm_raises_terminated():
        code = _run(args)
    sys.exit(code)


def _run(args: list[str]) -> int:
    command = typer.main.get_command(app)
    ctx = None
    try:
        ctx = command.make_context("quantcli", args)
        ctx.meta[ARGV] = list(args)  # the command line --workers ranks run again
        with ctx:
            result = command.invoke(ctx)
        sys.stdout.flush()  # a closed pipe shows up here, not in interpreter shutdown
        return result if isinstance(result, int) else 0
    except typer.Exit as exc:  # --help, --version and every command's own exit code
        sys.stdout.flush()
        return exc.exit_code
    except click_errors.UsageError as exc:  # unknown option, missing argument, --top abc
        return _fail(_usage_message(exc), 2)
    except QuantcliError as exc:
        if _debug():
            raise
        return _fail(str(exc), exc.exit_code)
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (errors.Terminated)
        line = ctx.meta.get(INTERRUPT_LINE, "interrupted") if ctx is not None else "interrupted"
        return _fail(line, getattr(exc, "exit_code", 130), prefix="")
    except BrokenPipeError:  # stdout piped into `head` that has stopped reading: end quietly
        _discard_stdout()
        return 128 + signal.SIGPIPE
    except OSError as exc:  # the file system said no where no check turned it into a QuantcliError
        if _debug():
            raise
        return _fail(_os_error_message(exc, resumable=ctx is not None and INTERRUPT_LINE in ctx.meta), 2)
    except typer.Abort:
        return _fail("aborted", 130, prefix="")
    except Exception as exc:  # a bug: say so in one line, the traceback only on request
        if _debug():
            raise
        return _fail(f"internal error: {type(exc).__name__}: {exc} "
                     "(rerun with QUANTCLI_DEBUG=1 for the traceback and report it)", 3)


def _debug() -> bool:
    return bool(os.environ.get("QUANTCLI_DEBUG"))


def _fail(message: str, code: int, prefix: str = "error: ") -> int:
    print(prefix + " ".join(message.split()), file=sys.stderr)
    return code


def _usage_message(exc: click_errors.UsageError) -> str:
    command = exc.ctx.command_path if exc.ctx is not None else "quantcli"
    if isinstance(exc, click_errors.NoSuchOption):
        # click's own difflib matches among the options, the closest first
        near = difflib.get_close_matches(exc.option_name, sorted(exc.possibilities or []), n=3, cutoff=0)
        text = f"no such option {exc.option_name} for '{command}'"
        text += f"; did you mean {' or '.join(near)}?" if near else ""
    else:
        text = exc.format_message().rstrip(".")
        text = text[:1].lower() + text[1:]
    return f"{text} (see '{command} --help')"


# errno -> what to add to the OS's own text, where that text leaves the cause unclear.
_ERRNO_HINTS = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "over the file-size limit, see ulimit -f",
}


def _os_error_message(exc: OSError, resumable: bool) -> str:
    text = str(exc.strerror or exc)
    if exc.filename is not None:  # None where the OS call had only a file descriptor
        where = exc.filename if exc.filename2 is None else f"{exc.filename} -> {exc.filename2}"
        text = f"{where}: {text}"
    if exc.errno in _ERRNO_HINTS:
        text += f" ({_ERRNO_HINTS[exc.errno]})"
        if resumable:
            text += "; once fixed, rerun with --resume to continue"
    return text


def _discard_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not fail a second time."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout replaced by a test harness: nothing to do
        pass


@contextmanager
def _sigterm_raises_terminated() -> Iterator[None]:
    """SIGTERM raises errors.Terminated (a KeyboardInterrupt) so that it runs the Ctrl-C path."""
    from .errors import Terminated

    def raise_terminated(signum, frame):
        raise Terminated()

    try:
        previous = signal.signal(signal.SIGTERM, raise_terminated)
    except ValueError:  # not the main thread (an embedding caller): leave signals alone
        previous = None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    main()
