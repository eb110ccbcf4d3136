"""Segments keyed by due bucket: the schedule log and the dispatch log.

Both logs keep one segment per due bucket (``scale_minutes`` wide, named by its UTC
start minute, in day folders; see ``segments.naming``). Segments are opened lazily
through the shared handle pool, so far-future buckets cost a directory entry and a small
Python object, not an open file.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from collections.abc import Callable

from qdelay.segments import naming
from qdelay.segments.framing import Frame
from qdelay.segments.segment import CorruptionPolicy, HandlePool, Recovery, Segment, fsync_dir, recover

log = logging.getLogger("qdelay.buckets")


_SYNC_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_SYNC_POOL_LOCK = threading.Lock()


def sync_all(segments: list[Segment]) -> None:
    """fdatasync many segments, several at a time: a far-future ingest touches a thousand
    minute files between two checkpoints, and an SSD serves parallel flushes much faster
    than the same flushes one after another."""
    global _SYNC_POOL
    if len(segments) <= 2:
        for seg in segments:
            seg.sync()
        return
    with _SYNC_POOL_LOCK:
        if _SYNC_POOL is None:
            _SYNC_POOL = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="qdelay-fsync")
    for fut in [_SYNC_POOL.submit(seg.sync) for seg in segments]:
        fut.result()  # an fsync error propagates to the caller


def sync_dirs(dirs: list[str]) -> None:
    """fsync directories that gained entries; one deleted since (the cleaner removes empty
    day folders) needs nothing."""
    for d in dirs:
        try:
            fsync_dir(d)
        except FileNotFoundError:
            pass


class BucketLog:
    def __init__(self, root: str, suffix: str, pool: HandlePool) -> None:
        self.root = root
        self.suffix = suffix
        self.pool = pool
        self._lock = threading.Lock()
        self._segments: dict[int, Segment] = {}
        self._dirty: set[int] = set()
        self._dirty_dirs: set[str] = set()
        os.makedirs(root, exist_ok=True)
        for bucket, path in naming.list_buckets(root, suffix):
            self._segments[bucket] = Segment(path, bucket, pool)

    def get(self, bucket: int) -> Segment | None:
        return self._segments.get(bucket)

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
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
                os.close(fd)
                # the new entry becomes durable with the next sync(), before any checkpoint
                # relies on it: one directory fsync per batch, not one per new minute
                self._dirty_dirs.add(day)  # self._lock is held
                if new_day:
                    self._dirty_dirs.add(self.root)
                seg = Segment(path, bucket, self.pool, size=0)
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
        return rec

    def append(self, bucket: int, data: bytes | bytearray) -> tuple[Segment, int]:
        seg = self.get_or_create(bucket)
        offset = seg.append(data)
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
