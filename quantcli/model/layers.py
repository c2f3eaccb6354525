"""Run the source model one layer at a time, in flat memory, for passes that look at its
activations (calibration, data-aware rounding; `eval` runs its two sides the same way).

The model (a causal LM's decoder layers or a BERT-like encoder's blocks) is built by
transformers on the meta device (model/stack.py, no memory). Layer 0's inputs (hidden states,
position embeddings, the causal or attention mask) are captured with only the embedding
materialized; then each layer in turn gets its weights from the source through quantcli's
reader (FP32), runs every batch, hands its outputs on as the next layer's inputs and goes back to
meta. Peak memory: one layer's weights + the activation buffer + a constant, whatever the depth.

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
from quantcli.model.stack import CAUSAL, FINAL_NORM, MasksByLayer, Stack, build_stack, capture
from quantcli.model.weights import ExpertModules, WeightMap, experts_blocks


class LayerPass:
    """What a pass does with each layer the walk loads. The defaults do nothing."""

    changes_weights = False  # a weight pass: observe, update, then run again for the outputs

    def begin(self, stack: Stack) -> None:
        """Before the first layer: the model the walk runs (its kind, its layers' prefixes)."""

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

    def finish(self, stack: Stack, get, buffer: ActivationBuffer, count: int) -> None:
        """After the last layer: `buffer` holds its outputs for `count` batches."""


def batches(ids: list[list[int]], size: int) -> list[torch.Tensor]:
    """Consecutive samples of equal length, at most `size` per batch (no padding)."""
    out: list[list[list[int]]] = []
    for s in ids:
        if out and len(out[-1]) < size and len(out[-1][0]) == len(s):
            out[-1].append(s)
        else:
            out.append([s])
    return [torch.tensor(b, dtype=torch.long) for b in out]


def cache_kwarg(layer) -> str | None:
    """The keyword a layer's attention takes its KV cache by, or None (no self_attn)."""
    attn = getattr(layer, "self_attn", None)
    if attn is None:
        return None
    params = inspect.signature(type(attn).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def layer_index(layer) -> int | None:
    """The index a decoder layer knows itself by (its attention's `layer_idx`), or None."""
    for mod in layer.modules():
        if isinstance(getattr(mod, "layer_idx", None), int):
            return mod.layer_idx
    return None


def run_batches(layer, buffer: ActivationBuffer, captured: list[tuple], cache=None, write: bool = True,
                batch_done=lambda j: None) -> None:
    """Run every batch through the loaded `layer` with the arguments model/stack.capture took for
    it (those the model's own forward gave layer 0, with use_cache=False), `cache` as its
    attention's KV cache (none for a layer without self_attn); its outputs replace its inputs in
    `buffer` when `write`."""
    key = cache_kwarg(layer) if cache is not None else None
    index = layer_index(layer)
    for j, (args, kwargs) in enumerate(captured):
        if isinstance(kwargs.get("attention_mask"), MasksByLayer):
            if index not in kwargs["attention_mask"]:
                raise QuantcliError(f"{type(layer).__name__}: its layers differ in kind (config.layer_types) but "
                                    f"this one names no layer_idx, so its attention mask is unknown; quantcli cannot "
                                    f"run this architecture layer by layer")
            kwargs = {**kwargs, "attention_mask": kwargs["attention_mask"][index]}
        out = layer(buffer.read(j), *args, **({**kwargs, key: cache} if key else kwargs))
        if write:
            buffer.write(j, out[0] if isinstance(out, tuple) else out)
        batch_done(j)


def load_layer(layer, prefix: str, get, weights: WeightMap, experts: dict[str, ExpertModules],
               device: torch.device) -> None:
    """Give the (meta) `layer` its parameters, built from checkpoint tensors `get(name)`, in FP32."""
    layer.load_state_dict({n: weights.tensor(prefix + n, get, experts).to(device, torch.float32)
                           for n in layer.state_dict()}, assign=True)


def run_layer(layer, prefix: str, get, weights: WeightMap, buffer: ActivationBuffer, captured: list[tuple],
              layer_pass: LayerPass) -> list[str]:
    """Load one layer from the source, run every batch through it for `layer_pass` (its
    outputs replace its inputs in `buffer`), and send it back to the meta device. Returns the
    checkpoint tensors it read."""
    experts = experts_blocks(layer, prefix, weights)
    read = [src for n in layer.state_dict() for src in weights.sources(prefix + n, experts)]
    written = layer_pass.replay(prefix)
    load_layer(layer, prefix, written or get, weights, experts, buffer.device)
    if written is not None:
        run_batches(layer, buffer, captured, None, write=True)
        layer.to("meta")
        return read
    hooks = layer_pass.observe(layer, prefix, weights, experts)
    cache = layer_pass.cache(prefix)
    try:
        run_batches(layer, buffer, captured, cache, write=not layer_pass.changes_weights,
                     batch_done=layer_pass.batch_done)
    finally:
        for h in hooks:
            h.remove()
    layer_pass.layer_done(layer, prefix, weights, cache)
    if layer_pass.changes_weights:
        layer_pass.update(layer, prefix, weights, experts)
        run_batches(layer, buffer, captured, None, write=True)
    layer.to("meta")
    return read


def walk_layers(config_dict: dict, get, release, names, ids: list[list[int]], batch: int, device: torch.device,
                layer_pass: LayerPass, progress=None, part: tuple[int, int] = (0, 1)) -> None:
    """Run `layer_pass` over the model of `config_dict` on `ids`, layer by layer. `get(name)`
    reads a checkpoint tensor, `release(name)` says it is no longer needed; `progress(done,
    total, samples)` is called after each layer; `part` = (i, n): only batches i, i + n,
    ... (rank i of n)."""
    fix_mmap_threshold()  # else freed layers stay in the heap as fragments: memory grows with depth
    stack = build_stack(config_dict, names, "--calibration")
    weights = WeightMap(names)
    input_batches = batches(ids, batch)[part[0]::part[1]]
    shapes = [(*b.shape, stack.config.hidden_size) for b in input_batches]
    layer_pass.begin(stack)
    with torch.inference_mode(), ActivationBuffer(shapes, device, budget_bytes()) as buffer:
        captured, read = capture(stack, get, device, input_batches, buffer)
        for name in read:
            release(name)
        for i, layer in enumerate(stack.layers):
            for name in run_layer(layer, stack.layer_prefix(i), get, weights, buffer, captured, layer_pass):
                release(name)
            if progress is not None:
                progress(i + 1, len(stack.layers), len(ids))
        layer_pass.finish(stack, get, buffer, len(captured))
        if stack.kind == CAUSAL:  # an encoder has no final norm; its output is pooled
            release(FINAL_NORM)
