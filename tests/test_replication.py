"""Replication with real server processes on 127.0.0.1 (docs/operations.md, the runbook).

Helpers here are shared with test_failover.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from conftest import wait_until
from serverproc import ServerProc

from qdelay import errors
from qdelay.client.types import Receipt
from qdelay.segments import naming, reader
from qdelay.v1 import replication_pb2 as rpb
from qdelay.v1 import replication_pb2_grpc as rpb_grpc

SMALL_SEGMENTS = ["--set", "engine.segment_bytes=65536"]
# a slave left refused as behind retention, for an operator's 'qdelay admin resync'
MANUAL_RESYNC = ["--set", "auto_resync=false"]


# --- helpers ---------------------------------------------------------------------------------------


def status(address: str, token: str | None = None, timeout: float = 5.0) -> rpb.ReplicationStatus:
    ch = grpc.insecure_channel(address)
    try:
        md = (("authorization", f"Bearer {token}"),) if token else ()
        return rpb_grpc.ReplicationStub(ch).Status(rpb.ReplicationStatusRequest(), timeout=timeout, metadata=md)
    finally:
        ch.close()


RPC_ERRORS = (grpc.RpcError, errors.QdelayError)  # a server starting or gone: not yet


def assert_refuses_writes(address: str) -> None:
    """A write is refused with FAILED_PRECONDITION (UNAVAILABLE only while the channel to a
    restarted server is still in its reconnect backoff)."""
    from qdelay.client import Client

    def refused():
        with Client(address, retries=0) as c:
            try:
                c.send("refuse.check", b"x")
            except errors.FailedPrecondition:
                return True
            except errors.Unavailable:
                return False
        raise AssertionError(f"{address} accepted a write")

    wait_until(refused, 15, f"{address} to refuse writes", ignore=RPC_ERRORS)


def wait_caught_up(master: str, slave: str, timeout: float = 30.0) -> None:
    def ok():
        m, s = status(master), status(slave)
        return s.connected and s.end_offset == m.end_offset and m.end_offset > 0 and (m, s)

    wait_until(ok, timeout, f"{slave} to catch up with {master}", ignore=RPC_ERRORS)


def admin(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    cp = subprocess.run(
        [sys.executable, "-m", "qdelay.cli", "admin", *args], capture_output=True, text=True, timeout=120
    )
    if check and cp.returncode != 0:
        raise AssertionError(f"qdelay admin {' '.join(args)} failed ({cp.returncode}): {cp.stdout}{cp.stderr}")
    return cp


def wal_files(data_dir) -> dict[str, bytes]:
    d = Path(data_dir) / naming.MESSAGE_DIR
    return {p.name: p.read_bytes() for p in sorted(d.glob("*.wal"))}


def assert_same_message_log(a, b, *, allow_missing_head: bool = False) -> None:
    fa, fb = wal_files(a), wal_files(b)
    if allow_missing_head:
        common = sorted(set(fa) & set(fb))
        assert common and common[-1] == sorted(fa)[-1] == sorted(fb)[-1]
        fa = {k: fa[k] for k in common}
        fb = {k: fb[k] for k in common}
    assert list(fa) == list(fb), (list(fa), list(fb))
    for name in fa:
        assert fa[name] == fb[name], f"segment {name} differs"


def schedule_records(data_dir) -> set[tuple[int, int, int]]:
    """(bucket, sequence, kind) of every schedule-log record."""
    out = set()
    for bucket, path in naming.list_buckets(str(Path(data_dir) / naming.SCHEDULE_DIR), naming.SCHEDULE_SUFFIX):
        data = Path(path).read_bytes()
        for f in reader.frames(data):
            out.add((bucket, f.sequence, f.kind))
    return out


def dispatched(data_dir) -> set[int]:
    out = set()
    for _b, path in naming.list_buckets(str(Path(data_dir) / naming.DISPATCH_DIR), naming.DISPATCH_SUFFIX):
        out |= {f.sequence for f in reader.frames(Path(path).read_bytes())}
    return out


def master(tmp_path, name="a", args=(), **kw) -> ServerProc:
    return ServerProc(tmp_path / name, args=[*SMALL_SEGMENTS, *args], **kw)


def slave(tmp_path, of: ServerProc | str, name="b", args=(), **kw) -> ServerProc:
    addr = of if isinstance(of, str) else of.address
    return ServerProc(tmp_path / name, args=[*SMALL_SEGMENTS, "--role", "slave", "--master", addr, *args], **kw)


def send_some(address: str, n: int, delay_ms: int = 600_000, size: int = 200) -> list:
    from qdelay.client import Client

    with Client(address) as c:
        return c.send_many(
            (c.message("rep.test", os.urandom(size), delay_ms=delay_ms + (i % 7) * 60_000) for i in range(n)),
            batch_size=500,
        )


# --- tests -----------------------------------------------------------------------------------------


def test_slave_catches_up_from_empty_and_from_behind(tmp_path):
    with master(tmp_path) as a:
        send_some(a.address, 3000)
        b = slave(tmp_path, a)
        with b:
            wait_caught_up(a.address, b.address)
            st = status(b.address)
            assert st.role == "slave" and st.lag_bytes == 0
            with pytest.raises(errors.FailedPrecondition):
                b.client(retries=0).send("x", b"1")  # a slave refuses writes
            assert status(a.address).lag_bytes == 0
        # slave stopped: the master goes on, the slave catches up from behind
        send_some(a.address, 3000)
        ms = status(a.address)
        assert ms.lag_bytes == -1  # no slave attached
        with b:
            b.start() if not b.alive() else None
            wait_caught_up(a.address, b.address)
            send_some(a.address, 500)  # and follows live appends
            wait_caught_up(a.address, b.address)
            wait_until(
                lambda: status(b.address).iterate_offset == status(b.address).end_offset,
                20,
                "slave iterate",
                ignore=RPC_ERRORS,
            )
            wait_until(
                lambda: status(a.address).iterate_offset == status(a.address).end_offset,
                20,
                "master iterate",
                ignore=RPC_ERRORS,
            )
    assert len(wal_files(tmp_path / "a")) > 5
    assert_same_message_log(tmp_path / "a", tmp_path / "b")
    # the slave built its own schedule log: the same records, hence the same pending set
    assert schedule_records(tmp_path / "a") == schedule_records(tmp_path / "b")


# Refusals are tested with a short wait for a slave; what must be acknowledged once a slave is
# attached, with a long one, on the same data folder: 300 ms was short enough for a slave to
# miss under a loaded CI box (a 200-message batch of send_many refused, stop 30).
SHORT_SYNC = ["--replication", "sync", "--replication-timeout-ms", "300"]
LONG_SYNC = ["--replication", "sync", "--replication-timeout-ms", "20000"]


def test_sync_mode_acks_after_slave_and_times_out_without_one(tmp_path):
    with master(tmp_path, args=SHORT_SYNC) as a:
        c = a.client(retries=0)
        t0 = time.monotonic()
        with pytest.raises(errors.Unavailable) as info:
            c.send("s", b"x", delay_ms=1000, message_id="first")
        assert "sync replication" in str(info.value) and time.monotonic() - t0 >= 0.25
        assert status(a.address).sync_timeouts == 1
        # the retry the refusal asks for ("retry with the same message_id") is a duplicate of
        # a write no slave has: it was acknowledged at once (duplicate = true), so an
        # acknowledged write could be lost with the master; it waits for a slave as well
        with pytest.raises(errors.Unavailable, match="no slave confirmed"):
            c.send("s", b"x", delay_ms=1000, message_id="first")
        assert status(a.address).sync_timeouts == 2
        # so with a cancel: its retry found the tombstone and said ALREADY_CANCELLED at once
        with pytest.raises(errors.Unavailable, match="no slave confirmed"):
            c.cancel("first")
        with pytest.raises(errors.Unavailable, match="no slave confirmed"):
            c.cancel("first")
        assert status(a.address).sync_timeouts == 4
    with master(tmp_path, args=LONG_SYNC) as a, slave(tmp_path, a) as b:
        c = a.client(retries=0)
        wait_until(lambda: status(b.address).connected, 20, "slave attached", ignore=RPC_ERRORS)
        again = c.send("s", b"x", delay_ms=1000, message_id="first")
        assert again.sequence == 1 and status(b.address).last_sequence >= 2  # the original and its tombstone
        assert c.cancel("first") == "ALREADY_CANCELLED"
        r = c.send("s", b"y", delay_ms=1000)
        # acknowledged only once the slave had it durable
        assert status(b.address).last_sequence >= r.sequence
        rs = c.send_many((c.message("s", b"z", delay_ms=1000) for _ in range(2000)), batch_size=200)
        assert status(b.address).last_sequence >= rs[-1].sequence
        assert status(a.address).sync_timeouts == 0


def test_sync_mode_retried_reschedule_waits_for_a_slave(tmp_path):
    """A reschedule refused UNAVAILABLE in sync mode (its new message and the old one's
    tombstone durable on the master only), retried with the same receipt as the refusal
    asks: the retry finds the old message cancelled and must not answer CANCELLED before a
    slave has that tombstone (after a failover the slave would deliver it at the old time)."""
    with master(tmp_path, args=SHORT_SYNC) as a:
        c = a.client(retries=0)
        with pytest.raises(errors.Unavailable):
            c.send("s", b"x", delay_ms=60_000, message_id="move")
        old = Receipt("move", c.get(message_id="move").deliver_at_ms, 1)  # the log's first record
        with pytest.raises(errors.Unavailable, match="no slave confirmed"):
            c.reschedule(old, delay_ms=120_000)
        with pytest.raises(errors.Unavailable, match="no slave confirmed"):
            c.reschedule(old, delay_ms=120_000)
        assert status(a.address).sync_timeouts == 3
    with master(tmp_path, args=LONG_SYNC) as a, slave(tmp_path, a) as b:
        c = a.client(retries=0)
        wait_until(lambda: status(b.address).connected, 20, "slave attached", ignore=RPC_ERRORS)
        assert c.reschedule(old, delay_ms=120_000) == ("CANCELLED", None)
        assert status(b.address).last_sequence >= 3  # the original, its move and its tombstone


def test_slave_without_token_is_refused(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("s3cret-token\n")
    other = tmp_path / "wrong"
    other.write_text("not-it\n")
    with master(tmp_path, args=["--auth-token-file", str(tokens)]) as a:
        c = a.client(token="s3cret-token")
        c.send_many(c.message("s", b"x", delay_ms=60_000) for _ in range(100))
        with pytest.raises(grpc.RpcError) as info:
            status(a.address)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # a slave presenting a wrong token is refused, and says so
        with slave(
            tmp_path, a, name="b", args=["--auth-token-file", str(tokens), "--replication-token-file", str(other)]
        ) as b:
            st = wait_until(
                lambda: (s := status(b.address, "s3cret-token")).error and s, 20, "refusal", ignore=RPC_ERRORS
            )
            assert "UNAUTHENTICATED" in st.error or "refused" in st.error
            assert st.end_offset == 0
        # with the cluster's token it replicates
        with slave(tmp_path, a, name="c", args=["--auth-token-file", str(tokens)]) as b2:
            wait_until(
                lambda: status(b2.address, "s3cret-token").end_offset == status(a.address, "s3cret-token").end_offset,
                20,
                "catch-up with token",
                ignore=RPC_ERRORS,
            )
        cp = admin("status", "--servers", a.address, check=False)
        assert cp.returncode == 1 and "UNAUTHENTICATED" in cp.stdout
        tf = tmp_path / "tok"
        tf.write_text("s3cret-token\n")
        assert "master" in admin("status", "--servers", a.address, "--token-file", str(tf)).stdout


def test_dispatch_progress_replicated_and_promotion_delivers_the_rest(tmp_path):
    from qdelay.client import Client

    peers_a = []
    a = master(tmp_path)
    a.start()
    b = slave(tmp_path, a, args=["--peers", a.address])
    b.start()
    try:
        now = int(time.time() * 1000)
        with Client(a.address) as c:
            first = c.send_many(c.message("disp", str(i).encode(), deliver_at_ms=now + 500) for i in range(400))
            later = c.send_many(c.message("disp", str(i).encode(), deliver_at_ms=now + 8000) for i in range(300))
            got = {}
            with c.subscribe("disp", max_in_flight=5000) as cons:
                deadline = time.monotonic() + 20
                while len(got) < 400 and time.monotonic() < deadline:
                    batch = cons.receive(400 - len(got), 1.0)
                    for d in batch:
                        got[d.message_id] = d
                    cons.ack(batch)
        assert set(got) == {r.message_id for r in first}
        delivered_seqs = {r.sequence for r in first}
        wait_until(
            lambda: delivered_seqs <= dispatched(tmp_path / "b"), 20, "dispatch records on the slave", ignore=RPC_ERRORS
        )
        assert dispatched(tmp_path / "b") == dispatched(tmp_path / "a")
        a.kill9()
        cp = admin("promote", "--target", b.address)
        assert "master at epoch 1" in cp.stdout
        st = status(b.address)
        assert st.role == "master" and st.epoch == 1
        with Client(b.address) as cb:
            with cb.subscribe("disp", max_in_flight=5000) as cons:
                again = {}
                deadline = time.monotonic() + 25
                while len(again) < 300 and time.monotonic() < deadline:
                    batch = cons.receive(300 - len(again), 1.0)
                    for d in batch:
                        again[d.message_id] = d
                        assert d.dispatched_at_ms >= d.deliver_at_ms
                    cons.ack(batch)
                extra = cons.receive(1, 1.5)
        # the promoted master delivered what was not in its dispatch log, and nothing else
        assert set(again) == {r.message_id for r in later}
        assert not extra
        # the new master accepts writes; the restarted old master (peers: b) is fenced
        cb = Client(b.address)
        cb.send("disp", b"after", delay_ms=100_000)
        a.args += ["--peers", b.address]
        a.start()
        sa = status(a.address)
        assert sa.role == "fenced" and sa.epoch == 1
        # ... and its status says what to do (it said only "fenced")
        advice = f"to re-attach it, restart it with --role slave --master {b.address} (docs/operations.md 4.3)"
        assert sa.note == f"fenced: a newer master exists (epoch 1); {advice}", sa.note
        assert (
            f"note: fenced: a newer master exists (epoch 1); {advice}" in admin("status", "--servers", a.address).stdout
        )
        assert_refuses_writes(a.address)
        # runbook: re-attach the old master as a slave of the new one
        a.stop()
        a.args = [*SMALL_SEGMENTS, "--role", "slave", "--master", b.address]
        a.start()
        wait_caught_up(b.address, a.address)
        assert status(a.address).role == "slave"
    finally:
        for p in (a, b):
            if p.alive():
                p.stop()
    assert_same_message_log(tmp_path / "a", tmp_path / "b")
    del peers_a


def test_resync_holds_the_new_folder_while_it_writes_it(tmp_path):
    """A server started on the data folder while a resync builds it (a unit restarted by its
    supervisor) is refused until the folder is whole: the old folder was locked, the new one
    it writes was not, so the server opened a folder without its checkpoint and wrote into
    it beside the resync."""
    from qdelay.errors import FolderInUse
    from qdelay.replication.snapshot import write_snapshot
    from qdelay.segments.folder_lock import FolderLock

    data = tmp_path / "b"
    (data / "messages").mkdir(parents=True)
    (data / "messages" / "old").write_bytes(b"x")
    seen: list[str] = []

    def chunks():
        yield rpb.SnapshotChunk(epoch=2, offset=0, sequence=0)
        try:
            FolderLock(str(data), "a test server").release()
            seen.append("taken")
        except FolderInUse:
            seen.append("refused")

    info = write_snapshot(str(data), chunks())
    assert seen == ["refused"]
    assert info["moved_old_to"] and (data / naming.CHECKPOINT_DIR / "role.ckpt").exists()
    FolderLock(str(data)).release()  # free once the resync is done


def test_behind_retention_is_reported_then_full_resync(tmp_path):
    args = [
        "--set",
        "engine.message_retention_ms=0",
        "--set",
        "engine.cleaner_interval_ms=200",
        "--set",
        "slave_hold_ms=0",
        "--set",
        "engine.checkpoint_interval_ms=50",
    ]
    with master(tmp_path, args=args) as a:
        # the manual path (automatic resync: tests/test_autoresync.py)
        with slave(tmp_path, a, args=MANUAL_RESYNC) as b:  # attached: the master keeps what it has not confirmed
            wait_until(lambda: status(b.address).connected, 20, "slave attached", ignore=RPC_ERRORS)
            send_some(a.address, 1500, delay_ms=3_600_000)
            wait_caught_up(a.address, b.address)
        send_some(a.address, 3000, delay_ms=3_600_000)
        wait_until(
            lambda: (
                status(a.address).first_offset > status(a.address).iterate_offset - 200_000
                and status(a.address).first_offset > 0
            ),
            20,
            "master cleaned its message log",
            ignore=RPC_ERRORS,
        )
        with b:
            b.start() if not b.alive() else None
            st = wait_until(lambda: (s := status(b.address)).error and s, 20, "retention error", ignore=RPC_ERRORS)
            assert "behind retention" in st.error and "resync" in st.error
            assert not st.connected
            # runbook step 1 is "stop the slave": resync used to move the folder from under
            # the running one; the folder's lock refuses it, and nothing moves
            cp = admin("resync", "--data-dir", str(tmp_path / "b"), "--master", a.address, check=False)
            assert cp.returncode == 1 and "Traceback" not in cp.stderr, cp.stderr
            assert f"data folder {tmp_path / 'b'} is in use by another process (pid {b.proc.pid}" in cp.stderr
            assert [p.name for p in tmp_path.iterdir() if p.name.startswith("b.before-resync")] == []
        # a master that does not answer: the old folder stays where it is (it was moved aside
        # and an empty one put in its place before the master was asked)
        cp = admin("resync", "--data-dir", str(tmp_path / "b"), "--master", "127.0.0.1:1", check=False)
        assert cp.returncode == 1 and "UNAVAILABLE" in cp.stderr, cp.stderr
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith("b.before-resync")] == []
        cp = admin("resync", "--data-dir", str(tmp_path / "b"), "--master", a.address)
        assert "resynced" in cp.stdout
        # the next step names the slave's own flags: a bare 'qdelay server --data-dir D --role
        # slave --master M' listened on the default address and presented no token
        assert "--listen HOST:PORT" in cp.stdout and "--auth-token-file" in cp.stdout, cp.stdout
        with b:
            b.start() if not b.alive() else None
            send_some(a.address, 200, delay_ms=3_600_000)
            wait_caught_up(a.address, b.address)
            wait_until(
                lambda: status(b.address).iterate_offset == status(b.address).end_offset,
                20,
                "slave iterate",
                ignore=RPC_ERRORS,
            )
            wait_until(
                lambda: status(a.address).iterate_offset == status(a.address).end_offset,
                20,
                "master iterate",
                ignore=RPC_ERRORS,
            )
    assert_same_message_log(tmp_path / "a", tmp_path / "b", allow_missing_head=True)
    # every pending message is in the resynced slave's schedule log
    assert schedule_records(tmp_path / "a") == schedule_records(tmp_path / "b")


def test_a_slave_ending_at_the_masters_oldest_segment_is_behind_retention(tmp_path):
    """A slave whose log ends exactly where the master's oldest kept segment starts: its last
    record is in a segment the master deleted, so the logs cannot be compared. It was told
    "diverged", and its repair then failed on "no common prefix"; it is behind retention
    (the same advice: a full resync), as one a byte further back is. It is genuinely behind:
    with slave_hold_ms=0 the master holds nothing for it once it stops (a held slave keeps
    the segment with its last record: test_a_held_slave_ending_at_a_segment_end_...)."""
    args = ["--set", "engine.message_retention_ms=0", "--set", "engine.cleaner_interval_ms=200"]
    args += ["--set", "slave_hold_ms=0", "--set", "engine.checkpoint_interval_ms=50"]
    with master(tmp_path, args=args) as a:
        with slave(tmp_path, a, args=MANUAL_RESYNC) as b:
            wait_until(lambda: status(b.address).connected, 20, "slave attached", ignore=RPC_ERRORS)
            send_some(a.address, 100, delay_ms=3_600_000)
            wait_caught_up(a.address, b.address)
            end = status(b.address).end_offset
        # one batch larger than a segment: the master rolls at the slave's end, and cleans
        # everything before (the new segment is the active one, never deleted)
        send_some(a.address, 100, delay_ms=3_600_000, size=1000)
        assert f"{end:020d}.wal" in wal_files(tmp_path / "a")
        wait_until(lambda: status(a.address).first_offset == end, 20, "master cleaned", ignore=RPC_ERRORS)
        with b:
            b.start() if not b.alive() else None
            st = wait_until(lambda: (s := status(b.address)).error and s, 20, "retention error", ignore=RPC_ERRORS)
            want = "(its last record, where the two logs are compared) but the master's oldest segment "
            assert st.error.startswith("behind retention: the slave needs message-log offset "), st.error
            why = "(the master's hold for this slave expired: slave_hold_ms / slave_hold_bytes)"
            assert f"{want}starts at {end} {why}; stop the slave and run 'qdelay admin resync " in st.error, st.error
            assert not st.connected and st.end_offset == end


def test_a_held_slave_ending_at_a_segment_end_catches_up_without_a_resync(tmp_path):
    """The master rolls to a new segment exactly where a (disconnected, held) slave's log
    ends, and cleans: the segment holding that slave's last record stays, because the
    reconnect compares that record; the cleaner used to delete it (the slave's confirmed
    offset was the floor), and the slave, which has every record, was sent to a full resync
    as behind retention. A second slave, held further back, keeps the oldest segment until
    it catches up after the roll, so the pass that cleans is known to come after it."""
    args = ["--set", "engine.message_retention_ms=0", "--set", "engine.cleaner_interval_ms=200"]
    args += ["--set", "engine.checkpoint_interval_ms=50"]  # slave_hold_ms: the default hour
    with master(tmp_path, args=args) as a:
        with slave(tmp_path, a) as b, slave(tmp_path, a, name="c") as c:
            for s in (b, c):
                wait_until(lambda s=s: status(s.address).connected, 20, "slave attached", ignore=RPC_ERRORS)
            send_some(a.address, 25, delay_ms=3_600_000, size=1000)  # half the first segment
            wait_caught_up(a.address, c.address)
            c.stop()  # held where it is, in the first segment
            send_some(a.address, 25, delay_ms=3_600_000, size=1000)
            send_some(a.address, 50, delay_ms=3_600_000, size=1000)  # does not fit: a second segment
            wait_caught_up(a.address, b.address)
            end = status(b.address).end_offset
        held = max(int(n.split(".")[0]) for n in wal_files(tmp_path / "a"))  # holds b's last record
        assert 0 < held < end
        # one batch larger than a segment: the master rolls at b's end
        send_some(a.address, 100, delay_ms=3_600_000, size=1000)
        assert f"{end:020d}.wal" in wal_files(tmp_path / "a")
        wait_until(lambda: (s := status(a.address)).iterate_offset == s.end_offset, 20, "master iterate")
        assert status(a.address).first_offset == 0  # c holds the first segment
        with c:
            wait_caught_up(a.address, c.address)
            wait_until(lambda: status(a.address).first_offset > 0, 20, "master cleaned", ignore=RPC_ERRORS)
        assert status(a.address).first_offset == held, "the segment holding b's last record stays"
        with b:
            wait_caught_up(a.address, b.address)
            st = status(b.address)
            assert st.error == "" and st.note == "", (st.error, st.note)
        assert [p.name for p in tmp_path.iterdir() if "before-resync" in p.name] == []
        assert not (tmp_path / "b" / naming.DIVERGED_DIR).exists()
    assert_same_message_log(tmp_path / "a", tmp_path / "b", allow_missing_head=True)


def test_three_servers_failover_other_slave_follows_new_master(tmp_path):
    from qdelay.client import ClusterClient

    a = master(tmp_path, "a")
    a.start()
    b = slave(tmp_path, a, "b")
    c = slave(tmp_path, a, "c")
    b.start()
    c.start()
    b.args += ["--peers", f"{a.address},{c.address}"]
    c.args += ["--peers", f"{a.address},{b.address}"]
    b.restart()
    c.restart()
    try:
        send_some(a.address, 2000)
        wait_caught_up(a.address, b.address)
        wait_caught_up(a.address, c.address)
        a.kill9()
        admin("promote", "--target", b.address)
        with ClusterClient([a.address, b.address, c.address], failover_timeout=20) as cc:
            rs = cc.send_batch([cc.message("three", b"x", delay_ms=600_000) for _ in range(500)])
            assert len(rs) == 500
        wait_caught_up(b.address, c.address)
        st = status(c.address)
        assert st.master == b.address and st.epoch == 1
        out = admin("status", "--servers", f"{a.address},{b.address},{c.address}", check=False).stdout
        assert "unreachable" in out and "master" in out and "slave" in out
        # B's note said A was "not reached ... must be started with --role slave" long after
        # it was: the part of a server that re-attaches is updated, C's part kept
        head, *parts = status(b.address).note.split("; ")
        assert head.startswith("promoted to master at epoch 1 "), head
        assert parts[0].startswith(f"{a.address}: not reached (UNAVAILABLE)"), parts
        assert parts[-1] == f"{c.address}: now slave at epoch 1", parts
        a.args = [*SMALL_SEGMENTS, "--role", "slave", "--master", b.address]
        a.start()
        wait_caught_up(b.address, a.address)
        want = f"{head}; {a.address}: re-attached as slave at epoch 1; {c.address}: now slave at epoch 1"
        wait_until(lambda: status(b.address).note == want, 10, "the note updated", ignore=RPC_ERRORS)
        assert f"note: {want}" in admin("status", "--servers", b.address).stdout
    finally:
        for p in (a, b, c):
            if p.alive():
                p.stop()
    assert_same_message_log(tmp_path / "b", tmp_path / "c")
    assert schedule_records(tmp_path / "b") == schedule_records(tmp_path / "c")


def test_groups_and_their_progress_survive_replication_and_promotion(tmp_path):
    """Groups are GROUP records in the replicated message log, and their closes DISPATCH
    records in the replicated dispatch log: a promoted slave knows every group and hands
    each one only what it has not acknowledged."""
    from qdelay.client import Client

    a = master(tmp_path)
    a.start()
    b = slave(tmp_path, a, args=["--peers", a.address])
    b.start()
    try:
        now = int(time.time() * 1000)
        with Client(a.address) as c:
            assert c.create_group("fan", "done") and c.create_group("fan", "behind")
            sent = c.send_many(c.message("fan", str(i).encode(), deliver_at_ms=now + 300) for i in range(200))
            got: set[str] = set()
            with c.subscribe("fan", group="done", max_in_flight=1000) as cons:
                deadline = time.monotonic() + 20
                while len(got) < 200 and time.monotonic() < deadline:
                    batch = cons.receive(200 - len(got), 1.0)
                    got |= {d.message_id for d in batch}
                    cons.ack(batch)
        assert got == {r.message_id for r in sent}
        seqs = {r.sequence for r in sent}
        wait_until(lambda: seqs <= dispatched(tmp_path / "b"), 20, "dispatch records on the slave", ignore=RPC_ERRORS)
        a.kill9()
        admin("promote", "--target", b.address)
        with Client(b.address) as cb:
            assert sorted(g["group"] for g in cb.groups() if g["subject"] == "fan") == ["behind", "done"]
            behind: set[str] = set()
            with cb.subscribe("fan", group="behind", max_in_flight=1000) as cons:
                deadline = time.monotonic() + 25
                while len(behind) < 200 and time.monotonic() < deadline:
                    batch = cons.receive(200 - len(behind), 1.0)
                    behind |= {d.message_id for d in batch}
                    cons.ack(batch)
            assert behind == {r.message_id for r in sent}
            with cb.subscribe("fan", group="done", max_in_flight=1000) as cons:
                assert cons.receive(1, 1.5) == [], "the group that had acknowledged everything got messages again"
    finally:
        for p in (a, b):
            if p.alive():
                p.stop()


def test_reschedule_is_replicated_and_a_slave_answers_get_by_id(tmp_path):
    """A Reschedule (or a RescheduleBatch) is two records a move in the replicated message log
    (the message again at its new time, the old one's tombstone): the slave answers Get by id and by receipt with the
    new time (reads are served by any role; writes only by the master), and once promoted
    delivers the message at its new time, never at the old one."""
    from qdelay.client import Client

    a = master(tmp_path)
    a.start()
    b = slave(tmp_path, a, args=["--peers", a.address])
    b.start()
    try:
        now = int(time.time() * 1000)
        with Client(a.address) as c:
            later = c.send("mv", b"later", deliver_at_ms=now + 2_000, message_id="later")  # moved out
            sooner = c.send("mv", b"sooner", deliver_at_ms=now + 3_600_000, message_id="sooner")  # moved in
            outcome, moved_out = c.reschedule("later", deliver_at_ms=now + 7_000)
            assert outcome == "RESCHEDULED"
            outcome, moved_in = c.reschedule(sooner, deliver_at_ms=now + 5_000)
            assert outcome == "RESCHEDULED"
            c.send("mv", b"batch", deliver_at_ms=now + 3_600_000, message_id="batch")
            [(outcome, moved_batch), (none, _r)] = c.reschedule_many(["batch", "nobody"], deliver_at_ms=now + 6_000)
            assert (outcome, none) == ("RESCHEDULED", "NOT_FOUND")  # a RescheduleBatch: the same records
        wait_caught_up(a.address, b.address)
        with Client(b.address, retries=0) as cb:
            st = cb.get(message_id="later")
            assert (st.state, st.deliver_at_ms) == ("PENDING", moved_out.deliver_at_ms)
            assert cb.get(message_id="sooner").deliver_at_ms == moved_in.deliver_at_ms
            assert cb.get(later).state == "CANCELLED"  # the old receipt: its tombstone
            assert cb.get(moved_in).state == "PENDING"
            assert cb.get(message_id="nobody").state == "NOT_FOUND"
            assert cb.get(message_id="batch").deliver_at_ms == moved_batch.deliver_at_ms
            with pytest.raises(errors.FailedPrecondition):
                cb.reschedule_many(["batch"], delay_ms=1000)
            with pytest.raises(errors.FailedPrecondition):
                cb.cancel(message_id="later")
            with pytest.raises(errors.FailedPrecondition):
                cb.reschedule("later", delay_ms=1000)
        a.kill9()
        admin("promote", "--target", b.address)
        got = []
        with Client(b.address) as cb, cb.subscribe("mv", max_in_flight=10) as cons:
            deadline = time.monotonic() + 20
            while len(got) < 3 and time.monotonic() < deadline:
                batch = cons.receive(3 - len(got), 1.0)
                got += batch
                cons.ack(batch)
            extra = cons.receive(1, 1.0)
            assert cb.get(message_id="later").state == "DELIVERED"
        assert [(d.message_id, d.deliver_at_ms) for d in got] == [
            ("sooner", moved_in.deliver_at_ms),
            ("batch", moved_batch.deliver_at_ms),
            ("later", moved_out.deliver_at_ms),
        ]
        for d in got:  # never at the old time: handed over at or after the new one
            assert d.dispatched_at_ms >= d.deliver_at_ms
        assert not extra
    finally:
        for p in (a, b):
            if p.alive():
                p.stop()


def test_a_slave_answers_a_get_with_every_record_its_log_holds_a_replicated_cancel_too(tmp_path):
    """A read on a slave after a replicated write sees it. Lookups waited for the iterate
    service to copy their target's own record (and what the log held at open), which covers
    a master's own Cancels (their claims answer until then) but not a tombstone that came by
    replication: a Get by receipt on the slave said PENDING for a message whose Cancel its
    message log already held, until its iterate service copied it. The window here: the
    slave's ``iterate_gather_ms`` of 3 s, the wait after a step that lets commits share the
    next one (a backlog makes it as real). A lookup now waits for everything the slave's
    log holds at the call, and hurries the service (no 3 s wait)."""
    from qdelay.client import Client

    with master(tmp_path) as a, slave(tmp_path, a, args=["--set", "engine.iterate_gather_ms=3000"]) as b:
        wait_until(lambda: status(b.address).connected, 20, "slave attached", ignore=RPC_ERRORS)
        with Client(a.address) as c, Client(b.address, retries=0) as cb:
            for n, by_id in enumerate((False, True)):
                target = c.send("stale.get", b"x", delay_ms=3_600_000, message_id=f"t{n}")
                end = status(a.address).end_offset
                # the slave copied it, and its iterate service now gathers for 3 s
                wait_until(lambda e=end: status(b.address).iterate_offset >= e, 20, "iterated", ignore=RPC_ERRORS)
                assert c.cancel(target) == "CANCELLED"
                end = status(a.address).end_offset
                st = wait_until(lambda e=end: (s := status(b.address)).end_offset >= e and s, 20, "cancel replicated")
                assert st.iterate_offset < end, "the window: the tombstone in the slave's log, not yet copied"
                t0 = time.monotonic()
                got = cb.get(message_id=f"t{n}") if by_id else cb.get(target)
                assert got.state == "CANCELLED", (by_id, got)
                assert time.monotonic() - t0 < 2.0, "the lookup hurries the iterate service"
                assert cb.get(target).state == cb.get(message_id=f"t{n}").state == "CANCELLED"


def test_admin_names_an_unusable_file_or_an_empty_server_list(tmp_path):
    """Walking the operator's side: ``qdelay admin status --token-file`` (or ``--tls-ca``) with
    a path that is not there printed a FileNotFoundError traceback (exit 1), a token file
    holding only comments sent no token and came back UNAUTHENTICATED "missing ...", and
    ``--servers ,`` printed nothing and exited 0, and an address without its port was tried
    on port 443. Each is a usage error (exit 2) naming the flag, before any call."""
    empty = tmp_path / "tokens"
    empty.write_text("# rotate here\n\n")
    binary = tmp_path / "key.der"  # not text: a UnicodeDecodeError traceback
    binary.write_bytes(b"\xff\xfe\x00\x01key\n")
    for args, want in (
        (
            ("status", "--servers", "127.0.0.1:1", "--token-file", str(binary)),
            f"qdelay admin status: --token-file {binary} is not a text file",
        ),
        (
            ("status", "--servers", "127.0.0.1:1", "--token-file", str(tmp_path / "gone")),
            f"qdelay admin status: --token-file {tmp_path / 'gone'}: cannot read it: No such file or directory",
        ),
        (
            ("group", "list", "--server", "127.0.0.1:1", "--token-file", str(empty)),
            f"qdelay admin group: --token-file {empty} holds no token",
        ),
        (
            ("promote", "--target", "127.0.0.1:1", "--tls-ca", str(tmp_path / "ca.pem")),
            f"qdelay admin promote: --tls-ca {tmp_path / 'ca.pem'}: cannot read it",
        ),
        (("status", "--servers", " , "), "qdelay admin status: --servers ' , ' names no HOST:PORT"),
        # without its port gRPC tried 443 (its default): "127.0.0.1 unreachable ... :443", exit 1
        (
            ("status", "--servers", "127.0.0.1:1,127.0.0.1"),
            "qdelay admin status: --servers must be HOST:PORT, not '127.0.0.1'",
        ),
        (("promote", "--target", "host"), "qdelay admin promote: --target must be HOST:PORT, not 'host'"),
        # a URL: "http://host" was taken for the host, and gRPC failed to resolve it, exit 1
        (
            ("promote", "--target", "http://127.0.0.1:1"),
            "qdelay admin promote: --target must be HOST:PORT (or a gRPC target: unix:, dns:, ipv4:, ...), "
            "not 'http://127.0.0.1:1': gRPC takes no URL, drop the http://; pass '127.0.0.1:1'",
        ),
        (("group", "list", "--server", "h:x"), "qdelay admin group: --server must be HOST:PORT, not 'h:x': the port"),
        (
            ("fence", "--target", "127.0.0.1:1", "--epoch", "2", "--master", "m"),
            "qdelay admin fence: --master must be HOST:PORT, not 'm'",
        ),
        (("resync", "--data-dir", str(tmp_path), "--master", "m:0"), "qdelay admin resync: --master must be HOST:PORT"),
    ):
        cp = admin(*args, check=False)
        assert cp.returncode == 2 and cp.stdout == "", (args, cp.returncode, cp.stdout, cp.stderr)
        assert cp.stderr.startswith(want) and len(cp.stderr.splitlines()) == 1, (args, cp.stderr)


def test_admin_status_json_prints_64_bit_numbers_as_numbers(tmp_path):
    """``qdelay admin status --json`` printed every 64-bit field as a string ("epoch": "1",
    "end_offset": "4183"): protobuf's JSON mapping. A script comparing offsets or lag then
    compared text. They are JSON numbers now, under the same field names, nested too."""
    import json

    with master(tmp_path) as a, slave(tmp_path, a) as b:
        send_some(a.address, 10)
        wait_caught_up(a.address, b.address)
        out = json.loads(admin("status", "--servers", f"{a.address},{b.address}", "--json").stdout)
    m, s = out[a.address], out[b.address]
    assert (m["role"], s["role"]) == ("master", "slave")
    for field in ("epoch", "first_offset", "end_offset", "last_sequence", "lag_bytes", "lag_ms", "sync_timeouts"):
        assert type(m[field]) is int and type(s[field]) is int, (field, m[field], s[field])
    assert m["end_offset"] == s["end_offset"] > 0 and m["last_sequence"] == 10
    assert s["delay_p99_ms"] >= -1 and m["slaves"] and type(m["slaves"][0]["acked_offset"]) is int
    assert m["slaves"][0]["acked_offset"] == m["end_offset"] and type(m["slaves"][0]["connected"]) is bool


def test_a_master_restart_is_a_warning_on_its_slave_not_an_error(tmp_path):
    """A slave whose master restarts (a rolling restart, or the master started after the
    slave) logged 'ERROR ... replication: master M: UNAVAILABLE ...' each time, though it
    only retries with backoff and catches up: an ERROR an operator's alerting pages on for
    routine work. Connection loss is a WARNING saying it retries; refusals (a token, the
    retention, a divergence) stay ERRORs."""
    with master(tmp_path) as a, slave(tmp_path, a) as b:
        wait_until(lambda: status(b.address).connected, 20, "slave attached", ignore=RPC_ERRORS)
        a.restart()
        send_some(a.address, 10)
        wait_caught_up(a.address, b.address)
        log = b.log_path.read_text()
        assert f"WARNING qdelay.replication.slave: replication: master {a.address}: UNAVAILABLE: " in log, log
        assert "(retrying)" in log and " ERROR " not in log, log


def test_a_lost_status_on_the_pull_stream_is_a_master_restart_not_a_refusal():
    """grpc.aio reports INTERNAL "Internal error from Core" instead of a stream's own
    status when a write fails on a stream that ended or broke: the slave's write of its
    durable offset as a stopping master ends the Pull stream (UNAVAILABLE) or a killed one
    breaks it. The puller retried it, but logged it as a refusal: an ERROR at a routine
    master restart (see the test above). It is the master away now, as UNAVAILABLE; any other
    INTERNAL stays a refusal."""
    from qdelay.replication.slave import master_away

    def ended(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)

    assert master_away(ended(grpc.StatusCode.INTERNAL, "Internal error from Core"))
    assert master_away(ended(grpc.StatusCode.UNAVAILABLE, "the server is shutting down"))
    assert master_away(ended(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
    assert not master_away(ended(grpc.StatusCode.INTERNAL, "Exception iterating responses"))
    assert not master_away(ended(grpc.StatusCode.UNAUTHENTICATED, "bad token"))


def test_a_divergent_tail_can_be_read_with_inspect_as_the_runbook_says(tmp_path):
    """Runbook 4.3: an old master re-attached as a slave keeps the records the new master
    never had in ``diverged/<from>-<to>.wal`` and the docs say to inspect that file and
    re-send what matters; ``qdelay inspect dump --data-dir A diverged/...`` answered 'is
    not a segment of A' (exit 1). It reads it as message-log bytes now."""
    import json

    from qdelay.client import Client

    a = master(tmp_path)
    a.start()
    b = slave(tmp_path, a)
    try:
        b.start()
        send_some(a.address, 20)
        wait_caught_up(a.address, b.address)
        b.stop()
        with Client(a.address) as c:  # acknowledged by A alone (async): the tail B never gets
            c.send_many(c.message("only.a", b"lost %d" % i, delay_ms=600_000, message_id=f"a-{i}") for i in range(3))
        a.kill9()
        b.start()
        admin("promote", "--target", b.address)
        send_some(b.address, 2)
        a.args = [*SMALL_SEGMENTS, "--role", "slave", "--master", b.address]
        a.start()
        st = wait_until(lambda: (s := status(a.address)).note and s, 20, "divergence noted", ignore=RPC_ERRORS)
        rel = st.note.split(f"kept in {tmp_path / 'a'}/", 1)[1]
        assert rel.startswith("diverged/") and rel.endswith(".wal"), st.note
        cp = subprocess.run(
            [sys.executable, "-m", "qdelay.cli", "inspect", "dump", "--data-dir", str(tmp_path / "a"), rel],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert cp.returncode == 0, cp.stderr
        rows = [json.loads(line) for line in cp.stdout.splitlines()]
        assert [(r["message_id"], r["payload"]) for r in rows] == [(f"a-{i}", f"lost {i}") for i in range(3)]
        assert {r["segment"] for r in rows} == {rel}
    finally:
        for p in (a, b):
            if p.alive():
                p.stop()


def test_a_slave_refuses_a_retried_send_it_holds_a_duplicate_of(tmp_path):
    """Idempotent send looked the id up before checking the role: a send of an id the slave
    has (replicated) was answered by the slave with the original receipt, duplicate = true,
    not FAILED_PRECONDITION; a fenced master did the same for ids of a tail the new master
    may never have had. The role is checked first."""
    with master(tmp_path) as a, slave(tmp_path, a) as b:
        ca = a.client(retries=0)
        r = ca.send("dup.s", b"x", delay_ms=600_000, message_id="held-1")
        wait_caught_up(a.address, b.address)
        with pytest.raises(errors.FailedPrecondition, match="this server is a slave"):
            b.client(retries=0).send("dup.s", b"x", delay_ms=600_000, message_id="held-1")
        assert ca.send("dup.s", b"x", delay_ms=600_000, message_id="held-1").sequence == r.sequence  # the master's


def test_gets_on_an_old_master_whose_divergent_tail_was_cut_answer_at_once(tmp_path):
    """Lookups wait until the iterate service has copied what the message log held when the
    engine opened or last changed role (``Engine._claims_from``). An old master re-attached
    as a slave opened (and re-attached) with its divergent tail in that count; the tail is
    then cut, and the iterate service can reach that sequence only once the new master has
    written past it. Until then every Get on it, by receipt or by id, waited 5 s and failed
    'the iterate service is behind; retry shortly' (a quiet shard: for as long as nobody
    writes). The cut lowers that point with the log."""
    from qdelay.client import Client

    a = master(tmp_path)
    a.start()
    b = slave(tmp_path, a)
    try:
        b.start()
        kept = send_some(a.address, 20)
        wait_caught_up(a.address, b.address)
        b.stop()
        with Client(a.address) as c:  # acknowledged by A alone (async): the tail B never gets
            c.send_many(c.message("only.a", b"lost %d" % i, delay_ms=600_000, message_id=f"a-{i}") for i in range(5))
        a.kill9()
        b.start()
        admin("promote", "--target", b.address)
        after = send_some(b.address, 2)  # fewer than the cut tail: B's log ends before A's did
        a.args = [*SMALL_SEGMENTS, "--role", "slave", "--master", b.address]
        a.start()
        wait_until(lambda: status(a.address).note, 20, "divergence noted", ignore=RPC_ERRORS)
        wait_caught_up(b.address, a.address)
        with Client(a.address, retries=0) as c:
            for r in (kept[0], after[-1]):
                t0 = time.monotonic()
                assert c.get(r, timeout=3.0).state == "PENDING"
                assert time.monotonic() - t0 < 2.0
    finally:
        for p in (a, b):
            if p.alive():
                p.stop()


def test_admin_status_marks_which_slaves_are_in_sync(tmp_path):
    """Which slaves could take over without losing more than ``sync_bound_ms`` of writes was
    known only to a cluster master's log (its in-sync set). Status marks each slave of a
    master ``in_sync`` in any mode, and ``qdelay admin status`` shows it: a slave that stops
    confirming (SIGSTOP: attached, its stream open) drops out while the other stays in, and
    comes back once it has caught up."""
    import json
    import signal

    bound = ["--sync-bound-ms", "300"]
    with master(tmp_path, args=bound) as a, slave(tmp_path, a) as b, slave(tmp_path, a, name="c") as c:
        send_some(a.address, 10)
        wait_caught_up(a.address, b.address)
        wait_caught_up(a.address, c.address)

        def marks() -> dict[str, tuple[bool, bool]]:
            """{b or c: (connected, in_sync)} as the master's Status says."""
            out = {}
            for s in status(a.address).slaves:
                for p, letter in ((b, "b"), (c, "c")):
                    if s.name.endswith(os.path.abspath(p.data_dir)):
                        out[letter] = (s.connected, s.in_sync)
            return out

        wait_until(lambda: marks() == {"b": (True, True), "c": (True, True)}, 20, "both in sync", ignore=RPC_ERRORS)
        out = admin("status", "--servers", a.address).stdout
        assert out.count(" connected=True in_sync=True acked=") == 2, out
        os.kill(c.pid, signal.SIGSTOP)
        try:
            send_some(a.address, 10)  # async mode: acknowledged without c, b confirms them
            wait_until(lambda: marks() == {"b": (True, True), "c": (True, False)}, 20, "c out", ignore=RPC_ERRORS)
            out = admin("status", "--servers", a.address).stdout
            lines = [line for line in out.splitlines() if line.strip().startswith("slave ")]
            assert sorted("in_sync=True" in line for line in lines) == [False, True], out
            assert any(os.path.abspath(c.data_dir) in line and "connected=True in_sync=False" in line for line in lines)
            js = json.loads(admin("status", "--servers", a.address, "--json").stdout)[a.address]
            assert sorted(s["in_sync"] for s in js["slaves"]) == [False, True], js
        finally:
            os.kill(c.pid, signal.SIGCONT)
        wait_until(lambda: marks() == {"b": (True, True), "c": (True, True)}, 20, "c back", ignore=RPC_ERRORS)
        # a slave's own Status has no slaves to mark
        assert list(status(b.address).slaves) == []


def test_the_in_sync_bound_starts_again_at_a_new_epoch_as_master(tmp_path):
    """The hub's in-sync target is what the master had ``sync_bound_ms`` ago, but never
    before it became master at its epoch: a promoted slave's offsets from before say
    nothing of what it acknowledged since (in process, no clock: a bound of a minute)."""
    from types import SimpleNamespace

    from qdelay.replication.master import Hub
    from qdelay.server.config import ServerConfig

    folder = SimpleNamespace(data_dir=str(tmp_path))
    engine = SimpleNamespace(config=folder, wal=SimpleNamespace(committed_offset=100), role="slave", epoch=1)
    hub = Hub(engine, ServerConfig(sync_bound_ms=60_000))
    s = hub.attach("s", "peer", 0)
    assert hub.in_sync() == [], "not a master: none"
    engine.role = "master"
    hub.on_ack(s, 100)
    assert hub.in_sync() == [s]
    engine.wal.committed_offset = 200
    hub.on_ack(s, 150)
    assert hub.in_sync() == [s], "it has what the master had a minute ago (at 100)"
    engine.epoch = 2  # fenced and elected again, or promoted: a new epoch
    assert hub.in_sync() == [], "the target is what the master had at its new epoch: 200"
    hub.on_ack(s, 200)
    assert hub.in_sync() == [s]
    hub.detach(s)
    assert hub.in_sync() == [], "a detached slave is not in sync"
