"""What --overwrite and --resume may replace (issue 21 item 9): --overwrite replaces only a
quantcli output (it has quantcli_manifest.json) or an empty folder, never a folder of the user's
files; a finished DST is called complete (nothing to resume), and --overwrite --resume on it says
how to convert again instead of telling the user to pass the --overwrite they passed."""

from __future__ import annotations

from pathlib import Path

import pytest
from faults import assert_one_line_error, tree_state

from quantcli.testing import make_llama


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_llama(tmp_path_factory.mktemp("ow") / "llama", hidden=64, layers=1, shards=1)


def convert(run_cli, src: Path, dst: Path, *flags: str, recipe: str = "nvfp4"):
    return run_cli("convert", src, dst, "--recipe", recipe, "--device", "cpu", *flags)


def test_overwrite_refuses_a_folder_of_the_users_files(llama, tmp_path, run_cli):
    dst = tmp_path / "mine"
    dst.mkdir()
    (dst / "thesis.tex").write_text("years of work")
    (dst / "data").mkdir()
    before = tree_state(tmp_path)
    for flags in (["--overwrite"], ["--overwrite", "--resume"], []):
        code, out, err = convert(run_cli, llama, dst, *flags)
        line = assert_one_line_error(code, out, err, str(dst), "quantcli did not write", "data and 1 more",
                                     "delete it yourself or choose another destination")
        assert "--resume" not in line  # nothing of quantcli's to resume there
        assert tree_state(tmp_path) == before


def test_overwrite_replaces_an_empty_folder_and_a_quantcli_output(llama, tmp_path, run_cli):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert convert(run_cli, llama, empty, "--overwrite", "-q")[0] == 0
    out = tmp_path / "out"
    assert convert(run_cli, llama, out, "-q", recipe="fp8")[0] == 0
    code, _, err = convert(run_cli, llama, out, "--overwrite", "-q")
    assert code == 0 and '"recipe": "nvfp4"' in (out / "quantcli_manifest.json").read_text(), err


def test_a_finished_dst_is_called_complete_not_resumable(llama, tmp_path, run_cli):
    dst = tmp_path / "out"
    assert convert(run_cli, llama, dst, "-q")[0] == 0
    before = tree_state(dst)
    code, out, err = convert(run_cli, llama, dst)
    line = assert_one_line_error(code, out, err, str(dst), "finished quantcli output", "nothing to resume",
                                 "--overwrite")
    assert "--resume to continue" not in line and tree_state(dst) == before


def test_overwrite_with_resume_on_a_finished_dst_is_coherent(llama, tmp_path, run_cli):
    dst = tmp_path / "out"
    assert convert(run_cli, llama, dst, "-q")[0] == 0
    before = tree_state(dst)
    code, out, err = convert(run_cli, llama, dst, "--overwrite", "--resume")  # the same plan: kept
    assert code == 0 and "already complete" in out and "drop --resume (keep --overwrite)" in out, (out, err)
    assert "Use --overwrite" not in out and tree_state(dst) == before
    code, out, err = convert(run_cli, llama, dst, "--resume")
    assert code == 0 and "use --overwrite to convert again" in out
    code, _, err = convert(run_cli, llama, dst, "--overwrite", "--resume", "-q", recipe="fp8")  # another plan
    assert code == 0 and '"recipe": "fp8"' in (dst / "quantcli_manifest.json").read_text(), err
