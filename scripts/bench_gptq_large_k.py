"""One GPTQ solve of a very wide projection on this machine: H = X^T X of random rows for
K = 18,432 (DeepSeek-V3's dense `down_proj` input width), its factorization and GPTQ of an
N x K weight, each part timed, with the process's peak RSS beside the budget the dry run
states for it (H's FP64 sum plus side_by_side.solve_bytes).

    .venv/bin/python scripts/bench_gptq_large_k.py [--k 18432] [--n 7168] [--rows 4096] [--recipe nvfp4]

The weight and the rows are random (seed 0): the solve's cost depends on the shapes, not the values.
Torch's own threads build H (as the walk's statistics do for such widths); the factorization and
GPTQ run on one intra-op thread, as the weight pass runs them.
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from quantcli.convert.passes.gptq_pass import gram
from quantcli.convert.passes.side_by_side import solve_bytes
from quantcli.formats.facts import NO_FACTS
from quantcli.recipes import get_recipe
from quantcli.rounding.gptq import GptqSettings, factorize, gptq_quantize


def peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=18432)
    ap.add_argument("--n", type=int, default=7168)
    ap.add_argument("--rows", type=int, default=4096, help="calibration rows in H (one group's product)")
    ap.add_argument("--recipe", default="nvfp4")
    args = ap.parse_args()
    base = peak_gib()  # the interpreter, torch and quantcli before any tensor
    g = torch.Generator().manual_seed(0)
    settings = GptqSettings()
    t = time.perf_counter()
    x = torch.randn(args.rows, args.k, generator=g) * torch.rand(args.k, generator=g)
    h = gram(x.double())
    del x
    stats = time.perf_counter() - t
    print(f"K {args.k}, N {args.n}, {args.rows} rows, {args.recipe}; torch threads {torch.get_num_threads()}")
    print(f"H (X^T X, FP64): {stats:.1f} s, peak RSS {peak_gib():.2f} GiB")
    w = (torch.randn(args.n, args.k, generator=g) * 0.02).to(torch.bfloat16)
    torch.set_num_threads(1)
    t = time.perf_counter()
    factor = factorize(h, settings)
    factorized = time.perf_counter() - t
    print(f"factorization (one thread): {factorized:.1f} s (dampening {factor.dampening:g}), "
          f"peak RSS {peak_gib():.2f} GiB")
    t = time.perf_counter()
    out = gptq_quantize("w", w, h, get_recipe(args.recipe), NO_FACTS, settings, factor=factor)
    solved = time.perf_counter() - t
    print(f"GPTQ (column loop, output errors; one thread): {solved:.1f} s, method {out.method}, "
          f"output error {out.error:.4g} vs nearest {out.nearest_error:.4g}, peak RSS {peak_gib():.2f} GiB")
    budget = 8 * args.k * args.k + solve_bytes((args.n, args.k))
    print(f"the dry run's budget for it (H + one solve): {budget / 2**30:.2f} GiB; peak RSS over the "
          f"{base:.2f} GiB before any tensor: {peak_gib() - base:.2f} GiB")


if __name__ == "__main__":
    main()
