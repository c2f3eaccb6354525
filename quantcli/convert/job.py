"""The conversion job: passes that learn facts -> the per-shard job for every shard not already
finished (--resume) -> finalize (index, configs, card, manifest last) -> the staging folder is
put in place of DST.

A reader therefore sees DST either absent (or as it was, with --overwrite) or complete. A data
refusal in a run that started fresh removes what it made (resuming would meet the same
refusal); a filesystem fault or an interruption keeps the staging folder, consistent, for
--resume, which reuses each shard the progress file records and that shard's recorded result.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ..errors import CheckpointError, QuantcliError
from ..manifest import MANIFEST_NAME
from ..plan import Plan
from ..tensors import CheckpointTensors
from .destination import (FilesystemError, discard, empty_staging, filesystem_error, install, leftovers,
                          manifest_doc, missing_parents, staging_dir, writing)
from .device import resolve_device
from .finalize import build_manifest, write_side_files
from .lock import StagingLock
from .passes import learn_facts
from .progress import PROGRESS_NAME, ProgressFile, changed_source_shard, fingerprint, load_progress, source_identity
from .reading import ModuleReader
from .records import ConvertResult, Findings, Progress, RunOptions, ShardResult
from .shard import convert_shard


def convert(plan: Plan, dst: Path, run: RunOptions, progress: Progress | None = None) -> ConvertResult:
    """Convert `plan` into DST (see the module docstring for what a failure leaves)."""
    return ConversionJob(plan, dst, run, progress).execute()


class ConversionJob:
    def __init__(self, plan: Plan, dst: Path, run: RunOptions, progress: Progress | None = None):
        self.plan = plan
        self.dst = dst
        self.run = run
        self.device = resolve_device(run.device)
        self.progress = progress or (lambda n, s: None)
        self.start = time.time()

    def execute(self) -> ConvertResult:
        self.start = time.time()
        stage, fp = staging_dir(self.dst), fingerprint(self.plan)
        if self.run.resume and not stage.exists() and (self.dst / MANIFEST_NAME).exists():
            done = self._already_complete(fp)
            if done is not None:
                return done
        if stage.is_dir():
            self._stage_kind(stage, fp)  # refusals before the lock is taken: nothing touched
        created = missing_parents(stage)
        with writing(stage, self.dst):
            stage.mkdir(parents=True, exist_ok=True)
        lock = StagingLock(stage)
        fresh = False
        try:
            with writing(lock.path, self.dst):
                lock.acquire(self.dst)
            kind = self._stage_kind(stage, fp)  # again, now that no other run can change it
            fresh = kind == "new"
            return self._finish_installed(stage, lock) if kind == "finished" else \
                self._convert(stage, fp, kind, lock)
        except FilesystemError:
            raise
        except QuantcliError:
            if fresh:
                lock.release()
                discard(stage, created)
            raise
        except OSError as exc:  # one not caught where it happened (reading the source, say)
            raise filesystem_error(exc, stage, self.dst) from None
        finally:
            lock.release()

    def _convert(self, stage: Path, fp: str, kind: str, lock: StagingLock) -> ConvertResult:
        """Shards, then the side files, then the manifest (last: it marks the output complete)."""
        progress = self._open_progress(stage, fp, kind)
        results, written = self._convert_shards(stage, progress)
        with writing(stage, self.dst):
            write_side_files(self.plan, stage)
        found = Findings.merge(r.found for r in results.values())
        manifest = build_manifest(self.plan, fp, found)
        with writing(stage / MANIFEST_NAME, self.dst):
            (stage / MANIFEST_NAME).write_text(manifest.to_json())
            (stage / PROGRESS_NAME).unlink()
        lock.release()
        warnings = install(stage, self.dst)
        return self._result(written, len(results) - written, warnings, found.note_list(),
                            dict(sorted(found.errors.items())))

    def _convert_shards(self, stage: Path, progress: ProgressFile) -> tuple[dict[str, ShardResult], int]:
        """Every shard's result, in the plan's shard order; and how many were written now."""
        results: dict[str, ShardResult] = {}
        written = 0
        with CheckpointTensors(self.plan.source) as tensors:
            reader = ModuleReader(self.plan, tensors, self.device, self.run.backend)
            facts = learn_facts(reader)
            for shard, planned in self.plan.by_shard().items():
                out_path = stage / shard
                with writing(out_path.parent, self.dst):
                    out_path.parent.mkdir(parents=True, exist_ok=True)
                done = progress.finished(shard, out_path) if self.run.resume else None
                if done is not None:
                    results[shard] = done
                    self.progress(sum(t.bytes_in for t in planned), shard)
                    continue
                with writing(out_path, self.dst):
                    results[shard] = convert_shard(reader, shard, facts, out_path, self.progress)
                with writing(progress.path, self.dst):
                    progress.record(shard, results[shard])
                written += 1
                _fault_injection(written)
        return results, written

    def _result(self, written: int, resumed: int, warnings: list[str], notes: list[str],
                errors: dict[str, float] | None = None, already_complete: bool = False) -> ConvertResult:
        plan = self.plan
        return ConvertResult(self.dst, time.time() - self.start, plan.bytes_in, plan.bytes_out, written, resumed,
                             sum(t.quantized for t in plan.tensors), [*plan.warnings, *warnings], notes,
                             errors or {}, already_complete)

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
            return ProgressFile(path, load_progress(path))
        empty_staging(stage, self.dst)
        progress = ProgressFile.new(path, fp, self.run.overwrite, source_identity(self.plan.source))
        with writing(path, self.dst):
            progress.save()
        return progress


def _fault_injection(shards_written: int) -> None:
    """Crash-safety tests kill the process here (SIGKILL, no cleanup) after N shards."""
    limit = os.environ.get("QUANTCLI_KILL_AFTER_SHARDS")
    if limit and int(limit) == shards_written:
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
