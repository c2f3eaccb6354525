"""The face: the command line (options, usage help, the one error path, rendering, tables,
progress bars, push and the --workers launcher). Nothing below this package imports it."""

from quantcli.cli.app import app, entry, main

__all__ = ["app", "entry", "main"]
