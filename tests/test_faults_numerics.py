"""Fault injection for the numerics: values near FP32 max, FP32-subnormal tensors, zero-size
tensors, NaN/Inf, K not a multiple of the block, and the dense dtypes' extremes.

Every written block must decode to finite values, decoded here from the written bytes in plain
FP32 exactly as the consumers do (code * 2^(byte - 127) for MX; e2m1 * e4m3 scale * global for
NVFP4; e4m3 * scale for FP8), independently of kernels.reference. The Triton kernels (compiled on
the GPU when there is one, else run on the CPU by the interpreter, tests/conftest.py) must write
the same bytes as the torch reference on the CPU.
"""

from __future__ import annotations

import glob

import pytest
import torch
from faults import assert_one_line_error

from quantcli.errors import RecipeError
from quantcli.formats.facts import ModuleFacts
from quantcli.kernels import NonFiniteInput, tensor_amax, triton_available
from quantcli.kernels import reference as ref
from quantcli.kernels.spec import E8M0_MAX_FINITE_BYTE, FP8_BLOCK
from quantcli.recipes import RECIPES, get_recipe

FMAX = torch.finfo(torch.float32).max
NAME = "model.layers.0.mlp.down_proj.weight"
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not triton_available(), reason="no triton"))]
RECIPE_RULES = [(r, rule) for r in RECIPES for rule in (RECIPES[r].scale_rules or (None,))]
RR_IDS = [f"{r}-{rule}" if rule else r for r, rule in RECIPE_RULES]

# ---------------------------------------------------------------- an FP32 decode of written bytes

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
E2M1 = torch.tensor(E2M1 + [-v for v in E2M1], dtype=torch.float32)  # index = the 4-bit code
E8M0 = torch.tensor([2.0 ** (b - 127) for b in range(256)], dtype=torch.float32)  # 255 -> inf


def _e4m3(byte: torch.Tensor) -> torch.Tensor:
    return byte.contiguous().view(torch.float8_e4m3fn).to(torch.float32)


def _fp4(packed: torch.Tensor) -> torch.Tensor:
    nibbles = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*packed.shape[:-1], -1)
    return E2M1[nibbles.long()]


def fp32_decode(recipe, q, nvfp4_left_to_right: bool = False) -> torch.Tensor:
    """What a consumer computes from the bytes on disk, in FP32. NVFP4: e2m1 * (sb * s2) as
    quantcli's dequantize (ModelOpt's order), or left to right (e2m1 * sb) * s2. INT4: offset
    binary nibbles minus 8, times the group's scale (weight dtype, exact in FP32)."""
    shape = q.shape
    if recipe.scale_encoding == "weight_dtype":
        nibbles = torch.stack((q.codes & 0xF, q.codes >> 4), dim=-1).reshape(shape)
        g = (nibbles.to(torch.float32) - 8).reshape(*shape[:-1], shape[-1] // recipe.block[1], recipe.block[1])
        return (g * q.scale.to(torch.float32).unsqueeze(-1)).reshape(shape)
    if recipe.scale_encoding == "f32":
        values = q.codes.view(torch.int8).to(torch.float32) if recipe.codes_dtype == torch.int8 else _e4m3(q.codes)
        scale = q.scale
        if recipe.block == (1, 0):  # one scale per row
            scale = scale.unsqueeze(-1)
        elif recipe.block == (FP8_BLOCK, FP8_BLOCK):
            scale = scale.repeat_interleave(FP8_BLOCK, -2).repeat_interleave(FP8_BLOCK, -1)[..., :shape[-2], :shape[-1]]
        return values * scale
    values = _fp4(q.codes) if recipe.element_bits == 4 else _e4m3(q.codes)
    group = recipe.block[1]
    g = values.reshape(*shape[:-1], shape[-1] // group, group)
    if recipe.scale_encoding == "e8m0_bias127":
        return (g * E8M0[q.scale.long()].unsqueeze(-1)).reshape(shape)
    sb = _e4m3(q.scale).unsqueeze(-1)
    if nvfp4_left_to_right:
        return (g * sb * q.global_scale).reshape(shape)
    return (g * (sb * q.global_scale)).reshape(shape)


def on_device(w: torch.Tensor, backend: str) -> torch.Tensor:
    """`w` where `backend` runs it: compiled Triton kernels take CUDA tensors (the interpreter,
    used without CUDA, takes CPU ones); the torch backend is checked on the CPU."""
    return w.to("cuda") if backend == "triton" and torch.cuda.is_available() else w


def quantize_checked(recipe, w: torch.Tensor, backend: str, **kw):
    """Quantize, decode the bytes in FP32, and check what every case must hold: finite decode,
    equal to the library's own dequantize, and the same bytes from both backends."""
    q = recipe.quantize(NAME, on_device(w, backend), backend=backend, **kw)
    dequantized = recipe.dequantize(q, backend=backend).cpu()
    q = q.to("cpu")
    decoded = fp32_decode(recipe, q)
    assert torch.isfinite(decoded).all(), f"{recipe.name}: non-finite decode at {(~torch.isfinite(decoded)).nonzero()}"
    assert torch.equal(decoded, dequantized), "dequantize != FP32 decode of the bytes"
    assert torch.isfinite(fp32_decode(recipe, q, nvfp4_left_to_right=True)).all()
    if backend == "triton":
        t = recipe.quantize(NAME, w, backend="torch", **kw)
        assert torch.equal(q.codes, t.codes), "codes differ from the torch reference"
        assert torch.equal(q.scale.reshape(-1).view(torch.uint8), t.scale.reshape(-1).view(torch.uint8))
        if t.global_scale is not None:
            assert torch.equal(q.global_scale.reshape(()), t.global_scale.reshape(()))
    return q, decoded


def small(shape=(4, 128), seed=0) -> torch.Tensor:  # K = 128: a whole block of every recipe (int4's groups)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * 0.02


# ---------------------------------------------------------------- values near FP32 max


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("recipe", "rule"), RECIPE_RULES, ids=RR_IDS)
def test_near_fp32_max_saturates_to_finite(recipe, rule, backend):
    """FP32 max, 3.3e38, 3.0e38, 2.6e38 (each past some rule's last finite E8M0 byte), next to
    ordinary values: every recipe saturates (none refuses) and every decode is finite."""
    r = get_recipe(recipe, rule)
    w = small()
    huge = {(0, 3): FMAX, (1, 40): -3.3e38, (2, 17): 3.0e38, (3, 60): -2.6e38, (3, 0): -FMAX}
    for (i, j), v in huge.items():
        w[i, j] = v
    q, decoded = quantize_checked(r, w, backend)
    for (i, j), v in huge.items():
        # saturation keeps the sign and clips at most what the format's largest code allows:
        # MXFP4 6 * 2^125 = 2.55e38 (floor already clips up to 8 -> 6), MXFP8 448 * 2^119 = 2.98e38
        assert decoded[i, j].sign() == torch.tensor(v).sign() and abs(decoded[i, j]) >= 0.74 * abs(v)
    if r.scale_encoding == "e8m0_bias127":
        cap = E8M0_MAX_FINITE_BYTE[r.spec.element.name]
        amax = w.abs().reshape(4, -1, 32).amax(-1)
        assert torch.equal(q.scale, ref.e8m0_byte(amax, r.spec.element.name, rule).clamp_max(cap))
        assert int(q.scale.max()) == cap  # the huge blocks saturate at the cap...
        assert (q.scale[amax < 1] < 127).all()  # ...and the ordinary blocks keep their own byte


@pytest.mark.parametrize("rule", ["floor", "even", "rceil"])
@pytest.mark.parametrize("element", ["e2m1", "e4m3"])
def test_mx_cap_is_the_last_finite_byte(element, rule):
    """The cap is tight (one byte more and the largest code decodes to Inf), and it binds only
    for block amaxes above 2.5e38: below that every rule's byte is its own (ordinary inputs keep
    every byte; tests/test_numerics.py checks the rules themselves)."""
    cap = E8M0_MAX_FINITE_BYTE[element]
    maxv = torch.tensor(6.0 if element == "e2m1" else 448.0)
    assert torch.isfinite(maxv * E8M0[cap]) and torch.isinf(maxv * E8M0[cap + 1])
    edge = torch.tensor(2.5e38).view(torch.int32)
    amax = torch.cat([(edge - torch.arange(100_000, dtype=torch.int32)).view(torch.float32),
                      torch.logspace(-45, 38.39, 5000, dtype=torch.float64).float()])
    assert int(ref.e8m0_byte(amax, element, rule).max()) <= cap
    assert int(ref.e8m0_byte(torch.tensor([FMAX]), element, rule)) >= cap  # where the cap acts


@pytest.mark.parametrize("order", ["e2m1*sb*s2", "e2m1*(sb*s2)", "e2m1*sb/(1/s2)"])
def test_nvfp4_and_fp8_top_decode_is_finite_in_every_op_order(order):
    """No cap is needed at the top for NVFP4 and FP8: amax / 2688 (or / 448) rounded never
    overshoots enough for 6 * 448 * s2 (448 * s) to overflow, whatever the consumer's op order,
    including compressed-tensors' divide by weight_global_scale = 1 / s2. The top 10^5 amaxes."""
    top = (torch.tensor(FMAX).view(torch.int32) - torch.arange(100_000, dtype=torch.int32)).view(torch.float32)
    s2 = top / 2688  # nvfp4_global_scale's division (its clamp acts only at the bottom)
    e2m1, sb = torch.tensor(6.0), torch.tensor(448.0)
    decoded = {"e2m1*sb*s2": e2m1 * sb * s2, "e2m1*(sb*s2)": e2m1 * (sb * s2),
               "e2m1*sb/(1/s2)": e2m1 * sb / (1 / s2)}[order]
    assert torch.isfinite(decoded).all()
    assert torch.isfinite(448 * ref.fp8_scale(top)).all()


# ---------------------------------------------------------------- tiny, signed-zero and mixed inputs


def edge_tensors() -> dict[str, torch.Tensor]:
    sub = torch.finfo(torch.float32).smallest_normal
    w_sub = small() * 1e-40  # every value FP32-subnormal (or zero)
    w_sub[0, 0] = 1e-45  # the smallest subnormal
    lone = torch.zeros(4, 128)
    lone[1, 33] = 1e-45  # one subnormal in an all-zero tensor
    negzero = torch.full((4, 128), -0.0)
    negzero[2, :32] = 0.0
    outlier = small() * 1e-30  # tiny values next to one huge outlier, in one block
    outlier[0, 5] = 3.0e38
    mixed = small((4, 256))
    mixed[:, :128] = 0.0  # all-zero blocks (of every recipe's width, int4's 128 too) next to ordinary ones
    mixed[1, 140] = sub / 2
    return {"subnormal": w_sub, "lone_subnormal": lone, "negative_zero": negzero, "outlier": outlier,
            "zero_blocks": mixed}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("recipe", "rule"), RECIPE_RULES, ids=RR_IDS)
def test_edge_values_decode_finite_and_twins_agree(recipe, rule, backend):
    r = get_recipe(recipe, rule)
    for case, w in edge_tensors().items():
        q, decoded = quantize_checked(r, w, backend)
        if case == "negative_zero":
            assert (decoded == 0).all()
            if r.codes_dtype not in (torch.int8, torch.int32):  # integers have no -0; float codes keep the sign
                assert torch.signbit(decoded[0]).all()
            if r.scale_encoding == "f32":
                assert float(q.scale.reshape(-1)[0]) == 1.0  # the all-zero rule, never a zero scale
        if case in ("subnormal", "lone_subnormal") and r.scale_encoding == "f32":
            assert (q.scale >= torch.finfo(torch.float32).smallest_normal).all()  # never 0: x/0 is NaN
        if case == "subnormal" and r.has_global_scale:
            assert float(q.global_scale) == 2.0**-126 and torch.isfinite(1 / q.global_scale)
        if case == "outlier":
            assert decoded[0, 5] >= 0.74 * 3.0e38


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_dense_dtype_extremes(recipe, dtype, backend):
    """Each source dtype's max and smallest normal magnitude (fp16 65504, bf16 3.39e38)."""
    info = torch.finfo(dtype)
    w = small().to(dtype)
    w[0, 0], w[1, 1], w[2, 2], w[3, 3] = info.max, -info.max, info.tiny, -info.tiny
    _, decoded = quantize_checked(get_recipe(recipe), w, backend)
    assert decoded[0, 0] >= 0.74 * info.max and decoded[1, 1] <= -0.74 * info.max


# ---------------------------------------------------------------- zero-size tensors


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_zero_size_tensors(recipe, backend):
    r = get_recipe(recipe)
    for shape in [(0, 128), (8, 0), (0, 0), (2, 0, 128), (0, 8, 128), (2, 8, 0)]:
        w = on_device(torch.empty(shape, dtype=torch.bfloat16), backend)
        q = r.quantize(NAME, w, backend=backend)
        assert tuple(q.codes.shape) == r.codes_shape(shape) and q.codes.dtype == torch.uint8, shape
        assert tuple(q.scale.shape) == r.scale_shape(shape), shape
        assert (q.global_scale is not None) == r.has_global_scale
        d = r.dequantize(q, backend=backend)
        assert d.shape == shape and d.dtype == torch.float32
        assert torch.isfinite(q.scale.float()).all()
    assert float(tensor_amax(on_device(torch.empty(0, 64), backend), backend=backend, name=NAME)) == 0.0


# ---------------------------------------------------------------- NaN / Inf name the tensor


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_nonfinite_names_the_tensor(recipe, backend):
    r = get_recipe(recipe)
    for bad in (float("nan"), float("inf"), float("-inf")):
        w = small()
        w[2, 50] = bad
        with pytest.raises(RecipeError, match=rf"^{NAME}: holds NaN or Inf values; .*--ignore$"):
            r.quantize(NAME, on_device(w, backend), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_amax_and_fused_global_name_the_tensor(backend):
    """The fused-group pass computes the group amax with kernels.tensor_amax(w, backend=...);
    with name= the error names the tensor; without, it is still a one-line RecipeError."""
    w = small()
    w[0, 1] = float("nan")
    w = on_device(w, backend)
    with pytest.raises(RecipeError, match=rf"^{NAME}: holds NaN or Inf"):
        tensor_amax(w, backend=backend, name=NAME)
    with pytest.raises(NonFiniteInput) as exc:
        tensor_amax(w, backend=backend)
    assert isinstance(exc.value, RecipeError) and "\n" not in str(exc.value)
    # a NaN group amax handed to a member (never from tensor_amax, but the kernel checks it too)
    with pytest.raises(RecipeError, match=rf"^{NAME}: holds NaN or Inf"):
        get_recipe("nvfp4").quantize(NAME, on_device(small(), backend), backend=backend,
                                         facts=ModuleFacts(group_amax=torch.tensor(float("nan"))))


# ---------------------------------------------------------------- K not a multiple of the block


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_k_not_a_multiple_of_the_block(recipe):
    r = get_recipe(recipe)
    shape = (8, 40)  # 40 % 16 and 40 % 32 != 0
    if r.k_multiple == 1:  # per-tensor, per-channel and 128x128 (partial edge blocks) take any K
        r.check(NAME, shape, torch.bfloat16)
        quantize_checked(r, small(shape), "torch")
        return
    with pytest.raises(RecipeError) as exc:
        r.check(NAME, shape, torch.bfloat16)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(f"{NAME}: input dim K=40 is not a multiple of {r.k_multiple}")
    assert "--ignore" in msg
    with pytest.raises(RecipeError, match=f"^{NAME}: input dim K=40"):
        r.quantize(NAME, small(shape), backend="torch")


# ---------------------------------------------------------------- end to end


def test_convert_huge_linear_writes_finite_blocks(tmp_path, run_cli):
    """A Linear with values near FP32 max converts (exit 0) to MXFP4 with the rceil rule, whose
    scale used to overflow, and every written block decodes to finite values."""
    import safetensors.torch as st

    from quantcli.testing import make_llama

    src = make_llama(tmp_path / "src", hidden=64, layers=1, shards=1)
    (shard,) = glob.glob(str(src / "*.safetensors"))
    tensors = st.load_file(shard)
    w = tensors[NAME]
    w[3, 5] = torch.finfo(torch.bfloat16).max
    w[7, 40] = -3.3e38
    st.save_file(tensors, shard, metadata={"format": "pt"})
    dst = tmp_path / "dst"
    code, out, err = run_cli("convert", src, dst, "--recipe", "mxfp4", "--scale-rule", "rceil", "--quiet")
    assert code == 0, err
    written = {}
    for f in glob.glob(str(dst / "*.safetensors")):
        written.update(st.load_file(f))
    module = NAME.removesuffix(".weight")
    packed, scale = written[f"{module}.weight_packed"], written[f"{module}.weight_scale"]
    assert int(scale.max()) == E8M0_MAX_FINITE_BYTE["e2m1"]
    decoded = _fp4(packed).reshape(*scale.shape, 32) * E8M0[scale.long()].unsqueeze(-1)
    assert torch.isfinite(decoded).all()
    assert decoded.reshape(w.shape)[3, 5] >= 0.74 * float(w[3, 5])
    code, out, err = run_cli("verify", dst, "--reference", src)
    assert code == 0 and "Traceback" not in err and "PASS" in out, out + err


@pytest.mark.parametrize(("recipe", "name"), [
    ("mxfp8", NAME),  # the block amax inside the quantizer
    ("fp8", NAME),  # the per-tensor amax
    ("nvfp4", "model.layers.0.self_attn.k_proj.weight"),  # the fused q/k/v group's global amax
])
def test_convert_nonfinite_linear_one_line_naming_it(tmp_path, run_cli, recipe, name):
    """NaN in a Linear, found by each amax path: exit 2, one line naming the tensor and the fix."""
    import safetensors.torch as st

    from quantcli.testing import make_llama

    src = make_llama(tmp_path / "src", hidden=64, layers=1, shards=1)
    (shard,) = glob.glob(str(src / "*.safetensors"))
    tensors = st.load_file(shard)
    tensors[name][2, 9] = float("nan")
    st.save_file(tensors, shard, metadata={"format": "pt"})
    code, out, err = run_cli("convert", src, tmp_path / "dst", "--recipe", recipe, "--quiet")
    assert_one_line_error(code, out, err, name, "NaN or Inf", "--ignore")
