"""Triton quantize/dequantize kernels, byte-identical to kernels/reference.py.

Same signatures as the reference (`quantize(x, spec, global_amax)`, `dequantize(q, spec, shape)`,
`tensor_amax(x)`). Each kernel fuses block amax, scale, element rounding and nibble packing in one
pass over a tile; the tensor-wide amax (fp8 per-tensor, NVFP4 global) is a separate reduction.

Bit-exactness rules (why the code looks the way it does):
- every FP32 division is `tl.math.div_rn` (IEEE round-to-nearest); a plain `/` may lower to
  an approximate division on the GPU;
- E4M3 and E2M1 encodings are integer bit math, not `.to(tl.float8e4nv)`: the cast's rounding
  differs between the interpreter and hardware, the bit math is RNE everywhere;
- E8M0 exponents come from the FP32 bit pattern exactly as in the reference;
- every launch compiles without FP contraction or flush-to-zero (triton_launch.EXACT_OPTIONS),
  so a*b+c rounds twice and subnormals survive, as in torch; the PTX of every variant the
  recipes launch is checked for this on sm_90 and sm_100 (kernels/ptx_rules.py,
  tests/test_kernels_compile.py).
Every kernel also counts non-finite inputs per program, so NaN/Inf are rejected without a
separate pass over the data.

One kernel per geometry (tensor, row, 128 x 128 block, 1 x G group); the element and scale
codecs (kernels/triton_codecs.py) are constexpr parameters, each codec object's `triton_id`.
The tensor, row and block kernels take the F32 scale codec and one-byte elements; the group
kernel takes every scale codec and packs 4-bit elements.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from quantcli.kernels import reference
from quantcli.kernels.spec import (
    BLOCK,
    F32_SCALE,
    FP8_BLOCK,
    FP32_MAX,
    FP32_MIN_NORMAL,
    GROUP,
    ROW,
    TENSOR,
    NonFiniteInput,
    QuantResult,
    QuantSpec,
)
from quantcli.kernels.triton_codecs import (
    _decode,
    _decode_scale,
    _encode,
    _encode_scale,
    _f32_scale,
    _load_tile,
    _nonfinite,
    _pack_pairs,
    _scaled,
    _searched_scale,
)
from quantcli.kernels.triton_launch import Launch, recording, run

MIN_SCALE = tl.constexpr(FP32_MIN_NORMAL)  # reference.f32_scale's floor
BM, BK = 32, 256  # row tile for the grouped kernels (BK is a multiple of every group size)
# The scale search evaluates up to 11 candidate scales per element: at 32 rows it needed 255
# registers and spilled (ptxas -v, sm_90, NVFP4) and took ~15 s to compile per variant; 4 rows
# per program need 78 registers, no spills, and compile in ~1 s.
BM_SEARCH = 4

# ---------------------------------------------------------------- kernels, one per geometry


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
def _tensor_kernel(x_ptr, scale_ptr, codes_ptr, M, K, sxm, sxk, TM: tl.constexpr, TK: tl.constexpr,
                   ELEM: tl.constexpr):
    """Elementwise code(x / scale) with one FP32 scale for the whole tensor."""
    rows = tl.program_id(0) * TM + tl.arange(0, TM)
    cols = tl.program_id(1) * TK + tl.arange(0, TK)
    x, mask = _load_tile(x_ptr, rows, cols, M, K, sxm, sxk)
    scale = tl.load(scale_ptr)
    y = tl.math.div_rn(x, tl.broadcast_to(scale, x.shape))
    tl.store(codes_ptr + rows[:, None] * K + cols[None, :], _encode(y, ELEM), mask=mask)


@triton.jit
def _row_kernel(x_ptr, codes_ptr, scale_ptr, flag_ptr, M, K, sxm, sxk, TM: tl.constexpr, TK: tl.constexpr,
                ELEM: tl.constexpr, DIVISOR: tl.constexpr, CAP: tl.constexpr):
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
    scale = _f32_scale(amax, DIVISOR, MIN_SCALE, CAP)
    tl.store(scale_ptr + rows, scale, mask=rows < M)
    tl.store(flag_ptr + pm, bad)
    for k0 in range(0, K, TK):
        cols = k0 + tl.arange(0, TK)
        x, mask = _load_tile(x_ptr, rows, cols, M, K, sxm, sxk)
        y = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
        tl.store(codes_ptr + rows[:, None] * K + cols[None, :], _encode(y, ELEM), mask=mask)


@triton.jit
def _block_kernel(x_ptr, codes_ptr, scale_ptr, flag_ptr, N, K, NB, KB, sxb, sxn, sxk, B: tl.constexpr,
                  ELEM: tl.constexpr, DIVISOR: tl.constexpr, CAP: tl.constexpr):
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
    scale = _f32_scale(tl.max(tl.max(tl.abs(x), axis=1), axis=0), DIVISOR, MIN_SCALE, CAP)
    tl.store(scale_ptr + pb * KB + pk, scale)
    tl.store(flag_ptr + pb * KB + pk, _nonfinite(x))
    y = tl.math.div_rn(x, tl.broadcast_to(scale, x.shape))
    tl.store(codes_ptr + mat * N * K + rows[:, None] * K + cols[None, :], _encode(y, ELEM), mask=mask)


@triton.jit
def _group_kernel(x_ptr, codes_ptr, scale_ptr, s2_ptr, flag_ptr, w_ptr, M, K, sxm, sxk,
                  TM: tl.constexpr, TK: tl.constexpr, G: tl.constexpr, ELEM: tl.constexpr, BITS: tl.constexpr,
                  SCALE: tl.constexpr, EMAX: tl.constexpr, MAXV: tl.constexpr, RULE: tl.constexpr,
                  MAXBYTE: tl.constexpr, DIVISOR: tl.constexpr, CAP: tl.constexpr, MANT: tl.constexpr,
                  TINY: tl.constexpr, MAGIC: tl.constexpr, EPS: tl.constexpr, SEARCH: tl.constexpr,
                  WEIGHTED: tl.constexpr):
    """1 x G groups along K, one scale per group by the scale codec (E8M0 for MX, E4M3 times the
    FP32 global for NVFP4, the weight's dtype for INT4); 4-bit elements (BITS 4) are packed two
    per byte. SEARCH 1: the scale code of each group is searched around the absmax one
    (kernels/search.py), with per-column error weights from w_ptr when WEIGHTED."""
    pm = tl.program_id(0)
    pk = tl.program_id(1)
    rows = pm * TM + tl.arange(0, TM)
    cols = pk * TK + tl.arange(0, TK)
    x, mask = _load_tile(x_ptr, rows, cols, M, K, sxm, sxk)
    tl.store(flag_ptr + pm * tl.num_programs(1) + pk, _nonfinite(x))
    g = tl.reshape(x, [TM, TK // G, G])
    amax = tl.max(tl.abs(g), axis=2)
    scale_code, denom = _encode_scale(amax, s2_ptr, SCALE, EMAX, MAXV, RULE, MAXBYTE, DIVISOR, MIN_SCALE, CAP,
                                      MANT, TINY, MAGIC, EPS)
    if SEARCH:
        scale_code, denom = _searched_scale(g, scale_code, denom, s2_ptr, w_ptr, cols, K, TM, TK, G, ELEM, SCALE,
                                            MAXBYTE, WEIGHTED)
    y = tl.reshape(_scaled(g, tl.broadcast_to(denom[:, :, None], g.shape), SCALE, MANT, TINY, MAGIC), [TM, TK])
    srows = rows[:, None]
    scols = pk * (TK // G) + tl.arange(0, TK // G)[None, :]
    tl.store(scale_ptr + srows * (K // G) + scols, scale_code, mask=(srows < M) & (scols < K // G))
    if BITS == 4:
        packed = _pack_pairs(_encode(y, ELEM), TM, TK)
        pcols = pk * (TK // 2) + tl.arange(0, TK // 2)[None, :]
        tl.store(codes_ptr + srows * (K // 2) + pcols, packed, mask=(srows < M) & (pcols < K // 2))
    else:
        tl.store(codes_ptr + srows * K + cols[None, :], _encode(y, ELEM), mask=mask)


@triton.jit
def _dequant_kernel(codes_ptr, scale_ptr, s2_ptr, out_ptr, N, K, SN, SK, BR, BC,
                    TM: tl.constexpr, TK: tl.constexpr, ELEM: tl.constexpr, BITS: tl.constexpr,
                    SCALE: tl.constexpr):
    """out[b, r, c] = elem(codes) * scale[b, r // BR, c // BC], codecs by id (triton_codecs)."""
    b = tl.program_id(2)
    rows = tl.program_id(0) * TM + tl.arange(0, TM)
    cols = tl.program_id(1) * TK + tl.arange(0, TK)
    mask = (rows[:, None] < N) & (cols[None, :] < K)
    if BITS == 4:
        byte = tl.load(codes_ptr + b * N * (K // 2) + rows[:, None] * (K // 2) + cols[None, :] // 2,
                       mask=mask, other=0)
        values = _decode(tl.where((cols[None, :] % 2) == 0, byte & 0xF, byte >> 4), ELEM)
    else:
        values = _decode(tl.load(codes_ptr + b * N * K + rows[:, None] * K + cols[None, :], mask=mask, other=0),
                         ELEM)
    sidx = b * SN * SK + (rows[:, None] // BR) * SK + cols[None, :] // BC
    scale = _decode_scale(tl.load(scale_ptr + sidx, mask=mask, other=0), s2_ptr, SCALE)
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
    run(Launch(_amax_kernel, grid, (x2, partial, flags, m, k, x2.stride(0), x2.stride(1)), dict(TM=tm, TK=tk)))
    _check_flags(flags)
    return partial.amax()


def _single_level_f32(spec: QuantSpec) -> None:
    """What the tensor, row and block kernels implement: F32 scales, one code byte per element."""
    if spec.scale.triton_id != F32_SCALE.triton_id or spec.element.packed:
        raise NotImplementedError(f"Triton: the {spec.geometry} geometry takes the F32 scale codec and 8-bit "
                                  f"elements only, got {spec.scale.encoding} / {spec.element.name}; use backend torch")


def _cap(spec: QuantSpec) -> float:
    return FP32_MAX if spec.element.scale_cap is None else spec.element.scale_cap


def _tensor(x: torch.Tensor, spec: QuantSpec, s2) -> QuantResult:
    _single_level_f32(spec)
    scale = reference.f32_scale(tensor_amax(x), spec.element.scale_divisor, spec.element.scale_cap)
    x2 = _rows(x)
    m, k = x2.shape
    codes = torch.empty((m, k), dtype=torch.uint8, device=x.device)
    grid = (triton.cdiv(m, 64), triton.cdiv(k, 256))
    run(Launch(_tensor_kernel, grid, (x2, scale, codes, m, k, x2.stride(0), x2.stride(1)),
               dict(TM=64, TK=256, ELEM=spec.element.triton_id)))
    return QuantResult(codes.reshape(x.shape), scale)


def _row(x: torch.Tensor, spec: QuantSpec, s2) -> QuantResult:
    _single_level_f32(spec)
    x2 = _rows(x)
    m, k = x2.shape
    tm = 16
    codes = torch.empty((m, k), dtype=torch.uint8, device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    flags = torch.empty(triton.cdiv(m, tm), dtype=torch.int32, device=x.device)
    run(Launch(_row_kernel, (triton.cdiv(m, tm),), (x2, codes, scale, flags, m, k, x2.stride(0), x2.stride(1)),
               dict(TM=tm, TK=256, ELEM=spec.element.triton_id, DIVISOR=spec.element.scale_divisor,
                    CAP=_cap(spec))))
    _check_flags(flags)
    return QuantResult(codes.reshape(x.shape), scale.reshape(x.shape[:-1]))


def _block(x: torch.Tensor, spec: QuantSpec, s2) -> QuantResult:
    _single_level_f32(spec)
    *lead, n, k = x.shape
    x3 = x.reshape(-1, n, k)
    nmat = x3.shape[0]
    nb, kb = triton.cdiv(n, FP8_BLOCK), triton.cdiv(k, FP8_BLOCK)
    codes = torch.empty((nmat, n, k), dtype=torch.uint8, device=x.device)
    scale = torch.empty((nmat, nb, kb), dtype=torch.float32, device=x.device)
    flags = torch.empty(nmat * nb * kb, dtype=torch.int32, device=x.device)
    run(Launch(_block_kernel, (nmat * nb, kb),
               (x3, codes, scale, flags, n, k, nb, kb, x3.stride(0), x3.stride(1), x3.stride(2)),
               dict(B=FP8_BLOCK, ELEM=spec.element.triton_id, DIVISOR=spec.element.scale_divisor,
                    CAP=_cap(spec))))
    _check_flags(flags)
    return QuantResult(codes.reshape(x.shape), scale.reshape(*lead, nb, kb))


def _source_format(dtype: torch.dtype) -> dict:
    """The weight's float format, for the weight-dtype scale codec (triton_codecs._round_to_src):
    mantissa bits, smallest normal, the constant that rounds below it, and eps."""
    info = torch.finfo(dtype)
    mant = round(-math.log2(info.eps))  # BF16 7, FP16 10, FP32 23
    return dict(MANT=mant, TINY=info.tiny, MAGIC=info.tiny * 2.0 ** (23 - mant), EPS=info.eps)


def _codec_args(spec: QuantSpec, dtype: torch.dtype) -> dict:
    """The constexprs that select and parametrize the codecs' Triton twins in _group_kernel."""
    element = spec.element
    return dict(ELEM=element.triton_id, BITS=element.bits, SCALE=spec.scale.triton_id, EMAX=element.emax,
                MAXV=element.max, RULE=spec.scale_rule.triton_id if spec.scale_rule else 0,
                MAXBYTE=254 - element.emax, DIVISOR=element.scale_divisor, CAP=_cap(spec), **_source_format(dtype))


def _group(x: torch.Tensor, spec: QuantSpec, s2: torch.Tensor | None,
           channel_weight: torch.Tensor | None = None) -> QuantResult:
    x2 = _rows(x)
    m, k = x2.shape
    g, element = spec.group, spec.element
    search = spec.scale_search == "mse"
    tm = BM_SEARCH if search else BM
    codes = torch.empty((m, element.codes_cols(k)), dtype=torch.uint8, device=x.device)
    # Scales of the weight's dtype are written as FP32 and cast here (exact: the kernel rounds
    # them to that dtype): the interpreter's narrowing store flushes BF16 subnormals to zero.
    scale = torch.empty((m, k // g), dtype=spec.scale.raw_dtype_for(torch.float32), device=x.device)
    grid = (triton.cdiv(m, tm), triton.cdiv(k, BK))
    flags = torch.empty(grid[0] * grid[1], dtype=torch.int32, device=x.device)
    dummy = torch.zeros(1, dtype=torch.float32, device=x.device)
    weight = None if channel_weight is None else channel_weight.reshape(-1).to(x.device, torch.float32).contiguous()
    args = (x2, codes, scale, dummy if s2 is None else s2, flags, dummy if weight is None else weight, m, k,
            x2.stride(0), x2.stride(1))
    run(Launch(_group_kernel, grid, args, dict(
        TM=tm, TK=BK, G=g, **_codec_args(spec, x.dtype), SEARCH=search, WEIGHTED=weight is not None)))
    _check_flags(flags)
    lead = x.shape[:-1]
    scale = scale.to(spec.scale.raw_dtype_for(x.dtype))
    return QuantResult(codes.reshape(*lead, codes.shape[-1]), scale.reshape(*lead, k // g), s2)


LAUNCHERS = {TENSOR: _tensor, ROW: _row, BLOCK: _block, GROUP: _group}


def quantize(x: torch.Tensor, spec: QuantSpec, global_amax: torch.Tensor | None = None,
             channel_weight: torch.Tensor | None = None) -> QuantResult:
    if x.numel() == 0:
        return reference.empty_result(x, spec, global_amax)
    s2 = None
    if spec.scale.has_global:
        amax = tensor_amax(x) if global_amax is None else global_amax.to(x.device)
        s2 = spec.scale.global_scale(amax).reshape(())
    if spec.scale_search.active:
        return _group(x, spec, s2, channel_weight)
    return LAUNCHERS[spec.geometry](x, spec, s2)


def _dequant_grid(q: QuantResult, spec: QuantSpec, shape: tuple[int, ...]) -> tuple[int, int, int, int, int, int]:
    """(matrices, rows per matrix, block rows, block cols, scale rows, scale cols) for the kernel."""
    n, k = shape[-2], shape[-1]
    if spec.geometry == BLOCK:
        nmat = max(1, q.codes.numel() // (n * k))
        return nmat, n, FP8_BLOCK, FP8_BLOCK, q.scale.numel() // nmat // q.scale.shape[-1], q.scale.shape[-1]
    rows = q.codes.numel() * 8 // spec.element.bits // k
    if spec.geometry == TENSOR:
        return 1, rows, rows, k, 1, 1
    if spec.geometry == ROW:
        return 1, rows, 1, k, q.scale.numel(), 1
    return 1, rows, 1, spec.group, q.scale.numel() // q.scale.shape[-1], q.scale.shape[-1]


def dequantize(q: QuantResult, spec: QuantSpec, shape: tuple[int, ...]) -> torch.Tensor:
    if len(shape) == 0 or 0 in shape:
        return reference.dequantize(q, spec, shape)
    k = shape[-1]
    nmat, rows, br, bc, sn, sk = _dequant_grid(q, spec, shape)
    out = torch.empty((nmat, rows, k), dtype=torch.float32, device=q.codes.device)
    s2 = q.global_scale if q.global_scale is not None else torch.zeros((), device=q.codes.device)
    grid = (triton.cdiv(rows, 32), triton.cdiv(k, 128), nmat)
    scale = q.scale.to(spec.scale.raw_dtype_for(torch.float32)).contiguous()  # BF16 / FP16 scales as FP32 (exact)
    run(Launch(_dequant_kernel, grid, (q.codes.contiguous(), scale, s2.to(torch.float32), out, rows, k, sn, sk, br, bc),
               dict(TM=32, TK=128, ELEM=spec.element.triton_id, BITS=spec.element.bits,
                    SCALE=spec.scale.triton_id)))
    return out.reshape(shape)


def launches(x: torch.Tensor, spec: QuantSpec, global_amax: torch.Tensor | None = None,
             channel_weight: torch.Tensor | None = None) -> list[Launch]:
    """The kernel launches `quantize(x, spec, global_amax, channel_weight)` and the dequantize of
    its result make, recorded rather than run (x: a small CPU tensor of the dtype and layout
    to check). tests/test_kernels_compile.py compiles these for GPU targets."""
    with recording() as made:
        q = quantize(x, spec, global_amax, channel_weight)
        dequantize(q, spec, tuple(x.shape))
    return made
