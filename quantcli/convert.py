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
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from . import __version__
from .errors import CheckpointError, QuantcliError
from .manifest import MANIFEST_NAME, DiskEntry, Manifest, ModuleEntry
from .plan import Plan, TensorPlan
from .decode import decode_module
from .recipes import QuantizedTensor
from .safetensors_io import DTYPES, ShardWriter, tensor_bytes
from .source import INDEX
from .tensors import CheckpointTensors

PROGRESS_NAME = ".quantcli-progress.json"
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

    def record(self, shard: str, size: int, sha256: str, found: dict[str, dict]) -> None:
        """`found`: what the shard's conversion learned per module (globals, notes, errors)."""
        self.state["shards"][shard] = {"size": size, "sha256": sha256, **found}
        _write_json_atomic(self.path, self.state)


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
            for t in members:
                amaxes.append(tensor_amax(self.weight(t, tensors), backend=self.backend).cpu())
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
                            global_amax=group_amax.get(t.fused_group) if t.fused_group else None)
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
        """Write one output shard atomically; returns its size and SHA-256."""
        producer = {o.name: t for t in planned for o in t.outputs}
        specs = [o for t in planned for o in t.outputs]
        tmp = out_path.with_name(out_path.name + ".tmp")
        # One background thread writes (and hashes) while the next tensor is read and quantized;
        # at most WRITE_QUEUE outputs wait, so memory stays a few tensors whatever the shard size.
        with open(tmp, "wb") as f, ThreadPoolExecutor(max_workers=1) as io:
            writer = ShardWriter(f, specs, {"format": "pt"})
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
        written = resumed = 0
        with CheckpointTensors(plan.source) as tensors:
            group_amax = self.fused_amax(tensors) if plan.fused_groups() else {}
            for shard, planned in plan.by_shard().items():
                out_path = stage / shard
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
                progress.record(shard, size, sha256, {key: {m: v for m, v in found.items() if m not in before[key]}
                                                      for key, found in self._found().items()})
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
                             sum(t.quantized for t in plan.tensors), list(plan.warnings), self.note_list(), dict(sorted(self.errors.items())))

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


__all__ = ["ConvertResult", "Converter", "RunOptions", "check_destination", "fingerprint"]
