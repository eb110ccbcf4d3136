"""The one reader of qdelay's frames (docs/formats.md, "Record frame"): every walk over
frames, in files or in memory, goes through here (tests/test_one_reader.py checks).

- Columns: where each frame of a chunk starts, its kind, sequence and due time, found by
  one walk (the native codec's ``scan``, or its Python twin :func:`scan_py`) that verifies
  every frame; :func:`read_columns` / :func:`read_frames` read a segment's range chunk by
  chunk (the loader, the dispatcher, lookups, ``Segment.frames``), :func:`read_frame` one
  frame at a known offset.
- Damage: :func:`walk` (a buffer: inspect, the Spark twin) and :func:`walk_reads` (a file,
  chunk by chunk: recovery) report every torn, corrupt or zero-filled stretch with its
  offsets, resuming after corruption (:func:`damage_at` is the one place that tells a
  torn tail from corruption).
- Bytes from elsewhere: :func:`require_whole` (replicated chunks), :func:`sole_frame`
  (a checkpoint file), :func:`header` / :func:`frame_spans` (replication's unverified
  looks at headers).

The Python twins of the native storage codec's walks live here, each with the signature
and results of its C function (segments/_codec.c; the table is ``native.twins()``):
:func:`scan_py`, :func:`gather_py`, :func:`route_py` (the iterate service's copy of a read
into per-bucket buffers) and :func:`read_messages_py` (MESSAGE records read back for
dispatch).

A reader that needs a field of many records (a CANCEL's target, a DISPATCH's time) gathers
it from the chunk with numpy at a fixed body offset (:meth:`Columns.u64_at`) instead of
decoding a record object per frame: this is what keeps a lookup in a busy minute bucket
cheap (issue 13)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, cast

import numpy as np

from qdelay.errors import CorruptRecord, InvariantViolation
from qdelay.segments import framing, native, records
from qdelay.segments.framing import (
    HEADER_SIZE,
    KIND_AT,
    LENGTH_AT,
    SEQUENCE_AT,
    TIMESTAMP_AT,
    VERSION_AT,
    Frame,
    FrameError,
    RecordKind,
)
from qdelay.segments.naming import MS_PER_MINUTE

if TYPE_CHECKING:
    from qdelay.segments.segment import Segment

__all__ = ["KIND_AT", "SEQUENCE_AT"]  # the header offsets, re-exported for the column readers
SCAN_BYTES = 1024 * 1024
READ_CHUNK = 4 * 1024 * 1024  # a file walk's read size (recovery, Segment.frames)


@dataclass(slots=True)
class Columns:
    """The whole, verified frames at the start of ``data`` (read from file offset ``base``)."""

    data: bytes | memoryview
    base: int
    end: int  # offset in ``data`` just after the last whole good frame
    starts: np.ndarray  # int64: offsets in ``data``
    kinds: np.ndarray  # uint8
    seqs: np.ndarray  # int64
    dues: np.ndarray  # int64: a body's first 8 bytes (0 for a shorter body)
    bad: int  # offset in ``data`` of a frame failing its checks, or -1

    def __len__(self) -> int:
        return len(self.starts)

    def frames(self) -> list[Frame]:
        """The frames as :class:`Frame` objects with file offsets (``base`` + start): bodies
        cut from ``data``, timestamps gathered in one call. For readers that need bodies;
        column readers use the arrays."""
        n = len(self.starts)
        if not n:
            return []
        data = self.data if isinstance(self.data, bytes) else bytes(self.data[: self.end])
        starts = self.starts.tolist()
        ends = starts[1:] + [self.end]  # whole frames lie end to end
        stamps = gather(data, self.starts, TIMESTAMP_AT, 8).tolist()
        base, hs = self.base, HEADER_SIZE
        return [
            Frame(base + s, k, q, t, data[s + hs : e])
            for s, e, k, q, t in zip(starts, ends, self.kinds.tolist(), self.seqs.tolist(), stamps)
        ]

    def stamp(self, i: int) -> int:
        """The timestamp in the header of frame ``i``."""
        at = int(self.starts[i]) + TIMESTAMP_AT
        return int.from_bytes(self.data[at : at + 8], "little", signed=True)

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


def gather(data: bytes | memoryview, starts: np.ndarray, offset: int, width: int, signed: bool = False) -> np.ndarray:
    """The little-endian field of ``width`` bytes (1, 2, 4 or 8) at ``starts + offset`` of
    ``data``, as int64 (a width of 8 is read signed): one fixed field of many frames in one
    call, native when built (the Spark reader's columns come from these)."""
    codec = native.codec
    starts = np.ascontiguousarray(starts, dtype=np.int64)
    return np.frombuffer(
        (codec.gather if codec is not None else gather_py)(data, starts, offset, width, signed), np.int64
    )


def gather_py(data: bytes | memoryview, starts: np.ndarray, offset: int, width: int, signed: bool) -> bytes:
    """The Python twin of the native ``gather``: the int64 column as bytes (numpy fancy
    indexing); a field outside ``data`` or an odd width is a ValueError."""
    if width not in (1, 2, 4, 8):
        raise ValueError(f"width {width} is not 1, 2, 4 or 8")
    starts = np.frombuffer(starts, dtype=np.int64) if isinstance(starts, bytes) else np.asarray(starts, np.int64)
    if not len(starts):
        return b""
    first = starts + offset
    if starts.min() < 0 or first.min() < 0 or first.max() + width > len(data):
        raise ValueError(f"a field at +{offset} runs past the data ({len(data)} bytes)")
    raw = np.frombuffer(data, dtype=np.uint8)
    picked = raw[first[:, None] + np.arange(width)].copy()
    kind = "i" if signed or width == 8 else "u"
    return picked.view(f"<{kind}{width}").reshape(-1).astype(np.int64).tobytes()


def scan_columns(data: bytes | memoryview) -> Columns:
    """Walk the whole frames at the start of ``data`` (native when built)."""
    codec = native.codec
    end, _count, starts, kinds, seqs, dues, bad = (codec.scan if codec is not None else scan_py)(data, framing.MAX_BODY)
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


def scan_py(data: bytes | memoryview, max_body: int) -> tuple[int, int, bytes, bytes, bytes, bytes, int]:
    """The Python twin of the native ``scan``: (end, count, starts, kinds, sequences, dues,
    bad) of the whole, verified frames at the start of ``data``, the columns as int64 (kinds
    uint8) array bytes; ``bad`` is the offset of a frame failing its checks, or -1. A frame
    cut by the end of ``data`` ends the walk without a verdict (unless its length is one no
    frame can have)."""
    starts: list[int] = []
    kinds: list[int] = []
    seqs: list[int] = []
    dues: list[int] = []
    pos, size, bad = 0, len(data), -1
    while pos + framing.HEADER_SIZE <= size:
        length = frame_length(data, pos)
        header_ok = data[pos : pos + 4] == framing.MAGIC_BYTES and data[pos + VERSION_AT] == framing.VERSION
        if header_ok and length <= max_body and pos + framing.HEADER_SIZE + length > size:
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
    return (
        pos,
        len(starts),
        np.array(starts, dtype=np.int64).tobytes(),
        np.array(kinds, dtype=np.uint8).tobytes(),
        np.array(seqs, dtype=np.int64).tobytes(),
        np.array(dues, dtype=np.int64).tobytes(),
        bad,
    )


def read_columns(seg: Segment, start: int, stop: int, max_bytes: int = SCAN_BYTES) -> Columns:
    """The frames in [start, stop) of ``seg``, reading about ``max_bytes`` at most; the next
    call starts at ``result.base + result.end``. A frame cut by the read size is left for the
    next call (a single frame larger than ``max_bytes`` is read whole); a bad frame, one
    running past ``stop`` or a file shorter than ``stop`` raises :class:`CorruptRecord` with
    its file offset. No byte at or past ``stop`` is ever served."""
    want = min(max_bytes, stop - start)
    data = seg.read(start, want) if want > 0 else b""
    if want > 0 and not data:
        raise CorruptRecord(seg.path, start, "file is shorter than its recorded size")
    cols = scan_columns(data)
    past = False  # one frame larger than the read that runs past ``stop``
    if cols.bad < 0 and cols.end == 0 and len(data) >= HEADER_SIZE and start + len(data) < stop:
        whole = HEADER_SIZE + frame_length(data)  # at most MAX_BODY: scan judged the header sound
        past = start + whole > stop
        if not past:  # one frame larger than the read: read it whole
            data = seg.read(start, whole)
            cols = scan_columns(data)
    if cols.bad >= 0 or (cols.end < len(data) and (start + len(data) >= stop or cols.end == 0)):
        at = cols.bad if cols.bad >= 0 else cols.end
        reason = "frame cut short by the end of the data"
        try:
            framing.check_at(data, at)
        except FrameError as err:
            reason = err.reason
        if past:
            reason = f"record of {HEADER_SIZE + frame_length(data)} bytes runs past the end of the range ({stop})"
        raise CorruptRecord(seg.path, start + at, reason)
    cols.base = start
    return cols


def read_frames(seg: Segment, start: int, stop: int, max_bytes: int = SCAN_BYTES) -> tuple[list[Frame], int]:
    """Frames in [start, stop) of ``seg``, reading at most about ``max_bytes``; (frames, next).
    The rules of :func:`read_columns` (whose frames these are)."""
    if start >= stop:
        return [], start
    cols = read_columns(seg, start, stop, max_bytes)
    return cols.frames(), start + cols.end


def segment_frames(seg: Segment, start: int = 0, stop: int | None = None) -> Iterator[Frame]:
    """Every frame in [start, stop) of ``seg`` (stop None: its valid size), read in chunks of
    :data:`READ_CHUNK` (:func:`walk_reads`); a bad frame raises :class:`CorruptRecord` when
    the walk reaches it, the frames before it yielded first: data failing its checksum, or
    past ``stop``, is never yielded."""
    end = seg.size if stop is None else stop
    for got in walk_reads(seg.read, start, end):
        if isinstance(got, Damage):
            raise CorruptRecord(seg.path, got.offset, got.reason)
        yield from got.frames()


def read_frame(seg: Segment, offset: int) -> Frame:
    """Read and verify the one frame at ``offset`` of ``seg`` (two reads: its header, then its
    body); a bad one raises :class:`CorruptRecord`."""
    with seg.pool.fd(seg.path) as fd:
        head = os.pread(fd, HEADER_SIZE, offset)
        data = head
        if len(head) == HEADER_SIZE:
            length = frame_length(head)
            if length <= framing.MAX_BODY:
                data = head + os.pread(fd, length, offset + HEADER_SIZE)
    try:
        frame = framing.check_at(data, 0)
    except FrameError as err:
        raise CorruptRecord(seg.path, offset, err.reason) from None
    return Frame(offset, frame.kind, frame.sequence, frame.timestamp, frame.body)


# read_frames_at: frames this close (bytes between one's offset and the next's) share a
# read, as long as that read stays within SPAN_BYTES
SPAN_GAP = 64 * 1024
SPAN_BYTES = 4 << 20
_TAIL_GUESS = 4096  # read past a span's last offset: most frames end within it


def read_frames_at(seg: Segment, offsets: list[int]) -> list[Frame]:
    """:func:`read_frame` of each of ``offsets`` (a batch: RescheduleBatch's records to write
    again), in that order, with one pread per run of nearby frames instead of two per frame
    (1,000 records of a 10,000-message minute one at a time cost ~28 us each in a busy
    server). A frame that runs past its run's read is read alone; a bad one raises
    :class:`CorruptRecord` with its offset."""
    order = sorted(range(len(offsets)), key=offsets.__getitem__)
    out: list[Frame | None] = [None] * len(offsets)
    i = 0
    while i < len(order):
        j = i + 1
        start = offsets[order[i]]
        while (
            j < len(order)
            and offsets[order[j]] - offsets[order[j - 1]] <= SPAN_GAP
            and offsets[order[j]] + _TAIL_GUESS - start <= SPAN_BYTES
        ):
            j += 1
        buf = seg.read(start, offsets[order[j - 1]] + _TAIL_GUESS - start)
        for k in order[i:j]:
            pos = offsets[k] - start
            if pos + HEADER_SIZE > len(buf) or pos + HEADER_SIZE + frame_length(buf, pos) > len(buf):
                out[k] = read_frame(seg, offsets[k])  # runs past this read (or the file's end)
                continue
            try:
                out[k] = frame_at(buf, pos, start)
            except FrameError as err:
                raise CorruptRecord(seg.path, offsets[k], err.reason) from None
        i = j
    return cast("list[Frame]", out)


def frame_at(buf: bytes | bytearray | memoryview, pos: int, file_offset: int = 0) -> Frame:
    """The verified frame at ``pos`` of ``buf`` (bytes read from file offset
    ``file_offset``), with its file offset; :class:`FrameError` if bad."""
    frame = framing.check_at(buf, pos)
    if not file_offset:
        return frame
    return Frame(file_offset + pos, frame.kind, frame.sequence, frame.timestamp, frame.body)


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


def next_frame(buf: bytes | bytearray | memoryview, start: int) -> int | None:
    """Offset of the first valid frame at or after ``start`` of ``buf`` (found by its magic,
    then verified): where reading resumes after a bad stretch."""
    data = bytes(buf) if not isinstance(buf, bytes) else buf
    magic = framing.MAGIC_BYTES
    pos = data.find(magic, start)
    while pos != -1:
        try:
            framing.check_at(data, pos)
            return pos
        except FrameError:
            pos = data.find(magic, pos + 1)
    return None


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
    nxt = next_frame(rest, 1)
    if nxt is None:
        return Damage(TORN, file_offset + pos, file_offset + end, err.reason)
    return Damage(CORRUPT, file_offset + pos, file_offset + pos + nxt, err.reason)


def walk(buf: bytes | bytearray | memoryview, file_offset: int = 0, start: int = 0) -> Iterator[Frame | Damage]:
    """Every verified frame of ``buf`` (a segment's bytes, or a range starting on a frame
    boundary at ``file_offset``; frames carry file offsets) and every damaged stretch, in
    order, from ``start`` of ``buf`` (a frame boundary; a jump into a memory map copies
    nothing). Reading resumes after a CORRUPT stretch; ZERO and TORN end the walk."""
    pos, end = start, len(buf)
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


def record_before(buf: bytes | bytearray | memoryview, sequence: int, probe: int = 1 << 16) -> int:
    """An offset of ``buf`` (a segment of a log in sequence order: the message log) where a
    frame at or before ``sequence`` starts, 0 when none nearer is found: a bisection over
    byte offsets, each step resynchronised on the next valid frame within ``probe`` bytes
    (as a walk resumes after damage), so log2(len / probe) small reads, never a walk of the
    segment; a copy of no more than ``probe`` bytes a step when ``buf`` is a memory map."""
    lo, hi = 0, len(buf)
    while hi - lo > probe:
        mid = (lo + hi) // 2
        window = bytes(buf[mid : min(hi, mid + probe)])
        at = next_frame(window, 0)
        if at is None:  # a frame larger than the window, or damage: stop here
            break
        if frame_sequence(window, at) <= sequence:
            lo = mid + at
        else:  # no valid frame starts in [mid, mid + at): the wanted one starts before mid
            hi = mid
    return lo


def walk_reads(
    read: Callable[[int, int], bytes], start: int, stop: int, chunk_bytes: int | None = None
) -> Iterator[Columns | Damage]:
    """The chunked walk of a file's [start, stop) (``read(offset, n)`` reads it, e.g. a
    pread): the verified frames as :class:`Columns`, a chunk at a time (file offsets:
    ``base`` + start), and every damaged stretch as a :class:`Damage` judged by the bytes up
    to ``stop`` (:func:`damage_at`), in order. A frame cut by a chunk is read again with the
    next; a frame larger than a chunk is read whole. Reading resumes after a CORRUPT
    stretch; ZERO and TORN end the walk, and so does a file shorter than ``stop`` (TORN).
    ``chunk_bytes`` defaults to :data:`READ_CHUNK`."""
    chunk_bytes = chunk_bytes or READ_CHUNK
    pos = start
    while pos < stop:
        want = min(chunk_bytes, stop - pos)
        data = read(pos, want)
        if not data:
            yield Damage(TORN, pos, stop, "file is shorter than its recorded size")
            return
        cols = scan_columns(data)
        if len(cols):
            cols.base = pos
            yield cols
        at = pos + cols.end
        if cols.bad < 0 and cols.end == len(data):
            pos = at
            continue
        if cols.bad < 0 and pos + len(data) < stop:
            if cols.end:
                pos = at  # the frame is cut by the chunk: read again from it
                continue
            whole = HEADER_SIZE + frame_length(data)  # one frame larger than a chunk
            if len(data) >= HEADER_SIZE and pos + whole <= stop:
                one = read(pos, whole)
                big = scan_columns(one)
                if len(big) == 1 and big.end == len(one):
                    big.base = pos
                    yield big
                    pos += whole
                    continue
        damage = damage_at(read(at, stop - at), 0, None, at)
        yield damage
        if damage.status != CORRUPT:
            return
        pos = damage.end


def frames(buf: bytes | bytearray | memoryview) -> list[Frame]:
    """The verified frames at the start of ``buf``, up to the first that is bad or cut (for
    buffers this process wrote, such as records not yet on disk; :func:`walk` tells what
    stopped a walk)."""
    return scan_columns(buf if isinstance(buf, bytes) else bytes(buf)).frames()


def require_whole(cols: Columns, what: str, base: int = 0) -> None:
    """Raise :class:`CorruptRecord` (``what``, ``base`` + offset, why) unless ``cols`` (a
    :func:`scan_columns` of bytes received from elsewhere) covers its data end to end with
    whole, verified frames."""
    if cols.end == len(cols.data):
        return
    try:
        framing.check_at(cols.data, cols.end)
    except FrameError as err:
        raise CorruptRecord(what, base + cols.end, err.reason) from None
    raise InvariantViolation(f"a verified frame at {base + cols.end} that the walk did not take")


def sole_frame(data: bytes) -> Frame:
    """The one verified frame ``data`` holds, with nothing after it (a checkpoint file);
    :class:`FrameError` otherwise."""
    frame = framing.check_at(data, 0)
    if frame.size != len(data):
        raise FrameError(frame.size, "trailing bytes after the record")
    return frame


class Header(NamedTuple):
    """A frame header's fields, as written (not verified)."""

    magic: int
    checksum: int
    length: int
    kind: int
    version: int
    flags: int
    sequence: int
    timestamp: int


def header(data: bytes | bytearray | memoryview, pos: int = 0) -> Header:
    """The header at ``pos`` of ``data``, unverified (replication compares a frame's place,
    sequence and checksum with its peer's; the lag reads its time)."""
    return Header._make(framing.HEADER.unpack_from(data, pos))


def frame_spans(data: bytes | bytearray | memoryview, base: int = 0) -> list[tuple[int, int, int, int]]:
    """(offset, sequence, checksum, size) of the whole frames at the start of ``data``, read
    from their headers only, checksums not verified (replication compares them with its
    peer's); offsets from ``base``. Stops at the first frame cut by the end of ``data``."""
    out = []
    pos, n, hs = 0, len(data), HEADER_SIZE
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
    pos, n, hs = 0, len(data), HEADER_SIZE
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


_MESSAGE_KIND = int(RecordKind.MESSAGE)  # plain ints: IntEnum attribute lookups cost ~0.5 µs
_CANCEL_KIND = int(RecordKind.CANCEL)


def route_py(
    data: bytes | memoryview,
    pos: int,
    st: np.ndarray,
    kind: np.ndarray,
    seq: np.ndarray,
    due: np.ndarray,
    scale: int,
    near: int | None,
    behind: dict[int, bytearray],
    segment_of: Callable[[int], Segment],
    spares: list[bytearray],
    segments: dict[int, Segment],
) -> tuple:
    """The Python twin of the native ``route`` (the iterate service's routing of one read):
    the scanned frames' bytes into ``behind[bucket]`` (bucket: the due's UTC minute rounded
    down to ``scale``; a missing buffer is the last of ``spares``, emptied, or a new one; its
    segment ``segments[bucket]``, or ``segment_of(bucket)`` where that has none),
    records a bucket's segment already holds (a replay) skipped;
    returns (handed: [(index, bucket, offset in its buffer)] for the copied records of
    buckets <= ``near`` (all when None) and every CANCEL, messages, cancels, duplicates,
    unknown indexes, copied, bytes added)."""
    if not isinstance(spares, list) or not isinstance(segments, dict):
        raise TypeError("route: spares is a list of bytearrays, segments a dict")
    sizes = np.empty_like(st)  # (np.diff with append= costs ~20 µs more per call)
    sizes[:-1] = st[1:] - st[:-1]
    sizes[-1] = pos - st[-1]
    is_msg = kind == _MESSAGE_KIND
    is_cancel = kind == _CANCEL_KIND
    known = is_msg | is_cancel
    minute = due // MS_PER_MINUTE
    bucket = minute - minute % scale
    unknown = np.flatnonzero(~known).tolist()
    counts = (int(is_msg.sum()), int(is_cancel.sum()))
    if not known.any():
        return [], *counts, 0, unknown, 0, 0
    if unknown:
        bucket[~known] = bucket[known][0]  # skipped below; must not create a segment
    # a replay after a crash finds records its segment already holds: skip those
    buckets, inverse = np.unique(bucket, return_inverse=True)
    segs = [segments[b] if b in segments else segment_of(b) for b in buckets.tolist()]
    held = np.fromiter((sg.last_sequence for sg in segs), dtype=np.int64, count=len(segs))
    keep = known & (seq > held[inverse])
    duplicates = int(known.sum() - keep.sum())
    idx = np.flatnonzero(keep)
    if len(idx) == 0:
        return [], *counts, duplicates, unknown, 0, 0
    # group by bucket, in sequence order inside each; join each group's frame bytes
    order = idx[np.argsort(inverse[idx], kind="stable")]
    group = inverse[order]
    o_st, o_size = st[order], sizes[order]
    o_end = np.cumsum(o_size)
    o_at = (o_end - o_size).tolist()  # where each frame lands in its group's run
    firsts = [0] + (np.flatnonzero(group[1:] != group[:-1]) + 1).tolist()  # each group's first record
    bounds = firsts[1:] + [len(order)]
    starts_l, ends_l = o_st.tolist(), (o_st + o_size).tolist()
    group_l, seq_l, buckets_l = group.tolist(), seq[order].tolist(), buckets.tolist()
    mv = memoryview(data)
    at_of: dict[int, int] = {}  # group -> its buffer's length before this run, minus the run's o_at
    for lo, hi in zip(firsts, bounds):
        g = group_l[lo]
        b = buckets_l[g]
        segs[g].last_sequence = seq_l[hi - 1]
        buf = behind.get(b)
        if buf is None:
            if spares:
                if not isinstance(spares[-1], bytearray):
                    raise TypeError("route: spares holds a non-bytearray")
                buf = spares.pop()
                del buf[:]
            else:
                buf = bytearray()
            behind[b] = buf
        at_of[g] = len(buf) - o_at[lo]
        buf += b"".join([mv[a:z] for a, z in zip(starts_l[lo:hi], ends_l[lo:hi])])
    handed_mask = keep & (is_cancel | (bucket <= near)) if near is not None else keep
    where = np.empty(len(st), dtype=np.int64)
    where[order] = o_at
    handed = [
        (i, buckets_l[g], w + at_of[g])
        for i, g, w in zip(
            np.flatnonzero(handed_mask).tolist(), inverse[handed_mask].tolist(), where[handed_mask].tolist()
        )
    ]
    return handed, *counts, duplicates, unknown, len(order), int(o_end[-1])


# frame header + MESSAGE fixed part (docs/formats.md): records read back for delivery are
# checked and split column-wise, with these 56 bytes of each gathered into one array
_HEAD_DTYPE = np.dtype(
    framing.HEADER_FIELDS
    + [
        ("due", "<i8"),
        ("slen", "<u2"),
        ("mlen", "<u2"),
        ("hlen", "<u4"),
        ("plen", "<u4"),
    ]
)
_HEAD_SIZE = _HEAD_DTYPE.itemsize
_HEAD_RANGE = np.arange(_HEAD_SIZE, dtype=np.int64)
if _HEAD_SIZE != framing.HEADER_SIZE + records.MESSAGE_FIXED.size:
    raise InvariantViolation("frame header + MESSAGE fixed part does not match the spec's layout")


def read_messages_py(
    data: bytes, offsets: np.ndarray, sequences: np.ndarray
) -> tuple[list[bytes | None], list[bytes | None], list[bytes | None], list[int]]:
    """The Python twin of the native ``read_messages``: the MESSAGE records at ``offsets``
    (int64) of ``data`` (one read of a schedule segment), each expected to carry the
    sequence in ``sequences``. Returns, in input order, message id bytes, payload bytes,
    the raw header block or None, and the positions that failed a check (their entries
    are None).

    Every check of a frame is made before any of its bytes is used: magic, kind, the
    sequence the index expects, the frame inside the read, the MESSAGE lengths adding up to
    the frame's length, and the xxh3 checksum (one call per frame; the rest is done for the
    whole run with numpy on the frame headers gathered side by side).
    """
    rel = np.frombuffer(offsets, np.int64) if isinstance(offsets, bytes) else np.asarray(offsets, np.int64)
    seqs = np.frombuffer(sequences, np.int64) if isinstance(sequences, bytes) else np.asarray(sequences, np.int64)
    size = len(data)
    n = len(rel)
    if len(seqs) != n:
        raise ValueError("read_messages: offsets and sequences differ in length")
    mids: list[bytes | None] = [None] * n
    payloads: list[bytes | None] = [None] * n
    headers: list[bytes | None] = [None] * n
    if size < _HEAD_SIZE or n == 0:
        return mids, payloads, headers, list(range(n))
    room = (rel >= 0) & (rel + _HEAD_SIZE <= size)
    u8 = np.frombuffer(data, dtype=np.uint8)
    h = u8[np.clip(rel, 0, size - _HEAD_SIZE)[:, None] + _HEAD_RANGE].view(_HEAD_DTYPE)[:, 0]
    length = h["length"].astype(np.int64)
    slen = h["slen"].astype(np.int64)
    mlen = h["mlen"].astype(np.int64)
    hlen = h["hlen"].astype(np.int64)
    plen = h["plen"].astype(np.int64)
    end = rel + framing.HEADER_SIZE + length
    ok = (
        room
        & (h["magic"] == framing.MAGIC)
        & (h["kind"] == RecordKind.MESSAGE)
        & (h["version"] == framing.VERSION)
        & (h["sequence"].astype(np.int64) == seqs)
        & (end <= size)
        & (records.MESSAGE_FIXED.size + slen + mlen + hlen + plen == length)
    )
    cand = np.flatnonzero(ok)
    sums = np.fromiter(
        map(
            framing._xxh,
            map(data.__getitem__, map(slice, (rel[cand] + framing.CHECKED_FROM).tolist(), end[cand].tolist())),
        ),
        dtype=np.uint64,
        count=len(cand),
    )
    good = cand[sums == h["checksum"][cand]]
    a = rel[good] + _HEAD_SIZE + slen[good]
    b = a + mlen[good]
    e = end[good]
    for k, mid, payload in zip(
        good.tolist(),
        map(data.__getitem__, map(slice, a.tolist(), b.tolist())),
        map(data.__getitem__, map(slice, (e - plen[good]).tolist(), e.tolist())),
    ):
        mids[k] = mid
        payloads[k] = payload
    for pos in np.flatnonzero(hlen[good] > 0).tolist():
        k = int(good[pos])
        headers[k] = data[int(b[pos]) : int(b[pos]) + int(hlen[k])]
    bad = np.ones(n, dtype=bool)
    bad[good] = False
    return mids, payloads, headers, np.flatnonzero(bad).tolist()


def read_frames_past_damage(
    seg: Segment, start: int, stop: int, max_bytes: int = SCAN_BYTES
) -> tuple[list[Frame], int, CorruptRecord | None]:
    """Like :func:`read_frames`, but a bad frame does not stop the reading: the frames
    before it are returned, and the next offset is the next valid frame after it (or
    ``stop``); the third value reports the damage (None when there was none). For readers
    that step over a corrupt record (its message is lost, the others are not)."""
    try:
        frames, nxt = read_frames(seg, start, stop, max_bytes)
        return frames, nxt, None
    except CorruptRecord as err:
        damage = err
    frames = []
    pos = start
    while pos < damage.offset:
        more, pos = read_frames(seg, pos, damage.offset, max_bytes)
        frames.extend(more)
    rest = seg.read(damage.offset, stop - damage.offset)
    found = next_frame(rest, 1)
    return frames, damage.offset + found if found is not None else stop, damage


def columns_past_damage(seg: Segment, start: int, stop: int, max_bytes: int = SCAN_BYTES) -> tuple[Columns | None, int]:
    """Like :func:`read_columns`, stepping over a bad frame: (columns of the frames before
    it, or None if there are none; where reading goes on)."""
    try:
        cols = read_columns(seg, start, stop, max_bytes)
        return cols, cols.base + cols.end
    except CorruptRecord as err:
        cols_before = read_columns(seg, start, err.offset) if err.offset > start else None
        rest = seg.read(err.offset, stop - err.offset)
        found = next_frame(rest, 1)
        return cols_before, err.offset + found if found is not None else stop


def kind_frames(seg: Segment, kind: int, start: int = 0, stop: int | None = None) -> Iterator[Frame]:
    """The frames of one kind in [start, stop) of ``seg`` (stop None: its size); a corrupt
    record is stepped over (for the dispatch log: at worst its message is delivered again,
    as at-least-once allows)."""
    end = seg.size if stop is None else stop
    pos = start
    while pos < end:
        frames, pos, _damage = read_frames_past_damage(seg, pos, end)
        yield from (f for f in frames if f.kind == kind)
