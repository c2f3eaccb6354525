#!/usr/bin/env python3
"""The README runs top to bottom as written: clone the repository afresh, then run every
```bash block of README.md that is marked to run, in order, in one bash session (so
`. .venv/bin/activate` carries over, as in a user's shell), and stop at the first failing command.

Every ```bash block must say what happens to it on the line just above its fence:

    <!-- readme-check: run -->
    <!-- readme-check: skip (why: placeholders, needs a GPU, ...) -->

so a block with placeholders (SRC, DST) is skipped deliberately, and a new unmarked block is an
error here (and in tests/test_readme.py) rather than silently unchecked. Blocks fenced with
another language (or none) are not shell commands and are left alone.

    python3 scripts/readme_check.py                # clone this repository's HEAD and run
    python3 scripts/readme_check.py --list         # print the blocks and what happens to each
    python3 scripts/readme_check.py --from URL --keep
    python3 scripts/readme_check.py --into DIR     # clone into DIR and keep it
    python3 scripts/readme_check.py --into DIR --setup-only && python3 scripts/readme_check.py --rest DIR
                                                   # the same in two parts (.ci/run: work beside the rest)

Standard library only: it runs before any virtual environment exists.
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w-]*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*readme-check:\s*(?P<verdict>run|skip)\b(?P<why>.*?)-->\s*$")


@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the opening fence in README.md
    run: bool
    why: str  # a skipped block's reason
    text: str  # the commands, the fence's indentation removed


def bash_blocks(readme: str) -> list[Block]:
    """The ```bash blocks of `readme` with their markers; an unmarked or unclosed one raises ValueError."""
    lines = readme.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise ValueError(f"README.md:{i + 1}: a ``` fence that is never closed")
        if fence["lang"] in ("bash", "sh", "shell"):
            marker = MARKER.match(lines[i - 1]) if i else None
            if marker is None:
                raise ValueError(f"README.md:{i + 1}: a ```{fence['lang']} block without a marker on the line above; "
                                 "add <!-- readme-check: run --> or <!-- readme-check: skip (why) -->")
            indent = len(fence["indent"])
            text = "\n".join(line[indent:] if line.startswith(fence["indent"]) else line.lstrip()
                             for line in lines[i + 1:end])
            blocks.append(Block(i + 1, marker["verdict"] == "run", marker["why"].strip(" :()"), text))
        i = end + 1
    return blocks


def session_script(blocks: list[Block]) -> str:
    """One bash script that runs the `run` blocks in order, says how long each took (the set-up and
    the tests are blocks too, so CI's log shows their times) and names the README line that failed."""
    parts = ["set -eo pipefail",
             "trap 'rc=$?; echo \"readme-check: FAILED in the block at README.md:$block (exit $rc)\" >&2' ERR"]
    for b in blocks:
        if b.run:
            said = f"readme-check: README.md:{b.line}"
            parts += [f"block={b.line}; started=$SECONDS", f"echo {shlex.quote(said)} >&2", b.text,
                      f"echo \"{said} took $((SECONDS - started)) s\" >&2"]
    return "\n".join(parts) + "\n"


def list_blocks(blocks: list[Block]) -> None:
    for b in blocks:
        head = b.text.splitlines()[0] if b.text else ""
        print(f"README.md:{b.line:<4} {'run ' if b.run else 'skip'}  {head}" + ("" if b.run else f"   ({b.why})"))


# What a part of the check runs: every block marked to run, or that split in two at the first one
# (the README's set-up), so that CI can start work needing the set-up's .venv beside the rest.
PARTS = {"all": "the README ran top to bottom", "setup": "the README's set-up ran",
         "rest": "the rest of the README ran"}


def part(blocks: list[Block], which: str) -> list[Block]:
    """The blocks `which` part runs, in order: `all`, `setup` (the first that runs) or `rest`."""
    runs = [b for b in blocks if b.run]
    return {"all": runs, "setup": runs[:1], "rest": runs[1:]}[which]


def run_part(clone: Path, which: str) -> int:
    """Run `which` part of the clone's README there, in one bash session -> its exit code."""
    blocks = bash_blocks((clone / "README.md").read_text())
    chosen = part(blocks, which)
    commit = subprocess.run(["git", "-C", str(clone), "rev-parse", "--short", "HEAD"], check=True,
                            capture_output=True, text=True).stdout.strip()
    print(f"readme-check: {len(chosen)} blocks of README.md at {commit}, in {clone}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="quantcli-readme-") as work:
        script = Path(work) / "readme.sh"
        script.write_text(session_script(chosen))
        start = time.monotonic()
        code = subprocess.run(["bash", str(script)], cwd=clone).returncode
        took = time.monotonic() - start
    if code == 0:
        skipped = f", {len(blocks) - sum(b.run for b in blocks)} skipped as marked" if which != "setup" else ""
        print(f"readme-check: {PARTS[which]} ({len(chosen)} blocks{skipped}) in {took:.0f} s", file=sys.stderr)
    return code


def check(source: str, keep: bool, into: Path | None = None, which: str = "all") -> int:
    """Clone `source` (into `into`, always kept, or a temporary folder) and run `which` part of
    its README there -> the exit code."""
    if into is not None and into.exists():
        raise ValueError(f"--into {into}: already exists; name a new folder")
    work = None if into is not None else Path(tempfile.mkdtemp(prefix="quantcli-readme-"))
    clone = into or work / "quantcli"
    subprocess.run(["git", "clone", "--quiet", source, str(clone)], check=True)
    code = run_part(clone, which)
    if work is not None and code == 0 and not keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"readme-check: the clone is kept in {clone}", file=sys.stderr)
    return code


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--from", dest="source", default=str(ROOT), metavar="REPO",
                        help="the repository to clone (default: this one; its HEAD commit, not the work tree)")
    parser.add_argument("--list", action="store_true", help="print the bash blocks and whether each runs; run nothing")
    parser.add_argument("--keep", action="store_true", help="keep the temporary clone after a success")
    parser.add_argument("--into", type=Path, metavar="DIR",
                        help="clone into DIR (a new folder) and keep it, so later steps can use its .venv")
    parser.add_argument("--setup-only", action="store_true",
                        help="run only the first block marked to run (the set-up); with --into")
    parser.add_argument("--rest", type=Path, metavar="DIR",
                        help="in DIR, a clone whose set-up ran (--into DIR --setup-only), run every block after it")
    args = parser.parse_args()
    try:
        if args.list:
            list_blocks(bash_blocks((ROOT / "README.md").read_text()))
            return 0
        if args.setup_only and args.into is None:
            raise ValueError("--setup-only needs --into DIR: the clone the rest (--rest DIR) continues in")
        if args.rest is not None:
            if not (args.rest / ".venv").is_dir():
                raise ValueError(f"--rest {args.rest}: no clone whose set-up ran; run --into {args.rest} --setup-only")
            return run_part(args.rest, "rest")
        return check(args.source, args.keep, args.into, "setup" if args.setup_only else "all")
    except ValueError as exc:
        print(f"readme-check: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
