"""Segments keyed by due bucket: the schedule log and the dispatch log.

Both logs keep one segment per due bucket (``scale_minutes`` wide, named by its UTC
start minute, in day folders; see ``segments.naming``). Segments are opened lazily
through the shared handle pool, so far-future buckets cost a directory entry and a small
Python object, not an open file.

The schedule log (``indexed``) keeps an index file beside each segment
(segments/schedule_index.py), written with every append, synced, truncated and deleted
with its segment, and checked (re-derived where it does not match) by ``check_indexes``
at open.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from collections.abc import Callable

import numpy as np

from qdelay.segments import framing, naming, records
from qdelay.segments.framing import Frame
from qdelay.segments.reader import Columns, columns_past_damage, gather, scan_columns
from qdelay.segments.schedule_index import IndexFile
from qdelay.segments.schedule_index import path_of as index_path
from qdelay.segments.segment import CorruptionPolicy, HandlePool, Recovery, Segment, fsync_dir, recover

log = logging.getLogger("qdelay.buckets")


_SYNC_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_SYNC_POOL_LOCK = threading.Lock()


SYNC_THREADS = 8


def sync_all(segments: list[Segment]) -> None:
    """fdatasync many segments, several at a time: a far-future ingest touches a thousand
    minute files between two checkpoints, and an SSD serves parallel flushes much faster
    than the same flushes one after another.

    SYNC_THREADS tasks take the segments from one shared iterator (its ``next`` is atomic
    under the GIL), not a task a segment: a future per segment was ~700 B of Python
    objects each (its condition and locks), ~2 MB a checkpoint at 2,880 minute files, in
    pymalloc arenas that the burst's long-lived objects then pinned (docs/benchmarks.md,
    "RSS per pending message"). A failing fsync ends its task; the others sync the rest,
    and the first error (in task order) propagates to the caller once every task is done
    (raised at once, it let the caller stop the service and close segments that tasks
    were still syncing)."""
    global _SYNC_POOL
    if len(segments) <= 2:
        for seg in segments:
            seg.sync()
        return
    with _SYNC_POOL_LOCK:
        if _SYNC_POOL is None:
            _SYNC_POOL = concurrent.futures.ThreadPoolExecutor(SYNC_THREADS, thread_name_prefix="qdelay-fsync")
    todo = iter(segments)

    def run() -> None:
        for seg in todo:
            seg.sync()

    futures = [_SYNC_POOL.submit(run) for _ in range(min(SYNC_THREADS, len(segments)))]
    concurrent.futures.wait(futures)
    for fut in futures:
        fut.result()


def sync_dirs(dirs: list[str]) -> None:
    """fsync directories that gained entries; one deleted since (the cleaner removes empty
    day folders) needs nothing."""
    for d in dirs:
        try:
            fsync_dir(d)
        except FileNotFoundError:
            pass


# DISPATCH body: the group's name is its last ``group_len`` bytes (0: the default group)
_GROUP_LEN_AT = records.DISPATCH_FIXED.size - 3


def group_closes(cols: Columns, group: str) -> np.ndarray:
    """Sequences of the DISPATCH frames in ``cols`` that close their message for ``group``,
    found column-wise on the frames' bytes (no record object per frame: a drain reads back
    millions of them while its own acks append more)."""
    rows = np.flatnonzero(cols.kinds == framing.RecordKind.DISPATCH)
    if not len(rows):
        return np.empty(0, dtype=np.int64)
    starts = cols.starts[rows]
    ends = np.append(cols.starts, cols.end)[rows + 1]  # frames are contiguous
    glen = gather(cols.data, starts, framing.HEADER_SIZE + _GROUP_LEN_AT, 1)
    named = group.encode()
    keep = glen == 0 if group == records.DEFAULT_GROUP else np.zeros(len(rows), dtype=bool)
    match = np.flatnonzero(glen == len(named))
    if len(match):
        raw = np.frombuffer(cols.data, dtype=np.uint8)
        at = (ends[match] - len(named))[:, None] + np.arange(len(named))
        keep[match[(raw[at] == np.frombuffer(named, dtype=np.uint8)).all(axis=1)]] = True
    return cols.seqs[rows[keep]]


def group_closes_in(seg: Segment, start: int, stop: int, group: str) -> np.ndarray:
    """:func:`group_closes` over the dispatch segment ``seg`` in [start, stop); a corrupt
    record is stepped over (at worst its message is delivered again, as at-least-once
    allows)."""
    found: list[np.ndarray] = []
    pos = start
    while pos < stop:
        cols, pos = columns_past_damage(seg, pos, stop)
        if cols is not None:
            found.append(group_closes(cols, group))
    return np.concatenate(found) if found else np.empty(0, dtype=np.int64)


def group_closes_of(data: bytes, group: str) -> np.ndarray:
    """:func:`group_closes` over buffered DISPATCH frames not yet written (whole frames)."""
    return group_closes(scan_columns(data), group)


class BucketLog:
    def __init__(self, root: str, suffix: str, pool: HandlePool, indexed: bool = False) -> None:
        self.root = root
        self.suffix = suffix
        self.pool = pool
        self.indexed = indexed  # an index file beside each segment (the schedule log)
        self._lock = threading.Lock()
        self._segments: dict[int, Segment] = {}
        self._dirty: set[int] = set()
        self._dirty_dirs: set[str] = set()
        os.makedirs(root, exist_ok=True)
        for bucket, path in naming.list_buckets(root, suffix):
            seg = self._segments[bucket] = Segment(path, bucket, pool)
            if indexed:
                seg.index = IndexFile(index_path(path), pool)  # counted by check_indexes

    def check_indexes(self, rebuild: set[int]) -> tuple[int, int]:
        """At open: re-derive the index of each bucket in ``rebuild`` (segments a crash may
        have left a tail in) and of every other segment whose index does not match it
        (missing, torn, behind or ahead: ``IndexFile.matches``); (how many of those others,
        entries written in all)."""
        mismatched = entries = 0
        for b, seg in sorted(self._segments.items()):
            idx = seg.index
            if idx is None:
                continue
            if b in rebuild:
                entries += idx.rebuild(seg)
            elif not idx.matches(seg):
                entries += idx.rebuild(seg)
                mismatched += 1
        return mismatched, entries

    def truncate(self, bucket: int, size: int) -> None:
        """Cut a segment to ``size`` (a record boundary) and re-derive its index."""
        seg = self._segments.get(bucket)
        if seg is None:
            return
        seg.truncate(size)
        if seg.index is not None:
            seg.index.rebuild(seg)

    def get(self, bucket: int) -> Segment | None:
        return self._segments.get(bucket)

    @property
    def by_bucket(self) -> dict[int, Segment]:
        """The segments by bucket, to read only (the iterate service's ``route`` looks each
        bucket up here, and calls ``get_or_create`` only for one missing): entries are added
        under this log's lock and replaced never; ``delete`` removes one."""
        return self._segments

    def get_or_create(self, bucket: int) -> Segment:
        seg = self._segments.get(bucket)
        if seg is not None:
            return seg
        with self._lock:
            seg = self._segments.get(bucket)
            if seg is None:
                path = os.path.join(self.root, naming.bucket_relpath(bucket, self.suffix))
                day = os.path.dirname(path)
                new_day = not os.path.isdir(day)
                os.makedirs(day, exist_ok=True)
                for name in (path, index_path(path)) if self.indexed else (path,):
                    os.close(os.open(name, os.O_RDWR | os.O_CREAT, 0o644))
                # the new entries becomes durable with the next sync(), before any checkpoint
                # relies on it: one directory fsync per batch, not one per new minute
                self._dirty_dirs.add(day)  # self._lock is held
                if new_day:
                    self._dirty_dirs.add(self.root)
                seg = Segment(path, bucket, self.pool, size=0)
                if self.indexed:
                    seg.index = IndexFile(index_path(path), self.pool)
                self._segments[bucket] = seg
        return seg

    def recover(
        self, bucket: int, policy: CorruptionPolicy, on_frame: Callable[[Frame], object] | None = None
    ) -> Recovery | None:
        """Verify a segment whose tail may be torn (written after the last checkpoint)."""
        seg = self._segments.get(bucket)
        if seg is None:
            return None
        self.pool.forget(seg.path)
        rec = recover(seg.path, policy, on_frame)
        seg.size = seg.synced_size = rec.valid_size
        seg.last_sequence = rec.last_sequence
        return rec  # its index is re-derived by check_indexes

    def append(self, bucket: int, data: bytes | bytearray) -> tuple[Segment, int]:
        """Append whole frames to ``bucket``'s segment; (segment, offset they start at). An
        indexed log writes their index entries first and publishes them after the bytes (a
        failed try changes nothing a reader sees, and may be repeated)."""
        seg = self.get_or_create(bucket)
        idx = seg.index
        n = idx.write_ahead(data, seg.size) if idx is not None else 0
        offset = seg.append(data)
        if idx is not None:
            idx.publish(n)
        with self._lock:
            self._dirty.add(bucket)
        return seg, offset

    def append_many(self, bucket: int, chunks: list[bytes]) -> tuple[Segment, int]:
        """``append`` of whole frames given as chunks, written without joining them (an
        indexed log joins them: its index is written from one buffer)."""
        seg = self.get_or_create(bucket)
        if seg.index is not None:
            return self.append(bucket, b"".join(chunks))
        offset = seg.append_many(list(chunks))
        with self._lock:
            self._dirty.add(bucket)
        return seg, offset

    def take_dirty(self) -> list[Segment]:
        """The segments appended to since the last call (their data may not be durable)."""
        with self._lock:
            dirty, self._dirty = self._dirty, set()
            return [seg for b in dirty if (seg := self._segments.get(b)) is not None]

    def take_dirty_dirs(self) -> list[str]:
        """Directories that gained entries since the last call (deepest first)."""
        with self._lock:
            dirs, self._dirty_dirs = self._dirty_dirs, set()
        return sorted(dirs, key=len, reverse=True)

    def sync(self) -> int:
        """fdatasync every segment appended to since the last call, and fsync the
        directories of new segments; return how many segments."""
        segments = self.take_dirty()
        dirs = self.take_dirty_dirs()
        sync_all(segments)
        sync_dirs(dirs)
        return len(segments)

    def buckets(self) -> list[int]:
        return sorted(self._segments)

    def delete(self, bucket: int) -> bool:
        with self._lock:
            seg = self._segments.pop(bucket, None)
        if seg is None:
            return False
        self._dirty.discard(bucket)
        self.pool.forget(seg.path)
        if seg.index is not None:
            seg.index.delete()
        try:
            os.unlink(seg.path)
        except FileNotFoundError:
            pass
        day = os.path.dirname(seg.path)
        try:
            os.rmdir(day)  # only succeeds once the day folder is empty
        except OSError:
            pass
        return True

    def __len__(self) -> int:
        return len(self._segments)
