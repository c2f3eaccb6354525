"""Declared options (planning/settings.py) on a Typer command: each Setting becomes an option of
the command (its flag, metavar, help with the field's default, a checked and completed choice), and
the command receives their values as one dict, so that a new option is one declaration."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Annotated, Optional

import typer

from quantcli.cli.options import completer, one_of
from quantcli.planning.settings import Setting


def option_type(s: Setting):
    """The Annotated type Typer reads for `s`: None when not given, so the recipe file can say it."""
    help = f"{s.help}  [default: {s.default}]"
    if s.choices:
        info = typer.Option(s.flag, metavar=s.metavar, help=help, autocompletion=completer(s.choices),
                            callback=one_of(s.flag, s.noun or s.key.replace("_", " "), lambda: list(s.choices)))
    else:
        info = typer.Option(s.flag, metavar=s.metavar, help=help)
    return Annotated[Optional[s.kind], info]


def with_settings(settings: Sequence[Setting], after: str, into: str) -> Callable:
    """Add `settings`' options to a command after its parameter `after` (--help lists them
    there), and call it with their values as `into`: {file key: value, None where not given}."""

    def wrap(command: Callable) -> Callable:
        signature = inspect.signature(command, eval_str=True)  # app.py's annotations are strings
        params = [p for p in signature.parameters.values() if p.name != into]
        at = [p.name for p in params].index(after) + 1
        added = [inspect.Parameter(s.file_key, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
                                   annotation=option_type(s)) for s in settings]

        @functools.wraps(command)
        def run(*args, **kwargs):
            values = {s.file_key: kwargs.pop(s.file_key, None) for s in settings}
            return command(*args, **kwargs, **{into: values})

        run.__signature__ = signature.replace(parameters=params[:at] + added + params[at:])  # type: ignore[attr-defined]
        return run

    return wrap
