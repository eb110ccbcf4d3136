"""The iterate service: message log -> schedule log.

It tails the message log from a durable *iterate offset*, copies every record into the
schedule segment of its due bucket (a CANCEL into its target's bucket), fsyncs the
segments it wrote, and only then saves the offset in ``checkpoint/iterate.ckpt``.
A crash between the schedule fsync and the checkpoint replays some records; each
schedule segment remembers its highest sequence, and a replayed record at or below it
is skipped, so re-running never duplicates.

Records are handed to the scheduler once written (``on_records``), so a message due
within the loaded window reaches the timer without waiting for a reload.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from qdelay.segments import checkpoint, framing, records
from qdelay.segments.framing import RecordKind
from qdelay.segments.naming import bucket_of
from qdelay.segments.wal import MessageLog
from qdelay.server.bucket_log import BucketLog

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
                 extra_state: Callable[[], dict] | None = None, counts: dict | None = None) -> None:
        self.wal = wal
        self.schedule = schedule
        self.checkpoint_path = checkpoint_path
        self.offset = start_offset          # next message-log offset to copy
        self.sequence = start_sequence      # last sequence copied
        self.saved_offset = start_offset    # what the checkpoint on disk says
        self.scale = scale_minutes
        self.checkpoint_interval = checkpoint_interval
        self.read_bytes = read_bytes
        self.extra_state = extra_state or (lambda: {})
        self.on_records: Callable[[list[Scheduled]], None] | None = None
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
                        self.checkpoint()
                    self.wal.wait_commit(self.offset, 0.05)
        except BaseException as err:  # surfaced through stats and health, never swallowed
            self.error = err
            log.exception("iterate service stopped")

    def step(self) -> bool:
        """Copy one batch; return False when there was nothing to copy."""
        frames, nxt = self.wal.read(self.offset, self.read_bytes)
        if not frames:
            return False
        with self.append_lock:
            written = self._copy(frames)
            if written and self.on_records is not None:
                self.on_records(written)
        with self._progress:
            self.offset = nxt
            self.sequence = max(self.sequence, frames[-1].sequence)
            self._progress.notify_all()
        if time.monotonic() - self._last_checkpoint >= self.checkpoint_interval:
            self.checkpoint()
        return True

    def _copy(self, frames) -> list[Scheduled]:
        per_bucket: dict[int, bytearray] = {}
        pending: list[tuple[int, int, Scheduled]] = []  # (bucket, position in its buffer, record)
        for f in frames:
            if f.kind == RecordKind.MESSAGE:
                due, subject, _mid = records.message_index_fields(f.body)
                target = 0
                self.counts["messages"] += 1
            elif f.kind == RecordKind.CANCEL:
                c = records.decode_cancel(f.body)
                due, subject, target = c.deliver_at_ms, b"", c.target_sequence
                self.counts["cancels"] += 1
            else:
                log.error("unexpected record kind in message log", extra={
                    "kind": f.kind, "offset": f.offset})
                continue
            bucket = bucket_of(due, self.scale)
            seg = self.schedule.get(bucket)
            if seg is not None and f.sequence <= seg.last_sequence:
                self.duplicates_skipped += 1
                continue
            buf = per_bucket.setdefault(bucket, bytearray())
            pending.append((bucket, len(buf), Scheduled(f.kind, bucket, 0, f.sequence, due, subject, target,
                                                        f.size)))
            buf += framing.encode(f.kind, f.sequence, f.timestamp, f.body)
        bases = {}
        for bucket, buf in per_bucket.items():
            seg, base = self.schedule.append(bucket, buf)
            bases[bucket] = base
        written: list[Scheduled] = []
        for bucket, pos, rec in pending:
            rec.offset = bases[bucket] + pos
            seg = self.schedule.get(bucket)
            if rec.sequence > seg.last_sequence:
                seg.last_sequence = rec.sequence
            written.append(rec)
        self.records_copied += len(written)
        return written

    def checkpoint(self) -> None:
        """Flush the schedule segments written so far, then save the offset (in that order)."""
        offset, sequence = self.offset, self.sequence
        self.schedule.sync()
        state = {"offset": offset, "sequence": sequence}
        state.update(self.extra_state())
        checkpoint.write(self.checkpoint_path, state)
        self.saved_offset = offset
        self._last_checkpoint = time.monotonic()
