"""Kernel throughput: every recipe on BF16 8192x28672, 28672x8192 and 4096x4096.

    python scripts/bench_kernels.py            # CUDA: Triton vs copy bandwidth vs torch reference
    python scripts/bench_kernels.py --cpu      # the torch reference on the CPU (smaller shapes)

On CUDA, for each shape and recipe: the median time (triton.testing.do_bench), GB/s counting bytes
read plus written, the percentage of a device-to-device copy of the same bytes measured in the
same run, and the speedup over the torch reference on the same GPU.
"""

from __future__ import annotations

import argparse
import time

import torch

from quantcli.kernels import quantize
from quantcli.recipes import RECIPES, get_recipe

SHAPES = [(8192, 28672), (28672, 8192), (4096, 4096)]


def out_bytes(recipe, shape) -> int:
    return recipe.storage_bytes(shape)


def bench_cuda() -> None:
    import triton.testing

    print(f"device: {torch.cuda.get_device_name()}")
    print(f"{'shape':>14} {'recipe':<12}{'ms':>8}{'GB/s':>9}{'% copy':>8}{'vs torch':>10}")
    for shape in SHAPES:
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        for name in RECIPES:
            recipe = get_recipe(name)
            moved = x.numel() * 2 + out_bytes(recipe, shape)
            src = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
            dst = torch.empty_like(src)
            copy_ms = triton.testing.do_bench(lambda: dst.copy_(src))  # reads + writes `moved` bytes in all
            tri_ms = triton.testing.do_bench(lambda: quantize(x, recipe.spec, backend="triton"))
            ref_ms = triton.testing.do_bench(lambda: quantize(x, recipe.spec, backend="torch"))
            gbs = moved / tri_ms / 1e6
            print(f"{'x'.join(map(str, shape)):>14} {name:<12}{tri_ms:>8.3f}{gbs:>9.0f}{100 * copy_ms / tri_ms:>7.0f}%"
                  f"{ref_ms / tri_ms:>9.1f}x")


def bench_cpu() -> None:
    print(f"device: CPU, {torch.get_num_threads()} threads (torch reference)")
    print(f"{'shape':>12} {'recipe':<12}{'ms':>9}{'GB/s':>8}")
    for shape in [(2048, 4096), (4096, 2048)]:
        x = torch.randn(shape, dtype=torch.bfloat16)
        for name in RECIPES:
            recipe = get_recipe(name)
            quantize(x, recipe.spec, backend="torch")
            times = []
            for _ in range(3):
                t = time.perf_counter()
                quantize(x, recipe.spec, backend="torch")
                times.append(time.perf_counter() - t)
            ms = sorted(times)[1] * 1e3
            moved = x.numel() * 2 + out_bytes(recipe, shape)
            print(f"{'x'.join(map(str, shape)):>12} {name:<12}{ms:>9.1f}{moved / ms / 1e6:>8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="benchmark the torch reference on the CPU")
    args = ap.parse_args()
    if torch.cuda.is_available() and not args.cpu:
        bench_cuda()
    else:
        bench_cpu()


if __name__ == "__main__":
    main()
