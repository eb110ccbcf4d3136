"""One append-only segment file of frames, a bounded pool of open handles, and recovery.

A :class:`Segment` knows its path and its valid size; its file descriptor comes from a
:class:`HandlePool` on demand, so a server with a million schedule segments keeps only
a bounded number open. Recovery (:func:`recover`) applies the torn-tail / corruption
rules of docs/formats.md ("Recovery rules").
"""

from __future__ import annotations

import collections
import contextlib
import enum
import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from qdelay.errors import CorruptRecord
from qdelay.segments import native, reader
from qdelay.segments.framing import Frame

if TYPE_CHECKING:
    from qdelay.segments.schedule_index import IndexFile

log = logging.getLogger("qdelay.segments")


class HandlePool:
    """An LRU of open file descriptors, bounded; a handle in use is pinned and never closed.

    Pins are counted per descriptor, not per path: :meth:`forget` (before a file is deleted
    or replaced) drops the path at once, and a descriptor still pinned by a reader is closed
    when that reader lets go, so forgetting a file in use is safe and a new file at the same
    path gets a new descriptor.
    """

    def __init__(self, capacity: int = 256) -> None:
        if capacity < 2:
            raise ValueError("the handle pool needs room for at least 2 files")
        self.capacity = capacity
        self._lock = threading.Lock()
        self._fds: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._pins: collections.Counter[int] = collections.Counter()
        self._orphans: set[int] = set()  # forgotten while pinned: close on the last unpin
        self.opens = 0  # how many times a file was opened (for tests and stats)

    def acquire(self, path: str, create: bool = False) -> int:
        """A pinned descriptor of ``path``; give it back with :meth:`release`.

        The hot paths (appends, record reads) call acquire/release in try/finally rather
        than the :meth:`fd` context manager, which costs ~2 µs more per use.
        """
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                flags = os.O_RDWR | (os.O_CREAT if create else 0)
                fd = os.open(path, flags, 0o644)
                self.opens += 1
                self._fds[path] = fd
            else:
                self._fds.move_to_end(path)
            self._pins[fd] += 1
            if len(self._fds) > self.capacity:
                self._evict_locked()
        return fd

    def release(self, fd: int) -> None:
        with self._lock:
            left = self._pins[fd] - 1
            if left > 0:
                self._pins[fd] = left
                return
            del self._pins[fd]
            if fd in self._orphans:
                self._orphans.discard(fd)
                os.close(fd)
            if len(self._fds) > self.capacity:
                self._evict_locked()

    @contextlib.contextmanager
    def fd(self, path: str, create: bool = False) -> Iterator[int]:
        fd = self.acquire(path, create)
        try:
            yield fd
        finally:
            self.release(fd)

    def _evict_locked(self) -> None:
        excess = len(self._fds) - self.capacity
        if excess <= 0:
            return
        victims = []
        for path, fd in self._fds.items():  # least recently used first; stops early
            if fd not in self._pins:
                victims.append(path)
                if len(victims) >= excess:
                    break
        for path in victims:
            os.close(self._fds.pop(path))

    def forget(self, path: str) -> None:
        """Drop the handle of a file about to be deleted, truncated by another owner or renamed."""
        with self._lock:
            fd = self._fds.pop(path, None)
            if fd is None:
                return
            if fd in self._pins:
                self._orphans.add(fd)
            else:
                os.close(fd)

    def close(self) -> None:
        """Close every handle; one still pinned is closed when its user lets go."""
        with self._lock:
            for fd in self._fds.values():
                if fd in self._pins:
                    self._orphans.add(fd)
                else:
                    os.close(fd)
            self._fds.clear()

    @property
    def open_count(self) -> int:
        """File descriptors open right now (pooled ones plus forgotten ones still in use)."""
        return len(self._fds) + len(self._orphans)


_WRITE_PIECE = 256 * 1024  # the most one pwrite of an append writes (see Segment.append_many)


def _nbytes(data: bytes | bytearray | memoryview) -> int:
    return data.nbytes if isinstance(data, memoryview) else len(data)


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """Write all of ``view`` at ``offset``, ``_WRITE_PIECE`` bytes at a time at most."""
    written, size = 0, view.nbytes
    while written < size:
        more = os.pwrite(fd, view[written : written + _WRITE_PIECE], offset + written)
        if more == 0:
            raise OSError("pwrite wrote nothing")
        written += more


class Segment:
    """An append-only file of frames. Not thread-safe for appends: one writer per segment."""

    def __init__(self, path: str, key: int, pool: HandlePool, size: int | None = None) -> None:
        self.path = path
        self.key = key  # base offset (message log) or bucket minute (schedule, dispatch)
        self.pool = pool
        self.size = os.path.getsize(path) if size is None else size
        self.synced_size = self.size
        self.last_sequence = -1  # highest sequence appended, maintained by the owner
        # Preallocation (the message log sets ``prealloc``): the file is kept zero-filled
        # ahead of ``size`` up to ``allocated``, so that an fdatasync after an append finds
        # the blocks and the file size already on disk: it flushes data only, without a
        # journal commit (half the latency and CPU on ext4, and no waiting behind other
        # files' metadata). Readers stop at ``size``; recovery treats the zeros as an
        # unwritten tail (docs/formats.md).
        self.prealloc = 0
        self.allocated = self.size
        # a schedule segment's index file (segments/schedule_index.py), synced with it
        self.index: IndexFile | None = None

    def append(self, data: bytes | bytearray | memoryview) -> int:
        """Write ``data`` at the end; return the offset it starts at (not yet durable)."""
        return self.append_many([data])

    def append_many(self, chunks: Sequence[bytes | bytearray | memoryview]) -> int:
        """Write ``chunks`` back to back at the end, without joining them first; return the
        offset they start at (not yet durable). Written ``_WRITE_PIECE`` bytes at a time at
        most (pwritev of several chunks, or pieces of a large one): one pwrite of several
        MB cost 3-7x the CPU of the same bytes written 256 KiB at a time (22 MB in 3 writes:
        19-43 ms, in 256 KiB pieces: 6-7 ms, ext4 on the 2-core VM; a fan-out burst's
        DISPATCH records, flushed as one joined write per bucket, were a quarter of the
        scheduler thread's time)."""
        offset = self.size
        pool = self.pool
        fd = pool.acquire(self.path, create=True)
        try:
            end = _write_chunks(fd, chunks, offset)
            if end > self.allocated:
                self.allocated = end
                if self.prealloc:
                    self._extend(fd, end)
        finally:
            pool.release(fd)
        self.size = end
        return offset

    def append_synced(self, chunks: list[bytearray]) -> tuple[int, float]:
        """``append_many`` (preallocation included) then fdatasync, in one call of the native
        codec that releases the GIL once (``write_sync``; its Python twin where it is not
        built, or where ``native_write_sync`` is off): the message log's commit. Between its
        write and its fdatasync, released apart, the writer thread waited for the GIL again
        under ingest (~1.9 thread switches a commit, docs/benchmarks.md, "Thread wake-ups a
        batch under ingest"). A failed write raises OSError (nothing synced; the caller cuts
        the file back); returns (the errno of a failed fdatasync or 0, its seconds)."""
        offset = self.size
        end = offset + sum(map(_nbytes, chunks))
        zero_to = 0
        if self.prealloc and end > self.allocated:
            zero_to = (end // self.prealloc + 1) * self.prealloc
        codec = native.codec
        write_sync = codec.write_sync if codec is not None and native_write_sync else write_sync_py
        pool = self.pool
        fd = pool.acquire(self.path, create=True)
        try:
            end, allocated, sync_errno, took = write_sync(fd, chunks, offset, zero_to, True)
        finally:
            pool.release(fd)
        self.size = end
        self.allocated = max(self.allocated, allocated)
        if not sync_errno:
            self.synced_size = end
        return sync_errno, took

    def _extend(self, fd: int, end: int) -> None:
        """Zero-fill the file from ``end`` to the next multiple of ``prealloc`` past it.

        Best effort: where the zeros do not fit (a full disk) the file just ends at ``end``."""
        step = self.prealloc
        self.allocated = _zero_fill(fd, end, (end // step + 1) * step)

    def trim(self) -> None:
        """Cut the preallocated zeros off, durably: a sealed segment ends at its last record."""
        if self.allocated > self.size:
            with self.pool.fd(self.path) as fd:
                os.ftruncate(fd, self.size)
                os.fdatasync(fd)
            self.allocated = self.synced_size = self.size

    def truncate(self, size: int) -> None:
        with self.pool.fd(self.path) as fd:
            os.ftruncate(fd, size)
            os.fdatasync(fd)
        self.size = self.synced_size = self.allocated = size

    def sync(self) -> None:
        """fdatasync if anything was appended since the last sync (and the index beside it,
        if any, first: it is durable whenever its segment is); errors propagate."""
        if self.index is not None:
            self.index.sync()
        if self.synced_size == self.size:
            return
        size = self.size
        with self.pool.fd(self.path) as fd:
            os.fdatasync(fd)
        self.synced_size = size

    def read(self, offset: int, length: int) -> bytes:
        pool = self.pool
        fd = pool.acquire(self.path)
        try:
            return os.pread(fd, length, offset)
        finally:
            pool.release(fd)

    def read_into(self, offset: int, view: memoryview) -> int:
        """Read up to ``len(view)`` bytes from ``offset`` into ``view``; how many were read (fewer
        only at the end of the file)."""
        pool = self.pool
        fd = pool.acquire(self.path)
        try:
            got = 0
            while got < len(view):
                n = os.preadv(fd, [view[got:]], offset + got)
                if n == 0:
                    break
                got += n
            return got
        finally:
            pool.release(fd)

    def read_frame(self, offset: int) -> Frame:
        """Read and verify the frame at ``offset``; a bad one raises :class:`CorruptRecord`
        (the frame reader's :func:`~qdelay.segments.reader.read_frame`)."""
        return reader.read_frame(self, offset)

    def frames(self, start: int = 0, stop: int | None = None) -> Iterator[Frame]:
        """Yield the frames in [start, stop) (default: to the valid size), read in chunks by
        the frame reader (:func:`~qdelay.segments.reader.segment_frames`).

        A bad frame inside the range raises :class:`CorruptRecord` with its offset: data
        that fails its checksum is never yielded.
        """
        return reader.segment_frames(self, start, stop)


_ZEROS = bytes(1 << 20)

#: False: ``Segment.append_synced`` runs the Python twin (``write_sync_py``: each write and
#: the fdatasync through ``os``, one after the other), e.g. for a test that injects failures
#: into those calls
native_write_sync = True


def _write_chunks(fd: int, chunks: Sequence[bytes | bytearray | memoryview], offset: int) -> int:
    """Write ``chunks`` back to back from ``offset`` (at most 1,024 buffers and
    ``_WRITE_PIECE`` bytes a pwritev, a larger chunk in pieces); return where they end."""
    pos = offset
    i, n = 0, len(chunks)
    while i < n:
        group = [chunks[i]]
        size = _nbytes(chunks[i])
        i += 1
        while i < n and len(group) < 1024 and size + _nbytes(chunks[i]) <= _WRITE_PIECE:
            group.append(chunks[i])
            size += _nbytes(chunks[i])
            i += 1
        if size <= _WRITE_PIECE:
            written = os.pwritev(fd, group, pos) if len(group) > 1 else os.pwrite(fd, group[0], pos)
            if written < size:  # short writes happen on signals and near ENOSPC
                _pwrite_all(fd, memoryview(b"".join(group))[written:], pos + written)
        else:  # one chunk larger than a piece
            _pwrite_all(fd, memoryview(group[0]).cast("B"), pos)
        pos += size
    return pos


def _zero_fill(fd: int, end: int, zero_to: int) -> int:
    """Zeros from ``end`` to ``zero_to`` with one pwrite, best effort; where they stop."""
    try:
        return end + os.pwrite(fd, _zeros(zero_to - end), end)
    except OSError:
        return end


def write_sync_py(fd: int, chunks: list, offset: int, zero_to: int, sync: bool) -> tuple[int, int, int, float]:
    """The Python twin of the native ``write_sync``: ``chunks`` written back to back from
    ``offset`` (``_write_chunks``; a failed write raises OSError), then zeros up to
    ``zero_to`` if it is past their end (``_zero_fill``), then, if ``sync``, fdatasync.
    Returns (end, where the zeros stop or end, the errno of a failed fdatasync or 0, the
    fdatasync's seconds)."""
    end = _write_chunks(fd, chunks, offset)
    allocated = _zero_fill(fd, end, zero_to) if zero_to > end else end
    sync_errno, took = 0, 0.0
    if sync:
        started = time.monotonic()
        try:
            os.fdatasync(fd)
        except OSError as err:
            sync_errno = err.errno or errno.EIO
        took = time.monotonic() - started
    return end, allocated, sync_errno, took


def _zeros(n: int) -> memoryview | bytes:
    return memoryview(_ZEROS)[:n] if n <= len(_ZEROS) else bytes(n)


class CorruptionPolicy(enum.Enum):
    FAIL = "fail"  # refuse to open: an operator decides (the default)
    TRUNCATE = "truncate"  # cut the file at the bad record, keeping the cut bytes in .broken


@dataclass(slots=True)
class Recovery:
    """What :func:`recover` found and did to one file."""

    path: str
    valid_size: int
    records: int
    last_sequence: int
    first_timestamp: int | None
    last_timestamp: int | None
    cut_bytes: int = 0
    torn: bool = False  # a torn or zero-filled tail was truncated
    corrupt_at: int | None = None
    reason: str | None = None
    broken_path: str | None = None


def recover(
    path: str, policy: CorruptionPolicy = CorruptionPolicy.FAIL, on_frame: Callable[[Frame], object] | None = None
) -> Recovery:
    """Check every frame of ``path`` and repair its tail.

    - a bad frame with no valid frame after it is a torn tail: truncated (the cut bytes
      are kept in ``<path>.broken`` unless they are all zero);
    - a bad frame followed by a valid one is corruption: raise :class:`CorruptRecord`
      (policy FAIL) or cut the file there like a torn tail (policy TRUNCATE).

    ``on_frame(frame)`` is called for each valid frame, in order (to rebuild indexes).
    """
    result = Recovery(path, 0, 0, -1, None, None)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        fd = f.fileno()
        for got in reader.walk_reads(lambda at, n: os.pread(fd, n, at), 0, size):
            if isinstance(got, reader.Columns):
                result.records += len(got)
                result.last_sequence = int(got.seqs[-1])
                if result.first_timestamp is None:
                    result.first_timestamp = got.stamp(0)
                result.last_timestamp = got.stamp(len(got) - 1)
                if on_frame is not None:
                    for frame in got.frames():
                        on_frame(frame)
                continue
            # the first damage decides: everything from it on is cut (or refused)
            bad_at = got.offset
            if got.status == reader.CORRUPT:
                result.corrupt_at = bad_at
                result.reason = got.reason
                if policy is CorruptionPolicy.FAIL:
                    # say what the operator can do (docs/recovery.md, "Policy"): the bare
                    # "checksum mismatch" left them to find the corruption setting
                    raise CorruptRecord(
                        path,
                        bad_at,
                        f"{got.reason} (a valid record follows at offset {got.end}); with corruption = fail "
                        f"nothing is cut: restore the file from a replica, or start with --set "
                        f"engine.corruption=truncate to cut it at {bad_at} (the cut bytes are kept in "
                        f"{os.path.basename(path)}.broken)",
                    )
                log.error("corrupt record, truncating", extra={"path": path, "offset": bad_at, "reason": got.reason})
            else:
                result.torn = True
                result.reason = got.reason
            _cut(result, bad_at, os.pread(fd, size - bad_at, bad_at))
            return result
    result.valid_size = size
    return result


def _cut(result: Recovery, at: int, rest: bytes) -> None:
    if any(rest):
        broken = f"{result.path}.broken"
        n = 0
        while os.path.exists(broken):
            n += 1
            broken = f"{result.path}.broken.{n}"
        with open(broken, "wb") as out:
            out.write(rest)
            out.flush()
            os.fsync(out.fileno())
        result.broken_path = broken
    with open(result.path, "r+b") as f:
        f.truncate(at)
        f.flush()
        os.fsync(f.fileno())
    result.valid_size = at
    result.cut_bytes = len(rest)
    if result.cut_bytes and result.broken_path is None:
        log.info(
            "cut the unwritten (zero) tail of a segment",
            extra={"path": result.path, "offset": at, "cut_bytes": len(rest)},
        )
    elif result.cut_bytes:
        log.warning(
            "truncated segment tail",
            extra={
                "path": result.path,
                "offset": at,
                "cut_bytes": len(rest),
                "reason": result.reason,
                "kept_in": result.broken_path,
            },
        )


def disk_full(err: OSError) -> bool:
    """Whether a failed write means "no space" (full disk or quota), which frees up later."""
    return err.errno in (errno.ENOSPC, errno.EDQUOT)


def fsync_dir(path: str) -> None:
    """fsync a directory so that a create, rename or unlink in it is durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
