"""`python -m quantcli` runs the command line (used by tests that need a separate process)."""

from .cli import main

main()
