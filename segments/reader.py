"""Reading frames in bulk, as columns: where each frame starts, its kind, sequence and due
time, found by one walk over a chunk of bytes (the native codec's ``scan``, or its Python
twin :func:`scan_columns_py`).

A reader that needs a field of many records (a CANCEL's target, a DISPATCH's time) gathers
it from the chunk with numpy at a fixed body offset (:meth:`Columns.u64_at`) instead of
decoding a record object per frame: this is what keeps a lookup in a busy minute bucket
cheap (issue 13).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from qdelay.errors import CorruptRecord
from qdelay.segments import framing, native
from qdelay.segments.framing import KIND_AT, LENGTH_AT, SEQUENCE_AT, VERSION_AT, Frame, FrameError

if TYPE_CHECKING:
    from qdelay.segments.segment import Segment

__all__ = ["KIND_AT", "SEQUENCE_AT"]  # the header offsets, re-exported for the column readers
SCAN_BYTES = 1024 * 1024


@dataclass(slots=True)
class Columns:
    """The whole, verified frames at the start of ``data`` (read from file offset ``base``)."""

    data: bytes
    base: int
    end: int  # offset in ``data`` just after the last whole good frame
    starts: np.ndarray  # int64: offsets in ``data``
    kinds: np.ndarray  # uint8
    seqs: np.ndarray  # int64
    dues: np.ndarray  # int64: a body's first 8 bytes (0 for a shorter body)
    bad: int  # offset in ``data`` of a frame failing its checks, or -1

    def __len__(self) -> int:
        return len(self.starts)

    def u64_at(self, rows: np.ndarray, body_offset: int) -> np.ndarray:
        """The little-endian 64-bit field at ``body_offset`` of each frame's body, for the
        frames picked by ``rows`` (a mask or index array), as int64. The picked frames'
        bodies must hold the field (their kind's fixed part does)."""
        picked = self.starts[rows]
        if not len(picked):
            return np.empty(0, dtype=np.int64)
        raw = np.frombuffer(self.data, dtype=np.uint8)
        at = picked[:, None] + (framing.HEADER_SIZE + body_offset) + np.arange(8)
        return raw[at].copy().view("<i8").reshape(-1)


def gather(data: bytes, starts: np.ndarray, offset: int, width: int, signed: bool = False) -> np.ndarray:
    """The little-endian field of ``width`` bytes (1, 2, 4 or 8) at ``starts + offset`` of
    ``data``, as int64 (a width of 8 is read signed): one fixed field of many frames in one
    call, native when built (the Spark reader's columns come from these)."""
    codec = native.codec
    starts = np.ascontiguousarray(starts, dtype=np.int64)
    if codec is None:
        return gather_py(data, starts, offset, width, signed)
    return np.frombuffer(codec.gather(data, starts, offset, width, signed), dtype=np.int64)


def gather_py(data: bytes, starts: np.ndarray, offset: int, width: int, signed: bool = False) -> np.ndarray:
    """The Python twin of :func:`gather` (and of the native ``gather``)."""
    if width not in (1, 2, 4, 8):
        raise ValueError(f"width {width} is not 1, 2, 4 or 8")
    starts = np.asarray(starts, dtype=np.int64)
    if not len(starts):
        return np.empty(0, dtype=np.int64)
    first = starts + offset
    if starts.min() < 0 or first.min() < 0 or first.max() + width > len(data):
        raise ValueError(f"a field at +{offset} runs past the data ({len(data)} bytes)")
    raw = np.frombuffer(data, dtype=np.uint8)
    picked = raw[first[:, None] + np.arange(width)].copy()
    kind = "i" if signed or width == 8 else "u"
    return picked.view(f"<{kind}{width}").reshape(-1).astype(np.int64)


def scan_columns(data: bytes) -> Columns:
    """Walk the whole frames at the start of ``data`` (native when built)."""
    codec = native.codec
    if codec is None:
        return scan_columns_py(data)
    end, _count, starts, kinds, seqs, dues, bad = codec.scan(data, framing.MAX_BODY)
    return Columns(
        data,
        0,
        end,
        np.frombuffer(starts, dtype=np.int64),
        np.frombuffer(kinds, dtype=np.uint8),
        np.frombuffer(seqs, dtype=np.int64),
        np.frombuffer(dues, dtype=np.int64),
        bad,
    )


def scan_columns_py(data: bytes) -> Columns:
    """The Python twin of :func:`scan_columns` (and of the native ``scan``)."""
    starts: list[int] = []
    kinds: list[int] = []
    seqs: list[int] = []
    dues: list[int] = []
    pos, size, bad = 0, len(data), -1
    while pos + framing.HEADER_SIZE <= size:
        length = frame_length(data, pos)
        header_ok = data[pos : pos + 4] == framing._MAGIC_BYTES and data[pos + VERSION_AT] == framing.VERSION
        if header_ok and length <= framing.MAX_BODY and pos + framing.HEADER_SIZE + length > size:
            break  # cut by the end of the data: not a verdict on the frame
        try:
            f = framing.check_at(data, pos)
        except FrameError:
            bad = pos
            break
        starts.append(pos)
        kinds.append(f.kind)
        seqs.append(f.sequence)
        dues.append(int.from_bytes(f.body[:8], "little", signed=True) if len(f.body) >= 8 else 0)
        pos += f.size
    return Columns(
        data,
        0,
        pos,
        np.array(starts, dtype=np.int64),
        np.array(kinds, dtype=np.uint8),
        np.array(seqs, dtype=np.int64),
        np.array(dues, dtype=np.int64),
        bad,
    )


def read_columns(seg: Segment, start: int, stop: int, max_bytes: int = SCAN_BYTES) -> Columns:
    """The frames in [start, stop) of ``seg``, reading about ``max_bytes`` at most; the next
    call starts at ``result.base + result.end``. A frame cut by the read size is left for the
    next call (a single frame larger than ``max_bytes`` is read whole); a bad frame raises
    :class:`CorruptRecord` with its file offset."""
    want = min(max_bytes, stop - start)
    data = seg.read(start, want) if want > 0 else b""
    cols = scan_columns(data)
    if cols.bad < 0 and cols.end == 0 and len(data) >= framing.HEADER_SIZE and start + len(data) < stop:
        # one frame larger than the read: read it whole
        data = seg.read(start, framing.HEADER_SIZE + frame_length(data))
        cols = scan_columns(data)
    if cols.bad >= 0 or (cols.end < len(data) and (start + len(data) >= stop or cols.end == 0)):
        at = cols.bad if cols.bad >= 0 else cols.end
        reason = "frame cut short by the end of the data"
        try:
            framing.check_at(data, at)
        except FrameError as err:
            reason = err.reason
        raise CorruptRecord(seg.path, start + at, reason)
    cols.base = start
    return cols


# --- walking with damage: what recovery, inspect and replication read through ---------------


@dataclass(frozen=True, slots=True)
class Damage:
    """A stretch of bytes where no valid frame starts: ``status`` is ZERO (unwritten space up
    to the end), TORN (bad bytes up to the end: a write cut short) or CORRUPT (a valid frame
    follows at ``end``: reading resumes there); offsets are file offsets."""

    status: str
    offset: int
    end: int
    reason: str


ZERO, TORN, CORRUPT = "zero", "torn", "corrupt"


def damage_at(
    buf: bytes | bytearray | memoryview, pos: int, err: FrameError | None = None, file_offset: int = 0
) -> Damage:
    """What the bad frame at ``pos`` of ``buf`` (whose check failed with ``err``; checked
    here when None) is, judged by what follows it: a valid frame later in ``buf`` makes it
    CORRUPT (up to that frame), else the tail is ZERO (all zero bytes) or TORN. The one
    place that tells a torn tail from corruption."""
    if err is None:
        try:
            framing.check_at(buf, pos)
        except FrameError as e:
            err = e
        else:
            raise ValueError(f"a valid frame starts at {pos}")
    end = len(buf)
    rest = bytes(buf[pos:])
    if not rest.strip(b"\0"):  # all zero (C speed; any() walks byte by byte)
        return Damage(ZERO, file_offset + pos, file_offset + end, err.reason)
    nxt = framing.find_next_frame(rest, 1)
    if nxt is None:
        return Damage(TORN, file_offset + pos, file_offset + end, err.reason)
    return Damage(CORRUPT, file_offset + pos, file_offset + pos + nxt, err.reason)


def walk(buf: bytes | bytearray | memoryview, file_offset: int = 0) -> Iterator[Frame | Damage]:
    """Every verified frame of ``buf`` (a segment's bytes, or a range starting on a frame
    boundary at ``file_offset``; frames carry file offsets) and every damaged stretch, in
    order. Reading resumes after a CORRUPT stretch; ZERO and TORN end the walk."""
    pos, end = 0, len(buf)
    check_at = framing.check_at
    while pos < end:
        try:
            frame = check_at(buf, pos)
        except FrameError as err:
            damage = damage_at(buf, pos, err, file_offset)
            yield damage
            if damage.status != CORRUPT:
                return
            pos += damage.end - damage.offset
            continue
        if file_offset:
            frame = Frame(file_offset + pos, frame.kind, frame.sequence, frame.timestamp, frame.body)
        yield frame
        pos += frame.size


def frame_spans(data: bytes | bytearray | memoryview, base: int = 0) -> list[tuple[int, int, int, int]]:
    """(offset, sequence, checksum, size) of the whole frames at the start of ``data``, read
    from their headers only, checksums not verified (replication compares them with its
    peer's); offsets from ``base``. Stops at the first frame cut by the end of ``data``."""
    out = []
    pos, n, hs = 0, len(data), framing.HEADER_SIZE
    unpack = framing.HEADER.unpack_from
    while pos + hs <= n:
        _m, checksum, length, _k, _v, _f, seq, _ts = unpack(data, pos)
        if pos + hs + length > n:
            break
        out.append((base + pos, seq, checksum, hs + length))
        pos += hs + length
    return out


def whole_frames(data: bytes | bytearray | memoryview) -> int:
    """How many bytes at the start of ``data`` are whole frames, by their headers only."""
    pos, n, hs = 0, len(data), framing.HEADER_SIZE
    while pos + hs <= n:
        length = frame_length(data, pos)
        if pos + hs + length > n:
            break
        pos += hs + length
    return pos


def frame_sequence(data: bytes | bytearray | memoryview, pos: int = 0) -> int:
    """The sequence a frame header at ``pos`` declares (unverified)."""
    return int.from_bytes(data[pos + SEQUENCE_AT : pos + SEQUENCE_AT + 8], "little")


def frame_length(data: bytes | bytearray | memoryview, pos: int = 0) -> int:
    """The body length a frame header at ``pos`` declares (unverified)."""
    return int.from_bytes(data[pos + LENGTH_AT : pos + LENGTH_AT + 4], "little")


def read_frames(seg: Segment, start: int, stop: int, max_bytes: int = SCAN_BYTES) -> tuple[list[Frame], int]:
    """Frames in [start, stop) of ``seg``, reading at most about ``max_bytes``; (frames, next).

    A frame cut by the read size is left for the next call; a bad frame raises
    :class:`CorruptRecord` with its offset.
    """
    if start >= stop:
        return [], start
    want = min(max_bytes, stop - start)
    data = seg.read(start, want)
    frames: list[Frame] = []
    pos = 0
    while pos < len(data):
        try:
            f = framing.check_at(data, pos)
        except FrameError as err:
            if start + len(data) < stop:
                if frames:
                    break  # cut by the read size: the next call starts here
                # a single frame larger than max_bytes
                big = seg.read_frame(start + pos)
                frames.append(big)
                pos += big.size
                break
            raise CorruptRecord(seg.path, start + pos, err.reason) from None
        frames.append(Frame(start + pos, f.kind, f.sequence, f.timestamp, f.body))
        pos += f.size
    return frames, start + pos
