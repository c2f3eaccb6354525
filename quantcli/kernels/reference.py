"""Pure-torch quantizers and dequantizers: the reference every Triton kernel must match bit for bit.

Numerics follow docs/formats.md, "Numerics": FP32 arithmetic, clamp before every narrowing cast, RNE for
E4M3 (PyTorch's cast) and E2M1 (ties to the even code, saturating at 6), low nibble first,
NVFP4 with ModelOpt's op order, MX scale exponents from the FP32 bit pattern per `scale_rule`,
INT4 with compressed-tensors' eager arithmetic in the weight's dtype. The arithmetic of each
element and scale type is its codec's (kernels/elements.py, kernels/scales.py); this file owns
the geometries. Inputs are `[..., N, K]`; blocks always run along the last (input) dimension.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from quantcli.kernels.chunks import CHUNK_ELEMENTS, _chunked, cpu_workers  # noqa: F401 (search.py and callers use them here)
from quantcli.kernels.elements import (  # noqa: F401 (the codec functions, importable from here as before)
    E2M1_VALUES,
    decode_e2m1,
    decode_e4m3,
    encode_e2m1,
    encode_e4m3,
    pack_nibbles,
    unpack_nibbles,
)
from quantcli.kernels.scales import e8m0_byte, e8m0_to_float, f32_scale, fp8_scale, nvfp4_global_scale  # noqa: F401
from quantcli.kernels.spec import BLOCK, FP8_BLOCK, ROW, TENSOR, ElementCodec, QuantResult, QuantSpec, check_finite

_check_finite = check_finite  # the name cpu.py, search.py and the tests use


# ---------------------------------------------------------------- codecs, by role


def encode_elements(v: torch.Tensor, element: ElementCodec) -> torch.Tensor:
    """Scaled FP32 values -> code bytes (4-bit codes packed two per byte along the last dim)."""
    return element.encode(v)


def decode_elements(codes: torch.Tensor, element: ElementCodec) -> torch.Tensor:
    return element.decode(codes)


def encode_scale(amax: torch.Tensor, spec: QuantSpec, s2: torch.Tensor | None,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Block amax -> (the stored scale, the FP32 divisor the elements are scaled by); `dtype` is
    the weight's (only the weight-dtype scale codec uses it)."""
    return spec.scale.encode(amax, spec.element, spec.scale_rule, s2, dtype)


def decode_scale(scale: torch.Tensor, global_scale: torch.Tensor | None, spec: QuantSpec) -> torch.Tensor:
    return spec.scale.decode(scale, global_scale)


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """Max |x| as an FP32 0-d tensor (0 for an empty tensor). One aminmax pass in the source
    dtype: a max is exact in any float format, and NaN/Inf propagate into it."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    lo, hi = torch.aminmax(x)
    return check_finite(torch.maximum(-lo, hi).to(torch.float32))


# ---------------------------------------------------------------- one chunk, per geometry
# Each takes the chunk upcast to FP32 and the weight's own dtype.


def _amax_last(x: torch.Tensor) -> torch.Tensor:
    return check_finite(x.abs().amax(dim=-1) if x.shape[-1] else x.new_zeros(x.shape[:-1]))


def _groups(x: torch.Tensor, group: int) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // group, group)


def _encode(x: torch.Tensor, denom: torch.Tensor, spec: QuantSpec, dtype: torch.dtype) -> torch.Tensor:
    return spec.element.encode(spec.scale.scaled(x, denom, dtype))


def _tensor_chunk(x: torch.Tensor, spec: QuantSpec, amax: torch.Tensor, s2, dtype) -> QuantResult:
    stored, denom = encode_scale(amax, spec, s2, dtype)
    return QuantResult(_encode(x, denom, spec, dtype), stored)


def _row_chunk(x: torch.Tensor, spec: QuantSpec, s2, dtype) -> QuantResult:
    stored, denom = encode_scale(_amax_last(x), spec, s2, dtype)
    return QuantResult(_encode(x, denom.unsqueeze(-1), spec, dtype), stored)


def _group_amax(x: torch.Tensor, group: int) -> torch.Tensor:
    """Max |x| of each 1 x `group` block of rows `[R, K]`: a max-pool with kernel = stride =
    group is one vectorized pass where `amax(-1)` over a 16-wide last dim is several times slower;
    both are exact and both propagate NaN (checked by tests/test_fast_codecs.py)."""
    if x.dim() == 2 and x.shape[-1]:
        return check_finite(F.max_pool1d(x.abs().unsqueeze(1), group).squeeze(1))
    return _amax_last(_groups(x, group))


def _group_chunk(x: torch.Tensor, spec: QuantSpec, s2, dtype) -> QuantResult:
    g = _groups(x, spec.group)
    stored, denom = encode_scale(_group_amax(x, spec.group), spec, s2, dtype)
    y = spec.scale.scaled(g, denom.unsqueeze(-1), dtype).reshape(x.shape)
    return QuantResult(spec.element.encode(y), stored)


def _block_chunk(x: torch.Tensor, spec: QuantSpec, s2, dtype=torch.float32) -> QuantResult:
    *lead, n, k = x.shape
    nb, kb = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    # Zero padding affects only the amax of edge blocks; the output is cropped back.
    padded = F.pad(x, (0, kb * FP8_BLOCK - k, 0, nb * FP8_BLOCK - n))
    tiles = padded.reshape(*lead, nb, FP8_BLOCK, kb, FP8_BLOCK)
    amax = check_finite(tiles.abs().amax(dim=(-3, -1)) if tiles.numel() else tiles.new_zeros(*lead, nb, kb))
    stored, denom = encode_scale(amax, spec, s2, dtype)
    return QuantResult(_encode(x, _expand_blocks(denom, n, k), spec, dtype), stored)


def _expand_blocks(scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    return scale.repeat_interleave(FP8_BLOCK, -2).repeat_interleave(FP8_BLOCK, -1)[..., :n, :k]


# ---------------------------------------------------------------- entry points


def global_scale_for(x: torch.Tensor, spec: QuantSpec, global_amax: torch.Tensor | None) -> torch.Tensor | None:
    """The FP32 global scale of a two-level scale codec (NVFP4), from the fused group's amax when
    given, else the tensor's own; None for single-level codecs."""
    if not spec.scale.has_global:
        return None
    return spec.scale.global_scale(tensor_amax(x) if global_amax is None else global_amax)


def empty_result(x: torch.Tensor, spec: QuantSpec, global_amax: torch.Tensor | None = None) -> QuantResult:
    """A tensor with a zero-size dimension: empty codes of the right shape, and every scale (a
    row of K = 0 still has one) set as for an all-zero block. Both backends use this."""
    dev = x.device
    codes = torch.empty(spec.codes_shape(tuple(x.shape)), dtype=torch.uint8, device=dev)
    zero = torch.zeros(spec.scale_shape(tuple(x.shape)), dtype=torch.float32, device=dev)
    s2 = None
    if spec.scale.has_global:
        amax = torch.zeros((), device=dev) if global_amax is None else global_amax.to(dev)
        s2 = spec.scale.global_scale(amax).reshape(())
    return QuantResult(codes, encode_scale(zero, spec, s2, x.dtype)[0], s2)


def quantize(x: torch.Tensor, spec: QuantSpec, global_amax: torch.Tensor | None = None) -> QuantResult:
    """Quantize `x [..., N, K]` (any float dtype; upcast to FP32 chunk by chunk) per `spec`.

    `global_amax` (two-level scales only) overrides the tensor's own amax, so that fused groups
    share one `weight_scale_2`."""
    if x.numel() == 0:
        return empty_result(x, spec, global_amax)
    s2 = global_scale_for(x, spec, global_amax)
    f32, dtype = (lambda t: t.to(torch.float32)), x.dtype
    if spec.geometry == TENSOR:
        amax = tensor_amax(x)
        r = _chunked(x, 1, lambda c: _tensor_chunk(f32(c), spec, amax, s2, dtype))
    elif spec.geometry == BLOCK:
        r = _chunked(x, FP8_BLOCK, lambda c: _block_chunk(f32(c), spec, s2, dtype))
    else:
        chunk = _row_chunk if spec.geometry == ROW else _group_chunk
        r = _chunked(x, 1, lambda c: chunk(f32(c), spec, s2, dtype))
    return QuantResult(r.codes, r.scale, s2)


def dequantize(q: QuantResult, spec: QuantSpec, shape: tuple[int, ...]) -> torch.Tensor:
    """Decode to FP32 `[..., N, K]` = `shape`."""
    if math.prod(shape) == 0:
        return torch.zeros(shape, dtype=torch.float32, device=q.codes.device)
    values = spec.element.decode(q.codes)
    scale = spec.scale.decode(q.scale, q.global_scale)
    if spec.geometry == TENSOR:
        return values * scale
    if spec.geometry == ROW:
        return values * scale.unsqueeze(-1)
    if spec.geometry == BLOCK:
        return values * _expand_blocks(scale, shape[-2], shape[-1])
    return (_groups(values, spec.group) * scale.unsqueeze(-1)).reshape(shape)
