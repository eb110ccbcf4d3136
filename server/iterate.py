"""The iterate service: message log -> schedule log.

It tails the message log from a durable *iterate offset*, copies every record into the
schedule segment of its due bucket (a CANCEL into its target's bucket), fsyncs the
segments it wrote, and only then saves the offset in ``checkpoint/iterate.ckpt``.
A crash between the schedule fsync and the checkpoint replays some records; each
schedule segment remembers its highest sequence, and a replayed record at or below it
is skipped, so re-running never duplicates.

Records are handed to the scheduler once written (``on_records``), so a message due
within the loaded window reaches the timer without waiting for a reload.

A full disk stalls copying instead of stopping it: a schedule write that finds no space is
tried again (with a growing pause) until space is freed, so nothing is skipped or written
twice, and the message log refuses new writes meanwhile. A checkpoint that finds no space
is left for the next one.

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
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from qdelay.errors import CorruptRecord, DiskFull
from qdelay.segments import checkpoint, framing, native, records
from qdelay.segments.bucket_log import BucketLog, sync_all, sync_dirs
from qdelay.segments.framing import RecordKind
from qdelay.segments.idindex import IdIndex
from qdelay.segments.reader import route_py
from qdelay.segments.segment import Segment, disk_full
from qdelay.segments.wal import MessageLog
from qdelay.server import allocator

log = logging.getLogger("qdelay.iterate")

_MESSAGE = int(RecordKind.MESSAGE)  # plain ints: IntEnum attribute lookups cost ~0.5 µs
_CANCEL = int(RecordKind.CANCEL)
_KIND_AT = 16  # frame header field offsets (docs/formats.md, "Record frame")
_SEQ_AT = 20
_SUBJECT_LEN = struct.Struct("<H")
_TIMESTAMP = struct.Struct("<q")
_SUBJECT_LEN_AT = framing.HEADER_SIZE + 8  # MESSAGE body: due i64, then subject_len u16
_SUBJECT_AT = framing.HEADER_SIZE + records.MESSAGE_FIXED.size
_CANCEL_TARGET_AT = framing.HEADER_SIZE + 8  # CANCEL body: target due i64, then its sequence u64
_BYTE_OFFSETS = np.arange(8, dtype=np.int64)
TRIM_AFTER_BYTES = 4 * 1024 * 1024  # a write-behind flush this large gives its memory back (_trim)


def _gather_i64(u8: np.ndarray, at: np.ndarray) -> np.ndarray:
    """The little-endian 64-bit integers at byte offsets ``at`` of ``u8``."""
    return u8[at[:, None] + _BYTE_OFFSETS].view("<i8").ravel()


@dataclass(slots=True)
class Scheduled:
    """A record just written to a schedule segment."""

    kind: int
    bucket: int
    offset: int  # in the schedule segment
    sequence: int
    due: int  # the message's due time; for a CANCEL, its target's
    subject: bytes  # b"" for a CANCEL
    target: int  # for a CANCEL, the cancelled sequence; else 0
    size: int  # frame size in bytes


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
        # on_records(records, near): records copied for buckets <= near (None: all of them)
        self.on_records: Callable[[list[Scheduled], int | None], None] | None = None
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
        self.disk_full_waits = 0  # schedule writes retried for want of space
        self._trim_due = False  # write-behind buffers of several MiB were freed

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
            try:
                self.checkpoint()
            except DiskFull:
                log.warning("no space for the final checkpoint: a restart copies again from the last one")

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
                    if (
                        time.monotonic() - self._last_checkpoint >= self.checkpoint_interval
                        and self.saved_offset != self.offset
                    ):
                        self._request_checkpoint()
                        self._trim()
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
        self._trim()
        return True

    def _trim(self) -> None:
        """After a big write-behind flush, hand the freed heap back to the kernel: the
        buffers are many small blocks (a few KiB per minute file) that glibc keeps
        otherwise, and RSS would stay at their high-water mark (about write_behind_bytes)."""
        if self._trim_due:
            self._trim_due = False
            allocator.trim()

    def flush_bucket(self, bucket: int) -> None:
        """Write ``bucket``'s records out of the write-behind buffer (a reader needs them)."""
        with self.append_lock:
            if bucket in self._behind:
                self._flush_behind([bucket])

    def _until_space(self, write: Callable, *args):
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

    def _append(self, bucket: int, data: bytearray) -> int:
        """Append to a schedule segment; returns the offset the data starts at."""
        return self._until_space(self.schedule.append, bucket, data)[1]

    def _flush_behind(self, buckets: list[int]) -> None:
        """Append the write-behind buffers of ``buckets`` to their segments (append_lock held).

        A bucket the scheduler loaded meanwhile (the horizon passed it) is sent back to its
        loader, which reads on from its cursor: ``on_records`` with an empty list and a
        ``near`` just below the lowest bucket written does that.
        """
        if not buckets:
            return
        freed = 0
        for bucket in buckets:
            self._append(bucket, self._behind[bucket])
            buf = self._behind.pop(bucket)
            self._behind_bytes -= len(buf)
            freed += len(buf)
        if freed >= TRIM_AFTER_BYTES:
            self._trim_due = True
        if self.on_records is not None:
            self.on_records([], min(buckets) - self.scale)

    def _copy(self, data: bytes, near: int | None) -> tuple[int, int, list[Scheduled]]:
        """Copy the whole frames at the start of ``data`` (message-log bytes from ``offset``)
        to their schedule segments, byte for byte.

        Returns (bytes used, last sequence, records handed to the scheduler). Records of
        buckets up to ``near`` (all of them if None) and cancels are written at once and
        handed over; the others are written behind, and the loader reads them from disk
        when their time comes, so a far-future message costs no Python object here.

        The walk from frame to frame (each frame's checksum verified) is one call of the
        native codec (or its Python twin); buckets, duplicate skipping and the per-bucket
        byte runs are computed with numpy over the whole read.
        """
        data, pos, st, kind, seq, due = self._scan(data)
        if len(st) == 0:
            return pos, self.sequence, []
        if self.ids is not None:
            is_msg = kind == _MESSAGE
            if is_msg.any():
                self.ids.put_frames(bytes(data), st[is_msg], due[is_msg], seq[is_msg])
        codec = native.codec
        route = codec.route if codec is not None else route_py
        handed, messages, cancels, duplicates, unknown, copied, added = route(
            data, pos, st, kind, seq, due, self.scale, near, self._behind, self._segment_of
        )
        self.counts["messages"] += messages
        self.counts["cancels"] += cancels
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
                    at = _TIMESTAMP.unpack_from(data, start + 28)[0]
                    body = bytes(data[start + framing.HEADER_SIZE : end])
                    self.on_group(records.decode_group(body), at, int(seq[i]))
                continue
            log.error(
                "unexpected record kind in message log",
                extra={"kind": int(kind[i]), "offset": self.offset + int(st[i])},
            )
        last_seq = max(self.sequence, int(seq[-1]))
        if not handed:
            return pos, last_seq, []
        # records handed to the scheduler: written at once, with their offsets
        # the handed records' fields as columns (a batch of tombstones is thousands of them):
        # no numpy scalar per field, no Cancel object per tombstone (its target is read
        # at a fixed place of the verified frame)
        idx = np.fromiter((i for i, _b, _at in handed), dtype=np.int64, count=len(handed))
        starts = st[idx]
        ends = np.append(st, pos)[idx + 1]
        kinds_l = kind[idx].tolist()
        is_cancel = kind[idx] == _CANCEL
        targets = np.zeros(len(idx), dtype=np.int64)
        if is_cancel.any():
            u8 = np.frombuffer(data, dtype=np.uint8)
            targets[is_cancel] = _gather_i64(u8, starts[is_cancel] + _CANCEL_TARGET_AT)
        starts_l = starts.tolist()
        sizes_l = (ends - starts).tolist()
        written: list[Scheduled] = []
        for (_i, b, at), k, start, size, sq, du, target in zip(
            handed, kinds_l, starts_l, sizes_l, seq[idx].tolist(), due[idx].tolist(), targets.tolist()
        ):
            if k == _MESSAGE:
                slen = _SUBJECT_LEN.unpack_from(data, start + _SUBJECT_LEN_AT)[0]
                subject = bytes(data[start + _SUBJECT_AT : start + _SUBJECT_AT + slen])
                target = 0
            else:
                subject = b""
            written.append(Scheduled(k, b, at, sq, du, subject, target, size))
        base: dict[int, int] = {}
        for b in {rec.bucket for rec in written}:
            base[b] = self._append(b, self._behind[b])
            buf = self._behind.pop(b)
            self._behind_bytes -= len(buf)
        for rec in written:
            rec.offset += base[rec.bucket]
        return pos, last_seq, written

    def _scan(self, data: bytes) -> tuple[bytes, int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(data, end, starts, kinds, sequences, dues) of the whole, verified frames at the
        start of ``data``; a due is the body's first 8 bytes (MESSAGE and CANCEL bodies
        start with it). A frame larger than the read is read again, whole."""
        codec = native.codec
        if codec is None:
            data, starts, pos = self._frame_starts(data)
            st = np.asarray(starts, dtype=np.int64)
            if not starts:
                return data, pos, st, st.astype(np.uint8), st, st
            u8 = np.frombuffer(data, dtype=np.uint8, count=pos)
            return (
                data,
                pos,
                st,
                u8[st + _KIND_AT],
                _gather_i64(u8, st + _SEQ_AT),
                _gather_i64(u8, st + framing.HEADER_SIZE),
            )
        pos, count, starts_b, kinds_b, seqs_b, dues_b, bad = codec.scan(data, framing.MAX_BODY)
        if bad >= 0:
            raise CorruptRecord(
                self._wal_path(), self.offset + bad, "message-log record failed its checks while iterating"
            )
        if count == 0 and len(data) >= framing.HEADER_SIZE:  # one frame larger than a read
            length = framing.HEADER.unpack_from(data, 0)[2]
            if framing.HEADER_SIZE + length > len(data):
                return self._scan(self.wal.read_raw(self.offset, framing.HEADER_SIZE + length))
        return (
            data,
            pos,
            np.frombuffer(starts_b, dtype=np.int64),
            np.frombuffer(kinds_b, dtype=np.uint8),
            np.frombuffer(seqs_b, dtype=np.int64),
            np.frombuffer(dues_b, dtype=np.int64),
        )

    def _frame_starts(self, data: bytes) -> tuple[bytes, list[int], int]:
        """Offsets of the whole, verified frames at the start of ``data``, and where they end
        (with the data they are in: a frame larger than the read is read again, whole)."""
        unpack = framing.HEADER.unpack_from
        xxh = framing._xxh
        hs, checked, magic_ok, version_ok = framing.HEADER_SIZE, framing.CHECKED_FROM, framing.MAGIC, framing.VERSION
        mv = memoryview(data)
        size = len(data)
        starts: list[int] = []
        add = starts.append
        pos = 0
        while pos + hs <= size:
            magic, checksum, length, _kind, version, _flags, _seq, _ts = unpack(data, pos)
            end = pos + hs + length
            if end > size:
                if pos == 0:  # one frame larger than a read: fetch it whole
                    return self._frame_starts(self.wal.read_raw(self.offset, hs + length))
                break
            if magic != magic_ok or version != version_ok or xxh(mv[pos + checked : end]) != checksum:
                raise CorruptRecord(
                    self._wal_path(), self.offset + pos, "message-log record failed its checks while iterating"
                )
            add(pos)
            pos = end
        return data, starts, pos

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
