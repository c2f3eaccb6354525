"""The staging folder `DST.partial` a conversion writes into, and what it finds there when it
opens it (rank 0 alone): nothing (a fresh run), an interrupted run's shards to resume, a finished
folder whose rename was all that was left, or DST already finished by the same plan (--resume).

Opening refuses what cannot be continued before anything is touched (another plan's folder,
source shards that changed since), then takes the lock and keeps the progress record. A refusal
of the data later in a fresh run removes what this run made (`discard`): resuming would meet the
same refusal; a filesystem fault or an interruption keeps the folder for --resume."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from quantcli.checkpoint.manifest import MANIFEST_NAME
from quantcli.convert.destination import (
    discard,
    empty_staging,
    leftovers,
    manifest_doc,
    missing_parents,
    staging_dir,
    writing,
)
from quantcli.convert.lock import StagingLock
from quantcli.convert.progress import PROGRESS_NAME, ProgressFile, changed_source_shard, load_progress, source_identity
from quantcli.convert.rank_files import RankRecords
from quantcli.convert.records import RunOptions, ShardResult
from quantcli.errors import CheckpointError
from quantcli.planning.plan import Plan


class Found(StrEnum):
    """What opening the staging folder found."""

    NEW = "new"  # nothing to continue: a fresh run in an emptied folder
    RESUME = "resume"  # an interrupted run of this plan: its finished shards are reused
    FINISHED = "finished"  # complete in the staging folder: only the final rename is left
    COMPLETE = "complete"  # DST itself is this plan's finished output (--resume): nothing to do


@dataclass
class Opened:
    """The outcome of opening, sent to every rank (as JSON)."""

    found: Found
    finished: dict[str, dict] = field(default_factory=dict)  # shard -> ShardResult.to_json(), reused
    notes: list[str] = field(default_factory=list)  # DST's own manifest notes (COMPLETE)

    def to_json(self) -> dict:
        return {"found": str(self.found), "finished": self.finished, "notes": self.notes}

    @staticmethod
    def from_json(doc: dict) -> Opened:
        return Opened(Found(doc["found"]), doc["finished"], doc["notes"])

    def reused(self) -> dict[str, ShardResult]:
        """The shards an interrupted run finished, with what converting each found."""
        return {shard: ShardResult.from_json(r) for shard, r in self.finished.items()}


class Staging:
    """`DST.partial` of one conversion (fingerprint `fp`): rank 0 opens it; every rank records
    its finished shards in `records` (rank 0's progress file, the others' rank files)."""

    def __init__(self, plan: Plan, dst: Path, fp: str, run: RunOptions):
        self.plan, self.dst, self.fp, self.run = plan, dst, fp, run
        self.path = staging_dir(dst)
        self.lock = StagingLock(self.path)
        self.created: list[Path] = []  # folders this run made (removed again by `discard`)
        self.fresh = False  # this run started the folder anew: a refusal of the data removes it
        self.records: ProgressFile | RankRecords | None = None

    def open(self) -> Opened:
        """Rank 0: refusals, the lock, the progress record (see the module docstring)."""
        if self.run.resume and not self.path.exists() and (self.dst / MANIFEST_NAME).exists():
            notes = self._dst_already_complete()
            if notes is not None:
                return Opened(Found.COMPLETE, notes=notes)
        if self.path.is_dir():
            self._found()  # refusals before the lock is taken: nothing touched
        self.created = missing_parents(self.path)
        with writing(self.path, self.dst):
            self.path.mkdir(parents=True, exist_ok=True)
        with writing(self.lock.path, self.dst):
            self.lock.acquire(self.dst)
        found = self._found()  # again, now that no other run can change it
        self.fresh = found == Found.NEW
        if found == Found.FINISHED:
            return Opened(found)
        self.records = self._open_progress(found)
        finished = {}
        if self.run.resume:
            for shard in self.plan.by_shard():
                done = self.records.finished(shard, self.path / shard)
                if done is not None:
                    finished[shard] = done.to_json()
        return Opened(found, finished)

    def discard_if_fresh(self) -> None:
        """After a refusal of the data: a fresh run's folder goes (a resumed one stays)."""
        if self.fresh:
            self.lock.release()
            discard(self.path, self.created)

    def release(self) -> None:
        self.lock.release()

    def _dst_already_complete(self) -> list[str] | None:
        """--resume on a finished DST: the same plan is done (its notes); another plan is refused,
        or with --overwrite too (None) converted afresh."""
        doc = manifest_doc(self.dst)
        if doc.get("fingerprint") != self.fp:
            if self.run.overwrite:
                return None
            raise CheckpointError(f"{self.dst}: holds a finished quantcli output of another source, recipe or "
                                  f"options, and there is no interrupted run to resume; use --overwrite to replace it")
        return list(doc.get("notes", []))

    def _found(self) -> Found:
        """What the folder holds, refusing what cannot be continued (read-only, so it runs before
        the lock is taken too: a refusal touches nothing). RESUME: a progress file of this plan and
        of the source shards as they are now; FINISHED: complete but for the rename; else NEW."""
        path = self.path / PROGRESS_NAME
        if self.run.resume and path.exists():
            state = load_progress(path)
            if state["fingerprint"] != self.fp:
                raise CheckpointError(f"{self.path}: --resume refused: that run used a different source, recipe "
                                      f"or options; pass --overwrite to start over")
            changed = changed_source_shard(state["sources"], source_identity(self.plan.source))
            if changed is not None:
                shard, what = changed
                raise CheckpointError(f"{self.plan.source.root / shard}: --resume refused: source shard {shard} "
                                      f"changed since the interrupted run: {what}; to start over (the shards in "
                                      f"{self.path} were made from the old bytes), rerun with --overwrite")
            return Found.RESUME
        if self.run.resume and (self.path / MANIFEST_NAME).exists():
            if manifest_doc(self.path).get("fingerprint") != self.fp:
                raise CheckpointError(f"{self.path}: holds a finished conversion of another source, recipe or "
                                      f"options; rerun with --overwrite to start over")
            return Found.FINISHED
        if leftovers(self.path) and not self.run.overwrite:
            raise CheckpointError(f"{self.path}: has no progress file, so it is not an interrupted quantcli run that "
                                  f"--resume can continue; pass --overwrite to start over")
        return Found.NEW

    def _open_progress(self, found: Found) -> ProgressFile:
        """The interrupted run's record (RESUME), or a new one in an emptied folder."""
        path = self.path / PROGRESS_NAME
        if found == Found.RESUME:
            progress = ProgressFile(path, load_progress(path))
            with writing(path, self.dst):
                RankRecords.merge_into(progress)
            return progress
        empty_staging(self.path, self.dst)
        progress = ProgressFile.new(path, self.fp, self.run.overwrite, source_identity(self.plan.source))
        with writing(path, self.dst):
            progress.save()
        return progress
