"""Small random checkpoints made with transformers, for the demo, tests and benchmarks.

transformers is imported here only (it is a test/demo dependency, not a runtime one)."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from string import ascii_lowercase

# torch, transformers, safetensors and tokenizers are imported inside the makers: importing this
# module for its size tables (scripts/architectures_table.py) stays light.


def _save(model, out: Path, shards: int) -> None:
    """save_pretrained (which also turns runtime-fused expert weights back into the checkpoint
    names), re-sharded into exactly `shards` safetensors files balanced by bytes, with the index."""
    from safetensors.torch import load_file

    from quantcli.checkpoint.safetensors_io import write_file

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        model.save_pretrained(tmp, max_shard_size="1000GB")
        state = load_file(Path(tmp) / "model.safetensors")
        for p in Path(tmp).iterdir():
            if p.suffix != ".safetensors":
                p.replace(out / p.name)
    names = sorted(state)
    shards = max(1, min(shards, len(names)))
    if shards == 1:
        write_file(out / "model.safetensors", state)
        return
    groups = _balanced_groups(names, [state[n].numel() * state[n].element_size() for n in names], shards)
    weight_map = {}
    for i, group in enumerate(groups):
        shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        write_file(out / shard, {n: state[n] for n in group})
        weight_map.update({n: shard for n in group})
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _balanced_groups(names: list[str], sizes: list[int], n: int) -> list[list[str]]:
    """Split `names` (kept in order) into exactly n non-empty runs of similar byte size."""
    total, groups, current, done = sum(sizes), [], [], 0
    for i, (name, size) in enumerate(zip(names, sizes)):
        current.append(name)
        done += size
        left_names, left_groups = len(names) - i - 1, n - len(groups) - 1
        if left_groups and (done >= total * (len(groups) + 1) / n or left_names == left_groups):
            groups.append(current)
            current = []
    groups.append(current)
    return groups


def _kv_heads(hidden: int, head_dim: int) -> int:
    """Half the attention heads, or a divisor of them (transformers needs heads % kv_heads == 0:
    hidden 320 has 5 heads of 64, and 2 KV heads would not run)."""
    return math.gcd(max(1, hidden // head_dim), max(1, hidden // (2 * head_dim)))


def make_llama(out: Path, hidden: int = 256, layers: int = 2, shards: int = 2, seed: int = 0,
               tie: bool = False, dtype: str = "bfloat16") -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                         num_attention_heads=max(1, hidden // 64), num_key_value_heads=_kv_heads(hidden, 64),
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
                           num_attention_heads=max(1, hidden // 32), num_key_value_heads=_kv_heads(hidden, 32),
                           num_local_experts=experts, num_experts_per_tok=2, max_position_embeddings=256)
    model = MixtralForCausalLM(config).to(torch.bfloat16)
    _save(model, Path(out), shards)
    return Path(out)


def make_gpt_oss(out: Path, hidden: int = 128, layers: int = 2, shards: int = 2, seed: int = 0,
                 experts: int = 4, sliding_window: int = 128) -> Path:
    """A random GptOss (transformers' GptOssForCausalLM): 3-D expert stacks `mlp.experts.gate_up_proj`
    [E, hidden, 2 * intermediate] and `down_proj` [E, intermediate, hidden], stored [E, in, out],
    for `--layout gpt-oss` (recipes/examples/mxfp4-gpt-oss-experts.toml). MXFP4 blocks are 32 wide
    along each stack's input, so hidden is rounded up to a multiple of 32. Its layers alternate
    sliding-window (`sliding_window` tokens) and full attention, as gpt-oss's do."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(seed)
    hidden = -(-hidden // 32) * 32
    heads = max(1, hidden // 64)
    config = GptOssConfig(vocab_size=512, hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=layers,
                          num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=64,
                          num_local_experts=experts, num_experts_per_tok=min(2, experts),
                          sliding_window=sliding_window)
    model = GptOssForCausalLM(config).to(torch.bfloat16)
    _save(model, Path(out), shards)
    return Path(out)


# make_bert's WordPiece vocabulary: BERT's special tokens, a few words, each letter as a word start
# and a continuation (so that any lowercase ASCII text tokenizes).
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
BERT_WORDS = ["the", "a", "of", "and", "to", "in", "is", "on", "cat", "sat", "mat", "model", "small", "rain", "north",
              ".", ",", "?", "!"]


def bert_tokenizer(out: Path, max_length: int = 64) -> Path:
    """A BERT WordPiece tokenizer.json (lowercasing, [CLS] ... [SEP] around each sample) built offline
    with the tokenizers library, and the tokenizer_config.json that makes transformers load it."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    vocab = [*BERT_SPECIALS, *BERT_WORDS, *ascii_lowercase, *(f"##{c}" for c in ascii_lowercase)]
    ids = {t: i for i, t in enumerate(vocab)}
    tok = Tokenizer(models.WordPiece(ids, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.BertProcessing(("[SEP]", ids["[SEP]"]), ("[CLS]", ids["[CLS]"]))
    tok.decoder = decoders.WordPiece()
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "BertTokenizer", "do_lower_case": True, "model_max_length": max_length,
        **{f"{k}_token": f"[{k.upper()}]" for k in ("unk", "sep", "pad", "cls", "mask")}}))
    return out


def make_bert(out: Path, hidden: int = 64, layers: int = 2, heads: int = 4, intermediate: int = 128, seed: int = 0,
              prefix: str = "", dtype: str = "bfloat16") -> Path:
    """A random BertModel (pooler included, as all-MiniLM-L6-v2 ships it) with bert_tokenizer's
    vocabulary; `prefix` ("bert.") is put before every tensor name, as some BERT checkpoints name them."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import BertConfig, BertModel

    out = bert_tokenizer(Path(out))
    torch.manual_seed(seed)
    vocab = len(BERT_SPECIALS) + len(BERT_WORDS) + 52
    config = BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                        intermediate_size=intermediate, max_position_embeddings=512, pad_token_id=0)
    BertModel(config).to(getattr(torch, dtype)).save_pretrained(out)
    if prefix:
        path = out / "model.safetensors"
        save_file({prefix + n: t for n, t in load_file(path).items()}, str(path), metadata={"format": "pt"})
    return out


# make_tiny's sizes: set wherever transformers' default config has the attribute (a VLM's
# text_config gets SIZES, its vision_config VISION), so that any architecture comes out a
# few hundred thousand parameters with every kind of block it has (2 layers, 4 experts, MLA ranks,
# a sliding window shorter than a sample).
SIZES = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, vocab_size=512, max_position_embeddings=256, moe_intermediate_size=128, n_routed_experts=4,
             num_experts=4, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
             q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_group=1,
             topk_group=1, shared_expert_intermediate_size=64, decoder_sparse_step=1, sliding_window=8,
             global_attn_every_n_layers=2, local_attention=8, ffn_hidden_size=128, linear_key_head_dim=16,
             linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, vocab_size_per_layer_input=512,
             hidden_size_per_layer_input=16, global_head_dim=16, num_global_key_value_heads=2,
             intermediate_size_mlp=128, rotary_dim=16)
MAX_TINY = 20_000_000  # parameters: make_tiny refuses more (a config whose sizes it did not find)
GEMMA4_SIZES = dict(global_head_dim=16, num_global_key_value_heads=2)  # read by Gemma 4's config init only
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, depth=1, num_attention_heads=2, num_heads=2,
              embed_dim=32, image_size=28, patch_size=14, out_hidden_size=64, mlp_ratio=2, spatial_merge_size=2,
              temporal_patch_size=2)


def _sizes_for(config, sizes: dict) -> dict:
    """The entries of `sizes` that `config` has; a model that is multi-head by design (MLA: as many
    KV heads as heads) stays so."""
    keys = {**config.to_dict(), **{k: None for k in getattr(config, "attribute_map", {})}}  # GPT-J's n_embd...
    out = {k: v for k, v in sizes.items() if k in keys}
    heads, kv = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if kv is not None and kv == heads:
        out["num_key_value_heads"] = out.get("num_attention_heads", heads)
    return out


def _layer_kinds(config, sizes: dict) -> dict:
    """num_hidden_layers and layer_types for a config whose layers differ in kind: one layer of
    each kind, in the order the full model first has them (at least sizes' layer count)."""
    types = getattr(config, "layer_types", None)
    if not types:
        return {}
    kinds = list(dict.fromkeys(types))
    n = max(sizes.get("num_hidden_layers", 2), len(kinds))
    return {"num_hidden_layers": n, "layer_types": [kinds[i % len(kinds)] for i in range(n)]}


def _shrunk(config, sizes: dict):
    for key, value in _sizes_for(config, sizes).items():
        try:
            if key not in ("num_hidden_layers", "layer_types"):
                setattr(config, key, value)
        except Exception:  # a derived property, or a per-layer one (Gemma 4's head_dim)
            pass
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):  # inside the small vocabulary
        value = config.__dict__.get(key)
        if isinstance(value, int) and value >= sizes.get("vocab_size", 512):
            setattr(config, key, 0)
    if getattr(config, "qk_rope_head_dim", None) and getattr(config, "qk_nope_head_dim", None):
        config.head_dim = config.qk_rope_head_dim  # MLA: the rotary part is what head_dim sizes
        config.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    if "hidden_size" in config.to_dict():
        _shrunk_rope_sections(config)
    return config


def _shrunk_rope_sections(config) -> None:
    """Multimodal rotary sections (Qwen2-VL's mrope_section) rescaled to the smaller head."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    head = config.to_dict().get("head_dim") or config.hidden_size // config.num_attention_heads
    if isinstance(rope, dict) and "VL" in type(config).__name__ and "mrope_section" not in rope:
        rope["mrope_section"] = [16, 24, 24]  # the default Qwen2-VL's code takes when the config names none
    if isinstance(rope, dict) and isinstance(rope.get("mrope_section"), list):
        sections, half = rope["mrope_section"], head // 2
        scaled = [max(1, s * half // sum(sections)) for s in sections]
        scaled[0] += half - sum(scaled)
        rope["mrope_section"] = scaled


def tiny_config(model_type: str):
    """transformers' default config of `model_type`, shrunk (SIZES, VISION): built from the sizes
    as keyword arguments where the config takes them, so that what its __init__ derives follows,
    then set on what it keeps as plain attributes."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    subs = [(sub, sizes) for sub, sizes in (("text_config", SIZES), ("vision_config", VISION))
            if getattr(default, sub, None) is not None]
    kwargs = {**_sizes_for(default, SIZES), **_layer_kinds(default, SIZES), **GEMMA4_SIZES,
              **{sub: {**_sizes_for(getattr(default, sub), sizes), **_layer_kinds(getattr(default, sub), sizes)}
                 for sub, sizes in subs}}
    try:
        config = AutoConfig.for_model(model_type, **kwargs)
    except (ValueError, TypeError, AttributeError):
        config = default
    for sub, sizes in subs:
        _shrunk(getattr(config, sub), sizes)
    return _shrunk(config, SIZES)


def make_tiny(out: Path, model_type: str, architecture: str, seed: int = 0, shards: int = 1) -> Path:
    """A random BF16 checkpoint of transformers' `architecture` (a class name) for `model_type`,
    shrunk by tiny_config and saved as transformers saves it (the checkpoint names its producer's
    format, which transformers converts on load)."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()  # its config warnings and save progress bars are about the
    transformers.logging.disable_progress_bar()  # full-size model, not this one: kept out of the tests' output
    config = tiny_config(model_type)
    with torch.device("meta"):  # a size the shrinking missed is refused before it takes the memory
        size = sum(p.numel() for p in getattr(transformers, architecture)(config).parameters())
    if size > MAX_TINY:
        raise ValueError(f"{model_type}: the tiny config still has {size:,} parameters (some size key of its config "
                         f"is not in quantcli.testing.SIZES)")
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).eval()
    with torch.no_grad():  # a config the shrinking made inconsistent fails here, not in the test that uses it
        model(input_ids=torch.arange(1, 13)[None], use_cache=False)
    _save(model.to(torch.bfloat16), Path(out), shards)
    return Path(out)


# The architectures tests/test_architectures.py runs every command on (tiny, from transformers'
# own config classes), and docs/architectures.md lists (scripts/architectures_table.py): model_type,
# transformers class, what is special about it (shown in the table).
MATRIX = (
    ("llama", "LlamaForCausalLM", ""),
    ("mistral", "MistralForCausalLM", "sliding window"),
    ("qwen2", "Qwen2ForCausalLM", "q/k/v biases"),
    ("qwen3", "Qwen3ForCausalLM", "q/k norms"),
    ("qwen3_moe", "Qwen3MoeForCausalLM", "MoE"),
    ("qwen3_5_text", "Qwen3_5ForCausalLM", "linear-attention (Gated DeltaNet) and full-attention layers"),
    ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", "hybrid attention, MoE with a shared expert"),
    ("mixtral", "MixtralForCausalLM", "MoE (w1/w3/w2 experts)"),
    ("olmoe", "OlmoeForCausalLM", "MoE"),
    ("minimax_m2", "MiniMaxM2ForCausalLM", "MoE"),
    ("deepseek_v2", "DeepseekV2ForCausalLM", "MLA, shared + routed experts"),
    ("deepseek_v3", "DeepseekV3ForCausalLM", "MLA, shared + routed experts, dense first layer (also Kimi K2)"),
    ("glm4", "Glm4ForCausalLM", "fused gate/up MLP"),
    ("glm4_moe", "Glm4MoeForCausalLM", "MoE with a shared expert"),
    ("gemma2", "Gemma2ForCausalLM", "logit soft-capping, sliding/full layers, embedding scale"),
    ("gemma3_text", "Gemma3ForCausalLM", "sliding/full layers with their own rotary"),
    ("gemma4_text", "Gemma4ForCausalLM", "per-layer inputs, per-layer head sizes"),
    ("phi", "PhiForCausalLM", "parallel attention and MLP"),
    ("phi3", "Phi3ForCausalLM", "fused qkv_proj and gate_up_proj"),
    ("granite", "GraniteForCausalLM", "logit, embedding and residual multipliers"),
    ("cohere", "CohereForCausalLM", "logit scale, parallel attention and MLP"),
    ("olmo2", "Olmo2ForCausalLM", "post-norms"),
    ("starcoder2", "Starcoder2ForCausalLM", "biases, GELU MLP"),
    ("smollm3", "SmolLM3ForCausalLM", "layers without rotary"),
    ("falcon", "FalconForCausalLM", "fused query_key_value, parallel attention"),
    ("gpt_neox", "GPTNeoXForCausalLM", "fused query_key_value, output head embed_out"),
    ("gpt_oss", "GptOssForCausalLM", "3-D expert stacks (--layout gpt-oss), sinks, sliding/full layers"),
    ("llama4_text", "Llama4ForCausalLM", "3-D expert stacks, chunked attention, a router that is a Linear"),
    ("qwen2_vl", "Qwen2VLForConditionalGeneration", "VLM: multimodal rotary; the vision tower stays dense"),
    ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", "VLM"),
    ("qwen3_vl", "Qwen3VLForConditionalGeneration", "VLM"),
    ("llava", "LlavaForConditionalGeneration", "VLM: CLIP tower, Llama decoder"),
    ("gemma3", "Gemma3ForConditionalGeneration", "VLM: SigLIP tower, Gemma 3 decoder"),
    ("bert", "BertModel", "encoder"),
    ("xlm-roberta", "XLMRobertaModel", "encoder"),
    ("modernbert", "ModernBertModel", "encoder: fused Wqkv, final norm, sliding/global layers"),
    ("nomic_bert", "NomicBertModel", "encoder: rotary, SwiGLU"),
)
# ... whose 3-D expert stacks only --layout gpt-oss (mxfp4, gpt-oss itself) quantizes: the matrix
# keeps them dense elsewhere with --ignore '*.experts'
MATRIX_STACKS = frozenset({"gpt_oss", "llama4_text"})
# ... whose KV cache holds MLA's compressed latent: --kv-cache fp8 is refused for them
MATRIX_MLA = frozenset({"deepseek_v2", "deepseek_v3"})
