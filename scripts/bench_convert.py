"""Benchmark `quantcli convert` against the floor of plain safetensors read+write of the same files.

    python scripts/bench_convert.py                 # ~2 GB BF16 in 4 shards
    python scripts/bench_convert.py --size-gb 0.5 --recipes nvfp4 fp8-block
    python scripts/bench_convert.py --workers 1,2       # each recipe on 1 and on 2 ranks (--workers N)

Builds a synthetic Llama-shaped checkpoint, then in one run times (each in a fresh process, so
peak memory is measured per job): the floor (safetensors load_file + save_file of every shard)
and `quantcli convert` for each recipe and worker count. Prints GB/s of source bytes, the ratio to
the floor and the peak resident memory (of the largest process, with several workers).

Each job also pays a fixed start-up (Python, torch and the CLI's imports, planning, the side
files), measured here on a 1-layer checkpoint; "steady x floor" divides it out of both sides,
(floor - floor start-up) / (job - job start-up), which is the ratio a checkpoint large enough
for start-up not to matter would see.
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

import torch
from safetensors.torch import save_file

RECIPES = ["fp8", "fp8-channel", "fp8-block", "mxfp8", "mxfp4", "nvfp4"]
FLOOR = """
import sys, glob, os
from safetensors.torch import load_file, save_file
src, dst = sys.argv[1], sys.argv[2]
os.makedirs(dst, exist_ok=True)
for f in sorted(glob.glob(os.path.join(src, "*.safetensors"))):
    save_file(load_file(f), os.path.join(dst, os.path.basename(f)), metadata={"format": "pt"})
"""


def make_checkpoint(root: Path, size_gb: float, shards: int, hidden: int = 4096) -> int:
    """Llama-like layers (q/k/v/o + gate/up/down) until the size is reached."""
    root.mkdir(parents=True, exist_ok=True)
    inter = hidden * 11 // 4
    inter -= inter % 128
    layer = [("self_attn.q_proj", hidden, hidden), ("self_attn.k_proj", hidden // 4, hidden),
             ("self_attn.v_proj", hidden // 4, hidden), ("self_attn.o_proj", hidden, hidden),
             ("mlp.gate_proj", inter, hidden), ("mlp.up_proj", inter, hidden), ("mlp.down_proj", hidden, inter)]
    per_layer = sum(n * k for _, n, k in layer) * 2
    layers = max(shards, round(size_gb * 1e9 / per_layer))
    g = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    per_shard = -(-layers // shards)
    for s in range(shards):
        tensors = {}
        for i in range(s * per_shard, min(layers, (s + 1) * per_shard)):
            for name, n, k in layer:
                w = torch.randn(n, k, generator=g, dtype=torch.float32).mul_(0.02).to(torch.bfloat16)
                tensors[f"model.layers.{i}.{name}.weight"] = w
            tensors[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file(tensors, root / fname, metadata={"format": "pt"})
        total += sum(t.numel() * 2 for t in tensors.values())
        weight_map.update({n: fname for n in tensors})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": hidden,
                                                  "num_hidden_layers": layers}))
    return total


def timed(cmd: list[str], quiet: bool = False) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of one child process (`quiet`: its stdout dropped)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL if quiet else None)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}")
    return seconds, usage.ru_maxrss * 1024


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=2.0,
                    help="about this many GB of BF16, in whole hidden-4096 layers (0.36 GB each), at least one "
                         "per shard: --size-gb 0.3 --shards 2 builds 0.72 GB")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--recipes", nargs="+", default=RECIPES)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--workers", default="1", help="comma-separated worker counts, e.g. 1,2")
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="quantcli-bench-"))
    src = work / "src"
    # Built in a child process: ru_maxrss survives fork+exec, so a big parent would inflate every
    # child's measured peak.
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            "from bench_convert import make_checkpoint;"
            f"from pathlib import Path; make_checkpoint(Path({str(src)!r}), {args.size_gb}, {args.shards})")
    subprocess.run([sys.executable, "-c", code], check=True)
    total = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    print(f"checkpoint: {total / 1e9:.2f} GB (files) BF16 in {args.shards} shards at {src}; torch threads "
          f"{torch.get_num_threads()}; load average {_load()} (rerun above ~2 on 2 cores: shared CPUs skew it)")
    timed([sys.executable, "-c", FLOOR, str(src), str(work / "floor")])  # warm the page cache
    shutil.rmtree(work / "floor")
    floor_s, floor_rss = timed([sys.executable, "-c", FLOOR, str(src), str(work / "floor")])
    shutil.rmtree(work / "floor")
    floor_start = min(timed([sys.executable, "-c", "from safetensors.torch import load_file, save_file"])[0]
                      for _ in range(2))
    worker_counts = [int(w) for w in args.workers.split(",")]
    tiny = work / "tiny"  # one small layer per shard, as many shards as the most workers
    subprocess.run([sys.executable, "-c", code.replace(repr(str(src)), repr(str(tiny)))
                    .replace(f"{args.size_gb}, {args.shards})", f"0.0, {max(worker_counts)}, 256)")], check=True)
    floor_rate = total / floor_s / 1e9
    print(f"start-up: floor {floor_start:.2f} s (imports); each job's below, on a checkpoint of tiny layers")
    print(f"{'job':<14}{'seconds':>9}{'GB/s':>8}{'x floor':>9}{'start-up':>10}{'steady x floor':>16}{'peak RSS':>11}")
    print(f"{'floor':<14}{floor_s:>9.2f}{floor_rate:>8.2f}{1.0:>9.2f}{floor_start:>9.2f}s{1.0:>16.2f}"
          f"{floor_rss / 2**30:>7.2f} GiB")
    for recipe in args.recipes:
        for workers in worker_counts:
            out = work / recipe
            job_cmd = lambda s, o: [sys.executable, "-m", "quantcli", "convert", str(s), str(o),  # noqa: E731
                                    "--recipe", recipe, "--device", args.device, "--quiet", "--overwrite",
                                    "--workers", str(workers)]
            start = min(timed(job_cmd(tiny, work / "tiny-out"), quiet=True)[0] for _ in range(2))
            s, rss = timed(job_cmd(src, out), quiet=True)
            rate = total / s / 1e9
            steady = (floor_s - floor_start) / max(s - start, 1e-9)
            job = recipe if workers == 1 else f"{recipe} x{workers}"
            print(f"{job:<14}{s:>9.2f}{rate:>8.2f}{rate / floor_rate:>9.2f}{start:>9.2f}s{steady:>16.2f}"
                  f"{rss / 2**30:>7.2f} GiB", flush=True)
            shutil.rmtree(out)
    print(f"load average at the end: {_load()}")
    if args.workdir is None:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
