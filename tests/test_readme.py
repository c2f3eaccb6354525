"""The README's shell blocks as scripts/readme_check.py sees them: every ```bash block is marked
run or skip, the two top commands (set-up, tests) run first, and the session script stops at
the first failing command and names the block, and .ci/run runs each command once. The full run (a
fresh clone, set-up, tests, every block) is `python3 scripts/readme_check.py`, a CI step (.ci/run),
not a test: it takes minutes."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def readme_check():
    spec = importlib.util.spec_from_file_location("readme_check", ROOT / "scripts" / "readme_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_bash_block_is_marked_and_the_top_two_run_first(readme_check):
    blocks = readme_check.bash_blocks((ROOT / "README.md").read_text())  # raises on an unmarked block
    run = [b.text.strip() for b in blocks if b.run]
    assert run[:2] == ["bash scripts/setup.sh", ".venv/bin/python -m pytest tests"]
    assert all(b.why for b in blocks if not b.run), "a skipped block says why"
    # .ci/run runs the check, so the README's commands are exercised by CI as written
    assert "scripts/readme_check.py" in (ROOT / ".ci" / "run").read_text()


def test_unmarked_block_and_unclosed_fence_are_refused(readme_check):
    with pytest.raises(ValueError, match=r"README.md:3: a ```bash block without a marker"):
        readme_check.bash_blocks("text\n\n```bash\nls\n```\n")
    with pytest.raises(ValueError, match="never closed"):
        readme_check.bash_blocks("<!-- readme-check: run -->\n```bash\nls\n")
    # other languages are not shell commands: no marker needed
    assert readme_check.bash_blocks("```toml\nrecipe = 'nvfp4'\n```\n```\nplain\n```\n") == []


def test_session_runs_marked_blocks_in_order_and_stops_at_the_first_failure(readme_check, tmp_path):
    readme = ("<!-- readme-check: run -->\n```bash\ncd sub 2>/dev/null || mkdir sub\necho one > log\n```\n"
              "<!-- readme-check: skip (placeholders) -->\n```bash\necho SRC >> log\n```\n"
              "- item\n\n  <!-- readme-check: run -->\n  ```bash\n  echo two >> log\n  false\n"
              "  echo three >> log\n  ```\n")
    blocks = readme_check.bash_blocks(readme)
    assert [(b.line, b.run, b.why) for b in blocks] == [(2, True, ""), (7, False, "placeholders"), (13, True, "")]
    script = tmp_path / "s.sh"
    script.write_text(readme_check.session_script(blocks))
    done = subprocess.run(["bash", str(script)], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 1
    assert (tmp_path / "log").read_text() == "one\ntwo\n"  # indentation removed, skip skipped, stopped at `false`
    assert "FAILED in the block at README.md:13 (exit 1)" in done.stderr
    assert re.search(r"README.md:2 took \d+ s", done.stderr)  # a block that ended says how long it took
    assert "README.md:13 took" not in done.stderr


def test_the_set_up_and_the_rest_are_every_block_once(readme_check):
    """CI runs the README in two parts (so the slow tier can start once the set-up's .venv exists):
    together they are the blocks a whole run runs, in order, the set-up first."""
    blocks = readme_check.bash_blocks((ROOT / "README.md").read_text())
    setup, rest = readme_check.part(blocks, "setup"), readme_check.part(blocks, "rest")
    assert [b.text.strip() for b in setup] == ["bash scripts/setup.sh"]
    assert setup + rest == readme_check.part(blocks, "all") == [b for b in blocks if b.run]


def test_ci_runs_each_command_once():
    """.ci/run once ran the set-up and the whole suite itself and again through the README check:
    now the check (in its fresh clone) is the only place for the README's set-up and test
    command, and the slow tier that command leaves out runs once after it."""
    lines = [line.split("#")[0] for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    said = "\n".join(lines)
    assert re.findall(r"scripts/readme_check.py ([^\n]*)", said) == ['--into "$clone" --setup-only', '--rest "$clone"']
    assert "scripts/setup.sh" not in said
    assert re.findall(r"pytest ([^\"\n]*)", said) == ["tests -q -m slow"]
    assert said.count("scripts/plain_install_check.sh") == 1 and said.count("ruff check") == 1
    # the README's command runs the default tier: pyproject's addopts leave the slow one out
    assert "-m 'not slow'" in (ROOT / "pyproject.toml").read_text()
