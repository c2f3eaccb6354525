"""Every command's --json is a stable, documented document: it validates against its JSON Schema
in quantcli/schemas/ (shipped with the package), carries the envelope (quantcli_version,
schema_version, command, source/destination where they apply), writes `excluded` in one shape,
and verify records the thresholds it applied. The outputs validated here are real runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator
from referencing import Registry, Resource

from quantcli import __version__
from quantcli.reports import SCHEMA_VERSION, envelope, json_schema
from quantcli.testing import make_llama, make_moe

SCHEMA_DIR = Path(__file__).resolve().parents[1] / "quantcli" / "schemas"
SCHEMAS = sorted(p.stem for p in SCHEMA_DIR.glob("*.json"))


def _validator(name: str) -> Draft202012Validator:
    registry = Registry().with_resources(
        (json_schema(n)["$id"], Resource.from_contents(json_schema(n))) for n in SCHEMAS)
    return Draft202012Validator(json_schema(name), registry=registry)


def validate(name: str, doc: dict) -> dict:
    errors = sorted(_validator(name).iter_errors(doc), key=lambda e: list(e.path))
    assert not errors, f"{name}: " + "; ".join(f"{list(e.path)}: {e.message}" for e in errors[:5])
    return doc


def run_json(run_cli, *args, code: int = 0) -> dict:
    got, out, err = run_cli(*map(str, args), "--json")
    assert got == code, err
    return json.loads(out, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("schema")
    return {"llama": make_llama(root / "llama", hidden=64, layers=1, shards=2),
            "moe": make_moe(root / "moe", hidden=64, layers=1, shards=1), "root": root}


@pytest.fixture(scope="module")
def nvfp4(sources, tmp_path_factory):
    from quantcli.cli.app import main

    dst = sources["root"] / "llama-nvfp4"
    with pytest.raises(SystemExit) as exc:
        main(["convert", str(sources["llama"]), str(dst), "--recipe", "nvfp4", "--quiet"])
    assert exc.value.code == 0
    return dst


def test_every_schema_is_a_valid_draft_2020_12_schema_and_every_command_has_one():
    from quantcli.cli.app import app

    for name in SCHEMAS:
        Draft202012Validator.check_schema(json_schema(name))
    commands = {c.name or c.callback.__name__ for c in app.registered_commands}
    missing = {c for c in commands if c != "help"} - set(SCHEMAS)
    assert not missing, f"commands without a JSON Schema in quantcli/schemas/: {sorted(missing)}"


def test_convert_json_validates_with_envelope_and_one_excluded_shape(run_cli, sources, tmp_path):
    doc = validate("convert", run_json(run_cli, "convert", sources["moe"], tmp_path / "out", "--recipe", "fp8"))
    assert (doc["quantcli_version"], doc["schema_version"], doc["command"]) == (__version__, SCHEMA_VERSION, "convert")
    assert doc["source"] == str(sources["moe"]) and doc["destination"] == str(tmp_path / "out")
    assert any(e["module"] == "model.layers.0.block_sparse_moe.gate" and e["reason"] for e in doc["excluded"])
    assert "lm_head" in doc["exclusion_list"] and "dry_run" not in doc


def test_dry_run_json_validates_and_names_the_same_exclusions(run_cli, sources, tmp_path):
    dry = validate("convert-dry-run", run_json(run_cli, "convert", sources["moe"], tmp_path / "o", "--recipe", "fp8",
                                               "--dry-run"))
    real = run_json(run_cli, "convert", sources["moe"], tmp_path / "o", "--recipe", "fp8")
    assert dry["dry_run"] is True and dry["destination"] == str(tmp_path / "o")
    assert dry["excluded"] == real["excluded"] and dry["exclusion_list"] == real["exclusion_list"]
    with pytest.raises(AssertionError):  # the two documents are told apart by their schemas
        validate("convert", dry)


def test_relayout_without_recipe_keeps_the_source_recipe_and_validates(run_cli, nvfp4, tmp_path):
    doc = validate("convert", run_json(run_cli, "convert", nvfp4, tmp_path / "ct", "--layout", "compressed-tensors"))
    assert doc["recipes"] == ["nvfp4"] and doc["layout"] == "compressed-tensors" and doc["lossless"] is True


def test_dequantize_json_validates(run_cli, nvfp4, tmp_path):
    doc = validate("convert", run_json(run_cli, "convert", nvfp4, tmp_path / "bf16", "--recipe", "bf16"))
    assert doc["recipes"] == [] and doc["exclusion_key"] is None


def test_inspect_json_validates_for_quantized_and_dense_checkpoints(run_cli, sources, nvfp4):
    doc = validate("inspect", run_json(run_cli, "inspect", nvfp4, "--stats", "--kv-cache"))
    assert doc["command"] == "inspect" and doc["source"] == str(nvfp4) and "destination" not in doc
    assert doc["excluded"] == [{"module": "lm_head", "reason": "in the config's exclusion list"}]
    dense = validate("inspect", run_json(run_cli, "inspect", sources["moe"]))
    assert dense["layout"] == "unquantized" and dense["excluded"] == []


def test_inspect_json_of_mx_stats_validates(run_cli, sources, tmp_path):
    code, _, err = run_cli("convert", sources["llama"], tmp_path / "mx", "--recipe", "mxfp4", "--quiet")
    assert code == 0, err
    doc = validate("inspect", run_json(run_cli, "inspect", tmp_path / "mx", "--stats"))
    assert all("e8m0_histogram" in m["stats"] for m in doc["modules"])


def test_verify_json_validates_and_records_thresholds(run_cli, sources, nvfp4):
    doc = validate("verify", run_json(run_cli, "verify", nvfp4, "--reference", sources["llama"]))
    assert doc["source"] == str(sources["llama"]) and doc["destination"] == str(nvfp4) and doc["passed"]
    t = doc["thresholds"]
    assert t["margin"] is None and "sqrt" in t["margin_rule"] and t["rel_err"] is None
    strict = validate("verify", run_json(run_cli, "verify", nvfp4, "--reference", sources["llama"], "--threshold",
                                         "rel_err=1e-9", "--threshold", "margin=0.05", code=1))
    assert strict["thresholds"] == {"margin": 0.05, "margin_rule": None, "rel_err": 1e-9, "sqnr_db": None,
                                    "cosine": None}
    assert not strict["passed"] and strict["faults"]


def test_margin_rule_says_what_verify_applies():
    """Without --threshold margin= no module is held to quantcli's own error (judge.py judges it as
    a rounding); the size rule of limits.py applies to re-quantized modules only (compare.py)."""
    from quantcli.cli.commands import applied_thresholds
    from quantcli.verify.judge import ERROR_FACTOR, OUTPUT_MARGIN
    from quantcli.verify.limits import TOLERANCE_FLOOR, TOLERANCE_NOISE, Limits

    rule = applied_thresholds(Limits())["margin_rule"]
    assert rule.startswith("none over quantcli's own error") and f"{ERROR_FACTOR:g} x" in rule
    assert f"{OUTPUT_MARGIN:.0%}" in rule and "--calibration" in rule
    assert rule.endswith(f"re-quantized from a quantized source: both quantizations' errors x (1 + "
                         f"{TOLERANCE_FLOOR:g} + {TOLERANCE_NOISE:g} / sqrt(max(1, numel / 128)))")
    assert applied_thresholds(Limits(margin=0.05))["margin_rule"] is None


def test_verify_json_without_reference_and_of_a_dequantized_output_validates(run_cli, sources, nvfp4, tmp_path):
    alone = validate("verify", run_json(run_cli, "verify", nvfp4))
    assert alone["source"] is None and alone["tensors"] == []
    code, _, err = run_cli("convert", nvfp4, tmp_path / "bf16", "--recipe", "bf16", "--quiet")
    assert code == 0, err
    # identical tensors have an infinite SQNR: written as the string "Infinity", strict JSON
    doc = validate("verify", run_json(run_cli, "verify", tmp_path / "bf16", "--reference", nvfp4))
    assert doc["passed"] and doc["tensors"] and all(r["sqnr_db"] == "Infinity" for r in doc["tensors"])


def test_envelope_writes_strict_json_and_refuses_non_objects():
    doc = envelope("inspect", {"x": float("nan"), "y": [float("-inf"), 1.5]}, source=Path("a/b"))
    assert doc == {"quantcli_version": __version__, "schema_version": SCHEMA_VERSION, "command": "inspect",
                   "source": "a/b", "x": "NaN", "y": ["-Infinity", 1.5]}
    json.dumps(doc, allow_nan=False)
    with pytest.raises(TypeError):
        envelope("inspect", [1, 2])


def test_recipes_and_layouts_json_validate(run_cli):
    recipes = validate("recipes", run_json(run_cli, "recipes"))
    assert recipes["command"] == "recipes" and {r["name"] for r in recipes["recipes"]} >= {"nvfp4", "fp8"}
    schemes = {s["scheme"]: s for s in recipes["llm_compressor"]}
    assert schemes["NVFP4"]["options"] == ("--recipe nvfp4 --layout compressed-tensors --activations static "
                                           "--calibration DATA")
    layouts = validate("layouts", run_json(run_cli, "layouts"))
    assert layouts["loadability"]["compressed-tensors"]["nvfp4"] == "loads"
    assert layouts["layouts"][0]["verdicts"]["nvfp4"][0]["rules"][0].startswith("vllm-project/vllm 0.33.0 ")
