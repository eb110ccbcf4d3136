"""The message log: qdelay's write-ahead log, with group commit.

Every accepted write (message or cancel tombstone) is a frame in the message log. Offsets
are global: a segment named by its base offset holds the bytes [base, base + size).

Group commit: appenders encode their records and queue them under a lock, which also
hands out sequences and offsets, so file order is sequence order. One writer thread
takes everything queued, writes it with one pwrite per segment and one fdatasync, then
completes every appender whose records it covered (the async ones with one wake-up of
their event loop per commit, ``_LoopSettler``). An append is acknowledged only once its
bytes are durable (flush policy ``sync``); ``interval:N`` acknowledges after the write
and fsyncs every N ms, which loses up to N ms of acknowledged writes on power loss. The
segment being written is kept zero-filled a little ahead of its end (preallocation), so an
fdatasync flushes data without a journal commit (docs/formats.md, "Preallocation").

Failures: a write that fails (ENOSPC) is cut back off the file and its appenders, and
everything queued behind them, get :class:`DiskFull`; the log stays usable. A failed
fdatasync poisons the log (:class:`WalFailed`) until it is reopened, because after such
a failure the kernel may have dropped the dirty pages and a retried fsync could lie.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NoReturn

import numpy as np

from qdelay.errors import (
    DiskFull,
    InvariantViolation,
    QdelayError,
    ShuttingDown,
    StorageError,
    WalFailed,
)
from qdelay.segments import framing, naming, reader
from qdelay.segments.framing import Frame
from qdelay.segments.segment import CorruptionPolicy, HandlePool, Recovery, Segment, disk_full, fsync_dir, recover

log = logging.getLogger("qdelay.wal")

DEFAULT_SEGMENT_BYTES = 64 * 1024 * 1024
DEFAULT_PREALLOC_BYTES = 1024 * 1024  # zeros kept ahead of the last record (docs/formats.md)

Entry = tuple[int, int, bytes]  # (kind, timestamp ms, body)


@dataclass(frozen=True, slots=True)
class FlushPolicy:
    """``sync``: ack after fdatasync. ``interval:N``: ack after write, fdatasync every N ms."""

    interval_ms: int = 0

    @classmethod
    def parse(cls, text: str) -> FlushPolicy:
        if text == "sync":
            return cls(0)
        if text.startswith("interval:"):
            try:
                ms = int(text.split(":", 1)[1].removesuffix("ms").strip())
            except ValueError:
                raise ValueError(f"flush policy {text!r}: interval:N needs N in whole ms, e.g. interval:5") from None
            if ms <= 0:
                raise ValueError("interval flush needs a positive number of ms")
            return cls(ms)
        raise ValueError(f"unknown flush policy {text!r}: use 'sync' or 'interval:N'")

    @property
    def is_sync(self) -> bool:
        return self.interval_ms == 0


@dataclass(frozen=True, slots=True)
class Appended:
    """Where a group of records landed: sequences [first, first + count), bytes [start, end)."""

    first_sequence: int
    count: int
    start_offset: int
    end_offset: int


# an async append's outcome, called on its loop: (appended, None) once durable, (None, error)
Settle = Callable[[Appended | None, Exception | None], None]


class _Pending:
    __slots__ = ("appended", "callback", "tombstones")

    def __init__(
        self,
        appended: Appended,
        callback: Callable[[Appended | None, Exception | None], None],
        tombstones: bool = False,
    ):
        self.appended = appended
        self.callback = callback
        # CANCEL records alone, or a Reschedule's whose new MESSAGE records the engine keeps
        # findable by id until copied (committed_past_tombstones)
        self.tombstones = tombstones


class _Waiter:
    """Completion of one blocking append: a bare lock, held until the writer releases it.

    Cheaper than ``threading.Event`` (no Condition, no waiter list): the single-record
    append path is dominated by this hand-off, not by encoding or the disk.
    """

    __slots__ = ("done", "appended", "error")

    def __init__(self) -> None:
        self.done = threading.Lock()
        self.done.acquire()
        self.appended: Appended | None = None
        self.error: Exception | None = None

    def __call__(self, appended: Appended | None, error: Exception | None) -> None:
        self.appended = appended
        self.error = error
        self.done.release()


class _LoopSettler:
    """Settles, on one event loop, the futures of the async appends a group commit
    completed, with one wake-up of the loop for the whole commit (one
    ``call_soon_threadsafe``: a write to the loop's self-pipe and a turn of the loop)
    instead of one per appender: a commit carries several SendStream batches when sends
    pipeline (bench.compare's ingest, ~3 a commit), and each wake-up is a syscall on the
    writer thread, a thread switch and a read on the loop (docs/benchmarks.md).

    ``put`` (the writer thread) queues a result; ``wake`` (the writer thread, after the
    commit's last ``put``) schedules ``_run`` unless one is already scheduled and has not
    started. ``_run`` clears that mark before it drains, so a result put after its last
    look is drained by the run ``wake`` then schedules.

    A result is for a future (``append_future``), or for a callback
    (``append_bodies_then``) that ``_run`` calls on the loop with ``(appended, error)``: an
    outcome nobody can cancel, one loop turn sooner than a future's done callback."""

    __slots__ = ("_loop", "_results", "_armed", "__weakref__")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        # weakly: the log's settlers are keyed weakly by their loop, and a strong reference
        # from the value kept every loop that ever appended alive (closed) for the log's life
        self._loop = weakref.ref(loop)
        self._results: collections.deque[tuple[asyncio.Future | Settle, Appended | None, Exception | None]] = (
            collections.deque()
        )
        self._armed = False

    def put(self, fut: asyncio.Future | Settle, appended: Appended | None, error: Exception | None) -> None:
        self._results.append((fut, appended, error))

    def wake(self) -> None:
        if self._armed:
            return
        loop = self._loop()
        if loop is None:  # the loop is gone: nobody is waiting any more
            self._results.clear()
            return
        self._armed = True
        try:
            loop.call_soon_threadsafe(self._run)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            self._armed = False
            self._results.clear()

    def _run(self) -> None:
        self._armed = False
        results = self._results
        while results:
            fut, appended, error = results.popleft()
            if not isinstance(fut, asyncio.Future):  # a callback (append_bodies_then)
                try:
                    fut(appended, error)
                except Exception:  # one appender's bug must not strand the others' results
                    log.exception("message log callback failed")
                continue
            if fut.done():  # cancelled by its caller
                continue
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(appended)


class _AsyncWaiter:
    """Completion of one async append: its future (or callback), settled through its loop's
    settler."""

    __slots__ = ("settler", "fut")

    def __init__(self, settler: _LoopSettler, fut: asyncio.Future | Settle) -> None:
        self.settler = settler
        self.fut = fut

    def __call__(self, appended: Appended | None, error: Exception | None) -> None:
        self.settler.put(self.fut, appended, error)
        self.settler.wake()


def _complete(waiters: list[_Pending], error: Exception | None) -> None:
    """Run the callbacks of appends the writer is done with (their records durable, or
    ``error``): the async ones queue their results and each loop is woken once, after
    the last (see _LoopSettler)."""
    settlers: list[_LoopSettler] = []
    for w in waiters:
        callback = w.callback
        try:
            if type(callback) is _AsyncWaiter:
                settler = callback.settler
                settler.put(callback.fut, None if error else w.appended, error)
                if not settlers or settlers[-1] is not settler:  # (one loop, nearly always)
                    settlers.append(settler)
            else:
                callback(None if error else w.appended, error)
        except Exception:  # a waiter's bug must not kill the log
            log.exception("message log callback failed")
    for settler in dict.fromkeys(settlers) if len(settlers) > 1 else settlers:
        settler.wake()


class MessageLog:
    def __init__(
        self,
        directory: str,
        *,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        flush: FlushPolicy | str = "sync",
        pool: HandlePool | None = None,
        corruption: CorruptionPolicy = CorruptionPolicy.FAIL,
        min_next_sequence: int = 1,
        prealloc_bytes: int = DEFAULT_PREALLOC_BYTES,
    ) -> None:
        self.directory = directory
        self.segment_bytes = segment_bytes
        self.prealloc_bytes = prealloc_bytes
        self.flush = FlushPolicy.parse(flush) if isinstance(flush, str) else flush
        self._owns_pool = pool is None
        self.pool = pool or HandlePool(64)
        self.corruption = corruption
        self.recoveries: list[Recovery] = []

        os.makedirs(directory, exist_ok=True)
        # Ordered by base offset. Readers use it without the lock, so it is only ever
        # appended to in place; removals build a new list (copy on write).
        self._segments: list[Segment] = []
        self._open(min_next_sequence)

        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        # what is submitted and not yet taken by the writer: per segment, each append's frames
        # as its own buffer (written with one pwritev, never joined on the appenders' side)
        self._queue: list[tuple[Segment, list[bytearray]]] = []
        self._waiters: list[_Pending] = []
        # the settler of each event loop that appends (_append_async), made on that loop
        self._settlers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopSettler] = weakref.WeakKeyDictionary()
        # planned tail: where the next queued record goes (ahead of what is written)
        tail = self._segments[-1]
        self._plan_segment = tail
        self._plan_size = tail.size
        self._next_sequence = self.committed_sequence + 1
        self._failed: Exception | None = None
        self._closing = False

        self._commit = threading.Condition(threading.Lock())
        self._last_sync = time.monotonic()
        # stats
        self.fsyncs = 0
        self.fsync_seconds_total = 0.0
        self.records_appended = 0
        self.on_fsync: Callable[[float], None] | None = None  # latency observer (metrics)
        # called (no arguments) on the committing thread after each commit moved the committed
        # offset: the iterate service's far wait listens (IterateService._committed)
        self.on_commit: Callable[[], None] | None = None
        self._writer = threading.Thread(target=self._write_loop, name="qdelay-wal-writer", daemon=True)
        self._writer.start()

    # --- opening and recovery -----------------------------------------------------------

    def _open(self, min_next_sequence: int) -> None:
        listed = naming.list_wal(self.directory)
        last_seq = min_next_sequence - 1
        expected_base = None
        # Only the newest segment holding records can have a torn tail: segments before it
        # were complete when the log rolled past them. They are taken at their file size and
        # their records are checked when read (iterate, replication, 'qdelay inspect
        # verify'), so opening costs the active segment, not the whole retention.
        sizes = [os.path.getsize(path) for _base, path in listed]
        with_data = [i for i, size in enumerate(sizes) if size]
        sealed = with_data[-1] if with_data else 0  # segments before this index are sealed
        for i, (base, path) in enumerate(listed):
            later = listed[i + 1 :]
            if i < sealed and (expected_base is None or base == expected_base):
                self._segments.append(Segment(path, base, self.pool, size=sizes[i]))
                expected_base = base + sizes[i]
                continue
            if expected_base is not None and base != expected_base:
                # A roll creates the next segment before the records queued for the previous
                # one are written; a crash in between leaves empty segments past the real end.
                if self._drop_unwritten(listed[i:]):
                    break
                raise InvariantViolation(
                    f"message log gap: {path} starts at offset {base}, previous segment ends at {expected_base}"
                )
            rec = recover(path, self.corruption)
            self.recoveries.append(rec)
            if rec.cut_bytes and later and not self._drop_unwritten(later):
                raise InvariantViolation(
                    f"message log segment {path} lost its tail at offset {rec.valid_size} but later "
                    f"segments hold records; run 'qdelay inspect verify' and restore from a replica"
                )
            seg = Segment(path, base, self.pool, size=rec.valid_size)
            if rec.records:
                seg.last_sequence = rec.last_sequence
                last_seq = max(last_seq, rec.last_sequence)
            elif self._segments and rec.cut_bytes:
                # the newest segment lost all its records: the last sequence is the sealed
                # one's before it
                last_seq = max(last_seq, self._last_sequence_of(self._segments[-1]))
            self._segments.append(seg)
            expected_base = base + rec.valid_size
            if rec.cut_bytes:
                break  # the later (empty) segments were just dropped
        if not self._segments:
            self._create_segment(0)
        self._segments[-1].prealloc = self.prealloc_bytes
        self.committed_offset = self._segments[-1].key + self._segments[-1].size
        self.committed_sequence = last_seq
        # the highest committed sequence but for appends of CANCEL records alone made by this
        # process (``submit_bodies`` of CANCEL) and for its Reschedules' appends (``covered``:
        # their new MESSAGE records are in the engine's moved ids until copied, Engine._moved):
        # a reader that needs every MESSAGE findable by id (a by-id lookup,
        # Engine.resolve_ids) waits for this, not for the tombstones a Cancel's or a
        # Reschedule's claims cover until they are copied. Everything found at open, or
        # replicated, counts (no claim of this process covers those tombstones).
        self.committed_past_tombstones = last_seq

    @staticmethod
    def _last_sequence_of(seg: Segment) -> int:
        last = -1
        for frame in seg.frames():
            last = frame.sequence
        return last

    def _drop_unwritten(self, listed: list[tuple[int, str]]) -> bool:
        """Delete segments that never got a byte (an interrupted roll); False if any has data."""
        if any(os.path.getsize(path) for _, path in listed):
            return False
        for _base, path in listed:
            log.warning("deleting an empty message-log segment left by an interrupted roll", extra={"path": path})
            os.unlink(path)
        fsync_dir(self.directory)
        return True

    def _create_segment(self, base: int) -> Segment:
        path = os.path.join(self.directory, naming.wal_name(base))
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        os.close(fd)
        fsync_dir(self.directory)
        seg = Segment(path, base, self.pool, size=0)
        seg.prealloc = self.prealloc_bytes
        self._segments.append(seg)
        return seg

    # --- appending ------------------------------------------------------------------------

    def submit(
        self,
        entries: Iterable[Entry],
        callback: Callable[[Appended | None, Exception | None], None],
        covered: bool = False,
    ) -> Appended:
        """Queue records; ``callback(appended, error)`` runs on the writer thread once durable.
        ``covered``: left out of ``committed_past_tombstones`` (a Reschedule's append)."""

        def frame(buf: bytearray, seq: int) -> int:
            encode_into = framing.encode_into
            for kind, timestamp, body in entries:
                encode_into(buf, kind, seq, timestamp, body)
                seq += 1
            return seq

        return self._submit(frame, callback, tombstones=covered)

    def submit_bodies(
        self,
        kind: int,
        timestamp: int,
        bodies: list[bytes],
        callback: Callable[[Appended | None, Exception | None], None],
    ) -> Appended:
        """:meth:`submit` for records of one kind and timestamp (a SendBatch)."""
        return self._submit(
            lambda buf, seq: framing.encode_many_into(buf, kind, seq, timestamp, bodies),
            callback,
            tombstones=kind == framing.RecordKind.CANCEL,
        )

    def _submit(
        self,
        frame: Callable[[bytearray, int], int],
        callback: Callable[[Appended | None, Exception | None], None],
        tombstones: bool = False,
    ) -> Appended:
        buf = bytearray()
        with self._lock:
            if self._failed is not None:
                raise self._failed
            if self._closing:
                raise ShuttingDown("the message log is closing")
            first = self._next_sequence
            seq = frame(buf, first)
            if seq == first:
                raise InvariantViolation("submit needs at least one record")
            if self._plan_size > 0 and self._plan_size + len(buf) > self.segment_bytes:
                base = self._plan_segment.key + self._plan_size
                try:
                    self._plan_segment = self._create_segment(base)
                except OSError as err:
                    if disk_full(err):
                        raise DiskFull("no room for a new message-log segment; free space and retry") from err
                    raise StorageError(f"cannot create a message-log segment: {err}") from err
                self._plan_size = 0
            start = self._plan_segment.key + self._plan_size
            # Kept as its own buffer, not copied onto the previous append's: that extend
            # reallocated and copied everything queued for the commit before it, on the event
            # loop, at each append (quadratic in the appends a commit gathers: 43 us a batch
            # of 100 at 10-16 batches a commit, docs/benchmarks.md "Ingest per thread, and the
            # event loop's two cuts"); the writer hands the list to one pwritev.
            queue = self._queue
            idle = not queue  # the writer waits only for an empty queue: woken by its first append
            if queue and queue[-1][0] is self._plan_segment:
                queue[-1][1].append(buf)
            else:
                queue.append((self._plan_segment, [buf]))
            self._plan_size += len(buf)
            self._next_sequence = seq
            appended = Appended(first, seq - first, start, start + len(buf))
            self._waiters.append(_Pending(appended, callback, tombstones))
            if idle:
                self._wake.notify()
        return appended

    def append(self, entries: Iterable[Entry], timeout: float | None = None) -> Appended:
        """Append and block until durable (or the flush policy's acknowledgement)."""
        waiter = _Waiter()
        self.submit(entries, waiter)
        if not waiter.done.acquire(timeout=-1 if timeout is None else timeout):
            raise TimeoutError("message log append timed out")
        if waiter.error is not None:
            raise waiter.error
        if waiter.appended is None:  # done with neither a result nor an error: a bug
            raise InvariantViolation("message log append finished without a result")
        return waiter.appended

    async def append_async(
        self, entries: Iterable[Entry], queued: Callable[[Appended], None] | None = None, covered: bool = False
    ) -> Appended:
        """Append from asyncio code; resolves once durable, without blocking the loop.
        ``queued(appended)`` runs once they are queued (their sequences known), before they
        are durable. ``covered``: as :meth:`submit`'s."""
        return await self._append_async(lambda cb: self.submit(entries, cb, covered), queued)

    async def append_bodies_async(
        self,
        kind: int,
        timestamp: int,
        bodies: list[bytes],
        queued: Callable[[Appended], None] | None = None,
    ) -> Appended:
        """:meth:`append_async` for records of one kind and timestamp; ``queued(appended)``
        runs once they are queued (their sequences known), before they are durable."""
        return await self._append_async(lambda cb: self.submit_bodies(kind, timestamp, bodies, cb), queued)

    def append_future(
        self, entries: Iterable[Entry], queued: Callable[[Appended], None] | None = None, covered: bool = False
    ) -> asyncio.Future[Appended]:
        """:meth:`append_async` without its await: the records are queued on return (or it
        raises), and the future settles, on the calling loop, once they are durable. For a
        caller that must act on the outcome even if it is cancelled meanwhile (it awaits the
        future through ``asyncio.shield``): a cancelled ``append_async`` leaves the records
        to be written with nobody told."""
        return self._append_future(lambda cb: self.submit(entries, cb, covered), queued)

    def append_bodies_future(
        self,
        kind: int,
        timestamp: int,
        bodies: list[bytes],
        queued: Callable[[Appended], None] | None = None,
    ) -> asyncio.Future[Appended]:
        """:meth:`append_future` for records of one kind and timestamp."""
        return self._append_future(lambda cb: self.submit_bodies(kind, timestamp, bodies, cb), queued)

    def append_bodies_then(
        self,
        kind: int,
        timestamp: int,
        bodies: list[bytes],
        done: Settle,
        queued: Callable[[Appended], None] | None = None,
    ) -> Appended:
        """:meth:`append_bodies_future` with a callback instead of a future: the records are
        queued on return (or it raises, and ``done`` is never called), and ``done(appended,
        None)`` once durable, or ``done(None, error)``, runs on the calling loop (in the
        settler's turn, no turn of its own). Nobody can cancel it, so what must follow the
        write (an idempotent send's ids) follows it without ``asyncio.shield``, and a
        SendStream batch needs no task (DelayService._start_write)."""
        loop = asyncio.get_running_loop()
        settler = self._settler(loop)
        appended = self.submit_bodies(kind, timestamp, bodies, _AsyncWaiter(settler, done))
        if queued is not None:
            queued(appended)
        return appended

    async def _append_async(self, submit: Callable, queued: Callable[[Appended], None] | None = None) -> Appended:
        return await self._append_future(submit, queued)

    def _settler(self, loop: asyncio.AbstractEventLoop) -> _LoopSettler:
        settler = self._settlers.get(loop)
        if settler is None:
            settler = self._settlers[loop] = _LoopSettler(loop)
        return settler

    def _append_future(
        self, submit: Callable, queued: Callable[[Appended], None] | None = None
    ) -> asyncio.Future[Appended]:
        loop = asyncio.get_running_loop()
        settler = self._settler(loop)
        fut = loop.create_future()
        appended = submit(_AsyncWaiter(settler, fut))
        if queued is not None:
            queued(appended)
        return fut

    # --- the writer thread ----------------------------------------------------------------

    def _write_loop(self) -> None:
        try:
            self._write_until_closed()
        except BaseException as err:  # never leave appenders waiting on a dead writer
            self._writer_failed(err)

    def _write_until_closed(self) -> None:
        interval = self.flush.interval_ms / 1000.0
        while True:
            with self._lock:
                while not self._queue and not self._closing:
                    if interval and self._unsynced():
                        left = interval - (time.monotonic() - self._last_sync)
                        if left <= 0 or not self._wake.wait(left):
                            break
                    else:
                        self._wake.wait()
                queue, self._queue = self._queue, []
                waiters, self._waiters = self._waiters, []
                closing = self._closing
            if queue:
                self._commit_batch(queue, waiters)
            elif interval and self._unsynced():
                self._sync_idle()
            # not held while the log waits for the next append: the last commit's buffers
            # (up to a commit's bytes) and its appenders (an async one's future, and through
            # it its event loop)
            queue, waiters = [], []
            if closing:
                with self._lock:
                    if self._queue:
                        continue  # submitted before close() was called: write it first
                if self._unsynced():
                    self._sync_idle()  # interval policy: nothing acknowledged stays unsynced
                return

    def _commit_batch(self, queue: list[tuple[Segment, list[bytearray]]], waiters: list[_Pending]) -> None:
        """Write one batch (and fdatasync it under the sync policy), then complete its appenders."""
        try:
            error = self._write(queue, waiters)
            if error is None:
                end = waiters[-1].appended
                with self._commit:
                    self.committed_offset = end.end_offset
                    self.committed_sequence = end.first_sequence + end.count - 1
                    for w in reversed(waiters):
                        if not w.tombstones:
                            self.committed_past_tombstones = w.appended.first_sequence + w.appended.count - 1
                            break
                    self.records_appended += sum(w.appended.count for w in waiters)
                    self._commit.notify_all()
                self._committed()
        except Exception as err:  # a bug, not an I/O error (those are handled in _write)
            error = self._writer_failed(err)
        _complete(waiters, error)

    def _committed(self) -> None:
        on_commit = self.on_commit
        if on_commit is not None:
            try:
                on_commit()
            except Exception:  # a listener's bug must not kill the log
                log.exception("message log commit listener failed")

    def _sync_idle(self) -> None:
        try:
            self._sync_segments(self._segments[-2:])
        except WalFailed:
            log.exception("message log fdatasync failed; the log refuses appends until reopened")

    def _unsynced(self) -> bool:
        return any(s.synced_size != s.size for s in self._segments[-2:])

    def _write(self, queue: list[tuple[Segment, list[bytearray]]], waiters: list[_Pending]) -> Exception | None:
        written: list[tuple[Segment, int]] = []
        try:
            if len(queue) == 1 and self.flush.is_sync:
                # nearly every commit: one segment, written and synced in one call that
                # releases the GIL once (Segment.append_synced)
                seg, chunks = queue[0]
                before = seg.size
                if before == 0:
                    self._seal_before(seg)
                written.append((seg, before))
                sync_errno, took = seg.append_synced(chunks)
                if sync_errno:
                    self._sync_failed(OSError(sync_errno, os.strerror(sync_errno)))
                self._synced(took)
                return None
            for seg, chunks in queue:
                before = seg.size
                if before == 0:
                    self._seal_before(seg)
                written.append((seg, before))
                seg.append_many(chunks)
            if self.flush.is_sync or time.monotonic() - self._last_sync >= self.flush.interval_ms / 1000:
                self._sync_segments([seg for seg, _ in written])
            return None
        except OSError as err:
            return self._fail_write(err, written)
        except QdelayError as err:
            return err

    def _seal_before(self, seg: Segment) -> None:
        """Before the first write into ``seg``, the segment before it loses its preallocated
        zeros: only the newest segment holding records may end in zeros."""
        i = bisect.bisect_left(self._segments, seg.key, key=_segment_key)
        if i > 0:
            self._segments[i - 1].trim()

    def _sync_segments(self, segments: list[Segment]) -> None:
        started = time.monotonic()
        try:
            for seg in {id(s): s for s in segments}.values():
                seg.sync()
        except OSError as err:
            self._sync_failed(err)
        self._synced(time.monotonic() - started)

    def _sync_failed(self, err: OSError) -> NoReturn:
        failure = WalFailed(f"fdatasync of the message log failed: {err}; restart to recover")
        self._poison(failure)
        raise failure from err

    def _synced(self, took: float) -> None:
        self._last_sync = time.monotonic()
        self.fsyncs += 1
        self.fsync_seconds_total += took
        if self.on_fsync is not None:
            self.on_fsync(took)

    def _fail_write(self, err: OSError, written: list[tuple[Segment, int]]) -> Exception:
        """Undo a failed write so the file holds only acknowledged records, then reject."""
        try:
            for seg, before in reversed(written):
                seg.truncate(before)
        except OSError as cut_err:
            failure: Exception = WalFailed(f"message log write failed ({err}) and could not be undone ({cut_err})")
            self._poison(failure)
            return failure
        if disk_full(err):
            failure = DiskFull("the disk holding the message log is full; free space and retry")
        else:
            failure = WalFailed(f"message log write failed: {err}")
        # everything queued behind the failed write holds sequences after it: reject it too,
        # and hand the same sequences and offsets out again
        with self._lock:
            rejected, self._waiters = self._waiters, []
            self._queue = []
            while len(self._segments) > 1:  # a roll planned for the failed write: undo it
                tail, prev = self._segments[-1], self._segments[-2]
                if tail.size or tail.key == prev.key + prev.size:
                    break
                self._drop_empty_tail()
            tail = self._segments[-1]
            self._plan_segment = tail
            self._plan_size = tail.size
            self._next_sequence = self.committed_sequence + 1
            if isinstance(failure, WalFailed):
                self._failed = failure
        _complete(rejected, failure)
        log.warning("message log write failed", extra={"error": str(err)})
        return failure

    def _drop_empty_tail(self) -> None:
        seg = self._segments[-1]
        self._segments = self._segments[:-1]
        self.pool.forget(seg.path)
        os.unlink(seg.path)

    def _writer_failed(self, err: BaseException) -> WalFailed:
        """The writer met an error that is not an I/O error: a bug, or a native codec older
        than this code (a stale build without ``write_sync`` raised AttributeError here, and
        the dead thread left every appender waiting until its deadline, health SERVING). What
        reached the files is unknown, so the log refuses appends until it is reopened, whose
        recovery reads what is really there; the appenders in hand and queued are refused now
        (health turns NOT_SERVING through ``failed``)."""
        failure = WalFailed(f"the message log's writer failed ({type(err).__name__}: {err}); restart to recover")
        log.error("message log writer failed; the log refuses appends until reopened", exc_info=err)
        self._poison(failure)
        return failure

    def _poison(self, failure: Exception) -> None:
        with self._lock:
            self._failed = failure
            rejected, self._waiters = self._waiters, []
            self._queue = []
        _complete(rejected, failure)

    # --- reading --------------------------------------------------------------------------

    def wait_commit(self, beyond: int, timeout: float) -> int:
        """Block until the committed offset passes ``beyond`` (or timeout); return it."""
        with self._commit:
            if self.committed_offset <= beyond:
                self._commit.wait(timeout)
            return self.committed_offset

    def segment_at(self, offset: int) -> Segment | None:
        segments = self._segments
        i = bisect.bisect_right(segments, offset, key=_segment_key) - 1
        return segments[i] if i >= 0 else None

    def read(self, offset: int, max_bytes: int = 4 * 1024 * 1024) -> tuple[list[Frame], int]:
        """Committed frames from ``offset`` (global); returns (frames, next offset).

        Frames carry global offsets. Reads stop at a segment end; the next call moves on.
        """
        limit = self.committed_offset
        if offset >= limit:
            return [], offset
        segments = self._segments  # one snapshot: delete_before replaces the list, never edits it
        i = bisect.bisect_right(segments, offset, key=_segment_key) - 1
        if i < 0:
            raise InvariantViolation(
                f"offset {offset} is before the oldest message-log segment ({segments[0].key}); it was cleaned"
            )
        seg = segments[i]
        end = min(seg.key + seg.size, limit)
        if offset >= end:
            if i + 1 < len(segments):
                return self.read(segments[i + 1].key, max_bytes)
            return [], offset
        frames = []
        taken = 0
        for f in seg.frames(offset - seg.key, end - seg.key):
            frames.append(Frame(seg.key + f.offset, f.kind, f.sequence, f.timestamp, f.body))
            taken += f.size
            if taken >= max_bytes:
                break
        nxt = frames[-1].offset + frames[-1].size
        return frames, nxt

    def read_raw(self, offset: int, max_bytes: int) -> bytes:
        """Committed bytes from ``offset`` within one segment (for replication)."""
        limit = self.committed_offset
        seg = self.segment_at(offset)
        if seg is None or offset >= limit:
            return b""
        end = min(seg.key + seg.size, limit)
        if offset >= end:
            nxt = self.segment_at(end)
            return self.read_raw(end, max_bytes) if nxt is not None and nxt is not seg else b""
        return seg.read(offset - seg.key, min(max_bytes, end - offset))

    def read_raw_into(self, offset: int, buf: memoryview) -> memoryview:
        """``read_raw`` into ``buf`` (at most its length) instead of a new bytes object: the part
        of ``buf`` read. The iterate service reads every step into one buffer of its own: a new
        bytes object of half a megabyte each step was mapped fresh (past glibc's mmap
        threshold) or taken from the heap the write-behind buffers had just given back, and
        faulted in page by page either way (docs/benchmarks.md, "The iterate thread: cache
        misses and page faults")."""
        limit = self.committed_offset
        seg = self.segment_at(offset)
        if seg is None or offset >= limit:
            return buf[:0]
        end = min(seg.key + seg.size, limit)
        if offset >= end:
            nxt = self.segment_at(end)
            return self.read_raw_into(end, buf) if nxt is not None and nxt is not seg else buf[:0]
        view = buf[: min(len(buf), end - offset)]
        return view[: seg.read_into(offset - seg.key, view)]

    # --- replication (slave side) ---------------------------------------------------------

    def append_raw(self, data: bytes, expected_offset: int, segment_base: int) -> list[int]:
        """Append frames copied byte-for-byte from a master, durably (a slave's only write).

        Every frame is checked (magic, version, whole, checksum) and its sequence must follow
        the previous one; ``expected_offset`` must be where this log ends, and
        ``segment_base`` the base of the master's segment holding the bytes, so segments
        start where the master's did. Nothing is written when a check fails
        (:class:`CorruptRecord` / :class:`InvariantViolation`). Returns the frames' timestamps.
        """
        cols = reader.scan_columns(data)  # verifies every frame; judged below, in order
        n = len(data)
        with self._lock:
            if self._failed is not None:
                raise self._failed
            if self._closing:
                raise ShuttingDown("the message log is closing")
            if self._queue or self._waiters:
                raise InvariantViolation("append_raw on a log with local appends queued")
            end = self._plan_segment.key + self._plan_size
            if expected_offset != end:
                raise InvariantViolation(
                    f"replicated bytes start at offset {expected_offset}, but this message log ends at {end}"
                )
            seq = self._next_sequence
            # the verified frames' sequences must follow on (the first that does not is
            # reported before any damage after it), then the chunk must be whole frames
            off = np.flatnonzero(cols.seqs != np.arange(seq, seq + len(cols), dtype=np.int64))
            if len(off):
                k = int(off[0])
                raise InvariantViolation(
                    f"replicated frame at offset {end + int(cols.starts[k])} has sequence "
                    f"{int(cols.seqs[k])}, expected {seq + k}"
                )
            reader.require_whole(cols, "replicated message-log chunk", end)
            stamps: list[int] = reader.gather(data, cols.starts, framing.TIMESTAMP_AT, 8).tolist()
            seq += len(cols)
            if not stamps:
                return stamps
            seg = self._plan_segment
            if segment_base == end and self._plan_size > 0:
                seg = self._create_segment(end)
            elif segment_base != seg.key:
                raise InvariantViolation(
                    f"replicated bytes at {end} belong to the master's segment "
                    f"{segment_base}, this log's tail segment starts at {seg.key}"
                )
            before = seg.size
            try:
                if before == 0:
                    self._seal_before(seg)
                seg.append(data)
                self._sync_segments([seg])
            except OSError as err:
                try:
                    seg.truncate(before)
                except OSError:
                    pass
                if disk_full(err):
                    raise DiskFull("the disk holding the message log is full") from err
                raise StorageError(f"cannot write replicated bytes: {err}") from err
            seg.last_sequence = seq - 1
            self._plan_segment = seg
            self._plan_size = seg.size
            self._next_sequence = seq
        with self._commit:
            self.committed_offset = end + n
            self.committed_sequence = self.committed_past_tombstones = seq - 1
            self.records_appended += len(stamps)
            self._commit.notify_all()
        self._committed()
        return stamps

    def truncate_to(self, offset: int, last_sequence: int) -> int:
        """Cut the log at ``offset`` (a frame boundary; ``last_sequence`` is the sequence of
        the frame before it): a divergent tail, before re-attaching as a slave. Returns the
        number of bytes removed. Only for a log without local appends in flight."""
        removed = 0
        with self._lock:
            if self._queue or self._waiters:
                raise InvariantViolation("truncate_to on a log with appends queued")
            if offset < self._segments[0].key:
                raise InvariantViolation(f"cannot truncate to {offset}: before the oldest segment")
            while len(self._segments) > 1 and self._segments[-1].key >= offset:
                seg = self._segments[-1]
                removed += seg.size
                self._drop_empty_tail()
            seg = self._segments[-1]
            if seg.key + seg.size > offset:
                removed += seg.key + seg.size - offset
                seg.truncate(offset - seg.key)
            seg.last_sequence = last_sequence
            fsync_dir(self.directory)
            self._plan_segment = seg
            self._plan_size = seg.size
            self._next_sequence = last_sequence + 1
        with self._commit:
            self.committed_offset = seg.key + seg.size
            self.committed_sequence = self.committed_past_tombstones = last_sequence
            self._commit.notify_all()
        return removed

    @property
    def first_offset(self) -> int:
        return self._segments[0].key

    def segments(self) -> list[Segment]:
        return list(self._segments)

    def delete_before(self, offset: int) -> list[str]:
        """Delete whole segments that end at or before ``offset``; never the active one.

        Nor the last segment holding a committed record: the highest sequence must stay on
        disk, or a restart after a roll whose first write never happened would hand out
        sequence 1 again.
        """
        removed = []
        with self._lock:
            keep = 0
            for seg in self._segments[:-1]:
                end = seg.key + seg.size
                if end > offset or seg is self._plan_segment or end >= self.committed_offset:
                    break
                keep += 1
            doomed, self._segments = self._segments[:keep], self._segments[keep:]
            for seg in doomed:
                self.pool.forget(seg.path)
                os.unlink(seg.path)
                removed.append(seg.path)
        if removed:
            fsync_dir(self.directory)
        return removed

    @property
    def failed(self) -> Exception | None:
        return self._failed

    def close(self) -> None:
        """Write and sync everything submitted so far, stop the writer, release the files."""
        with self._lock:
            self._closing = True
            self._wake.notify()
        self._writer.join()
        if self._failed is None:
            try:
                for seg in self._segments[-2:]:  # a cleanly closed log ends at its last record
                    seg.trim()
            except OSError as err:
                log.warning("could not cut the preallocated zeros off the message log", extra={"error": str(err)})
        if self._owns_pool:
            self.pool.close()


def _segment_key(seg: Segment) -> int:
    return seg.key
