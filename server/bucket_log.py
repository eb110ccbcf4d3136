"""Segments keyed by due bucket: the schedule log and the dispatch log.

Both logs keep one segment per due bucket (``scale_minutes`` wide, named by its UTC
start minute, in day folders; see ``segments.naming``). Segments are opened lazily
through the shared handle pool, so far-future buckets cost a directory entry and a small
Python object, not an open file.
"""

from __future__ import annotations

import logging
import os
import threading

from qdelay.segments import naming
from qdelay.segments.segment import CorruptionPolicy, HandlePool, Recovery, Segment, fsync_dir, recover

log = logging.getLogger("qdelay.buckets")


class BucketLog:
    def __init__(self, root: str, suffix: str, pool: HandlePool) -> None:
        self.root = root
        self.suffix = suffix
        self.pool = pool
        self._lock = threading.Lock()
        self._segments: dict[int, Segment] = {}
        self._dirty: set[int] = set()
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
                fsync_dir(day)
                if new_day:
                    fsync_dir(self.root)
                seg = Segment(path, bucket, self.pool, size=0)
                self._segments[bucket] = seg
        return seg

    def recover(self, bucket: int, policy: CorruptionPolicy, on_frame=None) -> Recovery | None:
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
        self._dirty.add(bucket)
        return seg, offset

    def sync(self) -> int:
        """fdatasync every segment appended to since the last call; return how many."""
        dirty, self._dirty = self._dirty, set()
        n = 0
        for bucket in dirty:
            seg = self._segments.get(bucket)
            if seg is not None:
                seg.sync()
                n += 1
        return n

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
