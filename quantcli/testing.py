"""Small random checkpoints made with transformers, for the demo, tests and benchmarks.

transformers is imported here only (it is a test/demo dependency, not a runtime one)."""

from __future__ import annotations

import json
from pathlib import Path


def _save(model, out: Path, shards: int) -> None:
    import torch

    out.mkdir(parents=True, exist_ok=True)
    total = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    shard_bytes = max(1, total // max(1, shards)) + 1
    model.save_pretrained(out, max_shard_size=shard_bytes)
    del torch


def make_llama(out: Path, hidden: int = 256, layers: int = 2, shards: int = 2, seed: int = 0,
               tie: bool = False, dtype: str = "bfloat16") -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                         num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 128),
                         max_position_embeddings=256, tie_word_embeddings=tie)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    _save(model, Path(out), shards)
    (Path(out) / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
    return Path(out)


def make_moe(out: Path, hidden: int = 128, layers: int = 2, shards: int = 2, seed: int = 0, experts: int = 4) -> Path:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(vocab_size=512, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                           num_attention_heads=max(1, hidden // 32), num_key_value_heads=max(1, hidden // 64),
                           num_local_experts=experts, num_experts_per_tok=2, max_position_embeddings=256)
    model = MixtralForCausalLM(config).to(torch.bfloat16)
    _save(model, Path(out), shards)
    return Path(out)
