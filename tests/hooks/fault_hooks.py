"""Fault injection for the crash-safety tests, kept out of quantcli's own code. `install(env)`
patches quantcli's classes by the environment's settings and returns the undo:

- QUANTCLI_TEST_KILL_AFTER_SHARDS=N kills the process (SIGKILL: no cleanup, as a crash) right
  after its N-th finished shard is recorded;
- QUANTCLI_TEST_SHARD_DELAY_S=S sleeps S seconds after each recorded shard (a slow disk: an
  interrupt then lands mid-run);
- QUANTCLI_TEST_KILL_AFTER_LAYERS=N kills it right after a weight pass has staged N layers.

sitecustomize.py beside it installs them as every process starts (tests/faults.py `fault_env`
puts this folder on PYTHONPATH); a test that runs quantcli in a process it already has (the
spawned ranks of tests/test_distributed.py) calls install itself."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping


def _kill() -> None:
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


def _after(cls, method: str, limit: str | None, delay: str | None, undo: list) -> None:
    original, count = getattr(cls, method), [0]

    def wrapped(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        count[0] += 1
        if delay:
            time.sleep(float(delay))
        if limit is not None and count[0] == int(limit):
            _kill()
        return out

    setattr(cls, method, wrapped)
    undo.append(lambda: setattr(cls, method, original))


def install(env: Mapping[str, str] = os.environ) -> Callable[[], None]:
    shards, delay = env.get("QUANTCLI_TEST_KILL_AFTER_SHARDS"), env.get("QUANTCLI_TEST_SHARD_DELAY_S")
    layers = env.get("QUANTCLI_TEST_KILL_AFTER_LAYERS")
    undo: list = []
    if shards or delay:
        from quantcli.convert.progress import ProgressFile
        from quantcli.convert.rank_files import RankRecords

        for cls in (ProgressFile, RankRecords):
            _after(cls, "record", shards, delay, undo)
    if layers:
        from quantcli.convert.staged import StagedWeights

        _after(StagedWeights, "write_layer", layers, None, undo)
    return lambda: [u() for u in reversed(undo)]
