"""A master's hold on its message log for a stopped slave survives the master's restart
(docs/operations.md §3.4), with real server processes on 127.0.0.1.

Before the holds were saved (``checkpoint/slave_holds.ckpt``, docs/formats.md), a master
restarted while a slave was away held nothing for it: its cleaner deleted the segments
the slave still needed, and the slave, when it came back, was refused as behind
retention and needed a full resync.
"""

from __future__ import annotations

import pytest
from conftest import wait_until
from test_replication import (
    MANUAL_RESYNC,
    RPC_ERRORS,
    assert_same_message_log,
    master,
    schedule_records,
    send_some,
    slave,
    status,
    wait_caught_up,
    wal_files,
)

from qdelay.segments import naming

CLEAN_FAST = [
    "--set",
    "engine.message_retention_ms=0",
    "--set",
    "engine.cleaner_interval_ms=200",
    "--set",
    "engine.checkpoint_interval_ms=50",
]
KEPT_LINE = "message log kept for slaves"


def _log_since(proc, start: int) -> str:
    return proc.log_path.read_bytes()[start:].decode(errors="replace")


def _held_base(data_dir, end: int) -> int:
    """Base offset of the message-log segment holding the record that ends at ``end``."""
    return max(int(n.split(".")[0]) for n in wal_files(data_dir) if int(n.split(".")[0]) < end)


def _holds_file(data_dir) -> dict:
    from qdelay.replication import holds
    from qdelay.segments import checkpoint

    return (checkpoint.read(holds.path_in(str(data_dir))) or {}).get("slaves", {})


def _wait_cleaner_pass(a, mark: int, since: int) -> None:
    """The restarted master iterated everything and its cleaner has had a pass with the
    slaves' holds (it says what it keeps for them, in its log after ``mark``) -- or it
    deleted past ``since``, as it did before the holds were saved."""

    def passed():
        s = status(a.address)
        return s.iterate_offset == s.end_offset and (s.first_offset >= since or KEPT_LINE in _log_since(a, mark))

    wait_until(passed, 30, "the restarted master's cleaner", ignore=RPC_ERRORS)


@pytest.mark.parametrize("restart", ["sigterm", "sigkill"])
def test_a_stopped_slave_catches_up_after_the_master_restarts(tmp_path, restart):
    """Slave stopped, master written to and cleaned, restarted (SIGTERM: the holds saved at
    the stop; SIGKILL: the saver's last save, within a second of the slave detaching),
    written to and cleaned again, slave started: it catches up from the log, every record.
    Before, it was refused: "behind retention: the slave needs message-log offset 130035
    but the master's oldest segment starts at 238420 ...", and needed a full resync."""
    with master(tmp_path, args=CLEAN_FAST) as a:
        with slave(tmp_path, a) as b:
            wait_until(lambda: status(b.address).connected, 20, "slave attached", ignore=RPC_ERRORS)
            for _ in range(3):  # a batch goes into one segment: three batches, two segments at least
                send_some(a.address, 40, delay_ms=3_600_000, size=1000)
            wait_caught_up(a.address, b.address)
            end = status(b.address).end_offset
        held = _held_base(tmp_path / "a", end)
        assert held > 0
        send_some(a.address, 100, delay_ms=3_600_000, size=1000)
        if restart == "sigterm":
            a.stop()
        else:
            name = next(iter(status(a.address).slaves)).name
            wait_until(lambda: _holds_file(tmp_path / "a").get(name, {}).get("offset") == end, 10, "the hold saved")
            a.kill9()
        mark = a.log_path.stat().st_size
        a.start()
        send_some(a.address, 100, delay_ms=3_600_000, size=1000)
        _wait_cleaner_pass(a, mark, end)
        first = status(a.address).first_offset

        def a_end():
            return status(a.address).end_offset

        with b:
            wait_until(
                lambda: (s := status(b.address)).error or (s.connected and s.end_offset == a_end()),
                30,
                "the slave to catch up or be refused",
                ignore=RPC_ERRORS,
            )
            st = status(b.address)
            assert st.error == "" and st.note == "", (st.error, st.note, first, end)
            for p in (a, b):  # nothing skipped: the slave's schedule log is the master's
                wait_until(lambda p=p: (s := status(p.address)).iterate_offset == s.end_offset, 20, "iterated")
        assert first == held, f"the master kept from {first}; the slave's last record is in the segment at {held}"
        assert [p.name for p in tmp_path.iterdir() if "before-resync" in p.name] == []
        assert not (tmp_path / "b" / naming.DIVERGED_DIR).exists()
    assert_same_message_log(tmp_path / "a", tmp_path / "b", allow_missing_head=True)
    assert schedule_records(tmp_path / "a") == schedule_records(tmp_path / "b")


def test_a_restarted_master_cleans_nothing_a_held_slave_needs_before_its_holds_are_restored(tmp_path):
    """The cleaner started with the engine, before the replication hook restored the holds
    (``engine.replication_floor`` was still "no slave"): with a short enough
    ``cleaner_interval_ms`` its first pass after a restart deleted, unheld, every segment
    behind the saved iterate checkpoint -- the stopped slave's among them. It starts once the
    hooks are installed now: the master keeps the segment holding the slave's last record,
    and the slave catches up from the log."""
    args = [*CLEAN_FAST, "--set", "engine.cleaner_interval_ms=1"]
    with master(tmp_path, args=args) as a:
        with slave(tmp_path, a) as b:
            wait_until(lambda: status(b.address).connected, 20, "slave attached", ignore=RPC_ERRORS)
            for _ in range(3):  # three batches, two segments at least
                send_some(a.address, 40, delay_ms=3_600_000, size=1000)
            wait_caught_up(a.address, b.address)
            end = status(b.address).end_offset
        held = _held_base(tmp_path / "a", end)
        assert held > 0
        send_some(a.address, 100, delay_ms=3_600_000, size=1000)
        wait_until(lambda: (s := status(a.address)).iterate_offset == s.end_offset, 20, "iterated")
        a.stop()  # its last checkpoint: the iterate service past every segment but the active one
        a.start()
        assert status(a.address).first_offset == held, "cleaned before the holds were restored"
        with b:
            wait_caught_up(a.address, b.address)
            st = status(b.address)
            assert st.error == "" and st.note == "", (st.error, st.note)
    assert_same_message_log(tmp_path / "a", tmp_path / "b", allow_missing_head=True)


def test_an_expired_hold_sends_the_slave_to_a_resync_never_past_a_gap(tmp_path):
    """A hold past its limit (here slave_hold_bytes, lowered at the restart) is dropped and
    logged; the cleaner deletes what the slave needs, and the slave, asking for an offset
    below the master's oldest, is refused (behind retention, naming the expired hold) -- it
    writes nothing, skips nothing -- until it is resynced, after which it holds every
    record the master's schedule log does."""
    from test_replication import admin

    with master(tmp_path, args=CLEAN_FAST) as a:
        with slave(tmp_path, a, args=MANUAL_RESYNC) as b:
            wait_until(lambda: status(b.address).connected, 20, "slave attached", ignore=RPC_ERRORS)
            for _ in range(3):
                send_some(a.address, 40, delay_ms=3_600_000, size=1000)
            wait_caught_up(a.address, b.address)
            end = status(b.address).end_offset
        name = next(iter(status(a.address).slaves)).name
        send_some(a.address, 100, delay_ms=3_600_000, size=1000)
        a.stop()
        mark = a.log_path.stat().st_size
        a.args += ["--set", "slave_hold_bytes=10000"]
        a.start()
        logged = wait_until(lambda: "hold expired for slave" in (t := _log_since(a, mark)) and t, 10, "expiry logged")
        assert "slave_hold_bytes=10000): the cleaner may delete the message log from offset" in logged
        # no longer listed by Status (it was, detached, until the next restart): held no more
        assert [s.name for s in status(a.address).slaves] == []
        send_some(a.address, 100, delay_ms=3_600_000, size=1000)  # a segment after the slave's end
        wait_until(lambda: status(a.address).first_offset > end, 20, "the master cleaned", ignore=RPC_ERRORS)
        with b:
            st = wait_until(lambda: (s := status(b.address)).error and s, 20, "retention error", ignore=RPC_ERRORS)
            assert st.error.startswith(f"behind retention: the slave needs message-log offset {end} "), st.error
            assert "(the master's hold for this slave expired: slave_hold_ms / slave_hold_bytes)" in st.error
            assert not st.connected and st.end_offset == end, "nothing written past the gap"
        admin("resync", "--data-dir", str(tmp_path / "b"), "--master", a.address)
        with b:
            send_some(a.address, 50, delay_ms=3_600_000, size=1000)
            wait_caught_up(a.address, b.address)
            for p in (a, b):
                wait_until(lambda p=p: (s := status(p.address)).iterate_offset == s.end_offset, 20, "iterated")
            assert status(b.address).error == ""
            # the resync's hold was taken under the slave's own name: its stream took it over
            # (it was a second hold, by the folder's path, kept for slave_hold_ms)
            assert [(s.name, s.connected) for s in status(a.address).slaves] == [(name, True)]
    assert_same_message_log(tmp_path / "a", tmp_path / "b", allow_missing_head=True)
    assert schedule_records(tmp_path / "a") == schedule_records(tmp_path / "b")


# --- the Hub and its file, in process ---------------------------------------------------------------


def _engine(tmp_path, end: int = 0, role: str = "master"):
    from types import SimpleNamespace

    return SimpleNamespace(
        config=SimpleNamespace(data_dir=str(tmp_path)), wal=SimpleNamespace(committed_offset=end), role=role
    )


def _hub(engine, **cfg):
    from qdelay.replication.master import Hub
    from qdelay.server.config import ServerConfig

    return Hub(engine, ServerConfig(**cfg))


def _run(coro):
    import asyncio

    return asyncio.run(coro)


def test_holds_are_saved_at_a_bounded_rate_and_restored(tmp_path):
    from qdelay.replication.master import HOLD_REFRESH_S

    engine = _engine(tmp_path, end=10_000)
    hub = _hub(engine)
    s = hub.attach("s1", "peer", 0)
    saves = hub.holds.saves
    for off in range(1, 5_001):  # a slave confirming record after record
        hub.on_ack(s, off)
    assert hub.holds.saves == saves, "an ack writes nothing: the saver does, at most once a HOLD_SAVE_S"
    assert _run(hub.save_if_changed()) and hub.holds.saves == saves + 1
    assert not _run(hub.save_if_changed()) and hub.holds.saves == saves + 1, "nothing changed, nothing written"
    # an attached slave's time on disk is refreshed, acks or not, every HOLD_REFRESH_S (and at the stop)
    hub._saved_at -= HOLD_REFRESH_S
    assert _run(hub.save_if_changed()) and _run(hub.save_if_changed(final=True)) and hub.holds.saves == saves + 3
    hub.detach(s)
    assert _run(hub.save_if_changed())

    again = _hub(engine)  # a restart: the slave is held where it confirmed, detached
    (r,) = again.sessions.values()
    assert (r.name, r.acked, r.connected, r.last_seen) == ("s1", 5_000, False, s.last_seen // 0.001 / 1000)
    assert again.floor() == 5_000
    # it reconnects behind what the file says (it cut a divergent tail): saved before it is served
    assert again.lowers_a_hold("s1", 4_000) and not again.lowers_a_hold("s1", 5_000)
    assert again.lowers_a_hold("new slave", 0)
    # a resync's snapshot: held from its offset, saved before the stream's head goes out
    # (replication/snapshot.py), so a restart of the master during the copy keeps it
    again.hold_for("resynced", 3_000)
    again.save()
    assert _hub(engine).floor() == 3_000


def test_a_hold_expires_by_age_and_by_size_and_is_then_left_out_of_the_file(tmp_path, caplog):
    import logging
    import time

    from qdelay.replication import holds

    engine = _engine(tmp_path, end=1_000_000)
    now_ms = int(time.time() * 1000)
    holds.HoldFile(str(tmp_path)).save(
        lambda: {
            "old": holds.Hold(100, now_ms - 2 * 3_600_000),  # away two hours (slave_hold_ms: one)
            "far": holds.Hold(200, now_ms - 1_000),  # a second, but 999,800 bytes behind
            "near": holds.Hold(900_000, now_ms - 1_000),
        }
    )
    with caplog.at_level(logging.INFO, logger="qdelay.replication"):
        hub = _hub(engine, slave_hold_bytes=500_000)
    expired = sorted(r.getMessage() for r in caplog.records if r.getMessage().startswith("hold expired for slave"))
    assert len(expired) == 2 and "slave far (away 1 s, 999800 bytes behind" in expired[0], expired
    assert "slave old (away 7200 s" in expired[1] and "need a full resync (automatic on the slave unless" in expired[1]
    assert any("holding the message log for slave near from offset 900000" in r.getMessage() for r in caplog.records)
    assert hub.floor() == 900_000 and hub.expired("old") and hub.expired("far") and not hub.expired("near")
    assert (hub.held_detached(), hub.holds_expired) == (1, 2)
    # out of memory and of what Status lists (they stayed there until the next restart)
    assert set(hub.sessions) == {"near"} and [s.name for s in hub.listed()] == ["near"]
    hub.save()
    assert set(holds.HoldFile(str(tmp_path)).load()[0]) == {"near"}
    # the age limit, counted from when the master last heard of the slave, restarts included
    short = _hub(engine, slave_hold_ms=60_000)
    assert short.floor() == 900_000
    short.sessions["near"].last_seen -= 60.0
    # ran out: not listed at once, dropped (logged once) by the saver's next turn
    assert short.floor() is None and short.listed() == [] and short.expired("near")
    with caplog.at_level(logging.INFO, logger="qdelay.replication"):
        _run(short.save_if_changed())
        _run(short.save_if_changed())
    assert short.sessions == {} and short.expired("near") and short.holds_expired == 1
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("hold expired for slave near")]
    assert len(said) == 1 and "slave_hold_ms=60000" in said[0], said
    # the slave attaches again: held, listed, its old expiry forgotten
    again = short.attach("near", "peer", 900_000)
    assert short.listed() == [again] and not short.expired("near")


def test_a_failed_save_is_logged_and_tried_again(tmp_path, monkeypatch, caplog):
    """A full disk: the save fails, the old file stays, the attach or snapshot that asked for
    it goes on (the hold is in memory), and the saver writes it once it can."""
    import errno
    import logging

    from qdelay.segments import checkpoint

    engine = _engine(tmp_path, end=1_000)
    hub = _hub(engine)
    real = checkpoint.write

    def full(path, state):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "write", full)
    hub.attach("s1", "peer", 500)
    with caplog.at_level(logging.ERROR, logger="qdelay.replication"):
        _run(hub.save_now())  # does not raise
    assert any("saving the slave holds failed" in r.getMessage() for r in caplog.records)
    assert hub.lowers_a_hold("s1", 500), "not on disk: an attach there still saves first"
    assert hub.holds.load() == ({}, "")
    monkeypatch.setattr(checkpoint, "write", real)
    assert _run(hub.save_if_changed())
    assert not hub.lowers_a_hold("s1", 500) and _hub(engine).floor() == 500


def test_a_bucket_the_master_cleaned_while_the_slave_was_away_is_emptied_on_the_slave(tmp_path):
    """Dispatch segments are not held for slaves (docs/operations.md 3.4): a bucket finished
    and cleaned on the master while a slave was away is answered, when the slave comes back
    with its copy, by a reset (that copy emptied, nothing appended). The slave needs no more:
    the master's progress it adopts (common.apply_progress) has the bucket below
    done_before, so a promotion never loads it (here, is_done says so)."""
    from types import SimpleNamespace

    from qdelay.replication.master import PullServer, SlaveSession
    from qdelay.replication.slave import Puller
    from qdelay.v1 import replication_pb2 as rpb

    gone, kept = 28_000_000, 28_000_001

    class Seg:
        def __init__(self, data: bytes) -> None:
            self.data = bytearray(data)

        @property
        def size(self) -> int:
            return len(self.data)

        synced_size = size

        def read(self, at: int, n: int) -> bytes:
            return bytes(self.data[at : at + n])

        def truncate(self, n: int) -> None:
            del self.data[n:]

    master_disp = {kept: Seg(b"")}
    server = object.__new__(PullServer)
    server.engine = SimpleNamespace(dispatch=SimpleNamespace(get=master_disp.get, buckets=lambda: sorted(master_disp)))
    session = SlaveSession("s", "peer", 0)
    hello = rpb.PullRequest()
    hello.dispatch.add(bucket=gone, size=3, checksum=1)  # the slave's copy of the cleaned bucket
    server.dispatch_states(hello, session)
    (chunk,) = server.dispatch_chunks(session, 1 << 20)
    assert (chunk.bucket, chunk.offset, chunk.data, chunk.reset) == (gone, 0, b"", True)
    assert server.dispatch_chunks(session, 1 << 20) == [], "said once"

    slave_disp = {gone: Seg(b"abc")}
    puller = object.__new__(Puller)
    puller.engine = SimpleNamespace(
        dispatch=SimpleNamespace(get=slave_disp.get),
        scheduler=SimpleNamespace(is_done=lambda b: True),
        schedule=SimpleNamespace(get=lambda b: None),
    )
    assert puller._apply_dispatch(chunk) is False  # nothing appended, no fsync needed
    assert slave_disp[gone].size == 0


def test_a_master_with_an_attached_slave_stops_at_once_and_saves_its_hold_after_the_stream(tmp_path):
    """SIGTERM on a master with a slave attached: the slave's Pull stream ends at the stop
    (the master says it is shutting down; the slave retries), so the master exits without
    waiting out ``grace_seconds``, and its holds file, saved after the stream ended, has
    the slave as seen at the stop. Before, the stream ran on: the master waited its whole
    grace period (10 s by default) every time, and the hold saved before the stream ended
    was the grace period older than the slave's last word."""
    import time

    with master(tmp_path, args=["--set", "grace_seconds=30"]) as a:
        with slave(tmp_path, a) as b:
            send_some(a.address, 20)
            wait_caught_up(a.address, b.address)
            name = next(iter(status(a.address).slaves)).name
            mark = b.log_path.stat().st_size
            t0 = time.monotonic()
            assert a.stop() == 0
            took = time.monotonic() - t0
            stopped_ms = time.time() * 1000
            assert took < 10, f"the master took {took:.1f} s to stop (grace_seconds=30)"
            saved = _holds_file(tmp_path / "a")[name]
            assert saved["seen_ms"] >= stopped_ms - took * 1000 - 1000, (saved, stopped_ms, took)
            wait_until(lambda: "shutting down" in _log_since(b, mark), 10, "the slave told the master stops")


def test_a_hold_kept_from_its_master_days_ends_quietly_on_a_slave(tmp_path, caplog):
    """An old master re-attached as a slave (operations.md 4.3) still has the holds it kept
    for its slaves then -- one of them the new master. When they ran out it warned "hold
    expired for slave <the new master> ...: the slave will be refused as behind retention and
    need 'qdelay admin resync'", advice for a server that is no slave of it and needs
    nothing. On a server that is not master the end of a hold is an INFO line saying so."""
    import logging
    import time

    from qdelay.replication import holds

    now_ms = int(time.time() * 1000)
    holds.HoldFile(str(tmp_path)).save(lambda: {"new-master:/data": holds.Hold(100, now_ms - 2 * 3_600_000)})
    with caplog.at_level(logging.INFO, logger="qdelay.replication"):
        hub = _hub(_engine(tmp_path, end=1_000, role="slave"))
    said = [r for r in caplog.records if "new-master:/data" in r.getMessage()]
    assert hub.expired("new-master:/data") and hub.floor() is None
    assert said and all(r.levelno < logging.WARNING and "resync" not in r.getMessage() for r in said), [
        (r.levelname, r.getMessage()) for r in said
    ]
    assert "this server is slave now" in said[-1].getMessage(), said[-1].getMessage()


def test_a_stream_ending_after_its_slave_idled_past_the_hold_keeps_the_slave_held(tmp_path):
    """An attached slave's ``last_seen`` moves only when it confirms more; an idle one's can
    be older than ``slave_hold_ms``. When its stream ends, the saver may run before the
    stream's ``detach``: it then dropped the hold as expired at once (it stayed marked
    expired after the detach, too). The detach lists the slave again, held from then."""
    engine = _engine(tmp_path, end=5_000)
    hub = _hub(engine, slave_hold_ms=60_000)
    s = hub.attach("idle", "peer", 5_000)
    s.last_seen -= 3_600  # confirmed its last record an hour ago: idle since
    s.connected = False  # its stream ended (PullServer's reader) ...
    _run(hub.save_if_changed())  # ... and the saver ran before the detach
    assert hub.expired("idle") and hub.floor() is None
    hub.detach(s)
    assert hub.floor() == 5_000 and hub.held_detached() == 1 and not hub.expired("idle")
    assert hub.listed() == [s]


def test_a_snapshot_copy_longer_than_the_hold_keeps_the_log_held_until_it_ends(tmp_path):
    """The master holds its log from the snapshot's offset for the resyncing slave while the
    copy runs, however long, and for slave_hold_ms after (replication/snapshot.py). The hold
    counted from the copy's start: a copy longer than slave_hold_ms (a large schedule log, a
    slow link) lost it midway, the saver dropped it, the cleaner could delete the offset the
    copy starts the slave at, and the resynced slave was refused as behind retention again
    (the automatic resync then copied again a minute later, and again)."""
    import time
    from types import SimpleNamespace

    from qdelay.replication.snapshot import serve_snapshot
    from qdelay.segments import checkpoint

    engine = _engine(tmp_path, end=5_000)
    no_log = SimpleNamespace(buckets=lambda: [], get=lambda b: None)
    engine.wal.first_offset = 0
    engine.epoch, engine.schedule, engine.dispatch = 3, no_log, no_log
    engine.checkpoint_path = str(tmp_path / "iterate.ckpt")
    checkpoint.write(engine.checkpoint_path, {"offset": 4_000, "sequence": 40})
    hub = _hub(engine, slave_hold_ms=60_000)
    node = SimpleNamespace(engine=engine, hub=hub)

    async def copy() -> None:
        chunks = serve_snapshot(node, SimpleNamespace(slave_name="s1"))
        head = await chunks.__anext__()
        assert head.offset == 4_000 and hub.floor() == 4_000
        hub.sessions["s1"].last_seen -= 3_600  # an hour into the copy ...
        await hub.save_if_changed()  # ... the saver's turn
        assert hub.floor() == 4_000 and not hub.expired("s1") and [s.name for s in hub.listed()] == ["s1"]
        assert [c async for c in chunks] == []  # the copy ends

    _run(copy())
    # held for slave_hold_ms from the copy's end, then no longer
    assert hub.floor() == 4_000 and not hub.expired("s1")
    assert time.time() - hub.sessions["s1"].last_seen < 30
    hub.sessions["s1"].last_seen -= 60
    assert hub.floor() is None and hub.expired("s1")
