"""The process's allocator, set for the data paths: freed chunk buffers go back to the system.

A push or a pull allocates and frees chunk-sized buffers (compressed objects, decoded chunks,
the windows a stream is cut in: 0.1 to 16 MiB) by the thousand, on many threads. glibc
serves an allocation at or above its *mmap threshold* with a mapping of its own, unmapped when
freed; but the threshold starts at 128 KiB and rises to the size of every such block freed
(up to 32 MiB), and from then on these buffers come from the heap arenas (one per thread, up
to eight per core), where freed memory stays mapped and fragments. The process's anonymous
memory then grows with the work done — with the size of the image — not with what is in
flight (measured: ``bench/memory_bench.py``, docs/benchmarks.md).

``return_freed_buffers`` sets the threshold (``mallopt(M_MMAP_THRESHOLD)``), which also stops
glibc from moving it: every buffer of a chunk's size is then mapped when allocated and given
back when freed, and what the process holds is what its byte budgets let be in flight. It
runs once per process, when a store is first opened (``open_store``), and does nothing where
the C library is not glibc or the operator chose a threshold (``MALLOC_MMAP_THRESHOLD_``).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

log = logging.getLogger(__name__)

# At or above this, an allocation is its own mapping (below: chunk objects of zeros and of
# very compressible data, small enough that the arenas' reuse of them costs little).
MMAP_THRESHOLD = 256 * 1024
_M_MMAP_THRESHOLD = -3  # glibc's <malloc.h>


@functools.cache  # once per process (a second call at the same time only sets it again)
def return_freed_buffers() -> bool:
    """Set glibc's mmap threshold to ``MMAP_THRESHOLD``; whether it was set."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False  # the operator's choice stands
    try:
        libc = ctypes.CDLL(None)
        if not hasattr(libc, "gnu_get_libc_version"):
            return False  # not glibc: its allocator has its own rules
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1:
        log.debug("mallopt(M_MMAP_THRESHOLD) refused; freed buffers may stay mapped")
        return False
    return True
