"""The layer loop: the reference and the quantized checkpoint over the same batches, one block at
a time. Per block: the reference's weights are loaded and its batches run (its outputs replace
its inputs in the reference buffer); then the quantized weights are loaded into the same module
and its batches run with the checkpoint's activation and KV-cache quantization, each module's
own error measured against the reference weights still in hand; the block's hidden-state error
is taken; both weight sets go (back to the meta device, tensors released). Peak memory: two
blocks' weights + two activation buffers + a constant, whatever the depth."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from quantcli.errors import QuantcliError
from quantcli.evaluate.emulate import ErrorSum, attach, detach
from quantcli.evaluate.fake_quant import KvQuantCache
from quantcli.memory import fix_malloc_thresholds, release_freed_memory
from quantcli.model.buffer import ActivationBuffer, budget_bytes
from quantcli.model.layers import layer_sources, load_layer, run_batches
from quantcli.model.names import CheckpointMap
from quantcli.model.outer import to_meta
from quantcli.model.stack import Stack, attention_path, capture


@dataclass
class Emulation:
    steps: dict  # checkpoint module -> fake_quant.ActQuant
    kv: dict  # checkpoint attention module -> (k_scale, v_scale)
    # the checkpoint's exact transforms (its manifest's; planning/transforms.py): a module's own
    # error is against the reference's module transformed alike (a rotated v_proj against the
    # rotated reference), while the layers' and the model's outputs are the reference's own
    transforms: dict = field(default_factory=dict)


def transformed(params: dict[str, torch.Tensor], prefix: str, names: CheckpointMap, ops: dict) -> dict:
    """A block's reference parameters with the checkpoint's transforms applied (a parameter
    built from one transformed checkpoint tensor)."""
    if not ops:
        return params
    out = dict(params)
    for n, p in params.items():
        sources = names.sources(prefix + n)
        if len(sources) == 1 and sources[0] in ops:
            out[n] = ops[sources[0]].apply(p).to(p.dtype)
    return out


@dataclass
class Walked:
    """What the loop measured; `finish` is called with both buffers before they are freed. Each
    part is a sum over the batches walked, so the walks of a split run's ranks add up (`merge`)."""

    layers: list[ErrorSum] = field(default_factory=list)
    modules: list[dict[str, ErrorSum]] = field(default_factory=list)
    final: object = None  # metrics.CausalSums | metrics.EncoderSums

    @staticmethod
    def empty(layers: int, final) -> Walked:
        """What a rank with no batches measured: nothing, in the shape the others send."""
        return Walked([ErrorSum() for _ in range(layers)], [{} for _ in range(layers)], final)

    def to_json(self) -> dict:
        return {"layers": [e.sums for e in self.layers],
                "modules": [{m: e.sums for m, e in mods.items()} for mods in self.modules],
                "final": asdict(self.final)}

    @staticmethod
    def from_json(doc: dict, final_type) -> Walked:
        return Walked([ErrorSum.of(e) for e in doc["layers"]],
                      [{m: ErrorSum.of(e) for m, e in mods.items()} for mods in doc["modules"]],
                      final_type(**doc["final"]))

    @staticmethod
    def merge(parts: list[Walked]) -> Walked:
        if len(parts) == 1:
            return parts[0]

        def add(errors: list[ErrorSum]) -> ErrorSum:
            return ErrorSum.of([sum(e.d2 for e in errors), sum(e.r2 for e in errors)])

        layers = [add([p.layers[i] for p in parts]) for i in range(len(parts[0].layers))]
        modules = []
        for i in range(len(parts[0].modules)):
            names = sorted({m for p in parts for m in p.modules[i]})
            modules.append({m: add([p.modules[i][m] for p in parts if m in p.modules[i]]) for m in names})
        return Walked(layers, modules, type(parts[0].final).merge([p.final for p in parts]))


def load_block(layer, prefix: str, side, names: CheckpointMap) -> dict[str, torch.Tensor]:
    """Assign `side`'s FP32 parameters of one block (shapes checked); returns them by name."""
    try:
        return load_layer(layer, prefix, side.get, names, side.device)
    except QuantcliError as exc:
        raise QuantcliError(f"{side.label}: {exc}") from None


def release_block(layer, prefix: str, side, names: CheckpointMap) -> None:
    for src in layer_sources(layer, prefix, names):
        side.release(src)


def _block(stack: Stack, i: int, sides: tuple, maps: tuple, bufs: tuple, layer_args: list, emu: Emulation,
           walked: Walked) -> None:
    layer, prefix = stack.layers[i], stack.layer_prefix(i)
    (ref, quant), (ref_map, quant_map), (ref_buf, quant_buf) = sides, maps, bufs
    ref_params = load_block(layer, prefix, ref, ref_map)
    run_batches(layer, i, ref_buf, layer_args[0])
    load_block(layer, prefix, quant, quant_map)
    errors: dict[str, ErrorSum] = {}
    handles = attach(layer, prefix, quant_map, transformed(ref_params, prefix, ref_map, emu.transforms), emu.steps,
                     errors)
    attention = attention_path(layer, prefix)
    attention = quant_map.module(attention) if attention is not None else None
    cache = KvQuantCache(*emu.kv[attention]) if attention in emu.kv else None
    try:
        run_batches(layer, i, quant_buf, layer_args[1], cache)
    finally:
        detach(layer, handles)
    hidden = ErrorSum()
    for j in range(len(layer_args[0])):
        hidden.add(quant_buf.read(j), ref_buf.read(j))
    walked.layers.append(hidden)
    walked.modules.append(errors)
    to_meta(layer)
    del ref_params
    release_block(layer, prefix, ref, ref_map)
    release_block(layer, prefix, quant, quant_map)


def walk(stack: Stack, ref, quant, input_batches: list[torch.Tensor], device: torch.device, emu: Emulation,
         finish, progress=None) -> Walked:
    """Run both sides over `input_batches`; `finish(stack, maps, buffers, input_batches)` computes
    the model-level metrics from the last block's outputs; `progress(done, total, seconds_per_block)`."""
    fix_malloc_thresholds()  # with release_freed_memory after each block: memory flat in depth (quantcli/memory.py)
    maps = (stack.names, side_map(stack, quant))
    walked, start = Walked(), time.monotonic()
    with torch.inference_mode(), ActivationBuffer(device, budget_bytes()) as ref_buf, \
            ActivationBuffer(device, budget_bytes()) as quant_buf:
        # each side's own layer arguments: what runs before the layers may be quantized too (Gemma 4's
        # per-layer input projection), and then the quantized side's layers get its outputs
        layer_args = []
        for side, names_map, buf in ((ref, maps[0], ref_buf), (quant, maps[1], quant_buf)):
            args, names = capture(stack, side.get, device, input_batches, buf.write, names_map)
            layer_args.append(args)
            for name in names:
                side.release(name)
        for i in range(len(stack.layers)):
            _block(stack, i, (ref, quant), maps, (ref_buf, quant_buf), layer_args, emu, walked)
            release_freed_memory()
            if progress is not None:
                progress(i + 1, len(stack.layers), (time.monotonic() - start) / (i + 1))
        walked.final = finish(stack, maps, (ref_buf, quant_buf), input_batches)
    return walked


def side_map(stack: Stack, side) -> CheckpointMap:
    """The map of `side`'s checkpoint onto the stack's model (a quantized side names its tensors
    as the reference does, and holds scales besides)."""
    return CheckpointMap(stack.model, side.names, side.shape)
