"""The model eval walks, one block at a time: a causal LM (`model.layers[i]`, rotary, final norm
and `lm_head`) or a BERT-like encoder (`embeddings`, `encoder.layer[i]`, no rotary, the last
block's output pooled). Built by transformers on the meta device (no memory), as the calibration
walk builds it (quantcli/model/layers.py); each side's layer-0 inputs are captured with only its
embedding materialized."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantcli.errors import QuantcliError
from quantcli.model.layers import EMBEDDING, first_layer_inputs, meta_model
from quantcli.model.samples import EXTRA

CAUSAL, ENCODER = "causal-lm", "encoder"


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


def _encoder_prefix(names) -> str | None:
    hit = next((n for n in sorted(names) if n.endswith("embeddings.word_embeddings.weight")), None)
    return None if hit is None else hit[: -len("embeddings.word_embeddings.weight")]


def build_stack(config: dict, names, label: str) -> Stack:
    """The causal LM or encoder of `config`; a one-line refusal for any other architecture."""
    try:
        import transformers
    except ImportError:
        raise QuantcliError(f"quantcli eval needs transformers: {EXTRA}") from None
    archs = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    prefix = _encoder_prefix(names)
    if prefix is not None and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        cfg = dict(config)
        tf_config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        with torch.device("meta"):
            try:  # BERT-likes build a pooler eval does not use (sentence-transformers does not either)
                model = transformers.AutoModel.from_config(tf_config, add_pooling_layer=False)
            except TypeError:
                model = transformers.AutoModel.from_config(tf_config)
        if not hasattr(getattr(model, "encoder", None), "layer"):
            raise QuantcliError(f"{label}: {archs or config.get('model_type')} has embeddings but no encoder.layer "
                                f"blocks; eval runs causal LMs and BERT-like encoders")
        return Stack(ENCODER, model.float().eval(), model.encoder.layer, prefix, "encoder.layer")
    if EMBEDDING not in names:
        raise QuantcliError(f"{label}: {archs or config.get('model_type')} is neither a causal LM with "
                            f"{EMBEDDING} nor a BERT-like encoder; eval runs those two kinds")
    model = meta_model(config)
    return Stack(CAUSAL, model, model.model.layers, "", "model.layers")


def _materialize(stack: Stack, get, device: torch.device) -> tuple[torch.nn.Module, list[str]]:
    """The module to call with input_ids, its embedding loaded from `get` on `device`; the
    checkpoint names read."""
    model = stack.model
    if stack.kind == ENCODER:
        with torch.device(device):  # its position_ids / token_type_ids buffers are built, not read
            emb = type(model.embeddings)(model.config)
        names = {n: f"{stack.prefix}embeddings.{n}" for n in emb.state_dict()}
        emb.load_state_dict({n: get(src) for n, src in names.items()}, assign=True)
        model.embeddings = emb.float().eval()  # built fresh: in training mode (dropout) until told
        return model, list(names.values())
    body = model.model
    body.embed_tokens.load_state_dict({"weight": get(EMBEDDING)}, assign=True)
    if hasattr(body, "rotary_emb"):
        with torch.device(device):  # its inv_freq buffer is computed, not read: build it for real
            body.rotary_emb = type(body.rotary_emb)(config=model.config)
    return body, [EMBEDDING]


def capture(stack: Stack, get, device: torch.device, input_batches: list[torch.Tensor], buffer) -> tuple[list, list]:
    """Block 0's hidden states per batch (into `buffer`) and its other arguments, as
    ([(args, kwargs)], names read): position embeddings and masks are the same for both sides,
    the hidden states are each side's own embedding."""
    body, names = _materialize(stack, get, device)
    captured: list[tuple] = []

    def record(hidden, args, kwargs):
        buffer.write(len(captured), hidden.to(torch.float32))
        captured.append((args, kwargs))

    first_layer_inputs(body, stack.layers[0], device, input_batches, record)
    (stack.model.embeddings if stack.kind == ENCODER else body.embed_tokens).to("meta")
    return captured, names


