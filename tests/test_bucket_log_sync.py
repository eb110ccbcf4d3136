"""segments/bucket_log.py sync_all: every segment synced, a few tasks at a time, and an
fsync error reaches the caller while the other segments are still synced."""

from __future__ import annotations

import pytest
from conftest import wait_until

from qdelay.segments import bucket_log


class _Seg:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.synced = 0

    def sync(self) -> None:
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


def test_sync_all_raises_an_fsync_error_and_syncs_the_others():
    segs = [_Seg(fail=(i == 10)) for i in range(200)]
    with pytest.raises(OSError, match="fdatasync failed"):
        bucket_log.sync_all(segs)
    # the failing task stopped; the other tasks sync every other segment (maybe still
    # running when the error reached the caller)
    wait_until(lambda: sum(s.synced for s in segs) == 200, what="every segment synced")
    assert all(s.synced == 1 for s in segs)
