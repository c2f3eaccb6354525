"""quantcli eval --workers N: the ranks split the batches, each walks the model on its share, and
rank 0 adds their sums up; the report is the one-process report (to the last bits their sums'
order moves), sensitivity included, also when a rank has no batch at all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantcli.evaluate import share
from quantcli.testing import make_llama

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path, Path]:
    from quantcli.cli.app import main

    root = tmp_path_factory.mktemp("eval-workers")
    src = make_llama(root / "llama", hidden=64, layers=2, shards=1)
    data = root / "eval.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [(5 * i + 11 * j + 3) % 512 for j in range(12 + 3 * i)]}) + "\n"
                            for i in range(5)))
    with pytest.raises(SystemExit) as exc:
        main(["convert", str(src), str(root / "nvfp4"), "--recipe", "nvfp4", "-q"])
    assert exc.value.code == 0
    return src, root / "nvfp4", data


def _eval(run_cli, dst: Path, src: Path, data: Path, *args) -> dict:
    code, out, err = run_cli("eval", dst, "--reference", src, "--data", data, "--device", "cpu", "--json", *args)
    assert code == 0, err
    return json.loads(out)


def _same(a: dict, b: dict) -> None:
    for key in ("perplexity_reference", "perplexity_quantized", "kl_mean", "kl_p99", "kl_max", "logits_rel_err"):
        assert a["causal"][key] == pytest.approx(b["causal"][key], rel=1e-6), key
    assert a["causal"]["tokens"] == b["causal"]["tokens"]
    one_token = 1.0 / a["causal"]["tokens"]  # a near-tie's argmax may flip with the ranks' thread counts
    assert a["causal"]["top1_agreement"] == pytest.approx(b["causal"]["top1_agreement"], abs=1.5 * one_token)
    for x, y in zip(a["layers"], b["layers"], strict=True):
        assert x["hidden_rel_err"] == pytest.approx(y["hidden_rel_err"], rel=1e-6)
        assert [m["module"] for m in x["worst_modules"]] == [m["module"] for m in y["worst_modules"]]
    assert [s["module"] for s in a["sensitivity"]] == [s["module"] for s in b["sensitivity"]]
    for x, y in zip(a["sensitivity"], b["sensitivity"], strict=True):
        assert x["output_error"] == pytest.approx(y["output_error"], rel=1e-6)


@pytest.mark.slow
def test_two_workers_report_what_one_process_reports(run_cli, pair):
    src, dst, data = pair
    one = _eval(run_cli, dst, src, data, "--sensitivity", "2")
    two = _eval(run_cli, dst, src, data, "--sensitivity", "2", "--workers", "2")
    assert len(two["sensitivity"]) == 2 and two["samples"] == one["samples"] == 5
    _same(two, one)


@pytest.mark.slow
def test_a_worker_without_a_batch_adds_nothing(run_cli, pair):
    src, dst, data = pair
    one = _eval(run_cli, dst, src, data, "--samples", "1", "--sensitivity", "1")
    two = _eval(run_cli, dst, src, data, "--samples", "1", "--sensitivity", "1", "--workers", "2")
    _same(two, one)
    assert any("--workers 2: the samples make 1 batch(es), so 1 worker(s) had none" in n for n in two["notes"])


def test_batches_are_shared_by_tokens():
    import torch

    batches = [torch.zeros(1, n) for n in (10, 50, 20, 30)]
    mine = [[b.shape[1] for b in share(batches, r, 2)] for r in range(2)]
    assert mine == [[10, 50], [20, 30]]  # largest first to the lighter rank: 60 tokens each, kept in order
    assert share(batches, 0, 1) == batches
