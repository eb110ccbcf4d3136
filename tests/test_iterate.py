"""The iterate service on its own: message log -> schedule segments, byte for byte.

Real files (a message log, a schedule log, a checkpoint) in a temporary folder; the
scheduler is replaced by lists that collect what the service publishes (per bucket, the
bytes appended; the cancels' targets), and the loading horizon is a number the test sets.
"""

from __future__ import annotations

import errno
import os
import random
import threading

import pytest
from conftest import wait_until

from qdelay.segments import checkpoint, framing, idindex, naming, reader, records
from qdelay.segments.bucket_log import BucketLog
from qdelay.segments.framing import RecordKind
from qdelay.segments.idindex import IdIndex
from qdelay.segments.segment import HandlePool
from qdelay.segments.wal import MessageLog
from qdelay.server import allocator, iterate
from qdelay.server.iterate import IterateService, Written

MIN = naming.MS_PER_MINUTE
T0 = 1_800_000_000_000 - 1_800_000_000_000 % MIN  # a minute boundary


class Rig:
    def __init__(
        self,
        root,
        horizon_minutes: int = 3,
        read_bytes: int = 64 * 1024,
        start_offset=None,
        write_behind_bytes: int = 8 * 1024 * 1024,
        gather: float = 0.0,
        gather_far: float = 0.0,
        **extra,
    ) -> None:
        self.root = str(root)
        self.pool = HandlePool(64)
        self.wal = MessageLog(os.path.join(self.root, "message"), pool=self.pool)
        self.schedule = BucketLog(os.path.join(self.root, "schedule"), naming.SCHEDULE_SUFFIX, self.pool)
        self.horizon = naming.bucket_of(T0) + horizon_minutes
        self.published: list[tuple[int, Written]] = []  # (bucket, what was appended), in order
        self.cancels: list[tuple[int, int]] = []  # (bucket, target) of each tombstone published
        self.ckpt = os.path.join(self.root, "iterate.ckpt")
        self.it = IterateService(
            self.wal,
            self.schedule,
            self.ckpt,
            start_offset=self.wal.first_offset if start_offset is None else start_offset,
            start_sequence=0,
            read_bytes=read_bytes,
            horizon=lambda: self.horizon,
            write_behind_bytes=write_behind_bytes,
            gather=gather,
            gather_far=gather_far,
            **extra,
        )
        self.it.on_written = self._on_written

    def _on_written(self, written, cancels):
        for b, w in written.items():
            seg = self.schedule.get(b)
            assert w.end == seg.size, "published once the bytes are in the segment"
            self.published.append((b, w))
        self.cancels.extend((b, t) for b, targets in cancels.items() for t in targets)

    def published_frames(self, bucket=None) -> list[framing.Frame]:
        """The frames of every published range (of ``bucket``), read back from the files."""
        out = []
        for b, w in self.published:
            if bucket is None or b == bucket:
                out += reader.frames(self.schedule.get(b).read(w.start, w.end - w.start))
        return out

    def send(self, dues, payload=b"p" * 40, subject=b"s"):
        bodies = [records.encode_message(subject, f"m{d}-{i}".encode(), b"", payload, d) for i, d in enumerate(dues)]
        return self.wal.append([(RecordKind.MESSAGE, T0, b) for b in bodies])

    def cancel(self, due, seq):
        body = records.encode_cancel(records.Cancel(f"c{seq}", due, seq))
        return self.wal.append([(RecordKind.CANCEL, T0, body)])

    def catch_up(self):
        while self.it.step():
            pass

    def send_far(self, dues):
        """``send`` of records declared far before they are queued (as the engine declares
        a send whose every due time is beyond the horizon); their last sequence."""
        first = self.wal.committed_sequence + 1
        self.it.expect_far(first, first + len(dues) - 1)
        self.send(dues)
        return first + len(dues) - 1

    def close(self):
        self.wal.close()
        self.pool.close()


def wal_frames(rig) -> list[framing.Frame]:
    out, pos = [], rig.wal.first_offset
    while True:
        frames, pos2 = rig.wal.read(pos, 1 << 20)
        if not frames:
            return out
        out += frames
        pos = pos2


def sched_bytes(rig, bucket) -> bytes:
    seg = rig.schedule.get(bucket)
    return b"" if seg is None or seg.size == 0 else seg.read(0, seg.size)


def expected_bytes(rig) -> dict[int, bytes]:
    """Bucket -> the message-log frames routed to it, in log order, re-encoded."""
    out: dict[int, bytearray] = {}
    for f in wal_frames(rig):
        due = records.decode_body(f.kind, f.body).deliver_at_ms
        framing.encode_into(out.setdefault(naming.bucket_of(due), bytearray()), f.kind, f.sequence, f.timestamp, f.body)
    return {b: bytes(v) for b, v in out.items()}


def test_copies_every_record_byte_for_byte_and_hands_over_only_near_ones(tmp_path):
    rig = Rig(tmp_path)
    rnd = random.Random(7)
    dues = [T0 + rnd.randrange(0, 60 * MIN) for _ in range(2_000)]
    for k in range(0, len(dues), 100):
        rig.send(dues[k : k + 100])
    rig.cancel(dues[5], 6)  # a tombstone for a far bucket: handed over at once
    rig.catch_up()
    rig.it.checkpoint()
    want = expected_bytes(rig)
    for bucket, data in want.items():
        assert sched_bytes(rig, bucket) == data, bucket
    near = rig.horizon + 1
    # published before the checkpoint: the buckets up to near, and the cancel's (at once)
    at_once = [(b, w) for b, w in rig.published if b <= near or b == naming.bucket_of(dues[5])]
    assert {b for b, _w in at_once} == {naming.bucket_of(d) for d in dues if naming.bucket_of(d) <= near} | {
        naming.bucket_of(dues[5])
    }
    assert rig.cancels[0] == (naming.bucket_of(dues[5]), 6)
    for b, w in rig.published:  # every published range is whole frames of that bucket
        frames = reader.frames(rig.schedule.get(b).read(w.start, w.end - w.start))
        assert frames and sum(f.size for f in frames) == w.end - w.start
        assert w.last_sequence >= max(f.sequence for f in frames)
        assert w.first_due <= min(records.decode_body(f.kind, f.body).deliver_at_ms for f in frames)
    near_msgs = [f for f in rig.published_frames() if f.kind == RecordKind.MESSAGE]
    assert sum(1 for d in dues if naming.bucket_of(d) <= near) <= len(near_msgs)
    assert rig.it.counts == {"messages": 2_000, "cancels": 1}
    assert checkpoint.read(rig.ckpt)["offset"] == rig.wal.committed_offset
    rig.close()


def test_far_records_are_written_behind_until_checkpoint_or_a_reader(tmp_path):
    rig = Rig(tmp_path)
    far = naming.bucket_of(T0) + 30
    rig.send([far * MIN + 5, far * MIN + 6])
    rig.send([(far + 1) * MIN])
    rig.catch_up()
    assert sched_bytes(rig, far) == b"" and not rig.published
    rig.it.flush_bucket(far)  # Cancel and Get call this before they look
    assert len(reader.frames(sched_bytes(rig, far))) == 2
    assert sched_bytes(rig, far + 1) == b""
    rig.it.checkpoint()
    assert sched_bytes(rig, far + 1) == expected_bytes(rig)[far + 1]
    rig.close()


def test_flush_bucket_now_writes_behind_records_only_when_the_append_lock_is_free(tmp_path):
    rig = Rig(tmp_path)
    far = naming.bucket_of(T0) + 30
    rig.send([far * MIN + 5, far * MIN + 6])
    rig.catch_up()
    assert rig.it.written_behind(far)
    with rig.it.append_lock:  # a step copying: the event loop must not wait for it
        assert rig.it.flush_bucket_now(far) is False
    assert sched_bytes(rig, far) == b"" and rig.it.written_behind(far)
    assert rig.it.flush_bucket_now(far) is True
    assert len(reader.frames(sched_bytes(rig, far))) == 2 and not rig.it.written_behind(far)
    assert rig.it.flush_bucket_now(far + 1) is True  # nothing behind: nothing to do
    rig.close()


def test_flush_bucket_now_does_not_wait_out_a_full_disk(tmp_path):
    """The event loop's flush (a Cancel of a far minute) declines on a full disk, as it does
    on a held append lock: waiting out the disk there froze every call of the server until
    space came back (the worker thread the claim goes to then waits instead)."""
    # no checkpoint meanwhile: one (0.2 s after the rig is made, on a loaded machine) wrote
    # the bucket out before the flush under test and it had nothing left to decline
    rig = Rig(tmp_path, checkpoint_interval=60.0)
    far = naming.bucket_of(T0) + 30
    rig.send([far * MIN + 5])
    rig.catch_up()
    append = rig.schedule.append

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    rig.schedule.append = full
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(rig.it.flush_bucket_now(far)), daemon=True)
    t.start()
    t.join(3.0)
    stuck = t.is_alive()
    rig.schedule.append = append  # (a thread still waiting then writes and ends)
    t.join(5.0)
    assert not stuck and got == [False]
    assert rig.it.written_behind(far)  # nothing lost: written by the next flush
    assert rig.it.flush_bucket_now(far) is True and not rig.it.written_behind(far)
    rig.close()


def test_write_behind_is_bounded(tmp_path):
    rig = Rig(tmp_path, write_behind_bytes=10_000)
    far = naming.bucket_of(T0) + 30
    for k in range(10):
        rig.send([far * MIN + k] * 20)
        rig.catch_up()
        assert rig.it._behind_bytes <= 10_000
    rig.close()


def test_a_bucket_reached_by_the_horizon_is_written_and_sent_back_to_its_loader(tmp_path):
    rig = Rig(tmp_path)
    b = naming.bucket_of(T0) + 10
    rig.send([b * MIN + 1])
    rig.catch_up()
    assert sched_bytes(rig, b) == b""
    rig.horizon = b  # the loader may have read the bucket without the record ...
    rig.it.step()  # ... so it is written and published: the loader reads on from its cursor
    assert sched_bytes(rig, b) == expected_bytes(rig)[b]
    assert [(pb, w.start, w.last_sequence) for pb, w in rig.published] == [(b, 0, 1)]
    rig.send([b * MIN + 2])  # from now on written at once and published
    rig.catch_up()
    assert [f.sequence for f in rig.published_frames(b)] == [1, 2]
    assert rig.published[-1][1].end == rig.schedule.get(b).size
    rig.close()


def test_replay_from_an_older_checkpoint_never_duplicates(tmp_path):
    rig = Rig(tmp_path)
    rnd = random.Random(3)
    rig.send([T0 + rnd.randrange(0, 20 * MIN) for _ in range(500)])
    rig.catch_up()
    rig.it.checkpoint()
    before = {b: sched_bytes(rig, b) for b in rig.schedule.buckets()}
    rig.send([T0 + rnd.randrange(0, 20 * MIN) for _ in range(50)])  # some new ones too
    replay = IterateService(
        rig.wal,
        rig.schedule,
        rig.ckpt,
        start_offset=rig.wal.first_offset,
        start_sequence=0,
        horizon=lambda: rig.horizon,
    )
    while replay.step():
        pass
    replay.checkpoint()
    assert replay.duplicates_skipped == 500
    assert replay.records_copied == 50
    for b, data in expected_bytes(rig).items():
        assert sched_bytes(rig, b) == data
        assert sched_bytes(rig, b).startswith(before.get(b, b""))
    rig.close()


def test_a_record_larger_than_one_read(tmp_path):
    rig = Rig(tmp_path, read_bytes=4096)
    b = naming.bucket_of(T0) + 1
    rig.send([b * MIN], payload=b"x" * 20_000)
    rig.send([b * MIN + 1, b * MIN + 2])
    rig.catch_up()
    assert sched_bytes(rig, b) == expected_bytes(rig)[b]
    assert [f.sequence for f in rig.published_frames()] == [1, 2, 3]
    rig.close()


def test_a_corrupt_message_log_record_stops_the_copy(tmp_path):
    rig = Rig(tmp_path)
    rig.send([T0 + 1, T0 + 2])
    seg = rig.wal.segment_at(rig.wal.first_offset)
    second = framing.HEADER_SIZE + len(wal_frames(rig)[0].body)
    with open(seg.path, "r+b") as f:  # flip a body byte of the second record
        f.seek(second + framing.HEADER_SIZE + 3)
        byte = f.read(1)
        f.seek(second + framing.HEADER_SIZE + 3)
        f.write(bytes([byte[0] ^ 0xFF]))
    rig.pool.forget(seg.path)
    with pytest.raises(Exception) as info:
        rig.catch_up()
    assert getattr(info.value, "offset", None) == rig.wal.first_offset + second
    rig.close()


def test_records_declared_far_gather_longer_until_something_else_comes(tmp_path):
    # gather_far of a minute: any step before it is over was ended by something else
    rig = Rig(tmp_path, gather=0.002, gather_far=60.0)
    far = naming.bucket_of(T0) + 30
    rig.it.start()
    first = rig.send_far([far * MIN + 1] * 10)
    wait_until(lambda: rig.it.sequence >= first, what="the first commit woke the idle service")
    steps = rig.it.steps
    second = rig.send_far([far * MIN + 2] * 10)  # follows on: one run declared far
    assert rig.it._only_far()
    rig.cancel(far * MIN + 1, 1)  # not declared: ends the long wait within a gather
    assert not rig.it._only_far()
    wait_until(lambda: rig.it.sequence == second + 1, what="copied with the record after it")
    assert rig.it.steps == steps + 1  # the far ones waited for it, then one step took both
    third = rig.send_far([far * MIN + 3])
    assert rig.it.wait_for(third, timeout=10)  # a reader waiting for them wakes the service
    rig.it.stop()
    rig.close()


def _voluntary_switches(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/status") as f:
        return int(next(line for line in f if line.startswith("voluntary_ctxt_switches:")).split()[1])


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="counts a thread's switches in Linux's /proc")
def test_a_far_wait_sleeps_through_and_a_commit_that_ends_it_wakes_it(tmp_path):
    # it used to look every ``gather`` whether it might go on sleeping: one wake-up (a thread
    # switch and a GIL hand-off) each, ~10 a step under bench.compare's ingest
    rig = Rig(tmp_path, gather=0.001, gather_far=60.0)
    far = naming.bucket_of(T0) + 30
    rig.it.start()
    first = rig.send_far([far * MIN + 1])
    wait_until(lambda: rig.it.sequence >= first, what="the first commit woke the idle service")
    second = rig.send_far([far * MIN + 2] * 3)
    wait_until(lambda: rig.it._waiting_far, what="the service in its far wait")
    tid = rig.it._thread.native_id
    before = _voluntary_switches(tid)
    # a window of 200 gathers (what is measured is what happens during it, so a time)
    threading.Event().wait(0.2)
    assert rig.it._waiting_far and rig.it.sequence < second  # still waiting for more
    assert _voluntary_switches(tid) - before <= 3  # was ~200: one a gather
    third = rig.send_far([far * MIN + 3])  # far too: the commit leaves the wait alone
    assert rig.it._waiting_far and rig.it.sequence < second
    rig.send([T0 + 5])  # not declared far: its commit ends the wait
    wait_until(lambda: rig.it.sequence == third + 1, what="copied at the commit of a record not declared far")
    rig.it.stop()
    rig.close()


def test_a_far_wait_ends_once_a_read_s_worth_is_committed(tmp_path):
    rig = Rig(tmp_path, gather=0.001, gather_far=60.0, read_bytes=8192)
    far = naming.bucket_of(T0) + 30
    rig.it.start()
    first = rig.send_far([far * MIN + 1])
    wait_until(lambda: rig.it.sequence >= first)
    last = rig.send_far([far * MIN + 2])
    wait_until(lambda: rig.it._waiting_far, what="the service in its far wait")
    while rig.wal.committed_offset - rig.it.offset < 4096:  # half a read: the wait ends at its commit
        last = rig.send_far([far * MIN + 3] * 10)
    wait_until(lambda: rig.it.sequence >= last, what="copied once half a read was committed")
    rig.it.stop()
    rig.close()


def test_records_declared_far_are_copied_within_gather_far(tmp_path):
    rig = Rig(tmp_path, gather=0.002, gather_far=0.05)
    far = naming.bucket_of(T0) + 30
    rig.it.start()
    first = rig.send_far([far * MIN + 1])
    wait_until(lambda: rig.it.sequence >= first)
    second = rig.send_far([far * MIN + 2] * 5)
    wait_until(lambda: rig.it.sequence >= second, what="copied once gather_far was over")
    assert rig.it.counts["messages"] == 6
    rig.it.stop()
    rig.close()


@pytest.mark.parametrize("interval", [0.01, 0.0])
def test_going_idle_flushes_the_id_index_memtable_and_trims_the_heap(tmp_path, monkeypatch, interval):
    # after a burst the memtable (up to two of 4 MiB) would stay in RAM until ingest filled
    # it; the first idle checkpoint writes it to an SST, then the heap is trimmed while idle.
    # An interval of 0 makes every step checkpoint: the one requested by the step that
    # copied the last records saves every offset, and going idle then found nothing
    # unsaved (the memtable stayed, 3 MB at 1 M pending, one bench.scheduler memory_far
    # run in three); the idle checkpoint is owed by the records copied, not by an offset.
    monkeypatch.setattr(idindex, "IDLE_FLUSH_BYTES", 1)
    trims = []
    monkeypatch.setattr(allocator, "trim", lambda: trims.append(1))
    ids = IdIndex(str(tmp_path / "ids"))
    rig = Rig(tmp_path, ids=ids, checkpoint_interval=interval)
    try:
        empty = ids.memory()["id_index_memtable_bytes"]  # a new memtable's first block
        rig.send([T0 + 30 * MIN + i for i in range(200)])
        rig.it.start()
        wait_until(lambda: rig.it.saved_offset == rig.it.offset == rig.wal.committed_offset, what="checkpointed")
        wait_until(lambda: ids.memory()["id_index_memtable_bytes"] == empty, what="the memtable flushed")
        wait_until(lambda: len(trims) >= iterate.IDLE_TRIMS, what="the heap trimmed after it")
        assert ids.get(f"m{T0 + 30 * MIN + 1}-1") == (T0 + 30 * MIN + 1, 2)  # in an SST now
    finally:
        rig.it.stop()
        ids.close()
        rig.close()


def test_a_small_memtable_is_kept_when_ingest_goes_idle_and_the_heap_trimmed_all_the_same(tmp_path, monkeypatch):
    # below IDLE_FLUSH_BYTES an idle flush would only make a tiny SST (a file, compaction);
    # the trims follow going idle, not the flush (other threads free after a burst too)
    trims = []
    monkeypatch.setattr(allocator, "trim", lambda: trims.append(1))
    ids = IdIndex(str(tmp_path / "ids"))
    rig = Rig(tmp_path, ids=ids, checkpoint_interval=0.01)
    try:
        rig.send([T0 + 30 * MIN + i for i in range(20)])
        rig.it.start()
        wait_until(lambda: rig.it.saved_offset == rig.it.offset == rig.wal.committed_offset, what="checkpointed")
        held = ids.memory()["id_index_memtable_bytes"]
        assert 0 < held < idindex.IDLE_FLUSH_BYTES
        assert not ids.flush_idle()
        assert ids.memory()["id_index_memtable_bytes"] == held
        wait_until(lambda: len(trims) >= iterate.IDLE_TRIMS, what="the heap trimmed while idle")
    finally:
        rig.it.stop()
        ids.close()
        rig.close()


def test_written_out_buffers_are_taken_again_and_dropped_with_the_read_buffer_when_idle(tmp_path, monkeypatch):
    """A bucket's write-behind buffer, once written out, is kept (with its allocation) for the
    next bucket route meets: grown again from nothing each checkpoint it faulted in fresh
    pages. Those buffers, and the buffer every step reads into, are dropped by the trims once
    ingest went idle, so that RSS falls back after a burst."""
    monkeypatch.setattr(allocator, "trim", lambda: None)
    rig = Rig(tmp_path, checkpoint_interval=60.0)
    far = naming.bucket_of(T0) + 30
    rig.send([far * MIN + 1] * 50 + [(far + 1) * MIN + 1] * 50)
    rig.catch_up()
    held = {b: rig.it._behind[b] for b in (far, far + 1)}
    with rig.it.append_lock:
        rig.it._flush_behind(list(rig.it._behind))
    assert {id(b) for b in rig.it._spares} == {id(b) for b in held.values()}
    assert len(rig.it._read_buf) > 0
    rig.send([(far + 5) * MIN + 1] * 10)
    rig.catch_up()
    assert any(rig.it._behind[far + 5] is b for b in held.values())  # taken again
    assert len(rig.it._spares) == 1
    assert reader.frames(bytes(rig.it._behind[far + 5]))[-1].sequence == rig.it.sequence  # only the new frames
    rig.it.checkpoint_interval = 0.01
    rig.it.start()
    wait_until(lambda: not rig.it._spares and not rig.it._read_buf, what="the spares and the read buffer dropped")
    rig.it.stop()
    assert len(reader.frames(sched_bytes(rig, far + 5))) == 10
    rig.close()


def test_the_heap_is_trimmed_after_a_large_flush_only_once_nothing_is_left_to_copy(tmp_path, monkeypatch):
    # while ingest goes on, the next checkpoint's write-behind buffers take the freed blocks
    # again: a malloc_trim after each large flush cost the iterate thread ~0.05-0.1 us a
    # message (the trim's heap walk and the page faults of taking the memory back)
    monkeypatch.setattr(iterate, "TRIM_AFTER_BYTES", 1)
    trims = []
    monkeypatch.setattr(allocator, "trim", lambda: trims.append(1))
    rig = Rig(tmp_path, write_behind_bytes=1, checkpoint_interval=60.0)
    try:
        far = naming.bucket_of(T0) + 30
        rig.send([far * MIN + i for i in range(50)])
        assert rig.it.step()  # copied, and flushed at once (past write_behind_bytes)
        assert len(sched_bytes(rig, far)) > 0 and not rig.it._behind
        rig.send([far * MIN + i for i in range(50)])
        assert rig.it.step()
        assert trims == []  # still copying: no trim
        rig.it.start()  # nothing left to copy: the flushes' trim is done now
        wait_until(lambda: len(trims) >= 1, what="the heap trimmed once idle")
    finally:
        rig.it.stop()
        rig.close()


def test_stop_after_an_error_waits_for_the_checkpoint_in_progress(tmp_path):
    # with an error set, stop() wrote no final checkpoint and so never took the persist
    # lock: it returned while a background checkpoint still fsynced segments and the id
    # index (Engine.close then closes both under it); now it waits for that one to end
    rig = Rig(tmp_path, checkpoint_interval=60.0)  # the one checkpoint: the test's
    order: list[str] = []
    release = threading.Event()
    real_persist = rig.it._persist

    def held_persist(state, dirty):
        assert release.wait(10)
        real_persist(state, dirty)
        order.append("checkpoint done")

    rig.it._persist = held_persist  # type: ignore[method-assign]
    try:
        rig.send([T0 + 30 * MIN])
        rig.it.start()
        wait_until(lambda: rig.it.offset == rig.wal.committed_offset, what="copied")
        assert rig.it._request_checkpoint()
        rig.it.error = RuntimeError("a step failed")

        def let_go() -> None:
            wait_until(lambda: rig.it._stop.is_set() and rig.it._thread is None, what="stop() joined the loop")
            release.set()

        helper = threading.Thread(target=let_go)
        helper.start()
        rig.it.stop()
        order.append("stopped")
        helper.join()
        assert order == ["checkpoint done", "stopped"]
    finally:
        release.set()
        rig.close()


def test_a_checkpoint_whose_snapshot_fails_leaves_stop_free_to_return(tmp_path):
    # _request_checkpoint took the persist lock, then _snapshot raised (its write-out of the
    # write-behind buffers): no checkpoint thread was started to release it, and stop() after
    # the error waited for it forever (a test suite hung in Engine.close, 27 Nov)
    rig = Rig(tmp_path, checkpoint_interval=60.0)
    try:
        rig.send([T0 + 30 * MIN])
        assert rig.it.step()

        def failing_snapshot():
            raise OSError("write-out of a write-behind buffer failed")

        rig.it._snapshot = failing_snapshot  # type: ignore[method-assign]
        with pytest.raises(OSError):
            rig.it._request_checkpoint()
        rig.it.error = RuntimeError("the iterate thread stopped on it")
        done = threading.Event()
        stopper = threading.Thread(target=lambda: (rig.it.stop(), done.set()), daemon=True)
        stopper.start()
        assert done.wait(10), "stop() waited for a persist lock nobody would release"
        stopper.join()
    finally:
        rig.close()
