"""Small random checkpoints made with transformers, for the demo, tests and benchmarks.

transformers is imported here only (it is a test/demo dependency, not a runtime one)."""

from __future__ import annotations

import json
from pathlib import Path


def _save(model, out: Path, shards: int) -> None:
    """save_pretrained (which also turns runtime-fused expert weights back into the checkpoint
    names), re-sharded into exactly `shards` safetensors files balanced by bytes, with the index."""
    import tempfile

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
    import math

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
    from string import ascii_lowercase

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
