"""Run the source model one decoder layer at a time, in flat memory, for passes that look at its
activations (calibration today; data-aware rounding and `eval` build on the same walk).

The model is built by transformers on the meta device (no memory). Layer 0's inputs (hidden
states, position embeddings, mask) are captured with only the embedding materialized; then each
layer in turn gets its weights from the source through quantcli's reader (FP32), runs every
batch, hands its outputs on as the next layer's inputs and goes back to meta. Peak memory: one
layer's weights + the activation buffer + a constant, whatever the depth.

What a pass does at each layer is a `LayerPass`:
- a *fact pass* (calibration) only observes: `observe` registers hooks on the loaded layer, one
  run over the batches both feeds the hooks and writes the layer's outputs;
- a *weight pass* (`changes_weights = True`) observes in a first run that leaves the inputs in
  place (`batch_done` after each batch, where ranks can meet batch by batch), then `update` may
  change the layer's weights (the quantized ones it will write), and a second run writes the
  outputs of the changed layer: each layer's statistics come from the outputs of the layers
  already changed, as a sequential GPTQ pipeline needs. A layer such a pass finished in an
  interrupted run is `replay`ed: loaded from what it wrote and run once for its outputs.
"""

from __future__ import annotations

import inspect

import torch

from quantcli.errors import QuantcliError
from quantcli.memory import fix_mmap_threshold
from quantcli.model.buffer import ActivationBuffer, budget_bytes
from quantcli.model.samples import EXTRA
from quantcli.model.weights import ExpertModules, WeightMap, experts_blocks

EMBEDDING, FINAL_NORM, HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head"


class LayerPass:
    """What a pass does with each decoder layer the walk loads. The defaults do nothing."""

    changes_weights = False  # a weight pass: observe, update, then run again for the outputs

    def observe(self, layer, prefix: str, weights: WeightMap, experts: dict[str, ExpertModules]) -> list:
        """Hooks (removable handles) on the loaded layer for the observing run."""
        return []

    def cache(self, prefix: str):
        """The object passed to the attention as its KV cache in the observing run, or None."""
        return None

    def batch_done(self, j: int) -> None:
        """After batch `j` (this process's numbering) of the observing run, before batch j + 1."""

    def replay(self, prefix: str):
        """None, or for a layer this pass finished before (a resumed run) the `get(name)` of the
        weights it wrote: the walk loads the layer from it and runs it once, observing nothing."""
        return None

    def layer_done(self, layer, prefix: str, weights: WeightMap, cache) -> None:
        """After the observing run, before `update` and before the layer goes back to meta."""

    def update(self, layer, prefix: str, weights: WeightMap, experts: dict[str, ExpertModules]) -> None:
        """A weight pass changes the loaded layer's parameters here (in place)."""

    def finish(self, model, get, buffer: ActivationBuffer, count: int) -> None:
        """After the last decoder layer: `buffer` holds its outputs for `count` batches."""


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


class _Stop(Exception):
    pass


def first_layer_inputs(body, first_layer, device: torch.device, input_batches: list[torch.Tensor],
                       record) -> None:
    """Run `body` on each batch only until `first_layer` would start, and hand its inputs to
    `record(hidden_states, other_args, kwargs)`: the embedding (and whatever else sits before the
    first layer) is all that must be loaded. Calibration's walk and eval's two-sided walk share it."""
    def catch(module, args, kwargs):
        kwargs = dict(kwargs)
        hidden = args[0] if args else kwargs.pop("hidden_states")
        record(hidden, tuple(args[1:]), kwargs)
        raise _Stop

    hook = first_layer.register_forward_pre_hook(catch, with_kwargs=True)
    try:
        for ids in input_batches:
            try:
                body(input_ids=ids.to(device), use_cache=False)
            except _Stop:
                pass
    finally:
        hook.remove()


def capture_inputs(model, get, device: torch.device, input_batches: list[torch.Tensor],
                   buffer: ActivationBuffer) -> list[dict]:
    """Layer 0's hidden states per batch (into `buffer`) and its other arguments (position
    embeddings, mask), with only the embedding loaded."""
    body = model.model
    body.embed_tokens.load_state_dict({"weight": get(EMBEDDING).to(device, torch.float32)}, assign=True)
    with torch.device(device):  # its inv_freq buffer is computed, not read: build it for real
        body.rotary_emb = type(body.rotary_emb)(config=model.config)
    captured: list[dict] = []

    def record(hidden, args, kwargs):
        buffer.write(len(captured), hidden)
        captured.append(kwargs)

    first_layer_inputs(body, body.layers[0], device, input_batches, record)
    body.embed_tokens.to("meta")
    return captured


def cache_kwarg(layer) -> str | None:
    """The keyword a layer's attention takes its KV cache by, or None (no self_attn)."""
    attn = getattr(layer, "self_attn", None)
    if attn is None:
        return None
    params = inspect.signature(type(attn).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _run_batches(layer, buffer: ActivationBuffer, captured: list[dict], cache, write: bool,
                 batch_done=lambda j: None) -> None:
    extra = {cache_kwarg(layer): cache} if cache is not None else {}
    for j, kwargs in enumerate(captured):
        out = layer(buffer.read(j), **{**kwargs, **extra, "use_cache": False})
        if write:
            buffer.write(j, out[0] if isinstance(out, tuple) else out)
        batch_done(j)


def layer_prefix(i: int) -> str:
    """The model path of decoder layer `i`, as every LayerPass method receives it."""
    return f"model.layers.{i}."


def load_layer(layer, prefix: str, get, weights: WeightMap, experts: dict[str, ExpertModules],
               device: torch.device) -> None:
    """Give the (meta) `layer` its parameters, built from checkpoint tensors `get(name)`, in FP32."""
    layer.load_state_dict({n: weights.tensor(prefix + n, get, experts).to(device, torch.float32)
                           for n in layer.state_dict()}, assign=True)


def run_layer(layer, prefix: str, get, weights: WeightMap, buffer: ActivationBuffer, captured: list[dict],
              layer_pass: LayerPass) -> list[str]:
    """Load one decoder layer from the source, run every batch through it for `layer_pass` (its
    outputs replace its inputs in `buffer`), and send it back to the meta device. Returns the
    checkpoint tensors it read."""
    experts = experts_blocks(layer, prefix, weights)
    read = [src for n in layer.state_dict() for src in weights.sources(prefix + n, experts)]
    written = layer_pass.replay(prefix)
    load_layer(layer, prefix, written or get, weights, experts, buffer.device)
    if written is not None:
        _run_batches(layer, buffer, captured, None, write=True)
        layer.to("meta")
        return read
    hooks = layer_pass.observe(layer, prefix, weights, experts)
    cache = layer_pass.cache(prefix)
    try:
        _run_batches(layer, buffer, captured, cache, write=not layer_pass.changes_weights,
                     batch_done=layer_pass.batch_done)
    finally:
        for h in hooks:
            h.remove()
    layer_pass.layer_done(layer, prefix, weights, cache)
    if layer_pass.changes_weights:
        layer_pass.update(layer, prefix, weights, experts)
        _run_batches(layer, buffer, captured, None, write=True)
    layer.to("meta")
    return read


def walk_layers(config_dict: dict, get, release, names, ids: list[list[int]], batch: int, device: torch.device,
                layer_pass: LayerPass, progress=None, part: tuple[int, int] = (0, 1)) -> None:
    """Run `layer_pass` over the model of `config_dict` on `ids`, layer by layer. `get(name)`
    reads a checkpoint tensor, `release(name)` says it is no longer needed; `progress(done,
    total, samples)` is called after each decoder layer; `part` = (i, n): only batches i, i + n,
    ... (rank i of n)."""
    fix_mmap_threshold()  # else freed layers stay in the heap as fragments: memory grows with depth
    model = meta_model(config_dict)
    weights = WeightMap(names)
    input_batches = batches(ids, batch)[part[0]::part[1]]
    shapes = [(*b.shape, model.config.hidden_size) for b in input_batches]
    with torch.inference_mode(), ActivationBuffer(shapes, device, budget_bytes()) as buffer:
        captured = capture_inputs(model, get, device, input_batches, buffer)
        release(EMBEDDING)
        layers = model.model.layers
        for i, layer in enumerate(layers):
            for name in run_layer(layer, layer_prefix(i), get, weights, buffer, captured, layer_pass):
                release(name)
            if progress is not None:
                progress(i + 1, len(layers), len(ids))
        layer_pass.finish(model, get, buffer, len(captured))
        release(FINAL_NORM)
