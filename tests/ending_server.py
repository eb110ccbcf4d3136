"""A real ``qdelay server`` that ends a Subscribe stream when its client says so, as a
server shutting down ends every stream, while the client may still be writing acks on
it: the moment grpc.aio loses the stream's status (INTERNAL "Internal error from Core":
a write on a stream the server had just ended failed) and a consumer that does not know
it ends. Used by tests/test_consumer_lost_status.py through ``ServerProc(command=...)``.

Ack ids read and dropped (never acknowledged):
    END_ACK     the stream it came on ends at once, with OK (``sub.closed``, what a
                shutdown sets)
    NOISE...    acks that keep the client writing on the stream as it ends

And a SendStream that carries a message whose id starts with CANCEL_ID ends with
CANCELLED after its next answer, batches read and not answered (what a stopping server's
transport does to a stream it cuts), once per such id: the message and the batches around
it are written or not, and the client's retry finds them by id. Used by
tests/test_client_batching.py.

And a CancelBatch that names an id starting with CANCELLED_CALL_ID is carried out, then
answered CANCELLED instead of its outcomes (what a stopping server does to a call still
running at its deadline), once per such id: the client's retry finds the tombstone.
Used by tests/test_client_cut_calls.py.

Usage: python tests/ending_server.py server --data-dir ... (qdelay's own arguments)
"""

from __future__ import annotations

import sys

import grpc

from qdelay import cli
from qdelay.server.service import DelayService

END_ACK = "end-this-stream"
NOISE = "noise-"
CANCEL_ID = "cancel-this-stream-"
CANCELLED_CALL_ID = "cancelled-call-"
_ack = DelayService._ack
_cancel_batch = DelayService.CancelBatch
_send_stream = DelayService.SendStream
_cancelled: set[bytes] = set()


def ack(self, sub, ack_ids):
    if END_ACK in ack_ids:
        sub.closed = True  # the handler sends what it holds back and ends the stream
        sub.event.set()
    real = [a for a in ack_ids if a != END_ACK and not a.startswith(NOISE)]
    if real:
        _ack(self, sub, real)


async def send_stream(self, request_iterator, context):
    marker = CANCEL_ID.encode()
    seen: list[bytes] = []

    async def requests():
        async for request in request_iterator:
            at = request.find(marker)
            if at >= 0:
                key = request[at : at + len(marker) + 8]
                if key not in _cancelled:
                    _cancelled.add(key)
                    seen.append(key)
            yield request

    async for answer in _send_stream(self, requests(), context):
        yield answer
        if seen:
            await context.abort(grpc.StatusCode.CANCELLED, "cut by the test server")


async def cancel_batch(self, request, context):
    answer = await _cancel_batch(self, request, context)
    marker = CANCELLED_CALL_ID.encode()
    at = request.find(marker)  # the request as wire bytes (app.RAW_REQUEST_METHODS)
    if at >= 0:
        key = request[at : at + len(marker) + 8]
        if key not in _cancelled:
            _cancelled.add(key)
            await context.abort(grpc.StatusCode.CANCELLED, "cancelled by the test server")
    return answer


DelayService._ack = ack  # type: ignore[method-assign]
DelayService.CancelBatch = cancel_batch  # type: ignore[method-assign]
DelayService.SendStream = send_stream  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(cli.main())
