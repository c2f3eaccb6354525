"""Encoders (a tiny BertModel with a sentence-transformers card, as all-MiniLM-L6-v2): the card
keeps `library_name: sentence-transformers`, no `lm_head` is named, `pooler.dense` stays dense
(with its reason), `inspect --kv-cache` says there is no KV cache, and verify's per-layer chart
counts `encoder.layer.N` as layer N."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> Path:
    import torch

    src = tmp_path_factory.mktemp("enc") / "minilm"
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=128, max_position_embeddings=64)
    transformers.BertModel(config).to(torch.bfloat16).save_pretrained(src)
    (src / "README.md").write_text("---\nlibrary_name: sentence-transformers\ntags:\n- sentence-transformers\n"
                                   "pipeline_tag: sentence-similarity\n---\n\n# minilm\n")
    (src / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    return src


@pytest.fixture(scope="module")
def converted(bert, tmp_path_factory):
    from quantcli.cli.app import main

    out = tmp_path_factory.mktemp("encq") / "minilm-fp8"
    with pytest.MonkeyPatch.context() as mp, pytest.raises(SystemExit) as exc:
        mp.setattr("sys.argv", ["quantcli", "convert", str(bert), str(out), "--recipe", "fp8-channel", "--quiet"])
        main()
    assert not exc.value.code
    return out


def test_card_keeps_sentence_transformers_and_names_no_lm_head(converted):
    from huggingface_hub import ModelCard

    card = ModelCard((converted / "README.md").read_text())
    assert card.data.library_name == "sentence-transformers"
    assert "sentence-transformers" in card.data.tags and "quantcli" in card.data.tags
    qc = json.loads((converted / "config.json").read_text())["quantization_config"]
    assert "lm_head" not in qc["ignore"] and "lm_head" not in card.text
    assert (converted / "modules.json").exists()


def test_pooler_stays_dense_with_its_reason(bert, converted, run_cli, tmp_path):
    qc = json.loads((converted / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == ["pooler.dense"]
    doc = json.loads(run_cli("convert", bert, tmp_path / "x", "--recipe", "fp8-channel", "--dry-run", "--json")[1])
    assert {"module": "pooler.dense", "reason": "pooler head"} in doc["excluded"]
    quantized = {t["name"] for t in doc["tensors"] if t["recipe"]}
    assert "encoder.layer.0.attention.self.query.weight" in quantized and "pooler.dense.weight" not in quantized


def test_inspect_kv_cache_says_an_encoder_has_none(converted, run_cli):
    code, out, _ = run_cli("inspect", converted, "--kv-cache")
    assert code == 0 and "BertModel is an encoder-only model; it keeps no KV cache" in out
    assert "tokens in budget" not in out
    doc = json.loads(run_cli("inspect", converted, "--kv-cache", "--json")[1])
    assert "kv_cache" not in doc and any("encoder-only" in w for w in doc["warnings"])


def test_verify_chart_counts_encoder_layers(bert, converted, run_cli):
    doc = json.loads(run_cli("verify", converted, "--reference", bert, "--json")[1])
    assert doc["passed"] and set(doc["layers"]) == {"0", "1"}
    out = run_cli("verify", converted, "--reference", bert)[1]
    assert "other" not in out.split("relative error by layer")[1]


def test_a_causal_lm_still_names_its_tied_lm_head(tmp_path, run_cli):
    """A tied head has no tensor, but vLLM/SGLang build an lm_head Linear: still named."""
    from quantcli.testing import make_llama

    src = make_llama(tmp_path / "tied", hidden=64, layers=1, shards=1, tie=True)
    doc = json.loads(run_cli("convert", src, tmp_path / "o", "--recipe", "fp8", "--dry-run", "--json")[1])
    assert "lm_head" in doc["exclusion_list"]
