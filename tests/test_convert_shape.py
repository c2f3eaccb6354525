"""Convert as passes -> a pure per-shard job -> finalize (issue 11): shards converted in any
order give the same bytes and results, pass 1 reaches quantization only as ModuleFacts, and
--resume rebuilds the manifest from the results recorded in the progress file."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from faults import after_each_shard, assert_one_line_error, tree_state

import quantcli.convert.job as job_mod
from quantcli.checkpoint.source import open_source
from quantcli.checkpoint.tensors import CheckpointTensors
from quantcli.convert import PROGRESS_NAME, convert_shard, learn_facts
from quantcli.convert.reading import ModuleReader
from quantcli.planning.conversion import plan_conversion
from quantcli.planning.plan import Options
from quantcli.testing import make_llama


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_llama(tmp_path_factory.mktemp("shape") / "llama", hidden=64, layers=2, shards=2)


def nvfp4_plan(src: Path):
    return plan_conversion(open_source(str(src), None), Options(recipe="nvfp4"))


def convert_in_order(plan, order: list[str], out: Path) -> dict:
    """Each shard with its own reader, as separate workers would."""
    out.mkdir()
    with CheckpointTensors(plan.source) as tensors:
        facts = learn_facts(ModuleReader(plan, tensors, torch.device("cpu"), "torch"))
    results = {}
    for shard in order:
        with CheckpointTensors(plan.source) as tensors:
            reader = ModuleReader(plan, tensors, torch.device("cpu"), "torch")
            results[shard] = convert_shard(reader, shard, facts, out / shard)
    return results


def test_shards_in_any_order_give_the_same_bytes_and_results(llama, tmp_path, run_cli):
    plan = nvfp4_plan(llama)
    shards = list(plan.by_shard())
    assert len(shards) == 2
    forward = convert_in_order(plan, shards, tmp_path / "fwd")
    backward = convert_in_order(plan, shards[::-1], tmp_path / "bwd")
    assert forward == backward
    code, _, err = run_cli("convert", llama, tmp_path / "cli", "--recipe", "nvfp4", "--quiet", "--device", "cpu",
                           "--backend", "torch")
    assert code == 0, err
    for shard, result in forward.items():
        data = (tmp_path / "cli" / shard).read_bytes()
        assert (result.size, result.sha256) == (len(data), hashlib.sha256(data).hexdigest())
        # each result carries exactly its own shard's global scales, and they are the manifest's
        mods = {t.module for t in plan.tensors if t.shard == shard and t.quantized}
        assert set(result.found.globals) == mods and mods
    manifest = json.loads((tmp_path / "cli" / "quantcli_manifest.json").read_text())
    written = {m["module"]: d["value"] for m in manifest["modules"] for d in m["tensors"]
               if d["role"] == "global_scale"}
    assert written == {m: v for r in forward.values() for m, v in r.found.globals.items()}


def test_pass_one_gives_each_fused_member_its_group_amax(llama):
    plan = nvfp4_plan(llama)
    with CheckpointTensors(plan.source) as tensors:
        facts = learn_facts(ModuleReader(plan, tensors, torch.device("cpu"), "torch"))
        expected = {}
        for group, members in plan.fused_groups().items():
            amax = max(float(tensors.get(t.name).float().abs().max()) for t in members)
            expected.update({t.module: amax for t in members})
    assert {m: float(f.group_amax) for m, f in facts.items()} == expected
    assert any("q_proj" in m for m in facts) and not any("o_proj" in m for m in facts)


def test_resume_rebuilds_the_manifest_from_recorded_results(llama, tmp_path, run_cli, monkeypatch):
    flags = ("--recipe", "nvfp4", "--quiet", "--device", "cpu")
    code, _, err = run_cli("convert", llama, tmp_path / "clean", *flags)
    assert code == 0, err
    dst = tmp_path / "out"

    def stop(written: int) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        after_each_shard(m, stop)
        code, _, err = run_cli("convert", llama, dst, *flags)
    assert code == 130, err
    state = json.loads((dst.with_name("out.partial") / PROGRESS_NAME).read_text())
    (done, rec), = state["shards"].items()
    assert rec["globals"] and all(m.startswith("model.") for m in rec["globals"])  # what that shard learned
    converted = []
    real = job_mod.convert_shard

    def counting(reader, shard, *args):
        converted.append(shard)
        return real(reader, shard, *args)

    with monkeypatch.context() as m:
        m.setattr(job_mod, "convert_shard", counting)
        code, out, err = run_cli("convert", llama, dst, *flags, "--resume", "--json")
    assert code == 0, err
    assert done not in converted and len(converted) == 1  # the recorded shard was not converted again
    assert tree_state(dst) == tree_state(tmp_path / "clean")  # ... yet its globals reached the manifest


def test_progress_record_without_findings_is_refused_in_one_line(llama, tmp_path, run_cli, monkeypatch):
    flags = ("--recipe", "nvfp4", "--quiet", "--device", "cpu")
    dst = tmp_path / "out"

    def stop(written: int) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        after_each_shard(m, stop)
        assert run_cli("convert", llama, dst, *flags)[0] == 130
    path = dst.with_name("out.partial") / PROGRESS_NAME
    state = json.loads(path.read_text())
    for rec in state["shards"].values():
        del rec["globals"]  # a record that cannot rebuild the manifest
    path.write_text(json.dumps(state))
    before = tree_state(dst.with_name("out.partial"))
    code, out, err = run_cli("convert", llama, dst, *flags, "--resume")
    assert_one_line_error(code, out, err, str(path), "corrupt", "--overwrite")
    assert tree_state(dst.with_name("out.partial")) == before
