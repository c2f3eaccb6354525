"""The GPTQ pass factorizes each H once: modules that read one input (q/k/v, gate/up) are handed
the same H object one after the other, and share its Factor (the same bits as factorizing again);
the factor is H^-1's upper Cholesky factor in loop order, its triangular inverse taken by halves."""

from __future__ import annotations

import gc

import torch

from quantcli.convert.passes.gptq_pass import GptqPass
from quantcli.formats.facts import NO_FACTS
from quantcli.recipes import get_recipe
from quantcli.rounding.gptq import LEAF, GptqSettings, factorize, gptq_quantize, lower_inverse, upper_inverse_factor


def _h(k: int = 128, seed: int = 0) -> torch.Tensor:
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return x.T @ x


def test_one_factor_per_h_and_settings():
    p, h, settings = GptqPass(), _h(), GptqSettings()
    first = p._factor(h, settings)
    assert p._factor(h, settings) is first  # k_proj after q_proj: not factorized again
    assert p._factor(h, GptqSettings(act_order="none")) is not first
    assert p._factor(h.clone(), settings) is not first  # another input: its own


def test_the_factor_goes_with_its_h():
    p = GptqPass()
    h = _h()
    p._factor(h, GptqSettings())
    del h
    gc.collect()
    assert not p._last  # no K x K Hinv kept past the layer's sums (in any solving thread)


def test_a_shared_factor_gives_the_bytes_of_a_fresh_one():
    recipe, h, settings = get_recipe("nvfp4"), _h(), GptqSettings()
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    fresh = gptq_quantize("w", w, h, recipe, NO_FACTS, settings)
    shared = gptq_quantize("w", w, h, recipe, NO_FACTS, settings, factor=factorize(h, settings))
    assert torch.equal(fresh.q.codes, shared.q.codes) and torch.equal(fresh.q.scale, shared.q.scale)


def test_the_triangular_inverse_by_halves_inverts():
    # K past LEAF, odd, so the halves nest unevenly; against a triangular solve against I
    k = 2 * LEAF + 77
    x = torch.randn(3 * k, k, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    low = torch.linalg.cholesky(x.T @ x)
    inverse = lower_inverse(low)
    assert torch.equal(inverse, inverse.tril())
    solved = torch.linalg.solve_triangular(low, torch.eye(k, dtype=torch.float64), upper=False)
    assert float((inverse - solved).abs().max() / solved.abs().max()) < 1e-13
    assert float((inverse @ low - torch.eye(k, dtype=torch.float64)).abs().max()) < 1e-11


def test_the_factor_in_loop_order_is_the_inverse_s_upper_cholesky_factor():
    k = LEAF + 40
    h = _h(k, seed=3)
    order = torch.randperm(k, generator=torch.Generator().manual_seed(4))
    up, d, _ = upper_inverse_factor(h, 0.01, order)
    assert up.dtype == torch.float32 and torch.equal(up, up.triu()) and bool((up.diagonal() > 0).all())
    damped = h[order][:, order]
    damped.diagonal().add_(d * float(torch.diagonal(h).mean()))
    product = up.double().T @ up.double() @ damped
    assert float((product - torch.eye(k, dtype=torch.float64)).abs().max()) < 1e-4  # FP32 U
