"""Reading frames in bulk, as columns: where each frame starts, its kind, sequence and due
time, found by one walk over a chunk of bytes (the native codec's ``scan``, or its Python
twin :func:`scan_columns_py`).

A reader that needs a field of many records (a CANCEL's target, a DISPATCH's time) gathers
it from the chunk with numpy at a fixed body offset (:meth:`Columns.u64_at`) instead of
decoding a record object per frame: this is what keeps a lookup in a busy minute bucket
cheap (issue 13).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qdelay.errors import CorruptRecord
from qdelay.segments import framing, native
from qdelay.segments.framing import FrameError
from qdelay.segments.segment import Segment

# byte offsets inside a frame header (docs/formats.md, "Frame")
KIND_AT = 16
SEQUENCE_AT = 20
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
        length = int.from_bytes(data[pos + 12 : pos + 16], "little")
        header_ok = data[pos : pos + 4] == framing._MAGIC_BYTES and data[pos + 17] == framing.VERSION
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
        data = seg.read(start, framing.HEADER_SIZE + int.from_bytes(data[12:16], "little"))
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
