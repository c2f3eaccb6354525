"""Every command on every architecture of the matrix (quantcli/testing.py MATRIX): tiny random
models built from transformers' own config classes, each through convert (four recipes) and
verify, static activation and KV-cache calibration, GPTQ, and eval, whose figures must equal
transformers' own FP32 forward of the source and of the decoded checkpoint."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from quantcli.testing import MATRIX, MATRIX_MLA, MATRIX_STACKS, make_tiny

STACKS = {mt: ["--ignore", "*.experts"] for mt in MATRIX_STACKS}
MLA = MATRIX_MLA
ENCODER = {mt for mt, cls, _ in MATRIX if cls.endswith("Model")}
IDS = [mt for mt, _, _ in MATRIX]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("archs")
    rng = random.Random(0)
    data = root / "ids.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [rng.randrange(1, 500) for _ in range(12)]}) + "\n"
                            for _ in range(4)))
    return {"root": root, "data": data, "built": {}}


def _src(zoo: dict, mt: str) -> Path:
    if mt not in zoo["built"]:
        cls = next(c for m, c, _ in MATRIX if m == mt)
        zoo["built"][mt] = make_tiny(zoo["root"] / mt, mt, cls)
    return zoo["built"][mt]


def _ok(run_cli, *args) -> str:
    code, out, err = run_cli(*map(str, args))
    assert code == 0, err
    return out


@pytest.mark.parametrize("mt", IDS)
def test_convert_and_verify_every_recipe(zoo, run_cli, mt):
    src = _src(zoo, mt)
    for recipe in ("nvfp4", "fp8-block", "int4", "mxfp4"):
        out = zoo["root"] / f"{mt}-{recipe}"
        _ok(run_cli, "convert", src, out, "--recipe", recipe, "-q", *STACKS.get(mt, []))
        _ok(run_cli, "verify", out, "--reference", src, "-q")


@pytest.mark.parametrize("mt", IDS)
def test_static_scales_kv_cache_and_gptq(zoo, run_cli, mt):
    src, data, root = _src(zoo, mt), zoo["data"], zoo["root"]
    kv = [] if mt in ENCODER | MLA else ["--kv-cache", "fp8"]
    static = root / f"{mt}-static"
    _ok(run_cli, "convert", src, static, "--recipe", "nvfp4", "--activations", "static", *kv, "--calibration", data,
        "-q", *STACKS.get(mt, []))
    _ok(run_cli, "verify", static, "--reference", src, "--calibration", data, "-q")
    if mt in MLA:
        code, _, err = run_cli("convert", src, root / f"{mt}-kv", "--recipe", "nvfp4", "--kv-cache", "fp8",
                               "--calibration", data)
        assert code == 2 and "compressed latent (MLA)" in err and len(err.strip().splitlines()) == 1
    gptq = root / f"{mt}-gptq"
    _ok(run_cli, "convert", src, gptq, "--recipe", "nvfp4", "--rounding", "gptq", "--calibration", data, "-q",
        *STACKS.get(mt, []))
    manifest = json.loads((gptq / "quantcli_manifest.json").read_text())
    methods = {m["rounding"]["method"] for m in manifest["modules"] if m.get("rounding")}
    assert "gptq" in methods, methods  # GPTQ reached the layers' Linears
    _ok(run_cli, "verify", gptq, "--reference", src, "-q")


def test_gptq_rounds_gpt_oss_expert_stacks_expert_by_expert(zoo, run_cli):
    src, data, out = _src(zoo, "gpt_oss"), zoo["data"], zoo["root"] / "gpt-oss-stacks-gptq"
    card = Path(__file__).resolve().parents[1] / "recipes" / "examples" / "mxfp4-gpt-oss-experts.toml"
    _ok(run_cli, "convert", src, out, "--config", card, "--rounding", "gptq", "--calibration", data,
        "--gptq-min-tokens", "1", "-q")
    records = [m["rounding"] for m in json.loads((out / "quantcli_manifest.json").read_text())["modules"]]
    assert len(records) == 4 and all(r["method"] == "gptq" and r["experts"] == r["experts_gptq"] == 4 for r in records)
    assert all(r["output_error"] < r["nearest_output_error"] for r in records)
    text = _ok(run_cli, "verify", out, "--reference", src, "--exact", "--calibration", data)
    assert "4 of 4 GPTQ module(s) byte-identical" in text


def _transformers_figures(folder: Path, samples: list[list[int]], encoder: bool, reference=None):
    """Perplexity over the next-token positions (causal LM), or the mean-pooled last hidden
    states (encoder), from transformers' own FP32 forward of `folder`."""
    import transformers

    arch = json.loads((folder / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, arch).from_pretrained(folder, dtype=torch.float32).eval()
    nll, count, pooled = 0.0, 0, []
    with torch.inference_mode():
        for s in samples:
            out = model(input_ids=torch.tensor([s]))
            if encoder:
                pooled.append(out.last_hidden_state[0].double().mean(0))
                continue
            logp = torch.log_softmax(out.logits[0, :-1].double(), dim=-1)
            nll -= float(logp.gather(-1, torch.tensor(s[1:])[:, None]).sum())
            count += len(s) - 1
    return pooled if encoder else float(torch.tensor(nll / count).exp())


@pytest.mark.parametrize("mt", IDS)
def test_eval_equals_transformers_forward(zoo, run_cli, mt):
    src, data, root = _src(zoo, mt), zoo["data"], zoo["root"]
    out, dense = root / f"{mt}-eval-nvfp4", root / f"{mt}-eval-dense"
    _ok(run_cli, "convert", src, out, "--recipe", "nvfp4", "-q", *STACKS.get(mt, []))
    _ok(run_cli, "convert", out, dense, "--recipe", "fp32", "-q")
    doc = json.loads(_ok(run_cli, "eval", out, "--reference", src, "--data", data, "--json"))
    samples = [json.loads(line)["input_ids"] for line in data.read_text().splitlines()]
    if mt in ENCODER:
        a, b = (_transformers_figures(f, samples, True) for f in (src, dense))
        cosine = sum(float(torch.nn.functional.cosine_similarity(x, y, dim=0)) for x, y in zip(a, b)) / len(a)
        assert doc["encoder"]["cosine_mean"] == pytest.approx(cosine, rel=1e-4, abs=1e-6)
        return
    ref, quant = (_transformers_figures(f, samples, False) for f in (src, dense))
    assert doc["causal"]["perplexity_reference"] == pytest.approx(ref, rel=1e-4)
    assert doc["causal"]["perplexity_quantized"] == pytest.approx(quant, rel=1e-4)
    assert doc["causal"]["perplexity_quantized"] != doc["causal"]["perplexity_reference"]


def test_docs_table_is_generated_from_the_matrix():
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "scripts" / "architectures_table.py"), "--check"],
                          capture_output=True, text=True)
    assert done.returncode == 0, "docs/architectures.md is stale: run python scripts/architectures_table.py"


@pytest.mark.parametrize("mt", IDS)
def test_gptq_s_observed_run_stopping_early_writes_the_same_bytes(zoo, run_cli, mt, monkeypatch, whole_batches):
    # one sample a batch, so batches 2-4 stop once they reached every module a layer rounds
    # (weight_walk.py); the same conversion with every batch run whole must write the same bytes
    from faults import tree_state

    from quantcli.convert.passes import weight_walk
    from quantcli.model.layers import Observed

    src, data, root = _src(zoo, mt), zoo["data"], zoo["root"]
    stops = []

    class Counted(Observed):
        def __init__(self, *args):
            stops.append(1)
            super().__init__(*args)

    monkeypatch.setattr(weight_walk, "Observed", Counted)
    args = ["--recipe", "nvfp4", "--rounding", "gptq", "--calibration", data, "--calibration-batch", "1", "-q",
            *STACKS.get(mt, [])]
    _ok(run_cli, "convert", src, root / f"{mt}-stopped", *args)
    whole_batches()
    _ok(run_cli, "convert", src, root / f"{mt}-whole", *args)
    assert stops  # 2 layers x 3 batches stop where each reached every module (an MoE's: every expert)
    assert tree_state(root / f"{mt}-stopped") == tree_state(root / f"{mt}-whole")
