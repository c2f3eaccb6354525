"""How the command line presents itself: one-line messages for a missing or misspelled command,
arguments shown in usage and --help as words (SRC, [SRC]) rather than typer's {SRC} <str>,
option names never split across lines in --help, and allowed ranges in words ('at least 1')."""

from __future__ import annotations

import typer
import typer._click._textwrap
import typer.core

from quantcli.errors import UsageError, did_you_mean


class _WholeWords(typer._click._textwrap.TextWrapper):
    """The help's wrapper (typer's own copy of click's), but a line never ends inside a word at a
    hyphen ('--target-' then 'bits'): textwrap breaks there by default, and an option name split
    in two cannot be searched for or copied. typer._click.formatting.wrap_text looks the class
    up in typer._click._textwrap at each call."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "break_on_hyphens": False})


typer._click._textwrap.TextWrapper = _WholeWords


def _number_range(min: int | float | None, max: int | float | None) -> str | None:  # noqa: A002 (typer's names)
    """An option's allowed numbers in --help as words ('at least 1', '1 to 8'), not typer's
    'x>=1', which reads as a formula to solve; its errors already say 'must be at least 1'."""
    if min is None and max is None:
        return None
    if min is None:
        return f"at most {max}"
    if max is None:
        return f"at least {min}"
    return f"{min} to {max}"


typer.core.describe_number_range = _number_range  # typer.core's help looks the name up at each call

# Each command's --help ends with these (tests/test_cli_papercuts.py parses every one).
EXAMPLES = {  # a long one goes on in a second line after ' \\'
    "convert": ["quantcli convert meta-llama/Llama-3.2-1B out/nvfp4 --recipe nvfp4",
                "quantcli convert ./llama out/fp8 --recipe fp8-block --dry-run",
                "quantcli convert ./llama out/w4a4 --recipe nvfp4 --activations static \\\n"
                "    --calibration data.jsonl",
                "quantcli convert ./llama out/int4 --recipe int4 --rounding gptq \\\n"
                "    --calibration data.jsonl",
                "quantcli convert out/nvfp4 out/nvfp4-ct --layout compressed-tensors"],
    "inspect": ["quantcli inspect out/nvfp4",
                "quantcli inspect out/nvfp4 --stats --tensors model.layers.0",
                "quantcli inspect ./llama --kv-cache --kv-budget 40GiB"],
    "verify": ["quantcli verify out/nvfp4",
               "quantcli verify out/nvfp4 --reference meta-llama/Llama-3.2-1B --top 5",
               "quantcli verify out/nvfp4 --reference ./llama --exact -q"],
    "recipes": ["quantcli recipes", "quantcli recipes --json"],
    "layouts": ["quantcli layouts", "quantcli layouts --json"],
    "eval": ["quantcli eval out/nvfp4 --reference ./llama --data heldout.txt",
             "quantcli eval ./llama --recipe mxfp4 --scale-search mse \\\n"
             "    --data heldout.txt --json",
             "quantcli eval ./llama --auto nvfp4,fp8-block --target-bits 6 \\\n"
             "    --calibration data.jsonl --data heldout.txt"],
    "push": ["quantcli push out/nvfp4 my-org/llama-nvfp4",
             "quantcli push out/nvfp4 my-org/llama-nvfp4 --create-pr \\\n    --commit-message 'NVFP4 weights'"],
}


def examples(command: str) -> str:
    """The --help epilog: the command's examples, one per line (\\b keeps click from rewrapping them)."""
    lines = [line for example in EXAMPLES[command] for line in example.split("\n")]
    return "Examples:\n\n\b\n" + "\n".join(f"  {line}" for line in lines)


class Commands(typer.core.TyperGroup):
    """The top-level group, with one-line messages for a missing or misspelled command."""

    def _visible(self, ctx) -> list[str]:
        return [name for name in self.list_commands(ctx) if not self.get_command(ctx, name).hidden]

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        if not args and not ctx.resilient_parsing:  # resilient: shell completion of `quantcli <Tab>`
            raise UsageError(f"missing command; choose one of: {', '.join(self._visible(ctx))} "
                             f"(see '{ctx.command_path} --help')")
        return super().parse_args(ctx, args)

    def resolve_command(self, ctx, args: list[str]):
        name = args[0] if args else ""
        if name and not name.startswith("-") and self.get_command(ctx, name) is None and not ctx.resilient_parsing:
            commands = self._visible(ctx)
            raise UsageError(f"no such command {name!r}{did_you_mean(name, commands)} "
                             f"(commands: {', '.join(commands)}; see '{ctx.command_path} --help')")
        return super().resolve_command(ctx, args)


class WordArgument(typer.core.TyperArgument):
    """An argument shown as its word, SRC or [SRC], without typer's {SRC} and <str>."""

    def _usage_display_name(self) -> str:
        return self.display_name_raw if self.required else f"[{self.display_name_raw}]"

    def display_type_rich(self, ctx) -> None:
        return None


# Options that would be silently ignored together: (command or None for any, option, given with
# (True) or without (False) the other, the other, what to say). Refused before the command runs.
CONFLICTS = (
    (None, "quiet", True, "verbose", "-q and -v together: -q leaves only what a script needs, -v adds detail "
                                     "(per tensor, or per layer for eval); choose one"),
    ("verify", "revision", False, "reference", "--revision applies to a --reference repo id (QUANT is read as "
                                               "given); add --reference SRC or drop --revision"),
    # convert -v without --dry-run stays: it lists each tensor as it is written (stderr)
    ("convert", "per_tensor", False, "dry_run", "--per-tensor only changes --dry-run's plan (a row per tensor); "
                                                "add --dry-run or drop --per-tensor (-v lists each tensor as it is "
                                                "written)"),
    ("convert", "private", False, "push_to_hub", "--private only applies to the repo --push-to-hub REPO creates; "
                                                 "add --push-to-hub REPO or drop --private"),
    ("convert", "push_revision", False, "push_to_hub", "--push-revision only applies to --push-to-hub REPO's "
                                                       "upload (--revision is the source's); add --push-to-hub REPO "
                                                       "or drop --push-revision"),
)


class Command(typer.core.TyperCommand):
    """A command whose arguments are shown as words (see WordArgument), and that refuses options
    it would ignore (CONFLICTS)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for p in self.params:
            if type(p) is typer.core.TyperArgument:
                p.__class__ = WordArgument

    def invoke(self, ctx):
        for command, option, together, other, said in CONFLICTS:
            if command in (None, self.name) and ctx.params.get(option) and bool(ctx.params.get(other)) == together:
                raise UsageError(f"{said} (see '{ctx.command_path} --help')")
        return super().invoke(ctx)
