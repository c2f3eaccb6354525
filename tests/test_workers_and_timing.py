"""convert's summary time and --workers on a small model (issue 21 item 14): the time counts the
start-up (Python, torch, planning, the ranks) as well as the conversion, and --workers above the
shard count runs one worker per shard with a warning instead of refusing after the plan."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from quantcli.testing import make_llama


@pytest.fixture(scope="module")
def one_shard(tmp_path_factory) -> Path:
    return make_llama(tmp_path_factory.mktemp("wt") / "llama", hidden=64, layers=1, shards=1)


def test_more_workers_than_shards_runs_one_per_shard_with_a_warning(one_shard, tmp_path, run_cli):
    code, out, err = run_cli("convert", one_shard, tmp_path / "o", "--recipe", "nvfp4", "--workers", "3",
                             "--device", "cpu")
    assert code == 0, err
    assert re.search(r"warning: --workers 3: .* has 1 shard\(s\), and a worker converts whole shards; "
                     r"converting on 1", err), err
    assert (tmp_path / "o" / "quantcli_manifest.json").is_file()


def test_the_summary_says_start_up_and_conversion(one_shard, tmp_path, run_cli):
    code, out, err = run_cli("convert", one_shard, tmp_path / "o", "--recipe", "nvfp4", "--device", "cpu")
    assert code == 0, err
    assert re.search(r" in [0-9.]+ s \(start-up [0-9.]+ s, converting [0-9.]+ s at [0-9.]+ [KMG]?i?B/s\)", out), out


@pytest.mark.slow
def test_seconds_total_counts_the_process_start_up(one_shard, tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    proc = subprocess.run([sys.executable, "-m", "quantcli", "convert", str(one_shard), str(tmp_path / "o"),
                           "--recipe", "nvfp4", "--device", "cpu", "--json"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    # importing torch alone takes longer than this; the conversion of a 200 KiB model does not
    assert doc["seconds_total"] >= doc["seconds"] + 0.3, doc


def test_a_failed_ranks_message_promises_resume_only_once_the_staging_folder_exists(tmp_path):
    from quantcli.convert.job import ResumeHint

    stage = tmp_path / "out.partial"
    hint = ResumeHint(stage)
    assert f"...; {hint}" == "...; nothing was written yet: rerun the same command"
    stage.mkdir()
    assert f"{hint}" == f"{stage} is kept: rerun with --resume (any number of workers) to continue"
