"""Peak memory of `quantcli eval` at two depths, next to a plain forward pass of the same model.

For each depth (4 and 16 decoder layers by default) a random Llama (hidden 1024, BF16) is made
and converted to NVFP4; then, each in a fresh process whose peak RSS is read from the kernel
(getrusage of the child):
- `quantcli eval DST --reference SRC --data DATA --device cpu -q` (both sides, layer by layer);
- a plain forward: transformers loads the reference in FP32 and runs the same samples.
Flat with depth means eval's peak barely moves from 4 to 16 layers while the forward's grows with
the weights. Nothing is downloaded; everything is written under --work (default: a temp folder).

    .venv/bin/python scripts/measure_eval_memory.py [--hidden 1024] [--layers 4 16] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MEASURE = "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); " \
          "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, r.returncode)"
FORWARD = """
import json, sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
with torch.inference_mode():
    for line in open(sys.argv[2]):
        model(input_ids=torch.tensor([json.loads(line)["input_ids"]]), use_cache=False)
"""


def peak_mib(cmd: list[str]) -> tuple[float, float]:
    """(peak RSS in MiB, seconds) of `cmd` run as the only child of a fresh process."""
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", MEASURE, *cmd], capture_output=True, text=True, check=True)
    kib, code = out.stdout.split()[-2:]
    if code != "0":
        raise SystemExit(f"{' '.join(cmd)} failed: {out.stderr[-500:]}")
    return int(kib) / 1024, time.monotonic() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="quantcli-eval-mem-"))
    work.mkdir(parents=True, exist_ok=True)
    data = work / "data.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [(7 * i + 13 * j) % 512 for j in range(64)]}) + "\n"
                            for i in range(args.samples)))
    quantcli = str(Path(sys.executable).with_name("quantcli"))
    from quantcli.testing import make_llama

    print(f"hidden {args.hidden}, {args.samples} samples x 64 tokens, CPU")
    print("layers | checkpoint (BF16) | quantcli eval peak RSS | plain FP32 forward peak RSS")
    for layers in args.layers:
        src, dst = work / f"llama-{layers}", work / f"llama-{layers}-nvfp4"
        if not src.exists():
            make_llama(src, hidden=args.hidden, layers=layers, shards=max(1, layers // 4))
        if not dst.exists():
            subprocess.run([quantcli, "convert", str(src), str(dst), "--recipe", "nvfp4", "-q"], check=True,
                           capture_output=True)
        size = sum(p.stat().st_size for p in src.glob("*.safetensors")) / 2**20
        ev, ev_s = peak_mib([quantcli, "eval", str(dst), "--reference", str(src), "--data", str(data),
                             "--samples", str(args.samples), "--device", "cpu", "-q"])
        fw, fw_s = peak_mib([sys.executable, "-c", FORWARD, str(src), str(data)])
        print(f"{layers:>6} | {size:>13.1f} MiB | {ev:>12.0f} MiB ({ev_s:5.1f} s) | {fw:>12.0f} MiB ({fw_s:5.1f} s)")


if __name__ == "__main__":
    main()
