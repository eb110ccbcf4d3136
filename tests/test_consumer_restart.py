"""Consumers that survive the server (real process): after a SIGTERM restart and after a
SIGKILL restart, the same consumer object keeps receiving — a message sent after the
restart is consumed — for the blocking and the asyncio client; it ends only when closed."""

from __future__ import annotations

import asyncio
import itertools
import sys
import threading
import time
from pathlib import Path

import pytest
from serverproc import ServerProc

from qdelay import aio
from qdelay.client import Client, batching

_subjects = itertools.count(1)


def subject() -> str:
    return f"cr{next(_subjects)}.{int(time.time() * 1000) % 100000}"


def restart(srv: ServerProc, how: str) -> None:
    if how == "sigterm":
        assert srv.stop() == 0
    else:
        srv.kill9()
    srv.start()


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_blocking_consumer_keeps_receiving_across_a_restart(tmp_path, how):
    srv = ServerProc(tmp_path / "data").start()
    try:
        with Client(srv.address, retries=20, retry_backoff=0.05, timeout=30) as c:
            s = subject()
            consumer = c.subscribe(s, group="g1", max_in_flight=50)
            before = c.send(s, b"before")
            got = consumer.receive(1, timeout=10)
            assert [d.message_id for d in got] == [before.message_id]
            consumer.ack(got)
            restart(srv, how)
            after = c.send(s, b"after")
            deadline = time.monotonic() + 30
            seen: list = []
            while after.message_id not in {d.message_id for d in seen} and time.monotonic() < deadline:
                batch = consumer.receive(1, timeout=1)
                consumer.ack(batch)
                seen.extend(batch)
            assert after.message_id in {d.message_id for d in seen}
            assert consumer.reconnects >= 1
            assert (consumer.subject, consumer.group, consumer.max_in_flight) == (s, "g1", 50)
            # it ends only when the user closes it
            ended = threading.Event()
            t = threading.Thread(target=lambda: (list(consumer.batches()), ended.set()), daemon=True)
            t.start()
            assert not ended.wait(0.3)
            consumer.close()
            assert ended.wait(10)
    finally:
        srv.kill9()


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_asyncio_consumer_keeps_receiving_across_a_restart(tmp_path, how):
    srv = ServerProc(tmp_path / "data").start()

    async def main():
        async with aio.Client(srv.address, retries=20, retry_backoff=0.05, timeout=30) as c:
            s = subject()
            async with c.subscribe(s, group="g2", max_in_flight=40) as consumer:
                before = await c.send(s, b"before")
                got = await consumer.receive(1, timeout=10)
                assert [d.message_id for d in got] == [before.message_id]
                consumer.ack(got)
                await asyncio.to_thread(restart, srv, how)
                after = await c.send(s, b"after")
                seen: list = []
                deadline = time.monotonic() + 30
                while after.message_id not in {d.message_id for d in seen} and time.monotonic() < deadline:
                    batch = await consumer.receive(1, timeout=1)
                    consumer.ack(batch)
                    seen.extend(batch)
                assert after.message_id in {d.message_id for d in seen}
                assert consumer.reconnects >= 1 and consumer.max_in_flight == 40
                reader = asyncio.create_task(consumer.receive(10**6, timeout=60))
                await asyncio.sleep(0.3)
                assert not reader.done()  # still reading: it ends only on close
            assert await asyncio.wait_for(reader, 10) == []

    try:
        asyncio.run(asyncio.wait_for(main(), 90))
    finally:
        srv.kill9()


# A consumer whose stream broke waits out its backoff (doubling, at most MAX_BACKOFF) between
# tries, but a restarted server is tried again as soon as the channel has connected to it: the
# backoff paces tries against a server that answers and refuses, not the wait for one that was
# away. Made long here (a minute) so that only the reconnection can bring the consumer back
# within the test's bound; before, it waited its backoff whatever the channel did (with the
# default 2 s cap and grpc's own reconnect backoff, a restart cost consumers up to ~2-4 s past
# the server's start, more than the start itself on a quiet machine).
LONG_BACKOFF = 60.0
BACK_WITHIN = 20.0


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_blocking_consumer_subscribes_again_once_the_server_is_back_not_after_its_backoff(tmp_path, how, monkeypatch):
    monkeypatch.setattr(batching, "MAX_BACKOFF", 10 * LONG_BACKOFF)
    srv = ServerProc(tmp_path / "data").start()
    try:
        with Client(srv.address, retries=20, retry_backoff=0.05, timeout=30) as sender:
            c = Client(srv.address, retry_backoff=LONG_BACKOFF, timeout=30)
            s = subject()
            consumer = c.subscribe(s, group="g1", max_in_flight=50)
            before = sender.send(s, b"before")
            got = consumer.receive(1, timeout=10)
            assert [d.message_id for d in got] == [before.message_id]
            consumer.ack(got)
            restart(srv, how)
            after = sender.send(s, b"after")
            deadline = time.monotonic() + BACK_WITHIN
            seen: set[str] = set()
            while after.message_id not in seen and time.monotonic() < deadline:
                batch = consumer.receive(1, timeout=0.5)
                consumer.ack(batch)
                seen.update(d.message_id for d in batch)
            assert after.message_id in seen, f"the consumer was not back within {BACK_WITHIN} s"
            assert consumer.reconnects >= 1
            consumer.close()
            c.close()
    finally:
        srv.kill9()


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_asyncio_consumer_subscribes_again_once_the_server_is_back_not_after_its_backoff(tmp_path, how, monkeypatch):
    monkeypatch.setattr(batching, "MAX_BACKOFF", 10 * LONG_BACKOFF)
    srv = ServerProc(tmp_path / "data").start()

    async def main():
        async with (
            aio.Client(srv.address, retries=20, retry_backoff=0.05, timeout=30) as sender,
            aio.Client(srv.address, retry_backoff=LONG_BACKOFF, timeout=30) as c,
        ):
            s = subject()
            async with c.subscribe(s, group="g2", max_in_flight=40) as consumer:
                before = await sender.send(s, b"before")
                got = await consumer.receive(1, timeout=10)
                assert [d.message_id for d in got] == [before.message_id]
                consumer.ack(got)
                await asyncio.to_thread(restart, srv, how)
                after = await sender.send(s, b"after")
                seen: set[str] = set()
                deadline = time.monotonic() + BACK_WITHIN
                while after.message_id not in seen and time.monotonic() < deadline:
                    batch = await consumer.receive(1, timeout=0.5)
                    consumer.ack(batch)
                    seen.update(d.message_id for d in batch)
                assert after.message_id in seen, f"the consumer was not back within {BACK_WITHIN} s"
                assert consumer.reconnects >= 1

    try:
        asyncio.run(asyncio.wait_for(main(), 90))
    finally:
        srv.kill9()


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_a_delivery_in_flight_at_a_restart_comes_again_at_once_not_after_the_ack_timeout(tmp_path, how):
    """docs/recovery.md "Deliveries in flight at a stop or a crash": the ack ledger lives in
    memory, so after a restart a delivery that was handed out and not acknowledged (its
    consumer still holding it, or gone) is loaded again with its bucket and handed out as
    soon as a consumer subscribes, with attempt 1, whatever the ack timeout (10 min here)."""
    srv = ServerProc(tmp_path / "data", args=["--set", "engine.ack_timeout_ms=600000"]).start()
    try:
        with Client(srv.address, retries=20, retry_backoff=0.05, timeout=30) as c:
            s = subject()
            consumer = c.subscribe(s, group="g1", max_in_flight=50)
            sent = c.send(s, b"held")
            got = consumer.receive(1, timeout=10)
            assert [(d.message_id, d.attempt) for d in got] == [(sent.message_id, 1)]
            restart(srv, how)  # never acknowledged
            deadline = time.monotonic() + BACK_WITHIN
            again: list = []
            while not again and time.monotonic() < deadline:
                again = [d for d in consumer.receive(1, timeout=0.5) if d.message_id == sent.message_id]
            assert again, f"not delivered again within {BACK_WITHIN} s of the restart"
            # handed out again by the new process (the same ack id: the sequence and the attempt)
            assert again[0].attempt == 1 and again[0].dispatched_at_ms > got[0].dispatched_at_ms
            consumer.ack(again)
            consumer.close()
    finally:
        srv.kill9()


def test_a_batch_that_finds_its_group_without_subscribers_is_offered_again_at_once(tmp_path):
    """A dispatch round takes a group's credit, then hands its batch to the registry; a
    stream that ended in between (a consumer closed, a connection lost) leaves the batch to
    nobody. It is in flight in the ack ledger all the same: it used to wait for the ack
    timeout (10 min here, 30 s by default) before anyone could have it; it is released at
    once now, so the next consumer of the group gets it (attempt 2, as a stream's leftovers)."""
    mark = tmp_path / "paused"
    due = int(time.time() * 1000) + 1500
    srv = ServerProc(
        tmp_path / "data",
        args=["--set", "engine.ack_timeout_ms=600000"],
        command=[sys.executable, str(Path(__file__).with_name("dropping_server.py"))],
        env={"QDELAY_TEST_DROP_DUE_MS": str(due), "QDELAY_TEST_DROP_MARK": str(mark)},
    ).start()
    try:
        with Client(srv.address, retries=20, retry_backoff=0.05, timeout=30) as c:
            s = subject()
            first = c.subscribe(s, group="g1", max_in_flight=50)
            sent = c.send(s, b"dropped", deliver_at_ms=due)
            deadline = time.monotonic() + BACK_WITHIN
            while not mark.exists() and time.monotonic() < deadline:
                first.receive(1, timeout=0.2)  # nothing comes: the batch is paused
            assert mark.exists(), "the round holding the message never came"
            first.close()  # its stream ends while the round holds the batch
            done = tmp_path / "paused.done"
            deadline = time.monotonic() + BACK_WITHIN
            while not done.exists() and time.monotonic() < deadline:
                time.sleep(0.02)  # polls a file the server writes (no event to wait on across processes)
            assert done.exists(), "the paused batch did not go on once the group had no subscriber"
            second = c.subscribe(s, group="g1", max_in_flight=50)
            got: list = []
            deadline = time.monotonic() + BACK_WITHIN
            while not got and time.monotonic() < deadline:
                got = [d for d in second.receive(1, timeout=0.5) if d.message_id == sent.message_id]
            assert got, f"not offered again within {BACK_WITHIN} s (it waited for the ack timeout)"
            assert got[0].attempt == 2
            second.ack(got)
            second.close()
    finally:
        srv.kill9()
