"""The command line: one Typer app, one function per command. Commands only turn result objects
into text and exit codes; the work lives in convert.py, inspect.py and verify.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from . import __version__
from .errors import QuantcliError

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Quantize and convert Hugging Face safetensors checkpoints (FP8, MXFP8, MXFP4, NVFP4).")

RECIPE_NAMES = ["fp8", "fp8-channel", "fp8-block", "mxfp8", "mxfp4", "nvfp4", "bf16", "fp16", "fp32"]
LAYOUT_NAMES = ["modelopt", "compressed-tensors", "fp8", "gpt-oss"]

Revision = Annotated[Optional[str], typer.Option(help="Hub revision (branch, tag or commit) of a repo id.")]
JsonOut = Annotated[bool, typer.Option("--json", help="Print a machine-readable JSON document instead of tables.")]
Tensors = Annotated[Optional[str], typer.Option(help="Only tensors/modules matching this glob or re:REGEX.")]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"quantcli {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="Print the version and exit.")] = False) -> None:
    """quantcli: convert, inspect and verify quantized checkpoints."""


def _choice(value: str | None, allowed: list[str], option: str) -> None:
    if value is not None and value not in allowed:
        raise QuantcliError(f"{option} {value!r}: not one of {', '.join(allowed)}")


@app.command()
def convert(
    src: Annotated[str, typer.Argument(help="Source: checkpoint folder, .safetensors file or Hub repo id.")],
    dst: Annotated[Path, typer.Argument(help="Destination folder (created; written atomically).")],
    recipe: Annotated[Optional[str], typer.Option(help=f"One of: {', '.join(RECIPE_NAMES)}.")] = None,
    layout: Annotated[Optional[str], typer.Option(help=f"One of: {', '.join(LAYOUT_NAMES)} (default per recipe).")] = None,
    ignore: Annotated[Optional[list[str]], typer.Option(help="Leave modules matching this glob or re:REGEX unquantized (repeatable).")] = None,
    config: Annotated[Optional[Path], typer.Option(help="TOML recipe file: recipe, layout, targets, ignore, [[override]].")] = None,
    scale_rule: Annotated[Optional[str], typer.Option(help="MX scale exponent rule: floor, even or rceil (default: the layout's producer).")] = None,
    revision: Revision = None,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.")] = "auto",
    backend: Annotated[str, typer.Option(help="auto (Triton on CUDA), torch or triton.")] = "auto",
    dry_run: Annotated[bool, typer.Option(help="Print the plan and write nothing.")] = False,
    resume: Annotated[bool, typer.Option(help="Continue an interrupted run with the same inputs.")] = False,
    overwrite: Annotated[bool, typer.Option(help="Replace a non-empty destination.")] = False,
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
    json_out: JsonOut = False,
) -> None:
    """Quantize (or re-layout, or dequantize) a checkpoint."""
    from .commands import run_convert

    _choice(layout, LAYOUT_NAMES, "--layout")
    _choice(backend, ["auto", "torch", "triton"], "--backend")
    code = run_convert(src, dst, recipe=recipe, layout=layout, ignore=ignore or [], config=config,
                       scale_rule=scale_rule, revision=revision, device=device, backend=backend,
                       dry_run=dry_run, resume=resume, overwrite=overwrite, quiet=quiet, json_out=json_out)
    raise typer.Exit(code)


@app.command()
def inspect(
    path: Annotated[str, typer.Argument(help="Checkpoint folder, .safetensors file or Hub repo id.")],
    revision: Revision = None,
    tensors: Tensors = None,
    stats: Annotated[bool, typer.Option(help="Read the data: scale ranges, zero blocks, saturation, NaN/Inf.")] = False,
    kv_cache: Annotated[bool, typer.Option(help="Print the KV-cache byte account from config.json.")] = False,
    kv_budget: Annotated[str, typer.Option(help="Memory for the KV cache in --kv-cache, e.g. 80GiB.")] = "80GiB",
    json_out: JsonOut = False,
) -> None:
    """Explain a checkpoint from its headers: layout, recipes, scales, bits per parameter."""
    from .commands import run_inspect

    raise typer.Exit(run_inspect(path, revision=revision, tensors=tensors, stats=stats, kv_cache=kv_cache,
                                 kv_budget=kv_budget, json_out=json_out))


@app.command()
def verify(
    quant: Annotated[str, typer.Argument(help="The quantized checkpoint.")],
    reference: Annotated[Optional[str], typer.Option(help="The source checkpoint to compare against.")] = None,
    revision: Revision = None,
    tensors: Tensors = None,
    top: Annotated[int, typer.Option(help="How many worst tensors to list.")] = 10,
    exact: Annotated[bool, typer.Option(help="Re-quantize the reference and compare codes and scales byte for byte.")] = False,
    tp: Annotated[Optional[int], typer.Option(help="Check that quantized dims split into whole blocks across N ranks.")] = None,
    threshold: Annotated[Optional[list[str]], typer.Option(help="Override a limit: METRIC=VALUE (rel_err, sqnr_db, cosine, margin).")] = None,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.")] = "auto",
    json_out: JsonOut = False,
) -> None:
    """Decode a quantized checkpoint and prove it is what it should be. Exit 0 pass, 1 fail, 2 usage."""
    from .commands import run_verify

    raise typer.Exit(run_verify(quant, reference=reference, revision=revision, tensors=tensors, top=top,
                                exact=exact, tp=tp, thresholds=threshold or [], device=device, json_out=json_out))


def main() -> None:
    try:
        rc = app(standalone_mode=False)
        sys.exit(rc if isinstance(rc, int) else 0)
    except QuantcliError as exc:
        if os.environ.get("QUANTCLI_DEBUG"):
            raise
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        print("aborted", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:  # click usage errors carry their own exit code
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        raise


if __name__ == "__main__":
    main()

