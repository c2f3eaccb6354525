"""Benchmark calibration (`--activations static --kv-cache fp8 --calibration`) on CPU: time,
samples/s and peak RSS, next to the RSS of the whole model loaded in transformers.

    python scripts/bench_calibrate.py                       # ~1.5 GB BF16: hidden 2048, 12 layers
    python scripts/bench_calibrate.py --layers 4 --samples 8 --keep /tmp/bench

Each job runs in its own child process (the synthetic model is made with transformers'
save_pretrained, the conversion is `quantcli convert`, the reference load is
AutoModelForCausalLM.from_pretrained), so each peak RSS is that child's own
(resource.getrusage(RUSAGE_CHILDREN) after it alone has run, in a fresh wrapper process).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

MAKE = """
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
out, hidden, layers, inter, vocab = sys.argv[1], *map(int, sys.argv[2:6])
torch.manual_seed(0)
config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                     num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128,
                     max_position_embeddings=4096, torch_dtype="bfloat16")
LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
"""
# The whole model in memory, every weight touched (from_pretrained alone may leave the
# memory-mapped file's pages unread, which would understate it).
LOAD = """
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
with torch.no_grad():
    print(sum(float(p.abs().amax()) for p in model.parameters()))
"""
# Runs one command as its child and prints that child's peak RSS (ru_maxrss is KiB on Linux).
MEASURE = """
import resource, subprocess, sys, time
t = time.perf_counter()
rc = subprocess.call(sys.argv[1:], stdout=subprocess.DEVNULL)
print(rc, time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
"""


def make_synthetic(src: Path, data: Path, args, layers: int | None = None) -> None:
    """A random Llama (args.hidden, args.intermediate, args.vocab; `layers` or args.layers) at `src`,
    unless one is there, and args.samples random samples of args.seq_len token ids at `data`."""
    if not (src / "config.json").exists():
        subprocess.run([sys.executable, "-c", MAKE, str(src), str(args.hidden), str(layers or args.layers),
                        str(args.intermediate), str(args.vocab)], check=True)
    rng = random.Random(0)
    data.write_text("".join(json.dumps({"input_ids": [rng.randrange(args.vocab) for _ in range(args.seq_len)]})
                            + "\n" for _ in range(args.samples)))


def measured(cmd: list[str]) -> tuple[float, int]:
    """(seconds, peak RSS bytes) of `cmd` run alone in a fresh process."""
    out = subprocess.run([sys.executable, "-c", MEASURE, *cmd], check=True, capture_output=True, text=True).stdout
    rc, secs, rss = out.split()
    if rc != "0":
        raise SystemExit(f"failed ({rc}): {' '.join(cmd)}")
    return float(secs), int(rss)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--intermediate", type=int, default=6656)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--recipe", default="nvfp4")
    ap.add_argument("--keep", help="work folder to keep (default: a temporary one, removed)")
    args = ap.parse_args()
    root = Path(args.keep or tempfile.mkdtemp(prefix="bench_calibrate_"))
    root.mkdir(parents=True, exist_ok=True)
    src, dst, data = root / "src", root / "dst", root / "ids.jsonl"
    try:
        make_synthetic(src, data, args)
        size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
        shutil.rmtree(dst, ignore_errors=True)
        cal_s, cal_rss = measured([sys.executable, "-m", "quantcli", "convert", str(src), str(dst), "--recipe",
                                   args.recipe, "--activations", "static", "--kv-cache", "fp8", "--calibration",
                                   str(data), "--calibration-samples", str(args.samples), "--calibration-seq-len",
                                   str(args.seq_len), "--quiet"])
        shutil.rmtree(dst, ignore_errors=True)
        plain_s, plain_rss = measured([sys.executable, "-m", "quantcli", "convert", str(src), str(dst), "--recipe",
                                       args.recipe, "--quiet"])
        load_s, load_rss = measured([sys.executable, "-c", LOAD, str(src)])
        estimate = json.loads(subprocess.run(
            [sys.executable, "-m", "quantcli", "convert", str(src), str(dst), "--recipe", args.recipe, "--activations",
             "static", "--kv-cache", "fp8", "--calibration", str(data), "--calibration-samples", str(args.samples),
             "--calibration-seq-len", str(args.seq_len), "--dry-run", "--json"],
            check=True, capture_output=True, text=True).stdout)["calibration_estimate"]
        layer_bf16 = 2 * (args.hidden * (2 * args.hidden + 2 * args.hidden // 2) + 3 * args.hidden * args.intermediate)
        bound = 2 * layer_bf16 + estimate["activation_bytes"] + 2**30
        calib = cal_s - plain_s
        print(f"model: Llama hidden {args.hidden}, {args.layers} layers, intermediate {args.intermediate}, vocab "
              f"{args.vocab}: {gib(size)} BF16; data: {args.samples} samples x {args.seq_len} tokens; CPU")
        print("| job | time | samples/s | peak RSS |")
        print("|---|---|---|---|")
        print(f"| `convert --recipe {args.recipe} --activations static --kv-cache fp8 --calibration` "
              f"(calibrate + convert) | {cal_s:.1f} s | {args.samples / cal_s:.2f} | {gib(cal_rss)} |")
        print(f"| calibration alone (the above minus the plain convert) | {calib:.1f} s | "
              f"{args.samples / calib:.2f} | - |")
        print(f"| `convert --recipe {args.recipe}` (weights only) | {plain_s:.1f} s | - | {gib(plain_rss)} |")
        print(f"| whole model in transformers (BF16, every weight read) | {load_s:.1f} s | - | {gib(load_rss)} |")
        print(f"goal: peak RSS < 2 decoder layers ({gib(2 * layer_bf16)} BF16) + activation buffer "
              f"({gib(estimate['activation_bytes'])}) + 1 GiB = {gib(bound)}: "
              f"{'met' if cal_rss < bound else 'NOT met'} ({gib(cal_rss)})")
        print(f"dry-run estimate: peak {gib(estimate['peak_memory_bytes'])}, calibration {estimate['seconds']:.0f} s "
              f"(measured: {gib(cal_rss)}, {calib:.0f} s)")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
