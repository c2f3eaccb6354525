"""Measure verify's judgement (quantcli/verify/judge.py) on valid producers and on corruptions.

    python scripts/measure_verify.py                  # 256 x 512 tensors, Gaussian and Student-t(3)
    python scripts/measure_verify.py --rows 512 --cols 2048

For each recipe, on BF16 weights: quantcli's own quantization (every MX scale rule, the mse scale
search), compressed-tensors' and ModelOpt's arithmetic (tests/test_faults_verify.py's producers),
a GPTQ (tests/gptq.py) on two kinds of correlated inputs; then corruptions of quantcli's output:
scales transposed and shifted, 16 block scales x2, /2 or random, scales x2 and x1.125, MX
exponents +-1, an inverted global, swapped nibbles, another tensor's codes. Prints, per case, the
three margins judge.py decides by (a value above 1 fails the module):

- error: relative error / (ERROR_FACTOR x the rounding bound ||h||)
- gain: |gain - 1| / the rounding bound on it
- blocks: the largest block score, min(along / (BLOCK_Z x typical), along / (BLOCK_T x across))

and whether the verdict is the expected one. Run on this project's machine (256 x 512, both weight
kinds, every recipe): every valid producer passed with error <= 0.67 (GPTQ on int4; round-to-
nearest 0.28-0.41), gain <= 0.15 (the MX floor rule's clipping) and blocks <= 0.15 (GPTQ; 0 for
every round-to-nearest: a block's gain cannot leave its rounding bound). Every corruption failed
(16 halved NVFP4 block scales at block score 1.32 the closest) but three, which the grid's own
rounding covers: a 128 x 128 tile permutation of fp8-block on 8 tiles of near-equal amax (its
scales decode within 10 % of the right ones: error 0.69-0.70 of the limit) and int4 scales x1.125
(an INT4 half step is 1/8 to 1/2 of a value: gain 0.49-0.71 of its bound). 4 unexpected verdicts,
those.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from gptq import correlated_inputs, gptq  # noqa: E402

from quantcli.kernels.blockstats import block_stats  # noqa: E402
from quantcli.recipes import get_recipe  # noqa: E402
from quantcli.verify import judge as J  # noqa: E402

RECIPES = ["nvfp4", "mxfp4", "mxfp8", "fp8-block", "fp8-channel", "fp8", "int8-channel", "int4"]


def weights(n: int, k: int, kind: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(n, k, generator=g)
    if kind == "t3":
        t = t / torch.sqrt(torch.rand(n, k, generator=g).clamp_min(0.02) * 3)
    return (t * 0.02).to(torch.bfloat16)


def margins(w: torch.Tensor, q, recipe) -> tuple[float, float, float, bool]:
    st = block_stats(w, q.result, recipe.spec)
    v = J.judge(st, recipe, tuple(w.shape))
    typical = math.sqrt(max(J._median(st.ee, st.ss > 0), 0.0))
    score = torch.minimum(st.along / max(J.BLOCK_Z * typical, 1e-30),
                          st.along / (J.BLOCK_T * st.across).clamp_min(1e-30))
    gain = abs(v.gain - 1) / v.gain_allowed if v.gain_allowed > 0 else math.inf
    return v.rel_err / v.error_limit, gain, float(score.max()), not v.reasons


def valid_cases(w: torch.Tensor, recipe, kind: str) -> dict:
    import test_faults_verify as producers

    cases = {"quantcli": recipe.quantize("w", w)}
    for rule in recipe.scale_rules:
        cases[f"quantcli {rule}"] = recipe.with_scale_rule(rule).quantize("w", w)
    if recipe.searches:
        cases["quantcli mse"] = recipe.with_scale_search("mse").quantize("w", w)
    theirs = {"nvfp4": lambda: producers.ct_nvfp4(w), "mxfp4": lambda: producers.ct_mx(w),
              "mxfp8": lambda: producers.ct_mx(w, "MXFP8A16"), "fp8-block": lambda: producers.ct_fp8(w, "block"),
              "fp8-channel": lambda: producers.ct_fp8(w, "channel")}
    if recipe.name in theirs:
        layout = producers.CT
        disk = {f"w.{n}": t for n, t in theirs[recipe.name]().items()}
        cases["compressed-tensors"] = layout.from_disk("w", layout.recipe_for(recipe.name), disk.__getitem__,
                                                       dict.fromkeys(disk, "x"))
    for seed, rank in ((0, None), (1, 8)):
        cases[f"gptq {rank or 'k/8'}"] = gptq(w, correlated_inputs(w.shape[1], seed=seed, rank=rank), recipe)
    return cases


def corruptions(w: torch.Tensor, q, recipe, kind: str) -> dict:
    sc, out = q.scale, {}
    if sc.dim():
        moved = sc.t().contiguous().reshape(sc.shape) if sc.dim() == 2 else sc.flip(0)
        out["scales transposed"] = replace(q, scale=moved)
        out["scales shifted"] = replace(q, scale=sc.roll(1, -1))
    idx = torch.randperm(sc.numel(), generator=torch.Generator().manual_seed(1))[:16]
    if recipe.scale_encoding == "e8m0_bias127":
        for step in (1, -1):
            out[f"exponents {step:+d}"] = replace(q, scale=sc + step)
            s16 = sc.clone().view(-1)
            s16[idx] += step
            out[f"16 exponents {step:+d}"] = replace(q, scale=s16.view(sc.shape))
    elif recipe.scale_encoding == "e4m3fn":
        for factor in (2.0, 0.5):
            s16 = sc.clone().view(-1)
            s16[idx] = (s16[idx].view(torch.float8_e4m3fn).float() * factor).to(torch.float8_e4m3fn).view(torch.uint8)
            out[f"16 block scales x{factor:g}"] = replace(q, scale=s16.view(sc.shape))
        out["global inverted"] = replace(q, global_scale=1 / q.global_scale)
    else:
        out["scales x2"], out["scales x1.125"] = replace(q, scale=sc * 2), replace(q, scale=sc * 1.125)
    if recipe.element.packed:
        out["nibbles swapped"] = replace(q, codes=(q.codes >> 4) | (q.codes << 4))
    out["another tensor's codes"] = replace(q, codes=recipe.quantize("w", weights(*w.shape, kind, seed=5)).codes)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--cols", type=int, default=512)
    ap.add_argument("--recipes", nargs="+", default=RECIPES)
    args = ap.parse_args()
    print(f"{'weights':<7}{'recipe':<14}{'case':<26}{'error':>7}{'gain':>7}{'blocks':>8}  verdict")
    wrong = 0
    for kind in ("gauss", "t3"):
        w = weights(args.rows, args.cols, kind)
        for name in args.recipes:
            recipe = get_recipe(name)
            q = recipe.quantize("w", w)
            for expect, cases in ((True, valid_cases(w, recipe, kind)), (False, corruptions(w, q, recipe, kind))):
                for case, qc in cases.items():
                    e, g, b, passed = margins(w, qc, recipe)
                    wrong += passed != expect
                    verdict = ("pass" if passed else "FAIL") + ("" if passed == expect else "  (unexpected)")
                    print(f"{kind:<7}{name:<14}{case:<26}{e:>7.2f}{g:>7.2f}{b:>8.2f}  {verdict}", flush=True)
    print(f"{wrong} unexpected verdict(s)")


if __name__ == "__main__":
    main()
