"""Where a per-head transform of an attention's value and output projections applies, read off
the model itself, and the proof that it is exact on this architecture: one layer of each kind
run by its own code on random tokens, before and after the transform.

An attention that does more to its values than a weighted sum per head (Qwen 3.5's output gate
multiplies each head's output elementwise) would compute another function once rotated; the
layer's own forward says so, whatever the architecture, where a list of names could not."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from quantcli.model.buffer import ActivationBuffer, budget_bytes
from quantcli.model.layers import Weights, load_layer, run_batches
from quantcli.model.outer import to_meta
from quantcli.model.stack import Stack, attention_path, capture

TOLERANCE = 1e-4  # relative L2 change of a layer's output: FP32 rounding of the product is ~1e-7


@dataclass(frozen=True)
class VoPair:
    layer: int
    attention: str  # the model path of the attention
    head: int  # its head size
    v: str  # checkpoint tensors: v_proj's weight, its bias (or None), o_proj's weight
    v_bias: str | None
    o: str


def vo_pairs(stack: Stack) -> list[VoPair]:
    """Each layer's attention with separate v_proj and o_proj Linears, its head size as the
    attention module holds it (per layer: Gemma 4's global layers have larger heads)."""
    out = []
    for i, layer in enumerate(stack.layers):
        path = attention_path(layer, stack.layer_prefix(i))
        attn = layer.get_submodule(path[len(stack.layer_prefix(i)):]) if path else None
        v, o = getattr(attn, "v_proj", None), getattr(attn, "o_proj", None)
        head = getattr(attn, "head_dim", None)
        if not (isinstance(v, torch.nn.Linear) and isinstance(o, torch.nn.Linear) and isinstance(head, int)):
            continue
        names = stack.names
        v_src, o_src = names.sources(f"{path}.v_proj.weight"), names.sources(f"{path}.o_proj.weight")
        b_src = names.sources(f"{path}.v_proj.bias") if v.bias is not None else []
        if len(v_src) == 1 and len(o_src) == 1 and len(b_src) <= 1:
            out.append(VoPair(i, path, head, v_src[0], b_src[0] if b_src else None, o_src[0]))
    return out


def worst_change(stack: Stack, source: Weights, pairs: list[VoPair], transform: Callable[[str, torch.Tensor],
                 torch.Tensor], device: torch.device) -> tuple[float, int | None]:
    """The largest relative change of a layer's output when its v/o are transformed, over the
    first layer of each kind (its class and `layer_types` entry), and that layer."""
    vocab = stack.vocab_size or 2
    ids = torch.randint(1, max(2, min(vocab, 1000)), (1, 16), generator=torch.Generator().manual_seed(0))
    kinds = list(getattr(stack.config, "layer_types", None) or getattr(getattr(stack.config, "text_config", None),
                                                                          "layer_types", None) or [])
    seen, worst = set(), (0.0, None)
    with torch.inference_mode(), ActivationBuffer(device, budget_bytes()) as before:
        layer_args, read = capture(stack, source.get, device, [ids], before.write)
        for pair in pairs:
            kind = (type(stack.layers[pair.layer]).__name__, kinds[pair.layer] if pair.layer < len(kinds) else None)
            if kind in seen:
                continue
            seen.add(kind)
            change = _change(stack, source, pair, transform, layer_args, before, device)
            worst = max(worst, (change, pair.layer), key=lambda w: w[0])
    for name in read:
        source.release(name)
    return worst


def _change(stack: Stack, source: Weights, pair: VoPair, transform, layer_args, buffer, device) -> float:
    """Layer pair.layer run on the captured input (the embedded random tokens: any input proves
    it) with its own weights, then with v/o transformed."""
    layer, prefix = stack.layers[pair.layer], stack.layer_prefix(pair.layer)
    hidden = buffer.read(0).clone()
    outs = []
    for changed in (False, True):
        get = source.get if not changed else (lambda n: transform(n, source.get(n)))
        load_layer(layer, prefix, get, stack.names, device)
        buffer.write(0, hidden)
        run_batches(layer, pair.layer, buffer, layer_args)
        outs.append(buffer.read(0).clone())
        to_meta(layer)
    return float((outs[1] - outs[0]).norm() / outs[0].norm().clamp_min(1e-30))
