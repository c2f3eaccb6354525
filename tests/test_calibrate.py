"""Calibrated scales (--activations static, --kv-cache fp8): the written input_scale /
input_global_scale / k_scale / v_scale equal amax / divisor of tensors recorded here with plain
hooks on the full transformers model in FP32; reruns are byte-identical; refusals write nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from quantcli.testing import make_llama

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return make_llama(tmp_path_factory.mktemp("cal") / "llama", hidden=64, layers=2, shards=2)


def _ids() -> list[list[int]]:
    return [[(7 * i + 13 * j) % 512 for j in range(12 + 4 * (i % 2))] for i in range(5)]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "ids.jsonl"
    path.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in _ids()))
    return path


def _reference(src: Path) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """max |input| per Linear, max |key| after rotary and max |value| per attention, from the
    full model in FP32 with forward hooks (no quantcli code)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    inputs, keys, values = {}, {}, {}
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name != "lm_head":
            hooks.append(mod.register_forward_pre_hook(
                lambda m, a, n=name: inputs.__setitem__(n, max(inputs.get(n, 0.0), float(a[0].abs().amax()))),
            ))
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    for i, layer in enumerate(model.model.layers):
        attn = f"model.layers.{i}.self_attn"

        def k_hook(m, a, out, attn=attn):
            k = out.view(*out.shape[:-1], -1, head_dim).transpose(1, 2)
            pos = torch.arange(out.shape[1])[None]
            cos, sin = model.model.rotary_emb(out, pos)
            _, k = apply_rotary_pos_emb(k, k, cos, sin)
            keys[attn] = max(keys.get(attn, 0.0), float(k.abs().amax()))

        hooks.append(layer.self_attn.k_proj.register_forward_hook(k_hook))
        hooks.append(layer.self_attn.v_proj.register_forward_hook(
            lambda m, a, out, attn=attn: values.__setitem__(attn, max(values.get(attn, 0.0), float(out.abs().amax())))))
    with torch.no_grad():
        for s in _ids():
            model(input_ids=torch.tensor([s]))
    for h in hooks:
        h.remove()
    return inputs, keys, values


def _tensors(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    found = {}
    for f in sorted(out.glob("*.safetensors")):
        found.update(load_file(f))
    return found


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * abs(b)


@pytest.mark.parametrize("recipe,layout", [("nvfp4", "modelopt"), ("nvfp4", "compressed-tensors"),
                                           ("fp8", "compressed-tensors"), ("fp8", "modelopt"), ("fp8", "fp8")])
def test_scales_equal_hooked_amax(src, data, tmp_path, run_cli, recipe, layout):
    out = tmp_path / "out"
    code, _, err = run_cli("convert", str(src), str(out), "--recipe", recipe, "--layout", layout,
                           "--activations", "static", "--kv-cache", "fp8", "--calibration", str(data), "--quiet")
    assert code == 0, err
    inputs, keys, values = _reference(src)
    t = _tensors(out)
    divisor = 2688.0 if recipe == "nvfp4" else 448.0
    group = {"q_proj": "q_proj", "k_proj": "q_proj", "v_proj": "q_proj", "gate_proj": "gate_proj",
             "up_proj": "gate_proj", "o_proj": "o_proj", "down_proj": "down_proj"}
    for module, amax in inputs.items():
        parent, _, leaf = module.rpartition(".")
        shared = max(inputs[f"{parent}.{m}"] for m, g in group.items() if g == group[leaf])
        if layout == "compressed-tensors" and recipe == "nvfp4":
            got = 1.0 / float(t[f"{module}.input_global_scale"])
        else:
            got = float(t[f"{module}.input_scale"])
        assert _close(got, shared / divisor), module
    for attn in keys:
        if layout == "modelopt":
            k, v = t[f"{attn}.k_proj.k_scale"], t[f"{attn}.v_proj.v_scale"]
            assert k.shape == () and k.dtype == torch.float32
        elif layout == "fp8":  # what vLLM's and SGLang's Fp8KVCacheMethod read, as `self_attn.attn.k_scale`
            k, v = t[f"{attn}.k_scale"], t[f"{attn}.v_scale"]
            assert k.shape == () and v.shape == () and k.dtype == torch.float32
        else:
            k, v = t[f"{attn}.k_scale"], t[f"{attn}.v_scale"]
            assert k.shape == (1,) and k.dtype == torch.float32
        assert _close(float(k), keys[attn] / 448.0) and _close(float(v), values[attn] / 448.0), attn
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    if layout == "modelopt":
        hq = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
        assert hq["quant_algo"] == {"nvfp4": "NVFP4", "fp8": "FP8"}[recipe] and hq["kv_cache_quant_algo"] == "FP8"
        if recipe == "fp8":  # 0-d F32 weight and input scales (docs/formats.md, "ModelOpt FP8 and NVFP4 scales")
            assert t["model.layers.0.mlp.down_proj.weight_scale"].shape == ()
            assert t["model.layers.0.mlp.down_proj.input_scale"].shape == ()
    elif layout == "fp8":  # SGLang turns its cache to FP8 from this key; the card tells vLLM's flag
        assert qc["kv_cache_quant_algo"] == "FP8" and qc["activation_scheme"] == "static"
        assert t["model.layers.0.mlp.down_proj.input_scale"].shape == ()
        assert "vllm serve MODEL --kv-cache-dtype fp8\n" in (out / "README.md").read_text()
    else:
        assert qc["kv_cache_scheme"]["num_bits"] == 8
        assert qc["config_groups"]["group_0"]["input_activations"]["dynamic"] in (False, "local")


def test_rerun_is_byte_identical(src, data, tmp_path, run_cli):
    outs = []
    for name in ("a", "b"):
        out = tmp_path / name
        code, _, err = run_cli("convert", str(src), str(out), "--recipe", "nvfp4", "--activations", "static",
                               "--kv-cache", "fp8", "--calibration", str(data), "--quiet")
        assert code == 0, err
        outs.append({p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.suffix != ".md"})
    assert outs[0] == outs[1]


def test_text_data_with_tokenizer_free_ids_txt_refused(src, tmp_path, run_cli):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n  \n")
    out = tmp_path / "out"
    code, _, err = run_cli("convert", str(src), str(out), "--recipe", "nvfp4", "--kv-cache", "fp8",
                           "--calibration", str(empty))
    assert code == 2 and "holds no text" in err and len(err.strip().splitlines()) == 1
    assert not out.exists() and not list(tmp_path.glob("out*"))


def test_an_empty_jsonl_is_said_to_hold_no_samples(src, tmp_path, run_cli):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    code, _, err = run_cli("convert", str(src), str(tmp_path / "out"), "--recipe", "nvfp4", "--kv-cache", "fp8",
                           "--calibration", str(empty))
    assert code == 2 and "holds no samples (the file is empty)" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("args,needle", [
    (["--recipe", "nvfp4", "--activations", "static"], "--activations static needs --calibration"),
    (["--recipe", "nvfp4", "--kv-cache", "fp8"], "--kv-cache fp8 needs --calibration"),
    (["--recipe", "mxfp4", "--activations", "static", "--calibration", "DATA"], "recipe mxfp4"),
    (["--recipe", "fp8", "--layout", "modelopt"], "only with static activation scales"),
    (["--recipe", "fp8", "--layout", "modelopt", "--kv-cache", "fp8", "--calibration", "DATA"],
     "only with static activation scales"),
    (["--recipe", "nvfp4", "--kv-cache", "fp8", "--calibration", "missing.jsonl"], "no such file"),
])
def test_refusals_one_line_write_nothing(src, data, tmp_path, run_cli, args, needle):
    args = [str(data) if a == "DATA" else a for a in args]
    out = tmp_path / "out"
    code, _, err = run_cli("convert", str(src), str(out), *args)
    assert code == 2 and needle in err, err
    assert len(err.strip().splitlines()) == 1
    assert not list(tmp_path.glob("out*"))


@pytest.mark.parametrize("arch, needle", [
    ("FalconForCausalLM", "names architecture FalconForCausalLM (a FalconConfig) but model_type 'llama'"),
    ("MyRemoteCodeForCausalLM", "MyRemoteCodeForCausalLM is not a transformers"),
])
def test_architecture_the_walk_cannot_build_refused_before_work(src, tmp_path, data, run_cli, arch, needle):
    import shutil

    other = tmp_path / "other"
    shutil.copytree(src, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "architectures": [arch]}))
    code, _, err = run_cli("convert", str(other), str(tmp_path / "out"), "--recipe", "nvfp4", "--kv-cache", "fp8",
                           "--calibration", str(data))
    assert code == 2 and needle in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_uncalibrated_output_unchanged(src, tmp_path, run_cli):
    out = tmp_path / "out"
    assert run_cli("convert", str(src), str(out), "--recipe", "nvfp4", "--quiet")[0] == 0
    assert not any(k.endswith(("input_scale", "k_scale", "v_scale")) for k in _tensors(out))


def test_the_output_head_runs_only_where_its_input_is_used(src, data, tmp_path, run_cli, monkeypatch):
    """The head's input statistics serve only a quantized head: an unquantized one (every
    convert's: the output head is never quantized) is not run on the batches (a [tokens, vocab]
    product, the embedding and the head loaded in FP32: +0.4 GiB of peak at hidden 2048)."""
    from types import SimpleNamespace

    import quantcli.calibrate.engine as engine

    runs = []
    real = engine.head_inputs
    monkeypatch.setattr(engine, "head_inputs", lambda *a, **k: runs.append(1) or real(*a, **k))
    code, _, err = run_cli("convert", str(src), str(tmp_path / "out"), "--recipe", "nvfp4", "--activations",
                           "static", "--calibration", str(data), "--quiet")
    assert code == 0, err
    assert runs == []
    stack = SimpleNamespace(kind=engine.CAUSAL, head=lambda: "lm_head",
                            names=SimpleNamespace(linear_modules=lambda path: [path]))
    for quantized, head in ((None, "lm_head"), (frozenset({"lm_head"}), "lm_head"), (frozenset({"x"}), None)):
        stats_pass = engine.StatsPass(engine.Stats(), quantized)
        stats_pass.begin(stack)
        assert stats_pass.head == head
