"""The CPU quantizer: reference.py's arithmetic, op for op, without temporaries.

reference.py defines every byte. Run as written on the CPU, its functional style (every op
returns a new tensor) costs more in memory than in arithmetic: each FP32 temporary of a chunk is
a fresh allocation, which glibc often maps anew and the kernel zeroes and page-faults in, and an
E2M1 encode makes a dozen of them. Here each thread keeps one workspace for a chunk of rows, every
op writes into it (`out=` and in-place methods), and each chunk writes its codes and scales
straight into slices of the output, so nothing is joined or copied afterwards.

The same ops, in the same order, on the same FP32 operands, give the same bits; the two places
written differently say why they are equal. tests/test_cpu_kernels.py compares every recipe
against reference.quantize on ordinary, edge (zeros, subnormals, ties, huge, saturating) and
odd-shaped inputs, expert stacks and strided views.
"""

from __future__ import annotations

import math
import sys
import threading

import torch
import torch.nn.functional as F

from quantcli.kernels import reference as R
from quantcli.kernels.chunks import _map, band_rows
from quantcli.kernels.decode import bands, decode_band
from quantcli.kernels.elements import encode_e2m1_into
from quantcli.kernels.spec import BLOCK, FP8_BLOCK, GROUP, TENSOR, ElementCodec, QuantResult, QuantSpec

# Elements per chunk. Smaller chunks stay in cache but cost more per element: every op of a chunk
# is a Python call that takes the GIL, which two chunk threads then pass back and forth, and the
# ~20 ops of an E2M1 chunk pay it each time. 2^20 (four 4 MiB buffers a thread) was fastest of
# 2^17..2^20 on a 2-core CPU for every recipe (`python scripts/bench_kernels.py --cpu --chunks
# 17,18,19,20`: NVFP4 82, 45, 31, 29 ms for 4096 x 4096 on 2 threads; the reference 43 ms).
CHUNK = 1 << 20



class _Workspace(threading.local):
    """Per-thread flat buffers, grown on demand, handed out as views of the size asked."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < numel:
            buf = self.buffers[name] = torch.empty(numel, dtype=torch.int32)
        return buf[:numel].view(dtype)


_WS = _Workspace()


# ---------------------------------------------------------------- element encoders, in place


def _encode_e2m1(mag: torch.Tensor, signed: torch.Tensor, codes: torch.Tensor) -> None:
    """The E2M1 codec's in-place encoder on this thread's workspace (tests call it directly)."""
    encode_e2m1_into(mag, signed, codes, _WS.get)


def _encode(f: torch.Tensor, element: ElementCodec, codes: torch.Tensor) -> None:
    """element.encode(f) into the uint8 `codes`, in place (`f` overwritten). A sign-magnitude
    codec (E2M1) encodes |f| with f's signs; group chunks hand it the magnitudes they already
    have (see _group_chunk)."""
    element.encode_into(f.abs() if element.sign_magnitude else f, f, codes, _WS.get)


def _load(x: torch.Tensor) -> torch.Tensor:
    """The chunk `x` upcast to FP32 in the workspace (the reference's `.to(torch.float32)`)."""
    f = _WS.get("f", x.numel(), torch.float32).view(x.shape)
    return f.copy_(x)


def _abs(f: torch.Tensor) -> torch.Tensor:
    """|f| in the workspace."""
    return torch.abs(f, out=_WS.get("m", f.numel(), torch.float32).view(f.shape))


# ---------------------------------------------------------------- one chunk, per geometry


def _group_chunk(x, spec: QuantSpec, s2, codes, scale) -> None:
    rows, k = x.shape
    f = _load(x)
    mag = _abs(f)
    amax = R._check_finite(F.max_pool1d(mag.unsqueeze(1), spec.group).squeeze(1))
    stored, denom = R.encode_scale(amax, spec, s2, x.dtype)
    scale.copy_(stored)
    element = spec.element
    scaled = mag if element.sign_magnitude else f  # E2M1 scales |x| (here for the amax), keeps x's signs
    groups = scaled.view(rows, k // spec.group, spec.group)
    torch.div(groups, denom.unsqueeze(-1), out=groups)
    spec.scale.round_quotient_(scaled, x.dtype)
    element.encode_into(scaled, f, codes, _WS.get)


def _row_chunk(x, spec: QuantSpec, s2, codes, scale) -> None:
    f = _load(x)
    amax = R._check_finite(torch.amax(_abs(f), dim=-1))
    stored, denom = R.encode_scale(amax, spec, s2, x.dtype)
    scale.copy_(stored)
    f.div_(denom.unsqueeze(-1))
    _encode(spec.scale.round_quotient_(f, x.dtype), spec.element, codes)


def _tensor_chunk(x, spec: QuantSpec, denom, codes) -> None:
    f = _load(x)
    f.div_(denom)
    _encode(spec.scale.round_quotient_(f, x.dtype), spec.element, codes)


def _block_chunk(x, spec: QuantSpec, s2, codes, scale) -> None:
    """Bands of whole 128-row tiles. A ragged edge (rows or K not a multiple of 128) takes the
    reference's padded path: rare, and padding is what makes its edge amaxes right."""
    n, k = x.shape
    if n % FP8_BLOCK or k % FP8_BLOCK:
        r = R._block_chunk(x.to(torch.float32), spec, s2, x.dtype)
        codes.copy_(r.codes)
        scale.copy_(r.scale)
        return
    nb, kb = n // FP8_BLOCK, k // FP8_BLOCK
    f = _load(x)
    amax = R._check_finite(_abs(f).view(nb, FP8_BLOCK, kb, FP8_BLOCK).amax(dim=(-3, -1)))
    stored, denom = R.encode_scale(amax, spec, s2, x.dtype)
    scale.copy_(stored)
    f.view(nb, FP8_BLOCK, kb, FP8_BLOCK).div_(denom.view(nb, 1, kb, 1))
    _encode(spec.scale.round_quotient_(f, x.dtype), spec.element, codes)


# ---------------------------------------------------------------- entry points


def _bands(rows: int, cols: int, band: int) -> list[tuple[int, int]]:
    """Row ranges of about CHUNK elements, each a whole number of `band` rows."""
    step = band_rows(cols, band, CHUNK)
    return [(i, min(rows, i + step)) for i in range(0, rows, step)]


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """reference.tensor_amax, one aminmax per chunk on the worker threads: a max of maxes is
    the max, and NaN propagates through both."""
    if x.numel() == 0 or x.dim() < 2:
        return R.tensor_amax(x)
    rows = x.reshape(-1, x.shape[-1])

    def band(r: tuple[int, int]) -> torch.Tensor:
        lo, hi = torch.aminmax(rows[r[0]:r[1]])
        return torch.maximum(-lo, hi)

    parts = list(_map(band, _bands(rows.shape[0], rows.shape[1], 1)))
    return R._check_finite(torch.stack(parts).max().to(torch.float32))


def quantize(x: torch.Tensor, spec: QuantSpec, global_amax: torch.Tensor | None = None) -> QuantResult:
    """reference.quantize, byte for byte, for a CPU tensor."""
    if x.numel() == 0 or x.dim() < 2 or sys.byteorder != "little":
        return R.quantize(x, spec, global_amax)
    s2 = None
    if spec.scale.has_global:
        s2 = spec.scale.global_scale(tensor_amax(x) if global_amax is None else global_amax)
    codes = torch.empty(spec.codes_shape(tuple(x.shape)), dtype=torch.uint8)
    k = x.shape[-1]
    if spec.geometry == TENSOR:
        stored, denom = R.encode_scale(tensor_amax(x), spec, s2, x.dtype)
        _run(lambda r, c, _: _tensor_chunk(r, spec, denom, c), x.reshape(-1, k), codes.reshape(-1, codes.shape[-1]))
        return QuantResult(codes, stored, s2)
    scale = torch.empty(spec.scale_shape(tuple(x.shape)), dtype=spec.scale.raw_dtype_for(x.dtype))
    if spec.geometry == BLOCK:  # one expert matrix at a time: tiles never cross two
        n = x.shape[-2]
        for xe, ce, se in zip(x.reshape(-1, n, k), codes.reshape(-1, n, codes.shape[-1]),
                              scale.reshape(-1, *scale.shape[-2:])):
            _run(lambda r, c, s: _block_chunk(r, spec, s2, c, s), xe, ce, se, FP8_BLOCK)
        return QuantResult(codes, scale, s2)
    chunk = _group_chunk if spec.geometry == GROUP else _row_chunk
    per_row = scale.reshape(-1, scale.shape[-1]) if spec.geometry == GROUP else scale.reshape(-1)
    _run(lambda r, c, s: chunk(r, spec, s2, c, s), x.reshape(-1, k), codes.reshape(-1, codes.shape[-1]), per_row)
    return QuantResult(codes, scale, s2)


def _run(fn, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor | None = None, band: int = 1) -> None:
    """`fn(x rows, codes rows, scale rows)` on each band of `x [R, K]`, on the worker threads.
    Scale rows: one per row, or one per `band` rows for the block geometry."""
    def one(r: tuple[int, int]) -> None:
        i, j = r
        s = None if scale is None else scale[i // band:-(-j // band)]
        fn(x[i:j], codes[i:j], s)

    for _ in _map(one, _bands(x.shape[0], x.shape[1], band)):
        pass


def dequantize(q: QuantResult, spec: QuantSpec, shape: tuple[int, ...]) -> torch.Tensor:
    """reference.dequantize, bit for bit, a band of rows at a time on the worker threads, each
    decoded through kernels/decode.py's byte tables straight into its rows of the output."""
    if math.prod(shape) == 0 or q.codes.device.type != "cpu":
        return R.dequantize(q, spec, tuple(shape))
    out = torch.empty(tuple(shape), dtype=torch.float32)
    rows = out.view(-1, shape[-2], shape[-1])

    def one(band) -> None:
        decode_band(band, q.global_scale, spec, rows[band.matrix, band.start:band.stop])

    for _ in _map(one, list(bands(q, spec, tuple(shape)))):
        pass
    return out
