"""`quantcli convert` end to end on tiny transformers checkpoints made in the session."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from faults import fault_env

from quantcli.checkpoint.source import open_source
from quantcli.formats.layouts import DEFAULT_LAYOUT

RECIPES = ["fp8", "fp8-channel", "fp8-block", "mxfp8", "mxfp4", "nvfp4"]


def tree_digest(path: Path) -> dict[str, str]:
    return {p.relative_to(path).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def linear_modules(src: Path) -> set[str]:
    s = open_source(str(src))
    return {n[:-7] for h in s.headers.values() for n, i in h.tensors.items()
            if n.endswith(".weight") and len(i.shape) == 2 and "embed" not in n and "norm" not in n}


def check_output(src: Path, out: Path, recipe: str, layout: str):
    manifest = json.loads((out / "quantcli_manifest.json").read_text())
    assert manifest["layout"] == layout
    quantized = {m["module"] for m in manifest["modules"]}
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    excluded = set(json.loads((out / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]) \
        if layout == "modelopt" \
        else set(qc.get("ignore") or qc.get("ignored_layers") or qc.get("modules_to_not_convert"))
    assert linear_modules(src) <= quantized | excluded  # every Linear is quantized or listed
    assert "lm_head" in excluded and excluded
    assert not any(".gate" in m and m.endswith("gate") for m in quantized)  # routers stay dense
    index = json.loads((out / "model.safetensors.index.json").read_text())
    s = open_source(str(out))
    assert set(index["weight_map"]) == {n for h in s.headers.values() for n in h.tensors}
    assert index["metadata"]["total_size"] == sum(i.nbytes for h in s.headers.values() for i in h.tensors.values())
    assert (out / "tokenizer_config.json").exists() or not (src / "tokenizer_config.json").exists()
    assert "Quantization (quantcli)" in (out / "README.md").read_text()
    # Unquantized tensors pass through bit-identical (no dtype casts).
    src_s = open_source(str(src))
    from quantcli.checkpoint.tensors import CheckpointTensors

    with CheckpointTensors(src_s) as a, CheckpointTensors(s) as b:
        for name in a.where:
            if name.endswith(".weight") and name[:-7] in quantized:
                continue
            assert a.info(name).dtype == b.info(name).dtype and a.raw(name) == b.raw(name), name


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("which", ["default", "compressed-tensors"])
def test_every_recipe_converts_llama_and_moe(recipe, which, tiny_llama, tiny_moe, tmp_path, run_cli):
    layout = DEFAULT_LAYOUT[recipe] if which == "default" else which
    for src in (tiny_llama, tiny_moe):
        out = tmp_path / f"{src.name}-{recipe}"
        code, _, err = run_cli("convert", src, out, "--recipe", recipe, "--layout", layout, "--quiet")
        assert code == 0, err
        check_output(src, out, recipe, layout)


def test_moe_experts_quantized_fused_groups_share_global(tiny_moe, tmp_path, run_cli):
    out = tmp_path / "moe-nvfp4"
    assert run_cli("convert", tiny_moe, out, "--recipe", "nvfp4", "--quiet")[0] == 0
    m = json.loads((out / "quantcli_manifest.json").read_text())
    mods = {x["module"]: x for x in m["modules"]}
    assert "model.layers.0.block_sparse_moe.experts.3.w2" in mods
    assert "model.layers.0.block_sparse_moe.gate" in m["excluded"]

    def g(name):
        return next(t["value"] for t in mods[name]["tensors"] if t["role"] == "global_scale")

    e = "model.layers.1.block_sparse_moe.experts.2"
    assert g(f"{e}.w1") == g(f"{e}.w3") != g(f"{e}.w2")
    a = "model.layers.0.self_attn"
    assert g(f"{a}.q_proj") == g(f"{a}.k_proj") == g(f"{a}.v_proj")


def test_ct_outputs_load_in_transformers_with_close_logits(tiny_llama, tmp_path, run_cli):
    transformers = pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    ref = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = ref(ids).logits.flatten()
    floors = {"fp8-block": 0.995, "fp8-channel": 0.995, "mxfp8": 0.99, "nvfp4": 0.95, "mxfp4": 0.93, "fp8": 0.99}
    for recipe, floor in floors.items():
        out = tmp_path / recipe
        assert run_cli("convert", tiny_llama, out, "--recipe", recipe, "--layout", "compressed-tensors",
                       "--quiet")[0] == 0
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                     quantization_config=CompressedTensorsConfig(run_compressed=False))
        with torch.no_grad():
            got = model(ids).logits.flatten()
        cos = float(torch.nn.functional.cosine_similarity(got, base, dim=0))
        assert floor < cos < 1.0, (recipe, cos)  # close, and really quantized
    del transformers


def test_two_runs_byte_identical_and_triton_backend_matches(tiny_llama, tmp_path, run_cli):
    for name, backend in (("a", "torch"), ("b", "torch"), ("c", "triton")):
        assert run_cli("convert", tiny_llama, tmp_path / name, "--recipe", "nvfp4", "--backend", backend,
                       "--quiet")[0] == 0
    a, b, c = (tree_digest(tmp_path / n) for n in "abc")
    assert a == b == c


@pytest.mark.slow
def test_kill_after_first_shard_then_resume_is_byte_identical(tiny_llama, tmp_path, run_cli):
    assert run_cli("convert", tiny_llama, tmp_path / "clean", "--recipe", "mxfp4", "--quiet")[0] == 0
    env = {**os.environ, **fault_env(kill_after_shards=1)}
    cmd = [sys.executable, "-m", "quantcli", "convert", str(tiny_llama), str(tmp_path / "out"), "--recipe", "mxfp4",
           "--quiet"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert proc.returncode == -9
    assert not (tmp_path / "out").exists() and (tmp_path / "out.partial").exists()
    code, _, err = run_cli("convert", tiny_llama, tmp_path / "out", "--recipe", "mxfp4", "--quiet")
    assert code == 2 and "--resume" in err  # an interrupted run is never silently redone
    code, out, _ = run_cli("convert", tiny_llama, tmp_path / "out", "--recipe", "mxfp4", "--resume", "--json")
    assert code == 0 and json.loads(out)["shards_resumed"] == 1
    assert tree_digest(tmp_path / "out") == tree_digest(tmp_path / "clean")
    assert not (tmp_path / "out.partial").exists()


@pytest.mark.slow
def test_resume_with_other_recipe_refused(tiny_llama, tmp_path):
    env = {**os.environ, **fault_env(kill_after_shards=1)}
    base = [sys.executable, "-m", "quantcli", "convert", str(tiny_llama), str(tmp_path / "o"), "--quiet"]
    assert subprocess.run(base + ["--recipe", "nvfp4"], env=env, capture_output=True).returncode == -9
    before = tree_digest(tmp_path / "o.partial")
    proc = subprocess.run(base + ["--recipe", "fp8-block", "--resume"], capture_output=True, text=True)
    assert proc.returncode == 2 and "different source, recipe or options" in proc.stderr
    assert proc.stderr.count("\n") == 1
    assert tree_digest(tmp_path / "o.partial") == before


def test_refusals_write_nothing(tiny_llama, tmp_path, run_cli):
    src_before = tree_digest(tiny_llama)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    cases = [
        (["convert", tiny_llama, tmp_path / "full", "--recipe", "nvfp4"], "quantcli did not write"),
        (["convert", tiny_llama, tiny_llama / "sub", "--recipe", "nvfp4"], "inside the source folder"),
        (["convert", tiny_llama, tmp_path / "a", "--recipe", "nvfp5"], "unknown recipe 'nvfp5'"),
        (["convert", tiny_llama, tmp_path / "a", "--recipe", "mxfp4", "--layout", "modelopt"], "layouts that do"),
        (["convert", tiny_llama, tmp_path / "a", "--recipe", "nvfp4", "--ignore", "re:(("], "not a valid regex"),
        (["convert", tmp_path / "nope", tmp_path / "a", "--recipe", "nvfp4"], "no such file or folder"),
        (["convert", tiny_llama, tmp_path / "a", "--recipe", "nvfp4", "--device", "cuda:7"], "cuda"),
        (["convert", tiny_llama, tmp_path / "a", "--recipe", "fp8", "--scale-rule", "even"], "only MX recipes"),
    ]
    for args, message in cases:
        code, _, err = run_cli(*args)
        assert code == 2 and message in err and err.count("\n") == 1, (args, err)
    assert (tmp_path / "full" / "keep.txt").read_text() == "x" and len(list((tmp_path / "full").iterdir())) == 1
    assert not (tmp_path / "a").exists() and not (tmp_path / "a.partial").exists()
    assert tree_digest(tiny_llama) == src_before


def test_pickle_only_and_escaping_index_refused(tmp_path, run_cli):
    p = tmp_path / "pkl"
    p.mkdir()
    (p / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    code, _, err = run_cli("convert", p, tmp_path / "o", "--recipe", "nvfp4")
    assert code == 2 and "never unpickles" in err
    e = tmp_path / "esc"
    e.mkdir()
    (e / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a.weight": "../secret.safetensors"}}))
    code, _, err = run_cli("convert", e, tmp_path / "o2", "--recipe", "nvfp4")
    assert code == 2 and "outside the checkpoint folder" in err
    assert not (tmp_path / "o").exists() and not (tmp_path / "o2").exists()


def test_dry_run_plan_and_toml_overrides(tiny_moe, tmp_path, run_cli):
    cfg = tmp_path / "mixed.toml"
    cfg.write_text('recipe = "nvfp4"\nlayout = "compressed-tensors"\nignore = ["re:.*layers\\\\.1\\\\.self_attn.*"]\n'
                   '[[override]]\npattern = "re:.*self_attn.*"\nrecipe = "fp8-block"\n')
    code, out, _ = run_cli("convert", tiny_moe, tmp_path / "o", "--config", cfg, "--dry-run", "--json")
    assert code == 0 and not (tmp_path / "o").exists()
    plan = json.loads(out)
    recipes = {t["name"]: t["recipe"] for t in plan["tensors"]}
    assert recipes["model.layers.0.self_attn.q_proj.weight"] == "fp8-block"
    assert recipes["model.layers.0.block_sparse_moe.experts.0.w1.weight"] == "nvfp4"
    assert recipes["model.layers.1.self_attn.q_proj.weight"] is None
    assert "model.layers.1.self_attn.q_proj" in plan["exclusion_list"]
    assert plan["bytes_out"] < plan["bytes_in"] and plan["estimated_peak_memory_bytes"] > 0
    code, out, _ = run_cli("convert", tiny_moe, tmp_path / "o", "--config", cfg, "--quiet")
    qc = json.loads((tmp_path / "o" / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mixed-precision" and len(qc["config_groups"]) == 2


def test_hub_repo_id_from_offline_cache(tiny_llama, tmp_path, monkeypatch, run_cli):
    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny-llama"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in tiny_llama.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    code, _, err = run_cli("convert", "acme/tiny-llama", tmp_path / "o", "--recipe", "fp8-block", "--quiet")
    assert code == 0, err
    assert run_cli("convert", tiny_llama, tmp_path / "local", "--recipe", "fp8-block", "--quiet")[0] == 0
    a, b = tree_digest(tmp_path / "o"), tree_digest(tmp_path / "local")
    assert {k: v for k, v in a.items() if k not in ("README.md", "quantcli_manifest.json")} == \
           {k: v for k, v in b.items() if k not in ("README.md", "quantcli_manifest.json")}
    manifest = json.loads((tmp_path / "o" / "quantcli_manifest.json").read_text())
    assert manifest["source"]["repo_id"] == "acme/tiny-llama"
    code, _, err = run_cli("convert", "acme/missing", tmp_path / "o3", "--recipe", "fp8-block")
    assert code == 2 and "acme/missing" in err


def test_gpt_oss_expert_stacks_transposed_and_verified(tmp_path, run_cli):
    from quantcli.checkpoint.safetensors_io import write_file

    src = tmp_path / "goss"
    src.mkdir()
    g = torch.Generator().manual_seed(0)
    write_file(src / "model.safetensors", {  # HF gpt-oss BF16 stores experts as [E, in, out]
        "model.layers.0.mlp.experts.gate_up_proj": torch.randn(4, 64, 128, generator=g).bfloat16(),
        "model.layers.0.mlp.experts.down_proj": torch.randn(4, 64, 64, generator=g).bfloat16(),
        "model.layers.0.mlp.router.weight": torch.randn(4, 64, generator=g).bfloat16(),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64, generator=g).bfloat16()})
    (src / "config.json").write_text(json.dumps({"model_type": "gpt_oss", "num_hidden_layers": 1}))
    out = tmp_path / "q"
    assert run_cli("convert", src, out, "--config", "recipes/examples/mxfp4-gpt-oss-experts.toml", "--quiet")[0] == 0
    s = open_source(str(out))
    h = s.headers["model.safetensors"].tensors
    assert h["model.layers.0.mlp.experts.gate_up_proj_blocks"].shape == (4, 128, 2, 16)  # [E, N, K/32, 16]
    assert h["model.layers.0.mlp.experts.gate_up_proj_scales"].shape == (4, 128, 2)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "mxfp4"
    assert {"model.layers.0.mlp.router", "model.layers.0.self_attn.q_proj"} <= set(qc["modules_to_not_convert"])
    code, o, _ = run_cli("verify", out, "--reference", src, "--exact", "--json")
    doc = json.loads(o)
    assert code == 0 and all(t["exact_identical_fraction"] == 1.0 for t in doc["tensors"])
    assert doc["tensors"][0]["scale_rule_matches"] == "rceil"


def test_fp8_block_layout_loads_through_transformers_finegrained_fp8(tiny_llama, tmp_path, run_cli):
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    out = tmp_path / "fp8b"
    assert run_cli("convert", tiny_llama, out, "--recipe", "fp8-block", "--quiet")[0] == 0
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                 quantization_config=FineGrainedFP8Config(dequantize=True))
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cos = float(torch.nn.functional.cosine_similarity(model(ids).logits.flatten(), ref(ids).logits.flatten(),
                                                          dim=0))
    assert 0.99 < cos < 1.0  # weight_scale_inv applied (multiply), and really quantized


def _gpt_oss(tmp_path) -> Path:
    from quantcli.checkpoint.safetensors_io import write_file

    src = tmp_path / "goss-dense"
    src.mkdir()
    g = torch.Generator().manual_seed(1)
    write_file(src / "model.safetensors", {
        "model.layers.0.mlp.experts.gate_up_proj": torch.randn(4, 64, 128, generator=g).bfloat16(),
        "model.layers.0.mlp.experts.down_proj": torch.randn(4, 64, 64, generator=g).bfloat16(),
        "model.layers.0.mlp.router.weight": torch.randn(4, 64, generator=g).bfloat16(),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64, generator=g).bfloat16()})
    (src / "config.json").write_text(json.dumps({"model_type": "gpt_oss", "num_hidden_layers": 1}))
    return src


@pytest.mark.parametrize("recipe", ["nvfp4", "fp8-block", "mxfp4"])
def test_expert_stacks_a_layout_cannot_hold_are_refused_not_left_dense(tmp_path, run_cli, recipe):
    """3-D gpt-oss expert stacks under a layout with no 3-D names: refused in one line, nothing
    written; with --ignore they stay dense and the exclusion list names their MoE layer (the
    name vLLM and SGLang check), so verify passes; an output that leaves them dense unlisted
    fails verify's coverage check."""
    src, out = _gpt_oss(tmp_path), tmp_path / "q"
    code, _, err = run_cli("convert", src, out, "--recipe", recipe)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "model.layers.*.mlp.experts" in lines[0], err
    assert not out.exists() and not (tmp_path / "q.partial").exists()
    code, _, err = run_cli("convert", src, out, "--recipe", recipe, "--ignore", "model.layers.*.mlp.experts",
                           "--quiet")
    assert code == 0, err
    code, o, _ = run_cli("verify", out, "--reference", src, "--json")
    doc = json.loads(o)
    assert code == 0, doc
    hf = out / "hf_quant_config.json"
    listed = (json.loads(hf.read_text())["quantization"]["exclude_modules"] if hf.exists() else
              json.loads((out / "config.json").read_text())["quantization_config"].get("ignore")
              or json.loads((out / "config.json").read_text())["quantization_config"].get("modules_to_not_convert"))
    assert "model.layers.0.mlp.experts" in listed, listed


def test_verify_fails_a_dense_expert_stack_missing_from_the_exclusion_list(tmp_path, run_cli):
    src, out = _gpt_oss(tmp_path), tmp_path / "q"
    assert run_cli("convert", src, out, "--recipe", "nvfp4", "--ignore", "model.layers.*.mlp.experts",
                   "--quiet")[0] == 0
    hf = out / "hf_quant_config.json"  # as another tool would write it: the experts left out of the list
    doc = json.loads(hf.read_text())
    doc["quantization"]["exclude_modules"].remove("model.layers.0.mlp.experts")
    hf.write_text(json.dumps(doc))
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["exclude_modules"] = doc["quantization"]["exclude_modules"]
    (out / "config.json").write_text(json.dumps(cfg))
    code, o, _ = run_cli("verify", out, "--json")
    faults = json.dumps(json.loads(o))
    assert code == 1 and "model.layers.0.mlp.experts" in faults and "expert stack" in faults


def test_an_moe_layer_is_quantized_whole_or_left_dense_whole(tmp_path, run_cli):
    """Ignoring one stack of a gpt-oss MoE layer while the other is quantized is refused (the
    exclusion list can only name the whole layer); verify fails a checkpoint that quantizes an
    expert stack whose MoE layer its exclusion list names."""
    src, out = _gpt_oss(tmp_path), tmp_path / "q"
    toml = "recipes/examples/mxfp4-gpt-oss-experts.toml"
    code, _, err = run_cli("convert", src, out, "--config", toml, "--ignore", "model.layers.*.mlp.experts.down_proj")
    assert code == 2 and "model.layers.*.mlp.experts" in err and not out.exists(), err
    assert run_cli("convert", src, out, "--config", toml, "--quiet")[0] == 0
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"].append("model.layers.0.mlp.experts")
    (out / "config.json").write_text(json.dumps(cfg))
    code, o, _ = run_cli("verify", out, "--json")
    assert code == 1 and "is in the exclusion list" in o, o


EXAMPLE = Path(__file__).resolve().parents[1] / "recipes" / "examples" / "nvfp4-experts-fp8-attention.toml"


def test_example_recipe_plans_the_moe_without_warnings(one_shard_moe, tmp_path, run_cli):
    code, out, err = run_cli("convert", str(one_shard_moe), str(tmp_path / "o"), "--config", str(EXAMPLE), "--dry-run",
                             "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["warnings"] == [] and "warning" not in err
    assert {"nvfp4", "fp8-block"} <= set(doc["recipes"])
