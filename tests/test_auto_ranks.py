"""convert --auto on several ranks scores once: rank 0 makes the choice (before it spawns the
--workers ranks, or in the world under torchrun) and hands it to the others as JSON; no other
rank runs the scoring walk, and the output is byte for byte one process's.

The scoring walk's count is its stderr line, `auto: scoring N modules in R ...`, one per
candidate per walk (evaluate/auto_scores.py): each rank's stderr is captured, so a rank that
scored would show its own lines."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest
from faults import tree_state

from quantcli.testing import make_llama

pytest.importorskip("transformers")

CANDIDATES = ("nvfp4", "fp8")  # both fit hidden 64 (fp8-block's 128 multiples would not)
SCORING = "auto: scoring"


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("auto-ranks")
    ids = [[(7 * i + 13 * j + 3) % 512 for j in range(12 + 4 * (i % 2))] for i in range(4)]
    (root / "cal.jsonl").write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in ids))
    return make_llama(root / "llama", hidden=64, layers=2, shards=2)


def _argv(src: Path, dst: Path) -> list[str]:
    return ["convert", str(src), str(dst), "--auto", ",".join(CANDIDATES), "--target-bits", "6",
            "--calibration", str(src.parent / "cal.jsonl"), "--device", "cpu"]


@pytest.fixture(scope="module")
def one(src: Path) -> Path:
    """The one-process conversion every split one is compared with; it scored once itself."""
    from quantcli.cli.app import _run

    dst, err = src.parent / "one", io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert _run(_argv(src, dst)) == 0
    assert err.getvalue().count(SCORING) == len(CANDIDATES), err.getvalue()
    return dst


def test_the_choice_travels_as_json_and_reads_back_equal(src, tmp_path):
    from quantcli.planning import auto
    from tests.test_auto import _groups

    source, request, layout, base, groups, none = _groups(src, (*CANDIDATES, "bf16"), tmp_path)
    # scores with fractions JSON must keep to the last bit
    scores = {m: {c: (i + 1) / 3 + k / 7 for k, c in enumerate(request.quantizing)}
              for i, m in enumerate(m for g in groups for m in g.modules)}
    budget = auto.budget_bits(request, groups, base, none)
    choice = auto.choose(request, layout.name, groups, scores, budget, none)
    doc = json.loads(json.dumps(auto.choice_json(choice)))
    assert auto.choice_from_json(doc) == choice
    assert auto.chosen_options(base.options, auto.choice_from_json(doc)) == auto.chosen_options(base.options, choice)


@pytest.mark.slow
def test_workers_scores_once_in_the_launcher(src, one, tmp_path, capfd, monkeypatch):
    """--workers 2: the spawned rank reruns the command line but takes the launcher's choice."""
    code, _, err = _main(monkeypatch, capfd, *_argv(src, tmp_path / "two"), "--workers", "2")
    assert code == 0, err
    assert err.count(SCORING) == len(CANDIDATES), err  # the spawned rank's stderr is this process's fd 2
    assert tree_state(one) == tree_state(tmp_path / "two")


@pytest.mark.slow
def test_torchrun_ranks_score_once_on_rank_0(src, one, tmp_path):
    """Every rank started alike (torchrun's environment): rank 0 scores, rank 1 only receives."""
    from tests.test_distributed import _run_group

    logs = _run_group(2, [{"name": "auto", "argv": _argv(src, tmp_path / "two")}], tmp_path / "log")["auto"]
    assert sorted(logs) == [0, 1] and all(rec["code"] == 0 for rec in logs.values()), logs
    assert logs[0]["err"].count(SCORING) == len(CANDIDATES), logs[0]["err"]
    assert SCORING not in logs[1]["err"], logs[1]["err"]
    assert tree_state(one) == tree_state(tmp_path / "two")


@pytest.mark.slow
def test_eval_auto_on_workers_scores_once_and_previews_the_same_choice(src, one, capfd, monkeypatch):
    flags = _argv(src, one)[3:]  # --auto ... --device cpu, as convert took them (not --json: it silences the lines)
    code, out, err = _main(monkeypatch, capfd, "eval", str(src), *flags, "--data", str(src.parent / "cal.jsonl"),
                           "--workers", "2")
    assert code == 0, err
    assert err.count(SCORING) == len(CANDIDATES), err
    record = json.loads((one / "quantcli_manifest.json").read_text())["auto"]
    assert (f"{record['achieved_bits']:.4f} bits per weight" in out
            and f"predicted output error {record['predicted_error']:.6g}" in out), out


def _main(monkeypatch, capfd, *argv: str) -> tuple[int, str, str]:
    """main() on `argv` -> (exit code, stdout, stderr), at the file descriptors: spawned ranks write there."""
    from quantcli.cli.app import main

    monkeypatch.setattr(sys, "argv", ["quantcli", *argv])
    with pytest.raises(SystemExit) as exc:
        main()
    got = capfd.readouterr()
    return exc.value.code or 0, got.out, got.err
