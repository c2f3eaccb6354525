"""`--ignore qkv_proj` (issue 21 item 13): a bare fused name, as engines name the fused layer,
covers the shards fused into it (q/k/v, gate/up), and a fused group left dense because the user
ignored one member says so instead of calling that member impossible to quantize."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantcli.formats.patterns import match_rule
from quantcli.testing import make_llama

Q = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("pattern, name, rule", [
    ("qkv_proj", Q, "fused"), ("qkv_proj", "model.layers.0.self_attn.v_proj", "fused"),
    ("self_attn.qkv_proj", Q, "fused"), ("gate_up_proj", "model.layers.3.mlp.up_proj", "fused"),
    ("model.layers.0.self_attn.qkv_proj", Q, "fused"), ("*.qkv_proj", Q, "fused"),
    ("qkv_proj", "model.layers.0.self_attn.o_proj", None), ("qkv", Q, None),
    ("model.layers.1.self_attn.qkv_proj", Q, None),
])
def test_a_fused_name_covers_its_shards(pattern, name, rule):
    assert match_rule(pattern, name) == rule


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_llama(tmp_path_factory.mktemp("ig") / "llama", hidden=64, layers=2, shards=1)


def plan(run_cli, llama: Path, tmp_path: Path, *ignore: str) -> dict:
    flags = [x for p in ignore for x in ("--ignore", p)]
    code, out, err = run_cli("convert", llama, tmp_path / "o", "--recipe", "nvfp4", "--dry-run", "--json", *flags)
    assert code == 0, err
    return json.loads(out)


def test_ignore_a_bare_fused_name_leaves_its_shards_dense_in_every_layer(llama, tmp_path, run_cli):
    doc = plan(run_cli, llama, tmp_path, "qkv_proj")
    excluded = {e["module"]: e["reason"] for e in doc["excluded"]}
    for layer in (0, 1):
        for p in ("q_proj", "k_proj", "v_proj"):
            assert excluded[f"model.layers.{layer}.self_attn.{p}"] == "--ignore"
        assert f"model.layers.{layer}.self_attn.o_proj" not in excluded
    assert not [w for w in doc["warnings"] if "matches no Linear" in w or "cannot be quantized" in w], doc["warnings"]


def test_ignoring_one_member_says_the_user_asked_for_it(llama, tmp_path, run_cli):
    doc = plan(run_cli, llama, tmp_path, "model.layers.0.self_attn.q_proj")
    (warning,) = [w for w in doc["warnings"] if "left dense as a whole" in w]
    assert "you asked to ignore q_proj" in warning and "--ignore qkv_proj names the whole group" in warning
    assert "cannot be quantized" not in warning
