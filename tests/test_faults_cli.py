"""Fault injection on the command-line surface: usage mistakes, --config values of the wrong type,
Ctrl-C / SIGTERM, a closed stdout, OS errors and bugs. Each must end in one line and the
documented exit code (0 done, 1 verify found a problem, 2 bad input or usage, 3 internal error,
130 interrupted, 143 terminated), never a traceback, with the source and destination untouched."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from faults import assert_nothing_left, assert_one_line_error, fault_env, tree_state
from safetensors.torch import save_file


def _write_checkpoint(out: Path, shards: int, layers_per_shard: int, dim: int) -> Path:
    """A Llama-named checkpoint of MLP weights only, written directly (no transformers)."""
    out.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    weight_map = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {f"model.layers.{s * layers_per_shard + i}.mlp.{p}.weight":
                   torch.randn(dim, dim, generator=g).to(torch.bfloat16)
                   for i in range(layers_per_shard) for p in ("up_proj", "down_proj")}
        save_file(tensors, out / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                 "num_hidden_layers": shards * layers_per_shard}))
    return out


@pytest.fixture(scope="module")
def small_src(tmp_path_factory) -> Path:
    return _write_checkpoint(tmp_path_factory.mktemp("cli") / "src", shards=1, layers_per_shard=1, dim=64)


# ---------------------------------------------------------------- usage mistakes

S, D = "{SRC}", "{DST}"  # replaced by the test's source and destination
USAGE_MISTAKES = [
    # (argv, needles that the one error line must hold)
    ([], ["missing command", "convert, inspect, verify"]),
    (["convrt", S, D], ["'convrt'", "did you mean 'convert'"]),
    (["inspct", S], ["'inspct'", "did you mean 'inspect'"]),
    (["convert"], ["missing argument", "SRC"]),
    (["convert", S], ["missing argument", "DST"]),
    (["verify"], ["missing argument", "QUANT"]),
    (["convert", S, D, "--recipie", "nvfp4"], ["--recipie", "did you mean --recipe"]),
    (["inspect", S, "--tensrs", "*"], ["--tensrs", "did you mean --tensors"]),
    (["convert", S, D, "--recipe", "nvpf4"], ["--recipe", "'nvpf4'", "did you mean 'nvfp4'"]),
    (["convert", S, D, "--recipe", "nvfp4", "--layout", "modelopts"], ["--layout", "did you mean 'modelopt'"]),
    (["convert", S, D, "--recipe", "nvfp4", "--backend", "trition"], ["--backend", "did you mean 'triton'"]),
    (["convert", S, D, "--recipe", "nvfp4", "--device", "cdua"], ["--device", "did you mean 'cuda'"]),
    (["convert", S, D, "--recipe", "mxfp4", "--scale-rule", "flor"], ["--scale-rule", "did you mean 'floor'"]),
    (["convert", S, D, "--recipe"], ["--recipe", "requires an argument"]),
    (["verify", S, "--device", "gpu"], ["--device", "'gpu'", "cuda:N"]),
    (["verify", S, "--top", "abc"], ["--top", "integer"]),
    (["verify", S, "--tp", "abc"], ["--tp", "integer"]),
    (["verify", S, "--top", "-1"], ["--top"]),
    (["convert", S, D, "--recipe", "nvfp4", "extra"], ["extra"]),
]


@pytest.mark.parametrize("argv,needles", USAGE_MISTAKES, ids=[" ".join(a) or "(none)" for a, _ in USAGE_MISTAKES])
def test_usage_mistake_is_one_line_exit_2(argv, needles, small_src, tmp_path, run_cli):
    dst = tmp_path / "out"
    before = tree_state(small_src)
    args = [str(small_src) if a == S else str(dst) if a == D else a for a in argv]
    code, out, err = run_cli(*args)
    assert_one_line_error(code, out, err, *needles)
    assert "Usage:" not in err  # one line, not click's multi-line usage block
    assert tree_state(small_src) == before
    assert_nothing_left(dst)


@pytest.mark.parametrize("argv", [["help"], ["-h"], ["--help"], ["help", "convert"], ["convert", "-h"],
                                  ["inspect", "--help"], ["verify", "-h"]])
def test_help_exits_0(argv, run_cli):
    code, out, err = run_cli(*argv)
    assert code == 0 and err == "" and out.startswith("Usage: quantcli")
    if argv[-1] in ("help", "-h", "--help") and len(argv) == 1:
        assert "Exit codes: 0 done" in out and "convert" in out
    if "convert" in argv:
        for name in ("nvfp4", "fp8-block", "bf16", "compressed-tensors", "gpt-oss"):  # choices shown
            assert name in out


def test_help_lists_equal_the_registries():
    from quantcli.cli import options as cli
    from quantcli.formats.layouts import LAYOUTS
    from quantcli.kernels import BACKENDS
    from quantcli.kernels.spec import SCALE_RULES
    from quantcli.recipes import DENSE_RECIPES, RECIPES

    assert list(cli.RECIPE_NAMES) == [*RECIPES, *DENSE_RECIPES]
    assert list(cli.LAYOUT_NAMES) == list(LAYOUTS)
    assert tuple(cli.BACKEND_NAMES) == tuple(BACKENDS) and tuple(cli.SCALE_RULE_NAMES) == tuple(SCALE_RULES)


def test_help_does_not_load_torch():
    """`quantcli --help`, `convert --help` and usage errors answer in a fraction of a second: the
    command line's declarations import no torch (it costs 1-2 s)."""
    probe = ("import sys; from quantcli.cli.app import app; "
             "print(sorted(m for m in ('torch', 'transformers', 'huggingface_hub') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_choices_are_case_insensitive(small_src, tmp_path, run_cli):
    code, out, err = run_cli("convert", small_src, tmp_path / "out", "--recipe", "NVFP4", "--layout", "ModelOpt",
                             "--device", "CPU", "--backend", "Torch", "--dry-run", "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["layout"] == "modelopt" and plan["recipes"] == ["nvfp4"]
    assert_nothing_left(tmp_path / "out")


# ---------------------------------------------------------------- --config values of the wrong type

CONFIG_MISTAKES = [
    ('recipe = "nvfp4"\ntargets = "*q_proj"', ["targets", "a string", "array of strings"]),
    ('recipe = "nvfp4"\nignore = 5', ["ignore", "an integer", "array of strings"]),
    ('recipe = "nvfp4"\nignore = ["*down*", 5]', ["ignore", "non-string"]),
    ("recipe = 3", ["recipe", "an integer", "expected a string"]),
    ('recipe = "nvfp4"\nlayout = []', ["layout", "an array", "expected a string"]),
    ('recipe = "mxfp4"\nscale_rule = 1', ["scale_rule", "an integer", "expected a string"]),
    ('recipe = "nvpf4"', ["recipe", "'nvpf4'", "did you mean 'nvfp4'"]),
    ('recipe = "nvfp4"\nlayout = "modelopts"', ["layout", "did you mean 'modelopt'"]),
    ('recipie = "nvfp4"', ["'recipie'", "did you mean 'recipe'"]),
    ('recipe = "nvfp4"\noverride = 5', ["override", "an integer", "[[override]]"]),
    ('recipe = "nvfp4"\noverride = ["x"]', ["[[override]] #1", "a string"]),
    ('recipe = "nvfp4"\n[[override]]\npattern = "*up*"', ["[[override]] #1", "'pattern' and 'recipe'"]),
    ('recipe = "nvfp4"\n[[override]]\npattern = 1\nrecipe = "fp8"', ["[[override]] #1 pattern", "an integer"]),
    ('recipe = "nvfp4"\n[[override]]\npattern = "*up*"\nrecipe = 8', ["[[override]] #1 recipe", "an integer"]),
    ('recipe = "nvfp4"\n[[override]]\npattern = "*up*"\nrecipe = "fp9"',
     ["[[override]] #1 recipe", "'fp9'", "did you mean 'fp8'"]),
]


@pytest.mark.parametrize("toml,needles", CONFIG_MISTAKES, ids=[t.replace("\n", " ") for t, _ in CONFIG_MISTAKES])
def test_config_value_of_wrong_type_is_refused(toml, needles, small_src, tmp_path, run_cli):
    config = tmp_path / "recipe.toml"
    config.write_text(toml + "\n")
    dst = tmp_path / "out"
    before = tree_state(small_src)
    code, out, err = run_cli("convert", small_src, dst, "--config", config)
    assert_one_line_error(code, out, err, str(config), *needles)
    assert tree_state(small_src) == before
    assert_nothing_left(dst)


def test_valid_config_is_read_as_written(small_src, tmp_path, run_cli):
    config = tmp_path / "recipe.toml"
    config.write_text('recipe = "MXFP8"\ntargets = ["*up_proj"]\n[[override]]\npattern = "*"\nrecipe = "MxFp4"\n')
    code, out, err = run_cli("convert", small_src, tmp_path / "out", "--config", config, "--dry-run", "--json")
    assert code == 0, err
    quantized = {t["name"]: t["recipe"] for t in json.loads(out)["tensors"] if t["recipe"]}
    assert quantized == {"model.layers.0.mlp.up_proj.weight": "mxfp4"}  # not every tensor: targets is a list


# ---------------------------------------------------------------- the top-level fallbacks


def _raising(exc: BaseException):
    def run(*args, **kwargs):
        raise exc
    return run


@pytest.mark.parametrize("err_no,needles", [
    (errno.ENOSPC, ["disk full"]),
    (errno.EFBIG, ["file-size limit"]),
    (errno.EROFS, ["Read-only file system"]),
    (errno.EACCES, ["Permission denied"]),
])
def test_os_error_is_one_line_naming_the_file(err_no, needles, small_src, monkeypatch, run_cli):
    import quantcli.cli.commands

    exc = OSError(err_no, os.strerror(err_no), "/data/out/model-00001.safetensors")
    monkeypatch.setattr(quantcli.cli.commands, "run_inspect", _raising(exc))
    code, out, err = run_cli("inspect", small_src)
    assert_one_line_error(code, out, err, "/data/out/model-00001.safetensors", os.strerror(err_no), *needles)
    assert "--resume" not in err  # inspect has nothing to resume


def test_disk_full_during_convert_points_at_resume(small_src, tmp_path, monkeypatch, run_cli):
    import quantcli.cli.commands

    exc = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "out.partial" / "x"))
    monkeypatch.setattr(quantcli.cli.commands, "run_convert", _raising(exc))
    code, out, err = run_cli("convert", small_src, tmp_path / "out", "--recipe", "nvfp4")
    assert_one_line_error(code, out, err, "out.partial", "disk full", "rerun with --resume")


def test_unexpected_exception_is_internal_error_exit_3(small_src, monkeypatch, run_cli):
    import quantcli.cli.commands

    monkeypatch.setattr(quantcli.cli.commands, "run_verify", _raising(ZeroDivisionError("division by zero\nmore")))
    code, out, err = run_cli("verify", small_src)
    line = assert_one_line_error(code, out, err, "internal error: ZeroDivisionError: division by zero",
                                 "QUANTCLI_DEBUG=1", exit_code=3)
    assert "more" in line  # a multi-line message is folded into the one line
    monkeypatch.setenv("QUANTCLI_DEBUG", "1")  # asked for: the traceback
    from quantcli.cli.app import main

    monkeypatch.setattr(sys, "argv", ["quantcli", "verify", str(small_src)])
    with pytest.raises(ZeroDivisionError):
        main()


@pytest.mark.parametrize("interrupt,exit_code", [(KeyboardInterrupt(), 130), ("SIGTERM", 143)])
def test_interrupt_outside_convert_says_interrupted(interrupt, exit_code, small_src, monkeypatch, run_cli):
    import quantcli.cli.commands

    def inspect_then_interrupted(*args, **kwargs):
        if interrupt == "SIGTERM":
            os.kill(os.getpid(), signal.SIGTERM)  # main()'s handler turns it into errors.Terminated
            time.sleep(5)
            raise AssertionError("SIGTERM was not turned into an exception")
        raise interrupt

    handler_before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(quantcli.cli.commands, "run_inspect", inspect_then_interrupted)
    code, out, err = run_cli("inspect", small_src)
    assert code == exit_code and err.strip() == "interrupted" and "Traceback" not in err
    assert signal.getsignal(signal.SIGTERM) == handler_before  # main() put the old handler back



def test_interrupt_path_imports_nothing(small_src, monkeypatch, run_cli):
    """A Ctrl-C can land while torch is half imported; the handler then must not import anything
    (it once imported cli/launch.py, hence torch, and died on the half-built module: exit 1 and a
    torch traceback). Poisoned modules stand in for the half-imported ones."""
    import quantcli.cli.commands

    def interrupted(*args, **kwargs):
        for name in ("quantcli.cli.launch", "quantcli.convert.destination"):
            monkeypatch.setitem(sys.modules, name, None)  # importing them now raises ImportError
        raise KeyboardInterrupt

    monkeypatch.setattr(quantcli.cli.commands, "run_inspect", interrupted)
    code, out, err = run_cli("inspect", small_src)
    assert code == 130 and err.strip() == "interrupted", err


def test_interrupt_while_the_command_line_imports_is_one_line(tmp_path):
    """The console script imports quantcli.cli first; a Ctrl-C while the rest (torch, ...) loads
    prints `interrupted` and exits 130 (an import hook raises the interrupt, deterministically)."""
    code = ("import sys, importlib.abc\n"
            "class Interrupt(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'quantcli.cli.app':\n"
            "            raise KeyboardInterrupt\n"
            "sys.meta_path.insert(0, Interrupt())\n"
            "from quantcli.cli import entry\n"
            "entry()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 130 and proc.stderr == "interrupted\n", proc.stderr


# ---------------------------------------------------------------- --threshold ranges (read before QUANT is opened)

@pytest.mark.parametrize("item,needle", [
    ("margin=-0.5", "margin must be 0 or more"), ("rel_err=0", "rel_err must be more than 0"),
    ("cosine=1.5", "cosine must be in (0, 1]"), ("cosine=0", "cosine must be in (0, 1]"),
    ("sqnr_db=inf", "finite"), ("rel_err=nan", "finite"), ("margin=inf", "finite"),
    ("relerr=0.1", "did you mean 'rel_err'?")])
def test_threshold_out_of_range(item, needle, small_src, run_cli):
    code, out, err = run_cli("verify", small_src, "--threshold", item)
    assert_one_line_error(code, out, err, "--threshold", needle)


def test_threshold_in_range_accepted():
    from quantcli.verify.limits import parse_thresholds

    limits = parse_thresholds(["margin=0", "cosine=1", "rel_err=0.2", "sqnr_db=-3"])
    assert (limits.margin, limits.cosine, limits.rel_err, limits.sqnr_db) == (0, 1, 0.2, -3)


# ---------------------------------------------------------------- real processes: signals, closed pipes


def _popen(*args: str, extra_env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
    env = {**os.environ, "TRITON_INTERPRET": "1", "HF_HUB_DISABLE_TELEMETRY": "1", **(extra_env or {})}
    env.pop("QUANTCLI_DEBUG", None)
    return subprocess.Popen([sys.executable, "-m", "quantcli", *map(str, args)], env=env, text=True, **kw)


@pytest.mark.slow
def test_stdout_closed_early_ends_quietly(small_src):
    proc = _popen("inspect", small_src, "--json", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # like `| head` that has exited before quantcli writes
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 128 + signal.SIGPIPE
    assert err == "", err


def _many_modules(folder: Path) -> Path:
    """2000 FP8 per-tensor modules: `inspect --json` lists each one (about 2 MB of JSON)."""
    from quantcli.checkpoint.safetensors_io import write_file

    folder.mkdir()
    tensors = {}
    for i in range(2000):
        tensors[f"model.layers.{i}.mlp.down_proj.weight"] = torch.zeros(16, 16).to(torch.float8_e4m3fn)
        tensors[f"model.layers.{i}.mlp.down_proj.weight_scale"] = torch.ones(1)
    write_file(folder / "model.safetensors", tensors)
    group = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"}}
    (folder / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": group}}}))
    return folder


@pytest.mark.slow
def test_inspect_json_into_closed_pipe_exits_141(tmp_path, run_cli):
    big = _many_modules(tmp_path / "big")
    code, out, _ = run_cli("inspect", big, "--json")
    assert code == 0 and len(out) > 64 * 1024
    env = {**os.environ, "TRITON_INTERPRET": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "quantcli", "inspect", str(big), "--json"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"{"
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert not err.strip(), err


@pytest.mark.slow
def test_ctrl_c_during_convert_then_resume_is_byte_identical(tmp_path, run_cli):
    src = _write_checkpoint(tmp_path / "src", shards=4, layers_per_shard=1, dim=256)
    src_before = tree_state(src)
    dst, stage = tmp_path / "out", tmp_path / "out.partial"
    # Each shard takes 1 s more (a slow disk), so the interrupt lands mid-run even when this test's
    # polling loop is starved on a loaded machine: a run that had already finished would be
    # complete and exit 0 (see the test below; 0.5 s was not enough at load average 9).
    proc = _popen("convert", src, dst, "--recipe", "nvfp4", "--quiet", stdout=subprocess.PIPE,
                  stderr=subprocess.PIPE, extra_env=fault_env(shard_delay_s=1.0))
    deadline = time.monotonic() + 120
    while not (stage / ".quantcli-progress.json").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (out, err)
    assert [ln for ln in err.splitlines() if ln.strip()] == ["interrupted; rerun with --resume to continue"]
    assert stage.is_dir() and not dst.exists()  # the staging folder is kept for --resume

    code, _, err = run_cli("convert", src, dst, "--recipe", "nvfp4", "--quiet", "--resume")
    assert code == 0, err
    assert not stage.exists()
    code, _, err = run_cli("convert", src, tmp_path / "straight", "--recipe", "nvfp4", "--quiet")
    assert code == 0, err
    assert tree_state(dst) == tree_state(tmp_path / "straight")
    assert tree_state(src) == src_before


def test_an_interrupt_after_dst_is_in_place_says_it_is_complete(tiny_llama, tmp_path, run_cli, monkeypatch):
    """Ctrl-C that lands after the final rename (rank 0 waiting for the others, or the summary)
    finds nothing to resume: one line saying DST is complete, no --resume; still 130, since what
    was left (the summary, --json, a push) did not happen. A later run in the same process
    that is interrupted mid-way is not taken for complete."""
    import quantcli.cli.commands as commands

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "_print_convert_result", interrupted)
    out = tmp_path / "out"
    code, _, err = run_cli("convert", tiny_llama, out, "--recipe", "fp8")
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 130 and len(lines) == 1 and "was complete" in lines[0] and "--resume" not in lines[0], err
    assert (out / "quantcli_manifest.json").exists() and not (tmp_path / "out.partial").exists()
    monkeypatch.undo()
    import quantcli.convert.shard as shard

    monkeypatch.setattr(shard, "produce", interrupted)  # mid-way this time, into the same DST
    code, _, err = run_cli("convert", tiny_llama, out, "--recipe", "nvfp4", "--overwrite")
    assert code == 130 and "--resume" in err and (tmp_path / "out.partial").exists(), err


def test_an_interrupt_before_the_staging_folder_exists_promises_no_resume(small_src, tmp_path, run_cli, monkeypatch):
    """Ctrl-C while convert reads the source or starts its --workers ranks, before DST.partial
    is made: nothing to resume, so the line is plain `interrupted` (--workers once promised
    --resume here); once DST.partial exists, the line says to rerun with --resume."""
    import quantcli.cli.commands as commands

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "run_convert", interrupted)
    code, out, err = run_cli("convert", small_src, tmp_path / "out", "--recipe", "nvfp4", "--workers", "2")
    assert code == 130 and err.strip() == "interrupted", err
    (tmp_path / "out.partial").mkdir()
    code, out, err = run_cli("convert", small_src, tmp_path / "out", "--recipe", "nvfp4", "--workers", "2")
    assert code == 130 and err.strip() == "interrupted; rerun with --resume to continue", err
