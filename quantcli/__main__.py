"""`python -m quantcli` runs the command line (used by tests that need a separate process)."""

from quantcli.cli import entry

if __name__ == "__main__":  # not when --workers' spawned ranks import it as __mp_main__
    entry()
