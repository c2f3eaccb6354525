"""Module-name patterns (quantcli/formats/patterns.py) and `inspect`'s handling of bad input.

Injected: patterns of every rule and near misses, a gpt-oss config whose exclusion list names
parent modules by glob, `--ignore` with a parent glob, `--tensors` that selects nothing or is an
invalid regex, bad `--kv-budget` values and config keys, exclusion lists of the wrong type, and
inputs that are not checkpoints (empty folder, pickle, text file, missing path, unknown Hub id,
a missing path under a local folder, which is never sent to the Hub).
"""

from __future__ import annotations

import json

import pytest
import torch
from faults import assert_one_line_error, tree_state

from quantcli.checkpoint.safetensors_io import write_file
from quantcli.errors import QuantcliError
from quantcli.formats import patterns

# (pattern, name, the rule that covers it or None)
RULES = [
    # exact
    ("lm_head", "lm_head", "exact"),
    ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.q_proj", "exact"),
    # glob: fnmatch, `*` crosses dots
    ("*q_proj", "model.layers.0.self_attn.q_proj", "glob"),
    ("model.layers.*.mlp.gate", "model.layers.3.mlp.gate", "glob"),
    ("model.layers.0.mlp.gate*", "model.layers.0.mlp.gate", "glob"),
    ("model.layers.[01].mlp.down_proj", "model.layers.1.mlp.down_proj", "glob"),
    # regex: re.match (anchored at the start only), as compressed-tensors and vLLM
    ("re:.*mlp\\.gate$", "model.layers.0.mlp.gate", "regex"),
    ("re:.*q_proj", "model.layers.0.self_attn.q_proj", "regex"),
    ("re:model\\.layers\\.1\\.", "model.layers.1.mlp.up_proj", "regex"),
    # parent module, plain and glob (the gpt-oss config form)
    ("model.layers.0", "model.layers.0.mlp.down_proj", "parent"),
    ("model.layers.*.self_attn", "model.layers.0.self_attn.q_proj", "parent"),
    ("model.layers.*.self_attn", "model.layers.17.self_attn.o_proj", "parent"),
    ("model.layers.*.mlp.router", "model.layers.0.mlp.router", "glob"),
    ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.q_proj.weight", "parent"),
    # dot-bounded segment (SGLang, transformers, vLLM modelopt's substring on boundaries)
    ("self_attn", "model.layers.2.self_attn.k_proj", "segment"),
    ("mlp.gate", "model.layers.0.mlp.gate", "segment"),
    ("lm_head", "model.lm_head", "segment"),
    # fused engine names cover their checkpoint shards (vLLM packed_modules_mapping)
    ("model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.v_proj", "fused"),
    ("*.gate_up_proj", "model.layers.4.mlp.up_proj", "fused"),
    # near misses: never across a part boundary
    ("model.layers.1", "model.layers.10.mlp.down_proj", None),
    ("model.layers.1", "model.layers.10", None),
    ("layers.1", "model.layers.16.self_attn.q_proj", None),
    ("mlp.gate", "model.layers.0.mlp.gate_up_proj", None),
    ("attn", "model.layers.0.self_attn.q_proj", None),
    ("in_proj_a", "model.layers.0.linear_attn.in_proj_ba", None),
    ("model.layers.*.self_attn", "model.layers.0.mlp.down_proj", None),
    ("re:.*mlp\\.gate$", "model.layers.0.mlp.gate_up_proj", None),
    ("re:self_attn", "model.layers.0.self_attn.q_proj", None),  # re.match: anchored at the start
    ("model.layers.0.self_attn.qkv_proj", "model.layers.1.self_attn.q_proj", None),
    ("model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj", None),
    ("Q_PROJ", "model.layers.0.self_attn.q_proj", None),  # case-sensitive, like every consumer
]


@pytest.mark.parametrize("pattern,name,rule", RULES, ids=[f"{p}~{n}" for p, n, _ in RULES])
def test_pattern_rules(pattern, name, rule):
    assert patterns.match_rule(pattern, name) == rule
    assert patterns.matches(pattern, name) is (rule is not None)


def test_compressed_tensors_targets_take_the_class_name():
    assert patterns.matches_target("Linear", "model.layers.0.mlp.down_proj")
    assert patterns.matches_target("re:.*down_proj$", "model.layers.0.mlp.down_proj")
    assert not patterns.matches_target("Embedding", "model.layers.0.mlp.down_proj")


@pytest.mark.parametrize("bad,needle", [("re:[", "not a valid regex"), ("re:(a", "not a valid regex"),
                                        ("", "empty pattern"), ("re:", "empty pattern"),
                                        (5, "must be a string"), (["a"], "must be a string")])
def test_validate_names_the_option(bad, needle):
    with pytest.raises(QuantcliError) as exc:
        patterns.validate(bad, "--ignore")
    msg = str(exc.value)
    assert msg.startswith("--ignore ") and needle in msg and "\n" not in msg


def test_invalid_regex_is_one_line_even_where_nobody_validated():
    with pytest.raises(QuantcliError, match="not a valid regex"):
        patterns.matches("re:[", "model.layers.0.mlp.down_proj")


# ---------------------------------------------------------------- gpt-oss: parent globs in the config


def _gpt_oss_source(root):
    """A one-layer gpt-oss-style BF16 checkpoint: 3-D expert stacks ([E, in, out], as HF stores
    them), a router and four attention projections."""
    root.mkdir()
    g = torch.Generator().manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": torch.randn(32, 64, generator=g).bfloat16(),
        "model.layers.0.mlp.experts.gate_up_proj": torch.randn(4, 64, 128, generator=g).bfloat16(),
        "model.layers.0.mlp.experts.down_proj": torch.randn(4, 64, 64, generator=g).bfloat16(),
        "model.layers.0.mlp.router.weight": torch.randn(4, 64, generator=g).bfloat16(),
        "lm_head.weight": torch.randn(32, 64, generator=g).bfloat16(),
    }
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        tensors[f"model.layers.0.self_attn.{proj}.weight"] = torch.randn(64, 64, generator=g).bfloat16()
    write_file(root / "model.safetensors", tensors)
    (root / "config.json").write_text(json.dumps({"model_type": "gpt_oss", "num_hidden_layers": 1}))
    return root


@pytest.fixture(scope="module")
def gpt_oss_quantized(tmp_path_factory):
    from quantcli.cli.commands import run_convert

    base = tmp_path_factory.mktemp("goss")
    src = _gpt_oss_source(base / "src")
    out = base / "q"
    assert run_convert(str(src), out, recipe="mxfp4", layout="gpt-oss", ignore=[], config=None, scale_rule=None,
                       revision=None, device="cpu", backend="torch", dry_run=False, resume=False, overwrite=False,
                       quiet=True, json_out=False) == 0
    return out


def _with_exclusions(quantized, tmp_path, excluded):
    """A copy of the converted checkpoint whose modules_to_not_convert is `excluded`."""
    import shutil

    out = tmp_path / "edited"
    shutil.copytree(quantized, out)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = excluded
    (out / "config.json").write_text(json.dumps(config))
    return out


# The list OpenAI's gpt-oss release ships: parent modules by glob, not Linears by name.
GPT_OSS_LIST = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def test_gpt_oss_parent_glob_exclusions_pass_verify(gpt_oss_quantized, tmp_path, run_cli):
    written = json.loads((gpt_oss_quantized / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.self_attn.q_proj" in written["modules_to_not_convert"]  # quantcli writes exact names
    ckpt = _with_exclusions(gpt_oss_quantized, tmp_path, GPT_OSS_LIST)
    code, out, err = run_cli("verify", ckpt)
    assert code == 0, out + err
    assert "neither quantized nor" not in out + err
    code, out, _ = run_cli("inspect", ckpt, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["unlisted_linears"] == [] and doc["exclusion_list"] == GPT_OSS_LIST


def test_gpt_oss_list_without_attention_is_still_caught(gpt_oss_quantized, tmp_path, run_cli):
    ckpt = _with_exclusions(gpt_oss_quantized, tmp_path, ["model.layers.*.mlp.router", "lm_head",
                                                          "model.layers.1.self_attn"])  # wrong layer
    code, out, err = run_cli("verify", ckpt)
    assert code == 1
    assert "model.layers.0.self_attn.q_proj" in out and "neither quantized nor" in out


def test_exclusion_list_of_the_wrong_type_is_named(gpt_oss_quantized, tmp_path, run_cli):
    ckpt = _with_exclusions(gpt_oss_quantized, tmp_path, "model.layers.*.self_attn")  # a string, not a list
    before = tree_state(ckpt)
    code, out, err = run_cli("inspect", ckpt)
    assert_one_line_error(code, out, err, "modules_to_not_convert", "must be a list")
    assert tree_state(ckpt) == before


# ---------------------------------------------------------------- convert --ignore


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory):
    from quantcli.testing import make_llama

    return make_llama(tmp_path_factory.mktemp("llama") / "l", hidden=64, layers=2, shards=1)


def _plan(run_cli, src, *args):
    code, out, err = run_cli("convert", src, src.parent / "never", "--recipe", "fp8", "--dry-run", "--json", *args)
    assert code == 0, err
    assert not (src.parent / "never").exists()
    doc = json.loads(out)
    quantized = {r["name"].removesuffix(".weight") for r in doc["tensors"] if r["recipe"]}
    excluded = {e["module"]: e["reason"] for e in doc["excluded"]}
    return quantized, excluded


def test_convert_ignore_parent_glob_excludes_the_children(small_llama, run_cli):
    quantized, excluded = _plan(run_cli, small_llama, "--ignore", "model.layers.*.self_attn")
    attn = {f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    assert {m for m, why in excluded.items() if why == "--ignore"} == attn
    assert not attn & quantized
    assert {f"model.layers.{i}.mlp.{p}" for i in (0, 1) for p in ("gate_proj", "up_proj", "down_proj")} <= quantized


def test_convert_ignore_fused_name_and_layer_prefix(small_llama, run_cli):
    _, excluded = _plan(run_cli, small_llama, "--ignore", "model.layers.0.self_attn.qkv_proj",
                        "--ignore", "model.layers.1.mlp")
    ignored = {m for m, why in excluded.items() if why == "--ignore"}
    assert ignored == {"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                       "model.layers.0.self_attn.v_proj", "model.layers.1.mlp.gate_proj",
                       "model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj"}


def test_convert_ignore_invalid_regex_is_one_line(small_llama, tmp_path, run_cli):
    code, out, err = run_cli("convert", small_llama, tmp_path / "o", "--recipe", "fp8", "--ignore", "re:[")
    assert_one_line_error(code, out, err, "--ignore", "re:[", "not a valid regex")
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------- inspect options


def test_inspect_tensors_selecting_nothing_exits_2(small_llama, run_cli):
    code, out, err = run_cli("inspect", small_llama, "--tensors", "*no_such_module*")
    assert_one_line_error(code, out, err, "--tensors", "*no_such_module*", "matches no tensor or module",
                          str(small_llama), "try")


def test_inspect_tensors_by_parent_module(small_llama, run_cli):
    code, out, _ = run_cli("inspect", small_llama, "--tensors", "model.layers.1", "--json")
    doc = json.loads(out)
    # 9 tensors under layer 1: 7 projections and 2 norms; nothing from layer 0 or the embeddings
    assert code == 0 and sum(d["tensors"] for d in doc["dense"].values()) == 9


def test_inspect_tensors_invalid_regex_is_one_line(small_llama, run_cli):
    code, out, err = run_cli("inspect", small_llama, "--tensors", "re:[")
    assert_one_line_error(code, out, err, "--tensors", "re:[", "not a valid regex")


def test_verify_tensors_invalid_regex_is_one_line(gpt_oss_quantized, run_cli):
    # verify does not validate --tensors itself; the matcher's own error still makes it one line
    code, out, err = run_cli("verify", gpt_oss_quantized, "--tensors", "re:[")
    assert_one_line_error(code, out, err, "re:[", "not a valid regex")


def test_verify_tensors_selecting_nothing_exits_2(gpt_oss_quantized, run_cli):
    # a filter that selects nothing would let every check pass vacuously
    code, out, err = run_cli("verify", gpt_oss_quantized, "--tensors", "*no_such_module*")
    assert_one_line_error(code, out, err, "--tensors", "*no_such_module*", "matches no tensor or module")


@pytest.mark.parametrize("budget", ["abc", "0", "0GiB", "1.2.3GiB", ".", "-5GiB", "80 parsecs", ""])
def test_inspect_bad_kv_budget(small_llama, run_cli, budget):
    code, out, err = run_cli("inspect", small_llama, "--kv-cache", "--kv-budget", budget)
    assert_one_line_error(code, out, err, "--kv-budget", "80GiB")


def test_inspect_kv_budget_units(small_llama, run_cli):
    code, out, _ = run_cli("inspect", small_llama, "--kv-cache", "--kv-budget", "1.5 GiB", "--json")
    assert code == 0 and json.loads(out)["kv_cache"]["budget_bytes"] == int(1.5 * 1024**3)


@pytest.mark.parametrize("edit,needle", [({"num_attention_heads": None}, "num_attention_heads"),
                                         ({"num_hidden_layers": "2"}, "num_hidden_layers"),
                                         ({"head_dim": 0}, "head_dim")])
def test_inspect_kv_cache_names_the_bad_config_key(small_llama, tmp_path, run_cli, edit, needle):
    import shutil

    ckpt = tmp_path / "c"
    shutil.copytree(small_llama, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config.update(edit)
    (ckpt / "config.json").write_text(json.dumps(config))
    code, out, err = run_cli("inspect", ckpt, "--kv-cache")
    assert_one_line_error(code, out, err, "--kv-cache", needle)


# ---------------------------------------------------------------- not checkpoints


def _not_checkpoints(tmp_path):
    import pickle

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "README.md").write_text("no weights here")
    with open(tmp_path / "pytorch_model.bin", "wb") as f:
        pickle.dump({"w": [1.0, 2.0]}, f)
    (tmp_path / "notes.txt").write_text("hello\n")
    pickles = tmp_path / "pickled"
    pickles.mkdir()
    (pickles / "pytorch_model.bin").write_bytes((tmp_path / "pytorch_model.bin").read_bytes())
    return {"empty folder": (empty, "no .safetensors"),
            "pickle file": (tmp_path / "pytorch_model.bin", "pickle"),
            "pickle folder": (pickles, "pickle"),
            "text file": (tmp_path / "notes.txt", "not a .safetensors file"),
            "missing path": (tmp_path / "missing", "no such file or folder")}


@pytest.mark.parametrize("kind", ["empty folder", "pickle file", "pickle folder", "text file", "missing path"])
def test_inspect_not_a_checkpoint(tmp_path, run_cli, kind):
    path, needle = _not_checkpoints(tmp_path)[kind]
    before = tree_state(tmp_path)
    code, out, err = run_cli("inspect", path)
    assert_one_line_error(code, out, err, str(path), needle)
    assert tree_state(tmp_path) == before


def test_inspect_unknown_hub_id_offline(tmp_path, run_cli, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    code, out, err = run_cli("inspect", "acme/no-such-model")
    assert_one_line_error(code, out, err, "acme/no-such-model", "--revision")


def test_missing_path_under_a_local_folder_is_not_a_hub_id(one_shard_moe, run_cli, monkeypatch):
    monkeypatch.chdir(one_shard_moe.parent)

    def no_hub(*a, **k):
        raise AssertionError("went to the Hub")

    monkeypatch.setattr("quantcli.checkpoint.source.open_hub", no_hub)
    code, _, err = run_cli("inspect", "moe/nonexistent-folder-xyz")
    assert code == 2 and "no such file or folder in moe/" in err and len(err.strip().splitlines()) == 1


def test_hub_offline_miss_reads_in_our_words(tmp_path, run_cli, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    code, _, err = run_cli("inspect", "someorg/somemodel")
    assert code == 2 and "not in the local Hugging Face cache" in err and len(err.strip().splitlines()) == 1


def test_kv_budget_without_kv_cache_is_refused(small_llama, run_cli):
    # a budget that silently does nothing reads as if it had been applied
    code, out, err = run_cli("inspect", small_llama, "--kv-budget", "40GB")
    assert_one_line_error(code, out, err, "--kv-budget", "--kv-cache")
