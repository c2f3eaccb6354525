"""Peak RSS of `quantcli convert` next to the dry run's estimate (PROCESS_BYTES in
quantcli/cli/commands.py plus the largest tensor's working set).

Makes random Llamas with quantcli.testing.make_llama (--small: hidden 64, 128, 256; 2 shards) and
bigger ones with scripts/make_checkpoint.py (--big: --hidden 2048 --layers 2), then for each recipe runs
`quantcli convert SRC DST --recipe R -q --device cpu` as the only child of a fresh process and
reads its peak RSS from the kernel (getrusage of the child), and `--dry-run --json` for the
estimate. Prints one row per (checkpoint, recipe): measured, estimated, estimate - measured.

    .venv/bin/python scripts/measure_convert_memory.py [--recipes fp8 nvfp4 ...] [--small 64 ...]
        [--big 2048 ...] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

MEASURE = "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); " \
          "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, r.returncode)"
RECIPES = ["fp8", "fp8-channel", "fp8-block", "mxfp8", "mxfp4", "nvfp4", "int8-channel", "int4"]
MIB = 2**20


def peak_mib(cmd: list[str]) -> float:
    """Peak RSS in MiB of `cmd` run as the only child of a fresh process."""
    out = subprocess.run([sys.executable, "-c", MEASURE, *cmd], capture_output=True, text=True, check=True)
    kib, code = out.stdout.split()[-2:]
    if code != "0":
        raise SystemExit(f"{' '.join(cmd)} failed: {out.stderr[-500:]}")
    return int(kib) / 1024


def checkpoints(work: Path, small: list[int], big: list[int]) -> dict[str, Path]:
    """make_llama's (2 shards) for `small` hidden sizes, make_checkpoint.py's for `big` ones."""
    from quantcli.testing import make_llama

    made = {f"llama-{h}": make_llama(work / f"llama-{h}", hidden=h, shards=2) for h in small}
    script = Path(__file__).with_name("make_checkpoint.py")
    for h in big:
        made[f"llama-{h}"] = work / f"llama-{h}"
        subprocess.run([sys.executable, str(script), str(made[f"llama-{h}"]), "--hidden", str(h), "--layers", "2",
                        "--shards", "2"], check=True, capture_output=True)
    return made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", nargs="+", default=RECIPES)
    ap.add_argument("--small", type=int, nargs="*", default=[64, 128, 256], help="make_llama hidden sizes")
    ap.add_argument("--big", type=int, nargs="*", default=[2048], help="make_checkpoint.py hidden sizes")
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="quantcli-convert-mem-"))
    work.mkdir(parents=True, exist_ok=True)
    quantcli = str(Path(sys.executable).with_name("quantcli"))
    print(f"{'checkpoint':<12} {'recipe':<13} {'measured':>9} {'estimate':>9} {'margin':>8}  (MiB)", flush=True)
    for name, src in checkpoints(work, args.small, args.big).items():
        for recipe in args.recipes:
            dst = work / f"{name}-{recipe}"
            shutil.rmtree(dst, ignore_errors=True)
            base = [quantcli, "convert", str(src), str(dst), "--recipe", recipe, "--device", "cpu"]
            doc = json.loads(subprocess.run([*base, "--dry-run", "--json"], capture_output=True, text=True,
                                            check=True).stdout)
            estimate = doc["estimated_peak_memory_bytes"] / MIB
            measured = peak_mib([*base, "-q"])
            print(f"{name:<12} {recipe:<13} {measured:9.1f} {estimate:9.1f} {estimate - measured:+8.1f}", flush=True)
            shutil.rmtree(dst, ignore_errors=True)


if __name__ == "__main__":
    main()
