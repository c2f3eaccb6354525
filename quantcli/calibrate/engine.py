"""Run the source model one decoder layer at a time and record activation statistics.

The model is built by transformers on the meta device (no memory). Layer 0's inputs (hidden
states, position embeddings, mask) are captured with only the embedding materialized; then each
layer in turn gets its weights from the source through quantcli's reader (FP32), runs every
batch, records max |input| of each Linear (a forward pre-hook) and max |key| after rotary / max
|value| (a recording cache passed to the attention, whose `update()` sees what a serving engine
stores), hands its outputs on as the next layer's inputs and goes back to meta. Peak memory:
one layer's weights + the activation buffer + a constant, whatever the depth.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

from ..errors import QuantcliError
from .data import EXTRA


@dataclass
class Stats:
    inputs: dict[str, float] = field(default_factory=dict)  # Linear module -> max |x|
    keys: dict[str, float] = field(default_factory=dict)  # attention module -> max |k| after rotary
    values: dict[str, float] = field(default_factory=dict)  # attention module -> max |v|


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


def capture_inputs(model, get, device: torch.device, input_batches: list[torch.Tensor]) -> list[tuple]:
    """(hidden_states, kwargs) of decoder layer 0 per batch, with only the embedding loaded."""
    body = model.model
    body.embed_tokens.load_state_dict({"weight": get("model.embed_tokens.weight").to(device, torch.float32)},
                                      assign=True)
    with torch.device(device):  # its inv_freq buffer is computed, not read: build it for real
        body.rotary_emb = type(body.rotary_emb)(config=model.config)
    captured: list[tuple] = []

    def catch(module, args, kwargs):
        kwargs = dict(kwargs)
        hidden = args[0] if args else kwargs.pop("hidden_states")
        captured.append((hidden, kwargs))
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


def run_layer(layer, prefix: str, get, device: torch.device, captured: list[tuple], stats: Stats) -> None:
    """Load one decoder layer from the source, run every batch through it (its outputs replace
    `captured` in place), record its statistics, and send it back to the meta device."""
    names = list(layer.state_dict())
    layer.load_state_dict({n: get(prefix + n).to(device, torch.float32) for n in names}, assign=True)
    hooks = []
    for sub, mod in layer.named_modules():
        if isinstance(mod, torch.nn.Linear):
            hooks.append(mod.register_forward_pre_hook(_recorder(stats.inputs, prefix + sub)))
    cache, key = RecordingCache(), _cache_kwarg(layer)
    try:
        for j, (hidden, kwargs) in enumerate(captured):
            out = layer(hidden, **{**kwargs, key: cache, "use_cache": False})
            captured[j] = (out[0] if isinstance(out, tuple) else out, kwargs)
    finally:
        for h in hooks:
            h.remove()
    attn = prefix + "self_attn"
    stats.keys[attn], stats.values[attn] = cache.k, cache.v
    layer.to("meta")


def _recorder(found: dict[str, float], name: str):
    def record(module, args):
        amax = float(args[0].detach().abs().amax())
        found[name] = max(found.get(name, 0.0), amax)
    return record


def collect(config_dict: dict, get, release, ids: list[list[int]], batch: int, device: torch.device,
            progress=None) -> Stats:
    """Statistics of the unquantized model over `ids`, layer by layer."""
    model = meta_model(config_dict)
    stats = Stats()
    with torch.inference_mode():
        captured = capture_inputs(model, get, device, batches(ids, batch))
        release("model.embed_tokens.weight")
        for i, layer in enumerate(model.model.layers):
            prefix = f"model.layers.{i}."
            run_layer(layer, prefix, get, device, captured, stats)
            for n in layer.state_dict():
                release(prefix + n)
            if progress is not None:
                progress(i + 1, len(model.model.layers))
    return stats
