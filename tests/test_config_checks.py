"""A checkpoint's config.json against what it must be for any engine to load it, and against
its own tensors (issue 21 item 8 and the fault sweep's config/tensor contradictions): convert
refuses before any work, verify fails its config check, inspect names the problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from faults import assert_nothing_left, assert_one_line_error

from quantcli.testing import make_llama


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


# ---------------------------------------------------------------- config and tensors that contradict each other


def undeclared(quantized: Path, to: Path) -> Path:
    """A quantized output whose config no longer declares it: no quantization_config, no
    hf_quant_config.json, no manifest (what is left are codes and scales)."""
    shutil.copytree(quantized, to)
    config = json.loads((to / "config.json").read_text())
    del config["quantization_config"]
    (to / "config.json").write_text(json.dumps(config))
    for name in ("hf_quant_config.json", "quantcli_manifest.json"):
        (to / name).unlink(missing_ok=True)
    return to


def stale(llama: Path, quantized: Path, to: Path) -> Path:
    """The dense model under a quantization_config copied from a quantized output."""
    shutil.copytree(llama, to)
    config = json.loads((to / "config.json").read_text())
    config["quantization_config"] = json.loads((quantized / "config.json").read_text())["quantization_config"]
    (to / "config.json").write_text(json.dumps(config))
    return to


@pytest.fixture(scope="module")
def fp8_ct(llama, tmp_path_factory) -> Path:
    from quantcli.cli.app import main

    out = tmp_path_factory.mktemp("cfg") / "fp8"
    with pytest.raises(SystemExit) as exc:
        main(["convert", str(llama), str(out), "--recipe", "fp8", "--layout", "compressed-tensors", "-q"])
    assert not exc.value.code
    return out


@pytest.mark.parametrize("which", ["nvfp4", "fp8_ct"])
def test_codes_no_config_declares_are_named_and_refused(which, request, tmp_path, run_cli):
    src = undeclared(request.getfixturevalue(which), tmp_path / "src")
    code, out, err = run_cli("inspect", src)
    assert code == 0 and "problem: config.json: 7 module(s) hold quantized codes" in out, out
    assert "loads in any" not in out and "the config and the tensors disagree" in out
    code, out, err = run_cli("verify", src, "--json")
    faults = json.loads(out)["faults"]
    assert code == 1 and [f["tensor"] for f in faults] == ["config.json"], err
    assert "no config declares a quantization" in faults[0]["fault"]
    dst = tmp_path / "out"
    code, out, err = run_cli("convert", src, dst, "--recipe", "nvfp4", "-q")
    assert_one_line_error(code, out, err, str(src), "quantized codes", "no config declares", "nothing converted")
    assert_nothing_left(dst)


def test_a_quantization_config_over_dense_weights_is_named_and_converted_with_a_warning(llama, nvfp4, tmp_path,
                                                                                       run_cli):
    src = stale(llama, nvfp4, tmp_path / "src")
    code, out, err = run_cli("inspect", src)
    assert code == 0 and "quantization_config declares a modelopt quantization, but no tensor carries it" in out
    code, out, err = run_cli("verify", src, "-q")
    assert code == 1 and "FAIL config.json: quantization_config declares" in err, (out, err)
    dst = tmp_path / "out"
    code, out, err = run_cli("convert", src, dst, "--recipe", "fp8", "-q", "--device", "cpu")
    assert code == 0 and "warning: config.json: quantization_config declares a modelopt quantization" in err, err
    assert "the output's config.json replaces" in err
    assert run_cli("verify", dst, "-q")[0] == 0  # the output's own config declares its own fp8


def test_a_consistent_checkpoint_has_no_config_problem(nvfp4, llama, run_cli):
    for folder in (nvfp4, llama):
        code, out, err = run_cli("inspect", folder, "--json")
        assert code == 0 and not [p for p in json.loads(out)["problems"] if p.startswith("config.json")]
