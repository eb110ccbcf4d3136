"""The dispatch log's writer and readers: what each group closed (delivered or
dead-lettered) per bucket.

The scheduler thread buffers DISPATCH frames per bucket (``add``) and writes them every
few milliseconds (``flush``); their fsync happens on the ``qdelay-dispatch-sync`` thread,
so the timer never waits for the disk. A bucket with records buffered, being written or
written and not yet fsynced is *unsynced*: it cannot become done. Records not yet in
their file are visible to Cancel/Get through ``pending``.

The writer's lock guards its buffers only and is never held across I/O; it is taken
inside the scheduler lock (lock order: ``Scheduler.lock`` -> ``DispatchLogWriter._lock``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from qdelay.errors import CorruptRecord
from qdelay.segments import records
from qdelay.segments.bucket_log import BucketLog
from qdelay.segments.framing import RecordKind
from qdelay.segments.reader import kind_frames
from qdelay.segments.segment import CorruptionPolicy, disk_full

log = logging.getLogger("qdelay.scheduler")


class DispatchLogWriter:
    def __init__(self, dispatch: BucketLog, flush_ms: int) -> None:
        self.dispatch = dispatch
        self.flush_ms = flush_ms
        self._lock = threading.Lock()
        # DISPATCH frames not yet handed to a write, per bucket as the chunks added (written
        # as they are, BucketLog.append_many: a bytearray grown by every ack's frames copied
        # them over and over as it grew, ~70 ns a frame in a burst, as much as encoding them)
        self._buf: dict[int, list[bytes]] = {}
        self._writing: dict[int, list[bytes]] = {}  # ... being appended to their files
        self._first = 0.0  # when the oldest buffered frame came (monotonic)
        self._write_gen: dict[int, int] = {}  # buckets with records written, not fsynced
        self._sync_wanted = threading.Event()
        self._sync_stop = False
        self._syncer: threading.Thread | None = None
        self._waiting_space = False  # the last write found the disk full
        self.disk_full_total = 0  # writes that found the disk full (tried again later)
        self.error: BaseException | None = None
        self.on_synced: Callable[[list[int]], None] | None = None  # these buckets may be done now

    # --- the sync thread --------------------------------------------------------------------------

    def start(self) -> None:
        self._sync_stop = False
        self._syncer = threading.Thread(target=self._sync_loop, name="qdelay-dispatch-sync", daemon=True)
        self._syncer.start()

    def stop(self) -> None:
        """Stop the sync thread, then write and fsync what is left."""
        if self._syncer is not None:
            self._sync_stop = True
            self._sync_wanted.set()
            self._syncer.join()
            self._syncer = None
        self.flush(force=True)
        self.sync()
        with self._lock:
            left = sum(len(chunk) for buf in self._buf.values() for chunk in buf)
        if left and self._waiting_space:
            log.warning(
                "no space for the last DISPATCH records: their messages are delivered again after a restart",
                extra={"bytes": left},
            )
        elif left:  # the scheduler adds none after its stop(): a caller bypassed it
            log.error("DISPATCH records added after the final flush were not written", extra={"bytes": left})

    def _sync_loop(self) -> None:
        while True:
            self._sync_wanted.wait()
            self._sync_wanted.clear()
            if self._sync_stop:
                return
            try:
                self.sync()
            except BaseException as err:  # fsync failed: stop like any storage failure
                self.error = err
                log.exception("dispatch log sync failed")
                return

    # --- writing ----------------------------------------------------------------------------------

    def add(self, bucket: int, frames: bytes) -> None:
        """Buffer DISPATCH frames of ``bucket``; written within ``flush_ms``."""
        with self._lock:
            buf = self._buf.get(bucket)
            if buf is None:
                buf = self._buf[bucket] = []
                if len(self._buf) == 1:
                    self._first = time.monotonic()
            buf.append(frames)

    def flush(self, force: bool = False) -> None:
        """Write buffered DISPATCH records (their fsync happens on the sync thread)."""
        with self._lock:
            if not self._buf:
                return
            if not force and (time.monotonic() - self._first) * 1000 < self.flush_ms:
                return
            bufs, self._buf = self._buf, {}
            self._writing = bufs  # visible to Cancel/Get (pending) until they are in the files
        written: list[int] = []
        try:
            # outside any lock: appending to a page that the syncer's fdatasync has under
            # writeback can block for milliseconds
            for bucket, buf in bufs.items():
                self.dispatch.append_many(bucket, buf)
                written.append(bucket)
        except OSError as err:
            if not disk_full(err):
                raise
            # no space: the records not written go back in front of any newer ones, and
            # the next pass tries again (a failed append moves no segment's size)
            if not self._waiting_space:
                log.warning("disk full: DISPATCH records wait for free space", extra={"error": str(err)})
            self._waiting_space = True
            self.disk_full_total += 1
            with self._lock:
                for bucket, buf in bufs.items():
                    if bucket not in written:
                        self._buf[bucket] = buf + self._buf.get(bucket, [])
                self._first = time.monotonic()
        else:
            if self._waiting_space:
                log.info("DISPATCH records written again after a full disk")
                self._waiting_space = False
        finally:
            with self._lock:
                self._writing = {}
                for bucket in written:
                    self._write_gen[bucket] = self._write_gen.get(bucket, 0) + 1
        if written:
            self._sync_wanted.set()

    def sync(self) -> None:
        """fsync written DISPATCH records, then let their buckets become done."""
        with self._lock:
            gens = dict(self._write_gen)
        if not gens:
            return
        self.dispatch.sync()
        with self._lock:
            for bucket, gen in gens.items():
                if self._write_gen.get(bucket) == gen:
                    del self._write_gen[bucket]
        if self.on_synced is not None:
            self.on_synced(list(gens))

    # --- questions ----------------------------------------------------------------------------------

    def pending(self, bucket: int) -> bytes:
        """DISPATCH frames of ``bucket`` buffered or being written, not yet in its file."""
        with self._lock:
            return b"".join([*self._writing.get(bucket, ()), *self._buf.get(bucket, ())])

    def has_buffered(self) -> bool:
        return bool(self._buf)

    def unsynced(self, bucket: int) -> bool:
        """Records of ``bucket`` are buffered, being written, or not yet fsynced."""
        with self._lock:
            return bucket in self._buf or bucket in self._writing or bucket in self._write_gen

    def unsynced_count(self) -> int:
        with self._lock:
            return len(set(self._buf) | set(self._writing) | set(self._write_gen))


# --- reading ------------------------------------------------------------------------------------


def read_closed(
    dispatch: BucketLog, bucket: int, policy: CorruptionPolicy, counted_below: int = 0
) -> tuple[dict[str, set[int]], dict[str, set[int]]]:
    """Per group name, the sequences the dispatch log of ``bucket`` says were delivered
    or dead-lettered; and per group, those closed by records before offset
    ``counted_below`` (closes already counted in ``closed_retired``).

    A torn tail is cut (only the last flush before a crash can be torn); a corrupt
    record in the middle is reported and stepped over: at worst its message is
    delivered again, which at-least-once allows, rather than the scheduler stopping.
    """
    closed: dict[str, set[int]] = {}
    counted: dict[str, set[int]] = {}
    if dispatch.get(bucket) is None:
        return closed, counted
    try:
        dispatch.recover(bucket, policy)
    except CorruptRecord as err:
        log.error(
            "corrupt dispatch record; messages it covered may be delivered again",
            extra={"path": err.path, "offset": err.offset, "reason": err.reason},
        )
    seg = dispatch.get(bucket)
    if seg is None:
        return closed, counted
    for f in kind_frames(seg, RecordKind.DISPATCH):
        name = records.dispatch_group(f.body)
        closed.setdefault(name, set()).add(f.sequence)
        if f.offset < counted_below:
            counted.setdefault(name, set()).add(f.sequence)
    return closed, counted
