"""The message log: group commit, flush policies, rolls, reopening, cleaning, failures."""

from __future__ import annotations

import asyncio
import errno
import os
import threading

import pytest
from byte_surgery import file_bytes
from conftest import wait_until
from disks import fill_disk, small_tmpfs

from qdelay.errors import DiskFull, InvariantViolation, ShuttingDown, WalFailed
from qdelay.segments import naming, segment
from qdelay.segments.framing import RecordKind
from qdelay.segments.segment import recover
from qdelay.segments.wal import DEFAULT_PREALLOC_BYTES, FlushPolicy, MessageLog

MESSAGE = RecordKind.MESSAGE


def entries(n: int, size: int = 100, ts: int = 0):
    return [(MESSAGE, ts + i, bytes([i % 251]) * size) for i in range(n)]


def read_all(log: MessageLog):
    frames, offset = [], log.first_offset
    while True:
        batch, offset = log.read(offset)
        if not batch:
            return frames
        frames.extend(batch)


@pytest.fixture
def wal_dir(tmp_path):
    return str(tmp_path / "message")


# --- group commit -----------------------------------------------------------------------


def test_concurrent_appenders_share_fsyncs_and_get_contiguous_sequences(wal_dir):
    log = MessageLog(wal_dir)
    threads, per_thread = 16, 150
    results: list = []
    lock = threading.Lock()

    def appender(t: int) -> None:
        for i in range(per_thread):
            done = log.append([(MESSAGE, t, b"%d:%d" % (t, i))])
            with lock:
                results.append(done)

    workers = [threading.Thread(target=appender, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    total = threads * per_thread
    assert sorted(r.first_sequence for r in results) == list(range(1, total + 1))
    assert log.committed_sequence == total and log.records_appended == total
    assert log.fsyncs < total  # records shared fdatasyncs
    frames = read_all(log)
    assert [f.sequence for f in frames] == list(range(1, total + 1))  # file order == sequence order
    by_seq = {r.first_sequence: r for r in results}
    for f in frames:
        assert (by_seq[f.sequence].start_offset, by_seq[f.sequence].end_offset) == (f.offset, f.offset + f.size)
    assert log.committed_offset == frames[-1].offset + frames[-1].size
    log.close()


def test_a_batch_gets_consecutive_sequences(wal_dir):
    log = MessageLog(wal_dir)
    a = log.append(entries(100))
    b = log.append(entries(3, ts=500))
    assert (a.first_sequence, a.count, b.first_sequence, b.count) == (1, 100, 101, 3)
    assert a.end_offset == b.start_offset == 100 * 136
    frames = read_all(log)
    assert [(f.sequence, f.timestamp) for f in frames[-3:]] == [(101, 500), (102, 501), (103, 502)]
    with pytest.raises(InvariantViolation):
        log.append([])
    log.close()


def test_append_async(wal_dir):
    log = MessageLog(wal_dir)

    async def main():
        return await asyncio.gather(*(log.append_async(entries(2)) for _ in range(50)))

    done = asyncio.run(main())
    assert sorted(d.first_sequence for d in done) == list(range(1, 101, 2))
    assert log.committed_sequence == 100 and log.fsyncs <= 50
    log.close()


def test_append_bodies_then_calls_back_on_the_loop_even_when_a_callback_fails(wal_dir, monkeypatch):
    """append_bodies_then: the records are queued on return; each callback runs on the
    appending loop's thread with (appended, None) once durable, in commit order, and one
    that raises neither strands the others' outcomes nor stops the log; a failed commit
    calls back (None, error)."""
    log = MessageLog(wal_dir)

    async def main():
        loop = asyncio.get_running_loop()
        outcomes: list = []
        settled = loop.create_future()

        def done(appended, error):
            assert threading.current_thread() is threading.main_thread()
            outcomes.append((appended, error))
            if len(outcomes) == 3:
                settled.set_result(None)
            if len(outcomes) == 1:
                raise RuntimeError("a callback's bug")

        queued = [log.append_bodies_then(MESSAGE, 7, [b"a", b"b"], done) for _ in range(3)]
        assert [a.first_sequence for a in queued] == [1, 3, 5]
        await asyncio.wait_for(settled, 10)
        assert [(a, e) for a, e in outcomes] == [(a, None) for a in queued]
        assert [f.body for f in read_all(log)] == [b"a", b"b"] * 3

        def failing(fd):
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(segment, "native_write_sync", False)  # the faults go through os.*
        monkeypatch.setattr(segment.os, "fdatasync", failing)
        failed = loop.create_future()
        log.append_bodies_then(MESSAGE, 7, [b"c"], lambda a, e: failed.set_result((a, e)))
        appended, error = await asyncio.wait_for(failed, 10)
        assert appended is None and isinstance(error, WalFailed)

    asyncio.run(main())
    log.close()


def test_async_appends_of_one_commit_wake_their_loop_once(wal_dir, monkeypatch):
    """The appends a group commit completes are settled with one wake-up of their loop (one
    call_soon_threadsafe), each with its own result, a failed commit's with its error."""
    log = MessageLog(wal_dir)
    real_fdatasync = segment.os.fdatasync
    in_sync, release = threading.Event(), threading.Event()
    fail = False

    def held_fdatasync(fd):
        in_sync.set()
        assert release.wait(10)
        if fail:
            raise OSError(errno.EIO, "Input/output error")
        real_fdatasync(fd)

    monkeypatch.setattr(segment, "native_write_sync", False)  # the faults go through os.*
    monkeypatch.setattr(segment.os, "fdatasync", held_fdatasync)

    async def main():
        nonlocal fail
        loop = asyncio.get_running_loop()
        wakes = 0
        real_call = loop.call_soon_threadsafe

        def counting(callback, *args):
            nonlocal wakes
            wakes += getattr(callback, "__qualname__", "") == "_LoopSettler._run"  # (to_thread's too go here)
            return real_call(callback, *args)

        monkeypatch.setattr(loop, "call_soon_threadsafe", counting)
        first = asyncio.ensure_future(log.append_async(entries(1)))
        await asyncio.to_thread(in_sync.wait, 10)  # the writer holds that commit in its fdatasync
        rest = [asyncio.ensure_future(log.append_async(entries(2))) for _ in range(5)]
        await asyncio.sleep(0)  # the five are queued behind it, for one commit
        release.set()
        done = await asyncio.gather(first, *rest)
        assert [d.first_sequence for d in done] == [1, 2, 4, 6, 8, 10]
        assert wakes == 2  # one a commit, not one an append
        in_sync.clear()
        release.clear()
        fail = True
        doomed = [asyncio.ensure_future(log.append_async(entries(1))) for _ in range(3)]
        await asyncio.to_thread(in_sync.wait, 10)
        release.set()
        outcomes = await asyncio.gather(*doomed, return_exceptions=True)
        assert all(isinstance(o, WalFailed) for o in outcomes)
        assert wakes <= 4

    asyncio.run(main())
    log.close()


def _hold_fdatasync(monkeypatch):
    """fdatasync held until released: appends submitted meanwhile gather for one commit."""
    real_fdatasync = segment.os.fdatasync
    in_sync, release = threading.Event(), threading.Event()

    def held(fd):
        in_sync.set()
        assert release.wait(10)
        real_fdatasync(fd)

    monkeypatch.setattr(segment, "native_write_sync", False)  # the faults go through os.*
    monkeypatch.setattr(segment.os, "fdatasync", held)
    return in_sync, release


def test_appends_gathered_for_one_commit_are_written_as_they_were_framed_not_joined(wal_dir, monkeypatch):
    """Each append's frames stay their own buffer until the writer hands them all to the
    segment at once (pwritev): an append never copies the ones queued before it (that
    copy, on the event loop, grew with every append a commit gathered). More appends than
    one pwritev takes (1,024) and more bytes than one write piece (256 KiB), read back in
    order, and again after a reopen."""
    log = MessageLog(wal_dir)
    chunk_counts: list[int] = []
    real_append_synced = segment.Segment.append_synced  # a commit's write and fdatasync

    def counting(self, chunks):
        chunk_counts.append(len(chunks))
        return real_append_synced(self, chunks)

    monkeypatch.setattr(segment.Segment, "append_synced", counting)
    in_sync, release = _hold_fdatasync(monkeypatch)
    waiters = []
    first = _Collect()
    log.submit(entries(1), first)
    assert in_sync.wait(10)  # the writer holds that commit in its fdatasync
    appends = 1500
    for i in range(appends):
        w = _Collect()
        log.submit([(MESSAGE, i, bytes([i % 251]) * 300)], w)
        waiters.append(w)
    release.set()
    for w in [first, *waiters]:
        assert w.done.wait(10) and w.error is None
    assert chunk_counts == [1, appends]  # one buffer an append, none joined
    expected = [bytes([0]) * 100] + [bytes([i % 251]) * 300 for i in range(appends)]
    assert [f.body for f in read_all(log)] == expected
    assert [w.appended.first_sequence for w in waiters] == list(range(2, appends + 2))
    log.close()
    reopened = MessageLog(wal_dir)
    assert [f.body for f in read_all(reopened)] == expected
    reopened.close()


def test_a_failed_write_of_gathered_appends_is_undone_and_each_rejected(wal_dir, monkeypatch):
    """A commit of several appends (one pwritev) that fails leaves no byte of any of them and
    rejects every one; their sequences are handed out again."""
    log = MessageLog(wal_dir, prealloc_bytes=0)  # byte-exact file contents
    log.append(entries(3))
    before = file_bytes(log.segments()[-1].path)
    in_sync, release = _hold_fdatasync(monkeypatch)
    held = _Collect()
    log.submit(entries(1), held)
    assert in_sync.wait(10)
    real_pwritev = os.pwritev

    def half_then_enospc(fd, buffers, offset):
        data = b"".join(bytes(b) for b in buffers)
        real_pwritev(fd, [data[:150]], offset)  # a partial record reaches the file
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(segment, "native_write_sync", False)  # the faults go through os.*
    monkeypatch.setattr(segment.os, "pwritev", half_then_enospc)
    doomed = [_Collect() for _ in range(4)]
    for w in doomed:
        log.submit(entries(2), w)
    release.set()
    assert held.done.wait(10) and held.error is None
    for w in doomed:
        assert w.done.wait(10) and isinstance(w.error, DiskFull)
    monkeypatch.setattr(segment.os, "pwritev", real_pwritev)
    assert log.failed is None
    assert log.append(entries(1)).first_sequence == 5  # after the held commit's record 4
    assert len(read_all(log)) == 5
    assert file_bytes(log.segments()[-1].path)[: len(before)] == before
    log.close()


class _Collect:
    """A submit callback that records its outcome."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.appended = None
        self.error: Exception | None = None

    def __call__(self, appended, error) -> None:
        self.appended, self.error = appended, error
        self.done.set()


def test_an_event_loop_that_appended_is_not_kept_alive_by_the_log(wal_dir):
    """The log keeps a settler per event loop that appends (a weak dict keyed by the loop);
    the settler held its loop strongly, so the weak key never died: every asyncio.run()
    that appended stayed alive, closed, for the log's life. (The writer thread also held
    the last commit's appenders, and their futures' loop, until the next commit.)"""
    import gc
    import weakref

    log = MessageLog(wal_dir)
    loops = []

    async def main():
        loops.append(weakref.ref(asyncio.get_running_loop()))
        await log.append_async(entries(1))

    for _ in range(3):
        asyncio.run(main())
    gc.collect()
    assert [r() for r in loops] == [None, None, None]
    log.append(entries(1))  # the log goes on
    log.close()


def test_wait_commit(wal_dir):
    log = MessageLog(wal_dir)
    assert log.wait_commit(0, 0.01) == 0
    threading.Timer(0.05, lambda: log.append(entries(1))).start()
    assert log.wait_commit(0, 5) == 136
    log.close()


# --- flush policies -----------------------------------------------------------------------


def test_flush_policy_parsing():
    assert FlushPolicy.parse("sync").is_sync
    assert FlushPolicy.parse("interval:5").interval_ms == 5
    assert FlushPolicy.parse("interval:20ms").interval_ms == 20
    for bad in ("interval:0", "always", "interval:x"):
        with pytest.raises(ValueError):
            FlushPolicy.parse(bad)


def test_interval_policy_acks_before_fsync_and_syncs_later(wal_dir):
    log = MessageLog(wal_dir, flush="interval:1000")
    for _ in range(20):
        log.append(entries(1))
    tail = log.segments()[-1]
    assert log.fsyncs == 0 and tail.synced_size < tail.size  # acknowledged, not yet synced
    wait_until(lambda: tail.synced_size == tail.size, timeout=5, what="the writer's own sync")
    assert log.fsyncs >= 1  # the writer synced on its own
    log.close()


def test_close_syncs_under_the_interval_policy(wal_dir):
    log = MessageLog(wal_dir, flush="interval:60000")
    log.append(entries(5))
    tail = log.segments()[-1]
    log.close()
    assert tail.synced_size == tail.size
    with pytest.raises(ShuttingDown):
        log.append(entries(1))


# --- reopening, rolling, cleaning ------------------------------------------------------------


def test_reopen_continues_sequences_and_offsets(wal_dir):
    log = MessageLog(wal_dir)
    log.append(entries(10))
    log.close()
    log = MessageLog(wal_dir)
    assert (log.committed_sequence, log.committed_offset) == (10, 1360)
    done = log.append(entries(1))
    assert (done.first_sequence, done.start_offset) == (11, 1360)
    log.close()
    log = MessageLog(wal_dir, min_next_sequence=1000)  # e.g. a promoted replica's floor
    assert log.append(entries(1)).first_sequence == 1000
    log.close()


def test_committed_past_tombstones_leaves_out_appends_of_cancel_records_alone(wal_dir):
    """What a by-id lookup waits for (Engine._ids_current): every commit but this process's
    appends of CANCEL records alone (submit_bodies of CANCEL); whatever was in the log at
    open counts, and a mixed append (a Reschedule's MESSAGE and CANCEL records) counts."""
    log = MessageLog(wal_dir)
    log.append(entries(3))
    assert (log.committed_sequence, log.committed_past_tombstones) == (3, 3)

    async def tombstones(n: int):
        return await log.append_bodies_async(RecordKind.CANCEL, 0, [b"t" * 24] * n)

    asyncio.run(tombstones(2))
    assert (log.committed_sequence, log.committed_past_tombstones) == (5, 3)
    log.append([(RecordKind.MESSAGE, 0, b"m"), (RecordKind.CANCEL, 0, b"t" * 24)])
    assert (log.committed_sequence, log.committed_past_tombstones) == (7, 7)

    async def both():  # one commit, a tombstone append queued after a message's
        return await asyncio.gather(log.append_async(entries(1)), tombstones(1))

    asyncio.run(both())
    assert log.committed_sequence == 9 and log.committed_past_tombstones in (8, 9)
    asyncio.run(tombstones(1))
    past = log.committed_past_tombstones
    # a Reschedule's append (its new MESSAGE records are findable by id elsewhere until
    # copied: Engine._moved) is left out too when it says so
    moved = [(RecordKind.MESSAGE, 0, b"m"), (RecordKind.CANCEL, 0, b"t" * 24)]
    asyncio.run(log.append_async(moved, covered=True))
    assert (log.committed_sequence, log.committed_past_tombstones) == (12, past)
    log.close()
    log = MessageLog(wal_dir)  # reopened: no claim covers what the log holds
    assert (log.committed_sequence, log.committed_past_tombstones) == (12, 12)
    log.close()


def test_segments_roll_by_size_and_are_named_by_base_offset(wal_dir):
    log = MessageLog(wal_dir, segment_bytes=1000)
    for _ in range(30):
        log.append(entries(2))  # 272 bytes a batch: three batches per segment
    segs = log.segments()
    assert len(segs) == 10
    for prev, seg in zip(segs, segs[1:]):
        assert seg.key == prev.key + prev.size and 0 < prev.size <= 1000
    assert [os.path.basename(s.path) for s in segs] == [naming.wal_name(s.key) for s in segs]
    assert naming.list_wal(wal_dir) == [(s.key, s.path) for s in segs]
    frames = read_all(log)
    assert [f.sequence for f in frames] == list(range(1, 61))
    assert frames[10].offset == 1360 and log.segment_at(1360).key == 816
    raw = log.read_raw(0, 10_000)
    assert len(raw) == 816  # one segment at a time
    assert raw == file_bytes(segs[0].path)
    log.close()
    log = MessageLog(wal_dir, segment_bytes=1000)
    assert log.append(entries(1)).first_sequence == 61
    log.close()


def test_read_raw_into_reads_what_read_raw_does_into_the_buffer_given(wal_dir):
    """The iterate service's read into its own buffer: the same bytes as read_raw (one segment
    at a time, committed bytes only, at most the buffer's length), a view of that buffer."""
    log = MessageLog(wal_dir, segment_bytes=1000)
    for _ in range(30):
        log.append(entries(2))  # 272 bytes a batch: three batches per segment
    buf = bytearray(5000)
    for offset in (0, 272, 815, 816, 1360, log.committed_offset - 1, log.committed_offset, log.committed_offset + 9):
        for size in (1, 100, 5000):
            got = log.read_raw_into(offset, memoryview(buf)[:size])
            assert bytes(got) == log.read_raw(offset, size)
            assert got.obj is buf
    log.close()


def test_delete_before_never_deletes_the_active_segment(wal_dir):
    log = MessageLog(wal_dir, segment_bytes=1000)
    for _ in range(12):
        log.append(entries(2))
    segs = log.segments()
    assert len(segs) == 4
    assert log.delete_before(segs[1].key + segs[1].size - 1) == [segs[0].path]
    assert log.first_offset == segs[1].key
    removed = log.delete_before(1 << 62)
    assert removed == [s.path for s in segs[1:-1]]
    assert log.segments() == [segs[-1]] and os.path.exists(segs[-1].path)
    with pytest.raises(InvariantViolation, match="cleaned"):
        log.read(0)
    assert [f.sequence for f in read_all(log)] == list(range(19, 25))
    log.close()
    log = MessageLog(wal_dir, segment_bytes=1000)
    assert log.append(entries(1)).first_sequence == 25
    log.close()


def test_an_interrupted_roll_leaves_nothing_that_blocks_reopening(wal_dir):
    log = MessageLog(wal_dir, segment_bytes=1000)
    log.append(entries(5))
    end = log.committed_offset
    log.close()
    # the crash came after the roll created the next segment but before the records queued
    # for the previous one were written: an empty file past the real end of the log
    open(os.path.join(wal_dir, naming.wal_name(end + 272)), "wb").close()
    log = MessageLog(wal_dir, segment_bytes=1000)
    assert naming.list_wal(wal_dir) == [(0, os.path.join(wal_dir, naming.wal_name(0)))]
    assert log.append(entries(1)).first_sequence == 6
    log.close()


def test_torn_tail_is_recovered_on_open_and_appends_continue(wal_dir):
    log = MessageLog(wal_dir)
    log.append(entries(5))
    log.close()
    path = os.path.join(wal_dir, naming.wal_name(0))
    os.truncate(path, 5 * 136 - 7)
    log = MessageLog(wal_dir)
    assert log.recoveries[0].torn and log.committed_sequence == 4
    assert log.append(entries(1)).first_sequence == 5
    assert [f.sequence for f in read_all(log)] == [1, 2, 3, 4, 5]
    log.close()


def test_a_gap_between_segments_with_records_is_refused(wal_dir):
    log = MessageLog(wal_dir, segment_bytes=300)
    for _ in range(4):
        log.append(entries(2))
    segs = log.segments()
    log.close()
    os.unlink(segs[1].path)
    with pytest.raises(InvariantViolation, match="gap"):
        MessageLog(wal_dir, segment_bytes=300)


# --- failures -----------------------------------------------------------------------------------


def test_a_failed_write_is_undone_and_rejected(wal_dir, monkeypatch):
    log = MessageLog(wal_dir, prealloc_bytes=0)  # byte-exact file contents
    log.append(entries(3))
    before = file_bytes(log.segments()[-1].path)
    real_pwrite = os.pwrite

    def half_then_enospc(fd, data, offset):
        if len(data) > 200:
            real_pwrite(fd, bytes(data)[:150], offset)  # a partial record reaches the file
            return 150
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(segment, "native_write_sync", False)  # the faults go through os.*
    monkeypatch.setattr(segment.os, "pwrite", half_then_enospc)
    with pytest.raises(DiskFull):
        log.append(entries(4))
    monkeypatch.setattr(segment.os, "pwrite", real_pwrite)
    assert file_bytes(log.segments()[-1].path) == before  # no partial record left behind
    assert log.failed is None
    assert log.append(entries(1)).first_sequence == 4  # the same sequence is handed out again
    log.close()


def test_a_failed_fdatasync_poisons_the_log(wal_dir, monkeypatch):
    log = MessageLog(wal_dir)
    log.append(entries(1))

    def eio(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(segment, "native_write_sync", False)  # the faults go through os.*
    monkeypatch.setattr(segment.os, "fdatasync", eio)
    with pytest.raises(WalFailed):
        log.append(entries(1))
    monkeypatch.undo()
    with pytest.raises(WalFailed):  # never retried: the kernel may have dropped the pages
        log.append(entries(1))
    assert isinstance(log.failed, WalFailed)
    log.close()
    log = MessageLog(wal_dir)  # reopening recovers from what is really on disk
    assert log.append(entries(1)).first_sequence == log.committed_sequence
    log.close()


def test_a_writer_that_breaks_refuses_its_appenders_instead_of_stranding_them(wal_dir, monkeypatch):
    """An error in the writer thread that is not an I/O error (a bug; a stale native codec
    without ``write_sync`` raised AttributeError here) used to kill the thread: every
    appender, sync or async, waited until its deadline and health stayed SERVING. Now the
    appenders in hand are refused, the log is poisoned and refuses the next appends."""
    log = MessageLog(wal_dir)
    log.append(entries(1))

    def broken(self, chunks):
        raise AttributeError("module 'qdelay.segments._codec' has no attribute 'write_sync'")

    monkeypatch.setattr(segment.Segment, "append_synced", broken)
    outcome: list[BaseException | None] = []

    def append_sync() -> None:
        try:
            log.append(entries(2))
            outcome.append(None)
        except BaseException as err:  # noqa: BLE001 - the outcome is what the test looks at
            outcome.append(err)

    appender = threading.Thread(target=append_sync, daemon=True)
    appender.start()
    appender.join(30)
    assert not appender.is_alive(), "the appender was left waiting on a dead writer"
    assert isinstance(outcome[0], WalFailed) and "AttributeError" in str(outcome[0])
    assert isinstance(log.failed, WalFailed)

    async def append_async() -> None:
        await asyncio.wait_for(log.append_async(entries(1)), 30)

    with pytest.raises(WalFailed):  # refused at once: the log stays poisoned
        asyncio.run(append_async())
    monkeypatch.undo()
    with pytest.raises(WalFailed):
        log.append(entries(1))
    log.close()
    log = MessageLog(wal_dir)  # reopening recovers from what is really on disk
    assert log.append(entries(1)).first_sequence == log.committed_sequence
    log.close()


def test_a_writer_that_breaks_after_its_write_still_answers_its_appenders(wal_dir, monkeypatch):
    """The same for an error after the write (the commit's bookkeeping): an async appender is
    refused, not stranded, and the writer does not die."""
    log = MessageLog(wal_dir)
    log.append(entries(1))
    monkeypatch.setattr(log, "_committed", lambda: (_ for _ in ()).throw(RuntimeError("bug after the write")))

    async def append_async():
        return await asyncio.wait_for(log.append_async(entries(3)), 30)

    with pytest.raises(WalFailed, match="RuntimeError: bug after the write"):
        asyncio.run(append_async())
    assert isinstance(log.failed, WalFailed)
    log.close()


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs, so that ENOSPC is real (test_a_failed_write_is_undone_and_rejected covers
    the same path where mounting is not allowed)."""
    with small_tmpfs(tmp_path, "1m") as mount_point:
        yield str(mount_point)


def test_disk_full_for_real(small_disk):
    directory = os.path.join(small_disk, "message")
    log = MessageLog(directory, prealloc_bytes=0)  # no reserved zeros: the next append fails
    log.append(entries(10, size=500))
    filler = fill_disk(small_disk)
    path = log.segments()[-1].path
    before = file_bytes(path)
    for _ in range(3):
        with pytest.raises(DiskFull):
            log.append(entries(100, size=1000))  # larger than any slack in the last page
        assert file_bytes(path) == before
    assert log.committed_sequence == 10 and log.failed is None
    os.unlink(filler)
    done = log.append(entries(100, size=1000))
    assert (done.first_sequence, done.count) == (11, 100)
    log.close()
    rec = recover(path)
    assert (rec.records, rec.cut_bytes) == (110, 0)
    log = MessageLog(directory)
    assert [f.sequence for f in read_all(log)] == list(range(1, 111))
    log.close()


def test_disk_full_with_preallocated_space(small_disk):
    """The zeros reserved ahead of the last record are written into after the disk fills;
    once they are used, appends fail with DiskFull and leave nothing behind."""
    directory = os.path.join(small_disk, "message")
    log = MessageLog(directory, prealloc_bytes=256 * 1024)
    log.append(entries(10, size=500))
    path = log.segments()[-1].path
    assert os.path.getsize(path) == 256 * 1024
    filler = fill_disk(small_disk)
    taken = 0
    with pytest.raises(DiskFull):
        for _ in range(100):
            log.append(entries(10, size=1000))
            taken += 10
    assert 10 <= taken and (10 + taken) * 1036 <= 256 * 1024 + 10 * 1036  # the reserve, then no more
    size = log.segments()[-1].size
    assert file_bytes(path)[size:] == bytes(os.path.getsize(path) - size)  # only zeros after the records
    assert log.committed_sequence == 10 + taken and log.failed is None
    os.unlink(filler)
    assert log.append(entries(5)).first_sequence == 11 + taken
    log.close()
    assert (recover(path).records, os.path.getsize(path)) == (15 + taken, size + 5 * 136)


def test_the_segment_being_written_is_zero_filled_ahead_and_trimmed_when_sealed(wal_dir):
    log = MessageLog(wal_dir, segment_bytes=3000, prealloc_bytes=1024)
    log.append(entries(2))  # 272 bytes
    seg = log.segments()[-1]
    assert os.path.getsize(seg.path) == 1024 and file_bytes(seg.path)[272:] == bytes(1024 - 272)
    for _ in range(12):
        log.append(entries(2))
    segs = log.segments()
    assert len(segs) == 2
    assert os.path.getsize(segs[0].path) == segs[0].size  # sealed: cut to its last record
    assert os.path.getsize(segs[1].path) % 1024 == 0 and os.path.getsize(segs[1].path) > segs[1].size
    assert [f.sequence for f in read_all(log)] == list(range(1, 27))
    assert log.read_raw(segs[1].key, 1 << 20) == file_bytes(segs[1].path)[: segs[1].size]
    log.close()
    assert os.path.getsize(segs[1].path) == segs[1].size  # a clean close cuts the zeros too


def test_a_crash_leaves_zeros_that_recovery_cuts(wal_dir, tmp_path):
    """What a SIGKILL leaves (tests/test_wal_crash.py kills real processes): every
    acknowledged record, then zeros. Reopening cuts the zeros, keeps nothing as evidence and
    continues the sequences and offsets."""
    import shutil

    log = MessageLog(wal_dir, prealloc_bytes=4096)
    log.append(entries(7))
    end = log.committed_offset
    crashed = str(tmp_path / "crashed")
    shutil.copytree(wal_dir, crashed)  # the files as they are on disk while the log runs
    log.close()
    path = os.path.join(crashed, naming.wal_name(0))
    assert os.path.getsize(path) == 4096
    log = MessageLog(crashed)
    rec = log.recoveries[-1]
    assert rec.torn and rec.cut_bytes == 4096 - end and rec.broken_path is None
    assert log.committed_offset == end and log.append(entries(1)).first_sequence == 8
    assert [f.sequence for f in read_all(log)] == list(range(1, 9))
    log.close()


def test_a_commit_is_written_and_synced_in_one_call(wal_dir, monkeypatch):
    """A commit into one segment (nearly every one) is one Segment.append_synced: its writes
    and its fdatasync in one native call that releases the GIL once (the writer waited for
    the GIL again between the two), with the same bytes, preallocation and fsync count."""
    log = MessageLog(wal_dir)
    calls = []
    real_append_synced = segment.Segment.append_synced

    def counting(self, chunks):
        calls.append(len(chunks))
        return real_append_synced(self, chunks)

    monkeypatch.setattr(segment.Segment, "append_synced", counting)
    monkeypatch.setattr(segment.Segment, "sync", lambda self: pytest.fail("synced apart from its write"))
    fsyncs = log.fsyncs
    for _ in range(3):
        log.append(entries(2))
    assert calls == [1, 1, 1] and log.fsyncs == fsyncs + 3
    seg = log.segments()[-1]
    assert seg.synced_size == seg.size and seg.allocated == DEFAULT_PREALLOC_BYTES  # zeros ahead, as before
    assert os.path.getsize(seg.path) == DEFAULT_PREALLOC_BYTES
    assert len(read_all(log)) == 6
    log.close()
