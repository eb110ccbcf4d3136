"""Lanes: what one consumer group of one subject has due, in memory up to a bound.

Owned by the scheduler thread (``server/scheduler.py``); no I/O here. A lane holds a
ready queue (packed chunks of timer-wheel entries, plus retries) and, when it went over
its bound, the state of a *spill*: its entries wait in the schedule segments and passes
read them back (``Pass``) while its consumers have credit.
"""

from __future__ import annotations

import collections
import itertools

import numpy as np

from qdelay.server.wheel import Entries

# (seq, offset, bucket, due, attempt): a retry waiting in a lane
Retry = tuple[int, int, int, int, int]
# items taken from a lane, as columns: (seqs, offsets, buckets, due times, attempts)
Columns = tuple[list[int], list[int], list[int], list[int], list[int]]


class Ready:
    """Entries of one subject waiting for consumer credit: packed chunks, plus retries.

    ``count`` is what the lane has due in memory (Stats' backlog): a message cancelled
    while it waits here leaves it at once (``cancel``); its entry stays in its chunk,
    marked, and is dropped when a round or a spill reaches it, or when the marked ones
    outnumber the rest (the chunks are then copied without them, so that a queue nobody
    takes from holds no more than about twice what it counts)."""

    __slots__ = (
        "chunks",
        "retries",
        "count",
        "_serial",
        "_runs",
        "_run_total",
        "_indexed",
        "_retry_seqs",
        "_gone",
        "_marked",
    )

    def __init__(self) -> None:
        # [Entries, position, serial, cancelled positions or None]; the serials of the
        # chunks queued are consecutive (pushed in order, taken from the front)
        self.chunks: collections.deque[list] = collections.deque()
        self.retries: collections.deque[Retry] = collections.deque()
        self.count = 0
        self._serial = 0  # the next chunk's
        # sorted runs of (sequence, chunk serial, position) over the chunks, built only
        # when a cancel asks whether a sequence is queued here (see ``cancel``)
        self._runs: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._run_total = 0
        self._indexed = 0  # chunks from this serial on are not in the runs yet
        self._retry_seqs: set[int] = set()  # sequences of the retries queued
        self._gone: set[int] = set()  # ... and those of them cancelled meanwhile
        self._marked = 0  # entries of the chunks marked cancelled and not yet passed over

    def push(self, e: Entries) -> None:
        self.chunks.append([e, 0, self._serial, None])
        self._serial += 1
        self.count += len(e)

    def push_retry(self, retry: Retry) -> None:
        self.retries.append(retry)
        self._retry_seqs.add(retry[0])
        self.count += 1

    def take(self, n: int, shared: dict | None = None) -> Columns:
        """Up to n items, retries first, as columns (seq, off, bucket, due, attempt);
        entries cancelled while queued are passed over (dropped).

        ``shared`` (one dispatch round's): the columns of a stretch of a chunk, made once
        for every lane that takes the same stretch of the same chunk in the round. The
        groups of a subject get the same fired chunks and take them in step (fan-out), so
        only the first pays for the lists; they are then the same list objects in every
        group's columns, which nobody changes in place."""
        pieces: list[Columns] = []
        if self.retries and n > 0:
            r: list[Retry] = []
            while self.retries and n > 0:
                item = self.retries.popleft()
                self._retry_seqs.discard(item[0])
                if self._gone and item[0] in self._gone:
                    self._gone.discard(item[0])
                    continue
                r.append(item)
                n -= 1
            if r:
                seqs, offs, buckets, dues, attempts = (list(col) for col in zip(*r))
                pieces.append((seqs, offs, buckets, dues, attempts))
        while self.chunks and n > 0:
            chunk = self.chunks[0]
            e, pos, _serial, gone = chunk
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
            if gone:
                cols = _without(cols, pos, end, gone)
                self._marked -= end - pos - len(cols[0])
            pieces.append(cols)
            n -= len(cols[0])
            if end >= len(e):
                self.chunks.popleft()
            else:
                chunk[1] = end
        if not self.chunks and self._runs:
            self._forget_runs()
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
        """Sequences of every entry queued here (chunks from their position, and retries),
        those cancelled meanwhile left out."""
        out: set[int] = self._retry_seqs - self._gone
        for chunk in self.chunks:
            out.update(_rest(chunk).seq.tolist())
        return out

    def holding(self, targets: list[int]) -> set[int]:
        """Which of ``targets`` are queued here, or were until a cancel marked them (held in
        memory, not on disk): a look-up in the sorted runs, as ``cancel`` makes."""
        out = self._retry_seqs.intersection(targets)
        if self.chunks and targets:
            for chunk, i in self._find(np.asarray(targets, dtype=np.int64)):
                out.add(int(chunk[0].seq[i]))
        return out

    def drop_chunks(self) -> list[np.ndarray]:
        """Forget the queued entries (not the retries); returns their bucket columns (those
        cancelled while queued left out: they were counted out already)."""
        dropped = [_rest(chunk).bucket for chunk in self.chunks]
        self.count -= sum(map(len, dropped))
        self.chunks.clear()
        self._marked = 0
        self._forget_runs()
        return dropped

    def cancel(self, targets: set[int]) -> int:
        """Take the entries of ``targets`` (cancelled sequences) out of what is queued here:
        out of ``count`` at once, each marked in its chunk so that a round or a spill drops
        it later; how many there were. Costs the targets, not the queue: each is looked up
        in sorted runs of the chunks' sequences (``_find``), which a lane builds only when
        a cancel asks and keeps up to date as chunks come, at an amortised O(log n) per
        entry queued."""
        n = 0
        if self._retry_seqs and not self._retry_seqs.isdisjoint(targets):
            for q in (self._retry_seqs & targets) - self._gone:
                self._gone.add(q)
                n += 1
        if self.chunks:
            for chunk, i in self._find(np.fromiter(targets, dtype=np.int64, count=len(targets))):
                gone = chunk[3]
                if gone is None:
                    gone = chunk[3] = set()
                if i not in gone:
                    gone.add(i)
                    self._marked += 1
                    n += 1
        self.count -= n
        if self.count == 0 and (self.chunks or self.retries):
            self._clear()
        elif self._marked > max(1024, self.count):
            self._compact()
        return n

    def _clear(self) -> None:
        """Everything queued was cancelled: let go of it now. At count 0 the lane leaves the
        round-robin, so no round would pass over the marked entries, and their chunk (fired
        for the subject's every group) stayed held for as long as the group got nothing new."""
        self.chunks.clear()
        self.retries.clear()
        self._retry_seqs.clear()
        self._gone.clear()
        self._marked = 0
        self._forget_runs()

    def _compact(self) -> None:
        """Copy the chunks without their marked entries, as one chunk (in order): paid for
        by the cancels that marked at least as many entries as are left."""
        rest = [_rest(chunk) for chunk in self.chunks]
        self.chunks.clear()
        self._marked = 0
        self._forget_runs()
        left = Entries.concat([e for e in rest if len(e)])
        if len(left):
            self.chunks.append([left, 0, self._serial, None])
            self._serial += 1

    # --- the sorted runs: which chunk and position holds a sequence --------------------------

    def _find(self, targets: np.ndarray) -> list[tuple[list, int]]:
        """(chunk, position) of every queued entry with a sequence of ``targets``."""
        self._index_new()
        head, head_pos = self.chunks[0][2], self.chunks[0][1]
        out = []
        for seqs, serials, idx in self._runs:
            lo = np.searchsorted(seqs, targets, "left")
            hi = np.searchsorted(seqs, targets, "right")
            for a, b in zip(lo[hi > lo].tolist(), hi[hi > lo].tolist()):
                for j in range(a, b):
                    s, i = int(serials[j]), int(idx[j])
                    if s > head or (s == head and i >= head_pos):
                        out.append((self.chunks[s - head], i))
        return out

    def _index_new(self) -> None:
        """Add the chunks pushed since the last look-up as a run; merge runs of like size
        (dropping entries taken since); start again from the queue when most of what the
        runs hold was taken."""
        head = self.chunks[0][2]
        if self._run_total > 2 * self.count + 1024:
            self._forget_runs()
            self._indexed = head  # every queued chunk goes into the new run below
        start = max(self._indexed, head)
        if start < self._serial:
            parts = list(itertools.islice(self.chunks, start - head, None))
            seqs = np.concatenate([e.seq[pos:] for e, pos, _s, _g in parts])
            serials = np.concatenate([np.full(len(e) - pos, s, dtype=np.int64) for e, pos, s, _g in parts])
            idx = np.concatenate([np.arange(pos, len(e), dtype=np.int64) for e, pos, _s, _g in parts])
            order = np.argsort(seqs, kind="stable")
            self._runs.append((seqs[order], serials[order], idx[order]))
            self._run_total += len(seqs)
            self._indexed = self._serial
        runs = self._runs
        while len(runs) > 1 and len(runs[-2][0]) <= 2 * len(runs[-1][0]):
            b, a = runs.pop(), runs.pop()
            seqs, serials, idx = (np.concatenate([x, y]) for x, y in zip(a, b))
            head_pos = self.chunks[0][1]
            live = (serials > head) | ((serials == head) & (idx >= head_pos))
            order = np.argsort(seqs[live], kind="stable")
            runs.append((seqs[live][order], serials[live][order], idx[live][order]))
            self._run_total -= len(seqs) - int(live.sum())

    def _forget_runs(self) -> None:
        self._runs = []
        self._run_total = 0
        self._indexed = self._serial


def _rest(chunk: list) -> Entries:
    """What a queued chunk still holds: its entries from its position on, less those marked
    cancelled."""
    e, pos, _serial, gone = chunk
    if gone:
        keep = np.ones(len(e) - pos, dtype=bool)
        keep[[i - pos for i in gone if i >= pos]] = False
        return e.take(np.flatnonzero(keep) + pos)
    return e.take(slice(pos, None)) if pos else e


def _without(cols: Columns, pos: int, end: int, gone: set[int]) -> Columns:
    """A chunk's columns for positions [pos, end) less the positions in ``gone`` (new
    lists: the shared ones stay as they are)."""
    keep = [j for j in range(end - pos) if pos + j not in gone]
    if len(keep) == end - pos:
        return cols
    return tuple([col[j] for j in keep] for col in cols)  # type: ignore[return-value]


class Pass:
    """A spilled lane's walk over the schedule segments, reading back its entries due at or
    before ``hi`` that are not in memory, not closed for the group and not cancelled.

    A *counting* walk (``counting``: bucket -> how far its loader had read) reads the same
    entries but only counts them on disk for the lane: those a group created beside others
    finds already fired when it is made (due from its ``since`` to ``hi``, fired for the
    other groups only), which nothing counted. It comes before the lane's first pass and
    reads each bucket only as far as was loaded then (what is loaded later fires for the
    group, counted as it spills)."""

    __slots__ = ("bucket", "offset", "hi", "closed_bucket", "closed_size", "closed", "counting")

    def __init__(self, bucket: int, hi: int, counting: dict[int, int] | None = None) -> None:
        self.bucket = bucket  # the bucket being read (every loaded bucket below it is read)
        self.offset = 0
        self.hi = hi
        self.closed_bucket = -1  # the group's closes in ``closed_bucket``'s dispatch log
        self.closed_size = 0  # ... as far as the file was read
        self.closed: set[int] = set()
        self.counting = counting

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
    its subject kept for it while it had no group, what fired for its subject's other
    groups from its ``since`` on before it was made: ``Pass.counting``) less those read
    back, less those cancelled while they waited there (found by their records once their
    tombstones passed: ``ReadBack.apply_cancelled``; a pass skips a cancelled entry without
    counting it); 0 when it is whole again. One a pass meets while a Cancel has claimed it
    is set aside and counted as read back (``Timer.set_aside``): a release queues it again,
    its tombstone drops it.
    """

    __slots__ = ("sid", "gid", "bound", "ready", "spilled", "drop_from", "walk", "recent", "on_disk", "in_rr", "serial")

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
        # in the timer's round-robin (``Timer.rr``), whatever its count: a queue emptied
        # outside a round (a spill, cancels) stays there until the next round passes it
        self.in_rr = False
        # the timer's lane epoch when it was made or last became whole (``Timer.lane_epoch``):
        # what it counts on disk dates from then
        self.serial = 0

    def dropped(self, buckets: np.ndarray, counted: int | None = None) -> None:
        """Entries of ``buckets`` (one per entry) forgotten: they wait on disk; ``counted``
        of them (all by default) are counted here (the rest by a counting walk)."""
        if len(buckets):
            low = int(buckets.min())
            self.drop_from = low if self.drop_from is None else min(self.drop_from, low)
            self.on_disk += len(buckets) if counted is None else counted

    def counted(self, n: int) -> None:
        """``n`` entries found on disk by a counting walk (``Pass.counting``)."""
        self.on_disk += n

    def cancelled(self, n: int) -> None:
        """``n`` entries it counted on disk were cancelled: no longer due to the group."""
        self.on_disk = max(0, self.on_disk - n)

    def read_back(self, n: int) -> None:
        """``n`` entries read back from disk into the ready queue."""
        self.on_disk = max(0, self.on_disk - n)

    def whole(self) -> None:
        """Nothing forgotten any more: the lane takes its entries from the timer again."""
        self.spilled = False
        self.drop_from = None
        self.on_disk = 0
