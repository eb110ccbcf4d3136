"""The iterate service: message log -> schedule log.

It tails the message log from a durable *iterate offset*, copies every record into the
schedule segment of its due bucket (a CANCEL into its target's bucket), fsyncs the
segments it wrote, and only then saves the offset in ``checkpoint/iterate.ckpt``.
A crash between the schedule fsync and the checkpoint replays some records; each
schedule segment remembers its highest sequence, and a replayed record at or below it
is skipped, so re-running never duplicates.

Once records are in their schedule segments, the service publishes how far each bucket
it appended to is written (``on_written``: per bucket, the byte range just appended, a
lower bound of the due times in it and its highest sequence) and which sequences the
cancels in it target. That is the only route from the schedule log into the timer: the
scheduler's loader reads on from its cursor in each loaded bucket (``Scheduler.on_written``).

A full disk stalls copying instead of stopping it: a schedule write that finds no space is
tried again (with a growing pause) until space is freed, so nothing is skipped or written
twice, and the message log refuses new writes meanwhile. A checkpoint that finds no space
is left for the next one.

When it is not behind, the service lets the commits of ``gather`` seconds (2 ms by default,
``iterate_gather_ms``) share one step: a step costs about the same for one group commit
as for several, and a busy server commits every millisecond or so. While everything
committed since its last step is known to be due well ahead (at least a second, and ten
times ``gather_far``: the engine says so as it queues a send, ``expect_far``), nobody needs
those records soon (a step that late still puts them in the timer long before they are
due), and after that first ``gather`` it lets them gather on up to ``gather_far`` (20 ms,
``iterate_gather_far_ms``), asleep: the message log's writer wakes it at the commit of
anything not declared far, or of half a read's bytes (``MessageLog.on_commit``). Callers that wait for its progress
(``wait_for``: Get, Cancel, dedupe's catch-up) wake it at once.

Records of buckets beyond the scheduler's loading horizon are written behind: they
collect in one buffer per bucket and reach their segment with the next checkpoint (at
most ``checkpoint_interval`` later), when the buffers pass ``write_behind_bytes``, or when
a reader needs that bucket (``flush_bucket``: Cancel and Get). Far-future due times
spread a batch over dozens of minute files; writing each bucket once per checkpoint
instead of once per batch cut the iterate service's CPU per record several times (see
docs/benchmarks.md). Nothing is lost by a crash: the checkpoint moves only past records
whose segments were written and fsynced.
"""

from __future__ import annotations

import itertools
import logging
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from qdelay.errors import CorruptRecord, DiskFull
from qdelay.segments import checkpoint, framing, native, records
from qdelay.segments.bucket_log import BucketLog, sync_all, sync_dirs
from qdelay.segments.framing import RecordKind
from qdelay.segments.idindex import IdIndex
from qdelay.segments.naming import MS_PER_MINUTE
from qdelay.segments.reader import frame_length, route_py, scan_columns
from qdelay.segments.segment import Segment, disk_full
from qdelay.segments.wal import MessageLog
from qdelay.server import allocator

log = logging.getLogger("qdelay.iterate")

_MESSAGE = int(RecordKind.MESSAGE)  # plain ints: IntEnum attribute lookups cost ~0.5 µs
_CANCEL = int(RecordKind.CANCEL)
_TIMESTAMP = struct.Struct("<q")
_CANCEL_TARGET_AT = framing.HEADER_SIZE + 8  # CANCEL body: target due i64, then its sequence u64
_BYTE_OFFSETS = np.arange(8, dtype=np.int64)
# When ingest goes idle (the checkpoint that flushes the id index's memtable), the heap is
# trimmed IDLE_TRIMS times while the service stays idle: the first IDLE_TRIM_FIRST s later,
# then every IDLE_TRIM_EVERY s. RocksDB frees the memtable, and its flush's and compaction's
# buffers, in its own threads after the flush call returns, at times we cannot see: a trim
# right after the flush left ~1.0 MB of freed pages in RSS, one armed only by a flush left
# the same in the rounds without one (docs/benchmarks.md, "RSS per pending message").
IDLE_TRIMS = 3
IDLE_TRIM_FIRST = 0.25
IDLE_TRIM_EVERY = 1.0
_T = TypeVar("_T")
TRIM_AFTER_BYTES = 4 * 1024 * 1024  # a write-behind flush this large gives its memory back (_trim, when idle)
MAX_SPARES = 4096  # write-behind buffers kept for reuse, at most (IterateService._spares)


def _gather_i64(u8: np.ndarray, at: np.ndarray) -> np.ndarray:
    """The little-endian 64-bit integers at byte offsets ``at`` of ``u8``."""
    return u8[at[:, None] + _BYTE_OFFSETS].view("<i8").ravel()


@dataclass(slots=True)
class Written:
    """What one append to a bucket's schedule segment covered."""

    start: int  # the file offset the appended bytes begin at
    end: int  # ... and end at (the segment's size after the append)
    first_due: int  # a lower bound of the due times in them (for the timer's wake-up)
    last_sequence: int  # the highest sequence in them


# on_written(appended, cancels): bucket -> what was appended to it; bucket -> the
# sequences its CANCELs written target (a batch of tombstones settles per bucket, not one
# Python call a tombstone)
OnWritten = Callable[[dict[int, Written], dict[int, list[int]]], None]


class IterateService:
    def __init__(
        self,
        wal: MessageLog,
        schedule: BucketLog,
        checkpoint_path: str,
        *,
        start_offset: int,
        start_sequence: int,
        scale_minutes: int = 1,
        checkpoint_interval: float = 0.2,
        read_bytes: int = 4 * 1024 * 1024,
        extra_state: Callable[[], dict] | None = None,
        counts: dict | None = None,
        horizon: Callable[[], int] | None = None,
        write_behind_bytes: int = 8 * 1024 * 1024,
        ids: IdIndex | None = None,
        gather: float = 0.0,
        gather_far: float = 0.0,
    ) -> None:
        self.wal = wal
        self.ids = ids  # message id -> (due, sequence) of each MESSAGE copied
        self.schedule = schedule
        self.checkpoint_path = checkpoint_path
        self.offset = start_offset  # next message-log offset to copy
        self.sequence = start_sequence  # last sequence copied
        self.saved_offset = start_offset  # what the checkpoint on disk says
        self.scale = scale_minutes
        self.checkpoint_interval = checkpoint_interval
        self.read_bytes = read_bytes
        self.max_read_bytes = max(read_bytes, 16 * 1024 * 1024)
        self.extra_state = extra_state or (lambda: {})
        self.horizon = horizon
        # called with the append lock held, once bytes are in their schedule segments
        # (Scheduler.on_written on a master; the engine's slave bookkeeping on a slave)
        self.on_written: OnWritten | None = None
        # on_group(record, at_ms, sequence): a GROUP record passed (see Scheduler.apply_group)
        self.on_group: Callable[[records.Group, int, int], None] | None = None
        self.records_copied = 0
        # records passed, duplicates included, so the totals saved with a checkpoint are
        # exactly those of the records before its offset
        self.counts = {"messages": 0, "cancels": 0}
        self.counts.update(counts or {})
        self.duplicates_skipped = 0
        self.append_lock = threading.Lock()  # held while writing; the cleaner takes it to delete
        self._stop = threading.Event()
        self._progress = threading.Condition()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self._last_checkpoint = time.monotonic()
        self._persist_lock = threading.Lock()
        # write-behind buffers of far buckets (guarded by append_lock); each segment's
        # last_sequence already counts what its buffer holds
        self.write_behind_bytes = write_behind_bytes
        self._behind: dict[int, bytearray] = {}
        self._behind_bytes = 0
        # buffers written out, kept (with their allocations) for route to take for the next
        # buckets: a buffer grown again from nothing each checkpoint faulted in fresh pages
        # and realloc'ed its way up, ~0.1 us a message of this thread under bench.iterate.
        # At most ``write_behind_bytes`` of them (by their last content); dropped by the
        # trims once ingest went idle (``_trim``), so that RSS falls back as it did
        self._spares: list[bytearray] = []
        self._spare_bytes = 0
        # every step reads into this one buffer (wal.read_raw_into), grown to the largest read
        # asked for; dropped with the spares when ingest goes idle
        self._read_buf = bytearray()
        self.disk_full_waits = 0  # schedule writes retried for want of space
        # After a step that left little to copy, the next one waits up to ``gather`` seconds
        # for more commits to share it: a step costs about the same for one group commit as
        # for several (being woken, the GIL, the reads, the index's write, the schedule
        # appends), and a busy server commits every millisecond or so. Whoever waits for
        # progress (wait_for: Get, Cancel, the dedupe catch-up) ends the wait at once.
        self.gather = gather
        # ... and up to ``gather_far`` while every record committed since the last step is in
        # the newest run of sequences declared far (expect_far): (first, last), one tuple so
        # that it is read and replaced whole, without a lock, across threads
        self.gather_far = max(gather, gather_far)
        self._far: tuple[int, int] = (0, -1)
        self._hurry = threading.Event()
        # the iterate thread is in a far wait (_gather), which a commit may have to end
        self._waiting_far = False
        wal.on_commit = self._committed
        self.steps = 0
        self._trim_due = False  # write-behind buffers of several MiB were freed
        self._drop_spares = False  # ... and ingest went idle: the spares go too
        # trims left since ingest went idle, and when the next is due (IDLE_TRIMS)
        self._idle_trims = 0
        self._idle_trim_at = 0.0
        self._idle_owed = False  # records copied since the last idle checkpoint

    # --- control ------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="qdelay-iterate", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._hurry.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.error is None:
            try:
                self.checkpoint()
            except DiskFull:
                log.warning("no space for the final checkpoint: a restart copies again from the last one")
        else:
            # no final checkpoint, but one in the background may still be syncing segments
            # and the id index: the caller closes them once this returns
            with self._persist_lock:
                pass

    def lag_bytes(self) -> int:
        return max(0, self.wal.committed_offset - self.offset)

    def lag_records(self) -> int:
        return max(0, self.wal.committed_sequence - self.sequence)

    def expect_far(self, first: int, last: int) -> None:
        """Records ``first``..``last``, just queued in the message log, are all due well
        ahead (Engine.far_ahead_ms): no reader needs them soon, so they may wait up to
        ``gather_far`` for a step (a hint: records nobody declared are copied within
        ``gather``). Declarations of runs that follow on extend the newest."""
        f0, f1 = self._far
        self._far = (f0, last) if first == f1 + 1 else (first, last)

    def _only_far(self) -> bool:
        """Whether every record committed beyond those copied was declared far."""
        first, last = self._far
        return first <= self.sequence + 1 and last >= self.wal.committed_sequence

    def wait_for(self, sequence: int, timeout: float) -> bool:
        """Block until every record up to ``sequence`` is in the schedule log."""
        deadline = time.monotonic() + timeout
        if self.sequence < sequence:
            self._hurry.set()
        with self._progress:
            while self.sequence < sequence:
                left = deadline - time.monotonic()
                if left <= 0 or self.error is not None:
                    return False
                self._progress.wait(min(left, 0.05))
        return True

    # --- the loop -----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.step():
                    # an idle checkpoint is owed by the records copied since the last one, not
                    # only by an unsaved offset (a checkpoint that failed for want of space):
                    # the checkpoint a step asked for may already have saved every record, and
                    # the idle flush of the id index's memtable would never come
                    if (
                        (self._idle_owed or self.saved_offset != self.offset)
                        and time.monotonic() - self._last_checkpoint >= self.checkpoint_interval
                        and self._request_checkpoint(idle=True)
                    ):
                        self._idle_owed = False
                        self._idle_trims = IDLE_TRIMS
                        self._idle_trim_at = time.monotonic() + IDLE_TRIM_FIRST
                    if self._idle_trims and time.monotonic() >= self._idle_trim_at:
                        self._idle_trims -= 1
                        self._idle_trim_at = time.monotonic() + IDLE_TRIM_EVERY
                        self._trim_due = True
                        self._drop_spares = True
                    self._trim()
                    self.wal.wait_commit(self.offset, 0.05)
                elif self.gather > 0 and self.lag_bytes() < self.read_bytes // 2:
                    self._gather()
        except BaseException as err:  # surfaced through stats and health, never swallowed
            self.error = err
            log.exception("iterate service stopped")

    def _gather(self) -> None:
        """Let more commits share the next step: ``gather`` (only a ``wait_for`` ends it), then,
        while everything committed since is declared far (and not much of it), on up to
        ``gather_far`` in all. That second wait sleeps through, ended early by a
        ``wait_for`` or by a commit that makes it wrong (``_committed``, on the message log's
        writer): it used to look every ``gather`` whether it might go on sleeping (~10
        wake-ups a step, each a thread switch and a GIL hand-off, under bench.compare's
        ingest)."""
        if not self._hurry.wait(self.gather) and self.gather_far > self.gather and self._may_wait_far():
            # published before the last look, so that a commit landing after that look
            # finds it set and wakes the wait (_committed: its commit is visible first)
            self._waiting_far = True
            if self._may_wait_far():
                self._hurry.wait(self.gather_far - self.gather)
            self._waiting_far = False
        self._hurry.clear()  # (a wait_for begun just now is served by the next step)

    def _may_wait_far(self) -> bool:
        """Whether what is committed and not copied lets the far wait go on: all of it
        declared far, and less than half a read."""
        return self._only_far() and self.lag_bytes() < self.read_bytes // 2

    def _committed(self) -> None:
        """The message log committed more (its writer thread, after each commit): a far wait
        (``_gather``) ends once something not declared far was committed, or enough to read
        at once. Cheap when there is nothing to wake (most commits)."""
        if self._waiting_far and not self._may_wait_far():
            self._waiting_far = False
            self._hurry.set()

    def step(self) -> bool:
        """Copy one batch; return False when there was nothing to copy."""
        # Read more at once when behind: records spread over many buckets (far-future due
        # times land in up to 1,440 minute files a day) then share each bucket's append.
        lag = self.wal.committed_offset - self.offset
        want = min(self.max_read_bytes, max(self.read_bytes, lag // 4))
        if len(self._read_buf) < want:
            self._read_buf = bytearray(want)  # (no view of the old one is left: steps are sequential)
        data = self.wal.read_raw_into(self.offset, memoryview(self._read_buf)[:want])
        if self._behind and self.horizon is not None:
            # buckets the horizon reached since they were written behind go to disk now (the
            # loader wants them), and before any record of theirs is written at once, so
            # that a bucket's bytes stay in sequence order
            with self.append_lock:
                reach = self.horizon() + self.scale
                if self._behind and min(self._behind) <= reach:
                    self._flush_behind([b for b in self._behind if b <= reach])
        if not data:
            return False
        self.steps += 1
        with self.append_lock:
            # write at once everything up to one bucket past the horizon (the horizon may
            # move while this batch is copied: a bucket it passes meanwhile is flushed, and
            # published, at the start of the next step)
            near = self.horizon() + self.scale if self.horizon is not None else None
            if near is not None and self._behind and min(self._behind) <= near:
                self._flush_behind([b for b in self._behind if b <= near])
            used, last_seq, written, cancels = self._copy(data, near)
            if self.on_written is not None and written:
                self.on_written(written, cancels)
            if self._behind_bytes > self.write_behind_bytes:
                self._flush_behind(list(self._behind))
        with self._progress:
            self.offset += used
            self.sequence = max(self.sequence, last_seq)
            self._progress.notify_all()
        self._idle_owed = True
        if time.monotonic() - self._last_checkpoint >= self.checkpoint_interval:
            self._request_checkpoint()
        return True

    def _trim(self) -> None:
        """After a big write-behind flush, hand the freed heap back to the kernel: the
        buffers are many small blocks (a few KiB per minute file) that glibc keeps
        otherwise, and RSS would stay at their high-water mark (about write_behind_bytes).

        Called once a step finds nothing to copy, not after the step that flushed: while
        ingest goes on, the next checkpoint's buffers take the freed blocks again, and a
        trim after each checkpoint's flush cost ~1.8 ms of the iterate thread (malloc_trim
        walking the heap) and the page faults of taking the memory back, ~0.1 us a message
        under bench.compare's ingest (bench.iterate)."""
        if self._trim_due:
            self._trim_due = False
            if self._drop_spares:  # ingest went idle: their memory goes back too
                self._drop_spares = False
                with self.append_lock:
                    self._spares = []
                    self._spare_bytes = 0
                self._read_buf = bytearray()  # (this thread's own: no step runs meanwhile)
            allocator.trim()

    def written_behind(self, bucket: int) -> bool:
        """Whether ``bucket`` has records in the write-behind buffer (a reader would have
        to ``flush_bucket`` first): a look without the lock, for a caller deciding whether
        a lookup can run without waiting (Engine.get_now)."""
        return bucket in self._behind

    def flush_bucket(self, bucket: int) -> None:
        """Write ``bucket``'s records out of the write-behind buffer (a reader needs them).

        A bucket with nothing behind returns at once, without the append lock (which a step
        holds while it copies): a buffer leaves ``_behind`` only after it is written, and
        what a reader waited for (``wait_for``) was copied, so it is in the file or behind."""
        if bucket not in self._behind:
            return
        with self.append_lock:
            if bucket in self._behind:
                self._flush_behind([bucket])

    def flush_bucket_now(self, bucket: int) -> bool:
        """``flush_bucket`` if it need not wait: False, nothing written, when a step holds the
        append lock (the caller, on the event loop, then hands its look to a worker thread).
        A Cancel or Reschedule of a far minute finds that minute's earlier tombstones behind
        (each one's own); writing them here costs a pwrite, handing the claim to a worker
        thread and back ~0.5 ms of CPU."""
        if bucket not in self._behind:
            return True
        if not self.append_lock.acquire(blocking=False):
            return False
        try:
            if bucket in self._behind:
                self._flush_behind([bucket], wait=False)
        except OSError as err:
            if not disk_full(err):
                raise
            return False  # a full disk is waited out on a worker thread, not on the event loop
        finally:
            self.append_lock.release()
        return True

    def _until_space(self, write: Callable[..., _T], *args: Any) -> _T:
        """``write(*args)``, waiting out a full disk: tried again after a pause that grows to
        1 s, until it succeeds or the service stops (then DiskFull). The caller's state is
        untouched by a failed try (a segment's size moves only after a whole write)."""
        pause = 0.01
        while True:
            try:
                return write(*args)
            except OSError as err:
                if not disk_full(err):
                    raise
                if self.disk_full_waits == 0 or pause >= 1.0:
                    log.warning(
                        "disk full: copying to the schedule log waits for free space", extra={"error": str(err)}
                    )
                self.disk_full_waits += 1
                if self._stop.wait(pause):
                    raise DiskFull(f"stopped while waiting for disk space: {err}") from err
                pause = min(1.0, pause * 2)

    def _segment_of(self, bucket: int) -> Segment:
        return self._until_space(self.schedule.get_or_create, bucket)

    def _append(self, bucket: int, data: bytearray, wait: bool = True) -> int:
        """Append to a schedule segment; returns the offset the data starts at. ``wait``:
        a full disk is waited out (``_until_space``), else its OSError raised at once."""
        if not wait:
            return self.schedule.append(bucket, data)[1]
        return self._until_space(self.schedule.append, bucket, data)[1]

    def _flush_behind(self, buckets: list[int], wait: bool = True) -> None:
        """Append the write-behind buffers of ``buckets`` to their segments (append_lock
        held) and publish them: a bucket the scheduler loaded meanwhile (the horizon passed
        it) is read on by its loader. ``wait`` as for ``_append`` (a buffer not written
        stays behind)."""
        if not buckets:
            return
        freed = 0
        written: dict[int, Written] = {}
        for bucket in buckets:
            buf = self._behind[bucket]
            start = self._append(bucket, buf, wait)
            del self._behind[bucket]
            self._behind_bytes -= len(buf)
            freed += len(buf)
            self._spare(buf)
            seg = self.schedule.get(bucket)
            last = seg.last_sequence if seg is not None else 0
            written[bucket] = Written(start, start + len(buf), bucket * MS_PER_MINUTE, last)
        if freed >= TRIM_AFTER_BYTES:
            self._trim_due = True
        if self.on_written is not None:
            self.on_written(written, {})

    def _spare(self, buf: bytearray) -> None:
        """Keep a buffer just written out for route to take again (append_lock held)."""
        if self._spare_bytes + len(buf) <= self.write_behind_bytes and len(self._spares) < MAX_SPARES:
            self._spares.append(buf)
            self._spare_bytes += len(buf)

    def _copy(
        self, data: bytes | memoryview, near: int | None
    ) -> tuple[int, int, dict[int, Written], dict[int, list[int]]]:
        """Copy the whole frames at the start of ``data`` (message-log bytes from ``offset``)
        to their schedule segments, byte for byte.

        Returns (bytes used, last sequence, buckets written at once, the cancels written: per
        bucket, their targets' sequences).
        Records of buckets up to ``near`` (all of them if None) and cancels are written at
        once; the others are written behind, and the loader reads them from disk when their
        time comes, so a far-future message costs no Python object here.

        The walk from frame to frame (each frame's checksum verified) is the frame reader's
        (segments/reader.py: one call of the native codec or its Python twin); buckets,
        duplicate skipping and the per-bucket byte runs are computed with numpy over the
        whole read.
        """
        data, pos, st, kind, seq, due = self._scan(data)
        if len(st) == 0:
            return pos, self.sequence, {}, {}
        if self.ids is not None:
            is_msg = kind == _MESSAGE
            if is_msg.any():
                self.ids.put_frames(data, st[is_msg], due[is_msg], seq[is_msg])
        codec = native.codec
        route = codec.route if codec is not None else route_py
        spares = len(self._spares)
        handed, messages, ncancels, duplicates, unknown, copied, added = route(
            data,
            pos,
            st,
            kind,
            seq,
            due,
            self.scale,
            near,
            self._behind,
            self._segment_of,
            self._spares,
            self.schedule.by_bucket,
        )
        if len(self._spares) != spares:  # route took some: what is left is counted again
            self._spare_bytes = sum(map(len, self._spares)) if self._spares else 0
        self.counts["messages"] += messages
        self.counts["cancels"] += ncancels
        self.duplicates_skipped += duplicates
        self.records_copied += copied
        self._behind_bytes += added
        for i in unknown:
            if int(kind[i]) == RecordKind.GROUP:
                # a consumer group created or deleted: nothing to schedule; the scheduler
                # applies it (again, after a restart or on a slave: applying twice is harmless)
                start = int(st[i])
                end = int(st[i + 1]) if i + 1 < len(st) else pos
                if self.on_group is not None:
                    at = _TIMESTAMP.unpack_from(data, start + framing.TIMESTAMP_AT)[0]
                    body = bytes(data[start + framing.HEADER_SIZE : end])
                    self.on_group(records.decode_group(body), at, int(seq[i]))
                continue
            log.error(
                "unexpected record kind in message log",
                extra={"kind": int(kind[i]), "offset": self.offset + int(st[i])},
            )
        last_seq = max(self.sequence, int(seq[-1]))
        if not handed:
            return pos, last_seq, {}, {}
        # the buckets written at once: per bucket, a lower bound of the due times appended
        # and the highest sequence, as columns (a burst hands over ~100k records: no
        # object per record); a record that lands after bytes already in its bucket's
        # buffer may follow records written behind earlier (a cancel's target bucket), of
        # unknown due times in that bucket: the bucket's start bounds them
        n = len(handed)
        cols = np.fromiter(itertools.chain.from_iterable(handed), dtype=np.int64, count=3 * n).reshape(n, 3)
        idx, bks, behind_first = cols[:, 0], cols[:, 1], cols[:, 2] > 0
        dues = due[idx].copy()
        dues[behind_first] = np.minimum(dues[behind_first], bks[behind_first] * MS_PER_MINUTE)
        buckets, inverse = np.unique(bks, return_inverse=True)
        first_due = np.full(len(buckets), np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(first_due, inverse, dues)
        last_sequence = np.zeros(len(buckets), dtype=np.int64)
        np.maximum.at(last_sequence, inverse, seq[idx])
        # the cancels' targets, read at their fixed place in the verified frames (no Cancel
        # object per tombstone: a batch of tombstones is thousands of them)
        cancels: dict[int, list[int]] = {}
        is_cancel = kind[idx] == _CANCEL
        if is_cancel.any():
            u8 = np.frombuffer(data, dtype=np.uint8)
            targets = _gather_i64(u8, st[idx[is_cancel]] + _CANCEL_TARGET_AT)
            cbks = bks[is_cancel]
            if bool((cbks == cbks[0]).all()):  # a CancelBatch of one minute's messages
                cancels[int(cbks[0])] = targets.tolist()
            else:
                for b, target in zip(cbks.tolist(), targets.tolist()):
                    cancels.setdefault(b, []).append(target)
        written: dict[int, Written] = {}
        for b, fd, ls in zip(buckets.tolist(), first_due.tolist(), last_sequence.tolist()):
            buf = self._behind[b]
            at = self._append(b, buf)
            del self._behind[b]
            self._behind_bytes -= len(buf)
            self._spare(buf)
            written[b] = Written(at, at + len(buf), fd, ls)
        return pos, last_seq, written, cancels

    def _scan(
        self, data: bytes | memoryview
    ) -> tuple[bytes | memoryview, int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(data, end, starts, kinds, sequences, dues) of the whole, verified frames at the
        start of ``data`` (the frame reader's walk); a due is the body's first 8 bytes
        (MESSAGE and CANCEL bodies start with it). A frame larger than the read is read
        again, whole."""
        cols = scan_columns(data)
        if cols.bad >= 0:
            raise CorruptRecord(
                self._wal_path(), self.offset + cols.bad, "message-log record failed its checks while iterating"
            )
        if len(cols) == 0 and len(data) >= framing.HEADER_SIZE:  # one frame larger than a read
            length = frame_length(data)
            if framing.HEADER_SIZE + length > len(data):
                return self._scan(self.wal.read_raw(self.offset, framing.HEADER_SIZE + length))
        return data, cols.end, cols.starts, cols.kinds, cols.seqs, cols.dues

    def _wal_path(self) -> str:
        seg = self.wal.segment_at(self.offset)
        return seg.path if seg is not None else self.wal.directory

    def checkpoint(self) -> None:
        """Flush the schedule segments written so far, then save the offset (in that order).

        Synchronous (tests, shutdown); while running, the same happens in the background
        (``_request_checkpoint``) so copying never waits for the fsyncs.
        """
        with self._persist_lock:
            state, dirty = self._snapshot()
            self._persist(state, dirty)

    def _snapshot(self) -> tuple[dict[str, Any], tuple[list[Segment], list[str]]]:
        """On the iterate thread, between steps: the offset and the segments it depends on
        (written-behind records included: they are written out first)."""
        with self.append_lock:
            self._flush_behind(list(self._behind))
        state = {"offset": self.offset, "sequence": self.sequence}
        state.update(self.extra_state())
        state.update(self.counts)
        return state, (self.schedule.take_dirty(), self.schedule.take_dirty_dirs())

    def _persist(self, state: dict[str, Any], dirty: tuple[list[Segment], list[str]]) -> None:
        segments, dirs = dirty
        sync_all(segments)
        sync_dirs(dirs)
        if self.ids is not None:
            self.ids.sync()  # the ids of the records before this offset, durable with them
        try:
            checkpoint.write(self.checkpoint_path, state)
        except OSError as err:
            if not disk_full(err):
                raise
            # the segments are durable; the offset stays where it was, and the next
            # checkpoint (which covers these records too) tries again
            log.warning("no space for the iterate checkpoint; kept the previous one", extra={"error": str(err)})
            return
        self.saved_offset = state["offset"]

    def _request_checkpoint(self, idle: bool = False) -> bool:
        """Start a background checkpoint unless one is still being written (then False);
        ``idle``: nothing was left to copy, so the id index's memtable is written out after it."""
        self._last_checkpoint = time.monotonic()
        if not self._persist_lock.acquire(blocking=False):
            return False
        try:
            state, dirty = self._snapshot()
        except BaseException:
            # no checkpoint thread will release it: a leaked lock left stop() waiting forever
            # once the iterate thread had stopped on this error (seen in a test suite, 27 Nov)
            self._persist_lock.release()
            raise

        def run() -> None:
            try:
                self._persist(state, dirty)
                if idle and self.ids is not None:
                    self.ids.flush_idle()
            except BaseException as err:  # fsync failed: stop, as for any storage error
                self.error = err
                log.exception("iterate checkpoint failed")
            finally:
                self._persist_lock.release()

        threading.Thread(target=run, name="qdelay-iterate-checkpoint", daemon=True).start()
        return True
