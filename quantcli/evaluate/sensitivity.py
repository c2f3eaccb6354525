"""Sensitivity: the model output error when one module alone is quantized.

For each chosen module (those with the largest own error), the model runs with every weight the
reference's except that module's, which runs as the quantized side runs it (its decoded weights
and its declared input quantization; no KV-cache quantization). A module in block i changes the
hidden states from block i on only, so one walk serves them all: the reference runs block by
block as in the main loop, and at block i each of its chosen modules starts from a copy of the
reference's input to block i, runs block i with that module swapped, then every later block with
the reference's weights (loaded once per block for all of them). Cost: one block forward per
module per block from its own on (one model pass per module, at most); memory: one block's
weights and one activation buffer per module, the buffers sharing the activation budget (above
it they are memory-mapped files). Then per module: KL(reference || module-quantized) mean of the
next-token distributions and top-1 agreement (causal LM), or 1 - the mean pooled-embedding
cosine (encoder)."""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from quantcli.evaluate.emulate import detach, experts_name, quantize_expert_inputs
from quantcli.evaluate.engine import load_block, release_block, side_map
from quantcli.evaluate.metrics import pool
from quantcli.memory import fix_malloc_thresholds, release_freed_memory
from quantcli.model.buffer import ActivationBuffer, budget_bytes
from quantcli.model.inputs import experts_params
from quantcli.model.layers import run_batches
from quantcli.model.names import CheckpointMap
from quantcli.model.outer import to_meta
from quantcli.model.stack import Stack, Tail, capture


@dataclass
class Score:
    output_error: float  # causal LM: KL mean; encoder: 1 - mean pooled cosine
    top1_agreement: float | None  # causal LM only


@dataclass
class ScoreSums:
    """One module's Score as sums over the batches one process ran (the ranks of a split run add
    theirs up): summed KL and agreeing positions over `count` positions (causal LM), or summed
    1 - cosine over `count` samples (encoder, `agree` None)."""

    error: float
    agree: int | None
    count: int

    @staticmethod
    def merge(parts: list[ScoreSums]) -> ScoreSums:
        agree = None if parts[0].agree is None else sum(p.agree for p in parts)
        return ScoreSums(sum(p.error for p in parts), agree, sum(p.count for p in parts))

    def score(self) -> Score:
        n = max(self.count, 1)
        return Score(self.error / n, None if self.agree is None else self.agree / n)


def module_paths(layer, prefix: str, names: CheckpointMap) -> dict[str, list[str]]:
    """{checkpoint module: its paths in the block (Linears, or an experts block)}, as emulate.attach names them."""
    out: dict[str, list[str]] = {}
    for sub, mod in layer.named_modules():
        modules = names.linear_modules(prefix + sub) if isinstance(mod, torch.nn.Linear) else []
        if modules:
            out.setdefault(modules[0], []).append(sub)
    for path, params in experts_params(layer, prefix, names).items():
        out.setdefault(experts_name(names, params), []).append(path[len(prefix):])
    return out


def _swap(layer, prefix: str, subs: list[str], quant, quant_map: CheckpointMap, steps: dict, module: str):
    """Load the quantized side's parameters of `subs` over the reference's and hook their input
    quantization; returns (the reference's parameters to put back, hook handles)."""
    saved, params, handles = {}, {}, []
    experts = experts_params(layer, prefix, quant_map)
    for sub in subs:
        mod = layer.get_submodule(sub) if sub else layer
        for name, p in mod.named_parameters(recurse=False):
            key = f"{sub}.{name}" if sub else name
            saved[key] = p
            params[key] = quant_map.tensor(f"{prefix}{key}", quant.get).to(quant.device, torch.float32)
        if isinstance(mod, torch.nn.Linear):
            step = steps.get(module)
            if step is not None:
                handles.append(mod.register_forward_pre_hook(lambda m, args, step=step: (step(args[0]), *args[1:])))
    layer.load_state_dict(params, strict=False, assign=True)
    for sub in subs:  # after loading: the traced parameters are the quantized ones
        if prefix + sub in experts:
            mod = layer.get_submodule(sub) if sub else layer
            traced = quantize_expert_inputs(mod, prefix + sub, quant_map, experts_params(layer, prefix, quant_map)[
                prefix + sub], steps)
            handles += [traced] if traced is not None else []
    return saved, handles


def _block(stack: Stack, i: int, sides: tuple, maps: tuple, ref_buf, bufs: dict, new: dict, layer_args: list,
           steps: dict) -> None:
    layer, prefix = stack.layers[i], stack.layer_prefix(i)
    (ref, quant), (ref_map, quant_map) = sides, maps
    load_block(layer, prefix, ref, ref_map)
    for buf in new.values():
        for j in range(len(layer_args)):
            buf.write(j, ref_buf.read(j).clone())
    for buf in bufs.values():
        run_batches(layer, i, buf, layer_args)
    run_batches(layer, i, ref_buf, layer_args)
    paths = module_paths(layer, prefix, quant_map) if new else {}
    for module, buf in new.items():
        saved, handles = _swap(layer, prefix, paths[module], quant, quant_map, steps, module)
        try:
            run_batches(layer, i, buf, layer_args)
        finally:
            detach(layer, handles)
            layer.load_state_dict(saved, strict=False, assign=True)
        bufs[module] = buf
    to_meta(layer)
    release_block(layer, prefix, ref, ref_map)
    if new:
        release_block(layer, prefix, quant, quant_map)


def walk_sensitivity(stack: Stack, ref, quant, input_batches: list[torch.Tensor], device: torch.device,
                     steps: dict, chosen: dict[int, list[str]], pooled=None, progress=None) -> dict[str, ScoreSums]:
    """{module: Score} for `chosen` ({block index: checkpoint modules in it}); `pooled` is the
    encoder's metrics.Encoder (None for a causal LM); `progress(done, total, seconds_per_block, phase)`."""
    fix_malloc_thresholds()
    phase, start = f"sensitivity of {sum(len(m) for m in chosen.values())} modules", time.monotonic()
    maps = (stack.names, side_map(stack, quant))
    share = budget_bytes() // (1 + sum(len(m) for m in chosen.values()))
    with torch.inference_mode(), ExitStack() as held:
        ref_buf = held.enter_context(ActivationBuffer(device, share))
        layer_args, names = capture(stack, ref.get, device, input_batches, ref_buf.write)
        for name in names:
            ref.release(name)
        bufs: dict[str, ActivationBuffer] = {}
        for i in range(len(stack.layers)):
            new = {m: held.enter_context(ActivationBuffer(device, share)) for m in chosen.get(i, [])}
            _block(stack, i, (ref, quant), maps, ref_buf, bufs, new, layer_args, steps)
            release_freed_memory()
            if progress is not None:
                progress(i + 1, len(stack.layers), (time.monotonic() - start) / (i + 1), phase)
        return _scores(stack, ref, input_batches, ref_buf, bufs, pooled)


def _scores(stack: Stack, ref, input_batches: list, ref_buf, bufs: dict, pooled) -> dict[str, ScoreSums]:
    """Per module, through the reference's own code after its layers: KL(reference ||
    module-quantized) mean and top-1 agreement over every predicting position (causal LM), or
    1 - the pooled-embedding cosine (encoder, `pooled` its metrics.Encoder)."""
    error, agree, n = dict.fromkeys(bufs, 0.0), dict.fromkeys(bufs, 0), 0
    with Tail(stack, stack.names, ref.get, ref_buf.device) as tail:
        for j, ids in enumerate(input_batches):
            ref_out = tail(ids, ref_buf.read(j))
            if pooled is not None:
                a = pool(ref_out.double(), pooled.modes)
                for m, buf in bufs.items():
                    b = pool(tail(ids, buf.read(j)).double(), pooled.modes)
                    error[m] += float((1.0 - F.cosine_similarity(a, b, dim=-1)).sum())
                n += a.shape[0]
                continue
            ref_logp = torch.log_softmax(ref_out[:, :-1].double(), dim=-1)
            ref_top = ref_logp.argmax(-1)
            n += ref_top.numel()
            for m, buf in bufs.items():
                logp = torch.log_softmax(tail(ids, buf.read(j))[:, :-1].double(), dim=-1)
                error[m] += float((ref_logp.exp() * (ref_logp - logp)).sum())
                agree[m] += int((ref_top == logp.argmax(-1)).sum())
        read = tail.read
    for name in read:
        ref.release(name)
    return {m: ScoreSums(error[m], None if pooled is not None else agree[m], n) for m in bufs}
