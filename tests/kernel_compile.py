"""Compile every Triton kernel variant the recipes launch for GPU targets, on a machine without a
GPU, and check each one's PTX (kernels/ptx_rules.py); plus the negative controls that prove the
check. tests/test_kernels_compile.py runs this as a subprocess: the compiler needs the kernels as
JITFunctions, and conftest.py makes them interpreted functions when there is no CUDA device.

    python tests/kernel_compile.py [--json OUT] [--arch 90,100] [--workers N]

Variants come from the recipe registry and the launch code, not from a list: each recipe x its
scale rules x its scale searches (x channel weights or not when searching) x input dtype, the
launches `triton_quant.launches` records for a quantize and a dequantize of a [256, 1024] weight
(multiples of 16, contiguous: how the JIT specializes ordinary weights). Launches that compile
to the same thing (same kernel, specialized signature, constexprs, attributes, options) are
compiled once per target.
"""

from __future__ import annotations

import os
import resource

os.environ.pop("TRITON_INTERPRET", None)  # before triton.jit decorates the kernels, which reads it

import argparse  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ProcessPoolExecutor  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from quantcli.kernels import ptx_rules, triton_quant  # noqa: E402
from quantcli.kernels.spec import SCALE_SEARCHES  # noqa: E402
from quantcli.kernels.triton_launch import EXACT_OPTIONS, Launch, compile_key, compile_launch  # noqa: E402
from quantcli.recipes import RECIPES  # noqa: E402
from quantcli.recipes.base import FLOAT_DTYPES  # noqa: E402

SHAPE = (256, 1024)
ARCHS = (90, 100)  # Hopper (H100/H200), Blackwell (B200); triton 3.9 runs its CUDA 13 ptxas for both


def recipe_variants() -> list[tuple[str, str | None, str, bool, torch.dtype]]:
    """(recipe, scale rule, scale search, channel weights or not, input dtype): everything a
    recipe can be asked to run, from the registry."""
    out = []
    for name, recipe in RECIPES.items():
        for rule in recipe.scale_rules or (None,):
            ruled = recipe.with_scale_rule(rule)
            for search in SCALE_SEARCHES if ruled.searches else ("none",):
                for weighted in (False, True) if search != "none" else (False,):
                    out.extend((name, rule, search, weighted, dtype) for dtype in FLOAT_DTYPES)
    return out


def launches(variant) -> list[Launch]:
    """The launches a quantize and a dequantize of a SHAPE weight make for this variant."""
    name, rule, search, weighted, dtype = variant
    spec = RECIPES[name].with_scale_rule(rule).with_scale_search(search).spec
    w = torch.ones(SHAPE[-1]) if weighted else None
    return triton_quant.launches(torch.zeros(SHAPE, dtype=dtype), spec, channel_weight=w)


def label(variant) -> str:
    name, rule, search, weighted, dtype = variant
    return f"{name} rule={rule} search={search}{'+weights' if weighted else ''} {str(dtype).removeprefix('torch.')}"


def distinct(archs) -> tuple[int, int, list[dict]]:
    """(recipe variants, launches, one job per distinct compiled variant and target with every
    variant that launches it)."""
    jobs: dict[str, dict] = {}
    count = 0
    variants = recipe_variants()
    for number, variant in enumerate(variants):
        for position, launch in enumerate(launches(variant)):
            count += 1
            for arch in archs:
                job = jobs.setdefault(compile_key(launch, arch), {"variant": number, "position": position,
                                                                  "arch": arch, "kernel": launch.name, "labels": []})
                job["labels"].append(label(variant))
    return len(variants), count, list(jobs.values())


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (ptxas runs as a child)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def compile_and_check(launch: Launch, arch: int) -> dict:
    t, cpu = time.perf_counter(), _cpu_seconds()
    try:
        kernel = compile_launch(launch, arch)
        error = None if kernel.asm.get("cubin") else "no cubin"
    except Exception as e:  # a compile error is the test's finding, reported with its text
        kernel, error = None, f"{type(e).__name__}: {e}"[:4000]
    found = [] if kernel is None else ptx_rules.findings(kernel.asm["ptx"])
    return {"ok": error is None, "error": error, "seconds": time.perf_counter() - t, "cpu": _cpu_seconds() - cpu,
            "findings": len(found), "summary": ptx_rules.summary(found)}


def _compile_job(job: dict) -> dict:
    """In a worker process: rebuild the job's launch (a dry run, cheap) and compile it."""
    launch = launches(recipe_variants()[job["variant"]])[job["position"]]
    return {**job, **compile_and_check(launch, job["arch"])}


# ---------------------------------------------------------------- negative controls


@triton.jit
def _plain_division(x_ptr, y_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, tl.load(x_ptr + i) / tl.load(y_ptr + i))


@triton.jit
def _multiply_add(x_ptr, y_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    tl.store(out_ptr + i, x * tl.load(y_ptr + i) + x)


@triton.jit
def _floor(x_ptr, y_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, tl.floor(tl.load(x_ptr + i) * tl.load(y_ptr + i)))


@triton.jit
def _exact_twin(x_ptr, y_ptr, out_ptr, N: tl.constexpr):
    """The three above as the kernels write them: div_rn, and compiled with EXACT_OPTIONS."""
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    y = tl.load(y_ptr + i)
    tl.store(out_ptr + i, tl.math.div_rn(x, y) + tl.floor(x * y) + x * y + x)


# name -> (kernel, compile options): each bad kernel with the options that let it be bad.
CONTROLS = {
    "plain /, exact options": (_plain_division, EXACT_OPTIONS),
    "a*b+c, fusion on (triton 3.9's default)": (_multiply_add, {"enable_fp_fusion": True}),
    "tl.floor, fusion off but libdevice ftz": (_floor, {"enable_fp_fusion": False}),
    "div_rn + floor + a*b+c, exact options": (_exact_twin, EXACT_OPTIONS),
}


def control(name: str, arch: int) -> dict:
    kernel, options = CONTROLS[name]
    args = (torch.ones(64), torch.ones(64), torch.empty(64))
    compiled = compile_launch(Launch(kernel, (1,), args, {"N": 64}, dict(options)), arch)
    return {"control": name, "arch": arch, "findings": [str(f) for f in ptx_rules.findings(compiled.asm["ptx"])]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--arch", default=",".join(map(str, ARCHS)))
    ap.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    args = ap.parse_args()
    archs = [int(a) for a in args.arch.split(",")]
    t = time.perf_counter()
    variants, count, jobs = distinct(archs)
    # spawn, not fork: a fork of a process whose torch thread pool is running can deadlock
    with ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        checks = [pool.submit(control, name, arch) for name in CONTROLS for arch in archs]
        results = list(pool.map(_compile_job, jobs))
    report = {"archs": archs, "variants": variants, "launches": count, "results": results,
              "controls": [c.result() for c in checks], "seconds": time.perf_counter() - t,
              "cpu_seconds": sum(r["cpu"] for r in results), "workers": args.workers}
    for r in results:
        status = "ok" if r["ok"] and not r.get("findings") else "FAIL"
        more = f" (+{len(r['labels']) - 1} more)" if len(r["labels"]) > 1 else ""
        print(f"{status:4} sm_{r['arch']} {r['kernel']:16} {r['seconds']:5.1f}s  {r['labels'][0]}{more}")
        if status == "FAIL":
            print("     " + (r["error"] or r["summary"]).replace("\n", "\n     "))
    print(f"{len(results)} compiles of {count} launches ({variants} recipe variants) "
          f"for sm_{', sm_'.join(map(str, archs))} in {report['seconds']:.1f}s on {args.workers} workers "
          f"({report['cpu_seconds']:.0f} CPU seconds compiling)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    sys.exit(0 if all(r["ok"] and not r.get("findings") for r in results) else 1)


if __name__ == "__main__":
    main()
