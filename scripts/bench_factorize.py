"""GPTQ's factorization of H (rounding/gptq.py `factorize`: dampening, J H J in loop order, one
Cholesky, L^-1 by halves, the flipped FP32 factor) on one thread, as the solves run it, against
its floor measured in the same run: the Cholesky of the same K x K matrix alone (LAPACK's
potrf, a third of the multiply-adds). H is X^T X of 2K + 512 random FP64 rows (seed 0); each
time is the better of two calls. The digest of the FP32 factor lets two checkouts be compared:

    python scripts/bench_factorize.py [--k 1024 2048 5632]
    PYTHONPATH=OTHER_CHECKOUT python scripts/bench_factorize.py
"""

from __future__ import annotations

import argparse
import hashlib
import time

import torch

import quantcli  # noqa: F401 - MKL's strict mode, as convert runs
from quantcli.rounding.gptq import factorize
from quantcli.rounding.settings import GptqSettings


def best_of_two(fn) -> float:
    times = []
    for _ in range(2):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, nargs="+", default=[1024, 2048, 5632])
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("| K | Cholesky alone | factorize | ratio | FP32 factor (sha256, first 12) |")
    print("|---|---|---|---|---|")
    for k in args.k:
        x = torch.randn(2 * k + 512, k, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        h = x.T @ x
        del x
        damped = h + 0.01 * float(h.diagonal().mean()) * torch.eye(k, dtype=torch.float64)
        floor = best_of_two(lambda m=damped: torch.linalg.cholesky_ex(m))
        del damped
        factor = factorize(h, GptqSettings())
        secs = best_of_two(lambda: factorize(h, GptqSettings()))
        digest = hashlib.sha256(factor.hinv.numpy().tobytes()).hexdigest()[:12]
        print(f"| {k} | {floor:.2f} s | {secs:.2f} s | {secs / floor:.2f} | {digest} |", flush=True)


if __name__ == "__main__":
    main()
