"""Fused projections: the groups engines run as one GEMM (q/k/v, gate/up, w1/w3, ...), which must
share one precision and, for NVFP4, one global scale (docs/formats.md, "Fused groups share one global scale")."""

from __future__ import annotations

# Projections that engines fuse into one GEMM and that must share one global scale (A.3).
FUSED_SETS = [("q_proj", "k_proj", "v_proj"), ("query", "key", "value"), ("gate_proj", "up_proj"),
              ("w1", "w3"), ("q_a_proj", "kv_a_proj_with_mqa")]


# One Linear an attention computes q, k and v with (Phi-3, Falcon, GPT-NeoX, Baichuan, GPT-2): its
# KV-cache scales sit on the attention module itself (`<attn>.k_scale`), which vLLM's
# `maybe_remap_kv_scale_name` maps to the attention's `attn.k_scale` as it maps compressed-tensors' own.
FUSED_QKV = ("qkv_proj", "query_key_value", "Wqkv", "W_pack", "c_attn")


def fused_group_of(module: str) -> str | None:
    parent, _, leaf = module.rpartition(".")
    for members in FUSED_SETS:
        if leaf in members:
            return f"{parent}.{{{','.join(members)}}}"
    return None
