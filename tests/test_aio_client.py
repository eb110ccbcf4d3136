"""qdelay.aio.Client end to end against a real server process: every method, typed
results, subscribe/ack, concurrent sends through the batching path, a task cancelled
mid-send."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time
from datetime import timedelta

import pytest
from conftest import wait_until
from serverproc import ServerProc

from qdelay import errors
from qdelay.aio import Batching, Client, Delivery, Outgoing, Receipt, Status

_subjects = itertools.count(1)
HOUR_MS = 3_600_000


def subject() -> str:
    return f"aio{next(_subjects)}.{int(time.time() * 1000) % 100000}"


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def until(cond, what: str, timeout: float = 10.0) -> None:
    """``conftest.wait_until`` for a coroutine: polls ``cond`` without blocking the loop."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.01)


async def pending(c: Client, n: int, tag: str) -> list[Receipt]:
    at = int(time.time() * 1000) + HOUR_MS
    return list(
        await c.send_many(
            [Outgoing("aio.cancel", b"p", deliver_at_ms=at + i, message_id=f"{tag}{i}") for i in range(n)]
        )
    )


def test_send_get_cancel_stats_with_typed_results(server):
    async def main():
        async with Client(server.address) as c:
            s = subject()
            r = await c.send(s, b"order 42", delay=timedelta(hours=1), headers={"order": "42"})
            assert isinstance(r, Receipt) and r.deliver_at_ms > time.time() * 1000 + HOUR_MS - 60_000
            st = await c.get(str(r))  # the string form, as kept in a database row
            assert isinstance(st, Status) and st.state == "PENDING" and st.payload == b"order 42"
            assert st.headers == {"order": "42"} and c.state_name(st) == "PENDING"
            assert await c.cancel(Receipt.parse(str(r))) == "CANCELLED"
            assert await c.cancel(r.to_pb()) == "ALREADY_CANCELLED"
            assert (await c.get(r)).state == "CANCELLED"
            batch = await c.send_batch([c.message(s, b"b%d" % i, delay_ms=HOUR_MS) for i in range(3)])
            assert [type(x) for x in batch] == [Receipt] * 3
            many = await c.send_many((Outgoing(s, b"m%d" % i, delay_ms=HOUR_MS) for i in range(250)), batch_size=60)
            assert len(many) == 250 and len({x.sequence for x in many}) == 250
            assert (await c.get(many[249])).payload == b"m249"
            stats = await c.stats()
            assert stats["role"] == "master" and stats["pending"] >= 253
            assert await c.health() == "SERVING"
            with pytest.raises(errors.InvalidArgument, match=r"2 years \(max_delay_ms=63072000000\)"):
                await c.send(s, b"", delay=timedelta(days=3 * 365))

    run(main())


def test_subscribe_receive_and_ack(server):
    async def main():
        async with Client(server.address) as c:
            s = subject()
            sent = [await c.send(s, b"d%d" % i, headers={"i": str(i)}) for i in range(5)]
            async with c.subscribe(s, group="g1", max_in_flight=100) as consumer:
                got = []
                async for batch in consumer.batches():
                    got.extend(batch)
                    consumer.ack(batch)  # a batch of typed deliveries acks as one request
                    if len(got) >= 5:
                        break
            assert sorted(d.message_id for d in got) == sorted(r.message_id for r in sent)
            # typed results, not protobuf: the same fields, and the group delivered to
            assert all(type(d) is Delivery for d in got)
            by_id = {r.message_id: (i, r) for i, r in enumerate(sent)}
            for d in got:
                i, r = by_id[d.message_id]
                assert (d.subject, d.payload, d.headers, d.group, d.attempt) == (s, b"d%d" % i, {"i": str(i)}, "g1", 1)
                assert d.deliver_at_ms == r.deliver_at_ms <= d.dispatched_at_ms and d.ack_id
            return sent

    sent = run(main())
    with server.client() as c:  # the acks are applied shortly after they were sent
        wait_until(lambda: all(c.get(r).state == "DELIVERED" for r in sent), what="every ack applied")


def test_concurrent_tasks_share_batches_each_gets_its_own_receipt(server):
    async def main():
        async with Client(server.address) as c:
            s = subject()

            valid = await asyncio.gather(*(c.send(s, b"v", delay_ms=HOUR_MS, message_id=f"v-{i}") for i in range(64)))
            assert [r.message_id for r in valid] == [f"v-{i}" for i in range(64)]
            assert c._batcher.batches < 64  # gathered

            async def one(i):
                bad = i == 33
                try:
                    return await c.send("bad subject" if bad else s, b"%d" % i, delay_ms=HOUR_MS, message_id=f"t-{i}")
                except errors.InvalidArgument as err:
                    return err

            results = await asyncio.gather(*(one(i) for i in range(64)))
            assert isinstance(results[33], errors.InvalidArgument)
            # the field of the task's own message, as unary Send names it: not messages[0]
            assert str(results[33]).startswith("INVALID_ARGUMENT: message.subject: ")
            assert results[33].details.startswith("message.subject: ")
            with pytest.raises(errors.InvalidArgument, match=r"^INVALID_ARGUMENT: messages\[0\]\.subject: "):
                await c.send_many([c.message("bad subject", b"x")])  # the user's batch: its index
            for i, r in enumerate(results):
                if i != 33:
                    assert r.message_id == f"t-{i}"

    run(main())


def test_tasks_sending_in_a_loop_ride_one_batch_a_round(server):
    """Natural batching with tasks: 64 tasks each awaiting send() in a loop share one batch a
    round (the batch waits, at most a linger after the answer, for the callers it answered)."""

    async def main():
        rounds = 20
        async with Client(server.address, batching=Batching(linger=0.2)) as c:
            s = subject()
            await c.send(s, b"warm", delay_ms=HOUR_MS)
            before = c._batcher.batches

            async def loop(t):
                return [await c.send(s, b"%d" % t, delay_ms=HOUR_MS, message_id=f"a{t}-{k}") for k in range(rounds)]

            results = await asyncio.gather(*(loop(t) for t in range(64)))
            batches = c._batcher.batches - before
        for t, receipts in enumerate(results):
            assert [r.message_id for r in receipts] == [f"a{t}-{k}" for k in range(rounds)]
        assert batches <= rounds + 8, batches

    run(main())


def test_a_task_cancelled_mid_send_leaves_the_client_working(server):
    async def main():
        async with Client(server.address, batching=Batching(max_in_flight=1, max_batch=8, linger=0.01)) as c:
            s = subject()
            tasks = [asyncio.create_task(c.send(s, b"%d" % i, delay_ms=HOUR_MS)) for i in range(40)]
            await asyncio.sleep(0)
            for t in tasks[10:30]:
                t.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            cancelled = [r for r in results if isinstance(r, asyncio.CancelledError)]
            receipts = [r for r in results if isinstance(r, Receipt)]
            assert len(cancelled) + len(receipts) == 40 and len(receipts) >= 20
            after = await c.send(s, b"after", delay_ms=HOUR_MS)
            assert (await c.get(after)).payload == b"after"
            assert c._batcher.peak_queued <= c.batching.max_queued

    run(main())


def test_batching_off_is_one_unary_call_per_send(server):
    async def main():
        async with Client(server.address, batching=False) as c:
            r = await c.send(subject(), b"x", delay_ms=HOUR_MS)
            assert isinstance(r, Receipt) and c._batcher is None

    run(main())


def test_cancel_and_get_by_id_alone(server):
    async def main():
        async with Client(server.address) as c:
            r = await c.send(subject(), b"x", delay_ms=HOUR_MS, message_id="by-id-aio-1")
            st = await c.get("by-id-aio-1")
            assert st.state == "PENDING" and st.message_id == r.message_id
            outcome, moved = await c.reschedule(message_id="by-id-aio-1", delay_ms=2 * HOUR_MS)
            assert outcome == "RESCHEDULED" and moved is not None and moved.deliver_at_ms > r.deliver_at_ms
            assert await c.cancel(message_id="by-id-aio-1") == "CANCELLED"

    run(main())


def test_a_send_that_times_out_raises_deadline_exceeded_and_the_client_goes_on(tmp_path):
    from qdelay.client import DeadlineExceeded

    srv = ServerProc(tmp_path / "data").start()

    async def main():
        async with Client(srv.address, retries=50, retry_backoff=0.05) as c:
            s = subject()
            assert (await c.send(s, b"warm", delay_ms=HOUR_MS)).message_id
            await asyncio.to_thread(srv.stop)
            started = time.monotonic()
            with pytest.raises(DeadlineExceeded):
                await c.send(s, b"lost?", delay_ms=HOUR_MS, timeout=0.3)
            assert time.monotonic() - started < 5
            await asyncio.to_thread(srv.start)
            assert (await c.send(s, b"after", delay_ms=HOUR_MS, timeout=20)).message_id

    try:
        run(main())
    finally:
        srv.kill9()


def test_restart_mid_stream_every_send_answered_or_raised_none_lost(tmp_path):
    """64 tasks keep sending while the server is SIGKILLed and restarted: each send returns its
    own receipt or raises; every receipt is found afterwards, and each id was written once."""
    srv = ServerProc(tmp_path / "data").start()
    s = subject()

    async def main():
        results: dict[int, object] = {}
        counter = itertools.count()
        stop = asyncio.Event()
        async with Client(srv.address, retries=30, retry_backoff=0.05, timeout=60) as c:

            async def sender():
                while not stop.is_set():
                    i = next(counter)
                    try:
                        results[i] = await c.send(s, b"%d" % i, delay_ms=HOUR_MS, message_id=f"a-{i}")
                    except errors.QdelayError as err:
                        results[i] = err

            tasks = [asyncio.create_task(sender()) for _ in range(64)]
            while len(results) < 2000:
                await asyncio.sleep(0.01)
            await asyncio.to_thread(srv.kill9)
            await asyncio.to_thread(srv.start)
            seen = len(results)
            while len(results) < seen + 2000:
                await asyncio.sleep(0.01)
            stop.set()
            await asyncio.gather(*tasks)
            sent = next(counter)
            assert sorted(results) == list(range(sent))  # every send answered or raised
            receipts = {i: r for i, r in results.items() if isinstance(r, Receipt)}
            assert len(receipts) >= sent - 64
            assert all(r.message_id == f"a-{i}" for i, r in receipts.items())
            rs = list(receipts.values())
            for k in range(0, len(rs), 256):  # none lost: every answered send is there
                states = await asyncio.gather(*(c.get(r) for r in rs[k : k + 256]))
                assert {st.state for st in states} == {"PENDING"}
            # none doubled: one pending message per id that landed (a raised send may have
            # landed too); a retry written twice would be one pending message too many
            failed = [i for i, r in results.items() if not isinstance(r, Receipt)]
            found = await asyncio.gather(*(c.get(message_id=f"a-{i}") for i in failed))
            landed = len(receipts) + sum(st.state == "PENDING" for st in found)
            while (await c.stats())["iterate_lag_bytes"]:
                await asyncio.sleep(0.05)
            assert (await c.stats())["pending"] == landed
            assert len({r.sequence for r in receipts.values()}) == len(receipts)

    try:
        asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        srv.kill9()


def test_concurrent_cancel_tasks_share_calls_each_gets_its_own_outcome(server):
    async def main():
        async with Client(server.address) as c:
            receipts = await pending(c, 400, "share")
            targets = receipts + receipts[:50]  # 50 named twice: CANCELLED once, ALREADY_CANCELLED once
            out = await asyncio.gather(*(c.cancel(r) for r in targets))
            by_seq: dict[int, list[str]] = {}
            for r, outcome in zip(targets, out):
                by_seq.setdefault(r.sequence, []).append(outcome)
            assert all(
                sorted(v) == (["ALREADY_CANCELLED", "CANCELLED"] if len(v) == 2 else ["CANCELLED"])
                for v in by_seq.values()
            )
            batcher = c._canceller
            assert batcher is not None and batcher.carried == len(targets)
            assert batcher.batches < len(targets) / 10  # gathered
            assert {(await c.get(r)).state for r in receipts[::40]} == {"CANCELLED"}

    run(main())


def test_a_bad_target_among_valid_ones_fails_only_its_task_and_batching_off_is_unary(server):
    from qdelay.v1 import qdelay_pb2 as pb

    async def main():
        async with Client(server.address) as c:
            receipts = await pending(c, 30, "bad")
            bad = pb.Receipt(message_id="caf\u00e9", deliver_at_ms=1, sequence=1)
            targets = receipts[:15] + [bad] + receipts[15:]
            out = await asyncio.gather(*(c.cancel(t) for t in targets), return_exceptions=True)
            assert isinstance(out[15], errors.InvalidArgument) and "message_id" in str(out[15])
            assert [o for i, o in enumerate(out) if i != 15] == ["CANCELLED"] * 30
            assert c._canceller is not None and c._canceller.calls >= 1  # they went as one call first
        async with Client(server.address, batching=False) as c:
            assert await c.cancel(receipts[0]) == "ALREADY_CANCELLED"
            assert c._canceller is None

    run(main())


def test_tasks_cancelled_mid_call_and_while_queued_and_a_short_timeout(server):
    """The server is stopped (SIGSTOP) so that calls stay unanswered: two calls are under way
    (the batcher's limit) and five more targets wait. A task cancelled while its call is under
    way gets CancelledError and the call goes on for the others (its target is cancelled,
    unknown to it); one cancelled while queued is left out (its target stays pending); a
    task with a short timeout gets DEADLINE_EXCEEDED by its own timeout."""
    from qdelay.client import DeadlineExceeded

    async def main():
        async with Client(server.address) as c:
            receipts = await pending(c, 16, "mid")
            assert await c.cancel(receipts[15]) == "CANCELLED"  # the batcher exists
            batcher = c._canceller
            assert batcher is not None
            os.kill(server.pid, signal.SIGSTOP)
            try:
                first = [asyncio.create_task(c.cancel(r)) for r in receipts[0:5]]
                first.append(asyncio.create_task(c.cancel(receipts[5], timeout=1.0)))  # same call
                started = time.monotonic()
                await until(lambda: batcher.carried == 7, "the first call under way")
                second = [asyncio.create_task(c.cancel(r)) for r in receipts[6:10]]
                await until(lambda: batcher.carried == 11, "the second call under way")
                queued = [asyncio.create_task(c.cancel(r)) for r in receipts[10:15]]
                await until(lambda: len(batcher._queue) == 5, "five targets queued")
                for t in (first[0], second[0], queued[0], queued[1]):
                    t.cancel()
                with pytest.raises(DeadlineExceeded):
                    await first[5]
                assert time.monotonic() - started < 1.0 + 1.5
            finally:
                os.kill(server.pid, signal.SIGCONT)
            out = await asyncio.gather(*first[:5], *second, *queued, return_exceptions=True)
            cancelled = [i for i, o in enumerate(out) if isinstance(o, asyncio.CancelledError)]
            assert cancelled == [0, 5, 9, 10]
            assert [o for i, o in enumerate(out) if i not in cancelled] == ["CANCELLED"] * 10
            states = [(await c.get(r)).state for r in receipts[:15]]
            # the calls went on for the others: 0, 5 (timed out) and 6 were cancelled all the same
            assert states == ["CANCELLED"] * 10 + ["PENDING"] * 2 + ["CANCELLED"] * 3
            assert batcher.carried == 14 and batcher._under_way == 0
            assert await c.cancel(receipts[10]) == "CANCELLED"  # the client goes on

    run(main())


def test_a_consumer_dropped_without_close_ends_its_stream_and_task(server):
    """A consumer the user drops without close() (and its stream open, deliveries in its
    hands) is freed by the collector, and its stream ends, so the server gives what it held
    to the group's other consumers at once: the client kept every unclosed consumer in a
    strong set until close(), and the reader task kept it too, its stream open and its
    deliveries held for ever. A never-started one is freed as well."""
    import gc
    import weakref

    async def main():
        async with Client(server.address) as c:
            s = subject()
            sent = [await c.send(s, b"x") for _ in range(3)]
            dropped = c.subscribe(s, group="g", max_in_flight=10)
            held = await dropped.receive(3, 10)  # its stream open, the messages in its hands
            assert sorted(d.message_id for d in held) == sorted(r.message_id for r in sent)
            unstarted = weakref.ref(c.subscribe(s, group="g"))
            gone = weakref.ref(dropped)
            del dropped, held
            gc.collect()
            assert gone() is None and unstarted() is None
            await until(lambda: not [t for t in asyncio.all_tasks() if t.get_name() == "qdelay-consumer"], "reader")
            async with c.subscribe(s, group="g", max_in_flight=10) as other:  # given at once, not after the ack timeout
                again = await other.receive(3, 10)
                assert sorted(d.message_id for d in again) == sorted(r.message_id for r in sent)
                assert all(d.attempt == 2 for d in again)
                other.ack(again)

    run(main())
