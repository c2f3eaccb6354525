"""The model a layer walk runs, one layer at a time, for any architecture transformers builds.

The model is config.json's own class (model/build.py: on the meta device, real non-persistent
buffers), and its checkpoint tensors map to its parameters by transformers' loading rules
(model/names.py). The walk runs the stack of layers the model's text decoder (or encoder) loops
over: the ModuleList of its `_no_split_modules` blocks under `get_decoder()` (a VLM's
`model.language_model.layers`, Falcon's `transformer.h`, BERT's `encoder.layer`), the largest
when there are several. Everything around the layers runs as the model's own forward runs it:

- `capture` calls the model with the tokens and steps over every layer (each returns its input
  and records the arguments the model handed it: position embeddings, the mask of its kind,
  alibi, per-layer inputs), so each layer later gets exactly its own arguments; layer 0's input
  is the hidden state the walk starts from. Only what runs before layer 0 is loaded
  (model/outer.py).
- `tail` calls the model again with layer 0 returning the walk's final hidden state and the
  others stepped over: the final norm, the head and whatever the model applies after it (logit
  scaling, soft-capping) run as the model's code has them, giving logits (a causal LM) or the
  encoder's last hidden state."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch

from quantcli.errors import QuantcliError
from quantcli.model.build import meta_model
from quantcli.model.names import CheckpointMap, Get
from quantcli.model.outer import OuterWeights, load_module, to_meta

CAUSAL, ENCODER = "causal-lm", "encoder"
CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past", "cache")


@dataclass
class Stack:
    kind: str  # causal-lm | encoder
    model: torch.nn.Module  # the whole model, parameters on the meta device
    body: torch.nn.Module  # what the walk calls with input_ids: the model (causal) or its base model
    layers: torch.nn.ModuleList
    layer_path: str  # model path of the layers: model.layers, model.language_model.layers, transformer.h, ...
    names: CheckpointMap
    # what a layer returns, as the model's loop reads it: None a tensor, n a tuple of n (hidden first);
    # learned by running layer 0 once (capture), used wherever a layer is stepped over
    output_arity: int | None = None
    arity_known: bool = False

    def dressed(self, hidden: torch.Tensor):
        """`hidden` as a layer of this model returns it."""
        return hidden if self.output_arity is None else (hidden, *([None] * (self.output_arity - 1)))

    def layer_prefix(self, i: int) -> str:
        """The model path prefix of layer i's parameters."""
        return f"{self.layer_path}.{i}."

    @property
    def config(self):
        return self.model.config

    @property
    def vocab_size(self) -> int | None:
        emb = self.model.get_input_embeddings()
        return getattr(emb, "num_embeddings", None)

    def head(self) -> str | None:
        """The model path of the output head (a causal LM's), or None."""
        head = self.model.get_output_embeddings() if self.kind == CAUSAL else None
        return next((p for p, m in self.model.named_modules() if m is head), None) if head is not None else None


def encoder_positions(config: dict) -> int | None:
    """How many tokens a BERT-like encoder's absolute position embeddings reach (RoBERTa's count
    from its padding id + 1), or None when its config does not say."""
    limit = config.get("max_position_embeddings")
    if not isinstance(limit, int):
        return None
    if config.get("model_type") in ("roberta", "xlm-roberta", "camembert"):
        limit -= int(config.get("pad_token_id", 1)) + 1
    return limit


def text_config(config: dict) -> dict:
    """The part of config.json that sizes the text layers: a VLM's `text_config`, else the whole."""
    sub = config.get("text_config")
    return sub if isinstance(sub, dict) and "hidden_size" in sub and "hidden_size" not in config else config


def layer_count(config: dict) -> int | str:
    """How many layers config.json says the walk runs (a VLM's text_config's), '?' if it does not say."""
    layers = text_config(config).get("num_hidden_layers")
    return layers if isinstance(layers, int) else "?"


def _module_path(model: torch.nn.Module, module: torch.nn.Module) -> str | None:
    return next((p for p, m in model.named_modules() if m is module), None)


def find_layers(model: torch.nn.Module, within: torch.nn.Module, label: str) -> tuple[str, torch.nn.ModuleList]:
    """(model path, ModuleList) of the layers the walk runs: see the module docstring."""
    blocks = set(getattr(model, "_no_split_modules", None) or [])
    root = _module_path(model, within) or ""
    found = []
    for path, mod in model.named_modules():
        if not isinstance(mod, torch.nn.ModuleList) or not len(mod) or not (path + ".").startswith(
                f"{root}." if root else ""):
            continue
        if blocks and type(mod[0]).__name__ not in blocks:
            continue
        found.append((sum(p.numel() for p in mod.parameters()), path, mod))
    if not found:
        raise QuantcliError(f"{label}: {type(model).__name__} has no stack of layers quantcli can walk (no "
                            f"ModuleList of its {', '.join(sorted(blocks)) or 'blocks'})")
    _, path, layers = max(found, key=lambda f: (f[0], -f[1].count(".")))
    return path, layers


def build_stack(config: dict, names, shape: Callable[[str], tuple[int, ...]], label: str) -> Stack:
    """The model of `config` with checkpoint tensors `names` (`shape(name)` from the headers)."""
    model = meta_model(config, label)
    causal = bool(getattr(model, "can_generate", lambda: False)()) and model.get_output_embeddings() is not None
    body = model if causal else model.base_model
    within = model.get_decoder() if causal else body
    path, layers = find_layers(model, within if isinstance(within, torch.nn.Module) else model, label)
    try:
        checkpoint = CheckpointMap(model, names, shape)
    except ImportError:
        raise QuantcliError(f"{label}: the layer walk needs transformers 5 (its checkpoint conversion "
                            f"mapping); upgrade it: pip install 'transformers>=5'") from None
    stack = Stack(CAUSAL if causal else ENCODER, model, body, layers, path, checkpoint)
    missing = [n for i in range(len(layers)) for n in layers[i].state_dict()
               if not checkpoint.sources(stack.layer_prefix(i) + n)]
    if missing:
        raise QuantcliError(f"{label}: the checkpoint has no tensor for the model's {stack.layer_prefix(0)}"
                            f"{missing[0]} ({len(missing)} parameters of its layers unmapped); it does not match "
                            f"its config.json architecture ({type(model).__name__})")
    return stack


def cache_kwarg(layer) -> str | None:
    """The keyword a layer takes its KV cache by, or None (an encoder's layer takes none)."""
    params = inspect.signature(type(layer).forward).parameters
    return next((k for k in CACHE_KWARGS if k in params), None)


def attention_path(layer, prefix: str) -> str | None:
    """The model path of a layer's attention: its submodule whose class is an ...Attention (the
    outermost, as transformers names them: LlamaAttention, FalconAttention, DeepseekV3Attention)."""
    for sub, mod in layer.named_modules():
        if sub and type(mod).__name__.endswith("Attention"):
            return prefix + sub
    return None


class _Stop(Exception):
    pass


def _stop():
    raise _Stop


def _warm_up(body, ids: torch.Tensor) -> None:
    """One call that loads what the model runs (model/outer.py), its outputs thrown away: code that
    reads a module's `weight.device` before calling it (Llama 4 moves the tokens there) would
    otherwise see the meta device on the first batch. A fault here is the real call's to report."""
    try:
        body(input_ids=ids, use_cache=False)
    except _Stop:
        pass
    except Exception:  # noqa: BLE001 - the call that follows, with what loaded here, raises it if it persists
        pass


# per batch, per layer: (positional arguments after the hidden states, keyword arguments)
LayerArgs = list[list[tuple[tuple, dict]]]


def _stepped(layers, on_call: Callable[[int, torch.Tensor, tuple, dict], object]):
    """Replace each layer's forward (on the instance) with `on_call(i, hidden, args, kwargs)`."""
    def step(i: int):
        def forward(*args, **kwargs):
            kwargs = dict(kwargs)
            hidden = args[0] if args else kwargs.pop("hidden_states")
            return on_call(i, hidden, tuple(args[1:]), kwargs)
        return forward
    for i, layer in enumerate(layers):
        layer.forward = step(i)


def _restored(layers) -> None:
    for layer in layers:
        layer.__dict__.pop("forward", None)


def capture(stack: Stack, get: Get, device: torch.device, input_batches: list[torch.Tensor],
            write: Callable[[int, torch.Tensor], None],
            names: CheckpointMap | None = None) -> tuple[LayerArgs, list[str]]:
    """Layer 0's input of every batch (handed to `write(j, hidden)`), every layer's other
    arguments as the model passes them, and the checkpoint tensors read (see the module
    docstring); `names`: the map of the checkpoint `get` reads (the stack's own by default)."""
    taken: LayerArgs = []
    last = len(stack.layers) - 1

    def on_call(i, hidden, args, kwargs):
        if i == 0:
            write(len(taken), hidden.to(torch.float32))
            taken.append([])
        taken[-1].append((args, kwargs))
        if i == last:
            raise _Stop
        return stack.dressed(hidden)

    names = names or stack.names
    with OuterWeights(stack.model, stack.layers, names, get, device) as outer:
        _stepped(stack.layers, lambda i, hidden, args, kwargs: _stop())
        try:
            if input_batches:
                _warm_up(stack.body, input_batches[0].to(device))
                if not stack.arity_known:
                    _learn_arity(stack, names, get, device, input_batches[0])
            _stepped(stack.layers, on_call)
            for ids in input_batches:
                try:
                    stack.body(input_ids=ids.to(device), use_cache=False)
                except _Stop:
                    pass
        finally:
            _restored(stack.layers)
        read = list(outer.read)
    if len(taken) != len(input_batches) or any(len(t) != len(stack.layers) for t in taken):
        raise QuantcliError(f"{type(stack.model).__name__}: its forward did not call each of its "
                            f"{len(stack.layers)} layers once per batch, so quantcli cannot run it layer by layer")
    return taken, read


def _learn_arity(stack: Stack, names: CheckpointMap, get: Get, device: torch.device, ids: torch.Tensor) -> None:
    """Run layer 0 for real once (loaded, then back to meta) to see what a layer returns: the
    model's loop may index it (`outputs[0]`, Falcon, MPT), so a stepped-over layer must return
    the same kind of thing for every later layer's arguments to be the model's."""
    layer = stack.layers[0]

    def probe(i, hidden, args, kwargs):
        load_module(layer, stack.layer_prefix(0), names, get, device)
        try:
            out = type(layer).forward(layer, hidden, *args, **kwargs)
        finally:
            to_meta(layer)
        stack.output_arity = len(out) if isinstance(out, tuple) else None
        stack.arity_known = True
        raise _Stop

    _stepped(stack.layers, probe)
    try:
        stack.body(input_ids=ids.to(device), use_cache=False)
    except _Stop:
        pass


class Tail:
    """The model's code after its layers, run on hidden states the walk computed (see the module
    docstring): `tail(ids, hidden)` returns the logits (a causal LM) or the last hidden state (an
    encoder) of batch `ids` whose last layer output `hidden` is. The modules it runs are loaded
    from `get` on first use and stay until `close`. `model`: a copy of the stack's model, for two
    tails (two checkpoints) loaded side by side."""

    def __init__(self, stack: Stack, names: CheckpointMap, get: Get, device: torch.device, model=None):
        self.stack, self.device = stack, device
        self.model = model if model is not None else stack.model
        self.layers = self.model.get_submodule(stack.layer_path)
        self.body = self.model if stack.kind == CAUSAL else self.model.base_model
        self.outer = OuterWeights(self.model, self.layers, names, get, device)
        self._final: torch.Tensor | None = None
        self._warm = False
        _stepped(self.layers, lambda i, hidden, args, kwargs: stack.dressed(self._final if i == 0 else hidden))

    def __call__(self, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        self._final = hidden
        if not self._warm:  # see _warm_up
            self._warm = True
            _warm_up(self.body, ids.to(self.device))
        try:
            out = self.body(input_ids=ids.to(self.device), use_cache=False)
        finally:
            self._final = None
        return out.logits if self.stack.kind == CAUSAL else out.last_hidden_state

    @property
    def read(self) -> list[str]:
        """The checkpoint tensors loaded so far."""
        return list(self.outer.read)

    def close(self) -> None:
        _restored(self.layers)
        self.outer.release()

    def __enter__(self) -> Tail:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
