"""int4 (W4A16): symmetric INT4 weights in groups of 128 with scales in the weight's dtype, byte
for byte compressed-tensors' own arithmetic: its calculate_qparams (scale), quantize (codes),
dequantize (values) and pack_to_int32 (`weight_packed`) are called here directly and compared
with the recipe on random and adversarial weights in BF16, FP16 and FP32; and the three
backends (torch reference, in-place CPU, Triton under TRITON_INTERPRET=1) agree byte for byte."""

import pytest
import torch

from quantcli.errors import RecipeError
from quantcli.kernels import cpu, dequantize, quantize, reference, tensor_amax, triton_available
from quantcli.kernels.scales import round_to_dtype
from quantcli.recipes import get_recipe

if triton_available():  # module globals: the interpreter resolves a kernel's names there
    import triton
    import triton.language as tl

    from quantcli.kernels.triton_codecs import _round_to_src
    from quantcli.kernels.triton_quant import _source_format

CT = pytest.importorskip("compressed_tensors")
RECIPE = get_recipe("int4")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
IDS = ["bf16", "fp16", "fp32"]
NAME = "model.layers.0.mlp.down_proj.weight"
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not triton_available(), reason="no triton"))]


def ct_int4(w: torch.Tensor):
    """compressed-tensors' W4A16 preset on `w` [..., N, K]: (int8 codes, scale, dequantized,
    weight_packed int32), as its observer (amin / amax per group in the weight's dtype) and its
    pack-quantized compressor compute them."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize
    from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = preset_name_to_scheme("W4A16", ["Linear"]).weights
    groups = w.unflatten(-1, (w.shape[-1] // args.group_size, args.group_size))
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    q = ct_quantize(w, scale, None, args, dtype=torch.int8)
    return q, scale, ct_dequantize(q, scale, None, args), pack_to_int32(q, 4)


def adversarial(shape, dtype, seed=0, subnormal=True) -> torch.Tensor:
    """Gaussian weights of varied row scales, and one 128-group each of: all zero (-0.0 too),
    all equal, +-amax at both ends (the -7.5 tie -> -8), exact .5 ties (amax 7.5: scale 1),
    every BF16 value in (0, 1] against amax 1 (quotients next to each tie, where the rounding to
    the weight's dtype decides), tiny values beside a large one, and a near-subnormal group."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.exp(torch.randn(*shape[:-1], 1, generator=g))
    rows = w.reshape(-1, shape[-1])
    rows[0, :128] = 0.0
    rows[0, 64:128] = -0.0
    rows[1, :128] = -0.3
    rows[2, :128] = torch.linspace(-1.0, 1.0, 128)
    rows[3, :128] = torch.arange(-15, 16).repeat(5)[:128] * 0.5
    dense = torch.arange(0x3D80, 0x3F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()  # 1/16..1
    dense = dense * torch.where(torch.arange(dense.numel()) % 3 == 0, -1.0, 1.0)
    n = min(len(rows) - 6, dense.numel() // 127)
    rows[6:6 + n, :128] = torch.cat([dense[:n * 127].reshape(n, 127), torch.ones(n, 1)], 1)
    rows[4, :128] = 1e-3
    rows[4, 7] = 1000.0
    if subnormal:
        rows[5, :128] = torch.linspace(-3e-39, 3e-39, 128)  # BF16 / FP32 subnormal amax
    return w.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("seed", range(2))
def test_codes_scales_and_values_equal_compressed_tensors(dtype, seed):
    w = adversarial((48, 384), dtype, seed)
    codes, scale, values, packed = ct_int4(w)
    q = RECIPE.quantize("w", w)
    assert q.scale.dtype == dtype and torch.equal(q.scale, scale)
    assert torch.equal(RECIPE.element.decode(q.codes).to(torch.int8), codes)
    assert q.codes.view(torch.int32).shape == packed.shape and torch.equal(q.codes.view(torch.int32), packed)
    assert torch.equal(RECIPE.dequantize(q).to(dtype), values)
    assert codes.min() == -8 and codes.max() == 7


@pytest.mark.parametrize("dtype", DTYPES[:2], ids=IDS[:2])
def test_the_quotient_is_rounded_to_the_weight_dtype(dtype):
    """compressed-tensors divides BF16 / FP16 weights in their dtype: a quotient just below a
    .5 tie becomes the tie. The dense BF16 sweep reaches such quotients, where an FP32 division
    would give another code: the recipe follows compressed-tensors there."""
    w = adversarial((48, 384), dtype)
    q = RECIPE.quantize("w", w)
    groups = w.float().unflatten(-1, (3, 128))
    s = q.scale.float().unsqueeze(-1)
    in_fp32 = torch.round(groups / s).clamp(-8, 7).flatten(-2)
    in_dtype = torch.round(round_to_dtype(groups / s, dtype)).clamp(-8, 7).flatten(-2)
    assert (in_fp32 != in_dtype).any()
    assert torch.equal(RECIPE.element.decode(q.codes), in_dtype)


def test_expert_stack_zero_group_and_eps_scale():
    w = adversarial((3, 16, 256), torch.bfloat16)
    codes, scale, values, packed = ct_int4(w)
    q = RECIPE.quantize("experts", w)
    assert q.codes.shape == (3, 16, 128) and q.scale.shape == (3, 16, 2)
    assert torch.equal(q.scale, scale) and torch.equal(q.codes.view(torch.int32), packed)
    assert q.scale[0, 0, 0] == torch.finfo(torch.bfloat16).eps  # the all-zero group
    assert torch.equal(q.codes[0, 0, :64], torch.full((64,), 0x88, dtype=torch.uint8))  # code 0 is nibble 8


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_dtype_extremes_decode_finite(dtype, backend):
    """Each dtype's max and smallest normal, FP32 values near FP32 max: FP32 decodes stay finite
    (the scale cap acts only above ~3.18e38) and near the input; zeros decode to zero."""
    info = torch.finfo(dtype)
    w = torch.zeros(4, 256, dtype=dtype)
    w[0, 0], w[1, 1], w[2, 2], w[3, 3] = info.max, -info.max, info.tiny, -info.tiny
    w[3, 200] = -info.max if dtype == torch.float32 else 1.0
    q = RECIPE.quantize(NAME, w, backend=backend)
    d = RECIPE.dequantize(q, backend=backend)
    assert torch.isfinite(d).all() and torch.isfinite(q.scale.float()).all()
    assert d[0, 0] >= 0.74 * info.max and d[1, 1] <= -0.74 * info.max
    assert torch.equal(d[0, 128:], torch.zeros(128)) and torch.equal(q.scale, RECIPE.quantize(NAME, w).scale)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_size_and_nonfinite(backend):
    for shape in [(0, 128), (8, 0), (0, 0), (2, 0, 128), (0, 8, 128), (2, 8, 0)]:
        w = torch.empty(shape, dtype=torch.bfloat16)
        q = RECIPE.quantize(NAME, w, backend=backend)
        assert tuple(q.codes.shape) == RECIPE.codes_shape(shape) and q.codes.dtype == torch.uint8, shape
        assert tuple(q.scale.shape) == RECIPE.scale_shape(shape) and q.scale.dtype == torch.bfloat16, shape
        assert RECIPE.dequantize(q, backend=backend).shape == shape
    assert float(tensor_amax(torch.empty(0, 128), backend=backend, name=NAME)) == 0.0
    for bad in (float("nan"), float("inf"), float("-inf")):
        w = torch.randn(4, 256)
        w[2, 150] = bad
        with pytest.raises(RecipeError, match=rf"^{NAME}: holds NaN or Inf values; .*--ignore$"):
            RECIPE.quantize(NAME, w, backend=backend)


@pytest.mark.parametrize("k", [64, 192, 200])
def test_k_not_a_multiple_of_128_is_refused(k):
    with pytest.raises(RecipeError, match="not a multiple of 128"):
        RECIPE.quantize("m.weight", torch.randn(8, k, dtype=torch.bfloat16))


def test_scheme_facts():
    assert (RECIPE.element_bits, RECIPE.block, RECIPE.k_multiple, RECIPE.scale_encoding) == (4, (1, 128), 128,
                                                                                         "weight_dtype")
    assert RECIPE.codes_dtype == torch.int32 and RECIPE.codes_shape((16, 256)) == (16, 128)
    assert RECIPE.storage_bytes((16, 256)) == 16 * 128 + 16 * 2 * 2
    fields = RECIPE.manifest_fields()
    assert (fields["element"], fields["packing"], fields["nibble_order"], fields["scale_rule"]) == (
        "int4", "int4x2_offset8", "low_first", "amax/7.5")
    assert not RECIPE.searches and RECIPE.with_scale_search("mse") is RECIPE
    q = RECIPE.quantize("w", adversarial((8, 128), torch.bfloat16))
    assert 0 < RECIPE.saturated_fraction(q) < 1
    assert RECIPE.scale_stats(q)["scale_nonfinite"] == 0
    assert RECIPE.decoded_amax_bound(q) == 7 * float(q.scale.float().max())


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_cpu_path_matches_the_reference(dtype):
    x = adversarial((40, 512), dtype, seed=3)
    ref, fast = reference.quantize(x, RECIPE.spec), cpu.quantize(x, RECIPE.spec)
    assert torch.equal(ref.codes, fast.codes) and torch.equal(ref.scale, fast.scale)
    strided = adversarial((384, 128), dtype, seed=4).t()
    assert torch.equal(reference.quantize(strided, RECIPE.spec).codes, cpu.quantize(strided, RECIPE.spec).codes)


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("shape", [(48, 384), (2, 5, 256)])
def test_triton_matches_the_reference(dtype, shape):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # The Triton interpreter (TRITON_INTERPRET=1) widens BF16 subnormals wrongly on load (3.03e-39
    # arrives as 3.67e-40, for every recipe), so on the CPU the kernel gets none; on a GPU it does.
    x = adversarial(shape, dtype, seed=sum(shape), subnormal=device == "cuda").to(device)
    ref = quantize(x, RECIPE.spec, backend="torch")
    tri = quantize(x, RECIPE.spec, backend="triton")
    assert torch.equal(ref.codes, tri.codes) and torch.equal(ref.scale, tri.scale) and tri.global_scale is None
    assert torch.equal(dequantize(ref, RECIPE.spec, shape, backend="torch"),
                       dequantize(tri, RECIPE.spec, shape, backend="triton"))


def boundary_values(dtype) -> torch.Tensor:
    """FP32 values at, next to and between the rounding boundaries of `dtype` (BF16 or FP16):
    normal-range ties by bits near 2^-126, 2^-14 and 0.5, and FP16's subnormal ties k * 2^-25,
    with their neighbours, both signs."""
    step = 1 << (23 - round(-torch.log2(torch.tensor(torch.finfo(dtype).eps)).item()))
    near = torch.arange(-512, 512) * step
    base = torch.cat([torch.arange(0, 1024) * step, 0x38800000 + near, 0x3F000000 + near])
    offsets = torch.tensor([0, 1, step // 2 - 1, step // 2, step // 2 + 1, step - 1])
    normal = (base.unsqueeze(1) + offsets).reshape(-1).to(torch.int32).view(torch.float32)
    sub = torch.arange(0, 2048, dtype=torch.float32) * 2.0**-25
    sub = torch.cat([sub, torch.nextafter(sub, torch.tensor(1.0)), torch.nextafter(sub, torch.tensor(-1.0))])
    x = torch.cat([normal, sub])
    return torch.cat([x, -x]).contiguous()


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("dtype", DTYPES[:2], ids=IDS[:2])
def test_triton_rounds_to_the_weight_dtype_like_torch(dtype):
    """triton_codecs._round_to_src (the quotient's and the scale's rounding) against torch's
    cast, on every value of boundary_values."""

    @triton.jit
    def kernel(x_ptr, out_ptr, n, MANT: tl.constexpr, TINY: tl.constexpr, MAGIC: tl.constexpr,
               EPS: tl.constexpr, B: tl.constexpr):
        i = tl.program_id(0) * B + tl.arange(0, B)
        tl.store(out_ptr + i, _round_to_src(tl.load(x_ptr + i, mask=i < n), MANT, TINY, MAGIC), mask=i < n)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = boundary_values(dtype).to(device)
    out = torch.empty_like(x)
    kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), **_source_format(dtype), B=1024)
    assert torch.equal(out.view(torch.int32), x.to(dtype).to(torch.float32).view(torch.int32))
