"""Triton quantize/dequantize kernels, byte-identical to kernels/reference.py.

Same signatures as the reference (`quantize(x, spec, global_amax)`, `dequantize(q, spec, shape)`,
`tensor_amax(x)`). Each kernel fuses block amax, scale, element rounding and nibble packing in one
pass over a tile; the tensor-wide amax (fp8 per-tensor, NVFP4 global) is a separate reduction.

Bit-exactness rules (why the code looks the way it does):
- every FP32 division is `tl.math.div_rn` (IEEE round-to-nearest); a plain `/` may lower to
  an approximate division on the GPU;
- E4M3 and E2M1 encodings are integer bit math, not `.to(tl.float8e4nv)`: the cast's rounding
  differs between the interpreter and hardware, the bit math is RNE everywhere;
- E8M0 exponents come from the FP32 bit pattern exactly as in the reference.
Every kernel also counts non-finite inputs per program, so NaN/Inf are rejected without a
separate pass over the data.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference
from .spec import (
    E8M0_MAX_FINITE_BYTE,
    FP8_BLOCK,
    FP8_BLOCK_KIND,
    FP8_CHANNEL,
    FP8_TENSOR,
    FP32_MIN_NORMAL,
    MX,
    NVFP4,
    NonFiniteInput,
    QuantResult,
    QuantSpec,
)

RULE_IDS = {"floor": 0, "even": 1, "rceil": 2}
MIN_FP8_SCALE = tl.constexpr(FP32_MIN_NORMAL)  # reference.fp8_scale's floor
BM, BK = 32, 256  # row tile for the grouped kernels (BK is a multiple of every group size)

# ---------------------------------------------------------------- device helpers


@triton.jit
def _nonfinite(x):
    bits = x.to(tl.int32, bitcast=True)
    return tl.sum(tl.sum(((bits & 0x7F800000) == 0x7F800000).to(tl.int32), axis=1), axis=0)


@triton.jit
def _encode_e4m3(v):
    """FP32 -> E4M3FN byte: clamp to 448, RNE, sign kept (incl. -0.0)."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.minimum(tl.abs(v), 448.0)
    ab = a.to(tl.int32, bitcast=True)
    exp = ab >> 23
    # Normal range (a >= 2^-6): round the mantissa to 3 bits, RNE, carry into the exponent.
    lsb = (ab >> 20) & 1
    normal = ((ab + 0x7FFFF + lsb) >> 20) - (120 << 3)
    # Subnormal range: the code is a * 2^9 rounded to an integer, RNE.
    mant = (ab & 0x7FFFFF) | tl.where(exp > 0, 0x800000, 0)
    shift = tl.minimum(141 - exp, 31)
    q = mant >> shift
    rem = mant & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    sub = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    code = tl.where(exp >= 121, normal, sub)
    return (code | sign).to(tl.uint8)


@triton.jit
def _decode_e4m3(c):
    """E4M3FN byte (non-negative scales only) -> FP32, exactly."""
    c = c.to(tl.int32)
    e = (c >> 3) & 0xF
    m = c & 0x7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    value = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    return tl.where((c & 0x80) != 0, -value, value)


@triton.jit
def _encode_e2m1(v):
    """FP32 -> E2M1 nibble: RNE with ties to the even code, saturating at 6, sign bit kept."""
    a = tl.abs(v)
    mag = (
        (a > 0.25).to(tl.int32)
        + (a >= 0.75).to(tl.int32)
        + (a > 1.25).to(tl.int32)
        + (a >= 1.75).to(tl.int32)
        + (a > 2.5).to(tl.int32)
        + (a >= 3.5).to(tl.int32)
        + (a > 5.0).to(tl.int32)
    )
    sign = (v.to(tl.int32, bitcast=True) >> 28) & 0x8
    return (mag | sign).to(tl.uint8)


@triton.jit
def _decode_e2m1(c):
    c = c.to(tl.int32)
    m = c & 0x7
    # 0, .5, 1, 1.5 for codes 0..3; 2, 3, 4, 6 for codes 4..7
    small = m.to(tl.float32) * 0.5
    big = tl.where(m == 7, 6.0, (m - 2).to(tl.float32))
    value = tl.where(m < 4, small, big)
    return tl.where((c & 0x8) != 0, -value, value)


@triton.jit
def _e8m0_byte(amax, EMAX: tl.constexpr, MAXV: tl.constexpr, RULE: tl.constexpr):
    bits = amax.to(tl.int32, bitcast=True)
    if RULE == 0:
        biased = (bits >> 23) - EMAX
    elif RULE == 1:
        biased = ((bits + (1 << 21)) >> 23) - EMAX
    else:
        q = tl.math.div_rn(amax, tl.full(amax.shape, MAXV, tl.float32)).to(tl.int32, bitcast=True)
        biased = (q + 0x7FFFFF) >> 23
    return tl.minimum(tl.maximum(biased, 0), 254)


@triton.jit
def _e8m0_to_float(byte):
    return tl.where(byte == 0, 0x00400000, byte << 23).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_scale(amax, MIN_SCALE: tl.constexpr):
    """reference.fp8_scale: amax / 448, at least MIN_SCALE (smallest normal FP32), 1.0 for 0."""
    scale = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
    return tl.where(amax == 0.0, 1.0, tl.maximum(scale, MIN_SCALE))


@triton.jit
def _pack_pairs(codes, R: tl.constexpr, C: tl.constexpr):
    lo, hi = tl.split(tl.reshape(codes, [R, C // 2, 2]))
    return lo | (hi << 4)


@triton.jit
def _load_tile(x_ptr, rows, cols, M, K, sxm, sxk):
    """A [rows, cols] tile of a strided [M, K] input as FP32 (zeros outside), and its mask."""
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * sxm + cols[None, :] * sxk, mask=mask, other=0.0).to(tl.float32)
    return x, mask


# ---------------------------------------------------------------- kernels


@triton.jit
def _amax_kernel(x_ptr, out_ptr, flag_ptr, M, K, sxm, sxk, TM: tl.constexpr, TK: tl.constexpr):
    pm = tl.program_id(0)
    pk = tl.program_id(1)
    rows = pm * TM + tl.arange(0, TM)
    cols = pk * TK + tl.arange(0, TK)
    x, _ = _load_tile(x_ptr, rows, cols, M, K, sxm, sxk)
    pid = pm * tl.num_programs(1) + pk
    tl.store(out_ptr + pid, tl.max(tl.max(tl.abs(x), axis=1), axis=0))
    tl.store(flag_ptr + pid, _nonfinite(x))


@triton.jit
def _fp8_scaled_kernel(x_ptr, scale_ptr, codes_ptr, M, K, sxm, sxk, TM: tl.constexpr, TK: tl.constexpr):
    """Elementwise e4m3(x / scale) with one FP32 scale for the whole tensor."""
    rows = tl.program_id(0) * TM + tl.arange(0, TM)
    cols = tl.program_id(1) * TK + tl.arange(0, TK)
    x, mask = _load_tile(x_ptr, rows, cols, M, K, sxm, sxk)
    scale = tl.load(scale_ptr)
    y = tl.math.div_rn(x, tl.broadcast_to(scale, x.shape))
    tl.store(codes_ptr + rows[:, None] * K + cols[None, :], _encode_e4m3(y), mask=mask)


@triton.jit
def _fp8_channel_kernel(x_ptr, codes_ptr, scale_ptr, flag_ptr, M, K, sxm, sxk,
                        TM: tl.constexpr, TK: tl.constexpr):
    """One program per TM rows: pass 1 the row amax, pass 2 quantize (rows stay in L2)."""
    pm = tl.program_id(0)
    rows = pm * TM + tl.arange(0, TM)
    amax = tl.zeros([TM], tl.float32)
    bad = 0
    for k0 in range(0, K, TK):
        cols = k0 + tl.arange(0, TK)
        x, _ = _load_tile(x_ptr, rows, cols, M, K, sxm, sxk)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
        bad += _nonfinite(x)
    scale = _fp8_scale(amax, MIN_FP8_SCALE)
    tl.store(scale_ptr + rows, scale, mask=rows < M)
    tl.store(flag_ptr + pm, bad)
    for k0 in range(0, K, TK):
        cols = k0 + tl.arange(0, TK)
        x, mask = _load_tile(x_ptr, rows, cols, M, K, sxm, sxk)
        y = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
        tl.store(codes_ptr + rows[:, None] * K + cols[None, :], _encode_e4m3(y), mask=mask)


@triton.jit
def _fp8_block_kernel(x_ptr, codes_ptr, scale_ptr, flag_ptr, N, K, NB, KB, sxb, sxn, sxk,
                      B: tl.constexpr):
    """One program per B x B block of one matrix; edge blocks are partial (masked as zeros)."""
    pb = tl.program_id(0)  # matrix index * NB + block row
    pk = tl.program_id(1)
    mat = pb // NB
    bn = pb % NB
    rows = bn * B + tl.arange(0, B)
    cols = pk * B + tl.arange(0, B)
    mask = (rows[:, None] < N) & (cols[None, :] < K)
    x = tl.load(x_ptr + mat * sxb + rows[:, None] * sxn + cols[None, :] * sxk, mask=mask, other=0.0)
    x = x.to(tl.float32)
    scale = _fp8_scale(tl.max(tl.max(tl.abs(x), axis=1), axis=0), MIN_FP8_SCALE)
    tl.store(scale_ptr + pb * KB + pk, scale)
    tl.store(flag_ptr + pb * KB + pk, _nonfinite(x))
    y = tl.math.div_rn(x, tl.broadcast_to(scale, x.shape))
    tl.store(codes_ptr + mat * N * K + rows[:, None] * K + cols[None, :], _encode_e4m3(y), mask=mask)


@triton.jit
def _grouped_kernel(x_ptr, codes_ptr, scale_ptr, s2_ptr, flag_ptr, M, K, sxm, sxk,
                    TM: tl.constexpr, TK: tl.constexpr, G: tl.constexpr, FP4: tl.constexpr,
                    NVFP4: tl.constexpr, EMAX: tl.constexpr, MAXV: tl.constexpr, RULE: tl.constexpr,
                    MAXBYTE: tl.constexpr):
    """MXFP8, MXFP4 (E8M0 scale per G) and NVFP4 (E4M3 scale per 16 times the FP32 global)."""
    pm = tl.program_id(0)
    pk = tl.program_id(1)
    rows = pm * TM + tl.arange(0, TM)
    cols = pk * TK + tl.arange(0, TK)
    x, mask = _load_tile(x_ptr, rows, cols, M, K, sxm, sxk)
    tl.store(flag_ptr + pm * tl.num_programs(1) + pk, _nonfinite(x))
    g = tl.reshape(x, [TM, TK // G, G])
    amax = tl.max(tl.abs(g), axis=2)
    if NVFP4:
        s2 = tl.load(s2_ptr)
        six_s2 = tl.full(amax.shape, 6.0, tl.float32) * s2
        block = tl.math.div_rn(amax, six_s2)
        block = tl.where(block == 0.0, 1.0, block)
        scale_code = _encode_e4m3(tl.minimum(tl.maximum(block, 0.001953125), 448.0))
        denom = _decode_e4m3(scale_code) * s2
    else:
        # Saturate at the largest byte whose codes all decode finitely (reference._mx).
        byte = tl.minimum(_e8m0_byte(amax, EMAX, MAXV, RULE), MAXBYTE)
        scale_code = byte.to(tl.uint8)
        denom = _e8m0_to_float(byte)
    y = tl.reshape(tl.math.div_rn(g, tl.broadcast_to(denom[:, :, None], g.shape)), [TM, TK])
    srows = rows[:, None]
    scols = pk * (TK // G) + tl.arange(0, TK // G)[None, :]
    tl.store(scale_ptr + srows * (K // G) + scols, scale_code, mask=(srows < M) & (scols < K // G))
    if FP4:
        packed = _pack_pairs(_encode_e2m1(y), TM, TK)
        pcols = pk * (TK // 2) + tl.arange(0, TK // 2)[None, :]
        tl.store(codes_ptr + srows * (K // 2) + pcols, packed, mask=(srows < M) & (pcols < K // 2))
    else:
        tl.store(codes_ptr + srows * K + cols[None, :], _encode_e4m3(y), mask=mask)


@triton.jit
def _dequant_kernel(codes_ptr, scale_ptr, s2_ptr, out_ptr, N, K, SN, SK, BR, BC,
                    TM: tl.constexpr, TK: tl.constexpr, FP4: tl.constexpr, SCALE: tl.constexpr):
    """out[b, r, c] = elem(codes) * scale[b, r // BR, c // BC]; SCALE 0 = FP32,
    1 = E8M0 byte, 2 = E4M3 byte times the FP32 global."""
    b = tl.program_id(2)
    rows = tl.program_id(0) * TM + tl.arange(0, TM)
    cols = tl.program_id(1) * TK + tl.arange(0, TK)
    mask = (rows[:, None] < N) & (cols[None, :] < K)
    if FP4:
        byte = tl.load(codes_ptr + b * N * (K // 2) + rows[:, None] * (K // 2) + cols[None, :] // 2,
                       mask=mask, other=0)
        nib = tl.where((cols[None, :] % 2) == 0, byte & 0xF, byte >> 4)
        values = _decode_e2m1(nib)
    else:
        values = _decode_e4m3(tl.load(codes_ptr + b * N * K + rows[:, None] * K + cols[None, :],
                                      mask=mask, other=0))
    sidx = b * SN * SK + (rows[:, None] // BR) * SK + cols[None, :] // BC
    raw = tl.load(scale_ptr + sidx, mask=mask, other=0)
    if SCALE == 0:
        scale = raw
    elif SCALE == 1:
        scale = _e8m0_to_float(raw.to(tl.int32))
    else:
        scale = _decode_e4m3(raw) * tl.load(s2_ptr)
    tl.store(out_ptr + b * N * K + rows[:, None] * K + cols[None, :], values * scale, mask=mask)


# ---------------------------------------------------------------- launchers


def _check_flags(flags: torch.Tensor) -> None:
    if int(flags.sum()) != 0:
        raise NonFiniteInput()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., K] -> [M, K] without copying when the strides allow it."""
    return x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    x2 = _rows(x if x.dim() >= 2 else x.reshape(1, -1))
    m, k = x2.shape
    tm, tk = 64, 256
    grid = (triton.cdiv(m, tm), triton.cdiv(k, tk))
    partial = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=x.device)
    flags = torch.empty(grid[0] * grid[1], dtype=torch.int32, device=x.device)
    _amax_kernel[grid](x2, partial, flags, m, k, x2.stride(0), x2.stride(1), TM=tm, TK=tk)
    _check_flags(flags)
    return partial.amax()


def _fp8_tensor(x: torch.Tensor) -> QuantResult:
    amax = tensor_amax(x)
    scale = reference.fp8_scale(amax)
    x2 = _rows(x)
    m, k = x2.shape
    codes = torch.empty((m, k), dtype=torch.uint8, device=x.device)
    grid = (triton.cdiv(m, 64), triton.cdiv(k, 256))
    _fp8_scaled_kernel[grid](x2, scale, codes, m, k, x2.stride(0), x2.stride(1), TM=64, TK=256)
    return QuantResult(codes.reshape(x.shape), scale)


def _fp8_channel(x: torch.Tensor) -> QuantResult:
    x2 = _rows(x)
    m, k = x2.shape
    tm = 16
    codes = torch.empty((m, k), dtype=torch.uint8, device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    flags = torch.empty(triton.cdiv(m, tm), dtype=torch.int32, device=x.device)
    _fp8_channel_kernel[(triton.cdiv(m, tm),)](x2, codes, scale, flags, m, k, x2.stride(0),
                                                x2.stride(1), TM=tm, TK=256)
    _check_flags(flags)
    return QuantResult(codes.reshape(x.shape), scale.reshape(x.shape[:-1]))


def _fp8_block(x: torch.Tensor) -> QuantResult:
    *lead, n, k = x.shape
    x3 = x.reshape(-1, n, k)
    nmat = x3.shape[0]
    nb, kb = triton.cdiv(n, FP8_BLOCK), triton.cdiv(k, FP8_BLOCK)
    codes = torch.empty((nmat, n, k), dtype=torch.uint8, device=x.device)
    scale = torch.empty((nmat, nb, kb), dtype=torch.float32, device=x.device)
    flags = torch.empty(nmat * nb * kb, dtype=torch.int32, device=x.device)
    _fp8_block_kernel[(nmat * nb, kb)](x3, codes, scale, flags, n, k, nb, kb, x3.stride(0),
                                       x3.stride(1), x3.stride(2), B=FP8_BLOCK)
    _check_flags(flags)
    return QuantResult(codes.reshape(x.shape), scale.reshape(*lead, nb, kb))


def _grouped(x: torch.Tensor, spec: QuantSpec, s2: torch.Tensor | None) -> QuantResult:
    x2 = _rows(x)
    m, k = x2.shape
    g = spec.group
    fp4 = spec.element == "e2m1"
    codes = torch.empty((m, k // 2 if fp4 else k), dtype=torch.uint8, device=x.device)
    scale = torch.empty((m, k // g), dtype=torch.uint8, device=x.device)
    grid = (triton.cdiv(m, BM), triton.cdiv(k, BK))
    flags = torch.empty(grid[0] * grid[1], dtype=torch.int32, device=x.device)
    dummy = torch.zeros(1, dtype=torch.float32, device=x.device)
    _grouped_kernel[grid](
        x2, codes, scale, dummy if s2 is None else s2, flags, m, k, x2.stride(0), x2.stride(1),
        TM=BM, TK=BK, G=g, FP4=fp4, NVFP4=spec.kind == NVFP4,
        EMAX=2 if fp4 else 8, MAXV=6.0 if fp4 else 448.0, RULE=RULE_IDS.get(spec.scale_rule, 0),
        MAXBYTE=E8M0_MAX_FINITE_BYTE[spec.element],
    )
    _check_flags(flags)
    lead = x.shape[:-1]
    return QuantResult(codes.reshape(*lead, codes.shape[-1]), scale.reshape(*lead, k // g), s2)


def quantize(x: torch.Tensor, spec: QuantSpec, global_amax: torch.Tensor | None = None) -> QuantResult:
    if x.numel() == 0:
        return reference.empty_result(x, spec, global_amax)
    if spec.kind == FP8_TENSOR:
        return _fp8_tensor(x)
    if spec.kind == FP8_CHANNEL:
        return _fp8_channel(x)
    if spec.kind == FP8_BLOCK_KIND:
        return _fp8_block(x)
    if spec.kind == MX:
        return _grouped(x, spec, None)
    if spec.kind == NVFP4:
        amax = tensor_amax(x) if global_amax is None else global_amax.to(x.device)
        return _grouped(x, spec, reference.nvfp4_global_scale(amax).reshape(()))
    raise ValueError(f"unknown quantizer kind {spec.kind!r}")


def dequantize(q: QuantResult, spec: QuantSpec, shape: tuple[int, ...]) -> torch.Tensor:
    if len(shape) == 0 or 0 in shape:
        return reference.dequantize(q, spec, shape)
    *lead, n, k = shape
    fp4 = spec.element == "e2m1" and spec.kind in (MX, NVFP4)
    if spec.kind == FP8_BLOCK_KIND:
        nmat, rows, br, bc = max(1, q.codes.numel() // (n * k)), n, FP8_BLOCK, FP8_BLOCK
    elif spec.kind == FP8_TENSOR:
        nmat, rows, br, bc = 1, q.codes.numel() // k, q.codes.numel() // k, k
    elif spec.kind == FP8_CHANNEL:
        nmat, rows, br, bc = 1, q.codes.numel() // k, 1, k
    else:
        nmat, rows, br, bc = 1, q.codes.numel() * (2 if fp4 else 1) // k, 1, spec.group
    scale = q.scale.contiguous()
    sn = scale.numel() // nmat
    sk = 1 if spec.kind in (FP8_TENSOR, FP8_CHANNEL) else scale.shape[-1]
    sn = sn // sk
    out = torch.empty((nmat, rows, k), dtype=torch.float32, device=q.codes.device)
    s2 = q.global_scale if q.global_scale is not None else torch.zeros((), device=q.codes.device)
    kind = 0 if spec.kind in (FP8_TENSOR, FP8_CHANNEL, FP8_BLOCK_KIND) else (1 if spec.kind == MX else 2)
    grid = (triton.cdiv(rows, 32), triton.cdiv(k, 128), nmat)
    _dequant_kernel[grid](q.codes.contiguous(), scale, s2.to(torch.float32), out, rows, k, sn, sk,
                          br, bc, TM=32, TK=128, FP4=fp4, SCALE=kind)
    return out.reshape(shape)
