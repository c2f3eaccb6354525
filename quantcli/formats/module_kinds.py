"""What kind of module a checkpoint name is, by name alone: the modules never quantized by
default (output head, embeddings, norms, MoE routers, vision towers, MTP heads), and which 2-D
weights are Linear layers that must be quantized or named in an exclusion list."""

from __future__ import annotations

import re

DEFAULT_EXCLUDES: list[tuple[str, re.Pattern]] = [
    ("output head", re.compile(r"(^|\.)lm_head$|^output$|(^|\.)output_layer$")),
    ("embedding", re.compile(r"embed|(^|\.)wte$|(^|\.)wpe$|word_embeddings|position_embeddings")),
    ("norm", re.compile(r"norm", re.IGNORECASE)),
    ("MoE router/gate", re.compile(r"(^|\.)gate$|router|shared_expert_gate$")),
    ("vision tower", re.compile(r"vision_tower|(^|\.)visual(\.|$)|vision_model|multi_modal_projector|embed_vision")),
    ("MTP head", re.compile(r"(^|\.)mtp(\.|$)")),
]

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
