"""verify --exact and inspect on checkpoints convert rounded by GPTQ (--rounding gptq).

--exact without the calibration data lists the GPTQ modules as not byte-checked and names the
data; with it, verify reruns quantcli's own conversion of the reference with the options and data
the manifest records and compares each GPTQ module's bytes: quantcli's output passes, codes
changed after convert fail, other data is refused in one line (exit 2). Every recipe's GPTQ
output passes verify --reference with and without --calibration (and with act order static).
inspect shows the rounding the manifest records."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from quantcli.testing import make_llama

DOWN = "model.layers.0.mlp.down_proj"


def _ids(path: Path, samples: int, seed: int = 0) -> Path:
    r = random.Random(seed)
    path.write_text("".join(json.dumps({"input_ids": [r.randrange(512) for _ in range(r.randrange(8, 17))]}) + "\n"
                            for _ in range(samples)))
    return path


def _convert(src: Path, dst: Path, data: Path, recipe: str = "nvfp4", *extra: str) -> Path:
    from quantcli.cli.app import main

    with pytest.raises(SystemExit) as exc:
        main(["convert", str(src), str(dst), "--recipe", recipe, "--rounding", "gptq", "--calibration", str(data),
              "--gptq-min-tokens", "8", "--device", "cpu", "--quiet", *extra])
    assert exc.value.code == 0
    return dst


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("vgptq")
    src = make_llama(root / "llama", hidden=64, layers=1, shards=1)
    data = _ids(root / "ids.jsonl", 12)
    return {"src": src, "data": data, "dst": _convert(src, root / "gptq", data), "root": root}


def _verify(run_cli, quant, src, *args):
    code, out, err = run_cli("verify", quant, "--reference", src, *args, "--json")
    return code, (json.loads(out) if out else None), err


def _gptq_modules(dst: Path) -> list[str]:
    manifest = json.loads((dst / "quantcli_manifest.json").read_text())
    return sorted(m["module"] for m in manifest["modules"] if m.get("rounding", {}).get("method") == "gptq")


def test_exact_without_data_lists_gptq_modules_and_names_the_data(made, run_cli):
    from test_json_schema import validate

    gptq = _gptq_modules(made["dst"])
    assert gptq
    code, doc, _ = _verify(run_cli, made["dst"], made["src"], "--exact")
    assert code == 0 and doc["passed"], doc["faults"]
    validate("verify", doc)
    assert sorted(doc["not_byte_checked"]) == gptq and "gptq_rerun" not in doc
    note = next(n for n in doc["notes"] if "GPTQ" in n)
    assert f"{len(gptq)} module(s) were rounded by GPTQ" in note and "recorded as ids.jsonl" in note
    assert all("exact_identical_fraction" not in t for t in doc["tensors"])  # never held to round to nearest
    code, out, _ = run_cli("verify", made["dst"], "--reference", made["src"], "--exact")
    assert code == 0 and f"PASS ({len(gptq)} module(s) not byte-checked: need --calibration)" in out


def test_exact_with_data_reruns_gptq_and_reproduces_the_bytes(made, run_cli):
    from test_json_schema import validate

    gptq = _gptq_modules(made["dst"])
    code, doc, _ = _verify(run_cli, made["dst"], made["src"], "--exact", "--calibration", made["data"])
    assert code == 0 and doc["passed"], doc["faults"]
    validate("verify", doc)
    assert doc["gptq_rerun"]["modules"] == doc["gptq_rerun"]["identical"] == len(gptq)
    assert doc["not_byte_checked"] == []
    rows = {t["tensor"]: t for t in doc["tensors"]}
    assert all(rows[m]["exact_identical_fraction"] == 1.0 for m in gptq)
    assert any("reran GPTQ" in n and " s: " in n for n in doc["notes"])  # the text output says how long
    # quantcli's own error (ours) is round to nearest's, GPTQ modules included: the report says so
    assert all(rows[m]["baseline_rounding"] == "nearest" for m in gptq)
    code, out, _ = run_cli("verify", made["dst"], "--reference", made["src"], "--exact", "--calibration", made["data"])
    assert code == 0 and "(nearest)" in out and "ours (nearest): quantcli's own quantization rounded to nearest" in out


def _shard_with(folder: Path, name: str) -> Path:
    return next(p for p in folder.glob("*.safetensors") if name in load_file(p))


def test_codes_changed_after_convert_fail_exact_with_data(made, run_cli, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(made["dst"], bad)
    shard = _shard_with(bad, f"{DOWN}.weight")
    tensors = load_file(shard)
    codes = tensors[f"{DOWN}.weight"].clone()
    codes[0, :3] ^= 1  # three packed NVFP4 bytes, one code step each: still valid codes
    tensors[f"{DOWN}.weight"] = codes
    save_file(tensors, str(shard), metadata={"format": "pt"})
    code, doc, _ = _verify(run_cli, bad, made["src"], "--exact", "--calibration", made["data"])
    assert code == 1 and not doc["passed"]
    exact = [f for f in doc["faults"] if f["fault"].startswith("--exact:")]
    assert [f["tensor"] for f in exact] == [DOWN]
    assert "of bytes differ from rerunning GPTQ with the recorded options and data" in exact[0]["fault"]
    assert doc["gptq_rerun"]["identical"] == doc["gptq_rerun"]["modules"] - 1


def test_per_module_recipes_and_rounding_overrides_are_rebuilt_from_the_manifest(made, run_cli, tmp_path):
    """A recipe file's [[override]] (the manifest records each module's recipe, not the pattern:
    rebuilt as exact names) and [[rounding_override]] (recorded as given): the rerun has the
    manifest's fingerprint and reproduces the bytes."""
    config = tmp_path / "recipe.toml"
    config.write_text('recipe = "nvfp4"\nrounding = "gptq"\n[[override]]\npattern = "mlp.down_proj"\n'
                      'recipe = "fp8"\n[[rounding_override]]\npattern = "self_attn.o_proj"\nrounding = "nearest"\n')
    dst = tmp_path / "mixed"
    code, _, err = run_cli("convert", made["src"], dst, "--config", config, "--layout", "compressed-tensors",
                           "--calibration", made["data"], "--gptq-min-tokens", "8", "--device", "cpu", "--quiet")
    assert code == 0, err
    gptq = _gptq_modules(dst)
    assert DOWN in gptq and "model.layers.0.self_attn.o_proj" not in gptq
    code, doc, _ = _verify(run_cli, dst, made["src"], "--exact", "--calibration", made["data"])
    assert code == 0 and doc["passed"], doc["faults"]
    assert doc["gptq_rerun"]["identical"] == doc["gptq_rerun"]["modules"] == len(gptq)


def test_other_data_is_refused_in_one_line(made, run_cli, tmp_path):
    other = _ids(tmp_path / "ids.jsonl", 12, seed=1)
    code, out, err = run_cli("verify", made["dst"], "--reference", made["src"], "--exact", "--calibration", other)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "not the data" in err and "ids.jsonl" in err


def test_a_reference_other_than_the_source_is_refused(made, run_cli, tmp_path, capsys):
    """The conversion rebuilt on another reference (here the same model in two shards: other
    headers) does not have the manifest's fingerprint: refused, not compared."""
    other = make_llama(tmp_path / "other", hidden=64, layers=1, shards=2)
    capsys.readouterr()  # make_llama's progress
    code, _, err = run_cli("verify", made["dst"], "--reference", other, "--exact", "--calibration", made["data"])
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "cannot rebuild the conversion options" in err and "is not the source" in err


def test_an_interrupted_rerun_leaves_no_temporary_folder(made, run_cli, tmp_path, monkeypatch):
    import tempfile

    import quantcli.verify.gptq_exact as gptq_exact

    def interrupted(plan, out, run):
        out.mkdir()
        (out / "model.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(gptq_exact, "convert", interrupted)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    code, _, _ = run_cli("verify", made["dst"], "--reference", made["src"], "--exact", "--calibration", made["data"])
    assert code == 130 and list((tmp_path / "tmp").iterdir()) == []


def test_inspect_shows_the_rounding(made, run_cli):
    from test_json_schema import validate

    code, out, _ = run_cli("inspect", made["dst"], "--per-tensor")
    assert code == 0
    assert "rounding: GPTQ (dampening 0.01, act order static, scales updated, 128-column blocks" in out
    assert "modules by GPTQ; layer-output error on the calibration data" in out
    manifest = json.loads((made["dst"] / "quantcli_manifest.json").read_text())
    record = next(m["rounding"] for m in manifest["modules"] if m["module"] == DOWN)
    line = next(line for line in out.splitlines() if DOWN in line and "gptq" in line)
    assert f"{record['nearest_output_error']:#.4g} -> {record['output_error']:#.4g}" in line
    code, out, _ = run_cli("inspect", made["dst"], "--json")
    doc = validate("inspect", json.loads(out))
    assert doc["rounding"] == manifest["rounding"]
    assert next(m for m in doc["modules"] if m["module"] == DOWN)["rounding"] == record


# ------------------------------------------------------------- every recipe's GPTQ output passes

RECIPES = ("nvfp4", "mxfp4", "mxfp8", "fp8", "fp8-channel", "fp8-block", "int8-channel", "int4")


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """int4 groups 128 input channels: hidden 128 (intermediate 256)."""
    root = tmp_path_factory.mktemp("vgptq-recipes")
    return make_llama(root / "llama", hidden=128, layers=1, shards=1), _ids(root / "ids.jsonl", 12), root


@pytest.mark.parametrize("act_order", ["none", "static"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipes_gptq_output_passes_verify(recipe, act_order, wide, run_cli):
    src, data, root = wide
    dst = root / f"{recipe}-{act_order}"
    code, _, err = run_cli("convert", src, dst, "--recipe", recipe, "--rounding", "gptq", "--calibration", data,
                           "--gptq-min-tokens", "8", "--gptq-act-order", act_order, "--device", "cpu", "--quiet")
    assert code == 0, err
    assert _gptq_modules(dst)  # GPTQ, not round to nearest's fallback
    code, doc, _ = _verify(run_cli, dst, src)
    assert code == 0 and doc["passed"], doc["faults"]
    code, doc, _ = _verify(run_cli, dst, src, "--exact", "--calibration", data)
    assert code == 0 and doc["passed"], doc["faults"]
    assert doc["gptq_rerun"]["identical"] == doc["gptq_rerun"]["modules"] > 0
    assert all(t["output_rel_err"] < t["output_rounded_rel_err"] for t in doc["tensors"])
