"""The per-shard job: one output shard as a function of (plan, shard, facts, staged products). It
shares no mutable state with other shards (everything it learned comes back in its ShardResult),
so shards can run in any order or on any worker, and a resumed run rebuilds the same manifest
from the recorded results. A tensor a weight pass produced (convert/staged.py) is written as it
was staged instead of being quantized here."""

from __future__ import annotations

import contextlib
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping

import torch

from quantcli.atomic import atomic_file
from quantcli.checkpoint.safetensors_io import DTYPES, ShardWriter, tensor_bytes
from quantcli.convert.reading import ModuleReader
from quantcli.convert.records import Findings, Progress, ShardResult
from quantcli.convert.staged import StagedWeights
from quantcli.formats.facts import NO_FACTS, ModuleFacts
from quantcli.formats.layouts.base import Direction, Role, module_of, to_direction
from quantcli.kernels import cpu_workers
from quantcli.memory import release_freed_memory
from quantcli.planning.actions import Action
from quantcli.planning.plan import TensorPlan
from quantcli.recipes import QuantizedTensor, Recipe

# Outputs waiting for the writer thread besides the one it writes: one keeps it busy while the
# next tensor is quantized; two held one more tensor's codes (peak RSS above the floor's).
WRITE_QUEUE = 1


@dataclass(frozen=True)
class Learned:
    """What producing one module's outputs learned (None: nothing)."""

    global_scale: float | None = None  # the multiplier, for the manifest
    note: str | None = None  # what the user must know (an inexact reciprocal)
    error: float | None = None  # re-quantized vs decoded source, relative L2 error
    weighted: str | None = None  # what weighted its scale search ("input_channel_ms"), if anything
    rounding: dict | None = None  # a weight pass's account of how it rounded (GPTQ: method, errors, tokens)


def convert_shard(reader: ModuleReader, shard: str, facts: Mapping[str, ModuleFacts], out_path: Path,
                  progress: Progress | None = None, staged: StagedWeights | None = None) -> ShardResult:
    """Write output shard `shard` to `out_path` atomically. A failed or interrupted write leaves
    no partial file behind; an OSError names the file it was writing."""
    planned = [t for t in reader.plan.tensors if t.shard == shard]
    learned: dict[str, Learned] = {}
    try:
        with atomic_file(out_path) as f, compute_threads(reader.device):
            writer = _stream(f, reader, shard, planned, facts, staged, learned, progress or (lambda n, s: None))
    except OSError as exc:
        if not (exc.filename or exc.filename2):
            exc.filename = str(out_path)  # a write() error names no file: name the shard
        raise
    return ShardResult(writer.size, writer.sha256, _findings(learned))


def compute_threads(device: torch.device):
    """On the CPU, torch's intra-op threads (as many as it would use, set per rank on several
    ranks) quantize whole chunks side by side instead of splitting every op (cpu_workers)."""
    return cpu_workers(torch.get_num_threads()) if device.type == "cpu" else contextlib.nullcontext()


def _findings(learned: Mapping[str, Learned]) -> Findings:
    return Findings(
        globals={m: x.global_scale for m, x in learned.items() if x.global_scale is not None},
        notes={m: x.note for m, x in learned.items() if x.note is not None},
        errors={m: x.error for m, x in learned.items() if x.error is not None},
        weighted={m: x.weighted for m, x in learned.items() if x.weighted is not None},
        rounding={m: x.rounding for m, x in learned.items() if x.rounding is not None})


def _stream(f, reader: ModuleReader, shard: str, planned: list[TensorPlan], facts: Mapping[str, ModuleFacts],
            staged: StagedWeights | None, learned: dict[str, Learned], progress: Progress) -> ShardWriter:
    producer = {o.name: t for t in planned for o in t.outputs}
    writer = ShardWriter(f, [o for t in planned for o in t.outputs], {"format": "pt"})
    # One background thread writes (and hashes) while the next tensor is read and quantized;
    # at most WRITE_QUEUE outputs wait, so memory stays a few tensors whatever the shard size.
    io = ThreadPoolExecutor(max_workers=1)
    try:
        pending: dict[str, torch.Tensor | memoryview] = {}
        queued: deque[Future] = deque()
        for spec in writer.order:
            if spec.name not in pending:
                t = producer[spec.name]
                module = t.module or module_of(t.name)
                module_facts = facts.get(module, NO_FACTS)
                outputs, found = _outputs(reader, t, module_facts, staged)
                if reader.plan.layout is not None and module_facts is not NO_FACTS:  # KV scales come from facts
                    outputs.update(reader.plan.layout.kv_to_disk(module, module_facts))
                if t.module is not None:
                    if module_facts.note is not None and found.note is None:
                        found = replace(found, note=module_facts.note)
                    learned[t.module] = found
                pending.update(outputs)
                reader.release(t)
                release_freed_memory()
                progress(t.bytes_in, shard)
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


def _outputs(reader: ModuleReader, t: TensorPlan, facts: ModuleFacts,
             staged: StagedWeights | None) -> tuple[dict, Learned]:
    """What a weight pass staged for `t`, byte for byte (checked against the plan), or else the
    outputs produced here."""
    staged_product = staged.product(t, reader.plan.layout) if staged is not None else None
    if staged_product is None:
        return produce(reader, t, facts)
    outputs, learned = staged_product
    return outputs, Learned(**learned)


def produce(reader: ModuleReader, t: TensorPlan, facts: ModuleFacts) -> tuple[dict, Learned]:
    """The output tensors of one planned tensor, by its action, and what producing them learned."""
    plan = reader.plan
    if t.action == Action.COPY:
        return {t.name: reader.tensors.raw(t.name)}, Learned()  # bit-identical pass-through
    if t.action == Action.TRANSFORM:  # an exact transform's result, in the output's dense dtype
        (spec,) = t.outputs
        return {spec.name: reader.weight(t).to(DTYPES[spec.dtype]).cpu()}, Learned()
    if t.action == Action.RELAYOUT:  # codes and block scales carried over byte for byte
        q = reader.source_quantized(t)
        out = plan.layout.to_disk(t.module, q, facts=facts)
        return out, Learned(_global_of(q), note=_inversion_note(reader, t, out))
    w = reader.weight(t)
    if t.action == Action.DEQUANTIZE:
        w = w.transpose(-1, -2) if t.transpose else w
        (spec,) = t.outputs
        return {spec.name: w.to(DTYPES[spec.dtype]).cpu()}, Learned()
    recipe = plan.recipes[t.recipe]
    # int4's scales take the weight's dtype: the FP32 decode is cast to the model's first (planned)
    wq = w if t.requantize_dtype is None else w.to(DTYPES[t.requantize_dtype])
    q = recipe.quantize(t.name, wq, backend=reader.backend, facts=facts)
    error = None
    if t.action == Action.REQUANTIZE:  # the combined error, against the decoded source
        d = recipe.dequantize(q, backend=reader.backend)
        error = float((d - w).float().norm() / w.float().norm().clamp_min(1e-30))
    return plan.layout.to_disk(t.module, q.to("cpu"), facts=facts), learned_of(recipe, q, facts, error)


def learned_of(recipe: Recipe, q: QuantizedTensor, facts: ModuleFacts, error: float | None = None) -> Learned:
    """What quantizing a module to `q` tells the manifest (also for a weight pass's product)."""
    weighted = "input_channel_ms" if recipe.scale_search != "none" and facts.input_channel_ms is not None else None
    return Learned(_global_of(q), error=error, weighted=weighted)


def _global_of(q: QuantizedTensor) -> float | None:
    return float(q.global_scale) if q.global_scale is not None else None


def _inversion_note(reader: ModuleReader, t: TensorPlan, out: dict[str, torch.Tensor]) -> str | None:
    """A re-layout between multiply (`weight_scale_2`) and divide (`weight_global_scale`) globals
    is exact only if the reciprocal written inverts back to the source's value in FP32."""
    src, dst = reader.plan.source_layout, reader.plan.layout
    before = _global_scale(src, t.module, src.recipe_for(t.source_recipe), reader.tensors.get)
    after = _global_scale(dst, t.module, reader.plan.recipes[t.recipe], out.__getitem__)
    if before is None or after is None:
        return None
    (b, b_dir), (a, a_dir) = before, after
    back = a if a_dir == b_dir else to_direction(a, Direction.DIVIDE)  # the stored value in the source's direction
    if torch.equal(back, b):
        return None
    return (f"{t.module}: global scale {float(b)!r} ({b_dir}) has no exact FP32 reciprocal; "
            f"wrote {float(a)!r} ({a_dir}), which inverts to {float(back)!r}")


def _global_scale(layout, module: str, recipe, get) -> tuple[torch.Tensor, str] | None:
    """The stored global scale of a module and its direction, or None."""
    for d in layout.describe(module, recipe):
        if d.role == Role.GLOBAL_SCALE:
            return get(d.name).to(torch.float32).reshape(()), d.direction
    return None
