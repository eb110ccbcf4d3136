"""A SIGTERM stop is prompt with streams open, and loses nothing (server/app.py App.stop,
docs/internals.md "Stopping").

The server ends the streams it can end -- a slave's Pull stream once that slave confirmed
everything, Subscribe streams, idle SendStreams -- instead of letting gRPC's stop wait its
whole grace period for them: a master with an attached slave took ~10 s to stop (the Pull
stream waited out), which, with the other waits of the stop in sequence, ran past tests'
30 s stop timeouts on a loaded machine.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from pathlib import Path

import grpc
import pytest
from conftest import wait_until
from simclock import started_engine
from test_replication import RPC_ERRORS, assert_same_message_log, master, send_some, slave, status, wait_caught_up

from qdelay.errors import ShuttingDown
from qdelay.segments import checkpoint
from qdelay.v1 import replication_pb2 as rpb
from qdelay.v1 import replication_pb2_grpc as rpb_grpc

# well below the tests' stop timeouts (15-30 s) and gRPC's own grace (10 s, the deadline)
STOP_BOUND_S = 8.0


def timed_stop(proc) -> tuple[int, float]:
    """SIGTERM ``proc`` and wait for it to exit: (exit code, seconds)."""
    t0 = time.monotonic()
    code = proc.stop(timeout=30)
    return code, time.monotonic() - t0


def test_master_with_a_slave_and_open_streams_stops_promptly_and_reopens_whole(tmp_path):
    subject = "stop.test"
    with master(tmp_path) as a, slave(tmp_path, a) as b:
        receipts = send_some(a.address, 2000, delay_ms=600_000)  # due in 10+ minutes: nothing in flight
        wait_caught_up(a.address, b.address)
        # open streams: two Subscribe streams (blocking client) and the slave's Pull stream
        clients = [a.client() for _ in range(2)]
        consumers = [c.subscribe(subject) for c in clients]
        ended = threading.Event()

        def consume(consumer) -> None:
            for _ in consumer:  # ends once the consumer is closed
                pass
            ended.set()

        threads = [threading.Thread(target=consume, args=(k,), daemon=True) for k in consumers]
        for t in threads:
            t.start()
        wait_until(
            lambda: sum(g["consumers"] for g in a.client().stats()["groups"] if g["subject"] == subject) == 2,
            15,
            "both Subscribe streams open",
            ignore=RPC_ERRORS,
        )
        st = status(a.address)
        end = st.end_offset  # the group's record included (the first Subscribe wrote it)
        assert st.slaves[0].connected

        code, took = timed_stop(a)
        assert code == 0, a.tail_log()
        assert took < STOP_BOUND_S, f"the master took {took:.1f}s to stop: {a.tail_log()}"
        assert "stopped" in a.tail_log()
        for k in consumers:
            k.close()
        for c in clients:
            c.close()
        # the slave saw its stream end (it waited on the ended stream, "connected", before)
        wait_until(lambda: not status(b.address).connected, 10, "the slave to see the master gone", ignore=RPC_ERRORS)

        # a clean close: the checkpoint is at the message log's end, the slave has all of it
        state = checkpoint.read(str(Path(a.data_dir) / "checkpoint" / "iterate.ckpt"))
        assert state is not None and state["offset"] == end
        code, took = timed_stop(b)
        assert code == 0 and took < STOP_BOUND_S, (took, b.tail_log())
        assert_same_message_log(a.data_dir, b.data_dir)

        # and it opens again with every acknowledged message pending, no recovery needed
        log_before = len(a.log_path.read_bytes())
        a.start()
        with a.client() as c:
            assert c.stats()["pending"] == len(receipts)
            assert {c.state_name(c.get(r)) for r in receipts[::97]} == {"PENDING"}
        restart_log = a.log_path.read_bytes()[log_before:].decode()
        assert " WARNING " not in restart_log and " ERROR " not in restart_log, restart_log


def test_a_role_change_after_the_engine_closed_is_refused(tmp_path):
    """set_role and close run one at a time (Engine._role_lock): a cluster agent's fence or a
    slave's re-attach still running on a worker thread when the server stopped changed the
    role of a closed engine (its scheduler stopped twice at once, the role file written into
    a folder the next process may hold)."""
    engine, _sink = started_engine(tmp_path / "data")
    engine.close(timeout=1.0)
    with pytest.raises(ShuttingDown):
        engine.set_role("fenced", engine.epoch + 1)
    assert engine.role == "master"


class _EndingMaster(rpb_grpc.ReplicationServicer):
    """A master that answers a Pull stream once and then ends it without an error."""

    def __init__(self) -> None:
        self.pulls = 0

    def Status(self, request, context):
        return rpb.ReplicationStatus(role="master", epoch=1)

    def Pull(self, request_iterator, context):
        next(request_iterator)  # the hello
        self.pulls += 1
        yield rpb.PullResponse(master_epoch=1)


def test_a_slave_whose_stream_the_master_ends_without_an_error_connects_again(tmp_path):
    """The end of a Pull stream without an error was read as no end at all (the inbox's end
    marker was None, also "nothing stopped the batch"): the slave sat on the finished stream,
    'connected', for ever. It now logs it and connects again."""
    fake = _EndingMaster()
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(4))
    rpb_grpc.add_ReplicationServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with slave(tmp_path, f"127.0.0.1:{port}") as b:
            wait_until(lambda: fake.pulls >= 2, 15, "the slave to pull again after the stream ended")
            assert "ended the stream" in b.tail_log()
    finally:
        server.stop(None)
