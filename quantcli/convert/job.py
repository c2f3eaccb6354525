"""The conversion job: fact passes -> a weight pass, if one takes any tensor (its products staged
layer by layer) -> the per-shard job for every shard not already finished (--resume) -> finalize
(index, configs, card, manifest last) -> the staging folder is put in place of DST.

A reader therefore sees DST either absent (or as it was, with --overwrite) or complete. A data
refusal in a run that started fresh removes what it made (resuming would meet the same
refusal); a filesystem fault or an interruption keeps the staging folder, consistent, for
--resume, which reuses each shard the progress file records and that shard's recorded result.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from quantcli.checkpoint.manifest import MANIFEST_NAME
from quantcli.checkpoint.tensors import CheckpointTensors
from quantcli.convert.destination import (
    INSTALLED,
    FilesystemError,
    discard,
    empty_staging,
    filesystem_error,
    install,
    leftovers,
    manifest_doc,
    missing_parents,
    staging_dir,
    writing,
)
from quantcli.convert.device import resolve_device
from quantcli.convert.finalize import build_manifest, import_ahead, write_side_files
from quantcli.convert.lock import StagingLock
from quantcli.convert.passes import CALIBRATION_CACHE, learn_facts, learn_weights
from quantcli.convert.progress import (
    PROGRESS_NAME,
    ProgressFile,
    changed_source_shard,
    fingerprint,
    load_progress,
    source_identity,
)
from quantcli.convert.rank_files import RankRecords, check_shared_staging
from quantcli.convert.reading import ModuleReader
from quantcli.convert.records import ConvertResult, Findings, Progress, RunOptions, ShardResult
from quantcli.convert.shard import convert_shard
from quantcli.convert.staged import StagedWeights, discard_weights
from quantcli.convert.world import World
from quantcli.errors import CheckpointError, QuantcliError
from quantcli.planning.plan import Plan


def convert(plan: Plan, dst: Path, run: RunOptions, progress: Progress | None = None,
            world: World | None = None) -> ConvertResult:
    """Convert `plan` into DST (see the module docstring for what a failure leaves). With several
    ranks (`world`), every rank calls this with the same plan; rank 0 alone touches the staging
    folder's lock, progress file, side files and the final rename."""
    return ConversionJob(plan, dst, run, progress, world).execute()


class ResumeHint:
    """The end of a failed rank's message, true when it is printed: the staging folder is kept for
    --resume once it exists; before that (a rank failed while the job started) nothing was written."""

    def __init__(self, stage: Path):
        self.stage = stage

    def __str__(self) -> str:
        if self.stage.exists():
            return f"{self.stage} is kept: rerun with --resume (any number of workers) to continue"
        return "nothing was written yet: rerun the same command"

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


class ConversionJob:
    def __init__(self, plan: Plan, dst: Path, run: RunOptions, progress: Progress | None = None,
                 world: World | None = None):
        self.plan = plan
        self.dst = dst
        self.run = run
        self.world = world or World()
        self.device = resolve_device(run.device)
        self.progress = self.world.progress(progress)  # several ranks: bytes of all, on rank 0's bar
        self.start = time.time()
        self.records: ProgressFile | RankRecords | None = None
        self.layers_resumed = (0, 0)  # the weight pass's layers staged by an interrupted run, of all

    def execute(self) -> ConvertResult:
        self.start = time.time()
        INSTALLED.discard(self.dst.absolute())  # put in place by an earlier run in this process, if any
        stage, fp, world = staging_dir(self.dst), fingerprint(self.plan), self.world
        world.resume_hint = ResumeHint(stage)
        lock, created, fresh = StagingLock(stage), [], [False]
        try:
            step = world.settle_all(lambda: self._start(stage, fp, lock, created, fresh) if world.lead else None)[0]
            if step["kind"] == "complete":
                return self._result(0, 0, [], step["notes"], already_complete=True)
            if step["kind"] == "finished":
                return self._finish_installed(stage, lock) if world.lead else self._result(0, 0, [], [])
            return self._convert(stage, fp, step, lock)
        except (FilesystemError, BrokenPipeError):  # kept for --resume (a closed pipe is an interruption)
            raise
        except QuantcliError:
            if fresh[0]:
                lock.release()
                discard(stage, created)
            raise
        except OSError as exc:  # one not caught where it happened (reading the source, say)
            raise filesystem_error(exc, stage, self.dst) from None
        finally:
            lock.release()

    def _start(self, stage: Path, fp: str, lock: StagingLock, created: list[Path], fresh: list[bool]) -> dict:
        """Rank 0: refusals, the lock, the progress record; what every rank does next."""
        if self.run.resume and not stage.exists() and (self.dst / MANIFEST_NAME).exists():
            done = self._already_complete(fp)
            if done is not None:
                return {"kind": "complete", "notes": done.notes}
        if stage.is_dir():
            self._stage_kind(stage, fp)  # refusals before the lock is taken: nothing touched
        created.extend(missing_parents(stage))
        with writing(stage, self.dst):
            stage.mkdir(parents=True, exist_ok=True)
        with writing(lock.path, self.dst):
            lock.acquire(self.dst)
        kind = self._stage_kind(stage, fp)  # again, now that no other run can change it
        fresh[0] = kind == "new"
        if kind == "finished":
            return {"kind": kind}
        self.records = self._open_progress(stage, fp, kind)
        finished = {}
        if self.run.resume:
            for shard in self.plan.by_shard():
                done = self.records.finished(shard, stage / shard)
                if done is not None:
                    finished[shard] = done.to_json()
        return {"kind": kind, "finished": finished}

    def _convert(self, stage: Path, fp: str, step: dict, lock: StagingLock) -> ConvertResult:
        """Shards, then the side files, then the manifest (last: it marks the output complete)."""
        world = self.world
        if world.size > 1:
            check_shared_staging(world, stage)
            self.records = self.records or RankRecords(stage, world.rank)
        finished = {s: ShardResult.from_json(r) for s, r in step["finished"].items()}
        if world.lead:
            import_ahead()
        mine = self._convert_shards(stage, finished)
        gathered: dict[str, dict] = {}
        for part in world.settle_all(lambda: {s: r.to_json() for s, r in mine.items()}):
            gathered.update(part)
        results = {s: finished[s] if s in finished else ShardResult.from_json(gathered[s])
                   for s in self.plan.by_shard()}
        found = Findings.merge(r.found for r in results.values())
        warnings = world.settle(lambda: self._finalize(stage, fp, found, lock) if world.lead else [])
        return self._result(len(results) - len(finished), len(finished), warnings, found.note_list(),
                            dict(sorted(found.errors.items())))

    def _finalize(self, stage: Path, fp: str, found: Findings, lock: StagingLock) -> list[str]:
        with writing(stage, self.dst):
            write_side_files(self.plan, stage)
        manifest = build_manifest(self.plan, fp, found)
        with writing(stage / MANIFEST_NAME, self.dst):
            (stage / MANIFEST_NAME).write_text(manifest.to_json())
            (stage / PROGRESS_NAME).unlink()
            (stage / CALIBRATION_CACHE).unlink(missing_ok=True)
            discard_weights(stage)
            for rank_file in RankRecords.files(stage):
                rank_file.unlink()
        lock.release()
        return install(stage, self.dst)

    def _convert_shards(self, stage: Path, finished: dict[str, ShardResult]) -> dict[str, ShardResult]:
        """The results of the unfinished shards this rank converts (longest first over the ranks)."""
        sizes = {s: sum(t.bytes_in for t in planned) for s, planned in self.plan.by_shard().items()}
        mine = self.world.mine({s: n for s, n in sizes.items() if s not in finished})
        if self.world.lead:
            for shard in finished:
                self.progress(sizes[shard], shard)
        with CheckpointTensors(self.plan.source) as tensors:
            reader = ModuleReader(self.plan, tensors, self.device, self.run.backend, stage,
                                  self.progress if self.world.lead else None)
            facts = learn_facts(reader, world=self.world)
            staged = learn_weights(reader, facts, world=self.world)  # None: no weight pass takes a tensor
            self.layers_resumed = staged.resumed if staged is not None else (0, 0)
            try:
                return self.world.settle(lambda: self._write_shards(stage, reader, facts, staged,
                                                                    [s for s in sizes if s in mine]))
            finally:
                if staged is not None:
                    staged.close()

    def _write_shards(self, stage: Path, reader: ModuleReader, facts, staged: StagedWeights | None,
                      shards: list[str]) -> dict[str, ShardResult]:
        results: dict[str, ShardResult] = {}
        for shard in shards:
            out_path = stage / shard
            with writing(out_path.parent, self.dst):
                out_path.parent.mkdir(parents=True, exist_ok=True)
            with writing(out_path, self.dst):
                results[shard] = convert_shard(reader, shard, facts, out_path, self.progress, staged)
            with writing(self.records.path, self.dst):
                self.records.record(shard, results[shard])
            _fault_injection(len(results))
        return results

    def _result(self, written: int, resumed: int, warnings: list[str], notes: list[str],
                errors: dict[str, float] | None = None, already_complete: bool = False) -> ConvertResult:
        plan = self.plan
        return ConvertResult(self.dst, time.time() - self.start, plan.bytes_in, plan.bytes_out, written, resumed,
                             sum(t.quantized for t in plan.tensors), [*plan.all_warnings, *warnings], notes,
                             errors or {}, already_complete, self.layers_resumed)

    def _finish_installed(self, stage: Path, lock: StagingLock) -> ConvertResult:
        """The staging folder is complete (the run died between the manifest and the rename)."""
        lock.release()
        notes = list(manifest_doc(stage).get("notes", []))
        warnings = install(stage, self.dst)
        return self._result(0, len(self.plan.by_shard()), warnings, notes)

    def _already_complete(self, fp: str) -> ConvertResult | None:
        """--resume on a finished DST: the same plan is done, touch nothing; another plan is
        refused, or with --overwrite too (None) converted afresh."""
        doc = manifest_doc(self.dst)
        if doc.get("fingerprint") != fp:
            if self.run.overwrite:
                return None
            raise CheckpointError(f"{self.dst}: holds a finished quantcli output of another source, recipe or "
                                  f"options, and there is no interrupted run to resume; use --overwrite to replace it")
        return self._result(0, 0, [], list(doc.get("notes", [])), already_complete=True)

    def _stage_kind(self, stage: Path, fp: str) -> str:
        """What the staging folder holds, refusing what cannot be continued (read-only, so it runs
        before the lock is taken too: a refusal touches nothing). 'resume': a progress file that
        matches this plan and the source shards as they are now; 'finished': complete, only the
        final rename is left (the run died between the manifest and the rename); 'new'."""
        path = stage / PROGRESS_NAME
        if self.run.resume and path.exists():
            state = load_progress(path)
            if state["fingerprint"] != fp:
                raise CheckpointError(f"{stage}: --resume refused: that run used a different source, recipe "
                                      f"or options; pass --overwrite to start over")
            changed = changed_source_shard(state["sources"], source_identity(self.plan.source))
            if changed is not None:
                raise CheckpointError(f"{self.plan.source.root / changed}: source shard {changed} changed since the "
                                      f"interrupted run (size, mtime or content), so the shards in {stage} cannot "
                                      f"be reused; rerun with --overwrite")
            return "resume"
        if self.run.resume and (stage / MANIFEST_NAME).exists():
            if manifest_doc(stage).get("fingerprint") != fp:
                raise CheckpointError(f"{stage}: holds a finished conversion of another source, recipe or options; "
                                      f"rerun with --overwrite to start over")
            return "finished"
        if leftovers(stage) and not self.run.overwrite:
            raise CheckpointError(f"{stage}: has no progress file, so it is not an interrupted quantcli run that "
                                  f"--resume can continue; pass --overwrite to start over")
        return "new"

    def _open_progress(self, stage: Path, fp: str, kind: str) -> ProgressFile:
        """The interrupted run's record (kind 'resume'), or a new one in an emptied folder."""
        path = stage / PROGRESS_NAME
        if kind == "resume":
            progress = ProgressFile(path, load_progress(path))
            with writing(path, self.dst):
                RankRecords.merge_into(progress)
            return progress
        empty_staging(stage, self.dst)
        progress = ProgressFile.new(path, fp, self.run.overwrite, source_identity(self.plan.source))
        with writing(path, self.dst):
            progress.save()
        return progress


def _fault_injection(shards_written: int) -> None:
    """Crash-safety tests kill the process here (SIGKILL, no cleanup) after N shards, or slow
    each shard down (QUANTCLI_SHARD_DELAY_S, a slow disk) so that an interrupt lands mid-run."""
    delay = os.environ.get("QUANTCLI_SHARD_DELAY_S")
    if delay:
        time.sleep(float(delay))
    limit = os.environ.get("QUANTCLI_KILL_AFTER_SHARDS")
    if limit and int(limit) == shards_written:
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
