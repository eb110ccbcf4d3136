"""The iterate service: message log -> schedule log.

It tails the message log from a durable *iterate offset*, copies every record into the
schedule segment of its due bucket (a CANCEL into its target's bucket), fsyncs the
segments it wrote, and only then saves the offset in ``checkpoint/iterate.ckpt``.
A crash between the schedule fsync and the checkpoint replays some records; each
schedule segment remembers its highest sequence, and a replayed record at or below it
is skipped, so re-running never duplicates.

Records are handed to the scheduler once written (``on_records``), so a message due
within the loaded window reaches the timer without waiting for a reload.

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

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from qdelay.segments import checkpoint, framing, records
from qdelay.segments.framing import RecordKind
from qdelay.errors import CorruptRecord
from qdelay.segments.naming import MS_PER_MINUTE
from qdelay.segments.segment import Segment
from qdelay.segments.wal import MessageLog
from qdelay.server.bucket_log import BucketLog, sync_all, sync_dirs

log = logging.getLogger("qdelay.iterate")


@dataclass(slots=True)
class Scheduled:
    """A record just written to a schedule segment."""

    kind: int
    bucket: int
    offset: int        # in the schedule segment
    sequence: int
    due: int           # the message's due time; for a CANCEL, its target's
    subject: bytes     # b"" for a CANCEL
    target: int        # for a CANCEL, the cancelled sequence; else 0
    size: int          # frame size in bytes


class IterateService:
    def __init__(self, wal: MessageLog, schedule: BucketLog, checkpoint_path: str, *,
                 start_offset: int, start_sequence: int, scale_minutes: int = 1,
                 checkpoint_interval: float = 0.2, read_bytes: int = 4 * 1024 * 1024,
                 extra_state: Callable[[], dict] | None = None, counts: dict | None = None,
                 horizon: Callable[[], int] | None = None, write_behind_bytes: int = 8 * 1024 * 1024) -> None:
        self.wal = wal
        self.schedule = schedule
        self.checkpoint_path = checkpoint_path
        self.offset = start_offset          # next message-log offset to copy
        self.sequence = start_sequence      # last sequence copied
        self.saved_offset = start_offset    # what the checkpoint on disk says
        self.scale = scale_minutes
        self.checkpoint_interval = checkpoint_interval
        self.read_bytes = read_bytes
        self.max_read_bytes = max(read_bytes, 16 * 1024 * 1024)
        self.extra_state = extra_state or (lambda: {})
        self.horizon = horizon
        # on_records(records, near): records copied for buckets <= near (None: all of them)
        self.on_records: Callable[[list[Scheduled], int | None], None] | None = None
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

    # --- control ------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="qdelay-iterate", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.error is None:
            self.checkpoint()

    def lag_bytes(self) -> int:
        return max(0, self.wal.committed_offset - self.offset)

    def lag_records(self) -> int:
        return max(0, self.wal.committed_sequence - self.sequence)

    def wait_for(self, sequence: int, timeout: float) -> bool:
        """Block until every record up to ``sequence`` is in the schedule log."""
        deadline = time.monotonic() + timeout
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
                    if time.monotonic() - self._last_checkpoint >= self.checkpoint_interval and \
                            self.saved_offset != self.offset:
                        self._request_checkpoint()
                    self.wal.wait_commit(self.offset, 0.05)
        except BaseException as err:  # surfaced through stats and health, never swallowed
            self.error = err
            log.exception("iterate service stopped")

    def step(self) -> bool:
        """Copy one batch; return False when there was nothing to copy."""
        # Read more at once when behind: records spread over many buckets (far-future due
        # times land in up to 1,440 minute files a day) then share each bucket's append.
        lag = self.wal.committed_offset - self.offset
        want = min(self.max_read_bytes, max(self.read_bytes, lag // 4))
        data = self.wal.read_raw(self.offset, want)
        if self._behind and self.horizon is not None:
            # buckets the horizon reached since they were written behind go to disk now (the
            # loader wants them), and before any record of theirs is handed over, so that
            # handed-over offsets stay in file order
            with self.append_lock:
                near = self.horizon() + self.scale
                if self._behind and min(self._behind) <= near:
                    self._flush_behind([b for b in self._behind if b <= near])
        if not data:
            return False
        with self.append_lock:
            # hand over everything up to one bucket past the horizon: the horizon may move
            # while this batch is copied (see Scheduler.on_records for the rest)
            near = self.horizon() + self.scale if self.horizon is not None else None
            if near is not None and self._behind and min(self._behind) <= near:
                self._flush_behind([b for b in self._behind if b <= near])
            used, last_seq, written = self._copy(data, near)
            if self.on_records is not None and (written or (near is not None and self.horizon() > near)):
                self.on_records(written, near)
            if self._behind_bytes > self.write_behind_bytes:
                self._flush_behind(list(self._behind))
        with self._progress:
            self.offset += used
            self.sequence = max(self.sequence, last_seq)
            self._progress.notify_all()
        if time.monotonic() - self._last_checkpoint >= self.checkpoint_interval:
            self._request_checkpoint()
        return True

    def flush_bucket(self, bucket: int) -> None:
        """Write ``bucket``'s records out of the write-behind buffer (a reader needs them)."""
        with self.append_lock:
            if bucket in self._behind:
                self._flush_behind([bucket])

    def _flush_behind(self, buckets: list[int]) -> None:
        """Append the write-behind buffers of ``buckets`` to their segments (append_lock held).

        A bucket the scheduler loaded meanwhile (the horizon passed it) is sent back to its
        loader, which reads on from its cursor: ``on_records`` with an empty list and a
        ``near`` just below the lowest bucket written does that.
        """
        if not buckets:
            return
        for bucket in buckets:
            buf = self._behind.pop(bucket)
            self.schedule.append(bucket, buf)
            self._behind_bytes -= len(buf)
        if self.on_records is not None:
            self.on_records([], min(buckets) - self.scale)

    def _copy(self, data: bytes, near: int | None) -> tuple[int, int, list[Scheduled]]:
        """Copy the whole frames at the start of ``data`` (message-log bytes from ``offset``)
        to their schedule segments, byte for byte.

        Returns (bytes used, last sequence, records handed to the scheduler). Records of
        buckets up to ``near`` (all of them if None) and cancels are written at once and
        handed over; the others are written behind, and the loader reads them from disk
        when their time comes, so a far-future message costs no Python object here.
        """
        unpack = framing.HEADER.unpack_from
        fixed = records.MESSAGE_FIXED.unpack_from
        xxh = framing._xxh
        hs, checked, magic_ok = framing.HEADER_SIZE, framing.CHECKED_FROM, framing.MAGIC
        scale = self.scale
        mv = memoryview(data)
        size = len(data)
        behind = self._behind
        segments: dict[int, Segment] = {}
        pending: list[tuple[int, int, Scheduled]] = []
        now_buckets: set[int] = set()
        counts = self.counts
        pos = 0
        copied = 0
        added = 0
        last_seq = self.sequence
        get_or_create = self.schedule.get_or_create
        while pos + hs <= size:
            magic, checksum, length, kind, version, _flags, seq, _ts = unpack(data, pos)
            end = pos + hs + length
            if end > size:
                if pos == 0:  # one frame larger than a read: fetch it whole
                    return self._copy(self.wal.read_raw(self.offset, hs + length), near)
                break
            if magic != magic_ok or version != framing.VERSION or xxh(mv[pos + checked:end]) != checksum:
                raise CorruptRecord(self._wal_path(), self.offset + pos,
                                    "message-log record failed its checks while iterating")
            last_seq = seq
            if kind == RecordKind.MESSAGE:
                due, slen = fixed(data, pos + hs)[:2]
                counts["messages"] += 1
                target = 0
            elif kind == RecordKind.CANCEL:
                c = records.decode_cancel(bytes(mv[pos + hs:end]))
                due, slen, target = c.deliver_at_ms, 0, c.target_sequence
                counts["cancels"] += 1
            else:
                log.error("unexpected record kind in message log", extra={
                    "kind": kind, "offset": self.offset + pos})
                pos = end
                continue
            minute = due // MS_PER_MINUTE
            bucket = minute - minute % scale
            seg = segments.get(bucket)
            if seg is None:
                seg = segments[bucket] = get_or_create(bucket)
            if seq <= seg.last_sequence:
                self.duplicates_skipped += 1
                pos = end
                continue
            seg.last_sequence = seq
            copied += 1
            buf = behind.get(bucket)
            if buf is None:
                buf = behind[bucket] = bytearray()
            if near is None or bucket <= near or kind == RecordKind.CANCEL:
                subject = bytes(mv[pos + hs + 20:pos + hs + 20 + slen]) if slen else b""
                pending.append((bucket, len(buf), Scheduled(kind, bucket, 0, seq, due, subject, target,
                                                            end - pos)))
                now_buckets.add(bucket)
            buf += mv[pos:end]
            added += end - pos
            pos = end
        self._behind_bytes += added
        base: dict[int, int] = {}
        for bucket in now_buckets:
            buf = behind.pop(bucket)
            base[bucket] = self.schedule.append(bucket, buf)[1]
            self._behind_bytes -= len(buf)
        written = []
        for bucket, at, rec in pending:
            rec.offset = base[bucket] + at
            written.append(rec)
        self.records_copied += copied
        return pos, last_seq, written

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

    def _snapshot(self) -> tuple[dict, list]:
        """On the iterate thread, between steps: the offset and the segments it depends on
        (written-behind records included: they are written out first)."""
        with self.append_lock:
            self._flush_behind(list(self._behind))
        state = {"offset": self.offset, "sequence": self.sequence}
        state.update(self.extra_state())
        state.update(self.counts)
        return state, (self.schedule.take_dirty(), self.schedule.take_dirty_dirs())

    def _persist(self, state: dict, dirty: tuple) -> None:
        segments, dirs = dirty
        sync_all(segments)
        sync_dirs(dirs)
        checkpoint.write(self.checkpoint_path, state)
        self.saved_offset = state["offset"]

    def _request_checkpoint(self) -> None:
        """Start a background checkpoint unless one is still being written."""
        self._last_checkpoint = time.monotonic()
        if not self._persist_lock.acquire(blocking=False):
            return
        state, dirty = self._snapshot()

        def run() -> None:
            try:
                self._persist(state, dirty)
            except BaseException as err:  # fsync failed: stop, as for any storage error
                self.error = err
                log.exception("iterate checkpoint failed")
            finally:
                self._persist_lock.release()

        threading.Thread(target=run, name="qdelay-iterate-checkpoint", daemon=True).start()
