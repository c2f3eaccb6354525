"""Benchmark GPTQ (`convert --rounding gptq --calibration`) against the calibration-only run
(`--activations static`) and a plain conversion of the same synthetic Llama, on this machine:
seconds per decoder layer and peak RSS, at two depths (peak memory must stay flat with depth),
next to the dry run's estimate; then the estimate's projection for Llama-3-8B and -70B shapes.

    python scripts/bench_gptq.py                                # hidden 1024, 4 and 12 layers, CPU
    python scripts/bench_gptq.py --layers 4 16 --samples 16 --seq-len 256
    python scripts/bench_gptq.py --device cuda --hidden 4096 --intermediate 14336   # a GPU machine

Each job runs alone in a child process and reports its own peak RSS (bench_calibrate.measured).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_calibrate import gib, make_synthetic, measured  # noqa: E402

# Llama-3 shapes (hidden, intermediate, layers, attention heads, KV heads) for the projection.
PROJECTED = {"Llama-3-8B": (4096, 14336, 32, 32, 8), "Llama-3-70B": (8192, 28672, 80, 64, 8)}


def convert(src: Path, dst: Path, data: Path, args, *extra: str) -> list[str]:
    return [sys.executable, "-m", "quantcli", "convert", str(src), str(dst), "--recipe", args.recipe, "--device",
            args.device, "--quiet", *extra, *(["--calibration", str(data), "--calibration-samples", str(args.samples),
                                         "--calibration-seq-len", str(args.seq_len)] if extra else [])]


def depth(root: Path, layers: int, args) -> dict:
    src, dst, data = root / f"src-{layers}", root / "dst", root / "ids.jsonl"
    make_synthetic(src, data, args, layers)
    out = {}
    for job, extra in (("plain", ()), ("calibration", ("--activations", "static")),
                       ("gptq", ("--rounding", "gptq"))):
        shutil.rmtree(dst, ignore_errors=True)
        out[job] = measured(convert(src, dst, data, args, *extra))
    dry = subprocess.run(convert(src, dst, data, args, "--rounding", "gptq") + ["--dry-run", "--json"],
                         check=True, capture_output=True, text=True).stdout
    out["estimate"] = json.loads(dry)["calibration_estimate"]
    shutil.rmtree(dst, ignore_errors=True)
    return out


def projection(tokens: int) -> list[str]:
    """The dry run's GPTQ formulas (calibrate/estimate.py _gptq_cost) on full-size shapes."""
    rows = []
    for name, (h, inter, layers, heads, kv) in PROJECTED.items():
        head = h // heads
        modules = [(heads * head, h, "qkv"), (kv * head, h, "qkv"), (kv * head, h, "qkv"), (h, heads * head, "o"),
                   (inter, h, "gu"), (inter, h, "gu"), (h, inter, "down")]
        inputs = {"qkv": h, "o": heads * head, "gu": h, "down": inter}
        sums = sum(8 * k * k for k in inputs.values())
        k_max = max(inputs.values())
        solve = 3 * 8 * k_max * k_max + 3 * 4 * max(n * k for n, k, _ in modules)
        params = sum(n * k for n, k, _ in modules)
        flops = layers * (2 * 2.0 * tokens * params + sum(2.0 * tokens * k * k for k in inputs.values())
                          + sum(2.0 * n * k * k + float(k) ** 3 for n, k, _ in modules))
        columns = layers * sum(k for _, k, _ in modules)
        rows.append(f"| {name} | {gib(sums + solve)} + one layer's FP32 weights ({gib(4 * params)}) | "
                    f"{flops / 1e15:.2f} PFLOP | {columns:,} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--layers", type=int, nargs=2, default=[4, 12])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--recipe", default="nvfp4")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine (H and the solve on the device)")
    ap.add_argument("--keep", help="work folder to keep (default: a temporary one, removed)")
    args = ap.parse_args()
    root = Path(args.keep or tempfile.mkdtemp(prefix="bench_gptq_"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        print(f"model: Llama hidden {args.hidden}, intermediate {args.intermediate}, vocab {args.vocab}, "
              f"recipe {args.recipe}; data: {args.samples} samples x {args.seq_len} tokens; CPU")
        print("| layers | job | time | s/layer over plain | peak RSS | dry-run estimate |")
        print("|---|---|---|---|---|---|")
        for layers in args.layers:
            r = depth(root, layers, args)
            plain_s = r["plain"][0]
            for job in ("plain", "calibration", "gptq"):
                secs, rss = r[job]
                per = "-" if job == "plain" else f"{(secs - plain_s) / layers:.2f}"
                est = (f"peak {gib(r['estimate']['peak_memory_bytes'])}, {r['estimate']['seconds']:.0f} s"
                       if job == "gptq" else "")
                print(f"| {layers} | {job} | {secs:.1f} s | {per} | {gib(rss)} | {est} |")
        tokens = 128 * 2048
        print(f"\nprojection (the dry run's formulas; 128 samples x 2048 tokens = {tokens:,} tokens):")
        print("| model | GPTQ memory on top of the walk | FLOPs (2 forwards, X^T X, solves) | columns rounded |")
        print("|---|---|---|---|")
        for row in projection(tokens):
            print(row)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
