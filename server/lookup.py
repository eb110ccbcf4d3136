"""Finding one record in a bucket's segments, for Cancel and Get.

Schedule segments are written in sequence order (the iterate service copies the message
log in order and skips replays), so a sparse index of every 64th record's sequence and
offset turns a lookup into a bisect and a short scan. Indexes are built lazily, extended
as segments grow, and kept for a bounded number of buckets.
"""

from __future__ import annotations

import array
import bisect
import collections
import threading

import numpy as np

from qdelay.errors import CorruptRecord
from qdelay.segments import framing, records
from qdelay.segments.framing import Frame, FrameError, RecordKind
from qdelay.segments.segment import Segment

SPARSE_EVERY = 64
SCAN_BYTES = 1024 * 1024


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


class SparseIndex:
    __slots__ = ("seqs", "offsets", "upto", "count")

    def __init__(self) -> None:
        self.seqs: list[int] = []
        self.offsets: list[int] = []
        self.upto = 0
        self.count = 0


class RecordFinder:
    def __init__(self, capacity: int = 128) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._indexes: collections.OrderedDict[str, SparseIndex] = collections.OrderedDict()

    def _index(self, seg: Segment) -> SparseIndex:
        with self._lock:
            idx = self._indexes.get(seg.path)
            if idx is None:
                idx = self._indexes[seg.path] = SparseIndex()
                while len(self._indexes) > self.capacity:
                    self._indexes.popitem(last=False)
            else:
                self._indexes.move_to_end(seg.path)
        stop = seg.size
        while idx.upto < stop:
            frames, nxt = read_frames(seg, idx.upto, stop)
            for f in frames:
                if idx.count % SPARSE_EVERY == 0:
                    idx.seqs.append(f.sequence)
                    idx.offsets.append(f.offset)
                idx.count += 1
            idx.upto = nxt
        return idx

    def forget(self, path: str) -> None:
        with self._lock:
            self._indexes.pop(path, None)

    def find(self, seg: Segment, sequence: int) -> Frame | None:
        """The frame with ``sequence`` in a schedule segment, or None."""
        idx = self._index(seg)
        i = bisect.bisect_right(idx.seqs, sequence) - 1
        if i < 0:
            return None
        pos = idx.offsets[i]
        stop = idx.upto
        while pos < stop:
            frames, nxt = read_frames(seg, pos, stop, 64 * 1024)
            for f in frames:
                if f.sequence == sequence:
                    return f
                if f.sequence > sequence:
                    return None
            pos = nxt
        return None

    @staticmethod
    def find_cancel(seg: Segment, target: int, start: int, stop: int | None = None) -> Frame | None:
        """A CANCEL for ``target`` at or after ``start`` (tombstones follow their target)."""
        stop = seg.size if stop is None else stop
        pos = start
        while pos < stop:
            frames, nxt = read_frames(seg, pos, stop)
            for f in frames:
                if f.kind == RecordKind.CANCEL and records.decode_cancel(f.body).target_sequence == target:
                    return f
            pos = nxt
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
            entry = self._cache.get(seg.path)
            if entry is None:
                entry = self._cache[seg.path] = [array.array("q"), array.array("q"), 0]
                while len(self._cache) > self.capacity:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(seg.path)
            seqs, ats, upto = entry
            stop = seg.size
            while upto < stop:
                frames, upto = read_frames(seg, upto, stop)
                for f in frames:
                    if f.kind == RecordKind.DISPATCH:
                        seqs.append(f.sequence)
                        ats.append(records.DISPATCH_FIXED.unpack_from(f.body, 0)[1])
            entry[2] = upto
            if not seqs:
                return None
            hits = np.flatnonzero(np.frombuffer(seqs, dtype=np.int64) == sequence)
            return int(ats[int(hits[0])]) if len(hits) else None

    def forget(self, path: str) -> None:
        with self._lock:
            self._cache.pop(path, None)
