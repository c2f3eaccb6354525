"""`--gptq-forward bfloat16`: the weight walk runs each layer's matmuls under torch.autocast to
BF16 (model/layers.py matmuls_in), the residual stream in FP32. What must hold: the matmuls
really take BF16 operands, the option reaches the manifest and the plan's fingerprint (so --resume and
verify --exact tell the two apart), its bytes are reproducible and verify --exact reruns them,
and a manifest written before the option existed reads back as float32 (what it ran)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from quantcli.model.layers import linear_weights_in, matmuls_in
from quantcli.planning.from_manifest import _roundings
from quantcli.testing import make_llama

pytest.importorskip("transformers")
CPU = torch.device("cpu")


def test_matmuls_in_bfloat16_rounds_the_operands_and_leaves_the_rest_fp32():
    torch.manual_seed(0)
    lin, x = torch.nn.Linear(64, 32, bias=False), torch.randn(4, 64)
    with torch.inference_mode():
        with matmuls_in(torch.bfloat16, CPU):
            y = lin(x)
            normed = torch.nn.functional.layer_norm(y.float(), (32,))
            summed = x + x  # not a matmul: FP32 in, FP32 out
        exact = x.bfloat16().double() @ lin.weight.bfloat16().double().T  # BF16 products are exact in FP64
        assert y.dtype == torch.bfloat16 and normed.dtype == torch.float32 and summed.dtype == torch.float32
        # FP32 accumulation, then the output rounded to BF16: within one BF16 rounding of the exact value
        assert ((y.double() - exact).abs() <= exact.abs() * 2.0 ** -8).all()
        with matmuls_in(None, CPU):
            assert torch.equal(lin(x), x @ lin.weight.T)


def test_linear_weights_cast_once_give_autocast_s_own_outputs():
    torch.manual_seed(1)
    layer = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.LayerNorm(48), torch.nn.Linear(48, 16))
    cast, x = copy.deepcopy(layer), torch.randn(3, 64)
    linear_weights_in(cast, torch.bfloat16)
    assert [p.dtype for p in cast.parameters()] == [torch.bfloat16, torch.float32, torch.float32, torch.float32,
                                                     torch.bfloat16, torch.float32]  # Linear weights only
    with torch.inference_mode(), matmuls_in(torch.bfloat16, CPU):
        assert torch.equal(cast(x), layer(x))  # the same values autocast casts to at each call


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gptq-forward")
    data = tmp / "ids.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [(5 * i + 11 * j) % 512 for j in range(10)]}) + "\n"
                            for i in range(8)))
    return {"data": data, "llama": make_llama(tmp / "llama", hidden=64, layers=2, shards=1)}


def _convert(run_cli, env, out, *extra) -> None:
    code, _, err = run_cli("convert", env["llama"], out, "--recipe", "nvfp4", "--rounding", "gptq", "--calibration",
                           env["data"], "--device", "cpu", "-q", *extra)
    assert code == 0, err


def _bytes(out) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors"))}


def test_bfloat16_forward_is_recorded_reproducible_and_verified_byte_for_byte(run_cli, env, tmp_path):
    _convert(run_cli, env, tmp_path / "fp32")
    _convert(run_cli, env, tmp_path / "bf16", "--gptq-forward", "bfloat16")
    _convert(run_cli, env, tmp_path / "bf16-again", "--gptq-forward", "bfloat16")
    manifest = json.loads((tmp_path / "bf16" / "quantcli_manifest.json").read_text())
    assert manifest["rounding"]["forward"] == "bfloat16"
    assert json.loads((tmp_path / "fp32" / "quantcli_manifest.json").read_text())["rounding"]["forward"] == "float32"
    assert _bytes(tmp_path / "bf16") == _bytes(tmp_path / "bf16-again")
    assert _bytes(tmp_path / "bf16") != _bytes(tmp_path / "fp32")  # the statistics came from other activations
    code, out, err = run_cli("verify", tmp_path / "bf16", "--reference", env["llama"], "--exact", "--calibration",
                             env["data"], "--device", "cpu")
    assert code == 0, out + err
    assert "14 of 14 GPTQ module(s) byte-identical" in out
    code, out, err = run_cli("inspect", tmp_path / "bf16")
    assert code == 0 and "inputs from the quantized layers, forward in bfloat16)" in out, out + err


def test_a_float32_manifest_without_the_key_verifies_exactly(run_cli, env, tmp_path):
    """What a run before the option wrote: no rounding.forward, the fingerprint of float32."""
    out = tmp_path / "fp32"
    _convert(run_cli, env, out)
    path = out / "quantcli_manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["rounding"]["forward"]
    path.write_text(json.dumps(manifest, indent=2))
    code, text, err = run_cli("verify", out, "--reference", env["llama"], "--exact", "--calibration", env["data"],
                              "--device", "cpu")
    assert code == 0 and "14 of 14 GPTQ module(s) byte-identical" in text, text + err
    code, text, err = run_cli("inspect", out)
    assert code == 0 and "forward in" not in text, text + err


def test_resume_with_another_forward_is_refused(run_cli, env, tmp_path):
    out = tmp_path / "out"
    _convert(run_cli, env, out, "--gptq-forward", "bfloat16")
    code, _, err = run_cli("convert", env["llama"], out, "--recipe", "nvfp4", "--rounding", "gptq", "--calibration",
                           env["data"], "--device", "cpu", "--resume", "-q")
    assert code == 2 and len(err.strip().splitlines()) == 1, err


def test_a_manifest_from_before_the_option_reads_back_as_float32():
    record = {"method": "gptq", "dampening": 0.01, "act_order": "none", "scales": "updated", "block_columns": 128,
              "min_tokens": 32, "inputs": "quantized", "default": "gptq", "overrides": []}
    assert {r.forward for r in _roundings(record, "old")} == {"float32"}
    assert {r.forward for r in _roundings({**record, "forward": "bfloat16"}, "new")} == {"bfloat16"}
    with pytest.raises(Exception, match="malformed"):
        _roundings({**record, "forward": "float16"}, "bad")


def test_an_unknown_forward_dtype_is_refused_in_one_line(run_cli, env, tmp_path):
    code, _, err = run_cli("convert", env["llama"], tmp_path / "out", "--recipe", "nvfp4", "--rounding", "gptq",
                           "--calibration", env["data"], "--gptq-forward", "bfloat")
    assert code == 2 and "bfloat16" in err and len(err.strip().splitlines()) == 1, err
    code, _, err = run_cli("convert", env["llama"], tmp_path / "out", "--recipe", "nvfp4", "--gptq-forward",
                           "bfloat16")
    assert code == 2 and "--rounding gptq" in err and len(err.strip().splitlines()) == 1, err
