"""Fault-injection sweep: wrong-typed quantization config keys, and corrupt scales in a quantized
source.

1. Every quantization key quantcli reads (config.json quantization_config and its config_groups,
   the exclusion lists, quant_method / quant_algo, weight_block_size; hf_quant_config.json) of
   the wrong JSON type is refused when the source is opened: exit 2, one line naming the file
   and the key, in convert, inspect (with and without --kv-cache) and verify alike.
2. A quantized source whose scales hold values no producer writes (a global scale NaN, Inf, 0
   or negative; an E4M3 block scale NaN or negative; an E8M0 byte 255; a float block scale
   negative or NaN) is refused while planning, before anything is written, whether it would be
   dequantized, re-laid out or re-quantized; legal zeros (docs/formats.md,
   "Zero blocks and scale values producers write") still convert.
   inspect lists a bad global scale as a problem.
3. A compressed-tensors `targets` entry that is not a valid regex is refused in all three commands;
   a `group_size` that disagrees with the blocks on disk is a problem verify reports.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from faults import assert_nothing_left, assert_one_line_error, tree_state
from safetensors.torch import load_file, save_file

from quantcli.testing import make_llama

MODULE = "model.layers.0.self_attn.q_proj"


def _cli(*args: str) -> int:
    """main() outside a test's fixtures (for module-scoped sources): the exit code."""
    from quantcli.cli.app import main

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", ["quantcli", *map(str, args)])
        with pytest.raises(SystemExit) as exc:
            main()
    return exc.value.code or 0


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    return make_llama(tmp_path_factory.mktemp("sweep") / "dense", hidden=64, layers=1, shards=1)


@pytest.fixture(scope="module")
def quantized(dense, tmp_path_factory) -> dict[str, Path]:
    """Quantized sources by name: NVFP4 in modelopt (multiply global) and compressed-tensors
    (divide global), MXFP8 (E8M0 scales) and fp8-block (F32 block scales)."""
    root = tmp_path_factory.mktemp("quantized")
    made = {}
    for name, args in {"nvfp4-modelopt": ("--recipe", "nvfp4"),
                       "nvfp4-ct": ("--recipe", "nvfp4", "--layout", "compressed-tensors"),
                       "mxfp8-ct": ("--recipe", "mxfp8", "--layout", "compressed-tensors"),
                       "fp8-block": ("--recipe", "fp8-block", "--layout", "fp8")}.items():
        assert _cli("convert", dense, root / name, *args, "--quiet") == 0
        made[name] = root / name
    return made


# ---------------------------------------------------------------- 1. wrong-typed config keys

def _with_config(src: Path, dst: Path, config_key: str | None, value: object, hf_quant: object = None) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    if config_key is not None:
        config["quantization_config"] = value
    (dst / "config.json").write_text(json.dumps(config))
    if hf_quant is not None:
        (dst / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    return dst


CONFIG_CASES = {  # id -> (quantization_config value or None, hf_quant_config.json or None, file, key named)
    "qc-list": ([1], None, "config.json", "quantization_config"),
    "qc-string": ("fp8", None, "config.json", "quantization_config"),
    "config_groups-string": ({"quant_method": "compressed-tensors", "config_groups": "x"}, None,
                             "config.json", "quantization_config.config_groups"),
    "group-not-object": ({"quant_method": "compressed-tensors", "config_groups": {"g": ["Linear"]}}, None,
                         "config.json", "quantization_config.config_groups.g"),
    "targets-string": ({"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": "*q_proj"}}}, None,
                       "config.json", "quantization_config.config_groups.g.targets"),
    "weights-list": ({"quant_method": "compressed-tensors",
                      "config_groups": {"g": {"targets": ["Linear"], "weights": [8]}}}, None,
                     "config.json", "quantization_config.config_groups.g.weights"),
    "num_bits-string": ({"quant_method": "compressed-tensors",
                         "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": "8"}}}}, None,
                        "config.json", "quantization_config.config_groups.g.weights.num_bits"),
    "ignore-int": ({"quant_method": "compressed-tensors", "ignore": 5}, None, "config.json",
                   "quantization_config.ignore"),
    "ignored_layers-string": ({"quant_method": "fp8", "ignored_layers": "lm_head"}, None, "config.json",
                              "quantization_config.ignored_layers"),
    "modules_to_not_convert-mixed": ({"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head", 3]}, None,
                                     "config.json", "quantization_config.modules_to_not_convert"),
    "quant_method-number": ({"quant_method": 5}, None, "config.json", "quantization_config.quant_method"),
    "quant_algo-list": ({"quant_method": "modelopt", "quant_algo": ["NVFP4"]}, None, "config.json",
                        "quantization_config.quant_algo"),
    "weight_block_size-one-int": ({"quant_method": "fp8", "weight_block_size": [128]}, None, "config.json",
                                  "quantization_config.weight_block_size"),
    "hf-quantization-string": (None, {"quantization": "NVFP4"}, "hf_quant_config.json", "quantization"),
    "hf-quant_algo-number": (None, {"quantization": {"quant_algo": 4}}, "hf_quant_config.json",
                             "quantization.quant_algo"),
    "hf-exclude_modules-string": (None, {"quantization": {"quant_algo": "NVFP4", "exclude_modules": "lm_head"}},
                                  "hf_quant_config.json", "quantization.exclude_modules"),
}
COMMANDS = {"convert": ("convert", "{src}", "{dst}", "--recipe", "fp8"), "inspect": ("inspect", "{src}"),
            "inspect-kv-cache": ("inspect", "{src}", "--kv-cache"), "verify": ("verify", "{src}")}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", CONFIG_CASES)
def test_wrong_typed_quantization_key_is_one_line(dense, tmp_path, run_cli, case, command):
    value, hf_quant, file, key = CONFIG_CASES[case]
    src = _with_config(dense, tmp_path / "src", "quantization_config" if value is not None else None, value, hf_quant)
    dst = tmp_path / "dst"
    before = tree_state(src)
    args = [a.format(src=src, dst=dst) for a in COMMANDS[command]]
    line = assert_one_line_error(*run_cli(*args), f"{src / file}: {key} is ", "must be")
    assert "internal error" not in line
    assert tree_state(src) == before
    assert_nothing_left(dst)


def test_correct_types_and_nulls_are_accepted(dense, tmp_path, run_cli):
    """Nulls read as 'not set', and real producers' typed keys pass (no false refusal)."""
    qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": None, "kv_cache_scheme": None,
          "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                        "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                                    "group_size": None, "dynamic": False, "symmetric": True}}}}
    src = _with_config(dense, tmp_path / "src", "quantization_config", qc)
    code, out, err = run_cli("inspect", src)
    assert code == 0, err
    src2 = _with_config(dense, tmp_path / "src2", "quantization_config", None)  # "quantization_config": null
    code, out, err = run_cli("convert", src2, tmp_path / "dst", "--recipe", "fp8", "--quiet")
    assert code == 0, err


# ---------------------------------------------------------------- 2. corrupt scales in a quantized source

def _corrupt(src: Path, dst: Path, name: str, edit) -> Path:
    """A copy of `src` whose tensor `name` is replaced by edit(tensor)."""
    shutil.copytree(src, dst)
    index = dst / "model.safetensors.index.json"
    shard = dst / (json.loads(index.read_text())["weight_map"][name] if index.exists() else "model.safetensors")
    tensors = load_file(str(shard))
    tensors[name] = edit(tensors[name].clone())
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return dst


def _fill(value: float):
    return lambda t: torch.full_like(t, value)


def _set_byte(index: tuple[int, int], byte: int):
    def edit(t: torch.Tensor) -> torch.Tensor:
        b = t.view(torch.uint8)
        b[index] = byte
        return b.view(t.dtype)
    return edit


ACTIONS = {"dequantize": ("--recipe", "bf16"), "relayout": ("--recipe", "nvfp4", "--layout", "compressed-tensors"),
           "requantize": ("--recipe", "fp8")}
GLOBALS = {"nan": float("nan"), "zero": 0.0, "negative": -0.5, "inf": float("inf")}


def _refused(run_cli, src: Path, dst: Path, tensor: str, *args: str) -> str:
    before = tree_state(src)
    line = assert_one_line_error(*run_cli("convert", src, dst, *args), tensor, "corrupt", f"quantcli verify {src}")
    assert tree_state(src) == before
    assert_nothing_left(dst)
    return line


@pytest.mark.parametrize("action", ACTIONS)
@pytest.mark.parametrize("value", GLOBALS)
def test_bad_global_scale_is_refused_before_writing(quantized, tmp_path, run_cli, value, action):
    name = f"{MODULE}.weight_scale_2"
    src = _corrupt(quantized["nvfp4-modelopt"], tmp_path / "src", name, _fill(GLOBALS[value]))
    line = _refused(run_cli, src, tmp_path / "dst", name, *ACTIONS[action])
    assert "global scale" in line


@pytest.mark.parametrize("value", ["zero", "nan"])
def test_bad_divisor_global_scale_is_refused(quantized, tmp_path, run_cli, value):
    """compressed-tensors stores the divisor: 0 there would decode to Inf."""
    name = f"{MODULE}.weight_global_scale"
    src = _corrupt(quantized["nvfp4-ct"], tmp_path / "src", name, _fill(GLOBALS[value]))
    _refused(run_cli, src, tmp_path / "dst", name, "--recipe", "nvfp4")  # a re-layout to modelopt


BLOCK_CASES = {  # id -> (source, tensor suffix, edit, what the message says)
    "e4m3-nan": ("nvfp4-modelopt", "weight_scale", _set_byte((3, 1), 0x7F), "E4M3 block scale nan"),
    "e4m3-negative-nan": ("nvfp4-modelopt", "weight_scale", _set_byte((0, 0), 0xFF), "E4M3 block scale nan"),
    "e4m3-negative": ("nvfp4-modelopt", "weight_scale", _set_byte((2, 2), 0xB8), "E4M3 block scale -1.0 at [2, 2]"),
    "e8m0-255": ("mxfp8-ct", "weight_scale", _set_byte((1, 0), 255), "E8M0 block scale byte 255"),
    "f32-negative": ("fp8-block", "weight_scale_inv", _fill(-0.5), "block scale -0.5 at [0, 0]"),
    "f32-nan": ("fp8-block", "weight_scale_inv", _fill(float("nan")), "block scale nan"),
}


@pytest.mark.parametrize("case", BLOCK_CASES)
def test_bad_block_scale_is_refused_before_writing(quantized, tmp_path, run_cli, case):
    source, suffix, edit, said = BLOCK_CASES[case]
    name = f"{MODULE}.{suffix}"
    src = _corrupt(quantized[source], tmp_path / "src", name, edit)
    line = _refused(run_cli, src, tmp_path / "dst", name, "--recipe", "bf16")
    assert said in line


@pytest.mark.parametrize("source,suffix", [("nvfp4-modelopt", "weight_scale"), ("fp8-block", "weight_scale_inv")])
def test_zero_block_scales_are_legal(quantized, tmp_path, run_cli, source, suffix):
    """All-zero blocks: older modelopt writes E4M3 0, HF FineGrainedFP8 an F32 0 (docs/formats.md,
    "Zero blocks and scale values producers write")."""
    src = _corrupt(quantized[source], tmp_path / "src", f"{MODULE}.{suffix}", _fill(0.0))
    code, out, err = run_cli("convert", src, tmp_path / "dst", "--recipe", "bf16", "--quiet")
    assert code == 0, err
    for shard in (tmp_path / "dst").glob("*.safetensors"):
        assert all(torch.isfinite(t.float()).all() for t in load_file(str(shard)).values() if t.is_floating_point())


def test_inspect_lists_a_bad_global_scale(quantized, tmp_path, run_cli):
    name = f"{MODULE}.weight_scale_2"
    src = _corrupt(quantized["nvfp4-modelopt"], tmp_path / "src", name, _fill(-1.0))
    code, out, err = run_cli("inspect", src, "--json")
    assert code == 0, err
    problems = json.loads(out)["problems"]
    assert any(name in p and "global scale -1.0" in p and "corrupt" in p for p in problems), problems


# ---------------------------------------------------------------- 3. compressed-tensors config_groups

def _with_group_edit(nvfp4: Path, tmp_path: Path, edit) -> Path:
    path = tmp_path / "ckpt"
    shutil.copytree(nvfp4, path)
    (path / "quantcli_manifest.json").unlink()  # read the config, as for another producer's checkpoint
    config = json.loads((path / "config.json").read_text())
    edit(config["quantization_config"]["config_groups"]["group_0"])
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("command", ["verify", "convert", "inspect"])
def test_invalid_target_regex_is_refused(command, quantized, tmp_path, run_cli):
    path = _with_group_edit(quantized["nvfp4-ct"], tmp_path, lambda g: g.update(targets=["Linear", "re:model.(layers"]))
    dst = tmp_path / "out"
    args = ("convert", path, dst, "--recipe", "fp8-block") if command == "convert" else (command, path)
    code, out, err = run_cli(*args)
    assert_one_line_error(code, out, err, "config.json", "config_groups.group_0.targets", "not a valid regex")
    assert_nothing_left(dst)


def test_group_size_disagreeing_with_the_blocks_is_reported(quantized, tmp_path, run_cli):
    path = _with_group_edit(quantized["nvfp4-ct"], tmp_path, lambda g: g["weights"].update(group_size=32))
    code, out, _ = run_cli("verify", path, "--json")
    assert code == 1
    assert "group_0.weights.group_size is 32, but nvfp4 blocks hold 16" in out
