"""inspect's tables at scale and at 80 columns: input and KV-cache scales grouped by layer pattern
as the modules table is; --stats puts the saturation absmax scaling causes by construction (NVFP4:
one code per 16-block, 6.25 %) beside the measured one; E8M0 columns only where a recipe has E8M0
scales."""

from __future__ import annotations

import json

import pytest

from quantcli.formats.analysis import inherent_saturation
from quantcli.recipes import get_recipe
from quantcli.testing import make_llama


@pytest.fixture(scope="module")
def outs(tmp_path_factory):
    from quantcli.cli.app import main

    root = tmp_path_factory.mktemp("tables")
    src = make_llama(root / "llama", hidden=64, layers=3, shards=1)
    data = root / "ids.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [(3 * i + j) % 512 for j in range(10)]}) + "\n" for i in range(3)))
    found = {}
    for name, args in (("nvfp4", ["--recipe", "nvfp4", "--activations", "static", "--kv-cache", "fp8",
                                  "--calibration", str(data)]),
                       ("mxfp4", ["--recipe", "mxfp4"])):
        with pytest.MonkeyPatch.context() as mp, pytest.raises(SystemExit) as exc:
            mp.setattr("sys.argv", ["quantcli", "convert", str(src), str(root / name), *args, "--quiet"])
            main()
        assert not exc.value.code
        found[name] = root / name
    return found


def test_input_and_kv_scales_grouped_like_the_modules(outs, run_cli, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    out = run_cli("inspect", outs["nvfp4"])[1]
    table = out.split("\ninput scales\n")[1].split("KV-cache scales")[0]
    rows = [line for line in table.splitlines() if line.startswith("│")]
    assert len(rows) == 7  # one per projection pattern, not 21 tensors
    assert "model.layers.{0..2}.mlp.down_proj.input_scale" in table and "multiply" in table
    kv = out.split("KV-cache scales")[1].split("totals")[0]
    assert "model.layers.{0..2}.self_attn │ 3 │" in kv
    per_tensor = run_cli("inspect", outs["nvfp4"], "--per-tensor")[1]
    assert per_tensor.count(".input_scale ") == 21


def test_stats_show_inherent_saturation_and_no_e8m0_columns_for_nvfp4(outs, run_cli, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    out = run_cli("inspect", outs["nvfp4"], "--stats")[1]
    stats = out.split("data (--stats)")[1].split("activations:")[0]
    assert "(6.25% inherent)" in stats and "E8M0" not in stats
    doc = json.loads(run_cli("inspect", outs["nvfp4"], "--stats", "--json")[1])
    assert {m["stats"]["saturated_inherent"] for m in doc["modules"]} == {0.0625}
    assert all(m["stats"]["saturated_fraction"] >= 0.0625 for m in doc["modules"])
    mx = run_cli("inspect", outs["mxfp4"], "--stats")[1].split("data (--stats)")[1]
    assert "E8M0 exp" in mx and "inherent" not in mx and "scale range" not in mx


def test_inherent_saturation_is_one_code_per_block():
    assert inherent_saturation(get_recipe("nvfp4"), (64, 128)) == 1 / 16
    assert inherent_saturation(get_recipe("fp8-channel"), (64, 128)) == 1 / 128
    assert inherent_saturation(get_recipe("fp8"), (64, 128)) == 1 / (64 * 128)
    assert inherent_saturation(get_recipe("fp8-block"), (192, 128)) == 2 / (192 * 128)  # a partial edge block
    assert inherent_saturation(get_recipe("mxfp8"), (64, 128)) is None
