"""Finding one record in a bucket's segments, for Cancel and Get.

A schedule segment's records are found through the index file beside it
(segments/schedule_index.py): a binary search over a memory map of fixed-width entries,
so a lookup costs the same in a minute of a thousand records as in one of a million, cold
or not; only the maps of the last few index files looked up are kept (their touched
pages). A MESSAGE's entry carries its due time, a hash of its id and whether a tombstone
of it follows, so a batch of receipts (CancelBatch) and their tombstones are checked
without reading a record.
"""

from __future__ import annotations

import array
import collections
import logging
import threading
from collections.abc import Iterator

import numpy as np
import xxhash

from qdelay.errors import CorruptRecord, InvariantViolation
from qdelay.segments import reader, records
from qdelay.segments.framing import Frame, RecordKind
from qdelay.segments.reader import CORRUPT, SCAN_BYTES, Columns, Damage, read_columns, read_frames, walk_reads
from qdelay.segments.schedule_index import (
    CANCELLED,
    FLAGS_SHIFT,
    OFFSET_BITS,
    IndexFile,
    id_hashes,
    index_confirm,
    index_gather,
)
from qdelay.segments.segment import Segment

_CANCEL_TARGET_AT = records.CANCEL_TARGET_SEQUENCE_AT  # CANCEL body: the target's sequence
_DISPATCHED_AT = records.DISPATCH_DISPATCHED_AT
_MESSAGE = int(RecordKind.MESSAGE)


log = logging.getLogger("qdelay.lookup")


def _index(seg: Segment) -> IndexFile:
    if seg.index is None:
        raise InvariantViolation(f"{seg.path} has no schedule index (the schedule log keeps one beside each)")
    return seg.index


# a lookup that would read more than this to bring the dispatch index up to date is not
# "ready" (DispatchIndex.ready): it goes to a worker thread
READY_SLACK = 64 * 1024


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


def _receipt_matches(kind: int, due: int, id_hash: int, want_due: int, message_id: str) -> bool:
    """Whether a schedule-index entry (its kind, due time and id hash) is the MESSAGE a
    receipt names: same due time and the xxh3-64 of the receipt's (non-empty) id."""
    return (
        kind == _MESSAGE
        and due == want_due
        and bool(message_id)
        and id_hash == xxhash.xxh3_64_intdigest(message_id.encode())
    )


class RecordFinder:
    """Finds a record and its tombstone in a schedule segment through its index file
    (no walk of the segment)."""

    def find(self, seg: Segment, sequence: int) -> Frame | None:
        """The frame with ``sequence`` in a schedule segment, or None."""
        idx = _index(seg)
        entry = idx.entry(sequence)
        if entry is None:
            return None
        try:
            frame = seg.read_frame(entry[0])
        except CorruptRecord as err:
            # rotted after it was indexed: never served, as the loader skips it (rows 5b, 14d)
            log.warning("a looked-up record is damaged", extra={"path": err.path, "offset": err.offset})
            return None
        if frame.sequence != sequence:
            raise CorruptRecord(idx.path, 0, f"the index places sequence {sequence} where {frame.sequence} is")
        return frame

    def find_many(self, seg: Segment, sequences: list[int]) -> list[Frame | None]:
        """``find`` of each of ``sequences`` in one segment: one search of its index, then
        the records read a run of nearby ones at a time (``reader.read_frames_at``). A
        damaged record is None, as ``find`` has it (the others are then read one by one)."""
        if len(sequences) == 1:
            return [self.find(seg, sequences[0])]
        idx = _index(seg)
        found = idx.lookup(sequences)
        rows = np.flatnonzero(found.hit).tolist()
        out: list[Frame | None] = [None] * len(sequences)
        if not rows:
            return out
        try:
            frames = reader.read_frames_at(seg, found.offsets.tolist())
        except CorruptRecord:
            return [self.find(seg, seq) for seq in sequences]  # which one, and the rest
        for i, frame in zip(rows, frames):
            if frame.sequence != sequences[i]:
                raise CorruptRecord(idx.path, 0, f"the index places sequence {sequences[i]} where {frame.sequence} is")
            out[i] = frame
        return out

    def ready(self, seg: Segment) -> bool:
        """Whether a lookup in ``seg`` can run without waiting or reading much (Engine.get_now):
        always, for a segment with its index (a lookup reads ~log2(n) entries and one
        record, and takes no lock)."""
        return seg.index is not None

    def holds(
        self, seg: Segment, sequences: np.ndarray | list[int], dues: np.ndarray | list[int], message_ids: list[str]
    ) -> list[bool]:
        """Whether ``seg`` holds, for each (sequence, due, id), a MESSAGE with exactly that
        sequence and due time and an id of that 64-bit hash (as far as it is written): a
        batch of receipts checked in one search of the index, no record read."""
        return self.holds_at(seg, sequences, dues, message_ids)[0].tolist()

    def holds_at(
        self, seg: Segment, sequences: np.ndarray | list[int], dues: np.ndarray | list[int], message_ids: list[str]
    ) -> tuple[np.ndarray, np.ndarray]:
        """``holds`` as a bool array, and where each held MESSAGE's entry is in the index (-1
        for the others), for ``cancelled_at``: CancelBatch searches the index once a target."""
        ok, where, _cancelled = self.holds_across([(seg, np.arange(len(sequences)))], sequences, dues, message_ids)
        return ok, where

    def holds_across(
        self,
        parts: list[tuple[Segment, np.ndarray]],
        sequences: np.ndarray | list[int],
        dues: np.ndarray | list[int],
        message_ids: list[str],
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``holds_at`` for a batch spread over several segments: ``parts`` names each
        segment and the rows of the batch to look for in it (rows in no part are not held);
        (held, where, and whether each held one's entry was flagged CANCELLED as this search
        read it). One index search per segment; the entries' fields are compared once for
        the whole batch, so that a segment costs its search and little else (a batch of
        retried sends can touch a different minute per message)."""
        n = len(sequences)
        ok = np.zeros(n, dtype=bool)
        where = np.full(n, -1, dtype=np.int64)
        cancelled = np.zeros(n, dtype=bool)
        parts = [(seg, rows) for seg, rows in parts if len(rows)]
        if not parts:
            return ok, where, cancelled
        seqs = np.asarray(sequences, dtype=np.int64)
        order = parts[0][1] if len(parts) == 1 else np.concatenate([rows for _seg, rows in parts])
        q = seqs[order]
        counts = np.fromiter((len(rows) for _seg, rows in parts), dtype=np.int64, count=len(parts))
        highest = np.maximum.reduceat(q, np.cumsum(counts) - counts).tolist()
        # one native call searches every segment's index (index_gather): per segment only
        # its map is fetched here
        views = [_index(seg).searchable(top) for (seg, _rows), top in zip(parts, highest)]
        pos, words = index_gather(views, q, counts)
        hit = pos >= 0
        if not len(words):
            return ok, where, cancelled
        rows, pos = order[hit], pos[hit]
        if len(rows) == n:  # every row found (the usual batch): the batch's own order, no list made
            if not bool((rows[1:] > rows[:-1]).all()):
                order = np.argsort(rows, kind="stable")
                rows, pos, words = rows[order], pos[order], words[order]
            ids = message_ids
        else:
            ids = [message_ids[i] for i in rows.tolist()]
        kinds = words[:, 1] >> np.uint64(OFFSET_BITS) & np.uint64(0xFF)
        good = (kinds == _MESSAGE) & (words[:, 2].view(np.int64) == np.asarray(dues, dtype=np.int64)[rows])
        good &= words[:, 3] == id_hashes(ids)
        good &= np.fromiter(map(bool, ids), dtype=bool, count=len(ids))  # an empty id is no receipt
        held = rows[good]
        ok[held] = True
        where[held] = pos[good]
        cancelled[held] = (words[good, 1] >> np.uint64(FLAGS_SHIFT) & np.uint64(CANCELLED)) != 0
        return ok, where, cancelled

    def holds_few(
        self, parts: list[tuple[Segment, list[int]]], sequences: list[int], dues: list[int], message_ids: list[str]
    ) -> list[int]:
        """``holds_across`` for a few receipts (a gathered ``cancel()`` batch claimed on the
        event loop), as lists: where each held MESSAGE's entry is in its segment's index, -1
        where not held. One native call searches the indexes and compares the entries found
        with the receipts (``index_confirm``): for 16 targets holds_across's dozen array
        steps cost ~50 us in process (~100 in a busy server), the search with the fields
        compared in Python ~25, this ~5."""
        n = len(sequences)
        parts = [(seg, rows) for seg, rows in parts if rows]
        if not parts:
            return [-1] * n
        views = [_index(seg).searchable(max([sequences[i] for i in rows])) for seg, rows in parts]
        if len(parts) == 1 and len(parts[0][1]) == n and parts[0][1][0] == 0:  # one minute, rows in order
            return index_confirm(views, [n], list(sequences), list(dues), list(message_ids))
        order = [i for _seg, rows in parts for i in rows]
        found = index_confirm(
            views,
            [len(rows) for _seg, rows in parts],
            [sequences[i] for i in order],
            [dues[i] for i in order],
            [message_ids[i] for i in order],
        )
        where = [-1] * n
        for i, p in zip(order, found):
            where[i] = p
        return where

    def holds_one(self, seg: Segment, sequence: int, due: int, message_id: str) -> bool:
        """``holds`` of one receipt without arrays (``IndexFile.entry``: the search, then the
        32 bytes unpacked): a one-target Cancel or Reschedule on the event loop, where a
        batch's arrays cost ~100 us of numpy calls for one row."""
        entry = _index(seg).entry(sequence)
        return entry is not None and _receipt_matches(entry[1], entry[3], entry[4], due, message_id)

    def cancelled_at(self, seg: Segment, positions: np.ndarray) -> np.ndarray:
        """Whether the MESSAGE entries at ``positions`` of ``seg``'s index (from ``holds_at``)
        are flagged CANCELLED now: the flags read again without a second search (an entry
        never moves; a tombstone sets its target's flag in place)."""
        return (_index(seg).flags_at(positions) & CANCELLED) != 0

    def cancelled_few(self, seg: Segment, positions: list[int]) -> list[bool]:
        """``cancelled_at`` of a few positions (from ``holds_few``), as a list: the flag bytes
        read from the map one by one, where an array's steps cost more than the reads."""
        return [bool(flags & CANCELLED) for flags in _index(seg).flags_of(positions)]

    def cancelled(self, seg: Segment, target: int) -> bool:
        """Whether ``seg`` holds a CANCEL for its MESSAGE ``target`` (as far as it is written)."""
        entry = _index(seg).entry(target)
        return entry is not None and entry[1] == _MESSAGE and bool(entry[2] & CANCELLED)

    def cancelled_among(self, seg: Segment, targets: np.ndarray) -> np.ndarray:
        """For each of ``targets``, whether ``seg`` holds that MESSAGE and a CANCEL of it (a
        bool each): one search of the index for a batch of lookups in one bucket."""
        found = _index(seg).lookup(targets)
        out = np.zeros(len(targets), dtype=bool)
        out[np.flatnonzero(found.hit)] = (found.kinds == _MESSAGE) & ((found.flags & CANCELLED) != 0)
        return out

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
        """Whether a lookup in ``seg`` (None: no dispatch log, nothing to read) now reads at
        most ``slack`` bytes to bring its arrays up to date, and nobody holds the index (a
        look without waiting, for a caller deciding whether a lookup can run on the event
        loop: Engine.get_now)."""
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
