"""Fault injection for the crash-safety tests, kept out of quantcli's own code: a test puts this
folder on PYTHONPATH (tests/faults.py `fault_env`) and Python runs it as every process starts
(the quantcli under test, and each rank it spawns), so that

- QUANTCLI_TEST_KILL_AFTER_SHARDS=N kills the process (SIGKILL: no cleanup, as a crash) right
  after its N-th finished shard is recorded;
- QUANTCLI_TEST_SHARD_DELAY_S=S sleeps S seconds after each recorded shard (a slow disk: an
  interrupt then lands mid-run);
- QUANTCLI_TEST_KILL_AFTER_LAYERS=N kills it right after a weight pass has staged N layers."""

import os

_SHARDS = os.environ.get("QUANTCLI_TEST_KILL_AFTER_SHARDS")
_DELAY = os.environ.get("QUANTCLI_TEST_SHARD_DELAY_S")
_LAYERS = os.environ.get("QUANTCLI_TEST_KILL_AFTER_LAYERS")


def _kill() -> None:
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


def _after(cls, method: str, limit: str | None, delay: str | None = None) -> None:
    original, count = getattr(cls, method), [0]

    def wrapped(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        count[0] += 1
        if delay:
            import time

            time.sleep(float(delay))
        if limit is not None and count[0] == int(limit):
            _kill()
        return out

    setattr(cls, method, wrapped)


if _SHARDS or _DELAY:
    from quantcli.convert.progress import ProgressFile
    from quantcli.convert.rank_files import RankRecords

    for _cls in (ProgressFile, RankRecords):
        _after(_cls, "record", _SHARDS, _DELAY)
if _LAYERS:
    from quantcli.convert.staged import StagedWeights

    _after(StagedWeights, "write_layer", _LAYERS)
