"""Options declared once (planning/settings.py): each GPTQ Setting is a flag in --help with its
field's default, a recipe-file key, a checked value naming where it was given, a manifest key and
a read-back, all from the declaration."""

import json

import pytest

from quantcli.errors import QuantcliError
from quantcli.planning.from_manifest import _roundings
from quantcli.planning.options_file import conversion_options
from quantcli.planning.rounding import GPTQ_SETTINGS
from quantcli.testing import make_llama


def _options(tmp_path, cli: dict, file: str | None = None):
    config = None
    if file is not None:
        config = tmp_path / "recipe.toml"
        config.write_text(file)
    return conversion_options(recipe="nvfp4", layout=None, ignore=[], config=config, scale_rule=None,
                              rounding={"rounding": "gptq", **cli}, calibrate={"calibration": "data.jsonl"})


def test_every_setting_is_a_flag_in_help_with_its_fields_default(run_cli):
    words = " ".join(run_cli("convert", "--help")[1].split())  # the help's wrapping aside
    for s in GPTQ_SETTINGS:
        assert f"{s.flag} {s.metavar} {s.help} [default: {s.default}]" in words, s.flag


# A value other than the default for each setting, as the command line and the file give it.
OTHER = {"dampening": 0.05, "act_order": "none", "scales": "original", "block_columns": 64, "min_tokens": 8,
         "inputs": "dense", "forward": "bfloat16"}


def test_each_setting_reaches_the_plan_from_the_command_line_and_the_file(tmp_path):
    assert set(OTHER) == {s.key for s in GPTQ_SETTINGS}, "a new setting needs a value here"
    for s in GPTQ_SETTINGS:
        value = OTHER[s.key]
        toml = f'{s.file_key} = {json.dumps(value)}\n'
        for rounding in (_options(tmp_path, {s.file_key: value}).rounding, _options(tmp_path, {}, toml).rounding):
            held = rounding.gptq if hasattr(rounding.gptq, s.key) else rounding
            assert getattr(held, s.key) == value and value != s.default
            record = rounding.record()
            assert record[s.key] == value
            assert any(r == rounding for r in _roundings(record, "a manifest")), s.key  # read back alike


@pytest.mark.parametrize("s", GPTQ_SETTINGS, ids=lambda s: s.key)
def test_a_wrong_value_names_where_it_was_given(tmp_path, s):
    bad = "fast" if s.choices else 0
    with pytest.raises(QuantcliError, match=f"^{s.flag}"):
        _options(tmp_path, {s.file_key: bad})
    with pytest.raises(QuantcliError, match=f"{s.file_key}"):
        _options(tmp_path, {}, f"{s.file_key} = {json.dumps(bad)}\n")


def test_block_columns_is_recorded_and_rerun_by_verify_exact(run_cli, tmp_path):
    src = make_llama(tmp_path / "llama", hidden=64, layers=1, shards=1)
    data = tmp_path / "ids.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [(5 * i + 3 * j) % 512 for j in range(16)]}) + "\n"
                            for i in range(8)))
    out = tmp_path / "out"
    code, _, err = run_cli("convert", str(src), str(out), "--recipe", "nvfp4", "--rounding", "gptq", "--calibration",
                           str(data), "--gptq-block-columns", "16", "--device", "cpu", "-q")
    assert code == 0, err
    manifest = json.loads((out / "quantcli_manifest.json").read_text())
    assert manifest["rounding"]["block_columns"] == 16
    code, stdout, err = run_cli("verify", str(out), "--reference", str(src), "--exact", "--calibration", str(data))
    assert code == 0, stdout + err
