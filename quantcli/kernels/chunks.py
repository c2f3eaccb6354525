"""Quantizing a tensor in bands of whole rows: bounded FP32 temporaries whatever the tensor, and
on the CPU several bands at once on a small thread pool (cpu_workers). Every block lies inside
one band, so neither the banding nor the thread a band runs on changes a byte."""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar

import torch

from quantcli.kernels.spec import QuantResult

# Rows are quantized in chunks of about this many elements: big enough to amortize torch's
# per-op overhead, small enough that the FP32 temporaries stay a few MB whatever the tensor
# (2^20 was fastest of 2^16..2^21 on a 2-core CPU, scripts/bench_convert.py). Every block lies
# inside one chunk (chunks hold whole rows, and whole 128-row bands for the block geometry), so
# chunking never changes a byte.
CHUNK_ELEMENTS = 1 << 20


# Set by cpu_workers(): chunks of one tensor run on this pool, each worker running torch
# single-threaded. Chunks are independent, so they overlap without OpenMP's barrier after every
# op, which on a busy 2-core machine spins away most of the CPU (measured: 48 s user for 5 s of
# work when the machine was shared) and which the shard writer's thread also has to fight.
_POOL: ContextVar[ThreadPoolExecutor | None] = ContextVar("quantcli_chunk_pool", default=None)


@contextlib.contextmanager
def cpu_workers(n: int):
    """Within the block, quantize CPU chunks on `n` threads with torch's intra-op threads at 1
    (restored after). n = 1: plain single-threaded torch. Bytes never change: each chunk's result
    is the same whichever thread computes it, and they are joined in order."""
    previous = torch.get_num_threads()
    pool = ThreadPoolExecutor(n, thread_name_prefix="quantcli-chunk") if n > 1 else None
    token = _POOL.set(pool)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        _POOL.reset(token)
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        torch.set_num_threads(previous)


def _map(fn, items: list):
    """`fn` over `items`, results in order (an iterator: each is consumed as it is ready)."""
    pool = _POOL.get()
    if pool is None or len(items) < 2:
        return map(fn, items)
    return pool.map(in_callers_mode(fn), items)


def in_callers_mode(fn):
    """`fn`, run in the calling thread's inference mode on whichever thread runs it. Inference
    mode is per thread: a caller in it (the layer walk's weight pass) hands the workers inference
    tensors, which they may only update in place inside it too."""
    inference = torch.is_inference_mode_enabled()

    def run(*args):
        with torch.inference_mode(inference):
            return fn(*args)

    return run


def band_rows(cols: int, band: int, elements: int) -> int:
    """Rows per chunk: about `elements` elements, a whole number of `band` rows (at least one band)."""
    return max(band, elements // max(band * cols, 1) * band)


def _chunked(x: torch.Tensor, band: int, fn) -> QuantResult:
    """Apply `fn` to bands of whole rows (`band` rows at a time, e.g. 128 for the block geometry)
    and join. Row-wise geometries (band 1) see `[rows, K]` with leading dims flattened; the block
    geometry sees one expert matrix at a time."""
    *lead, n, k = x.shape
    if band > 1 and lead:
        parts = [_chunked(m, band, fn) for m in x.reshape(-1, n, k)]
        if not parts:
            return fn(x)
        r = _join(parts, torch.stack)
        return QuantResult(r.codes.reshape(x.shape), r.scale.reshape(*lead, *r.scale.shape[1:]), r.global_scale)
    rows = x.reshape(-1, k) if band == 1 else x
    step = band_rows(k, band, CHUNK_ELEMENTS)
    r = fn(rows) if rows.shape[0] <= step else _gather(fn, rows, step, band)
    if band == 1:
        scale = r.scale if r.scale.dim() == 0 else r.scale.reshape(*lead, n, *r.scale.shape[1:])
        r = QuantResult(r.codes.reshape(*lead, n, r.codes.shape[-1]), scale, r.global_scale)
    return r


def _gather(fn, rows: torch.Tensor, step: int, band: int) -> QuantResult:
    """`fn` on each band of `step` rows, each result copied into one output as it arrives: no
    list of parts and no cat (a second copy of the codes), and no small long-lived parts left
    between freed temporaries in malloc's heap, which kept the peak RSS far above the floor's."""
    n = rows.shape[0]
    starts = range(0, n, step)
    codes = scale = first = None
    scale_at = 0
    for i, part in zip(starts, _map(fn, [rows[i:i + step] for i in starts])):
        if first is None:
            first = part
            codes = part.codes.new_empty((n, *part.codes.shape[1:]))
            if part.scale.dim():
                scale = part.scale.new_empty((-(-n // band), *part.scale.shape[1:]))
        codes[i:i + part.codes.shape[0]] = part.codes
        if scale is not None:
            scale[scale_at:scale_at + part.scale.shape[0]] = part.scale
            scale_at += part.scale.shape[0]
    return QuantResult(codes, first.scale if scale is None else scale, first.global_scale)


def _join(parts: list[QuantResult], join) -> QuantResult:
    scales = [p.scale for p in parts]
    scale = scales[0] if scales[0].dim() == 0 else join(scales)
    return QuantResult(join([p.codes for p in parts]), scale, parts[0].global_scale)
