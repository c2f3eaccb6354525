"""Triton kernels vs the torch reference on the CPU: exact bytes. Without CUDA the kernels run
under TRITON_INTERPRET=1 (conftest.py) on small shapes; with CUDA the same tests run the compiled
kernels on the GPU, still against the CPU reference (tests/test_kernels_compile.py checks the
PTX of every variant for what would make them differ)."""

import pytest
import torch

from quantcli.kernels import QuantResult, dequantize, quantize, tensor_amax, triton_available
from quantcli.kernels.spec import (
    BLOCK,
    E2M1,
    E4M3,
    E4M3_GLOBAL_SCALE,
    E8M0_SCALE,
    F32_SCALE,
    GROUP,
    INT8,
    ROW,
    TENSOR,
    QuantSpec,
)

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


def on_cpu(q: QuantResult) -> QuantResult:
    g = None if q.global_scale is None else q.global_scale.cpu()
    return QuantResult(q.codes.cpu(), q.scale.cpu(), g)


def assert_same(a, b):
    a, b = on_cpu(a), on_cpu(b)
    assert torch.equal(a.codes, b.codes), (a.codes != b.codes).nonzero()[:5]
    assert torch.equal(a.scale, b.scale)
    assert (a.global_scale is None) == (b.global_scale is None)
    if a.global_scale is not None:
        assert torch.equal(a.global_scale.reshape(()), b.global_scale.reshape(()))


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
@pytest.mark.parametrize("shape", [(2, 64), (37, 96), (3, 5, 160), (130, 288)])
def test_kernel_matches_reference(spec, shape):
    x = adversarial(shape, seed=sum(shape))
    ref = quantize(x, spec, backend="torch")
    tri = quantize(x.to(DEVICE), spec, backend="triton")
    assert_same(ref, tri)
    d_ref = dequantize(ref, spec, shape, backend="torch")
    d_tri = dequantize(tri, spec, shape, backend="triton")
    assert torch.equal(d_ref, d_tri.cpu())


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_kernel_non_contiguous_and_fp32(spec):
    x = adversarial((64, 96), seed=5, dtype=torch.float32).t()  # [96, 64], strided
    assert not x.is_contiguous() and not x.to(DEVICE).is_contiguous()
    assert_same(quantize(x, spec, backend="torch"), quantize(x.to(DEVICE), spec, backend="triton"))


def test_kernel_zero_size_and_global_amax():
    spec = NVFP4_SPEC
    x = adversarial((16, 64))
    g = torch.tensor(50.0)
    assert_same(quantize(x, spec, g, backend="torch"), quantize(x.to(DEVICE), spec, g, backend="triton"))
    empty = torch.empty(0, 64, device=DEVICE)
    assert quantize(empty, spec, backend="triton").codes.shape == (0, 32)
    assert torch.equal(tensor_amax(x.to(DEVICE), backend="triton").cpu(), tensor_amax(x, backend="torch"))


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_kernel_rejects_nonfinite(spec):
    from quantcli.kernels import NonFiniteInput

    x = adversarial((8, 64)).float()
    x[3, 7] = float("inf")
    with pytest.raises(NonFiniteInput):
        quantize(x.to(DEVICE), spec, backend="triton")
