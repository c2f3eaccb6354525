"""`convert --rounding gptq` end to end on tiny models: the manifest's account (method, parameters,
per-module tokens and layer-output errors), verify passing, byte-identical reruns, a TOML file
choosing GPTQ for the MLPs only, dense vs sequential inputs, SIGKILL then --resume, routed MoE
experts with the few-token fallback named, 2 ranks writing one process's bytes, and every
refusal in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from faults import fault_env, tree_state
from safetensors.torch import load_file

from quantcli.testing import make_llama, make_moe

pytest.importorskip("transformers")
TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gptq")
    data = tmp / "ids.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [(7 * i + 13 * j) % 512 for j in range(8 + 4 * (i % 3))]}) + "\n"
                            for i in range(12)))
    return {"tmp": tmp, "data": data, "llama": make_llama(tmp / "llama", hidden=64, layers=2, shards=2),
            "moe": make_moe(tmp / "moe", hidden=64, layers=2, shards=2, experts=4)}


def _convert(run_cli, env, src, out, *extra):
    code, stdout, err = run_cli("convert", str(src), str(out), "--calibration", str(env["data"]), "--device", "cpu",
                                *extra)
    assert code == 0, err
    return stdout


def _manifest(out: Path) -> dict:
    return json.loads((out / "quantcli_manifest.json").read_text())


def _tensors(out: Path) -> dict:
    found = {}
    for f in sorted(out.glob("*.safetensors")):
        found.update(load_file(f))
    return found


def test_the_manifest_records_the_method_and_each_modules_errors_and_verify_passes(run_cli, env, tmp_path):
    out = tmp_path / "out"
    stdout = _convert(run_cli, env, env["llama"], out, "--recipe", "nvfp4", "--rounding", "gptq", "--kv-cache", "fp8")
    assert "rounded: 14 modules by GPTQ; layer-output error on the calibration data" in stdout
    m = _manifest(out)
    assert m["rounding"] == {"method": "gptq", "dampening": 0.01, "act_order": "static", "scales": "updated",
                             "block_columns": 128, "min_tokens": 32, "inputs": "quantized", "forward": "float32",
                             "default": "gptq", "overrides": []}
    tokens = sum(8 + 4 * (i % 3) for i in range(12))
    for e in m["modules"]:
        r = e["rounding"]
        assert r["method"] == "gptq" and r["tokens"] == tokens and r["dampening"] == 0.01, e["module"]
        assert 0 < r["output_error"] < r["nearest_output_error"], e["module"]
    assert m["calibration"]["data_sha256"]
    code, stdout, err = run_cli("verify", str(out), "--reference", str(env["llama"]))
    assert code == 0 and stdout.rstrip().endswith("PASS"), stdout + err


def test_two_runs_and_one_thread_write_the_same_bytes_and_nearest_rounding_is_unchanged(run_cli, env, tmp_path):
    args = ("--recipe", "int8-channel", "--rounding", "gptq", "--quiet")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # the layer's solves side by side on two threads (passes/side_by_side.py)
        _convert(run_cli, env, env["llama"], tmp_path / "a", *args)
        _convert(run_cli, env, env["llama"], tmp_path / "b", *args)
        torch.set_num_threads(1)  # one after the other
        _convert(run_cli, env, env["llama"], tmp_path / "c", *args)
    finally:
        torch.set_num_threads(threads)
    assert tree_state(tmp_path / "a") == tree_state(tmp_path / "b") == tree_state(tmp_path / "c")
    code, _, err = run_cli("convert", str(env["llama"]), str(tmp_path / "plain"), "--recipe", "int8-channel", "-q")
    assert code == 0, err
    assert "rounding" not in _manifest(tmp_path / "plain")  # round-to-nearest manifests keep their form
    gptq, plain = _tensors(tmp_path / "a"), _tensors(tmp_path / "plain")
    assert sorted(gptq) == sorted(plain)
    assert any(not (gptq[n] == plain[n]).all() for n in gptq if n.endswith(".weight"))  # other codes
    assert all((gptq[n] == plain[n]).all() for n in gptq if "layers" not in n)  # embedding, norm, head: as is


def test_a_recipe_file_rounds_only_the_mlps_with_gptq(run_cli, env, tmp_path):
    cfg = tmp_path / "recipe.toml"
    cfg.write_text('recipe = "mxfp4"\ngptq_dampening = 0.05\n[[rounding_override]]\npattern = "*mlp*"\n'
                   'rounding = "gptq"\n')
    out = tmp_path / "out"
    _convert(run_cli, env, env["llama"], out, "--config", str(cfg), "-q")
    m = _manifest(out)
    assert m["rounding"]["default"] == "nearest" and m["rounding"]["overrides"] == [["*mlp*", "gptq"]]
    assert m["rounding"]["dampening"] == 0.05
    rounded = {e["module"] for e in m["modules"] if e.get("rounding")}
    assert rounded == {e["module"] for e in m["modules"] if ".mlp." in e["module"]} and rounded
    code, _, err = run_cli("convert", str(env["llama"]), str(tmp_path / "plain"), "--recipe", "mxfp4", "-q")
    assert code == 0, err
    got, plain = _tensors(out), _tensors(tmp_path / "plain")
    attn = [n for n in got if ".self_attn." in n]
    assert attn and all((got[n] == plain[n]).all() for n in attn)  # rounded to nearest: a plain conversion's bytes


def test_dense_inputs_change_only_the_layers_after_the_first(run_cli, env, tmp_path):
    args = ("--recipe", "fp8-block", "--rounding", "gptq", "-q")
    _convert(run_cli, env, env["llama"], tmp_path / "seq", *args)
    _convert(run_cli, env, env["llama"], tmp_path / "dense", *args, "--gptq-inputs", "dense")
    seq, dense = _tensors(tmp_path / "seq"), _tensors(tmp_path / "dense")
    assert all((seq[n] == dense[n]).all() for n in seq if n.startswith("model.layers.0."))
    assert any(not (seq[n] == dense[n]).all() for n in seq if n.startswith("model.layers.1."))
    assert _manifest(tmp_path / "dense")["rounding"]["inputs"] == "dense"


@pytest.mark.slow
def test_a_run_killed_after_a_layer_resumes_to_the_same_bytes(run_cli, env, tmp_path):
    argv = ["convert", str(env["llama"]), str(tmp_path / "killed"), "--recipe", "nvfp4", "--rounding", "gptq",
            "--calibration", str(env["data"]), "--device", "cpu", "-q"]
    proc = subprocess.run([sys.executable, "-m", "quantcli", *argv], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **fault_env(kill_after_layers=1)})
    assert proc.returncode == -9, proc.stderr
    staged = list((tmp_path / "killed.partial" / ".quantcli-weights").glob("layer-*.safetensors"))
    assert [p.name for p in staged] == ["layer-00000.safetensors"]
    code, _, err = run_cli(*argv[:-1], "--resume", "-q")
    assert code == 0, err
    _convert(run_cli, env, env["llama"], tmp_path / "whole", "--recipe", "nvfp4", "--rounding", "gptq", "-q")
    assert tree_state(tmp_path / "killed") == tree_state(tmp_path / "whole")
    code, _, err = run_cli(*argv[:-1], "--resume", "--gptq-dampening", "0.1", "-q")  # other options: not resumed
    assert code == 2 and "already complete" not in err


def test_moe_experts_get_their_routed_tokens_and_the_few_token_fallback_is_named(run_cli, env, tmp_path):
    out = tmp_path / "out"
    stdout = _convert(run_cli, env, env["moe"], out, "--recipe", "nvfp4", "--rounding", "gptq",
                      "--gptq-min-tokens", "70")
    m = _manifest(out)
    experts = {e["module"]: e["rounding"] for e in m["modules"] if ".experts." in e["module"]}
    total = sum(8 + 4 * (i % 3) for i in range(12))
    assert experts and all(r["tokens"] < total for r in experts.values())  # routed: each expert its own tokens
    layer0 = [r["tokens"] for name, r in experts.items() if name.startswith("model.layers.0.") and name.endswith("w1")]
    assert sum(layer0) == 2 * total  # two experts per token
    few = sorted(name for name, r in experts.items() if r["tokens"] < 70)
    assert few, "the data should leave some expert under the threshold"
    for name in few:
        assert experts[name]["method"] == "nearest" and "fewer than --gptq-min-tokens 70" in experts[name]["reason"]
        assert any(note.startswith(f"{name}: rounded to nearest, not GPTQ") for note in m["notes"])
        assert f"note: {name}: rounded to nearest" in stdout
    assert all(r["method"] == "gptq" for name, r in experts.items() if name not in few)


def test_the_progress_names_the_rounding_phase_layer_by_layer(run_cli, env, tmp_path):
    """No byte is written before the shards: until then the bar's label says which phase and layer
    the walk is in, and the bar fills by that layer (-v prints each label as a line, as without a
    terminal)."""
    code, _, err = run_cli("convert", str(env["llama"]), str(tmp_path / "out"), "--recipe", "nvfp4", "--rounding",
                           "gptq", "--calibration", str(env["data"]), "--device", "cpu", "-v")
    assert code == 0, err
    phases = [ln.split(",")[0] for ln in err.splitlines() if ln.startswith("rounding (gptq): ")]
    assert phases == ["rounding (gptq): tokenizing the data", "rounding (gptq): layer 0/2",
                      "rounding (gptq): layer 1/2", "rounding (gptq): layer 2/2"], err


@pytest.mark.parametrize("args, message", [
    (["--rounding", "gptq"], "--rounding gptq needs --calibration DATA"),
    (["--gptq-dampening", "0.1", "--calibration", "DATA", "--kv-cache", "fp8"],
     "--gptq-dampening: only used with --rounding gptq"),
    (["--rounding", "gptq", "--gptq-dampening", "0", "--calibration", "DATA"], "--gptq-dampening: must be a number"),
    (["--rounding", "gptq", "--gptq-min-tokens", "0", "--calibration", "DATA"],
     "--gptq-min-tokens: must be a positive"),
    (["--rounding", "gptq", "--gptq-act-order", "dynamic", "--calibration", "DATA"], "--gptq-act-order"),
])
def test_refusals_are_one_line(run_cli, env, tmp_path, args, message):
    args = [str(env["data"]) if a == "DATA" else a for a in args]
    code, _, err = run_cli("convert", str(env["llama"]), str(tmp_path / "out"), "--recipe", "nvfp4", *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_a_recipe_file_with_a_bad_rounding_override_is_refused(run_cli, env, tmp_path):
    cfg = tmp_path / "recipe.toml"
    cfg.write_text('recipe = "nvfp4"\n[[rounding_override]]\npattern = "*mlp*"\nrounding = "gptqq"\n')
    code, _, err = run_cli("convert", str(env["llama"]), str(tmp_path / "out"), "--config", str(cfg),
                           "--calibration", str(env["data"]))
    assert code == 2 and "[[rounding_override]] #1 rounding" in err and "gptq" in err, err


@pytest.mark.slow
def test_two_ranks_write_one_process_s_bytes(env, tmp_path):
    from test_weight_pass_ranks import _two_ranks

    argv = ["convert", str(env["llama"]), "DST", "--recipe", "mxfp8", "--rounding", "gptq", "--calibration",
            str(env["data"]), "--device", "cpu", "--quiet"]
    one = subprocess.run([sys.executable, "-m", "quantcli", *[str(tmp_path / "one") if a == "DST" else a
                                                               for a in argv]], capture_output=True, text=True)
    assert one.returncode == 0, one.stderr
    logs = _two_ranks([{"name": "two", "nearest": False, "argv": [str(tmp_path / "two") if a == "DST" else a
                                                                  for a in argv]}], tmp_path / "log")
    assert all(rec["code"] == 0 for rec in logs["two"].values()), logs
    assert tree_state(tmp_path / "two") == tree_state(tmp_path / "one")


def test_gptq_combines_with_a_weighted_search_static_activations_and_an_fp8_kv_cache(run_cli, env, tmp_path):
    out = tmp_path / "out"
    _convert(run_cli, env, env["llama"], out, "--recipe", "nvfp4", "--rounding", "gptq", "--scale-search", "mse",
             "--activations", "static", "--kv-cache", "fp8", "-q")
    m = _manifest(out)
    assert all(e["rounding"]["method"] == "gptq" and e["scale_search_weights"] == "input_channel_ms"
               for e in m["modules"])
    names = _tensors(out)
    assert any(n.endswith(".input_scale") for n in names) and any(n.endswith(".k_scale") for n in names)
    code, stdout, err = run_cli("verify", str(out), "--reference", str(env["llama"]))
    assert code == 0, stdout + err


def test_non_finite_activations_are_refused_in_one_line(run_cli, env, tmp_path):
    import shutil

    from safetensors.torch import save_file

    src = tmp_path / "overflowing"
    shutil.copytree(env["llama"], src)
    name = "model.layers.1.input_layernorm.weight"
    for f in src.glob("*.safetensors"):
        tensors = load_file(f)
        if name in tensors:
            tensors[name] = tensors[name] * 0 + 3e38  # finite weights; normalized values above 1.13 overflow
            save_file(tensors, f, metadata={"format": "pt"})
    code, _, err = run_cli("convert", str(src), str(tmp_path / "out"), "--recipe", "fp8", "--rounding", "gptq",
                           "--calibration", str(env["data"]), "--calibration-samples", "12", "--device", "cpu")
    assert code == 2 and "not finite" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_a_config_transformers_cannot_run_is_refused_before_the_walk(run_cli, env, tmp_path):
    import shutil

    src = tmp_path / "odd-heads"
    shutil.copytree(env["llama"], src)
    config = json.loads((src / "config.json").read_text())
    config.update(num_attention_heads=5, num_key_value_heads=2)
    (src / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli("convert", str(src), str(tmp_path / "out"), "--recipe", "nvfp4", "--rounding", "gptq",
                           "--calibration", str(env["data"]), "--calibration-samples", "12")
    assert code == 2 and "not a multiple of num_key_value_heads 2" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_a_gptq_key_in_a_recipe_file_without_rounding_names_the_files_fix(run_cli, env, tmp_path):
    cfg = tmp_path / "recipe.toml"
    cfg.write_text('recipe = "nvfp4"\ngptq_dampening = 0.02\n')
    code, _, err = run_cli("convert", str(env["llama"]), str(tmp_path / "out"), "--config", str(cfg),
                           "--calibration", str(env["data"]), "--kv-cache", "fp8")
    assert code == 2 and 'add rounding = "gptq" in the file' in err, err


@pytest.mark.parametrize("recipe", ["fp8", "fp8-channel", "int8-channel"])
def test_gptq_scales_is_refused_where_every_rounded_module_has_per_tensor_or_per_row_scales(run_cli, env, tmp_path,
                                                                                             recipe):
    """Those scales come from the original weights either way, so --gptq-scales (either value, or
    gptq_scales in --config) would change nothing: refused, as --scale-search is for a recipe
    that does not search; the default (not given) is not, nor a plan whose GPTQ modules include
    block scales."""
    gptq = ("--rounding", "gptq", "--calibration", str(env["data"]), "--dry-run", "-q")
    for value in ("original", "updated"):
        code, _, err = run_cli("convert", str(env["llama"]), str(tmp_path / "out"), "--recipe", recipe, *gptq,
                               "--gptq-scales", value)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert f"--gptq-scales {value}: changes nothing for {recipe}" in err and "drop the option" in err, err
    cfg = tmp_path / "recipe.toml"
    cfg.write_text(f'recipe = "{recipe}"\ngptq_scales = "original"\n')
    code, _, err = run_cli("convert", str(env["llama"]), str(tmp_path / "out"), "--config", str(cfg), *gptq)
    assert code == 2 and 'gptq_scales = "original" in --config: changes nothing for' in err, err
    code, _, err = run_cli("convert", str(env["llama"]), str(tmp_path / "out"), "--recipe", recipe, *gptq)
    assert code == 0, err
    # the MLPs' 128 x 128 blocks: the choice matters there
    cfg.write_text(f'recipe = "{recipe}"\nlayout = "compressed-tensors"\ngptq_scales = "original"\n'
                   f'[[override]]\npattern = "*mlp*"\nrecipe = "fp8-block"\n')
    code, _, err = run_cli("convert", str(env["llama"]), str(tmp_path / "out"), "--config", str(cfg), *gptq)
    assert code == 0, err
    assert not (tmp_path / "out").exists()


def test_make_llama_splits_heads_transformers_can_run(tmp_path):
    config = json.loads((make_llama(tmp_path / "odd", hidden=320, layers=1, shards=1) / "config.json").read_text())
    assert config["num_attention_heads"] == 5 and 5 % config["num_key_value_heads"] == 0
