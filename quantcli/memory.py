"""Keeping freed tensor memory from staying in the process (glibc only; elsewhere no-ops).

glibc serves a large allocation with its own mmap and unmaps it on free, but after such a free
it raises its mmap threshold (up to 32 MiB on 64-bit), so later allocations of that size come
from the heap or a thread's arena, where freed blocks stay resident as fragments. Two jobs
suffer, and each gets the remedy that costs it least:

- the layer walks (calibration, GPTQ, eval) allocate and free a decoder layer's tensors, layer
  after layer: with glibc's adjustment memory grew ~15 MiB per layer (hidden 1024; 39 MiB in an
  earlier measurement) although nothing was alive. They fix the thresholds instead
  (`fix_malloc_thresholds`: no adjustment; MMAP_THRESHOLD, the largest glibc takes, so a batch's
  activations, freed and allocated again batch after batch, reuse heap memory instead of being
  a fresh mapping each, whose page faults made a 2048-wide Llama layer 1.7x slower at the
  128 KiB the walks fixed before, glibc's starting value) and return the heap's free pages
  after each layer (`release_freed_memory`): peak memory is flat in depth (4, 12 and 24 layers
  of that model: 670, 683 and 655 MB; 646-649 MB at 128 KiB, the cost of the heap kept between
  batches). The thresholds hold for the rest of the process (the shard job after the walk);
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

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers
MMAP_THRESHOLD = 32 * 2**20  # the largest glibc accepts on 64-bit: larger tensors get their own mapping
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD  # free memory kept at the heap's top, as glibc's adjustment pairs them


@functools.cache
def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


@functools.cache
def fix_malloc_thresholds() -> bool:
    """Fix glibc's mmap and trim thresholds (module docstring); True when glibc accepted both."""
    mallopt = getattr(_libc(), "mallopt", None)
    return bool(mallopt and mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
                and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)


def release_freed_memory() -> None:
    """Return every arena's free pages to the OS (malloc_trim(0))."""
    trim = getattr(_libc(), "malloc_trim", None)  # glibc only
    if trim is not None:
        trim(0)
