"""Full resync: the master's side (Snapshot stream) and the slave's (``qdelay admin resync``).

A slave that fell behind the master's message-log retention cannot catch up from the log
alone: messages iterated long ago live only in the schedule log. The snapshot is cut at
the master's saved iterate checkpoint (offset O, sequence S): every schedule segment the
master still needs (bucket >= done_before, or reopened) is copied up to its last record
with sequence <= S, every dispatch segment in full, and the new slave's message log
starts empty at offset O. Pulling from O then replays exactly the records after S.
The master keeps its message log from O for the slave while the copy runs, however long
(and for ``slave_hold_ms`` after), a hold saved before the stream's head is sent (replication/holds.py).
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import time

from qdelay.replication import autoresync, common
from qdelay.replication.master import _Refuse
from qdelay.segments import checkpoint, naming, reader
from qdelay.segments.folder_lock import FolderLock
from qdelay.segments.segment import fsync_dir
from qdelay.v1 import replication_pb2 as rpb

CHUNK = 1024 * 1024


def _segment_chunks(seg, limit_seq: int | None):
    """(at, bytes) pieces of a segment's synced, whole frames (up to sequence ``limit_seq``)."""
    pos = 0
    stop = seg.synced_size
    while pos < stop:
        data = seg.read(pos, min(CHUNK, stop - pos))
        infos = common.frame_infos(data, pos)
        if not infos:
            if not data:
                return
            length = reader.frame_length(data) if len(data) >= common.HS else 0
            data = seg.read(pos, common.HS + length)
            infos = common.frame_infos(data, pos)
            if not infos:
                return
        end = pos
        for off, seq, _c, size in infos:
            if limit_seq is not None and seq > limit_seq:
                if end > pos:
                    yield pos, data[: end - pos]
                return
            end = off + size
        yield pos, data[: end - pos]
        pos = end


async def serve_snapshot(node, request):
    engine = node.engine
    if engine.role != "master":
        raise _Refuse("FAILED_PRECONDITION", f"this server is {engine.role}; take the snapshot from the master")
    state = checkpoint.read(engine.checkpoint_path) or {}
    if "offset" not in state:
        raise _Refuse("UNAVAILABLE", "the master has no iterate checkpoint yet; retry in a moment")
    offset, sequence = int(state["offset"]), int(state["sequence"])
    if offset < engine.wal.first_offset:
        raise _Refuse("UNAVAILABLE", "the iterate checkpoint is behind the message log; retry in a moment")
    held = node.hub.hold_for(request.slave_name or "snapshot", offset)
    try:
        await node.hub.save_now()  # the hold survives a restart of this master during the resync
        async for chunk in _snapshot_chunks(engine, offset, sequence, state):
            yield chunk
    finally:
        node.hub.snapshot_sent(held)  # (also when the slave breaks the stream off)


async def _snapshot_chunks(engine, offset: int, sequence: int, state: dict):
    done_before = int(state.get("done_before", 0))
    reopened = [int(b) for b in state.get("reopened", ())]
    head = rpb.SnapshotChunk(epoch=engine.epoch, offset=offset, sequence=sequence)
    head.progress.done_before = done_before
    head.progress.reopened.extend(reopened)
    head.progress.sequence = sequence
    yield head
    wanted = set(reopened)
    for log_name, blog, limit in (("schedule", engine.schedule, sequence), ("dispatch", engine.dispatch, None)):
        for b in blog.buckets():
            if b < done_before and b not in wanted:
                continue
            seg = blog.get(b)
            if seg is None:
                continue
            pieces = await asyncio.to_thread(lambda s=seg, lim=limit: list(_segment_chunks(s, lim)))
            if not pieces:
                yield rpb.SnapshotChunk(log=log_name, bucket=b, at=0, data=b"")
            for at, data in pieces:
                yield rpb.SnapshotChunk(log=log_name, bucket=b, at=at, data=data)


def write_snapshot(
    data_dir: str, chunks, master_epoch_hint: int = 0, hand_over: bool = False, lock: FolderLock | None = None
) -> dict:
    """Build a fresh slave data folder from a Snapshot stream (the old one is moved aside).

    The old folder's lock is taken first (a running server on it is refused: its folder
    would be moved from under it) and the stream's head read before anything is written (a
    master that does not answer changes nothing). The new folder is written beside the old
    one, in ``<data>.resync-incoming``, locked from its creation: the old folder stays in
    place, whole and locked, until the new one is complete and fsynced, so a master that
    stops answering midway leaves the old folder as it was (the incoming one is removed).
    Then the two are swapped in one step (``renameat2(RENAME_EXCHANGE)``) and the old one
    renamed to ``<data>.before-resync-<time>``: at no moment is there no locked folder at
    ``data_dir``. Where the file system lacks the exchange, two renames, between which
    ``data_dir`` is briefly absent: a server started in that moment makes an empty folder
    there, and the second rename then fails with an error naming both paths (the copy stays
    at ``<data>.resync-incoming``, the old folder at ``<data>.before-resync-<time>``:
    nothing is lost, but an operator puts the right one back). ``hand_over``: the new folder's
    lock stays held for the next ``FolderLock`` of this process (the server that opens it).
    ``lock``: the old folder's, taken by the caller, who keeps it (after the swap it locks
    the folder moved aside)."""
    data_dir = os.path.abspath(data_dir)
    own = lock is None
    if own and os.path.isdir(data_dir):
        lock = FolderLock(data_dir, "qdelay admin resync")
    try:
        it = iter(chunks)
        head = next(it)
        unattached = autoresync.unattached_resyncs(data_dir) + 1  # this one's folder: not yet
        staging = _fresh_incoming(data_dir)
        new = FolderLock(staging, "qdelay admin resync")
        try:
            info = _write_snapshot(staging, head, it, master_epoch_hint, unattached)
            os.unlink(os.path.join(staging, naming.INCOMING_FILE))
            fsync_dir(staging)
            info["moved_old_to"] = _swap_in(data_dir, staging)
        except BaseException:
            new.release()
            if os.path.exists(os.path.join(staging, naming.INCOMING_FILE)):
                shutil.rmtree(staging, ignore_errors=True)  # a partial copy of the master's
            raise
        if hand_over:
            new.hand_over()
        else:
            new.release()
        return info
    finally:
        if own and lock is not None:
            lock.release()


def incoming_path(data_dir: str) -> str:
    return f"{os.path.abspath(data_dir)}.resync-incoming"


def _aside_path(data_dir: str) -> str:
    base = f"{data_dir}.before-resync-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while os.path.exists(path):  # two resyncs within a second
        path, n = f"{base}.{n}", n + 1
    return path


def tidy_incoming(data_dir: str) -> tuple[bool, str | None]:
    """A ``<data>.resync-incoming`` an interrupted run left, under ``data_dir``'s lock (the
    caller's): removed when it still holds its INCOMING mark (a partial copy of the
    master's), moved aside like an old folder when it does not (a crash between the swap
    and the old folder's rename: the old folder; or just before the swap: a whole copy).
    (whether there was one, where it was moved to or None when removed)."""
    staging = incoming_path(data_dir)
    if not os.path.exists(staging):
        return False, None
    if os.path.exists(os.path.join(staging, naming.INCOMING_FILE)):
        shutil.rmtree(staging)
        return True, None
    aside = _aside_path(os.path.abspath(data_dir))
    os.rename(staging, aside)
    fsync_dir(os.path.dirname(aside))
    return True, aside


def _fresh_incoming(data_dir: str) -> str:
    """An empty ``<data>.resync-incoming`` holding its INCOMING mark (one an earlier run
    left: ``tidy_incoming``)."""
    staging = incoming_path(data_dir)
    tidy_incoming(data_dir)
    os.makedirs(staging)
    with open(os.path.join(staging, naming.INCOMING_FILE), "wb") as f:
        os.fsync(f.fileno())
    fsync_dir(staging)
    fsync_dir(os.path.dirname(staging))
    return staging


def _exchange(a: str, b: str) -> None:
    """Swap two paths atomically (Linux ``renameat2`` with ``RENAME_EXCHANGE``); OSError
    where the C library or the file system cannot."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), a)


def _swap_in(data_dir: str, staging: str) -> str | None:
    """Put the complete ``staging`` folder at ``data_dir``; the old folder's new path (None
    when there was none worth keeping: missing, or holding only its lock file)."""
    keep = os.path.isdir(data_dir) and bool(set(os.listdir(data_dir)) - {naming.LOCK_FILE})
    parent = os.path.dirname(data_dir)
    if not os.path.exists(data_dir):
        os.rename(staging, data_dir)
        fsync_dir(parent)
        return None
    aside = _aside_path(data_dir)
    try:
        _exchange(staging, data_dir)
        os.rename(staging, aside)  # the old folder, now at the staging path
    except OSError as e:
        if e.errno not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
            raise
        os.rename(data_dir, aside)
        os.rename(staging, data_dir)
    fsync_dir(parent)
    if not keep:
        shutil.rmtree(aside)
        return None
    return aside


def _write_snapshot(data_dir: str, head, it, master_epoch_hint: int, unattached: int = 1) -> dict:
    """The new folder's files from the stream's ``head`` and the chunks after it (``it``)."""
    offset, sequence = head.offset, head.sequence
    msg_dir = os.path.join(data_dir, naming.MESSAGE_DIR)
    os.makedirs(msg_dir)
    open(os.path.join(msg_dir, naming.wal_name(offset)), "wb").close()
    files = 0
    total = 0
    handles: dict[tuple[str, int], object] = {}
    try:
        for ch in it:
            suffix = naming.SCHEDULE_SUFFIX if ch.log == "schedule" else naming.DISPATCH_SUFFIX
            root = os.path.join(data_dir, naming.SCHEDULE_DIR if ch.log == "schedule" else naming.DISPATCH_DIR)
            key = (ch.log, ch.bucket)
            f = handles.get(key)
            if f is None:
                path = os.path.join(root, naming.bucket_relpath(ch.bucket, suffix))
                os.makedirs(os.path.dirname(path), exist_ok=True)
                f = handles[key] = open(path, "wb")
                files += 1
            if f.tell() != ch.at:
                raise ValueError(f"snapshot chunk of {ch.log} bucket {ch.bucket} at {ch.at}, file has {f.tell()}")
            f.write(ch.data)
            total += len(ch.data)
    finally:
        for f in handles.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
    state = {
        "offset": offset,
        "sequence": sequence,
        "done_before": head.progress.done_before,
        "reopened": list(head.progress.reopened),
    }
    checkpoint.write(os.path.join(data_dir, naming.CHECKPOINT_DIR, "iterate.ckpt"), state)
    checkpoint.write(
        os.path.join(data_dir, naming.CHECKPOINT_DIR, "role.ckpt"),
        {"role": "slave", "epoch": max(head.epoch, master_epoch_hint)},
    )
    # no schedule index, no id index: the engine derives them at its first open and, told
    # so by this mark, logs that at INFO (an expected step, not a loss), then removes it
    with open(os.path.join(data_dir, naming.UNINDEXED_FILE), "wb") as f:
        os.fsync(f.fileno())
    # the new folder holds nothing but what the master at this epoch had (autoresync.py)
    # (resynced_ms: until a stream is accepted, autoresync.retry_delay; unattached: the
    # resyncs in a row whose folder never attached, this one included)
    checkpoint.write(
        os.path.join(data_dir, naming.CHECKPOINT_DIR, naming.FOLLOWED_FILE),
        {"epoch": head.epoch, "resynced_ms": int(time.time() * 1000), "unattached": unattached},
    )
    for root, dirs, _files in os.walk(data_dir):
        for d in dirs:
            fd = os.open(os.path.join(root, d), os.O_RDONLY | os.O_DIRECTORY)
            os.fsync(fd)
            os.close(fd)
    return {
        "offset": offset,
        "sequence": sequence,
        "files": files,
        "bytes": total,
        "moved_old_to": None,
        "epoch": head.epoch,
    }
