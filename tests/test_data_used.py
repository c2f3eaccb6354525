"""How much of the data a run used, of how much there is. convert's default takes the whole
calibration file up to 512 samples (it once kept the first 128: a 190-sample file lost a third,
where llm-compressor uses all of it), and its summary, its --json and the manifest say the
samples and tokens used of those the data holds; eval's report says the samples and tokens it used of
the --data's (its --samples keeps the first 32, --seq-len cuts each)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantcli.testing import make_llama

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from test_calibrate_verify import _tokenizer  # noqa: E402
from test_json_schema import run_json, validate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    folder = make_llama(tmp_path_factory.mktemp("used") / "llama", hidden=64, layers=1, shards=1)
    _tokenizer(folder)  # word level: a sample of n words is n tokens
    return folder


def _text(path: Path, samples: int) -> list[int]:
    """`samples` lines of 3 to 20 words (w0..w499) -> each line's length in tokens."""
    lengths = [3 + (7 * i) % 18 for i in range(samples)]
    path.write_text("".join(" ".join(f"w{(13 * i + j) % 500}" for j in range(n)) + "\n"
                            for i, n in enumerate(lengths)))
    return lengths


def _calibration(out: Path) -> dict:
    return json.loads((out / "quantcli_manifest.json").read_text())["calibration"]


def test_gptq_uses_the_whole_190_sample_file_by_default(src, tmp_path, run_cli):
    lengths = _text(tmp_path / "c190.txt", 190)
    code, out, err = run_cli("convert", src, tmp_path / "out", "--recipe", "nvfp4", "--rounding", "gptq",
                             "--calibration", tmp_path / "c190.txt")
    assert code == 0, err
    record = _calibration(tmp_path / "out")
    assert record["samples"] == 512 and record["samples_used"] == record["samples_in_data"] == 190
    assert record["tokens_used"] == record["tokens_in_data"] == sum(lengths)
    assert f"calibration data: all 190 samples, {sum(lengths):,} tokens of c190.txt" in out
    assert "warning" not in err  # fewer samples than the default cap is what the default means


def test_an_explicit_cap_and_seq_len_say_what_they_left_out(src, tmp_path, run_cli):
    lengths = _text(tmp_path / "c190.txt", 190)
    args = ("convert", src, tmp_path / "out", "--recipe", "nvfp4", "--activations", "static", "--calibration",
            tmp_path / "c190.txt", "--calibration-samples", "100", "--calibration-seq-len", "8")
    doc = validate("convert", run_json(run_cli, *args))
    used = sum(min(n, 8) for n in lengths[:100])
    assert doc["calibration"] == _calibration(tmp_path / "out")
    assert {k: doc["calibration"][k] for k in ("samples", "samples_used", "samples_in_data", "tokens_used",
                                              "tokens_in_data", "seq_len")} == {
        "samples": 100, "samples_used": 100, "samples_in_data": 190, "tokens_used": used,
        "tokens_in_data": sum(lengths), "seq_len": 8}
    code, out, err = run_cli(*args, "--overwrite")
    assert code == 0, err
    assert (f"calibration data: 100 of 190 samples, {used:,} of {sum(lengths):,} tokens of c190.txt (the rest left "
            f"out by --calibration-samples 100 and --calibration-seq-len 8)") in out
    # an uncalibrated conversion's document says so
    assert validate("convert", run_json(run_cli, "convert", src, tmp_path / "plain", "--recipe", "nvfp4"))[
        "calibration"] is None


def test_the_cap_is_stated_in_help_and_docs(run_cli):
    code, out, _ = run_cli("convert", "--help")
    assert code == 0 and "by default the whole data up to 512 (llm-compressor's default)" in " ".join(out.split())
    assert "the whole data up to 512 samples" in " ".join((ROOT / "docs" / "cli.md").read_text().split())


def test_eval_says_how_many_samples_of_the_data_it_used(src, tmp_path, run_cli):
    assert run_cli("convert", src, tmp_path / "q", "--recipe", "nvfp4", "-q")[0] == 0
    (tmp_path / "d64.jsonl").write_text("".join(json.dumps({"input_ids": [(5 * i + j) % 500 for j in range(6)]}) + "\n"
                                                for i in range(64)))
    args = ("eval", tmp_path / "q", "--reference", src, "--data", tmp_path / "d64.jsonl", "--device", "cpu")
    code, out, err = run_cli(*args)
    assert code == 0, err
    assert "32 of 64 samples (the first 32: --samples), 192 of 384 tokens" in out
    doc = validate("eval", run_json(run_cli, *args))
    assert (doc["samples"], doc["samples_in_data"], doc["tokens"], doc["tokens_in_data"]) == (32, 64, 192, 384)
    doc = validate("eval", run_json(run_cli, *args, "--samples", "100"))
    assert (doc["samples"], doc["samples_in_data"], doc["tokens"], doc["tokens_in_data"]) == (64, 64, 384, 384)
    code, out, err = run_cli(*args, "--samples", "100", "--seq-len", "4")  # each sample cut: tokens left out
    assert code == 0 and "64 of 64 samples, 256 of 384 tokens (at most 4 each)" in out, err
