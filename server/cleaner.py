"""The cleaner: deletes what no message needs any more, and nothing else.

- A message-log segment goes once it is wholly behind the *saved* iterate checkpoint
  (so a restart never needs it), behind the last record of every slave the master holds
  the log for (``engine.replication_floor()``: the lowest offset such a slave confirmed;
  the segment holding the record before it stays, see ``message_log_floor``), and older
  than ``message_retention_ms``. The active segment is never deleted.
- A schedule segment (and its dispatch segment) goes once its bucket is below the
  scheduler's ``done_before`` and not reopened — every message in it delivered or
  dead-lettered for every group it is for, or cancelled, with the dispatch records on disk
  (tests/test_cleaner.py, with two groups) — and its end is more
  than ``schedule_keep_ms`` in the past (so Get and Cancel still answer for a while).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from qdelay.segments.naming import MS_PER_MINUTE

if TYPE_CHECKING:
    from qdelay.server.engine import Engine

log = logging.getLogger("qdelay.cleaner")


@dataclass(slots=True)
class CleanerConfig:
    enabled: bool = True
    interval_ms: int = 60_000
    message_retention_ms: int = 3_600_000
    schedule_keep_ms: int = 3_600_000


class Cleaner:
    def __init__(self, engine: Engine, config: CleanerConfig) -> None:
        self.engine = engine
        self.cfg = config
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.removed_message_segments = 0
        self.removed_buckets = 0
        self._kept_from: int | None = None  # where the log was last said kept for slaves

    def start(self) -> None:
        if not self.cfg.enabled or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="qdelay-cleaner", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.cfg.interval_ms / 1000):
            try:
                self.run_once()
            except Exception:
                log.exception("cleaner pass failed")

    def message_log_floor(self) -> int:
        """The offset below which no reader needs the message log.

        The iterate service reads on from its saved offset. A slave needs more than the
        bytes after its confirmed offset: when it reconnects, the master compares its last
        record (the one ending at that offset) before sending more, and refuses it as behind
        retention if that record is gone. So the floor for slaves is the last byte of that
        record (offset - 1): the segment holding it stays even when the offset is exactly
        where the next segment starts."""
        floor = self.engine.iterate.saved_offset
        replicated = self.engine.replication_floor()
        if replicated is not None:
            floor = min(floor, max(0, replicated - 1))
        return floor

    def run_once(self, now_ms: int | None = None) -> dict:
        now_ms = self.engine.clock() if now_ms is None else now_ms
        return {"message_segments": self._clean_message_log(), "buckets": self._clean_buckets(now_ms)}

    def _clean_message_log(self) -> list[str]:
        wal = self.engine.wal
        floor = self.message_log_floor()
        cutoff = time.time() - self.cfg.message_retention_ms / 1000
        upto = self._deletable_upto(floor, cutoff)
        saved = self.engine.iterate.saved_offset
        unheld = self._deletable_upto(saved, cutoff) if floor < saved else upto
        kept_from = upto if upto is not None else wal.first_offset
        if unheld != upto and kept_from != self._kept_from:
            # segments a slave's hold keeps (docs/operations.md 3.4): said once per position
            self._kept_from = kept_from
            log.info("message log kept for slaves from offset %d (else deleted up to %d)", kept_from, unheld)
        if upto is None:
            return []
        removed = wal.delete_before(upto)
        self.removed_message_segments += len(removed)
        if removed:
            log.info("message log segments deleted", extra={"count": len(removed), "upto": upto})
        return removed

    def _deletable_upto(self, floor: int, cutoff: float) -> int | None:
        """The end of the last segment the cleaner may delete below ``floor`` (None: none)."""
        upto = None
        for seg in self.engine.wal.segments()[:-1]:
            if seg.key + seg.size > floor:
                break
            try:
                if os.path.getmtime(seg.path) > cutoff:
                    break
            except FileNotFoundError:
                continue
            upto = seg.key + seg.size
        return upto

    def _clean_buckets(self, now_ms: int) -> list[int]:
        engine = self.engine
        scale = engine.config.scale_minutes
        removed = []
        # the iterate service's append lock keeps a late record from landing in a file that
        # is being deleted (only such a record reopens a finished bucket); the scheduler
        # answers which buckets are finished, and its lock is not held while deleting
        with engine.iterate.append_lock:
            keep_ms = self.cfg.schedule_keep_ms
            finished = engine.scheduler.finished_buckets(
                engine.schedule.buckets(), lambda b: (b + scale) * MS_PER_MINUTE + keep_ms <= now_ms
            )
            for b in finished:
                dseg = engine.dispatch.get(b)
                if dseg is not None:
                    engine.dispatched.forget(dseg.path)
                engine.schedule.delete(b)
                engine.dispatch.delete(b)
                removed.append(b)
        self.removed_buckets += len(removed)
        if removed:
            log.info("finished buckets deleted", extra={"count": len(removed)})
        return removed
