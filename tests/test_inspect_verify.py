"""inspect and verify on quantcli's output, on foreign-layout files written as docs/formats.md,
"Producers and consumers" describes them, and on
checkpoints with planted faults."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from quantcli import inspect as inspect_report
from quantcli import verify
from quantcli.checkpoint.safetensors_io import write_file
from quantcli.checkpoint.source import open_source
from quantcli.checkpoint.tensors import CheckpointTensors
from quantcli.reports import to_json


# The library returns dataclasses; these tests read them in their --json form (reports.to_json).
def inspect_checkpoint(*args, **kwargs) -> dict:
    return to_json(inspect_report.inspect_checkpoint(*args, **kwargs))


def kv_cache_account(*args, **kwargs) -> dict:
    return to_json(inspect_report.kv_cache_account(*args, **kwargs))


def verify_checkpoint(*args, **kwargs) -> dict:
    return to_json(verify.verify_checkpoint(*args, **kwargs))


def load_all(path: Path) -> dict[str, torch.Tensor]:
    with CheckpointTensors(open_source(str(path))) as t:
        return {n: t.get(n).clone() for n in t.where}


def rewrite(path: Path, edit) -> None:
    """Apply `edit(tensors)` to a single-shard copy of a checkpoint (index removed)."""
    tensors = load_all(path)
    edit(tensors)
    for f in list(path.glob("*.safetensors")) + [path / "model.safetensors.index.json"]:
        f.unlink(missing_ok=True)
    write_file(path / "model.safetensors", tensors, {"format": "pt"})


@pytest.fixture(scope="module")
def converted(tiny_llama, tmp_path_factory):
    from typer.testing import CliRunner

    from quantcli.cli.app import app

    root = tmp_path_factory.mktemp("conv")
    outs = {}
    for recipe, layout in [("nvfp4", "modelopt"), ("nvfp4", "compressed-tensors"), ("mxfp4", "compressed-tensors"),
                           ("fp8-block", "fp8"), ("mxfp8", "compressed-tensors"), ("fp8-channel", "modelopt")]:
        out = root / f"{recipe}-{layout}"
        r = CliRunner().invoke(app, ["convert", str(tiny_llama), str(out), "--recipe", recipe, "--layout", layout,
                                     "--quiet"])
        assert r.exit_code == 0, r.output
        outs[(recipe, layout)] = out
    return outs


def foreign(src: Path, dst: Path, drop_manifest=True) -> Path:
    shutil.copytree(src, dst)
    if drop_manifest:
        (dst / "quantcli_manifest.json").unlink()
    return dst


@pytest.mark.parametrize("key, bits", [(("nvfp4", "modelopt"), 4.5), (("nvfp4", "compressed-tensors"), 4.5),
                                       (("mxfp4", "compressed-tensors"), 4.25), (("fp8-block", "fp8"), 8.0),
                                       (("mxfp8", "compressed-tensors"), 8.25),
                                       (("fp8-channel", "modelopt"), 8.25)])  # K=128: 8 + 32/128
def test_inspect_reports_layout_recipe_direction_bits(converted, tmp_path, key, bits):
    recipe, layout = key
    for path in (converted[key], foreign(converted[key], tmp_path / "f")):  # with and without a manifest
        r = inspect_checkpoint(str(path))
        assert r["layout"] == layout
        mods = {m["module"]: m for m in r["modules"]}
        m = mods["model.layers.0.self_attn.q_proj"]
        assert m["recipe"] == recipe and m["tensors_look_like"] == recipe
        assert abs(m["bits_per_param"] - bits) < 0.05
        assert not r["problems"] and not r["unlisted_linears"] and not r["fused_mismatches"]
        if recipe == "nvfp4":
            g = next(t for t in m["tensors"] if t["role"] == "global_scale")
            assert g["direction"] == ("divide" if layout == "compressed-tensors" else "multiply")
            assert (g["value"] > 1) == (layout == "compressed-tensors")
        assert "lm_head" in r["exclusion_list"]


def test_inspect_flags_planted_faults(converted, tmp_path):
    path = foreign(converted[("nvfp4", "modelopt")], tmp_path / "bad")

    def plant(t):
        t["model.layers.0.self_attn.k_proj.weight_scale_2"] = t["model.layers.0.self_attn.k_proj.weight_scale_2"] * 2
        t["model.layers.1.mlp.extra.weight"] = torch.zeros(8, 16, dtype=torch.bfloat16)

    rewrite(path, plant)
    r = inspect_checkpoint(str(path))
    assert r["fused_mismatches"][0]["group"] == "model.layers.0.self_attn.{q_proj,k_proj,v_proj}"
    assert r["unlisted_linears"] == ["model.layers.1.mlp.extra"]
    # config says one format, tensors another
    cfg = tmp_path / "cfg"
    shutil.copytree(converted[("mxfp4", "compressed-tensors")], cfg)
    c = json.loads((cfg / "config.json").read_text())
    c["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 16  # claims nvfp4-like
    c["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 8
    c["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "channel"
    (cfg / "config.json").write_text(json.dumps(c))
    (cfg / "quantcli_manifest.json").unlink()
    r = inspect_checkpoint(str(cfg))
    assert any("tensors look like mxfp4" in p for p in r["problems"])


def test_inspect_reads_compressed_tensors_package_output(tmp_path):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    from quantcli.formats.layouts import get_layout

    # Produce a checkpoint with CT's own compressor: its NVFP4 scales, its packing.
    torch.manual_seed(0)
    w = torch.randn(64, 128, dtype=torch.bfloat16)
    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    global_scale = (448.0 * 6.0 / w.float().abs().amax()).reshape(1)
    from compressed_tensors.quantization.utils import calculate_qparams

    blocks = w.float().reshape(64, 8, 16)
    amax = blocks.abs().amax(-1)
    scale, _ = calculate_qparams(-amax, amax, scheme.weights, global_scale=global_scale)
    comp = BaseCompressor.get_value_from_registry("nvfp4-pack-quantized")
    sd = comp.compress({"weight": w, "weight_scale": scale, "weight_global_scale": global_scale}, scheme)
    tensors = {f"model.layers.0.mlp.up_proj.{k}": v for k, v in sd.items()}
    tensors["lm_head.weight"] = torch.zeros(8, 128, dtype=torch.bfloat16)
    d = tmp_path / "ct"
    d.mkdir()
    write_file(d / "model.safetensors", tensors)
    qc = get_layout("compressed-tensors").quantization_config({"nvfp4": ["x"]}, ["lm_head"])
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": qc}))
    r = inspect_checkpoint(str(d))
    assert r["layout"] == "compressed-tensors"
    m = r["modules"][0]
    assert m["recipe"] == "nvfp4" and m["logical_shape"] == [64, 128] and abs(m["bits_per_param"] - 4.5) < 0.01
    # and verify decodes it close to the source (CT's BF16 arithmetic differs from ModelOpt's in a few bytes)
    ref = tmp_path / "ref"
    ref.mkdir()
    write_file(ref / "model.safetensors", {"model.layers.0.mlp.up_proj.weight": w,
                                           "lm_head.weight": tensors["lm_head.weight"]})

    rep = verify_checkpoint(str(d), reference=str(ref))
    assert rep["passed"], rep["faults"]


def test_kv_cache_account_llama_and_mla():
    acc = kv_cache_account({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                            "hidden_size": 4096}, 80 * 2**30)
    per = {r["format"]: r["bytes_per_token"] for r in acc["formats"]}
    assert per["bf16"] == 128 * 1024 and per["fp8"] == 64 * 1024 and per["nvfp4"] == 36 * 1024
    assert acc["formats"][0]["tokens_in_budget"] == 80 * 2**30 // (128 * 1024)
    mla = kv_cache_account({"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64}, 2**30)
    assert mla["formats"][0]["bytes_per_token"] == 61 * 576 * 2


def test_inspect_cli_kv_cache_and_json(converted, run_cli):
    code, out, _ = run_cli("inspect", converted[("nvfp4", "modelopt")], "--kv-cache", "--json", "--stats")
    doc = json.loads(out)
    assert code == 0 and doc["kv_cache"]["formats"][0]["format"] == "bf16"
    assert "e8m0_histogram" not in doc["modules"][0]["stats"] and doc["modules"][0]["stats"]["nonfinite_values"] == 0
    code, out, _ = run_cli("inspect", converted[("nvfp4", "modelopt")], "--kv-cache")
    assert code == 0 and "KV cache" in out and "nvfp4" in out
    code, _, err = run_cli("inspect", converted[("nvfp4", "modelopt")], "--kv-budget", "lots")
    assert code == 2 and "--kv-budget" in err


# ---------------------------------------------------------------- verify


def test_verify_good_checkpoints_pass_and_exact_is_100(converted, tiny_llama, run_cli):
    for key, path in converted.items():
        code, out, _ = run_cli("verify", path, "--reference", tiny_llama, "--exact", "--json")
        doc = json.loads(out)
        assert code == 0 and doc["passed"], (key, doc["faults"])
        assert all(t["exact_identical_fraction"] == 1.0 for t in doc["tensors"])
        if key[0] in ("mxfp4", "mxfp8"):
            assert doc["tensors"][0]["scale_rule_matches"] == "even"


def _swap_nibbles(t, name):
    t[name] = ((t[name] >> 4) | (t[name] << 4)).to(torch.uint8)


def _transpose_scale(t, name):
    s = t[name]
    t[name] = s.view(torch.uint8).t().contiguous().reshape(s.shape).view(s.dtype)


def _bump_scale(t, name):
    s = t[name]
    t[name] = (s.view(torch.uint8) + 1).view(s.dtype)


FAULTS = {
    "nibbles swapped": (("nvfp4", "modelopt"), "model.layers.0.mlp.up_proj",
                        lambda t, m: _swap_nibbles(t, f"{m}.weight")),
    "global inverted": (("nvfp4", "modelopt"), "model.layers.0.mlp.down_proj",
                        lambda t, m: t.__setitem__(f"{m}.weight_scale_2", 1.0 / t[f"{m}.weight_scale_2"])),
    "ct global inverted": (("nvfp4", "compressed-tensors"), "model.layers.1.self_attn.o_proj",
                           lambda t, m: t.__setitem__(f"{m}.weight_global_scale", 1.0 / t[f"{m}.weight_global_scale"])),
    "block scales transposed": (("mxfp4", "compressed-tensors"), "model.layers.1.mlp.gate_proj",
                                lambda t, m: _transpose_scale(t, f"{m}.weight_scale")),
    "block scale bytes +1": (("nvfp4", "modelopt"), "model.layers.1.mlp.down_proj",
                             lambda t, m: _bump_scale(t, f"{m}.weight_scale")),
    "fp8 block scale +1": (("fp8-block", "fp8"), "model.layers.0.self_attn.o_proj",
                           lambda t, m: t.__setitem__(f"{m}.weight_scale_inv", t[f"{m}.weight_scale_inv"] * 1.125)),
    "norm cast to bf16": (("fp8-block", "fp8"), "model.norm",
                          lambda t, m: t.__setitem__(f"{m}.weight", t[f"{m}.weight"].to(torch.float16))),
    "tensor dropped": (("mxfp8", "compressed-tensors"), "model.layers.1.post_attention_layernorm",
                       lambda t, m: t.pop(f"{m}.weight")),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_verify_catches_each_corruption(fault, converted, tiny_llama, tmp_path, run_cli):
    key, module, edit = FAULTS[fault]
    path = foreign(converted[key], tmp_path / "bad")
    rewrite(path, lambda t: edit(t, module))
    code, out, _ = run_cli("verify", path, "--reference", tiny_llama, "--json")
    doc = json.loads(out)
    assert code == 1 and not doc["passed"]
    assert any(f["tensor"] == module or f["tensor"].startswith(module) for f in doc["faults"]), doc["faults"]


def test_verify_reference_of_another_model_fails(converted, tmp_path, run_cli):
    from quantcli.testing import make_llama

    other = make_llama(tmp_path / "other", hidden=128, layers=2, shards=1, seed=7)
    code, out, _ = run_cli("verify", converted[("nvfp4", "modelopt")], "--reference", other, "--json")
    assert code == 1 and len(json.loads(out)["faults"]) >= 14


def test_verify_tp_divisibility_and_usage_errors(converted, tiny_llama, run_cli):
    path = converted[("fp8-block", "fp8")]
    code, out, _ = run_cli("verify", path, "--tp", "4", "--json")
    doc = json.loads(out)
    assert code == 1 and any("--tp 4" in f["fault"] for f in doc["faults"])  # 128-row blocks over 4 ranks
    assert run_cli("verify", converted[("nvfp4", "modelopt")], "--tp", "2")[0] == 0
    code, _, err = run_cli("verify", path, "--exact")
    assert code == 2 and "--reference" in err
    code, _, err = run_cli("verify", tiny_llama)
    assert code == 2 and "no quantized modules" in err
    code, _, err = run_cli("verify", path, "--threshold", "bogus=1")
    assert code == 2 and "METRIC=VALUE" in err


@pytest.mark.parametrize("pair, named", [(("fp8-channel", "modelopt"), "vLLM refuses"),  # SGLang: no
                                         (("mxfp8", "compressed-tensors"), "vLLM refuses"),  # SGLang: no
                                         (("nvfp4", "modelopt"), "vLLM and SGLang refuse")])
def test_verify_tp_names_only_the_engines_that_load_the_pair(converted, run_cli, pair, named):
    code, out, _ = run_cli("verify", converted[pair], "--tp", "3", "--json")  # 128 does not split 3 ways
    faults = [f["fault"] for f in json.loads(out)["faults"] if "--tp 3" in f["fault"]]
    assert code == 1 and faults and all(f.endswith(f"{named} to load it at TP=3") for f in faults), faults


def test_inspect_reports_the_manifest_scale_rule(tiny_llama, tmp_path, run_cli):
    out = tmp_path / "floor"
    assert run_cli("convert", tiny_llama, out, "--recipe", "mxfp4", "--scale-rule", "floor", "--quiet")[0] == 0
    assert {m["scale_rule"] for m in inspect_checkpoint(str(out))["modules"]} == {"floor"}
    code, o, _ = run_cli("verify", out, "--reference", tiny_llama, "--exact", "--json")
    assert code == 0 and json.loads(o)["tensors"][0]["scale_rule_matches"] == "floor"


def test_tensors_pattern_limits_inspect_and_verify(converted, tiny_llama, run_cli):
    path = converted[("nvfp4", "modelopt")]
    code, out, _ = run_cli("inspect", path, "--tensors", "re:.*layers\\.1\\.mlp\\..*", "--json")
    mods = [m["module"] for m in json.loads(out)["modules"]]
    assert code == 0 and mods == ["model.layers.1.mlp.down_proj", "model.layers.1.mlp.gate_proj",
                                  "model.layers.1.mlp.up_proj"]
    code, out, _ = run_cli("verify", path, "--reference", tiny_llama, "--tensors", "*.self_attn.q_proj", "--json")
    doc = json.loads(out)
    assert code == 0 and sorted(t["tensor"] for t in doc["tensors"]) == [
        "model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]
