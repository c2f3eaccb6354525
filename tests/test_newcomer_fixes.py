"""What a newcomer's trial and a fault sweep from a fresh clone found: the example recipe file
warns about nothing on the MoE it is written for, a regular expression gets no 'closest module
name', a path under a local folder is not sent to the Hub, Hub failures read in our words, and
--workers beyond the shard count runs one worker per shard (tests/test_workers_and_timing.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantcli.testing import make_moe

EXAMPLE = Path(__file__).resolve().parents[1] / "recipes" / "examples" / "nvfp4-experts-fp8-attention.toml"


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    return make_moe(tmp_path_factory.mktemp("nc") / "moe", hidden=64, layers=1, shards=1)


def test_example_recipe_plans_the_moe_without_warnings(moe, tmp_path, run_cli):
    code, out, err = run_cli("convert", str(moe), str(tmp_path / "o"), "--config", str(EXAMPLE), "--dry-run", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["warnings"] == [] and "warning" not in err
    assert {"nvfp4", "fp8-block"} <= set(doc["recipes"])


def test_regex_pattern_that_matches_nothing_gets_no_name_hint(moe, tmp_path, run_cli):
    code, out, err = run_cli("convert", str(moe), str(tmp_path / "o"), "--recipe", "nvfp4", "--ignore",
                             "re:.*nothing$", "--dry-run", "--json")
    warnings = " ".join(json.loads(out)["warnings"])
    assert code == 0 and "matches no Linear" in warnings and "closest module name" not in warnings
    code, out, err = run_cli("convert", str(moe), str(tmp_path / "o"), "--recipe", "nvfp4", "--ignore", "q_prj",
                             "--dry-run", "--json")
    assert code == 0 and "closest module name" in " ".join(json.loads(out)["warnings"])


def test_missing_path_under_a_local_folder_is_not_a_hub_id(moe, run_cli, monkeypatch):
    monkeypatch.chdir(moe.parent)

    def no_hub(*a, **k):
        raise AssertionError("went to the Hub")

    monkeypatch.setattr("quantcli.checkpoint.source.open_hub", no_hub)
    code, _, err = run_cli("inspect", "moe/nonexistent-folder-xyz")
    assert code == 2 and "no such file or folder in moe/" in err and len(err.strip().splitlines()) == 1


def test_hub_offline_miss_reads_in_our_words(tmp_path, run_cli, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    code, _, err = run_cli("inspect", "someorg/somemodel")
    assert code == 2 and "not in the local Hugging Face cache" in err and len(err.strip().splitlines()) == 1
