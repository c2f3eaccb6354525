"""Kernel throughput: every recipe (and each searching one with --scale-search mse) on BF16
8192x28672, 28672x8192 and 4096x4096.

    python scripts/bench_kernels.py            # CUDA: Triton vs copy bandwidth vs torch reference
    python scripts/bench_kernels.py --cpu      # CPU: the in-place path vs the torch reference
    python scripts/bench_kernels.py --cpu --chunks 17,18,19,20   # ... per chunk size (kernels/cpu.py)

On CUDA, for each shape and recipe: the median time (triton.testing.do_bench), GB/s counting bytes
read plus written, the percentage of a device-to-device copy of the same bytes measured in the
same run, and the speedup over the torch reference on the same GPU. The first call of each
recipe compiles its kernels (Triton's JIT) and is not timed: do_bench calls once before timing.
"""

from __future__ import annotations

import argparse
import time

import torch

from quantcli.kernels import quantize
from quantcli.recipes import RECIPES, Recipe, get_recipe

SHAPES = [(8192, 28672), (28672, 8192), (4096, 4096)]


def out_bytes(recipe, shape) -> int:
    return recipe.storage_bytes(shape)


def cuda_recipes() -> list[tuple[str, Recipe]]:
    """Every recipe as convert runs it by default, then each searching one with the scale search
    (its Triton kernel runs BM_SEARCH rows per program, triton_quant.py)."""
    plain = [(name, get_recipe(name)) for name in RECIPES]
    return plain + [(f"{name}+mse", r.with_scale_search("mse")) for name, r in plain if r.searches]


def bench_cuda() -> None:
    import triton.testing

    print(f"device: {torch.cuda.get_device_name()}")
    print(f"{'shape':>14} {'recipe':<12}{'ms':>8}{'GB/s':>9}{'% copy':>8}{'vs torch':>10}")
    for shape in SHAPES:
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        for name, recipe in cuda_recipes():
            moved = x.numel() * 2 + out_bytes(recipe, shape)
            src = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
            dst = torch.empty_like(src)
            copy_ms = triton.testing.do_bench(lambda: dst.copy_(src))  # reads + writes `moved` bytes in all
            tri_ms = triton.testing.do_bench(lambda: quantize(x, recipe.spec, backend="triton"))
            ref_ms = triton.testing.do_bench(lambda: quantize(x, recipe.spec, backend="torch"))
            gbs = moved / tri_ms / 1e6
            print(f"{'x'.join(map(str, shape)):>14} {name:<12}{tri_ms:>8.3f}{gbs:>9.0f}{100 * copy_ms / tri_ms:>7.0f}%"
                  f"{ref_ms / tri_ms:>9.1f}x")


def _best_ms(fn, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def bench_cpu(chunks: list[int]) -> None:
    """The in-place CPU path (kernels/cpu.py, what convert runs) against the functional torch
    reference it must match, both on the thread pool convert uses, per chunk size."""
    from quantcli.kernels import cpu, cpu_workers, reference

    threads = torch.get_num_threads()
    print(f"device: CPU, {threads} threads (chunks side by side, as convert runs them)")
    print(f"{'shape':>10} {'recipe':<12}{'chunk':>9}{'reference ms':>14}{'cpu ms':>9}{'GB/s':>7}{'speedup':>9}")
    x = torch.randn(4096, 4096, dtype=torch.bfloat16)
    for name in RECIPES:
        spec = get_recipe(name).spec
        moved = x.numel() * 2 + out_bytes(get_recipe(name), tuple(x.shape))
        with cpu_workers(threads):
            ref_ms = _best_ms(lambda: reference.quantize(x, spec))
            for chunk in chunks:
                cpu.CHUNK = chunk
                ms = _best_ms(lambda: cpu.quantize(x, spec))
                print(f"{'4096x4096':>10} {name:<12}{'2^' + str(chunk.bit_length() - 1):>9}{ref_ms:>14.1f}{ms:>9.1f}"
                      f"{moved / ms / 1e6:>7.2f}{ref_ms / ms:>8.1f}x", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="benchmark the CPU paths (also without a GPU)")
    ap.add_argument("--chunks", default="19", help="CPU: comma-separated log2 chunk sizes, e.g. 17,18,19,20")
    args = ap.parse_args()
    if torch.cuda.is_available() and not args.cpu:
        bench_cuda()
    else:
        bench_cpu([1 << int(c) for c in args.chunks.split(",")])


if __name__ == "__main__":
    main()
