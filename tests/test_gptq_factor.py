"""The GPTQ pass factorizes each H once: modules that read one input (q/k/v, gate/up) are handed
the same H object one after the other, and share its Factor (the same bits as factorizing again)."""

from __future__ import annotations

import gc

import torch

from quantcli.convert.passes.gptq_pass import GptqPass
from quantcli.formats.facts import NO_FACTS
from quantcli.recipes import get_recipe
from quantcli.rounding.gptq import GptqSettings, factorize, gptq_quantize


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
