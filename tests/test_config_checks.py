"""A checkpoint's config.json against what it must be for any engine to load it, and against
its own tensors (issue 21 item 8 and the fault sweep's config/tensor contradictions): convert
refuses before any work, verify fails its config check, inspect names the problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from quantcli.testing import make_llama

from faults import assert_nothing_left, assert_one_line_error


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_llama(tmp_path_factory.mktemp("cfg") / "llama", hidden=64, layers=1, shards=1)


@pytest.fixture(scope="module")
def nvfp4(llama, tmp_path_factory) -> Path:
    from quantcli.cli.app import main

    out = tmp_path_factory.mktemp("cfg") / "nvfp4"
    with pytest.raises(SystemExit) as exc:
        main(["convert", str(llama), str(out), "--recipe", "nvfp4", "-q", "--device", "cpu"])
    assert not exc.value.code
    return out


def copy_without_config(folder: Path, to: Path, keep: dict | None = None) -> Path:
    """`folder` copied; config.json removed, or replaced by `keep`."""
    shutil.copytree(folder, to)
    (to / "config.json").unlink()
    if keep is not None:
        (to / "config.json").write_text(json.dumps(keep))
    return to


# ---------------------------------------------------------------- item 8: no config.json


@pytest.mark.parametrize("config, needle", [(None, "missing"), ({"torch_dtype": "bfloat16"}, "no model_type")])
@pytest.mark.parametrize("dry_run", [False, True])
def test_convert_refuses_a_source_no_engine_can_load(llama, tmp_path, run_cli, config, needle, dry_run):
    src = copy_without_config(llama, tmp_path / "src", config)
    dst = tmp_path / "out"
    code, out, err = run_cli("convert", src, dst, "--recipe", "nvfp4", "-q", *(["--dry-run"] * dry_run))
    assert_one_line_error(code, out, err, str(src), "config.json", needle, "copy the model's own config.json")
    assert_nothing_left(dst)


def test_verify_fails_a_quantized_output_without_config(nvfp4, tmp_path, run_cli):
    quant = copy_without_config(nvfp4, tmp_path / "q")
    code, out, err = run_cli("verify", quant)
    assert code == 1, (out, err)
    assert "FAIL (1) config keys the consumer needs are present" in out
    assert "FAIL config.json: missing" in out


def test_verify_fails_a_dense_copy_without_config(llama, tmp_path, run_cli):
    dense = copy_without_config(llama, tmp_path / "d")
    for flags in ([], ["--reference", str(llama)]):
        code, out, err = run_cli("verify", dense, "--json", *flags)
        doc = json.loads(out)
        assert code == 1 and not doc["passed"], err
        assert [f["tensor"] for f in doc["faults"]] == ["config.json"]


def test_inspect_says_config_json_is_missing(llama, tmp_path, run_cli):
    src = copy_without_config(llama, tmp_path / "src")
    code, out, err = run_cli("inspect", src)
    assert code == 0 and "problem: config.json: missing" in out and "loads in any" not in out, out
    code, out, err = run_cli("inspect", src, "--kv-cache")
    line = assert_one_line_error(code, out, err, "--kv-cache", "no config.json")
    assert "is None" not in line
    src_partial = copy_without_config(llama, tmp_path / "src2", {"model_type": "llama"})
    code, out, err = run_cli("inspect", src_partial, "--kv-cache")
    assert_one_line_error(code, out, err, "config.json has no num_hidden_layers")
