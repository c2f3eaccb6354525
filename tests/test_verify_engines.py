"""verify says where a checkpoint loads, as convert and inspect do: the engines table's checks
settled on its shapes and config ('loads in:'), and a warning where no engine loads it as it is,
though each (recipe, layout) pair is one an engine loads (then the pair check alone said ok)."""

from __future__ import annotations

import json

import pytest

from quantcli.testing import make_llama

pytest.importorskip("transformers")

from tests.test_json_schema import validate  # noqa: E402


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_llama(tmp_path_factory.mktemp("engines") / "llama", hidden=64, layers=1, shards=1)


def test_an_output_no_engine_loads_is_said_so_and_one_that_loads_names_the_engines(run_cli, llama, tmp_path):
    for recipe in ("fp8-block", "nvfp4"):
        code, _, err = run_cli("convert", llama, tmp_path / recipe, "--recipe", recipe, "-q")
        assert code == 0, err
    code, out, err = run_cli("convert", llama, tmp_path / "again", "--recipe", "fp8-block")
    assert code == 0 and "loads in: no engine" in out  # what convert says of the 64-wide fp8-block output
    code, out, err = run_cli("verify", tmp_path / "fp8-block")
    assert code == 0 and "  loads in: no engine" in out and out.rstrip().endswith("PASS")  # its bytes are right
    assert "warning: no serving engine loads this checkpoint as it is (vLLM: needs" in out and "quantcli inspect" in out
    doc = validate("verify", json.loads(run_cli("verify", tmp_path / "fp8-block", "--json")[1]))
    assert doc["loads_in"] == "no engine" and any("no serving engine loads" in w for w in doc["warnings"])
    code, out, err = run_cli("verify", tmp_path / "nvfp4")
    assert code == 0 and "  loads in: vLLM, SGLang" in out and "warning" not in out + err
