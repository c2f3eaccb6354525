"""quantcli eval --sensitivity is exact: each ranked module's KL and top-1 agreement equal those of
transformers' own full forward (FP32) of the reference with only that module's weight replaced by
its quantize -> dequantize (quantcli's recipe, called here directly) against the reference's
forward, to relative 1e-4; and the ranking is the order of those independent KLs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from quantcli.testing import make_llama

transformers = pytest.importorskip("transformers")

from tests.test_json_schema import validate  # noqa: E402

REL = 1e-4
RECIPE = "mxfp4"  # weight-only in its default layout, no global scale: each module quantizes alone


def _ids(n: int = 4) -> list[list[int]]:
    return [[(7 * i + 13 * j + 3) % 512 for j in range(16 + 4 * (i % 2))] for i in range(n)]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sensitivity")
    (root / "eval.jsonl").write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in _ids()))
    make_llama(root / "llama", hidden=64, layers=2, shards=1)
    return root


def _eval(run_cli, root: Path, *args) -> dict:
    code, out, err = run_cli("eval", root / "llama", "--recipe", RECIPE, "--data", root / "eval.jsonl",
                             "--device", "cpu", "--json", *args)
    assert code == 0, err
    return validate("eval", json.loads(out))


def _alone(root: Path, module: str) -> tuple[float, float]:
    """KL(reference || only `module` quantized) mean and top-1 agreement, by two full forwards."""
    from quantcli.recipes import get_recipe

    ref, quant = (transformers.AutoModelForCausalLM.from_pretrained(root / "llama", dtype=torch.float32).eval()
                  for _ in range(2))
    recipe = get_recipe(RECIPE)
    linear = quant.get_submodule(module)
    with torch.no_grad():
        linear.weight.copy_(recipe.dequantize(recipe.quantize(module, linear.weight.detach().clone())).float())
        kl, agree, n = 0.0, 0, 0
        for s in _ids():
            x = torch.tensor([s])
            a, b = (torch.log_softmax(m(input_ids=x).logits[0, :-1].double(), -1) for m in (ref, quant))
            kl += float((a.exp() * (a - b)).sum())
            agree += int((a.argmax(-1) == b.argmax(-1)).sum())
            n += a.shape[0]
    return kl / n, agree / n


def test_two_modules_kl_equals_a_forward_with_only_that_module_quantized(run_cli, root):
    doc = _eval(run_cli, root, "--sensitivity", "2")
    assert doc["activations"] == [] and len(doc["sensitivity"]) == 2
    own = [m["module"] for m in doc["worst_modules"][:2]]
    assert sorted(r["module"] for r in doc["sensitivity"]) == sorted(own)  # the two largest own errors
    for row in doc["sensitivity"]:
        kl, top1 = _alone(root, row["module"])
        assert kl > 0
        assert row["output_error"] == pytest.approx(kl, rel=REL), row["module"]
        assert row["top1_agreement"] == pytest.approx(top1, rel=REL)
        assert row["layer"] == int(row["module"].split(".")[2])


def test_ranking_is_the_order_of_the_independent_kls(run_cli, root):
    doc = _eval(run_cli, root, "--sensitivity", "all")
    rows = doc["sensitivity"]
    assert len(rows) == 14  # every quantized Linear of the 2 blocks
    kls = {r["module"]: _alone(root, r["module"])[0] for r in rows}
    assert [r["module"] for r in rows] == sorted(kls, key=lambda m: -kls[m])
    for r in rows:
        assert r["output_error"] == pytest.approx(kls[r["module"]], rel=REL)
    # the sensitivity walk leaves the rest of the report as it is without it
    plain = _eval(run_cli, root)
    assert plain["sensitivity"] == []
    for key in ("causal", "layers", "worst_modules"):
        assert plain[key] == doc[key], key


def test_sensitivity_table_and_bad_values(run_cli, root):
    code, out, err = run_cli("eval", root / "llama", "--recipe", RECIPE, "--data", root / "eval.jsonl",
                             "--device", "cpu", "--sensitivity", "3")
    assert code == 0, err
    assert "sensitivity" in out and "KL mean" in out and "top-1 agreement" in out
    code, _, err = run_cli("eval", root / "llama", "--recipe", RECIPE, "--data", root / "eval.jsonl",
                           "--device", "cpu", "--sensitivity", "3", "-v", "--json")
    assert code == 0, err
    lines = [line.split(" (")[0] for line in err.strip().splitlines()]
    assert lines == ["layer 1/2 done", "layer 2/2 done", "sensitivity of 3 modules: layer 1/2 done",
                     "sensitivity of 3 modules: layer 2/2 done"], err
    code, _, err = run_cli("eval", root / "llama", "--recipe", RECIPE, "--data", root / "eval.jsonl",
                           "--sensitivity", "some")
    assert code == 2 and "--sensitivity 'some'" in err


def test_encoder_one_minus_cosine_equals_a_forward_with_only_that_module_quantized(run_cli, root):
    from quantcli.recipes import get_recipe

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=128, max_position_embeddings=64)
    transformers.BertModel(config, add_pooling_layer=False).save_pretrained(root / "bert")
    code, out, err = run_cli("eval", root / "bert", "--recipe", RECIPE, "--data", root / "eval.jsonl",
                             "--device", "cpu", "--json", "--sensitivity", "2")
    assert code == 0, err
    rows = validate("eval", json.loads(out))["sensitivity"]
    assert len(rows) == 2 and rows[0]["output_error"] >= rows[1]["output_error"]
    recipe = get_recipe(RECIPE)
    for row in rows:
        ref, quant = (transformers.BertModel.from_pretrained(root / "bert", dtype=torch.float32,
                                                             add_pooling_layer=False).eval() for _ in range(2))
        linear = quant.get_submodule(row["module"])
        with torch.no_grad():
            linear.weight.copy_(recipe.dequantize(recipe.quantize(row["module"], linear.weight.detach().clone())))
            cos = [float(torch.nn.functional.cosine_similarity(
                *(m(input_ids=torch.tensor([s])).last_hidden_state[0].double().mean(0) for m in (ref, quant)), dim=0))
                for s in _ids()]
        assert row["top1_agreement"] is None and row["output_error"] > 0
        assert row["output_error"] == pytest.approx(1 - sum(cos) / len(cos), rel=REL), row["module"]


def test_declared_input_quantization_goes_with_the_module(run_cli, root):
    """--reference with a dynamic-FP8 checkpoint: the module alone runs its decoded weight and its
    input through compressed-tensors' fake-quantize, everything else the reference."""
    from compressed_tensors.quantization import QuantizationArgs

    from tests.test_eval import _ct_hooks, _linears, _tensors

    dst = root / "llama-fp8ch"
    code, _, err = run_cli("convert", root / "llama", dst, "--recipe", "fp8-channel", "-q")
    assert code == 0, err
    code, out, err = run_cli("eval", dst, "--reference", root / "llama", "--data", root / "eval.jsonl",
                             "--device", "cpu", "--json", "--sensitivity", "1")
    assert code == 0, err
    doc = validate("eval", json.loads(out))
    assert doc["activations"] == [{"scheme": "FP8 dynamic per token", "modules": 14}]
    (row,) = doc["sensitivity"]
    module, tensors = row["module"], _tensors(dst)
    ref, quant = (transformers.AutoModelForCausalLM.from_pretrained(root / "llama", dtype=torch.float32).eval()
                  for _ in range(2))
    with torch.no_grad():  # fp8-channel decoded: E4M3 codes times the per-row scale
        quant.get_submodule(module).weight.copy_(tensors[f"{module}.weight"].float()
                                                 * tensors[f"{module}.weight_scale"].float())
    token = QuantizationArgs(num_bits=8, type="float", strategy="token", dynamic=True, symmetric=True)
    _ct_hooks(_linears(quant), {module: token})
    kl, n = 0.0, 0
    with torch.no_grad():
        for s in _ids():
            a, b = (torch.log_softmax(m(input_ids=torch.tensor([s])).logits[0, :-1].double(), -1) for m in (ref, quant))
            kl, n = kl + float((a.exp() * (a - b)).sum()), n + a.shape[0]
    assert kl > 0 and row["output_error"] == pytest.approx(kl / n, rel=REL)
