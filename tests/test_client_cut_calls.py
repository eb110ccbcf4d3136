"""Calls cut at a server restart are tried again, not raised: found by a chaos soak of both
clients against a server SIGKILLed/SIGTERMed every few seconds. A unary call (CancelBatch:
``cancel_many``) that a stopping server cancelled at its deadline raised CANCELLED; a
send_many whose SendStream grpc.aio cancelled itself (its half-close failed on the broken
connection) raised "the client was closed during the call" (blocking) or CancelledError
(asyncio); and send()'s batcher and send_many counted "retries in a row" across
streams that had answered batches before they broke, so callers failed after retries + 1
restarts however long the server served between them. Real server processes
(tests/ending_server.py answers a marked CancelBatch with CANCELLED after doing it, and
cuts a SendStream after answering a batch with a marked message).

And a stream grpc.aio cancelled itself (its writing task failed) ended the task reading it
cancelled, which nobody had asked for: the CancelStream's reader, send()'s sender and the
asyncio consumer's reader, whose close() then raised CancelledError; and a channel closed
under the asyncio client other than by close() gave grpc's UsageError, a wait until the
caller's timeout, or a consumer's iteration ended as if closed, instead of
FailedPrecondition. These run on a loop in debug mode with warnings as errors."""

from __future__ import annotations

import asyncio
import gc
import itertools
import sys
import threading
import time
import warnings
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import grpc.aio._call as aio_call
import pytest
from ending_server import CANCELLED_CALL_ID
from grpc._cython import cygrpc
from serverproc import ServerProc

from qdelay import aio, errors
from qdelay.client import Batching, Client, Outgoing

ENDING = [sys.executable, str(Path(__file__).with_name("ending_server.py"))]
_subjects = itertools.count(1)
_ids = itertools.count(1)


def subject() -> str:
    return f"cut{next(_subjects)}.{int(time.time() * 1000) % 100000}"


def later() -> int:
    return int(time.time() * 1000) + 3_600_000


@pytest.fixture(scope="module")
def ending(tmp_path_factory):
    with ServerProc(tmp_path_factory.mktemp("ending") / "data", command=ENDING) as srv:
        yield srv


def test_cancel_many_cut_with_cancelled_is_tried_again(ending):
    """The server cancels the CancelBatch after writing its tombstones: the retry answers
    ALREADY_CANCELLED, read as CANCELLED (the first try's work); it raised CANCELLED."""
    with Client(ending.address, retries=3, retry_backoff=0.01) as c:
        s = subject()
        ids = [f"{CANCELLED_CALL_ID}{next(_ids):08d}", f"plain-{next(_ids)}"]
        for i in ids:
            c.send(s, b"p", deliver_at_ms=later(), message_id=i)
        assert c.cancel_many(ids) == ["CANCELLED", "CANCELLED"]
        assert [c.state_name(c.get(message_id=i)) for i in ids] == ["CANCELLED", "CANCELLED"]


def test_aio_cancel_many_cut_with_cancelled_is_tried_again(ending):
    async def main() -> None:
        async with aio.Client(ending.address, retries=3, retry_backoff=0.01) as c:
            s = subject()
            mid = f"{CANCELLED_CALL_ID}{next(_ids):08d}"
            await c.send(s, b"p", deliver_at_ms=later(), message_id=mid)
            assert await c.cancel_many([mid]) == ["CANCELLED"]
            assert c.state_name(await c.get(message_id=mid)) == "CANCELLED"

    asyncio.run(main())


class _Cancelled(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.CANCELLED

    def details(self) -> str:
        return "CANCELLED"


def test_cancelled_is_not_tried_again_when_this_side_is_closing():
    """CANCELLED is tried again only when it is not this side's doing: the same status on
    a client closing is its own channel closing under the call (raised, as before)."""
    from qdelay.client.client import call_async

    calls: list[str] = []

    async def method(request, timeout, metadata):
        calls.append(request)
        raise _Cancelled()

    async def main() -> None:
        with pytest.raises(errors.QdelayError, match="CANCELLED"):
            await call_async(method, "r", 1.0, (), 3, 0.001, None, lambda: True)
        assert len(calls) == 1
        calls.clear()
        with pytest.raises(errors.QdelayError, match="CANCELLED"):
            await call_async(method, "r", 1.0, (), 3, 0.001, None, lambda: False)
        assert len(calls) == 4  # the first try and 3 retries

    asyncio.run(main())


@pytest.fixture
def half_close_fails_once(monkeypatch):
    """grpc.aio's half-close of a stream fails once as on a connection just broken
    (``ExecuteBatchError`` of ``SendCloseFromClientOperation``, seen at server restarts);
    grpc.aio then cancels the call itself."""
    done_writing = aio_call._StreamRequestMixin._done_writing
    failed = []

    async def failing(self) -> None:
        if not failed:
            failed.append(self)
            raise cygrpc.ExecuteBatchError('Failed "execute_batch": SendCloseFromClientOperation (the test)')
        await done_writing(self)

    monkeypatch.setattr(aio_call._StreamRequestMixin, "_done_writing", failing)
    return failed


def _messages(s: str, n: int) -> list[Outgoing]:
    at = later()
    return [Outgoing(s, b"p", deliver_at_ms=at, message_id=f"hc-{next(_ids)}") for _ in range(n)]


def test_send_many_whose_stream_grpc_cancelled_sends_again(ending, half_close_fails_once):
    """It raised FailedPrecondition "the client was closed during the call"; now the
    unanswered batches go again on a new stream, each message written once."""
    with Client(ending.address, retries=3, retry_backoff=0.01) as c:
        s = subject()
        msgs = _messages(s, 50)
        receipts = c.send_many(msgs, batch_size=10)
        assert half_close_fails_once, "the half-close did not fail: the test tested nothing"
        assert [r.message_id for r in receipts] == [m.message_id for m in msgs]
        again = c.send_many(msgs, batch_size=50)  # written once: the same sequences, duplicates
        assert [r.sequence for r in again] == [r.sequence for r in receipts]
        assert len({r.sequence for r in receipts}) == 50


def test_aio_send_many_whose_stream_grpc_cancelled_sends_again(ending, half_close_fails_once):
    """It raised asyncio.CancelledError into a task nobody cancelled."""

    async def main() -> None:
        async with aio.Client(ending.address, retries=3, retry_backoff=0.01) as c:
            s = subject()
            msgs = _messages(s, 30)
            receipts = await c.send_many(msgs, batch_size=10)
            assert half_close_fails_once
            assert [r.message_id for r in receipts] == [m.message_id for m in msgs]
            again = await c.send_many(msgs, batch_size=30)
            assert [r.sequence for r in again] == [r.sequence for r in receipts]

    asyncio.run(main())


def test_a_cancelled_send_many_task_is_still_cancelled(ending):
    """The task's own cancellation is not taken for grpc's: it ends the call and raises."""

    async def main() -> None:
        async with aio.Client(ending.address, retries=3, retry_backoff=0.01) as c:
            msgs = _messages(subject(), 20000)
            task = asyncio.create_task(c.send_many(msgs, batch_size=10, max_in_flight=1))
            async with asyncio.timeout(30):  # until its stream is writing
                while c.state_name(await c.get(message_id=msgs[0].message_id)) != "PENDING":
                    await asyncio.sleep(0.01)
            assert not task.done()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())


def test_send_many_counts_tries_in_a_row_from_its_last_answer(ending):
    """Five streams in a row each answer a batch and are then cut (CANCELLED, as a server
    killed after serving a while): with retries=1 send_many raised CANCELLED at the second
    cut, though every stream had made progress; a stream that answered starts the count
    again. max_in_flight=1: the server reads one batch at a time, so each marked batch is
    answered, then cut (tests/ending_server.py)."""
    from ending_server import CANCEL_ID

    with Client(ending.address, retries=1, retry_backoff=0.01) as c:
        s = subject()
        msgs = _messages(s, 50)
        for b in range(5):  # one marked message in each batch of 10
            msgs[b * 10 + 3] = msgs[b * 10 + 3]._replace(message_id=f"{CANCEL_ID}{next(_ids):08d}")
        receipts = c.send_many(msgs, batch_size=10, max_in_flight=1)
        assert [r.message_id for r in receipts] == [m.message_id for m in msgs]
        assert len({r.sequence for r in receipts}) == 50


def test_send_counts_tries_in_a_row_from_its_last_answer(ending):
    """send()'s batcher, as send_many: streams that answered and were then cut, more of
    them in a row than retries, fail no caller (it failed the batches unanswered at the
    second cut with CANCELLED: the count started again only on a stream ended cleanly)."""
    from ending_server import CANCEL_ID

    batching = Batching(max_batch=1, max_in_flight=2)
    with Client(ending.address, retries=1, retry_backoff=0.01, batching=batching) as c:
        s = subject()
        ids = [f"{CANCEL_ID}{next(_ids):08d}" for _ in range(24)]
        with ThreadPoolExecutor(4) as pool:
            receipts = list(pool.map(lambda i: c.send(s, b"p", deliver_at_ms=later(), message_id=i), ids))
        assert [r.message_id for r in receipts] == ids
        assert c._batcher is not None and c._batcher.streams >= 5  # cut again and again


def test_aio_send_many_cut_by_close_raises_failed_precondition(ending):
    """close() while a send_many runs in another task closes the channel under its stream:
    it raised asyncio.CancelledError (grpc.aio's cancel of the call), grpc's UsageError
    "Channel is closed." (a retry opening a stream on it), or CANCELLED; now, as the
    blocking client's, FailedPrecondition "the client was closed during the call", with the
    receipts answered before."""

    async def main() -> None:
        c = aio.Client(ending.address, retries=3, retry_backoff=0.01)
        msgs = _messages(subject(), 20000)
        task = asyncio.create_task(c.send_many(msgs, batch_size=10, max_in_flight=1))
        async with asyncio.timeout(30):  # until its stream is writing
            while c.state_name(await c.get(message_id=msgs[0].message_id)) != "PENDING":
                await asyncio.sleep(0.01)
        await c.close()
        with pytest.raises(errors.FailedPrecondition, match="closed during the call") as info:
            await task
        done = info.value.receipts  # type: ignore[attr-defined]
        assert 0 < len(done) < len(msgs)
        assert [r.message_id for r in done] == [m.message_id for m in msgs[: len(done)]]

    asyncio.run(main())


def test_send_batcher_flushing_at_close_sends_again_what_a_cut_left(ending):
    """close() sends what is queued and waits for its answers; a stream the server cut
    with CANCELLED meanwhile (a server stopping as the client closes: 200 send() callers
    failed at once so in 25 closes) was taken for the client's own closing and its
    unanswered batches failed with CANCELLED. The batcher's close runs before its channel
    closes: such a CANCELLED is the server's, and they are sent again."""
    from ending_server import CANCEL_ID

    async def main() -> None:
        c = aio.Client(ending.address, retries=3, retry_backoff=0.01, batching=Batching(max_batch=1, max_in_flight=4))
        s = subject()
        ids = [f"{CANCEL_ID}{next(_ids):08d}"] + [f"flush-{next(_ids)}" for _ in range(40)]
        sends = [asyncio.create_task(c.send(s, b"p", deliver_at_ms=later(), message_id=i)) for i in ids]
        await asyncio.sleep(0)  # queued: close() owes them their answers
        await c.close()
        receipts = await asyncio.gather(*sends)
        assert [r.message_id for r in receipts] == ids

    asyncio.run(main())


def _strict(main: Callable[[], Awaitable[None]]) -> None:
    """``main`` on a loop in asyncio's debug mode with warnings as errors; fails on anything
    the loop reports (a task's exception never retrieved, a callback's error)."""
    reported: list[dict] = []

    async def run() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, context: reported.append(context))
        await main()
        gc.collect()  # a task that failed unobserved is reported when it is collected

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        asyncio.run(run(), debug=True)
    assert reported == []


@pytest.fixture
def request_write_fails_once(monkeypatch):
    """Once armed (``armed.set()``), grpc.aio's writing of a stream's next request fails
    once as on a connection just broken (``ExecuteBatchError``): its request-iterator task
    swallows it by cancelling the call, and the call's reader gets ``asyncio.CancelledError``
    though nobody cancelled it. ``armed.is_set()`` again once it failed: whether it did."""
    write = aio_call._StreamRequestMixin._write
    armed = threading.Event()
    failed = threading.Event()

    async def failing(self, request) -> None:
        if armed.is_set() and not failed.is_set():
            failed.set()
            raise cygrpc.ExecuteBatchError('Failed "execute_batch": SendMessageOperation (the test)')
        await write(self, request)

    monkeypatch.setattr(aio_call._StreamRequestMixin, "_write", failing)
    return armed, failed


def test_a_cancel_stream_grpc_cancelled_ends_its_reader_cleanly_and_sends_again(ending, request_write_fails_once):
    """grpc.aio cancels the CancelStream call under the cancel() it carries: its reader task
    ended cancelled, which nobody had asked for; now it ends as a stream cut with CANCELLED
    (batching.CancelledByGrpc), and the request goes again on a new stream."""

    async def main() -> None:
        async with aio.Client(ending.address, retries=3, retry_backoff=0.01) as c:
            s = subject()
            receipt = await c.send(s, b"p", deliver_at_ms=later())
            assert await c.cancel(f"never-sent-{next(_ids)}") == "NOT_FOUND"  # the stream opens
            assert c._canceller is not None and c._canceller._stream is not None
            calls = c._canceller._stream
            first = calls._stream
            assert first is not None
            armed, failed = request_write_fails_once
            armed.set()  # the next request's write fails
            assert await c.cancel(receipt) == "CANCELLED"
            assert failed.is_set(), "the write did not fail: the test tested nothing"
            assert first.reader.done() and not first.reader.cancelled(), first.reader
            assert first.reader.exception() is None
            assert calls.streams == 2 and calls.resent == 1
            assert c.state_name(await c.get(receipt)) == "CANCELLED"

    _strict(main)


def test_a_cancel_stream_reader_whose_own_task_is_cancelled_still_ends_cancelled(ending):
    """Its loop ending cancels the reader task (asyncio.run's end, the blocking client's
    bulk loop): that cancellation is not taken for grpc's."""

    async def main() -> None:
        async with aio.Client(ending.address, retries=3, retry_backoff=0.01) as c:
            assert await c.cancel(f"never-sent-{next(_ids)}") == "NOT_FOUND"
            assert c._canceller is not None and c._canceller._stream is not None
            stream = c._canceller._stream._stream
            assert stream is not None
            stream.reader.cancel()
            with pytest.raises(asyncio.CancelledError):
                await stream.reader
            assert stream.reader.cancelled()

    _strict(main)


def test_aio_send_batcher_whose_stream_grpc_cancelled_at_close_sends_again(ending, half_close_fails_once):
    """close() half-closes the SendStream once its queue is empty; the half-close failed
    on a connection just broken and grpc.aio cancelled the call: the sender task ended
    cancelled, its unanswered callers got Unavailable "the client was closed" and close()
    raised CancelledError into its caller. Now it is a cut: what was unanswered goes again,
    close() returns once it is answered."""

    async def main() -> None:
        c = aio.Client(ending.address, retries=3, retry_backoff=0.01, batching=Batching(max_batch=1, max_in_flight=4))
        s = subject()
        ids = [f"hc-close-{next(_ids)}" for _ in range(40)]
        sends = [asyncio.create_task(c.send(s, b"p", deliver_at_ms=later(), message_id=i)) for i in ids]
        await asyncio.sleep(0)  # queued: close() owes them their answers
        await c.close()
        assert half_close_fails_once, "the half-close did not fail: the test tested nothing"
        receipts = await asyncio.gather(*sends)
        assert [r.message_id for r in receipts] == ids

    _strict(main)


def test_aio_calls_on_a_channel_closed_under_the_client_get_failed_precondition(ending):
    """The asyncio client's ``channel`` closed by whoever else holds it (not close()): a
    send() waited until its timeout (its batcher's sender task died with grpc's UsageError
    "Channel is closed.", never retrieved), cancel(), get() and send_many raised that
    UsageError, outside qdelay's exception tree, and close() raised it too. Now each gets
    FailedPrecondition at once (send_many's with the receipts answered before: none), the
    readers of the streams the closing cut end cleanly, and close() returns."""

    async def main() -> None:
        c = aio.Client(ending.address, retries=3, retry_backoff=0.01)
        s = subject()
        receipt = await c.send(s, b"p", deliver_at_ms=later())  # the batcher's stream, open and idle
        assert await c.cancel(receipt) == "CANCELLED"  # the CancelStream, open and idle
        assert c._canceller is not None and c._canceller._stream is not None
        reader = c._canceller._stream._stream.reader
        await c.channel.close()
        started = time.monotonic()
        sends = [c.send(s, b"p", deliver_at_ms=later(), timeout=30) for _ in range(10)]
        for outcome in await asyncio.gather(*sends, return_exceptions=True):
            assert isinstance(outcome, errors.FailedPrecondition), outcome
            assert "channel was closed" in str(outcome)
        with pytest.raises(errors.FailedPrecondition, match="channel was closed"):
            await c.cancel(receipt, timeout=30)
        with pytest.raises(errors.FailedPrecondition, match="channel was closed"):
            await c.get(receipt)
        with pytest.raises(errors.FailedPrecondition, match="channel was closed") as info:
            await c.send_many(_messages(s, 5))
        assert len(info.value.receipts) == 0  # type: ignore[attr-defined]
        assert time.monotonic() - started < 10  # no caller waited for its timeout
        assert reader.done() and not reader.cancelled()
        await c.close()

    _strict(main)


async def _consuming(c: aio.Client) -> aio.Consumer:
    """A consumer of a fresh subject with its stream open: one delivery received and acked."""
    s = subject()
    await c.send(s, b"p")
    consumer = c.subscribe(s, "g")
    batch = await consumer.receive(1, timeout=20)
    assert len(batch) == 1
    consumer.ack(batch)
    return consumer


def test_aio_consumer_closing_whose_half_close_grpc_cancelled_returns(ending, half_close_fails_once):
    """close() half-closes the Subscribe stream; the half-close failed on a connection just
    broken and grpc.aio cancelled the call: the reader task ended cancelled and close()
    raised CancelledError into its caller. Now it is the stream's end, and close() returns."""

    async def main() -> None:
        async with aio.Client(ending.address, retries=3, retry_backoff=0.01) as c:
            consumer = await _consuming(c)
            await consumer.close()
            assert half_close_fails_once, "the half-close did not fail: the test tested nothing"
            assert await consumer.receive(1, timeout=0.2) == []  # its iteration ended

    _strict(main)


def test_aio_consumer_whose_channel_is_closed_under_it_raises_failed_precondition(ending):
    """Its iteration ended as if the consumer were closed (StopAsyncIteration, nothing
    raised: a consumer that had stopped said nothing) and close() raised CancelledError;
    wait_ready() and health() raised grpc's UsageError. Now the iterator raises
    FailedPrecondition, so do they, and close() returns."""

    async def main() -> None:
        c = aio.Client(ending.address, retries=3, retry_backoff=0.01)
        consumer = await _consuming(c)
        await c.channel.close()
        with pytest.raises(errors.FailedPrecondition, match="channel was closed"):
            async with asyncio.timeout(20):
                async for _batch in consumer.batches():
                    pass
        with pytest.raises(errors.FailedPrecondition, match="channel was closed"):
            await c.wait_ready(5)
        with pytest.raises(errors.FailedPrecondition, match="channel was closed"):
            await c.health()
        await consumer.close()
        await c.close()

    _strict(main)
