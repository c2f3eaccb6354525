"""What the ranks of one conversion share in the staging folder: each rank's record of the shards
it finished (rank 0 keeps the progress file itself; the others each keep their own file, merged
into the progress file by the next --resume), and the probe that proves every rank sees the
same staging folder (several nodes need a shared filesystem for DST)."""

from __future__ import annotations

import contextlib
import json
import socket
from pathlib import Path

from quantcli.convert.progress import PROGRESS_NAME, ProgressFile, write_json_atomic
from quantcli.convert.records import ShardResult
from quantcli.convert.world import World
from quantcli.errors import CheckpointError

PROBE_PREFIX = ".quantcli-probe-rank"


class RankRecords:
    """`.quantcli-progress.rankN.json`: rank N's finished shards, rewritten after each one. A
    record only names a candidate: --resume still checks the shard's size and SHA-256."""

    def __init__(self, stage: Path, rank: int):
        self.path = stage / PROGRESS_NAME.replace(".json", f".rank{rank}.json")
        self.shards: dict[str, dict] = {}

    def record(self, shard: str, result: ShardResult) -> None:
        self.shards[shard] = result.to_json()
        write_json_atomic(self.path, {"shards": self.shards})

    @staticmethod
    def files(stage: Path) -> list[Path]:
        return sorted(stage.glob(PROGRESS_NAME.replace(".json", ".rank*.json")))

    @classmethod
    def merge_into(cls, progress: ProgressFile) -> None:
        """Fold every rank's records into the progress file and drop the rank files, so the next
        run (with any number of ranks) starts from one record."""
        stage = progress.path.parent
        for path in cls.files(stage):
            with contextlib.suppress(ValueError, OSError, KeyError, TypeError):  # a torn file: its shards redo
                for shard, rec in json.loads(path.read_text())["shards"].items():
                    ShardResult.from_json(rec)  # the shape progress.py checks
                    progress.state["shards"].setdefault(shard, rec)
        progress.save()
        for path in cls.files(stage):
            path.unlink()


def check_shared_staging(world: World, stage: Path) -> None:
    """Every rank writes a probe file into the staging folder rank 0 made; rank 0 must see them
    all. Otherwise DST is not on a filesystem the nodes share: refused, in one line."""
    probe = stage / f"{PROBE_PREFIX}{world.rank}"

    def write_probe() -> None:
        if not stage.is_dir():
            raise CheckpointError(f"{stage}: rank {world.rank} on {socket.gethostname()} cannot see the staging "
                                  f"folder rank 0 made; DST must be on a filesystem every node shares (NFS, Lustre, "
                                  f"...): pass such a path")
        probe.write_text(socket.gethostname())

    def check_probes() -> None:
        missing = [r for r in range(world.size) if not (stage / f"{PROBE_PREFIX}{r}").exists()]
        for r in range(world.size):
            (stage / f"{PROBE_PREFIX}{r}").unlink(missing_ok=True)
        if missing:
            raise CheckpointError(f"{stage}: rank 0 cannot see the probe files of rank(s) "
                                  f"{', '.join(map(str, missing))}, so the ranks write to different filesystems; "
                                  f"DST must be on a filesystem every node shares (NFS, Lustre, ...)")

    world.settle(write_probe)
    world.lead_alone(check_probes)
