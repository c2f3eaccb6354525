"""Whether `quantcli eval --workers N` pays: the wall time of one process against N splitting the
samples, on the same checkpoint and data in the same run, and how far their reports differ.

A random Llama (hidden 1024, 4 layers, BF16) is made and converted to NVFP4; then
`quantcli eval DST --reference SRC --data DATA --device cpu --json` runs once per worker count
(`--workers 1 2` by default), each in a fresh process. Printed per count: seconds, the ratio to
one process, and the largest relative difference of perplexity, KL mean and the per-layer errors
from the one-process report (the ranks' sums are added in another order, and on a CPU each rank
runs on its share of the cores, so the last bits move). Nothing is downloaded; everything is
written under --work (default: a temp folder).

    .venv/bin/python scripts/measure_eval_workers.py [--workers 1 2] [--samples 32] [--seq-len 256]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_eval(quantcli: str, dst: Path, src: Path, data: Path, workers: int) -> tuple[dict, float]:
    start = time.monotonic()
    out = subprocess.run([quantcli, "eval", str(dst), "--reference", str(src), "--data", str(data), "--device", "cpu",
                          "--json", "--workers", str(workers)], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"eval --workers {workers} failed: {out.stderr[-500:]}")
    return json.loads(out.stdout), time.monotonic() - start


def differences(doc: dict, base: dict) -> float:
    pairs = [(doc["causal"][k], base["causal"][k]) for k in ("perplexity_reference", "perplexity_quantized", "kl_mean")]
    pairs += [(a["hidden_rel_err"], b["hidden_rel_err"]) for a, b in zip(doc["layers"], base["layers"])]
    return max(abs(a - b) / abs(b) for a, b in pairs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="quantcli-eval-workers-"))
    work.mkdir(parents=True, exist_ok=True)
    data = work / "data.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [(7 * i + 13 * j + i * j) % 512 for j in range(args.seq_len)]})
                            + "\n" for i in range(args.samples)))
    quantcli = str(Path(sys.executable).with_name("quantcli"))
    from quantcli.testing import make_llama

    src, dst = work / "llama", work / "llama-nvfp4"
    if not src.exists():
        make_llama(src, hidden=args.hidden, layers=args.layers, shards=2)
    if not dst.exists():
        subprocess.run([quantcli, "convert", str(src), str(dst), "--recipe", "nvfp4", "-q"], check=True,
                       capture_output=True)
    print(f"Llama hidden {args.hidden}, {args.layers} layers, NVFP4; {args.samples} samples x {args.seq_len} tokens; "
          f"CPU")
    base, base_s = None, None
    for n in args.workers:
        doc, seconds = run_eval(quantcli, dst, src, data, n)
        if base is None:
            base, base_s = doc, seconds
        print(f"--workers {n}: {seconds:6.1f} s  x{base_s / seconds:.2f} of the first  "
              f"max rel diff {differences(doc, base):.1e}  top-1 {doc['causal']['top1_agreement']:.5f}")


if __name__ == "__main__":
    main()
