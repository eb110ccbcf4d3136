"""Process-wide allocator settings that keep RSS proportional to live data.

glibc raises its mmap threshold each time a large block is freed, so after the first
few multi-megabyte read buffers every later one comes from the heap, where the hole
it leaves is rarely given back: RSS grew by ~350 bytes per message ingested even though
the live Python data did not. A fixed threshold keeps big buffers in their own
mappings, which go back to the kernel on free; a small trim threshold and no top pad
give the free top of each thread's arena back on free too (TRIM_THRESHOLD).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("qdelay.allocator")

M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 256 * 1024
# Each thread's arena (RocksDB's, gRPC's, the iterate and worker threads': six to ten of
# them) kept up to glibc's default trim threshold and top pad (128 KiB each) of free memory
# at its top, which malloc_trim does not release in a thread's arena: 2-3 MB of a server's
# RSS after a burst (docs/benchmarks.md, "RSS per pending message"). A small threshold and no
# pad give it back on free, at no ingest cost measured.
TRIM_THRESHOLD = 32 * 1024
TOP_PAD = 0
_done = False


_LIBC: list = []  # the loaded libc, or None where there is none (looked up once: find_library runs ldconfig)


def _libc():
    if not _LIBC:
        name = ctypes.util.find_library("c")
        try:
            _LIBC.append(ctypes.CDLL(name) if name else None)
        except OSError:
            _LIBC.append(None)
    return _LIBC[0]


def tune() -> bool:
    """Pin glibc's mmap threshold, trim threshold and top pad (no-op elsewhere); return
    whether all three were applied."""
    global _done
    if _done:
        return True
    try:
        libc = _libc()
        ok = bool(
            libc
            and libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
            and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
            and libc.mallopt(M_TOP_PAD, TOP_PAD)
        )
    except (OSError, AttributeError):
        ok = False
    _done = ok
    if not ok:
        log.info("allocator tuning not available on this platform")
    return ok


def trim() -> None:
    """Give free heap pages back to the kernel (after a large transient load)."""
    try:
        libc = _libc()
        if libc is not None:
            libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass
