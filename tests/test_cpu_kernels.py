"""kernels/cpu.py (the in-place CPU quantizer) against kernels/reference.py, byte for byte.

The CPU path is what every CPU convert runs, so each recipe is compared with the reference on
ordinary weights, on values spread over FP32's whole range (zeros of both signs, subnormals,
values that saturate), on every FP32 near each E2M1 rounding boundary, on expert stacks, ragged
128 x 128 edges, strided views, a fused group's global amax, several threads and many chunks.
"""

from __future__ import annotations

import pytest
import torch
from test_fast_codecs import BOUNDARIES, _bits_around

from quantcli.kernels import chunks, cpu
from quantcli.kernels import reference as ref
from quantcli.kernels.spec import NonFiniteInput
from quantcli.recipes import RECIPES, get_recipe

SHAPES = [(64, 256), (3, 40, 160), (130, 384), (1, 32), (2, 129, 256), (256, 96)]


def _same(a, b) -> None:
    assert a.codes.dtype == b.codes.dtype and a.codes.shape == b.codes.shape
    assert torch.equal(a.codes, b.codes)
    assert a.scale.dtype == b.scale.dtype and torch.equal(a.scale, b.scale)
    assert (a.global_scale is None) == (b.global_scale is None)
    if a.global_scale is not None:
        assert torch.equal(a.global_scale, b.global_scale)


def _wide_range(shape, seed: int) -> torch.Tensor:
    """Normal values times 2^e for e over FP32's whole range, with zeros of both signs and some
    all-zero rows, so that blocks hit every scale clamp, subnormals and saturation."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-140, 120, shape, generator=g).float())
    flat = x.view(-1)
    flat[::11] = 0.0
    flat[5::13] = -0.0
    x[..., :1, :] = 0.0
    return x


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cpu_path_matches_the_reference(name, dtype):
    spec = get_recipe(name).spec
    g = torch.Generator().manual_seed(7)
    for shape in SHAPES:
        if shape[-1] % spec.k_multiple:
            continue
        x = (torch.randn(*shape, generator=g) * torch.rand(*shape[:-1], 1, generator=g) * 4).to(dtype)
        _same(ref.quantize(x, spec), cpu.quantize(x, spec))


@pytest.mark.parametrize("name", list(RECIPES))
def test_cpu_path_matches_on_values_over_the_whole_fp32_range(name):
    spec = get_recipe(name).spec
    for seed, shape in enumerate([(128, 256), (2, 128, 128), (200, 160)]):
        if shape[-1] % spec.k_multiple:  # K = 160 is for fp8-block's ragged edge; int4 takes K % 128 == 0 only
            continue
        x = _wide_range(shape, seed)
        _same(ref.quantize(x, spec), cpu.quantize(x, spec))


def test_e2m1_encoder_matches_near_every_rounding_boundary():
    """Every finite FP32 within 64 ulps of each E2M1 grid value and midpoint, binade edge and
    saturation point, through the in-place encoder and packer against the reference's."""
    v = _bits_around(BOUNDARIES, 64)
    v = v[torch.isfinite(v)]
    v = v[: v.numel() // 2 * 2]
    expected = ref.pack_nibbles(ref.encode_e2m1(v.clone()))
    got = torch.empty(v.numel() // 2, dtype=torch.uint8)
    cpu._encode_e2m1(v.abs(), v.clone(), got)
    assert torch.equal(expected, got)


@pytest.mark.parametrize("name", list(RECIPES))
def test_strided_views_and_fused_globals_match(name):
    spec = get_recipe(name).spec
    torch.manual_seed(3)
    x = torch.randn(256, 128).bfloat16().t()  # a transposed view, as a `transpose` tensor plan reads it
    _same(ref.quantize(x, spec), cpu.quantize(x, spec))
    if spec.scale.has_global:
        amax = torch.tensor(9.5)
        _same(ref.quantize(x, spec, amax), cpu.quantize(x, spec, amax))


@pytest.mark.parametrize("name", list(RECIPES))
def test_threads_and_chunking_never_change_a_byte(name, monkeypatch):
    spec = get_recipe(name).spec
    torch.manual_seed(5)
    x = torch.randn(3, 300, 256).bfloat16()
    whole = ref.quantize(x, spec)
    monkeypatch.setattr(cpu, "CHUNK", 1000)  # many bands per matrix, several per 128-row tile band
    with chunks.cpu_workers(2):
        _same(whole, cpu.quantize(x, spec))


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_refused(name, bad):
    x = torch.randn(256, 256)
    x[200, 37] = bad
    with pytest.raises(NonFiniteInput):
        cpu.quantize(x, get_recipe(name).spec)


def test_convert_uses_the_cpu_path_for_cpu_tensors(monkeypatch):
    """The dispatcher sends CPU tensors here (and the search and Triton elsewhere)."""
    calls = []
    monkeypatch.setattr(cpu, "quantize", lambda *a, **k: calls.append(a) or ref.quantize(*a, **k))
    get_recipe("nvfp4").quantize("w", torch.randn(32, 64))
    assert len(calls) == 1



@pytest.mark.parametrize("name", list(RECIPES))
def test_cpu_decode_matches_the_reference_bit_for_bit(name):
    """kernels/decode.py's byte tables, banded on two threads, against reference.dequantize: every
    code byte (E4M3 NaN patterns included) under scales over FP32's whole range."""
    from quantcli.kernels import decode

    spec = get_recipe(name).spec
    for shape in [s for s in SHAPES if s[-1] % spec.k_multiple == 0]:
        q = ref.quantize(_wide_range(shape, 3), spec)
        codes = torch.randint(0, 256, q.codes.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
        for r in (q, ref.QuantResult(codes, q.scale, q.global_scale)):
            want = ref.dequantize(r, spec, shape)
            with chunks.cpu_workers(2):
                decode.CHUNK, saved = 1000, decode.CHUNK  # several bands per matrix
                try:
                    got = cpu.dequantize(r, spec, shape)
                finally:
                    decode.CHUNK = saved
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), shape


@pytest.mark.parametrize("name", ["nvfp4", "fp8-block", "int4"])
def test_workers_quantize_inference_tensors_of_a_caller_in_inference_mode(name):
    """The layer walk runs under torch.inference_mode; the worker threads must too (inference
    mode is per thread: outside it, an in-place update of an inference tensor raises)."""
    from quantcli.kernels import cpu_workers
    from quantcli.kernels import quantize as kquantize
    from quantcli.recipes import get_recipe

    spec = get_recipe(name).spec
    with torch.inference_mode():
        x = torch.randn(2048, 1024, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        with cpu_workers(2):
            got = kquantize(x, spec, backend="torch")
        want = kquantize(x, spec, backend="torch")
    assert torch.equal(got.codes, want.codes) and torch.equal(got.scale, want.scale)
