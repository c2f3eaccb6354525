"""Command-line papercuts (issue 21 item 17): one suggestion for a misspelled option, plain words
for a value of the wrong type, combinations that would be ignored refused, JSON errors under
--json, -V, examples in --help, and progress names that keep the layer index."""

from __future__ import annotations

import pytest
from faults import assert_one_line_error


def test_a_misspelled_option_gets_the_one_closest_suggestion(run_cli, tmp_path):
    line = assert_one_line_error(*run_cli("convert", tmp_path, tmp_path / "o", "--recpie", "nvfp4"),
                                 "--recpie", "did you mean --recipe?")
    assert " or " not in line  # was: --recipe or --resume or --device
    line = assert_one_line_error(*run_cli("convert", tmp_path, tmp_path / "o", "--zzzzzz", "x"), "--zzzzzz")
    assert "did you mean" not in line  # nothing is close


@pytest.mark.parametrize("argv, said", [
    (["verify", "q", "--top", "abc"], "--top 'abc': not an integer"),
    (["verify", "q", "--top=abc"], "--top 'abc': not an integer"),
    (["verify", "q", "--top", "-1"], "--top '-1': must be at least 0"),
    (["convert", "s", "d", "--workers", "0"], "--workers '0': must be at least 1"),
])
def test_a_bad_value_is_said_in_plain_words(run_cli, argv, said):
    line = assert_one_line_error(*run_cli(*argv), said)
    assert "Input should be" not in line and "unable to parse" not in line


# ---------------------------------------------------------------- options that would be ignored: refused


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from quantcli.testing import make_llama

    return make_llama(tmp_path_factory.mktemp("pc") / "llama", hidden=64, layers=1, shards=1)


@pytest.mark.parametrize("flag", ["--calibration-samples", "--calibration-seq-len", "--calibration-batch"])
def test_calibration_sizes_without_calibration_are_refused(llama, tmp_path, run_cli, flag):
    code, out, err = run_cli("convert", llama, tmp_path / "o", "--recipe", "nvfp4", flag, "0", "--dry-run")
    assert_one_line_error(code, out, err, f"{flag} 0", "only used with --calibration")


def test_calibration_sizes_from_a_recipe_file_without_calibration_are_refused(llama, tmp_path, run_cli):
    cfg = tmp_path / "r.toml"
    cfg.write_text('recipe = "nvfp4"\ncalibration_samples = 8\n')
    code, out, err = run_cli("convert", llama, tmp_path / "o", "--config", cfg, "--dry-run")
    assert_one_line_error(code, out, err, "calibration_samples in --config", "only used with --calibration")


@pytest.mark.parametrize("argv", [["inspect", "{SRC}", "-q", "-v"], ["verify", "{SRC}", "--quiet", "--verbose"],
                                  ["convert", "{SRC}", "{DST}", "--recipe", "nvfp4", "-v", "-q", "--dry-run"]])
def test_quiet_and_verbose_together_are_refused(llama, tmp_path, run_cli, argv):
    args = [str(llama) if a == "{SRC}" else str(tmp_path / "o") if a == "{DST}" else a for a in argv]
    assert_one_line_error(*run_cli(*args), "-q and -v together", "choose one")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("extra, said", [
    (["--per-tensor"], ["--per-tensor", "--dry-run"]),
    (["--per-tensor", "-v"], ["--per-tensor", "--dry-run", "-v"]),
    (["--private"], ["--private", "--push-to-hub REPO"]),
    (["--push-revision", "dev"], ["--push-revision", "--push-to-hub REPO"]),
])
def test_options_that_only_change_another_are_refused_without_it(llama, tmp_path, run_cli, extra, said):
    assert_one_line_error(*run_cli("convert", llama, tmp_path / "o", "--recipe", "fp8", *extra), *said)
    assert not (tmp_path / "o").exists()


def test_per_tensor_and_verbose_still_work_where_they_apply(llama, tmp_path, run_cli):
    code, out, err = run_cli("convert", llama, tmp_path / "d", "--recipe", "fp8", "--dry-run", "--per-tensor")
    assert code == 0 and "model.layers.0.self_attn.q_proj" in out, err
    code, out, err = run_cli("convert", llama, tmp_path / "o", "--recipe", "fp8", "-v")  # -v: a line per tensor
    assert code == 0 and "q_proj" in err, err


def test_verify_revision_without_reference_is_refused(llama, run_cli):
    assert_one_line_error(*run_cli("verify", llama, "--revision", "main"), "--revision", "--reference SRC")


# ---------------------------------------------------------------- errors under --json


def error_document(run_cli, *args, code: int = 2) -> dict:
    import json

    from test_json_schema import validate

    got, out, err = run_cli(*map(str, args))
    assert got == code, (out, err)
    doc = validate("error", json.loads(out))
    assert doc["error"]["exit_code"] == code and err.strip() == "error: " + doc["error"]["message"]
    return doc


def test_errors_under_json_put_an_error_document_on_stdout(llama, tmp_path, run_cli, monkeypatch):
    doc = error_document(run_cli, "inspect", tmp_path / "nope", "--json")
    assert doc["command"] == "inspect" and doc["error"]["kind"] == "bad input or usage"
    doc = error_document(run_cli, "convert", llama, tmp_path / "o", "--recpie", "nvfp4", "--json")
    assert doc["command"] == "convert" and "did you mean --recipe" in doc["error"]["message"]
    assert error_document(run_cli, "conevrt", "--json")["command"] is None
    import quantcli.cli.commands

    def bug(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(quantcli.cli.commands, "run_inspect", bug)
    doc = error_document(run_cli, "inspect", llama, "--json", code=3)
    assert doc["error"]["kind"] == "internal error" and "RuntimeError: a bug" in doc["error"]["message"]


def test_without_json_an_error_leaves_stdout_empty(tmp_path, run_cli):
    code, out, err = run_cli("inspect", tmp_path / "nope")
    assert code == 2 and out == "" and err.startswith("error: ")


# ---------------------------------------------------------------- progress names keep the layer index


@pytest.mark.parametrize("room", range(12, 40))
def test_a_long_name_keeps_its_layer_index_and_leaf(room):
    from quantcli.cli.bars import elide

    short = elide("model.layers.12.self_attn.o_proj.weight", room)
    assert len(short) <= room and "12." in short and "o_proj" in short, short
    assert elide("lm_head.weight", room) in ("lm_head", "lm_head.weight")


def test_the_convert_bar_at_80_columns_names_the_layer(monkeypatch):
    import io
    from types import SimpleNamespace

    from rich.console import Console

    from quantcli.cli.bars import ConvertBar

    plan = SimpleNamespace(by_shard=lambda: {}, bytes_in=1, options=SimpleNamespace(calibration=None))
    bar = ConvertBar(plan, Console(file=io.StringIO(), width=80), show_bar=False, verbose=False)
    text = bar._describe("shard 1/4", "model.layers.12.self_attn.o_proj.weight")
    assert "12." in text and "o_proj" in text and len(text) <= 80 - bar.bar_width - 48, text


# ---------------------------------------------------------------- -V and the examples in --help


@pytest.mark.parametrize("flag", ["-V", "--version"])
def test_version_has_a_short_flag(run_cli, flag):
    from quantcli import __version__

    assert run_cli(flag) == (0, f"quantcli {__version__}\n", "")


@pytest.mark.parametrize("command", ["convert", "inspect", "verify", "recipes", "layouts", "eval", "push"])
def test_each_help_ends_with_examples_that_parse(run_cli, command):
    import shlex

    import typer

    from quantcli.cli.app import app
    from quantcli.cli.usage import EXAMPLES

    code, out, err = run_cli(command, "--help")
    assert code == 0 and "Examples:" in out
    group = typer.main.get_command(app)
    for example in EXAMPLES[command]:
        args = shlex.split(example.replace("\\\n", " "))
        assert args[:2] == ["quantcli", command] and example.split("\n")[0] in out
        sub = group.get_command(None, command)
        sub.make_context(command, args[2:])  # every option and value is one the command takes
        assert max(len(line) for line in example.split("\n")) <= 76, example  # fits 80 columns, indented


# ---------------------------------------------------------------- a count agrees with its noun


def test_a_count_takes_the_singular_only_for_one():
    from quantcli.cli.name_tables import counted

    assert (counted(1, "empty tensor"), counted(2, "empty tensor")) == ("1 empty tensor", "2 empty tensors")
    assert (counted(0, "layer"), counted(2, "MoE router/gate")) == ("0 layers", "2 MoE routers/gates")
    assert counted(1234, "param", spec=",") == "1,234 params"


def test_left_dense_counts_agree_with_their_reasons():
    from quantcli.cli.render import dense_reasons
    from quantcli.planning.plan import Exclusion

    reasons = ["empty tensor"] * 2 + ["MoE router/gate"] * 3 + ["--ignore"] * 2 + ["output head", "norm", "norm"]
    said = dense_reasons([Exclusion(f"m{i}", r) for i, r in enumerate(reasons)])
    assert said == "3 MoE routers/gates, 2 --ignore, 2 empty tensors, 2 norms, 1 output head"  # was: 2 empty tensor
    assert dense_reasons([Exclusion("m", "dense in the source")] * 2) == "2 already dense in the source"
    sentence = "gpt-oss layout quantizes MoE experts only"  # a reason that is a sentence: a count of modules
    said = dense_reasons([Exclusion(f"m{i}", sentence) for i in range(8)] + [Exclusion("h", "output head")])
    assert said == f"8 modules ({sentence}), 1 output head"
    dtype = "dtype I8 is not a float weight"
    assert dense_reasons([Exclusion("m", dtype)]) == f"1 module ({dtype})"


def test_summary_lines_count_one_in_the_singular():
    from types import SimpleNamespace

    from quantcli.cli.convert_summary import _what_was_done
    from quantcli.cli.render_rounding import rounding_summary, settings_line

    one = SimpleNamespace(action="dequantize")
    dequantized = SimpleNamespace(layout=None, source_layout="modelopt", tensors=[one], dense_dtype="bf16")
    assert _what_was_done(dequantized, None) == "1 module dequantized to bf16"  # was: 1 modules
    plan = SimpleNamespace(layout=object(), lossless=False, tensors=[one], recipes={"fp8"}, target="fp8")
    assert _what_was_done(plan, SimpleNamespace(quantized=1)) == "1 of 1 tensor quantized (fp8 -> fp8)"
    gptq = {"method": "gptq", "nearest_output_error": 0.2, "output_error": 0.1}
    assert rounding_summary([gptq]).startswith("1 module by GPTQ;")
    assert "at least 1 token a module" in settings_line({"method": "gptq", "min_tokens": 1})
