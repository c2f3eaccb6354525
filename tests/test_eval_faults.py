"""quantcli eval refuses what it cannot compare or emulate in one line (exit 2), is clean on
Ctrl-C (exit 130, one line, no temporary files left), and prints its table, its one-line -q
summary and notes (evaluating on the calibration data)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from quantcli.testing import make_llama, make_moe

pytest.importorskip("transformers")


def _jsonl(path: Path, ids) -> Path:
    path.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in ids))
    return path


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("evalf")
    _jsonl(root / "eval.jsonl", [[(5 * i + 3 * j) % 512 for j in range(12)] for i in range(3)])
    make_llama(root / "llama", hidden=64, layers=2, shards=1)
    make_llama(root / "wide", hidden=128, layers=2, shards=1)
    make_moe(root / "moe", hidden=64, layers=2, shards=1)
    return root


def _ok(run_cli, *args) -> str:
    code, out, err = run_cli(*map(str, args))
    assert code == 0, err
    return out


def _fails(run_cli, *args) -> str:
    code, out, err = run_cli(*map(str, args))
    assert code == 2, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def nvfp4(root, tmp_path_factory) -> Path:
    from quantcli.cli.app import main

    with pytest.raises(SystemExit) as exc:
        main(["convert", str(root / "llama"), str(root / "llama-nvfp4"), "--recipe", "nvfp4", "-q"])
    assert exc.value.code == 0
    return root / "llama-nvfp4"


def _eval(*args) -> tuple:
    return ("eval", *args, "--device", "cpu")


def test_reference_of_another_architecture_or_shape(run_cli, root, nvfp4):
    line = _fails(run_cli, *_eval(nvfp4, "--reference", root / "moe", "--data", root / "eval.jsonl"))
    assert "not the same model" in line and "model_type mixtral vs llama" in line
    line = _fails(run_cli, *_eval(nvfp4, "--reference", root / "wide", "--data", root / "eval.jsonl"))
    assert "hidden_size 128 vs 64" in line


def test_data_the_tokenizer_cannot_read(run_cli, root, nvfp4):
    (root / "text.txt").write_text("one sample\nanother one\n")
    line = _fails(run_cli, *_eval(nvfp4, "--reference", root / "llama", "--data", root / "text.txt"))
    assert line.startswith("error: --data ") and "tokenizer" in line
    (root / "rows.csv").write_text("a,b\n")
    assert "unknown kind '.csv'" in _fails(run_cli, *_eval(nvfp4, "--reference", root / "llama", "--data",
                                                              root / "rows.csv"))
    _jsonl(root / "big.jsonl", [[1, 2, 9999]])
    assert "outside the model's vocabulary" in _fails(run_cli, *_eval(nvfp4, "--reference", root / "llama", "--data",
                                                                      root / "big.jsonl"))


def test_a_format_that_cannot_be_emulated(run_cli, root):
    _ok(run_cli, "convert", root / "llama", root / "int4a", "--recipe", "fp8-channel", "-q")
    config = json.loads((root / "int4a" / "config.json").read_text())
    for group in config["quantization_config"]["config_groups"].values():  # INT4 activations: no engine runs them
        group["input_activations"].update(num_bits=4, type="int")
    (root / "int4a" / "config.json").write_text(json.dumps(config))
    line = _fails(run_cli, *_eval(root / "int4a", "--reference", root / "llama", "--data", root / "eval.jsonl"))
    assert "input_activations {num_bits: 4, type: int, strategy: token" in line and "cannot emulate" in line
    _ok(run_cli, "convert", root / "llama", root / "asym", "--recipe", "fp8-channel", "-q")
    config = json.loads((root / "asym" / "config.json").read_text())
    for group in config["quantization_config"]["config_groups"].values():
        group["input_activations"]["symmetric"] = False
    (root / "asym" / "config.json").write_text(json.dumps(config))
    assert "asymmetric" in _fails(run_cli, *_eval(root / "asym", "--reference", root / "llama", "--data",
                                                  root / "eval.jsonl"))


def test_declared_fp8_kv_cache_without_scales(run_cli, root, nvfp4, tmp_path):
    import shutil

    dst = tmp_path / "kv"
    shutil.copytree(nvfp4, dst)
    hq = json.loads((dst / "hf_quant_config.json").read_text())
    hq["quantization"]["kv_cache_quant_algo"] = "FP8"
    (dst / "hf_quant_config.json").write_text(json.dumps(hq))
    line = _fails(run_cli, *_eval(dst, "--reference", root / "llama", "--data", root / "eval.jsonl"))
    assert "declares an FP8 KV cache" in line and "k_proj.k_scale is missing" in line and "scale-one" in line
    doc = json.loads(_ok(run_cli, *_eval(dst, "--reference", root / "llama", "--data", root / "eval.jsonl",
                                         "--kv-cache", "scale-one", "--json")))
    assert doc["kv_cache"] == "FP8 E4M3, scale 1.0 (2 attention layers)"
    doc = json.loads(_ok(run_cli, *_eval(dst, "--reference", root / "llama", "--data", root / "eval.jsonl",
                                         "--kv-cache", "none", "--json")))
    assert doc["kv_cache"].startswith("not quantized (--kv-cache none)")


def test_ctrl_c_is_one_line_and_leaves_no_temporary_files(run_cli, root, nvfp4, monkeypatch, tmp_path):
    from quantcli.evaluate import engine

    monkeypatch.setenv("QUANTCLI_CALIBRATION_BUFFER_GIB", "0")  # both buffers in temporary files
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    real = engine._block
    seen = []

    def interrupted(stack, i, *args):
        seen.append(sorted(p.name for p in tmp_path.iterdir()))
        if i == 1:
            raise KeyboardInterrupt
        return real(stack, i, *args)

    monkeypatch.setattr(engine, "_block", interrupted)
    code, out, err = run_cli(*_eval(nvfp4, "--reference", root / "llama", "--data", root / "eval.jsonl"))
    assert (code, out, err.strip()) == (130, "", "interrupted")
    assert len(seen[0]) == 2 and all(n.startswith("quantcli-calibration-") for n in seen[0])
    assert list(tmp_path.iterdir()) == []


def test_table_quiet_line_and_calibration_data_note(run_cli, root):
    _ok(run_cli, "convert", root / "llama", root / "w4a4", "--recipe", "nvfp4", "--activations", "static",
        "--calibration", root / "eval.jsonl", "-q")
    out = _ok(run_cli, *_eval(root / "w4a4", "--reference", root / "llama", "--data", root / "eval.jsonl"))
    assert "NVFP4 W4A4" in out and "perplexity, quantized" in out and "top-1 agreement" in out
    assert "is the data" in out and "calibrated on" in out
    assert "self_attn." in out or "mlp." in out  # the worst modules, named within their block
    quiet = _ok(run_cli, *_eval(root / "w4a4", "--reference", root / "llama", "--data", root / "eval.jsonl", "-q"))
    assert quiet.startswith("ppl ") and len(quiet.strip().splitlines()) == 1
    code, out, err = run_cli(*_eval(root / "w4a4", "--reference", root / "llama", "--data", root / "eval.jsonl",
                                    "-v"))
    assert code == 0 and [line.split(" (")[0] for line in err.strip().splitlines()] == ["layer 1/2 done",
                                                                                        "layer 2/2 done"]


def test_encoder_has_no_kv_cache(run_cli, root, tmp_path):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=128, max_position_embeddings=64)
    transformers.BertModel(config, add_pooling_layer=False).save_pretrained(tmp_path / "bert")
    _ok(run_cli, "convert", tmp_path / "bert", tmp_path / "bert-fp8", "--recipe", "fp8-channel", "-q")
    line = _fails(run_cli, *_eval(tmp_path / "bert-fp8", "--reference", tmp_path / "bert",
                                  "--data", root / "eval.jsonl", "--kv-cache", "scale-one"))
    assert "encoder keeps no KV cache" in line
    doc = json.loads(_ok(run_cli, *_eval(tmp_path / "bert-fp8", "--reference", tmp_path / "bert", "--data",
                                         root / "eval.jsonl", "--json")))
    assert doc["encoder"]["pooling_source"].startswith("default") and 0.99 < doc["encoder"]["cosine_min"] <= 1
    assert doc["activations"] == [{"scheme": "FP8 dynamic per token", "modules": 6}]


def test_the_walk_builds_any_stack_and_refuses_what_it_cannot_run_by_name():
    from quantcli.errors import QuantcliError
    from quantcli.model.stack import build_stack

    distil = {"model_type": "distilbert", "architectures": ["DistilBertModel"], "vocab_size": 100, "dim": 32,
              "n_layers": 1, "n_heads": 2, "hidden_dim": 64}
    with pytest.raises(QuantcliError, match=r"no tensor for the model's transformer\.layer\.0\..* does not match"):
        build_stack(distil, {"embeddings.word_embeddings.weight"}, lambda n: (100, 32), "ckpt")
    with pytest.raises(QuantcliError, match="T5Config is an encoder-decoder model"):
        build_stack({"model_type": "t5", "architectures": ["T5ForConditionalGeneration"]}, set(), None, "ckpt")
    with pytest.raises(QuantcliError, match="NotInTransformersForCausalLM is not a transformers .*remote code"):
        build_stack({"model_type": "llama", "architectures": ["NotInTransformersForCausalLM"]}, set(), None, "ckpt")


def test_recipe_and_reference_options_are_checked(run_cli, root, nvfp4):
    data = ("--data", root / "eval.jsonl")
    assert "drop one of them" in _fails(run_cli, *_eval(root / "llama", "--recipe", "nvfp4", "--reference",
                                                        root / "llama", *data))
    assert "give --reference SRC" in _fails(run_cli, *_eval(nvfp4, *data))
    assert "--layout need --recipe" in _fails(run_cli, *_eval(nvfp4, "--layout", "modelopt", *data))
    assert "already quantized" in _fails(run_cli, *_eval(nvfp4, "--recipe", "fp8", *data))


def test_ctrl_c_inside_transformers_lazy_imports_is_held_until_they_finish():
    """An interrupt inside a model's lazy import would come out as an import error (or abort in
    native code): it is held, then raised as KeyboardInterrupt once the import is done."""
    import os
    import signal

    from quantcli.model.build import interrupts_deferred

    done = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            done.append("the block ran to its end")
    assert done == ["the block ran to its end"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_reference_of_the_same_shapes_but_other_weights_gets_a_note(run_cli, root, nvfp4, tmp_path):
    other = make_llama(tmp_path / "other-seed", hidden=64, layers=2, shards=1, seed=1)
    code, out, err = run_cli(*map(str, _eval(nvfp4, "--reference", other, "--data", root / "eval.jsonl", "--json")))
    doc = json.loads(out)
    assert code == 0 and "model.embed_tokens.weight differs between --reference" in doc["notes"][0]
    assert "warning: model.embed_tokens.weight differs" in err  # -q and --json show no notes
    doc = json.loads(_ok(run_cli, *_eval(nvfp4, "--reference", root / "llama", "--data", root / "eval.jsonl",
                                         "--json")))
    assert not any("differs between" in n for n in doc["notes"])


def test_recipe_emulation_takes_ignore_and_a_recipe_file(run_cli, root, tmp_path):
    data = root / "eval.jsonl"
    ignored = json.loads(_ok(run_cli, *_eval(root / "llama", "--recipe", "nvfp4", "--ignore", "*mlp*", "--data", data,
                                             "--json")))
    assert ignored["recipes"] == {"nvfp4": 8}  # q, k, v, o of two layers; the MLPs left dense
    card = tmp_path / "recipe.toml"
    card.write_text('recipe = "nvfp4"\nignore = ["*mlp*"]\n')
    from_file = json.loads(_ok(run_cli, *_eval(root / "llama", "--config", card, "--data", data, "--json")))
    assert from_file["recipes"] == ignored["recipes"] and from_file["causal"] == ignored["causal"]
    assert "--config" in from_file["checkpoint"]
    line = _fails(run_cli, *_eval(root / "llama", "--config", card, "--reference", root / "llama", "--data", data))
    assert "--config with --reference" in line
    assert "fp32" not in _fails(run_cli, *_eval(root / "llama", "--recipe", "nvfp5", "--data", data))


def test_a_layout_eval_does_not_read_is_refused_not_taken_for_fp8():
    """Once every layout but modelopt and compressed-tensors was read as the fp8 layout's
    activation_scheme: a new layout would have been emulated with fp8's dynamic activations."""
    from types import SimpleNamespace

    from quantcli.evaluate.declared import NotEmulated, activation_steps
    from quantcli.formats.activation_scales import CalibratedScales

    config = {"quantization_config": {"quant_method": "future", "activation_scheme": "dynamic"}}
    with pytest.raises(NotEmulated) as exc:
        activation_steps(SimpleNamespace(name="future"), config, {"model.layers.0.mlp.down_proj": "fp8"},
                         CalibratedScales("dynamic", None), "ckpt")
    line = str(exc.value)
    assert "\n" not in line and line.startswith("ckpt: layout future: eval emulates")
    assert "compressed-tensors, modelopt, fp8 layouts" in line


def test_a_module_decoding_to_nan_is_named_and_exits_2(run_cli, root, nvfp4, tmp_path):
    """Block scales set to NaN: eval once exited 0 with `perplexity, quantized: nan`, naming nothing."""
    import shutil

    import safetensors.torch as st

    bad = tmp_path / "nan-scales"
    shutil.copytree(nvfp4, bad)
    (shard,) = bad.glob("*.safetensors")
    tensors = st.load_file(shard)
    scale = "model.layers.1.mlp.down_proj.weight_scale"
    tensors[scale] = torch.full_like(tensors[scale].float(), float("nan")).to(tensors[scale].dtype)
    st.save_file(tensors, shard, metadata={"format": "pt"})
    line = _fails(run_cli, *_eval(bad, "--reference", root / "llama", "--data", root / "eval.jsonl"))
    assert "model.layers.1.mlp.down_proj decodes to" in line and "non-finite" in line and "quantcli verify" in line
