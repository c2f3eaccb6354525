"""`quantcli convert`: stream a safetensors checkpoint into a quantized one.

Data flow (DESIGN.md): plan from headers -> pass 1, the shared amax of each fused group ->
pass 2, shard by shard, tensor by tensor: read -> quantize -> layout names -> streamed into a
shard in the staging folder `DST.partial` -> index, configs, copied files, model card ->
manifest last -> the staging folder is renamed to DST. A reader therefore sees DST either
absent (or as it was, with --overwrite) or complete. A progress file in the staging folder
records finished shards (size + sha256) so --resume continues an interrupted run and yields
the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from . import __version__
from .errors import CheckpointError, QuantcliError
from .manifest import MANIFEST_NAME, DiskEntry, Manifest, ModuleEntry
from .plan import Plan, TensorPlan
from .safetensors_io import ShardWriter, TensorReader, tensor_bytes
from .source import INDEX
from .tensors import CheckpointTensors

PROGRESS_NAME = ".quantcli-progress.json"
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
    h.update(plan.layout.name.encode())
    for t in plan.tensors:
        h.update(f"{t.name}|{t.shard}|{t.dtype}|{t.shape}|{t.recipe}|{t.transpose}|{t.fused_group}".encode())
    for name, r in sorted(plan.recipes.items()):
        h.update(f"{name}:{r.scale_rule}".encode())
    for shard in plan.source.shards:
        header = plan.source.headers[shard]
        h.update(json.dumps({n: [i.start, i.end] for n, i in sorted(header.tensors.items())}).encode())
    return h.hexdigest()


def staging_dir(dst: Path) -> Path:
    return dst.with_name(dst.name + ".partial")


def check_destination(src: Path | None, dst: Path, run: RunOptions) -> None:
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
    if dst.exists() and any(dst.iterdir()) and not run.overwrite and not run.resume:
        raise CheckpointError(f"{dst}: exists and is not empty; pass --overwrite to replace it or --resume to "
                              f"continue an interrupted run")
    if staging_dir(dst).exists() and not run.resume and not run.overwrite:
        raise CheckpointError(f"{staging_dir(dst)}: an interrupted run left this; rerun with --resume to continue "
                              f"it or --overwrite to start over")


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


class _Progress:
    def __init__(self, path: Path, fp: str, resume: bool):
        self.path = path
        self.state = {"fingerprint": fp, "shards": {}}
        if resume and path.exists():
            state = json.loads(path.read_text())
            if state.get("fingerprint") != fp:
                raise CheckpointError(f"{path.parent}: --resume refused: that run used a different source, recipe "
                                      f"or options; pass --overwrite to start over")
            self.state = state

    def done(self, shard: str, path: Path) -> dict | None:
        rec = self.state["shards"].get(shard)
        if rec and path.exists() and path.stat().st_size == rec["size"] and _sha256(path) == rec["sha256"]:
            return rec
        return None

    def record(self, shard: str, size: int, sha256: str, globals_: dict[str, float]) -> None:
        self.state["shards"][shard] = {"size": size, "sha256": sha256, "globals": globals_}
        _write_json_atomic(self.path, self.state)


class Converter:
    def __init__(self, plan: Plan, dst: Path, run: RunOptions, progress: Progress | None = None):
        self.plan = plan
        self.dst = dst
        self.run = run
        self.device = resolve_device(run.device)
        self.backend = run.backend
        self.progress = progress or (lambda n, s: None)
        self.globals: dict[str, float] = {}

    # --- pass 1

    def fused_amax(self) -> dict[str, torch.Tensor]:
        """The max |w| over each fused group's members, streaming (one tensor at a time)."""
        from .kernels import tensor_amax

        out: dict[str, torch.Tensor] = {}
        with CheckpointTensors(self.plan.source) as tensors:
            for group, members in self.plan.fused_groups().items():
                amaxes = [tensor_amax(tensors.get(t.name).to(self.device), backend=self.backend).cpu()
                          for t in members]
                out[group] = torch.stack(amaxes).amax()
        return out

    # --- pass 2

    def quantize_tensor(self, t: TensorPlan, w: torch.Tensor, group_amax: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        recipe = self.plan.recipes[t.recipe]
        w = w.to(self.device)
        if t.transpose:
            w = w.transpose(-1, -2)
        q = recipe.quantize(t.name, w, backend=self.backend,
                            global_amax=group_amax.get(t.fused_group) if t.fused_group else None)
        if q.global_scale is not None:
            self.globals[t.module] = float(q.global_scale)
        return self.plan.layout.to_disk(t.module, q.to("cpu"))

    def write_shard(self, shard: str, tensors: list[TensorPlan], out_path: Path,
                    group_amax: dict[str, torch.Tensor]) -> tuple[int, str]:
        """Write one output shard atomically; returns its size and SHA-256."""
        producer = {o.name: t for t in tensors for o in t.outputs}
        specs = [o for t in tensors for o in t.outputs]
        tmp = out_path.with_name(out_path.name + ".tmp")
        with TensorReader(self.plan.source.local_header(shard)) as reader, open(tmp, "wb") as f:
            writer = ShardWriter(f, specs, {"format": "pt"})
            pending: dict[str, torch.Tensor | bytearray] = {}
            for spec in writer.order:
                if spec.name not in pending:
                    t = producer[spec.name]
                    if t.quantized:
                        outs = self.quantize_tensor(t, reader.tensor(t.name), group_amax)
                        pending.update(outs)
                    else:
                        pending[t.name] = reader.raw(t.name)  # bit-identical pass-through
                    self.progress(t.bytes_in, shard)
                data = pending.pop(spec.name)
                writer.write(spec.name, data if isinstance(data, bytearray) else tensor_bytes(data))
            writer.finish()
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out_path)
        return writer.size, writer.sha256

    # --- the job

    def execute(self) -> ConvertResult:
        start = time.time()
        plan, dst = self.plan, self.dst
        stage = staging_dir(dst)
        fp = fingerprint(plan)
        if self.run.overwrite and stage.exists() and not self.run.resume:
            shutil.rmtree(stage)
        stage.mkdir(parents=True, exist_ok=True)
        progress = _Progress(stage / PROGRESS_NAME, fp, self.run.resume)
        group_amax = self.fused_amax() if plan.fused_groups() else {}
        written = resumed = 0
        for shard, tensors in plan.by_shard().items():
            out_path = stage / shard
            out_path.parent.mkdir(parents=True, exist_ok=True)
            rec = progress.done(shard, out_path) if self.run.resume else None
            if rec is not None:
                self.globals.update(rec.get("globals", {}))
                self.progress(sum(t.bytes_in for t in tensors), shard)
                resumed += 1
                continue
            before = set(self.globals)
            size, sha256 = self.write_shard(shard, tensors, out_path, group_amax)
            progress.record(shard, size, sha256, {m: v for m, v in self.globals.items() if m not in before})
            written += 1
            _fault_injection(written)
        self.write_side_files(stage, fp)
        (stage / PROGRESS_NAME).unlink()
        manifest = self.manifest(fp)
        (stage / MANIFEST_NAME).write_text(manifest.to_json())
        if dst.exists():
            shutil.rmtree(dst)
        os.replace(stage, dst)
        return ConvertResult(dst, time.time() - start, plan.bytes_in, plan.bytes_out, written, resumed,
                             sum(t.quantized for t in plan.tensors), list(plan.warnings))

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
        if any(t.quantized for t in plan.tensors):
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
            modules.append(module_entry(t, recipe, tuple(disk)))
        primary = plan.options.recipe
        return Manifest(__version__, plan.layout.name, primary, plan.source.describe(), fp, tuple(modules),
                        tuple(plan.excluded_names()))


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


def _fault_injection(shards_written: int) -> None:
    """Crash-safety tests kill the process here (SIGKILL, no cleanup) after N shards."""
    limit = os.environ.get("QUANTCLI_KILL_AFTER_SHARDS")
    if limit and int(limit) == shards_written:
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def model_card(plan: Plan) -> str:
    lines = ["", "## Quantization (quantcli)", "",
             f"Converted from `{plan.source.label}` with quantcli {__version__}, layout `{plan.layout.name}` "
             f"(loads in {plan.layout.consumers}).", "",
             "| recipe | modules | scale rule |", "|---|---|---|"]
    for name, mods in sorted(plan.modules_by_recipe().items()):
        lines.append(f"| {name} | {len(mods)} | {plan.recipes[name].scale_rule or '-'} |")
    lines += ["", f"Left unquantized ({plan.layout.exclusion_key}): "
              + ", ".join(f"`{n}`" for n in plan.excluded_names()), "",
              f"Every quantized tensor, its scales and their direction are listed in `{MANIFEST_NAME}`.", ""]
    return "\n".join(lines)


__all__ = ["ConvertResult", "Converter", "RunOptions", "check_destination", "fingerprint"]
