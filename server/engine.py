"""The engine: qdelay's storage and scheduling, wired together, without gRPC.

It owns the data folder::

    message/      the message log (WAL)
    schedule/     one schedule segment per due bucket
    dispatch/     one dispatch segment per due bucket
    checkpoint/   iterate.ckpt (iterate offset, dispatch progress), role.ckpt (role, epoch)

and offers what the API needs: ``send`` (durable before it returns), ``cancel``, ``get``,
delivery to a sink with ``ack``, and ``stats``. Opening the engine applies the recovery
rules of docs/recovery.md.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from qdelay.errors import (
    CorruptRecord,
    FailedPrecondition,
    Fenced,
    InvalidArgument,
    InvariantViolation,
    NotMaster,
    QdelayError,
    ShuttingDown,
    StorageError,
    Unavailable,
)
from qdelay.segments import checkpoint, naming, reader, records
from qdelay.segments.bucket_log import BucketLog
from qdelay.segments.folder_lock import FolderLock
from qdelay.segments.framing import Frame, RecordKind
from qdelay.segments.idindex import IdIndex
from qdelay.segments.lookup import DispatchIndex, RecordFinder
from qdelay.segments.naming import bucket_of
from qdelay.segments.segment import CorruptionPolicy, HandlePool, Segment, fsync_dir
from qdelay.segments.wal import DEFAULT_SEGMENT_BYTES, Appended, MessageLog
from qdelay.server import allocator
from qdelay.server.cleaner import Cleaner, CleanerConfig
from qdelay.server.groups import GroupTable
from qdelay.server.iterate import IterateService, Written
from qdelay.server.moved_ids import MovedIds
from qdelay.server.scheduler import DEAD_LETTER_HEADER, Delivery, DeliverySink, Scheduler, SchedulerConfig

log = logging.getLogger("qdelay.engine")

TWO_YEARS_MS = 2 * 365 * 24 * 3600 * 1000
FAR_AHEAD_MIN_MS = 1000  # see Engine.far_ahead_ms
# how long a lookup waits for the iterate service to copy what it must see (Engine._iterated)
LOOKUP_WAIT_S = 5.0

__all__ = [
    "Engine",
    "EngineConfig",
    "NewMessage",
    "Receipt",
    "CancelOutcome",
    "MessageState",
    "MessageStatus",
    "Delivery",
    "DeliverySink",
]


@dataclass
class EngineConfig:
    """What an engine runs with: its own settings, and the scheduler's and the cleaner's
    configs nested (each piece gets its own object, never copies of its fields).

    The user-facing ``[engine]`` keys are flat (docs/operations.md); the one mapping from
    them to these objects is ``qdelay.server.config.engine_config``.
    """

    data_dir: str = "./data"
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    flush: str = "sync"
    max_delay_ms: int = TWO_YEARS_MS
    dead_letter_prefix: str = "DLQ."
    corruption: str = "fail"
    open_files: int = 4096
    role: str = "master"
    checkpoint_interval_ms: int = 1000
    # the iterate service lets commits gather this long between its steps when it is not
    # behind (server/iterate.py): fewer, larger steps; a message reaches the timer and the
    # id index up to this much later (Get, Cancel and dedupe do not wait for it)
    iterate_gather_ms: float = 2.0
    # ... and up to this long while all it would copy is due at least max(1 s, ten times
    # this) ahead (nobody reads it soon: Engine.far_ahead_ms); ingest of such messages
    # costs the iterate thread less (bench.ingest's generated stub: ~1 us a message,
    # bench.compare's ingest: ~0.35)
    iterate_gather_far_ms: float = 20.0
    # the on-disk message-id index behind Cancel/Get by id (segments/idindex.py); off saves
    # its ingest cost (with dedupe, about 1.7 us of server CPU a message) and turns by-id calls away
    id_index: bool = True
    # idempotent send (server/dedupe.py): an id of a pending message, or of one delivered or
    # cancelled less than this long ago, is answered with the original receipt; 0 turns it off
    dedupe_window_ms: int = 600_000
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cleaner: CleanerConfig = field(default_factory=CleanerConfig)

    @property
    def scale_minutes(self) -> int:
        """The width of a bucket (the scheduler's setting; the engine, the iterate service
        and the cleaner lay out and find files by it)."""
        return self.scheduler.scale_minutes

    def validate(self) -> None:
        if self.scale_minutes < 1 or 1440 % self.scale_minutes:
            raise InvalidArgument("scale_minutes must divide a day (1, 2, 5, 10, 15, 30, 60 …)")
        if self.role not in ("master", "slave"):
            raise InvalidArgument(f"role must be master or slave, not {self.role!r}")
        if self.corruption not in ("fail", "truncate"):
            raise InvalidArgument("corruption must be 'fail' or 'truncate'")
        if self.scheduler.max_attempts < 1:
            raise InvalidArgument("max_attempts must be at least 1")
        if self.open_files < 8:
            raise InvalidArgument("open_files must be at least 8")


@dataclass(slots=True)
class NewMessage:
    subject: str
    payload: bytes
    headers: dict[str, str]
    message_id: str
    deliver_at_ms: int


@dataclass(frozen=True, slots=True)
class Receipt:
    message_id: str
    deliver_at_ms: int
    sequence: int


class CancelOutcome(enum.IntEnum):
    CANCELLED = 1
    ALREADY_DELIVERED = 2
    NOT_FOUND = 3
    ALREADY_CANCELLED = 4
    DEAD_LETTERED = 5  # every group that took it gave up: it went to DLQ.<subject>


class RescheduleOutcome(enum.IntEnum):  # values of RescheduleResponse.Outcome
    RESCHEDULED = 1
    ALREADY_DELIVERED = 2
    NOT_FOUND = 3
    CANCELLED = 4


class MessageState(enum.IntEnum):
    PENDING = 1
    DELIVERED = 2
    CANCELLED = 3
    NOT_FOUND = 4
    DEAD_LETTERED = 5


@dataclass(slots=True)
class MessageStatus:
    state: MessageState
    message: records.Message | None = None
    deliver_at_ms: int = 0
    delivered_at_ms: int = 0
    # per group of the subject the message is for: (name, state, delivered_at_ms)
    groups: list[tuple[str, MessageState, int]] = field(default_factory=list)


def _open_files_allowed(wanted: int) -> int:
    """Raise the soft open-files limit toward ``wanted`` + headroom if the hard limit allows;
    size the handle pool to what is really available (sockets and logs need some too)."""
    headroom = 256
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        need = wanted + headroom
        if soft != resource.RLIM_INFINITY and soft < need:
            new_soft = need if hard == resource.RLIM_INFINITY else min(need, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (new_soft, hard))
            soft = new_soft
        if soft != resource.RLIM_INFINITY:
            wanted = min(wanted, max(8, soft - headroom))
    except (ImportError, ValueError, OSError):
        pass
    return wanted


# a Cancel's claim is made on the event loop (``Engine._claims``) up to this many targets
# (a few us each there), so that a batch never holds the loop for long
CLAIM_NOW_MAX = 64
# Engine.claim_wait_s: a target claimed by another Cancel waits this long at most for it
CLAIM_WAIT_S = 10.0


class _NotNow(Exception):
    """A claim on the event loop (``Engine._claims``) would wait or read: it is made on a
    worker thread instead."""


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(slots=True)
class Places:
    """Where each of a batch of Cancel targets' messages is (Engine._find_targets), as
    arrays a row per target: due time and sequence (-1: no such message), the place of its
    MESSAGE entry in its schedule segment's index (-1: not known), and the segment
    searched per bucket (to which those places belong)."""

    dues: np.ndarray
    seqs: np.ndarray
    where: np.ndarray
    segs: dict[int, Segment]
    receipts: bool = False  # every target a committed receipt (none by id): a found one is where it says

    def as_list(self) -> list[tuple[int, int] | None]:
        """(deliver_at_ms, sequence) of each target's message, or None."""
        return [(d, q) if q >= 0 else None for d, q in zip(self.dues.tolist(), self.seqs.tolist())]


def _appended_or_none(done: asyncio.Future[Appended]) -> Appended | None:
    """A settled append future's result, or None if it failed (its error retrieved)."""
    if done.cancelled() or done.exception() is not None:
        return None
    return done.result()


async def _settled(fut: asyncio.Future[Appended], settle: Callable[[Appended | None], None]) -> Appended:
    """Await an append queued by ``MessageLog.append_future`` / ``append_bodies_future``;
    ``settle(appended)`` once its outcome is known (None: it failed), even if the caller is
    cancelled meanwhile: the records are written all the same, and what depends on them
    (a Send's ids, a Cancel's or Reschedule's claims) must follow the write, not the caller."""
    try:
        appended = await asyncio.shield(fut)
    except asyncio.CancelledError:
        fut.add_done_callback(lambda done: settle(_appended_or_none(done)))
        raise
    except BaseException:
        settle(None)
        raise
    settle(appended)
    return appended


class Engine:
    def __init__(self, config: EngineConfig, clock: Callable[[], int] = _now_ms) -> None:
        config.validate()
        allocator.tune()
        self.config = config
        self.clock = clock
        self.policy = CorruptionPolicy(config.corruption)
        root = config.data_dir
        os.makedirs(root, exist_ok=True)
        # before anything is read: recovery cuts torn tails, which would cut a running
        # server's log (segments/folder_lock.py)
        self.folder_lock = FolderLock(root)
        self.checkpoint_path = os.path.join(root, naming.CHECKPOINT_DIR, "iterate.ckpt")
        self.role_path = os.path.join(root, naming.CHECKPOINT_DIR, "role.ckpt")
        self.pool = HandlePool(_open_files_allowed(config.open_files))
        self.finder = RecordFinder()
        self.dispatched = DispatchIndex()
        self._closed = False
        # set_role and close one at a time: a role change on a worker thread (a cluster
        # agent's fence, a slave's re-attach) still running when the server stops stopped the
        # scheduler concurrently with close() (two joins of one thread, its dispatch writer
        # flushed after the files closed)
        self._role_lock = threading.Lock()
        self._started = False
        self.recovery_notes: list[str] = []

        role_state = checkpoint.read(self.role_path) or {}
        self.role = role_state.get("role", config.role)
        self.epoch = int(role_state.get("epoch", 0))
        if config.role == "slave" and self.role in ("master", "fenced"):
            # told to follow a master, but this server was (or still thinks it is) one: it
            # neither writes nor dispatches until replication compared epochs with that master
            self.role = "joining"

        state = self._read_checkpoint()
        self.wal = MessageLog(
            os.path.join(root, naming.MESSAGE_DIR),
            segment_bytes=config.segment_bytes,
            flush=config.flush,
            pool=self.pool,
            corruption=self.policy,
            min_next_sequence=int(state.get("sequence", 0)) + 1,
        )
        # every look at a message (by id or by receipt) and every delivery wait until the
        # iterate service has copied what was committed before this engine opened or last
        # changed its role (set_role): only this term's tombstones are covered by its claims
        # (a tombstone durable before a crash may still be in the message log alone)
        self._claims_from = self.wal.committed_sequence
        self.schedule = BucketLog(
            os.path.join(root, naming.SCHEDULE_DIR), naming.SCHEDULE_SUFFIX, self.pool, indexed=True
        )
        self.dispatch = BucketLog(os.path.join(root, naming.DISPATCH_DIR), naming.DISPATCH_SUFFIX, self.pool)
        start_offset, start_sequence = self._start_position(state)
        now = self.clock()
        done_before = state.get("done_before")
        if done_before is None:
            keys = self.schedule.buckets()
            done_before = keys[0] if keys else bucket_of(now, config.scale_minutes)
        reopened = set(state.get("reopened", ()))
        reopened_at = {int(b): int(n) for b, n in state.get("reopened_at", ())}
        if "closed_retired" in state:
            closed_retired = int(state["closed_retired"])
        else:
            # a checkpoint of an older version saved one total of closed messages, which
            # includes what the dispatch logs of the buckets to load hold: count only what
            # is appended to those from now on
            closed_retired = int(state.get("closed", 0))
            for b in self.dispatch.buckets():
                if b >= done_before or b in reopened:
                    seg = self.dispatch.get(b)
                    reopened_at[b] = seg.size if seg is not None else 0
        touched = self._recover_touched(start_offset)
        # a folder a resync wrote (replication/snapshot.py) has no index yet: deriving them is
        # the expected first step there, logged at INFO; anywhere else it means a loss, damage
        # or a crash, a WARNING (the mark stays until both are derived and durable, so a crash
        # during this first open leaves it for the next)
        unindexed_mark = os.path.join(root, naming.UNINDEXED_FILE)
        unindexed = os.path.exists(unindexed_mark)
        # the schedule indexes: re-derived where a crash may have left a tail (the touched
        # segments) and wherever one does not match its segment (docs/recovery.md row 15)
        t0 = time.monotonic()
        mismatched, entries = self.schedule.check_indexes(touched)
        if mismatched:
            self._note(
                f"schedule indexes missing or not matching their segments: {mismatched} re-derived "
                f"({entries} records indexed in {time.monotonic() - t0:.2f}s)"
                + (" (a folder written by a resync, which copies no index)" if unindexed else ""),
                expected=unindexed,
            )
        for b in touched:
            if b < done_before and b not in reopened:
                # reopened after the checkpoint: its closes so far are taken as counted in
                # closed_retired (those made after that checkpoint are not: see stats())
                reopened.add(b)
                seg = self.dispatch.get(b)
                reopened_at[b] = seg.size if seg is not None else 0

        # message id -> (due, sequence): derived from the schedule log, rebuilt when missing
        self.ids = IdIndex(os.path.join(root, "index", "ids")) if config.id_index else None
        self._moved = MovedIds()  # ids moved by this term's Reschedules, until copied (resolve_ids)
        if self.ids is not None and not self.ids.built:
            t0 = time.monotonic()
            n = self.ids.rebuild(self.schedule)
            if n:
                self._note(
                    f"id index rebuilt from the schedule log: {n} messages in {time.monotonic() - t0:.2f}s"
                    + (" (a folder written by a resync, which copies no index)" if unindexed else ""),
                    expected=unindexed,
                )
        if unindexed:
            # check_indexes fsynced the schedule indexes, rebuild marked the id index BUILT
            os.unlink(unindexed_mark)
            fsync_dir(root)
        if self.ids is not None:
            # now, whatever the role: a slave keeps it ready for its promotion (see start_filter)
            self.ids.start_filter()
        self.iterate = IterateService(
            self.wal,
            self.schedule,
            self.checkpoint_path,
            start_offset=start_offset,
            start_sequence=start_sequence,
            scale_minutes=config.scale_minutes,
            checkpoint_interval=config.checkpoint_interval_ms / 1000,
            extra_state=self._extra_state,
            read_bytes=1024 * 1024,
            horizon=self._handover_horizon,
            counts={k: int(state.get(k, 0)) for k in ("messages", "cancels")},
            ids=self.ids,
            gather=config.iterate_gather_ms / 1000,
            gather_far=config.iterate_gather_far_ms / 1000,
        )
        # How far ahead a send's every message must be due for the iterate service to let
        # it wait up to ``iterate_gather_far_ms`` for a step (IterateService.expect_far): a
        # record copied that much later still reaches the timer long before it is due (a
        # second, and ten times the wait, is far more than a step takes on a loaded host).
        # Sends used the cancels' rule (``_far``: beyond the loading horizon + 2 buckets,
        # minutes) before: a producer whose batches mix due times from a minute on
        # (bench.compare's ingest) never qualified. Cancels keep ``_far``: their argument
        # is the claim, not the timer (see cancel_many).
        self.far_ahead_ms = max(FAR_AHEAD_MIN_MS, 10 * config.iterate_gather_far_ms)
        # how long a Cancel or Reschedule waits, in all, for claims another one holds on its
        # targets to end (_after_other_claims); a claim ends within a commit and an iterate
        # step (up to iterate_gather_far_ms) unless its write is stuck
        self.claim_wait_s = CLAIM_WAIT_S
        self.scheduler = Scheduler(
            self.schedule,
            self.dispatch,
            config.scheduler,
            corruption=self.policy,
            clock=self.clock,
            done_before=done_before,
            reopened=reopened,
            dead_letter=self._dead_letter,
            closed_retired=closed_retired,
            reopened_at=reopened_at,
            groups=GroupTable.from_state(state),
            # a checkpoint of a version before groups: its subjects' messages belong to the
            # group "default", which inherits their DISPATCH records
            legacy_upto=int(state.get("sequence", 0)) if state and "groups" not in state else 0,
        )
        # a slave's scheduler stays idle (no wheel) until promotion; meanwhile the slave only
        # notes records that land in finished buckets (see _slave_on_written)
        self.slave_records: dict[int, int] = {}  # bucket -> highest sequence iterated into it
        self.iterate.on_written = self.scheduler.on_written if self.role == "master" else self._slave_on_written
        # group changes apply on every role: a slave's table is ready when it is promoted
        self.iterate.on_group = self.scheduler.apply_group  # type: ignore[assignment]  # its bool is unused
        self._group_lock = asyncio.Lock()
        self.cleaner = Cleaner(self, config.cleaner)
        self.replication_floor: Callable[[], int | None] = lambda: None
        # replication hooks (qdelay.replication): sync mode waits here after the local fsync
        # until a slave has the bytes up to an offset; stats() merges replication_stats()
        self.replication_wait: Callable[[int], Awaitable[object]] | None = None
        self.replication_stats: Callable[[], dict] = lambda: {"replication_lag_bytes": -1}
        # cluster mode (replication/cluster.py): raises unless this master can still prove its
        # etcd lease; checked before a write and again right before it is acknowledged
        self.write_guard: Callable[[], None] | None = None

    # --- recovery (docs/recovery.md) -------------------------------------------------------------

    def _read_checkpoint(self) -> dict:
        try:
            return checkpoint.read(self.checkpoint_path) or {}
        except CorruptRecord as err:
            # Rebuilding from the oldest message-log record is always safe: schedule segments
            # skip sequences they already hold, and dispatch logs say what was delivered.
            self._note(f"iterate checkpoint unreadable ({err}); rebuilding from the message log")
            return {}

    def _start_position(self, state: dict) -> tuple[int, int]:
        wal = self.wal
        if "offset" not in state:
            return wal.first_offset, 0
        offset, sequence = int(state["offset"]), int(state["sequence"])
        if offset > wal.committed_offset:
            msg = (
                f"iterate checkpoint (offset {offset}, sequence {sequence}) is ahead of the "
                f"message log (ends at {wal.committed_offset}): acknowledged records were lost"
            )
            if self.policy is CorruptionPolicy.FAIL:
                raise StorageError(
                    msg + "; restore the message log from a replica, or start with "
                    "corruption=truncate to continue from the log's end"
                )
            self._note(msg + "; continuing from the log's end, sequences stay above " + str(sequence))
            return wal.committed_offset, sequence
        if offset < wal.first_offset:
            msg = (
                f"iterate checkpoint (offset {offset}) is behind the oldest message-log segment "
                f"({wal.first_offset}): records in between were deleted before being iterated"
            )
            if self.policy is CorruptionPolicy.FAIL:
                raise StorageError(msg)
            self._note(msg + "; continuing from the oldest segment")
            return wal.first_offset, sequence
        if offset < wal.committed_offset:
            try:
                wal.read(offset, 1)
            except CorruptRecord:
                seg = wal.segment_at(offset)
                if seg is None:  # below the committed offset there is always a segment
                    raise InvariantViolation(f"no message-log segment holds offset {offset}") from None
                self._note(
                    f"iterate checkpoint offset {offset} is not a record boundary; "
                    f"replaying from the start of its segment ({seg.key})"
                )
                return seg.key, 0
        return offset, sequence

    def _recover_touched(self, start: int) -> set[int]:
        """Check the schedule segments that records after the checkpoint went to.

        Everything before the checkpoint was fsynced into schedule segments before the
        checkpoint was written, so only these can have torn tails; they also need their
        highest sequence, so that the replay skips what they already hold.
        """
        touched: set[int] = set()
        offset = start
        scale = self.config.scale_minutes
        while True:
            frames, nxt = self.wal.read(offset, 8 * 1024 * 1024)
            if not frames:
                break
            for f in frames:
                if f.kind == RecordKind.MESSAGE:
                    touched.add(bucket_of(records.message_due(f.body), scale))
                elif f.kind == RecordKind.CANCEL:
                    touched.add(bucket_of(records.decode_cancel(f.body).deliver_at_ms, scale))
            offset = nxt
        for b in sorted(touched):
            rec = self.schedule.recover(b, self.policy)
            if rec is not None and rec.cut_bytes:
                self._note(
                    f"schedule segment {rec.path}: cut {rec.cut_bytes} bytes at offset "
                    f"{rec.valid_size} ({rec.reason}); the replay rewrites them"
                )
        return touched

    def _note(self, text: str, expected: bool = False) -> None:
        """What recovery did at open; ``expected``: a normal step (a resync's first open),
        logged at INFO so that log-based alerts on WARNING do not fire for it."""
        self.recovery_notes.append(text)
        if expected:
            log.info(text)
        else:
            log.warning(text)

    def _closed_total(self) -> int:
        return self.scheduler.closed_total()

    def _extra_state(self) -> dict:
        state = self.scheduler.persistent_state()
        state.update(self.iterate.counts)
        return state

    # --- lifecycle --------------------------------------------------------------------------------

    def start(self, cleaner: bool = True) -> None:
        """Start the iterate service, the scheduler (a master) and, unless ``cleaner`` is
        False, the cleaner. The server passes False and starts the cleaner itself
        (``start_cleaner``) once the replication hook has set ``replication_floor`` with the
        slaves' restored holds: until then the floor says "no slave", and a first pass (after
        ``cleaner_interval_ms``, which may be a millisecond) deleted what a stopped slave
        needed."""
        if self._started:
            return
        self._started = True
        self.scheduler.prime(self.clock())
        self.iterate.start()
        if self.role == "master":
            self._hold_deliveries()
            self.scheduler.start()
        if cleaner:
            self.cleaner.start()

    def start_cleaner(self) -> None:
        """Start the cleaner of an engine started with ``cleaner=False`` (once; not after close)."""
        with self._role_lock:
            if self._started and not self._closed:
                self.cleaner.start()

    def _hold_deliveries(self) -> None:
        """No delivery before the iterate service has copied what the message log held when
        this engine opened or became master (``_claims_from``): a tombstone durable before a
        crash (or replicated to a slave now promoted) may be there alone, covered by no claim
        of this process, and the loader may meanwhile fire its target from the schedule log
        (docs/recovery.md row 17). Once copied, each such tombstone has been published to
        the scheduler (``on_written``) before the hold ends."""
        floor, iterate = self._claims_from, self.iterate
        self.scheduler.hold_deliveries(lambda: iterate.sequence >= floor)

    def close(self, timeout: float = 10.0) -> None:
        """Stop dispatching, let the iterate catch up (``timeout`` at most: the server's
        shutdown deadline), write the last checkpoint. What the iterate has not copied by
        then is copied again from the message log at the next start (docs/recovery.md)."""
        with self._role_lock:
            if self._closed:
                return
            self._closed = True
            self.cleaner.stop()
            self.scheduler.stop()
            if self._started and not self.iterate.wait_for(self.wal.committed_sequence, timeout=timeout):
                log.warning(
                    "the iterate service did not catch up before the shutdown deadline: the next "
                    "start copies the rest from the message log",
                    extra={"lag_records": self.iterate.lag_records(), "timeout_s": round(timeout, 3)},
                )
            self.wal.close()
            self.iterate.stop()
            if self.ids is not None:
                self.ids.close()
            self.pool.close()
            self.folder_lock.release()

    def set_role(self, role: str, epoch: int) -> None:
        """Persist a new role and epoch (promotion, demotion, fencing).

        Becoming master starts the scheduler: it loads every bucket from ``done_before`` and
        the reopened ones, skipping what their dispatch logs say was delivered. Leaving the
        master role (fenced) stops dispatching at once.
        """
        with self._role_lock:
            if self._closed:  # the folder may already belong to the next process
                raise ShuttingDown(f"the server is shutting down: not becoming {role}")
            self._set_role(role, epoch)

    def _set_role(self, role: str, epoch: int) -> None:
        checkpoint.write(self.role_path, {"role": role, "epoch": epoch})
        was = self.role
        self.role, self.epoch = role, epoch
        # tombstones committed before a change of role (an earlier term's, or a fenced
        # master's whose claims its scheduler no longer settles) are covered by no claim of
        # the new role: by-id lookups wait for them (_ids_current)
        self._claims_from = self.wal.committed_sequence
        self._moved.clear()  # (those lookups wait for every move before this: _ids_current)
        if was != "master" and role == "master" and self._started:
            sched = self.scheduler
            # also master -> fenced -> master in one process (cluster mode: a lease proven
            # again, or elected again later): start() after stop() runs the threads again
            with self.iterate.append_lock:
                sched.prime(self.clock())
                self.iterate.on_written = sched.on_written
            self._hold_deliveries()
            sched.start()
        elif was == "master" and role != "master":
            self.scheduler.stop()
            with self.iterate.append_lock:
                self.iterate.on_written = self._slave_on_written

    def _handover_horizon(self) -> int:
        """Up to which bucket the iterate service hands records to the scheduler."""
        now_bucket = bucket_of(self.clock(), self.config.scale_minutes) + self.config.scale_minutes
        return max(self.scheduler.loading_horizon(), now_bucket)

    def _slave_on_written(self, written: dict[int, Written], _cancels: dict[int, list[int]]) -> None:
        """Slave: remember past-due records; one in a finished bucket reopens it, so that a
        promotion loads that bucket again (the scheduler itself stays idle)."""
        sched = self.scheduler
        horizon = bucket_of(self.clock(), self.config.scale_minutes) + self.config.scale_minutes
        seen = self.slave_records
        for b, w in written.items():
            if b <= horizon:
                if w.last_sequence > seen.get(b, 0):
                    seen[b] = w.last_sequence
                if sched.is_done(b):
                    sched.note_reopened(b)

    # --- writes -----------------------------------------------------------------------------------

    def check_writable(self) -> None:
        """Refuse a write (or a write's answer) this server may not give: shutting down, a
        slave, fenced, or (cluster mode) a master that cannot prove its lease."""
        if self._closed:
            raise ShuttingDown("the server is shutting down")
        if self.role == "fenced":
            raise Fenced(f"this server was fenced at epoch {self.epoch}: a newer master exists")
        if self.role != "master":
            raise NotMaster("this server is a slave; send writes to the master")
        if self.write_guard is not None:
            self.write_guard()

    def log_cut_to(self, last_sequence: int) -> None:
        """The message log was cut back to ``last_sequence`` (a slave's divergent tail,
        replication/slave.py ``truncate_divergent``): the records past it, tombstones among
        them, are gone, so lookups no longer wait for the iterate service to reach them
        (``_claims_from``). Else an old master re-attached as a slave, which opened with that
        tail, kept every Get waiting 5 s and failing 'the iterate service is behind' until
        the new master had written past it."""
        self._claims_from = min(self._claims_from, last_sequence)

    def takes_writes(self) -> bool:
        """Whether a write would be let through now (:meth:`check_writable`): what the health
        service reports under ``qdelay.master`` for load balancers that route producers."""
        try:
            self.check_writable()
        except QdelayError:
            return False
        return True

    def now_ms(self) -> int:
        return self.clock()

    @staticmethod
    def _bodies(messages: list[NewMessage]) -> list[bytes]:
        enc = records.encode_message
        hdr = records.encode_headers
        return [
            enc(m.subject.encode(), m.message_id.encode(), hdr(m.headers), m.payload, m.deliver_at_ms) for m in messages
        ]

    async def send_bodies(
        self,
        bodies: list[bytes],
        soonest_due: int | None = None,
        durable: Callable[[Appended | None], None] | None = None,
    ) -> int:
        """Append MESSAGE bodies (already validated and encoded); return the first one's
        sequence once durable (and replicated, in sync mode). ``soonest_due``, the earliest
        due time among them, lets the iterate service copy them later when none is due
        within ``far_ahead_ms`` (IterateService.expect_far).

        ``durable(appended)``, once the records are queued: called once with the append's
        outcome (None: it failed) as soon as it is known, even if the caller is cancelled
        meanwhile (a client's deadline): the records are written all the same, and an
        idempotent send's ids must then stay known (Deduper.written), or the client's retry
        writes them a second time."""
        self.check_writable()
        queued = None
        if soonest_due is not None and soonest_due - self.clock() >= self.far_ahead_ms:
            queued = self._expect_far
        if durable is None:
            appended = await self.wal.append_bodies_async(RecordKind.MESSAGE, self.clock(), bodies, queued)
        else:
            fut = self.wal.append_bodies_future(RecordKind.MESSAGE, self.clock(), bodies, queued)
            appended = await _settled(fut, durable)
        if self.replication_wait is not None:
            await self.replication_wait(appended.end_offset)
        if self.write_guard is not None:
            self.write_guard()
        return appended.first_sequence

    @property
    def answers_when_durable(self) -> bool:
        """Whether a write is answered as soon as its records are durable: no sync
        replication to wait for, no cluster lease to check after it (``send_bodies_then``)."""
        return self.replication_wait is None and self.write_guard is None

    def send_bodies_then(
        self, bodies: list[bytes], soonest_due: int, done: Callable[[Appended | None, Exception | None], None]
    ) -> None:
        """:meth:`send_bodies` without its await, where ``answers_when_durable``: the records
        are queued on return (or it raises, and ``done`` is never called); ``done(appended,
        None)`` once durable, or ``done(None, error)``, runs on this loop whatever becomes of
        the caller (MessageLog.append_bodies_then). A SendStream batch is then answered
        without a task, a shield and their loop turns (DelayService._start_write)."""
        self.check_writable()
        queued = self._expect_far if soonest_due - self.clock() >= self.far_ahead_ms else None
        self.wal.append_bodies_then(RecordKind.MESSAGE, self.clock(), bodies, done, queued)

    async def wait_replicated(self) -> None:
        """Sync mode: return once a slave has confirmed everything committed so far (at once
        in async mode). A retried send answered as the duplicate of a message whose first
        write was refused UNAVAILABLE for want of that confirmation must wait for it too:
        it was acknowledged at once, so the promise of sync mode (an acknowledged write is
        on a slave) did not hold for exactly the retries the refusal asks for."""
        if self.replication_wait is not None:
            await self.replication_wait(self.wal.committed_offset)

    def _far(self, due_ms: int) -> bool:
        """Whether ``due_ms`` is beyond the bucket the iterate service writes at once, even if
        the horizon moves on by a bucket meanwhile: records due then are written behind
        whenever they are copied, and nobody reads them soon."""
        scale = self.config.scale_minutes
        return bucket_of(due_ms, scale) > self._handover_horizon() + 2 * scale

    def _expect_far(self, appended: Appended) -> None:
        self.iterate.expect_far(appended.first_sequence, appended.first_sequence + appended.count - 1)

    async def send(self, messages: list[NewMessage]) -> list[Receipt]:
        """Append to the message log; return once durable. Input is already validated."""
        first = await self.send_bodies(self._bodies(messages), min((m.deliver_at_ms for m in messages), default=None))
        return [Receipt(m.message_id, m.deliver_at_ms, first + i) for i, m in enumerate(messages)]

    def send_sync(self, messages: list[NewMessage], timeout: float | None = None) -> list[Receipt]:
        self.check_writable()
        now = self.clock()
        appended = self.wal.append([(RecordKind.MESSAGE, now, body) for body in self._bodies(messages)], timeout)
        first = appended.first_sequence
        return [Receipt(m.message_id, m.deliver_at_ms, first + i) for i, m in enumerate(messages)]

    def _dead_letter(
        self, msg: records.Message, seq: int, group: str, attempts: int, done: Callable[[Exception | None], None]
    ) -> None:
        self.check_writable()
        headers = dict(msg.headers)
        headers[DEAD_LETTER_HEADER] = str(seq)
        headers[DEAD_LETTER_HEADER + "-group"] = group
        headers[DEAD_LETTER_HEADER + "-attempts"] = str(attempts)
        headers[DEAD_LETTER_HEADER + "-reason"] = "max_attempts"
        now = self.clock()
        body = records.encode_message(
            (self.config.dead_letter_prefix + msg.subject).encode(),
            msg.message_id.encode(),
            records.encode_headers(headers),
            msg.payload,
            now,
        )
        self.wal.submit([(RecordKind.MESSAGE, now, body)], lambda _a, err: done(err))

    # --- cancel and get ---------------------------------------------------------------------------

    async def cancel(self, message_id: str, deliver_at_ms: int | None, sequence: int | None) -> CancelOutcome:
        """Cancel by receipt, or by id alone (``deliver_at_ms`` and ``sequence`` None)."""
        return (await self.cancel_many([(message_id, deliver_at_ms, sequence)]))[0]

    async def cancel_many(self, targets: list[tuple[str, int | None, int | None]]) -> list[CancelOutcome]:
        """Cancel each (message_id, deliver_at_ms, sequence); one outcome each, in order.
        A target with no due time and sequence is found by its id (the newest message
        that has it).

        Every target is looked up and claimed on one worker thread (a claimed message is
        skipped by the dispatcher from then on), then the tombstones of all claimed ones
        go to the message log in one append: one group commit for the whole batch. A target
        named twice is CANCELLED once and ALREADY_CANCELLED after. A target another Cancel
        or Reschedule has claimed answers once that claim has ended (``_after_other_claims``).
        """
        self.check_writable()
        return await self._cancel_many(targets, None)

    async def _cancel_many(
        self, targets: list[tuple[str, int | None, int | None]], deadline: float | None
    ) -> list[CancelOutcome]:
        outcomes, claimed, elsewhere = await self._claims(self._claim_cancels, targets, targets)
        if not claimed:
            await self._nothing_claimed(outcomes)
        else:
            await self._write_cancels(claimed)
        if elsewhere:
            # this call's own tombstones are written first: it holds no claim while it waits
            # (two Cancels each waiting for a claim the other holds would never end)
            await self._after_other_claims(
                elsewhere, deadline, lambda rows, d: self._cancel_many([targets[i] for i in rows], d), outcomes
            )
        return outcomes

    async def _write_cancels(self, claimed: list[tuple[str, int, int]]) -> None:
        """The tombstones of ``claimed`` to the message log (their claims released if that
        fails), then the replication wait and the write guard, as for any write."""
        # Tombstones of messages all due beyond the loading horizon may wait for the iterate
        # service as far-future sends do (expect_far: up to iterate_gather_far_ms), instead
        # of a step of its own after each commit (~0.25-0.3 ms of CPU holding the GIL right
        # when the message log's writer and the event loop answer the batch). Nothing needs
        # them sooner: each target stays claimed until its tombstone has passed that step
        # (Scheduler.on_written settles the claim), and the dispatcher, a Get and another
        # Cancel or Reschedule read the claim, so the answer holds whenever the step comes.
        queued = self._expect_far if self._far(min(due for _mid, due, _seq in claimed)) else None
        seqs = [seq for _mid, _due, seq in claimed]
        try:
            bodies = records.cancel_bodies(claimed)
            fut = self.wal.append_bodies_future(RecordKind.CANCEL, self.clock(), bodies, queued)
        except BaseException:
            self._release_claims(seqs)
            raise
        # durable: another Cancel of these may answer ALREADY_CANCELLED then (the claims hold
        # until the iterate service passes the tombstones, up to iterate_gather_far_ms)
        appended = await self._settle_append(fut, seqs, lambda _appended: self.scheduler.claims_written(seqs))
        if self.replication_wait is not None:
            await self.replication_wait(appended.end_offset)
        if self.write_guard is not None:
            self.write_guard()

    async def _after_other_claims(
        self,
        elsewhere: dict[int, int],
        deadline: float | None,
        again: Callable[[list[int], float], Awaitable[list]],
        out: list,
    ) -> None:
        """Wait, without holding the event loop, until the claims another Cancel or
        Reschedule holds on the messages of ``elsewhere`` (row -> sequence: the targets the
        scheduler answered CLAIM_CANCELLING) have ended; then answer those rows, in order,
        as if fresh: ``again(rows, deadline of the whole call)``, its answers into ``out``.

        An answer before the other claim's outcome is known could be wrong (issue 13 item 6):
        ALREADY_CANCELLED at once, then the first Cancel's write fails (a full disk, an I/O
        error, a lost lease), its claim is released and the message is delivered. Once the
        other call's tombstone is durable (the claim again answers CLAIM_WRITTEN:
        ALREADY_CANCELLED) or its claim has ended, the message is either cancelled for good
        (settled: the claim again answers ALREADY_CANCELLED, from the tombstone) or pending
        again (the claim again may take it). The scheduler, the claims' owner, calls back
        when each has; the callback hands that to this loop. Bounded by
        ``claim_wait_s`` over the whole call (the other claimant may claim again and again,
        or never finish): Unavailable after it, which the caller may retry."""
        loop = asyncio.get_running_loop()
        if deadline is None:
            deadline = loop.time() + self.claim_wait_s
        ended: asyncio.Future[None] = loop.create_future()

        def done() -> None:
            if not ended.done():
                ended.set_result(None)

        def on_scheduler() -> None:  # lock held: hand it over, never wait
            try:
                loop.call_soon_threadsafe(done)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

        watch = self.scheduler.watch_claims(sorted(set(elsewhere.values())), on_scheduler)
        try:
            async with asyncio.timeout_at(deadline):
                await ended
        except TimeoutError:
            raise Unavailable(
                f"another cancel or reschedule of {len(set(elsewhere.values()))} of the targets did not "
                f"finish within {self.claim_wait_s:g} s; their outcome is unknown, retry"
            ) from None
        finally:
            if watch.left:
                self.scheduler.unwatch_claims(watch)
        # the wait may have outlived this server's right to write (fenced, demoted, a lease
        # lost): asked again before claiming and writing anew, as a new call would
        self.check_writable()
        rows = sorted(elsewhere)
        for i, answer in zip(rows, await again(rows, deadline)):
            out[i] = answer

    async def _nothing_claimed(self, outcomes: list[CancelOutcome]) -> None:
        """Before a Cancel or Reschedule that wrote nothing answers: one that found a target
        cancelled may be the retry of one refused for want of a slave's confirmation (sync
        mode), whose tombstone is durable here only; its answer (ALREADY_CANCELLED, or a
        move's CANCELLED) must not say "cancelled" before a slave has it (a failover would
        deliver the message at its old time), nor after a wait that outlived the write
        guard's lease: the guard is asked again right before the answer, as for a write."""
        if CancelOutcome.ALREADY_CANCELLED in outcomes:
            await self.wait_replicated()
            if self.write_guard is not None:
                self.write_guard()

    async def reschedule(
        self, message_id: str, deliver_at_ms: int | None, sequence: int | None, new_due_ms: int
    ) -> tuple[RescheduleOutcome, Receipt | None]:
        """Move a pending message to ``new_due_ms``: (outcome, its new receipt). A
        ``reschedule_many`` of one."""
        return (await self.reschedule_many([(message_id, deliver_at_ms, sequence, new_due_ms)]))[0]

    _MOVE_OUTCOME = {
        CancelOutcome.NOT_FOUND: RescheduleOutcome.NOT_FOUND,
        CancelOutcome.ALREADY_DELIVERED: RescheduleOutcome.ALREADY_DELIVERED,
        CancelOutcome.DEAD_LETTERED: RescheduleOutcome.ALREADY_DELIVERED,
        CancelOutcome.ALREADY_CANCELLED: RescheduleOutcome.CANCELLED,
    }

    async def reschedule_many(
        self, moves: list[tuple[str, int | None, int | None, int]]
    ) -> list[tuple[RescheduleOutcome, Receipt | None]]:
        """Move each (message_id, deliver_at_ms, sequence, new_due_ms) to its new due time;
        (outcome, the new receipt when RESCHEDULED) each, in order. A target with no due time
        and sequence is found by its id (the newest message that has it).

        The targets are claimed as CancelBatch claims them (``_claims``: on the event loop
        for a few copied receipts, else on a worker thread; a claimed message is skipped by
        the dispatcher from then on, so it is never delivered at the old time after this
        answer), then one message-log append writes each claimed message again (same id,
        subject, headers and payload) at its new time, followed by the tombstones of the old
        ones: one group commit, one fsync for the whole batch. Every new MESSAGE comes before
        every tombstone, so that a write torn by a power loss can leave both of a message (a
        duplicate, as at-least-once allows) but never neither. A message named twice is
        moved once, by its first target; a repeat answers CANCELLED, as its old receipt
        would after the move.
        """
        self.check_writable()
        return await self._reschedule_many(moves, None)

    async def _reschedule_many(
        self, moves: list[tuple[str, int | None, int | None, int]], deadline: float | None
    ) -> list[tuple[RescheduleOutcome, Receipt | None]]:
        targets = [(mid, due, seq) for mid, due, seq, _new in moves]
        outcomes, claimed, msgs, elsewhere = await self._claims(self._claim_to_move, targets, targets)
        out: list[tuple[RescheduleOutcome, Receipt | None]] = [
            (self._MOVE_OUTCOME.get(o, RescheduleOutcome.RESCHEDULED), None) for o in outcomes
        ]
        if not claimed:
            await self._nothing_claimed(outcomes)
        else:
            await self._write_moves(moves, outcomes, claimed, msgs, out)
        if elsewhere:  # as _cancel_many: written first, then wait for the other claims
            await self._after_other_claims(
                elsewhere, deadline, lambda rows, d: self._reschedule_many([moves[i] for i in rows], d), out
            )
        return out

    async def _write_moves(
        self,
        moves: list[tuple[str, int | None, int | None, int]],
        outcomes: list[CancelOutcome],
        claimed: list[tuple[str, int, int]],
        msgs: list[records.Message],
        out: list[tuple[RescheduleOutcome, Receipt | None]],
    ) -> None:
        """The claimed messages written again at their new times and their old ones'
        tombstones, in one append (claims released if it fails); their answers into ``out``."""
        rows = [i for i, o in enumerate(outcomes) if o == CancelOutcome.CANCELLED]  # claimed, in order
        try:
            if len(rows) != len(claimed):  # each claim answers its target CANCELLED, in target order
                raise InvariantViolation(f"{len(claimed)} claims for {len(rows)} targets answered CANCELLED")
            enc, hdr = records.encode_message, records.encode_headers
            now = self.clock()
            entries = [
                (RecordKind.MESSAGE, now, enc(m.subject.encode(), mid.encode(), hdr(m.headers), m.payload, moves[i][3]))
                for i, (mid, _due, _seq), m in zip(rows, claimed, msgs)
            ]
            entries += [(RecordKind.CANCEL, now, body) for body in records.cancel_bodies(claimed)]
            # all due beyond the loading horizon (the old minutes' tombstones) and the new
            # times beyond far_ahead_ms (as a far-future send): the iterate service may
            # gather them (expect_far), as CancelBatch's tombstones and such sends; the
            # claims hold until the tombstones pass its step (see cancel_many)
            far = self._far(min(due for _mid, due, _seq in claimed)) and (
                min(moves[i][3] for i in rows) - now >= self.far_ahead_ms
            )
            # covered: by-id lookups do not wait for its copy (_ids_current); its new
            # messages are findable by id meanwhile through _moved, entered before the
            # claims are marked written (a Get of the old one then says CANCELLED)
            fut = self.wal.append_future(entries, self._expect_far if far else None, covered=True)
        except BaseException:
            self._release_claims([seq for _mid, _due, seq in claimed])
            raise
        seqs = [seq for _mid, _due, seq in claimed]

        def written(appended: Appended) -> None:
            first = appended.first_sequence
            self._moved.add(
                [(mid, moves[i][3], first + k) for k, (i, (mid, _due, _seq)) in enumerate(zip(rows, claimed))],
                self.iterate.sequence,
            )
            self.scheduler.claims_written(seqs)  # as _write_cancels

        appended = await self._settle_append(fut, seqs, written)
        first = appended.first_sequence
        if self.replication_wait is not None:
            await self.replication_wait(appended.end_offset)
        if self.write_guard is not None:
            self.write_guard()
        for k, (i, (mid, _due, _seq)) in enumerate(zip(rows, claimed)):
            out[i] = (RescheduleOutcome.RESCHEDULED, Receipt(mid, moves[i][3], first + k))

    async def _settle_append(
        self, fut: asyncio.Future[Appended], claims: list[int], written: Callable[[Appended], None]
    ) -> Appended:
        """Await a Cancel's or a Reschedule's append (``MessageLog.append_future``), queued
        under the ``claims`` on its targets: ``written(appended)`` once it is durable, the
        claims released if it failed. Either happens even if the caller is cancelled
        meanwhile (a client's deadline, a dropped call): the records are written all the
        same, so the claims must stay until their tombstones are copied, and a Reschedule's
        new messages must be findable by id (``_moved``; its append is one by-id lookups do
        not wait for). Released at the cancellation instead, the old message was claimable
        again: a Cancel by id right after found it, answered CANCELLED, and the moved
        message was delivered at its new time."""

        def settle(appended: Appended | None) -> None:
            if appended is None:
                self._release_claims(claims)
            else:
                written(appended)

        return await _settled(fut, settle)

    async def _off_loop_claims(self, claim: Callable, *args):
        """``claim(*args)`` on a worker thread; its result, whose second item is the claimed
        targets. If the caller is cancelled meanwhile (a client's deadline, a dropped call),
        the claims the thread makes are released when it finishes: left in place, they
        would keep a message from being delivered with no tombstone ever written."""
        work = asyncio.get_running_loop().run_in_executor(None, claim, *args)
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:

            def release(done: asyncio.Future) -> None:
                if not done.cancelled() and done.exception() is None:
                    self._release_claims([seq for _mid, _due, seq in done.result()[1]])

            work.add_done_callback(release)
            raise

    async def _claims(self, claim: Callable, targets: list[tuple[str, int | None, int | None]], *args):
        """``claim(*args)`` (``_claim_cancels`` or ``_claim_to_move``, whose claims are the
        ``targets``') on the calling thread, the event loop's, when it would neither wait
        nor read much (``_claimable_now``; ``claim`` is then called with ``now=True`` and
        may still decline, raising _NotNow before it claims anything), else on a worker
        thread (``_off_loop_claims``).

        The claim of a few receipts costs tens of us on the loop; handing it to a worker
        thread and back cost more than that (the thread's wake-up, the loop's, and each one
        waiting for the GIL and a core): Cancels from 16 threads, gathered into batches of
        ~8-16, paid ~250 us of worker-thread CPU a batch."""
        if self._claimable_now(targets):
            try:
                return claim(*args, now=True)
            except _NotNow:
                pass
        return await self._off_loop_claims(claim, *args)

    def _claimable_now(self, targets: list[tuple[str, int | None, int | None]]) -> bool:
        """Whether the claim of ``targets`` may run on the event loop, as ``get_now`` decides
        for a Get: at most CLAIM_NOW_MAX receipts (no id: the id index may wait), each of a
        message the iterate service has copied, in a bucket with nothing written behind,
        its schedule index there and its dispatch index current."""
        if len(targets) > CLAIM_NOW_MAX or self.iterate.sequence < self._claims_from:
            return False  # (the replay after a restart not past the log's end at open: _iterated)
        ready = min(self.wal.committed_sequence, self.iterate.sequence)
        dues: list[int] = []
        for _mid, due, seq in targets:
            if due is None or seq is None or not 0 < seq <= ready:
                return False
            dues.append(due)
        for bucket in self._few_buckets(dues):
            # earlier tombstones of a far minute (other cancels' or moves') are written first
            # if that needs no wait, as a worker thread's look would (_find_targets)
            if not self.iterate.flush_bucket_now(bucket) or not self._readable_now(bucket):
                return False
        return True

    def _readable_now(self, bucket: int) -> bool:
        """Whether a look at ``bucket`` reads only what is in memory or a few KiB: its
        schedule segment exists, nothing of it is written behind, and the finder's and the
        dispatch index of it are built (``get_now`` and ``_claimable_now`` decide with it)."""
        seg = self.schedule.get(bucket)
        return (
            seg is not None
            and not self.iterate.written_behind(bucket)
            and self.finder.ready(seg)
            and self.dispatched.ready(self.dispatch.get(bucket))
        )

    def _flush(self, bucket: int, now: bool = False) -> None:
        """Write ``bucket``'s records out of the iterate service's write-behind buffer before
        its segment is read (a far-future message, or another Cancel's tombstone, may wait
        there). On the event loop (``now``) only if that waits for nothing: the buffer may
        have filled again since ``_claimable_now`` flushed it (the iterate thread copies
        meanwhile), and the append lock is held across an iterate step's writes (and a full
        disk): _NotNow instead, and a worker thread does it."""
        if not now:
            self.iterate.flush_bucket(bucket)
        elif not self.iterate.flush_bucket_now(bucket):
            raise _NotNow

    def _claim_to_move(
        self, targets: list[tuple[str, int | None, int | None]], now: bool = False
    ) -> tuple[list[CancelOutcome], list, list[records.Message], dict[int, int]]:
        """Reschedule's look-up (on the event loop or a worker thread: ``_claims``): the
        claims (as a Cancel's: ``_claim_cancels``) and the record of each claimed message,
        to write again. The claim has confirmed where each one is (its minute's index, or
        the batch form's search), so the record is read from there, not located again.
        StorageError, every claim released, if one has gone meanwhile (the cleaner). A
        record damaged since it was indexed answers NOT_FOUND, its claim given back, as Get
        answers it (the loader never fires it): failing the batch, every retry of it failed."""
        outcomes, claimed, elsewhere = self._claim_cancels(targets, now)
        try:
            msgs = self._records_of(claimed)
        except BaseException:
            self._release_claims([seq for _mid, _due, seq in claimed])
            raise
        if None not in msgs:
            return outcomes, claimed, cast("list[records.Message]", msgs), elsewhere
        rows = [i for i, o in enumerate(outcomes) if o == CancelOutcome.CANCELLED]  # claimed, in order
        damaged = [k for k, msg in enumerate(msgs) if msg is None]
        self._release_claims([claimed[k][2] for k in damaged])
        for k in damaged:
            outcomes[rows[k]] = CancelOutcome.NOT_FOUND
        kept = [k for k, msg in enumerate(msgs) if msg is not None]
        return outcomes, [claimed[k] for k in kept], [cast("records.Message", msgs[k]) for k in kept], elsewhere

    def _records_of(self, claimed: list[tuple[str, int, int]]) -> list[records.Message | None]:
        """The MESSAGE record of each claimed (message_id, due, sequence), in order: each
        minute's read together (``finder.find_many``: one index search, a read per run of
        nearby records); None for one its segment holds damaged. StorageError if one has
        gone (the cleaner) or is not that message."""
        scale = self.config.scale_minutes
        groups: dict[int, list[int]] = {}
        for i, (_mid, due, _seq) in enumerate(claimed):
            groups.setdefault(bucket_of(due, scale), []).append(i)
        frames: list[Frame | None] = [None] * len(claimed)
        held = [False] * len(claimed)  # its minute's segment is there
        for bucket, rows in groups.items():
            seg = self.schedule.get(bucket)
            if seg is not None:
                for i, frame in zip(rows, self.finder.find_many(seg, [claimed[i][2] for i in rows])):
                    frames[i] = frame
                    held[i] = True
        msgs: list[records.Message | None] = []
        for (mid, due, _seq), frame, there in zip(claimed, frames, held):
            if frame is None and there:
                msgs.append(None)  # indexed, its record unreadable now (find_many logged it)
                continue
            msg = records.decode_message(frame.body) if frame is not None and frame.kind == RecordKind.MESSAGE else None
            if msg is None or msg.message_id != mid or msg.deliver_at_ms != due:
                raise StorageError(f"message {mid!r} vanished while being rescheduled; retry")
            msgs.append(msg)
        return msgs

    _NOT_PENDING = {
        MessageState.NOT_FOUND: CancelOutcome.NOT_FOUND,
        MessageState.DELIVERED: CancelOutcome.ALREADY_DELIVERED,
        MessageState.CANCELLED: CancelOutcome.ALREADY_CANCELLED,
        MessageState.DEAD_LETTERED: CancelOutcome.DEAD_LETTERED,
    }

    def _lookup_floor(self) -> int:
        """The sequence every lookup waits for the iterate service to have copied, beside
        its target's own: on a master, what the message log held when this engine opened or
        last changed its role (``_claims_from``; its own Cancels' tombstones since are
        covered by their claims). On a slave (or a joining or fenced server), everything its
        message log holds at the call: a replicated tombstone is covered by no claim of this
        process, and a Get by receipt on a slave answered PENDING for a message whose
        Cancel its log already held, until the iterate service copied it (up to a gather,
        or a backlog, later)."""
        if self.role == "master":
            return self._claims_from
        return max(self._claims_from, self.wal.committed_sequence)

    def _iterated(self, sequence: int) -> None:
        """Wait (up to 5 s) until the schedule log and the id index hold every record up to
        ``sequence``, and every record the message log held when this engine opened or last
        changed its role (``_claims_from``; on a slave, at this call: ``_lookup_floor``):
        the lookups' precondition. A look at a target
        needs more than its own record: a tombstone of it committed before a crash and not
        yet copied is covered by no claim of this process (claims live in memory), so a
        Get would say PENDING and a Reschedule move a message a Cancel had answered
        CANCELLED (docs/recovery.md row 17). Once the replay after a restart has passed that
        floor, this is one comparison. A service that stopped on an error is said
        to have stopped, with the error: "behind; retry" would send users retrying against a
        server whose log says it needs an operator."""
        if self.iterate.wait_for(max(sequence, self._lookup_floor()), timeout=LOOKUP_WAIT_S):
            return
        if self.iterate.error is not None:
            raise StorageError(
                f"the iterate service stopped ({self.iterate.error!r}); the server needs a restart, see its log"
            )
        # UNAVAILABLE, not INTERNAL: nothing is wrong, the answer needs the replay (after a
        # restart) or a burst's copy to finish, and the clients retry UNAVAILABLE by themselves
        raise Unavailable(
            "the iterate service is behind (replaying the message log, a burst, or on a slave what replication "
            "brought) and this answer needs what it has not copied yet; retry shortly"
        )

    def _ids_current(self) -> int:
        """The sequence the iterate service must have copied for a by-id lookup to see
        every message committed before it: the message log's committed sequence but for
        the Cancels' own tombstone appends and the Reschedules' appends since this engine
        opened or last changed its role (a Reschedule's new messages are found in
        ``_moved`` until copied: ``_index_get_many``).

        Such a tombstone changes no id's entry, and until the iterate service has copied it
        its target stays claimed (``Scheduler.on_written`` settles the claim), which a Get,
        a Cancel and a Reschedule read: waiting for it would only hurry the service into a
        step per by-id call. Under 64 tasks cancelling by id that was a step per
        CancelBatch, each appending to every minute its targets touch (~0.57 appends a
        call over 50 minutes, against ~0.07 by receipt, whose steps gather several
        batches; docs/benchmarks.md)."""
        return max(self.wal.committed_past_tombstones, self._lookup_floor())

    def resolve_id(self, message_id: str) -> tuple[int, int] | None:
        """(deliver_at_ms, sequence) of the newest message with ``message_id``, or None.

        Waits until the iterate service has copied (and so indexed) every message committed
        before this call, so that an id just sent is found (``_ids_current``), but for the
        Reschedules' (found in ``_moved``); and, when the newest is a message not yet
        copied (a move, found in ``_moved`` or already in the index: ``_index_get_many``),
        for its copy (its record is read from its minute's segment next)."""
        return self.resolve_ids([message_id])[0]

    def resolve_ids(self, message_ids: list[str]) -> list[tuple[int, int] | None]:
        """``resolve_id`` of each id, with one wait and one multi-get."""
        if self.ids is None:
            raise FailedPrecondition("by-id lookups are off on this server (engine.id_index = false); give the receipt")
        self._iterated(self._ids_current())
        found, newest = self._index_get_many(message_ids)
        if newest > self.iterate.sequence:
            self._iterated(newest)
        return found

    def _index_get_many(self, message_ids: list[str]) -> tuple[list[tuple[int, int] | None], int]:
        """(each id's newest (due, sequence) from ``_moved`` and the id index, the highest
        sequence found: 0 if none). ``_moved`` first: an entry dropped between the two
        looks is one the index holds by then.

        A caller that reads what it found waits for the iterate service to have copied up
        to that highest sequence (``resolve_ids``; ``get_now`` declines below it). Not only
        for a move found in ``_moved``: the index runs ahead of the schedule log. A step
        puts its ids into the index first, then writes its records to their segments, then
        publishes ``iterate.sequence`` (IterateService._copy), and a by-id lookup does not
        wait for a Reschedule's append (``_ids_current``). A CancelBatch, Cancel or
        Reschedule by id right after a Reschedule by id, meeting that step in between,
        found the moved message in the index and in ``_moved`` alike (so it did not wait),
        and no segment of its minute yet (``_in_existing_buckets`` read that as cleaned
        away): NOT_FOUND for a pending message, which was delivered later."""
        assert self.ids is not None
        moved = self._moved.get_many(message_ids, self.iterate.sequence) if len(self._moved) else None
        found = self.ids.get_many(message_ids)
        if moved is not None:
            for k, m in enumerate(moved):
                if m is not None and (found[k] is None or found[k][1] < m[1]):  # type: ignore[index]
                    found[k] = m
        # (the max: ~25 ns a target, timeit at load 2; a CancelBatch of 1,000 ids ~25 us)
        return found, max([f[1] for f in found if f is not None], default=0)

    def moved_since(self, message_ids: list[str], floor: int) -> dict[int, Receipt]:
        """Of ``message_ids``, the ones a Reschedule of this term moved to a message after
        ``floor`` (the sequence an id-index lookup began at: the index may not hold it):
        batch index -> the moved message's receipt, for a re-send's dedupe (Deduper.check;
        such a message is pending: nothing closes one before it is copied)."""
        if not len(self._moved):
            return {}
        got = self._moved.get_many(message_ids, floor)
        return {k: Receipt(message_ids[k], m[0], m[1]) for k, m in enumerate(got) if m is not None and m[1] > floor}

    def duplicates_among(
        self, ids: list[str], hits: list[tuple[int, int] | None], window_ms: int
    ) -> dict[int, Receipt]:
        """Of ``ids`` and what the id index maps them to (``hits``), the ones that make a new
        message a duplicate: still pending (or in flight), or closed less than ``window_ms``
        ago; batch index -> that message's receipt.

        The window runs from the close, not the send (docs/api.md): a delivered or dead-
        lettered message closed when its last DISPATCH record says it was handed over, a
        cancelled one when its tombstone was written. Only a retry reaches here (a new id
        misses the index), so reading those records is affordable.
        """
        out: dict[int, Receipt] = {}
        found = {k: hit for k, hit in enumerate(hits) if hit is not None}
        if not found:
            return out
        live = list(found)
        # batched, as CancelBatch reads them: the segments hold exactly these messages (one
        # search of each minute's index, the entries compared together), then their states
        # (one dispatch-log test and one set of tombstones per minute, the CANCELLED flags
        # at the places that search found). A retry of a pending message, the common
        # duplicate, costs no record read; a closed one, or one the index does not confirm,
        # is located alone. A batch's cost grows with the minutes it touches, not with N
        dues = np.array([found[k][0] for k in live], dtype=np.int64)
        seqs = np.array([found[k][1] for k in live], dtype=np.int64)
        segs: dict[int, Segment] = {}
        held, where, flagged = self._held_by_segments([ids[k] for k in live], dues, seqs, segs)
        rows = np.flatnonzero(held)
        # the flags that search read (no second look at each minute's index)
        closed = self._closed_states(dues[rows], seqs[rows], where[rows], segs, flagged[rows])
        states = {live[r]: MessageState.PENDING for r in rows.tolist()}
        for j, state in closed.items():
            states[live[int(rows[j])]] = state
        now = self.clock()
        scale = self.config.scale_minutes
        for k in live:
            due, seq = found[k]
            if states.get(k) != MessageState.PENDING:
                if bucket_of(due, scale) not in segs:
                    continue  # its minute was cleaned away long ago: the id is free again
                state, offset, _msg, _at, closes = self._locate(ids[k], due, seq, detail=True)
                if state == MessageState.NOT_FOUND:
                    continue
                if state != MessageState.PENDING and now - self._closed_at(due, seq, offset, state, closes) > window_ms:
                    continue  # closed before the window: the id may be used again
            out[k] = Receipt(ids[k], due, seq)
        return out

    def _closed_at(self, due: int, seq: int, offset: int, state: MessageState, closes: list[records.Dispatch]) -> int:
        """When a closed message (found at ``offset`` of its bucket's segment) was closed: its
        latest DISPATCH record's hand-over time, or its tombstone's timestamp. If neither can
        be read (a tombstone only claimed so far), now: the message has just been closed."""
        if state != MessageState.CANCELLED:
            if closes:
                return max(c.dispatched_at_ms for c in closes)
            return self.clock()
        seg = self.schedule.get(bucket_of(due, self.config.scale_minutes))
        stamp = self.finder.cancel_stamp(seg, seq, offset) if seg is not None else None
        return self.clock() if stamp is None else stamp

    def _claim_cancels(
        self, targets: list[tuple[str, int | None, int | None]], now: bool = False
    ) -> tuple[list[CancelOutcome], list, dict[int, int]]:
        """Look every target up and claim the pending ones; (outcomes, claimed targets,
        row -> sequence of the targets another Cancel has claimed).

        A claimed target's outcome is CANCELLED, which the caller makes true by writing its
        tombstone (or releases the claims if that write fails). A target claimed elsewhere
        (CLAIM_CANCELLING, and a repeat of one) has no outcome yet (ALREADY_CANCELLED stands
        in): the caller waits for that claim to end and claims it again
        (``_after_other_claims``).

        Batched (issue 13): the targets are found with one search of their minute's schedule
        index (or one multi-get of the id index), claimed by one request on the scheduler's
        queue (applied by this worker thread when the lock is free, else answered by the
        scheduler thread: ``Scheduler.call``), and their
        closed state read once per bucket (the dispatch log as one vectorised membership
        test, the tombstones as one set, or the index entries' flags found by that search),
        carried as arrays throughout, so that a target costs a few array elements rather
        than a segment read or a Python loop. A receipt the schedule index does not confirm
        (its id reused by a newer message) is read from its segment. The claim comes before
        the look at what closed the message: once claimed, the dispatcher skips it, so
        nothing can close it between the look and the answer.

        ``now`` (on the event loop, ``_claims``): raise _NotNow, before anything is claimed,
        where the look-up would read a record or the claim would wait for the scheduler's
        lock.
        """
        if now and len(targets) == 1:
            return self._claim_one(*targets[0])
        if now:
            few = self._claim_few(targets)
            if few is not None:
                return few
        sched = self.scheduler
        outcomes: list[CancelOutcome] = [CancelOutcome.NOT_FOUND] * len(targets)
        places = self._find_targets(targets, now)
        seqs = places.seqs
        found = np.flatnonzero(seqs >= 0)
        # a message named again (by id and by receipt, or twice) is claimed once, by the
        # first target naming it; the repeats answer after it (a set tells there is none,
        # the common case, for a tenth of np.unique's cost on a batch of a few)
        found_seqs = seqs[found].tolist()
        repeats: list[tuple[int, int]] = []
        if len(set(found_seqs)) == len(found_seqs):
            keep = found
        else:
            _u, first, inverse = np.unique(seqs[found], return_index=True, return_inverse=True)
            keep = found[np.sort(first)]
            again = np.ones(len(found), dtype=bool)
            again[first] = False
            repeats = list(zip(found[again].tolist(), found[first[inverse[again]]].tolist()))
        asked = found_seqs if keep is found else seqs[keep].tolist()
        # their buckets: the claim looks only at what is in flight of those
        buckets = np.unique(self._buckets(places.dues[keep])).tolist()
        if now:
            got = sched.claim_cancels_now(asked, buckets)
            if got is None:
                raise _NotNow
        else:
            got = sched.claim_cancels(asked, buckets)
        # every one claimed (the usual batch): counted in C, no array of the answers
        mine = keep if got.count(sched.CLAIMED) == len(got) else keep[np.asarray(got, dtype=np.int64) == sched.CLAIMED]
        elsewhere: dict[int, int] = {}
        if len(mine) < len(keep):
            answers = np.asarray(got, dtype=np.int64)
            for i in keep[answers == sched.CLAIM_CANCELLING].tolist():
                outcomes[i] = CancelOutcome.ALREADY_CANCELLED
                elsewhere[i] = int(seqs[i])
            for i in keep[answers == sched.CLAIM_WRITTEN].tolist():
                outcomes[i] = CancelOutcome.ALREADY_CANCELLED
            for i in keep[answers == sched.CLAIM_OUT].tolist():
                outcomes[i] = CancelOutcome.ALREADY_DELIVERED
        try:
            closed = self._closed_states(places.dues[mine], seqs[mine], places.where[mine], places.segs, now=now)
        except BaseException:
            sched.release_cancels(seqs[mine].tolist())
            raise
        if closed:
            rows = list(closed)
            for k, state in closed.items():
                outcomes[int(mine[k])] = self._NOT_PENDING[state]
            sched.release_cancels(seqs[mine[rows]].tolist())
            mine = np.delete(mine, rows)
        if len(mine) == len(targets):
            # every target claimed, each where its receipt says (no repeat, none by id): the
            # targets are the claims, as they came
            outcomes = [CancelOutcome.CANCELLED] * len(targets)
            claimed = list(targets) if places.receipts else self._claimed_at(targets, mine, places)
        else:
            mine_l = mine.tolist()
            for i in mine_l:
                outcomes[i] = CancelOutcome.CANCELLED
            claimed = self._claimed_at(targets, mine, places)
        for i, j in repeats:  # a repeat answers as a second Cancel after the first would
            outcomes[i] = CancelOutcome.ALREADY_CANCELLED if outcomes[j] == CancelOutcome.CANCELLED else outcomes[j]
            if j in elsewhere:  # ... once the other claim of its message has ended
                elsewhere[i] = elsewhere[j]
        return outcomes, claimed, elsewhere

    @staticmethod
    def _claimed_at(targets: list[tuple[str, int | None, int | None]], mine: np.ndarray, places: Places) -> list:
        """The claims of the rows ``mine``: (message_id as the target gave it, the due time
        and sequence of the message found)."""
        return list(zip([targets[i][0] for i in mine.tolist()], places.dues[mine].tolist(), places.seqs[mine].tolist()))

    def _claim_one(
        self, message_id: str, deliver_at_ms: int | None, sequence: int | None
    ) -> tuple[list, list, dict[int, int]]:
        """``_claim_cancels`` of one receipt on the event loop (a unary Cancel, a Reschedule,
        a lone ``cancel()``): the same steps with the one-record forms of each (the index
        entry, the claim, ``_closed_state``), since the arrays of a batch cost ~150 us of
        numpy calls for one target (in process: ~150 -> ~25 us a claim). _NotNow where
        ``_claim_cancels`` would look further than the minute's schedule index, or the lock
        is busy; nothing is claimed then."""
        if deliver_at_ms is None or sequence is None:
            raise _NotNow
        bucket = bucket_of(deliver_at_ms, self.config.scale_minutes)
        seg = self.schedule.get(bucket)
        if seg is None or not self.finder.holds_one(seg, sequence, deliver_at_ms, message_id):
            raise _NotNow  # NOT_FOUND or an id reused: the id index and the record decide
        sched = self.scheduler
        got = sched.claim_cancels_now([sequence], (bucket,))
        if got is None:
            raise _NotNow
        if got[0] == sched.CLAIM_CANCELLING:
            return [CancelOutcome.ALREADY_CANCELLED], [], {0: sequence}
        if got[0] == sched.CLAIM_WRITTEN:
            return [CancelOutcome.ALREADY_CANCELLED], [], {}
        if got[0] == sched.CLAIM_OUT:
            return [CancelOutcome.ALREADY_DELIVERED], [], {}
        try:
            state = self._closed_state(bucket, sequence, seg)[0]
        except BaseException:
            sched.release_cancels([sequence])
            raise
        if state != MessageState.PENDING:
            sched.release_cancels([sequence])
            return [self._NOT_PENDING[state]], [], {}
        return [CancelOutcome.CANCELLED], [(message_id, deliver_at_ms, sequence)], {}

    def _claim_few(self, targets: list[tuple[str, int | None, int | None]]) -> tuple[list, list, dict[int, int]] | None:
        """``_claim_cancels`` of a few receipts on the event loop (a gathered ``cancel()``
        batch, which ``_claimable_now`` let run there: receipts of copied messages, each
        bucket readable now), with lists where the batch form carries arrays: the same
        steps (the minute's index confirms each receipt, one claim request, then the
        closed state read after the claim). The confirmation is one native call for the
        whole batch (``RecordFinder.holds_few``), the closed state of a minute without
        DISPATCH records a read of its tombstones' set or of the flags at the places that
        call found: for 16 targets ~25 us in process against ~100 for the same steps as
        Python over numpy (docs/benchmarks.md), which a busy server pays ~3x over.

        None, before anything is claimed, where the batch form has more to do: a receipt the
        index does not confirm (NOT_FOUND, an id reused: looked further), a message named
        twice, a segment gone. _NotNow when the scheduler's lock is busy. A bucket with
        DISPATCH records (written or buffered) gets its closed state from
        ``_closed_states``, as the batch form's."""
        n = len(targets)
        mids = [t[0] for t in targets]
        dues = cast("list[int]", [t[1] for t in targets])
        seqs = cast("list[int]", [t[2] for t in targets])
        if len(set(seqs)) < n:
            return None
        groups = self._few_buckets(dues)
        parts: list[tuple[Segment, list[int]]] = []
        segs: dict[int, Segment] = {}
        for bucket, rows in groups.items():
            self._flush(bucket, True)  # as _held_by_segments: nothing is left behind
            seg = self.schedule.get(bucket)
            if seg is None:
                return None
            segs[bucket] = seg
            parts.append((seg, rows))
        where = self.finder.holds_few(parts, seqs, dues, mids)
        if -1 in where:
            return None
        sched = self.scheduler
        got = sched.claim_cancels_now(seqs, groups)
        if got is None:
            raise _NotNow
        elsewhere: dict[int, int] = {}
        if got.count(sched.CLAIMED) == n:  # the usual batch: every one claimed
            outcomes = [CancelOutcome.CANCELLED] * n
            mine = list(range(n))
        else:
            outcomes = [CancelOutcome.CANCELLED] * n
            mine = []
            for i, answer in enumerate(got):
                if answer == sched.CLAIMED:
                    mine.append(i)
                elif answer == sched.CLAIM_CANCELLING:  # answered once that claim ends
                    outcomes[i] = CancelOutcome.ALREADY_CANCELLED
                    elsewhere[i] = seqs[i]
                elif answer == sched.CLAIM_WRITTEN:
                    outcomes[i] = CancelOutcome.ALREADY_CANCELLED
                else:
                    outcomes[i] = CancelOutcome.ALREADY_DELIVERED
        try:
            closed = self._closed_few(groups, segs, mine, dues, seqs, where)
        except BaseException:
            sched.release_cancels([seqs[i] for i in mine])
            raise
        if not closed:
            if len(mine) == n:
                return outcomes, list(targets), elsewhere  # every target claimed, as it came
            return outcomes, [targets[i] for i in mine], elsewhere
        for i, state in closed.items():
            outcomes[i] = self._NOT_PENDING[state]
        sched.release_cancels([seqs[i] for i in closed])
        return outcomes, [targets[i] for i in mine if i not in closed], elsewhere

    def _few_buckets(self, dues: list[int]) -> dict[int, list[int]]:
        """``_by_bucket`` of a few due times, as lists: bucket -> rows, ascending (one group
        without a loop when they all share a minute, as a flash sale's cancels do)."""
        scale = self.config.scale_minutes
        span = naming.MS_PER_MINUTE * scale  # bucket_of: (due // minute) rounded down to scale
        keys = [due // span for due in dues]
        if keys and keys.count(keys[0]) == len(keys):
            return {keys[0] * scale: list(range(len(keys)))}
        groups: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(key * scale, []).append(i)
        return groups

    def _closed_few(
        self,
        groups: dict[int, list[int]],
        segs: dict[int, Segment],
        mine: list[int],
        dues: list[int],
        seqs: list[int],
        where: list[int],
    ) -> dict[int, MessageState]:
        """``_closed_states`` of the claimed rows ``mine`` of a ``_claim_few`` batch (row ->
        state, for those no longer pending): a bucket's tombstones from the scheduler's set
        when it is loaded, else from the flags of the index entries its search found. Any
        DISPATCH record in a bucket (in its file or still buffered) hands the whole look to
        ``_closed_states``, which reads them."""
        if not mine:
            return {}
        if len(mine) == len(seqs):  # every row claimed (the usual batch)
            buckets = list(groups.items())
        else:
            claimed = set(mine)
            buckets = [(bucket, [i for i in rows if i in claimed]) for bucket, rows in groups.items()]
            buckets = [(bucket, rows) for bucket, rows in buckets if rows]
        buffers = self.scheduler.dispatch_buffered([bucket for bucket, _rows in buckets])
        if any(buffers) or any(self.dispatch.get(bucket) is not None for bucket, _rows in buckets):
            at = np.asarray(mine, dtype=np.int64)
            states = self._closed_states(
                np.asarray(dues, dtype=np.int64)[at],
                np.asarray(seqs, dtype=np.int64)[at],
                np.asarray(where, dtype=np.int64)[at],
                segs,
                # the same buckets: their buffers were read before the files, as it needs
                buffered_by={bucket: b for (bucket, _rows), b in zip(buckets, buffers)},
                now=True,
            )
            return {mine[k]: state for k, state in states.items()}
        out: dict[int, MessageState] = {}
        for bucket, rows in buckets:
            self._flush(bucket, True)  # another Cancel's tombstone may be written behind
            tombs = self.scheduler.known_tombstones(bucket)
            if tombs is not None:
                if not tombs:
                    continue
                cancelled = [seqs[i] in tombs for i in rows]
            else:
                seg = self.schedule.get(bucket)
                if seg is None:  # the cleaner removed it: nothing is pending there
                    continue
                if seg is segs[bucket]:
                    cancelled = self.finder.cancelled_few(seg, [where[i] for i in rows])
                else:
                    cancelled = self.finder.cancelled_among(seg, np.asarray([seqs[i] for i in rows])).tolist()
            if True in cancelled:
                for i, c in zip(rows, cancelled):
                    if c:
                        out[i] = MessageState.CANCELLED
        return out

    def _find_targets(self, targets: list[tuple[str, int | None, int | None]], now: bool = False) -> Places:
        """Where each target's message is, if it exists (``Places``). By id: the newest
        message with the id. By receipt: checked against its bucket's schedule index as a
        batch (``_held_by_segments``); one that check does not confirm is looked up in the
        id index (exactly this due time and sequence for the id), then by reading its
        record (``_locate``): with ``now``, _NotNow instead."""
        n = len(targets)
        places = Places(np.zeros(n, dtype=np.int64), np.full(n, -1, dtype=np.int64), np.full(n, -1, dtype=np.int64), {})
        committed = self.wal.committed_sequence
        by_id: list[int] = []
        rec: list[int] = []  # indexes of the receipts worth looking up
        mids, tdues, tseqs = zip(*targets) if targets else ((), (), ())
        if None not in tdues and None not in tseqs and 0 < min(tseqs) and max(tseqs) <= committed:
            rec = list(range(n))  # receipts alone, all committed (CancelBatch's usual batch)
            places.receipts = True
        else:
            for i, (due, seq) in enumerate(zip(tdues, tseqs)):
                if due is None or seq is None:
                    by_id.append(i)
                elif 0 < seq <= committed:
                    rec.append(i)
        unsure: list[int] = []  # found in a way that does not prove its segment is still there
        if by_id:
            for i, place in zip(by_id, self.resolve_ids([targets[i][0] for i in by_id])):
                if place is not None:  # as the index says: that is its message's record
                    places.dues[i], places.seqs[i] = place
            unsure = by_id
            got = [i for i in by_id if places.seqs[i] >= 0]
            if got:
                # confirmed in their minutes' indexes by one native search for the batch, as
                # receipts are: the closed-state look after the claim then reads their flags
                # where this found them (``_closed_states``), instead of searching each
                # minute again (~25 us a minute touched: a CancelBatch by id over 50 minutes)
                at = np.asarray(got, dtype=np.int64)
                held, where, _flagged = self._held_by_segments(
                    [targets[i][0] for i in got], places.dues[at], places.seqs[at], places.segs, now
                )
                places.where[at[held]] = where[held]
                sure = set(at[held].tolist())  # their segments are there: nothing more to check
                unsure = [i for i in by_id if i not in sure]
        if rec:
            if len(rec) == n:
                ids_l = list(mids)
                dues = np.array(tdues, dtype=np.int64)
                seqs = np.array(tseqs, dtype=np.int64)
            else:
                ids_l = [targets[i][0] for i in rec]
                dues = np.array([targets[i][1] for i in rec], dtype=np.int64)
                seqs = np.array([targets[i][2] for i in rec], dtype=np.int64)
            self._iterated(int(seqs.max()))
            held, where, _flagged = self._held_by_segments(ids_l, dues, seqs, places.segs, now)
            if len(rec) == n and bool(held.all()):  # every receipt confirmed (CancelBatch's usual batch)
                places.dues, places.seqs, places.where = dues, seqs, where
            else:
                at = np.asarray(rec, dtype=np.int64)
                places.dues[at[held]] = dues[held]
                places.seqs[at[held]] = seqs[held]
                places.where[at[held]] = where[held]
            rest = np.flatnonzero(~held).tolist()
            if rest and now:
                raise _NotNow
            if rest:
                index = self.ids
                if index is not None and index.failed is None:
                    again = index.holds([ids_l[k] for k in rest], dues[rest].tolist(), seqs[rest].tolist())
                else:
                    again = [False] * len(rest)
                for k, ok in zip(rest, again):
                    i, due, seq = rec[k], int(dues[k]), int(seqs[k])
                    if ok:
                        places.dues[i], places.seqs[i] = due, seq
                        unsure.append(i)
                    elif self._locate(ids_l[k], due, seq)[0] != MessageState.NOT_FOUND:
                        places.dues[i], places.seqs[i] = due, seq
        if unsure:
            listed = places.as_list()
            self._in_existing_buckets(listed, unsure)
            for i in unsure:
                if listed[i] is None:
                    places.seqs[i] = -1
        return places

    def _buckets(self, dues: np.ndarray) -> np.ndarray:
        """``bucket_of`` of each due time."""
        minutes = dues // naming.MS_PER_MINUTE
        return minutes - minutes % self.config.scale_minutes

    def _by_bucket(self, dues: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """(bucket, the rows of ``dues`` in it) for each bucket among ``dues``: one group
        without sorting when they all share a minute (a CancelBatch of a flash sale's)."""
        buckets = self._buckets(dues)
        if not len(buckets):
            return []
        b0 = buckets[0]
        if bool((buckets == b0).all()):
            return [(int(b0), np.arange(len(buckets)))]
        # one sort, then slices: a comparison per bucket cost ~5 us a minute touched (a batch
        # of retried sends over many minutes); rows stay ascending within their bucket
        order = np.argsort(buckets, kind="stable")
        ordered = buckets[order]
        cuts = (np.flatnonzero(ordered[1:] != ordered[:-1]) + 1).tolist()
        return [(int(ordered[a]), order[a:b]) for a, b in zip([0, *cuts], [*cuts, len(order)])]

    def _held_by_segments(
        self,
        ids: list[str],
        dues: np.ndarray,
        seqs: np.ndarray,
        segs: dict[int, Segment] | None = None,
        now: bool = False,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Whether the schedule segment of each receipt's bucket holds exactly that MESSAGE
        (sequence, due time and id), checked per bucket with one search of the segment's
        index (RecordFinder.holds_at: no record read, no id-index lookup), and where each
        held one's entry is in that index (-1: not held). False means "look further"
        (``_find_targets`` asks the id index, then reads the record). ``segs`` collects
        the segment searched per bucket, to which those places belong. Third: the CANCELLED
        flag of each held one as that search read it. ``now``: on the event loop (``_flush``)."""
        parts: list[tuple[Segment, np.ndarray]] = []
        for bucket, ks in self._by_bucket(dues):
            self._flush(bucket, now)  # a far-future message may still be written behind
            seg = self.schedule.get(bucket)
            if seg is None:
                continue
            if segs is not None:
                segs[bucket] = seg
            parts.append((seg, ks))
        return self.finder.holds_across(parts, seqs, dues, ids)

    def _in_existing_buckets(self, places: list[tuple[int, int] | None], which: list[int]) -> None:
        """Drop from ``places`` (at the indexes ``which``) those whose schedule segment the
        cleaner removed (the index keeps their ids; ``_locate`` answers NOT_FOUND for them)."""
        scale = self.config.scale_minutes
        gone: dict[int, bool] = {}
        for i in which:
            p = places[i]
            if p is not None:
                b = bucket_of(p[0], scale)
                if b not in gone:
                    gone[b] = self.schedule.get(b) is None
                if gone[b]:
                    places[i] = None

    def _closed_states(
        self,
        dues: np.ndarray,
        seqs: np.ndarray,
        where: np.ndarray | None = None,
        segs: dict[int, Segment] | None = None,
        flagged: np.ndarray | None = None,
        buffered_by: dict[int, bytes] | None = None,
        now: bool = False,
    ) -> dict[int, MessageState]:
        """Of the messages known to exist at (``dues``, ``seqs``), those no longer pending:
        row -> CANCELLED, DELIVERED or DEAD_LETTERED, read once per bucket (``_closed_state``
        is its one-message form, which also gives the DISPATCH records; it answers the rare
        messages some group closed). ``where`` and ``segs`` (from ``_held_by_segments``)
        let an unloaded bucket's tombstones be read from the index entries found then
        rather than by a second search; ``flagged`` (the CANCELLED flags that search read)
        spares even that read, for a caller that needs no look after a claim (a retried
        send: a message cancelled meanwhile was closed within the window, a duplicate all
        the same). ``now``: on the event loop (``_flush``)."""
        out: dict[int, MessageState] = {}
        sched = self.scheduler
        closed = np.zeros(len(seqs), dtype=bool)
        cancelled = np.zeros(len(seqs), dtype=bool)
        # where the caller's search found each row (-1: not found), with the segments searched
        placed = (where, where >= 0, segs) if where is not None and segs is not None else None
        from_flags: list[np.ndarray] = []  # rows whose tombstone flag ``flagged`` gives
        # per bucket only what a minute with something to say needs (a batch of retries can
        # touch a minute per message): no array work for a minute nothing was dispatched from
        groups = self._by_bucket(dues)
        # what the scheduler has not written yet (every bucket's, one hold of its lock), then
        # the files (outside it): a close is in one or the other (both while being written),
        # never in neither
        given = buffered_by or {}  # read by the caller, also before the files (_closed_few)
        unread = [bucket for bucket, _rows in groups if bucket not in given]
        read = dict(zip(unread, sched.dispatch_buffered(unread))) if unread else {}
        buffers = [given[bucket] if bucket in given else read[bucket] for bucket, _rows in groups]
        for (bucket, rows), buffered in zip(groups, buffers):
            self._flush(bucket, now)  # another Cancel's tombstone may be written behind
            seg = self.schedule.get(bucket)
            dseg = self.dispatch.get(bucket)
            if dseg is not None or buffered:
                bseqs = seqs[rows]
                got = self.dispatched.closed_among(dseg, bseqs)
                if buffered:
                    got |= np.isin(bseqs, reader.scan_columns(buffered).seqs)
                closed[rows] = got
            tombs = sched.known_tombstones(bucket)
            if tombs is not None:
                if tombs:
                    listed = seqs[rows].tolist()
                    if not tombs.isdisjoint(listed):
                        cancelled[rows] = np.fromiter((seq in tombs for seq in listed), dtype=bool, count=len(listed))
            elif seg is not None:  # an unloaded bucket: its segment's index says (no walk of the segment)
                if placed is not None and placed[2].get(bucket) is seg and bool(placed[1][rows].all()):
                    if flagged is not None:
                        from_flags.append(rows)
                    else:
                        cancelled[rows] = self.finder.cancelled_at(seg, placed[0][rows])
                else:
                    cancelled[rows] = self.finder.cancelled_among(seg, seqs[rows])
        if from_flags and flagged is not None:
            at = from_flags[0] if len(from_flags) == 1 else np.concatenate(from_flags)
            cancelled[at] = flagged[at]
        scale = self.config.scale_minutes
        for k in np.flatnonzero(closed | cancelled).tolist():
            if closed[k]:
                state = self._closed_state(bucket_of(int(dues[k]), scale), int(seqs[k]))[0]
                if state != MessageState.PENDING:
                    out[k] = state
            else:
                out[k] = MessageState.CANCELLED
        return out

    def _release_claims(self, sequences: list[int]) -> None:
        self.scheduler.release_cancels(sequences)

    async def get(self, message_id: str, deliver_at_ms: int | None, sequence: int | None) -> MessageStatus:
        return await asyncio.to_thread(self.get_sync, message_id, deliver_at_ms, sequence)

    def get_now(self, message_id: str, deliver_at_ms: int | None, sequence: int | None) -> MessageStatus | None:
        """``get_sync`` on the calling thread (the event loop's) when it would neither wait
        nor read much, else None (the caller then runs ``get`` on a worker thread).

        A Get whose minute is indexed costs ~30-80 us here; handing it to a worker thread
        and back cost more than that, and on a busy machine each hand-off is a thread
        waiting for a core (issue 13: Get p99). Not ready: the iterate service has not
        copied what the call must see, the bucket has records written behind, or the
        finder's or the dispatch index of the bucket would read more than a few KiB (the
        first Get of a minute builds its index: milliseconds) or is in use by a worker."""
        iterate = self.iterate
        if sequence is None or deliver_at_ms is None:  # by id: the index answers once iterated
            if self.ids is None or iterate.sequence < self._ids_current():
                return None
            found = self._index_get_many([message_id])[0][0]  # (a message not yet copied: declined below)
            if found is None:
                return MessageStatus(MessageState.NOT_FOUND, None, 0, 0)
            deliver_at_ms, sequence = found
        if 0 < sequence <= self.wal.committed_sequence:
            # as _iterated: also the records the log held at open (a tombstone of this one)
            if iterate.sequence < max(sequence, self._lookup_floor()) or not self._readable_now(
                bucket_of(deliver_at_ms, self.config.scale_minutes)
            ):
                return None
        try:
            return self.get_sync(message_id, deliver_at_ms, sequence, now=True)
        except _NotNow:  # written behind since the check: the flush would wait for the append lock
            return None

    def get_sync(
        self, message_id: str, deliver_at_ms: int | None, sequence: int | None, now: bool = False
    ) -> MessageStatus:
        """Get's answer. ``now`` (on the event loop, ``get_now``): _NotNow rather than a wait
        for the iterate service's append lock (``_flush``)."""
        if sequence is None or deliver_at_ms is None:  # by id
            found = self.resolve_id(message_id)
            if found is None:
                return MessageStatus(MessageState.NOT_FOUND, None, 0, 0)
            deliver_at_ms, sequence = found
        settles = self.scheduler.settles
        state, _off, msg, delivered_at, closes = self._locate(message_id, deliver_at_ms, sequence, True, now)
        # claimed by a Cancel: cancelled once its tombstone is durable, not while the write
        # that may still fail is under way
        if state == MessageState.PENDING and self.scheduler.cancel_written(sequence):
            state = MessageState.CANCELLED
        elif state == MessageState.PENDING and self.scheduler.settles != settles:
            # a claim settled during the look: its tombstone passed the iterate service after
            # the look and the claim ended before the question (a Cancel may have answered
            # CANCELLED, and this said PENDING); the tombstone is in the segment now
            state, _off, msg, delivered_at, closes = self._locate(message_id, deliver_at_ms, sequence, True, now)
        groups = self._group_states(msg, closes) if msg is not None and state != MessageState.CANCELLED else []
        return MessageStatus(state, msg, msg.deliver_at_ms if msg else deliver_at_ms, delivered_at, groups)

    def _locate(self, message_id: str, deliver_at_ms: int, sequence: int, detail: bool = False, now: bool = False):
        """Where a message stands: NOT_FOUND, PENDING, DELIVERED or CANCELLED.

        DELIVERED includes dead-lettered messages and, for Cancel, deliveries in flight.
        ``now``: on the event loop (``_flush``).
        """

        def answer(state, offset=0, msg=None, at=0):
            return (state, offset, msg, at, []) if detail else (state, offset)

        if sequence <= 0 or sequence > self.wal.committed_sequence:
            return answer(MessageState.NOT_FOUND)
        self._iterated(sequence)
        bucket = bucket_of(deliver_at_ms, self.config.scale_minutes)
        self._flush(bucket, now)  # a far-future record may still be written behind
        seg = self.schedule.get(bucket)
        if seg is None:
            return answer(MessageState.NOT_FOUND)
        frame = self.finder.find(seg, sequence)
        if frame is None or frame.kind != RecordKind.MESSAGE:
            return answer(MessageState.NOT_FOUND)
        msg = records.decode_message(frame.body)
        if msg.message_id != message_id or msg.deliver_at_ms != deliver_at_ms:
            return answer(MessageState.NOT_FOUND)
        state, delivered_at, closes = self._closed_state(bucket, sequence, seg, detail)
        if detail:
            return state, frame.offset, msg, delivered_at or 0, closes
        return answer(state, frame.offset, msg, delivered_at or 0)

    def _closed_state(
        self, bucket: int, sequence: int, seg: Segment | None = None, detail: bool = False
    ) -> tuple[MessageState, int | None, list[records.Dispatch]]:
        """(state, delivered_at, its DISPATCH records) of a record known to be in ``bucket``:
        DELIVERED (some group acknowledged it), DEAD_LETTERED (none did, some group gave up
        on it), CANCELLED or PENDING, found in the dispatch log and the index of tombstones
        (no segment walk)."""
        if seg is None:
            self.iterate.flush_bucket(bucket)  # another Cancel's tombstone may be written behind
            seg = self.schedule.get(bucket)
        # closed? what the scheduler has not written yet and whether it is in flight, taken
        # together (so that no ack slips between the looks), then the file (read outside
        # the scheduler's lock): a close is in one or the other, never in neither
        pending, _size, in_flight = self.scheduler.dispatch_view(bucket, sequence)
        closes = [records.decode_dispatch(f.body) for f in reader.frames(pending) if f.sequence == sequence]
        dseg = self.dispatch.get(bucket)
        offsets = self.dispatched.offsets(dseg, sequence)
        if offsets and dseg is not None:
            closes = [records.decode_dispatch(dseg.read_frame(off).body) for off in offsets] + closes
        delivered = [c for c in closes if c.outcome == records.Outcome.DELIVERED]
        if delivered:
            return MessageState.DELIVERED, delivered[0].dispatched_at_ms, closes
        if closes:
            return MessageState.DEAD_LETTERED, None, closes
        if in_flight and not detail:
            return MessageState.DELIVERED, None, closes
        tombs = self.scheduler.known_tombstones(bucket)  # a loaded bucket knows them all
        if tombs is not None:
            cancelled = sequence in tombs
        else:
            cancelled = seg is not None and self.finder.cancelled(seg, sequence)
        return (MessageState.CANCELLED if cancelled else MessageState.PENDING), None, closes

    def _group_states(
        self, msg: records.Message, closes: list[records.Dispatch]
    ) -> list[tuple[str, MessageState, int]]:
        """Per group of the message's subject that it is for: (name, state, delivered_at)."""
        out = []
        for g in sorted(self.scheduler.groups_of(msg.subject), key=lambda g: g.name):
            if msg.deliver_at_ms < g.since:
                continue  # due before the group existed: not for it
            mine = [c for c in closes if c.group == g.name]
            done = [c for c in mine if c.outcome == records.Outcome.DELIVERED]
            if done:
                out.append((g.name, MessageState.DELIVERED, done[0].dispatched_at_ms))
            elif mine:
                out.append((g.name, MessageState.DEAD_LETTERED, 0))
            else:
                out.append((g.name, MessageState.PENDING, 0))
        return out

    # --- delivery ---------------------------------------------------------------------------------

    def set_sink(self, sink: DeliverySink | None) -> None:
        self.scheduler.set_sink(sink)

    def ack(self, ack_ids: list[str], subject: str | None = None, group: str | None = None) -> int:
        """Acknowledge deliveries to ``group`` of ``subject`` (both None: whichever group
        has them in flight, for tools and tests)."""
        return self.scheduler.ack(ack_ids, self._gid(subject, group))

    def post_ack(self, ack_ids: list[str], subject: str, group: str) -> None:
        """``ack`` without waiting for the scheduler (the event loop): applied by the
        scheduler thread shortly, or before any Cancel, Get or stats look at deliveries."""
        self.scheduler.post_ack(ack_ids, self._gid(subject, group))

    def post_release(self, ack_ids: list[str], subject: str, group: str) -> None:
        """``release`` without waiting for the scheduler (the event loop)."""
        self.scheduler.post_release(ack_ids, self._gid(subject, group))

    def release(self, ack_ids: list[str], subject: str | None = None, group: str | None = None) -> int:
        """A consumer's stream ended with these deliveries unacknowledged: offer them again
        now (attempt + 1), not after the ack timeout; see Scheduler.release."""
        return self.scheduler.release(ack_ids, self._gid(subject, group))

    def _gid(self, subject: str | None, group: str | None) -> int | None:
        if subject is None:
            return None
        gid = self.scheduler.gid_of(subject, group or records.DEFAULT_GROUP)
        return -1 if gid is None else gid  # a deleted group: nothing of it is in flight

    # --- consumer groups --------------------------------------------------------------------------

    async def ensure_group(self, subject: str, group: str) -> bool:
        """Create ``group`` of ``subject`` unless it exists (True if created): a GROUP record
        in the message log (durable and replicated like a send), then the scheduler."""
        if self.scheduler.gid_of(subject, group) is not None:
            return False
        return await self._group_change(records.GroupOp.CREATE, subject, group)

    async def delete_group(self, subject: str, group: str) -> bool:
        """Delete a group: what it had due and in flight is dropped (True if it existed)."""
        if self.scheduler.gid_of(subject, group) is None:
            return False
        return await self._group_change(records.GroupOp.DELETE, subject, group)

    async def _group_change(self, op: int, subject: str, group: str) -> bool:
        self.check_writable()
        async with self._group_lock:  # group records apply in sequence order
            exists = self.scheduler.gid_of(subject, group) is not None
            if exists == (op == records.GroupOp.CREATE):
                return False  # another call did it meanwhile
            now = self.clock()
            rec = records.Group(op, subject, group)
            appended = await self.wal.append_async([(RecordKind.GROUP, now, records.encode_group(rec))])
            if self.replication_wait is not None:
                await self.replication_wait(appended.end_offset)
            # the iterate service may have applied the record already (it passes it right
            # after the commit): either way the change is made once; on a worker thread,
            # so that the event loop never waits for the scheduler's lock
            await asyncio.to_thread(self.scheduler.apply_group, rec, now, appended.first_sequence)
            return (self.scheduler.gid_of(subject, group) is not None) == (op == records.GroupOp.CREATE)

    def groups(self, subject: str | None = None, group: str | None = None) -> list[dict]:
        """Every group (or those of ``subject``, those named ``group``, or both), with its
        ready entries, spill state and deliveries in flight."""
        return self.scheduler.group_stats(subject, group)

    def notify_credit(self) -> None:
        self.scheduler.wake()

    # --- introspection ----------------------------------------------------------------------------

    def stats(self) -> dict:
        """Scheduler, iterate, log and replication figures.

        ``pending`` = messages - cancels - closed. Messages and cancels are counted per
        message-log record and saved with the iterate checkpoint (exact for the records
        before its offset; the replay after a restart counts the rest). Closed (delivered or
        dead-lettered) is counted from durable state: buckets already done are summed in the
        same checkpoint (``closed_retired``, with ``done_before``); loaded buckets recount
        their dispatch logs when loaded. So it is exact in operation and after a clean
        restart, and after a crash too once the loader has read the buckets to load (the
        first scheduler pass), with one exception: a finished bucket reopened by a late
        record *after* the last checkpoint has its closes from then until the crash counted
        nowhere (pending too high by at most that many, until the data folder is rebuilt).
        Messages in corrupt schedule records, never delivered, stay counted as pending. A
        promoted slave counts as pending the messages of buckets below its ``done_before``
        that the old master delivered.
        """
        s = self.scheduler.stats()
        c = self.iterate.counts
        s.update(
            pending=max(0, c["messages"] - c["cancels"] - self._closed_total()),
            iterate_lag_bytes=self.iterate.lag_bytes(),
            iterate_lag_records=self.iterate.lag_records(),
            role=self.role,
            epoch=self.epoch,
            committed_offset=self.wal.committed_offset,
            committed_sequence=self.wal.committed_sequence,
            iterate_offset=self.iterate.offset,
            iterate_steps=self.iterate.steps,
            fsyncs=self.wal.fsyncs,
            schedule_segments=len(self.schedule),
            open_files=self.pool.open_count,
            disk_full_waits=self.iterate.disk_full_waits + self.scheduler.dispatch_disk_full_total,
            id_filter_keys=self.ids.filter_keys if self.ids is not None else 0,
            id_filter_layers=self.ids.filter_layers if self.ids is not None else 0,
            healthy=self.healthy(),
        )
        if self.ids is not None:
            s.update(self.ids.memory())
        s.update(self.replication_stats())
        return s

    def healthy(self) -> bool:
        return (
            self.iterate.error is None and self.scheduler.error is None and self.wal.failed is None and not self._closed
        )
