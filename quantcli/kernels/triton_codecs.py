"""Triton device functions: the element and scale codecs the kernels in triton_quant.py take as
parameters. Each is the bit-exact twin of a codec's torch arithmetic (kernels/elements.py,
kernels/scales.py; see the rules in triton_quant.py's docstring: `div_rn` for every division,
integer bit math for every encoding).

Triton kernels cannot take the codec objects, so each role has one function with one signature
(`_encode`, `_decode`, `_encode_scale`, `_scaled`, `_decode_scale`, `_searched_scale`) and the
codec's `triton_id`, a constexpr, selects its twin inside it: ELEM 0 = E4M3, 1 = E2M1, 2 = INT8,
3 = INT4 (4-bit codes come back one per byte and are packed by the kernel); SCALE 0 = F32,
1 = E8M0 byte, 2 = E4M3 byte times the FP32 global, 3 = the weight's dtype; RULE is the
ScaleRule's `triton_id`. The weight's float format enters as MANT (mantissa bits), TINY (its
smallest normal), MAGIC (TINY * 2^(23 - MANT)) and EPS (triton_quant._source_format).
"""

from __future__ import annotations

import triton
import triton.language as tl


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
def _e8m0_byte(amax, EMAX: tl.constexpr, MAXV: tl.constexpr, rule):
    """`rule` (RULE_IDS) is a runtime scalar, not a constexpr: one compiled kernel serves all
    three rules (a uniform branch per tile), a third of the variants to JIT-compile and check."""
    bits = amax.to(tl.int32, bitcast=True)
    if rule == 0:
        biased = (bits >> 23) - EMAX
    elif rule == 1:
        biased = ((bits + (1 << 21)) >> 23) - EMAX
    else:
        q = tl.math.div_rn(amax, tl.full(amax.shape, MAXV, tl.float32)).to(tl.int32, bitcast=True)
        biased = (q + 0x7FFFFF) >> 23
    return tl.minimum(tl.maximum(biased, 0), 254)


@triton.jit
def _e8m0_to_float(byte):
    return tl.where(byte == 0, 0x00400000, byte << 23).to(tl.float32, bitcast=True)


@triton.jit
def _round_int(v, LO: tl.constexpr, HI: tl.constexpr):
    """FP32 -> int32: clamp to [LO, HI], round half to even (elements.encode_int). The FP32 ->
    int32 cast truncates toward zero; the remainder is exact below 2^23."""
    c = tl.minimum(tl.maximum(v, LO), HI)
    t = c.to(tl.int32)
    frac = tl.abs(c - t.to(tl.float32))
    up = (frac > 0.5) | ((frac == 0.5) & ((t & 1) != 0))
    return t + tl.where(up, tl.where(c < 0.0, -1, 1), 0)


@triton.jit
def _encode(y, ELEM: tl.constexpr):
    """Scaled FP32 -> one code byte per element (4-bit codes as nibbles, packed by the caller)."""
    if ELEM == 1:
        return _encode_e2m1(y)
    elif ELEM == 2:
        return (_round_int(y, -128.0, 127.0) & 0xFF).to(tl.uint8)
    elif ELEM == 3:
        return (_round_int(y, -8.0, 7.0) + 8).to(tl.uint8)  # offset binary
    else:
        return _encode_e4m3(y)


@triton.jit
def _decode(c, ELEM: tl.constexpr):
    """One code byte (a nibble for 4-bit codes) -> FP32."""
    if ELEM == 1:
        return _decode_e2m1(c)
    elif ELEM == 2:
        c = c.to(tl.int32)
        return tl.where(c >= 128, c - 256, c).to(tl.float32)
    elif ELEM == 3:
        return (c.to(tl.int32) - 8).to(tl.float32)
    else:
        return _decode_e4m3(c)


@triton.jit
def _round_to_src(v, MANT: tl.constexpr, TINY: tl.constexpr, MAGIC: tl.constexpr):
    """scales.round_to_dtype: FP32 rounded (RNE) to the weight's float format, kept in FP32. At
    or above TINY by bits: add half an ulp less one plus the kept LSB, drop the low bits (a carry
    moves into the exponent); below it the format's step is TINY * 2^-MANT, and adding and
    subtracting MAGIC (whose FP32 ulp is that step) rounds to it."""
    if MANT >= 23:
        return v
    else:
        bits = v.to(tl.int32, bitcast=True)
        kept = (bits >> (23 - MANT)) & 1
        normal = ((bits + ((1 << (22 - MANT)) - 1) + kept) & -(1 << (23 - MANT))).to(tl.float32, bitcast=True)
        a = tl.abs(v)
        sub = (a + MAGIC) - MAGIC
        sub = tl.where(bits < 0, -sub, sub)  # the sign bit: -0.0 stays -0.0
        return tl.where(a < TINY, sub, normal)


@triton.jit
def _f32_scale(amax, DIVISOR: tl.constexpr, MIN_SCALE: tl.constexpr, CAP: tl.constexpr):
    """reference.f32_scale: amax / DIVISOR, at least MIN_SCALE (smallest normal FP32), at most
    CAP (FP32 max where no cap applies: a no-op for a finite scale), 1.0 for 0."""
    scale = tl.math.div_rn(amax, tl.full(amax.shape, DIVISOR, tl.float32))
    return tl.where(amax == 0.0, 1.0, tl.minimum(tl.maximum(scale, MIN_SCALE), CAP))


@triton.jit
def _encode_scale(amax, s2_ptr, SCALE: tl.constexpr, EMAX: tl.constexpr, MAXV: tl.constexpr,
                  RULE: tl.constexpr, MAXBYTE: tl.constexpr, DIVISOR: tl.constexpr, MIN_SCALE: tl.constexpr,
                  CAP: tl.constexpr, MANT: tl.constexpr, TINY: tl.constexpr, MAGIC: tl.constexpr,
                  EPS: tl.constexpr):
    """The scale codec's encode: block amax -> (the stored scale, the FP32 divisor)."""
    if SCALE == 2:  # ModelOpt's order: 6 * s2 first, then the division
        s2 = tl.load(s2_ptr)
        block = tl.math.div_rn(amax, tl.full(amax.shape, MAXV, tl.float32) * s2)
        block = tl.where(block == 0.0, 1.0, block)
        code = _encode_e4m3(tl.minimum(tl.maximum(block, 0.001953125), 448.0))
        return code, _decode_e4m3(code) * s2
    elif SCALE == 1:  # saturate at the largest byte whose codes all decode finitely
        byte = tl.minimum(_e8m0_byte(amax, EMAX, MAXV, RULE), MAXBYTE)
        return byte.to(tl.uint8), _e8m0_to_float(byte)
    elif SCALE == 3:  # compressed-tensors: amax / 7.5 in the weight's dtype, 0 -> its eps
        scale = tl.minimum(tl.math.div_rn(amax, tl.full(amax.shape, DIVISOR, tl.float32)), CAP)
        scale = _round_to_src(scale, MANT, TINY, MAGIC)
        scale = tl.where(scale == 0.0, EPS, scale)
        return scale, scale
    else:
        scale = _f32_scale(amax, DIVISOR, MIN_SCALE, CAP)
        return scale, scale


@triton.jit
def _scaled(x, denom, SCALE: tl.constexpr, MANT: tl.constexpr, TINY: tl.constexpr, MAGIC: tl.constexpr):
    """The scale codec's scaled: x / denom, rounded to the weight's dtype for SCALE 3."""
    y = tl.math.div_rn(x, denom)
    if SCALE == 3:
        y = _round_to_src(y, MANT, TINY, MAGIC)
    return y


@triton.jit
def _decode_scale(raw, s2_ptr, SCALE: tl.constexpr):
    """The scale codec's decode: stored scales -> FP32 multipliers."""
    if SCALE == 1:
        return _e8m0_to_float(raw.to(tl.int32))
    elif SCALE == 2:
        return _decode_e4m3(raw) * tl.load(s2_ptr)
    else:
        return raw.to(tl.float32)


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




# ---------------------------------------------------------------- scale search (kernels/search.py)


@triton.jit
def _on_grid(y, ELEM: tl.constexpr):
    """search.on_grid: the element magnitude nearest y >= 0 (E2M1 ties up; E4M3 RNE)."""
    if ELEM == 1:
        inv = tl.where(y < 2.0, 2.0, tl.where(y < 4.0, 1.0, 0.5))
        r = tl.math.div_rn(tl.floor(y * inv + 0.5), inv)
        return tl.minimum(r, 6.0)
    else:
        return _decode_e4m3(_encode_e4m3(y))


@triton.jit
def _halves_sum(e, TM: tl.constexpr, NG: tl.constexpr, G: tl.constexpr):
    """search.halves_sum over the last dim of [TM, NG, G] (G 16 or 32): e[:h] + e[h:] until one."""
    if G == 32:
        e = tl.sum(tl.reshape(e, [TM, NG, 2, 16]), axis=2)
    e = tl.sum(tl.reshape(e, [TM, NG, 2, 8]), axis=2)
    e = tl.sum(tl.reshape(e, [TM, NG, 2, 4]), axis=2)
    e = tl.sum(tl.reshape(e, [TM, NG, 2, 2]), axis=2)
    return tl.sum(e, axis=2)


@triton.jit
def _block_error(ax, den, w, ELEM: tl.constexpr, WEIGHTED: tl.constexpr, TM: tl.constexpr, NG: tl.constexpr,
                 G: tl.constexpr):
    """search.block_error: squared error per block of magnitudes ax [TM, NG, G] with divisors den [TM, NG]."""
    dd = tl.broadcast_to(den[:, :, None], ax.shape)
    d = _on_grid(tl.math.div_rn(ax, dd), ELEM) * dd - ax
    e = d * d
    if WEIGHTED:
        e = e * tl.broadcast_to(w[None, :, :], e.shape)
    return _halves_sum(e, TM, NG, G)


@triton.jit
def _searched_scale(g, code0, den0, s2_ptr, w_ptr, cols, K, TM: tl.constexpr, TK: tl.constexpr, G: tl.constexpr,
                    ELEM: tl.constexpr, SCALE: tl.constexpr, MAXBYTE: tl.constexpr, WEIGHTED: tl.constexpr):
    """search.search_codes: the absmax code, then each step of the scale codec's window in order
    (scales.py `search_window`, `code_range`, `decode_code`); strictly smaller wins."""
    ax = tl.abs(g)
    w = 0.0
    if WEIGHTED:
        w = tl.reshape(tl.load(w_ptr + cols, mask=cols < K, other=0.0), [TK // G, G])
    best = code0.to(tl.int32)
    base = best
    best_den = den0
    best_err = _block_error(ax, den0, w, ELEM, WEIGHTED, TM, TK // G, G)
    NCAND: tl.constexpr = 10 if SCALE == 2 else 2
    for i in tl.static_range(NCAND):
        if SCALE == 2:  # E4M3: -3, -2, -1, 1, ..., 7
            cand = base + (i - 3 if i < 3 else i - 2)
            lo, hi = 1, 126
        else:  # E8M0: +1, -1
            cand = base + (1 if i == 0 else -1)
            lo, hi = 0, MAXBYTE
        valid = (cand >= lo) & (cand <= hi)
        cand = tl.minimum(tl.maximum(cand, lo), hi)
        if SCALE == 2:
            den = _decode_e4m3(cand) * tl.load(s2_ptr)
        else:
            den = _e8m0_to_float(cand)
        err = _block_error(ax, den, w, ELEM, WEIGHTED, TM, TK // G, G)
        better = valid & (err < best_err)
        best_err = tl.where(better, err, best_err)
        best = tl.where(better, cand, best)
        best_den = tl.where(better, den, best_den)
    return best.to(tl.uint8), best_den
