"""A slave refused as behind the master's retention resyncs its folder by itself
(replication/autoresync.py; docs/operations.md §4.4; docs/recovery.md rows 18-21), with
real server processes on 127.0.0.1 where a server is involved.

Before, it stayed refused ("behind retention ... run 'qdelay admin resync ...'") until an
operator stopped it, ran the resync and started it again.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import pytest
from conftest import wait_until
from test_replication import (
    MANUAL_RESYNC,
    RPC_ERRORS,
    admin,
    assert_same_message_log,
    master,
    schedule_records,
    send_some,
    slave,
    status,
    wait_caught_up,
    wal_files,
)

from qdelay.errors import FolderInUse
from qdelay.replication import autoresync
from qdelay.replication.snapshot import incoming_path, write_snapshot
from qdelay.segments import checkpoint, naming
from qdelay.segments.folder_lock import FolderLock
from qdelay.v1 import replication_pb2 as rpb
from qdelay.v1 import replication_pb2_grpc as rpb_grpc

# a master that cleans at once what no slave holds, and holds a stopped slave for 1 s only
FORGETFUL = [
    "--set",
    "engine.message_retention_ms=0",
    "--set",
    "engine.cleaner_interval_ms=100",
    "--set",
    "engine.checkpoint_interval_ms=50",
    "--set",
    "slave_hold_ms=1000",
]
STARTS = "starting an automatic full resync"
DONE = "automatic full resync done"
FAILED = "automatic full resync from"
INDEX_NOTES = ("schedule indexes missing or not matching their segments", "id index rebuilt from the schedule log")


def _log(proc) -> str:
    return proc.log_path.read_bytes().decode(errors="replace")


def _lines(proc, level: str, text: str) -> list[str]:
    return [line for line in _log(proc).splitlines() if f" {level} " in line and text in line]


def _asides(tmp_path, name: str = "b") -> list:
    return sorted(p for p in tmp_path.iterdir() if p.name.startswith(f"{name}.before-resync"))


def _send_with_ids(address: str, prefix: str, n: int) -> list[str]:
    from qdelay.client import Client

    ids = [f"{prefix}-{i}" for i in range(n)]
    with Client(address) as c:
        c.send_many(
            (c.message("away.test", os.urandom(1000), delay_ms=3_600_000, message_id=m) for m in ids), batch_size=25
        )
    return ids


@contextlib.contextmanager
def _slave_left_behind(tmp_path, slave_args=()):
    """A master and a stopped slave it no longer holds the log for: the master wrote past the
    slave's end and cleaned the segments the slave needs. Yields (a, b, b's end, the ids
    written while b was away, b's message log as b left it)."""
    with master(tmp_path, args=FORGETFUL) as a:
        b = slave(tmp_path, a, args=list(slave_args))
        with b:
            wait_until(lambda: status(b.address).connected, 20, "slave attached", ignore=RPC_ERRORS)
            send_some(a.address, 60, delay_ms=3_600_000, size=1000)
            wait_caught_up(a.address, b.address)
            end = status(b.address).end_offset
        away = _send_with_ids(a.address, "away", 100)  # two segments and more past b's end
        wait_until(lambda: status(a.address).first_offset > end, 30, "the master cleaned past the slave's end")
        try:
            yield a, b, end, away, wal_files(tmp_path / "b")
        finally:
            b.kill9()


def _never_free(data_dir) -> bool:
    """The folder's lock is held by someone else (its server): False would mean a second
    server could open it now."""
    try:
        FolderLock(str(data_dir), "a test").release()
    except (FolderInUse, FileNotFoundError):
        return True
    raise AssertionError(f"{data_dir} was free to take while its server resynced it")


def test_a_slave_behind_retention_resyncs_by_itself(tmp_path):
    """Row 18: restarted after its hold ran out and the master cleaned, the slave resyncs
    (stops, re-executes itself: same pid, same address; the folder's lock held throughout),
    ends with lag 0 and answers Get for messages written while it was away; the old folder
    is kept aside as it was; one WARNING when it starts, one INFO when done."""
    from qdelay.client import Client

    with _slave_left_behind(tmp_path) as (a, b, end, away, old_log):
        b.start()
        pid, address = b.pid, b.address

        def resynced():
            _never_free(tmp_path / "b")
            m, s = status(a.address), status(b.address)
            return s.connected and s.end_offset == m.end_offset and s.lag_bytes == 0 and s

        st = wait_until(resynced, 60, "the slave to resync and catch up", ignore=RPC_ERRORS)
        assert st.error == "" and b.alive() and b.pid == pid and b.address == address
        wait_until(lambda: (s := status(b.address)).iterate_offset == s.end_offset, 20, "slave iterated")
        with Client(b.address, retries=0) as cb:
            states = {m: cb.get(message_id=m).state for m in away}
        assert set(states.values()) == {"PENDING"}, states
        # the old folder, moved aside whole; nothing half-written left about
        [aside] = _asides(tmp_path)
        assert wal_files(aside) == old_log and max(int(n.split(".")[0]) for n in old_log) < end
        assert not os.path.exists(incoming_path(str(tmp_path / "b")))
        for folder in (tmp_path / "b", aside):
            assert not (folder / naming.CHECKPOINT_DIR / naming.RESYNC_REQUEST_FILE).exists()
        [warning] = _lines(b, "WARNING", STARTS)
        assert f"behind retention: the slave needs message-log offset {end} " in warning
        [done] = _lines(b, "INFO", DONE)
        assert f"the old folder (its message log ending at offset {end}) was moved to {aside} " in done
        assert "qdelay admin resync" not in warning + done
        assert re.search(r"the message log starts at offset \d+ \(after sequence \d+\)", done), done
        assert not _lines(b, "ERROR", "resync")
        # the snapshot copies no index: deriving them at the new folder's first open is
        # expected there, INFO (a WARNING tripped log-based alerts at every resync)
        for text in INDEX_NOTES:
            assert _lines(b, "INFO", text) and not _lines(b, "WARNING", text), (text, _log(b))
        assert not (tmp_path / "b" / naming.UNINDEXED_FILE).exists()  # only that first open
        # and it goes on replicating
        send_some(a.address, 50, delay_ms=3_600_000)
        wait_caught_up(a.address, b.address)
        for p in (a, b):
            wait_until(lambda p=p: (s := status(p.address)).iterate_offset == s.end_offset, 20, "iterated")
        assert b.stop() == 0 and a.stop() == 0  # (far buckets' records are written behind until then)
        assert_same_message_log(tmp_path / "a", tmp_path / "b", allow_missing_head=True)
        assert schedule_records(tmp_path / "a") == schedule_records(tmp_path / "b")
        # the same folder's indexes lost later (deleted, damage): that is a WARNING again
        for p in (tmp_path / "b" / naming.SCHEDULE_DIR).rglob("*.sidx"):
            p.unlink()
        (tmp_path / "b" / "index" / "ids" / "BUILT").unlink()
        b.start()  # the engine derives them before the server listens
        for text in INDEX_NOTES:
            assert len(_lines(b, "WARNING", text)) == 1 and len(_lines(b, "INFO", text)) == 1, (text, _log(b))
        assert b.stop() == 0


def test_with_auto_resync_off_the_slave_stays_refused(tmp_path):
    """Row 18b: auto_resync = false: refused as behind retention, it writes nothing and
    waits for an operator, as before."""
    with _slave_left_behind(tmp_path, MANUAL_RESYNC) as (a, b, end, _away, old_log):
        b.start()
        st = wait_until(lambda: (s := status(b.address)).error and s, 20, "the refusal", ignore=RPC_ERRORS)
        assert st.error.startswith(f"behind retention: the slave needs message-log offset {end} "), st.error
        assert st.error.endswith("(not resynced automatically: auto_resync is off)"), st.error
        assert not st.connected and st.end_offset == end
        assert _asides(tmp_path) == [] and wal_files(tmp_path / "b") == old_log
        assert not (tmp_path / "b" / naming.CHECKPOINT_DIR / naming.RESYNC_REQUEST_FILE).exists()
        assert not _lines(b, "WARNING", STARTS)


def test_a_former_master_behind_retention_is_not_resynced_automatically(tmp_path):
    """Row 20: a server whose log was never compared with this master's at its epoch (here
    the old master, re-attached as a slave after a failover and a cleaning) may hold records
    the master never had: it stays refused, and the refusal says why."""
    with master(tmp_path, args=SMALL_ARGS) as a:
        with slave(tmp_path, a, args=FORGETFUL) as b:
            send_some(a.address, 60, delay_ms=3_600_000, size=1000)
            wait_caught_up(a.address, b.address)
        end = status(a.address).end_offset
    b.start()
    admin("promote", "--target", b.address)
    send_some(b.address, 100, delay_ms=3_600_000, size=1000)
    wait_until(lambda: status(b.address).first_offset >= end > 0, 30, "the new master cleaned")
    a.args = [*SMALL_ARGS, "--role", "slave", "--master", b.address]
    try:
        a.start()
        st = wait_until(lambda: (s := status(a.address)).error and s, 20, "the refusal", ignore=RPC_ERRORS)
        assert st.error.startswith("behind retention: "), st.error
        assert "(not resynced automatically: its message log was never compared with this master's at its epoch" in (
            st.error
        ), st.error
        assert st.role == "slave" and not st.connected and st.end_offset == end
        assert _asides(tmp_path, "a") == []
        assert not (tmp_path / "a" / naming.CHECKPOINT_DIR / naming.RESYNC_REQUEST_FILE).exists()
    finally:
        a.kill9()
        b.kill9()


SMALL_ARGS = ["--set", "engine.checkpoint_interval_ms=50"]


class _MidwayMaster(rpb_grpc.ReplicationServicer):
    """A master at epoch 0 that refuses every slave as behind retention and whose snapshot
    stops midway (a head and one chunk, then UNAVAILABLE), recording when it was asked."""

    def __init__(self) -> None:
        self.snapshots: list[float] = []

    def Status(self, request, context):
        return rpb.ReplicationStatus(role="master", epoch=0, end_offset=10**9, first_offset=10**9)

    def Pull(self, request_iterator, context):
        hello = next(request_iterator)
        context.abort(
            grpc.StatusCode.OUT_OF_RANGE,
            f"behind retention: the slave needs message-log offset {hello.end_offset} but the master's "
            f"oldest segment starts at 1000000000",
        )

    def Snapshot(self, request, context):
        self.snapshots.append(time.monotonic())
        head = rpb.SnapshotChunk(epoch=0, offset=10**9, sequence=10**6)
        yield head
        yield rpb.SnapshotChunk(log="schedule", bucket=29_000_000, at=0, data=b"\0" * 64)
        context.abort(grpc.StatusCode.UNAVAILABLE, "the master went away midway")


def test_a_master_that_stops_midway_leaves_the_old_folder_and_the_slave_tries_again_later(tmp_path):
    """Row 19: the snapshot breaks off midway: the old folder stays in place as it was (the
    incoming copy is removed), the server opens it and serves; the failure is an ERROR
    naming the reason; the next try waits out a backoff (2 s, then 4 s ...), never a loop."""
    fake = _MidwayMaster()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    rpb_grpc.add_ReplicationServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with master(tmp_path) as a, slave(tmp_path, a) as b:
            send_some(a.address, 60, delay_ms=3_600_000, size=1000)
            wait_caught_up(a.address, b.address)
        old_log = wal_files(tmp_path / "b")
        b.args = [*b.args[:-1], f"127.0.0.1:{port}"]  # its --master: the fake
        b.start()
        pid = b.pid
        failed = tmp_path / "b" / naming.CHECKPOINT_DIR / naming.RESYNC_FAILED_FILE
        wait_until(lambda: len(fake.snapshots) >= 2 and failed.exists(), 60, "two tries")
        wait_until(lambda: (checkpoint.read(str(failed)) or {}).get("attempts") == 2, 30, "the second failure")
        assert fake.snapshots[1] - fake.snapshots[0] >= autoresync.RETRY_FIRST_S, fake.snapshots
        st = wait_until(
            lambda: (s := status(b.address)) and "the automatic full resync failed" in s.error and s,
            30,
            "the failure in its status",
            ignore=RPC_ERRORS,
        )
        assert "UNAVAILABLE: the master went away midway" in st.error, st.error
        assert b.alive() and b.pid == pid
        assert wal_files(tmp_path / "b") == old_log and _asides(tmp_path) == []
        assert not os.path.exists(incoming_path(str(tmp_path / "b")))
        errors_logged = _lines(b, "ERROR", FAILED)
        assert len(errors_logged) >= 2 and "UNAVAILABLE: the master went away midway" in errors_logged[0]
        assert "opens its folder as it was" in errors_logged[0]
        if len(fake.snapshots) > 2:  # the third try waits 4 s
            assert fake.snapshots[2] - fake.snapshots[1] >= 2 * autoresync.RETRY_FIRST_S, fake.snapshots
        b.kill9()
    finally:
        server.stop(None)


# --- the folder swap, in process (row 19, row 21) ---------------------------------------------------


def _old_folder(tmp_path):
    data = tmp_path / "b"
    (data / naming.MESSAGE_DIR).mkdir(parents=True)
    (data / naming.MESSAGE_DIR / naming.wal_name(0)).write_bytes(b"old records")
    return data


def test_a_snapshot_broken_off_midway_changes_nothing(tmp_path):
    data = _old_folder(tmp_path)

    def chunks():
        yield rpb.SnapshotChunk(epoch=1, offset=100, sequence=5)
        yield rpb.SnapshotChunk(log="schedule", bucket=29_000_000, at=0, data=b"x" * 10)
        assert os.path.isdir(incoming_path(str(data)))  # written beside, not in place
        raise ConnectionError("the master went away")

    with pytest.raises(ConnectionError):
        write_snapshot(str(data), chunks())
    assert (data / naming.MESSAGE_DIR / naming.wal_name(0)).read_bytes() == b"old records"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]
    FolderLock(str(data)).release()


def test_leftovers_of_a_crashed_resync(tmp_path):
    """Row 21: a crash during a resync leaves ``<data>.resync-incoming``: with its INCOMING
    mark a partial copy (removed by the next resync), without it the old folder (the crash
    came between the swap and its rename: moved aside by the next resync, never deleted)."""
    data = _old_folder(tmp_path)
    incoming = tmp_path / "b.resync-incoming"
    incoming.mkdir()
    (incoming / naming.INCOMING_FILE).write_bytes(b"")
    (incoming / "partial").write_bytes(b"half a copy")

    def snapshot():
        yield rpb.SnapshotChunk(epoch=1, offset=100, sequence=5)

    info = write_snapshot(str(data), snapshot())
    [aside] = _asides(tmp_path)
    assert info["moved_old_to"] == str(aside) and (aside / naming.MESSAGE_DIR / naming.wal_name(0)).exists()
    assert not incoming.exists()
    assert (data / naming.MESSAGE_DIR / naming.wal_name(100)).read_bytes() == b""
    followed = checkpoint.read(str(data / naming.CHECKPOINT_DIR / naming.FOLLOWED_FILE))
    assert followed is not None and followed["epoch"] == 1 and followed["resynced_ms"] > 0
    # refused again before it attached (the master cleaned the resync's offset): a minute's wait
    left, why = autoresync.retry_delay(str(data))
    assert autoresync.AGAIN_AFTER_RESYNC_S - 5 < left <= autoresync.AGAIN_AFTER_RESYNC_S, left
    assert "after the full resync that made this folder, before it attached" in why
    autoresync.note_followed(str(data), 1)  # a stream accepted: no more wait
    assert autoresync.retry_delay(str(data)) == (0.0, "")

    # an old folder left at the incoming path
    incoming.mkdir()
    (incoming / "message").mkdir()
    (incoming / "message" / "kept").write_bytes(b"old")
    write_snapshot(str(data), snapshot())
    kept = [p for p in _asides(tmp_path) if (p / "message" / "kept").exists()]
    assert len(kept) == 1 and len(_asides(tmp_path)) == 3


# --- cluster mode -------------------------------------------------------------------------------------


def test_a_cluster_slave_behind_retention_resyncs_from_the_shards_master(tmp_path):
    """Row 18, cluster mode: the node follows the shard's master named by etcd; refused as
    behind retention, it resyncs from that master by itself and rejoins the shard."""
    from etcdproc import EtcdProc
    from test_cluster_etcd import node, wait_shard

    from qdelay.client import Client

    with EtcdProc(tmp_path / "etcd") as etcd:
        a = node(tmp_path, "a", etcd.endpoint, extra=[*FORGETFUL, "--set", "engine.segment_bytes=65536"]).start()
        b = node(tmp_path, "b", etcd.endpoint, extra=["--set", "engine.segment_bytes=65536"])
        try:
            wait_shard(a.address, "s1", 0)
            b.start()
            wait_shard(a.address, "s1", 1)
            wait_until(lambda: status(b.address).connected, 20, "slave attached", ignore=RPC_ERRORS)
            send_some(a.address, 60, delay_ms=3_600_000, size=1000)
            wait_caught_up(a.address, b.address)
            end = status(b.address).end_offset
            b.stop()
            away = _send_with_ids(a.address, "away", 100)
            wait_until(lambda: status(a.address).first_offset > end, 30, "the master cleaned past the slave's end")
            b.start()
            pid = b.pid

            def resynced():
                m, s = status(a.address), status(b.address)
                return s.connected and s.end_offset == m.end_offset and s.lag_bytes == 0 and s

            wait_until(resynced, 60, "the slave to resync and catch up", ignore=RPC_ERRORS)
            assert b.pid == pid and len(_lines(b, "INFO", DONE)) == 1 and len(_lines(b, "WARNING", STARTS)) == 1
            assert len(_asides(tmp_path)) == 1
            wait_shard(a.address, "s1", 1)
            wait_until(lambda: (s := status(b.address)).iterate_offset == s.end_offset, 20, "slave iterated")
            with Client(b.address, retries=0) as cb:
                assert {cb.get(message_id=m).state for m in away} == {"PENDING"}
        finally:
            a.kill9()
            b.kill9()


def test_never_on_a_master_nor_with_the_option_off(tmp_path):
    """Rows 18b and 20, the decisions in process: a request left in a folder is not acted on
    by a server started as a master, or with auto_resync off (consumed, counted, logged; the
    folder untouched); the puller's question answers no for a master, a fenced server, the
    option off, and a log compared at another epoch."""
    from types import SimpleNamespace

    from qdelay.server.config import ServerConfig

    data = _old_folder(tmp_path)
    for cfg, why in (
        (ServerConfig(data_dir=str(data)), "this server is started as a master"),
        (ServerConfig(data_dir=str(data), role="slave", master="m:1", auto_resync=False), "auto_resync is off"),
    ):
        autoresync.request(str(data), "m:1", "behind retention: test", 3, 11)
        autoresync.before_open(cfg)
        failed = checkpoint.read(str(data / naming.CHECKPOINT_DIR / naming.RESYNC_FAILED_FILE))
        assert failed is not None and why in failed["error"], failed
        assert not (data / naming.CHECKPOINT_DIR / naming.RESYNC_REQUEST_FILE).exists()
        assert (data / naming.MESSAGE_DIR / naming.wal_name(0)).read_bytes() == b"old records"
    assert _asides(tmp_path) == []

    cfg = ServerConfig(data_dir=str(data), role="slave", master="m:1")

    def engine(role: str, end: int = 500):
        return SimpleNamespace(role=role, wal=SimpleNamespace(committed_offset=end))

    assert autoresync.why_not(cfg, engine("master"), 3) == "this server is master"
    assert autoresync.why_not(cfg, engine("fenced"), 3) == "this server is fenced"
    assert autoresync.why_not(cfg, engine("slave", end=0), 3) == ""  # never held a record
    assert "never compared" in autoresync.why_not(cfg, engine("slave"), 3)
    autoresync.note_followed(str(data), 2)
    assert "last compared with a master's at epoch 2, not this master's epoch 3: it may" in autoresync.why_not(
        cfg, engine("slave"), 3
    )
    autoresync.note_followed(str(data), 3)
    assert autoresync.why_not(cfg, engine("slave"), 3) == ""
    off = ServerConfig(data_dir=str(data), role="slave", master="m:1", auto_resync=False)
    assert autoresync.why_not(off, engine("slave"), 3) == "auto_resync is off"


class _StalledMaster(_MidwayMaster):
    """A master whose snapshot sends its head and one chunk, then stalls (a slow or hung
    master, a copy of hours): until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def Snapshot(self, request, context):
        self.snapshots.append(time.monotonic())
        yield rpb.SnapshotChunk(epoch=0, offset=10**9, sequence=10**6)
        yield rpb.SnapshotChunk(log="schedule", bucket=29_000_000, at=0, data=b"\0" * 64)
        self.release.wait(300)
        context.abort(grpc.StatusCode.UNAVAILABLE, "released by the test")


def test_sigterm_during_the_resync_stops_the_server_within_its_grace(tmp_path):
    """A SIGTERM while the re-executed server copies the snapshot (before it listens) stops
    it at once: the copy is abandoned (the incoming folder removed), the old folder stays as
    it was, unopened, the request is withdrawn (not counted as a failure), exit 0.
    Before, the signal waited for the whole copy (up to its one-hour timeout): a
    supervisor's stop timed out and killed the server."""
    fake = _StalledMaster()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    rpb_grpc.add_ReplicationServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    proc = None
    try:
        with master(tmp_path) as a, slave(tmp_path, a) as b:
            send_some(a.address, 60, delay_ms=3_600_000, size=1000)
            wait_caught_up(a.address, b.address)
            end = status(b.address).end_offset
        old_log = wal_files(tmp_path / "b")
        data = str(tmp_path / "b")
        autoresync.request(data, f"127.0.0.1:{port}", "behind retention: a test", 0, end)
        b.args = [*b.args[:-1], f"127.0.0.1:{port}"]  # its --master: the fake
        cmd = [sys.executable, "-m", "qdelay.cli", "server", "--data-dir", data, "--listen", "127.0.0.1:0", *b.args]
        mark = b.log_path.stat().st_size
        with open(b.log_path, "ab") as logf:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=logf)
        wait_until(lambda: fake.snapshots and os.path.isdir(incoming_path(data)), 60, "the copy under way")
        proc.send_signal(signal.SIGTERM)
        # grace_seconds (10) bounds the stop once the server runs; its start is quick here
        assert proc.wait(30) == 0, _log(b)
        assert wal_files(tmp_path / "b") == old_log and _asides(tmp_path) == []
        assert not os.path.exists(incoming_path(data))
        checkpoints = tmp_path / "b" / naming.CHECKPOINT_DIR
        assert not (checkpoints / naming.RESYNC_REQUEST_FILE).exists()
        assert not (checkpoints / naming.RESYNC_FAILED_FILE).exists()
        [stopped] = _lines(b, "WARNING", "automatic full resync from")
        assert "stopped by a signal" in stopped, stopped
        assert not _lines(b, "ERROR", FAILED)
        # stopped before opening the folder: no puller asked for another resync on the way out
        this_run = b.log_path.read_bytes()[mark:].decode(errors="replace")
        assert "stopped before opening the data folder" in this_run and " INFO qdelay.server: started " not in this_run
    finally:
        fake.release.set()
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        server.stop(None)


def test_resyncs_refused_again_before_they_attach_stop_after_a_few(tmp_path):
    """A master that cleans the resync's offset before the slave attaches (its slave_hold_ms
    shorter than the slave's start) refuses each resynced folder again: the slave copied the
    snapshot again every AGAIN_AFTER_RESYNC_S, for ever, each copy keeping the folder before
    it aside (a whole schedule log each: the disk fills). After MAX_UNATTACHED_RESYNCS in a
    row the next is left to an operator, the status saying why; a stream accepted resets it."""
    from types import SimpleNamespace

    from qdelay.server.config import ServerConfig

    data = _old_folder(tmp_path)
    cfg = ServerConfig(data_dir=str(data), role="slave", master="m:1")
    resynced = SimpleNamespace(role="slave", wal=SimpleNamespace(committed_offset=100))

    def snapshot():
        yield rpb.SnapshotChunk(epoch=1, offset=100, sequence=5)

    for n in range(1, autoresync.MAX_UNATTACHED_RESYNCS):
        write_snapshot(str(data), snapshot())
        assert autoresync.unattached_resyncs(str(data)) == n
        assert autoresync.why_not(cfg, resynced, 1) == ""  # (after retry_delay's minute)
    write_snapshot(str(data), snapshot())
    why = autoresync.why_not(cfg, resynced, 1)
    last = autoresync.MAX_UNATTACHED_RESYNCS
    assert why.startswith(f"the last {last} full resyncs in a row were refused again before they attached "), why
    assert "resync it by hand" in why
    assert len(_asides(tmp_path)) == autoresync.MAX_UNATTACHED_RESYNCS  # all kept, none deleted
    autoresync.note_followed(str(data), 1)  # a stream accepted: counted from zero again
    assert autoresync.unattached_resyncs(str(data)) == 0 and autoresync.why_not(cfg, resynced, 1) == ""
    write_snapshot(str(data), snapshot())
    assert autoresync.unattached_resyncs(str(data)) == 1


def test_the_leftovers_of_a_crashed_resync_are_dealt_with_and_said_at_the_next_start(tmp_path, caplog):
    """Row 21: a crash between the swap and the old folder's rename leaves the old folder at
    ``<data>.resync-incoming``, and the server on the new folder started with nothing in its
    log to say so: the old folder sat there, unnamed, until a next resync moved it aside
    silently. Now the next start moves it aside and says where (WARNING), and removes a
    partial copy (INFO), with the folder's lock held; the engine then adopts that lock."""
    import logging

    from qdelay.server.config import ServerConfig

    data = _old_folder(tmp_path)  # the new folder, swapped in
    cfg = ServerConfig(data_dir=str(data), role="slave", master="m:1")
    incoming = tmp_path / "b.resync-incoming"  # the old one, not yet renamed aside
    (incoming / naming.MESSAGE_DIR).mkdir(parents=True)
    (incoming / naming.MESSAGE_DIR / "kept").write_bytes(b"the old folder's")
    with caplog.at_level(logging.INFO, logger="qdelay.replication"):
        autoresync.before_open(cfg)
    [aside] = _asides(tmp_path)
    assert (aside / naming.MESSAGE_DIR / "kept").read_bytes() == b"the old folder's" and not incoming.exists()
    [said] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"found {incoming} without its INCOMING mark" in said and f"moved to {aside}, kept" in said, said
    engine_lock = FolderLock(str(data), "the engine")  # adopts the lock before_open handed over
    with pytest.raises(FolderInUse):
        FolderLock(str(data), "a test")
    engine_lock.release()
    # a partial copy (its INCOMING mark): removed
    incoming.mkdir()
    (incoming / naming.INCOMING_FILE).write_bytes(b"")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="qdelay.replication"):
        autoresync.before_open(cfg)
    assert not incoming.exists() and len(_asides(tmp_path)) == 1
    assert any(f"removed {incoming}, the partial copy" in r.getMessage() for r in caplog.records)
    FolderLock(str(data), "the engine").release()
