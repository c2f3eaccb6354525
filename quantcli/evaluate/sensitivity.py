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
from quantcli.evaluate.engine import load_block, release_block
from quantcli.evaluate.metrics import Causal
from quantcli.memory import fix_mmap_threshold
from quantcli.model.buffer import ActivationBuffer, budget_bytes
from quantcli.model.layers import run_batches
from quantcli.model.stack import CAUSAL, Stack, capture
from quantcli.model.weights import WeightMap, experts_blocks


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


def module_paths(layer, prefix: str, weights: WeightMap) -> dict[str, list[str]]:
    """{checkpoint module: its paths in the block (Linears, or an experts block)}, as emulate.attach names them."""
    experts = experts_blocks(layer, prefix, weights, whole=True)
    out: dict[str, list[str]] = {}
    for sub, mod in layer.named_modules():
        if isinstance(mod, torch.nn.Linear):
            out.setdefault(weights.checkpoint_module(prefix + sub), []).append(sub)
        elif prefix + sub in experts:
            out.setdefault(experts_name(experts[prefix + sub]), []).append(sub)
    return out


def _swap(layer, prefix: str, subs: list[str], quant, quant_map: WeightMap, steps: dict, module: str):
    """Load the quantized side's parameters of `subs` over the reference's and hook their input
    quantization; returns (the reference's parameters to put back, hook handles)."""
    experts = experts_blocks(layer, prefix, quant_map, whole=True)
    saved, params, handles = {}, {}, []
    for sub in subs:
        mod = layer.get_submodule(sub)
        for name, p in mod.named_parameters(recurse=False):
            saved[f"{sub}.{name}"] = p
            params[f"{sub}.{name}"] = quant_map.tensor(f"{prefix}{sub}.{name}", quant.get, experts).to(torch.float32)
        if isinstance(mod, torch.nn.Linear):
            step = steps.get(module)
            if step is not None:
                handles.append(mod.register_forward_pre_hook(lambda m, args, step=step: (step(args[0]), *args[1:])))
        else:
            quantize_expert_inputs(mod, experts[prefix + sub], steps)
    layer.load_state_dict(params, strict=False, assign=True)
    return saved, handles


def _block(stack: Stack, i: int, sides: tuple, maps: tuple, ref_buf, bufs: dict, new: dict, captured: list,
           steps: dict) -> None:
    layer, prefix = stack.layers[i], stack.layer_prefix(i)
    (ref, quant), (ref_map, quant_map) = sides, maps
    load_block(layer, prefix, ref, ref_map)
    for buf in new.values():
        for j in range(len(captured)):
            buf.write(j, ref_buf.read(j).clone())
    for buf in bufs.values():
        run_batches(layer, buf, captured)
    run_batches(layer, ref_buf, captured)
    paths = module_paths(layer, prefix, quant_map) if new else {}
    for module, buf in new.items():
        saved, handles = _swap(layer, prefix, paths[module], quant, quant_map, steps, module)
        try:
            run_batches(layer, buf, captured)
        finally:
            detach(layer, handles)
            layer.load_state_dict(saved, strict=False, assign=True)
        bufs[module] = buf
    layer.to("meta")
    release_block(layer, prefix, ref, ref_map)
    if new:
        release_block(layer, prefix, quant, quant_map)


def walk_sensitivity(stack: Stack, ref, quant, input_batches: list[torch.Tensor], device: torch.device,
                     steps: dict, chosen: dict[int, list[str]], pooled=None, progress=None) -> dict[str, ScoreSums]:
    """{module: Score} for `chosen` ({block index: checkpoint modules in it}); `pooled` is the
    encoder's metrics.Encoder (None for a causal LM); `progress(done, total, seconds_per_block, phase)`."""
    fix_mmap_threshold()
    phase, start = f"sensitivity of {sum(len(m) for m in chosen.values())} modules", time.monotonic()
    shapes = [(*b.shape, stack.config.hidden_size) for b in input_batches]
    maps = (WeightMap(ref.names), WeightMap(quant.names))
    share = budget_bytes() // (1 + sum(len(m) for m in chosen.values()))
    with torch.inference_mode(), ExitStack() as held:
        ref_buf = held.enter_context(ActivationBuffer(shapes, device, share))
        captured, names = capture(stack, ref.get, device, input_batches, ref_buf)
        for name in names:
            ref.release(name)
        bufs: dict[str, ActivationBuffer] = {}
        for i in range(len(stack.layers)):
            new = {m: held.enter_context(ActivationBuffer(shapes, device, share)) for m in chosen.get(i, [])}
            _block(stack, i, (ref, quant), maps, ref_buf, bufs, new, captured, steps)
            if progress is not None:
                progress(i + 1, len(stack.layers), (time.monotonic() - start) / (i + 1), phase)
        if stack.kind == CAUSAL:
            return _causal_scores(stack, ref, input_batches, ref_buf, bufs)
        out = {}
        for m, buf in bufs.items():
            cosines = pooled(stack, (ref_buf, buf), len(captured)).cosines
            out[m] = ScoreSums(sum(1.0 - c for c in cosines), None, len(cosines))
        return out


def _causal_scores(stack: Stack, ref, input_batches: list, ref_buf, bufs: dict) -> dict[str, ScoreSums]:
    """KL(reference || module-quantized) mean and top-1 agreement over every predicting position,
    both sides through the reference's final norm and head."""
    norm = stack.model.model.norm
    norm_params, head, names = Causal._head(ref, list(norm.state_dict()))
    norm.load_state_dict(norm_params, assign=True)
    kl, agree, n = dict.fromkeys(bufs, 0.0), dict.fromkeys(bufs, 0), 0
    for j in range(len(input_batches)):
        ref_logp = torch.log_softmax(F.linear(norm(ref_buf.read(j)), head)[:, :-1].double(), dim=-1)
        ref_top = ref_logp.argmax(-1)
        n += ref_top.numel()
        for m, buf in bufs.items():
            logp = torch.log_softmax(F.linear(norm(buf.read(j)), head)[:, :-1].double(), dim=-1)
            kl[m] += float((ref_logp.exp() * (ref_logp - logp)).sum())
            agree[m] += int((ref_top == logp.argmax(-1)).sum())
    norm.to("meta")
    for name in names:
        ref.release(name)
    return {m: ScoreSums(kl[m], agree[m], n) for m in bufs}
