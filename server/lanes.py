"""Lanes: what one consumer group of one subject has due, in memory up to a bound.

Owned by the scheduler thread (``server/scheduler.py``); no I/O here. A lane holds a
ready queue (packed chunks of timer-wheel entries, plus retries) and, when it went over
its bound, the state of a *spill*: its entries wait in the schedule segments and passes
read them back (``Pass``) while its consumers have credit.
"""

from __future__ import annotations

import collections

import numpy as np

from qdelay.server.wheel import Entries

# (seq, offset, bucket, due, attempt): a retry waiting in a lane
Retry = tuple[int, int, int, int, int]
# items taken from a lane, as columns: (seqs, offsets, buckets, due times, attempts)
Columns = tuple[list[int], list[int], list[int], list[int], list[int]]


class Ready:
    """Entries of one subject waiting for consumer credit: packed chunks, plus retries."""

    __slots__ = ("chunks", "retries", "count")

    def __init__(self) -> None:
        self.chunks: collections.deque[list] = collections.deque()  # [Entries, position]
        self.retries: collections.deque[Retry] = collections.deque()
        self.count = 0

    def push(self, e: Entries) -> None:
        self.chunks.append([e, 0])
        self.count += len(e)

    def push_retry(self, retry: Retry) -> None:
        self.retries.append(retry)
        self.count += 1

    def take(self, n: int, shared: dict | None = None) -> Columns:
        """Up to n items, retries first, as columns (seq, off, bucket, due, attempt).

        ``shared`` (one dispatch round's): the columns of a stretch of a chunk, made once
        for every lane that takes the same stretch of the same chunk in the round. The
        groups of a subject get the same fired chunks and take them in step (fan-out), so
        only the first pays for the lists; they are then the same list objects in every
        group's columns, which nobody changes in place."""
        pieces: list[Columns] = []
        if self.retries and n > 0:
            r: list[Retry] = []
            while self.retries and n > 0:
                r.append(self.retries.popleft())
                n -= 1
            seqs, offs, buckets, dues, attempts = (list(col) for col in zip(*r))
            pieces.append((seqs, offs, buckets, dues, attempts))
        while self.chunks and n > 0:
            chunk = self.chunks[0]
            e, pos = chunk
            end = min(len(e), pos + n)
            key = (id(e), pos, end)
            got = shared.get(key) if shared is not None else None
            cols = got[1] if got is not None and got[0] is e else None  # (the chunk itself: ids are reused)
            if cols is None:
                cols = (
                    e.seq[pos:end].tolist(),
                    e.off[pos:end].tolist(),
                    e.bucket[pos:end].tolist(),
                    e.due[pos:end].tolist(),
                    [1] * (end - pos),
                )
                if shared is not None:
                    shared[key] = (e, cols)
            pieces.append(cols)
            n -= end - pos
            if end >= len(e):
                self.chunks.popleft()
            else:
                chunk[1] = end
        if len(pieces) == 1:
            out = pieces[0]
        else:
            out = ([], [], [], [], [])
            for piece in pieces:
                for col, part in zip(out, piece):
                    col += part
        self.count -= len(out[0])
        return out

    def in_memory(self) -> set[int]:
        """Sequences of every entry queued here (chunks from their position, and retries)."""
        out: set[int] = {item[0] for item in self.retries}
        for e, pos in self.chunks:
            out.update(e.seq[pos:].tolist())
        return out

    def drop_chunks(self) -> list[np.ndarray]:
        """Forget the queued entries (not the retries); returns their bucket columns."""
        dropped = [e.bucket[pos:] for e, pos in self.chunks]
        self.count -= sum(map(len, dropped))
        self.chunks.clear()
        return dropped


class Pass:
    """A spilled lane's walk over the schedule segments, reading back its entries due at or
    before ``hi`` that are not in memory, not closed for the group and not cancelled."""

    __slots__ = ("bucket", "offset", "hi", "closed_bucket", "closed_size", "closed")

    def __init__(self, bucket: int, hi: int) -> None:
        self.bucket = bucket  # the bucket being read (every loaded bucket below it is read)
        self.offset = 0
        self.hi = hi
        self.closed_bucket = -1  # the group's closes in ``closed_bucket``'s dispatch log
        self.closed_size = 0  # ... as far as the file was read
        self.closed: set[int] = set()

    def at(self, bucket: int) -> None:
        """Read ``bucket`` next, from its start (the loaded bucket after the last one read)."""
        if bucket != self.bucket:
            self.bucket, self.offset = bucket, 0

    def past(self, bucket_width: int) -> None:
        """The current bucket is read to its loader's cursor: on to the next."""
        self.bucket += bucket_width
        self.offset = 0

    def closes_from(self, bucket: int) -> int:
        """Where the group's closes in the dispatch log of ``bucket`` are to be read from."""
        return self.closed_size if self.closed_bucket == bucket else 0

    def note_closes(self, bucket: int, size: int, closes: set[int]) -> None:
        """The group's closes in the dispatch log of ``bucket`` up to ``size`` (read from
        ``closes_from``): a close is final, so they are kept whatever comes next."""
        if self.closed_bucket != bucket:
            self.closed_bucket, self.closed_size, self.closed = bucket, size, closes
        else:
            self.closed_size = max(self.closed_size, size)
            self.closed |= closes


class Lane:
    """What one group of one subject has due: entries ready in memory, up to its bound
    (``group_max_ready``, or the group's own in ``group_max_ready_of``). A lane over its
    bound *spills*: its queued entries are forgotten (they stay in the schedule segments)
    and so is whatever becomes due for it meanwhile; ``drop_from`` is the lowest bucket
    forgotten since the last pass began. When the lane has room again, passes read its
    entries back from disk (``Pass``) until one ends with nothing forgotten during it; then
    the lane takes entries from the timer again.

    This is what keeps one group without consumers (or with a slow one) from filling the
    scheduler's memory and stopping everyone else: it holds at most its bound.

    ``on_disk`` counts what a spilled lane has waiting on disk (for Stats' backlog): the
    entries it forgot (its queue when it spilled, what became due for it meanwhile, what
    its subject kept for it while it had no group) less those read back; 0 when it is whole
    again. A message cancelled (or claimed by a Cancel) while it waited on disk stays
    counted until the lane is whole again: the read-back pass skips it without knowing
    whether it was one of those counted.
    """

    __slots__ = ("sid", "gid", "bound", "ready", "spilled", "drop_from", "walk", "recent", "on_disk")

    def __init__(self, sid: int, gid: int, bound: int) -> None:
        self.sid = sid
        self.gid = gid
        self.bound = bound  # entries it may hold ready (Timer.lane_bound)
        self.ready = Ready()
        self.spilled = False
        self.drop_from: int | None = None
        self.walk: Pass | None = None
        # sequences read back by the last pass step: entries still in the wheel with the
        # same sequences fire once more at most, and are skipped then
        self.recent: set[int] | None = None
        self.on_disk = 0  # entries forgotten and not read back (see above)

    def dropped(self, buckets: np.ndarray) -> None:
        """Entries of ``buckets`` (one per entry) forgotten: they wait on disk."""
        if len(buckets):
            low = int(buckets.min())
            self.drop_from = low if self.drop_from is None else min(self.drop_from, low)
            self.on_disk += len(buckets)

    def read_back(self, n: int) -> None:
        """``n`` entries read back from disk into the ready queue."""
        self.on_disk = max(0, self.on_disk - n)

    def whole(self) -> None:
        """Nothing forgotten any more: the lane takes its entries from the timer again."""
        self.spilled = False
        self.drop_from = None
        self.on_disk = 0
