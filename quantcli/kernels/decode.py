"""Decoding a band of rows into an FP32 buffer: reference.dequantize's values, bit for bit, at a
fraction of its cost on the CPU.

The element codecs decode E2M1 codes through a long-index gather and E4M3 codes through
PyTorch's FP8 cast, both slow on the CPU (tens of ns per element: most of what verify spent
decoding). Here one 256-entry table per byte does it, built from the codec's own decode: a byte
of two 4-bit codes (E2M1, INT4) indexes a table of int64 words, each the two FP32 values of its
nibbles (low nibble first, as a little-endian int64 reads them), an 8-bit code a table of FP32
values (E4M3 NaN for 0x7F / 0xFF, as the cast gives). Then the same multiply by the same FP32
scale as the reference, so the values are the reference's bits (tests/test_cpu_kernels.py).
`bands` yields the rows of a quantized tensor that whole blocks cover, so a caller can decode a
tensor a band at a time on the chunk pool.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from quantcli.kernels import reference as R
from quantcli.kernels.chunks import band_rows
from quantcli.kernels.spec import BLOCK, E4M3, FP8_BLOCK, GROUP, ROW, TENSOR, ElementCodec, QuantResult, QuantSpec

CHUNK = 1 << 20  # elements per band, as the quantizer's (kernels/cpu.py)


@functools.cache
def _table(element: ElementCodec, device: torch.device) -> torch.Tensor:
    """Byte -> its value(s): FP32 for an 8-bit code, an int64 holding two FP32 for two 4-bit codes."""
    byte = torch.arange(256, dtype=torch.uint8)
    if not element.packed:
        return element.decode(byte).to(device)
    pairs = element.decode(byte.view(256, 1)).contiguous()  # [256, 2] FP32
    return pairs.view(torch.int64).reshape(256).to(device)


def decode_values(codes: torch.Tensor, element: ElementCodec, out: torch.Tensor,
                  index: torch.Tensor | None = None) -> None:
    """Element values of `codes` (uint8, [rows, packed cols]) into the FP32 `out` [rows, K].
    `index`: an int32 scratch of codes.numel() elements (allocated when None)."""
    flat = codes.reshape(-1)
    if element.packed and sys.byteorder != "little":
        out.view(-1).copy_(element.decode(flat))
        return
    idx = torch.empty(flat.numel(), dtype=torch.int32, device=codes.device) if index is None else index
    idx.copy_(flat)
    target = out.view(-1).view(torch.int64) if element.packed else out.view(-1)
    torch.index_select(_table(element, codes.device), 0, idx, out=target)


def scale_values(scale: torch.Tensor, global_scale: torch.Tensor | None, spec: QuantSpec) -> torch.Tensor:
    """The scale codec's decode, E4M3 block scales through the table (the same FP32 values)."""
    if spec.scale.encoding == "e4m3fn":
        values = torch.index_select(_table(E4M3, scale.device), 0, scale.reshape(-1).to(torch.int32))
        return values.view(scale.shape) * global_scale.to(torch.float32)
    return spec.scale.decode(scale, global_scale)


def apply_scale(out: torch.Tensor, scale: torch.Tensor, spec: QuantSpec) -> None:
    """`out` [rows, K] element values times their block's FP32 scale, in place (the reference's
    one multiply per element, so the same bits)."""
    rows, k = out.shape
    if spec.geometry == TENSOR:
        out.mul_(scale)
    elif spec.geometry == ROW:
        out.mul_(scale.reshape(rows, 1))
    elif spec.geometry == GROUP:
        out.view(rows, k // spec.group, spec.group).mul_(scale.reshape(rows, -1, 1))
    elif rows % FP8_BLOCK == 0 and k % FP8_BLOCK == 0:
        out.view(rows // FP8_BLOCK, FP8_BLOCK, k // FP8_BLOCK, FP8_BLOCK).mul_(
            scale.reshape(rows // FP8_BLOCK, 1, k // FP8_BLOCK, 1))
    else:  # a ragged edge: the reference's expansion
        out.mul_(R._expand_blocks(scale.reshape(-(-rows // FP8_BLOCK), -(-k // FP8_BLOCK)), rows, k))


@dataclass(frozen=True)
class Band:
    """Rows `start:stop` of matrix `matrix` (an [N, K] slice of the `[..., N, K]` tensor), whole
    blocks of its scale geometry; `codes` and `scale` are that band's slices of the result."""

    matrix: int
    start: int
    stop: int
    codes: torch.Tensor
    scale: torch.Tensor


def bands(q: QuantResult, spec: QuantSpec, shape: tuple[int, ...], elements: int | None = None,
          tall: int | None = None) -> Iterator[Band]:
    """The bands of about `elements` (CHUNK) elements that cover `q`, matrix by matrix, rows in
    order; each a whole number of `tall` rows (default: 128 for the block geometry, else 1)."""
    *lead, n, k = shape
    tall = tall or (FP8_BLOCK if spec.geometry == BLOCK else 1)
    step = band_rows(k, tall, elements or CHUNK)
    for m in range(math.prod(lead)):
        for i in range(0, n, step):
            yield band_of(q, spec, shape, m, i, min(n, i + step))


def band_of(q: QuantResult, spec: QuantSpec, shape: tuple[int, ...], m: int, i: int, j: int) -> Band:
    """Rows i:j of matrix m of `q` (i and j on block boundaries)."""
    *lead, n, k = shape
    matrices = math.prod(lead)
    scale = _matrix_scale(q.scale, spec, matrices, n, k, m)
    return Band(m, i, j, q.codes.reshape(matrices, n, -1)[m, i:j], _band_scale(scale, spec, i, j))


def _matrix_scale(scale: torch.Tensor, spec: QuantSpec, matrices: int, n: int, k: int, m: int) -> torch.Tensor:
    if spec.geometry == TENSOR:
        return scale
    if spec.geometry == ROW:
        return scale.reshape(matrices, n)[m]
    if spec.geometry == GROUP:
        return scale.reshape(matrices, n, -1)[m]
    return scale.reshape(matrices, -(-n // FP8_BLOCK), -(-k // FP8_BLOCK))[m]


def _band_scale(scale: torch.Tensor, spec: QuantSpec, i: int, j: int) -> torch.Tensor:
    if spec.geometry == TENSOR:
        return scale
    if spec.geometry == BLOCK:
        return scale[i // FP8_BLOCK:-(-j // FP8_BLOCK)]
    return scale[i:j]


def decode_band(band: Band, global_scale, spec: QuantSpec, out: torch.Tensor, index=None) -> torch.Tensor:
    """The band's FP32 values into `out` [rows, K]; returns `out`."""
    decode_values(band.codes, spec.element, out, index)
    apply_scale(out, scale_values(band.scale, global_scale, spec), spec)
    return out
