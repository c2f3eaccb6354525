"""Shared helpers for the fault-injection tests (tests/test_faults_*.py).

Every injected fault must end in: the expected exit code, one line on stderr naming the file,
tensor or option (and the fix), no traceback, the source unchanged, the destination and any
unrelated files unchanged, and nothing half-written left behind.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path


def tree_state(root: Path) -> dict[str, str]:
    """rel path -> sha256 of the content (or 'link:TARGET', 'dir'), for every entry under root."""
    root = Path(root)
    if not root.exists() and not root.is_symlink():
        return {}
    if root.is_file():
        return {".": hashlib.sha256(root.read_bytes()).hexdigest()}
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            if p.is_symlink():
                out[rel] = "link:" + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            elif p.is_file():
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                out[rel] = "special"
    return out


def assert_one_line_error(code: int, out: str, err: str, *needles: str, exit_code: int = 2) -> str:
    """The run failed with `exit_code` and one line 'error: ...' holding every needle."""
    assert code == exit_code, f"exit {code}, expected {exit_code}\nstdout: {out}\nstderr: {err}"
    assert "Traceback" not in err and "Traceback" not in out, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert len(errors) == 1, f"expected exactly one 'error:' line, got: {err!r}"
    for needle in needles:
        assert needle in errors[0], f"{needle!r} not in {errors[0]!r}"
    return errors[0]


def assert_nothing_left(dst: Path) -> None:
    """Neither DST nor its staging folder exist."""
    dst = Path(dst)
    assert not dst.exists(), f"{dst} was created"
    assert not dst.with_name(dst.name + ".partial").exists(), f"{dst}.partial was left behind"


HOOKS = Path(__file__).resolve().parent / "hooks"  # sitecustomize.py: the fault injection below


def fault_env(kill_after_shards: int | None = None, shard_delay_s: float | None = None,
              kill_after_layers: int | None = None) -> dict[str, str]:
    """Environment variables for a quantcli process (and the ranks it spawns) into which
    tests/hooks/sitecustomize.py injects a fault: SIGKILL after N shards or N staged layers, or a
    delay after each shard; merge them into the process's environment."""
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(HOOKS), os.environ.get("PYTHONPATH", "")) if p)}
    for key, value in (("SHARDS", kill_after_shards), ("LAYERS", kill_after_layers)):
        if value is not None:
            env[f"QUANTCLI_TEST_KILL_AFTER_{key}"] = str(value)
    if shard_delay_s is not None:
        env["QUANTCLI_TEST_SHARD_DELAY_S"] = str(shard_delay_s)
    return env


def after_each_shard(monkeypatch, action) -> None:
    """In this process: `action(n)` right after the n-th shard is recorded (a test's Ctrl-C)."""
    from quantcli.convert.progress import ProgressFile

    original, count = ProgressFile.record, [0]

    def record(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        count[0] += 1
        action(count[0])
        return out

    monkeypatch.setattr(ProgressFile, "record", record)


def run_subprocess(*args: str, env: dict | None = None, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    """`python -m quantcli ARGS` in a separate process (for signals, resource limits, real exit codes)."""
    full_env = {**os.environ, "TRITON_INTERPRET": "1", "HF_HUB_DISABLE_TELEMETRY": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "quantcli", *map(str, args)], env=full_env, capture_output=True,
                          text=True, timeout=timeout, **kw)
