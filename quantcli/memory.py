"""Keeping freed tensor memory from staying in the process (glibc only; elsewhere no-ops).

glibc serves a large allocation with its own mmap and unmaps it on free, but after such a free
it raises its mmap threshold (up to 32 MiB on 64-bit), so later allocations of that size come
from the heap or a thread's arena, where freed blocks stay resident as fragments. Two jobs
suffer, and each gets the remedy that costs it least:

- calibration allocates and frees a decoder layer's tensors, layer after layer: memory grew by
  ~39 MiB per layer (hidden 1024) although nothing was alive, and is flat with the threshold
  fixed (`fix_mmap_threshold`, which turns the adjustment off);
- convert frees a tensor's FP32 temporaries (several threads) thousands of times: returning the
  free pages after each tensor (`release_freed_memory`, malloc_trim) keeps its peak below that
  of loading whole shards (fp8-block, 0.72 GB: 611 -> 581 MB) without making every allocation
  a fresh mapping.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
THRESHOLD = 128 * 1024  # glibc's own starting value: tensors above it get their own mapping


@functools.cache
def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


@functools.cache
def fix_mmap_threshold() -> bool:
    """True when glibc accepted the fixed threshold."""
    mallopt = getattr(_libc(), "mallopt", None)
    return bool(mallopt and mallopt(M_MMAP_THRESHOLD, THRESHOLD) == 1)


def release_freed_memory() -> None:
    trim = getattr(_libc(), "malloc_trim", None)  # glibc only
    if trim is not None:
        trim(0)
