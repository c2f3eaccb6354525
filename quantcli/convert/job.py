"""The conversion, as one sentence: open the staging folder (resuming what an interrupted run left,
staging.py) -> learn the facts (the fact passes: fused groups' amax, calibrated scales) -> walk
the layers for a weight pass (observe, solve, stage, re-run; passes/weight_walk.py) -> write the
shards -> write the side files and, last, the manifest -> put the folder in place of DST.

A reader therefore sees DST either absent (or as it was, with --overwrite) or complete. A data
refusal in a run that started fresh removes what it made (resuming would meet the same
refusal); a filesystem fault or an interruption keeps the staging folder, consistent, for
--resume, which reuses each shard the progress file records and that shard's recorded result.

On several ranks the same sentence runs on every rank (world.py): rank 0 alone opens the
staging folder and finalizes, each step is a meeting (`settle`: every rank's outcome known
before the next), and each rank writes the shards it is given; one process is the world of one.
"""

from __future__ import annotations

import time
from pathlib import Path

from quantcli.checkpoint.manifest import MANIFEST_NAME
from quantcli.checkpoint.tensors import CheckpointTensors
from quantcli.convert.destination import INSTALLED, FilesystemError, filesystem_error, install, manifest_doc, writing
from quantcli.convert.device import resolve_device
from quantcli.convert.finalize import build_manifest, import_ahead, write_side_files
from quantcli.convert.passes import CALIBRATION_CACHE, learn_facts, learn_weights
from quantcli.convert.progress import PROGRESS_NAME, fingerprint
from quantcli.convert.rank_files import RankRecords, check_shared_staging
from quantcli.convert.reading import ModuleReader
from quantcli.convert.records import ConvertResult, Findings, Progress, RunOptions, ShardResult
from quantcli.convert.shard import convert_shard
from quantcli.convert.staged import StagedWeights, discard_weights
from quantcli.convert.staging import Found, Opened, Staging
from quantcli.convert.world import World
from quantcli.errors import QuantcliError
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
        self.layers_resumed = (0, 0)  # the weight pass's layers staged by an interrupted run, of all

    def execute(self) -> ConvertResult:
        """The sentence of the module docstring."""
        self.start = time.time()
        INSTALLED.discard(self.dst.absolute())  # put in place by an earlier run in this process, if any
        world = self.world
        staging = Staging(self.plan, self.dst, fingerprint(self.plan), self.run)
        world.resume_hint = ResumeHint(staging.path)
        try:
            opened = Opened.from_json(world.settle_all(lambda: staging.open().to_json() if world.lead else None)[0])
            if opened.found == Found.COMPLETE:
                return self._result(0, 0, [], opened.notes, already_complete=True)
            if opened.found == Found.FINISHED:
                return self._install_finished(staging) if world.lead else self._result(0, 0, [], [])
            reused = {s: ShardResult.from_json(r) for s, r in opened.finished.items()}
            written = self._written_shards(staging, reused)
            results = {s: reused[s] if s in reused else written[s] for s in self.plan.by_shard()}
            found = Findings.merge(r.found for r in results.values())
            warnings = world.settle(lambda: self._finalize(staging, found) if world.lead else [])
            return self._result(len(results) - len(reused), len(reused), warnings, found.note_list(),
                                dict(sorted(found.errors.items())))
        except (FilesystemError, BrokenPipeError):  # kept for --resume (a closed pipe is an interruption)
            raise
        except QuantcliError:
            staging.discard_if_fresh()
            raise
        except OSError as exc:  # one not caught where it happened (reading the source, say)
            raise filesystem_error(exc, staging.path, self.dst) from None
        finally:
            staging.release()

    def _written_shards(self, staging: Staging, reused: dict[str, ShardResult]) -> dict[str, ShardResult]:
        """Learn the facts, walk the layers for a weight pass, write the shards not reused: this
        rank's, and every rank's results gathered."""
        world = self.world
        if world.size > 1:
            check_shared_staging(world, staging.path)
            staging.records = staging.records or RankRecords(staging.path, world.rank)
        if world.lead:
            import_ahead()
        sizes = {s: sum(t.bytes_in for t in planned) for s, planned in self.plan.by_shard().items()}
        mine = world.mine({s: n for s, n in sizes.items() if s not in reused})
        if world.lead:
            for shard in reused:
                self.progress(sizes[shard], shard)
        with CheckpointTensors(self.plan.source) as tensors:
            reader = ModuleReader(self.plan, tensors, self.device, self.run.backend, staging.path,
                                  self.progress if world.lead else None)
            facts = learn_facts(reader, world=world)
            staged = learn_weights(reader, facts, world=world)  # None: no weight pass takes a tensor
            self.layers_resumed = staged.resumed if staged is not None else (0, 0)
            try:
                shards = [s for s in sizes if s in mine]
                written = world.settle(lambda: self._write_shards(staging, reader, facts, staged, shards))
            finally:
                if staged is not None:
                    staged.close()
        gathered: dict[str, ShardResult] = {}
        for part in world.settle_all(lambda: {s: r.to_json() for s, r in written.items()}):
            gathered.update({s: ShardResult.from_json(r) for s, r in part.items()})
        return gathered

    def _write_shards(self, staging: Staging, reader: ModuleReader, facts, staged: StagedWeights | None,
                      shards: list[str]) -> dict[str, ShardResult]:
        results: dict[str, ShardResult] = {}
        for shard in shards:
            out_path = staging.path / shard
            with writing(out_path.parent, self.dst):
                out_path.parent.mkdir(parents=True, exist_ok=True)
            with writing(out_path, self.dst):
                results[shard] = convert_shard(reader, shard, facts, out_path, self.progress, staged)
            with writing(staging.records.path, self.dst):
                staging.records.record(shard, results[shard])
        return results

    def _finalize(self, staging: Staging, found: Findings) -> list[str]:
        """The side files, then the manifest (last: it marks the output complete), then the rename."""
        stage = staging.path
        with writing(stage, self.dst):
            write_side_files(self.plan, stage)
        manifest = build_manifest(self.plan, staging.fp, found)
        with writing(stage / MANIFEST_NAME, self.dst):
            (stage / MANIFEST_NAME).write_text(manifest.to_json())
            (stage / PROGRESS_NAME).unlink()
            (stage / CALIBRATION_CACHE).unlink(missing_ok=True)
            discard_weights(stage)
            for rank_file in RankRecords.files(stage):
                rank_file.unlink()
        staging.release()
        return install(stage, self.dst)

    def _result(self, written: int, resumed: int, warnings: list[str], notes: list[str],
                errors: dict[str, float] | None = None, already_complete: bool = False) -> ConvertResult:
        plan = self.plan
        return ConvertResult(self.dst, time.time() - self.start, plan.bytes_in, plan.bytes_out, written, resumed,
                             sum(t.quantized for t in plan.tensors), [*plan.all_warnings, *warnings], notes,
                             errors or {}, already_complete, self.layers_resumed)

    def _install_finished(self, staging: Staging) -> ConvertResult:
        """The staging folder is complete (the run died between the manifest and the rename)."""
        staging.release()
        notes = list(manifest_doc(staging.path).get("notes", []))
        warnings = install(staging.path, self.dst)
        return self._result(0, len(self.plan.by_shard()), warnings, notes)
