"""Process-wide allocator settings that keep RSS proportional to live data.

glibc raises its mmap threshold each time a large block is freed, so after the first
few multi-megabyte read buffers every later one comes from the heap, where the hole
it leaves is rarely given back: RSS grew by ~350 bytes per message ingested even though
the live Python data did not. A fixed threshold keeps big buffers in their own
mappings, which go back to the kernel on free.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("qdelay.allocator")

M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 256 * 1024
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
    """Pin glibc's mmap threshold (no-op elsewhere); return whether it was applied."""
    global _done
    if _done:
        return True
    try:
        libc = _libc()
        ok = bool(libc and libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
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
