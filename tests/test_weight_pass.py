"""The weight-pass seam (quantcli/convert/passes): a pass that rounds each Linear to nearest with
its recipe's own quantizer (tests/nearest_pass.py) writes, through its staged products, the bytes
of a plain conversion, dense and MoE, with static activation and KV-cache scales or a weighted
scale search; the shard job writes what was staged instead of quantizing; each layer's statistic
is the sum over batches of the inputs that the *quantized* layers before it give."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from faults import tree_state
from nearest_pass import NearestPass, decoded, install, reference_statistics

import quantcli.convert.shard as shard
from quantcli.testing import make_llama, make_moe

transformers = pytest.importorskip("transformers")
CASES = {"nvfp4-static": ("llama", ["--recipe", "nvfp4", "--activations", "static", "--kv-cache", "fp8"]),
         "mxfp4-search": ("llama", ["--recipe", "mxfp4", "--scale-search", "mse"]),
         "fp8-modelopt": ("llama", ["--recipe", "fp8", "--layout", "modelopt", "--activations", "static",
                                    "--kv-cache", "fp8"]),
         "nvfp4-moe": ("moe", ["--recipe", "nvfp4", "--layout", "modelopt", "--kv-cache", "fp8"])}


def _ids() -> list[list[int]]:
    return [[(7 * i + 13 * j) % 512 for j in range(8 + 4 * (i % 3))] for i in range(5)]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("weights")
    data = tmp / "ids.jsonl"
    data.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in _ids()))
    return {"tmp": tmp, "data": data, "llama": make_llama(tmp / "llama", hidden=64, layers=2, shards=2),
            "moe": make_moe(tmp / "moe", hidden=64, layers=2, shards=2, experts=4)}


def _argv(env, src: Path, out: Path, args: list[str]) -> list[str]:
    return ["convert", str(src), str(out), *args, "--calibration", str(env["data"]), "--device", "cpu", "--quiet"]


def _quantized_modules(out: Path) -> set[str]:
    manifest = json.loads((out / "quantcli_manifest.json").read_text())
    return {m["module"] for m in manifest["modules"]}


@pytest.mark.parametrize("case", sorted(CASES))
def test_rounding_to_nearest_as_a_weight_pass_writes_a_plain_conversions_bytes(env, tmp_path, run_cli, monkeypatch,
                                                                               case):
    which, args = CASES[case]
    plain, rounded = tmp_path / "plain", tmp_path / "rounded"
    assert run_cli(*_argv(env, env[which], plain, args))[0] == 0
    wp = install(NearestPass())
    produced, real = [], shard.produce

    def counting(reader, t, facts):
        produced.append(t)
        return real(reader, t, facts)

    monkeypatch.setattr(shard, "produce", counting)
    code, _, err = run_cli(*_argv(env, env[which], rounded, args))
    assert code == 0, err
    assert tree_state(rounded) == tree_state(plain)  # shards, configs and manifest, byte for byte
    assert sorted(wp.rounded) == sorted(_quantized_modules(plain))
    assert not [t.name for t in produced if t.quantized], "the shard job quantized what the pass staged"
    tokens = sum(map(len, _ids()))
    assert all(n == tokens for m, (_, n) in wp.statistics.items() if ".experts." not in m)
    assert all(s.shape == (s.shape[0], s.shape[0]) and s.dtype == torch.float64 for s, _ in wp.statistics.values())


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    found = {}
    for f in sorted(folder.glob("*.safetensors")):
        found.update(load_file(f))
    return found


def test_the_shard_job_writes_a_staged_product_as_it_is(env, tmp_path, run_cli):
    """A pass that rounds -W for one module: what it staged is what DST holds for that module,
    which equals a plain conversion of a source holding -W there (and nothing else moved)."""
    from safetensors.torch import load_file, save_file

    module = "model.layers.0.self_attn.o_proj"
    negated = tmp_path / "negated"
    shutil.copytree(env["llama"], negated)
    for f in negated.glob("*.safetensors"):
        tensors = load_file(f)
        if f"{module}.weight" in tensors:
            tensors[f"{module}.weight"] = -tensors[f"{module}.weight"]
            save_file(tensors, f, metadata={"format": "pt"})
    args = ["--recipe", "nvfp4", "--kv-cache", "fp8"]
    assert run_cli(*_argv(env, env["llama"], tmp_path / "plain", args))[0] == 0
    assert run_cli(*_argv(env, negated, tmp_path / "plain-negated", args))[0] == 0
    install(NearestPass(negate=frozenset({module})))
    assert run_cli(*_argv(env, env["llama"], tmp_path / "rounded", args))[0] == 0
    got, plain, want = (_tensors(tmp_path / n) for n in ("rounded", "plain", "plain-negated"))
    for name, t in got.items():
        if name.startswith(f"{module}.weight"):  # codes, block scales, global scale
            assert torch.equal(t, want[name]), name
            assert name != f"{module}.weight" or not torch.equal(t, plain[name])  # really the other codes
        elif name.startswith("model.layers.0."):
            assert torch.equal(t, plain[name]), name


def _reference_statistics(src: Path, decoded_layer0: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """X^T X of layer 1's Linears in the full transformers model whose layer-0 Linears hold
    `decoded_layer0`, the samples one batch each, in order."""
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    return reference_statistics(model, "model.layers.1", [{"input_ids": torch.tensor([s])} for s in _ids()],
                                decoded_layer0)


def test_each_layers_statistic_sums_the_inputs_the_quantized_layers_before_it_give(env, tmp_path, run_cli):
    wp = install(NearestPass())
    out = tmp_path / "out"
    assert run_cli(*_argv(env, env["llama"], out, CASES["mxfp4-search"][1]))[0] == 0
    layer0 = sorted(m for m in wp.statistics if m.startswith("model.layers.0."))
    quantized = _reference_statistics(env["llama"], decoded(run_cli, out, tmp_path / "dense", layer0))
    dense = _reference_statistics(env["llama"], {})
    for m, ref in quantized.items():
        got = wp.statistics[m][0]
        assert torch.allclose(got, ref, rtol=1e-9, atol=1e-9), m
        assert (got - dense[m]).norm() > 1000 * (got - ref).norm(), m  # not the unquantized model's inputs


@pytest.fixture(autouse=True)
def _no_weight_pass_left(monkeypatch):
    """Each test installs the pass it needs; none outlives it."""
    import quantcli.convert.passes as passes

    monkeypatch.setattr(passes, "WEIGHT_PASSES", ())
