"""Triton kernels vs the torch reference: exact bytes. On the CPU they run under TRITON_INTERPRET=1
(set in conftest.py) on small shapes; on CUDA the same tests run on the GPU."""

import pytest
import torch

from quantcli.kernels import dequantize, quantize, tensor_amax, triton_available
from quantcli.kernels.spec import (BLOCK, E2M1, E4M3, E4M3_GLOBAL_SCALE, E8M0_SCALE, F32_SCALE, GROUP, INT8, ROW,
                                   TENSOR, QuantSpec)

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

NVFP4_SPEC = QuantSpec(GROUP, E2M1, E4M3_GLOBAL_SCALE, 16)
# Every geometry with the element codecs it is used with (INT8 on all three F32 geometries, as
# the codec is a parameter, not a recipe), and each E8M0 rule.
SPECS = [QuantSpec(g, el, F32_SCALE) for g in (TENSOR, ROW, BLOCK) for el in (E4M3, INT8)] + [
    QuantSpec(GROUP, el, E8M0_SCALE, 32, rule) for el in (E4M3, E2M1) for rule in ("floor", "even", "rceil")
] + [NVFP4_SPEC]
IDS = [f"{s.geometry}-{s.element.name}-{s.scale.encoding}-{s.scale_rule}" for s in SPECS]


def adversarial(shape, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * 2)
    flat = x.view(-1)
    n = flat.numel()
    if n >= 64:
        flat[:32] = 0  # all-zero blocks
        flat[32] = -0.0
        flat[33:40] = torch.tensor([448.0, 464.0, 480.0, 1e6, -5.0, 6.0, 6.5])  # at and past saturation
        flat[40:48] = 1e-30  # scales in the E4M3 subnormal range / E8M0 low clamp
    return x.to(dtype)


def assert_same(a, b):
    assert torch.equal(a.codes, b.codes), (a.codes != b.codes).nonzero()[:5]
    assert torch.equal(a.scale, b.scale)
    assert (a.global_scale is None) == (b.global_scale is None)
    if a.global_scale is not None:
        assert torch.equal(a.global_scale.reshape(()), b.global_scale.reshape(()))


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
@pytest.mark.parametrize("shape", [(2, 64), (37, 96), (3, 5, 160), (130, 288)])
def test_kernel_matches_reference(spec, shape):
    x = adversarial(shape, seed=sum(shape)).to(DEVICE)
    ref = quantize(x, spec, backend="torch")
    tri = quantize(x, spec, backend="triton")
    assert_same(ref, tri)
    d_ref = dequantize(ref, spec, shape, backend="torch")
    d_tri = dequantize(tri, spec, shape, backend="triton")
    assert torch.equal(d_ref, d_tri)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_kernel_non_contiguous_and_fp32(spec):
    x = adversarial((64, 96), seed=5, dtype=torch.float32).to(DEVICE).t()  # [96, 64], strided
    assert not x.is_contiguous()
    assert_same(quantize(x, spec, backend="torch"), quantize(x, spec, backend="triton"))


def test_kernel_zero_size_and_global_amax():
    spec = NVFP4_SPEC
    x = adversarial((16, 64)).to(DEVICE)
    g = torch.tensor(50.0)
    assert_same(quantize(x, spec, g, backend="torch"), quantize(x, spec, g, backend="triton"))
    empty = torch.empty(0, 64, device=DEVICE)
    assert quantize(empty, spec, backend="triton").codes.shape == (0, 32)
    assert torch.equal(tensor_amax(x, backend="triton"), tensor_amax(x, backend="torch"))


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_kernel_rejects_nonfinite(spec):
    from quantcli.kernels import NonFiniteInput

    x = adversarial((8, 64)).float()
    x[3, 7] = float("inf")
    with pytest.raises(NonFiniteInput):
        quantize(x.to(DEVICE), spec, backend="triton")
