"""One shard given as the whole model, --threshold ranges, the model card on a second
conversion, `inspect --json | head -1`, compressed-tensors targets and group_size checks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from faults import assert_nothing_left, assert_one_line_error, tree_state
from quantcli.testing import make_llama


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_llama(tmp_path_factory.mktemp("src") / "llama", hidden=64, layers=1, shards=2)


@pytest.fixture(scope="module")
def nvfp4(llama, tmp_path_factory) -> Path:
    from quantcli.cli.app import main

    out = tmp_path_factory.mktemp("q") / "nvfp4"
    with pytest.raises(SystemExit) as exc:
        main(["convert", str(llama), str(out), "--recipe", "nvfp4", "--layout", "compressed-tensors", "--quiet"])
    assert not exc.value.code
    return out


def _shard(folder: Path) -> Path:
    return sorted(folder.glob("model-*.safetensors"))[0]


# ---------------------------------------------------------------- 1. one shard of a sharded checkpoint

@pytest.mark.parametrize("command", ["convert", "inspect", "verify"])
def test_one_shard_is_refused(command, llama, nvfp4, tmp_path, run_cli):
    shard = _shard(llama)
    before = tree_state(llama)
    dst = tmp_path / "out"
    args = {"convert": ("convert", shard, dst, "--recipe", "nvfp4"), "inspect": ("inspect", shard),
            "verify": ("verify", nvfp4, "--reference", shard)}[command]
    code, out, err = run_cli(*args)
    assert_one_line_error(code, out, err, f"{shard}: is one shard of the sharded checkpoint in {llama}",
                          "the index lists 2 shards", f"pass the folder {llama}")
    assert tree_state(llama) == before
    assert_nothing_left(dst)


def test_lone_file_without_index_or_unlisted_still_opens(llama, tmp_path, run_cli):
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(_shard(llama), lone / "model.safetensors")
    assert run_cli("inspect", lone / "model.safetensors")[0] == 0
    (lone / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "x-1.safetensors",
                                                                                  "b": "x-2.safetensors"}}))
    assert run_cli("inspect", lone / "model.safetensors")[0] == 0


# ---------------------------------------------------------------- 2. --threshold ranges

@pytest.mark.parametrize("item,needle", [
    ("margin=-0.5", "margin must be 0 or more"), ("rel_err=0", "rel_err must be more than 0"),
    ("cosine=1.5", "cosine must be in (0, 1]"), ("cosine=0", "cosine must be in (0, 1]"),
    ("sqnr_db=inf", "finite"), ("rel_err=nan", "finite"), ("margin=inf", "finite"),
    ("relerr=0.1", "did you mean 'rel_err'?")])
def test_threshold_out_of_range(item, needle, nvfp4, run_cli):
    code, out, err = run_cli("verify", nvfp4, "--threshold", item)
    assert_one_line_error(code, out, err, "--threshold", needle)


def test_threshold_in_range_accepted():
    from quantcli.verify.limits import parse_thresholds

    limits = parse_thresholds(["margin=0", "cosine=1", "rel_err=0.2", "sqnr_db=-3"])
    assert (limits.margin, limits.cosine, limits.rel_err, limits.sqnr_db) == (0, 1, 0.2, -3)


# ---------------------------------------------------------------- 3. the model card, converted again

def test_second_conversion_replaces_the_card(nvfp4, tmp_path, run_cli):
    src = tmp_path / "src"
    shutil.copytree(nvfp4, src)
    (src / "README.md").write_text((nvfp4 / "README.md").read_text() + "\n## License\n\nMIT\n")
    out = tmp_path / "out"
    code, _, err = run_cli("convert", src, out, "--recipe", "fp8-block", "--quiet")
    assert code == 0, err
    text = (out / "README.md").read_text()
    assert text.count("## Quantization (quantcli)") == 1, text
    assert "fp8-block" in text and text.rstrip().endswith("MIT")


def test_card_section_replaced_up_to_next_heading():
    from quantcli.convert.model_card import with_model_card

    card = "\n## Quantization (quantcli)\n\nnew\n"
    assert with_model_card("# M\n\nhi", card) == "# M\n\nhi\n" + card
    old = "# M\n\n## Quantization (quantcli)\n\nold\n\n## License\nMIT\n"
    assert with_model_card(old, card) == "# M\n" + card + "\n## License\nMIT\n"


# ---------------------------------------------------------------- 4. inspect --json | head -1

def _many_modules(folder: Path) -> Path:
    """2000 FP8 per-tensor modules: `inspect --json` lists each one (about 2 MB of JSON)."""
    from quantcli.checkpoint.safetensors_io import write_file

    folder.mkdir()
    tensors = {}
    for i in range(2000):
        tensors[f"model.layers.{i}.mlp.down_proj.weight"] = torch.zeros(16, 16).to(torch.float8_e4m3fn)
        tensors[f"model.layers.{i}.mlp.down_proj.weight_scale"] = torch.ones(1)
    write_file(folder / "model.safetensors", tensors)
    group = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"}}
    (folder / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": group}}}))
    return folder


def test_inspect_json_into_closed_pipe_exits_141(tmp_path, run_cli):
    big = _many_modules(tmp_path / "big")
    code, out, _ = run_cli("inspect", big, "--json")
    assert code == 0 and len(out) > 64 * 1024
    env = {**os.environ, "TRITON_INTERPRET": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "quantcli", "inspect", str(big), "--json"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"{"
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert not err.strip(), err


# ---------------------------------------------------------------- 5. compressed-tensors config checks

def _with_config(nvfp4: Path, tmp_path: Path, edit) -> Path:
    path = tmp_path / "ckpt"
    shutil.copytree(nvfp4, path)
    (path / "quantcli_manifest.json").unlink()  # read the config, as for another producer's checkpoint
    config = json.loads((path / "config.json").read_text())
    edit(config["quantization_config"]["config_groups"]["group_0"])
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("command", ["verify", "convert", "inspect"])
def test_invalid_target_regex_is_refused(command, nvfp4, tmp_path, run_cli):
    path = _with_config(nvfp4, tmp_path, lambda g: g.update(targets=["Linear", "re:model.(layers"]))
    dst = tmp_path / "out"
    args = ("convert", path, dst, "--recipe", "fp8-block") if command == "convert" else (command, path)
    code, out, err = run_cli(*args)
    assert_one_line_error(code, out, err, "config.json", "config_groups.group_0.targets", "not a valid regex")
    assert_nothing_left(dst)


def test_group_size_disagreeing_with_the_blocks_is_reported(nvfp4, tmp_path, run_cli):
    path = _with_config(nvfp4, tmp_path, lambda g: g["weights"].update(group_size=32))
    code, out, _ = run_cli("verify", path, "--json")
    assert code == 1
    assert "group_0.weights.group_size is 32, but nvfp4 blocks hold 16" in out
