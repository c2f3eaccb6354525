"""verify and reference tensors whose value is their shape: a BERT-style `position_ids` buffer
(0, 1, 2, ...) that the reference carries and the quantized checkpoint lacks, as transformers saves
a BertModel (the buffer is non-persistent) and so every llm-compressor output of an older BERT
checkpoint, all-MiniLM-L6-v2's among them. Nothing is lost: a note, not a fault. A `position_ids`
that is not 0..n-1, or any other dropped tensor, stays a fault."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantcli.testing import make_llama

BUFFER = "model.embed_positions.position_ids"


def _shard(folder: Path) -> Path:
    (shard,) = folder.glob("*.safetensors")
    return shard


def _edit(folder: Path, edit) -> None:
    tensors = load_file(_shard(folder))
    edit(tensors)
    save_file(tensors, str(_shard(folder)), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Llama whose checkpoint also holds BUFFER, and its fp8-block conversion without BUFFER."""
    import sys

    from quantcli.cli.app import main

    root = tmp_path_factory.mktemp("buffers")
    src = make_llama(root / "src", hidden=64, layers=1, shards=1)
    _edit(src, lambda t: t.update({BUFFER: torch.arange(16, dtype=torch.int64)[None]}))
    dst = root / "fp8"
    old, sys.argv = sys.argv, ["quantcli", "convert", str(src), str(dst), "--recipe", "fp8-block", "--quiet"]
    try:
        with pytest.raises(SystemExit) as exc:
            main()
    finally:
        sys.argv = old
    assert (exc.value.code or 0) == 0
    _edit(dst, lambda t: t.pop(BUFFER, None))
    return src, dst


def _verify(run_cli, dst: Path, src: Path) -> tuple[int, dict]:
    code, out, err = run_cli("verify", dst, "--reference", src, "--json")
    assert "Traceback" not in err, err
    return code, json.loads(out)


def test_a_dropped_position_ids_buffer_is_a_note(pair, run_cli):
    src, dst = pair
    code, doc = _verify(run_cli, dst, src)
    assert code == 0 and doc["passed"], doc["faults"]
    assert any(n.startswith(f"{BUFFER}: absent") for n in doc["notes"]), doc["notes"]


@pytest.mark.parametrize("value", [torch.arange(16, dtype=torch.int64).flip(0)[None],  # not 0..n-1
                                   torch.arange(16, dtype=torch.float32)[None]])  # not integer
def test_a_position_ids_that_carries_values_is_still_missed(value, pair, tmp_path, run_cli):
    import shutil

    src, dst = pair
    ref = tmp_path / "src"
    shutil.copytree(src, ref)
    _edit(ref, lambda t: t.update({BUFFER: value}))
    code, doc = _verify(run_cli, dst, ref)
    assert code == 1 and [(f["tensor"], f["fault"]) for f in doc["faults"]] == [
        (BUFFER, "missing from the quantized checkpoint (dropped)")]


def test_another_dropped_tensor_is_still_a_fault(pair, tmp_path, run_cli):
    import shutil

    src, dst = pair
    bad = tmp_path / "bad"
    shutil.copytree(dst, bad)
    _edit(bad, lambda t: t.pop("model.norm.weight"))
    code, doc = _verify(run_cli, bad, src)
    assert code == 1 and {f["tensor"] for f in doc["faults"]} == {"model.norm.weight"}
