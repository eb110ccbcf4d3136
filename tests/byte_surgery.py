"""Byte-level damage for storage tests (after leveldb's log_test helpers).

Each helper changes one file in place and says exactly what it did, so a test can
damage a segment, run recovery and assert what was kept, what was cut and why.
"""

from __future__ import annotations

import os
import struct

import xxhash

CHECKSUM_AT = 4  # frame header: the xxh3_64 field
CHECKED_FROM = 12  # the checksum covers [12, 36 + length)
HEADER_SIZE = 36


def flip_byte(path: str, offset: int, mask: int = 0xFF) -> int:
    """XOR the byte at ``offset`` with ``mask``; return its old value."""
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([old ^ mask]))
    return old


def set_byte(path: str, offset: int, value: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(bytes([value]))


def truncate_at(path: str, size: int) -> None:
    """Cut the file to ``size`` bytes (a write that died after ``size`` bytes)."""
    os.truncate(path, size)


def zero_fill_tail(path: str, count: int) -> None:
    """Append ``count`` zero bytes (preallocated, never-written space)."""
    with open(path, "ab") as f:
        f.write(b"\0" * count)


def zero_range(path: str, offset: int, count: int) -> None:
    """Overwrite [offset, offset + count) with zeros (a lost sector)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\0" * count)


def append_garbage(path: str, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


def fix_checksum(path: str, offset: int) -> None:
    """Recompute the checksum of the frame at ``offset`` after a deliberate change, so
    that only the check the test aims at (length, kind, version...) can fire."""
    with open(path, "r+b") as f:
        f.seek(offset)
        head = f.read(HEADER_SIZE)
        (length,) = struct.unpack_from("<I", head, 12)
        f.seek(offset + CHECKED_FROM)
        checked = f.read(HEADER_SIZE - CHECKED_FROM + length)
        f.seek(offset + CHECKSUM_AT)
        f.write(struct.pack("<Q", xxhash.xxh3_64_intdigest(checked)))


def file_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
