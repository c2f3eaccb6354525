"""Every Triton kernel variant the recipes launch compiles for sm_90 and sm_100 (PTX and a cubin,
no GPU needed), and its PTX holds nothing that would make a GPU's bytes differ from the torch
reference (kernels/ptx_rules.py). The negative controls prove the PTX check: a plain `/`, an
a*b+c compiled with FP fusion, and a libdevice floor with flush-to-zero are flagged; the same
arithmetic written as the kernels write it is not.

The compiling happens in one subprocess per session (tests/kernel_compile.py, which says how
the variants are enumerated): on a machine without CUDA this process runs the kernels through
the interpreter, and interpreted kernels cannot be compiled. Compiled kernels land in Triton's
cache (TRITON_CACHE_DIR, default ~/.triton/cache), so a rerun recompiles only what changed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quantcli.kernels import ptx_rules, triton_available
from quantcli.recipes import RECIPES
from quantcli.recipes.base import FLOAT_DTYPES

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
HERE = Path(__file__).resolve().parent
ARCHS = (90, 100)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("compile") / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(HERE / "kernel_compile.py"), "--json", str(out),
                           "--arch", ",".join(map(str, ARCHS))],
                          env=env, cwd=HERE.parent, capture_output=True, text=True, timeout=1800)
    assert out.exists(), f"kernel_compile.py exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    report = json.loads(out.read_text())
    print(proc.stdout.splitlines()[-1])  # the count and the time, shown with pytest -s
    return report


@pytest.mark.slow
def test_every_variant_compiles_for_hopper_and_blackwell(compiled):
    failed = [f"sm_{r['arch']} {r['labels'][0]}: {r['kernel']}: {r['error']}"
              for r in compiled["results"] if not r["ok"]]
    assert not failed, "\n\n".join(failed)
    for arch in ARCHS:
        assert any(r["arch"] == arch for r in compiled["results"])


@pytest.mark.slow
def test_ptx_keeps_the_references_arithmetic(compiled):
    bad = [f"sm_{r['arch']} {r['labels'][0]}: {r['kernel']}:\n{r['summary']}" for r in compiled["results"]
           if r["findings"]]
    assert not bad, "\n\n".join(bad)


@pytest.mark.slow
def test_every_recipe_rule_search_dtype_and_kernel_is_covered(compiled):
    """Stated here from the registry on its own, so a variant kernel_compile.py forgot shows."""
    labels = {label for r in compiled["results"] for label in r["labels"]}
    dtypes = [str(d).removeprefix("torch.") for d in FLOAT_DTYPES]
    for name, recipe in RECIPES.items():
        searches = ("none", "mse", "mse+weights") if recipe.searches else ("none",)
        for rule in recipe.scale_rules or (None,):
            for search in searches:
                for dtype in dtypes:
                    assert f"{name} rule={rule} search={search} {dtype}" in labels
    from quantcli.kernels import triton_quant

    defined = {n for n in vars(triton_quant) if n.startswith("_") and n.endswith("_kernel")}
    assert defined == {r["kernel"] for r in compiled["results"]}


EXPECTED = {  # control -> the reason its PTX is flagged (None: must be clean)
    "plain /, exact options": "not correctly rounded",
    "a*b+c, fusion on (triton 3.9's default)": "fused multiply-add",
    "tl.floor, fusion off but libdevice ftz": "flush-to-zero",
    "div_rn + floor + a*b+c, exact options": None,
}


@pytest.mark.slow
def test_negative_controls_prove_the_check(compiled):
    seen = {(c["control"], c["arch"]): c["findings"] for c in compiled["controls"]}
    assert set(seen) == {(name, arch) for name in EXPECTED for arch in ARCHS}
    for (name, arch), found in seen.items():
        reason = EXPECTED[name]
        if reason is None:
            assert found == [], (name, arch, found)
        else:
            assert found and all(reason in f for f in found), (name, arch, found)


@pytest.mark.parametrize(("instruction", "flagged"), [
    ("fma.rn.f32 %r3, %r1, %r2, %r1;", True),
    ("fma.rn.f32x2 %rd3, %rd1, %rd2, %rd1;", True),
    ("mad.f32 %r3, %r1, %r2, %r1;", True),
    ("mul.f32 %r3, %r1, %r2;", True),
    ("@%p1 add.f32 %r3, %r1, %r2;", True),
    ("div.full.f32 %r3, %r1, %r2;", True),
    ("div.approx.f32 %r3, %r1, %r2;", True),
    ("rcp.approx.ftz.f64 %fd2, %fd1;", True),
    ("ex2.approx.f32 %r2, %r1;", True),
    ("cvt.rmi.ftz.f32.f32 %r2, %r1;", True),
    ("max.ftz.f32 %r3, %r1, %r2;", True),
    ("add.rn.bf16x2 %r3, %r1, %r2;", True),
    ("cvt.rn.satfinite.e4m3x2.f32 %rs1, %r2, %r1;", True),
    ("div.rn.f32 %r3, %r1, %r2;", False),
    ("mul.rn.f32x2 %rd3, %rd1, %rd2;", False),
    ("sub.rn.f32 %r3, %r1, %r2;", False),
    ("mad.wide.s32 %rd4, %r1, 4, %rd1;", False),
    ("mad.lo.s32 %r4, %r1, %r2, %r3;", False),
    ("cvt.rzi.s32.f32 %r2, %r1;", False),
    ("max.f16 %rs3, %rs1, %rs2;", False),
    ("abs.f16x2 %r2, %r1;", False),
    ("setp.lt.f32 %p1, %r1, %r2;", False),
    ("ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];", False),
    (".reg .f32 %r<4>;", False),
])
def test_the_rule_on_single_instructions(instruction, flagged):
    ptx = f"// a comment: fma.rn.f32\n\t{instruction}\n$L__BB0_1:\n"
    found = ptx_rules.findings(ptx)
    assert bool(found) == flagged, found
    if found:
        assert found[0].line == 2


def test_conftest_interprets_only_without_cuda():
    """conftest.py imports torch to ask for CUDA before any kernel is decorated: the kernels are
    interpreted exactly when TRITON_INTERPRET ended up set, and it is set whenever CUDA is absent."""
    from quantcli.kernels import triton_quant

    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    assert interpreted or torch.cuda.is_available()
    assert (type(triton_quant._group_kernel).__name__ == "InterpretedFunction") == interpreted
