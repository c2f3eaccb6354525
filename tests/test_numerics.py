"""Exhaustive and golden tests of the recipes' numerics (docs/formats.md, "Numerics" and "Worked examples")."""

import math
import struct
from fractions import Fraction

import pytest
import torch

from quantcli.errors import RecipeError
from quantcli.formats.facts import ModuleFacts
from quantcli.kernels import chunks, cpu
from quantcli.kernels import reference as ref
from quantcli.recipes import RECIPES, get_recipe

E2M1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6]


def f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


# ---------------------------------------------------------------- E2M1


def test_all_16_e2m1_codes_decode():
    codes = torch.arange(16, dtype=torch.uint8)
    expect = E2M1 + [-v for v in E2M1]
    assert ref.decode_e2m1(codes).tolist() == expect


def e2m1_oracle(x: float) -> int:
    """Nearest E2M1 magnitude, ties to the even code, saturating; exact rational arithmetic."""
    a = Fraction(abs(x))
    best = min(range(8), key=lambda c: (abs(Fraction(E2M1[c]) - a), c % 2))
    return best | (8 if math.copysign(1, x) < 0 else 0)


def test_e2m1_every_tie_and_saturation():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    # 0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0 (docs/formats.md, "E2M1 rounding: ties to the even code")
    expect_mag = [0, 2, 2, 4, 4, 6, 6]
    vals = torch.tensor(ties + [-t for t in ties] + [6.5, 1e9, -7.0])
    got = ref.encode_e2m1(vals).tolist()
    assert got[:7] == expect_mag
    assert got[7:14] == [m | 8 for m in expect_mag]
    assert got[14:] == [7, 7, 15]


def test_e2m1_matches_oracle_on_dense_grid():
    vals = [i / 64 for i in range(-7 * 64, 7 * 64 + 1)] + [0.2499999, 0.2500001, 4.9999, 5.0001]
    got = ref.encode_e2m1(torch.tensor(vals, dtype=torch.float32)).tolist()
    assert got == [e2m1_oracle(float(torch.tensor(v, dtype=torch.float32))) for v in vals]


def test_sign_of_zero_kept():
    assert ref.encode_e2m1(torch.tensor([-0.1, -0.0, 0.0, 0.1])).tolist() == [8, 8, 0, 0]


def test_nibble_order_low_first():
    codes = torch.tensor([[0x2, 0x7, 0xF, 0x1]], dtype=torch.uint8)  # 1.0, 6.0, -6.0, 0.5
    packed = ref.pack_nibbles(codes)
    assert packed.tolist() == [[0b0111_0010, 0b0001_1111]]  # 0x72, 0x1F
    assert torch.equal(ref.unpack_nibbles(packed), codes)


# ---------------------------------------------------------------- E4M3


@pytest.mark.parametrize("x, byte", [
    (448.0, 0x7E), (464.0, 0x7E), (480.0, 0x7E), (1e30, 0x7E), (-448.0, 0xFE), (-1e30, 0xFE),
    (1.0, 0x38), (0.125, 0x20), (64.0, 0x68), (2.0**-6, 0x08), (2.0**-9, 0x01), (2.0**-10, 0x00),
    (3 * 2.0**-10, 0x02), (-0.0, 0x80), (0.0, 0x00), (-(2.0**-11), 0x80), (7 * 2.0**-10, 0x04),
])
def test_e4m3_edges(x, byte):
    assert ref.encode_e4m3(torch.tensor([x])).item() == byte


# ---------------------------------------------------------------- E8M0


def e8m0_oracle(amax: float, element: str, rule: str) -> int:
    if amax == 0:
        return 0
    emax = {"e2m1": 2, "e4m3": 8}[element]
    maxv = {"e2m1": 6.0, "e4m3": 448.0}[element]
    if rule == "floor":
        e = math.floor(math.log2(amax)) - emax
    elif rule == "even":
        m, ex = math.frexp(amax)  # amax = m * 2^ex, m in [0.5, 1)
        e = ex - 1 + (1 if m * 2 >= 1.75 else 0) - emax
    else:
        q = float(torch.tensor(amax, dtype=torch.float32) / maxv)
        e = math.ceil(math.log2(q)) if q > 0 else -127
    return max(0, min(254, e + 127))


def test_all_256_e8m0_bytes_decode():
    b = torch.arange(256, dtype=torch.uint8)
    got = ref.e8m0_to_float(b).double().tolist()
    assert got[:255] == [2.0 ** (i - 127) for i in range(255)]
    assert got[255] == math.inf  # never written; the decoder shows why


@pytest.mark.parametrize("rule", ["floor", "even", "rceil"])
@pytest.mark.parametrize("element", ["e2m1", "e4m3"])
def test_e8m0_every_byte_each_rule(rule, element):
    """For every byte, amaxes at, just above and just below 2^(b-127)*max_elem and 1.75x it."""
    maxv = 6.0 if element == "e2m1" else 448.0
    amaxes = []
    for b in range(1, 255):
        base = (2.0 ** (b - 127)) * maxv
        for f in (1.0, 1.0 + 2**-20, 1.0 - 2**-20, 1.75, 1.3):
            v = float(torch.tensor(base * f, dtype=torch.float32))
            if 0 < v < 3.0e38:
                amaxes.append(v)
    t = torch.tensor(amaxes, dtype=torch.float32)
    got = ref.e8m0_byte(t, element, rule).tolist()
    assert got == [e8m0_oracle(float(a), element, rule) for a in t.tolist()]
    assert max(got) <= 254


MXFP4_TABLE = {  # amax -> byte by rule (docs/formats.md, "MX shared-exponent rules")
    "floor": [0, 121, 125, 126, 127, 127, 127, 127, 127, 127, 127, 128],
    "even": [0, 121, 125, 126, 127, 127, 127, 127, 127, 128, 128, 128],
    "rceil": [0, 122, 125, 126, 127, 127, 127, 127, 128, 128, 128, 128],
}
MXFP4_AMAX = [0, 0.1, 1, 3, 4, 4.5, 5, 6, 6.5, 7, 7.5, 8]
MXFP8_TABLE = {  # docs/formats.md, "MX shared-exponent rules"
    "floor": [119, 126, 127, 127, 127, 127, 127, 127],
    "even": [119, 127, 127, 127, 128, 128, 128, 128],
    "rceil": [119, 127, 127, 127, 127, 128, 128, 128],
}
MXFP8_AMAX = [1, 250, 300, 400, 448, 460, 480, 500]


@pytest.mark.parametrize("rule", ["floor", "even", "rceil"])
def test_mx_scale_tables_from_formats(rule):
    assert ref.e8m0_byte(torch.tensor(MXFP4_AMAX), "e2m1", rule).tolist() == MXFP4_TABLE[rule]
    assert ref.e8m0_byte(torch.tensor(MXFP8_AMAX, dtype=torch.float32), "e4m3", rule).tolist() == MXFP8_TABLE[rule]


# ---------------------------------------------------------------- worked examples


def test_fp8_tensor_worked_example_b31():
    w = torch.tensor([[1.0, -0.3, 3.5, 0.001, -3.5, 2.9]])
    q = get_recipe("fp8").quantize("w", w)
    assert f32_bits(float(q.scale)) == 0x3C000000
    assert q.codes.tolist() == [[0x70, 0xE2, 0x7E, 0x20, 0xFE, 0x7C]]


def test_fp8_block_worked_example_b54():
    w = torch.zeros(128, 128)
    w[0, :5] = torch.tensor([0.75, -0.75, 0.3, -0.01, 0.0])
    q = get_recipe("fp8-block").quantize("w", w)
    assert f32_bits(float(q.scale[0, 0])) == 0x3ADB6DB7
    assert q.codes[0, :5].tolist() == [0x7E, 0xFE, 0x73, 0xCC, 0x00]
    w2 = torch.zeros(130, 140)  # partial edge blocks, the second block has amax 3.5
    w2[129, 139], w2[128, 130] = 3.5, 0.3
    q2 = get_recipe("fp8-block").quantize("w", w2)
    assert q2.scale.shape == (2, 2)
    assert f32_bits(float(q2.scale[1, 1])) == 0x3C000000
    assert q2.codes[128, 130].item() == 0x62
    assert q2.scale[0, 0].item() == 1.0  # all-zero block -> scale 1.0, never NaN


NVFP4_ROW0 = [0, 0.1015625, -0.25, 0.3125, 0.5, -0.75, 1.0, 1.25, -1.5, 1.75, 2.0, -2.5, 3.0, 3.5, -5.0, 6.0]
NVFP4_ROW1 = [0.875, -0.4375, 0.0546875, 0.2109375, -0.6875, 0.125, 0, -0.875,
              0.3671875, 0.5, -0.015625, 0.75, 0.6484375, -0.2890625, 0.4609375, 0.03125]


def test_nvfp4_worked_example_b67():
    w = torch.tensor([NVFP4_ROW0, NVFP4_ROW1], dtype=torch.bfloat16)
    q = get_recipe("nvfp4").quantize("w", w)
    assert f32_bits(float(q.global_scale)) == 0x3B124925
    assert q.scale.tolist() == [[0x7E], [0x68]]
    assert bytes(q.codes[0].tolist()).hex() == "0018a1224bc4657e"
    assert bytes(q.codes[1].tolist()).hex() == "d7312ef05578c605"
    d = get_recipe("nvfp4").dequantize(q)
    assert abs(float(d[1, 0]) - 0.857143) < 1e-6
    # compressed-tensors stores the reciprocal: 2688/6 would be 448.0; 1/s2 in FP32 is 447.99997
    assert f32_bits(float(1.0 / q.global_scale)) == 0x43DFFFFF


MXFP4_X = [-4, -3.5, -3, -2.5, -2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2, 2.5, 3, 3.5,
           6.5, -7, 3.1, 0.24, 0.26, -0.74, 1.3, 2.4, 2.6, 3.49, 3.51, 4.9, 5.1, -0.0, 0.0, 1.0]


@pytest.mark.parametrize("rule, byte, packed", [
    ("floor", 0x7F, "eecdbc9a10324465f7059143556687 20".replace(" ", "")),
    ("even", 0x80, "ccabaa8900212243e503902133448510"),
    ("rceil", 0x80, "ccabaa8900212243e503902133448510"),
])
def test_mxfp4_worked_example_b76(rule, byte, packed):
    q = get_recipe("mxfp4", scale_rule=rule).quantize("w", torch.tensor([MXFP4_X]))
    assert q.scale.tolist() == [[byte]]
    assert bytes(q.codes[0].tolist()).hex() == packed


# ---------------------------------------------------------------- zero, NaN, shapes


@pytest.mark.parametrize("name", list(RECIPES))
def test_zero_tensor_never_nan(name):
    r = get_recipe(name)
    q = r.quantize("w", torch.zeros(4, 128))  # K = 128: a whole block of every recipe (int4's groups)
    d = r.dequantize(q)
    assert torch.equal(d, torch.zeros(4, 128))
    if name == "nvfp4":
        assert set(q.scale.flatten().tolist()) == {0x38}
        assert float(q.global_scale) == float(torch.tensor(1.0) / 2688)
    if r.scale_encoding == "e8m0_bias127":
        assert set(q.scale.flatten().tolist()) == {0}


@pytest.mark.parametrize("name", list(RECIPES))
def test_nonfinite_rejected_with_name(name):
    w = torch.randn(4, 128)
    w[1, 3] = float("nan")
    with pytest.raises(RecipeError, match="model.layers.0.q_proj.weight: holds NaN or Inf"):
        get_recipe(name).quantize("model.layers.0.q_proj.weight", w)


def test_shape_check_names_tensor_and_fix():
    with pytest.raises(RecipeError, match=r"x\.weight: input dim K=40 is not a multiple of 16.*--ignore"):
        get_recipe("nvfp4").check("x.weight", (8, 40), torch.bfloat16)
    with pytest.raises(RecipeError, match="unknown recipe 'nvfp5'; choose one of: fp8, fp8-channel"):
        get_recipe("nvfp5")


def test_expert_stack_blocks_run_along_last_dim():
    torch.manual_seed(0)
    w = torch.randn(3, 8, 128)  # K = 128: int4's groups are 128 wide
    for name in RECIPES:
        r = get_recipe(name)
        stacked = r.quantize("e", w)
        if name == "fp8":
            continue  # one scale for the whole stack by definition
        for e in range(3):  # nvfp4: the global scale is the whole stack's, passed explicitly
            single = r.quantize("e", w[e], facts=ModuleFacts(group_amax=w.abs().amax()))
            assert torch.equal(stacked.codes[e], single.codes), name
            assert torch.equal(stacked.scale[e], single.scale), name


# ---------------------------------------------------------------- round trips and error bounds


def test_lossless_on_representable_values():
    grid = torch.tensor(E2M1 + [-v for v in E2M1[1:]])
    torch.manual_seed(1)
    idx = torch.randint(0, len(grid), (16, 64))
    x = grid[idx]
    x[:, 0::16] = 6.0  # every 16/32-block holds the max, so the scale is exact
    assert torch.equal(get_recipe("mxfp4", scale_rule="rceil").dequantize(
        get_recipe("mxfp4", scale_rule="rceil").quantize("w", x)), x)
    nv = x * 448.0  # amax 2688 -> s2 = 1, block scale 448
    r = get_recipe("nvfp4")
    assert torch.equal(r.dequantize(r.quantize("w", nv)), nv)
    e4m3 = torch.arange(0, 256, dtype=torch.uint8)
    vals = e4m3[(e4m3 & 0x7F) != 0x7F].view(torch.float8_e4m3fn).float().reshape(2, -1)
    vals[:, 0] = 448.0
    for name in ("fp8", "fp8-channel"):
        r = get_recipe(name)
        assert torch.equal(r.dequantize(r.quantize("w", vals)), vals)


# int4 measures 0.174: a 128-wide group holding a 50x outlier rounds most of its other values to 0
# (0.11 on the same weights without outliers)
BOUNDS = {"fp8": 0.08, "fp8-channel": 0.05, "fp8-block": 0.05, "mxfp8": 0.05, "mxfp4": 0.2, "nvfp4": 0.13,
          "int8-channel": 0.05, "int4": 0.2}


@pytest.mark.parametrize("name", list(RECIPES))
def test_random_error_bounds(name):
    torch.manual_seed(2)
    w = torch.randn(256, 512)
    w[torch.rand_like(w) < 0.001] *= 50  # outliers
    r = get_recipe(name)
    d = r.dequantize(r.quantize("w", w.bfloat16()))
    rel = float((d - w.bfloat16().float()).norm() / w.bfloat16().float().norm())
    assert rel < BOUNDS[name], rel


# ---------------------------------------------------------------- ModelOpt arithmetic, written out


def modelopt_nvfp4(w: torch.Tensor):
    """docs/formats.md, "Numerics" (NVFP4) and "E2M1 rounding: ties to the even code", independently:
    searchsorted E2M1 with the +1 tie fix, FP32 math."""
    w = w.float()
    s2 = w.abs().amax() / (6.0 * 448.0)
    blocks = w.reshape(w.shape[0], -1, 16)
    sb = blocks.abs().amax(-1) / (6.0 * s2)
    sb[sb == 0] = 1.0
    sb = sb.clamp(2**-9, 448).to(torch.float8_e4m3fn)
    scaled = blocks / (sb.float() * s2).unsqueeze(-1)
    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    a = scaled.abs()
    code = torch.searchsorted(bounds, a.contiguous(), side="left")
    code = code + torch.isin(a, bounds[[1, 3, 5]]).long()
    code = code.clamp(max=7) | ((scaled < 0) | ((scaled == 0) & torch.signbit(scaled))).long() << 3
    code = code.reshape(w.shape).to(torch.uint8)
    return (code[:, 0::2] | code[:, 1::2] << 4), sb.view(torch.uint8), s2


def test_nvfp4_and_fp8_bytes_equal_modelopt_arithmetic():
    torch.manual_seed(3)
    for trial in range(3):
        w = (torch.randn(128, 256) * torch.exp(torch.randn(128, 1))).bfloat16()
        w[torch.rand(w.shape) < 0.002] *= 100
        q = get_recipe("nvfp4").quantize("w", w)
        codes, sb, s2 = modelopt_nvfp4(w)
        assert torch.equal(q.codes, codes) and torch.equal(q.scale, sb) and float(q.global_scale) == float(s2)
        # ModelOpt FP8 per-tensor: weight_scale = amax/448, codes (W / scale).to(fp8)
        qf = get_recipe("fp8").quantize("w", w)
        scale = w.float().abs().amax() / 448.0
        assert torch.equal(qf.codes, (w.float() / scale).to(torch.float8_e4m3fn).view(torch.uint8))
        assert float(qf.scale) == float(scale)


@pytest.mark.parametrize("name", list(RECIPES))
def test_chunking_never_changes_a_byte(name, monkeypatch):
    torch.manual_seed(4)
    x = torch.randn(3, 300, 256).bfloat16()
    r = get_recipe(name)
    whole = r.quantize("w", x)
    # Many row bands per matrix on both CPU paths (the reference's bands read chunks' constant).
    monkeypatch.setattr(chunks, "CHUNK_ELEMENTS", 1000)
    monkeypatch.setattr(cpu, "CHUNK", 1000)
    banded = r.quantize("w", x)
    assert torch.equal(whole.codes, banded.codes) and torch.equal(whole.scale, banded.scale)
    reference = ref.quantize(x, r.spec)
    assert torch.equal(whole.codes, reference.codes) and torch.equal(whole.scale, reference.scale)
