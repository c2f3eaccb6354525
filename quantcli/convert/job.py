"""The conversion, as one sentence: open the staging folder (resuming what an interrupted run left,
staging.py) -> learn the facts (the fact passes: fused groups' amax, calibrated scales) -> walk
the layers for a weight pass (observe, solve, stage, re-run; passes/weight_walk.py) -> write the
shards -> write the side files and, last, the manifest -> put the folder in place of DST.

A reader therefore sees DST either absent (or as it was, with --overwrite) or complete. A data
refusal in a run that started fresh removes what it made (resuming would meet the same
refusal); a filesystem fault or an interruption keeps the staging folder, consistent, for
--resume, which reuses each shard the progress file records and that shard's recorded result.

One process runs `ConversionJob.execute` as it reads. On several ranks the same sentence runs on
every rank (world.py): each step ends in a meeting (every rank's outcome known before the next),
rank 0 alone opens the staging folder and finalizes (`world.lead_alone` / `world.from_lead`),
and each rank learns facts and writes shards over its share. For one process every meeting is
the identity, so ranks and resume change no step, only what a step is given.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Iterator

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
        """The module docstring's sentence, step by step. One process runs it as it reads; with
        several ranks the steps that touch the staging folder run on rank 0 (`world.lead_alone`,
        `world.from_lead`) and every other step on each rank over its share."""
        self.start = time.time()
        INSTALLED.discard(self.dst.absolute())  # put in place by an earlier run in this process, if any
        staging = Staging(self.plan, self.dst, fingerprint(self.plan), self.run)
        self.world.resume_hint = ResumeHint(staging.path)
        with failure_policy(staging):
            opened = Opened.from_json(self.world.from_lead(lambda: staging.open().to_json()))
            if opened.found in (Found.COMPLETE, Found.FINISHED):
                return self._nothing_to_convert(staging, opened)
            reused = opened.reused()  # --resume: the shards an interrupted run finished
            written = self._convert_shards(staging, [s for s in self.plan.by_shard() if s not in reused])
            results = {**reused, **written}
            found = Findings.merge(results[s].found for s in self.plan.by_shard())  # in shard order, as written
            warnings = self.world.lead_alone(lambda: self._finalize(staging, found)) or []
            return self._result(len(written), len(reused), warnings, found.note_list(),
                                dict(sorted(found.errors.items())))

    def _convert_shards(self, staging: Staging, shards: list[str]) -> dict[str, ShardResult]:
        """Learn the facts, walk the layers for a weight pass, write `shards` (this rank its share):
        every rank's results."""
        world = self.world
        self._join_staging(staging)
        mine = self._share_of(shards)
        with CheckpointTensors(self.plan.source) as tensors:
            reader = ModuleReader(self.plan, tensors, self.device, self.run.backend, staging.path,
                                  self.progress if world.lead else None)
            facts = learn_facts(reader, world=world)  # fused groups' amax, calibrated scales
            staged = learn_weights(reader, facts, world=world)  # the weight pass's walk; None: no pass
            self.layers_resumed = staged.resumed if staged is not None else (0, 0)
            try:
                written = world.settle(lambda: self._write_shards(staging, reader, facts, staged, mine))
            finally:
                if staged is not None:
                    staged.close()
        merged = world.merged({s: r.to_json() for s, r in written.items()})
        return {s: ShardResult.from_json(r) for s, r in merged.items()}

    def _join_staging(self, staging: Staging) -> None:
        """Several ranks: each checks it sees rank 0's staging folder and keeps its own records."""
        if self.world.size > 1:
            check_shared_staging(self.world, staging.path)
            staging.records = staging.records or RankRecords(staging.path, self.world.rank)
        if self.world.lead:
            import_ahead()

    def _share_of(self, shards: list[str]) -> list[str]:
        """This rank's shards out of `shards` (longest first by bytes); rank 0's bar counts the
        shards an interrupted run finished as done."""
        sizes = {s: sum(t.bytes_in for t in planned) for s, planned in self.plan.by_shard().items()}
        mine = self.world.mine({s: sizes[s] for s in shards})
        if self.world.lead:
            for shard in sizes:
                if shard not in shards:
                    self.progress(sizes[shard], shard)
        return [s for s in sizes if s in mine]

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

    def _nothing_to_convert(self, staging: Staging, opened: Opened) -> ConvertResult:
        """DST is this plan's finished output (--resume), or the staging folder is complete and
        only its rename was left (the run died between the manifest and the rename)."""
        if opened.found == Found.COMPLETE or not self.world.lead:
            return self._result(0, 0, [], opened.notes, already_complete=opened.found == Found.COMPLETE)
        staging.release()
        notes = list(manifest_doc(staging.path).get("notes", []))
        warnings = install(staging.path, self.dst)
        return self._result(0, len(self.plan.by_shard()), warnings, notes)


@contextlib.contextmanager
def failure_policy(staging: Staging) -> Iterator[None]:
    """What a failure leaves (the module docstring): a filesystem fault or an interruption keeps the
    staging folder for --resume; a refusal of the data removes a fresh run's folder."""
    try:
        yield
    except (FilesystemError, BrokenPipeError):  # kept for --resume (a closed pipe is an interruption)
        raise
    except QuantcliError:
        staging.discard_if_fresh()
        raise
    except OSError as exc:  # one not caught where it happened (reading the source, say)
        raise filesystem_error(exc, staging.path, staging.dst) from None
    finally:
        staging.release()
