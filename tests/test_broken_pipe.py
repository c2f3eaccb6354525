"""A closed stdout or stderr (issue 21 item 6: `quantcli ... -v 2>&1 >/dev/null | head -1`): every
command exits 141, as a process killed by SIGPIPE would, and prints nothing more. A convert the
closed pipe stopped mid-way keeps DST.partial for --resume, as Ctrl-C does; once DST is in place
it stays, complete, with no .partial beside it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from faults import tree_state

from quantcli.testing import make_llama

SIGPIPE_EXIT = 128 + signal.SIGPIPE


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_llama(tmp_path_factory.mktemp("bp") / "llama", hidden=64, layers=1, shards=2)


def closed(stream: str, *args) -> tuple[int, str]:
    """Run `python -m quantcli ARGS` with `stream` (stdout or stderr) a pipe nobody reads: closed
    before the command writes (it imports torch first) -> (exit code, what the other stream got)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    env.pop("QUANTCLI_DEBUG", None)
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    proc = subprocess.Popen([sys.executable, "-m", "quantcli", *map(str, args)], env=env, text=True, **pipes)
    getattr(proc, stream).close()
    other = (proc.stderr if stream == "stdout" else proc.stdout).read()
    return proc.wait(timeout=300), other


@pytest.mark.slow
def test_closed_stderr_mid_convert_exits_141_and_resume_finishes(llama, tmp_path, run_cli):
    code, _, err = run_cli("convert", llama, tmp_path / "clean", "--recipe", "nvfp4", "-q", "--device", "cpu")
    assert code == 0, err
    dst = tmp_path / "out"
    code, stdout = closed("stderr", "convert", llama, dst, "--recipe", "nvfp4", "-v", "--device", "cpu")
    assert (code, stdout) == (SIGPIPE_EXIT, "")  # not 1, not 2 ("BrokenPipeError while writing")
    stage = tmp_path / "out.partial"
    assert not dst.exists() and (stage / ".quantcli-progress.json").is_file()  # kept, like Ctrl-C
    assert not (stage / ".quantcli-lock").exists()
    code, _, err = run_cli("convert", llama, dst, "--recipe", "nvfp4", "-q", "--device", "cpu", "--resume")
    assert code == 0, err
    assert tree_state(dst) == tree_state(tmp_path / "clean") and not stage.exists()


@pytest.mark.slow
def test_closed_stdout_after_convert_keeps_the_finished_output(llama, tmp_path):
    dst = tmp_path / "out"
    code, stderr = closed("stdout", "convert", llama, dst, "--recipe", "nvfp4", "--device", "cpu")
    assert (code, stderr) == (SIGPIPE_EXIT, "")
    assert (dst / "quantcli_manifest.json").is_file() and not (tmp_path / "out.partial").exists()


@pytest.mark.slow
def test_closed_stderr_under_a_failing_verify_exits_141_not_1(llama, tmp_path, run_cli):
    other = make_llama(tmp_path / "other", hidden=64, layers=1, shards=2, seed=1)
    quant = tmp_path / "q"
    assert run_cli("convert", other, quant, "--recipe", "nvfp4", "-q", "--device", "cpu")[0] == 0
    code, out, err = run_cli("verify", quant, "--reference", llama, "-q")
    assert code == 1 and err.count("\n") > 1, err  # each fault on stderr: something to write into the pipe
    code, stdout = closed("stderr", "verify", quant, "--reference", llama, "-q")
    assert code == SIGPIPE_EXIT
    assert stdout in ("", "FAIL\n") or stdout.startswith("FAIL"), stdout


@pytest.mark.slow
@pytest.mark.parametrize("args", [("verify", "no-such-folder/q"), ("inspect", "no-such-folder/q"),
                                  ("convert", "no-such-folder/q", "out", "--recipe", "nvfp4")])
def test_an_error_line_into_a_closed_stderr_exits_141(tmp_path, monkeypatch, args):
    monkeypatch.chdir(tmp_path)
    assert closed("stderr", *args) == (SIGPIPE_EXIT, "")  # was 1: the error line's own BrokenPipeError
