"""Run the source model one decoder layer at a time and record activation statistics.

The model is built by transformers on the meta device (no memory). Layer 0's inputs (hidden
states, position embeddings, mask) are captured with only the embedding materialized; then each
layer in turn gets its weights from the source through quantcli's reader (FP32), runs every
batch, records max |input| of each Linear (a forward pre-hook; MoE experts per expert, from the
router's choice) and its mean squared input per channel, and max |key| after rotary / max
|value| (a recording cache passed to the attention, whose `update()` sees what a serving engine
stores), hands its outputs on as the next layer's inputs and goes back to meta. Peak memory:
one layer's weights + the activation buffer + a constant, whatever the depth.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

from ..errors import QuantcliError
from ..memory import fix_mmap_threshold
from .buffer import ActivationBuffer, budget_bytes
from .data import EXTRA
from .weights import ExpertModules, WeightMap, experts_blocks

EMBEDDING, FINAL_NORM, HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head"


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


class _Stop(Exception):
    pass


def _transformers():
    try:
        import transformers
    except ImportError:
        raise QuantcliError(f"--calibration needs transformers: {EXTRA}") from None
    return transformers


def meta_model(config_dict: dict):
    """The source's model class, built on the meta device in FP32 (no weights)."""
    tf = _transformers()
    cfg = dict(config_dict)
    config = tf.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config)
    return model.float().eval()


def batches(ids: list[list[int]], size: int) -> list[torch.Tensor]:
    """Consecutive samples of equal length, at most `size` per batch (no padding)."""
    out: list[list[list[int]]] = []
    for s in ids:
        if out and len(out[-1]) < size and len(out[-1][0]) == len(s):
            out[-1].append(s)
        else:
            out.append([s])
    return [torch.tensor(b, dtype=torch.long) for b in out]


def capture_inputs(model, get, device: torch.device, input_batches: list[torch.Tensor],
                   buffer: ActivationBuffer) -> list[dict]:
    """Layer 0's hidden states per batch (into `buffer`) and its other arguments (position
    embeddings, mask), with only the embedding loaded."""
    body = model.model
    body.embed_tokens.load_state_dict({"weight": get(EMBEDDING).to(device, torch.float32)}, assign=True)
    with torch.device(device):  # its inv_freq buffer is computed, not read: build it for real
        body.rotary_emb = type(body.rotary_emb)(config=model.config)
    captured: list[dict] = []

    def catch(module, args, kwargs):
        kwargs = dict(kwargs)
        hidden = args[0] if args else kwargs.pop("hidden_states")
        buffer.write(len(captured), hidden)
        captured.append(kwargs)
        raise _Stop

    hook = body.layers[0].register_forward_pre_hook(catch, with_kwargs=True)
    try:
        for ids in input_batches:
            try:
                body(input_ids=ids.to(device), use_cache=False)
            except _Stop:
                pass
    finally:
        hook.remove()
    body.embed_tokens.to("meta")
    return captured


def _cache_kwarg(layer) -> str:
    params = inspect.signature(type(layer.self_attn).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def run_layer(layer, prefix: str, get, weights: WeightMap, buffer: ActivationBuffer, captured: list[dict],
              stats: Stats) -> list[str]:
    """Load one decoder layer from the source, run every batch through it (its outputs replace
    its inputs in `buffer`), record its statistics, and send it back to the meta device. Returns
    the checkpoint tensors it read."""
    experts = experts_blocks(layer, prefix, weights)
    names = list(layer.state_dict())
    layer.load_state_dict({n: weights.tensor(prefix + n, get, experts).to(buffer.device, torch.float32)
                           for n in names}, assign=True)
    hooks = []
    for sub, mod in layer.named_modules():
        if isinstance(mod, torch.nn.Linear):
            hooks.append(mod.register_forward_pre_hook(_recorder(stats, weights.checkpoint_module(prefix + sub))))
        elif prefix + sub in experts:
            hooks.append(mod.register_forward_pre_hook(_expert_recorder(stats, experts[prefix + sub]),
                                                       with_kwargs=True))
            _expert_roles(stats, prefix + sub, experts[prefix + sub])
    cache, key = RecordingCache(), _cache_kwarg(layer)
    try:
        for j, kwargs in enumerate(captured):
            out = layer(buffer.read(j), **{**kwargs, key: cache, "use_cache": False})
            buffer.write(j, out[0] if isinstance(out, tuple) else out)
    finally:
        for h in hooks:
            h.remove()
    attn = weights.checkpoint_module(prefix + "self_attn")
    stats.keys[attn], stats.values[attn] = cache.k, cache.v
    layer.to("meta")
    return [src for n in names for src in weights.sources(prefix + n, experts)]


def _recorder(stats: Stats, module: str):
    def record(mod, args):
        stats.add(module, args[0])
    return record


def _expert_recorder(stats: Stats, modules: ExpertModules):
    """Per expert: the tokens the router sent it, their max |x| (its gate and up inputs) and
    max |act(gate) * up| (its down input), computed as the experts block computes them."""
    def record(block, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        index = args[1] if len(args) > 1 else kwargs["top_k_index"]
        for e in range(block.gate_up_proj.shape[0]):
            tokens = (index == e).any(-1)
            if not bool(tokens.any()):
                continue
            x = hidden[tokens]
            gate, up = torch.nn.functional.linear(x, block.gate_up_proj[e]).chunk(2, dim=-1)
            gate_mod, up_mod, down_mod = modules.of(e)
            stats.add(gate_mod, x)
            if up_mod != gate_mod:
                stats.add(up_mod, x)
            stats.add(down_mod, block.act_fn(gate) * up)
    return record


def _expert_roles(stats: Stats, path: str, modules: ExpertModules) -> None:
    for role, names in (("gate_up", (*modules.gate, *modules.up)), ("down", modules.down)):
        for m in names:
            stats.expert_roles[m] = f"{path}:{role}"


def collect(config_dict: dict, get, release, names, ids: list[list[int]], batch: int, device: torch.device,
            progress=None, channel_stats: bool = True, part: tuple[int, int] = (0, 1)) -> Stats:
    """Statistics of the unquantized model over `ids`, layer by layer. `progress(done, total,
    samples)` is called after each decoder layer; `channel_stats`: also each Linear's mean
    squared input per channel; `part` = (i, n): only batches i, i + n, ... (rank i of n; batches
    are independent, so the maxima combine exactly, up to what the device's matmul rounding
    depends on, such as the CPU thread count)."""
    fix_mmap_threshold()  # else freed layers stay in the heap as fragments: memory grows with depth
    model = meta_model(config_dict)
    weights, stats = WeightMap(names), Stats(channel_stats=channel_stats)
    input_batches = batches(ids, batch)[part[0]::part[1]]
    shapes = [(*b.shape, model.config.hidden_size) for b in input_batches]
    with torch.inference_mode(), ActivationBuffer(shapes, device, budget_bytes()) as buffer:
        captured = capture_inputs(model, get, device, input_batches, buffer)
        release(EMBEDDING)
        layers = model.model.layers
        for i, layer in enumerate(layers):
            for name in run_layer(layer, f"model.layers.{i}.", get, weights, buffer, captured, stats):
                release(name)
            if progress is not None:
                progress(i + 1, len(layers), len(ids))
        _record_head_input(model, get, buffer, len(captured), stats)
        release(FINAL_NORM)
    return stats


def _record_head_input(model, get, buffer: ActivationBuffer, count: int, stats: Stats) -> None:
    """lm_head's input (the final norm of the last layer's output), for a quantized head."""
    norm = model.model.norm
    norm.load_state_dict({n: get(f"model.norm.{n}").to(buffer.device, torch.float32) for n in norm.state_dict()},
                         assign=True)
    for j in range(count):
        stats.add(HEAD, norm(buffer.read(j)))
    norm.to("meta")
