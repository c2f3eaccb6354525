"""`quantcli convert`: stream a safetensors checkpoint into a quantized one.

Data flow (DESIGN.md): plan from headers -> pass 1, the shared amax of each fused group ->
pass 2, shard by shard, tensor by tensor: read -> quantize -> layout names -> streamed into a
shard in the staging folder `DST.partial` -> index, configs, copied files, model card ->
manifest last -> the staging folder is renamed to DST. A reader therefore sees DST either
absent (or as it was, with --overwrite) or complete. A progress file in the staging folder
records finished shards (size + sha256) so --resume continues an interrupted run and yields
the same bytes.

Nothing is lost or half-written (issue 10): every destination problem is refused before any
work (`check_destination`); one run at a time holds the staging folder (`StagingLock`); the
progress file records what each source shard was (size, mtime, sampled hash) so --resume never
reuses shards made from other bytes; a filesystem fault keeps the staging folder for --resume,
a data refusal in a fresh run removes it; the old DST is only set aside, never deleted, until
the new one is in place.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import socket
import struct
import time
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from . import __version__
from .errors import CheckpointError, QuantcliError
from .facts import ModuleFacts
from .manifest import MANIFEST_NAME, DiskEntry, Manifest, ModuleEntry
from .plan import Plan, TensorPlan
from .decode import decode_module
from .recipes import QuantizedTensor
from .safetensors_io import DTYPES, ShardWriter, tensor_bytes
from .source import INDEX, Source
from .tensors import CheckpointTensors

PROGRESS_NAME = ".quantcli-progress.json"
LOCK_NAME = ".quantcli-lock"
ASIDE_SUFFIX = ".quantcli-replaced"  # the old DST, renamed aside by --overwrite until the new one is in
SAMPLE_WINDOWS = 8  # the cheap source hash: header + this many 64 KiB windows spread over the file
SAMPLE_BYTES = 1 << 16
WRITE_QUEUE = 2
Progress = Callable[[int, str], None]  # (bytes just done, current shard)


@dataclass
class RunOptions:
    device: str = "auto"
    backend: str = "auto"
    resume: bool = False
    overwrite: bool = False


@dataclass
class ConvertResult:
    dst: Path
    seconds: float
    bytes_in: int
    bytes_out: int
    shards_written: int
    shards_resumed: int
    quantized: int
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    requantize_errors: dict[str, float] = field(default_factory=dict)
    already_complete: bool = False  # --resume found DST finished with the same fingerprint


class FilesystemError(CheckpointError):
    """Disk full, file-size limit, permission: the staging folder is kept for --resume."""


# errno -> (what happened, what to do)
FS_FAULTS = {
    errno.ENOSPC: ("disk full (no space left on device)", "free space"),
    errno.EDQUOT: ("disk quota exceeded", "free space or raise the quota"),
    errno.EFBIG: ("file size limit reached (EFBIG)", "raise the limit (ulimit -f) or use a filesystem that "
                                                      "takes larger files"),
    errno.EACCES: ("permission denied", "make the folder writable"),
    errno.EPERM: ("permission denied", "make the folder writable"),
    errno.EROFS: ("read-only file system", "write to a writable filesystem"),
}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise QuantcliError(f"--device {device!r}: not a device; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise QuantcliError(f"--device {device}: CUDA is not available on this machine; use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise QuantcliError(f"--device {device}: only cpu and cuda are supported")
    return dev


def fingerprint(plan: Plan) -> str:
    """Identifies (source headers and sizes, recipe choices, layout, quantcli version)."""
    h = hashlib.sha256()
    h.update(__version__.encode())
    h.update(plan.target.encode())
    for t in plan.tensors:
        h.update(f"{t.name}|{t.shard}|{t.dtype}|{t.shape}|{t.recipe}|{t.transpose}|{t.fused_group}|{t.action}|"
                 f"{t.source_recipe}".encode())
    for name, r in sorted(plan.recipes.items()):
        h.update(f"{name}:{r.scale_rule}".encode())
    for shard in plan.source.shards:
        header = plan.source.headers[shard]
        h.update(json.dumps({n: [i.start, i.end] for n, i in sorted(header.tensors.items())}).encode())
    return h.hexdigest()


def check_run_options(run: RunOptions) -> None:
    """The device and the kernel backend can run here: found before anything is written."""
    from .kernels import resolve_backend

    device = resolve_device(run.device)
    try:
        resolve_backend(run.backend, device)
    except (RuntimeError, ValueError) as exc:
        raise QuantcliError(f"--backend {run.backend}: cannot run on {device.type} here ({exc}); "
                            f"use --backend torch") from None


def staging_dir(dst: Path) -> Path:
    return dst.with_name(dst.name + ".partial")


def aside_dir(dst: Path) -> Path:
    return dst.with_name(dst.name + ASIDE_SUFFIX)


def check_destination(src: Path | None, dst: Path, run: RunOptions) -> None:
    """Every destination problem, refused before the source is read or anything is written."""
    if dst.name in ("", ".", ".."):  # '', '.', '..' or '/': the staging folder needs a name beside DST
        named = Path(os.path.abspath(dst))
        if not named.name:
            raise CheckpointError(f"{dst}: the file-system root cannot be a destination; name a new folder")
        raise CheckpointError(f"{dst or '.'}: is the folder {named}, not a new one; name the output folder, "
                              f"e.g. {named / 'quantized'}")
    stage, aside = staging_dir(dst), aside_dir(dst)
    # DST is replaced by renaming a finished folder onto it: a link would be replaced, not its
    # target written, so a link is refused whatever it points at (the user names the real folder).
    if dst.is_symlink():
        raise CheckpointError(f"{dst}: is a symbolic link (to {os.readlink(dst)}); quantcli replaces DST by "
                              f"renaming a finished folder onto it, so pass the real folder {dst.resolve()} instead")
    _check_parent(dst)
    dst_r = dst.resolve()
    if src is not None:
        src_r = src.resolve()
        src_dir = src_r if src_r.is_dir() else src_r.parent
        if dst_r == src_dir or src_dir in dst_r.parents:
            raise CheckpointError(f"{dst}: is the source folder or inside it; choose a destination outside {src_dir}")
        if dst_r in src_r.parents:
            raise CheckpointError(f"{dst}: contains the source {src}; choose a destination that does not hold it")
    if dst.exists() and not dst.is_dir():
        raise CheckpointError(f"{dst}: exists and is not a folder; choose another destination")
    if stage.is_symlink() or (stage.exists() and not stage.is_dir()):
        raise CheckpointError(f"{stage}: exists and is not a folder, so it cannot be the staging folder of "
                              f"{dst.name}; remove it or choose another destination")
    holder = StagingLock(stage).live_holder()
    if holder is not None:
        raise CheckpointError(holder.busy_message(dst))
    _check_aside(dst, run)
    dst_full = dst.exists() and any(dst.iterdir())
    if dst_full and not run.overwrite:
        _check_resume_into_full(dst, run)
    if stage.exists() and not run.resume and not run.overwrite:
        raise CheckpointError(f"{stage}: an interrupted run left this; rerun with --resume to continue "
                              f"it or --overwrite to start over")
    if run.resume and (stage / PROGRESS_NAME).exists():
        load_progress(stage / PROGRESS_NAME)  # a corrupt one is refused now, touching nothing


def _check_parent(dst: Path) -> None:
    """The nearest existing ancestor must be a writable folder (missing parents are created)."""
    parent = dst.absolute().parent
    while not parent.exists() and not parent.is_symlink() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise CheckpointError(f"{dst}: its parent {parent} is not a folder; choose another destination")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CheckpointError(f"{dst}: cannot write in {parent} (permission denied or read-only); "
                              f"choose a writable destination")


def _check_aside(dst: Path, run: RunOptions) -> None:
    """DST.quantcli-replaced exists only after a crash inside the final swap of --overwrite."""
    aside, stage = aside_dir(dst), staging_dir(dst)
    if not (aside.exists() or aside.is_symlink()):
        return
    if dst.exists():
        raise CheckpointError(f"{aside}: the previous {dst.name}, set aside by an interrupted --overwrite; the new "
                              f"{dst} is complete: delete {aside} once you have checked it, then rerun")
    if not (run.resume and stage.is_dir()):
        raise CheckpointError(f"{aside}: the previous {dst.name}, set aside by an interrupted --overwrite; rerun "
                              f"with --resume to put the new output from {stage} in place, or move {aside} back "
                              f"to {dst}")


def _check_resume_into_full(dst: Path, run: RunOptions) -> None:
    """A non-empty DST without --overwrite: only --resume of a run that may replace it goes on."""
    stage = staging_dir(dst)
    if not run.resume:
        raise CheckpointError(f"{dst}: exists and is not empty; pass --overwrite to replace it or --resume to "
                              f"continue an interrupted run")
    if stage.is_dir():
        state = load_progress(stage / PROGRESS_NAME) if (stage / PROGRESS_NAME).exists() else {}
        if not state.get("replace_dst"):
            raise CheckpointError(f"{dst}: exists and is not empty, and the interrupted run in {stage} was not "
                                  f"started with --overwrite; pass --overwrite with --resume to replace {dst}")
        return
    if not (dst / MANIFEST_NAME).exists():  # a finished quantcli output is compared after the plan
        raise CheckpointError(f"{dst}: exists and is not empty, and there is no interrupted run ({stage}) to "
                              f"resume; --resume never replaces a folder it did not write: use --overwrite to "
                              f"replace it")


# --- what each source shard was, so --resume never reuses shards made from other bytes


def source_identity(source: Source) -> dict[str, dict]:
    """Per local source shard: size, mtime_ns and a sampled content hash. Hub sources: none (a
    commit's files do not change, and hashing would download every shard up front)."""
    if source.repo_id is not None:
        return {}
    return {shard: shard_identity(source.root / shard) for shard in source.shards}


def shard_identity(path: Path) -> dict:
    """sha256 over the header and SAMPLE_WINDOWS 64 KiB windows spread over the data (all of a
    small file): a cheap check that also works for TB checkpoints, where a full hash would not."""
    st = os.stat(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        h.update(head)
        h.update(f.read(min(n, st.st_size)))
        start = f.tell()
        span = st.st_size - start
        if span <= SAMPLE_WINDOWS * SAMPLE_BYTES:
            h.update(f.read())
        else:
            for i in range(SAMPLE_WINDOWS):
                f.seek(start + (span - SAMPLE_BYTES) * i // (SAMPLE_WINDOWS - 1))
                h.update(f.read(SAMPLE_BYTES))
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sample_sha256": h.hexdigest()}


def changed_source_shard(recorded: dict[str, dict], now: dict[str, dict]) -> str | None:
    for shard in sorted(set(recorded) | set(now)):
        if recorded.get(shard) != now.get(shard):
            return shard
    return None


# --- the progress file


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_json_atomic(path: Path, obj: object) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def _is_map(value: object, key_type: type = str, value_type: type | tuple = object) -> bool:
    return isinstance(value, dict) and all(isinstance(k, key_type) and isinstance(v, value_type)
                                           for k, v in value.items())


def _valid_progress(state: object) -> bool:
    number = (int, float)
    if not (isinstance(state, dict) and isinstance(state.get("fingerprint"), str)
            and isinstance(state.get("replace_dst"), bool) and _is_map(state.get("sources"), str, dict)
            and _is_map(state.get("shards"), str, dict)):
        return False
    for rec in state["sources"].values():
        if not (isinstance(rec.get("size"), int) and isinstance(rec.get("mtime_ns"), int)
                and isinstance(rec.get("sample_sha256"), str)):
            return False
    for rec in state["shards"].values():
        if not (isinstance(rec.get("size"), int) and isinstance(rec.get("sha256"), str)
                and _is_map(rec.get("globals"), str, number) and _is_map(rec.get("notes"), str, str)
                and _is_map(rec.get("errors"), str, number)):
            return False
    return True


def load_progress(path: Path) -> dict:
    """The progress file of an interrupted run, checked field by field (it decides which shards
    are reused, so a damaged one is refused rather than guessed at)."""
    try:
        state = json.loads(path.read_text())
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read the progress file ({exc.strerror}); rerun with --overwrite "
                              f"to start over") from None
    except ValueError:
        state = None
    if not _valid_progress(state):
        raise CheckpointError(f"{path}: the progress file is corrupt (not the JSON quantcli writes), so --resume "
                              f"cannot trust the shards beside it; rerun with --overwrite to start over")
    return state


class _Progress:
    def __init__(self, path: Path, state: dict):
        self.path = path
        self.state = state

    def save(self) -> None:
        _write_json_atomic(self.path, self.state)

    def done(self, shard: str, path: Path) -> dict | None:
        rec = self.state["shards"].get(shard)
        if rec and path.exists() and path.stat().st_size == rec["size"] and _sha256(path) == rec["sha256"]:
            return rec
        return None

    def record(self, shard: str, size: int, sha256: str, found: dict[str, dict]) -> None:
        """`found`: what the shard's conversion learned per module (globals, notes, errors)."""
        self.state["shards"][shard] = {"size": size, "sha256": sha256, **found}
        self.save()


# --- one run at a time per destination


@dataclass(frozen=True)
class LockHolder:
    pid: int
    host: str
    path: Path
    raw: str
    being_written: bool = False

    @property
    def alive(self) -> bool:
        if self.pid == 0:
            return self.being_written
        if self.host != socket.gethostname():
            return True  # another machine's process cannot be checked: assume it runs
        return _pid_alive(self.pid)

    def busy_message(self, dst: Path) -> str:
        where = "" if self.host == socket.gethostname() else f" on {self.host}"
        who = f"pid {self.pid}{where}" if self.pid else "its lock is being written"
        return (f"{dst}: another quantcli convert ({who}) is writing it (lock {self.path}); wait for it to "
                f"finish, or stop it and rerun with --resume" + (f"; if that run is gone, delete {self.path}"
                                                                   if where else ""))


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


class StagingLock:
    """`STAGE/.quantcli-lock` holding {"pid", "host", "token"}: created with O_CREAT|O_EXCL, so one run
    holds a staging folder at a time. A lock whose pid is gone (on this host) is stale and taken
    over: renamed away atomically (only one run can move a given file), checked to be the stale
    one, then created anew with O_EXCL."""

    def __init__(self, stage: Path):
        self.path = stage / LOCK_NAME
        self.content = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "token": uuid.uuid4().hex})
        self.held = False

    def holder(self) -> LockHolder | None:
        try:
            raw = self.path.read_text()
        except FileNotFoundError:
            return None
        try:
            obj = json.loads(raw)
            return LockHolder(int(obj["pid"]), str(obj["host"]), self.path, raw)
        except (ValueError, KeyError, TypeError):
            pass
        # Unreadable: a run between creating and writing it (a young file), or one that died there.
        try:
            young = time.time() - self.path.stat().st_mtime < 10
        except FileNotFoundError:
            return None
        return LockHolder(0, socket.gethostname(), self.path, raw, being_written=young)

    def live_holder(self) -> LockHolder | None:
        holder = self.holder()
        return holder if holder is not None and holder.alive else None

    def acquire(self, dst: Path) -> None:
        for _ in range(5):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self.holder()
                if holder is not None and holder.alive:
                    raise CheckpointError(holder.busy_message(dst)) from None
                if holder is not None:
                    self._remove_stale(holder)
                continue
            try:
                os.write(fd, self.content.encode())
            finally:
                os.close(fd)
            self.held = True
            return
        raise CheckpointError(f"{dst}: could not take the lock {self.path} (other runs keep taking it); "
                              f"make sure no other quantcli convert writes {dst}, then rerun")

    def _remove_stale(self, stale: LockHolder) -> None:
        moved = self.path.with_name(f"{LOCK_NAME}.stale-{uuid.uuid4().hex}")
        try:
            os.rename(self.path, moved)
        except FileNotFoundError:
            return  # another run moved it first
        if moved.read_text() != stale.raw:
            # Another run replaced the stale lock between our read and the rename: put its live
            # lock back (link fails if yet another lock appeared, and then that one stands).
            with contextlib.suppress(FileExistsError):
                os.link(moved, self.path)
        moved.unlink()

    def release(self) -> None:
        if self.held:
            with contextlib.suppress(FileNotFoundError):
                if self.path.read_text() == self.content:
                    self.path.unlink()
            self.held = False


class Converter:
    def __init__(self, plan: Plan, dst: Path, run: RunOptions, progress: Progress | None = None):
        self.plan = plan
        self.dst = dst
        self.run = run
        self.device = resolve_device(run.device)
        self.backend = run.backend
        self.progress = progress or (lambda n, s: None)
        self.globals: dict[str, float] = {}  # module -> weight_scale_2 (multiplier), for the manifest
        self.notes: dict[str, str] = {}  # module -> what the user must know (inexact reciprocals)
        self.errors: dict[str, float] = {}  # module -> re-quantized vs decoded source, relative L2 error

    def _found(self) -> dict[str, dict]:
        return {"globals": self.globals, "notes": self.notes, "errors": self.errors}

    # --- reading a module

    def source_quantized(self, t: TensorPlan, tensors: CheckpointTensors) -> QuantizedTensor:
        """A module of a quantized source, read through the source layout."""
        layout = self.plan.source_layout
        return layout.from_disk(t.module, layout.recipe_for(t.source_recipe), tensors.get, tensors.where)

    def weight(self, t: TensorPlan, tensors: CheckpointTensors) -> torch.Tensor:
        """The weight to quantize, on the device, as [..., N, K]: the source tensor, or the
        decoded module of a quantized source."""
        if t.source_recipe is None:
            w = tensors.get(t.name).to(self.device)
            return w.transpose(-1, -2) if t.transpose else w
        layout = self.plan.source_layout
        q = self.source_quantized(t, tensors)
        return decode_module(layout, t.module, layout.recipe_for(t.source_recipe), q, backend=self.backend,
                             device=self.device)

    def inputs(self, t: TensorPlan) -> list[str]:
        """The source tensors a planned tensor reads."""
        if t.source_recipe is None:
            return [t.name]
        layout = self.plan.source_layout
        return [d.name for d in layout.describe(t.module, layout.recipe_for(t.source_recipe))]

    # --- pass 1

    def fused_amax(self, tensors: CheckpointTensors) -> dict[str, torch.Tensor]:
        """The max |w| over each fused group's members, streaming (one tensor at a time)."""
        from .kernels import tensor_amax

        out = {}
        for group, members in self.plan.fused_groups().items():
            amaxes = []
            for t in members:  # NaN/Inf is refused naming the tensor (not only its group)
                amaxes.append(tensor_amax(self.weight(t, tensors), backend=self.backend, name=t.name).cpu())
                for name in self.inputs(t):
                    tensors.release(name)
            out[group] = torch.stack(amaxes).amax()
        return out

    # --- pass 2

    def produce(self, t: TensorPlan, tensors: CheckpointTensors,
                group_amax: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | memoryview]:
        """The output tensors of one planned tensor, by its action."""
        if t.action == "copy":
            return {t.name: tensors.raw(t.name)}  # bit-identical pass-through
        if t.action == "relayout":  # codes and block scales carried over byte for byte
            q = self.source_quantized(t, tensors)
            self._note_global(t, q)
            out = self.plan.layout.to_disk(t.module, q)
            self._check_inversion(t, out, tensors)
            return out
        w = self.weight(t, tensors)
        if t.action == "dequantize":
            w = w.transpose(-1, -2) if t.transpose else w
            (out,) = t.outputs
            return {out.name: w.to(DTYPES[out.dtype]).cpu()}
        recipe = self.plan.recipes[t.recipe]
        q = recipe.quantize(t.name, w, backend=self.backend,
                            facts=ModuleFacts(group_amax=group_amax.get(t.fused_group) if t.fused_group else None))
        self._note_global(t, q)
        if t.action == "requantize":  # the combined error, against the decoded source
            d = recipe.dequantize(q, backend=self.backend)
            self.errors[t.module] = float((d - w).float().norm() / w.float().norm().clamp_min(1e-30))
        return self.plan.layout.to_disk(t.module, q.to("cpu"))

    def _note_global(self, t: TensorPlan, q: QuantizedTensor) -> None:
        if q.global_scale is not None:
            self.globals[t.module] = float(q.global_scale)

    def _check_inversion(self, t: TensorPlan, out: dict[str, torch.Tensor], tensors: CheckpointTensors) -> None:
        """A re-layout between multiply (`weight_scale_2`) and divide (`weight_global_scale`) globals
        is exact only if the reciprocal written inverts back to the source's value in FP32."""
        src, dst = self.plan.source_layout, self.plan.layout
        before = _global_scale(src, t.module, src.recipe_for(t.source_recipe), tensors.get)
        after = _global_scale(dst, t.module, self.plan.recipes[t.recipe], out.__getitem__)
        if before is None or after is None:
            return
        (b, b_dir), (a, a_dir) = before, after
        back = a if a_dir == b_dir else 1.0 / a
        if not torch.equal(back, b):
            self.notes[t.module] = (f"{t.module}: global scale {float(b)!r} ({b_dir}) has no exact FP32 reciprocal; "
                                    f"wrote {float(a)!r} ({a_dir}), which inverts to {float(back)!r}")

    def write_shard(self, shard: str, planned: list[TensorPlan], out_path: Path, tensors: CheckpointTensors,
                    group_amax: dict[str, torch.Tensor]) -> tuple[int, str]:
        """Write one output shard atomically; returns its size and SHA-256. A failed or interrupted
        write leaves no partial file behind (and the progress file never names one)."""
        tmp = out_path.with_name(out_path.name + ".tmp")
        try:
            with open(tmp, "wb") as f:
                writer = self._stream_shard(f, shard, planned, tensors, group_amax)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, out_path)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            if isinstance(exc, OSError):  # a write() error names no file: name the shard
                raise self.filesystem_error(exc, out_path) from None
            raise
        return writer.size, writer.sha256

    def _stream_shard(self, f, shard: str, planned: list[TensorPlan], tensors: CheckpointTensors,
                      group_amax: dict[str, torch.Tensor]) -> ShardWriter:
        producer = {o.name: t for t in planned for o in t.outputs}
        specs = [o for t in planned for o in t.outputs]
        writer = ShardWriter(f, specs, {"format": "pt"})
        # One background thread writes (and hashes) while the next tensor is read and quantized;
        # at most WRITE_QUEUE outputs wait, so memory stays a few tensors whatever the shard size.
        io = ThreadPoolExecutor(max_workers=1)
        try:
            pending: dict[str, torch.Tensor | memoryview] = {}
            queued: deque[Future] = deque()
            for spec in writer.order:
                if spec.name not in pending:
                    t = producer[spec.name]
                    pending.update(self.produce(t, tensors, group_amax))
                    for name in self.inputs(t):
                        tensors.release(name)
                    self.progress(t.bytes_in, shard)
                data = pending.pop(spec.name)
                queued.append(io.submit(writer.write, spec.name,
                                        data if isinstance(data, memoryview) else tensor_bytes(data)))
                while len(queued) > WRITE_QUEUE or (queued and queued[0].done()):
                    queued.popleft().result()  # re-raises a write error here
            while queued:
                queued.popleft().result()
        except BaseException:
            # Ctrl-C or a failed write: the queued writes are dropped at once; only the one already
            # running finishes (a write call cannot be interrupted) before the file is closed.
            io.shutdown(wait=True, cancel_futures=True)
            raise
        io.shutdown(wait=True)
        writer.finish()
        return writer

    # --- filesystem faults

    def filesystem_error(self, exc: OSError, path: Path) -> FilesystemError:
        """One line naming the file and saying which fault (disk full, size limit, permission)."""
        file = Path(exc.filename2 or exc.filename or path)  # filename2: the destination of a copy
        stage = staging_dir(self.dst)
        writing = stage in file.parents or file in (stage, self.dst) or file.parent == self.dst.absolute().parent \
            or file.parent == self.dst.parent
        what, fix = FS_FAULTS.get(exc.errno, (exc.strerror or type(exc).__name__, "fix that"))
        if not writing and exc.errno in (errno.EACCES, errno.EPERM):
            fix = "make it readable"
        kept = f" ({stage} is kept)" if stage.exists() else ""
        return FilesystemError(f"{file}: {what} while {'writing' if writing else 'reading'}; {fix}, then rerun "
                               f"with --resume to continue{kept}")

    @contextlib.contextmanager
    def _writing(self, path: Path):
        try:
            yield
        except OSError as exc:
            raise self.filesystem_error(exc, path) from None

    # --- the job

    def execute(self) -> ConvertResult:
        """Convert into the staging folder, then put it in place. A data refusal in a run that
        started fresh removes what it made (resuming would meet the same refusal); a filesystem
        fault or an interruption keeps the staging folder, consistent, for --resume."""
        start = time.time()
        plan, dst = self.plan, self.dst
        stage = staging_dir(dst)
        fp = fingerprint(plan)
        if self.run.resume and not stage.exists() and (dst / MANIFEST_NAME).exists():
            done = self._already_complete(fp, start)
            if done is not None:
                return done
        if stage.is_dir():
            self._stage_kind(stage, fp)  # refusals before the lock is taken: nothing touched
        created = _missing_parents(stage)
        with self._writing(stage):
            stage.mkdir(parents=True, exist_ok=True)
        lock = StagingLock(stage)
        fresh = False
        try:
            with self._writing(lock.path):
                lock.acquire(dst)
            kind = self._stage_kind(stage, fp)  # again, now that no other run can change it
            if kind == "finished":
                lock.release()
                doc = _manifest_doc(stage)
                warnings = self._install(stage)
                return ConvertResult(dst, time.time() - start, plan.bytes_in, plan.bytes_out, 0, len(plan.by_shard()),
                                     sum(t.quantized for t in plan.tensors), [*plan.warnings, *warnings],
                                     list(doc.get("notes", [])))
            fresh = kind == "new"
            progress = self._open_progress(stage, fp, kind)
            written, resumed = self._convert_shards(stage, progress)
            with self._writing(stage):
                self.write_side_files(stage, fp)
            manifest = self.manifest(fp)
            with self._writing(stage / MANIFEST_NAME):
                (stage / MANIFEST_NAME).write_text(manifest.to_json())
                (stage / PROGRESS_NAME).unlink()
            lock.release()
            warnings = self._install(stage)
        except FilesystemError:
            raise
        except QuantcliError:
            if fresh:
                lock.release()
                _discard(stage, created)
            raise
        except OSError as exc:  # one not caught where it happened (reading the source, say)
            raise self.filesystem_error(exc, stage) from None
        finally:
            lock.release()
        return ConvertResult(dst, time.time() - start, plan.bytes_in, plan.bytes_out, written, resumed,
                             sum(t.quantized for t in plan.tensors), [*plan.warnings, *warnings], self.note_list(),
                             dict(sorted(self.errors.items())))

    def _already_complete(self, fp: str, start: float) -> ConvertResult | None:
        """--resume on a finished DST: the same plan is done, touch nothing; another plan is
        refused, or with --overwrite too (None) converted afresh."""
        plan, dst = self.plan, self.dst
        doc = _manifest_doc(dst)
        if doc.get("fingerprint") != fp:
            if self.run.overwrite:
                return None
            raise CheckpointError(f"{dst}: holds a finished quantcli output of another source, recipe or options, "
                                  f"and there is no interrupted run to resume; use --overwrite to replace it")
        return ConvertResult(dst, time.time() - start, plan.bytes_in, plan.bytes_out, 0, 0,
                             sum(t.quantized for t in plan.tensors), list(plan.warnings), list(doc.get("notes", [])),
                             already_complete=True)

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
            if _manifest_doc(stage).get("fingerprint") != fp:
                raise CheckpointError(f"{stage}: holds a finished conversion of another source, recipe or options; "
                                      f"rerun with --overwrite to start over")
            return "finished"
        if _leftovers(stage) and not self.run.overwrite:
            raise CheckpointError(f"{stage}: has no progress file, so it is not an interrupted quantcli run that "
                                  f"--resume can continue; pass --overwrite to start over")
        return "new"

    def _open_progress(self, stage: Path, fp: str, kind: str) -> _Progress:
        """The interrupted run's record (kind 'resume'), or a new one in an emptied folder."""
        path = stage / PROGRESS_NAME
        if kind == "resume":
            return _Progress(path, load_progress(path))
        with self._writing(stage):
            for p in _leftovers(stage):  # --overwrite: start over inside the folder this run now holds
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        progress = _Progress(path, {"fingerprint": fp, "replace_dst": self.run.overwrite,
                                    "sources": source_identity(self.plan.source), "shards": {}})
        with self._writing(path):
            progress.save()
        return progress

    def _convert_shards(self, stage: Path, progress: _Progress) -> tuple[int, int]:
        written = resumed = 0
        with CheckpointTensors(self.plan.source) as tensors:
            group_amax = self.fused_amax(tensors) if self.plan.fused_groups() else {}
            for shard, planned in self.plan.by_shard().items():
                out_path = stage / shard
                with self._writing(out_path.parent):
                    out_path.parent.mkdir(parents=True, exist_ok=True)
                rec = progress.done(shard, out_path) if self.run.resume else None
                if rec is not None:
                    for key, found in self._found().items():
                        found.update(rec[key])
                    self.progress(sum(t.bytes_in for t in planned), shard)
                    resumed += 1
                    continue
                before = {key: set(found) for key, found in self._found().items()}
                size, sha256 = self.write_shard(shard, planned, out_path, tensors, group_amax)
                with self._writing(progress.path):
                    progress.record(shard, size, sha256, {key: {m: v for m, v in found.items() if m not in before[key]}
                                                          for key, found in self._found().items()})
                written += 1
                _fault_injection(written)
        return written, resumed

    def _install(self, stage: Path) -> list[str]:
        """Put the staging folder in place of DST without ever deleting DST first: the old one is
        renamed aside, the new one renamed in, and only then the old one deleted. A crash in
        between leaves both (check_destination explains what to do)."""
        dst, aside = self.dst, aside_dir(self.dst)
        with self._writing(dst):
            if dst.exists():
                os.rename(dst, aside)
            os.rename(stage, dst)
        if not aside.exists():
            return []
        try:
            shutil.rmtree(aside)
        except OSError as exc:
            return [f"{aside}: the replaced destination could not be deleted ({exc.strerror}); delete it yourself"]
        return []


    def note_list(self) -> list[str]:
        return [self.notes[m] for m in sorted(self.notes)]

    def write_side_files(self, stage: Path, fp: str) -> None:
        plan = self.plan
        source = plan.source
        groups = plan.modules_by_recipe()
        excluded = plan.excluded_names()
        if source.weight_map or len(source.shards) > 1:
            weight_map = {o.name: t.shard for t in plan.tensors for o in t.outputs}
            index = {"metadata": {"total_size": plan.bytes_out},
                     "weight_map": dict(sorted(weight_map.items()))}
            _write_json_atomic(stage / INDEX, index)
        for rel in source.other_files():
            target = stage / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source.root / rel, target)
        config = dict(source.config)
        config.pop("quantization_config", None)
        if plan.layout is not None and any(t.quantized for t in plan.tensors):
            config["quantization_config"] = plan.layout.quantization_config(groups, excluded)
            for name, obj in plan.layout.extra_files(groups, excluded).items():
                _write_json_atomic(stage / name, obj)
        _write_json_atomic(stage / "config.json", config)
        readme = stage / "README.md"
        card = model_card(plan)
        text = readme.read_text() if readme.exists() else ""
        readme.write_text(text + ("\n" if text and not text.endswith("\n") else "") + card)

    def manifest(self, fp: str) -> Manifest:
        plan = self.plan
        modules = []
        for t in plan.tensors:
            if not t.quantized:
                continue
            recipe = plan.recipes[t.recipe]
            specs = {o.name: o for o in t.outputs}
            disk = []
            for d in plan.layout.describe(t.module, recipe):
                o = specs[d.name]
                value = None
                if d.role == "global_scale":
                    s2 = self.globals[t.module]
                    value = s2 if d.direction == "multiply" else float(1.0 / torch.tensor(s2, dtype=torch.float32))
                disk.append(DiskEntry(d.name, d.role, o.dtype, o.shape, d.encoding, d.direction, value))
            entry = module_entry(t, recipe, tuple(disk))
            if t.action == "relayout" and recipe.scale_rules:  # the bytes are the source producer's
                entry = replace(entry, scale_rule=f"as in the {plan.source_layout.name} source")
            if t.action == "requantize":  # verify against the original model adds this error to its yardstick
                entry = replace(entry, requantized_from=t.source_recipe, requantize_rel_err=self.errors.get(t.module))
            modules.append(entry)
        excluded = tuple(plan.excluded_names()) if plan.layout is not None else ()
        return Manifest(__version__, plan.target, plan.options.recipe, plan.source.describe(), fp, tuple(modules),
                        excluded, lossless=plan.lossless, notes=tuple(self.note_list()))


def module_entry(t: TensorPlan, recipe, disk: tuple[DiskEntry, ...]) -> ModuleEntry:
    fp4 = recipe.element_bits == 4
    rule = recipe.scale_rule or ("amax/2688" if recipe.has_global_scale else "amax/448")
    zero = {"e8m0_bias127": "byte 0", "e4m3fn": "block scale 1.0 (0x38)"}.get(recipe.scale_encoding, "scale 1.0")
    return ModuleEntry(
        module=t.module, source_name=t.name, source_dtype=t.dtype, logical_shape=t.logical_shape,
        recipe=recipe.name, block=recipe.block, axis=-1, element="e2m1" if fp4 else "e4m3fn",
        packing="e2m1x2" if fp4 else None, nibble_order="low_first" if fp4 else None, scale_rule=rule,
        element_rounding="rne_sat", zero_block_policy=zero, scale_layout="linear",
        transposed_from_source=t.transpose, fused_group=t.fused_group, tensors=disk)


def _manifest_doc(folder: Path) -> dict:
    """The manifest of a finished output as a dict ({} when absent or unreadable)."""
    try:
        doc = json.loads((folder / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _leftovers(stage: Path) -> list[Path]:
    """What a staging folder holds besides the lock and a progress file's temporary."""
    ours = {LOCK_NAME, PROGRESS_NAME + ".tmp"}
    return [p for p in stage.iterdir() if p.name not in ours and not p.name.startswith(LOCK_NAME + ".stale-")]


def _missing_parents(path: Path) -> list[Path]:
    """The ancestors of `path` that do not exist yet, nearest first."""
    out = []
    parent = path.absolute().parent
    while not parent.exists() and parent != parent.parent:
        out.append(parent)
        parent = parent.parent
    return out


def _discard(stage: Path, created: list[Path]) -> None:
    """Remove what a refused fresh run made: its staging folder and the parents it created."""
    shutil.rmtree(stage, ignore_errors=True)
    for parent in created:
        with contextlib.suppress(OSError):
            parent.rmdir()


def _global_scale(layout, module: str, recipe, get) -> tuple[torch.Tensor, str] | None:
    """The stored global scale of a module and its direction, or None."""
    for d in layout.describe(module, recipe):
        if d.role == "global_scale":
            return get(d.name).to(torch.float32).reshape(()), d.direction
    return None


def _fault_injection(shards_written: int) -> None:
    """Crash-safety tests kill the process here (SIGKILL, no cleanup) after N shards."""
    limit = os.environ.get("QUANTCLI_KILL_AFTER_SHARDS")
    if limit and int(limit) == shards_written:
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def model_card(plan: Plan) -> str:
    lines = ["", "## Quantization (quantcli)", ""]
    if plan.layout is None:
        lines += [f"Dequantized to {plan.dense_dtype} from the {plan.source_layout.name} checkpoint "
                  f"`{plan.source.label}` with quantcli {__version__}: a plain checkpoint, no quantization_config.", ""]
        return "\n".join(lines)
    what = {"relayout": "carried over byte for byte", "requantize": "decoded and re-quantized",
            "quantize": "quantized"}
    lines += [f"Converted from `{plan.source.label}` with quantcli {__version__}, layout `{plan.layout.name}` "
              f"(loads in {plan.layout.consumers}).", "",
              "| recipe | modules | scale rule | how |", "|---|---|---|---|"]
    for name, mods in sorted(plan.modules_by_recipe().items()):
        actions = sorted({what[t.action] for t in plan.tensors if t.recipe == name})
        lines.append(f"| {name} | {len(mods)} | {plan.recipes[name].scale_rule or '-'} | {', '.join(actions)} |")
    lines += ["", f"Left unquantized ({plan.layout.exclusion_key}): "
              + ", ".join(f"`{n}`" for n in plan.excluded_names()), "",
              f"Every quantized tensor, its scales and their direction are listed in `{MANIFEST_NAME}`.", ""]
    return "\n".join(lines)


__all__ = ["ConvertResult", "Converter", "FilesystemError", "RunOptions", "check_destination", "check_run_options", "fingerprint"]
