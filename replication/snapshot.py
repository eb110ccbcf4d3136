"""Full resync: the master's side (Snapshot stream) and the slave's (``qdelay admin resync``).

A slave that fell behind the master's message-log retention cannot catch up from the log
alone: messages iterated long ago live only in the schedule log. The snapshot is cut at
the master's saved iterate checkpoint (offset O, sequence S): every schedule segment the
master still needs (bucket >= done_before, or reopened) is copied up to its last record
with sequence <= S, every dispatch segment in full, and the new slave's message log
starts empty at offset O. Pulling from O then replays exactly the records after S.
The master keeps its message log from O for the slave while the copy runs (and for
``slave_hold_ms`` after), a hold saved before the stream's head is sent (replication/holds.py).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time

from qdelay.replication import common
from qdelay.replication.master import _Refuse
from qdelay.segments import checkpoint, naming, reader
from qdelay.segments.folder_lock import FolderLock
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
    node.hub.hold_for(request.slave_name or "snapshot", offset)
    await node.hub.save_now()  # the hold survives a restart of this master during the resync
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


def write_snapshot(data_dir: str, chunks, master_epoch_hint: int = 0) -> dict:
    """Build a fresh slave data folder from a Snapshot stream (the old one is moved aside).

    The old folder's lock is taken first (a running server on it is refused: its folder
    was moved from under it) and the stream's head read before anything moves (a master
    that does not answer left the old folder moved aside and an empty one in its place).
    The new folder is locked from its creation until it is whole: a server started on it
    meanwhile (a unit its supervisor restarted) opened it without its checkpoints and wrote
    into it beside this run."""
    lock = FolderLock(data_dir, "qdelay admin resync") if os.path.isdir(data_dir) else None
    try:
        it = iter(chunks)
        head = next(it)
        moved = None
        if os.path.exists(data_dir) and set(os.listdir(data_dir)) - {naming.LOCK_FILE}:
            moved = f"{data_dir.rstrip(os.sep)}.before-resync-{time.strftime('%Y%m%d-%H%M%S')}"
            shutil.move(data_dir, moved)
        elif os.path.exists(data_dir):
            shutil.rmtree(data_dir)  # nothing in it but the lock this run took
        os.makedirs(data_dir)
        new = FolderLock(data_dir, "qdelay admin resync")
        try:
            return _write_snapshot(data_dir, head, it, moved, master_epoch_hint)
        finally:
            new.release()
    finally:
        if lock is not None:
            lock.release()


def _write_snapshot(data_dir: str, head, it, moved: str | None, master_epoch_hint: int) -> dict:
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
        "moved_old_to": moved,
        "epoch": head.epoch,
    }
