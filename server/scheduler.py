"""The scheduler: loader, timer and dispatcher, on one thread.

- The *loader* brings each due bucket in ahead of time (``load_ahead_ms``): it reads the
  bucket's dispatch log (what was already delivered), then streams its schedule segment
  in chunks into the timer wheel, skipping delivered and cancelled messages. Loading
  pauses while the in-memory index holds ``max_loaded`` entries, so a hot bucket with
  millions of messages is streamed in as it drains.
- Records the iterate service writes into a bucket that is already loaded go straight
  into the wheel (``on_records``); one written into a bucket already finished reopens it.
- The *timer* moves due entries from the wheel to per-subject ready queues.
- The *dispatcher* takes ready entries round-robin over subjects, within the sink's
  credit and the rate limit, reads the full records back (one read per run of nearby
  records) and hands batches of deliveries to the sink. An acknowledged delivery gets a
  DISPATCH record in its bucket's dispatch log; an unacknowledged one is offered again
  after the ack timeout plus a backoff, and after ``max_attempts`` it is moved to the
  dead-letter subject.
- A bucket is *done* once it is loaded completely, its time has passed and every message
  in it is delivered, dead-lettered or cancelled, with the dispatch records on disk.
  ``done_before`` (every bucket below it is done) and the set of reopened buckets are
  saved with the iterate checkpoint, and tell a restart which buckets to load again.
"""

from __future__ import annotations

import bisect
import collections
import heapq
import itertools
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from qdelay.errors import CorruptRecord, InvariantViolation, QdelayError
from qdelay.segments import bucket_log, framing, native, records
from qdelay.segments.framing import Frame, RecordKind
from qdelay.segments.naming import MS_PER_MINUTE, bucket_of
from qdelay.segments.reader import read_columns, read_messages_py
from qdelay.segments.segment import CorruptionPolicy, Segment, disk_full
from qdelay.server.bucket_log import BucketLog
from qdelay.server.groups import BEGINNING, Group, GroupTable
from qdelay.server.iterate import Scheduled
from qdelay.server.lookup import read_frames
from qdelay.server.wheel import Entries, TimerWheel

log = logging.getLogger("qdelay.scheduler")

DEAD_LETTER_HEADER = "qdelay-dead-letter-of"


@dataclass(slots=True)
class Delivery:
    ack_id: str
    message_id: str
    subject: str
    payload: bytes
    headers: dict[str, str]
    deliver_at_ms: int
    dispatched_at_ms: int
    attempt: int


class Deliveries:
    """A batch of deliveries of one subject, as parallel lists (one entry per delivery).

    A burst hands out hundreds of thousands of deliveries a second; one Python object per
    delivery was a large share of that cost, so the dispatcher fills columns instead and a
    sink reads them directly (``ack_ids``, ``payloads`` ...). Iterating, indexing and
    ``len`` still behave like a list of :class:`Delivery` (built on demand), and a slice is
    a ``Deliveries`` again. ``headers`` holds None for a delivery without headers.
    ``message_id_bytes`` are the ids as stored (ASCII); ``message_ids`` decodes them on
    first use (a sink that encodes protobuf itself needs only the bytes).
    """

    __slots__ = (
        "subject",
        "group",
        "ack_ids",
        "message_id_bytes",
        "_message_ids",
        "payloads",
        "headers",
        "deliver_at_ms",
        "dispatched_at_ms",
        "attempts",
    )

    def __init__(
        self,
        subject: str,
        ack_ids: list[str],
        message_id_bytes: list[bytes],
        payloads: list[bytes],
        headers: list[dict[str, str] | None],
        deliver_at_ms: list[int],
        dispatched_at_ms: int,
        attempts: list[int],
        group: str = records.DEFAULT_GROUP,
    ) -> None:
        self.subject = subject
        self.group = group  # the consumer group these deliveries are for
        self.ack_ids = ack_ids
        self.message_id_bytes = message_id_bytes
        self._message_ids: list[str] | None = None
        self.payloads = payloads
        self.headers = headers
        self.deliver_at_ms = deliver_at_ms
        self.dispatched_at_ms = dispatched_at_ms  # one hand-over time for the whole batch
        self.attempts = attempts

    def __len__(self) -> int:
        return len(self.ack_ids)

    @property
    def message_ids(self) -> list[str]:
        if self._message_ids is None:
            self._message_ids = [m.decode() for m in self.message_id_bytes]
        return self._message_ids

    def _one(self, i: int) -> Delivery:
        return Delivery(
            self.ack_ids[i],
            self.message_ids[i],
            self.subject,
            self.payloads[i],
            self.headers[i] or {},
            self.deliver_at_ms[i],
            self.dispatched_at_ms,
            self.attempts[i],
        )

    def __iter__(self):
        return map(self._one, range(len(self.ack_ids)))

    def __getitem__(self, key: int | slice) -> Delivery | Deliveries:
        if isinstance(key, slice):
            return Deliveries(
                self.subject,
                self.ack_ids[key],
                self.message_id_bytes[key],
                self.payloads[key],
                self.headers[key],
                self.deliver_at_ms[key],
                self.dispatched_at_ms,
                self.attempts[key],
                self.group,
            )
        return self._one(range(len(self.ack_ids))[key])

    def __repr__(self) -> str:
        return f"Deliveries({self.subject!r}, {len(self)} deliveries)"


class DeliverySink(Protocol):
    def credit(self, subject: str, group: str) -> int:
        """How many more deliveries of ``subject`` the consumers of ``group`` accept now
        (cheap, thread-safe)."""

    def deliver(self, subject: str, group: str, deliveries: Deliveries) -> None:
        """Take a batch; called on the scheduler thread, so it must not block."""


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
    dead_letter_prefix: str = "DLQ."
    max_loaded: int = 8_000_000  # index entries in memory (wheel + ready), 32 bytes each
    # entries one group of one subject holds ready in memory; beyond it the rest wait on disk
    group_max_ready: int = 100_000
    implicit_group: str = ""  # a subject with no group gets this one when a message is due ("" none)
    load_chunk_bytes: int = 1024 * 1024
    dispatch_quantum: int = 512  # per subject per round: fairness across subjects
    dispatch_flush_ms: int = 5
    corruption: CorruptionPolicy = CorruptionPolicy.FAIL


class _Bucket:
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
    )

    def __init__(self, bucket: int, seg: Segment, cursor: int = 0, complete: bool = False) -> None:
        self.bucket = bucket
        self.seg = seg
        self.cursor = cursor  # schedule-segment bytes already indexed
        self.complete = complete  # the loader reached the end; new records arrive live
        self.unfired = 0  # indexed messages still in the timer wheel
        # group id -> this bucket's entries held in memory for that group (ready, retrying
        # or in flight); what a group holds on disk only is covered by its lane's spill
        self.owed: dict[int, int] = {}
        self.cancelled: set[int] = set()  # sequences cancelled in this bucket
        # group name -> sequences its DISPATCH records close, and those closed by records
        # already counted in Scheduler.closed_retired (only while loading)
        self.closed: dict[str, set[int]] | None = None
        self.counted: dict[str, set[int]] | None = None
        # group name -> sequences it closed before they were loaded, while some other group
        # had not (fan-out across a restart): the timer skips them for that group
        self.partial: dict[str, set[int]] = {}
        self.done = False
        self.dispatch_ready = False  # the dispatch log was checked and read
        # every tombstone of the segment is in ``cancelled`` (so a loaded entry may fire)
        self.tombstones_known = complete
        # messages of this bucket closed for their subject's first group (DISPATCH record)
        # and not yet counted in Scheduler.closed_retired: read back from the dispatch log
        # when the bucket is loaded, then one more per record written
        self.nclosed = 0

    def owe(self, gid: int, n: int) -> None:
        self.owed[gid] = self.owed.get(gid, 0) + n

    def outstanding(self) -> int:
        return self.unfired + sum(self.owed.values())


class _Ready:
    """Entries of one subject waiting for consumer credit: packed chunks, plus retries."""

    __slots__ = ("chunks", "retries", "count")

    def __init__(self) -> None:
        self.chunks: collections.deque[list] = collections.deque()  # [Entries, position]
        self.retries: collections.deque[tuple] = collections.deque()  # (seq, off, bucket, due, attempt)
        self.count = 0

    def take(self, n: int) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
        """Up to n items, retries first, as columns (seq, off, bucket, due, attempt)."""
        seqs: list[int] = []
        offs: list[int] = []
        buckets: list[int] = []
        dues: list[int] = []
        attempts: list[int] = []
        while self.retries and n > 0:
            seq, off, bucket, due, attempt = self.retries.popleft()
            seqs.append(seq)
            offs.append(off)
            buckets.append(bucket)
            dues.append(due)
            attempts.append(attempt)
            n -= 1
        while self.chunks and n > 0:
            chunk = self.chunks[0]
            e, pos = chunk
            end = min(len(e), pos + n)
            seqs += e.seq[pos:end].tolist()
            offs += e.off[pos:end].tolist()
            buckets += e.bucket[pos:end].tolist()
            dues += e.due[pos:end].tolist()
            attempts += [1] * (end - pos)
            n -= end - pos
            if end >= len(e):
                self.chunks.popleft()
            else:
                chunk[1] = end
        self.count -= len(seqs)
        return seqs, offs, buckets, dues, attempts

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


class _Pass:
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


class _Lane:
    """What one group of one subject has due: entries ready in memory, up to
    ``group_max_ready``. A lane over its bound *spills*: its queued entries are forgotten
    (they stay in the schedule segments) and so is whatever becomes due for it meanwhile;
    ``drop_from`` is the lowest bucket forgotten since the last pass began. When the lane
    has room again, passes read its entries back from disk (``_Pass``) until one ends with
    nothing forgotten during it; then the lane takes entries from the timer again.

    This is what keeps one group without consumers (or with a slow one) from filling the
    scheduler's memory and stopping everyone else: it holds at most its bound.
    """

    __slots__ = ("sid", "gid", "ready", "spilled", "drop_from", "walk", "recent")

    def __init__(self, sid: int, gid: int) -> None:
        self.sid = sid
        self.gid = gid
        self.ready = _Ready()
        self.spilled = False
        self.drop_from: int | None = None
        self.walk: _Pass | None = None
        # sequences read back by the last pass step: entries still in the wheel with the
        # same sequences fire once more at most, and are skipped then
        self.recent: set[int] | None = None

    def dropped(self, buckets: np.ndarray) -> None:
        if len(buckets):
            low = int(buckets.min())
            self.drop_from = low if self.drop_from is None else min(self.drop_from, low)


def _dispatch_frames(seg: Segment, start: int, stop: int) -> Iterator[Frame]:
    """The DISPATCH frames of a dispatch segment in [start, stop); a corrupt record is
    stepped over (at worst its message is delivered again, as at-least-once allows)."""
    pos = start
    while pos < stop:
        try:
            frames, pos = read_frames(seg, pos, stop)
        except CorruptRecord as err:
            rest = seg.read(err.offset, stop - err.offset)
            found = framing.find_next_frame(rest, 1)
            pos = err.offset + found if found is not None else stop
            continue
        yield from (f for f in frames if f.kind == RecordKind.DISPATCH)


_ACK_IDS = re.compile(r"(?:[0-9]{1,18}\.[0-9]{1,9} )*")  # "seq.attempt" ids, each followed by a space


def _ack_sequences(ack_ids: list[str]) -> list[int]:
    """The sequence part of each ack id ("seq.attempt"; a bare "seq" is accepted too);
    ids that are not numbers are skipped. Well-formed ids (all of them, normally) are
    parsed in one numpy call: per id, ``int(id.partition(".")[0])`` was a tenth of the
    ack path's cost."""
    joined = " ".join(ack_ids) + " "
    if _ACK_IDS.fullmatch(joined):  # at most 18 digits: no int64 overflow
        return np.fromstring(joined.replace(".", " "), dtype=np.int64, sep=" ")[::2].tolist()
    seqs = []
    for ack_id in ack_ids:
        try:
            seqs.append(int(ack_id.partition(".")[0]))
        except ValueError:
            continue
    return seqs


class _Flight:
    """Deliveries of one bucket handed out together, still awaiting their acks.

    ``Scheduler.in_flight[gid]`` maps each sequence to its flight: one object per batch
    rather than a tuple per delivery, and an ack request that returns a whole batch in
    order (the usual case) reads the columns as they are. A sequence belongs to the
    flight ``in_flight`` maps it to; a redelivery is a new flight, so an older flight
    still listing the sequence no longer owns it.
    """

    __slots__ = ("bucket", "subj", "gid", "at", "seqs", "offs", "dues", "attempts", "mids", "_pos")

    def __init__(
        self,
        bucket: int,
        subj: int,
        gid: int,
        at: int,
        seqs: list[int],
        offs: list[int],
        dues: list[int],
        attempts: list[int],
        mids: list[bytes],
    ) -> None:
        self.bucket = bucket
        self.subj = subj
        self.gid = gid
        self.at = at  # dispatched at (ms)
        self.seqs = seqs
        self.offs = offs
        self.dues = dues
        self.attempts = attempts
        self.mids = mids
        self._pos: dict[int, int] | None = None  # seq -> position, built when first needed

    def index(self, seq: int) -> int:
        if self._pos is None:
            self._pos = dict(zip(self.seqs, range(len(self.seqs))))
        return self._pos[seq]

    def attempt_of(self, seq: int) -> int:
        return self.attempts[self.index(seq)]

    def item(self, seq: int) -> tuple:
        """(seq, off, bucket, due, attempt + 1, subj, gid): the entry for its next attempt."""
        i = self.index(seq)
        return (seq, self.offs[i], self.bucket, self.dues[i], self.attempts[i] + 1, self.subj, self.gid)

    def columns(self, seqs: list[int]) -> tuple[list, list, list, list]:
        """(offs, dues, attempts, mids) of ``seqs``, all of this flight."""
        if seqs == self.seqs:
            return self.offs, self.dues, self.attempts, self.mids
        i = self.index(seqs[0])
        j = i + len(seqs)
        if self.seqs[i:j] == seqs:  # a stretch of the batch, as a consumer's response held it
            return self.offs[i:j], self.dues[i:j], self.attempts[i:j], self.mids[i:j]
        idx = list(map(self._pos.__getitem__, seqs))
        return (
            list(map(self.offs.__getitem__, idx)),
            list(map(self.dues.__getitem__, idx)),
            list(map(self.attempts.__getitem__, idx)),
            list(map(self.mids.__getitem__, idx)),
        )


class Scheduler:
    def __init__(
        self,
        schedule: BucketLog,
        dispatch: BucketLog,
        config: SchedulerConfig,
        *,
        clock: Callable[[], int],
        done_before: int,
        reopened: set[int],
        dead_letter: Callable[[records.Message, int, str, int, Callable[[Exception | None], None]], None] | None = None,
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
        self.lock = threading.RLock()  # apply_group -> add_group re-enter it
        self._wake = threading.Condition(self.lock)
        self.wheel = TimerWheel(config.tick_ms)
        self.buckets: dict[int, _Bucket] = {}
        self.done_before = done_before
        self.reopened = set(reopened)
        # Closed messages are counted from durable state, so that ``pending`` survives a
        # crash: those of buckets already forgotten (done, dispatch records fsynced) here,
        # saved with done_before in the same checkpoint; those of loaded buckets per bucket
        # (_Bucket.nclosed, recounted from the dispatch log on each load). A reopened bucket
        # was counted up to its dispatch log's size when it was reopened (reopened_at).
        self.closed_retired = closed_retired
        self.reopened_at: dict[int, int] = dict(reopened_at or {})
        self.dead_lettering: set[int] = set()  # dead-letter copy being written; cancel refused
        self._horizon = done_before - config.scale_minutes  # highest bucket considered for loading
        self._subjects: list[str] = []
        self._subject_ids: dict[bytes, int] = {}
        self.groups = groups if groups is not None else GroupTable()
        # messages up to this sequence were written before groups existed: a subject of
        # theirs without a group gets the group "default", which inherits their DISPATCH
        # records (docs/formats.md, upgrade)
        self.legacy_upto = legacy_upto
        self._targets_cache: dict[int, list[Group]] = {}
        self._targets_version = -1
        self._lanes: dict[tuple[int, int], _Lane] = {}  # (subject id, group id) -> lane
        # subject id -> lowest bucket with entries that became due while it had no group
        self._kept: dict[int, int] = {}
        self._ready_total = 0
        self._rr: collections.deque[_Lane] = collections.deque()  # lanes with ready work
        self._spilled: set[_Lane] = set()
        self._partial_any = False  # some loaded bucket has entries closed for some groups only
        self._fired_to = 0  # every wheel entry due at or before this has fired
        # group id -> seq -> the batch it was handed out in
        self.in_flight: dict[int, dict[int, _Flight]] = {}
        # (ack deadline, flights) per dispatched batch, in deadline order
        self._deadlines: collections.deque[tuple[int, list[_Flight]]] = collections.deque()
        self._retry_heap: list[tuple[int, int, tuple]] = []
        self._dispatch_buf: dict[int, bytearray] = {}
        self._writing: dict[int, bytearray] = {}  # DISPATCH frames being appended to their files
        self._dispatch_first = 0.0
        self._write_gen: dict[int, int] = {}  # buckets with DISPATCH records written, not fsynced
        self._sync_wanted = threading.Event()
        self._sync_stop = False
        self._syncer: threading.Thread | None = None
        self.cancelling: set[int] = set()  # cancel accepted, tombstone not yet through iterate
        self.sink: DeliverySink | None = None
        self._tokens = 0.0
        self._tokens_at = time.monotonic()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.load_blocked = False
        self._sleeping_until: float | None = None  # when the timer thread, waiting, wakes by itself
        self._last_done_check = 0
        # counters
        self.dispatched = 0
        self.acked = 0
        self.redeliveries = 0
        self.dead_lettered = 0
        self.cancel_skipped = 0
        self.corrupt_skipped = 0
        self.dispatch_disk_full_total = 0  # DISPATCH writes that found the disk full (tried again later)
        self._dispatch_waiting_space = False  # the last DISPATCH write found the disk full
        self.on_dispatch: Callable[[list[int]], None] | None = None  # lateness observer (ms)

    # --- control --------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the timer and sync threads; also after a stop() (a master fenced and then
        elected again in one process)."""
        with self.lock:
            self._stop = False
        self._sync_stop = False
        self._thread = threading.Thread(target=self._run, name="qdelay-scheduler", daemon=True)
        self._thread.start()
        self._syncer = threading.Thread(target=self._sync_loop, name="qdelay-dispatch-sync", daemon=True)
        self._syncer.start()

    def stop(self) -> None:
        with self.lock:
            self._stop = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._syncer is not None:
            self._sync_stop = True
            self._sync_wanted.set()
            self._syncer.join()
            self._syncer = None
        self._flush_dispatch(force=True)
        self._sync_dispatch()
        if self._dispatch_buf:
            log.warning(
                "no space for the last DISPATCH records: their messages are delivered again after a restart",
                extra={"bytes": sum(map(len, self._dispatch_buf.values()))},
            )

    def wake(self) -> None:
        with self.lock:
            self._wake.notify()

    def set_sink(self, sink: DeliverySink | None) -> None:
        with self.lock:
            self.sink = sink
            self._wake.notify()

    # --- the loop -------------------------------------------------------------------------------

    def run_once(self, now: int) -> None:
        """One pass at time ``now``, loading until done: for tests with a simulated clock
        (the scheduler thread must not be running)."""
        while self._load_step(now):
            pass
        with self.lock:
            self._fire(now)
            self._expire(now)
        self._dispatch(now)
        while self._reread():
            self._dispatch(now)
        self._flush_dispatch(force=True)
        self._sync_dispatch()
        self._last_done_check = 0
        self._check_done(now)

    def _run(self) -> None:
        try:
            while True:
                with self.lock:
                    if self._stop:
                        return
                now = self.clock()
                loading = self._load_step(now)
                with self.lock:
                    self._fire(now)
                    self._expire(now)
                more = self._dispatch(now)
                more = self._reread() or more
                self._flush_dispatch()
                self._check_done(now)
                with self.lock:
                    if self._stop:
                        return
                    now = self.clock()
                    timeout = self._sleep_for(now, loading or more)
                    if timeout > 0:
                        self._sleeping_until = now + timeout * 1000  # read by on_records
                        self._wake.wait(timeout)
                        self._sleeping_until = None
        except BaseException as err:
            self.error = err
            log.exception("scheduler stopped")

    def _sleep_for(self, now: int, loading: bool) -> float:
        if loading:
            return 0.0
        t = now + 100  # the loader looks for new buckets at least every 100 ms
        nf = self.wheel.next_fire()
        if nf is not None:
            t = min(t, nf)
        if self._deadlines:
            t = min(t, self._deadlines[0][0])
        if self._retry_heap:
            t = min(t, self._retry_heap[0][0])
        if self._dispatch_buf:
            t = min(t, now + self.cfg.dispatch_flush_ms)
        if self._ready_total and self.sink is not None and self.cfg.dispatch_rate > 0:
            t = min(t, now + 5)
        return max(0.0, (t - now) / 1000.0)

    # --- subjects ---------------------------------------------------------------------------------

    def subject_id(self, subject: bytes) -> int:
        sid = self._subject_ids.get(subject)
        if sid is None:
            sid = self._subject_ids[subject] = len(self._subjects)
            self._subjects.append(subject.decode())
        return sid

    # --- loading ----------------------------------------------------------------------------------

    def _load_step(self, now: int) -> bool:
        """Bring buckets into the wheel; return True if more loading is waiting."""
        scale = self.cfg.scale_minutes
        horizon = bucket_of(now + self.cfg.load_ahead_ms, scale)
        with self.lock:
            if horizon > self._horizon:
                self._open_buckets(horizon)
            pending = [st for st in self.buckets.values() if not st.complete]
            if not pending:
                self.load_blocked = False
                return False
            if len(self.wheel) + self._ready_total >= self.cfg.max_loaded:
                self._relieve()
            if len(self.wheel) + self._ready_total >= self.cfg.max_loaded:
                if not self.load_blocked:
                    log.warning(
                        "loading paused: in-memory index is full",
                        extra={"entries": len(self.wheel) + self._ready_total, "max": self.cfg.max_loaded},
                    )
                self.load_blocked = True
                return False
            self.load_blocked = False
            st = min(pending, key=lambda s: s.bucket)
            need_closed = not st.dispatch_ready
            start, stop = st.cursor, st.seg.size
        if need_closed:
            closed, counted = self._read_closed(st.bucket, self.reopened_at.get(st.bucket, 0))
            # A bucket loaded in several chunks fires its first entries before the loader
            # reaches the tombstones behind them: collect those tombstones first.
            tombstones = self._read_tombstones(st, start, stop) if stop - start > self.cfg.load_chunk_bytes else set()
            with self.lock:
                st.closed = closed
                st.counted = counted
                st.cancelled |= tombstones
                st.dispatch_ready = True
                st.tombstones_known = True
        frames, nxt = self._read_chunk(st, start, stop) if start < stop else ([], start)
        entries = self._index(st, frames)
        with self.lock:
            if st.cursor != start:  # only this thread advances a loading cursor
                raise InvariantViolation(f"bucket {st.bucket} cursor moved during load")
            if entries is not None:
                self.wheel.add_many(entries)
            st.cursor = nxt
            if st.cursor >= st.seg.size:
                st.complete = True
                st.closed = st.counted = None
                self._maybe_done(st, now)
        return True

    def _read_chunk(self, st: _Bucket, start: int, stop: int) -> tuple[list[Frame], int]:
        """One chunk of a schedule segment; a corrupt record is reported and stepped over.

        The message in a corrupt record cannot be delivered (it is never served as data);
        the audit job reports it as lost. Everything after it still is.
        """
        try:
            return read_frames(st.seg, start, stop, self.cfg.load_chunk_bytes)
        except CorruptRecord as err:
            log.error(
                "corrupt schedule record skipped", extra={"path": err.path, "offset": err.offset, "reason": err.reason}
            )
            self.corrupt_skipped += 1
            frames: list[Frame] = []
            pos = start
            while pos < err.offset:
                more, pos = read_frames(st.seg, pos, err.offset, self.cfg.load_chunk_bytes)
                frames.extend(more)
            rest = st.seg.read(err.offset, stop - err.offset)
            found = framing.find_next_frame(rest, 1)
            return frames, err.offset + found if found is not None else stop

    def _read_tombstones(self, st: _Bucket, start: int, stop: int) -> set[int]:
        found: set[int] = set()
        pos = start
        while pos < stop:
            frames, pos = self._read_chunk(st, pos, stop)
            for f in frames:
                if f.kind == RecordKind.CANCEL:
                    found.add(records.decode_cancel(f.body).target_sequence)
        return found

    def _open_buckets(self, horizon: int) -> None:
        """Give every unfinished bucket up to ``horizon`` a state for the loader (lock held)."""
        for b in self.schedule.buckets():
            if b > horizon:
                break
            if b not in self.buckets and (b >= self.done_before or b in self.reopened):
                self.buckets[b] = _Bucket(b, self.schedule.get(b))
        for b in self.reopened:  # reopened buckets are loaded whatever their time
            if b not in self.buckets and self.schedule.get(b) is not None:
                self.buckets[b] = _Bucket(b, self.schedule.get(b))
        self._horizon = max(self._horizon, horizon)

    def _mark_reopened(self, bucket: int) -> None:
        """A finished bucket comes back (lock held): the closes in its dispatch log so far are
        in ``closed_retired``; a reload after a restart counts only those after this size."""
        if bucket not in self.reopened_at:
            seg = self.dispatch.get(bucket)
            self.reopened_at[bucket] = seg.size if seg is not None else 0

    def prime(self, now: int) -> None:
        """Create the states of the buckets to load before the iterate service starts, so
        that records it replays into them are left to the loader (which dedupes them)."""
        with self.lock:
            self._open_buckets(bucket_of(now + self.cfg.load_ahead_ms, self.cfg.scale_minutes))

    def _read_closed(self, bucket: int, counted_below: int = 0) -> tuple[dict[str, set[int]], dict[str, set[int]]]:
        """Per group name, the sequences the dispatch log of ``bucket`` says were delivered
        or dead-lettered; and per group, those closed by records before offset
        ``counted_below`` (closes already counted in ``closed_retired``).

        A torn tail is cut (only the last flush before a crash can be torn); a corrupt
        record in the middle is reported and stepped over: at worst its message is
        delivered again, which at-least-once allows, rather than the scheduler stopping.
        """
        closed: dict[str, set[int]] = {}
        counted: dict[str, set[int]] = {}
        if self.dispatch.get(bucket) is None:
            return closed, counted
        try:
            self.dispatch.recover(bucket, self.cfg.corruption)
        except CorruptRecord as err:
            log.error(
                "corrupt dispatch record; messages it covered may be delivered again",
                extra={"path": err.path, "offset": err.offset, "reason": err.reason},
            )
        seg = self.dispatch.get(bucket)
        for f in _dispatch_frames(seg, 0, seg.size):
            name = records.dispatch_group(f.body)
            closed.setdefault(name, set()).add(f.sequence)
            if f.offset < counted_below:
                counted.setdefault(name, set()).add(f.sequence)
        return closed, counted

    # --- groups -----------------------------------------------------------------------------------

    def _targets(self, sid: int, seq: int = 0) -> list[Group]:
        """The groups of subject ``sid``, oldest ``since`` first (lock held). A subject of
        data written before groups existed gets the group "default" (see legacy_upto)."""
        if self._targets_version != self.groups.version:
            self._targets_cache.clear()
            self._targets_version = self.groups.version
        got = self._targets_cache.get(sid)
        if got is None:
            got = sorted(self.groups.of_subject(self._subjects[sid]), key=lambda g: (g.since, g.gid))
            if not got and (self.cfg.implicit_group or (seq and seq <= self.legacy_upto)):
                self.groups.create(self._subjects[sid], self.cfg.implicit_group or records.DEFAULT_GROUP, self.clock())
                return self._targets(sid)
            self._targets_cache[sid] = got
        return got

    def _lane(self, sid: int, gid: int) -> _Lane:
        lane = self._lanes.get((sid, gid))
        if lane is None:
            lane = self._lanes[(sid, gid)] = _Lane(sid, gid)
            self.in_flight.setdefault(gid, {})
        return lane

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
            sid = self.subject_id(subject.encode())
            # what already fired without this group and is for it is read back from disk:
            # what its subject kept while it had no group, and, for a group whose since is
            # not after the timer (one replayed after a restart, or created in the very
            # millisecond the timer fired), what fired from its since on
            read_from = self._kept.pop(sid, None)
            if self._fired_to >= g.since > BEGINNING:
                b = bucket_of(g.since, self.cfg.scale_minutes)
                read_from = b if read_from is None else min(read_from, b)
            if read_from is not None:
                lane = self._lane(sid, g.gid)
                lane.spilled = True
                lane.drop_from = read_from
                self._spilled.add(lane)
            self._wake.notify()
            return True

    def remove_group(self, subject: str, name: str, at_ms: int) -> bool:
        """Delete a group: its ready entries, spill and deliveries in flight are dropped
        (acks for them find nothing), and the buckets stop waiting for it."""
        with self.lock:
            g = self.groups.delete(subject, name, at_ms)
            if g is None:
                return False
            for key in [k for k in self._lanes if k[1] == g.gid]:
                lane = self._lanes.pop(key)
                self._ready_total -= lane.ready.count
                self._spilled.discard(lane)
                if lane in self._rr:
                    self._rr.remove(lane)
            self.in_flight.pop(g.gid, None)
            for st in self.buckets.values():
                st.owed.pop(g.gid, None)
                st.partial.pop(name, None)
            self._wake.notify()
            return True

    def group_stats(self) -> list[dict]:
        """Per group: ready (due, in memory), whether it spilled to disk, in flight."""
        with self.lock:
            out = []
            for g in self.groups.all():
                lanes = [ln for (sid, gid), ln in self._lanes.items() if gid == g.gid]
                out.append(
                    {
                        "subject": g.subject,
                        "group": g.name,
                        "ready": sum(ln.ready.count for ln in lanes),
                        "spilled": any(ln.spilled for ln in lanes),
                        "in_flight": len(self.in_flight.get(g.gid, ())),
                        "since": g.since,
                        "created_ms": g.created_ms,
                    }
                )
            return out

    def _index(self, st: _Bucket, frames: list[Frame]) -> Entries | None:
        due, seq, off, subj = [], [], [], []
        closed = st.closed or {}
        counted = st.counted or {}
        with self.lock:
            for f in frames:
                if f.kind == RecordKind.MESSAGE:
                    q = f.sequence
                    if q in st.cancelled:
                        continue
                    d, subject, _mid = records.message_index_fields(f.body)
                    sid = self.subject_id(subject)
                    if closed:
                        hit = [name for name, seqs in closed.items() if q in seqs]
                        if hit:
                            targets = [g for g in self._targets(sid, q) if g.since <= d]
                            first = targets[0].name if targets else hit[0]
                            if first in hit and q not in counted.get(first, ()):
                                st.nclosed += 1
                            if targets and all(g.name in hit for g in targets):
                                continue  # closed for every group it is for
                            for name in hit:
                                st.partial.setdefault(name, set()).add(q)
                            self._partial_any = True
                    due.append(d)
                    seq.append(q)
                    off.append(f.offset)
                    subj.append(sid)
                elif f.kind == RecordKind.CANCEL:
                    st.cancelled.add(records.decode_cancel(f.body).target_sequence)
            st.unfired += len(due)
        if not due:
            return None
        n = len(due)
        return Entries(
            np.array(due, dtype=np.int64),
            np.array(seq, dtype=np.int64),
            np.array(off, dtype=np.int64),
            np.full(n, st.bucket, dtype=np.int32),
            np.array(subj, dtype=np.int32),
        )

    def on_records(self, written: list[Scheduled], near: int | None = None) -> None:
        """Called by the iterate service once records are in schedule segments.

        ``near``: the iterate service handed over the records of buckets up to it only. If
        the horizon moved past it meanwhile, a bucket opened in between may have been loaded
        before those records were written and be waiting for them live: such buckets go
        back to the loader, which reads on from its cursor.
        """
        with self.lock:
            # wake the timer thread only for work it would not find before it wakes anyway:
            # waking it for every read of the iterate service cost ~1 µs per ingested message
            wake = False
            sleeping_until = self._sleeping_until
            if near is not None and self._horizon > near:
                for st in self.buckets.values():
                    if st.bucket > near and st.complete:
                        st.complete = False
                        wake = True
            for rec in written:
                st = self.buckets.get(rec.bucket)
                if st is None:
                    if rec.bucket > self._horizon or rec.bucket in self.reopened:
                        continue  # the loader will find it (and dedupe it) when its time comes
                    wake = True
                    # a bucket with nothing left to do (finished, or new behind the horizon)
                    seg = self.schedule.get(rec.bucket)
                    st = self.buckets[rec.bucket] = _Bucket(rec.bucket, seg, rec.offset, True)
                    st.dispatch_ready = True
                    if rec.bucket < self.done_before:
                        self.reopened.add(rec.bucket)
                        self._mark_reopened(rec.bucket)
                if rec.kind == RecordKind.CANCEL:
                    # known at once, whatever the loader's progress: an entry loaded from an
                    # earlier chunk must not fire after its cancel was acknowledged
                    st.cancelled.add(rec.target)
                if not st.complete:
                    wake = True
                    continue  # the loader has not reached the end; it will index this record
                if st.cursor != rec.offset:
                    log.error(
                        "schedule segment out of step with the wheel; reloading",
                        extra={"bucket": rec.bucket, "cursor": st.cursor, "offset": rec.offset},
                    )
                    st.complete = False
                    wake = True
                    continue
                if rec.kind == RecordKind.MESSAGE:
                    if len(self.wheel) + self._ready_total >= self.cfg.max_loaded:
                        st.complete = False  # over budget: the loader streams the rest later
                        wake = True
                        continue
                    self.wheel.add(rec.due, rec.sequence, rec.offset, rec.bucket, self.subject_id(rec.subject))
                    if sleeping_until is None or rec.due < sleeping_until:
                        wake = True
                    st.unfired += 1
                    st.done = False
                st.cursor = rec.offset + rec.size
            for rec in written:
                if rec.kind == RecordKind.CANCEL:
                    self.cancelling.discard(rec.target)
            if wake:
                self._wake.notify()

    # --- timer ------------------------------------------------------------------------------------

    def _fire(self, now: int) -> None:
        """Move due entries from the wheel to the lanes of their subjects' groups (lock
        held): every group the message is for gets it (fan-out)."""
        self._fired_to = max(self._fired_to, now)
        due = self.wheel.pop_due(now)
        if len(due) == 0:
            return
        buckets, counts = np.unique(due.bucket, return_counts=True)
        for b, c in zip(buckets.tolist(), counts.tolist()):
            st = self.buckets.get(b)
            if st is not None:
                st.unfired -= c
        # split by subject, keeping due order inside each subject
        order = np.argsort(due.subj, kind="stable")
        sorted_e = due.take(order)
        subjects, starts = np.unique(sorted_e.subj, return_index=True)
        bounds = list(starts[1:]) + [len(sorted_e)]
        for sid, lo, hi in zip(subjects.tolist(), starts.tolist(), bounds):
            part = sorted_e.take(slice(lo, hi))
            targets = self._targets(sid, int(part.seq.min()))
            if not targets:
                # nobody to deliver to: the entries wait on disk for the subject's first group
                low = int(part.bucket.min())
                self._kept[sid] = min(low, self._kept.get(sid, low))
                continue
            for g in targets:
                self._to_lane(self._lane(sid, g.gid), g, part)

    def _to_lane(self, lane: _Lane, g: Group, part: Entries) -> None:
        """Queue fired entries for one group (lock held): those it is for, not closed for
        it already and not just read back; a spilled lane forgets them (they are on disk)."""
        if g.since > int(part.due.min()):
            part = part.take(part.due >= g.since)
        if self._partial_any and len(part):
            keep = np.ones(len(part), dtype=bool)
            for b in np.unique(part.bucket).tolist():
                st = self.buckets.get(b)
                done_for_g = st.partial.get(g.name) if st is not None else None
                if done_for_g:
                    keep &= ~((part.bucket == b) & np.isin(part.seq, list(done_for_g)))
            part = part.take(keep)
        if lane.recent is not None:
            if len(part):
                part = part.take(~np.isin(part.seq, list(lane.recent)))
            lane.recent = None
        if not len(part):
            return
        if lane.spilled:
            lane.dropped(part.bucket)
            return
        self._owe(g.gid, part.bucket, 1)
        q = lane.ready
        if q.count == 0:
            self._rr.append(lane)
        q.chunks.append([part, 0])
        q.count += len(part)
        self._ready_total += len(part)
        if q.count > self._lane_bound():
            self._spill(lane)

    def _owe(self, gid: int, buckets: np.ndarray, sign: int) -> None:
        """Count entries of ``gid`` held in memory per bucket, up (1) or down (-1)."""
        if not len(buckets):
            return
        first = int(buckets[0])
        if int(buckets[-1]) == first and (len(buckets) < 3 or bool((buckets == first).all())):
            st = self.buckets.get(first)
            if st is not None:
                st.owe(gid, sign * len(buckets))
            return
        bs, cs = np.unique(buckets, return_counts=True)
        for b, c in zip(bs.tolist(), cs.tolist()):
            st = self.buckets.get(b)
            if st is not None:
                st.owe(gid, sign * c)

    def _lane_bound(self) -> int:
        """Entries one lane may hold ready: its own bound, and at most a quarter of the
        whole in-memory budget, so that a few idle groups cannot fill it."""
        return max(1, min(self.cfg.group_max_ready, self.cfg.max_loaded // 4))

    def _relieve(self) -> None:
        """The in-memory budget is full (lock held): the lanes holding the most ready entries
        spill to disk until a quarter of it is free again, so that entries nobody takes
        never stop the loader (and with it every other subject's deliveries)."""
        target = self.cfg.max_loaded * 3 // 4
        for lane in sorted(self._lanes.values(), key=lambda ln: ln.ready.count, reverse=True):
            if len(self.wheel) + self._ready_total <= target or not lane.ready.chunks:
                return
            self._spill(lane)

    def _spill(self, lane: _Lane) -> None:
        """A lane over its bound forgets its queued entries (lock held); retries stay."""
        dropped = lane.ready.drop_chunks()
        n = sum(map(len, dropped))
        self._ready_total -= n
        for buckets in dropped:
            self._owe(lane.gid, buckets, -1)
            lane.dropped(buckets)
        if not lane.spilled:
            log.info(
                "group over its in-memory bound: its due entries wait on disk",
                extra={"subject": self._subjects[lane.sid], "gid": lane.gid, "dropped": n},
            )
        lane.spilled = True
        self._spilled.add(lane)

    def _expire(self, now: int) -> None:
        """Deliveries not acknowledged in time go back for another attempt (or dead letters)."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _deadline, flights = self._deadlines.popleft()
            for fl in flights:
                in_flight = self.in_flight.get(fl.gid)
                if in_flight is None:
                    continue  # the group was deleted
                for seq in fl.seqs:
                    if in_flight.get(seq) is not fl:
                        continue  # acknowledged, or handed out again since
                    del in_flight[seq]
                    self._expired(seq, fl.item(seq), now)
        while self._retry_heap and self._retry_heap[0][0] <= now:
            _t, _seq, item = heapq.heappop(self._retry_heap)
            self._requeue(item)

    def _expired(self, seq: int, item: tuple, now: int) -> None:
        """One delivery's ack timeout passed: retry after a backoff, or dead-letter it."""
        self.redeliveries += 1
        attempt = item[4] - 1
        if attempt >= self.cfg.max_attempts:
            self._dead_letter(seq, item, now)
            return
        backoff = min(self.cfg.max_backoff_ms, self.cfg.retry_backoff_ms * (2 ** (attempt - 1)))
        heapq.heappush(self._retry_heap, (now + backoff, seq, item))

    def _requeue(self, item: tuple) -> None:
        """Put a retry at the front of its lane (lock held); a deleted group's is dropped."""
        seq, off, bucket, due, attempt, subj, gid = item
        lane = self._lanes.get((subj, gid))
        if lane is None:
            return
        q = lane.ready
        if q.count == 0:
            self._rr.append(lane)
        q.retries.append((seq, off, bucket, due, attempt))
        q.count += 1
        self._ready_total += 1

    # --- reading back what spilled lanes keep on disk ----------------------------------------------

    def _reread(self) -> bool:
        """One chunk of a spilled lane's pass over the loaded buckets; True if it did work.

        A pass reads back the lane's entries due at or before the time the pass began with
        (everything due then had fired) that are neither in memory, nor closed for the
        group (dispatch log and the records still buffered), nor cancelled. It stops while
        the lane is at half its bound and goes on when the consumers have taken them.
        """
        limit = self._lane_bound()
        sink = self.sink
        if sink is None:
            return False
        with self.lock:
            # only lanes whose consumers take deliveries now: an idle group's backlog stays
            # on disk until credit returns
            lane = next(
                (
                    ln
                    for ln in self._spilled
                    if ln.ready.count < limit // 2
                    and (
                        (g := self.groups.by_gid(ln.gid)) is None
                        or sink.credit(self._subjects[ln.sid], g.name) > 0
                        or (ln.walk is None and ln.drop_from is None)
                    )
                ),
                None,
            )
            if lane is None:
                return False
            g = self.groups.by_gid(lane.gid)
            if g is None or self._lanes.get((lane.sid, lane.gid)) is not lane:
                self._spilled.discard(lane)
                return True
            if lane.walk is None:
                if lane.drop_from is None:
                    # nothing forgotten since the last pass began: the lane is whole again
                    lane.spilled = False
                    self._spilled.discard(lane)
                    return True
                lane.walk = _Pass(lane.drop_from, self._fired_to)
                lane.drop_from = None
            w = lane.walk
            last = bucket_of(w.hi, self.cfg.scale_minutes)
            nxt = min((b for b in self.buckets if w.bucket <= b <= last), default=None)
            if nxt is None:
                lane.walk = None  # the pass is over
                return True
            if nxt != w.bucket:
                w.bucket, w.offset = nxt, 0
            st = self.buckets[nxt]
            start, stop = w.offset, st.cursor
            closed_known = w.closed_bucket == nxt
        if start >= stop:
            with self.lock:
                if lane.walk is w:
                    w.bucket += self.cfg.scale_minutes
                    w.offset = 0
            return True
        try:
            cols = read_columns(st.seg, start, stop, self.cfg.load_chunk_bytes)
            after = cols.base + cols.end
        except CorruptRecord as err:  # reported by the loader; step over it here
            cols = read_columns(st.seg, start, err.offset) if err.offset > start else None
            rest = st.seg.read(err.offset, stop - err.offset)
            found = framing.find_next_frame(rest, 1)
            after = err.offset + found if found is not None else stop
        picked = self._lane_rows(cols, self._subjects[lane.sid].encode(), g.since, w.hi) if cols else None
        if not closed_known:
            size, closes = self._group_closes(nxt, g.stored, 0)
        with self.lock:
            if lane.walk is not w:
                return True
            if not closed_known:
                w.closed_bucket, w.closed_size, w.closed = nxt, size, closes
            if picked is not None and len(picked[0]):
                self._take_back(lane, g, st, w, *picked)
            w.offset = after
        return True

    @staticmethod
    def _lane_rows(cols, subject: bytes, since: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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

    def _group_closes(self, bucket: int, stored: bytes, start: int) -> tuple[int, set[int]]:
        """(size read, sequences closed for the group stored as ``stored``) of the dispatch
        log of ``bucket`` from ``start``."""
        seg = self.dispatch.get(bucket)
        if seg is None:
            return 0, set()
        size = seg.size
        name = stored.decode() or records.DEFAULT_GROUP
        return size, set(bucket_log.group_closes_in(seg, start, size, name).tolist())

    def _take_back(
        self, lane: _Lane, g: Group, st: _Bucket, w: _Pass, seqs: np.ndarray, offs: np.ndarray, dues: np.ndarray
    ) -> None:
        """Queue entries read back for a spilled lane (lock held), minus those in memory,
        closed or cancelled by now."""
        size, more = self._group_closes(st.bucket, g.stored, w.closed_size)  # appended since
        w.closed_size = max(w.closed_size, size)
        w.closed |= more
        # what is not to be read back: a membership test per set, on the entries read
        # (unions of the sets cost their sizes per chunk: ``w.closed`` grows to the whole
        # backlog while it drains, which made a 5 M-message drain quadratic)
        keep = np.ones(len(seqs), dtype=bool)
        queued = [e.seq[pos:] for e, pos in lane.ready.chunks]
        if queued:
            keep &= ~np.isin(seqs, np.concatenate(queued))
        pending = self.pending_dispatch(st.bucket)
        held: set[int] = {item[0] for item in lane.ready.retries}
        held.update(self.in_flight.get(lane.gid, ()))
        held.update(it[1] for it in self._retry_heap if it[2][6] == lane.gid)
        if pending:
            held.update(bucket_log.group_closes_of(pending, g.name).tolist())
        listed = seqs.tolist()
        for skip in (held, w.closed, self.dead_lettering, st.cancelled, self.cancelling, st.partial.get(g.name)):
            if skip:
                keep &= np.fromiter((q not in skip for q in listed), dtype=bool, count=len(listed))
        if not keep.all():
            seqs, offs, dues = seqs[keep], offs[keep], dues[keep]
        if not len(seqs):
            return
        n = len(seqs)
        e = Entries(
            dues.astype(np.int64),
            seqs.astype(np.int64),
            offs.astype(np.int64),
            np.full(n, st.bucket, dtype=np.int32),
            np.full(n, lane.sid, dtype=np.int32),
        )
        q = lane.ready
        if q.count == 0:
            self._rr.append(lane)
        q.chunks.append([e, 0])
        q.count += n
        self._ready_total += n
        st.owe(lane.gid, n)
        if lane.recent is None:
            lane.recent = set(seqs.tolist())
        else:
            lane.recent.update(seqs.tolist())  # in place: a drain adds its whole backlog here
        self._wake.notify()

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
        or credit notification may come to wake it)."""
        sink = self.sink
        if sink is None:
            return False
        rounds = 0
        while True:
            batches: list[Deliveries] = []
            with self.lock:
                if not self._rr or self._stop:
                    break
                for _ in range(len(self._rr)):
                    lane = self._rr.popleft()
                    g = self.groups.by_gid(lane.gid)
                    if g is None or self._lanes.get((lane.sid, lane.gid)) is not lane:
                        continue  # the group was deleted
                    q = lane.ready
                    name = self._subjects[lane.sid]
                    credit = sink.credit(name, g.name)
                    n = min(credit, self.cfg.dispatch_quantum, q.count)
                    n = self._take_tokens(n) if n > 0 else 0
                    if n > 0:
                        seqs, offs, buckets, dues, attempts = q.take(n)
                        self._ready_total -= len(seqs)
                        out = self._prepare(lane, g, name, seqs, offs, buckets, dues, attempts, now)
                        if out is not None:
                            batches.append(out)
                    if q.count > 0:
                        self._rr.append(lane)
            for out in batches:
                sink.deliver(out.subject, out.group, out)
            rounds += 1
            if not batches:
                return False
            if rounds >= 64:  # let the loop flush dispatch records and fire new entries
                return True
        return False

    def _prepare(
        self,
        lane: _Lane,
        g: Group,
        name: str,
        seqs: list[int],
        offs: list[int],
        buckets: list[int],
        dues: list[int],
        attempts: list[int],
        now: int,
    ) -> Deliveries | None:
        """Turn ready items (columns, all of one lane) into deliveries (lock held): drop
        cancelled ones, read the records back, register them as in flight for the group.

        This is the per-message hot path of a burst, so it works on columns: no object or
        tuple per delivery except the in-flight entry an ack needs.
        """
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
        o_seqs: list[int] = []
        o_dues: list[int] = []
        o_attempts: list[int] = []
        o_mids: list[bytes] = []
        o_payloads: list[bytes] = []
        o_headers: list[dict[str, str] | None] = []
        gid = lane.gid
        in_flight = self.in_flight[gid]
        flights: list[_Flight] = []
        for bucket, g_seqs, g_offs, g_dues, g_attempts in by_bucket:
            st = self.buckets.get(bucket)
            if st is None:
                continue  # cannot happen for indexed entries; guards against a dropped bucket
            if st.cancelled or self.cancelling:
                cancelled, cancelling = st.cancelled, self.cancelling
                keep = [i for i, q in enumerate(g_seqs) if q not in cancelled and q not in cancelling]
                if len(keep) < len(g_seqs):
                    skipped = len(g_seqs) - len(keep)
                    st.owe(gid, -skipped)
                    self.cancel_skipped += skipped
                    g_seqs, g_offs, g_dues, g_attempts = (
                        [col[i] for i in keep] for col in (g_seqs, g_offs, g_dues, g_attempts)
                    )
                    if not g_seqs:
                        continue
            mids, payloads, headers = self._read_group(st, g_seqs, g_offs)
            if None in mids:  # unreadable records: reported by _read_group, never served
                keep = [i for i, m in enumerate(mids) if m is not None]
                bad = len(mids) - len(keep)
                st.owe(gid, -bad)
                self.corrupt_skipped += bad
                g_seqs, g_offs, g_dues, g_attempts, mids, payloads, headers = (
                    [col[i] for i in keep] for col in (g_seqs, g_offs, g_dues, g_attempts, mids, payloads, headers)
                )
                if not g_seqs:
                    continue
            fl = _Flight(bucket, lane.sid, gid, now, g_seqs, g_offs, g_dues, g_attempts, mids)
            in_flight.update(zip(g_seqs, itertools.repeat(fl)))
            flights.append(fl)
            o_seqs += g_seqs
            o_dues += g_dues
            o_attempts += g_attempts
            o_mids += mids
            o_payloads += payloads
            o_headers += headers
        if not o_seqs:
            return None
        self._deadlines.append((now + self.cfg.ack_timeout_ms, flights))
        self.dispatched += len(o_seqs)
        if self.on_dispatch is not None:
            lateness = [now - d for d, a in zip(o_dues, o_attempts) if a == 1]
            if lateness:
                self.on_dispatch(lateness)
        out = Deliveries(
            name,
            [f"{q}.{a}" for q, a in zip(o_seqs, o_attempts)],
            o_mids,
            o_payloads,
            o_headers,
            o_dues,
            now,
            o_attempts,
            g.name,
        )
        return out

    def _read_group(self, st: _Bucket, seqs: list[int], offs: list[int]) -> tuple[list, list, list]:
        """Message ids (bytes), payloads and headers (dict or None) of the records of one
        bucket at ``offs``, each in the input's order; the id is None for a record that
        cannot be served.

        Records are read with one pread per run of offsets less than 256 KiB apart and
        checked column-wise (:meth:`_check_run`); one that fails is read again on its own
        and, if still bad, reported and skipped.
        """
        n = len(seqs)
        o = np.array(offs, dtype=np.int64)
        in_order = n < 2 or bool((o[1:] > o[:-1]).all())
        order = None if in_order else np.argsort(o, kind="stable")
        so = o if order is None else o[order]
        sseq = np.array(seqs if order is None else [seqs[k] for k in order.tolist()], dtype=np.int64)
        mids: list = [None] * n
        payloads: list = [None] * n
        headers: list = [None] * n
        failed: list[int] = []
        i = 0
        while i < n:
            first = int(so[i])
            j = int(np.searchsorted(so, first + 256 * 1024, side="left"))
            data = st.seg.read(first, int(so[j - 1]) - first + 16 * 1024)
            failed += self._check_run(data, so[i:j] - first, sseq[i:j], mids, payloads, headers, i)
            i = j
        for k in failed:  # longer than what was read, or really corrupt: the slow, fully checked path
            mids[k], payloads[k], headers[k] = self._read_one(st, int(sseq[k]), int(so[k]))
            if headers[k] is not None:
                headers[k] = self._headers(headers[k], int(sseq[k]), int(so[k]), mids, k)
        if order is not None:  # back to the input's order
            back = order.tolist()
            m2, p2, h2 = [None] * n, [None] * n, [None] * n
            for pos, k in enumerate(back):
                m2[k], p2[k], h2[k] = mids[pos], payloads[pos], headers[pos]
            mids, payloads, headers = m2, p2, h2
        return mids, payloads, headers

    def _check_run(
        self, data: bytes, rel: np.ndarray, seqs: np.ndarray, mids: list, payloads: list, headers: list, base: int
    ) -> list[int]:
        """Check and split the records at offsets ``rel`` of ``data`` (one read): fill
        ``mids``/``payloads``/``headers`` from position ``base`` on, return the positions
        (from ``base``) that failed a check and were left empty. One call of the native
        codec (``read_messages``), or its Python twin (segments/reader.py).
        """
        codec = native.codec
        read = codec.read_messages if codec is not None else read_messages_py
        got_mids, got_payloads, raw_headers, bad = read(
            data, np.ascontiguousarray(rel, dtype=np.int64), np.ascontiguousarray(seqs, dtype=np.int64)
        )
        n = len(rel)
        mids[base : base + n] = got_mids
        payloads[base : base + n] = got_payloads
        if raw_headers.count(None) != n:
            for k, raw in enumerate(raw_headers):
                if raw is not None:
                    headers[base + k] = self._headers(raw, int(seqs[k]), int(rel[k]), mids, base + k)
        return [base + k for k in bad]

    def _headers(self, raw: bytes, seq: int, off: int, mids: list, k: int) -> dict[str, str] | None:
        """Decode a checked record's header block; a malformed one makes the record
        unservable (``mids[k] = None``)."""
        try:
            return records.decode_headers(raw)
        except ValueError as err:
            log.error(
                "malformed headers in a schedule record; it cannot be delivered",
                extra={"offset": off, "sequence": seq, "reason": str(err)},
            )
            mids[k] = None
            return None

    def _read_one(self, st: _Bucket, seq: int, off: int) -> tuple:
        """(message id, payload, raw headers or None) of one record read and checked on its
        own, or (None, None, None) if it cannot be served."""
        try:
            f = st.seg.read_frame(off)
        except CorruptRecord as err:
            log.error(
                "corrupt schedule record; it cannot be delivered",
                extra={"path": err.path, "offset": err.offset, "reason": err.reason},
            )
            return None, None, None
        if f.sequence != seq or f.kind != RecordKind.MESSAGE:
            log.error(
                "schedule record is not the indexed message; it cannot be delivered",
                extra={"offset": off, "sequence": seq, "found": f.sequence},
            )
            return None, None, None
        body = f.body
        slen = mlen = hlen = plen = -1
        if len(body) >= records.MESSAGE_FIXED.size:
            _due, slen, mlen, hlen, plen = records.MESSAGE_FIXED.unpack_from(body, 0)
        a = records.MESSAGE_FIXED.size + slen
        if slen < 0 or a + mlen + hlen + plen != len(body):
            log.error("malformed schedule record; it cannot be delivered", extra={"offset": off, "sequence": seq})
            return None, None, None
        return body[a : a + mlen], body[a + mlen + hlen :], (body[a + mlen : a + mlen + hlen] if hlen else None)

    # --- acknowledgements and the dispatch log ------------------------------------------------------

    def groups_of(self, subject: str) -> list[Group]:
        with self.lock:
            return self.groups.of_subject(subject)

    def gid_of(self, subject: str, group: str) -> int | None:
        with self.lock:
            g = self.groups.get(subject, group)
            return None if g is None else g.gid

    def ack(self, ack_ids: list[str], gid: int | None = None) -> int:
        """Close acknowledged deliveries of group ``gid`` (None: the group of the subject
        that has only one, for tests and tools): one lock hold and one encode per bucket
        for the whole request, the DISPATCH frames buffered for the loop to write and fsync."""
        now = self.clock()
        seqs = _ack_sequences(ack_ids)
        with self.lock:
            # an id already acknowledged, expired or from another server finds nothing
            if gid is None:
                flights = [self._pop_flight(q) for q in seqs]
            else:
                in_flight = self.in_flight.get(gid)
                if in_flight is None:
                    return 0
                flights = list(map(in_flight.pop, seqs, itertools.repeat(None)))
            first = flights[0] if flights else None
            if first is not None and flights.count(first) == len(flights):
                groups = [(first, seqs)]  # the usual case: one batch acknowledged as handed out
            else:  # several batches (or unknown ids): one group per run of the same batch
                groups = []
                start = 0
                for fl, run in itertools.groupby(flights):
                    k = sum(1 for _ in run)
                    if fl is not None:
                        groups.append((fl, seqs[start : start + k]))
                    start += k
            n = 0
            for fl, got in groups:
                offs, dues, attempts, mids = fl.columns(got)
                self._record_many(
                    fl.bucket,
                    got,
                    dues,
                    [fl.at] * len(got),
                    offs,
                    attempts,
                    mids,
                    records.Outcome.DELIVERED,
                    now,
                    fl.gid,
                )
                n += len(got)
            if n:
                self.acked += n
                self._wake.notify()
        return n

    def _pop_flight(self, seq: int) -> _Flight | None:
        """The flight of ``seq`` in whichever group has it (removed), or None."""
        for flights in self.in_flight.values():
            fl = flights.pop(seq, None)
            if fl is not None:
                return fl
        return None

    def in_flight_count(self) -> int:
        return sum(map(len, self.in_flight.values()))

    def is_in_flight(self, seq: int) -> bool:
        """Handed out to some group and not yet acknowledged (lock held)."""
        return any(seq in flights for flights in self.in_flight.values())

    # claim_cancels answers, one per sequence
    CLAIMED = 0
    CLAIM_CANCELLING = 1  # another Cancel claimed it already (or an earlier entry of the list)
    CLAIM_OUT = 2  # handed out and not acknowledged, or its dead-letter copy is being written

    def claim_cancels(self, sequences: list[int]) -> list[int]:
        """Claim each sequence for a Cancel, under one lock acquisition: a claimed message is
        skipped by the dispatcher until its tombstone has passed the iterate service (see
        on_records) or ``release_cancels``. One of CLAIMED, CLAIM_CANCELLING, CLAIM_OUT each."""
        out: list[int] = []
        cancelling, dead = self.cancelling, self.dead_lettering
        with self.lock:
            flights = [f for f in self.in_flight.values() if f]
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

    def known_tombstones(self, bucket: int) -> set[int] | None:
        """Every cancelled sequence of ``bucket`` if it is loaded with its tombstones all
        known (the set itself: read it, never change it); None otherwise."""
        st = self.buckets.get(bucket)
        return st.cancelled if st is not None and st.tombstones_known else None

    def release(self, ack_ids: list[str], gid: int | None = None) -> int:
        """Give back deliveries a consumer will not acknowledge (its stream ended).

        Each one still in flight *with that attempt* goes back to its lane's ready queue
        at once, as attempt + 1 (a redelivery, without the ack timeout or backoff); one that
        used its ``max_attempts`` goes to the dead-letter path, like an expiry. Ids of an
        older attempt, or of deliveries already acknowledged or expired, are ignored.
        Returns how many were released (dead-lettered ones included).
        """
        now = self.clock()
        n = 0
        with self.lock:
            parsed = []
            for ack_id in ack_ids:
                seq_text, _, attempt_text = ack_id.partition(".")
                try:
                    parsed.append((int(seq_text), int(attempt_text)))
                except ValueError:
                    continue
            for seq, attempt in parsed:
                if gid is None:
                    in_flight = next((m for m in self.in_flight.values() if seq in m), {})
                else:
                    in_flight = self.in_flight.get(gid, {})
                fl = in_flight.get(seq)
                if fl is None or fl.attempt_of(seq) != attempt:
                    continue
                del in_flight[seq]
                self.redeliveries += 1
                n += 1
                item = fl.item(seq)
                if attempt >= self.cfg.max_attempts:
                    self._dead_letter(seq, item, now)
                else:
                    self._requeue(item)
            if n:
                self._wake.notify()
        return n

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
        buf = self._dispatch_buf.get(bucket)
        if buf is None:
            buf = self._dispatch_buf[bucket] = bytearray()
            if len(self._dispatch_buf) == 1:
                self._dispatch_first = time.monotonic()
        buf += records.encode_dispatch_frames(seqs, dues, dispatched_at, offs, attempts, mids, now, outcome, g.stored)
        # a close counts for ``pending`` when it is by the subject's first group, the one
        # every message of the subject that has a group at all is for
        sid = self.subject_id(g.subject.encode())
        targets = self._targets(sid)
        counts = bool(targets) and targets[0].gid == gid
        st = self.buckets.get(bucket)
        if st is not None:
            st.owe(gid, -len(seqs))
            if counts:
                st.nclosed += len(seqs)
        elif counts:
            self.closed_retired += len(seqs)

    def closed_total(self) -> int:
        """Messages closed (delivered or dead-lettered) over the data folder's life."""
        with self.lock:
            return self.closed_retired + sum(st.nclosed for st in self.buckets.values())

    def _flush_dispatch(self, force: bool = False) -> None:
        """Write buffered DISPATCH records; their fsync happens on the syncer thread, so
        the timer never waits for the disk."""
        with self.lock:
            if not self._dispatch_buf:
                return
            if not force and (time.monotonic() - self._dispatch_first) * 1000 < self.cfg.dispatch_flush_ms:
                return
            bufs, self._dispatch_buf = self._dispatch_buf, {}
            # visible to Cancel/Get (pending_dispatch) until they are in the files
            self._writing = bufs
        written: list[int] = []
        try:
            # outside the lock: appending to a page that the syncer's fdatasync has under
            # writeback can block for milliseconds, and acks (the asyncio thread) and the
            # timer wait for this lock
            for bucket, buf in bufs.items():
                self.dispatch.append(bucket, buf)
                written.append(bucket)
        except OSError as err:
            if not disk_full(err):
                raise
            # no space: the records not written go back in front of any newer ones, and
            # the next pass tries again (a failed append moves no segment's size)
            if not self._dispatch_waiting_space:
                log.warning("disk full: DISPATCH records wait for free space", extra={"error": str(err)})
            self._dispatch_waiting_space = True
            self.dispatch_disk_full_total += 1
            with self.lock:
                for bucket, buf in bufs.items():
                    if bucket not in written:
                        newer = self._dispatch_buf.get(bucket)
                        self._dispatch_buf[bucket] = buf + newer if newer else buf
                self._dispatch_first = time.monotonic()
        else:
            if self._dispatch_waiting_space:
                log.info("DISPATCH records written again after a full disk")
                self._dispatch_waiting_space = False
        finally:
            with self.lock:
                self._writing = {}
                for bucket in written:
                    self._write_gen[bucket] = self._write_gen.get(bucket, 0) + 1
        if written:
            self._sync_wanted.set()

    def _sync_dispatch(self) -> None:
        """fsync written DISPATCH records, then let their buckets become done."""
        with self.lock:
            gens = dict(self._write_gen)
        if not gens:
            return
        self.dispatch.sync()
        now = self.clock()
        with self.lock:
            for bucket, gen in gens.items():
                if self._write_gen.get(bucket) == gen:
                    del self._write_gen[bucket]
                st = self.buckets.get(bucket)
                if st is not None:
                    self._maybe_done(st, now)
            self._advance_done(now)

    def _sync_loop(self) -> None:
        while True:
            self._sync_wanted.wait()
            self._sync_wanted.clear()
            if self._sync_stop:
                return
            try:
                self._sync_dispatch()
            except BaseException as err:  # fsync failed: stop like any storage failure
                self.error = err
                log.exception("dispatch log sync failed")
                return

    def pending_dispatch(self, bucket: int) -> bytes:
        """DISPATCH frames of ``bucket`` buffered but not yet in its file (lock held)."""
        return bytes(self._writing.get(bucket, b"")) + bytes(self._dispatch_buf.get(bucket, b""))

    def _check_done(self, now: int) -> None:
        """Every 100 ms: buckets whose time passed with nothing outstanding become done."""
        if now - self._last_done_check < 100:
            return
        self._last_done_check = now
        with self.lock:
            for st in self.buckets.values():
                if not st.done:
                    self._maybe_done(st, now)
            self._advance_done(now)

    def _spill_floor(self) -> int:
        """The lowest bucket that may hold entries some group keeps on disk only (lock held):
        no bucket at or above it is done."""
        floor = min(self._kept.values(), default=2**62)
        for lane in self._spilled:
            if lane.drop_from is not None:
                floor = min(floor, lane.drop_from)
            if lane.walk is not None:
                floor = min(floor, lane.walk.bucket)
        return floor

    def _maybe_done(self, st: _Bucket, now: int) -> None:
        end = (st.bucket + self.cfg.scale_minutes) * MS_PER_MINUTE
        if (
            st.complete
            and st.unfired <= 0
            and not any(st.owed.values())
            and now >= end
            and st.bucket < self._spill_floor()
            and st.bucket not in self._dispatch_buf
            and st.bucket not in self._writing
            and st.bucket not in self._write_gen
        ):  # its dispatch records are on disk
            st.done = True

    def _advance_done(self, now: int) -> None:
        """Move ``done_before`` over finished buckets and forget them (lock held)."""
        for b in [b for b in self.reopened if b < self.done_before]:
            st = self.buckets.get(b)
            if st is not None and st.done:
                self._retire(b)
        limit = min(bucket_of(now, self.cfg.scale_minutes), self._horizon + self.cfg.scale_minutes)
        if self.done_before >= limit:
            return
        keys = self.schedule.buckets()
        first = i = bisect.bisect_left(keys, self.done_before)
        new = limit
        while i < len(keys) and keys[i] < limit:
            st = self.buckets.get(keys[i])
            if st is None or not st.done:
                new = keys[i]
                break
            i += 1
        for b in keys[first:i]:
            self._retire(b)
        self.done_before = max(self.done_before, new)

    def _retire(self, bucket: int) -> None:
        """Forget a done bucket (lock held); its closes move to ``closed_retired``."""
        st = self.buckets.pop(bucket, None)
        if st is not None:
            self.closed_retired += st.nclosed
        self.reopened.discard(bucket)
        self.reopened_at.pop(bucket, None)

    # --- dead letters -------------------------------------------------------------------------------

    def _dead_letter(self, seq: int, item: tuple, now: int) -> None:
        """Move a message that failed ``max_attempts`` times for a group to the dead-letter
        subject (lock held).

        The copy goes through the message log like any send; only once it is durable is the
        original closed for that group with a DEAD_LETTERED dispatch record, so a crash in
        between delivers the original again rather than losing it.
        """
        _seq, off, bucket, due, attempt, subj, gid = item
        st = self.buckets.get(bucket)
        g = self.groups.by_gid(gid)
        if st is None or self.dead_letter is None or g is None:
            return
        try:
            msg = records.decode_message(st.seg.read_frame(off).body)
        except CorruptRecord as err:
            log.error(
                "corrupt schedule record; it cannot be dead-lettered", extra={"path": err.path, "offset": err.offset}
            )
            st.owe(gid, -1)
            self.corrupt_skipped += 1
            return

        def done(error: Exception | None) -> None:
            with self.lock:
                self.dead_lettering.discard(seq)
                if error is None:
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
                    heapq.heappush(self._retry_heap, (self.clock() + self.cfg.retry_backoff_ms, seq, item))
                self._wake.notify()

        self.dead_lettering.add(seq)
        try:
            self.dead_letter(msg, seq, g.name, attempt - 1, done)
        except QdelayError as err:
            self.dead_lettering.discard(seq)
            log.warning("dead-letter write refused; will retry", extra={"error": str(err)})
            heapq.heappush(self._retry_heap, (now + self.cfg.retry_backoff_ms, seq, item))

    # --- introspection ------------------------------------------------------------------------------

    def stats(self) -> dict:
        with self.lock:
            return {
                "wheel_size": len(self.wheel),
                "ready": self._ready_total,
                "in_flight": self.in_flight_count(),
                "loaded_buckets": len(self.buckets),
                "done_before": self.done_before,
                "reopened": len(self.reopened),
                "dispatched": self.dispatched,
                "acked": self.acked,
                "redeliveries": self.redeliveries,
                "dead_lettered": self.dead_lettered,
                "cancel_skipped": self.cancel_skipped,
                "corrupt_skipped": self.corrupt_skipped,
                "load_blocked": self.load_blocked,
                "dispatch_unsynced_buckets": len(set(self._dispatch_buf) | set(self._writing) | set(self._write_gen)),
            }

    def persistent_state(self) -> dict:
        with self.lock:
            return {
                "done_before": self.done_before,
                "reopened": sorted(self.reopened),
                "closed_retired": self.closed_retired,
                "reopened_at": [[b, n] for b, n in sorted(self.reopened_at.items())],
                **self.groups.state(),
            }
