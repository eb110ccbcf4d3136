"""The scheduler: loader, timer and dispatcher, on one thread (``qdelay-scheduler``).

It composes pieces with one job each (see docs/internals.md):

- ``buckets.BucketBook``: which buckets are loaded, which are done (``done_before``,
  reopened buckets), the closes counted for ``pending``;
- ``loader.Loader``: the disk reads of loading (schedule chunks, tombstones, dispatch
  logs); the scheduler indexes what it read into the timer wheel (``wheel.TimerWheel``)
  and streams a hot bucket in as it drains (at most ``max_loaded`` entries in memory);
- ``lanes``: per subject and group, entries ready in memory up to a bound, then *spilled*
  (left on disk and read back by passes when the group's consumers have credit);
- ``ledger.AckLedger``: deliveries in flight, ack deadlines, retries;
- ``dispatch_log.DispatchLogWriter``: DISPATCH records buffered, written, fsynced;
- ``segments.messages``: records read back for delivery, checked column-wise.

The *timer* moves due entries from the wheel to the lanes of every group of their subject
(fan-out). The *dispatcher* takes ready entries round-robin over lanes, within the sink's
credit and the rate limit, reads the records back and hands batches to the sink. An
acknowledged delivery gets a DISPATCH record; an unacknowledged one is offered again after
the ack timeout plus a backoff, and after ``max_attempts`` it goes to the dead-letter
subject.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qdelay.errors import CorruptRecord, InvariantViolation, QdelayError
from qdelay.segments import bucket_log, framing, records
from qdelay.segments.bucket_log import BucketLog
from qdelay.segments.framing import RecordKind
from qdelay.segments.messages import read_messages
from qdelay.segments.naming import bucket_of
from qdelay.segments.reader import Columns, columns_past_damage
from qdelay.segments.segment import CorruptionPolicy
from qdelay.server.buckets import BucketBook, BucketState
from qdelay.server.deliveries import DEAD_LETTER_HEADER, Deliveries, Delivery, DeliverySink
from qdelay.server.dispatch_log import DispatchLogWriter
from qdelay.server.groups import Group, GroupTable
from qdelay.server.iterate import Written
from qdelay.server.lanes import Lane, Pass
from qdelay.server.ledger import AckLedger, Flight, Item, ack_attempts, ack_ids, ack_sequences
from qdelay.server.loader import Loader
from qdelay.server.timer import Timer

log = logging.getLogger("qdelay.scheduler")

__all__ = ["DEAD_LETTER_HEADER", "Deliveries", "Delivery", "DeliverySink", "Scheduler", "SchedulerConfig"]

DeadLetter = Callable[[records.Message, int, str, int, Callable[[Exception | None], None]], None]


class _Part:
    """Entries of one lane and one bucket taken for delivery, and their records once read
    back (columns; ``keep`` narrows every column at once)."""

    __slots__ = ("st", "seqs", "offs", "dues", "attempts", "read")

    def __init__(self, st: BucketState, seqs: list[int], offs: list[int], dues: list[int], attempts: list[int]) -> None:
        self.st = st
        self.seqs = seqs
        self.offs = offs
        self.dues = dues
        self.attempts = attempts
        self.read: tuple[list[Any], list[Any], list[Any]] = ([], [], [])

    def keep(self, idx: list[int]) -> None:
        self.seqs, self.offs, self.dues, self.attempts = (
            [col[i] for i in idx] for col in (self.seqs, self.offs, self.dues, self.attempts)
        )
        if self.read[0]:
            mids, payloads, headers = self.read
            self.read = ([mids[i] for i in idx], [payloads[i] for i in idx], [headers[i] for i in idx])


@dataclass(slots=True)
class _Taken:
    """What one lane gave in one dispatch round."""

    lane: Lane
    group: Group
    name: str  # the subject
    parts: list[_Part]


@dataclass(slots=True)
class SchedulerConfig:
    scale_minutes: int = 1
    load_ahead_ms: int = 120_000
    tick_ms: int = 1
    dispatch_rate: float = 0.0  # messages/s over all subjects; 0 = unlimited
    ack_timeout_ms: int = 30_000
    max_attempts: int = 16
    retry_backoff_ms: int = 1_000  # doubled each attempt, at most max_backoff_ms
    max_backoff_ms: int = 300_000
    max_loaded: int = 8_000_000  # index entries in memory (wheel + ready), 32 bytes each
    # entries one group of one subject holds ready in memory; beyond it the rest wait on disk
    group_max_ready: int = 100_000
    # the same per group, for the groups that need another bound: "SUBJECT/GROUP" -> entries
    group_max_ready_of: dict[str, int] = field(default_factory=dict)
    implicit_group: str = ""  # a subject with no group gets this one when a message is due ("" none)
    load_chunk_bytes: int = 1024 * 1024
    dispatch_quantum: int = 512  # per subject per round: fairness across subjects
    dispatch_flush_ms: int = 5


class Scheduler:
    def __init__(
        self,
        schedule: BucketLog,
        dispatch: BucketLog,
        config: SchedulerConfig,
        *,
        clock: Callable[[], int],
        done_before: int,
        corruption: CorruptionPolicy = CorruptionPolicy.FAIL,
        reopened: set[int],
        dead_letter: DeadLetter | None = None,
        closed_retired: int = 0,
        reopened_at: dict[int, int] | None = None,
        groups: GroupTable | None = None,
        legacy_upto: int = 0,
    ) -> None:
        self.schedule = schedule
        self.dispatch = dispatch
        self.cfg = config
        self.clock = clock
        self.dead_letter = dead_letter
        # guards the scheduling state for short stretches, never across disk I/O; the
        # scheduler thread holds it most, other threads briefly (see docs/internals.md)
        self.lock = threading.RLock()  # apply_group -> add_group re-enter it
        # acks and releases posted by the event loop, applied by whoever next takes the lock
        # to look at deliveries (the scheduler thread at every turn, Cancel/Get, stats)
        self._inbox: collections.deque[tuple[str, list[str], int | None]] = collections.deque()
        self._wakeup = threading.Event()  # set: the scheduler thread goes round at once
        # dead-letter copies decided under the lock, written outside it by the scheduler thread
        self._to_dead_letter: list[tuple[int, Item, int]] = []
        self.book = BucketBook(
            schedule,
            dispatch,
            config.scale_minutes,
            done_before=done_before,
            reopened=reopened,
            closed_retired=closed_retired,
            reopened_at=dict(reopened_at or {}),
        )
        self.loader = Loader(dispatch, corruption)  # the engine's policy for damaged records
        self.ledger = AckLedger()
        self.writer = DispatchLogWriter(dispatch, config.dispatch_flush_ms)
        self.writer.on_synced = self._on_synced
        self.dead_lettering: set[int] = set()  # dead-letter copy being written; cancel refused
        self.groups = groups if groups is not None else GroupTable()
        # the wheel, the lanes, what fired: the scheduling state with no I/O
        self.timer = Timer(config, self.book, self.groups, legacy_upto=legacy_upto, clock=clock)
        self.cancelling: set[int] = set()  # cancel accepted, tombstone not yet through iterate
        self.sink: DeliverySink | None = None
        self._tokens = 0.0
        self._tokens_at = time.monotonic()
        self._stop = False
        # False once stop() applied the last acks: a later ack is not recorded (the writer
        # is stopped) and its delivery stays in flight (offered again after a restart)
        self._accepting = True
        self.acks_after_stop = 0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.load_blocked = False
        self._sleeping_until: float | None = None  # when the timer thread, waiting, wakes by itself
        self._last_done_check = 0
        # counters
        self.dispatched = 0
        self.acked = 0
        self.redeliveries = 0
        self.dead_lettered = 0
        self.cancel_skipped = 0
        self.on_dispatch: Callable[[list[int]], None] | None = None  # lateness observer (ms)

    # --- control --------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the timer and sync threads; also after a stop() (a master fenced and then
        elected again in one process)."""
        with self.lock:
            self._stop = False
            self._accepting = True
        self._thread = threading.Thread(target=self._run, name="qdelay-scheduler", daemon=True)
        self._thread.start()
        self.writer.start()

    def stop(self) -> None:
        with self.lock:
            self._stop = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self.lock:
            self._drain()  # acks posted until now are recorded ...
            self._accepting = False  # ... later ones are not (see _ack)
        self.writer.stop()

    def wake(self) -> None:
        """Credit returned, or new work: the scheduler thread goes round now (no lock)."""
        self._wakeup.set()

    def set_sink(self, sink: DeliverySink | None) -> None:
        self.sink = sink
        self._wakeup.set()

    @property
    def error(self) -> BaseException | None:
        return self._error or self.writer.error

    # --- the loop -------------------------------------------------------------------------------

    def run_once(self, now: int) -> None:
        """One pass at time ``now``, loading until done: for tests with a simulated clock
        (the scheduler thread must not be running)."""
        while self._load_step(now):
            pass
        with self.lock:
            self._drain()
            self.timer.fire(now)
            self._expire(now)
        self._write_dead_letters()
        self._dispatch(now)
        while self._reread():
            self._dispatch(now)
        self.writer.flush(force=True)
        self.writer.sync()
        self._last_done_check = 0
        self._check_done(now)

    def _run(self) -> None:
        try:
            while True:
                # cleared before the work: a wake-up posted from here on ends the next wait
                self._wakeup.clear()
                with self.lock:
                    if self._stop:
                        return
                now = self.clock()
                loading = self._load_step(now)
                with self.lock:
                    self._drain()
                    self.timer.fire(now)
                    self._expire(now)
                self._write_dead_letters()
                more = self._dispatch(now)
                more = self._reread() or more
                self.writer.flush()
                self._check_done(now)
                with self.lock:
                    if self._stop:
                        return
                    now = self.clock()
                    timeout = self._sleep_for(now, loading or more)
                    if timeout > 0:
                        self._sleeping_until = now + timeout * 1000  # read by on_written
                if timeout > 0:
                    self._wakeup.wait(timeout)
                    with self.lock:
                        self._sleeping_until = None
        except BaseException as err:
            self._error = err
            log.exception("scheduler stopped")

    def _sleep_for(self, now: int, loading: bool) -> float:
        if loading:
            return 0.0
        t = now + 100  # the loader looks for new buckets at least every 100 ms
        nf = self.timer.next_fire()
        if nf is not None:
            t = min(t, nf)
        nl = self.ledger.next_wakeup()
        if nl is not None:
            t = min(t, nl)
        if self.writer.has_buffered():
            t = min(t, now + self.cfg.dispatch_flush_ms)
        if self.timer.ready_total and self.sink is not None and self.cfg.dispatch_rate > 0:
            t = min(t, now + 5)
        return max(0.0, (t - now) / 1000.0)

    # --- loading ----------------------------------------------------------------------------------

    def _load_step(self, now: int) -> bool:
        """Bring buckets into the wheel; return True if more loading is waiting."""
        book = self.book
        horizon = bucket_of(now + self.cfg.load_ahead_ms, self.cfg.scale_minutes)
        with self.lock:
            if horizon > book.horizon:
                book.open_up_to(horizon)
            pending = book.to_load()
            if not pending:
                self.load_blocked = False
                return False
            if self.timer.room() <= 0:
                self.timer.relieve()
            if self.timer.room() <= 0:
                if not self.load_blocked:
                    log.warning(
                        "loading paused: in-memory index is full",
                        extra={"entries": self.timer.in_memory(), "max": self.cfg.max_loaded},
                    )
                self.load_blocked = True
                return False
            self.load_blocked = False
            st = min(pending, key=lambda s: s.bucket)
            need_closed = not st.dispatch_ready
            start, stop = st.cursor, st.seg.size
            counted_below = book.reopened_at.get(st.bucket, 0)
        if need_closed:
            closed, counted = self.loader.read_closed(st.bucket, counted_below)
            # A bucket loaded in several chunks fires its first entries before the loader
            # reaches the tombstones behind them: collect those tombstones first.
            chunk = self.cfg.load_chunk_bytes
            tombstones = self.loader.read_tombstones(st.seg, start, stop, chunk) if stop - start > chunk else set()
            with self.lock:
                st.closed = closed
                st.counted = counted
                st.cancelled |= tombstones
                st.dispatch_ready = True
                st.tombstones_known = True
        frames, nxt = (
            self.loader.read_chunk(st.seg, start, stop, self.cfg.load_chunk_bytes) if start < stop else ([], start)
        )
        with self.lock:
            room = self.timer.room()
            if len(frames) > room:
                # no more entries than the budget has room for (at least one, to move on):
                # the rest of the chunk is read again when there is room, so records
                # appended to a loaded bucket (a burst into the loading window) cannot pass
                # the bound by a chunk
                cut = [i for i, f in enumerate(frames) if f.kind == RecordKind.MESSAGE][max(room, 1) :]
                if cut:
                    nxt = frames[cut[0]].offset
                    frames = frames[: cut[0]]
            if st.cursor != start:  # only this thread advances a loading cursor
                raise InvariantViolation(f"bucket {st.bucket} cursor moved during load")
            self.timer.index(st, frames)
            st.cursor = nxt
            if st.cursor >= st.seg.size:
                st.complete = True
                st.closed = st.counted = None
                self._maybe_done(st, now)
        return True

    def prime(self, now: int) -> None:
        """Open the loading window before the iterate service starts (the scheduler thread
        would do it on its first turn): records it replays into the buckets of the window
        are then written at once rather than behind, and left to the loader."""
        with self.lock:
            self.book.open_up_to(bucket_of(now + self.cfg.load_ahead_ms, self.cfg.scale_minutes))

    def on_written(self, written: dict[int, Written], cancels: list[tuple[int, int]]) -> None:
        """The iterate service appended to schedule segments (called with its append lock
        held): the one route from the schedule log into the timer.

        A loaded bucket whose loader had read to the end goes back to the loader, which
        reads on from its cursor. A bucket not loaded is left to the loader when its time
        comes, unless it is behind the horizon (finished, or created there after the loader
        passed): then it is loaded from where the append began (nothing before it is
        outstanding) and, if finished, reopened. A cancel is known at once, whatever the
        loader's progress: an entry loaded from an earlier chunk must not fire after its
        cancel was acknowledged.
        """
        book = self.book
        with self.lock:
            # wake the timer thread only for work it would not find before it wakes anyway:
            # waking it for every write of the iterate service cost ~1 µs per ingested message
            wake = False
            sleeping_until = self._sleeping_until
            for b, w in written.items():
                st = book.get(b)
                if st is None:
                    if b > book.horizon or b in book.reopened:
                        continue  # the loader will find it (and dedupe it) when its time comes
                    seg = self.schedule.get(b)
                    if seg is None:
                        continue
                    st = book.loaded[b] = BucketState(b, seg, w.start)
                    st.dispatch_ready = st.tombstones_known = True
                    book.reopen(b)
                    wake = True
                elif st.complete:
                    if w.end <= st.cursor:
                        continue  # already read (the loader ran ahead of this notice)
                    st.complete = False
                    st.done = False
                if sleeping_until is None or w.first_due < sleeping_until:
                    wake = True
            for b, target in cancels:
                got = book.get(b)
                if got is not None:
                    got.cancelled.add(target)
                self.cancelling.discard(target)
        if wake:
            self._wakeup.set()

    # --- groups -----------------------------------------------------------------------------------

    def apply_group(self, rec: records.Group, at_ms: int, seq: int) -> bool:
        """Apply a GROUP record of sequence ``seq`` unless the table already reflects it
        (a replay after a restart, or the master's own record passing the iterate
        service); True if it changed something."""
        with self.lock:
            if seq <= self.groups.applied_seq:
                return False
            self.groups.applied_seq = seq
            if rec.op == records.GroupOp.CREATE:
                return self.add_group(rec.subject, rec.group, at_ms)
            return self.remove_group(rec.subject, rec.group, at_ms)

    def add_group(self, subject: str, name: str, at_ms: int) -> bool:
        """Create a group (idempotent; True if it is new). A subject's first group takes
        over what the subject kept with no group: its lane starts spilled, so the loaded
        buckets are read back for it."""
        with self.lock:
            g, created = self.groups.create(subject, name, at_ms)
            if not created:
                return False
            self.timer.group_created(g)
            self._wakeup.set()
            return True

    def remove_group(self, subject: str, name: str, at_ms: int) -> bool:
        """Delete a group: its ready entries, spill and deliveries in flight are dropped
        (acks for them find nothing), and the buckets stop waiting for it."""
        with self.lock:
            g = self.groups.delete(subject, name, at_ms)
            if g is None:
                return False
            self.timer.group_deleted(g)
            self.ledger.drop_group(g.gid)
            self._wakeup.set()
            return True

    def group_stats(self, subject: str | None = None, group: str | None = None) -> list[dict[str, Any]]:
        """Per group (every one, or those of ``subject``, those named ``group``, or both):
        ready (due, in memory), whether it spilled to disk, in flight. Costs the groups
        listed, not all of them."""
        with self.lock:
            self._drain()
            out = []
            for g in self.groups.select(subject, group):
                lanes = self.timer.lanes_of(g.gid)
                out.append(
                    {
                        "subject": g.subject,
                        "group": g.name,
                        "ready": sum(ln.ready.count for ln in lanes),
                        "spilled": any(ln.spilled for ln in lanes),
                        "in_flight": self.ledger.count_of(g.gid),
                        "since": g.since,
                        "created_ms": g.created_ms,
                    }
                )
            return out

    def groups_of(self, subject: str) -> list[Group]:
        with self.lock:
            return self.groups.of_subject(subject)

    def gid_of(self, subject: str, group: str) -> int | None:
        """The id of a group, or None. Without the lock (the event loop asks on every ack):
        two dict lookups, each atomic under the GIL; a group created or deleted meanwhile
        is seen before or after, as with the lock."""
        g = self.groups.get(subject, group)
        return None if g is None else g.gid

    # --- timer ------------------------------------------------------------------------------------

    def _expire(self, now: int) -> None:
        """Deliveries not acknowledged in time go back for another attempt (or dead letters)."""
        for seq, item in self.ledger.expired(now):
            self._expired(seq, item, now)
        for item in self.ledger.due_retries(now):
            self.timer.requeue(item)

    def _expired(self, seq: int, item: Item, now: int) -> None:
        """One delivery's ack timeout passed: retry after a backoff, or dead-letter it."""
        self.redeliveries += 1
        attempt = item[4] - 1
        if attempt >= self.cfg.max_attempts:
            self._dead_letter(seq, item, now)
            return
        backoff = min(self.cfg.max_backoff_ms, self.cfg.retry_backoff_ms * (2 ** (attempt - 1)))
        self.ledger.retry_at(now + backoff, seq, item)

    # --- reading back what spilled lanes keep on disk ----------------------------------------------

    def _reread(self) -> bool:
        """One chunk of a spilled lane's pass over the loaded buckets; True if it did work.

        A pass reads back the lane's entries due at or before the time the pass began with
        (everything due then had fired) that are neither in memory, nor closed for the
        group (dispatch log and the records still buffered), nor cancelled. It stops while
        the lane is at half its bound and goes on when the consumers have taken them.
        """
        sink = self.sink
        if sink is None:
            return False
        timer = self.timer
        with self.lock:
            lane = timer.spilled_to_read(sink.credit)
            if lane is None:
                return False
            g = timer.live_lane(lane)
            if g is None:
                timer.spilled.discard(lane)
                return True
            if lane.walk is None:
                if lane.drop_from is None:
                    # nothing forgotten since the last pass began: the lane is whole again
                    lane.spilled = False
                    timer.spilled.discard(lane)
                    return True
                lane.walk = Pass(lane.drop_from, timer.fired_to)
                lane.drop_from = None
            w = lane.walk
            last = bucket_of(w.hi, self.cfg.scale_minutes)
            nxt = min((b for b in self.book.loaded if w.bucket <= b <= last), default=None)
            if nxt is None:
                lane.walk = None  # the pass is over
                return True
            if nxt != w.bucket:
                w.bucket, w.offset = nxt, 0
            st = self.book.loaded[nxt]
            start, stop = w.offset, st.cursor
            closed_known = w.closed_bucket == nxt
            closed_size = w.closed_size
        if start >= stop:
            with self.lock:
                if lane.walk is w:
                    w.bucket += self.cfg.scale_minutes
                    w.offset = 0
            return True
        # the disk reads, outside the lock: the chunk, and the group's closes in the
        # bucket's dispatch log (all of it on the first visit, what was appended since after)
        cols, after = columns_past_damage(st.seg, start, stop, self.cfg.load_chunk_bytes)
        picked = self._lane_rows(cols, timer.subjects[lane.sid].encode(), g.since, w.hi) if cols else None
        size, closes = self._group_closes(nxt, g.stored, closed_size if closed_known else 0)
        for tries in itertools.count():
            with self.lock:
                if lane.walk is not w:
                    return True
                dseg = self.dispatch.get(nxt)
                grown = dseg is not None and dseg.size > size
                if not grown or tries >= 3:
                    if grown:  # appended again and again meanwhile: read the rest here (rare)
                        size, more = self._group_closes(nxt, g.stored, size)
                        closes |= more
                    if not closed_known:
                        w.closed_bucket, w.closed_size, w.closed = nxt, size, closes
                    else:
                        w.closed_size = max(w.closed_size, size)
                        w.closed |= closes
                    # closes written since the file was read are in the writer's buffers
                    # (an ack moves a delivery into them under this lock)
                    if picked is not None and len(picked[0]):
                        self._take_back(lane, g, st, w, *picked)
                    w.offset = after
                    return True
            # records were appended since the read (a flush): read them before applying,
            # outside the lock
            size, more = self._group_closes(nxt, g.stored, size)
            closes |= more
        return True

    def _group_closes(self, bucket: int, stored: bytes, start: int) -> tuple[int, set[int]]:
        """(size read, sequences closed for the group stored as ``stored``) of the dispatch
        log of ``bucket`` from ``start`` (found column-wise)."""
        seg = self.dispatch.get(bucket)
        if seg is None:
            return 0, set()
        size = seg.size
        name = stored.decode() or records.DEFAULT_GROUP
        return size, set(bucket_log.group_closes_in(seg, start, size, name).tolist())

    @staticmethod
    def _lane_rows(cols: Columns, subject: bytes, since: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(seqs, file offsets, due times) of the MESSAGE frames of ``cols`` of ``subject``
        due in [since, hi]: checked column-wise on the frames' bytes."""
        rows = (cols.kinds == RecordKind.MESSAGE) & (cols.dues <= hi) & (cols.dues >= since)
        idx = np.flatnonzero(rows)
        if len(idx):
            raw = np.frombuffer(cols.data, dtype=np.uint8)
            body = cols.starts[idx] + framing.HEADER_SIZE
            slen = raw[body + 8].astype(np.int64) | (raw[body + 9].astype(np.int64) << 8)
            idx = idx[slen == len(subject)]
            if len(idx) and subject:
                at = (cols.starts[idx] + framing.HEADER_SIZE + records.MESSAGE_FIXED.size)[:, None] + np.arange(
                    len(subject)
                )
                want = np.frombuffer(subject, dtype=np.uint8)
                idx = idx[(raw[at] == want).all(axis=1)]
        return cols.seqs[idx], cols.starts[idx] + cols.base, cols.dues[idx]

    def _take_back(
        self, lane: Lane, g: Group, st: BucketState, w: Pass, seqs: np.ndarray, offs: np.ndarray, dues: np.ndarray
    ) -> None:
        """Queue entries read back for a spilled lane (lock held), minus those held in
        memory, closed or cancelled by now."""
        # what is not to be read back: a membership test per set, on the entries read
        # (unions of the sets cost their sizes per chunk: ``w.closed`` grows to the whole
        # backlog while it drains, which made a 5 M-message drain quadratic)
        pending = self.writer.pending(st.bucket)
        held: set[int] = {item[0] for item in lane.ready.retries}
        held |= self.ledger.held(lane.gid)
        if pending:
            held.update(bucket_log.group_closes_of(pending, g.name).tolist())
        listed = seqs.tolist()
        keep = np.ones(len(seqs), dtype=bool)
        for skip in (held, w.closed, self.dead_lettering, st.cancelled, self.cancelling, st.partial.get(g.name)):
            if skip:
                keep &= np.fromiter((q not in skip for q in listed), dtype=bool, count=len(listed))
        if not keep.all():
            seqs, offs, dues = seqs[keep], offs[keep], dues[keep]
        if len(seqs):
            self.timer.take_back(lane, st, seqs, offs, dues)
            self._wakeup.set()

    # --- dispatch ---------------------------------------------------------------------------------

    def _take_tokens(self, want: int) -> int:
        rate = self.cfg.dispatch_rate
        if rate <= 0:
            return want
        now = time.monotonic()
        self._tokens = min(max(rate * 0.1, 1.0), self._tokens + (now - self._tokens_at) * rate)
        self._tokens_at = now
        n = min(want, int(self._tokens))
        self._tokens -= n
        return n

    def _dispatch(self, now: int) -> bool:
        """Hand ready entries to the sink; True if it stopped at the round limit with
        deliveries still flowing (the loop then goes round again without sleeping: no ack
        or credit notification may come to wake it).

        Each round takes entries from the lanes under the lock, reads their records back
        outside it (the event loop, Cancel and Get never wait for that read), then under
        the lock again drops what was cancelled or deleted meanwhile and registers the rest
        as in flight before handing the batches over.
        """
        sink = self.sink
        if sink is None:
            return False
        rounds = 0
        while True:
            taken: list[_Taken] = []
            with self.lock:
                if not self.timer.rr or self._stop:
                    break
                for lane, g, name, cols in self.timer.take(sink.credit, self._take_tokens, self.cfg.dispatch_quantum):
                    parts = self._by_bucket(lane.gid, *cols)
                    if parts:
                        taken.append(_Taken(lane, g, name, parts))
            if not taken:
                return False
            self._read_parts(taken)  # the disk reads, outside the lock
            with self.lock:
                ids: dict = {}  # ack ids made once for the groups taking the same entries
                batches = [b for b in (self._hand_out(t, now, ids) for t in taken) if b is not None]
            for out in batches:
                sink.deliver(out.subject, out.group, out)
            rounds += 1
            if rounds >= 64:  # let the loop flush dispatch records and fire new entries
                return True
        return False

    @staticmethod
    def _read_parts(taken: list[_Taken]) -> None:
        """Read back the records of every part taken in a round (outside the lock). The
        groups of one subject usually take the same entries in the same round (fan-out:
        they fired together): a part whose entries another part of the round has already
        read shares that read (the same bytes objects; nothing changes them in place)."""
        done: dict[tuple[int, int, int], list[_Part]] = {}
        for t in taken:
            for part in t.parts:
                key = (part.st.bucket, part.offs[0], len(part.offs))
                same = next((p for p in done.get(key, ()) if p.offs is part.offs or p.offs == part.offs), None)
                if same is not None:
                    part.read = same.read
                    continue
                part.read = read_messages(part.st.seg, part.seqs, part.offs)
                done.setdefault(key, []).append(part)

    def _by_bucket(
        self, gid: int, seqs: list[int], offs: list[int], buckets: list[int], dues: list[int], attempts: list[int]
    ) -> list[_Part]:
        """Ready items (columns, all of one lane) split by bucket, cancelled ones dropped
        (lock held)."""
        first = buckets[0]
        if buckets.count(first) == len(buckets):
            by_bucket = [(first, seqs, offs, dues, attempts)]
        else:
            where: dict[int, list[int]] = {}
            for i, b in enumerate(buckets):
                where.setdefault(b, []).append(i)
            by_bucket = [
                (b, [seqs[i] for i in idx], [offs[i] for i in idx], [dues[i] for i in idx], [attempts[i] for i in idx])
                for b, idx in where.items()
            ]
        parts = []
        for bucket, g_seqs, g_offs, g_dues, g_attempts in by_bucket:
            st = self.book.get(bucket)
            if st is None:
                continue  # cannot happen for indexed entries; guards against a dropped bucket
            part = _Part(st, g_seqs, g_offs, g_dues, g_attempts)
            if self._drop_cancelled(part, gid):
                parts.append(part)
        return parts

    def _drop_cancelled(self, part: _Part, gid: int) -> bool:
        """Drop the part's cancelled entries (lock held); False if none is left."""
        st = part.st
        if st.cancelled or self.cancelling:
            cancelled, cancelling = st.cancelled, self.cancelling
            keep = [i for i, q in enumerate(part.seqs) if q not in cancelled and q not in cancelling]
            if len(keep) < len(part.seqs):
                skipped = len(part.seqs) - len(keep)
                st.owe(gid, -skipped)
                self.cancel_skipped += skipped
                part.keep(keep)
        return bool(part.seqs)

    def _hand_out(self, t: _Taken, now: int, ids: dict) -> Deliveries | None:
        """Turn parts read back into one batch of deliveries (lock held): drop what was
        cancelled while they were read, and unreadable records; register the rest as in
        flight for the group.

        This is the per-message hot path of a burst, so it works on columns: no object or
        tuple per delivery except the in-flight entry an ack needs. A batch of one part
        (the usual case) uses the part's columns as they are, and the groups of a subject
        that took the same entries in the round (fan-out) share them, their records and
        their ack ids (``ids``: the round's, by the columns' identity); nothing changes a
        column in place.
        """
        lane, gid = t.lane, t.lane.gid
        if self.timer.live_lane(lane) is None:
            return None  # the group was deleted while its records were read
        flights: list[Flight] = []
        kept: list[_Part] = []
        for part in t.parts:
            st = part.st
            if not self._drop_cancelled(part, gid):  # cancelled while being read
                continue
            mids = part.read[0]
            if None in mids:  # unreadable records: reported by read_messages, never served
                keep = [i for i, m in enumerate(mids) if m is not None]
                bad = len(mids) - len(keep)
                st.owe(gid, -bad)
                self.loader.corrupt_skipped += bad
                part.keep(keep)
                if not part.seqs:
                    continue
                mids = part.read[0]
            flights.append(Flight(st.bucket, lane.sid, gid, now, part.seqs, part.offs, part.dues, part.attempts, mids))
            kept.append(part)
        if not kept:
            return None
        if len(kept) == 1:  # one part (the usual case): its columns, not copies
            (part,) = kept
            o_seqs, o_dues, o_attempts = part.seqs, part.dues, part.attempts
            o_mids, o_payloads, o_headers = part.read
        else:
            o_seqs, o_dues, o_attempts, o_mids, o_payloads, o_headers = [], [], [], [], [], []
            for part in kept:
                o_seqs += part.seqs
                o_dues += part.dues
                o_attempts += part.attempts
                o_mids += part.read[0]
                o_payloads += part.read[1]
                o_headers += part.read[2]
        key = (id(o_seqs), id(o_attempts))
        made = ids.get(key)
        if made is not None and made[0] is o_seqs and made[1] is o_attempts:
            o_ids = made[2]
        else:
            o_ids = ack_ids(o_seqs, o_attempts)
            ids[key] = (o_seqs, o_attempts, o_ids)
        self.ledger.hand_out(flights, now + self.cfg.ack_timeout_ms)
        self.dispatched += len(o_seqs)
        if self.on_dispatch is not None:
            lateness = [now - d for d, a in zip(o_dues, o_attempts) if a == 1]
            if lateness:
                self.on_dispatch(lateness)
        return Deliveries(
            t.name,
            o_ids,
            o_mids,
            o_payloads,
            o_headers,
            o_dues,
            now,
            o_attempts,
            t.group.name,
        )

    # --- acknowledgements ---------------------------------------------------------------------------

    def post_ack(self, ack_ids: list[str], gid: int | None = None) -> None:
        """Acknowledge deliveries without waiting (the event loop): the ids are queued for
        the scheduler thread, which wakes for them; no lock is taken here."""
        self._inbox.append(("ack", ack_ids, gid))
        self._wakeup.set()

    def post_release(self, ack_ids: list[str], gid: int | None = None) -> None:
        """``release`` without waiting (the event loop): queued like ``post_ack``."""
        self._inbox.append(("release", ack_ids, gid))
        self._wakeup.set()

    def _drain(self) -> None:
        """Apply the acks and releases posted so far, in order (lock held)."""
        inbox = self._inbox
        while inbox:
            op, ids, gid = inbox.popleft()
            if op == "ack":
                self._ack(ids, gid)
            else:
                self._release(ids, gid)

    def ack(self, ack_ids: list[str], gid: int | None = None) -> int:
        """Close acknowledged deliveries of group ``gid`` (None: whichever group has them in
        flight, for tests and tools) and say how many were in flight: one lock hold and one
        encode per bucket for the whole request, the DISPATCH frames buffered for the loop
        to write and fsync. Waits for the lock: the event loop posts instead (post_ack)."""
        with self.lock:
            self._drain()
            return self._ack(ack_ids, gid)

    def _ack(self, ack_ids: list[str], gid: int | None) -> int:
        if not self._accepting:
            # stopped: the dispatch log takes no more records; the deliveries stay in flight
            # and are offered again after a restart (at least once)
            if not self.acks_after_stop:
                log.info("acknowledgements after the scheduler stopped are not recorded", extra={"ids": len(ack_ids)})
            self.acks_after_stop += len(ack_ids)
            return 0
        now = self.clock()
        n = 0
        for fl, got in self.ledger.take_acked(ack_sequences(ack_ids), gid):
            offs, dues, attempts, mids = fl.columns(got)
            at = [fl.at] * len(got)
            self._record_many(fl.bucket, got, dues, at, offs, attempts, mids, records.Outcome.DELIVERED, now, fl.gid)
            n += len(got)
        if n:
            self.acked += n
            self._wakeup.set()
        return n

    def in_flight_count(self) -> int:
        with self.lock:
            self._drain()
            return self.ledger.count()

    def is_in_flight(self, seq: int) -> bool:
        """Handed out to some group and not yet acknowledged."""
        with self.lock:
            self._drain()
            return self.ledger.is_in_flight(seq)

    def release(self, ack_ids: list[str], gid: int | None = None) -> int:
        """Give back deliveries a consumer will not acknowledge (its stream ended).

        Each one still in flight *with that attempt* goes back to its lane's ready queue
        at once, as attempt + 1 (a redelivery, without the ack timeout or backoff); one that
        used its ``max_attempts`` goes to the dead-letter path, like an expiry. Ids of an
        older attempt, or of deliveries already acknowledged or expired, are ignored.
        Returns how many were released (dead-lettered ones included).
        """
        with self.lock:
            self._drain()
            n = self._release(ack_ids, gid)
        self._write_dead_letters()  # those that used their attempts, outside the lock
        return n

    def _release(self, ack_ids: list[str], gid: int | None) -> int:
        now = self.clock()
        released = self.ledger.take_released(ack_attempts(ack_ids), gid)
        for seq, item in released:
            self.redeliveries += 1
            if item[4] - 1 >= self.cfg.max_attempts:
                self._dead_letter(seq, item, now)
            else:
                self.timer.requeue(item)
        if released:
            self._wakeup.set()
        return len(released)

    def _record_many(
        self,
        bucket: int,
        seqs: list[int],
        dues: list[int],
        dispatched_at: list[int],
        offs: list[int],
        attempts: list[int],
        mids: list[bytes],
        outcome: int,
        now: int,
        gid: int,
    ) -> None:
        """Buffer DISPATCH records of messages of ``bucket`` closed for group ``gid`` (lock
        held), given as columns; the loop writes and fsyncs them shortly."""
        g = self.groups.by_gid(gid)
        if g is None:
            return  # deleted meanwhile: nothing to record for it
        self.writer.add(
            bucket,
            records.encode_dispatch_frames(seqs, dues, dispatched_at, offs, attempts, mids, now, outcome, g.stored),
        )
        # a close counts for ``pending`` when it is by the subject's first group, the one
        # every message of the subject that has a group at all is for
        targets = self.timer.targets(self.timer.subject_id(g.subject.encode()))
        st = self.book.get(bucket)
        if st is not None:
            st.owe(gid, -len(seqs))
        if targets and targets[0].gid == gid:
            self.book.count_closed(bucket, len(seqs))

    def closed_total(self) -> int:
        """Messages closed (delivered or dead-lettered) over the data folder's life."""
        with self.lock:
            self._drain()
            return self.book.closed_total()

    def pending_dispatch(self, bucket: int) -> bytes:
        """DISPATCH frames of ``bucket`` buffered but not yet in its file."""
        return self.writer.pending(bucket)

    # --- done buckets -----------------------------------------------------------------------------

    def _on_synced(self, buckets: list[int]) -> None:
        """DISPATCH records of ``buckets`` were fsynced (sync thread): they may be done now."""
        now = self.clock()
        with self.lock:
            for b in buckets:
                st = self.book.get(b)
                if st is not None:
                    self._maybe_done(st, now)
            self.book.advance(now)

    def _check_done(self, now: int) -> None:
        """Every 100 ms: buckets whose time passed with nothing outstanding become done."""
        if now - self._last_done_check < 100:
            return
        self._last_done_check = now
        with self.lock:
            for st in self.book.loaded.values():
                if not st.done:
                    self._maybe_done(st, now)
            self.book.advance(now)

    def _maybe_done(self, st: BucketState, now: int) -> None:
        self.book.maybe_done(st, now, self.timer.spill_floor(), self.writer.unsynced)

    # --- dead letters -------------------------------------------------------------------------------

    def _dead_letter(self, seq: int, item: Item, now: int) -> None:
        """A message failed ``max_attempts`` times for a group (lock held): it is marked as
        being dead-lettered (Cancel refuses it from now on) and its copy is written by the
        scheduler thread outside the lock (``_write_dead_letters``)."""
        self.dead_lettering.add(seq)
        self._to_dead_letter.append((seq, item, now))
        self._wakeup.set()

    def _write_dead_letters(self) -> None:
        """Move messages that failed ``max_attempts`` times to the dead-letter subject.

        The copy goes through the message log like any send; only once it is durable is the
        original closed for that group with a DEAD_LETTERED dispatch record, so a crash in
        between delivers the original again rather than losing it.
        """
        with self.lock:
            todo, self._to_dead_letter = self._to_dead_letter, []
            work = []
            for seq, item, now in todo:
                st = self.book.get(item[2])
                g = self.groups.by_gid(item[6])
                if st is None or self.dead_letter is None or g is None:
                    self.dead_lettering.discard(seq)
                    continue
                work.append((seq, item, now, st, g.name))
        for seq, item, now, st, name in work:
            self._write_dead_letter(seq, item, now, st, name)

    def _write_dead_letter(self, seq: int, item: Item, now: int, st: BucketState, name: str) -> None:
        _seq, off, bucket, due, attempt, _subj, gid = item
        try:
            msg = records.decode_message(st.seg.read_frame(off).body)  # outside the lock
        except CorruptRecord as err:
            log.error(
                "corrupt schedule record; it cannot be dead-lettered", extra={"path": err.path, "offset": err.offset}
            )
            with self.lock:
                self.dead_lettering.discard(seq)
                st.owe(gid, -1)
                self.loader.corrupt_skipped += 1
            return

        def done(error: Exception | None) -> None:
            with self.lock:
                self.dead_lettering.discard(seq)
                if error is None and not self._accepting:
                    # stopped meanwhile: the copy is written, the original not closed; it is
                    # dead-lettered again after a restart (at least once)
                    self.acks_after_stop += 1
                elif error is None:
                    self._record_many(
                        bucket,
                        [seq],
                        [due],
                        [now],
                        [off],
                        [attempt - 1],
                        [msg.message_id.encode()],
                        records.Outcome.DEAD_LETTERED,
                        self.clock(),
                        gid,
                    )
                    self.dead_lettered += 1
                else:  # try again later; the message stays pending meanwhile
                    self.ledger.retry_at(self.clock() + self.cfg.retry_backoff_ms, seq, item)
            self._wakeup.set()

        if self.dead_letter is None:
            return
        try:
            self.dead_letter(msg, seq, name, attempt - 1, done)
        except QdelayError as err:
            log.warning("dead-letter write refused; will retry", extra={"error": str(err)})
            with self.lock:
                self.dead_lettering.discard(seq)
                self.ledger.retry_at(now + self.cfg.retry_backoff_ms, seq, item)

    # --- for the engine, replication and the cleaner -------------------------------------------------

    def loading_horizon(self) -> int:
        """The highest bucket the loader considered so far (records of buckets up to it are
        handed over by the iterate service rather than written behind)."""
        return self.book.horizon

    @property
    def done_before(self) -> int:
        """Every bucket below it is done (read-only; replication adopts a master's with
        ``adopt_progress``)."""
        return self.book.done_before

    @property
    def reopened(self) -> frozenset[int]:
        return frozenset(self.book.reopened)

    def progress(self) -> tuple[int, list[int]]:
        """(done_before, reopened buckets): what a slave adopts."""
        with self.lock:
            return self.book.done_before, sorted(self.book.reopened)

    def adopt_progress(self, done_before: int, reopened: set[int]) -> None:
        """Slave: take the master's progress exactly (it may even move back: a bucket the
        master has not finished is loaded on promotion)."""
        with self.lock:
            self.book.adopt(done_before, reopened)

    def note_reopened(self, bucket: int) -> None:
        """Slave: a record landed in a bucket below ``done_before``; a promotion loads it."""
        with self.lock:
            self.book.note_reopened(bucket)

    def is_done(self, bucket: int) -> bool:
        """Below ``done_before``: finished (unless reopened by a late record)."""
        return bucket < self.book.done_before

    def is_finished(self, bucket: int) -> bool:
        """Done and forgotten: below ``done_before``, neither reopened nor loaded."""
        with self.lock:
            return self.book.finished(bucket)

    def finished_buckets(self, candidates: list[int], older_than: Callable[[int], bool]) -> list[int]:
        """Of ``candidates`` (ascending), those the cleaner may delete: a run of finished
        buckets below ``done_before``, stopping at the first one ``older_than`` refuses."""
        out = []
        with self.lock:
            book = self.book
            for b in candidates:
                if b >= book.done_before:
                    break
                if b in book.reopened or b in book.loaded:
                    continue
                if not older_than(b):
                    break
                out.append(b)
        return out

    # claim_cancels answers, one per sequence
    CLAIMED = 0
    CLAIM_CANCELLING = 1  # another Cancel claimed it already (or an earlier entry of the list)
    CLAIM_OUT = 2  # handed out and not acknowledged, or its dead-letter copy is being written

    def claim_cancels(self, sequences: list[int]) -> list[int]:
        """Claim each sequence for a Cancel, under one lock acquisition: a claimed message is
        skipped by the dispatcher until its tombstone has passed the iterate service (see
        on_written) or ``release_cancels``. One of CLAIMED, CLAIM_CANCELLING, CLAIM_OUT each."""
        out: list[int] = []
        cancelling, dead = self.cancelling, self.dead_lettering
        with self.lock:
            self._drain()  # acks posted before this Cancel count
            flights = [f for f in self.ledger.in_flight.values() if f]
            for seq in sequences:
                if seq in cancelling:
                    out.append(self.CLAIM_CANCELLING)
                elif seq in dead or any(seq in f for f in flights):
                    out.append(self.CLAIM_OUT)
                else:
                    cancelling.add(seq)
                    out.append(self.CLAIMED)
        return out

    def release_cancels(self, sequences: list[int]) -> None:
        """Give back claims whose tombstones will not be written (or were not needed)."""
        with self.lock:
            self.cancelling.difference_update(sequences)

    def cancel_claimed(self, seq: int) -> bool:
        """Whether a Cancel claimed ``seq`` and its tombstone has not passed yet."""
        with self.lock:
            return seq in self.cancelling

    def dispatch_view(self, bucket: int, seq: int) -> tuple[bytes, int, bool]:
        """(DISPATCH frames of ``bucket`` not yet in its file, the file's size then, whether
        ``seq`` was in flight then): taken together under the lock, so that no ack slips
        between a look at the file and a look at the buffers. Every close made before is
        in the buffers or in the file below that size (or both, while being written)."""
        with self.lock:
            self._drain()
            pending = self.writer.pending(bucket)
            dseg = self.dispatch.get(bucket)
            size = dseg.size if dseg is not None else 0
            return pending, size, self.ledger.is_in_flight(seq)

    def known_tombstones(self, bucket: int) -> set[int] | None:
        """Every cancelled sequence of ``bucket`` if it is loaded with its tombstones all
        known (the set itself: read it, never change it); None otherwise."""
        st = self.book.get(bucket)
        return st.cancelled if st is not None and st.tombstones_known else None

    # --- introspection ------------------------------------------------------------------------------

    @property
    def corrupt_skipped(self) -> int:
        return self.loader.corrupt_skipped

    @property
    def dispatch_disk_full_total(self) -> int:
        return self.writer.disk_full_total

    def stats(self) -> dict[str, Any]:
        with self.lock:
            self._drain()
            return {
                "wheel_size": len(self.timer.wheel),
                "ready": self.timer.ready_total,
                "in_flight": self.ledger.count(),
                "loaded_buckets": len(self.book.loaded),
                "done_before": self.book.done_before,
                "reopened": len(self.book.reopened),
                "dispatched": self.dispatched,
                "acked": self.acked,
                "redeliveries": self.redeliveries,
                "dead_lettered": self.dead_lettered,
                "cancel_skipped": self.cancel_skipped,
                "corrupt_skipped": self.loader.corrupt_skipped,
                "load_blocked": self.load_blocked,
                "dispatch_unsynced_buckets": self.writer.unsynced_count(),
                "acks_after_stop": self.acks_after_stop,
            }

    def persistent_state(self) -> dict[str, Any]:
        with self.lock:
            book = self.book
            return {
                "done_before": book.done_before,
                "reopened": sorted(book.reopened),
                "closed_retired": book.closed_retired,
                "reopened_at": [[b, n] for b, n in sorted(book.reopened_at.items())],
                **self.groups.state(),
            }
