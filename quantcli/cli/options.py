"""The command line's shared option values: the names shown in --help, the parse callbacks that
check a value against its registry, and the option types several commands declare alike."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Optional

import typer

from quantcli.errors import UsageError, did_you_mean, pick

# Names shown in --help. They are written out here because the registries they come from import
# torch (1-2 s), which --help and --version should not wait for; values are checked against the
# registries themselves, and tests/test_faults_cli.py checks that these lists equal them.
RECIPE_NAMES = ("fp8", "fp8-channel", "fp8-block", "mxfp8", "mxfp4", "nvfp4", "int8-channel", "int4",
                "bf16", "fp16", "fp32")
LAYOUT_NAMES = ("modelopt", "compressed-tensors", "fp8", "gpt-oss")
BACKEND_NAMES = ("auto", "torch", "triton")
SCALE_RULE_NAMES = ("floor", "even", "rceil")


def recipe_names() -> list[str]:
    from quantcli.recipes import DENSE_RECIPES, RECIPES

    return [*RECIPES, *DENSE_RECIPES]


def quantizing_recipe_names() -> list[str]:
    """The recipes that quantize (eval --recipe: a dequantizing one has nothing to emulate)."""
    from quantcli.recipes import RECIPES

    return list(RECIPES)


def layout_names() -> list[str]:
    from quantcli.formats.layouts import LAYOUTS

    return list(LAYOUTS)


def backend_names() -> list[str]:
    from quantcli.kernels import BACKENDS

    return list(BACKENDS)


def scale_rule_names() -> list[str]:
    from quantcli.kernels.spec import SCALE_RULES

    return list(SCALE_RULES)


def one_of(option: str, kind: str, names: Callable[[], list[str]]) -> Callable[[Optional[str]], Optional[str]]:
    """A parse callback: the value matched case-insensitively against the registry's names."""

    def check(value: Optional[str]) -> Optional[str]:
        return None if value is None else pick(option, kind, value, names())

    return check


def completer(names: Sequence[str]) -> Callable[..., list[str]]:
    """An autocompletion callback: the names that start with what was typed (Tab after --recipe)."""

    def complete(incomplete: str) -> list[str]:
        return [n for n in names if n.startswith(incomplete.lower())]

    return complete


def device(value: str) -> str:
    """auto, cpu, cuda or cuda:N (whether CUDA is there is checked when the device is opened)."""
    if re.fullmatch(r"auto|cpu|cuda(:\d+)?", value.lower()):
        return value.lower()
    raise UsageError(f"--device {value!r}: not a device{did_you_mean(value, ['auto', 'cpu', 'cuda'])} "
                     "(use auto, cpu, cuda or cuda:N)")


Revision = Annotated[Optional[str], typer.Option(
    metavar="REV", help="Hub revision (branch, tag or commit) of a repo id.")]
JsonOut = Annotated[bool, typer.Option("--json", help="Print a machine-readable JSON document instead of tables.")]
Tensors = Annotated[Optional[str], typer.Option(
    metavar="PATTERN", help="Only tensors/modules matching PATTERN: a name, a parent module, a glob or re:REGEX.")]
Device = Annotated[str, typer.Option(metavar="DEVICE", callback=device, help="auto, cpu, cuda or cuda:N.",
                                     autocompletion=completer(["auto", "cpu", "cuda"]))]
Token = Annotated[Optional[str], typer.Option(metavar="TOKEN", help=(
    "Hugging Face token for private or gated Hub repos and datasets (default: HF_TOKEN or the `hf auth login` "
    "token)."))]
CacheDir = Annotated[Optional[Path], typer.Option(metavar="DIR", help=(
    "Hugging Face Hub cache folder for Hub sources (default: HF_HUB_CACHE)."))]


def count_or_all(value: Optional[str]) -> Optional[str]:
    """eval --sensitivity: a number of modules (0: off) or `all`."""
    if value is None or value.strip().lower() == "all" or value.strip().isdigit():
        return None if value is None else value.strip().lower()
    raise UsageError(f"--sensitivity {value!r}: expected a number of modules (0: off) or all")
