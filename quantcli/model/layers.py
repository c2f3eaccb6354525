"""Run the source model one layer at a time, in flat memory, for passes that look at its
activations (calibration, data-aware rounding; `eval` runs its two sides the same way).

The model is built by transformers on the meta device and its layers found (model/stack.py).
Every layer's arguments and layer 0's inputs are captured with only what runs before layer 0
loaded; then each layer in turn gets its weights from the source through quantcli's reader
(FP32, by transformers' own renaming and converting, model/names.py), runs every batch, hands
its outputs on as the next layer's inputs and goes back to meta. Peak memory: one layer's
weights + the activation buffer + a constant, whatever the depth.

What a pass does at each layer is a `LayerPass`:
- a *fact pass* (calibration) only observes: `observe` registers hooks on the loaded layer, one
  run over the batches both feeds the hooks and writes the layer's outputs;
- a *weight pass* (`changes_weights = True`) observes in a first run that leaves the inputs in
  place (`batch_done` after each batch, where ranks can meet batch by batch), then `update` may
  change the layer's weights (the quantized ones it will write), and a second run writes the
  outputs of the changed layer: each layer's statistics come from the outputs of the layers
  already changed, as a sequential GPTQ pipeline needs. A layer such a pass finished in an
  interrupted run is `replay`ed: loaded from what it wrote and run once for its outputs.
  Where the pass keeps the source's weights in the model (`feeds_changed` False: the next
  layer's inputs are the source's) the first run writes the outputs and there is no second;
  nor is there for the last layer of a pass that does not read its outputs.
  The first run's outputs are otherwise thrown away, so a hook may end a batch's run there by
  raising `Observed` once the batch has reached every module the pass observes (the rest of the
  layer, a Llama's down_proj and residual, is not computed).
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Callable

import torch

from quantcli.memory import fix_malloc_thresholds, release_freed_memory
from quantcli.model.buffer import ActivationBuffer, budget_bytes
from quantcli.model.names import CheckpointMap, Get
from quantcli.model.outer import load_module, to_meta
from quantcli.model.stack import LayerArgs, Stack, Tail, build_stack, cache_kwarg, capture


@dataclass
class Weights:
    """A checkpoint as the walk reads it: `get(name)` a tensor, `release(name)` when no longer
    needed, every tensor's name, and `shape(name)` from its header."""

    get: Get
    release: Callable[[str], None]
    names: set[str]
    shape: Callable[[str], tuple[int, ...]]

    @staticmethod
    def of(tensors, transforms: dict | None = None) -> Weights:
        """The walk's view of a checkpoint.tensors.CheckpointTensors, with the tensors `transforms`
        ({name: planning.transforms.TransformOp}) changes transformed: the model the output is."""
        get = tensors.get
        if transforms:
            def get(name: str):
                op = transforms.get(name)
                return tensors.get(name) if op is None else op.apply(tensors.get(name))
        return Weights(get, tensors.release, set(tensors.where), lambda n: tuple(tensors.info(n).shape))


class Observed(BaseException):
    """Raised by a weight pass's hook in the observing run when the batch has reached every
    module the pass observes: the walk stops the batch's run there (see the module docstring).
    A BaseException, as KeyboardInterrupt is: model code that catches Exception lets it through."""


class LayerPass:
    """What a pass does with each layer the walk loads. The defaults do nothing."""

    changes_weights = False  # a weight pass: observe, update, then run again for the outputs
    feeds_changed = True  # a weight pass: the next layer's inputs come from the changed weights
    reads_last_outputs = True  # False: `finish` never reads the last layer's outputs (not computed)
    # None: every layer run in FP32; a lower dtype (BF16): the layer's runs under torch.autocast
    # (matmuls_in's docstring says what runs in which dtype)
    matmul_dtype: torch.dtype | None = None

    def begin(self, stack: Stack) -> None:
        """Before the first layer: the model the walk runs (its kind, its layers' prefixes)."""

    def observe(self, layer, prefix: str, names: CheckpointMap) -> list:
        """Hooks (removable handles) on the loaded layer for the observing run."""
        return []

    def cache(self, layer, prefix: str):
        """The object passed to the layer as its KV cache in the observing run, or None."""
        return None

    def batch_done(self, j: int) -> None:
        """After batch `j` (this process's numbering) of the observing run, before batch j + 1."""

    def replay(self, prefix: str):
        """None, or for a layer this pass finished before (a resumed run) the `get(name)` of the
        weights it wrote: the walk loads the layer from it and runs it once, observing nothing."""
        return None

    def layer_done(self, layer, prefix: str, names: CheckpointMap, cache) -> None:
        """After the observing run, before `update` and before the layer goes back to meta."""

    def update(self, layer, prefix: str, names: CheckpointMap, rerun: bool) -> None:
        """A weight pass changes the loaded layer's parameters here (in place) where `rerun`: the
        walk then runs the layer again for the next layer's inputs (not for the last layer of a
        pass that does not read its outputs, nor where `feeds_changed` is False)."""

    def finish(self, stack: Stack, get: Get, buffer: ActivationBuffer, input_batches: list) -> list[str]:
        """After the last layer: `buffer` holds its outputs (unless `reads_last_outputs` is False);
        returns the checkpoint tensors read."""
        return []


def batches(ids: list[list[int]], size: int) -> list[torch.Tensor]:
    """Consecutive samples of equal length, at most `size` per batch (no padding)."""
    out: list[list[list[int]]] = []
    for s in ids:
        if out and len(out[-1]) < size and len(out[-1][0]) == len(s):
            out[-1].append(s)
        else:
            out.append([s])
    return [torch.tensor(b, dtype=torch.long) for b in out]


def matmuls_in(dtype: torch.dtype | None, device: torch.device):
    """The context a layer runs in: FP32 throughout (`dtype` None), or torch.autocast to `dtype`.
    Autocast runs the matmuls (Linear, bmm, attention) on operands rounded to `dtype`,
    accumulating in FP32, with outputs in `dtype`; what consumes those outputs stays in `dtype`
    (a Llama's SiLU and gate x up, so down_proj's and o_proj's inputs are BF16; a router's
    logits). A sum with an FP32 tensor promotes back: the residual stream, and the norms taken
    of it, stay FP32. BF16's speed (AMX tiles on a recent x86 CPU, tensor cores on a GPU: ~4x
    FP32 on the layers of a 2048-wide Llama) without rounding the hidden state a layer hands on
    to BF16 (in a pre-norm residual architecture)."""
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def linear_weights_in(layer, dtype: torch.dtype) -> None:
    """The weights of the layer's Linears as `dtype`, cast once per run: autocast would cast each
    at every call, to the same values (both round to nearest even), and for a batch of a few
    hundred tokens that cast costs as much as the matmul. Other parameters (norms, 3-D expert
    stacks, biases) stay as loaded; loading the layer again brings FP32 weights back."""
    for mod in layer.modules():
        if isinstance(mod, torch.nn.Linear) and mod.weight.dtype != dtype:
            mod.weight = torch.nn.Parameter(mod.weight.to(dtype), requires_grad=False)


def run_batches(layer, index: int, buffer: ActivationBuffer, layer_args: LayerArgs, cache=None, write: bool = True,
                batch_done=lambda j: None, matmul_dtype: torch.dtype | None = None) -> None:
    """Run every batch through the loaded layer `index` with the arguments the model's own forward
    gave it (stack.capture), `cache` as its KV cache (none for a layer that takes none), its
    matmuls in `matmul_dtype` (matmuls_in); its outputs replace its inputs in `buffer` when
    `write` (else a hook may stop a batch's run by raising Observed)."""
    key = cache_kwarg(layer) if cache is not None else None
    if matmul_dtype is not None:
        linear_weights_in(layer, matmul_dtype)
    signature = inspect.signature(type(layer).forward) if key else None
    for j, per_layer in enumerate(layer_args):
        args, kwargs = per_layer[index]
        hidden = buffer.read(j)
        if key:  # the cache by its name, wherever the model passed its (empty) one: by position or keyword
            bound = signature.bind_partial(layer, hidden, *args, **kwargs)
            bound.arguments[key] = cache
        try:
            with matmuls_in(matmul_dtype, buffer.device):
                out = layer(*bound.args[1:], **bound.kwargs) if key else layer(hidden, *args, **kwargs)
        except Observed:
            if write:
                raise RuntimeError("internal: a layer's run was stopped early where its outputs are written") from None
        else:
            if write:
                buffer.write(j, out[0] if isinstance(out, tuple) else out)
        batch_done(j)


def load_layer(layer, prefix: str, get: Get, names: CheckpointMap, device: torch.device) -> dict[str, torch.Tensor]:
    """Give the (meta) `layer` its parameters and persistent buffers, built from checkpoint tensors
    `get(name)`, in FP32 (integer buffers keep their dtype); returns them by their name in it."""
    return load_module(layer, prefix, names, get, device)


def layer_sources(layer, prefix: str, names: CheckpointMap) -> list[str]:
    """The checkpoint tensors a layer is built from, each once."""
    return list(dict.fromkeys(src for n in layer.state_dict() for src in names.sources(prefix + n)))


def run_layer(stack: Stack, i: int, get: Get, buffer: ActivationBuffer, layer_args: LayerArgs,
              layer_pass: LayerPass) -> list[str]:
    """Load layer i from the source, run every batch through it for `layer_pass` (its outputs
    replace its inputs in `buffer`, unless it is the last and the pass does not read them), and
    send it back to the meta device. Returns the checkpoint tensors it read."""
    layer, prefix, names = stack.layers[i], stack.layer_prefix(i), stack.names
    read = layer_sources(layer, prefix, names)
    written = layer_pass.replay(prefix)
    load_layer(layer, prefix, written or get, names, buffer.device)
    dtype = layer_pass.matmul_dtype
    if written is not None:
        run_batches(layer, i, buffer, layer_args, None, write=True, matmul_dtype=dtype)
        to_meta(layer)
        return read
    outputs = layer_pass.reads_last_outputs or i < len(stack.layers) - 1
    rerun = layer_pass.changes_weights and layer_pass.feeds_changed and outputs
    hooks = layer_pass.observe(layer, prefix, names)
    cache = layer_pass.cache(layer, prefix)
    try:
        run_batches(layer, i, buffer, layer_args, cache, write=outputs and not rerun,
                    batch_done=layer_pass.batch_done, matmul_dtype=dtype)
    finally:
        for h in reversed(hooks):  # last in, first out: nested expert tracers unwind in order
            h.remove()
    layer_pass.layer_done(layer, prefix, names, cache)
    if layer_pass.changes_weights:
        layer_pass.update(layer, prefix, names, rerun)
    if rerun:
        run_batches(layer, i, buffer, layer_args, None, write=True, matmul_dtype=dtype)
    to_meta(layer)
    return read


def walk_layers(config_dict: dict, source: Weights, ids: list[list[int]], batch: int, device: torch.device,
                layer_pass: LayerPass, progress=None, part: tuple[int, int] = (0, 1)) -> None:
    """Run `layer_pass` over the model of `config_dict` on `ids`, layer by layer, reading
    `source`; `progress(done, total, samples)` is called after each layer; `part` = (i, n): only
    batches i, i + n, ... (rank i of n)."""
    fix_malloc_thresholds()  # with release_freed_memory after each layer: memory flat in depth (quantcli/memory.py)
    stack = build_stack(config_dict, source.names, source.shape, "--calibration")
    input_batches = batches(ids, batch)[part[0]::part[1]]
    layer_pass.begin(stack)
    with torch.inference_mode(), ActivationBuffer(device, budget_bytes()) as buffer:
        layer_args, read = capture(stack, source.get, device, input_batches, buffer.write)
        for name in read:
            source.release(name)
        for i in range(len(stack.layers)):
            for name in run_layer(stack, i, source.get, buffer, layer_args, layer_pass):
                source.release(name)
            release_freed_memory()
            if progress is not None:
                progress(i + 1, len(stack.layers), len(ids))
        for name in layer_pass.finish(stack, source.get, buffer, input_batches):
            source.release(name)


def head_inputs(stack: Stack, get: Get, buffer: ActivationBuffer, input_batches: list,
                record: Callable[[torch.Tensor], None]) -> list[str]:
    """Run the model's code after its layers (stack.Tail) on the buffer's final hidden states and
    hand `record(x)` the input of its output head; returns the checkpoint tensors read."""
    head = stack.head()
    if head is None:
        return []
    hook = stack.model.get_submodule(head).register_forward_pre_hook(lambda m, args: record(args[0]))
    try:
        with Tail(stack, stack.names, get, buffer.device) as run:
            for j, ids in enumerate(input_batches):
                run(ids, buffer.read(j))
            return run.read
    finally:
        hook.remove()
