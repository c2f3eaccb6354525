"""A weight pass killed mid-walk resumes after its last finished layer (the finished layers are
replayed from their staged files, not rounded again) with the bytes of an uninterrupted run; what
cannot be continued or written is refused in one line: another pass's products, a staged product
that does not match the plan, two passes at once, a weight pass without calibration data."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from faults import assert_nothing_left, assert_one_line_error, fault_env, tree_state
from nearest_pass import NearestPass, install

from quantcli.checkpoint.safetensors_io import OutSpec
from quantcli.testing import make_llama

pytest.importorskip("transformers")
TESTS = Path(__file__).parent
ARGS = ["--recipe", "nvfp4", "--activations", "static", "--kv-cache", "fp8", "--device", "cpu", "--quiet"]
WEIGHTS = ".quantcli-weights"


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """A plain conversion, and the same run with the nearest pass SIGKILLed once layer 0 of 2 is
    staged (a subprocess: nothing cleans up)."""
    tmp = tmp_path_factory.mktemp("resume")
    src = make_llama(tmp / "llama", hidden=64, layers=2, shards=2)
    data = tmp / "ids.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [(5 * i + 3 * j) % 512 for j in range(6 + 5 * (i % 2))]})
                            + "\n" for i in range(5)))
    argv = ["convert", str(src), "DST", *ARGS, "--calibration", str(data)]
    from quantcli.cli.app import _run

    assert _run([str(tmp / "plain") if a == "DST" else a for a in argv]) == 0
    env = {**os.environ, **fault_env(kill_after_layers=1)}
    proc = subprocess.run([sys.executable, str(TESTS / "nearest_pass.py"),
                           *[str(tmp / "out") if a == "DST" else a for a in argv]],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr
    return {"tmp": tmp, "argv": argv, "plain": tmp / "plain", "partial": tmp / "out.partial"}


def _copy(killed, name: str) -> tuple[list[str], Path]:
    """A copy of the killed run's staging folder for DST `name`, and the command line for it."""
    dst = killed["tmp"] / name
    shutil.copytree(killed["partial"], dst.with_name(name + ".partial"), symlinks=True)
    return [str(dst) if a == "DST" else a for a in killed["argv"]], dst


@pytest.mark.slow
def test_killed_mid_walk_resume_continues_after_the_last_finished_layer(killed, run_cli):
    state = tree_state(killed["partial"])
    assert f"{WEIGHTS}/layer-00000.safetensors" in state and f"{WEIGHTS}/layer-00001.safetensors" not in state
    assert not any(n.endswith(".tmp") for n in state) and not (killed["tmp"] / "out").exists()
    argv, dst = _copy(killed, "resumed")
    wp = install(NearestPass())
    code, _, err = run_cli(*argv, "--resume")
    assert code == 0, err
    assert wp.rounded and all(m.startswith("model.layers.1.") for m in wp.rounded)  # layer 0 replayed, not redone
    assert tree_state(dst) == tree_state(killed["plain"])
    assert not dst.with_name("resumed.partial").exists()


@pytest.mark.slow
def test_a_resumed_walk_shows_no_rate(killed, run_cli):
    """docs/cli.md: a run with --resume shows what it resumed and no rate. A walk killed before
    any shard was written resumes no shard, but its staged layers are work of the earlier run."""
    argv, dst = _copy(killed, "summary")
    install(NearestPass())
    code, out, err = run_cli(*[a for a in argv if a != "--quiet"], "--resume")
    assert code == 0, err
    line = next(ln for ln in out.splitlines() if ln.startswith("wrote "))
    assert "B/s" not in line and line.endswith("); 2 shard(s) written, 0 resumed, 1 rounded layer of 2 resumed"), line


@pytest.mark.slow
def test_resume_refuses_another_pass_s_products(killed, run_cli):
    argv, dst = _copy(killed, "other")
    stage = dst.with_name("other.partial")
    before = _without_lock(tree_state(stage))  # the dead run's lock is taken over and released
    code, out, err = run_cli(*argv, "--resume")  # no weight pass now: the staged layers would be dropped
    assert_one_line_error(code, out, err, "weight pass 'nearest-test'", "--overwrite")
    other = NearestPass()
    other.name = "another-pass"
    install(other)
    code, out, err = run_cli(*argv, "--resume")
    assert_one_line_error(code, out, err, "'nearest-test'", "'another-pass'", "--overwrite")
    assert _without_lock(tree_state(stage)) == before and not other.rounded


def _without_lock(state: dict[str, str]) -> dict[str, str]:
    return {n: h for n, h in state.items() if not n.startswith(".quantcli-lock")}


@pytest.mark.slow
def test_a_staged_product_that_does_not_match_the_plan_is_refused(killed, run_cli):
    from safetensors import safe_open
    from safetensors.torch import save_file

    argv, dst = _copy(killed, "tampered")
    path = dst.with_name("tampered.partial") / WEIGHTS / "layer-00000.safetensors"
    with safe_open(str(path), "pt") as f:
        tensors, meta = {n: f.get_tensor(n) for n in f.keys()}, f.metadata()
    name = "model.layers.0.self_attn.o_proj.weight_scale"
    tensors[name] = tensors[name].reshape(-1)  # the right bytes, the wrong shape
    save_file(tensors, str(path), metadata=meta)
    install(NearestPass())
    code, out, err = run_cli(*argv, "--resume")
    assert_one_line_error(code, out, err, str(path), name, "does not match the plan")


def test_check_product_names_every_mismatch():
    from quantcli.convert.staged import check_product
    from quantcli.errors import CheckpointError
    from quantcli.formats.layouts import get_layout
    from quantcli.planning.plan import TensorPlan

    t = TensorPlan("m.weight", "s", "BF16", (4, 32), recipe="nvfp4", module="m",
                   outputs=(OutSpec("m.weight", "U8", (4, 16)), OutSpec("m.weight_scale", "F8_E4M3", (4, 2))))
    layout = get_layout("modelopt")
    check_product(t, {o.name: o for o in t.outputs}, layout, "here")
    with pytest.raises(CheckpointError) as exc:
        check_product(t, {"m.weight": OutSpec("m.weight", "I8", (4, 16)), "m.extra": OutSpec("m.extra", "F32", ())},
                      layout, "here")
    assert all(s in str(exc.value) for s in ("m.extra is not in the plan", "m.weight_scale is missing",
                                             "m.weight is I8 [4, 16], the plan says U8 [4, 16]"))


@pytest.mark.slow
def test_two_weight_passes_are_refused_and_nothing_is_written(killed, run_cli):
    import quantcli.convert.passes as passes

    other = NearestPass()
    other.name = "another-pass"
    passes.WEIGHT_PASSES = (NearestPass(), other)
    dst = killed["tmp"] / "two"
    code, out, err = run_cli(*[str(dst) if a == "DST" else a for a in killed["argv"]])
    assert_one_line_error(code, out, err, "nearest-test, another-pass", "choose one")
    assert_nothing_left(dst)


@pytest.mark.slow
def test_a_weight_pass_without_calibration_data_is_refused(killed, run_cli):
    install(NearestPass())
    src, dst = killed["argv"][1], killed["tmp"] / "nodata"
    code, out, err = run_cli("convert", src, str(dst), "--recipe", "nvfp4", "--quiet")
    assert_one_line_error(code, out, err, "weight pass nearest-test needs --calibration")
    assert_nothing_left(dst)


@pytest.fixture(autouse=True)
def _no_weight_pass_left(monkeypatch):
    """Each test installs the pass it needs; none outlives it."""
    import quantcli.convert.passes as passes

    monkeypatch.setattr(passes, "WEIGHT_PASSES", ())
