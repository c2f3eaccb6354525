"""Calibration data in every accepted form, the manifest's account of a calibrated run, verify's
rerun of the calibration (--reference SRC --calibration DATA) and the dry run's estimate."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from quantcli.testing import make_llama

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")


def _tokenizer(folder: Path) -> None:
    """A word-level tokenizer (w0..w499) with a chat template, saved into the checkpoint folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(500)} | {"[UNK]": 500, "<s>": 501}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }}\n{% endfor %}"
    fast.save_pretrained(folder)


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    folder = make_llama(tmp_path_factory.mktemp("calv") / "llama", hidden=64, layers=2, shards=1)
    _tokenizer(folder)
    return folder


def _words(i: int, n: int = 9) -> str:
    return " ".join(f"w{(17 * i + 5 * j) % 500}" for j in range(n))


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    found = {}
    for f in sorted(folder.glob("*.safetensors")):
        found.update(load_file(f))
    return found


def _convert(run_cli, src: Path, out: Path, data: Path, *extra: str) -> None:
    code, _, err = run_cli("convert", str(src), str(out), "--recipe", "fp8", "--activations", "static",
                           "--kv-cache", "fp8", "--layout", "compressed-tensors", "--calibration", str(data),
                           "--quiet", *extra)
    assert code == 0, err


def test_txt_lines_blank_line_blocks_jsonl_text_and_messages(src, tmp_path, run_cli):
    """The same five samples as lines, as blank-line separated blocks, as jsonl text and as the
    token ids the tokenizer gives them: byte-identical outputs; chat messages are rendered with
    the source's chat template (so they differ from the plain text)."""
    samples = [_words(i) for i in range(5)]
    lines = tmp_path / "lines.txt"
    lines.write_text("\n".join(samples) + "\n")
    blocks = tmp_path / "blocks.txt"
    blocks.write_text("\n\n".join(s.replace(" w", "\nw", 1) for s in samples) + "\n")  # a block spans lines
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": s}) + "\n" for s in samples))
    tok = transformers.AutoTokenizer.from_pretrained(src)
    ids = tmp_path / "ids.jsonl"
    ids.write_text("".join(json.dumps({"input_ids": tok(s)["input_ids"]}) + "\n" for s in samples))
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": [{"role": "user", "content": s}]}) + "\n" for s in samples))
    shards = {}
    for data in (lines, blocks, text, ids, chat):
        _convert(run_cli, src, tmp_path / data.stem, data)
        shards[data.stem] = {p.name: p.read_bytes() for p in (tmp_path / data.stem).glob("*.safetensors")}
    assert shards["lines"] == shards["text"] == shards["ids"]
    # blank-line blocks join their lines with a newline, which the whitespace tokenizer ignores
    assert shards["blocks"] == shards["lines"]
    assert shards["chat"] != shards["lines"]  # "user" is a token the plain samples lack


@pytest.fixture
def bare(tmp_path) -> Path:
    return make_llama(tmp_path / "bare", hidden=64, layers=1, shards=1)


def test_text_without_tokenizer_refused_naming_the_fix(bare, tmp_path, run_cli):
    data = tmp_path / "d.txt"
    data.write_text("w1 w2 w3\n")
    code, _, err = run_cli("convert", str(bare), str(tmp_path / "out"), "--recipe", "fp8", "--kv-cache", "fp8",
                           "--layout", "compressed-tensors", "--calibration", str(data))
    assert code == 2 and "tokenizer" in err and "input_ids" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def calibrated(src, tmp_path_factory) -> tuple[Path, Path]:
    from quantcli.cli.app import main

    root = tmp_path_factory.mktemp("calv_out")
    data = root / "data.txt"
    data.write_text("\n".join(_words(i) for i in range(6)) + "\n")
    out = root / "out"
    with pytest.raises(SystemExit) as done:
        main(["convert", str(src), str(out), "--recipe", "nvfp4", "--layout", "modelopt", "--activations", "static",
              "--kv-cache", "fp8", "--calibration", str(data), "--calibration-samples", "4", "--quiet"])
    assert done.value.code == 0
    return out, data


def test_manifest_records_the_run_and_the_scale_tensors(calibrated):
    out, data = calibrated
    doc = json.loads((out / "quantcli_manifest.json").read_text())
    run = doc["calibration"]
    assert run["data"] == "data.txt" and run["samples"] == 4 and run["activations"] == "static"
    assert len(run["data_sha256"]) == 64 and run["kv_cache"] == "fp8"
    roles = {t["name"]: (t["role"], t["direction"]) for m in doc["modules"] for t in m["tensors"]}
    assert roles["model.layers.0.mlp.down_proj.input_scale"] == ("input_scale", "multiply")
    assert roles["model.layers.1.self_attn.k_proj.k_scale"] == ("k_scale", "multiply")
    assert roles["model.layers.1.self_attn.v_proj.v_scale"] == ("v_scale", "multiply")


def _verify(run_cli, out: Path, src: Path, data: Path) -> tuple[int, dict, str]:
    code, stdout, err = run_cli("verify", str(out), "--reference", str(src), "--calibration", str(data), "--json")
    return code, (json.loads(stdout) if stdout.strip() else {}), err


def test_verify_reruns_calibration_and_passes(calibrated, src, run_cli):
    out, data = calibrated
    code, report, err = _verify(run_cli, out, src, data)
    assert code == 0, err
    checks = {c["check"]: c["passed"] for c in report["checks"]}
    assert checks["static activation and KV-cache scales equal a rerun of the calibration on the reference"]


def test_verify_catches_a_scale_from_other_data(calibrated, src, tmp_path, run_cli):
    out, data = calibrated
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    from safetensors.torch import load_file, save_file

    (shard,) = sorted(bad.glob("*.safetensors"))
    t = load_file(shard)
    t["model.layers.1.mlp.down_proj.input_scale"] = t["model.layers.1.mlp.down_proj.input_scale"] * 1.01
    t["model.layers.0.self_attn.v_proj.v_scale"] = t["model.layers.0.self_attn.v_proj.v_scale"] * 0.5
    save_file(t, str(shard), metadata={"format": "pt"})
    code, report, _ = _verify(run_cli, bad, src, data)
    assert code == 1
    faulted = {f["tensor"] for f in report["faults"]}
    assert {"model.layers.1.mlp.down_proj.input_scale", "model.layers.0.self_attn.v_proj.v_scale"} <= faulted


@pytest.mark.parametrize("case,needle", [("other-data", "not the data"), ("no-reference", "needs --reference")])
def test_verify_calibration_refusals(calibrated, src, tmp_path, run_cli, case, needle):
    out, data = calibrated
    args = ["verify", str(out), "--reference", str(src), "--calibration", str(data)]
    if case == "other-data":
        other = tmp_path / "other.txt"
        other.write_text("w1 w2\n")
        args[-1] = str(other)
    else:
        args = ["verify", str(out), "--calibration", str(data)]
    code, _, err = run_cli(*args)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_verify_calibration_of_a_weight_only_checkpoint_judges_layer_outputs(calibrated, src, tmp_path, run_cli):
    """Nothing calibrated to compare, but every Linear is judged by its layer-output error on the data."""
    _, data = calibrated
    plain = tmp_path / "plain"
    assert run_cli("convert", str(src), str(plain), "--recipe", "fp8", "--quiet")[0] == 0
    code, report, _ = _verify(run_cli, plain, src, data)
    assert code == 0, report["faults"]
    rows = [t for t in report["tensors"] if "output_rel_err" in t]
    assert rows and all(t["output_rel_err"] <= 1.01 * t["output_rounded_rel_err"] for t in rows)


def test_dry_run_estimates_calibration_and_validates_against_its_schema(src, tmp_path, run_cli):
    from test_json_schema import validate

    data = tmp_path / "d.txt"
    data.write_text("\n".join(_words(i, 20) for i in range(7)) + "\n")
    code, stdout, err = run_cli("convert", str(src), str(tmp_path / "out"), "--recipe", "nvfp4", "--activations",
                                "static", "--calibration", str(data), "--dry-run", "--json")
    assert code == 0, err
    est = validate("convert-dry-run", json.loads(stdout))["calibration_estimate"]
    assert est["samples"] == 7 and est["tokens"] == 7 * 20 and est["layers"] == 2
    assert est["activation_bytes"] == 4 * 7 * 20 * 64 and not est["spilled"]
    assert est["peak_memory_bytes"] > est["layer_weight_bytes"] > 0 and est["seconds"] > 0
    assert not (tmp_path / "out").exists()
    code, stdout, _ = run_cli("convert", str(src), str(tmp_path / "out"), "--recipe", "nvfp4", "--activations",
                              "static", "--calibration", str(data), "--dry-run")
    assert code == 0 and "calibration: 7 samples, 140 tokens through 2 layers" in stdout


class _FakeDatasets:
    """Stands in for the `datasets` package: records load_dataset calls, serves rows."""

    class exceptions:  # noqa: N801 (mirrors datasets.exceptions)
        class DatasetNotFoundError(FileNotFoundError):
            pass

    def __init__(self, rows):
        self.rows, self.calls = rows, []

    def load_dataset(self, repo, config=None, split=None, streaming=False):
        self.calls.append((repo, config, split, streaming))
        if repo != "org/calib":
            raise self.exceptions.DatasetNotFoundError(
                f"Dataset '{repo}' doesn't exist on the Hub or cannot be accessed.")
        return iter(self.rows)


def test_hub_dataset_id_reads_rows_like_jsonl(src, tmp_path, run_cli, monkeypatch):
    import sys

    samples = [_words(i) for i in range(5)]
    fake = _FakeDatasets([{"text": s, "id": i} for i, s in enumerate(samples)] + [{"text": "w9"}] * 50)
    monkeypatch.setitem(sys.modules, "datasets", fake)
    monkeypatch.setattr("huggingface_hub.HfApi.dataset_info", lambda self, *a, **kw: None)  # the Hub is there
    local = tmp_path / "local.jsonl"
    local.write_text("".join(json.dumps({"text": s}) + "\n" for s in samples))
    _convert(run_cli, src, tmp_path / "hub", "org/calib:main:validation", "--calibration-samples", "5")
    _convert(run_cli, src, tmp_path / "local", local, "--calibration-samples", "5")
    # streamed once for the plan's checks, the fingerprint, the engine and the manifest together
    assert fake.calls == [("org/calib", "main", "validation", True)]
    shards = [{p.name: p.read_bytes() for p in (tmp_path / d).glob("*.safetensors")} for d in ("hub", "local")]
    assert shards[0] == shards[1]
    run = json.loads((tmp_path / "hub" / "quantcli_manifest.json").read_text())["calibration"]
    assert run["data"] == "org/calib:main:validation" and len(run["data_sha256"]) == 64


@pytest.mark.parametrize("case,needle", [("missing-package", "needs the datasets package"),
                                         ("not-found", "cannot read the Hub dataset org/nope")])
def test_hub_dataset_refusals_one_line(src, tmp_path, run_cli, monkeypatch, case, needle):
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None if case == "missing-package" else _FakeDatasets([]))
    monkeypatch.setattr("huggingface_hub.HfApi.dataset_info", lambda self, *a, **kw: None)  # the Hub is there
    code, _, err = run_cli("convert", str(src), str(tmp_path / "out"), "--recipe", "fp8", "--kv-cache", "fp8",
                           "--layout", "compressed-tensors", "--calibration", "org/nope:train")
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_fewer_samples_than_asked_warns_and_the_manifest_records_both(src, tmp_path, run_cli):
    data = tmp_path / "two.txt"
    data.write_text("w1 w2 w3\nw4 w5 w6\n")
    out = tmp_path / "out"
    code, _, err = run_cli("convert", str(src), str(out), "--recipe", "fp8", "--layout", "compressed-tensors",
                           "--activations", "static", "--calibration", str(data), "--calibration-samples", "4")
    assert code == 0, err
    assert "holds 2 sample(s), fewer than --calibration-samples 4; calibrating with 2" in err
    run = json.loads((out / "quantcli_manifest.json").read_text())["calibration"]
    assert run["samples"] == 4 and run["samples_used"] == 2


def test_kv_cache_in_the_fp8_layout_without_static_activations(src, tmp_path, run_cli):
    """--kv-cache fp8 --layout fp8 (once refused): dynamic activations, the KV scales alone, the
    config key SGLang reads, and the vLLM flag the card's serving command adds."""
    data = tmp_path / "d.txt"
    data.write_text("w1 w2 w3 w4\nw5 w6 w7\n")
    out = tmp_path / "out"
    code, _, err = run_cli("convert", str(src), str(out), "--recipe", "fp8", "--layout", "fp8",
                           "--kv-cache", "fp8", "--calibration", str(data), "--quiet")
    assert code == 0, err
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_quant_algo"] == "FP8" and qc["activation_scheme"] == "dynamic"
    written = json.loads((out / "quantcli_manifest.json").read_text())
    names = {t["name"] for m in written["modules"] for t in m["tensors"]}
    assert "model.layers.0.self_attn.k_scale" in names and not any(n.endswith("input_scale") for n in names)
    assert "vllm serve MODEL --kv-cache-dtype fp8" in (out / "README.md").read_text()
    assert run_cli("verify", str(out))[0] == 0


def test_messages_without_chat_template_refused_up_front(src, tmp_path, run_cli):
    plain = tmp_path / "plain"
    shutil.copytree(src, plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "w1"}]}) + "\n")
    code, _, err = run_cli("convert", str(plain), str(tmp_path / "out"), "--recipe", "fp8", "--activations", "static",
                           "--calibration", str(data))
    assert code == 2 and "chat template" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("ids,needle", [([5, -1, 7], "token id -1, outside"), ([5, 512, 7], "token id 512, outside"),
                                        ([5, 10**30], "outside the model's vocabulary"),
                                        ([True, False], "'input_ids'[0] is true (a boolean), not an integer token id"),
                                        ([1.5, 2], "'input_ids'[0] is 1.5 (a float), not an integer token id"),
                                        ([], "holds no samples (every row's 'input_ids' is empty)"),
                                        ("1 2 3", "must be a list of integer token ids, not a string")])
def test_bad_token_ids_refused_up_front(src, tmp_path, run_cli, ids, needle):
    data = tmp_path / "ids.jsonl"
    data.write_text(json.dumps({"input_ids": ids}) + "\n")
    out = tmp_path / "out"
    code, _, err = run_cli("convert", str(src), str(out), "--recipe", "nvfp4", "--layout", "modelopt",
                           "--activations", "static", "--calibration", str(data))
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert not list(tmp_path.glob("out*"))


def test_summary_counts_the_calibrated_scales_and_suggests_the_rerun(src, tmp_path, run_cli):
    data = tmp_path / "d.txt"
    data.write_text("w1 w2 w3\n")
    out = tmp_path / "out"
    code, stdout, err = run_cli("convert", str(src), str(out), "--recipe", "nvfp4", "--layout", "modelopt",
                                "--activations", "static", "--kv-cache", "fp8", "--calibration", str(data),
                                "--calibration-samples", "1")
    assert code == 0, err
    assert f"calibrated: 14 activation scales, 4 KV-cache scales from {data}" in stdout
    assert f"--calibration {data}" in stdout.splitlines()[-1]
