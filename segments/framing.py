"""The record frame shared by every qdelay log (docs/formats.md, "Record frame").

A frame is a 36-byte header followed by ``length`` body bytes, all little-endian::

    offset size  field
    0      4     magic      0x3144_5151 (bytes "QQD1")
    4      8     checksum   xxh3_64 of bytes [12, 36 + length): header rest + body
    12     4     length     body length in bytes
    16     1     kind       RecordKind
    17     1     version    1
    18     2     flags      0 (reserved)
    20     8     sequence   u64
    28     8     timestamp  i64, Unix epoch ms (meaning depends on the kind)
    36     len   body

A zero magic marks unwritten (zero-filled) space: the end of the data.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import xxhash

from qdelay.errors import InvariantViolation
from qdelay.segments import native

MAGIC = 0x31445151  # b"QQD1" read little-endian
VERSION = 1
HEADER = struct.Struct("<IQIBBHQq")
HEADER_SIZE = 36
# the header as numpy fields, for readers that gather the headers of many frames at once
# (a record's fixed part is appended to these; segments/reader.py, segments/records.py)
HEADER_FIELDS = [
    ("magic", "<u4"),
    ("checksum", "<u8"),
    ("length", "<u4"),
    ("kind", "u1"),
    ("version", "u1"),
    ("flags", "<u2"),
    ("sequence", "<u8"),
    ("timestamp", "<i8"),
]
CHECKED_FROM = 12  # the checksum covers everything after itself
MAX_BODY = 64 * 1024 * 1024
# where the header's fields start: every reader of raw frame bytes uses these names
CHECKSUM_AT = 4
LENGTH_AT = 12
KIND_AT = 16
VERSION_AT = 17
FLAGS_AT = 18
SEQUENCE_AT = 20
TIMESTAMP_AT = 28

if HEADER.size != HEADER_SIZE:  # the spec in docs/formats.md is the source of truth
    raise InvariantViolation(f"frame header is {HEADER.size} bytes, spec says {HEADER_SIZE}")

_REST = struct.Struct("<IBBHQq")  # header bytes [12, 36): what the checksum covers before the body
_LEAD = struct.Struct("<IQ")  # header bytes [0, 12): magic, checksum
MAGIC_BYTES = struct.pack("<I", MAGIC)  # how a frame starts: what a resync looks for
_xxh = xxhash.xxh3_64_intdigest
_pack_rest = _REST.pack
_pack_lead = _LEAD.pack
_unpack_from = HEADER.unpack_from

if _LEAD.size + _REST.size != HEADER_SIZE or _LEAD.size != CHECKED_FROM:
    raise InvariantViolation("frame header pieces do not add up to the spec's layout")
_FIELDS_AT = [struct.calcsize("<" + HEADER.format.lstrip("<")[:k]) for k in range(8)]
if (CHECKSUM_AT, LENGTH_AT, KIND_AT, VERSION_AT, FLAGS_AT, SEQUENCE_AT, TIMESTAMP_AT) != tuple(_FIELDS_AT[1:]):
    raise InvariantViolation(f"named header offsets do not match the header's layout {_FIELDS_AT}")


class RecordKind(enum.IntEnum):
    MESSAGE = 1  # a scheduled message (message log and schedule log)
    CANCEL = 2  # a tombstone for a scheduled message (message log and schedule log)
    DISPATCH = 3  # a delivered (acknowledged) or dead-lettered message (dispatch log)
    CHECKPOINT = 4  # a checkpoint file's single record
    GROUP = 5  # a consumer group created or deleted (message log only)


@dataclass(frozen=True, slots=True)
class Frame:
    """One decoded frame. ``offset`` is where it starts in its file; ``size`` its full length."""

    offset: int
    kind: int
    sequence: int
    timestamp: int
    body: bytes

    @property
    def size(self) -> int:
        return HEADER_SIZE + len(self.body)


def encode(kind: int, sequence: int, timestamp: int, body: bytes) -> bytes:
    """Return the full frame bytes for one record."""
    checked = _pack_rest(len(body), kind, VERSION, 0, sequence, timestamp) + body
    return _pack_lead(MAGIC, _xxh(checked)) + checked


def encode_into(out: bytearray, kind: int, sequence: int, timestamp: int, body: bytes) -> None:
    """Append one frame to ``out`` (the hot path of the message log).

    Hashing a fresh ``bytes`` of header rest + body and appending it is about twice as
    fast as packing into ``out`` and hashing a memoryview of it (0.5 vs 1.0 µs for a
    100-byte body): fewer Python-level calls matter more than one extra copy.
    """
    checked = _pack_rest(len(body), kind, VERSION, 0, sequence, timestamp) + body
    out += _pack_lead(MAGIC, _xxh(checked))
    out += checked


def encode_many_into(out: bytearray, kind: int, sequence: int, timestamp: int, bodies: list[bytes]) -> int:
    """Append one frame per body (sequences from ``sequence`` on) to ``out``; return the
    next sequence. Byte-identical to :func:`encode_into` per body, without its call per record."""
    codec = native.codec
    if codec is not None and type(bodies) is list and type(out) is bytearray:
        return codec.frame_bodies(out, kind, sequence, timestamp, bodies, MAX_BODY)
    return frame_bodies_py(out, kind, sequence, timestamp, bodies, MAX_BODY)


def frame_bodies_py(
    out: bytearray, kind: int, sequence: int, timestamp: int, bodies: list[bytes], max_body: int
) -> int:
    """The Python twin of the native ``frame_bodies``: one frame per body appended to
    ``out``, sequences from ``sequence`` on; returns the next sequence. Like the native
    function it checks every body (bytes, at most ``max_body``) before writing any."""
    for i, body in enumerate(bodies):
        if not isinstance(body, bytes):
            raise TypeError(f"bodies[{i}] is not bytes")
        if len(body) > max_body:
            raise ValueError(f"bodies[{i}] is {len(body)} bytes, more than {max_body}")
    rest, lead, xxh = _pack_rest, _pack_lead, _xxh
    for body in bodies:
        checked = rest(len(body), kind, VERSION, 0, sequence, timestamp) + body
        out += lead(MAGIC, xxh(checked))
        out += checked
        sequence += 1
    return sequence


class FrameError(Exception):
    """Why the bytes at an offset are not a valid frame (decided by :func:`check_at`)."""

    def __init__(self, offset: int, reason: str, zero: bool = False) -> None:
        super().__init__(reason)
        self.offset = offset
        self.reason = reason
        self.zero = zero  # the bytes are zero-filled (unwritten space), not garbage


def check_at(buf: bytes | memoryview | bytearray, offset: int) -> Frame:
    """Decode and verify the frame at ``offset`` of ``buf``; raise :class:`FrameError` if bad."""
    end = len(buf)
    if end - offset < HEADER_SIZE:
        zero = not any(buf[offset:end])
        raise FrameError(offset, f"{end - offset} bytes left, a header needs {HEADER_SIZE}", zero)
    magic, checksum, length, kind, version, _flags, sequence, timestamp = _unpack_from(buf, offset)
    if magic != MAGIC:
        zero = magic == 0 and not any(buf[offset : min(end, offset + HEADER_SIZE)])
        raise FrameError(offset, f"bad magic 0x{magic:08x}", zero)
    if version != VERSION:
        raise FrameError(offset, f"unknown frame version {version}")
    if length > MAX_BODY:
        raise FrameError(offset, f"length {length} exceeds the maximum {MAX_BODY}")
    stop = offset + HEADER_SIZE + length
    if stop > end:
        raise FrameError(offset, f"record of {HEADER_SIZE + length} bytes runs past the end ({end})")
    if _xxh(memoryview(buf)[offset + CHECKED_FROM : stop]) != checksum:
        raise FrameError(offset, "checksum mismatch")
    return Frame(offset, kind, sequence, timestamp, bytes(buf[offset + HEADER_SIZE : stop]))
