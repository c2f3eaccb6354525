"""convert --rotate vo: values and outputs rotated per head, exactly (planning/transforms.py)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from quantcli.planning.transforms import TransformOp, rotation
from quantcli.testing import make_tiny


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("rotate")
    rng = random.Random(3)
    data = root / "ids.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [rng.randrange(1, 500) for _ in range(16)]}) + "\n"
                            for _ in range(4)))
    return {"root": root, "data": data, "built": {}}


def _src(zoo: dict, mt: str, cls: str):
    if mt not in zoo["built"]:
        zoo["built"][mt] = make_tiny(zoo["root"] / mt, mt, cls)
    return zoo["built"][mt]


def _eval(run_cli, out, ref, data) -> dict:
    code, text, err = run_cli("eval", out, "--reference", ref, "--data", data, "--json")
    assert code == 0, err
    return json.loads(text)


def test_rotation_matrices_are_orthogonal_and_the_op_inverts():
    for d in (8, 64, 12):  # Hadamard, and a seeded orthogonal matrix where d is no power of two
        r = rotation(d)
        assert torch.allclose(r @ r.T, torch.eye(d, dtype=torch.float64), atol=1e-12)
        assert torch.equal(r, rotation(d))  # the same on every run
    w = torch.randn(3 * 8, 5)
    assert torch.allclose(TransformOp("rows", 8).apply(TransformOp("rows", 8).apply(w)), w, atol=1e-6)  # H = H^T


@pytest.mark.parametrize("mt, cls", [("llama", "LlamaForCausalLM"), ("gemma3_text", "Gemma3ForCausalLM"),
                                     ("gemma4_text", "Gemma4ForCausalLM"), ("qwen2", "Qwen2ForCausalLM"),
                                     ("gpt_oss", "GptOssForCausalLM")])
def test_a_rotated_dense_model_is_the_source_s_function(zoo, run_cli, mt, cls):
    src, out = _src(zoo, mt, cls), zoo["root"] / f"{mt}-rotated"
    code, _, err = run_cli("convert", src, out, "--recipe", "fp32", "--rotate", "vo", "-q")
    assert code == 0, err
    manifest = json.loads((out / "quantcli_manifest.json").read_text())
    rotated = manifest["transforms"]["tensors"]
    assert manifest["transforms"]["rotate"] == "vo" and any(n.endswith("v_proj.weight") for n in rotated)
    if mt == "qwen2":  # q/k/v biases: v_proj's is rotated with its rows
        assert any(n.endswith("v_proj.bias") for n in rotated)
    causal = _eval(run_cli, out, src, zoo["data"])["causal"]
    assert causal["logits_rel_err"] < 1e-5 and causal["kl_max"] < 1e-9  # exact, up to FP32 rounding


def test_rotated_nvfp4_composes_with_gptq_and_eval_measures_modules_in_the_rotated_basis(zoo, run_cli):
    src, data = _src(zoo, "llama", "LlamaForCausalLM"), zoo["data"]
    out = zoo["root"] / "llama-rot-gptq"
    code, _, err = run_cli("convert", src, out, "--recipe", "nvfp4", "--rotate", "vo", "--rounding", "gptq",
                           "--calibration", data, "--gptq-min-tokens", "1", "-q")
    assert code == 0, err
    manifest = json.loads((out / "quantcli_manifest.json").read_text())
    assert manifest["transforms"]["rotate"] == "vo"
    v = next(m for m in manifest["modules"] if m["module"].endswith("0.self_attn.v_proj"))
    assert v["rounding"]["method"] == "gptq" and v["rounding"]["output_error"] < v["rounding"]["nearest_output_error"]
    doc = _eval(run_cli, out, src, data)
    worst = {row["module"]: row["rel_err"] for row in doc["worst_modules"]}
    assert worst and max(worst.values()) < 0.3  # a rotated module against the rotated reference: a rounding's error


def test_what_the_rotation_cannot_do_is_refused_in_one_line(zoo, run_cli):
    root = zoo["root"]
    cases = [(("phi3", "Phi3ForCausalLM"), ["--recipe", "nvfp4"], "no attention with separate v_proj and o_proj"),
             (("qwen3_5_text", "Qwen3_5ForCausalLM"), ["--recipe", "nvfp4"], "not exact on Qwen3_5ForCausalLM"),
             (("llama", "LlamaForCausalLM"), ["--recipe", "fp32", "--calibration", zoo["data"], "--activations",
                                              "static"], "a dense output has nothing to calibrate")]
    for (mt, cls), args, needle in cases:
        code, _, err = run_cli("convert", _src(zoo, mt, cls), root / "refused", "--rotate", "vo", *args)
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
        assert not (root / "refused").exists() and not (root / "refused.partial").exists()
    plain = root / "llama-nvfp4"
    assert run_cli("convert", _src(zoo, "llama", "LlamaForCausalLM"), plain, "--recipe", "nvfp4", "-q")[0] == 0
    code, _, err = run_cli("convert", plain, root / "refused", "--recipe", "mxfp4", "--rotate", "vo")
    assert code == 2 and "already quantized; rotate the dense" in err


def test_a_rotated_run_has_its_own_fingerprint_so_resume_never_mixes_it_with_a_plain_one(zoo):
    from quantcli.checkpoint.source import open_source
    from quantcli.convert.progress import fingerprint
    from quantcli.planning.conversion import plan_conversion
    from quantcli.planning.options_file import conversion_options

    source = open_source(str(_src(zoo, "llama", "LlamaForCausalLM")))
    plain, rotated = (plan_conversion(source, conversion_options(recipe="nvfp4", layout=None, ignore=[], config=None,
                                                                 scale_rule=None, rotate=r)) for r in (None, "vo"))
    assert fingerprint(plain) != fingerprint(rotated) and not plain.transforms and rotated.transforms


def test_verify_judges_a_rotated_checkpoint_against_the_reference_rotated_as_the_manifest_records(zoo, run_cli):
    """Qwen2 has v_proj biases: the rotated bias is a dense changed tensor, compared bit for bit."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = zoo["root"] / "qwen2-biased"  # transformers initializes biases to 0: give them values to rotate
    shutil.copytree(_src(zoo, "qwen2", "Qwen2ForCausalLM"), src)
    shard = next(src.glob("*.safetensors"))
    tensors = load_file(shard)
    gen = torch.Generator().manual_seed(0)
    for n in [n for n in tensors if n.endswith(".bias")]:
        tensors[n] = torch.randn(tensors[n].shape, generator=gen).to(tensors[n].dtype)
    save_file(tensors, shard, metadata={"format": "pt"})
    out = zoo["root"] / "verify-rotated"
    code, _, err = run_cli("convert", str(src), str(out), "--recipe", "nvfp4", "--rotate", "vo", "-q")
    assert code == 0, err
    code, text, err = run_cli("verify", str(out), "--reference", str(src))
    assert code == 0, text + err

    manifest_path = out / "quantcli_manifest.json"
    manifest = json.loads(manifest_path.read_text())
    unrecorded = dict(manifest)
    del unrecorded["transforms"]
    manifest_path.write_text(json.dumps(unrecorded))  # without the record, the rotated codes fail
    code, text, _ = run_cli("verify", str(out), "--reference", str(src))
    assert code == 1 and "self_attn.v_proj" in text, text
    manifest_path.write_text(json.dumps(manifest))

    shard = next(out.glob("*.safetensors"))
    tensors = load_file(shard)
    bias = next(n for n in tensors if n.endswith("self_attn.v_proj.bias"))
    tensors[bias] = load_file(next(src.glob("*.safetensors")))[bias]  # the source's bias, not the rotated one
    save_file(tensors, shard, metadata={"format": "pt"})
    code, text, _ = run_cli("verify", str(out), "--reference", str(src))
    assert code == 1 and bias in text and "transformed as the manifest records" in text, text
