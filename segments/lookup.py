"""Finding one record in a bucket's segments, for Cancel and Get.

Schedule segments are written in sequence order (the iterate service copies the message
log in order and skips replays), so a sparse index of every 64th record's sequence and
offset turns a lookup into a bisect and a short scan. Indexes are built lazily, extended
as segments grow, and kept for a bounded number of buckets. Each also keeps every
MESSAGE's sequence, due time and id (about 24 bytes plus the id a message, at most
``max_bytes`` for all buckets kept), so that a batch of receipts (CancelBatch) is checked
against its segment with one binary search and one byte comparison (``holds``).
"""

from __future__ import annotations

import array
import bisect
import collections
import threading
from collections.abc import Iterator

import numpy as np

from qdelay.segments import framing, records
from qdelay.segments.framing import Frame, RecordKind
from qdelay.segments.reader import CORRUPT, SCAN_BYTES, Columns, Damage, read_columns, read_frames, walk_reads
from qdelay.segments.segment import Segment

SPARSE_EVERY = 64
_CANCEL_TARGET_AT = records.CANCEL_TARGET_SEQUENCE_AT  # CANCEL body: the target's sequence
_DISPATCHED_AT = records.DISPATCH_DISPATCHED_AT
# a MESSAGE's subject and id lengths and its subject, from the frame's start (the body's
# offsets are named in segments/records.py)
_SUBJECT_LEN_AT = framing.HEADER_SIZE + records.MESSAGE_SUBJECT_LEN_AT
_ID_LEN_AT = framing.HEADER_SIZE + records.MESSAGE_ID_LEN_AT
_SUBJECT_AT = framing.HEADER_SIZE + records.MESSAGE_FIXED.size


class SparseIndex:
    """Every SPARSE_EVERY-th record's sequence and offset, and the targets of every CANCEL
    seen, of one schedule segment up to ``upto``; and of every MESSAGE its sequence, due
    time and id (``mseqs``, ``mdues``, the ids end to end in ``ids`` with ``id_ends``), so
    that a batch of receipts is checked against the segment in a few vectorised steps."""

    __slots__ = ("seqs", "offsets", "upto", "count", "cancelled", "mseqs", "mdues", "id_ends", "ids", "ordered")

    def __init__(self) -> None:
        self.seqs: list[int] = []
        self.offsets: list[int] = []
        self.upto = 0
        self.count = 0
        self.cancelled: set[int] = set()
        self.mseqs = array.array("q")
        self.mdues = array.array("q")
        self.id_ends = array.array("q")
        self.ids = bytearray()
        self.ordered = True  # MESSAGE sequences ascending (as the iterate service writes them)

    @property
    def dense_bytes(self) -> int:
        return len(self.ids) + 24 * len(self.mseqs)


def _ragged(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The positions ``starts[i] .. starts[i] + lengths[i]`` of every row, end to end."""
    total = int(lengths.sum())
    offsets = np.cumsum(lengths) - lengths  # where each row begins in the output
    return np.repeat(starts - offsets, lengths) + np.arange(total, dtype=np.int64)


def _add_messages(idx: SparseIndex, cols: Columns) -> None:
    """Append the sequence, due time and id of every MESSAGE of ``cols`` to ``idx``."""
    rows = np.flatnonzero(cols.kinds == RecordKind.MESSAGE)
    if not len(rows):
        return
    st = cols.starts[rows]
    seqs = cols.seqs[rows]
    if (len(seqs) > 1 and bool((np.diff(seqs) <= 0).any())) or (idx.mseqs and int(seqs[0]) <= idx.mseqs[-1]):
        idx.ordered = False  # never written so: callers then look records up one by one
    raw = np.frombuffer(cols.data, dtype=np.uint8)
    slen = raw[st + _SUBJECT_LEN_AT].astype(np.int64) | (raw[st + _SUBJECT_LEN_AT + 1].astype(np.int64) << 8)
    ilen = raw[st + _ID_LEN_AT].astype(np.int64) | (raw[st + _ID_LEN_AT + 1].astype(np.int64) << 8)
    base = len(idx.ids)
    idx.ids += raw[_ragged(st + _SUBJECT_AT + slen, ilen)].tobytes()
    idx.id_ends.frombytes((np.cumsum(ilen) + base).tobytes())
    idx.mseqs.frombytes(seqs.astype(np.int64).tobytes())
    idx.mdues.frombytes(cols.dues[rows].astype(np.int64).tobytes())


# a lookup that would read more than this to bring an index up to date is not "ready"
# (RecordFinder.ready, DispatchIndex.ready): it goes to a worker thread
READY_SLACK = 64 * 1024

# up to this many receipts, ``holds`` checks them one by one: a binary search and a slice
# comparison each cost ~2 us, while the vectorised form's ~20 numpy calls cost ~25 us
# whatever the batch (a client gathering concurrent cancel() calls sends batches of a few)
SCALAR_UPTO = 16


def _holds_each(
    idx: SparseIndex, sequences: np.ndarray | list[int], dues: np.ndarray | list[int], message_ids: list[str]
) -> list[bool]:
    """``RecordFinder.holds`` for a few receipts, one at a time (the same answers: the test
    of the finder runs both forms on the same queries)."""
    ms, md, ends, ids = idx.mseqs, idx.mdues, idx.id_ends, idx.ids
    count = len(ms)
    seqs = sequences.tolist() if isinstance(sequences, np.ndarray) else sequences
    ats = dues.tolist() if isinstance(dues, np.ndarray) else dues
    out = []
    for seq, due, mid in zip(seqs, ats, message_ids):
        pos = bisect.bisect_left(ms, seq)
        if pos == count or ms[pos] != seq or md[pos] != due:
            out.append(False)
            continue
        start = ends[pos - 1] if pos else 0
        raw = mid.encode()
        out.append(len(raw) > 0 and ends[pos] - start == len(raw) and ids[start : ends[pos]] == raw)
    return out


def _verified(seg: Segment, start: int, stop: int, chunk: int = SCAN_BYTES) -> Iterator[Columns | int]:
    """The verified frames of ``seg`` in [start, stop) as columns, around corrupt records:
    a rotted record is skipped and reading resumes at the next valid frame, as the loader
    does (docs/recovery.md rows 5b, 14d), so that the messages after it stay found by Get,
    Cancel and dedupe. A torn or unwritten tail ends the walk: its offset is yielded last
    (an int), where a later look starts again."""
    for part in walk_reads(seg.read, start, stop, chunk):
        if isinstance(part, Damage):
            if part.status != CORRUPT:
                yield part.offset
                return
            continue
        yield part


class RecordFinder:
    """Finds a record and its tombstone in a schedule segment without walking the segment:
    each segment's index is extended by the bytes appended since the last look (read as
    columns, no object per record), so a Cancel or Get in a minute of N records costs the
    same whatever N is."""

    def __init__(self, capacity: int = 128, max_bytes: int = 64 * 1024 * 1024) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes  # the per-message columns of the indexes kept, at most
        self._bytes = 0
        self._lock = threading.Lock()
        self._indexes: collections.OrderedDict[str, SparseIndex] = collections.OrderedDict()

    def _index(self, seg: Segment) -> SparseIndex:
        with self._lock:
            idx = self._indexes.get(seg.path)
            if idx is None:
                idx = self._indexes[seg.path] = SparseIndex()
                while len(self._indexes) > self.capacity:
                    self._bytes -= self._indexes.popitem(last=False)[1].dense_bytes
            else:
                self._indexes.move_to_end(seg.path)
            stop = seg.size
            before = idx.dense_bytes
            for cols in _verified(seg, idx.upto, stop):
                if isinstance(cols, int):
                    break  # a tail not whole: looked at again from there next time
                n = len(cols)
                first = (-idx.count) % SPARSE_EVERY  # the next row whose count is a multiple
                idx.seqs.extend(cols.seqs[first::SPARSE_EVERY].tolist())
                idx.offsets.extend((cols.starts[first::SPARSE_EVERY] + cols.base).tolist())
                cancels = cols.kinds == RecordKind.CANCEL
                if cancels.any():
                    idx.cancelled.update(cols.u64_at(cancels, _CANCEL_TARGET_AT).tolist())
                _add_messages(idx, cols)
                idx.count += n
                idx.upto = cols.base + cols.end
            self._bytes += idx.dense_bytes - before
            while self._bytes > self.max_bytes and len(self._indexes) > 1:
                oldest = next(iter(self._indexes))
                if oldest == seg.path:
                    break
                self._bytes -= self._indexes.pop(oldest).dense_bytes
            return idx

    def ready(self, seg: Segment, slack: int = READY_SLACK) -> bool:
        """Whether a lookup in ``seg`` now reads at most ``slack`` bytes to bring its index up
        to date, and nobody holds the finder (a look without waiting, for a caller deciding
        whether a lookup can run on the event loop: Engine.get_now)."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            idx = self._indexes.get(seg.path)
            return idx is not None and seg.size - idx.upto <= slack
        finally:
            self._lock.release()

    def holds(
        self, seg: Segment, sequences: np.ndarray | list[int], dues: np.ndarray | list[int], message_ids: list[str]
    ) -> list[bool]:
        """Whether ``seg`` holds, for each (sequence, due, id), a MESSAGE with exactly that
        sequence, due time and id (as far as it is written): a batch of receipts checked in
        one binary search and one byte comparison, instead of a record read each."""
        idx = self._index(seg)
        n = len(sequences)
        with self._lock:  # the arrays may not grow while numpy looks at them
            if not idx.ordered or not idx.mseqs or n == 0:
                return [False] * n
            if n <= SCALAR_UPTO:
                return _holds_each(idx, sequences, dues, message_ids)
            ms = np.frombuffer(idx.mseqs, dtype=np.int64)
            q = np.asarray(sequences, dtype=np.int64)
            pos = np.minimum(np.searchsorted(ms, q), len(ms) - 1)
            ok = (ms[pos] == q) & (np.frombuffer(idx.mdues, dtype=np.int64)[pos] == np.asarray(dues, dtype=np.int64))
            ends = np.frombuffer(idx.id_ends, dtype=np.int64)
            rec_end = ends[pos]
            rec_start = np.where(pos > 0, ends[pos - 1], 0)
            raw = [m.encode() for m in message_ids]
            q_len = np.fromiter(map(len, raw), dtype=np.int64, count=n)
            ok &= (rec_end - rec_start == q_len) & (q_len > 0)
            rows = np.flatnonzero(ok)
            if len(rows):
                lens = q_len[rows]
                want = np.frombuffer(b"".join([raw[i] for i in rows.tolist()]), dtype=np.uint8)
                have = np.frombuffer(idx.ids, dtype=np.uint8)[_ragged(rec_start[rows], lens)]
                first = np.cumsum(lens) - lens
                ok[rows] = np.minimum.reduceat(want == have, first)
            return ok.tolist()

    def forget(self, path: str) -> None:
        with self._lock:
            idx = self._indexes.pop(path, None)
            if idx is not None:
                self._bytes -= idx.dense_bytes

    def find(self, seg: Segment, sequence: int) -> Frame | None:
        """The frame with ``sequence`` in a schedule segment, or None."""
        idx = self._index(seg)
        i = bisect.bisect_right(idx.seqs, sequence) - 1
        if i < 0:
            return None
        pos = idx.offsets[i]
        # the record is before the next sparse entry: read at most SPARSE_EVERY records
        stop = idx.offsets[i + 1] if i + 1 < len(idx.offsets) else idx.upto
        for cols in _verified(seg, pos, stop, 64 * 1024):
            if isinstance(cols, int):
                return None
            hits = np.flatnonzero(cols.seqs == sequence)
            if len(hits):
                return seg.read_frame(cols.base + int(cols.starts[hits[0]]))
            if len(cols.seqs) and cols.seqs[-1] > sequence:
                return None
        return None

    def cancelled(self, seg: Segment, target: int) -> bool:
        """Whether ``seg`` holds a CANCEL for ``target`` (as far as the segment is written)."""
        return target in self._index(seg).cancelled

    def tombstones(self, seg: Segment) -> set[int]:
        """The targets of every CANCEL in ``seg`` as far as it is written (the index's own
        set: read it, never change it), for a batch of lookups in one bucket."""
        return self._index(seg).cancelled

    @staticmethod
    def cancel_stamp(seg: Segment, target: int, start: int = 0) -> int | None:
        """The timestamp of the first CANCEL for ``target`` in ``seg`` at or after ``start``
        (a tombstone follows its target's record: give that record's offset), or None. A walk
        of the rest of the segment, for the rare caller that needs when a message was
        cancelled (an idempotent send's retry, server/engine.py ``duplicates_among``)."""
        for cols in _verified(seg, start, seg.size):
            if isinstance(cols, int):
                return None
            rows = np.flatnonzero(cols.kinds == RecordKind.CANCEL)
            if len(rows):
                hits = rows[cols.u64_at(rows, _CANCEL_TARGET_AT) == target]
                if len(hits):
                    return cols.stamp(int(hits[0]))
        return None

    @staticmethod
    def find_dispatch(
        seg: Segment | None, sequence: int, start: int = 0, stop: int | None = None
    ) -> tuple[Frame | None, int]:
        """The first DISPATCH record for ``sequence`` in [start, stop); (frame, where it stopped)."""
        if seg is None:
            return None, 0
        stop = seg.size if stop is None else stop
        pos = start
        while pos < stop:
            frames, nxt = read_frames(seg, pos, stop)
            for f in frames:
                if f.sequence == sequence and f.kind == RecordKind.DISPATCH:
                    return f, nxt
            pos = nxt
        return None, pos


class DispatchIndex:
    """Which sequences a dispatch segment closed, and when each was dispatched.

    Kept as two packed arrays per segment (16 bytes a record), extended incrementally
    as the segment grows, for a bounded number of segments: a Cancel or Get in a busy
    minute costs one vectorised comparison instead of a scan of the file.
    """

    def __init__(self, capacity: int = 32) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[str, list] = collections.OrderedDict()

    def lookup(self, seg: Segment | None, sequence: int) -> int | None:
        """The dispatched_at_ms of ``sequence``'s DISPATCH record in ``seg``, or None."""
        if seg is None:
            return None
        with self._lock:
            hits, ats, _offs = self._hits(self._entry(seg), seg, sequence)
            return int(ats[int(hits[0])]) if len(hits) else None

    def _entry(self, seg: Segment) -> list:
        """The cached arrays of ``seg`` (lock held): [sequences, dispatched_at, bytes indexed,
        file offsets], the least recently used segment's dropped beyond ``capacity``."""
        entry = self._cache.get(seg.path)
        if entry is None:
            entry = self._cache[seg.path] = [array.array("q"), array.array("q"), 0, array.array("q")]
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(seg.path)
        return entry

    def ready(self, seg: Segment | None, slack: int = READY_SLACK) -> bool:
        """As ``RecordFinder.ready``: whether a lookup in ``seg`` (None: no dispatch log, nothing
        to read) reads at most ``slack`` bytes and nobody holds the index."""
        if seg is None:
            return True
        if not self._lock.acquire(blocking=False):
            return False
        try:
            entry = self._cache.get(seg.path)
            return seg.size - (entry[2] if entry is not None else 0) <= slack
        finally:
            self._lock.release()

    def offsets(self, seg: Segment | None, sequence: int) -> list[int]:
        """File offsets of every DISPATCH record of ``sequence`` in ``seg`` (one per group
        that closed it, or more: at least once), in file order."""
        if seg is None:
            return []
        with self._lock:
            hits, _ats, offs = self._hits(self._entry(seg), seg, sequence)
            return [int(offs[int(i)]) for i in hits]

    def closed_among(self, seg: Segment | None, sequences: np.ndarray) -> np.ndarray:
        """Which of ``sequences`` have a DISPATCH record in ``seg`` (a bool per sequence): one
        vectorised membership test for a batch of lookups in one bucket."""
        if seg is None:
            return np.zeros(len(sequences), dtype=bool)
        with self._lock:
            entry = self._entry(seg)
            self._extend(entry, seg)
            if not entry[0]:
                return np.zeros(len(sequences), dtype=bool)
            return np.isin(sequences, np.frombuffer(entry[0], dtype=np.int64))

    @staticmethod
    def _extend(entry: list, seg: Segment) -> None:
        """Extend ``entry`` (lock held) to the segment's size."""
        seqs, ats, upto, offs = entry
        stop = seg.size
        while upto < stop:
            cols = read_columns(seg, upto, stop)
            rows = cols.kinds == RecordKind.DISPATCH
            seqs.frombytes(cols.seqs[rows].tobytes())
            ats.frombytes(cols.u64_at(rows, _DISPATCHED_AT).tobytes())
            offs.frombytes((cols.starts[rows] + cols.base).astype(np.int64).tobytes())
            upto = cols.base + cols.end
        entry[2] = upto

    @classmethod
    def _hits(cls, entry: list, seg: Segment, sequence: int) -> tuple[np.ndarray, array.array, array.array]:
        """Extend ``entry`` (lock held) to the segment's size; the positions of ``sequence``."""
        cls._extend(entry, seg)
        seqs, ats, _upto, offs = entry
        if not seqs:
            return np.empty(0, dtype=np.int64), ats, offs
        return np.flatnonzero(np.frombuffer(seqs, dtype=np.int64) == sequence), ats, offs

    def forget(self, path: str) -> None:
        with self._lock:
            self._cache.pop(path, None)
