"""`.partial` staging folders (issue 21 item 7): inspect, verify and convert name an unfinished
conversion and how to finish it (as push does), instead of calling its codes unquantized or
sending the user to the Hub for a DST that only exists as DST.partial."""

from __future__ import annotations

from pathlib import Path

import pytest
from faults import after_each_shard, assert_one_line_error

from quantcli.testing import make_llama


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_llama(tmp_path_factory.mktemp("uc") / "llama", hidden=64, layers=1, shards=2)


@pytest.fixture
def interrupted(llama, tmp_path, run_cli, monkeypatch) -> Path:
    """out/bk.partial after Ctrl-C between the shards: codes written, no config.json yet."""
    def stop(written: int) -> None:
        raise KeyboardInterrupt

    dst = tmp_path / "out" / "bk"
    with monkeypatch.context() as m:
        after_each_shard(m, stop)
        code, _, err = run_cli("convert", llama, dst, "--recipe", "nvfp4", "-q", "--device", "cpu")
    assert code == 130 and dst.with_name("bk.partial").is_dir(), err
    return dst


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_the_staging_folder_is_called_an_unfinished_conversion(interrupted, run_cli, command):
    stage = interrupted.with_name("bk.partial")
    line = assert_one_line_error(*run_cli(command, stage), str(stage), "unfinished conversion",
                                 f"quantcli convert SRC {interrupted} --resume")
    assert "unquantized" not in line


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_dst_that_exists_only_as_partial_is_not_sent_to_the_hub(interrupted, run_cli, command):
    line = assert_one_line_error(*run_cli(command, interrupted), str(interrupted), "does not exist yet",
                                 "bk.partial", "--resume")
    assert "Hub" not in line


def test_convert_from_a_staging_folder_is_refused_and_resume_still_finishes(llama, interrupted, run_cli, tmp_path):
    stage = interrupted.with_name("bk.partial")
    assert_one_line_error(*run_cli("convert", stage, tmp_path / "x", "--recipe", "fp8"), "unfinished conversion")
    code, _, err = run_cli("convert", llama, interrupted, "--recipe", "nvfp4", "-q", "--device", "cpu", "--resume")
    assert code == 0, err
    code, out, err = run_cli("inspect", interrupted, "-q")
    assert code == 0 and "modelopt" in out, (out, err)


def test_a_user_folder_named_partial_is_read_as_usual(llama, tmp_path, run_cli):
    import shutil

    mine = Path(shutil.copytree(llama, tmp_path / "weights.partial"))  # no quantcli files inside
    code, out, err = run_cli("inspect", mine, "-q")
    assert code == 0, err
