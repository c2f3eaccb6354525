"""Python runs this as every process starts when tests/faults.py `fault_env` put this folder on
PYTHONPATH: the faults its environment asks for are installed (fault_hooks.py)."""

import fault_hooks

fault_hooks.install()
