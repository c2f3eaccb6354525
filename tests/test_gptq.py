"""GPTQ of one Linear (quantcli/rounding/gptq.py): the same codes as a plain implementation of the
paper's algorithm written here (its own grid rounding: the nearest representable value, found by
argmin over the element's values times the block's decoded scale), a layer-output error below
round to nearest on inputs with correlated channels for every recipe, dead input channels
rounded to nearest and kept, a matrix that is not positive definite falling back to round to
nearest with the reason, and the codec identities the column loop rests on."""

from __future__ import annotations

import pytest
import torch

from quantcli.formats.facts import NO_FACTS, ModuleFacts
from quantcli.kernels.elements import ELEMENTS
from quantcli.kernels.scales import E4M3_GLOBAL_SCALE, E8M0_SCALE, F32_SCALE, WEIGHT_DTYPE_SCALE
from quantcli.recipes import RECIPES, get_recipe
from quantcli.rounding.gptq import GptqSettings, gptq_quantize

ALL = ("nvfp4", "mxfp4", "mxfp8", "fp8", "fp8-channel", "fp8-block", "int8-channel", "int4")
N, K, TOKENS = 96, 256, 1024


def _inputs(seed: int = 0, k: int = K) -> torch.Tensor:
    """Activations with correlated channels (a low-rank part) of uneven energy, as real ones."""
    g = torch.Generator().manual_seed(seed)
    low_rank = torch.randn(TOKENS, 16, generator=g) @ torch.randn(16, k, generator=g)
    x = low_rank + 0.3 * torch.randn(TOKENS, k, generator=g)
    return x * torch.linspace(0.2, 3.0, k)


def _weight(dtype=torch.float32, seed: int = 1, n: int = N, k: int = K) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.02).to(dtype)


def _h(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return x.T @ x


def _element_values(recipe) -> torch.Tensor:
    """Every value the element type represents (independent of the codecs' encoders)."""
    name = recipe.element.name
    if name == "e2m1":
        mags = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    elif name == "e4m3":
        mags = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    else:
        return torch.arange(recipe.element.code_min, recipe.element.code_max + 1, dtype=torch.float32)
    return torch.cat([-mags.flip(0), mags])


def _per_element_scale(recipe, q) -> torch.Tensor:
    """[N, K] multiplier of each element: the dequantized tensor whose every code is 1 would do,
    but that reuses the encoders; instead decode the scales and expand them by the geometry."""
    spec, (n, k) = recipe.spec, q.shape
    s = spec.scale.decode(q.scale, q.global_scale)
    if spec.geometry == "group":
        return s.repeat_interleave(spec.group, -1)
    if spec.geometry == "block":
        return s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    return s.reshape(-1, 1).expand(n, k) if s.dim() else s.expand(n, k)


def _reference(w: torch.Tensor, h: torch.Tensor, recipe, damp: float = 0.01, updated: bool = False,
               act_order: bool = False):
    """The paper's Algorithm 1 (lazy batches of 128), dead channels as quantcli treats them,
    rounding by argmin over the grid. `updated`: group scales from the updated weights (natural
    order only); `act_order`: columns by decreasing H_jj, scales from the original weights."""
    if act_order:
        perm = torch.argsort(torch.diagonal(h), descending=True, stable=True)
        scale = _per_element_scale(recipe, recipe.quantize("w", w))
        q = _reference_loop(w.float()[:, perm], h[perm][:, perm], recipe, damp, False, scale[:, perm])
        out = torch.empty_like(q)
        out[:, perm] = q
        return out
    return _reference_loop(w, h, recipe, damp, updated, _per_element_scale(recipe, recipe.quantize("w", w)))


def _reference_loop(w, h, recipe, damp, updated, scale):
    h = h.clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    h += damp * torch.diagonal(h).mean() * torch.eye(K, dtype=h.dtype)
    inverse = torch.cholesky_solve(torch.eye(K, dtype=h.dtype), torch.linalg.cholesky(h))
    u = torch.linalg.cholesky(inverse, upper=True).float()
    values = _element_values(recipe)
    scale = scale.T.clone()
    wt = w.float().T.contiguous()  # W^T: rows are columns of W (the updates as BLAS calls, as quantcli's)
    q = torch.zeros_like(wt)
    group = recipe.spec.group
    for b0 in range(0, K, 128):
        errs = torch.zeros(128, wt.shape[1])
        for i in range(128):
            c = b0 + i
            if updated and c % group == 0:
                g = recipe.quantize("w", wt[c:c + group].T.contiguous(),
                                    facts=ModuleFacts(group_amax=torch.tensor(float(_weight().abs().max()))))
                scale[c:c + group] = _per_element_scale(recipe, g).T
            grid = values[None, :] * scale[c][:, None]
            q[c] = grid.gather(1, (grid - wt[c][:, None]).abs().argmin(1, keepdim=True))[:, 0]
            errs[i] = (wt[c] - q[c]) / u[c, c]
            wt[c:b0 + 128].addmm_(u[c, c:b0 + 128, None], errs[i][None], alpha=-1)
        wt[b0 + 128:].addmm_(u[b0:b0 + 128, b0 + 128:].T, errs, alpha=-1)
    return q.T


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4", "int4", "fp8-channel", "fp8-block"])
def test_codes_equal_a_plain_implementation_of_the_algorithm(name):
    recipe, w, h = get_recipe(name), _weight(), _h(_inputs())
    out = gptq_quantize("w", w, h, recipe, NO_FACTS, GptqSettings(scales="original", act_order="none"))
    assert out.method == "gptq"
    assert torch.equal(recipe.dequantize(out.q), _reference(w, h, recipe))
    ordered = gptq_quantize("w", w, h, recipe, NO_FACTS, GptqSettings(scales="original", act_order="static"))
    assert torch.equal(recipe.dequantize(ordered.q), _reference(w, h, recipe, act_order=True))


def test_scales_chosen_from_the_updated_weights_equal_the_plain_implementation():
    recipe, w, h = get_recipe("nvfp4"), _weight(), _h(_inputs())
    out = gptq_quantize("w", w, h, recipe, NO_FACTS, GptqSettings(scales="updated", act_order="none"))
    assert torch.equal(recipe.dequantize(out.q), _reference(w, h, recipe, updated=True))
    rtn = recipe.quantize("w", w)
    assert torch.equal(out.q.global_scale, rtn.global_scale)  # the global scale stays the original weights'
    assert not torch.equal(out.q.scale, rtn.scale)  # block scales follow the updated weights


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("settings", [GptqSettings(), GptqSettings(scales="original"),
                                      GptqSettings(act_order="none")], ids=["default", "original", "natural-order"])
def test_layer_output_error_is_below_round_to_nearest(name, settings):
    recipe, w, x = get_recipe(name), _weight(torch.bfloat16), _inputs()
    out = gptq_quantize("w", w, _h(x), recipe, NO_FACTS, settings)
    assert out.method == "gptq", out.reason
    assert out.error < 0.6 * out.nearest_error, (out.error, out.nearest_error)
    # the recorded figures are the errors of the decoded tensors, on these inputs (FP32 products,
    # safeguard_errors: within ~1e-6 of the FP64 ones here, 1.8e-5 at most on MiniLM)
    rtn = recipe.dequantize(recipe.quantize("w", w))
    got = recipe.dequantize(out.q)
    for q, recorded in ((rtn, out.nearest_error), (got, out.error)):
        direct = float(((x @ (w.float() - q).T).double() ** 2).sum() / ((x @ w.float().T).double() ** 2).sum())
        assert direct == pytest.approx(recorded, rel=1e-4)
    assert out.q.codes.dtype == torch.uint8 and out.q.scale.dtype == recipe.quantize("w", w).scale.dtype


def test_dead_input_channels_are_rounded_to_nearest_and_kept():
    recipe = get_recipe("nvfp4")
    x = _inputs()
    dead = torch.tensor([3, 40, 41, 200])
    x[:, dead] = 0
    w = _weight()
    out = gptq_quantize("w", w, _h(x), recipe, NO_FACTS, GptqSettings(scales="original"))
    assert out.method == "gptq"
    rtn = recipe.dequantize(recipe.quantize("w", w))
    got = recipe.dequantize(out.q)
    assert torch.equal(got[:, dead], rtn[:, dead])  # no error fed in or out: the nearest codes
    assert got[:, dead].abs().sum() > 0  # not zeroed


def test_a_matrix_that_is_not_positive_definite_falls_back_to_nearest_with_the_reason():
    recipe, w = get_recipe("int4"), _weight()
    out = gptq_quantize("w", w, -torch.eye(K, dtype=torch.float64), recipe, NO_FACTS, GptqSettings())
    assert out.method == "nearest" and "not positive definite even with dampening 1" in out.reason
    assert torch.equal(out.q.codes, recipe.quantize("w", w).codes)


def test_uncorrelated_inputs_give_round_to_nearest_which_is_kept():
    """H = I: no error can be fed anywhere, GPTQ's codes are round to nearest's, and the tie goes
    to round to nearest (recorded as such)."""
    recipe, w = get_recipe("fp8-channel"), _weight()
    out = gptq_quantize("w", w, torch.eye(K, dtype=torch.float64), recipe, NO_FACTS, GptqSettings())
    assert out.method == "nearest" and "not below" in out.reason
    assert torch.equal(out.q.codes, recipe.quantize("w", w).codes)


def test_a_fused_groups_global_scale_is_kept():
    recipe, w = get_recipe("nvfp4"), _weight()
    facts = ModuleFacts(group_amax=torch.tensor(float(w.abs().max()) * 3))
    out = gptq_quantize("w", w, _h(_inputs()), recipe, facts, GptqSettings())
    assert torch.equal(out.q.global_scale, recipe.quantize("w", w, facts=facts).global_scale)


@pytest.mark.parametrize("element", sorted(ELEMENTS))
def test_nearest_is_the_decoded_encoding(element):
    codec = ELEMENTS[element]
    v = torch.randn(64, 32) * {"e2m1": 4, "e4m3": 300, "int8": 100, "int4": 6}[element]
    assert torch.equal(codec.nearest(v), codec.decode(codec.encode(v)))


@pytest.mark.parametrize("codec", [F32_SCALE, E8M0_SCALE, E4M3_GLOBAL_SCALE, WEIGHT_DTYPE_SCALE],
                         ids=lambda c: c.encoding)
def test_what_encode_divides_by_is_what_decode_multiplies_by(codec):
    """rounding/spans.py rounds with decode(stored) as the divisor: true for every codec."""
    amax = torch.rand(257) * 10.0 ** torch.randint(-6, 6, (257,)).float()
    amax[0] = 0
    element = ELEMENTS["int4" if codec is WEIGHT_DTYPE_SCALE else "e2m1"]
    s2 = torch.tensor(0.0123) if codec.has_global else None
    rule = codec.rules[0] if codec.rules else None
    stored, divisor = codec.encode(amax, element, rule, s2, torch.bfloat16)
    assert torch.equal(divisor, codec.decode(stored, s2))


def test_every_quantizing_recipe_is_covered():
    assert set(ALL) == set(RECIPES)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("order", ["static", "none"])
def test_gptqs_output_error_from_its_loop_equals_the_product(name, order):
    """E = Err U, so tr(E H_d E^T) = ||Err||^2: the loop's errors give GPTQ's ||(W - Q) X||^2
    without an N x K x K product, dead channels and the dampening's ridge taken off."""
    from quantcli.rounding import gptq

    recipe, w, x = get_recipe(name), _weight(), _inputs()
    x[:, 5] = 0  # a dead channel
    h = _h(x)
    settings = GptqSettings(act_order=order)
    factor = gptq.factorize(h, settings)
    q, squared = gptq._rounded(w, factor.hinv, factor.perm, recipe, NO_FACTS, settings, "auto")
    rounded = recipe.dequantize(q)
    from_loop = gptq.loop_output_error(w, rounded, h, squared, factor.ridge)
    _, (product,) = gptq.output_errors(w, [rounded], h)
    assert from_loop == pytest.approx(product, rel=3e-5)  # measured: within 7e-6; the FP32 product 1.6e-6


def test_the_loop_error_gives_way_to_the_product_where_the_difference_would_lose_digits(monkeypatch):
    from quantcli.rounding import gptq

    w, h = _weight(), _h(_inputs())
    rounded = w.float() + 0.01
    assert gptq.loop_output_error(w, rounded, h, 1.0, ridge=1e6) is None  # the ridge's share > 9/10
    calls = []
    real = gptq.relative_output_errors
    monkeypatch.setattr(gptq, "relative_output_errors", lambda *a, **k: calls.append(a[-1] if len(a) > 3 else
                                                                                     torch.float64) or real(*a, **k))
    gptq.safeguard_errors(w, rounded, w.float(), h, loop_error=None)
    assert calls == [torch.float32]  # no loop error: both products in FP32
    calls.clear()
    rtn, error = gptq.safeguard_errors(w, rounded, w.float(), h, loop_error=0.0)
    assert calls == [] and error == 0.0 and rtn > 0  # the loop's error: one product (round to nearest's)


def test_the_safeguard_decides_in_fp64_near_a_tie(monkeypatch):
    import quantcli.rounding.gptq as gptq

    calls = []
    real = gptq.relative_output_errors

    def spy(w, qs, h, dtype=torch.float64):
        calls.append(dtype)
        return real(w, qs, h, dtype)

    monkeypatch.setattr(gptq, "relative_output_errors", spy)
    w, h = _weight(), _h(_inputs())
    q = w.float() + 0.01
    far = gptq.safeguard_errors(w, q, w.float(), h)  # 1 vs 0: FP32 alone decides
    assert calls == [torch.float32] and far[1] == 0.0
    calls.clear()
    near = gptq.safeguard_errors(w, q, q * (1 + 1e-5), h)  # within TIE: decided again in FP64
    assert calls == [torch.float32, torch.float64]
    assert near == tuple(real(w, [q, q * (1 + 1e-5)], h))


@pytest.mark.parametrize("rows, k", [(14, 384), (600, 1536), (64, 2048), (300, 2100)])
def test_gram_by_block_rows_equals_one_product_bit_for_bit(rows, k):
    from quantcli.convert.passes.gptq_pass import gram

    g = torch.Generator().manual_seed(k)
    x = (torch.randn(rows, k, generator=g) * torch.rand(k, generator=g) * 5).double()
    assert torch.equal(gram(x), x.T @ x)
