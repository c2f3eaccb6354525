"""The dry run's time estimate for `convert --rounding gptq` against measured runs: for each shape,
`convert ... --dry-run --json` (its `seconds` and GPTQ terms, `rounding_seconds`), then the same
conversion timed as a whole process, with the load average (1 min) before and after each.

    python scripts/check_gptq_estimate.py                      # Llama hidden 512 x 2, 1024 x 2; MiniLM
    python scripts/check_gptq_estimate.py --shapes 1024x4 --samples 16 --seq-len 128 --no-minilm

Shapes are HIDDENxLAYERS of bench_calibrate's random Llama (intermediate 2.75 x hidden, vocab
8000); MiniLM is all-MiniLM-L6-v2 on the 192 lines of scripts/data/calibration_sentences.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_calibrate import make_synthetic  # noqa: E402
from minilm import model_dir  # noqa: E402

SENTENCES = Path(__file__).parent / "data" / "calibration_sentences.txt"


def check(src: Path, data: Path, samples: int, seq_len: int, dst: Path, recipe: str) -> dict:
    argv = [sys.executable, "-m", "quantcli", "convert", str(src), str(dst), "--recipe", recipe, "--device", "cpu",
            "--quiet", "--rounding", "gptq", "--calibration", str(data), "--calibration-samples", str(samples),
            "--calibration-seq-len", str(seq_len), "--overwrite"]
    load0 = os.getloadavg()[0]
    est = json.loads(subprocess.run(argv + ["--dry-run", "--json"], check=True, capture_output=True,
                                    text=True).stdout)["calibration_estimate"]
    t = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t
    shutil.rmtree(dst, ignore_errors=True)
    return {"estimate": est["seconds"], "terms": est.get("rounding_seconds", {}), "measured": wall,
            "load": (load0, os.getloadavg()[0])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="*", default=["512x2", "1024x2"], help="HIDDENxLAYERS random Llamas")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--recipe", default="nvfp4")
    ap.add_argument("--no-minilm", action="store_true")
    ap.add_argument("--model", help="MiniLM folder or zip (default: the installed wheel's)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="check_gptq_estimate_"))
    print("| shape | data | estimate (GPTQ terms) | measured | measured / estimate | load average before, after |")
    print("|---|---|---|---|---|---|")
    try:
        jobs = []
        for shape in args.shapes:
            hidden, layers = map(int, shape.split("x"))
            ns = argparse.Namespace(hidden=hidden, intermediate=int(2.75 * hidden), vocab=8000,
                                    samples=args.samples, seq_len=args.seq_len)
            src, data = root / f"llama-{shape}", root / f"ids-{shape}.jsonl"
            make_synthetic(src, data, ns, layers)
            jobs.append((f"Llama {hidden} x {layers}", src, data, args.samples, args.seq_len,
                         f"{args.samples} x {args.seq_len}"))
        if not args.no_minilm:
            lines = sum(1 for s in SENTENCES.read_text().splitlines() if s.strip())
            jobs.append(("all-MiniLM-L6-v2", model_dir(args.model), SENTENCES, lines, 128, f"{lines} sentences"))
        for name, src, data, samples, seq_len, what in jobs:
            r = check(src, data, samples, seq_len, root / "dst", args.recipe)
            terms = ", ".join(f"{k} {v:.1f}" for k, v in r["terms"].items())
            print(f"| {name} | {what} | {r['estimate']:.1f} s ({terms}) | {r['measured']:.1f} s | "
                  f"{r['measured'] / r['estimate']:.2f} | {r['load'][0]:.1f}, {r['load'][1]:.1f} |", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
