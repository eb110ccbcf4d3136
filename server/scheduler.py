"""The scheduler: the thread that owns the scheduling state (``qdelay-scheduler``), its
queue, and the lock discipline around its pieces' I/O (see docs/internals.md).

The pieces, one job each:

- ``buckets.BucketBook``: which buckets are loaded, which are done (``done_before``,
  reopened buckets), the closes counted for ``pending``;
- ``loader.Loader``: the disk reads of loading (schedule chunks, tombstones, dispatch
  logs), indexed by the timer (at most ``max_loaded`` entries in memory);
- ``timer.Timer``: the wheel, the lanes per subject and group (ready in memory up to a
  bound, then *spilled*), firing with fan-out, dispatch rounds within credit;
- ``dispatcher.Dispatcher``: ready entries taken, their records read back, handed out;
- ``readback.ReadBack``: a spilled lane's entries read again while its consumers have
  credit;
- ``ledger.AckLedger``: deliveries in flight, ack deadlines, retries;
- ``claims.CancelClaims``: messages a Cancel claimed, never handed out;
- ``dead_letters.DeadLetters``: copies to the dead-letter subject after ``max_attempts``;
- ``dispatch_log.DispatchLogWriter``: DISPATCH records buffered, written, fsynced.

Other threads hand work over on the queue: the event loop posts acks and releases, Cancel
claims arrive as requests their worker thread gets an answer to (``call``), the WAL writer
posts dead-letter completions. An acknowledged delivery gets a DISPATCH record; an unacknowledged one is
offered again after the ack timeout plus a backoff, and after ``max_attempts`` it goes to
the dead-letter subject.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures import wait as wait_for_future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from qdelay.segments import records
from qdelay.segments.bucket_log import BucketLog
from qdelay.segments.naming import bucket_of
from qdelay.segments.segment import CorruptionPolicy
from qdelay.server import claims
from qdelay.server.buckets import BucketBook, BucketState
from qdelay.server.claims import CancelClaims
from qdelay.server.dead_letters import DeadLetter, DeadLetters
from qdelay.server.deliveries import DEAD_LETTER_HEADER, Deliveries, Delivery, DeliverySink
from qdelay.server.dispatch_log import DispatchLogWriter
from qdelay.server.dispatcher import Dispatcher
from qdelay.server.groups import Group, GroupTable
from qdelay.server.iterate import Written
from qdelay.server.lanes import Lane, Pass
from qdelay.server.ledger import AckLedger, Item, ack_attempts
from qdelay.server.loader import Loader
from qdelay.server.readback import Cancelled, ReadBack
from qdelay.server.timer import Timer

log = logging.getLogger("qdelay.scheduler")

__all__ = ["DEAD_LETTER_HEADER", "DeadLetter", "Deliveries", "Delivery", "DeliverySink", "Scheduler", "SchedulerConfig"]

T = TypeVar("T")
# messages cancelled after they fired, while some lane was spilled or some subject kept its
# due messages for its first group (``on_written``): the timer's lane epoch then, its
# counting walks then, per bucket (its state, the targets, the (sequence, group id) a pass
# had set aside while claimed), and the subjects keeping then
_OnDisk = tuple[
    int, dict[Lane, tuple[Pass, int, int]], list[tuple[BucketState, list[int], set[tuple[int, int]]]], frozenset[int]
]


# groups whose figures ``group_stats`` reads per hold of the lock (~2 us each)
STATS_CHUNK = 256


def _group_order(g: Group) -> tuple[str, str]:
    return (g.subject, g.name)


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
        # guards the scheduling state for short stretches, never across disk I/O; the
        # scheduler thread holds it most, other threads briefly (see docs/internals.md)
        self.lock = threading.RLock()  # apply_group -> add_group re-enter it
        # the scheduler's queue: acks and releases posted by the event loop, Cancel claims
        # and releases, dead-letter completions; applied in order by the scheduler thread
        # (or, under the lock, by a caller that must see them before it looks: _drain)
        self._inbox: collections.deque[tuple[str, Any, Any]] = collections.deque()
        self._wakeup = threading.Event()  # set: the scheduler thread wakes up
        # a turn is wanted (new work, credit, acks): set by wake(); a call() alone wakes the
        # sleeping thread only to answer it, not for a whole turn (see _sleep)
        self._turn = False
        self.book = BucketBook(
            schedule,
            dispatch,
            config.scale_minutes,
            done_before=done_before,
            reopened=reopened,
            closed_retired=closed_retired,
            reopened_at=dict(reopened_at or {}),
        )
        self.ledger = AckLedger()
        self.writer = DispatchLogWriter(dispatch, config.dispatch_flush_ms)
        self.writer.on_synced = self._on_synced
        self.groups = groups if groups is not None else GroupTable()
        # the wheel, the lanes, what fired: the scheduling state with no I/O
        self.timer = Timer(config, self.book, self.groups, legacy_upto=legacy_upto, clock=clock)
        # the engine's policy for damaged records
        self.loader = Loader(config, self.book, self.timer, dispatch, corruption)
        self.claims = CancelClaims()  # cancel accepted, tombstone not yet through iterate
        self.dead_letters = DeadLetters(
            config,
            self.book,
            self.groups,
            self.ledger,
            self.loader,
            dead_letter,
            self._close_dead_lettered,
            self.post,
            clock,
        )
        self.dispatcher = Dispatcher(config, self.timer, self.book, self.ledger, self.claims, self.loader)
        self.readback = ReadBack(
            config,
            self.timer,
            self.book,
            dispatch,
            self.writer,
            self.ledger,
            self.claims,
            self.dead_letters.writing,
        )
        self.sink: DeliverySink | None = None
        self._stop = False
        # False once stop() applied the last acks: a later ack is not recorded (the writer
        # is stopped) and its delivery stays in flight (offered again after a restart)
        self._accepting = True
        self.acks_after_stop = 0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._sleeping_until: float | None = None  # when the timer thread, waiting, wakes by itself
        # while set and False, nothing is handed out (hold_deliveries); None once it said True
        self._held: Callable[[], bool] | None = None
        self._last_done_check = 0
        # counters
        self.acked = 0
        self.redeliveries = 0

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
        self.wake()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self.lock:
            self._drain()  # acks posted until now are recorded ...
            self._accepting = False  # ... later ones are not (see _ack)
        self.writer.stop()

    def thread_id(self) -> int | None:
        """The scheduler thread's native id while it runs (per-thread CPU figures)."""
        t = self._thread
        return t.native_id if t is not None else None

    def wake(self) -> None:
        """Credit returned, or new work: the scheduler thread goes round now (no lock)."""
        self._turn = True  # before the event: a sleeping thread that clears it still sees this
        self._wakeup.set()

    def set_sink(self, sink: DeliverySink | None) -> None:
        self.sink = sink
        self.wake()

    def hold_deliveries(self, until: Callable[[], bool]) -> None:
        """Hand nothing out until ``until()`` is true (asked at each dispatch round, every
        10 ms while it is false; forgotten once true): the engine's rule after a restart or a
        promotion, until the iterate service has copied the tombstones the message log held
        then (Engine._hold_deliveries). Loading and firing go on meanwhile; a tombstone
        copied in the meantime takes its target out of the wheel or the ready queues
        (``on_written``) before the hold ends."""
        self._held = until

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
                self._turn = False
                self._wakeup.clear()
                with self.lock:
                    if self._stop:
                        return
                    self._drain()  # Cancel claims waiting for an answer do not wait for the loader's reads
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
                    self._sleep(timeout)
                    with self.lock:
                        self._sleeping_until = None
        except BaseException as err:
            self._error = err
            log.exception("scheduler stopped")

    def _sleep(self, timeout: float) -> None:
        """Wait until a turn is wanted or ``timeout`` seconds passed. Woken only for queued
        calls (a Cancel's claims, a Get's question), apply them and sleep on: answering one
        costs a drain, not a whole turn of loading, firing and dispatching."""
        end = time.monotonic() + timeout
        while not self._turn and not self._stop:
            left = end - time.monotonic()
            if left <= 0 or not self._wakeup.wait(left):
                return
            self._wakeup.clear()
            if self._inbox:
                with self.lock:
                    self._drain()

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
        if self._held is not None:
            t = min(t, now + 10)  # deliveries held (hold_deliveries): look again soon
        return max(0.0, (t - now) / 1000.0)

    # --- loading ----------------------------------------------------------------------------------

    def _load_step(self, now: int) -> bool:
        """Bring one chunk of a bucket into the wheel (``server/loader.py``); True if more
        loading is waiting. The chunk is read outside the lock."""
        with self.lock:
            step = self.loader.next_step(now)
        if step is None:
            return False
        self.loader.read(step)  # the disk reads, outside the lock
        with self.lock:
            if self.loader.apply(step):
                self._maybe_done(step.st, now)
        return True

    def prime(self, now: int) -> None:
        """Open the loading window before the iterate service starts (the scheduler thread
        would do it on its first turn): records it replays into the buckets of the window
        are then written at once rather than behind, and left to the loader."""
        with self.lock:
            self.book.open_up_to(bucket_of(now + self.cfg.load_ahead_ms, self.cfg.scale_minutes))

    def on_written(self, written: dict[int, Written], cancels: dict[int, list[int]]) -> None:
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
                    book.load_behind(b, seg, w.start)
                    wake = True
                elif st.complete:
                    if w.end <= st.cursor:
                        continue  # already read (the loader ran ahead of this notice)
                    st.written_on()
                if sleeping_until is None or w.first_due < sleeping_until:
                    wake = True
            fired: list[tuple[int, list[int]]] = []
            # while some lane is spilled: the targets that fired already, which a spilled lane
            # of their subject may count on disk (known by their records, read later)
            spilled = bool(self.timer.spilled) or bool(self.timer.kept_count)
            on_disk: list[tuple[BucketState, list[int], set[tuple[int, int]]]] = []
            for b, targets in cancels.items():
                got = book.get(b)
                gone: list[int] = []
                if got is not None:
                    if spilled:
                        gone = self.timer.fired_among(got, targets)
                    if self.timer.may_hold_fired(got, targets):
                        fired.append((b, targets))
                    got.cancel(targets)
                aside: set[tuple[int, int]] = set()
                for item in self.claims.settled(targets):
                    # set aside while claimed, cancelled now: no longer held by the bucket
                    st = book.get(item[2])
                    if st is not None and self.timer.has_lane(item[5], item[6]):
                        st.owe(item[6], -1)
                    aside.add((item[0], item[6]))  # counted read back (Timer.set_aside)
                if gone and got is not None:
                    on_disk.append((got, gone, aside))
            disk = None
            if on_disk:
                timer = self.timer
                disk = (timer.lane_epoch, timer.counting_walks(), on_disk, frozenset(timer.kept_count))
        if fired or disk:
            # fired already, they may wait in ready queues: taken out of them (and out of
            # the groups' backlog) by the scheduler thread, which owns the lanes; or on a
            # spilled lane's disk, taken off its count once their records tell their subject
            self.post(lambda: self._cancel_ready(fired, disk))
        if wake:
            self.wake()

    def _cancel_ready(self, fired: list[tuple[int, list[int]]], disk: _OnDisk | None = None) -> None:
        if disk is not None:
            # which spilled lanes hold each in memory (ready, retrying, set aside): looked at
            # before the ready queues and the ledger let go of them below
            epoch, walks, parts, kept = disk
            for state, seqs, aside in parts:
                held = self.timer.spilled_holding(seqs, epoch)
                for lane, mine in held.items():
                    mine |= self.ledger.retrying_among(lane.gid, seqs)
                    mine.update(q for q, gid in aside if gid == lane.gid)
                if held or kept:
                    self.readback.note_cancelled(Cancelled(state, seqs, held, walks, epoch, kept))
                    self.wake()
        for b, targets in fired:
            gone = set(targets)
            self.timer.cancel_ready(b, gone)
            # and those waiting out a retry's backoff in the ack ledger: out of the backlog
            # now, and no longer held for their groups by the bucket
            dropped = self.ledger.cancel_retries(gone)
            st = self.book.get(b) if dropped else None
            if st is not None:
                for gid, n in dropped:
                    st.owe(gid, -n)

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
            self.wake()
            return True

    def remove_group(self, subject: str, name: str, at_ms: int) -> bool:
        """Delete a group: its ready entries, spill, retries and deliveries in flight are dropped
        (acks for them find nothing), and the buckets stop waiting for it."""
        with self.lock:
            g = self.groups.delete(subject, name, at_ms)
            if g is None:
                return False
            self.timer.group_deleted(g)
            self.ledger.drop_group(g.gid)
            self.wake()
            return True

    def group_stats(self, subject: str | None = None, group: str | None = None) -> list[dict[str, Any]]:
        """Per group (every one, or those of ``subject``, those named ``group``, or both):
        ready (due, in memory), whether it spilled to disk and how many due entries wait
        there (``on_disk``, see ``Lane``), how many wait out a retry's backoff after their
        ack timeout (``retrying``), the backlog (the sum of those three: due, not delivered
        again yet), in flight (handed to a consumer, awaiting its ack). Costs the groups listed, not all of
        them.

        Read under the lock ``STATS_CHUNK`` groups at a time, in ``GroupTable.all()``'s
        order (sorted outside it): a listing of every group (Stats, each metrics scrape)
        held the dispatcher for all of them at once, ~10 ms at 5,000 groups. Each group's
        figures are taken together; a group deleted meanwhile is left out."""
        narrow = subject is not None or group is not None
        with self.lock:
            self._drain()
            chosen = self.groups.select(subject, group) if narrow else self.groups.listed()
            if narrow and len(chosen) <= STATS_CHUNK:
                return [self._group_figures(g) for g in chosen]
        if not narrow:
            chosen.sort(key=_group_order)
        out = []
        for i in range(0, len(chosen), STATS_CHUNK):
            if i:
                # let a thread woken by the release (the dispatcher) take the GIL, and so
                # the lock, before the next chunk: released and taken again at once, the
                # lock would stay this thread's for the GIL's whole switch interval
                time.sleep(0)
            with self.lock:
                for g in chosen[i : i + STATS_CHUNK]:
                    if self.groups.by_gid(g.gid) is g:
                        out.append(self._group_figures(g))
        return out

    def _group_figures(self, g: Group) -> dict[str, Any]:
        lanes = self.timer.lanes_of(g.gid)
        ready = sum(ln.ready.count for ln in lanes)
        on_disk = sum(ln.on_disk for ln in lanes if ln.spilled)
        retrying = self.ledger.retrying_of(g.gid)
        return {
            "subject": g.subject,
            "group": g.name,
            # due, not delivered (again) yet: Stats' backlog
            "backlog": ready + on_disk + retrying,
            "ready": ready,
            "spilled": any(ln.spilled for ln in lanes),
            "on_disk": on_disk,
            "retrying": retrying,
            "in_flight": self.ledger.count_of(g.gid),
            "since": g.since,
            "created_ms": g.created_ms,
        }

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
            self.dead_letters.add(seq, item, now)
            self.wake()
            return
        backoff = min(self.cfg.max_backoff_ms, self.cfg.retry_backoff_ms * (2 ** (attempt - 1)))
        self.ledger.retry_at(now + backoff, seq, item)

    # --- reading back what spilled lanes keep on disk ----------------------------------------------

    def _reread(self) -> bool:
        """One step of a spilled lane's pass (``server/readback.py``); True if it did work.
        The chunk and the dispatch log are read outside the lock."""
        rb = self.readback
        if rb.cancelled:  # messages cancelled on a spilled lane's disk: their records first
            with self.lock:
                c = rb.cancelled.popleft() if rb.cancelled else None
                if c is not None and self.timer.spill_floor() > c.st.bucket:
                    c = None  # no spilled lane counts anything of that bucket any more
            if c is not None:
                rb.read_cancelled(c)  # outside the lock
                with self.lock:
                    rb.apply_cancelled(c)
                return True
        sink = self.sink
        if sink is None:
            return False
        with self.lock:
            step = self.readback.next_step(sink.credit)
        if isinstance(step, bool):
            return step
        self.readback.read(step)  # the disk reads, outside the lock
        with self.lock:
            if self.readback.apply(step):
                self.wake()
        return True

    # --- dispatch ---------------------------------------------------------------------------------

    def _dispatch(self, now: int) -> bool:
        """Hand ready entries to the sink (``server/dispatcher.py``); True if it stopped at
        the round limit with deliveries still flowing (the loop then goes round again
        without sleeping: no ack or credit notification may come to wake it).

        Each round takes entries from the lanes under the lock, reads their records back
        outside it (the event loop, Cancel and Get never wait for that read), then under
        the lock again applies what was posted meanwhile (a Cancel's claims among it),
        drops what was claimed, cancelled or deleted and registers the rest as in flight
        before handing the batches over.
        """
        sink = self.sink
        if sink is None:
            return False
        held = self._held
        if held is not None:
            if not held():
                return False
            self._held = None
        d = self.dispatcher
        for _round in range(64):  # then let the loop flush dispatch records and fire new entries
            with self.lock:
                if not self.timer.rr or self._stop:
                    return False
                self._drain()
                taken = d.take(sink.credit)
            if not taken:
                return False
            d.read(taken)  # the disk reads, outside the lock
            with self.lock:
                self._drain()
                batches = d.hand_out(taken, now)
            for out in batches:
                sink.deliver(out.subject, out.group, out)
        return True

    # --- the queue: work handed over by other threads -----------------------------------------------

    def post_ack(self, ack_ids: list[str], gid: int | None = None) -> None:
        """Acknowledge deliveries without waiting (the event loop): the ids are queued for
        the scheduler thread, which wakes for them; no lock is taken here."""
        self._inbox.append(("ack", ack_ids, gid))
        self.wake()

    def post_release(self, ack_ids: list[str], gid: int | None = None) -> None:
        """``release`` without waiting (the event loop): queued like ``post_ack``."""
        self._inbox.append(("release", ack_ids, gid))
        self.wake()

    def post(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the scheduler thread, with the scheduling state's lock held, in
        order with everything posted before; not waited for (no lock taken here). When the
        scheduler thread is not running (stopped, or a test driving ``run_once``), the
        poster applies the queue itself, under the lock."""
        self._inbox.append(("call", fn, None))
        self.wake()
        if not self._serving():
            with self.lock:
                self._drain()

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` in order with everything posted before, under the lock, and return its
        result (or raise its exception): a change that needs an answer, from a thread that
        may wait (never the event loop's hot paths nor the scheduler thread itself).

        The request goes on the queue. If the lock is free at that moment, the caller
        applies the queue itself (a non-blocking try: it never waits for the lock); else it
        wakes the scheduler thread and waits on a future, which that thread (or the next
        holder of the lock that applies the queue) answers. Always waiting for the
        scheduler thread cost two thread switches per call: in process, a one-target
        Cancel from 16 tasks 236-281 -> 432-513 us of CPU. When the scheduler thread is not
        running (stopped, or a test driving ``run_once``) the caller applies the queue
        itself, under the lock."""
        fut: Future[T] = Future()
        self._inbox.append(("call", fn, fut))
        if self.lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self.lock.release()
        else:
            self._wakeup.set()
        while not fut.done():
            if not self._serving():
                with self.lock:
                    self._drain()
            wait_for_future([fut], timeout=0.05)
        return fut.result()

    def queued(self) -> int:
        """Work posted and not yet applied (no lock: a deque's length)."""
        return len(self._inbox)

    def _serving(self) -> bool:
        """The scheduler thread runs and will apply the queue (read without the lock: a
        stop() seen late only means one more wait of 50 ms)."""
        t = self._thread
        return t is not None and t.is_alive() and not self._stop

    def _drain(self) -> None:
        """Apply what was posted so far, in order (lock held)."""
        inbox = self._inbox
        while inbox:
            op, arg, extra = inbox.popleft()
            if op == "ack":
                self._ack(arg, extra)
            elif op == "release":
                self._release(arg, extra)
            elif extra is None:
                arg()
            else:
                try:
                    extra.set_result(arg())
                except BaseException as err:  # the caller raises it
                    extra.set_exception(err)

    # --- acknowledgements ---------------------------------------------------------------------------

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
        for acked in self.ledger.take_acked_ids(ack_ids, gid):
            fl, got = acked.batch, acked.keys
            offs, dues, attempts, mids = fl.columns(got, acked.start)
            at = [fl.at] * len(got)
            self._record_many(fl.bucket, got, dues, at, offs, attempts, mids, records.Outcome.DELIVERED, now, fl.gid)
            n += len(got)
        if n:
            self.acked += n
            self.wake()
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
                self.dead_letters.add(seq, item, now)
            else:
                self.timer.requeue(item)
        if released:
            self.wake()
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

    def _write_dead_letters(self) -> None:
        """Write the dead-letter copies decided so far (``server/dead_letters.py``): taken
        under the lock, read and submitted outside it."""
        with self.lock:
            work = self.dead_letters.take()
        if work:
            self.dead_letters.write(work)

    def _close_dead_lettered(self, seq: int, item: Item, now: int, mid: bytes) -> bool:
        """The dead-letter copy of ``seq`` is durable: close the original for its group
        (lock held, scheduler thread); False if stopped meanwhile (the copy is written, the
        original not closed: it is dead-lettered again after a restart, at least once)."""
        if not self._accepting:
            self.acks_after_stop += 1
            return False
        _seq, off, bucket, due, attempt, _subj, gid = item
        self._record_many(
            bucket, [seq], [due], [now], [off], [attempt - 1], [mid], records.Outcome.DEAD_LETTERED, self.clock(), gid
        )
        return True

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

    # claim_cancels answers, one per sequence (server/claims.py)
    CLAIMED = claims.CLAIMED
    CLAIM_CANCELLING = claims.CLAIM_CANCELLING  # another Cancel claimed it already (or an earlier entry)
    CLAIM_OUT = claims.CLAIM_OUT  # handed out and not acknowledged, or its dead-letter copy is being written
    CLAIM_WRITTEN = claims.CLAIM_WRITTEN  # another Cancel claimed it, its tombstone is durable

    def claim_cancels(self, sequences: list[int], buckets: Iterable[int] | None = None) -> list[int]:
        """Claim each sequence for a Cancel: one of CLAIMED, CLAIM_CANCELLING, CLAIM_WRITTEN,
        CLAIM_OUT each.

        The claims go on the scheduler's queue as one request (``call``) and the caller (a
        worker thread) gets the answer: they are applied under the lock in order with the
        acks posted before (an ack before this Cancel counts), never inside a dispatch
        round's hand-out, so a claimed message is never handed out afterwards. It stays
        claimed until its tombstone has passed the iterate service (``on_written``) or
        ``release_cancels``.

        ``buckets``: the buckets of the messages claimed (their due minutes), when the caller
        knows them: only the deliveries in flight of those buckets are then looked at, not
        everything in flight."""
        return self.call(lambda: self._claim(sequences, buckets))

    def claim_cancels_now(self, sequences: list[int], buckets: Iterable[int] | None = None) -> list[int] | None:
        """``claim_cancels`` for the event loop (``Engine._claims``): applied at once if the
        lock is free, after what was posted before (as ``call`` applies it), else None and
        nothing claimed (the caller claims from a worker thread). Never waits for the lock."""
        if not self.lock.acquire(blocking=False):
            return None
        try:
            self._drain()
            return self._claim(sequences, buckets)
        finally:
            self.lock.release()

    def _claim(self, sequences: list[int], buckets: Iterable[int] | None = None) -> list[int]:
        ledger = self.ledger
        out = ledger.in_flight_maps() if buckets is None else ledger.in_flight_of(buckets, len(sequences))
        return self.claims.claim(sequences, [self.dead_letters.writing, *out])

    def release_cancels(self, sequences: list[int]) -> None:
        """Give back claims whose tombstones will not be written (or were not needed): the
        messages become deliverable again. Posted, not waited for (the event loop releases
        the claims of a Cancel whose caller went away); whatever asks about claims later
        (``claim_cancels``, ``cancel_claimed``) is answered after it."""
        self.post(lambda: self._release_claims(sequences))

    def _release_claims(self, sequences: list[int]) -> None:
        """Entries set aside while claimed go back to their lanes (still held by their
        buckets; a deleted group's are dropped with it)."""
        for item in self.claims.release(sequences):
            self.timer.requeue(item)
        self.wake()

    def claims_written(self, sequences: list[int]) -> None:
        """The tombstones of these claimed sequences are durable (their Cancel's append
        returned): another claim of one answers CLAIM_WRITTEN from then on. Queued without
        waking the scheduler thread unless a watch waits (one wake-up a Cancel would cost a
        thread switch): whatever asks about claims applies the queue first (``call``,
        ``claim_cancels_now``). A watch made meanwhile that misses this ends no later than
        the claim's settling (``on_written``)."""
        fn = lambda: self.claims.written(sequences)  # noqa: E731
        if self.claims.watched:
            self.post(fn)
        else:
            self._inbox.append(("call", fn, None))

    def watch_claims(self, sequences: list[int], callback: Callable[[], None]) -> claims.Watch:
        """Have ``callback`` run (on the thread applying the queue, lock held: it must not
        block) once none of ``sequences`` is claimed any more with its tombstone not known
        durable: its tombstone written (``claims_written``) or passed (``on_written``), or
        its claim released. Posted, not waited for, in order with
        what was posted before, so a claim answered CLAIM_CANCELLING before this is either
        still held when it is applied, or ended and the callback runs at once. The returned
        watch is what ``unwatch_claims`` forgets."""
        watch = claims.Watch(sequences, callback)
        self.post(lambda: self.claims.watch(watch))
        return watch

    def unwatch_claims(self, watch: claims.Watch) -> None:
        """Forget a watch whose waiter gave up (posted)."""
        self.post(lambda: self.claims.unwatch(watch))

    def cancel_claimed(self, seq: int) -> bool:
        """Whether a Cancel claimed ``seq`` and its tombstone has not passed yet. Asked by
        Get, also on the event loop (``Engine.get_now``), so not on the queue: a short hold
        of the lock (never held across disk I/O), after applying what was posted before (a
        release among it), as ``dispatch_view`` does."""
        with self.lock:
            self._drain()
            return self.claims.holds(seq)

    @property
    def settles(self) -> int:
        """How many times claims were settled (tombstones passed the iterate service), read
        without the lock: a Get that looked at a message while a claim of it may have
        settled (neither the tombstone seen nor the claim held any more) looks again."""
        return self.claims.settled_total

    def cancel_written(self, seq: int) -> bool:
        """Whether a Cancel (or Reschedule) claimed ``seq`` and its tombstone is durable
        (``claims_written``) but has not passed yet: what Get answers CANCELLED for a
        pending message. A claim whose write is under way does not count: that write may
        still fail and give the claim back, and a Get that said CANCELLED would then be
        followed by a delivery (issue 13 item 6). As ``cancel_claimed``: a short hold of
        the lock after applying what was posted before (the news of the write among it)."""
        with self.lock:
            self._drain()
            return self.claims.holds_written(seq)

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
            return pending, size, self.ledger.is_in_flight(seq, bucket)

    def dispatch_buffered(self, buckets: list[int]) -> list[bytes]:
        """``dispatch_view``'s first part for several buckets under one hold of the lock (a
        batch of retried sends can touch a minute per message): each bucket's DISPATCH
        frames not yet in its file. Every close made before is in them or in the file
        (looked at after this), or both."""
        with self.lock:
            self._drain()
            pending = self.writer.pending
            return [pending(bucket) for bucket in buckets]

    def known_tombstones(self, bucket: int) -> set[int] | None:
        """Every cancelled sequence of ``bucket`` if it is loaded with its tombstones all
        known (the set itself: read it, never change it); None otherwise."""
        st = self.book.get(bucket)
        return st.cancelled if st is not None and st.tombstones_known else None

    # --- introspection ------------------------------------------------------------------------------

    @property
    def dead_lettered(self) -> int:
        return self.dead_letters.dead_lettered

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
                "retrying": self.ledger.retrying_count(),
                "loaded_buckets": len(self.book.loaded),
                "done_before": self.book.done_before,
                "reopened": len(self.book.reopened),
                "dispatched": self.dispatcher.dispatched,
                "acked": self.acked,
                "redeliveries": self.redeliveries,
                "dead_lettered": self.dead_letters.dead_lettered,
                "cancel_skipped": self.dispatcher.cancel_skipped,
                "corrupt_skipped": self.loader.corrupt_skipped,
                "load_blocked": self.loader.blocked,
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
