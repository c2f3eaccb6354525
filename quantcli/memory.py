"""Keep freed tensor memory from piling up in the process (glibc only; elsewhere a no-op).

glibc serves a large allocation with its own mmap and unmaps it on free, but after such a free
it raises its mmap threshold (up to 32 MiB on 64-bit) so that later allocations of that size
come from the heap, where freed blocks stay as fragments the process keeps. A job that
allocates and frees tensors of many sizes, layer after layer, then grows by tens of MiB per
layer although nothing is alive (measured: +39 MiB anonymous memory per decoder layer while
calibrating; flat with a fixed threshold). Fixing the threshold turns the adjustment off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
THRESHOLD = 128 * 1024  # glibc's own starting value: tensors above it get their own mapping


@functools.lru_cache(maxsize=1)
def fix_mmap_threshold() -> bool:
    """True when glibc accepted the fixed threshold."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = getattr(libc, "mallopt", None) if libc else None
    except OSError:
        return False
    return bool(mallopt and mallopt(M_MMAP_THRESHOLD, THRESHOLD) == 1)
