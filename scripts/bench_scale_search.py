"""CPU cost of --scale-search mse against absmax: seconds per million parameters of the torch
quantizer (kernels/search.py vs kernels/reference.py) per searched recipe, and the ratio; then
the tensor MSE each gives on Gaussian, Laplace and Student-t (3 d.o.f.) weights.

    python scripts/bench_scale_search.py [--rows 4096] [--cols 4096] [--repeat 5] [--threads N]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

from quantcli.kernels import dequantize, quantize
from quantcli.recipes import RECIPES


def best_times(fns, repeat: int) -> list[float]:
    """Best wall time of each function, the runs interleaved so that a busy spell on a shared
    machine slows both sides of a ratio alike."""
    for fn in fns:
        fn()  # warm-up
    times = [[] for _ in fns]
    for _ in range(repeat):
        for fn, ts in zip(fns, times):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    return [min(ts) for ts in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x = torch.distributions.Laplace(0.0, 0.02).sample((args.rows, args.cols)).to(torch.bfloat16)
    mparams = x.numel() / 1e6
    print(f"{args.rows} x {args.cols} BF16 Laplace weights ({mparams:.1f} M params), torch threads "
          f"{torch.get_num_threads()}, best of {args.repeat}")
    print(f"{'recipe':8} {'absmax s/Mparam':>16} {'mse s/Mparam':>14} {'ratio':>6}")
    for name in ("nvfp4", "mxfp4", "mxfp8"):
        plain = RECIPES[name].spec
        searched = replace(plain, scale_search="mse")
        t0, t1 = best_times([lambda: quantize(x, plain, backend="torch"),
                             lambda: quantize(x, searched, backend="torch")], args.repeat)
        print(f"{name:8} {t0 / mparams:16.4f} {t1 / mparams:14.4f} {t1 / t0:6.2f}")
    print(f"\ntensor MSE drop of mse against absmax ({args.rows} x {args.cols} FP32 weights, scale 0.02)")
    samplers = {"gaussian": torch.distributions.Normal(0.0, 0.02), "laplace": torch.distributions.Laplace(0.0, 0.02),
                "student-t": torch.distributions.StudentT(3.0, 0.0, 0.02)}
    print(f"{'recipe':8} " + " ".join(f"{k:>10}" for k in samplers))
    for name in ("nvfp4", "mxfp4", "mxfp8"):
        plain = RECIPES[name].spec
        drops = []
        for sampler in samplers.values():
            w = sampler.sample((args.rows, args.cols))
            a, m = (tensor_mse(w, spec) for spec in (plain, replace(plain, scale_search="mse")))
            drops.append(f"{100 * (1 - m / a):9.1f}%")
        print(f"{name:8} " + " ".join(drops))


def tensor_mse(w: torch.Tensor, spec) -> float:
    d = dequantize(quantize(w, spec, backend="torch"), spec, tuple(w.shape), backend="torch")
    return float((d - w).double().square().mean())


if __name__ == "__main__":
    main()
