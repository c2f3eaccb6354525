"""Calibrating MoE checkpoints (Mixtral, Qwen2-MoE) and what the forward never reaches.

The reference statistics are recorded here without quantcli's engine: the full transformers
model in FP32, a hook on each MoE block's input, the router recomputed from the checkpoint's
gate weights (softmax, top-k) and each expert's gate/up/down Linear applied from the
checkpoint's per-expert tensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from faults import fault_env

from quantcli.testing import make_llama, make_moe

transformers = pytest.importorskip("transformers")


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    found = {}
    for f in sorted(folder.glob("*.safetensors")):
        found.update(load_file(f))
    return found


def _ids(n: int = 4, length: int = 10) -> list[list[int]]:
    return [[(11 * i + 5 * j + 3) % 512 for j in range(length)] for i in range(n)]


def _data(path: Path, ids: list[list[int]]) -> Path:
    path.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in ids))
    return path


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * abs(b)


def _mixtral_reference(src: Path, ids) -> dict[str, float]:
    """max |input| of every expert Linear (w1, w3, w2) and attention Linear, by checkpoint name."""
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    w = {k: v.float() for k, v in _tensors(src).items()}
    k = model.config.num_experts_per_tok
    found: dict[str, float] = {}

    def put(name, x):
        if x.numel():
            found[name] = max(found.get(name, 0.0), float(x.abs().amax()))

    def moe_hook(block, args, prefix):
        x = args[0].reshape(-1, args[0].shape[-1])
        probs = torch.softmax(x @ w[f"{prefix}.gate.weight"].T, dim=-1)
        chosen = torch.topk(probs, k, dim=-1).indices
        for e in range(model.config.num_local_experts):
            xe = x[(chosen == e).any(-1)]
            ex = f"{prefix}.experts.{e}"
            put(f"{ex}.w1", xe)
            put(f"{ex}.w3", xe)
            h = torch.nn.functional.silu(xe @ w[f"{ex}.w1.weight"].T) * (xe @ w[f"{ex}.w3.weight"].T)
            put(f"{ex}.w2", h)

    hooks = []
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}.block_sparse_moe"
        hooks.append(layer.mlp.register_forward_pre_hook(lambda m, a, p=prefix: moe_hook(m, a, p)))
        for leaf in ("q_proj", "k_proj", "v_proj", "o_proj"):
            name = f"model.layers.{i}.self_attn.{leaf}"
            hooks.append(getattr(layer.self_attn, leaf).register_forward_pre_hook(
                lambda m, a, n=name: put(n, a[0])))
    with torch.no_grad():
        for s in ids:
            model(input_ids=torch.tensor([s]))
    for h in hooks:
        h.remove()
    return found


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Path:
    return make_moe(tmp_path_factory.mktemp("moe") / "mixtral", hidden=64, layers=2, shards=2, experts=8)


def test_mixtral_expert_scales_equal_reference(mixtral, tmp_path, run_cli):
    ids = _ids()
    out = tmp_path / "out"
    code, _, err = run_cli("convert", str(mixtral), str(out), "--recipe", "nvfp4", "--layout", "modelopt",
                           "--activations", "static", "--kv-cache", "fp8",
                           "--calibration", str(_data(tmp_path / "ids.jsonl", ids)), "--quiet")
    assert code == 0, err
    ref = _mixtral_reference(mixtral, ids)
    t = _tensors(out)
    checked = 0
    for module, amax in ref.items():
        leaf = module.rpartition(".")[2]
        group = {"q_proj": ("q_proj", "k_proj", "v_proj"), "w1": ("w1", "w3"), "w3": ("w1", "w3")}.get(leaf, (leaf,))
        parent = module.rpartition(".")[0]
        shared = max(ref[f"{parent}.{m}"] for m in group if f"{parent}.{m}" in ref) \
            if leaf not in ("k_proj", "v_proj") \
            else max(ref[f"{parent}.{m}"] for m in ("q_proj", "k_proj", "v_proj"))
        assert _close(float(t[f"{module}.input_scale"]), shared / 2688.0), module
        checked += 1
    assert checked >= 2 * (4 + 8 * 3) - 8  # attention + nearly every expert was routed something
    assert all(f"model.layers.{i}.self_attn.k_proj.k_scale" in t for i in range(2))


def test_unrouted_expert_takes_block_max_and_is_named(mixtral, tmp_path, run_cli):
    """One sample of two tokens, top-2 of 8 experts: at most 4 experts per layer see a token."""
    ids = [[5, 9]]
    out = tmp_path / "out"
    code, stdout, err = run_cli("convert", str(mixtral), str(out), "--recipe", "fp8", "--layout", "compressed-tensors",
                                "--activations", "static", "--calibration", str(_data(tmp_path / "d.jsonl", ids)))
    assert code == 0, err
    ref = _mixtral_reference(mixtral, ids)
    t = _tensors(out)
    notes = json.loads((out / "quantcli_manifest.json").read_text()).get("notes", [])
    for layer in range(2):
        prefix = f"model.layers.{layer}.block_sparse_moe.experts"
        gate_up_max = max(v for m, v in ref.items() if m.startswith(prefix) and m.endswith((".w1", ".w3")))
        down_max = max(v for m, v in ref.items() if m.startswith(prefix) and m.endswith(".w2"))
        unrouted = [e for e in range(8) if f"{prefix}.{e}.w1" not in ref]
        assert len(unrouted) >= 4
        for e in unrouted:
            assert _close(float(t[f"{prefix}.{e}.w1.input_scale"]), gate_up_max / 448.0)
            assert _close(float(t[f"{prefix}.{e}.w2.input_scale"]), down_max / 448.0)
            assert any(n.startswith(f"{prefix}.{e}: no calibration token") for n in notes), (e, notes)
            assert f"{prefix}.{e}: no calibration token" in stdout + err


@pytest.fixture(scope="module")
def qwen_moe(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    config = transformers.Qwen2MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                         moe_intermediate_size=64, shared_expert_intermediate_size=128,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                         num_experts=4, num_experts_per_tok=2, max_position_embeddings=128)
    out = tmp_path_factory.mktemp("moe") / "qwen"
    transformers.Qwen2MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    return out


def test_qwen2_moe_shared_expert_and_experts_calibrated(qwen_moe, tmp_path, run_cli):
    out = tmp_path / "out"
    code, _, err = run_cli("convert", str(qwen_moe), str(out), "--recipe", "nvfp4", "--layout", "compressed-tensors",
                           "--activations", "static",
                           "--calibration", str(_data(tmp_path / "ids.jsonl", _ids(6, 16))), "--quiet")
    assert code == 0, err
    t = _tensors(out)
    names = [n for n in t if n.endswith(".input_global_scale")]
    assert any(".mlp.shared_expert.down_proj." in n for n in names)
    assert sum(".mlp.experts." in n for n in names) == 4 * 3
    assert all(torch.isfinite(t[n]).all() and float(t[n]) > 0 for n in names)
    # gate and up of an expert share one input scale (one fused GEMM in the engines)
    assert torch.equal(t["model.layers.0.mlp.experts.1.gate_proj.input_global_scale"],
                       t["model.layers.0.mlp.experts.1.up_proj.input_global_scale"])


def test_weights_beyond_the_forward_left_dense_with_reason(tmp_path, run_cli):
    """A layer the config does not run (an MTP-style extra layer) gets no made-up input scale."""
    src = make_llama(tmp_path / "llama", hidden=64, layers=1, shards=1)
    from safetensors.torch import save_file

    (shard,) = sorted(src.glob("*.safetensors"))
    t = _tensors(src)
    extra = {n.replace("layers.0.", "layers.1."): v.clone() for n, v in t.items() if n.startswith("model.layers.0.")}
    save_file({**t, **extra}, str(shard), metadata={"format": "pt"})
    out = tmp_path / "out"
    args = ("convert", str(src), str(out), "--recipe", "fp8", "--activations", "static",
            "--calibration", str(_data(tmp_path / "ids.jsonl", _ids())))
    code, stdout, err = run_cli(*args, "--dry-run", "--json")
    assert code == 0, err
    excluded = json.dumps(json.loads(stdout)["excluded"])
    assert "model.layers.1.self_attn.q_proj" in excluded and "not in the model's forward" in excluded
    code, _, err = run_cli(*args, "--quiet")
    assert code == 0, err
    written = _tensors(out)
    assert written["model.layers.1.mlp.down_proj.weight"].dtype == torch.bfloat16
    assert "model.layers.1.mlp.down_proj.input_scale" not in written
    assert written["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignored_layers"]
    assert "model.layers.1.mlp.down_proj" in ignore


def test_spilled_activation_buffer_is_byte_identical(mixtral, tmp_path, run_cli, monkeypatch):
    data = _data(tmp_path / "ids.jsonl", _ids())
    outs = []
    for name, budget in (("memory", "4"), ("disk", "0")):
        monkeypatch.setenv("QUANTCLI_CALIBRATION_BUFFER_GIB", budget)
        out = tmp_path / name
        code, _, err = run_cli("convert", str(mixtral), str(out), "--recipe", "nvfp4", "--activations", "static",
                               "--kv-cache", "fp8", "--layout", "modelopt", "--calibration", str(data), "--quiet")
        assert code == 0, err
        outs.append({p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors"))})
    assert outs[0] == outs[1]


def test_bad_buffer_budget_refused(mixtral, tmp_path, run_cli, monkeypatch):
    monkeypatch.setenv("QUANTCLI_CALIBRATION_BUFFER_GIB", "lots")
    code, _, err = run_cli("convert", str(mixtral), str(tmp_path / "out"), "--recipe", "nvfp4", "--kv-cache", "fp8",
                           "--layout", "modelopt", "--calibration", str(_data(tmp_path / "d.jsonl", _ids())))
    assert code == 2 and "QUANTCLI_CALIBRATION_BUFFER_GIB" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_resume_reuses_the_calibration_and_output_is_identical(mixtral, tmp_path, run_cli, monkeypatch):
    """Killed after the first shard: --resume finishes without calibrating again (the engine
    would raise), byte-identical to an uninterrupted run; the cache never reaches DST."""
    import os
    import subprocess
    import sys

    data = _data(tmp_path / "ids.jsonl", _ids())
    args = ["convert", str(mixtral), "--recipe", "nvfp4", "--layout", "modelopt", "--activations", "static",
            "--kv-cache", "fp8", "--calibration", str(data), "--quiet"]
    assert run_cli(args[0], args[1], str(tmp_path / "clean"), *args[2:])[0] == 0
    out = tmp_path / "out"
    env = {**os.environ, **fault_env(kill_after_shards=1)}
    proc = subprocess.run([sys.executable, "-m", "quantcli", args[0], args[1], str(out), *args[2:]], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    assert (tmp_path / "out.partial" / ".quantcli-calibration.safetensors").is_file()

    def no_second_calibration(*a, **k):
        raise AssertionError("calibrated again on --resume")

    monkeypatch.setattr("quantcli.calibrate.run.collect", no_second_calibration)
    code, _, err = run_cli(args[0], args[1], str(out), *args[2:], "--resume")
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in (tmp_path / "clean").iterdir())
    for p in (tmp_path / "clean").glob("*.safetensors"):
        assert (out / p.name).read_bytes() == p.read_bytes(), p.name
    assert (out / "quantcli_manifest.json").read_text() == (tmp_path / "clean" / "quantcli_manifest.json").read_text()


ALLOCATOR_CHECK = """
import resource, torch
from quantcli.memory import fix_malloc_thresholds, release_freed_memory
assert fix_malloc_thresholds()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
for _ in range(3):  # the heap grows to hold one batch's activation; torch's threads start
    torch.ones(512, 2816).sum()
before = faults()
for _ in range(100):  # a batch's activations (5.8 MB), freed and allocated again batch after batch
    torch.ones(512, 2816).sum()
print(faults() - before)
small = [torch.ones(2**18) for _ in range(200)]  # 200 MiB of 1 MiB heap blocks, then freed
held = rss()
del small
release_freed_memory()
print(held - rss())
"""


def test_the_walks_allocator_reuses_a_batchs_memory_and_gives_freed_layers_back_on_glibc():
    """quantcli/memory.py: with the walks' thresholds a batch's activations come from heap memory
    already faulted in (at the 128 KiB the walks fixed before, each was a fresh mapping: a
    2048-wide Llama layer ran 1.7x slower), and release_freed_memory, run after each layer,
    returns freed blocks to the OS (without a fix, glibc's own adjustment let memory grow ~15
    MiB per layer at hidden 1024)."""
    import platform
    import subprocess
    import sys

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc only")
    out = subprocess.run([sys.executable, "-c", ALLOCATOR_CHECK], check=True, capture_output=True, text=True).stdout
    faults, returned = map(int, out.split())
    assert faults < 10 * 1408  # 100 fresh mappings would fault 100 x 1408 pages
    assert returned > 150 * 2**20
