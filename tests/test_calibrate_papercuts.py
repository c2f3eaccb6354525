"""Calibration papercuts: a tokenizer_config.json alone is said to be that (not "lacks"); no
transformers warning about sequences longer than the model's maximum (quantcli truncates); the
bar names the calibration phase from the start, never `shard 1/N <tensor> 0 B` while the data is
tokenized and run; a calibrating line stays on one row at 100 and 80 columns; before the shards the bar
fills by layer (never `0 B` for the whole rounding phase)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from quantcli.testing import make_llama

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")


def _tokenizer(folder: Path, max_length: int) -> None:
    """A word-level tokenizer (w0..w499) whose model_max_length is short, saved in `folder`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(500)} | {"[UNK]": 500}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]",
                                         model_max_length=max_length).save_pretrained(folder)


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return make_llama(tmp_path_factory.mktemp("papercuts") / "llama", hidden=64, layers=2, shards=1)


def test_tokenizer_config_alone_is_named_as_such(src, tmp_path, run_cli):
    data = tmp_path / "d.txt"
    data.write_text("w1 w2 w3\nw4 w5\n")
    assert (src / "tokenizer_config.json").exists() and not (src / "tokenizer.json").exists()
    code, _, err = run_cli("convert", src, tmp_path / "out", "--recipe", "fp8", "--layout", "compressed-tensors",
                           "--activations", "static", "--calibration", data)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "has a tokenizer_config.json and no file to build the tokenizer from (tokenizer.json" in err
    assert "lacks" not in err


def test_no_sequence_length_warning_when_quantcli_truncates(src, tmp_path, monkeypatch):
    from transformers import tokenization_utils_base

    from quantcli.formats.facts import Calibration
    from quantcli.model.samples import token_ids

    folder = tmp_path / "tok"
    folder.mkdir()
    _tokenizer(folder, max_length=8)
    data = tmp_path / "long.txt"
    data.write_text(" ".join(f"w{i}" for i in range(40)) + "\n")
    said = []
    monkeypatch.setattr(tokenization_utils_base.logger, "warning", lambda msg, *a, **k: said.append(msg))
    ids = token_ids(Calibration(data=str(data), samples=4, seq_len=16), folder)
    assert ids == [list(range(16))]
    assert not [m for m in said if "sequence length is longer" in str(m)]


def _plan(src: Path, data: Path):
    from quantcli.checkpoint.source import open_source
    from quantcli.planning.conversion import plan_conversion
    from quantcli.planning.options_file import conversion_options

    opts = conversion_options(recipe="fp8", layout="compressed-tensors", ignore=[], config=None, scale_rule=None,
                              calibrate={"activations": "static", "calibration": str(data)})
    return plan_conversion(open_source(str(src)), opts)


def _rows(con: Console, bar) -> int:
    return len(con.render_lines(bar.progress.make_tasks_table(bar.progress.tasks), con.options))


@pytest.mark.parametrize("width", [100, 80])
def test_bar_names_the_calibration_phase_on_one_row(src, tmp_path, width):
    from quantcli.calibrate.run import collect_stats
    from quantcli.checkpoint.tensors import CheckpointTensors
    from quantcli.cli.bars import ConvertBar

    data = tmp_path / "ids.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [(i + j) % 500 for j in range(12)]}) + "\n" for i in range(3)))
    plan = _plan(src, data)
    con = Console(width=width, file=io.StringIO(), force_terminal=True)
    bar = ConvertBar(plan, con, show_bar=True, verbose=False)
    seen = [bar.progress.tasks[0].description]
    reports = []

    def report(n: int, text: str) -> None:
        reports.append(text)
        bar(n, text)
        seen.append(bar.progress.tasks[0].description)
        assert _rows(con, bar) == 1, bar.progress.tasks[0].description

    import torch

    with CheckpointTensors(plan.source) as tensors:
        collect_stats(plan, tensors, torch.device("cpu"), report)
    assert seen[0] == "calibrating: reading the data"
    assert all(s.startswith("calibrating:") for s in seen) and "shard" not in " ".join(seen)
    assert reports[0] == "calibrating: tokenizing the data" and reports[-1].startswith("calibrating: layer 2/2, ")
    bar(0, "calibrating: layer 12/32, 4.1 s/layer, 128 samples, 31.2 samples/s")  # a long one
    assert _rows(con, bar) == 1 and bar.progress.tasks[0].description.startswith("calibrating: layer 12/32")


def _row(con: Console, bar) -> str:
    return "".join(seg.text for line in con.render_lines(bar.progress.make_tasks_table(bar.progress.tasks),
                                                         con.options) for seg in line)


def test_bar_fills_by_layer_before_the_shards_then_counts_bytes_from_zero(src, tmp_path):
    """A rounding phase (most of a GPTQ run) is no longer `0 B / N` with an empty bar: the bar fills
    by the layer the phase names and says `layer i/N`; the first shard's bytes start it over."""
    from quantcli.cli.bars import ConvertBar

    data = tmp_path / "ids.jsonl"
    data.write_text(json.dumps({"input_ids": list(range(12))}) + "\n")
    plan = _plan(src, data)
    con = Console(width=100, file=io.StringIO(), force_terminal=True)
    bar = ConvertBar(plan, con, show_bar=True, verbose=False)
    task = bar.progress.tasks[0]
    assert " 0 B / " not in _row(con, bar)  # reading the data: no byte is due yet
    bar(0, "rounding (gptq): layer 1/4, 4.1 s/layer, 128 samples, 31.2 samples/s")
    assert task.completed == pytest.approx(plan.bytes_in / 4)
    assert "layer 1/4" in _row(con, bar).split("rounding (gptq)")[1] and " 0 B / " not in _row(con, bar)
    bar(0, "rounding (gptq): tokenizing the data")  # a phase with no layer count starts empty
    assert task.completed == 0 and " 0 B / " not in _row(con, bar)
    shard = next(iter(bar.order))
    first = bar.order[shard][0]
    bar(first.bytes_in, shard)
    assert task.completed == first.bytes_in and f" / {_human(plan.bytes_in)}" in _row(con, bar)
    assert "layer" not in _row(con, bar)


def _human(n: int) -> str:
    from quantcli.cli.render import human_bytes

    return human_bytes(n)
