"""One test per row of the recovery decision table in docs/recovery.md.

Every test writes real files with the real engine, damages them byte by byte
(tests/byte_surgery.py), reopens the engine on the folder and checks what it detected,
what it did, and that the delivery guarantees still hold: every acknowledged send
delivered, acknowledged deliveries not repeated unless their dispatch record was lost,
nothing corrupt ever served.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil

import byte_surgery as bs
import pytest
from simclock import MINUTE, T0, CollectingSink, Driver, FakeClock, files, message

from qdelay.errors import CorruptRecord, StorageError
from qdelay.segments import checkpoint, framing, records, schedule_index
from qdelay.segments.framing import RecordKind
from qdelay.segments.naming import bucket_of
from qdelay.server import iterate as iterate_mod
from qdelay.server.engine import CancelOutcome, MessageState

# --- helpers ------------------------------------------------------------------------------------------


def crash(engine) -> None:
    """Stop an engine the way SIGKILL would: no final checkpoint, no dispatch flush.

    Whatever the message log acknowledged is on disk (its writer is drained); schedule
    and dispatch writes are in the page cache, as after a process kill."""
    engine.wal.close()
    engine.pool.close()
    if engine.ids is not None:
        engine.ids.close()  # its WAL is in the page cache, as after a process kill
    engine.folder_lock.release()  # the kernel drops a killed process's lock


def frames_of(path: str) -> list[framing.Frame]:
    data = bs.file_bytes(path)
    out, pos = [], 0
    while pos < len(data):
        f = framing.check_at(data, pos)
        out.append(framing.Frame(pos, f.kind, f.sequence, f.timestamp, f.body))
        pos += f.size
    return out


def wal_file(root) -> str:
    (path,) = files(root, "message", ".wal")[-1:]
    return path


def sched_files(root) -> list[str]:
    return files(root, "schedule", ".sched")


def assert_no_duplicate_schedule_records(root) -> None:
    for path in sched_files(root):
        seqs = [f.sequence for f in frames_of(path)]
        assert len(seqs) == len(set(seqs)), f"{path} holds a sequence twice"


def ckpt_path(root) -> str:
    return os.path.join(str(root), "checkpoint", "iterate.ckpt")


@pytest.fixture
def clock():
    return FakeClock(T0 + 1_000)


def new_driver(root, clock, **cfg):
    return Driver(root, clock, CollectingSink(clock), **cfg)


def send_due_soon(d, n, prefix="m", offset=30_000):
    return d.send(message("s", d.clock.now + offset + i, f"{prefix}{i}") for i in range(n))


def deliver_all(d, upto_ms, ack=True):
    """Run to ``upto_ms`` and return (and ack) what was delivered."""
    d.run(upto_ms)
    got = d.sink.take()
    if ack:
        d.engine.ack([g.ack_id for g in got])
        d.run()
    return got


# --- message log ----------------------------------------------------------------------------------------


def test_message_log_torn_tail(tmp_path, clock):
    d = new_driver(tmp_path, clock)
    receipts = send_due_soon(d, 10)
    d.close()
    wal = wal_file(tmp_path)
    # a write of one more record that died half way (it was never acknowledged)
    torn = framing.encode(RecordKind.MESSAGE, 11, T0, b"x" * 200)[:120]
    bs.append_garbage(wal, torn)
    d.open()
    rec = d.engine.wal.recoveries[-1]
    assert rec.torn and rec.cut_bytes == 120 and rec.broken_path and os.path.exists(rec.broken_path)
    assert d.engine.wal.committed_sequence == 10
    nxt = d.send([message("s", clock.now, "after")])[0]
    assert nxt.sequence == 11
    got = deliver_all(d, clock.now + 31_000)
    assert sorted(g.message_id for g in got) == sorted([r.message_id for r in receipts] + ["after"])
    d.close()


def test_message_log_zero_filled_tail(tmp_path, clock):
    d = new_driver(tmp_path, clock)
    receipts = send_due_soon(d, 10)
    d.close()
    wal = wal_file(tmp_path)
    size = os.path.getsize(wal)
    bs.zero_fill_tail(wal, 4096)
    d.open()
    rec = d.engine.wal.recoveries[-1]
    assert rec.torn and rec.cut_bytes == 4096 and rec.broken_path is None, "zeros are not evidence"
    assert os.path.getsize(wal) == size
    got = deliver_all(d, clock.now + 31_000)
    assert sorted(g.message_id for g in got) == sorted(r.message_id for r in receipts)
    d.close()


@pytest.mark.parametrize("policy", ["fail", "truncate"])
def test_message_log_corrupt_record_before_tail(tmp_path, clock, policy):
    d = new_driver(tmp_path, clock)
    receipts = send_due_soon(d, 10)
    d.close()  # all 10 are iterated and checkpointed
    wal = wal_file(tmp_path)
    fifth = frames_of(wal)[4]
    bs.flip_byte(wal, fifth.offset + framing.HEADER_SIZE + 3)
    d.cfg["corruption"] = policy
    if policy == "fail":
        with pytest.raises(CorruptRecord) as err:
            d.open()
        assert err.value.offset == fifth.offset
        return
    d.open()
    rec = d.engine.wal.recoveries[-1]
    assert rec.corrupt_at == fifth.offset and rec.broken_path
    # the cut left the checkpoint ahead of the log: noted, and sequences never go back
    assert any("ahead of the message log" in n for n in d.engine.recovery_notes)
    assert d.send([message("s", clock.now, "after")])[0].sequence == 11
    # the schedule log already held all ten: nothing acknowledged is lost
    got = deliver_all(d, clock.now + 31_000)
    assert sorted(g.message_id for g in got) == sorted([r.message_id for r in receipts] + ["after"])
    d.close()


# --- schedule log -----------------------------------------------------------------------------------------


def test_schedule_torn_tail_after_checkpoint(tmp_path, clock):
    d = new_driver(tmp_path, clock, checkpoint_interval_ms=10**9)
    first = send_due_soon(d, 5, "a")
    d.catch_up()
    d.engine.iterate.checkpoint()
    second = send_due_soon(d, 5, "b")
    d.catch_up()  # copied to the schedule segment, no checkpoint yet
    crash(d.engine)
    (sched,) = sched_files(tmp_path)
    last = frames_of(sched)[-1]
    bs.truncate_at(sched, last.offset + 17)  # the last record's write was torn
    d.open()
    assert any("cut" in n and "replay" in n for n in d.engine.recovery_notes), d.engine.recovery_notes
    d.catch_up()
    assert_no_duplicate_schedule_records(tmp_path)
    assert [f.sequence for f in frames_of(sched)] == list(range(1, 11))
    got = deliver_all(d, clock.now + 31_000)
    assert sorted(g.message_id for g in got) == sorted(r.message_id for r in first + second)
    d.close()


def test_schedule_corrupt_record_at_dispatch(tmp_path, clock, caplog):
    d = new_driver(tmp_path, clock)
    receipts = send_due_soon(d, 10)
    d.run()  # loaded into the wheel (the minute is inside the window), not due yet
    assert d.engine.scheduler.stats()["wheel_size"] == 10
    (sched,) = sched_files(tmp_path)
    bad = frames_of(sched)[6]
    bs.flip_byte(sched, bad.offset + framing.HEADER_SIZE + 5)  # rots on disk after loading
    with caplog.at_level(logging.ERROR, logger="qdelay.scheduler"):
        got = deliver_all(d, clock.now + 31_000)
    assert sorted(g.message_id for g in got) == sorted(r.message_id for i, r in enumerate(receipts) if i != 6)
    assert d.engine.scheduler.stats()["corrupt_skipped"] == 1
    reports = [r for r in caplog.records if "corrupt schedule record" in r.getMessage()]
    assert reports and reports[0].path == sched and reports[0].offset == bad.offset
    # never served later either
    d.advance(10 * MINUTE)
    assert receipts[6].message_id not in [g.message_id for g in d.sink.take()]
    d.close()


def test_schedule_corrupt_record_at_load(tmp_path, clock, caplog):
    """A record that rots before the loader reads it: reported with path and offset,
    never served, and every other message of the bucket is still delivered."""
    d = new_driver(tmp_path, clock)
    receipts = send_due_soon(d, 10, offset=5 * MINUTE)  # beyond the window: only on disk
    d.run()
    d.close()
    (sched,) = sched_files(tmp_path)
    bad = frames_of(sched)[6]
    bs.flip_byte(sched, bad.offset + framing.HEADER_SIZE + 5)
    d.open()
    got = deliver_all(d, clock.now + 5 * MINUTE + 31_000)
    assert sorted(g.message_id for g in got) == sorted(r.message_id for i, r in enumerate(receipts) if i != 6)
    assert d.engine.scheduler.stats()["corrupt_skipped"] == 1
    reports = [r for r in caplog.records if "corrupt schedule record" in r.getMessage()]
    assert reports and reports[0].path == sched and reports[0].offset == bad.offset
    assert d.engine.healthy()
    d.close()


# --- the iterate checkpoint -----------------------------------------------------------------------------------


def _delivered_then_reopen(tmp_path, clock, damage):
    """Send 20 (due soon), deliver and ack 10 of them, close; damage; reopen and run."""
    d = new_driver(tmp_path, clock)
    acked = d.send(message("s", clock.now + 1_000 + i, f"a{i}") for i in range(10))
    later = d.send(message("s", clock.now + 40_000 + i, f"b{i}") for i in range(10))
    got = deliver_all(d, clock.now + 2_000)
    assert sorted(g.message_id for g in got) == sorted(r.message_id for r in acked)
    d.close()
    damage()
    d.open()
    d.catch_up()
    assert_no_duplicate_schedule_records(tmp_path)
    got = deliver_all(d, clock.now + 60_000)
    assert sorted(g.message_id for g in got) == sorted(r.message_id for r in later), (
        "acked deliveries are not repeated; every other message comes"
    )
    for r in acked:
        assert d.get(r).state == MessageState.DELIVERED
    assert d.send([message("s", clock.now, "z")])[0].sequence == 21
    return d


def test_checkpoint_missing(tmp_path, clock):
    d = _delivered_then_reopen(tmp_path, clock, lambda: os.unlink(ckpt_path(tmp_path)))
    assert d.engine.iterate.duplicates_skipped == 20, "the replay skipped what the schedule log held"
    d.close()


def test_checkpoint_corrupt(tmp_path, clock):
    d = _delivered_then_reopen(tmp_path, clock, lambda: bs.flip_byte(ckpt_path(tmp_path), 40))
    assert any("checkpoint unreadable" in n for n in d.engine.recovery_notes)
    assert d.engine.iterate.duplicates_skipped == 20
    d.close()


def test_checkpoint_behind_the_logs(tmp_path, clock):
    d = new_driver(tmp_path, clock)
    first = send_due_soon(d, 5, "a")
    d.catch_up()
    d.engine.iterate.checkpoint()
    old = bs.file_bytes(ckpt_path(tmp_path))
    second = send_due_soon(d, 5, "b")
    got = deliver_all(d, clock.now + 31_000)
    assert len(got) == 10
    d.close()
    with open(ckpt_path(tmp_path), "wb") as f:  # an older checkpoint (e.g. restored from backup)
        f.write(old)
    d.open()
    d.catch_up()
    assert d.engine.iterate.duplicates_skipped == 5
    assert_no_duplicate_schedule_records(tmp_path)
    d.advance(MINUTE)
    assert d.sink.take() == [], "acked deliveries are not repeated"
    for r in first + second:
        assert d.get(r).state == MessageState.DELIVERED
    d.close()


@pytest.mark.parametrize("policy", ["fail", "truncate"])
def test_checkpoint_ahead_of_message_log(tmp_path, clock, policy):
    d = new_driver(tmp_path, clock)
    receipts = send_due_soon(d, 10)
    d.close()
    wal = wal_file(tmp_path)
    eighth = frames_of(wal)[7]
    bs.truncate_at(wal, eighth.offset)  # acknowledged records 8..10 vanished (a lying disk)
    d.cfg["corruption"] = policy
    if policy == "fail":
        with pytest.raises(StorageError, match="ahead of the message log"):
            d.open()
        return
    d.open()
    assert any("ahead of the message log" in n for n in d.engine.recovery_notes)
    assert d.engine.iterate.offset == d.engine.wal.committed_offset
    assert d.send([message("s", clock.now, "after")])[0].sequence == 11, "sequences never go back"
    got = deliver_all(d, clock.now + 31_000)
    # the schedule log still held all ten
    assert sorted(g.message_id for g in got) == sorted([r.message_id for r in receipts] + ["after"])
    d.close()


def test_checkpoint_offset_not_at_record_boundary(tmp_path, clock):
    d = new_driver(tmp_path, clock)
    receipts = send_due_soon(d, 10)
    d.close()
    state = checkpoint.read(ckpt_path(tmp_path))
    wal = wal_file(tmp_path)
    fourth = frames_of(wal)[3]
    state["offset"] = fourth.offset + 7
    state["sequence"] = 4
    checkpoint.write(ckpt_path(tmp_path), state)
    d.open()
    assert any("not a record boundary" in n for n in d.engine.recovery_notes)
    d.catch_up()
    assert d.engine.iterate.duplicates_skipped == 10
    assert_no_duplicate_schedule_records(tmp_path)
    got = deliver_all(d, clock.now + 31_000)
    assert sorted(g.message_id for g in got) == sorted(r.message_id for r in receipts)
    d.close()


@pytest.mark.parametrize("policy", ["fail", "truncate"])
def test_checkpoint_behind_oldest_message_segment(tmp_path, clock, policy):
    d = new_driver(tmp_path, clock, segment_bytes=2048)
    first = send_due_soon(d, 3, "a")
    d.catch_up()
    d.engine.iterate.checkpoint()
    old = bs.file_bytes(ckpt_path(tmp_path))
    rest = []
    for k in range(6):
        rest += d.send(message("s", clock.now + 30_000, f"b{k}.{i}", payload=b"x" * 300) for i in range(4))
    d.close()
    wals = files(tmp_path, "message", ".wal")
    assert len(wals) >= 3
    with open(ckpt_path(tmp_path), "wb") as f:
        f.write(old)
    os.unlink(wals[0])  # deleted before being iterated (QMQ's cleaner did this)
    d.cfg["corruption"] = policy
    if policy == "fail":
        with pytest.raises(StorageError, match="behind the oldest message-log segment"):
            d.open()
        return
    d.open()
    assert any("behind the oldest" in n for n in d.engine.recovery_notes)
    d.catch_up()
    assert_no_duplicate_schedule_records(tmp_path)
    got = deliver_all(d, clock.now + 31_000)
    # the schedule log had everything that was iterated before the loss
    assert sorted(g.message_id for g in got) == sorted(r.message_id for r in first + rest)
    d.close()


# --- dispatch log -----------------------------------------------------------------------------------------------


def test_dispatch_log_torn_tail(tmp_path, clock):
    d = new_driver(tmp_path, clock)
    receipts = d.send(message("s", clock.now + 1_000 + i, f"m{i}") for i in range(5))
    got = deliver_all(d, clock.now + 2_000)
    assert len(got) == 5
    d.close()  # the minute is not over: it is loaded again on restart
    (disp,) = files(tmp_path, "dispatch", ".disp")
    recs = frames_of(disp)
    assert len(recs) == 5
    bs.truncate_at(disp, recs[-1].offset + 20)  # the last ack record was torn
    d.open()
    again = deliver_all(d, clock.now + 1)
    lost = recs[-1].sequence
    assert [g.ack_id.split(".")[0] for g in again] == [str(lost)], (
        "only the delivery whose ack record was torn comes again"
    )
    assert [f.sequence for f in frames_of(disp)].count(lost) == 1
    for r in receipts:
        assert d.get(r).state == MessageState.DELIVERED
    d.close()


# --- crash between the schedule flush and the checkpoint ---------------------------------------------------------


def test_crash_between_schedule_flush_and_checkpoint(tmp_path, clock, monkeypatch):
    d = new_driver(tmp_path, clock, checkpoint_interval_ms=10**9)
    first = send_due_soon(d, 5, "a")
    d.catch_up()
    d.engine.iterate.checkpoint()
    saved = checkpoint.read(ckpt_path(tmp_path))
    second = send_due_soon(d, 5, "b")
    d.catch_up()

    class Killed(Exception):
        pass

    def die(path, state):
        raise Killed  # the process dies after schedule.sync(), before the rename

    monkeypatch.setattr(iterate_mod.checkpoint, "write", die)
    with pytest.raises(Killed):
        d.engine.iterate.checkpoint()
    monkeypatch.undo()
    crash(d.engine)
    assert checkpoint.read(ckpt_path(tmp_path))["offset"] == saved["offset"]
    d.open()
    d.catch_up()
    assert d.engine.iterate.duplicates_skipped == 5, "the replay found the flushed records"
    assert_no_duplicate_schedule_records(tmp_path)
    got = deliver_all(d, clock.now + 31_000)
    assert sorted(g.message_id for g in got) == sorted(r.message_id for r in first + second)
    d.close()


def test_sealed_segment_corruption_found_when_read(tmp_path):
    """Row 3b: opening does not scan sealed message-log segments; a damaged one is found
    by the first reader, which refuses it with its path and offset."""
    from qdelay.segments import records as rec
    from qdelay.segments.framing import RecordKind
    from qdelay.segments.wal import MessageLog

    wal_dir = str(tmp_path / "message")
    log_ = MessageLog(wal_dir, segment_bytes=4096)
    body = rec.encode_message(b"s", b"id", b"", b"x" * 100, 0)
    for _ in range(10):
        log_.append([(RecordKind.MESSAGE, 1, body)] * 5)
    log_.close()
    first = sorted(p for p in (tmp_path / "message").iterdir())[0]
    bs.flip_byte(str(first), framing.HEADER_SIZE + 40)
    reopened = MessageLog(wal_dir, segment_bytes=4096)  # opens: the damage is in a sealed segment
    try:
        with pytest.raises(CorruptRecord) as err:
            reopened.read(0)
        assert err.value.path == str(first) and err.value.offset == 0
    finally:
        reopened.close()


# --- the message-id index (row 14) -------------------------------------------------------------------------

HOUR = 3_600_000


def by_id(d, message_id: str) -> tuple[MessageState, int]:
    """(state, due) of what a Get by id answers."""
    d.catch_up()
    st = d.engine.get_sync(message_id, None, None)
    return st.state, st.deliver_at_ms


def duplicates(d, ids: list[str]) -> dict[str, tuple[int, int]]:
    """What an idempotent send of ``ids`` answers (server/dedupe.py, the send path's own
    check): id -> (due, sequence) of the message it duplicates."""
    from qdelay.server.dedupe import Deduper

    d.catch_up()
    dups, _claim = asyncio.run(Deduper(d.engine, 600_000).check(ids))
    return {ids[k]: (r.deliver_at_ms, r.sequence) for k, r in dups.items()}


def place(r) -> tuple[int, int]:
    return r.deliver_at_ms, r.sequence


def test_id_index_lost(tmp_path, clock):
    """Row 14: the index folder is gone (deleted, disk replaced): rebuilt at open from the
    schedule segments; by-id calls and dedupe answer at once."""
    d = new_driver(tmp_path, clock)
    sent = d.send(message("s", clock.now + HOUR + i, f"l{i}") for i in range(10))
    d.close()
    shutil.rmtree(tmp_path / "index")
    d.open()
    assert (tmp_path / "index" / "ids" / "BUILT").exists()
    assert by_id(d, "l4") == (MessageState.PENDING, sent[4].deliver_at_ms)
    assert duplicates(d, ["l0", "l9", "new"]) == {"l0": place(sent[0]), "l9": place(sent[9])}
    d.close()


def test_id_index_half_written(tmp_path, clock):
    """Row 14b: the index folder is there but its build never completed (``BUILT`` missing:
    a crash during a rebuild, or an older copy of the folder put back): rebuilt at open.
    Ids it lacked, and an id whose newest message it did not know (rescheduled since),
    are right at once for by-id calls and for dedupe."""
    d = new_driver(tmp_path, clock)
    first = d.send(message("s", clock.now + HOUR + i, f"h{i}") for i in range(10))
    d.close()
    index = tmp_path / "index" / "ids"
    shutil.copytree(index, tmp_path / "older")
    d.open()
    later = d.send(message("s", clock.now + HOUR + 100 + i, f"h{i}") for i in range(10, 20))
    d.catch_up()
    outcome, moved = asyncio.run(d.engine.reschedule("h3", None, None, clock.now + 2 * HOUR))
    assert outcome == 1 and moved is not None  # RESCHEDULED
    d.close()
    shutil.rmtree(index)
    shutil.copytree(tmp_path / "older", index)
    os.unlink(index / "BUILT")
    d.open()
    assert (index / "BUILT").exists()
    assert by_id(d, "h15") == (MessageState.PENDING, later[5].deliver_at_ms)
    assert by_id(d, "h3") == (MessageState.PENDING, moved.deliver_at_ms)
    assert d.get(first[3]).state == MessageState.CANCELLED  # its old place: moved away
    assert duplicates(d, ["h3", "h15", "h0", "new"]) == {
        "h3": place(moved),
        "h15": place(later[5]),
        "h0": place(first[0]),
    }
    d.close()


class _FullDisk:
    """An index database whose writes fail as RocksDB's do on a full disk; reads work."""

    def __init__(self, db) -> None:
        self._db = db

    def write(self, *_args, **_kw):
        raise Exception("IO error: No space left on device: While appending to file: index/ids/000009.log")

    def __getattr__(self, name: str):
        return getattr(self._db, name)


def test_id_index_disabled_after_a_write_error(tmp_path, clock, monkeypatch):
    """Row 14c: a write to the index fails (a full disk): the index stops (by-id calls are
    UNAVAILABLE, receipts and sends work, the iterate service goes on) and drops ``BUILT``;
    the next open rebuilds it, and by-id calls and dedupe know every message again."""
    from qdelay.errors import Unavailable

    d = new_driver(tmp_path, clock)
    before = d.send(message("s", clock.now + HOUR + i, f"e{i}") for i in range(5))
    d.catch_up()
    index = d.engine.ids
    monkeypatch.setattr(index, "_db", _FullDisk(index._db))
    after = d.send(message("s", clock.now + HOUR + 10 + i, f"e{i}") for i in range(5, 10))
    d.catch_up()
    assert index.failed is not None and "No space left" in index.failed
    assert not (tmp_path / "index" / "ids" / "BUILT").exists()
    with pytest.raises(Unavailable, match="index is disabled"):
        by_id(d, "e1")
    assert d.get(after[2]).state == MessageState.PENDING  # receipts need no index
    assert d.engine.iterate.sequence == after[-1].sequence and d.engine.healthy()
    d.close()
    monkeypatch.undo()
    d.open()
    assert (tmp_path / "index" / "ids" / "BUILT").exists()
    assert by_id(d, "e7") == (MessageState.PENDING, after[2].deliver_at_ms)
    assert by_id(d, "e1") == (MessageState.PENDING, before[1].deliver_at_ms)
    assert duplicates(d, ["e1", "e7", "new"]) == {"e1": place(before[1]), "e7": place(after[2])}
    d.close()


def test_id_index_rebuilt_around_a_damaged_segment(tmp_path, clock):
    """Row 14d: the index is rebuilt from a schedule segment with a corrupt record: every
    verified record is indexed (the reading resumes after the damage, as the loader's
    does), so the messages after it are found by id and by receipt, cancelled, and
    recognised by dedupe; the damaged one, never delivered, is not found."""
    d = new_driver(tmp_path, clock)
    sent = d.send(message("s", clock.now + HOUR + i, f"d{i}") for i in range(10))
    d.close()
    (sched,) = sched_files(tmp_path)
    bad = frames_of(sched)[6]
    bs.flip_byte(sched, bad.offset + framing.HEADER_SIZE + 5)
    shutil.rmtree(tmp_path / "index")
    d.open()
    assert by_id(d, "d8") == (MessageState.PENDING, sent[8].deliver_at_ms)
    assert by_id(d, "d6")[0] == MessageState.NOT_FOUND
    assert duplicates(d, ["d2", "d6", "d8"]) == {"d2": place(sent[2]), "d8": place(sent[8])}
    # by receipt too: the finder reads around the damage as well
    assert d.get(sent[6]).state == MessageState.NOT_FOUND
    assert d.cancel(sent[7]) == CancelOutcome.CANCELLED
    assert by_id(d, "d7")[0] == MessageState.CANCELLED


# --- schedule index (row 15) ----------------------------------------------------------------------------


def _index_folder(tmp_path, clock, **cfg):
    """A folder with 40 messages an hour ahead, 6 of them cancelled; (driver still open,
    receipts, cancelled sequences, the index file)."""
    d = new_driver(tmp_path, clock, **cfg)
    receipts = d.send(message("s", clock.now + 60 * MINUTE + i, f"x{i}") for i in range(40))
    victims = receipts[3:30:5]
    d.catch_up()
    outcomes = asyncio.run(d.engine.cancel_many([(r.message_id, r.deliver_at_ms, r.sequence) for r in victims]))
    assert set(outcomes) == {CancelOutcome.CANCELLED}
    d.catch_up()
    d.engine.iterate.flush_bucket(bucket_of(receipts[0].deliver_at_ms))
    (sched,) = sched_files(tmp_path)
    return d, receipts, {r.sequence for r in victims}, schedule_index.path_of(sched)


def _assert_index_answers(d, receipts, cancelled, sidx, entries: int = 46) -> None:
    """Get answers from the index as from the records, and the file is what a fresh
    derivation from its segment writes."""
    for r in receipts:
        want = MessageState.CANCELLED if r.sequence in cancelled else MessageState.PENDING
        assert d.engine.get_sync(r.message_id, r.deliver_at_ms, r.sequence).state == want, r
    have = bs.file_bytes(sidx)
    seg = d.engine.schedule.get(bucket_of(receipts[0].deliver_at_ms))
    seg.index.rebuild(seg)
    assert bs.file_bytes(sidx) == have and len(have) == entries * schedule_index.ENTRY_SIZE


def _reopened_with_note(d) -> None:
    d.open()
    assert any("schedule indexes" in n and "re-derived" in n for n in d.engine.recovery_notes), d.engine.recovery_notes


def test_schedule_index_missing(tmp_path, clock):
    d, receipts, cancelled, sidx = _index_folder(tmp_path, clock)
    d.close()
    os.unlink(sidx)  # deleted, or a folder of an older version, or a resynced slave's
    _reopened_with_note(d)
    _assert_index_answers(d, receipts, cancelled, sidx)
    d.close()


def test_schedule_index_torn_tail(tmp_path, clock):
    d, receipts, cancelled, sidx = _index_folder(tmp_path, clock)
    d.close()
    bs.truncate_at(sidx, os.path.getsize(sidx) - 11)  # not a whole number of entries
    _reopened_with_note(d)
    _assert_index_answers(d, receipts, cancelled, sidx)
    d.close()


def test_schedule_index_behind_its_segment(tmp_path, clock):
    d, receipts, cancelled, sidx = _index_folder(tmp_path, clock)
    d.close()
    # whole entries, but the last two records (two tombstones) are not in it
    bs.truncate_at(sidx, os.path.getsize(sidx) - 2 * schedule_index.ENTRY_SIZE)
    _reopened_with_note(d)
    _assert_index_answers(d, receipts, cancelled, sidx)
    d.close()


def test_schedule_index_ahead_of_its_segment(tmp_path, clock):
    d, receipts, cancelled, sidx = _index_folder(tmp_path, clock)
    d.close()
    # the segment lost its last record (a tombstone) outside any crash: the index names a
    # record the segment does not hold; re-derived, it says what the segment says
    (sched,) = sched_files(tmp_path)
    last = frames_of(sched)[-1]
    bs.truncate_at(sched, last.offset)
    _reopened_with_note(d)
    lost = records.decode_cancel(last.body).target_sequence
    _assert_index_answers(d, receipts, cancelled - {lost}, sidx, entries=45)
    d.close()


def test_schedule_index_written_after_the_checkpoint(tmp_path, clock):
    """A crash after cancels were copied, before a checkpoint: the index of every segment
    written since is re-derived whatever it looks like (here a CANCELLED flag that a power
    loss did not write back, which its length cannot show), never answered from as is."""
    d, receipts, cancelled, sidx = _index_folder(tmp_path, clock, checkpoint_interval_ms=10**9)
    crash(d.engine)
    target = min(cancelled)
    entries = bs.file_bytes(sidx)
    pos = [int.from_bytes(entries[k : k + 8], "little") for k in range(0, len(entries), 32)].index(target)
    bs.set_byte(sidx, pos * schedule_index.ENTRY_SIZE + schedule_index.FLAGS_AT, 0)
    d.open()
    assert not d.engine.recovery_notes  # it matches its segment: only the crash says re-derive
    d.catch_up()  # the replay skips every record: the segment holds them all
    assert d.engine.iterate.duplicates_skipped > 0
    _assert_index_answers(d, receipts, cancelled, sidx)
    d.close()


def test_slave_holds_file_lost_or_corrupt(tmp_path, clock, caplog):
    """Row 16: the master's saved holds for its slaves (checkpoint/slave_holds.ckpt) are not
    the data: a file missing or damaged opens with no holds, said in the log (the slaves
    that were away may then need a resync); a whole one is restored, detached."""
    from qdelay.replication import holds
    from qdelay.replication.master import Hub
    from qdelay.server.config import ServerConfig

    d = new_driver(tmp_path, clock)
    send_due_soon(d, 5)
    d.catch_up()
    end = d.engine.wal.committed_offset
    hub = Hub(d.engine, ServerConfig())
    assert hub.sessions == {} and hub.floor() is None  # never written: nothing held, nothing said
    hub.on_ack(hub.attach("s1", "peer", 0), end)
    hub.save()
    path = holds.path_in(str(tmp_path))
    assert Hub(d.engine, ServerConfig()).floor() == end  # restored
    bs.flip_byte(path, 40)
    with caplog.at_level(logging.ERROR, logger="qdelay.replication"):
        hub = Hub(d.engine, ServerConfig())
    assert hub.sessions == {} and hub.floor() is None
    (said,) = [r.getMessage() for r in caplog.records if "slave holds file unreadable" in r.getMessage()]
    assert path in said and "no slave is held until it reconnects" in said
    hub.save()  # the next save replaces the damaged file
    assert holds.HoldFile(str(tmp_path)).load() == ({}, "")
    d.close()
