"""inspect shows calibrated scales (activation scheme, input scales, KV scales per layer) and
warns when a config declares an FP8 KV cache without them; verify passes a calibrated output
and fails (exit 1, naming the tensor) a NaN, negative, inverted or fused-mismatched scale."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantcli.testing import make_llama

pytest.importorskip("transformers")
Q = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def outs(tmp_path_factory) -> dict[str, Path]:
    from quantcli.cli.app import main

    root = tmp_path_factory.mktemp("cali")
    src = make_llama(root / "llama", hidden=64, layers=2, shards=1)
    data = root / "ids.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [(5 * i + 3 * j) % 512 for j in range(16)]}) + "\n"
                            for i in range(4)))
    found = {}
    for layout, recipe in (("modelopt", "nvfp4"), ("compressed-tensors", "nvfp4"), ("fp8", "fp8")):
        out = root / layout
        argv = ["quantcli", "convert", str(src), str(out), "--recipe", recipe, "--layout", layout,
                "--activations", "static", "--kv-cache", "fp8", "--calibration", str(data), "--quiet"]
        with pytest.MonkeyPatch.context() as mp, pytest.raises(SystemExit) as exc:
            mp.setattr("sys.argv", argv)
            main()
        assert not exc.value.code
        found[layout] = out
    return found


def _edit(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        t = load_file(f)
        edit(t)
        save_file(t, f, metadata={"format": "pt"})
    return dst


def test_inspect_shows_scales(outs, run_cli):
    code, out, _ = run_cli("inspect", str(outs["compressed-tensors"]))
    assert code == 0
    assert "activations: static" in out and "kv_cache_scheme" in out
    # grouped by layer pattern as the modules table (a real MoE has thousands), one per tensor on request
    assert "model.layers.{0,1}.self_attn.q_proj.input_global_scale" in out and "divide" in out
    assert f"{Q}.input_global_scale" not in out
    assert "model.layers.{0,1}.self_attn" in out and "KV-cache scales" in out
    per_tensor = run_cli("inspect", str(outs["compressed-tensors"]), "--per-tensor")[1]
    assert f"{Q}.input_global_scale" in per_tensor and "model.layers.1.self_attn " in per_tensor
    assert "input scales" in out and "kv scales" in out and "f32" not in out.split("totals")[1].split("params")[0]
    code, out, _ = run_cli("inspect", str(outs["modelopt"]), "--json")
    doc = json.loads(out)["calibrated"]
    assert doc["activation_scheme"] == "static" and doc["kv_cache"].startswith("kv_cache_quant_algo")
    assert {s["direction"] for s in doc["inputs"]} == {"multiply"}
    assert doc["kv"][0]["k_tensor"] == "model.layers.0.self_attn.k_proj.k_scale" and doc["kv"][0]["k_scale"] > 0


def test_inspect_shows_fp8_layout_kv_scales(outs, run_cli):
    """The fp8 layout holds KV-cache scales where vLLM's and SGLang's fp8 method read them."""
    code, out, _ = run_cli("inspect", str(outs["fp8"]), "--json")
    doc = json.loads(out)["calibrated"]
    assert code == 0 and doc["kv_cache"] == "kv_cache_quant_algo FP8" and doc["activation_scheme"] == "static"
    assert doc["kv"][1]["k_tensor"] == "model.layers.1.self_attn.k_scale" and doc["kv"][1]["v_scale"] > 0


@pytest.mark.parametrize("layout", ["modelopt", "compressed-tensors", "fp8"])
def test_verify_passes_calibrated(outs, run_cli, layout):
    code, out, _ = run_cli("verify", str(outs[layout]))
    assert code == 0, out
    assert "ok   activation and KV-cache scales" in out


def _set(name: str, fn):
    def edit(t):
        if name in t:
            t[name] = fn(t[name])
    return edit


@pytest.mark.parametrize("layout,tensor,fn,needle", [
    ("modelopt", f"{Q}.input_scale", lambda x: torch.full_like(x, float("nan")), "not finite"),
    ("modelopt", f"{Q}.input_scale", lambda x: -x, "not positive"),
    ("modelopt", f"{Q}.input_scale", lambda x: 1.0 / x, "inverted"),
    ("compressed-tensors", f"{Q}.input_global_scale", lambda x: 1.0 / x, "inverted"),
    ("modelopt", "model.layers.1.self_attn.v_proj.v_scale", lambda x: -x, "not positive"),
    ("compressed-tensors", "model.layers.0.mlp.up_proj.input_global_scale", lambda x: x * 2, "different input"),
    ("fp8", "model.layers.1.self_attn.v_scale", lambda x: -x, "not positive"),
    ("fp8", "model.layers.0.self_attn.k_scale", lambda x: 1.0 / x, "inverted"),
])
def test_verify_fails_bad_scale(outs, tmp_path, run_cli, layout, tensor, fn, needle):
    bad = _edit(outs[layout], tmp_path / "bad", _set(tensor, fn))
    code, out, _ = run_cli("verify", str(bad))
    assert code == 1, out
    fails = [line for line in out.splitlines() if line.startswith("FAIL ") and needle in line]
    assert fails and any(tensor in line or "gate_proj" in line for line in fails), out


@pytest.mark.parametrize("layout,k_scale", [("modelopt", "model.layers.0.self_attn.k_proj.k_scale"),
                                            ("fp8", "model.layers.0.self_attn.k_scale")])
def test_fp8_kv_declared_without_scales_warns(outs, tmp_path, run_cli, layout, k_scale):
    def drop(t):
        for name in [n for n in t if n.endswith(("k_scale", "v_scale"))]:
            del t[name]
    bad = _edit(outs[layout], tmp_path / "nokv", drop)
    (bad / "quantcli_manifest.json").unlink(missing_ok=True)
    code, out, _ = run_cli("inspect", str(bad))
    assert code == 0
    assert "warning" in out and "FP8 KV cache" in out and "fall back to a scale of 1.0" in out
    assert k_scale in out
    code, out, _ = run_cli("verify", str(bad))
    assert code == 1 and f"FAIL {k_scale}: is missing" in out, out
