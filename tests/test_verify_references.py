"""verify against quantized references, re-quantized outputs and dequantized outputs.

One tiny Llama is quantized to NVFP4 (ModelOpt), then re-laid out (compressed-tensors),
re-quantized (fp8-block) and dequantized (bf16). Each output is verified against the NVFP4 source
and against the original BF16 model; corrupted outputs (block scales doubled, one dequantized
weight nudged by one BF16 step) must still fail.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from faults import assert_one_line_error

from quantcli.checkpoint.manifest import MANIFEST_NAME, Manifest
from quantcli.checkpoint.safetensors_io import write_file
from quantcli.testing import make_llama
from quantcli.verify.findings import REF_ERROR


def _convert(src: Path, dst: Path, *args: str) -> Path:
    import sys

    from quantcli.cli.app import main

    old = sys.argv
    sys.argv = ["quantcli", "convert", str(src), str(dst), "--quiet", *args]
    try:
        with pytest.raises(SystemExit) as exc:
            main()
    finally:
        sys.argv = old
    assert (exc.value.code or 0) == 0, f"convert {args} failed"
    return dst


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("verify_refs")
    orig = make_llama(root / "orig", hidden=64, layers=1, shards=1)
    nv = _convert(orig, root / "nv", "--recipe", "nvfp4", "--layout", "modelopt")
    return {"orig": orig, "nv": nv,
            "ct": _convert(nv, root / "ct", "--recipe", "nvfp4", "--layout", "compressed-tensors"),
            "fb": _convert(nv, root / "fb", "--recipe", "fp8-block"),
            "dense": _convert(nv, root / "dense", "--recipe", "bf16")}


def _verify(run_cli, *args) -> tuple[int, dict, str]:
    code, out, err = run_cli("verify", *map(str, args), "--json")
    assert "Traceback" not in err, err
    return code, json.loads(out), err


def _single_shard(folder: Path) -> Path:
    (shard,) = folder.glob("*.safetensors")
    return shard


def _rewrite(folder: Path, change) -> None:
    """Rewrite the (single) shard of `folder` with change(tensors) applied."""
    from safetensors.torch import load_file

    shard = _single_shard(folder)
    tensors = load_file(shard)
    change(tensors)
    shard.unlink()
    write_file(shard, tensors)


def _corrupt_copy(src: Path, dst: Path, change) -> Path:
    shutil.copytree(src, dst)
    _rewrite(dst, change)
    return dst


# ---------------------------------------------------------------- 1. quantized reference


def test_relayout_against_its_quantized_source_is_identical(ckpts, run_cli):
    code, doc, _ = _verify(run_cli, ckpts["ct"], "--reference", ckpts["nv"])
    assert code == 0, doc["faults"]
    assert doc["reference_kind"] == "quantized (modelopt)"
    assert len(doc["tensors"]) == 7
    assert all(t["rel_err"] == 0.0 and t["limit_rel_err"] == 0.0 for t in doc["tensors"])
    assert all(t["limit_basis"] == "identical to the decoded reference" for t in doc["tensors"])
    # the human report says so too
    code, out, _ = run_cli("verify", ckpts["ct"], "--reference", ckpts["nv"])
    assert code == 0 and "identical to the decoded reference" in out and "PASS" in out


def test_relayout_exact_compares_the_references_own_bytes(ckpts, run_cli):
    code, doc, _ = _verify(run_cli, ckpts["ct"], "--reference", ckpts["nv"], "--exact")
    assert code == 0, doc["faults"]
    assert all(t["exact_identical_fraction"] == 1.0 for t in doc["tensors"])


def test_relayout_with_changed_codes_fails_against_the_quantized_source(ckpts, tmp_path, run_cli):
    def flip_nibbles(t):  # swap the two FP4 codes of every byte of one module
        codes = t["model.layers.0.mlp.up_proj.weight_packed"]
        t["model.layers.0.mlp.up_proj.weight_packed"] = ((codes >> 4) | (codes << 4)).to(torch.uint8)

    bad = _corrupt_copy(ckpts["ct"], tmp_path / "ct-bad", flip_nibbles)
    code, doc, _ = _verify(run_cli, bad, "--reference", ckpts["nv"], "--exact")
    assert code == 1
    faults = [f for f in doc["faults"] if f["tensor"] == "model.layers.0.mlp.up_proj"]
    assert faults and "must be identical to the decoded reference" in faults[0]["fault"]
    assert len(doc["faults"]) == 1
    row = next(t for t in doc["tensors"] if t["tensor"] == "model.layers.0.mlp.up_proj")
    assert row["exact_identical_fraction"] < 1.0


def test_requantized_against_its_quantized_source_passes(ckpts, run_cli):
    code, doc, _ = _verify(run_cli, ckpts["fb"], "--reference", ckpts["nv"], "--exact")
    assert code == 0, doc["faults"]
    assert all(t["recipe"] == "fp8-block" and t["rel_err"] > 0 for t in doc["tensors"])
    # quantcli's own re-quantization of the decoded source is what convert wrote, byte for byte
    assert all(t["exact_identical_fraction"] == 1.0 for t in doc["tensors"])


# ---------------------------------------------------------------- 2. re-quantized vs the original


def test_manifest_records_requantization(ckpts):
    manifest = Manifest.from_json((ckpts["fb"] / MANIFEST_NAME).read_text())
    assert {m.requantized_from for m in manifest.modules} == {"nvfp4"}
    assert all(0 < m.requantize_rel_err < 0.1 for m in manifest.modules)
    # other manifests do not carry the optional fields at all (their bytes are unchanged)
    assert "requantized_from" not in (ckpts["nv"] / MANIFEST_NAME).read_text()
    assert "requantized_from" not in (ckpts["ct"] / MANIFEST_NAME).read_text()


def test_requantized_against_the_original_passes_with_the_combined_bound(ckpts, run_cli):
    code, doc, _ = _verify(run_cli, ckpts["fb"], "--reference", ckpts["orig"])
    assert code == 0, doc["faults"]
    for t in doc["tensors"]:
        # the error is both quantizations: more than fp8-block alone, within nvfp4 + re-quantize
        assert t["rel_err"] > t["baseline_rel_err"] * 1.5
        assert t["source_recipe"] == "nvfp4" and t["requantize_rel_err"] > 0
        assert "nvfp4" in t["limit_basis"] and "re-quantize" in t["limit_basis"]
    code, out, _ = run_cli("verify", ckpts["fb"], "--reference", ckpts["orig"])
    assert code == 0 and "re-quantize" in out


def test_old_manifest_without_the_record_is_readable_and_judged_plainly(ckpts, tmp_path, run_cli):
    old = tmp_path / "fb-old"
    shutil.copytree(ckpts["fb"], old)
    doc = json.loads((old / MANIFEST_NAME).read_text())
    for m in doc["modules"]:
        m.pop("requantized_from"), m.pop("requantize_rel_err")
    (old / MANIFEST_NAME).write_text(json.dumps(doc))
    code, report, _ = _verify(run_cli, old, "--reference", ckpts["nv"])
    assert code == 0, report["faults"]
    code, report, _ = _verify(run_cli, old, "--reference", ckpts["orig"])
    # without the record, the fp8-block codes are judged as a rounding of the original: they round
    # the NVFP4 decode instead, so each element errs by NVFP4's steps, beyond what FP8 rounding gives
    assert code == 1
    assert all("the most that rounding to the stored scales can give" in f["fault"] for f in report["faults"])


def test_corrupted_requantized_output_fails_against_both_references(ckpts, tmp_path, run_cli):
    def double_scales(t):
        for name in [n for n in t if n.endswith("weight_scale_inv") or n.endswith("weight_scale")]:
            t[name] = t[name] * 2

    bad = _corrupt_copy(ckpts["fb"], tmp_path / "fb-bad", double_scales)
    for reference in (ckpts["nv"], ckpts["orig"]):
        code, doc, _ = _verify(run_cli, bad, "--reference", reference)
        assert code == 1
        assert {f["tensor"] for f in doc["faults"]} == {t["tensor"] for t in doc["tensors"]}
        assert len(doc["tensors"]) == 7
        assert all(f["check"] == REF_ERROR
                   for f in doc["faults"])


# ---------------------------------------------------------------- 3. dequantized output


def test_dequantized_against_its_quantized_source_is_bit_exact(ckpts, run_cli):
    code, doc, _ = _verify(run_cli, ckpts["dense"], "--reference", ckpts["nv"])
    assert code == 0, doc["faults"]
    assert doc["modules"] == 0 and doc["reference_kind"] == "quantized (modelopt)"
    dequantized = [t for t in doc["tensors"] if t["recipe"] == "nvfp4"]
    assert len(dequantized) == 7 and all(t["rel_err"] == 0.0 and t["passed"] for t in dequantized)


def test_dequantized_off_by_one_step_fails_against_its_quantized_source(ckpts, tmp_path, run_cli):
    name = "model.layers.0.self_attn.q_proj.weight"

    def nudge(t):  # one BF16 step on one element: not what decoding the reference gives
        w = t[name].clone()
        w.view(torch.int16).view(-1)[0] += 1
        t[name] = w

    bad = _corrupt_copy(ckpts["dense"], tmp_path / "dense-bad", nudge)
    code, doc, _ = _verify(run_cli, bad, "--reference", ckpts["nv"])
    assert code == 1
    assert [f["tensor"] for f in doc["faults"]] == [name]
    assert "decoded and cast to BF16" in doc["faults"][0]["fault"]


def test_dequantized_against_the_original_fails_not_identical(ckpts, run_cli):
    code, doc, _ = _verify(run_cli, ckpts["dense"], "--reference", ckpts["orig"])
    assert code == 1
    assert len(doc["faults"]) == 7  # the 7 dequantized Linears; embeddings, norms, lm_head identical
    for f in doc["faults"]:
        assert "not bit-identical" in f["fault"] and "checked for identity" in f["fault"]
        assert "pass that one as --reference" in f["fault"]
    assert any(t["tensor"] == "model.embed_tokens.weight" and t["passed"] for t in doc["tensors"])
    code, out, _ = run_cli("verify", ckpts["dense"], "--reference", ckpts["orig"])
    assert code == 1 and "checked for identity" in out


def test_dense_checkpoint_without_reference_is_one_line(ckpts, run_cli):
    code, out, err = run_cli("verify", ckpts["dense"])
    assert_one_line_error(code, out, err, str(ckpts["dense"]), "no quantized modules", "--reference SRC")


# ---------------------------------------------------------------- 4. the convert hint


def test_requantize_warns_and_the_summary_names_the_verify_command_once(ckpts, tmp_path, run_cli):
    dst = tmp_path / "fb2"
    code, out, err = run_cli("convert", ckpts["nv"], dst, "--recipe", "fp8-block")
    assert code == 0
    assert "errors of both quantizations add up" in err
    assert (out + err).count("quantcli verify") == 1
    assert f"quantcli verify {dst} --reference {ckpts['nv']}" in out
