"""Calibration's statistics, recorded by a fact pass over the layer walk (model/layers.py): max
|input| of each Linear (model/inputs.py: a forward pre-hook; MoE experts per expert, from the
router's choice) and its mean squared input per channel, and max |key| after rotary / max |value| (a recording cache
passed to the attention, whose `update()` sees what a serving engine stores)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quantcli.model.buffer import ActivationBuffer
from quantcli.model.cache import PassThroughCache
from quantcli.model.inputs import experts_params, input_hooks
from quantcli.model.layers import LayerPass, Weights, head_inputs, walk_layers
from quantcli.model.names import CheckpointMap
from quantcli.model.stack import CAUSAL, Stack, attention_path, cache_kwarg


@dataclass
class Stats:
    inputs: dict[str, float] = field(default_factory=dict)  # checkpoint module -> max |x| of its input
    # checkpoint module -> sum over tokens of x^2 per input channel (FP64), and the token count:
    # diag(X^T X) / N, the weight of each input channel's error in an activation-aware search.
    sumsq: dict[str, torch.Tensor] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    keys: dict[str, float] = field(default_factory=dict)  # attention module -> max |k| after rotary
    values: dict[str, float] = field(default_factory=dict)  # attention module -> max |v|
    # checkpoint expert module -> its experts parameter ("model.layers.0.mlp.experts.down_proj"):
    # an expert no token was routed to takes the max of the experts of its parameter.
    expert_roles: dict[str, str] = field(default_factory=dict)
    # Off when nothing reads sumsq (no activation-weighted search): an FP64 pass over every
    # Linear's input that the max alone does not need.
    channel_stats: bool = True

    def add(self, module: str, x: torch.Tensor, expert: int | None = None) -> None:
        x = x.detach().reshape(-1, x.shape[-1])
        if x.shape[0] == 0:
            return
        self.inputs[module] = max(self.inputs.get(module, 0.0), float(x.abs().amax()))
        if not self.channel_stats:
            return
        sq = x.double().square().sum(0).cpu()
        self.sumsq[module] = self.sumsq[module] + sq if module in self.sumsq else sq
        self.tokens[module] = self.tokens.get(module, 0) + x.shape[0]

    def channel_ms(self, module: str) -> torch.Tensor | None:
        """Mean squared input per channel (FP32), or None when nothing reached the module."""
        if module not in self.sumsq:
            return None
        return (self.sumsq[module] / self.tokens[module]).to(torch.float32)


class RecordingCache(PassThroughCache):
    """Stands in for a transformers Cache: records max |k|, |v| and returns them unchanged."""

    def __init__(self) -> None:
        self.k = self.v = 0.0

    def update(self, key_states, value_states, layer_idx=None, *args, **kwargs):
        self.k = max(self.k, float(key_states.detach().abs().amax()))
        self.v = max(self.v, float(value_states.detach().abs().amax()))
        return key_states, value_states


class StatsPass(LayerPass):
    """Calibration's fact pass: max |input| of each Linear (MoE experts per expert, from the
    router's choice), its mean squared input per channel, and max |key| after rotary / max
    |value| of each attention (a recording cache whose `update()` sees what an engine stores)."""

    def __init__(self, stats: Stats, quantized: frozenset[str] | None = None):
        self.stats = stats
        self.quantized = quantized  # the modules the plan quantizes (None: all): the head's only if there
        self.head: str | None = None
        self.kv = False  # a causal LM's layers keep a KV cache; an encoder's do not

    def begin(self, stack: Stack) -> None:
        self.kv = stack.kind == CAUSAL
        path = stack.head()
        self.head = stack.names.linear_modules(path)[0] if path and stack.names.linear_modules(path) else None
        if self.quantized is not None and self.head not in self.quantized:
            # an unquantized head's input is never used; taking it runs the head on every batch
            # (a [tokens, vocab] product, the embedding and the head loaded in FP32: +0.4 GiB of
            # peak and ~4 s on a 2048-wide Llama with a 32,000 vocabulary)
            self.head = None

    def observe(self, layer, prefix: str, names: CheckpointMap) -> list:
        _expert_roles(self.stats, layer, prefix, names)
        return input_hooks(layer, prefix, names, self.stats.add)

    def cache(self, layer, prefix: str) -> RecordingCache | None:
        return RecordingCache() if self.kv and attention_path(layer, prefix) is not None else None

    def layer_done(self, layer, prefix: str, names: CheckpointMap, cache: RecordingCache) -> None:
        attention = attention_path(layer, prefix)
        if not self.kv or cache_kwarg(layer) is None or attention is None:  # an encoder's layer: no KV cache
            return
        attn = names.module(attention)
        self.stats.keys[attn], self.stats.values[attn] = cache.k, cache.v

    def finish(self, stack: Stack, get, buffer: ActivationBuffer, input_batches: list) -> list[str]:
        """The output head's input (the model's own code after the last layer: the final norm),
        for a quantized head; an encoder has no head (its pooler, a head of its own, is never
        quantized)."""
        if self.head is None:
            return []
        return head_inputs(stack, get, buffer, input_batches, lambda x: self.stats.add(self.head, x))


def _expert_roles(stats: Stats, layer, prefix: str, names: CheckpointMap) -> None:
    """Each expert module's role, `<checkpoint experts block>:<the model's 3-D parameter>`."""
    for params in experts_params(layer, prefix, names).values():
        for p in params:
            modules = [k[: -len(".weight")] if k.endswith(".weight") else k for k in names.sources(p.name)]
            block = modules[0].rsplit(".", 2)[0] if len(modules) > 1 else modules[0].rsplit(".", 1)[0]
            for m in modules:
                stats.expert_roles[m] = f"{block}:{p.name.rpartition('.')[2]}"


def collect(config_dict: dict, source: Weights, ids: list[list[int]], batch: int, device: torch.device,
            progress=None, channel_stats: bool = True, part: tuple[int, int] = (0, 1),
            quantized: frozenset[str] | None = None) -> Stats:
    """Statistics of the unquantized model over `ids`, layer by layer (model/layers.py).
    `channel_stats`: also each Linear's mean squared input per channel; `part` = (i, n): only
    batches i, i + n, ... (rank i of n; batches are independent, so the maxima combine exactly,
    up to what the device's matmul rounding depends on, such as the CPU thread count);
    `quantized`: the modules whose statistics are used (None: every one; the output head's
    input is taken only if it is among them)."""
    stats = Stats(channel_stats=channel_stats)
    walk_layers(config_dict, source, ids, batch, device, StatsPass(stats, quantized), progress, part)
    return stats
