"""`convert --rounding gptq` with nothing else to calibrate walks the source's layers once (the
weight pass's walk): the calibration walk, whose findings it would throw away, does not run, and
the output is byte for byte what the run that also walked for calibration wrote."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
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
    # but one for its last layer (2 layers: 3 of 4), and one per layer with the source's inputs
    calibration = _estimate(run_cli, env, tmp_path, "--activations", "static")
    gptq = _estimate(run_cli, env, tmp_path, "--rounding", "gptq")
    both = _estimate(run_cli, env, tmp_path, "--rounding", "gptq", "--activations", "static")
    dense = _estimate(run_cli, env, tmp_path, "--rounding", "gptq", "--gptq-inputs", "dense")
    solve = gptq["flops"] - 1.5 * calibration["flops"]
    assert solve > 0 and both["flops"] == pytest.approx(2.5 * calibration["flops"] + solve)
    assert dense["flops"] == pytest.approx(calibration["flops"] + solve)
    # GPTQ's seconds by part, each term timed at its own rate; none without GPTQ
    assert calibration["rounding_seconds"] == {}
    assert set(gptq["rounding_seconds"]) == {"forward", "statistics", "factorization", "output_errors", "column_loop"}


def test_the_data_is_tokenized_once_per_conversion(run_cli, env, tmp_path):
    import quantcli.model.samples as samples

    samples._token_ids.cache_clear()
    _convert(run_cli, env, tmp_path / "out")
    assert samples._token_ids.cache_info().misses == 2  # as cut by --calibration-seq-len, and uncut to count


PROBE = 1


@pytest.fixture
def linear_calls(monkeypatch) -> Counter:
    """How many times the walk ran each kind of Linear, by its (in, out) features."""
    calls: Counter = Counter()
    real = torch.nn.Linear.forward

    def counted(self, x):
        calls[(self.in_features, self.out_features)] += 1
        return real(self, x)

    monkeypatch.setattr(torch.nn.Linear, "forward", counted)
    return calls


def test_the_observed_run_stops_after_the_last_module_it_observes(run_cli, env, tmp_path, linear_calls):
    # 8 one-sample batches, 2 layers, hidden 64: q/k/v/o_proj (64 -> 64) run observed and again
    # quantized for every batch; down_proj (128 -> 64), the last module a layer rounds, runs in
    # the observed run for the first batch only (which runs whole: a module called twice in a
    # batch would be refused there), then quantized for every batch; the last layer is not run
    # quantized (its outputs feed nothing). PROBE: the one run of layer 0 that learns what a
    # layer returns (model/stack.py _learn_arity).
    _convert(run_cli, env, tmp_path / "out")
    assert linear_calls[(64, 64)] == 4 * (8 + 8) + 4 * 8 + PROBE * 4
    assert linear_calls[(128, 64)] == (1 + 8) + 1 + PROBE


def test_stopping_the_observed_run_early_writes_the_same_bytes(run_cli, env, tmp_path, whole_batches):
    _convert(run_cli, env, tmp_path / "stopped")
    whole_batches()
    _convert(run_cli, env, tmp_path / "whole")
    assert tree_state(tmp_path / "stopped") == tree_state(tmp_path / "whole")


def test_with_the_source_inputs_each_layer_runs_once(run_cli, env, tmp_path, linear_calls):
    # --gptq-inputs dense keeps the source's weights in the walk: the observed run's outputs are
    # the next layer's inputs, so there is no second run
    _convert(run_cli, env, tmp_path / "out", "--gptq-inputs", "dense")
    assert linear_calls[(64, 64)] == 4 * 2 * 8 + PROBE * 4 and linear_calls[(128, 64)] == 2 * 8 + PROBE
