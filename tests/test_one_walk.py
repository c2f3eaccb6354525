"""`convert --rounding gptq` with nothing else to calibrate walks the source's layers once (the
weight pass's walk): the calibration walk, whose findings it would throw away, does not run, and
the output is byte for byte what the run that also walked for calibration wrote."""

from __future__ import annotations

import json

import pytest
from faults import tree_state

import quantcli.calibrate.engine
import quantcli.calibrate.run
import quantcli.convert.passes.fact_passes
from quantcli.testing import make_llama

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("walk")
    data = tmp / "ids.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [(5 * i + 11 * j) % 512 for j in range(6 + 2 * (i % 3))]}) + "\n"
                            for i in range(8)))
    return {"data": data, "llama": make_llama(tmp / "llama", hidden=64, layers=2, shards=2)}


@pytest.fixture
def walks(monkeypatch) -> list[str]:
    """The name of the LayerPass of every walk over the layers, in order."""
    seen: list[str] = []
    for module in (quantcli.calibrate.engine, quantcli.calibrate.run):
        real = module.walk_layers

        def counted(config, weights, ids, batch, device, layer_pass, *rest, _real=real, **kw):
            seen.append(type(layer_pass).__name__)
            return _real(config, weights, ids, batch, device, layer_pass, *rest, **kw)

        monkeypatch.setattr(module, "walk_layers", counted)
    return seen


def _convert(run_cli, env, out, *extra):
    code, _, err = run_cli("convert", str(env["llama"]), str(out), "--recipe", "nvfp4", "--rounding", "gptq",
                           "--calibration", str(env["data"]), "--device", "cpu", "-q", *extra)
    assert code == 0, err


def test_gptq_alone_walks_the_layers_once(run_cli, env, tmp_path, walks):
    _convert(run_cli, env, tmp_path / "out")
    assert walks == ["WeightWalk"]


def test_gptq_with_kv_scales_walks_for_calibration_then_for_the_rounding(run_cli, env, tmp_path, walks):
    _convert(run_cli, env, tmp_path / "out", "--kv-cache", "fp8")
    assert len(walks) == 2 and walks[-1] == "WeightWalk"


def test_skipping_the_calibration_walk_writes_the_same_bytes(run_cli, env, tmp_path, walks, monkeypatch):
    _convert(run_cli, env, tmp_path / "one")
    # as before: the calibration walk runs whenever there is calibration data, and learns nothing
    def every_time(plan):
        return plan.options.calibration is not None

    for module in (quantcli.convert.passes.fact_passes, quantcli.calibrate.run):
        monkeypatch.setattr(module, "needs_walk", every_time)
    _convert(run_cli, env, tmp_path / "two")
    assert walks == ["WeightWalk", walks[1], "WeightWalk"] and walks[1] != "WeightWalk"
    assert tree_state(tmp_path / "one") == tree_state(tmp_path / "two")


def _estimate(run_cli, env, tmp_path, *extra) -> dict:
    code, out, err = run_cli("convert", str(env["llama"]), str(tmp_path / "dry"), "--recipe", "nvfp4",
                             "--calibration", str(env["data"]), "--device", "cpu", "--dry-run", "--json", *extra)
    assert code == 0, err
    return json.loads(out)["calibration_estimate"]


def test_the_dry_run_counts_the_forwards_each_walk_runs(run_cli, env, tmp_path):
    # one forward per layer for the calibration walk, two for GPTQ's (observed, then quantized)
    calibration = _estimate(run_cli, env, tmp_path, "--activations", "static")
    gptq = _estimate(run_cli, env, tmp_path, "--rounding", "gptq")
    both = _estimate(run_cli, env, tmp_path, "--rounding", "gptq", "--activations", "static")
    solve = gptq["flops"] - 2 * calibration["flops"]
    assert solve > 0 and both["flops"] == pytest.approx(3 * calibration["flops"] + solve)
    # GPTQ's seconds by part, each term timed at its own rate; none without GPTQ
    assert calibration["rounding_seconds"] == {}
    assert set(gptq["rounding_seconds"]) == {"forward", "statistics", "factorization", "output_errors", "column_loop"}


def test_the_data_is_tokenized_once_per_conversion(run_cli, env, tmp_path):
    import quantcli.model.samples as samples

    samples._token_ids.cache_clear()
    _convert(run_cli, env, tmp_path / "out")
    assert samples._token_ids.cache_info().misses == 2  # as cut by --calibration-seq-len, and uncut to count
