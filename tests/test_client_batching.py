"""The batching path behind send() (blocking client), against a real server process:
concurrent senders share SendStream batches, each gets its own receipt or its own error,
a restart mid-stream leaves every send answered or raised and none lost."""

from __future__ import annotations

import itertools
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
from conftest import wait_until
from serverproc import ServerProc

from qdelay import errors
from qdelay.client import Batching, Client, DeadlineExceeded, Receipt

_subjects = itertools.count(1)
HOUR_MS = 3_600_000


def subject() -> str:
    return f"cb{next(_subjects)}.{int(time.time() * 1000) % 100000}"


def test_concurrent_sends_share_batches_and_each_caller_gets_its_own_receipt(server):
    s = subject()
    with Client(server.address, batching=Batching(linger=0.001, max_in_flight=2)) as c:
        barrier = threading.Barrier(16)

        def one(i: int):
            if i < 16:
                barrier.wait()  # start together: they must share batches
            return i, c.send(s, b"p%d" % i, delay_ms=HOUR_MS, message_id=f"mine-{i}", headers={"i": str(i)})

        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(one, range(400)))
        for i, r in results:
            assert r.message_id == f"mine-{i}" and r.deliver_at_ms > 0
        assert len({r.sequence for _, r in results}) == 400
        assert c._batcher.batches < 400  # gathered: fewer batches than sends
        for i, r in results[::50]:
            st = c.get(r)
            assert st.state == "PENDING" and st.payload == b"p%d" % i and st.headers == {"i": str(i)}


def test_an_invalid_message_fails_only_its_caller(server):
    s = subject()
    with Client(server.address, batching=Batching(linger=0.005)) as c:
        barrier = threading.Barrier(24)

        def one(i: int):
            barrier.wait()
            bad = i in (5, 17)
            try:
                r = c.send("not a subject!" if bad else s, b"x", delay_ms=HOUR_MS if i != 9 else 10**15)
            except errors.InvalidArgument as err:
                return i, err
            return i, r

        with ThreadPoolExecutor(24) as pool:
            results = dict(pool.map(one, range(24)))
    failed = {i for i, r in results.items() if isinstance(r, Exception)}
    assert failed == {5, 9, 17}
    assert "subject" in str(results[5]) and "max_delay_ms=" in str(results[9])
    assert "2 years" in str(results[9])
    # each names the field of the caller's own message, not an index into a batch it never made
    assert str(results[5]).startswith("INVALID_ARGUMENT: message.subject: ")
    assert str(results[9]).startswith("INVALID_ARGUMENT: message.delay_ms: ")
    assert results[5].details.startswith("message.subject: ")
    assert len({r.sequence for i, r in results.items() if i not in failed}) == 21


def test_a_refused_send_names_its_field_as_the_unary_send_does_send_many_keeps_the_index(server):
    """send() batches behind the API; its refusal reads as unary Send's (``message.subject``),
    while send_many, whose batches the user made, names the index (``messages[0].subject``)."""
    with Client(server.address, batching=False) as unary:
        with pytest.raises(errors.InvalidArgument) as want:
            unary.send("no spaces", b"x")
    with Client(server.address) as c:
        with pytest.raises(errors.InvalidArgument) as got:
            c.send("no spaces", b"x")
        assert str(got.value) == str(want.value)
        assert str(got.value).startswith("INVALID_ARGUMENT: message.subject: character ' ' not allowed")
        assert got.value.details == want.value.details and got.value.code == want.value.code
        with pytest.raises(errors.InvalidArgument, match=r"^INVALID_ARGUMENT: messages\[0\]\.subject: "):
            c.send_many([c.message("no spaces", b"x")])


def test_a_refused_send_many_raises_the_servers_status_not_a_lost_one(server):
    """A batch refused mid-pipeline ends the SendStream while the client writes the next
    batch: grpc.aio then reports INTERNAL "Internal error from Core" instead of the
    server's status (9 of 60 such send_many calls did). send_many sends the unanswered
    again once, as SendBatcher does, and the refused batch is refused again with its own
    INVALID_ARGUMENT; the batches before it stay acknowledged."""
    from qdelay.client import Outgoing

    later = int(time.time() * 1000) + 3_600_000
    with Client(server.address) as c:
        for k in range(25):
            msgs = [Outgoing("lost", b"p", deliver_at_ms=later, message_id=f"lost{k}-{i}") for i in range(80)]
            msgs[50] = msgs[50]._replace(subject="")
            with pytest.raises(errors.InvalidArgument) as info:
                c.send_many(msgs, batch_size=10, max_in_flight=4)
            assert "messages[0].subject" in str(info.value) and len(info.value.receipts) == 50


def test_send_many_sends_again_what_a_stream_cut_with_cancelled_left_unanswered(tmp_path):
    """A server whose transport cuts a SendStream (a restart: seen once in 60) ends it with
    CANCELLED, batches read and unanswered: send_many raised CANCELLED where SendBatcher
    sends them again. Now it sends the unanswered again on a new stream (same ids: what
    was written is answered with its original receipt), and every message is stored once."""
    from ending_server import CANCEL_ID

    from qdelay.client import Outgoing

    later = int(time.time() * 1000) + 3_600_000
    with ServerProc(
        tmp_path / "data", command=[sys.executable, str(Path(__file__).with_name("ending_server.py"))]
    ) as srv:
        with Client(srv.address, retries=3, retry_backoff=0.01) as c:
            s = subject()
            msgs = [Outgoing(s, b"p", deliver_at_ms=later, message_id=f"cut-{i}") for i in range(200)]
            msgs[95] = msgs[95]._replace(message_id=CANCEL_ID + "00000001")
            receipts = c.send_many(msgs, batch_size=10, max_in_flight=4)
            assert [r.message_id for r in receipts] == [m.message_id for m in msgs]
            assert len({r.sequence for r in receipts}) == 200  # each written once
            again = c.send_many(msgs, batch_size=50)  # all durable: all duplicates, same receipts
            assert [r.sequence for r in again] == [r.sequence for r in receipts]
            assert c.get(message_id=CANCEL_ID + "00000001").state == "PENDING"


def test_a_refused_send_many_leaves_no_task_pending_on_the_io_loop(server):
    """A refused SendStream left its request generator waiting for credit the ended call
    never gave back, and grpc's task reading it pending for the loop's life: one per refused
    send_many ("Task was destroyed but it is pending!" by the dozen when the loop closed)."""
    import asyncio

    from qdelay.client import Outgoing

    async def tasks(_channel) -> list:
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    later = int(time.time() * 1000) + 3_600_000
    with Client(server.address, batching=False) as c:
        for k in range(3):
            msgs = [Outgoing("left", b"p", deliver_at_ms=later, message_id=f"left{k}-{i}") for i in range(40)]
            msgs[20] = msgs[20]._replace(subject="")
            with pytest.raises(errors.InvalidArgument):
                c.send_many(msgs, batch_size=5, max_in_flight=2)
        wait_until(lambda: not c._bulk.run(tasks), timeout=10, what="no task left on the I/O loop")


class _SourceBroke(Exception):
    pass


def _breaking_source(s: str, ids: str, later: int, n: int):
    """``n`` messages, then the caller's own error (a generator that fails mid-batch)."""
    from qdelay.client import Outgoing

    for i in range(n):
        yield Outgoing(s, b"p", deliver_at_ms=later, message_id=f"{ids}-{i}")
    raise _SourceBroke("the caller's source failed")


def test_send_many_raises_the_error_of_the_callers_iterator_with_the_receipts_before_it(server):
    """An error raised by send_many's messages iterator was swallowed: raised inside grpc.aio's
    request iterator, it cancelled the call (read as a stream cut), and send_many returned
    the receipts of the batches before it as if every message was sent (the 50 taken for the
    batch that broke were lost without a word). Now it is raised, in both clients, once the
    batches before it are answered, with their receipts; nothing after them is written."""
    import asyncio

    from qdelay.client.aio import Client as AioClient

    later = int(time.time() * 1000) + 3_600_000
    s = subject()
    with Client(server.address, retries=3) as c:
        with pytest.raises(_SourceBroke) as info:
            c.send_many(_breaking_source(s, "brk", later, 250), batch_size=100, max_in_flight=4)
        assert [r.message_id for r in info.value.receipts] == [f"brk-{i}" for i in range(200)]
        assert c.get(message_id="brk-199").state == "PENDING"
        assert c.get(message_id="brk-200").state == "NOT_FOUND"  # the broken batch was not sent

    async def aio() -> None:
        async with AioClient(server.address, retries=3) as ac:
            with pytest.raises(_SourceBroke) as info:
                await ac.send_many(_breaking_source(s, "abrk", later, 150), batch_size=100, max_in_flight=4)
            assert [r.message_id for r in info.value.receipts] == [f"abrk-{i}" for i in range(100)]

    asyncio.run(aio())


def test_batching_off_sends_one_call_per_message(server):
    with Client(server.address, batching=False) as c:
        r = c.send(subject(), b"x", delay_ms=HOUR_MS)
        assert r.message_id and c._batcher is None


def test_the_in_client_queue_is_bounded(server):
    s = subject()
    with Client(server.address, batching=Batching(max_queued=8, max_batch=4, max_in_flight=1)) as c:
        with ThreadPoolExecutor(32) as pool:
            receipts = list(pool.map(lambda i: c.send(s, b"x", delay_ms=HOUR_MS), range(300)))
        assert len({r.sequence for r in receipts}) == 300
        assert 0 < c._batcher.peak_queued <= 8


def test_a_caller_that_times_out_gets_deadline_exceeded_and_others_go_on(tmp_path):
    srv = ServerProc(tmp_path / "data").start()
    try:
        with Client(srv.address, retries=50, retry_backoff=0.05) as c:
            s = subject()
            assert c.send(s, b"warm", delay_ms=HOUR_MS).message_id
            srv.stop()
            with pytest.raises(DeadlineExceeded):
                c.send(s, b"lost?", delay_ms=HOUR_MS, timeout=0.3)
            srv.start()
            assert c.send(s, b"after", delay_ms=HOUR_MS, timeout=20).message_id
    finally:
        srv.kill9()


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_restart_mid_stream_every_send_answered_or_raised_none_lost(tmp_path, how):
    """Senders keep going while the server restarts: each send returns its receipt or raises;
    every receipt is found afterwards (nothing answered was lost) and each id was written
    once (the retries across the restart doubled nothing)."""
    srv = ServerProc(tmp_path / "data").start()
    s = subject()
    results: dict[int, object] = {}
    stop = threading.Event()
    counter = itertools.count()
    try:
        with Client(srv.address, retries=30, retry_backoff=0.05, timeout=60) as c:

            def sender():
                while not stop.is_set():
                    i = next(counter)
                    try:
                        results[i] = c.send(s, b"%d" % i, delay_ms=HOUR_MS, message_id=f"r-{i}")
                    except errors.QdelayError as err:
                        results[i] = err

            threads = [threading.Thread(target=sender) for _ in range(8)]
            for t in threads:
                t.start()
            wait_until(lambda: len(results) >= 300, timeout=30, what="300 answers before the restart")
            if how == "sigterm":
                srv.stop()
            else:
                srv.kill9()
            srv.start()
            seen = len(results)
            wait_until(lambda: len(results) >= seen + 300, timeout=30, what="300 answers after the restart")
            stop.set()
            for t in threads:
                t.join(60)
            assert not any(t.is_alive() for t in threads)
            sent = next(counter)
            assert sorted(results) == list(range(sent))  # every send answered or raised
            receipts = {i: r for i, r in results.items() if not isinstance(r, Exception)}
            assert len(receipts) >= sent - 8  # retries bridged the restart for nearly all
            for i, r in receipts.items():
                assert r.message_id == f"r-{i}"
            states = {c.get(r).state for r in receipts.values()}
            assert states == {"PENDING"}  # none lost
            # none doubled: the server holds one message per id that landed (a raised send
            # may have landed too), so a retry written twice would show as one pending too many
            landed = len(receipts) + sum(
                c.get(message_id=f"r-{i}").state == "PENDING" for i, r in results.items() if isinstance(r, Exception)
            )
            wait_until(lambda: c.stats()["iterate_lag_bytes"] == 0, what="every message in the schedule")
            assert c.stats()["pending"] == landed
            assert len({r.sequence for r in receipts.values()}) == len(receipts)
    finally:
        stop.set()
        srv.kill9()


def test_a_re_sent_id_is_not_doubled(server):
    """What the batcher's retry relies on: the same message id sent again (as a re-sent batch
    does) is answered with the original receipt and delivered once."""
    s = subject()
    with Client(server.address) as c:
        first = c.send(s, b"once", delay_ms=0, message_id="again-1")
        second = c.send(s, b"once", delay_ms=0, message_id="again-1")
        assert second == first and second.duplicate
        with c.subscribe(s) as consumer:
            got = consumer.receive(2, timeout=3)
            consumer.ack(got)
        assert [d.message_id for d in got] == ["again-1"]


def test_cancel_and_get_take_the_receipt_its_string_or_the_protobuf(server):
    with Client(server.address) as c:
        r = c.send(subject(), b"keep me", delay=timedelta(hours=1))
        text = str(r)
        assert c.get(text).payload == b"keep me"  # as kept in a database row
        assert c.get(r.to_pb()).state == "PENDING" and c.get(Receipt.parse(text)) == c.get(r)
        assert c.cancel(text) == "CANCELLED" and c.get(r).state == "CANCELLED"


def test_cancel_and_get_by_the_id_alone(server):
    with Client(server.address) as c:
        c.send(subject(), b"keep me", delay=timedelta(hours=1), message_id="by-id-blocking-1")
        st = c.get("by-id-blocking-1")
        assert st.state == "PENDING" and st.payload == b"keep me"
        assert c.cancel(message_id="by-id-blocking-1") == "CANCELLED"


def test_threads_sending_in_a_loop_ride_one_batch_a_round(server):
    """Natural batching: 16 threads each sending in a loop come back from their receipts at
    about the same time; the batch waits for them (at most a linger after the answer) instead
    of going with the first few and leaving the rest to a second one, so a round is one
    batch. (The earlier policy, a fixed linger only while a batch was unanswered, made two
    batches a round: the first arrivals, then the rest.)"""
    s = subject()
    rounds = 60
    with Client(server.address, batching=Batching(linger=0.2)) as c:
        c.send(s, b"warm", delay_ms=HOUR_MS)
        barrier = threading.Barrier(16)

        def loop(t: int) -> list[Receipt]:
            barrier.wait()
            return [c.send(s, b"%d" % t, delay_ms=HOUR_MS, message_id=f"l{t}-{k}") for k in range(rounds)]

        before = c._batcher.batches
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(loop, range(16)))
        batches = c._batcher.batches - before
    for t, receipts in enumerate(results):
        assert [r.message_id for r in receipts] == [f"l{t}-{k}" for k in range(rounds)]
    assert len({r.sequence for receipts in results for r in receipts}) == 16 * rounds
    # a round is one batch once the threads are in step (~5 batches more in all on a quiet
    # box, the first rounds splitting), but a thread that waits for a core misses its round
    # and splits it: 102 at load 7 with other suites running (26 Nov), 73 at load 30. Sent
    # one by one it would be 960; the bound tells gathered rounds from that on any box, and
    # the rate this buys is bench.shapes' threads16 figure (docs/benchmarks.md)
    assert batches <= 2 * rounds, batches


def test_a_lone_sender_never_waits_for_the_linger(server):
    """One thread sending one message after another: each finds the stream idle, or only its
    own last batch answered, and goes at once (a linger of 0.5 s would cost 0.5 s a send)."""
    s = subject()
    with Client(server.address, batching=Batching(linger=0.5)) as c:
        c.send(s, b"warm", delay_ms=HOUR_MS)
        start = time.monotonic()
        for k in range(20):
            c.send(s, b"%d" % k, delay_ms=HOUR_MS)
        assert time.monotonic() - start < 5.0  # 20 lingers would be 10 s


def test_the_blocking_clients_unary_retries_wait_at_most_max_backoff(monkeypatch):
    """A unary call retried after UNAVAILABLE waits backoff * 2^(attempt-1) between tries,
    at most MAX_BACKOFF, as the asyncio client's and the batchers' retries: the blocking
    client's was not capped, so retries=12 slept 204.8 s before its last try."""
    import grpc

    from qdelay.client import client as client_mod
    from qdelay.client.batching import MAX_BACKOFF

    class _Down(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.UNAVAILABLE

        def details(self) -> str:
            return "connection refused"

    def down(_request, timeout=None, metadata=None):
        raise _Down()

    slept: list[float] = []
    monkeypatch.setattr(client_mod.time, "sleep", slept.append)
    c = Client("127.0.0.1:1", retries=12, retry_backoff=0.1)
    try:
        with pytest.raises(errors.Unavailable):
            c._call(down, None, 1)
    finally:
        c.close()
    assert len(slept) == 12 and slept[:3] == [0.1, 0.2, 0.4] and max(slept) == MAX_BACKOFF, slept


def test_retry_wait_stays_at_max_backoff_however_long_the_outage():
    """The attempt count of a consumer's resubscription grows for as long as the server is
    away (or, waiting for its group, a slave refuses): backoff * 2 ** (attempt - 1) overflowed
    a float at attempt 1025, about 34 minutes of 2 s waits, and the consumer's reader died of
    the OverflowError (outside the exception tree); every later try waits MAX_BACKOFF."""
    from qdelay.client.batching import MAX_BACKOFF, retry_wait

    assert [retry_wait(0.1, a) for a in (1, 2, 3)] == [0.1, 0.2, 0.4]
    assert [retry_wait(0.1, a) for a in (30, 1024, 1025, 10**6)] == [MAX_BACKOFF] * 4
    assert retry_wait(0.0, 10**6) == 0.0
