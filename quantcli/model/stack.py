"""The model a layer walk runs, one block at a time: a causal LM (`model.layers[i]`, rotary, final
norm and `lm_head`) or a BERT-like encoder (`embeddings`, `encoder.layer[i]`, no rotary, no head:
the last block's output is pooled). Built by transformers on the meta device (no memory); block
0's inputs are captured with only the embedding materialized. Calibration's walk (layers.py),
the weight passes that run on it and eval's two-sided walk all build and capture through here."""

from __future__ import annotations

import re
import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from quantcli.errors import QuantcliError
from quantcli.model.samples import EXTRA

EMBEDDING, FINAL_NORM, HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head"
CAUSAL, ENCODER = "causal-lm", "encoder"
WORD_EMBEDDINGS = "embeddings.word_embeddings.weight"
# A checkpoint tensor inside a layer the walk runs, group 1 its index: a causal LM's decoder layer
# or a BERT-like encoder's block (its names possibly under a prefix such as "bert.").
LAYER_TENSOR = re.compile(r"^(?:model\.layers|(?:\w+\.)?encoder\.layer)\.(\d+)\.")


@dataclass
class Stack:
    kind: str  # causal-lm | encoder
    model: torch.nn.Module  # on the meta device
    layers: torch.nn.ModuleList
    prefix: str  # the checkpoint's prefix of the model's parameter names ("" or "bert.")
    layer_path: str  # model path of the blocks: model.layers | encoder.layer

    def layer_prefix(self, i: int) -> str:
        """The checkpoint name prefix of block i's parameters."""
        return f"{self.prefix}{self.layer_path}.{i}."

    @property
    def config(self):
        return self.model.config


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Ctrl-C held until the block ends, then raised: transformers imports a model's code (and
    through it Triton's native modules) lazily, on first use, and an interrupt landing inside
    those imports comes out as an import error, or aborts the process from native code, instead
    of a KeyboardInterrupt. Only the main thread can set handlers; an ignored SIGINT stays ignored."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous in (signal.SIG_IGN, None):
        yield
        return
    held: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        raise KeyboardInterrupt


def _transformers():
    try:
        with interrupts_deferred():
            import transformers
    except ImportError:
        raise QuantcliError(f"--calibration needs transformers: {EXTRA}") from None
    return transformers


def _config(config_dict: dict):
    cfg = dict(config_dict)
    with interrupts_deferred():
        return _transformers().AutoConfig.for_model(cfg.pop("model_type"), **cfg)


def meta_model(config_dict: dict):
    """The source's causal LM class, built on the meta device in FP32 (no weights)."""
    config = _config(config_dict)
    with torch.device("meta"), interrupts_deferred():
        model = _transformers().AutoModelForCausalLM.from_config(config)
    return model.float().eval()


def encoder_prefix(names) -> str | None:
    """The prefix of a BERT-like encoder's parameter names ("" or "bert."), or None: no
    `embeddings.word_embeddings` (not such an encoder)."""
    hit = next((n for n in sorted(names) if n.endswith(WORD_EMBEDDINGS)), None)
    return None if hit is None else hit[: -len(WORD_EMBEDDINGS)]


def is_encoder(config: dict, names) -> bool:
    """Whether `build_stack` builds `config` as an encoder: its names have embeddings and no
    architecture it lists is a causal LM."""
    archs = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    return encoder_prefix(names) is not None and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs)


def encoder_positions(config: dict) -> int | None:
    """How many tokens a BERT-like encoder's absolute position embeddings reach (RoBERTa's count
    from its padding id + 1), or None when its config does not say."""
    limit = config.get("max_position_embeddings")
    if not isinstance(limit, int):
        return None
    if config.get("model_type") in ("roberta", "xlm-roberta", "camembert"):
        limit -= int(config.get("pad_token_id", 1)) + 1
    return limit


def _meta_encoder(config_dict: dict):
    config = _config(config_dict)
    auto = _transformers().AutoModel
    with torch.device("meta"), interrupts_deferred():
        try:  # BERT-likes build a pooler no walk runs (sentence-transformers does not either)
            model = auto.from_config(config, add_pooling_layer=False)
        except TypeError:
            model = auto.from_config(config)
    return model.float().eval()


def build_stack(config: dict, names, label: str) -> Stack:
    """The causal LM or encoder of `config` (checkpoint tensor names `names`); a one-line refusal
    for any other architecture."""
    archs = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    if is_encoder(config, names):
        model = _meta_encoder(config)
        if not hasattr(getattr(model, "encoder", None), "layer"):
            raise QuantcliError(f"{label}: {archs or config.get('model_type')} has embeddings but no encoder.layer "
                                f"blocks; quantcli runs causal LMs and BERT-like encoders layer by layer")
        return Stack(ENCODER, model, model.encoder.layer, encoder_prefix(names), "encoder.layer")
    if EMBEDDING not in names:
        raise QuantcliError(f"{label}: {archs or config.get('model_type')} is neither a causal LM with "
                            f"{EMBEDDING} nor a BERT-like encoder; quantcli runs those two kinds layer by layer")
    model = meta_model(config)
    return Stack(CAUSAL, model, model.model.layers, "", "model.layers")


class _Stop(Exception):
    pass


class MasksByLayer(dict):
    """{layer index: the attention mask the model's own forward gives that layer}, captured in
    place of layer 0's mask when the layers differ in kind (`config.layer_types`: gpt-oss's,
    Gemma's and Mistral-style sliding-window layers between full-attention ones); layers.run_batches
    hands each layer its own."""


def layer_kinds(config) -> list | None:
    """`config.layer_types` when its layers are not all of one kind, else None."""
    kinds = getattr(config, "layer_types", None)
    return list(kinds) if kinds and len(set(kinds)) > 1 else None


def first_layer_inputs(body, layers, device: torch.device, input_batches: list[torch.Tensor], record,
                       per_layer_masks: bool = False) -> None:
    """Run `body` on each batch only until the first of `layers` would start, and hand its inputs
    to `record(hidden_states, other_args, kwargs)`: the embedding (and whatever else sits before
    the first layer) is all that must be loaded. With `per_layer_masks`, every layer is stepped
    over (its forward returns its input, its weights untouched on the meta device) to take the
    mask the model gives it: kwargs' `attention_mask` is then a MasksByLayer."""
    taken: list = []

    def catch(module, args, kwargs):
        kwargs = dict(kwargs)
        hidden = args[0] if args else kwargs.pop("hidden_states")
        if not per_layer_masks:
            record(hidden, tuple(args[1:]), kwargs)
            raise _Stop
        taken.append((hidden, tuple(args[1:]), kwargs, MasksByLayer()))

    def step_over(i: int):
        def forward(*args, **kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            taken[-1][3][i] = kwargs.get("attention_mask")
            if i == len(layers) - 1:
                raise _Stop
            return hidden
        return forward

    hook = layers[0].register_forward_pre_hook(catch, with_kwargs=True)
    if per_layer_masks:
        for i, layer in enumerate(layers):
            layer.forward = step_over(i)
    try:
        for ids in input_batches:
            try:
                body(input_ids=ids.to(device), use_cache=False)
            except _Stop:
                pass
            if taken:
                hidden, args, kwargs, masks = taken.pop()
                record(hidden, args, {**kwargs, "attention_mask": masks})
    finally:
        hook.remove()
        for layer in layers:
            layer.__dict__.pop("forward", None)


def _materialize(stack: Stack, get, device: torch.device) -> tuple[torch.nn.Module, list[str]]:
    """The module to call with input_ids, its embedding loaded (FP32) from `get` on `device`;
    the checkpoint names read."""
    model = stack.model
    if stack.kind == ENCODER:
        with torch.device(device):  # its position_ids / token_type_ids buffers are built, not read
            emb = type(model.embeddings)(model.config)
        names = {n: f"{stack.prefix}embeddings.{n}" for n in emb.state_dict()}
        emb.load_state_dict({n: get(src).to(device, torch.float32) for n, src in names.items()}, assign=True)
        model.embeddings = emb.float().eval()  # built fresh: in training mode (dropout) until told
        return model, list(names.values())
    body = model.model
    body.embed_tokens.load_state_dict({"weight": get(EMBEDDING).to(device, torch.float32)}, assign=True)
    if hasattr(body, "rotary_emb"):
        with torch.device(device):  # its inv_freq buffer is computed, not read: build it for real
            body.rotary_emb = type(body.rotary_emb)(config=model.config)
    return body, [EMBEDDING]


def capture(stack: Stack, get, device: torch.device, input_batches: list[torch.Tensor], buffer) -> tuple[list, list]:
    """Block 0's hidden states per batch (into `buffer`) and its other arguments, as
    ([(args, kwargs)], checkpoint names read): position embeddings and masks (a causal LM's
    causal mask, an encoder's attention mask) as the model's own forward passes them to block 0."""
    body, names = _materialize(stack, get, device)
    captured: list[tuple] = []

    def record(hidden, args, kwargs):
        buffer.write(len(captured), hidden.to(torch.float32))
        captured.append((args, kwargs))

    first_layer_inputs(body, stack.layers, device, input_batches, record,
                       per_layer_masks=stack.kind != ENCODER and layer_kinds(stack.config) is not None)
    (stack.model.embeddings if stack.kind == ENCODER else body.embed_tokens).to("meta")
    return captured, names
