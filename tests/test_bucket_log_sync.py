"""segments/bucket_log.py sync_all: every segment synced, a few tasks at a time, and an
fsync error reaches the caller once the other segments are synced."""

from __future__ import annotations

import time

import pytest

from qdelay.segments import bucket_log


class _Seg:
    def __init__(self, fail: bool = False, slow: bool = False) -> None:
        self.fail = fail
        self.slow = slow
        self.synced = 0

    def sync(self) -> None:
        if self.slow:
            time.sleep(0.001)  # an fsync's time (the segment is a stand-in, no file)
        self.synced += 1
        if self.fail:
            raise OSError("fdatasync failed")


def test_sync_all_syncs_each_segment_once_from_a_few_tasks(monkeypatch):
    submitted = []
    pool = bucket_log._SYNC_POOL
    if pool is None:
        bucket_log.sync_all([_Seg() for _ in range(3)])  # makes the pool
        pool = bucket_log._SYNC_POOL
    real_submit = pool.submit
    monkeypatch.setattr(pool, "submit", lambda fn, *a: submitted.append(fn) or real_submit(fn, *a))
    segs = [_Seg() for _ in range(1000)]
    bucket_log.sync_all(segs)
    assert [s.synced for s in segs] == [1] * 1000
    assert len(submitted) == bucket_log.SYNC_THREADS  # not a future per segment
    few = [_Seg(), _Seg()]
    bucket_log.sync_all(few)  # two or fewer: on the caller's thread
    assert [s.synced for s in few] == [1, 1] and len(submitted) == bucket_log.SYNC_THREADS


def test_sync_all_raises_an_fsync_error_once_every_task_is_done():
    # the error reached the caller while the other tasks still synced (the caller then
    # stops the service and closes the segments under them); now it comes once every
    # segment was tried. The others' fsyncs take a moment, as a disk's do.
    segs = [_Seg(fail=(i == 0), slow=(i > 0)) for i in range(200)]
    with pytest.raises(OSError, match="fdatasync failed"):
        bucket_log.sync_all(segs)
    assert [s.synced for s in segs] == [1] * 200
