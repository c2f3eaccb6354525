"""Shell completion (issue 21 item 4): the script `quantcli --install-completion` installs sets
_QUANTCLI_COMPLETE and COMP_WORDS/COMP_CWORD and reads the candidates on stdout. That request
must reach click's completion path, not run a command (which printed `error: missing command`
into the prompt)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def complete(run_cli, monkeypatch, words: str, instruction: str = "complete_bash") -> tuple[int, list[str], str]:
    cword = len(words.split()) - (0 if words.endswith(" ") else 1)
    monkeypatch.setenv("_QUANTCLI_COMPLETE", instruction)
    monkeypatch.setenv("COMP_WORDS", words)
    monkeypatch.setenv("COMP_CWORD", str(cword))
    code, out, err = run_cli()
    return code, out.split(), err


@pytest.mark.parametrize("instruction", ["complete_bash", "bash_complete"])  # typer's script, click's order
def test_a_command_name_completes(run_cli, monkeypatch, instruction):
    code, words, err = complete(run_cli, monkeypatch, "quantcli con", instruction)
    assert (code, words, err) == (0, ["convert"], "")


def test_nothing_typed_lists_every_command(run_cli, monkeypatch):
    code, words, err = complete(run_cli, monkeypatch, "quantcli ")
    assert code == 0 and err == "" and words == ["convert", "inspect", "verify", "recipes", "layouts", "eval", "push"]


def test_options_and_their_values_complete(run_cli, monkeypatch):
    assert complete(run_cli, monkeypatch, "quantcli convert a b --rec")[1] == ["--recipe"]
    assert complete(run_cli, monkeypatch, "quantcli convert a b --recipe nv")[1] == ["nvfp4"]
    assert complete(run_cli, monkeypatch, "quantcli convert a b --layout c")[1] == ["compressed-tensors"]
    assert "--reference" in complete(run_cli, monkeypatch, "quantcli verify q --re")[1]


def test_an_unknown_command_is_no_error_in_the_prompt(run_cli, monkeypatch):
    code, _, err = complete(run_cli, monkeypatch, "quantcli xyz ")
    assert code == 0 and err == ""


def test_completion_in_a_real_process_prints_only_candidates(tmp_path):
    env = {**os.environ, "_QUANTCLI_COMPLETE": "complete_bash", "COMP_WORDS": "quantcli ins", "COMP_CWORD": "1"}
    proc = subprocess.run([sys.executable, "-m", "quantcli"], env=env, capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout.split(), proc.stderr) == (0, ["inspect"], "")
