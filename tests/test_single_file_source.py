"""A single .safetensors file as SRC (issue 21 item 5): its folder may hold DST (only the file
and its companion files are read), DST must never be the file or the folder holding it, and the
tokenizer and generation files beside the file come along, not only config.json."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from faults import assert_one_line_error, tree_state

from quantcli.testing import make_llama

COMPANIONS = {"tokenizer.json": "{}", "special_tokens_map.json": "{}", "chat_template.jinja": "{{ x }}"}


@pytest.fixture(scope="module")
def single_made(tmp_path_factory) -> Path:
    folder = make_llama(tmp_path_factory.mktemp("one") / "single", hidden=64, layers=1, shards=1)
    for name, text in COMPANIONS.items():
        (folder / name).write_text(text)
    (folder / "my-notes.json").write_text(json.dumps({"not": "the model's"}))
    return folder


@pytest.fixture
def single(single_made, tmp_path, monkeypatch) -> Path:
    """A private copy, and the working folder is it: `cd single && quantcli convert model.safetensors ...`."""
    folder = Path(shutil.copytree(single_made, tmp_path / "single"))
    monkeypatch.chdir(folder)
    return folder


def test_dst_beside_the_file_converts_and_leaves_the_source_alone(single, run_cli):
    before = tree_state(single)
    code, out, err = run_cli("convert", "model.safetensors", "out-nvfp4", "--recipe", "nvfp4", "-q", "--device", "cpu")
    assert code == 0, err
    out_dir = single / "out-nvfp4"
    assert out.strip() == "out-nvfp4" and (out_dir / "quantcli_manifest.json").is_file()
    assert {p: h for p, h in tree_state(single).items() if not p.startswith("out-nvfp4")} == before
    assert not (single / "out-nvfp4.partial").exists()
    copied = {p.name for p in out_dir.iterdir()}
    assert set(COMPANIONS) | {"tokenizer_config.json", "generation_config.json", "config.json"} <= copied
    assert "my-notes.json" not in copied  # the folder's other files are not the model's
    for name, text in COMPANIONS.items():
        assert (out_dir / name).read_text() == text


@pytest.mark.parametrize("dst, needle", [(".", "not a new one"), ("../single", "contains the source"),
                                        ("model.safetensors", "is the source itself")])
def test_dst_that_is_the_file_or_holds_it_is_refused(single, run_cli, dst, needle):
    before = tree_state(single)
    for flags in ([], ["--overwrite"]):
        code, out, err = run_cli("convert", "model.safetensors", dst, "--recipe", "nvfp4", "-q", *flags)
        assert_one_line_error(code, out, err, dst, needle)
        assert tree_state(single) == before


def test_a_truncated_file_is_named_not_hidden_by_the_destination_check(single, run_cli):
    path = single / "model.safetensors"
    os.truncate(path, path.stat().st_size - 100)
    code, out, err = run_cli("convert", "model.safetensors", "out", "--recipe", "nvfp4", "-q", "--device", "cpu")
    line = assert_one_line_error(code, out, err, "model.safetensors", "truncated")
    assert "source folder" not in line and not (single / "out").exists() and not (single / "out.partial").exists()


def test_dst_inside_a_source_folder_is_still_refused(single_made, tmp_path, run_cli):
    src = Path(shutil.copytree(single_made, tmp_path / "src"))
    code, out, err = run_cli("convert", src, src / "out", "--recipe", "nvfp4", "-q")
    assert_one_line_error(code, out, err, "inside", str(src))
