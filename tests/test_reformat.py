"""convert from quantized sources: lossless re-layout, dequantize, re-quantize (issue 7)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from faults import fault_env

from quantcli.checkpoint.safetensors_io import write_file
from quantcli.checkpoint.source import open_source
from quantcli.checkpoint.tensors import CheckpointTensors
from quantcli.formats.layouts import get_layout

PAIRS = [("nvfp4", "modelopt"), ("nvfp4", "compressed-tensors"), ("mxfp4", "compressed-tensors"),
         ("mxfp8", "compressed-tensors"), ("mxfp8", "modelopt"), ("mxfp8", "fp8"), ("fp8", "fp8"),
         ("fp8", "compressed-tensors"), ("fp8-channel", "compressed-tensors"), ("fp8-channel", "modelopt"),
         ("fp8-block", "fp8"), ("fp8-block", "compressed-tensors")]


def tensors_of(path: Path) -> dict[str, bytes]:
    with CheckpointTensors(open_source(str(path))) as t:
        return {n: bytes(t.raw(n)) for n in t.where}


@pytest.fixture(scope="module")
def quantized(tiny_llama, tmp_path_factory):
    from typer.testing import CliRunner

    from quantcli.cli.app import app

    root = tmp_path_factory.mktemp("q")
    out = {}
    for recipe, layout in PAIRS:
        dst = root / f"{recipe}-{layout}"
        r = CliRunner().invoke(app, ["convert", str(tiny_llama), str(dst), "--recipe", recipe, "--layout", layout,
                                     "--quiet"])
        assert r.exit_code == 0, r.output
        out[(recipe, layout)] = dst
    return out


def convert(run_cli, src, dst, *args):
    code, out, err = run_cli("convert", src, dst, *args, "--json")
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("recipe, a, b", [("nvfp4", "modelopt", "compressed-tensors"),
                                          ("fp8-block", "fp8", "compressed-tensors"),
                                          ("mxfp8", "modelopt", "fp8"),
                                          ("fp8-channel", "modelopt", "compressed-tensors")])
def test_relayout_is_lossless_both_ways(recipe, a, b, quantized, tmp_path, run_cli):
    src = quantized[(recipe, a)]
    s1 = convert(run_cli, src, tmp_path / "b", "--recipe", recipe, "--layout", b)
    s2 = convert(run_cli, tmp_path / "b", tmp_path / "a", "--recipe", recipe, "--layout", a)
    assert s1["lossless"] and s2["lossless"] and s1["tensors_quantized"] == 14
    # a -> b gives exactly what quantcli writes when it quantizes straight into b ...
    assert tensors_of(tmp_path / "b") == tensors_of(quantized[(recipe, b)])
    # ... and b -> a gives back the original bytes (global scales: unless a note says otherwise).
    back, orig = tensors_of(tmp_path / "a"), tensors_of(src)
    noted = {n.split(":")[0] for n in s1["notes"] + s2["notes"]}
    assert set(back) == set(orig)
    for name in orig:
        if back[name] != orig[name]:
            assert name.endswith("weight_scale_2") and name.rsplit(".", 1)[0] in noted, name
    manifest = json.loads((tmp_path / "b" / "quantcli_manifest.json").read_text())
    assert manifest["lossless"] is True and manifest["layout"] == b
    qc = json.loads((tmp_path / "b" / "config.json").read_text())["quantization_config"]
    assert "lm_head" in (qc.get("ignore") or qc.get("ignored_layers") or [])


def test_relayout_into_a_layout_without_the_recipe_is_refused(quantized, tmp_path, run_cli):
    code, _, err = run_cli("convert", quantized[("nvfp4", "modelopt")], tmp_path / "x", "--recipe", "nvfp4",
                           "--layout", "fp8")
    assert code == 2 and "layouts that do: modelopt, compressed-tensors" in err and err.count("\n") == 1
    code, _, err = run_cli("convert", quantized[("nvfp4", "modelopt")], tmp_path / "x", "--recipe", "nvfp4",
                           "--ignore", "re:.*o_proj")
    assert code == 2 and "already quantized" in err
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.partial").exists()


@pytest.mark.parametrize("pair", PAIRS, ids=[f"{r}-{lay}" for r, lay in PAIRS])
def test_every_layout_to_fp32_and_bf16_matches_its_dequantize(pair, quantized, tmp_path, run_cli):
    recipe_name, layout_name = pair
    src = quantized[pair]
    convert(run_cli, src, tmp_path / "f32", "--recipe", "fp32")
    convert(run_cli, src, tmp_path / "b16", "--recipe", "bf16")
    layout = get_layout(layout_name)
    recipe = layout.recipe_for(recipe_name)
    manifest = json.loads((src / "quantcli_manifest.json").read_text())
    with CheckpointTensors(open_source(str(src))) as q, CheckpointTensors(open_source(str(tmp_path / "f32"))) as f, \
            CheckpointTensors(open_source(str(tmp_path / "b16"))) as b:
        for m in manifest["modules"]:
            expect = recipe.dequantize(layout.from_disk(m["module"], recipe, q.get, q.where))
            assert torch.equal(f.get(m["source_name"]), expect)
            assert torch.equal(b.get(m["source_name"]), expect.bfloat16())
        for name in q.where:  # dense tensors untouched
            if name in f.where and not any(name.startswith(m["module"] + ".") for m in manifest["modules"]):
                assert q.raw(name) == f.raw(name)
    config = json.loads((tmp_path / "b16" / "config.json").read_text())
    assert "quantization_config" not in config
    assert not (tmp_path / "b16" / "hf_quant_config.json").exists()
    assert json.loads((tmp_path / "b16" / "quantcli_manifest.json").read_text())["modules"] == []


def test_bf16_output_loads_in_transformers(quantized, tiny_llama, tmp_path, run_cli):
    from transformers import AutoModelForCausalLM

    convert(run_cli, quantized[("nvfp4", "modelopt")], tmp_path / "d", "--recipe", "bf16")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "d", dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    ids = torch.randint(0, 512, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, base = model(ids).logits.flatten(), ref(ids).logits.flatten()
    assert torch.isfinite(got).all()
    assert 0.95 < float(torch.nn.functional.cosine_similarity(got, base, dim=0)) < 1.0


def test_requantize_warns_and_reports_error_vs_decoded_source(quantized, tiny_llama, tmp_path, run_cli):
    code, out, err = run_cli("convert", quantized[("fp8-block", "fp8")], tmp_path / "n", "--recipe", "nvfp4", "--json")
    assert code == 0 and "errors of both quantizations add up" in err
    summary = json.loads(out)
    errs = summary["requantize_rel_err_vs_decoded_source"]
    assert len(errs) == 14 and all(0.01 < e < 0.15 for e in errs.values())
    m = json.loads((tmp_path / "n" / "quantcli_manifest.json").read_text())
    mods = {x["module"]: x for x in m["modules"]}
    g = [next(t["value"] for t in mods[f"model.layers.0.self_attn.{p}_proj"]["tensors"] if t["role"] == "global_scale")
         for p in "qkv"]
    assert g[0] == g[1] == g[2]  # fused groups share one global scale after re-quantizing too
    code, out, _ = run_cli("verify", tmp_path / "n", "--json")
    assert code == 0, json.loads(out)["faults"]


def test_exclusions_carry_over(tiny_llama, tmp_path, run_cli):
    convert(run_cli, tiny_llama, tmp_path / "q", "--recipe", "nvfp4", "--ignore", "re:.*o_proj$")
    convert(run_cli, tmp_path / "q", tmp_path / "ct", "--recipe", "nvfp4", "--layout", "compressed-tensors")
    ignore = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]["ignore"]
    assert {"model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj", "lm_head"} <= set(ignore)
    a, b = tensors_of(tiny_llama), tensors_of(tmp_path / "ct")
    assert a["model.layers.0.self_attn.o_proj.weight"] == b["model.layers.0.self_attn.o_proj.weight"]


def test_compressed_tensors_package_checkpoint_to_modelopt_and_back(tmp_path, run_cli):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    comp = BaseCompressor.get_value_from_registry("nvfp4-pack-quantized")
    tensors = {"lm_head.weight": torch.zeros(8, 64, dtype=torch.bfloat16)}
    g = torch.Generator().manual_seed(0)
    for i in range(6):
        w = (torch.randn(32, 64, generator=g) * (0.01 + i)).bfloat16()
        gs = (448.0 * 6.0 / w.float().abs().amax()).reshape(1)
        amax = w.float().reshape(32, 4, 16).abs().amax(-1)
        scale, _ = calculate_qparams(-amax, amax, scheme.weights, global_scale=gs)
        sd = comp.compress({"weight": w, "weight_scale": scale, "weight_global_scale": gs}, scheme)
        tensors.update({f"model.layers.{i}.mlp.up_proj.{k}": v for k, v in sd.items()})
    src = tmp_path / "ct"
    src.mkdir()
    write_file(src / "model.safetensors", tensors)
    qc = get_layout("compressed-tensors").quantization_config({"nvfp4": ["x"]}, ["lm_head"])
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": qc}))
    s1 = convert(run_cli, src, tmp_path / "mo", "--recipe", "nvfp4", "--layout", "modelopt")
    s2 = convert(run_cli, tmp_path / "mo", tmp_path / "back", "--recipe", "nvfp4", "--layout", "compressed-tensors")
    assert s1["lossless"] and s2["lossless"]
    orig, back = tensors_of(src), tensors_of(tmp_path / "back")
    assert set(orig) == set(back)
    noted = {n.split(":")[0] for n in s1["notes"] + s2["notes"]}
    for name in orig:
        if orig[name] != back[name]:  # only a global scale with no exact FP32 reciprocal, and said so
            assert name.endswith("weight_global_scale") and name.rsplit(".", 1)[0] in noted, name


def test_inexact_reciprocal_is_noted_with_the_value_written(tmp_path, run_cli):
    # find a weight_scale_2 whose FP32 reciprocal does not invert back
    s2 = next(v for v in (torch.rand(1000, generator=torch.Generator().manual_seed(0)) * 0.01 + 1e-4)
              if not torch.equal(1.0 / (1.0 / v), v))
    src = tmp_path / "mo"
    src.mkdir()
    codes = torch.randint(0, 256, (16, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    write_file(src / "model.safetensors", {
        "model.layers.0.mlp.up_proj.weight": codes,
        "model.layers.0.mlp.up_proj.weight_scale":
            torch.full((16, 4), 0x60, dtype=torch.uint8).view(torch.float8_e4m3fn),
        "model.layers.0.mlp.up_proj.weight_scale_2": s2.reshape(()),
        "lm_head.weight": torch.zeros(4, 64, dtype=torch.bfloat16)})
    lay = get_layout("modelopt")
    (src / "hf_quant_config.json").write_text(json.dumps(
        lay.extra_files({"nvfp4": ["x"]}, ["lm_head"])["hf_quant_config.json"]))
    qc = lay.quantization_config({"nvfp4": ["x"]}, ["lm_head"])
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": qc}))
    s = convert(run_cli, src, tmp_path / "ct", "--recipe", "nvfp4", "--layout", "compressed-tensors")
    assert s["lossless"] and len(s["notes"]) == 1 and "no exact FP32 reciprocal" in s["notes"][0]
    written = float(tensors_of_tensor(tmp_path / "ct", "model.layers.0.mlp.up_proj.weight_global_scale"))
    assert repr(written) in s["notes"][0]
    assert json.loads((tmp_path / "ct" / "quantcli_manifest.json").read_text())["notes"] == s["notes"]


def tensors_of_tensor(path: Path, name: str) -> torch.Tensor:
    with CheckpointTensors(open_source(str(path))) as t:
        return t.get(name).clone()


def test_gpt_oss_to_bf16_restores_expert_orientation(tmp_path, run_cli):
    src = tmp_path / "goss"
    src.mkdir()
    w = torch.randn(2, 64, 96, generator=torch.Generator().manual_seed(0)).bfloat16()  # [E, in, out]
    write_file(src / "model.safetensors", {"model.layers.0.mlp.experts.gate_up_proj": w})
    (src / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    convert(run_cli, src, tmp_path / "q", "--recipe", "mxfp4", "--layout", "gpt-oss")
    convert(run_cli, tmp_path / "q", tmp_path / "d", "--recipe", "bf16")
    d = tensors_of_tensor(tmp_path / "d", "model.layers.0.mlp.experts.gate_up_proj")
    assert d.shape == w.shape and d.dtype == torch.bfloat16
    rel = float((d.float() - w.float()).norm() / w.float().norm())
    assert rel < 0.2
    shutil.rmtree(tmp_path / "d")


@pytest.mark.slow
def test_reformat_dry_run_and_resume_after_kill(quantized, tmp_path, run_cli):
    import os
    import subprocess
    import sys

    src = quantized[("nvfp4", "compressed-tensors")]
    code, out, _ = run_cli("convert", src, tmp_path / "d", "--recipe", "nvfp4", "--layout", "modelopt", "--dry-run",
                           "--json")
    plan = json.loads(out)
    assert code == 0 and not (tmp_path / "d").exists()
    assert {t["action"] for t in plan["tensors"]} == {"relayout", "copy"}
    convert(run_cli, src, tmp_path / "clean", "--recipe", "nvfp4", "--layout", "modelopt")
    cmd = [sys.executable, "-m", "quantcli", "convert", str(src), str(tmp_path / "o"), "--recipe", "nvfp4",
           "--layout", "modelopt", "--quiet"]
    assert subprocess.run(cmd, env={**os.environ, **fault_env(kill_after_shards=1)}).returncode == -9
    s = convert(run_cli, src, tmp_path / "o", "--recipe", "nvfp4", "--layout", "modelopt", "--resume")
    assert s["shards_resumed"] == 1
    assert tensors_of(tmp_path / "o") == tensors_of(tmp_path / "clean")
    assert (tmp_path / "o" / "quantcli_manifest.json").read_text() \
        == (tmp_path / "clean" / "quantcli_manifest.json").read_text()
