"""One error family. Every message names the file, tensor or option, the value, the
constraint and the fix; `main()` prints it on one line (QUANTCLI_DEBUG=1 shows the traceback).

Exit codes (cli.main): 0 done / verify passed, 1 verify found a problem, 2 bad input or usage,
3 internal error (a bug), 130 interrupted (Ctrl-C), 143 terminated (SIGTERM), 141 stdout or stderr closed early.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence


class QuantcliError(Exception):
    """A user-facing error: exit code 2 (bad input or usage)."""

    exit_code = 2


class UsageError(QuantcliError):
    """A command-line mistake: an unknown command, option or option value."""


class RecipeError(QuantcliError):
    """A tensor that the recipe cannot take (shape, dtype, values)."""


class LayoutError(QuantcliError):
    """A (recipe, layout) pair or on-disk form that a layout cannot write or read."""


class CheckpointError(QuantcliError):
    """A source or destination checkpoint that cannot be used as given."""


class ManifestError(QuantcliError):
    """A manifest that is malformed or disagrees with the files it describes."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C raises KeyboardInterrupt so that the same clean-up runs
    (staging folders kept for --resume, locks released); exits 143 instead of 130."""

    exit_code = 143


def did_you_mean(value: str, choices: Sequence[str]) -> str:
    """'; did you mean 'x'?' for the closest choice (difflib), or '' when nothing is close."""
    close = difflib.get_close_matches(value.lower(), [c.lower() for c in choices], n=1, cutoff=0.6)
    if not close:
        return ""
    return f"; did you mean {next(c for c in choices if c.lower() == close[0])!r}?"


def pick(label: str, kind: str, value: str, choices: Sequence[str]) -> str:
    """`value` matched case-insensitively against `choices` -> the canonical choice; otherwise a
    UsageError naming `label` (an option or a config key), the value, a suggestion and the choices."""
    for choice in choices:
        if choice.lower() == value.lower():
            return choice
    raise UsageError(f"{label}: unknown {kind} {value!r}{did_you_mean(value, choices)} "
                     f"(choose one of: {', '.join(choices)})")
