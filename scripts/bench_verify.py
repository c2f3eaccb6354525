"""Benchmark `quantcli verify` beside `quantcli convert` on the same checkpoint, as a ratio.

    python scripts/bench_verify.py                          # 8 layers, hidden 2048 (580 MiB BF16)
    python scripts/bench_verify.py --recipes nvfp4 fp8-block --runs 3
    python scripts/bench_verify.py --hidden 1024 --layers 4 --exact

Writes a random Llama with scripts/make_checkpoint.py (transformers' initialisation), then for
each recipe, each job a fresh process with a warm page cache: `convert SRC DST --recipe R`,
`verify DST --reference SRC`, `verify DST` (structure, scales, finiteness) and, with --exact,
`verify DST --reference SRC --exact`. Prints wall seconds and each verify's ratio to convert's
time; with --runs N, the median of N runs of each job (a shared machine's load moves single runs
by 30 % and more).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RECIPES = ["nvfp4", "fp8-block", "fp8-channel", "mxfp4"]


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"failed ({done.returncode}): {' '.join(cmd)}\n{done.stderr}")
    return seconds


def median_of(cmd: list[str], runs: int) -> float:
    return statistics.median(timed(cmd) for _ in range(runs))


def quantcli(*args: str) -> list[str]:
    return [sys.executable, "-m", "quantcli", *map(str, args)]


def bench(recipe: str, src: Path, work: Path, args) -> list[tuple[str, float]]:
    dst = work / recipe
    convert = quantcli("convert", src, dst, "--recipe", recipe, "--device", args.device, "--quiet", "--overwrite")
    jobs = [("convert", convert),
            ("verify --reference", quantcli("verify", dst, "--reference", src, "--device", args.device, "-q")),
            ("verify (no reference)", quantcli("verify", dst, "--device", args.device, "-q"))]
    if args.exact:
        jobs.append(("verify --reference --exact",
                     quantcli("verify", dst, "--reference", src, "--exact", "--device", args.device, "-q")))
    timed(convert)  # the output the verify jobs read, and a warm page cache
    return [(name, median_of(cmd, args.runs)) for name, cmd in jobs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--recipes", nargs="+", default=RECIPES)
    ap.add_argument("--runs", type=int, default=1, help="runs per job; the median is printed (default: 1)")
    ap.add_argument("--exact", action="store_true", help="also time verify --reference --exact")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="quantcli-bench-verify-"))
    src = work / "src"
    if not src.is_dir():
        subprocess.run([sys.executable, str(Path(__file__).parent / "make_checkpoint.py"), str(src), "--hidden",
                        str(args.hidden), "--layers", str(args.layers), "--shards", "2"], check=True,
                       stdout=subprocess.DEVNULL)
    size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    print(f"checkpoint: {size / 2**20:.0f} MiB BF16, hidden {args.hidden}, {args.layers} layers, at {src}; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; median of {args.runs} run(s)")
    print(f"{'recipe':<13}{'job':<29}{'seconds':>9}{'x convert':>11}")
    for recipe in args.recipes:
        results = bench(recipe, src, work, args)
        base = results[0][1]
        for name, seconds in results:
            print(f"{recipe:<13}{name:<29}{seconds:>9.2f}{seconds / base:>11.2f}", flush=True)
        shutil.rmtree(work / recipe)
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    if args.workdir is None:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
