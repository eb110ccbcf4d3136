"""CancelStream (proto/qdelay/v1/qdelay.proto): the clients' cancel() batches ride one stream
(client/batching.py CancelStreamCall). Against stand-in servers: a stream broken mid-way
is opened again and the unanswered request sent again with the same targets, its callers
seeing CANCELLED (not the ALREADY_CANCELLED their own first try caused); a refused request
refuses only its bad caller; a server without CancelStream gets CancelBatch calls. Against
a real server: each caller its own outcome, one stream for all, and a shutdown that does
not wait for an idle stream."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from qdelay import errors
from qdelay.aio import Client as AioClient
from qdelay.client import Client, Outgoing
from qdelay.client.client import DeadlineExceeded
from qdelay.v1 import qdelay_pb2 as pb
from qdelay.v1 import qdelay_pb2_grpc as pb_grpc

HOUR_MS = 3_600_000
HELD = 999  # the stand-in answers a request with this sequence only when told to
CANCELLED, NOT_FOUND, ALREADY_CANCELLED = (
    pb.CancelResponse.CANCELLED,
    pb.CancelResponse.NOT_FOUND,
    pb.CancelResponse.ALREADY_CANCELLED,
)


class _StandIn(pb_grpc.DelayServiceServicer):
    """Cancels by sequence: a multiple of 7 is NOT_FOUND, a sequence seen before
    ALREADY_CANCELLED, else CANCELLED; sequence 0 is refused (INVALID_ARGUMENT). The first
    ``breaks`` streams end with UNAVAILABLE after cancelling their first request's targets,
    without answering it (as a connection lost after the server's write)."""

    def __init__(self, breaks: int = 0, stream: bool = True) -> None:
        self.breaks = breaks
        self.stream = stream
        self.cancelled: set[int] = set()
        self.requests: list[tuple[int, list[int]]] = []  # (stream number, its sequences)
        self.streams = 0
        self.batch_calls = 0
        self.unary_calls = 0
        self.held = asyncio.Event()  # a request naming HELD is answered once this is set

    def _outcome(self, seq: int) -> int:
        if seq % 7 == 0:
            return NOT_FOUND
        if seq in self.cancelled:
            return ALREADY_CANCELLED
        self.cancelled.add(seq)
        return CANCELLED

    async def CancelStream(self, request_iterator, context):
        if not self.stream:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        self.streams += 1
        number = self.streams
        async for request in request_iterator:
            seqs = [r.receipt.sequence for r in request.requests]
            self.requests.append((number, seqs))
            if 0 in seqs:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "requests[k].receipt.sequence: 0")
            response = pb.CancelBatchResponse(responses=[pb.CancelResponse(outcome=self._outcome(s)) for s in seqs])
            if number <= self.breaks:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "connection lost")
            if HELD in seqs:
                await self.held.wait()
            yield response

    async def CancelBatch(self, request, context):
        self.batch_calls += 1
        seqs = [r.receipt.sequence for r in request.requests]
        if 0 in seqs:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "requests[k].receipt.sequence: 0")
        return pb.CancelBatchResponse(responses=[pb.CancelResponse(outcome=self._outcome(s)) for s in seqs])

    async def Cancel(self, request, context):
        self.unary_calls += 1
        if request.receipt.sequence == 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "receipt.sequence: 0")
        return pb.CancelResponse(outcome=self._outcome(request.receipt.sequence))


async def _serve(servicer: _StandIn) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    pb_grpc.add_DelayServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _target(seq: int) -> pb.Receipt:
    return pb.Receipt(message_id=f"m{seq}", deliver_at_ms=1, sequence=seq)


async def _cancel_all(client: AioClient, seqs: list[int]) -> dict[int, object]:
    async def one(seq: int) -> object:
        try:
            return await client.cancel(_target(seq), timeout=20)
        except errors.QdelayError as err:
            return err

    return dict(zip(seqs, await asyncio.gather(*(one(s) for s in seqs))))


def test_a_stream_broken_mid_way_sends_the_same_targets_again_and_callers_see_cancelled():
    async def main() -> None:
        stand_in = _StandIn(breaks=2)
        server, address = await _serve(stand_in)
        try:
            async with AioClient(address, retries=3, retry_backoff=0.01) as c:
                seqs = list(range(1, 120))
                out = await _cancel_all(c, seqs)
                stream = c._canceller._stream  # type: ignore[union-attr]
                assert stream is not None and stream.resent >= 2
        finally:
            await server.stop(None)
        # what each caller sees does not depend on where the streams broke
        assert out == {s: ("NOT_FOUND" if s % 7 == 0 else "CANCELLED") for s in seqs}
        assert stand_in.streams == 3
        # the request each broken stream took was sent again, unchanged, on the next stream
        broken = [seqs_ for n, seqs_ in stand_in.requests if n <= 2]
        later = [seqs_ for n, seqs_ in stand_in.requests if n == 3]
        assert broken and all(b in later for b in broken)
        assert sorted(s for _n, part in stand_in.requests if _n == 3 for s in part) == seqs

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_request_past_its_deadline_fails_in_time_and_its_late_answer_is_no_one_elses():
    """CancelStreamCall's deadline (a timer on the response's future): the request the
    server holds fails with DEADLINE_EXCEEDED when its time is up, the stream stays open,
    and the answer that comes later is dropped, not given to the next request."""

    async def main() -> None:
        stand_in = _StandIn()
        server, address = await _serve(stand_in)
        try:
            async with AioClient(address) as c:
                assert await c.cancel(_target(1)) == "CANCELLED"  # the stream is open
                call = c._canceller._stream  # type: ignore[union-attr]
                assert call is not None
                held = pb.CancelBatchRequest(requests=[pb.CancelRequest(receipt=_target(HELD))])
                t0 = time.monotonic()
                with pytest.raises(DeadlineExceeded):
                    await call(held, 0.3)
                assert 0.25 <= time.monotonic() - t0 < 5
                stand_in.held.set()  # the held answer goes out now, to no one
                nxt = pb.CancelBatchRequest(requests=[pb.CancelRequest(receipt=_target(2))] * 2)
                response = await call(nxt, 10)
                assert [r.outcome for r in response.responses] == [CANCELLED, ALREADY_CANCELLED]
                assert call.streams == 1 and call.resent == 0
        finally:
            await server.stop(None)

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_first_try_answers_already_cancelled_and_a_stream_that_stays_broken_fails_its_callers():
    """Only a re-sent request's ALREADY_CANCELLED reads as CANCELLED; after ``retries`` broken
    streams in a row the callers get UNAVAILABLE."""

    async def main() -> None:
        stand_in = _StandIn()
        server, address = await _serve(stand_in)
        try:
            async with AioClient(address, retries=1, retry_backoff=0.01) as c:
                assert await c.cancel(_target(5)) == "CANCELLED"
                assert await c.cancel(_target(5)) == "ALREADY_CANCELLED"
                stand_in.breaks = 10**6  # every stream from now on breaks
                out = await _cancel_all(c, [8, 9, 10])
        finally:
            await server.stop(None)
        assert all(isinstance(o, errors.Unavailable) for o in out.values())

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_refused_request_refuses_only_its_bad_caller():
    async def main() -> None:
        stand_in = _StandIn()
        server, address = await _serve(stand_in)
        try:
            async with AioClient(address, retries=2, retry_backoff=0.01) as c:
                seqs = list(range(1, 60))
                seqs.insert(30, 0)
                out = await _cancel_all(c, seqs)
        finally:
            await server.stop(None)
        assert isinstance(out[0], errors.InvalidArgument)
        assert {s: o for s, o in out.items() if s} == {
            s: ("NOT_FOUND" if s % 7 == 0 else "CANCELLED") for s in seqs if s
        }
        assert stand_in.unary_calls >= 1  # the refused request went again one Cancel per target

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_server_without_cancel_stream_gets_cancel_batch_calls():
    async def main() -> None:
        stand_in = _StandIn(stream=False)
        server, address = await _serve(stand_in)
        try:
            async with AioClient(address) as c:
                out = await _cancel_all(c, list(range(1, 40)))
                assert c._canceller._stream.unimplemented  # type: ignore[union-attr]
        finally:
            await server.stop(None)
        assert out == {s: ("NOT_FOUND" if s % 7 == 0 else "CANCELLED") for s in range(1, 40)}
        assert stand_in.batch_calls + stand_in.unary_calls >= 1

    asyncio.run(asyncio.wait_for(main(), 60))


@pytest.fixture(scope="module")
def server_args() -> list[str]:
    return ["--set", "grace_seconds=20"]


def test_threads_share_one_stream_each_gets_its_own_outcome_and_shutdown_does_not_wait_for_it(server):
    with Client(server.address) as c:
        at = int(time.time() * 1000) + HOUR_MS
        msgs = [Outgoing("cs.t", b"p", deliver_at_ms=at + i, message_id=f"cs{i}") for i in range(200)]
        receipts = list(c.send_many(msgs))
        targets = receipts + receipts[:30]
        with ThreadPoolExecutor(16) as pool:
            out = list(pool.map(lambda r: (r.sequence, c.cancel(r)), targets))
        by_seq: dict[int, list[str]] = {}
        for seq, outcome in out:
            by_seq.setdefault(seq, []).append(outcome)
        assert all(
            sorted(v) == (["ALREADY_CANCELLED", "CANCELLED"] if len(v) == 2 else ["CANCELLED"]) for v in by_seq.values()
        )
        stream = c._canceller._stream  # type: ignore[union-attr]
        assert stream is not None and stream.streams == 1 and not stream.unimplemented
        # the stream stays open while idle; stopping the server ends it at once rather than
        # after the grace period
        started = time.monotonic()
        server.stop()
        assert time.monotonic() - started < 10
