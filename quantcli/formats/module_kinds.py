"""What kind of module a checkpoint name is, by name alone: the modules never quantized by
default (output head, pooler head, embeddings, norms, MoE routers, vision towers, MTP heads),
which 2-D weights are Linear layers that must be quantized or named in an exclusion list, and
from config.json whether the model is an encoder and has an lm_head."""

from __future__ import annotations

import re

DEFAULT_EXCLUDES: list[tuple[str, re.Pattern]] = [
    ("output head", re.compile(r"(^|\.)lm_head$|^output$|(^|\.)output_layer$")),
    # BERT-style `pooler.dense`: a sequence-level head run once per input on the first token.
    # sentence-transformers pools the token states itself and never reads it, vLLM's BertModel
    # drops `pooler.` weights, and where it is read (sequence classification) it is the head, so
    # quantizing it saves ~1% of an encoder's Linear bytes for accuracy risk only. ModelOpt's
    # default disabled quantizers and llm-compressor's default ignore list ([]) do quantize it.
    ("pooler head", re.compile(r"(^|\.)pooler(\.dense)?$")),
    ("embedding", re.compile(r"embed|(^|\.)wte$|(^|\.)wpe$|word_embeddings|position_embeddings")),
    ("norm", re.compile(r"norm", re.IGNORECASE)),
    ("MoE router/gate", re.compile(r"(^|\.)gate$|router|shared_expert_gate$")),
    ("vision tower", re.compile(r"vision_tower|(^|\.)visual(\.|$)|vision_model|multi_modal_projector|embed_vision")),
    ("MTP head", re.compile(r"(^|\.)mtp(\.|$)")),
]

# model_type of encoder-only (bidirectional) transformers: no KV cache, no generation head.
ENCODER_MODEL_TYPES = frozenset({
    "bert", "roberta", "xlm-roberta", "distilbert", "electra", "deberta", "deberta-v2", "mpnet", "albert",
    "camembert", "modernbert", "nomic_bert", "ernie", "megatron-bert", "mobilebert", "xlm-roberta-xl", "esm"})
GENERATIVE = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")  # architectures with an lm_head


def is_encoder(config: dict) -> bool:
    """An encoder-only model (BertModel, XLMRobertaModel, ...): it caches no keys and values."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    return text.get("model_type") in ENCODER_MODEL_TYPES or config.get("model_type") in ENCODER_MODEL_TYPES


def has_lm_head(config: dict) -> bool:
    """Whether the model has an lm_head Linear (also a tied one, which has no tensor): a generative
    architecture, or, with none named, anything but an encoder."""
    archs = config.get("architectures") or []
    if archs:
        return any(str(a).endswith(GENERATIVE) for a in archs)
    return not is_encoder(config)


def default_exclusion(module: str, config: dict) -> str | None:
    for reason, rx in DEFAULT_EXCLUDES:
        if rx.search(module):
            return reason
    # DeepSeek-style MTP layers sit after the last decoder layer.
    n_layers, n_mtp = config.get("num_hidden_layers"), config.get("num_nextn_predict_layers")
    if n_layers and n_mtp:
        m = re.match(r"model\.layers\.(\d+)\.", module)
        if m and int(m.group(1)) >= n_layers:
            return "MTP head"
    return None


def is_dense_linear(module: str) -> bool:
    """A 2-D `.weight` module that is a Linear layer, not an embedding or a norm: the modules
    that must be quantized or named in the exclusion list."""
    return default_exclusion(module, {}) not in ("embedding", "norm")
