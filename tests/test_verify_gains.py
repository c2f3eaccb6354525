"""verify's gain rules on a module large enough that a few wrong blocks barely move its sums
(quantcli/verify/judge.py; docs/formats.md, "How verify judges a rounding").

On llm-compressor's NVFP4 and FP8 arithmetic (tests/test_faults_verify.py's producers), 1024 x 1024
Student-t(3) weights: every decode x1.03 (FP8 scales, the NVFP4 global) must fail; the clean
checkpoints pass. 16 block scales of 288-352 set to 448 (decode x1.27-1.56 on 16 of 65,536 blocks)
must fail by the per-block excess rule (judge.block_excess; the other rules pass them).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from quantcli.kernels.blockstats import block_stats
from quantcli.recipes import get_recipe
from quantcli.verify import judge as J

pytest.importorskip("compressed_tensors")
import test_faults_verify as producers  # noqa: E402  (after the skip: it needs compressed-tensors)

SHAPE = (1024, 1024)


def _weights() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    t = torch.randn(SHAPE, generator=g) / torch.sqrt(torch.rand(SHAPE, generator=g).clamp_min(0.02) * 3)
    return (t * 0.02).to(torch.bfloat16)


@pytest.fixture(scope="module")
def made() -> dict:
    w = _weights()
    out = {"w": w}
    ct = producers.CT
    for recipe, make in (("nvfp4", lambda: producers.ct_nvfp4(w)),
                         ("fp8-channel", lambda: producers.ct_fp8(w, "channel"))):
        disk = {f"w.{n}": t for n, t in make().items()}
        q = ct.from_disk("w", ct.recipe_for(recipe), disk.__getitem__, dict.fromkeys(disk, "x"))
        out[recipe] = q.result if hasattr(q, "result") else q
    return out


def _verdict(made, recipe: str, q) -> J.Verdict:
    r = get_recipe(recipe)
    return J.judge(block_stats(made["w"], q, r.spec), r, SHAPE)


def _excess(made, recipe: str, q) -> float:
    st = block_stats(made["w"], q, get_recipe(recipe).spec)
    return float(st.se.double().sum()) / math.sqrt(st.fh2)


@pytest.mark.parametrize("recipe", ["nvfp4", "fp8-channel"])
def test_clean_large_modules_pass(recipe, made):
    assert not _verdict(made, recipe, made[recipe]).reasons
    assert _excess(made, recipe, made[recipe]) < J.EXCESS_Z  # measured: -4.4 (nvfp4), -5.1 (fp8)


def test_fp8_decode_x103_fails(made):
    q = made["fp8-channel"]
    bad = replace(q, scale=q.scale * 1.03)
    v = _verdict(made, "fp8-channel", bad)
    assert abs(v.gain - 1) < v.gain_allowed  # inside the deterministic gain bound (0.049) ...
    assert any("spread nearest rounding gives" in r for r in v.reasons), v.reasons  # ... caught by the excess (180)


def test_nvfp4_global_x103_fails(made):
    q = made["nvfp4"]
    v = _verdict(made, "nvfp4", replace(q, global_scale=q.global_scale * 1.03))
    assert abs(v.gain - 1) < v.gain_allowed  # 0.027 against 0.19
    assert any("spread nearest rounding gives" in r for r in v.reasons), v.reasons  # excess 45


def _high_scales_to_448(q):
    """16 block scales among those of 288-352 (decoding x1.27-1.56 once set to 448)."""
    codes = q.scale.clone().view(-1)
    values = codes.view(torch.float8_e4m3fn).float()
    near = ((values >= 288) & (values < 448)).nonzero().view(-1)
    picked = near[torch.linspace(0, near.numel() - 1, 16).long()]
    codes[picked] = torch.tensor(448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    return replace(q, scale=codes.view(q.scale.shape))


def test_sixteen_high_nvfp4_scales_set_to_448_fail(made):
    bad = _high_scales_to_448(made["nvfp4"])
    st = block_stats(made["w"], bad, get_recipe("nvfp4").spec)
    assert float(J.block_excess(st, SHAPE).max()) > J.block_z(st.blocks)  # measured 11.6 against 7.2
    v = J.judge(st, get_recipe("nvfp4"), SHAPE)
    assert v.blocks_off and any("blocks decode to a multiple" in r for r in v.reasons), v.reasons
