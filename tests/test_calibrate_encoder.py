"""Calibration's layer walk on a BERT-like encoder (a tiny random BertModel with a WordPiece
tokenizer, quantcli.testing.make_bert): static input scales are amax/448 of each Linear's inputs in
transformers' own BertModel forward of the tokenized data ([CLS] ... [SEP]); a weight pass that
rounds to nearest writes a plain conversion's bytes, its layer-1 statistics the inputs that the
quantized layer 0 gives; the activation-weighted scale search weights each channel by the
forward's mean squared input; what an encoder cannot be calibrated for is refused in one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from faults import tree_state
from nearest_pass import NearestPass, decoded, install, reference_statistics

from quantcli.testing import make_bert

transformers = pytest.importorskip("transformers")
# 9, 9, 8, 7, 9 and 18 tokens with [CLS] and [SEP]: with --calibration-batch 2 the first two run as
# one batch (equal lengths, no padding), the others alone; the last is spelled letter by letter.
SENTENCES = ["The cat sat on the mat.", "The rain is on the mat.", "A small model is small.", "Rain in the north!",
             "the mat of the cat is small", "Quick brown zebra?"]
QKV = re.compile(r"\.(query|key|value)$")  # one GEMM in an engine: one input scale, the max over the three


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("encoder")
    data = tmp / "sentences.txt"
    data.write_text("\n".join(SENTENCES) + "\n")
    return {"tmp": tmp, "data": data, "bert": make_bert(tmp / "bert"),
            "prefixed": make_bert(tmp / "prefixed", prefix="bert.", seed=1)}


def _convert(run_cli, env, src: Path, out: Path, *args: str) -> None:
    code, _, err = run_cli("convert", src, out, *args, "--calibration", env["data"], "--device", "cpu", "--quiet")
    assert code == 0, err


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    found = {}
    for f in sorted(folder.glob("*.safetensors")):
        found.update(load_file(f))
    return found


def _forward_inputs(src: Path) -> list[dict]:
    """Each sentence tokenized by transformers' tokenizer of `src`, one forward's arguments each."""
    tok = transformers.AutoTokenizer.from_pretrained(src)
    return [{"input_ids": torch.tensor([tok(s)["input_ids"]])} for s in SENTENCES]


def _model(src: Path):
    return transformers.BertModel.from_pretrained(src, dtype=torch.float32).eval()


def _input_stats(src: Path, prefix: str = "") -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """max |x| and the mean squared input per channel (FP64 sums) of every Linear of the encoder
    blocks in transformers' forward, by the checkpoint's module names (`prefix` put back)."""
    model, amax, sumsq, tokens, hooks = _model(src), {}, {}, {}, []
    for name, mod in model.encoder.named_modules():
        if isinstance(mod, torch.nn.Linear):
            def record(m, args, name=f"{prefix}encoder.{name}"):
                x = args[0].reshape(-1, args[0].shape[-1])
                amax[name] = max(amax.get(name, 0.0), float(x.abs().amax()))
                sq = x.double().square().sum(0)
                sumsq[name] = sumsq[name] + sq if name in sumsq else sq
                tokens[name] = tokens.get(name, 0) + x.shape[0]
            hooks.append(mod.register_forward_pre_hook(record))
    with torch.no_grad():
        for kwargs in _forward_inputs(src):
            model(**kwargs)
    for h in hooks:
        h.remove()
    return amax, {m: (s / tokens[m]).to(torch.float32) for m, s in sumsq.items()}


@pytest.mark.parametrize("which", ["bert", "prefixed"])
def test_static_input_scales_are_the_amax_of_transformers_forward_over_448(env, tmp_path, run_cli, which):
    out, prefix = tmp_path / "fp8", "bert." if which == "prefixed" else ""
    _convert(run_cli, env, env[which], out, "--recipe", "fp8", "--activations", "static", "--calibration-batch", "2")
    amax, _ = _input_stats(env[which], prefix)
    group: dict[str, float] = {}
    for m, v in amax.items():
        group[QKV.sub(".qkv", m)] = max(group.get(QKV.sub(".qkv", m), 0.0), v)
    written = {n.removesuffix(".input_scale"): t for n, t in _tensors(out).items() if n.endswith(".input_scale")}
    assert sorted(written) == sorted(amax) and f"{prefix}encoder.layer.1.output.dense" in written
    for m, scale in written.items():
        want = torch.tensor(group[QKV.sub(".qkv", m)] / 448, dtype=torch.float64).to(torch.float32)
        assert torch.allclose(scale, want, rtol=1e-6, atol=0), (m, float(scale), float(want))
    manifest = json.loads((out / "quantcli_manifest.json").read_text())
    # a `bert.` checkpoint loads into BertModel as `pooler.dense`: both spellings are listed
    assert manifest["excluded"] == sorted({f"{prefix}pooler.dense", "pooler.dense"})
    assert manifest["calibration"]["samples_used"] == 6


@pytest.mark.parametrize("args", [["--recipe", "nvfp4", "--activations", "static"],
                                  ["--recipe", "mxfp4", "--scale-search", "mse"]], ids=["nvfp4-static", "mxfp4-search"])
def test_a_weight_pass_rounding_to_nearest_writes_a_plain_conversions_bytes(env, tmp_path, run_cli, args):
    plain, rounded = tmp_path / "plain", tmp_path / "rounded"
    _convert(run_cli, env, env["bert"], plain, *args)
    wp = install(NearestPass())
    _convert(run_cli, env, env["bert"], rounded, *args)
    assert tree_state(rounded) == tree_state(plain)
    modules = {m["module"] for m in json.loads((plain / "quantcli_manifest.json").read_text())["modules"]}
    assert sorted(wp.rounded) == sorted(modules) and len(modules) == 12  # 6 Linears a block, no pooler


def test_layer_1s_statistic_sums_the_inputs_the_quantized_layer_0_gives(env, tmp_path, run_cli):
    wp = install(NearestPass())
    out = tmp_path / "out"
    _convert(run_cli, env, env["bert"], out, "--recipe", "mxfp4", "--scale-search", "mse")
    layer0 = sorted(m for m in wp.statistics if m.startswith("encoder.layer.0."))
    inputs = _forward_inputs(env["bert"])
    quantized = reference_statistics(_model(env["bert"]), "encoder.layer.1", inputs,
                                     decoded(run_cli, out, tmp_path / "dense", layer0))
    dense = reference_statistics(_model(env["bert"]), "encoder.layer.1", inputs, {})
    assert len(quantized) == 6
    for m, ref in quantized.items():
        got, tokens = wp.statistics[m]
        assert tokens == sum(x["input_ids"].numel() for x in inputs)
        assert torch.allclose(got, ref, rtol=1e-9, atol=1e-9), m
        assert (got - dense[m]).norm() > 1000 * (got - ref).norm(), m  # not the unquantized model's inputs


def test_activation_weighted_scale_search_uses_the_forwards_mean_squared_inputs(env, tmp_path, run_cli):
    from quantcli.formats.facts import ModuleFacts
    from quantcli.recipes import RECIPES

    weighted, plain = tmp_path / "weighted", tmp_path / "plain"
    _convert(run_cli, env, env["bert"], weighted, "--recipe", "mxfp4", "--scale-search", "mse")
    assert run_cli("convert", env["bert"], plain, "--recipe", "mxfp4", "--scale-search", "mse", "-q")[0] == 0
    modules = json.loads((weighted / "quantcli_manifest.json").read_text())["modules"]
    assert {m["scale_search_weights"] for m in modules} == {"input_channel_ms"}
    names = [m["module"] for m in modules]
    got = decoded(run_cli, weighted, tmp_path / "dense", names)
    unweighted = decoded(run_cli, plain, tmp_path / "dense-plain", names)
    _, ms = _input_stats(env["bert"])
    source, recipe = _tensors(env["bert"]), RECIPES["mxfp4"].with_scale_search("mse")
    for m in names:
        facts = ModuleFacts(input_channel_ms=ms[m])
        q = recipe.quantize(f"{m}.weight", source[f"{m}.weight"], backend="torch", facts=facts)
        assert torch.equal(got[m], recipe.dequantize(q, backend="torch").to(torch.float32)), m
    assert any(not torch.equal(got[m], unweighted[m]) for m in names)  # the weights changed the choice


def _fails(run_cli, *args) -> str:
    code, _, err = run_cli(*map(str, args))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    return err


def test_what_an_encoder_cannot_be_calibrated_for_is_refused_in_one_line(env, tmp_path, run_cli):
    src, cal = env["bert"], ("--calibration", env["data"])
    err = _fails(run_cli, "convert", src, tmp_path / "o", "--recipe", "nvfp4", "--kv-cache", "fp8", *cal)
    assert "--kv-cache fp8: BertModel is an encoder-only model; it keeps no KV cache" in err
    masked = tmp_path / "masked"
    masked.mkdir()
    for f in src.iterdir():
        (masked / f.name).symlink_to(f)
    (masked / "config.json").unlink()
    config = json.loads((src / "config.json").read_text())
    (masked / "config.json").write_text(json.dumps({**config, "architectures": ["BertForMaskedLM"]}))
    err = _fails(run_cli, "convert", masked, tmp_path / "o", "--recipe", "fp8", "--kv-cache", "fp8", *cal)
    assert "--kv-cache fp8: BertForMaskedLM is an encoder-only model" in err  # its base model is walked
    assert not (tmp_path / "o").exists()
    doc = json.loads(run_cli("convert", src, tmp_path / "o", "--recipe", "fp8", "--activations", "static", *cal,
                             "--calibration-seq-len", "600", "--dry-run", "--json")[1])
    assert any("has position embeddings for 512 tokens; calibrating on at most 512" in w for w in doc["warnings"])
    estimate = doc["calibration_estimate"]  # the encoder's blocks are the layers it counts
    assert estimate["layers"] == 2 and estimate["layer_weight_bytes"] > 4 * 4 * 64 * 64 and estimate["flops"] > 0


def test_text_is_tokenized_with_cls_and_sep_and_cut_keeping_sep(env):
    from quantcli.formats.facts import Calibration
    from quantcli.model.samples import token_ids

    ids = token_ids(Calibration(str(env["data"]), seq_len=8), env["bert"])
    assert [len(s) for s in ids] == [8, 8, 8, 7, 8, 8]
    assert all(s[0] == 2 and s[-1] == 3 for s in ids)  # [CLS] ... [SEP], as the tokenizer cuts


def test_the_walk_runs_the_encoder_s_own_layers(env):
    from quantcli.checkpoint.source import open_source
    from quantcli.model.reach import walk_reach
    from quantcli.model.stack import ENCODER

    source = open_source(str(env["bert"]))
    infos = {n: i for h in source.headers.values() for n, i in h.tensors.items()}
    reach = walk_reach(source.config, set(infos), lambda n: tuple(infos[n].shape), source.label)
    assert (reach.kind, reach.layer_path, reach.layers, reach.head) == (ENCODER, "encoder.layer", 2, ())
    assert reach.layer_of("encoder.layer.1.attention.self.query.weight") == 1
    assert reach.layer_of("embeddings.word_embeddings.weight") is None and not reach.attentions


@pytest.fixture(autouse=True)
def _no_weight_pass_left(monkeypatch):
    import quantcli.convert.passes as passes

    monkeypatch.setattr(passes, "WEIGHT_PASSES", ())
