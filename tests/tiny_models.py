"""Tiny random BF16 checkpoints of the architectures whose module names or loaders differ from a
Llama's (tests/test_loader_names.py, scripts/check_loader_names.py), saved by transformers itself,
and the helpers that load a quantized output in transformers next to quantcli's own decode.

Shapes are the smallest each recipe takes: K a multiple of 32 (MX, NVFP4) and, where int4 must
quantize the text model, of 128; vision towers narrower than 128 so that int4 leaves them dense,
which transformers would otherwise try to quantize (the reported `group_size 128 but got 64`)."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 256
TEXT = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)


def _configs() -> dict:
    from transformers import (
        CLIPVisionConfig,
        DeepseekV3Config,
        FalconConfig,
        Gemma3Config,
        Glm4MoeConfig,
        GPTNeoXConfig,
        LlavaConfig,
        MixtralConfig,
        ModernBertConfig,
        Qwen2_5_VLConfig,
        Qwen2VLConfig,
        Qwen3MoeConfig,
        SiglipVisionConfig,
    )

    siglip = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    return {
        "qwen3_moe": lambda: Qwen3MoeConfig(**TEXT, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                                            decoder_sparse_step=1),
        # mrope's three sections cover head_dim / 2 rotary frequencies
        "qwen2_vl": lambda: Qwen2VLConfig(
            text_config={**TEXT, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                                     "mrope_section": [4, 6, 6]}},
            vision_config=dict(depth=1, embed_dim=32, hidden_size=128, num_heads=2, mlp_ratio=2, patch_size=14,
                               spatial_merge_size=2, temporal_patch_size=2, in_chans=3)),
        "gemma3": lambda: Gemma3Config(text_config={**TEXT, "sliding_window": 16}, vision_config=siglip.to_dict(),
                                       mm_tokens_per_image=1),
        "gpt_neox": lambda: GPTNeoXConfig(**{k: TEXT[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                                  "num_hidden_layers", "num_attention_heads")},
                                          tie_word_embeddings=False),
        "modernbert": lambda: ModernBertConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=2, num_attention_heads=4, local_attention=16,
                                               global_attn_every_n_layers=2, pad_token_id=0, cls_token_id=1,
                                               sep_token_id=2, bos_token_id=1, eos_token_id=2),
        "falcon": lambda: FalconConfig(vocab_size=VOCAB, hidden_size=64, ffn_hidden_size=128, num_hidden_layers=1,
                                       num_attention_heads=4),
        # the rest only for scripts/check_loader_names.py's matrix
        "mixtral": lambda: MixtralConfig(**TEXT, num_local_experts=4, num_experts_per_tok=2),
        "deepseek_v3": lambda: DeepseekV3Config(
            **{**TEXT, "num_hidden_layers": 2, "num_key_value_heads": 4, "head_dim": 16}, moe_intermediate_size=64,
            first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
            topk_group=1, q_lora_rank=64, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32),
        "glm4_moe": lambda: Glm4MoeConfig(**TEXT, moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2,
                                          n_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1),
        "qwen2_5_vl": lambda: Qwen2_5_VLConfig(
            text_config={**TEXT, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                                     "mrope_section": [4, 6, 6]}},
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=128,
                               patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_chans=3,
                               fullatt_block_indexes=[0], window_size=56)),
        "llava": lambda: LlavaConfig(text_config={**TEXT, "model_type": "llama"}, image_seq_length=4,
                                     vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64,
                                                                    num_hidden_layers=1, num_attention_heads=2,
                                                                    image_size=28, patch_size=14).to_dict()),
    }


CLASSES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_vl": "Qwen2VLForConditionalGeneration",
           "gemma3": "Gemma3ForConditionalGeneration", "gpt_neox": "GPTNeoXForCausalLM",
           "modernbert": "ModernBertModel", "falcon": "FalconForCausalLM"}
MORE = {"mixtral": "MixtralForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
        "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "llava": "LlavaForConditionalGeneration"}
VISION = ("qwen2_vl", "qwen2_5_vl", "gemma3", "llava")


def build(kind: str, out: Path, **config) -> Path:
    """A random BF16 `kind` model (CLASSES) saved by save_pretrained to `out`; `config` overrides."""
    import transformers

    cfg = _configs()[kind]()
    for key, value in config.items():
        setattr(cfg, key, value)
    torch.manual_seed(0)
    getattr(transformers, {**CLASSES, **MORE}[kind])(cfg).to(torch.bfloat16).save_pretrained(out)
    return out


def load(path: Path, **kwargs):
    """The checkpoint in transformers, in BF16 (compressed-tensors decompresses into it)."""
    import json

    import transformers

    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    return getattr(transformers, arch).from_pretrained(path, dtype=torch.bfloat16, **kwargs).eval()


def output(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits (or an encoder's last hidden state) for `ids`, flat, in FP32."""
    with torch.no_grad():
        out = model(input_ids=ids)
    got = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
    return got.float().flatten()


def vision(model, kind: str) -> torch.Tensor:
    """The vision tower's output for fixed random pixels, flat, in FP32."""
    cfg = model.config.vision_config
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        if kind.startswith("qwen2"):  # 4 x 4 patches, one frame: grid_thw [1, 4, 4]
            pixels = torch.randn(16, 3 * cfg.temporal_patch_size * cfg.patch_size ** 2, generator=gen)
            got = model.model.visual(pixels.to(torch.bfloat16), grid_thw=torch.tensor([[1, 4, 4]]))
        else:
            pixels = torch.randn(1, 3, cfg.image_size, cfg.image_size, generator=gen)
            got = model.model.vision_tower(pixel_values=pixels.to(torch.bfloat16)).last_hidden_state
    got = getattr(got, "pooler_output", got)
    return got.float().flatten()


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


IDS = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
