"""eval SRC --auto: the preview of convert --auto. Its choice is convert --dry-run's for the same
flags (the whole record: the same scores to the bit, so the same solve), and its measurement is
eval's of the converted output exactly (eval's emulation is exact: tests/test_eval.py holds
`eval --recipe` to `eval DST --reference SRC` by equality; a mix is the same per-module
quantization with exact-name overrides). The refusals come before any scoring, one line each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantcli.testing import make_llama

pytest.importorskip("transformers")

from tests.test_json_schema import validate  # noqa: E402

# hidden 128: q/k/v takes nvfp4 only (k_proj's N=64 and vLLM's fp8-block rule), the other
# groups either; 6 bits per weight leaves room for a mix of both
AUTO = ("--auto", "nvfp4,fp8-block", "--target-bits", "6")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("auto-eval")
    cal = [[(7 * i + 13 * j + 3) % 512 for j in range(16 + 4 * (i % 2))] for i in range(6)]
    held = [[(5 * i + 11 * j + 1) % 512 for j in range(16)] for i in range(4)]
    for name, ids in (("cal", cal), ("eval", held)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in ids))
    make_llama(root / "llama", hidden=128, layers=2, shards=2)
    return root


def _flags(root: Path) -> tuple:
    return (*AUTO, "--calibration", root / "cal.jsonl", "--device", "cpu")


def _json(run_cli, name: str, *args) -> dict:
    code, out, err = run_cli(*args, "--json")
    assert code == 0, err
    return validate(name, json.loads(out))


def test_preview_is_the_dry_runs_choice_and_the_converted_outputs_eval(run_cli, root, tmp_path):
    src, data = root / "llama", ("--data", root / "eval.jsonl")
    dry = _json(run_cli, "convert-dry-run", "convert", src, tmp_path / "dry", *_flags(root), "--dry-run")
    preview = _json(run_cli, "eval", "eval", src, *_flags(root), *data)
    assert preview["auto"]["choice"] == dry["auto"]  # every group's options, scores and choice
    assert preview["auto"]["predicted_error"] == dry["auto"]["predicted_error"]
    assert {g["choice"] for g in dry["auto"]["groups"]} == {"nvfp4", "fp8-block"}  # a mix, not one recipe
    assert preview["checkpoint"].endswith("(--auto nvfp4,fp8-block, emulated)")
    code, _, err = run_cli("convert", src, tmp_path / "out", *_flags(root), "--quiet")
    assert code == 0, err
    converted = _json(run_cli, "eval", "eval", tmp_path / "out", "--reference", src, *data, "--device", "cpu")
    for key in ("causal", "layers", "worst_modules", "activations", "recipes", "layout"):
        assert preview[key] == converted[key], key
    assert preview["auto"]["metric"] == "kl_mean"
    assert preview["auto"]["measured_error"] == converted["causal"]["kl_mean"]
    assert "auto" not in converted


def test_preview_on_the_terminal(run_cli, root):
    code, out, err = run_cli("eval", root / "llama", *_flags(root), "--data", root / "eval.jsonl")
    assert code == 0, err
    assert err.count("auto: scoring") == 2  # one walk per candidate, said on stderr
    assert out.startswith("auto: fp8-block ") and "predicted output error" in out  # convert --dry-run's lines
    assert "self_attn.{q_proj,k_proj,v_proj}" in out and "KL(ref || quant) mean" in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("auto: measured kl_mean ") and "predicted" in last, out


def test_refusals_are_one_line_before_any_scoring(run_cli, root, tmp_path):
    code, _, err = run_cli("convert", root / "llama", tmp_path / "fp8", "--recipe", "fp8", "--quiet")
    assert code == 0, err
    src, cal, data = root / "llama", ("--calibration", root / "cal.jsonl"), ("--data", root / "eval.jsonl")
    cases = [((src, *AUTO, "--recipe", "fp8", *cal), "drop the recipe"),
             ((src, *AUTO), "add --calibration DATA"),
             ((src, *AUTO, *cal, "--reference", src), "--auto with --reference"),
             ((src, "--recipe", "nvfp4", *cal), "eval uses it only with --auto"),
             ((src, "--recipe", "nvfp4", "--target-bits", "6"), "only used with --auto"),
             ((src, "--auto", "nvfp4,fp8-block", *cal), "exactly one budget"),
             ((src, *AUTO, "--calibration-samples", "4"), "only used with --calibration"),
             ((tmp_path / "fp8", *AUTO, *cal), "already quantized")]
    for args, said in cases:
        code, out, err = run_cli("eval", *args, *data, "--device", "cpu")
        assert code == 2, (args, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert said in err, (said, err)
        assert "scoring" not in err
