"""Which buckets the scheduler has loaded and which are done.

A bucket is *done* once it is loaded completely, its time has passed and every message in
it is delivered, dead-lettered or cancelled for every group it is for, with the dispatch
records on disk. ``done_before`` (every bucket below it is done) and the set of reopened
buckets (a late record landed in a finished one) are saved with the iterate checkpoint
and tell a restart which buckets to load again; replication copies them to slaves.

Owned by the scheduler (changed under its lock, on the scheduler thread, or by
replication adopting a master's progress); no I/O except reading file sizes.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable

from qdelay.segments.bucket_log import BucketLog
from qdelay.segments.naming import MS_PER_MINUTE, bucket_of
from qdelay.segments.segment import Segment


class BucketState:
    """What the scheduler knows of one loaded bucket."""

    __slots__ = (
        "bucket",
        "seg",
        "cursor",
        "complete",
        "unfired",
        "owed",
        "cancelled",
        "closed",
        "counted",
        "partial",
        "done",
        "dispatch_ready",
        "tombstones_known",
        "nclosed",
        "top_indexed",
        "late_cancels",
    )

    def __init__(self, bucket: int, seg: Segment, cursor: int = 0, complete: bool = False) -> None:
        self.bucket = bucket
        self.seg = seg
        self.cursor = cursor  # schedule-segment bytes already indexed
        self.complete = complete  # the loader reached the end of what is written
        self.unfired = 0  # indexed messages still in the timer wheel
        # group id -> this bucket's entries held in memory for that group (ready, retrying
        # or in flight); what a group holds on disk only is covered by its lane's spill
        self.owed: dict[int, int] = {}
        self.cancelled: set[int] = set()  # sequences cancelled in this bucket
        # group name -> sequences its DISPATCH records close, and those closed by records
        # already counted in closed_retired (only while loading)
        self.closed: dict[str, set[int]] | None = None
        self.counted: dict[str, set[int]] | None = None
        # group name -> sequences it closed before they were loaded, while some other group
        # had not (fan-out across a restart): the timer skips them for that group
        self.partial: dict[str, set[int]] = {}
        self.done = False
        self.dispatch_ready = False  # the dispatch log was checked and read
        # every tombstone of the segment is in ``cancelled``: Get and Cancel answer from it
        # (Scheduler.known_tombstones) rather than from the segment's index
        self.tombstones_known = complete
        # messages of this bucket closed for their subject's first group (DISPATCH record)
        # and not yet counted in closed_retired: read back from the dispatch log when the
        # bucket is loaded, then one more per record written
        self.nclosed = 0
        # the highest MESSAGE sequence the timer has read of the segment (increasing in it),
        # and the cancelled sequences at or below it: those may sit in the wheel, and the
        # timer leaves them out when they fall due (else an idle group's backlog counted a
        # cancelled message until a consumer came to drop it)
        self.top_indexed = -1
        self.late_cancels: set[int] = set()

    def cancel(self, targets: Iterable[int]) -> None:
        """Note cancelled sequences of this bucket (a tombstone read by the loader, or one the
        iterate service reports)."""
        cancelled, top = self.cancelled, self.top_indexed
        for q in targets:
            if q not in cancelled:
                cancelled.add(q)
                if q <= top and self.unfired > 0:  # may be in the wheel (else it fired already)
                    self.late_cancels.add(q)

    def written_on(self) -> None:
        """Records were appended past what the loader read to the end: it reads on from
        its cursor, and the bucket is not done before."""
        self.complete = False
        self.done = False

    def owe(self, gid: int, n: int) -> None:
        self.owed[gid] = self.owed.get(gid, 0) + n

    def outstanding(self) -> int:
        return self.unfired + sum(self.owed.values())


class BucketBook:
    """Loaded buckets, ``done_before``, the reopened buckets and the closes counted for
    ``pending`` (see Engine.stats)."""

    def __init__(
        self,
        schedule: BucketLog,
        dispatch: BucketLog,
        scale_minutes: int,
        *,
        done_before: int,
        reopened: set[int],
        closed_retired: int,
        reopened_at: dict[int, int],
    ) -> None:
        self.schedule = schedule
        self.dispatch = dispatch
        self.scale = scale_minutes
        self.loaded: dict[int, BucketState] = {}
        self.done_before = done_before
        self.reopened = set(reopened)
        # Closed messages are counted from durable state, so that ``pending`` survives a
        # crash: those of buckets already forgotten (done, dispatch records fsynced) here,
        # saved with done_before in the same checkpoint; those of loaded buckets per bucket
        # (BucketState.nclosed, recounted from the dispatch log on each load). A reopened
        # bucket was counted up to its dispatch log's size when it was reopened (reopened_at).
        self.closed_retired = closed_retired
        self.reopened_at: dict[int, int] = dict(reopened_at)
        self.horizon = done_before - scale_minutes  # highest bucket considered for loading

    def get(self, bucket: int) -> BucketState | None:
        return self.loaded.get(bucket)

    def open_up_to(self, horizon: int) -> None:
        """Give every unfinished bucket up to ``horizon`` a state for the loader."""
        for b in self.schedule.buckets():
            if b > horizon:
                break
            if b not in self.loaded and (b >= self.done_before or b in self.reopened):
                seg = self.schedule.get(b)
                if seg is not None:
                    self.loaded[b] = BucketState(b, seg)
        for b in self.reopened:  # reopened buckets are loaded whatever their time
            if b not in self.loaded:
                seg = self.schedule.get(b)
                if seg is not None:
                    self.loaded[b] = BucketState(b, seg)
        self.horizon = max(self.horizon, horizon)

    def load_behind(self, bucket: int, seg: Segment, start: int) -> BucketState:
        """A record was appended to a bucket behind the loading horizon that is not loaded
        (finished, or created there after the loader passed it): it is loaded from where
        the append began (nothing before it is outstanding) and, if finished, reopened.
        A segment new from ``start`` 0 has its every tombstone reported to the bucket from
        then on (``Scheduler.on_written``); one appended to after ``start`` has tombstones
        before it that are not read, so not known: Get and Cancel ask the segment's index
        (a message cancelled before the bucket finished read PENDING once a late record
        reopened it)."""
        st = self.loaded[bucket] = BucketState(bucket, seg, start)
        st.dispatch_ready = True
        st.tombstones_known = start == 0
        self.reopen(bucket)
        return st

    def reopen(self, bucket: int) -> None:
        """A record landed in a finished bucket: it is loaded again. The closes in its
        dispatch log so far are in ``closed_retired``; a reload after a restart counts only
        those after this size."""
        if bucket >= self.done_before:
            return
        self.reopened.add(bucket)
        if bucket not in self.reopened_at:
            seg = self.dispatch.get(bucket)
            self.reopened_at[bucket] = seg.size if seg is not None else 0

    def note_reopened(self, bucket: int) -> None:
        """Slave: a record landed in a bucket the master finished; a promotion loads it."""
        if bucket < self.done_before:
            self.reopened.add(bucket)

    def to_load(self) -> list[BucketState]:
        return [st for st in self.loaded.values() if not st.complete]

    def maybe_done(self, st: BucketState, now: int, floor: int, unsynced: Callable[[int], bool]) -> None:
        """Mark ``st`` done if nothing of it is outstanding: loaded, its time passed, no entry
        in memory, none kept on disk for a group (below ``floor``), its records fsynced."""
        end = (st.bucket + self.scale) * MS_PER_MINUTE
        if (
            st.complete
            and st.unfired <= 0
            and not any(st.owed.values())
            and now >= end
            and st.bucket < floor
            and not unsynced(st.bucket)
        ):
            st.done = True

    def advance(self, now: int) -> None:
        """Move ``done_before`` over finished buckets and forget them."""
        for b in [b for b in self.reopened if b < self.done_before]:
            st = self.loaded.get(b)
            if st is not None and st.done:
                self._retire(b)
        limit = min(bucket_of(now, self.scale), self.horizon + self.scale)
        if self.done_before >= limit:
            return
        keys = self.schedule.buckets()
        first = i = bisect.bisect_left(keys, self.done_before)
        new = limit
        while i < len(keys) and keys[i] < limit:
            st = self.loaded.get(keys[i])
            if st is None or not st.done:
                new = keys[i]
                break
            i += 1
        for b in keys[first:i]:
            self._retire(b)
        self.done_before = max(self.done_before, new)

    def _retire(self, bucket: int) -> None:
        """Forget a done bucket; its closes move to ``closed_retired``."""
        st = self.loaded.pop(bucket, None)
        if st is not None:
            self.closed_retired += st.nclosed
        self.reopened.discard(bucket)
        self.reopened_at.pop(bucket, None)

    def count_closed(self, bucket: int, n: int) -> None:
        """``n`` closes by their subject's first group were recorded in ``bucket``."""
        st = self.loaded.get(bucket)
        if st is not None:
            st.nclosed += n
        else:
            self.closed_retired += n

    def closed_total(self) -> int:
        return self.closed_retired + sum(st.nclosed for st in self.loaded.values())

    def finished(self, bucket: int) -> bool:
        """Done and forgotten: below ``done_before``, neither reopened nor loaded."""
        return bucket < self.done_before and bucket not in self.reopened and bucket not in self.loaded

    def adopt(self, done_before: int, reopened: set[int]) -> None:
        """Slave: take a master's progress exactly (it may even move back)."""
        self.reopened = {b for b in reopened if b < done_before}
        self.done_before = done_before
        self.horizon = max(self.horizon, done_before - self.scale)
        for b in [b for b in self.loaded if b < done_before and b not in self.reopened]:
            del self.loaded[b]
