"""Calibration's statistics, recorded by a fact pass over the layer walk (model/layers.py): max
|input| of each Linear (model/inputs.py: a forward pre-hook; MoE experts per expert, from the
router's choice) and its mean squared input per channel, and max |key| after rotary / max |value| (a recording cache
passed to the attention, whose `update()` sees what a serving engine stores)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quantcli.model.buffer import ActivationBuffer
from quantcli.model.inputs import input_hooks
from quantcli.model.layers import LayerPass, cache_kwarg, walk_layers
from quantcli.model.stack import CAUSAL, HEAD, Stack
from quantcli.model.weights import ExpertModules, WeightMap


@dataclass
class Stats:
    inputs: dict[str, float] = field(default_factory=dict)  # checkpoint module -> max |x| of its input
    # checkpoint module -> sum over tokens of x^2 per input channel (FP64), and the token count:
    # diag(X^T X) / N, the weight of each input channel's error in an activation-aware search.
    sumsq: dict[str, torch.Tensor] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    keys: dict[str, float] = field(default_factory=dict)  # attention module -> max |k| after rotary
    values: dict[str, float] = field(default_factory=dict)  # attention module -> max |v|
    # checkpoint expert module -> its experts block and role ("layers.0.mlp.experts:down"): an
    # expert no token was routed to takes the max of its block's experts in that role.
    expert_roles: dict[str, str] = field(default_factory=dict)
    # Off when nothing reads sumsq (no activation-weighted search): an FP64 pass over every
    # Linear's input that the max alone does not need.
    channel_stats: bool = True

    def add(self, module: str, x: torch.Tensor) -> None:
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


class RecordingCache:
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

    def __init__(self, stats: Stats):
        self.stats = stats

    def observe(self, layer, prefix: str, weights: WeightMap, experts: dict[str, ExpertModules]) -> list:
        for path, modules in experts.items():
            _expert_roles(self.stats, path, modules)
        return input_hooks(layer, prefix, weights, experts, self.stats.add)

    def cache(self, prefix: str) -> RecordingCache:
        return RecordingCache()

    def layer_done(self, layer, prefix: str, weights: WeightMap, cache: RecordingCache) -> None:
        if cache_kwarg(layer) is None:  # an encoder's block: no KV cache, nothing recorded
            return
        attn = weights.checkpoint_module(prefix + "self_attn")
        self.stats.keys[attn], self.stats.values[attn] = cache.k, cache.v

    def finish(self, stack: Stack, get, buffer: ActivationBuffer, count: int) -> None:
        """lm_head's input (the final norm of the last layer's output), for a quantized head; an
        encoder has no head (its pooler, a head of its own, is never quantized)."""
        if stack.kind != CAUSAL:
            return
        norm = stack.model.model.norm
        norm.load_state_dict({n: get(f"model.norm.{n}").to(buffer.device, torch.float32)
                              for n in norm.state_dict()}, assign=True)
        for j in range(count):
            self.stats.add(HEAD, norm(buffer.read(j)))
        norm.to("meta")


def _expert_roles(stats: Stats, path: str, modules: ExpertModules) -> None:
    for role, names in (("gate_up", (*modules.gate, *modules.up)), ("down", modules.down)):
        for m in names:
            stats.expert_roles[m] = f"{path}:{role}"


def collect(config_dict: dict, get, release, names, ids: list[list[int]], batch: int, device: torch.device,
            progress=None, channel_stats: bool = True, part: tuple[int, int] = (0, 1)) -> Stats:
    """Statistics of the unquantized model over `ids`, layer by layer (model/layers.py).
    `channel_stats`: also each Linear's mean squared input per channel; `part` = (i, n): only
    batches i, i + n, ... (rank i of n; batches are independent, so the maxima combine exactly,
    up to what the device's matmul rounding depends on, such as the CPU thread count)."""
    stats = Stats(channel_stats=channel_stats)
    walk_layers(config_dict, get, release, names, ids, batch, device, StatsPass(stats), progress, part)
    return stats
