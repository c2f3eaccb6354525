"""The fast CPU codecs of kernels/reference.py against the slow, obviously right ones they replaced.

The oracles below are the previous implementations, kept verbatim: the E2M1 compare ladder, the
strided nibble pack, `abs().amax(-1)` per block and the isfinite().all() check. Every output pin
(tests/test_output_pins.py) depends on these bytes; here each fast path is checked on every FP32
value near each rounding boundary, on every exponent, and on random tensors.
"""

from __future__ import annotations

import pytest
import torch

from quantcli.kernels import reference as ref
from quantcli.kernels.spec import NonFiniteInput


def ladder_e2m1(v: torch.Tensor) -> torch.Tensor:
    """The previous encode_e2m1: RNE by a ladder of compares (`>` rounds a midpoint down, `>=` up)."""
    a = v.abs()
    mag = (a > 0.25).to(torch.uint8)
    for bound, tie_up in ((0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False)):
        mag += (a >= bound) if tie_up else (a > bound)
    return mag | (torch.signbit(v).to(torch.uint8) << 3)


def strided_pack(codes: torch.Tensor) -> torch.Tensor:
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _bits_around(values, reach: int) -> torch.Tensor:
    """Every FP32 within `reach` ulps of each value, both signs (NaN patterns dropped)."""
    centre = torch.tensor(values, dtype=torch.float32).view(torch.int32).to(torch.int64)
    near = (centre[:, None] + torch.arange(-reach, reach + 1)).reshape(-1)
    near = near[(near >= 0) & (near <= 0x7FFFFFFF)].to(torch.int32).view(torch.float32)
    near = near[~torch.isnan(near)]
    return torch.cat([near, -near])


# Every E2M1 grid value and midpoint, each binade edge the encoder's magic constant changes at,
# saturation, FP32's smallest and largest values.
BOUNDARIES = [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0, 16.0,
              1e-45, 1.1754944e-38, 1e30, 3.4028235e38, float("inf")]


def test_e2m1_matches_the_ladder_near_every_boundary():
    v = _bits_around(BOUNDARIES, 1 << 15)
    assert torch.equal(ref.encode_e2m1(v), ladder_e2m1(v))


def test_e2m1_matches_the_ladder_on_every_exponent():
    """All 256 exponents (subnormals and Inf included) with 4096 mantissas each, both signs."""
    exponents = torch.arange(256, dtype=torch.int64)[:, None] << 23
    mantissas = torch.linspace(0, (1 << 23) - 1, 4096).to(torch.int64)[None, :]
    v = (exponents | mantissas).reshape(-1).to(torch.int32).view(torch.float32)
    v = v[~torch.isnan(v)]
    v = torch.cat([v, -v])
    assert torch.equal(ref.encode_e2m1(v), ladder_e2m1(v))


@pytest.mark.parametrize("scale", [0.3, 2.0, 6.0, 1e4])
def test_e2m1_matches_the_ladder_on_random_tensors(scale):
    g = torch.Generator().manual_seed(int(scale * 10))
    v = torch.randn(97, 256, generator=g) * scale
    v[0, :4] = torch.tensor([0.0, -0.0, 5.0, -5.0])
    assert torch.equal(ref.encode_e2m1(v), ladder_e2m1(v))
    # a strided view (a column slice) gives the same codes as its contiguous copy
    assert torch.equal(ref.encode_e2m1(v[:, 1::3]), ladder_e2m1(v[:, 1::3].contiguous()))


def test_pack_nibbles_matches_the_strided_pack():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (5, 3, 64), dtype=torch.uint8, generator=g)
    assert torch.equal(ref.pack_nibbles(codes), strided_pack(codes))
    assert torch.equal(ref.pack_nibbles(codes[..., :32]), strided_pack(codes[..., :32]))  # not contiguous
    every_pair = torch.cartesian_prod(torch.arange(16), torch.arange(16)).to(torch.uint8)
    assert torch.equal(ref.pack_nibbles(every_pair), strided_pack(every_pair))
    assert torch.equal(ref.unpack_nibbles(ref.pack_nibbles(every_pair)), every_pair)


@pytest.mark.parametrize("group", [16, 32])
def test_group_amax_is_the_blockwise_abs_max(group):
    g = torch.Generator().manual_seed(group)
    x = torch.randn(33, 8 * group, generator=g)
    x[3, 5] = -0.0
    expected = x.abs().reshape(33, 8, group).amax(-1)
    assert torch.equal(ref._group_amax(x, group), expected)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_blocks_are_refused_wherever_they_sit(bad):
    for row, col in ((0, 0), (7, 63), (4, 17)):
        x = torch.ones(8, 64)
        x[row, col] = bad
        with pytest.raises(NonFiniteInput):
            ref._group_amax(x, 16)
        with pytest.raises(NonFiniteInput):
            ref._amax_last(x)
    assert torch.equal(ref._check_finite(torch.zeros(0)), torch.zeros(0))  # nothing to check


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype == torch.float32 and torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_e2m1_nearest_is_decode_of_encode_bit_for_bit():
    """GPTQ's loop rounds with nearest_e2m1; the codes written are encode's: the two must agree
    on every value, -0.0 included, near every boundary, on every exponent and at random."""
    from quantcli.kernels.elements import decode_e2m1, nearest_e2m1

    near = _bits_around(BOUNDARIES, 1 << 15)
    exponents = torch.arange(256, dtype=torch.int64)[:, None] << 23
    mantissas = torch.linspace(0, (1 << 23) - 1, 4096).to(torch.int64)[None, :]
    every = (exponents | mantissas).reshape(-1).to(torch.int32).view(torch.float32)
    every = every[~torch.isnan(every)]
    g = torch.Generator().manual_seed(3)
    noise = torch.randint(-2**31, 2**31 - 1, (1 << 20,), generator=g, dtype=torch.int64).to(torch.int32)
    noise = noise.view(torch.float32)[~torch.isnan(noise.view(torch.float32))]
    for v in (near, torch.cat([every, -every]), noise, torch.randn(97, 256, generator=g)[:, 1::3]):
        assert _same_bits(nearest_e2m1(v), decode_e2m1(ref.encode_e2m1(v)))
