"""The face: the command line (options, usage help, the one error path, rendering, tables,
progress bars, push and the --workers launcher). Nothing below this package imports it.

`entry` and `main` import the command line when called, not when this package is imported: the
console script imports this package first, and a Ctrl-C while torch and the rest load must end
in the one line `interrupted` (exit 130), not a traceback."""

from __future__ import annotations

import sys


def entry():
    """The `quantcli` program (console script and `python -m quantcli`)."""
    try:
        from quantcli.cli.app import entry as run_entry
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        raise SystemExit(130) from None
    run_entry()


def main(argv=None, **kwargs):
    """main() of quantcli/cli/app.py: run a command line in this process (tests, embedding)."""
    from quantcli.cli.app import main as run_main

    return run_main(argv, **kwargs)
