"""Python client of the qdelay gRPC API (blocking; safe to share between threads).

    from qdelay.client import Client
    with Client("127.0.0.1:7600", token=None) as c:
        r = c.send("order.close", b"order 42", delay_ms=30 * 60 * 1000)
        c.cancel(r)
        receipts = c.send_many(c.message("s", b"x", delay_ms=1000) for _ in range(10_000))
        with c.subscribe("order.close") as consumer:
            for batch in consumer.batches():
                handle(batch)
                consumer.ack(batch)

Errors are raised as the matching class of :mod:`qdelay.errors` (InvalidArgument,
ResourceExhausted, Unauthenticated, FailedPrecondition, Unavailable, ...) carrying the
server's message, the gRPC code (``.code``) and the number of attempts. Retries happen
only for UNAVAILABLE (not reached, shutting down) with a short backoff, a bounded number of
times, and the last error is raised as it is: nothing is swallowed. A Send is retried only
with a message id set on the client side, so a retry of a send whose first try did land
repeats the same id (the consumer sees one id, maybe twice: at-least-once).
"""

from __future__ import annotations

import asyncio
import atexit
import bisect
import concurrent.futures
import contextlib
import inspect
import itertools
import logging
import os
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from datetime import datetime, timedelta
from typing import Any, NamedTuple, cast

import grpc

from qdelay import errors, wire  # imported, wire checks its native codec against the .proto (start-up)
from qdelay.addresses import check_target
from qdelay.client import reconnect
from qdelay.client.batching import (
    BatchCall,
    Batching,
    CancelBatcher,
    CancelledByGrpc,
    CancelStreamCall,
    RescheduleBatcher,
    SendBatcher,
    TargetBatcher,
    as_first_try,
    cancelled_by_grpc,
    channel_closed,
    lost_status,
    retry_wait,
    stream_cut,
    tries_allowed,
)
from qdelay.client.handoff import WaitTimeout
from qdelay.client.types import (
    KEEPALIVE_S,
    RECONNECT_OPTIONS,
    STATES,
    Delivery,
    LazyReceipts,
    Receipt,
    Status,
    Target,
    cancel_batches,
    cancel_request,
    cancel_target,
    keepalive_options,
    ref_or_id,
    reschedule_batches,
    reschedule_request,
    reschedule_result,
    stats_dict,
)
from qdelay.units import to_ms
from qdelay.v1 import qdelay_pb2 as pb
from qdelay.v1 import qdelay_pb2_grpc as pb_grpc

Message = pb.Message

DEFAULT_TARGET = "127.0.0.1:7600"
MAX_MESSAGE_BYTES = 80 * 1024 * 1024
# send_many packs the batches it has credit for at once into one stream message up to this
# many bytes (a server's max_request_bytes is 64 MiB by default; gRPC's own default 4 MiB).
# All of the credit, not a share of it: with 16 batches of 100 unanswered, packs of 16 ran
# at 260k msgs/s against 226k for packs of at most 8 and 214k for 4 (09:03, load 2-3)
PACK_BYTES = 1 << 20

CANCEL_OUTCOMES = {v.number: v.name for v in pb.CancelResponse.Outcome.DESCRIPTOR.values}

_ERRORS = {
    "INVALID_ARGUMENT": errors.InvalidArgument,
    "NOT_FOUND": errors.NotFound,
    "UNAUTHENTICATED": errors.Unauthenticated,
    "PERMISSION_DENIED": errors.PermissionDenied,
    "FAILED_PRECONDITION": errors.FailedPrecondition,
    "RESOURCE_EXHAUSTED": errors.ResourceExhausted,
    "UNAVAILABLE": errors.Unavailable,
    "DATA_LOSS": errors.StorageError,
    "INTERNAL": errors.QdelayError,
}


class DeadlineExceeded(errors.Unavailable):
    """The call did not finish within its timeout; whether it took effect is unknown."""

    grpc_code = "DEADLINE_EXCEEDED"


def translate(error: grpc.RpcError, attempts: int = 1) -> errors.QdelayError:
    """The qdelay error for a failed call (keeps the server's message and the code)."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    cls = DeadlineExceeded if code == grpc.StatusCode.DEADLINE_EXCEEDED else _ERRORS.get(code.name, errors.QdelayError)
    exc = cls.__new__(cls)
    exc.said(code, details)
    exc.attempts = attempts
    return exc


async def call_async(
    method: Callable[..., Any],
    request: Any,
    timeout: float,
    metadata: tuple,
    retries: int,
    backoff: float,
    retried_answer: Callable[[Any], Any] | None = None,
    closing: Callable[[], bool] = lambda: False,
) -> Any:
    """One grpc.aio call with the clients' retry policy: a call the server did not answer
    (:func:`~qdelay.client.batching.stream_cut`: UNAVAILABLE, or CANCELLED by a stopping
    server unless ``closing()``, this side's channel closing under it) is tried again with
    exponential backoff (at most ``MAX_BACKOFF`` between tries), ``retries`` times; any other
    error, or the last one, is raised as the qdelay error. With ``retried_answer``, a
    response that took more than one try is read through it (a retried write's answer may
    report its own first try's work: :func:`first_try_cancel`)."""
    attempt = 0
    while True:
        attempt += 1
        try:
            response = await method(request, timeout=timeout, metadata=metadata)
        except grpc.RpcError as e:
            if not stream_cut(e, closing()) or attempt > retries:
                raise translate(e, attempt) from None
            await asyncio.sleep(retry_wait(backoff, attempt))
            continue
        except grpc.aio.UsageError as e:  # "Channel is closed.": a retry after close(), or closed otherwise
            raise (closed_during_call() if closing() else channel_closed(e)) from None
        return retried_answer(response) if retried_answer is not None and attempt > 1 else response


def cancel_outcomes(response: pb.CancelBatchResponse) -> list[str]:
    """``cancel_many``'s outcomes of one CancelBatch (called with ``first_try_cancel`` as
    its ``retried_answer``: after a retry, ALREADY_CANCELLED reads CANCELLED, docs/api.md)."""
    return [CANCEL_OUTCOMES.get(x.outcome, str(x.outcome)) for x in response.responses]


def closed_during_call(receipts: SentReceipts | None = None) -> errors.FailedPrecondition:
    """What a call cut by its client's ``close()`` raises (both clients; send_many's with the
    receipts of the batches answered before it)."""
    err = errors.FailedPrecondition("the client was closed during the call")
    if receipts is not None:
        err.receipts = receipts
    return err


def not_ready(timeout: float) -> DeadlineExceeded:
    """What ``wait_ready`` raises when the channel did not connect within its timeout."""
    return DeadlineExceeded(f"DEADLINE_EXCEEDED: the channel was not ready within {timeout} s")


def deadline_exceeded(timeout: float) -> DeadlineExceeded:
    """What a caller gets when its own timeout passed before its answer."""
    return DeadlineExceeded(f"DEADLINE_EXCEEDED: no answer within {timeout} s")


class Outgoing(NamedTuple):
    """A message for :meth:`Client.send_many` as plain fields: the bulk path encodes a batch
    of these straight into the request's wire bytes (native codec), at a fraction of the
    CPU of a protobuf ``Message`` per message. Give exactly one of ``deliver_at_ms`` (Unix
    epoch ms) and ``delay_ms``; the server validates every field, as for any request."""

    subject: str
    payload: bytes
    deliver_at_ms: int | None = None
    delay_ms: int | None = None
    message_id: str = ""
    headers: dict[str, str] | None = None


# send_many's request of a batch of Outgoing tuples and its ids, made in one native call
# (absent from a codec built before it: the twin then)
_encode_request: Callable[[list, Callable[[], str]], tuple[bytes, list[str]]] = getattr(
    wire.native, "encode_outgoing_request", wire.encode_outgoing_request_py
)
_native_new = getattr(wire.native, "new_outgoing", None)  # absent from a codec built before it
if _native_new is not None:
    # the NamedTuple's generated __new__ is Python (a frame, then tuple.__new__ copying a
    # tuple): 230-300 ns a message on the producer's thread, more than encoding it; the
    # native one fills the instance directly (120-160 ns). help() and inspect keep the
    # fields' signature, which they would otherwise take from tuple's
    Outgoing.__signature__ = inspect.signature(Outgoing)  # type: ignore[attr-defined]
    Outgoing.__new__ = staticmethod(_native_new)  # type: ignore[method-assign]


def _set_due(msg: pb.Message, o: Outgoing) -> None:
    """The ``when`` of ``msg`` from ``o`` (neither time given: left unset, which the server
    refuses; :func:`outgoing` always gives one)."""
    if o.deliver_at_ms is not None:
        msg.deliver_at_ms = o.deliver_at_ms
    elif o.delay_ms is not None:
        msg.delay_ms = o.delay_ms


# send_many's source of requests: the next batch as wire bytes and its message ids, or None
NextRequest = Callable[[], "tuple[bytes, list[str]] | None"]


def outgoing(
    subject: str,
    payload: bytes,
    delay: timedelta | None,
    delay_ms: int | timedelta | None,
    deliver_at: datetime | None,
    deliver_at_ms: int | None,
    headers: dict[str, str] | None,
    message_id: str,
) -> Outgoing:
    """One message's fields, checked for their types (so that a batch never fails to encode
    for one caller's mistake) and with the due time as ms: ``delay`` takes a
    :class:`datetime.timedelta`, ``delay_ms`` ms or a timedelta, ``deliver_at`` an aware
    :class:`datetime.datetime`, ``deliver_at_ms`` Unix epoch ms. At most one of them; none
    means "now" (delay 0). An int as ``delay`` is refused: it used to be taken as ms, so
    ``delay=30`` meant as 30 seconds made the message due at once."""
    given = [x is not None for x in (delay, delay_ms, deliver_at, deliver_at_ms)]
    if sum(given) > 1:
        raise errors.InvalidArgument("give one of delay, delay_ms, deliver_at or deliver_at_ms, not several")
    if delay is not None and not isinstance(delay, timedelta):
        raise errors.InvalidArgument(
            f"delay: a datetime.timedelta, not {type(delay).__name__} (for milliseconds use delay_ms={delay!r})"
        )
    try:
        if deliver_at is not None:
            if not isinstance(deliver_at, datetime) or deliver_at.tzinfo is None:
                raise TypeError("deliver_at: an aware datetime.datetime (with a tzinfo), e.g. datetime.now(UTC)")
            at, rel = int(deliver_at.timestamp() * 1000), None
        elif deliver_at_ms is not None:
            if isinstance(deliver_at_ms, bool) or not isinstance(deliver_at_ms, int):
                raise TypeError(f"deliver_at_ms: an int of Unix epoch milliseconds, not {type(deliver_at_ms).__name__}")
            at, rel = deliver_at_ms, None
        elif delay is not None:
            at, rel = None, to_ms(delay, "delay")
        else:
            at, rel = None, (0 if delay_ms is None else to_ms(delay_ms, "delay_ms"))
        if not isinstance(subject, str):
            raise TypeError(f"subject: a str, not {type(subject).__name__}")
        if not isinstance(payload, bytes):
            if not isinstance(payload, bytearray | memoryview):
                raise TypeError(f"payload: bytes, not {type(payload).__name__}")
            payload = bytes(payload)
        if headers is not None and not (
            isinstance(headers, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items())
        ):
            raise TypeError("headers: a dict of str to str")
        if not isinstance(message_id, str):
            raise TypeError(f"message_id: a str, not {type(message_id).__name__}")
    except TypeError as err:
        raise errors.InvalidArgument(str(err)) from None
    return Outgoing(subject, payload, at, rel, message_id, headers or None)


def _retried(
    settings: Any, retried_answer: Callable[[Any], Any] | None = None
) -> Callable[[Callable[..., Any]], BatchCall]:
    """A batcher's call of a grpc.aio ``method``: (request, timeout) with a client's
    ``settings`` (timeout when none is given, metadata, retries, retry_backoff). With
    ``retried_answer``, a response that took more than one try is read through it (a
    Cancel's: :func:`first_try_cancel`)."""

    def call(method: Callable[..., Any]) -> BatchCall:
        async def tried(request: Any, timeout: float | None) -> Any:
            return await call_async(
                method,
                request,
                timeout or settings.timeout,
                settings.metadata,
                settings.retries,
                settings.retry_backoff,
                retried_answer,
                lambda: settings._closed,
            )

        return tried

    return call


def first_try_cancel(response: pb.CancelResponse | pb.CancelBatchResponse) -> Any:
    """A Cancel's or CancelBatch's response after a retry (UNAVAILABLE: the first try may
    have written its tombstone): ALREADY_CANCELLED read as CANCELLED, as a re-sent
    cancel's (docs/api.md)."""
    if isinstance(response, pb.CancelBatchResponse):
        return as_first_try(response)
    if response.outcome == pb.CancelResponse.ALREADY_CANCELLED:
        return pb.CancelResponse(outcome=pb.CancelResponse.CANCELLED)
    return response


def cancel_batcher(stub: pb_grpc.DelayServiceStub, settings: Any, batching: Batching) -> CancelBatcher:
    """``cancel()``'s batcher on a grpc.aio ``stub`` with a client's ``settings`` (timeout,
    metadata, retries, retry_backoff): the blocking client's on its bulk loop, the asyncio
    client's on the user's loop."""
    call = _retried(settings, first_try_cancel)  # a retried Cancel/CancelBatch: its first try's work
    stream = CancelStreamCall(
        lambda requests: stub.CancelStream(requests, metadata=settings.metadata),
        call(stub.CancelBatch),  # a server without CancelStream
        translate,
        settings.retries,
        settings.retry_backoff,
        settings.timeout,
        deadline_exceeded,
    )
    return CancelBatcher(
        call(stub.CancelBatch),
        call(stub.Cancel),
        max_batch=batching.max_batch,
        linger=batching.linger,
        timeout_error=deadline_exceeded,
        stream=stream,
    )


def reschedule_batcher(stub: pb_grpc.DelayServiceStub, settings: Any, batching: Batching) -> RescheduleBatcher:
    """``reschedule()``'s batcher on a grpc.aio ``stub`` with a client's ``settings``, as
    :func:`cancel_batcher`: RescheduleBatch calls, a lone reschedule a Reschedule call."""
    call = _retried(settings)
    return RescheduleBatcher(
        call(stub.RescheduleBatch),
        call(stub.Reschedule),
        max_batch=batching.max_batch,
        linger=batching.linger,
        timeout_error=deadline_exceeded,
    )


def reschedule_when(
    delay: timedelta | None, delay_ms: int | timedelta | None, deliver_at: datetime | None, deliver_at_ms: int | None
) -> tuple[int | None, int | None]:
    """(deliver_at_ms, delay_ms) of a reschedule's new time, given as for ``send`` (one of
    them)."""
    if delay is None and delay_ms is None and deliver_at is None and deliver_at_ms is None:
        raise errors.InvalidArgument("reschedule: give the new time (delay, delay_ms, deliver_at or deliver_at_ms)")
    o = outgoing("x", b"", delay, delay_ms, deliver_at, deliver_at_ms, None, "")
    return o.deliver_at_ms, o.delay_ms


_SEND_STREAM = "/qdelay.v1.DelayService/SendStream"
SUBSCRIBE = "/qdelay.v1.DelayService/Subscribe"


def deliveries_of(group: str) -> Callable[[bytes], list[Delivery]]:
    """Subscribe's response deserializer for a consumer of ``group``: each SubscribeResponse
    straight to a list of :class:`Delivery` (native decoder, no protobuf object per delivery)."""
    decode = wire.decode_deliveries
    return lambda raw: decode(raw, Delivery, group)


class _BulkSender:
    """send_many's I/O: a grpc.aio channel to the same target, on a private event loop in a
    daemon thread, both made on first use. A streamed batch costs the producer about a
    quarter less CPU on grpc.aio than on the blocking stack, which hands every request
    to a thread of its own and waits for it (measured: 3.6-4.6 -> 2.9-3.8 us per 100-byte
    message, batches of 100, 16 unanswered). The messages iterator is read on that loop.

    The loop's thread ends the loop as ``asyncio.run`` does (:func:`_serve`): whatever task is
    left on it (the batchers' of a client that was never closed) is cancelled and finishes
    before the loop closes. It is stopped by :meth:`close` (which waits for its end), by a
    ``weakref.finalize`` when the client is collected without ``close()`` (which only tells
    the loop to stop: a finalizer runs in whatever thread the collection happens, and must
    not stall it while the loop ends), and at interpreter exit by :func:`_end_loops_at_exit`
    for every loop not ended yet (it waits for each): else those tasks were destroyed
    pending, each logged as "Task was destroyed but it is pending!". (A client whose streams
    are open is referenced by grpc until they end; the batchers' tasks end by themselves
    once idle.)"""

    def __init__(self, target: str, creds: grpc.ChannelCredentials | None, options: list) -> None:
        self._target = target
        self._creds = creds
        self._options = options
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._channel = None
        self._channels: list = []  # the channel made on the loop, for _serve to close if close() did not
        self._stop: weakref.finalize | None = None
        self._closed = False

    def run(self, work):
        """``await work(channel)`` on the loop; its result or its exception. Interrupting the
        caller (KeyboardInterrupt) cancels the work."""
        loop = self.loop  # before the coroutine is made: FailedPrecondition once closed
        with self._lock:  # scheduled before close() stops the loop, or refused
            if self._closed:
                raise errors.FailedPrecondition("the client is closed")
            future = asyncio.run_coroutine_threadsafe(self._on_channel(work), loop)
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            raise closed_during_call() from None
        except grpc.aio.AioRpcError as err:
            if self._closed and err.code() == grpc.StatusCode.CANCELLED:  # its channel closed under it
                raise closed_during_call() from None
            raise
        except errors.QdelayError as err:
            if self._closed and getattr(err, "code", None) == grpc.StatusCode.CANCELLED:  # translated
                raise closed_during_call() from None
            raise
        except BaseException:
            future.cancel()
            raise

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The private loop (started on first use); FailedPrecondition once closed (a loop made
        again after close() would be one nobody stops)."""
        loop = self._loop
        if loop is not None:  # no lock once it runs: every send() from every thread asks
            return loop
        with self._lock:
            if self._closed:
                raise errors.FailedPrecondition("the client is closed")
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(
                    target=_serve, args=(loop, self._channels), name="qdelay-client-bulk", daemon=True
                )
                with _LIVE_LOCK:
                    _LIVE[thread] = loop
                thread.start()
                # references the loop and its thread, not self: runs when self is collected
                # (never waits); at exit _end_loops_at_exit ends what is left, waiting
                self._stop = weakref.finalize(self, _stop_loop, loop, thread)
                self._stop.atexit = False
                self._loop, self._thread = loop, thread
            return self._loop

    async def _on_channel(self, work):
        if self._channel is None:
            if self._creds is None:
                self._channel = grpc.aio.insecure_channel(self._target, self._options)
            else:
                self._channel = grpc.aio.secure_channel(self._target, self._creds, self._options)
            self._channels.append(self._channel)
        return await work(self._channel)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            loop, thread, stop = self._loop, self._thread, self._stop
            self._loop, self._thread, self._stop = None, None, None
        if loop is None or stop is None:
            return
        if self._channel is not None:
            asyncio.run_coroutine_threadsafe(self._channel.close(), loop).result(10)
            self._channel = None
            self._channels.clear()
        stop.detach()
        _stop_loop(loop, thread, wait=10.0)  # close() waits for the loop's end

    def on_loop(self) -> bool:
        """Whether the caller runs on the loop's own thread."""
        return self._thread is not None and threading.current_thread() is self._thread

    def close_later(self, closing: list[Callable[[], Awaitable[Any]]]) -> None:
        """:meth:`close` from the loop's own thread, which must not wait for the loop: the
        loop awaits each of ``closing`` (the batchers' close), then stops; ``_serve`` then
        closes the channel and the loop, as it does after :meth:`close`."""
        with self._lock:
            self._closed = True
            loop, stop = self._loop, self._stop
            self._loop, self._thread, self._stop = None, None, None
        if loop is None or stop is None:
            return
        stop.detach()

        async def end() -> None:
            for close in closing:
                try:
                    await close()
                except errors.QdelayError:
                    pass  # each waiting caller got its own error
            loop.stop()

        loop.create_task(end(), name="qdelay-client-close")


# the bulk loops whose thread has not ended yet (by thread), for _end_loops_at_exit
_LIVE: dict[threading.Thread, asyncio.AbstractEventLoop] = {}
_LIVE_LOCK = threading.Lock()


def _serve(loop: asyncio.AbstractEventLoop, channels: list) -> None:
    """The bulk loop's thread: runs it until stopped, then ends it as ``asyncio.run`` ends its
    loop: every task left is cancelled and awaited, the channel closed, then the loop."""
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        try:
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            if tasks:
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            for channel in channels:
                loop.run_until_complete(channel.close())
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()
            with _LIVE_LOCK:
                _LIVE.pop(threading.current_thread(), None)


def _stop_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread | None, wait: float = 0.0) -> None:
    """Stop the bulk loop; with ``wait``, wait up to that many seconds for its thread to end
    it (never when this is that thread: a client collected on its own loop)."""
    try:
        loop.call_soon_threadsafe(loop.stop)
    except RuntimeError:  # closed already
        pass
    if wait and thread is not None and thread is not threading.current_thread():
        thread.join(wait)


@atexit.register
def _end_loops_at_exit() -> None:
    """At interpreter exit, every bulk loop not ended yet (its client still open, or collected
    and ending) is stopped and waited for, so that its tasks end before the interpreter
    does."""
    with _LIVE_LOCK:
        live = list(_LIVE.items())
    for thread, loop in live:
        _stop_loop(loop, thread, wait=10.0)


class _Ids:
    def __init__(self) -> None:
        self._prefix = "c" + os.urandom(8).hex() + "-"
        self._count = itertools.count(1)

    def __call__(self) -> str:
        return f"{self._prefix}{next(self._count):x}"


# send_many's receipts are the same Receipt as send's (the old name stays for callers)
SentReceipt = Receipt


class SentReceipts(LazyReceipts):
    """What ``send_many`` returns: every message's receipt, in input order, as
    :class:`~qdelay.client.types.Receipt`, made when read. A receipt object per message would cost the
    producer more CPU than sending it (they are built from the compact answers)."""

    def __init__(self) -> None:
        self._chunks: list[tuple] = []  # (ids, first sequence, due times, shard) or (None, 0, [Receipt], "")
        self._ends: list[int] = []
        self._len = 0

    def _add(self, ids: list[str], response: pb.SendBatchResponse) -> None:
        chunk: tuple
        if response.receipts or not ids:  # a full answer (a server without compact receipts)
            chunk = (None, 0, [Receipt.from_pb(r) for r in response.receipts], "")
        else:
            if len(response.deliver_at_ms) != len(ids):
                raise errors.InvariantViolation(
                    f"compact answer has {len(response.deliver_at_ms)} due times for {len(ids)} messages"
                )
            chunk = (ids, response.first_sequence, response.deliver_at_ms, response.shard)
        self._chunks.append(chunk)
        self._len += len(chunk[2])
        self._ends.append(self._len)

    def __len__(self) -> int:
        return self._len

    def _at(self, index: int) -> Receipt:
        k = bisect.bisect_right(self._ends, index)
        ids, first, dues, shard = self._chunks[k]
        j = index - (self._ends[k] - len(dues))
        return dues[j] if ids is None else Receipt(ids[j], dues[j], first + j, shard)

    def __iter__(self) -> Iterator:
        for ids, first, dues, shard in self._chunks:
            if ids is None:
                yield from dues
            else:
                yield from map(Receipt, ids, dues, itertools.count(first), itertools.repeat(shard))

    def __repr__(self) -> str:
        return f"<SentReceipts of {self._len} messages>"


class Client:
    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        token: str | None = None,
        tls: bool = False,
        tls_ca: str | bytes | None = None,
        tls_server_name: str | None = None,
        timeout: float = 30.0,
        retries: int = 3,
        retry_backoff: float = 0.1,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        options: Sequence[tuple] = (),
        batching: Batching | bool = True,
        keepalive: float | None = KEEPALIVE_S,
    ) -> None:
        """``batching``: how concurrent ``send()`` calls are gathered into SendStream batches
        (a :class:`~qdelay.client.batching.Batching`; True: its defaults); False sends one
        unary Send per call. ``keepalive``: seconds between HTTP/2 pings while a call is open
        (a consumer's idle stream), so that a dead connection is noticed; None turns them
        off. Keep it at or above the server's ``min_ping_interval_ms`` (10 s), which refuses
        faster pings with GOAWAY. ``target``: HOST:PORT (or a gRPC ``unix:``/``dns:`` target),
        refused at once (InvalidArgument) without its port, which gRPC would take as 443."""
        check_target(target)
        opts = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            *RECONNECT_OPTIONS,
            *keepalive_options(keepalive),
            *options,
        ]
        if tls or tls_ca is not None:
            root = tls_ca
            if isinstance(tls_ca, str):
                with open(tls_ca, "rb") as f:
                    root = f.read()
            if tls_server_name:
                opts.append(("grpc.ssl_target_name_override", tls_server_name))
            creds = grpc.ssl_channel_credentials(root_certificates=root)
            self.channel = grpc.secure_channel(target, creds, opts)
        else:
            creds = None
            self.channel = grpc.insecure_channel(target, opts)
        self.stub = pb_grpc.DelayServiceStub(self.channel)
        self._bulk = _BulkSender(target, creds, opts)  # send_many's grpc.aio channel, made on first use
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.timeout = timeout
        self.retries = retries
        self.retry_backoff = retry_backoff
        self._ids = _Ids()
        self.batching = Batching() if batching is True else (batching or None)
        self._batcher: SendBatcher | None = None  # lives on the bulk loop, made by the first send
        # concurrent cancel() calls share CancelBatch calls on the bulk loop, as sends share batches
        self._canceller: CancelBatcher | None = None
        self._rescheduler: RescheduleBatcher | None = None  # reschedule()'s, as cancel()'s
        self._consumers: weakref.WeakSet[Consumer] = weakref.WeakSet()  # closed by close()
        self._closed = False

    # ------------------------------------------------------------------ plumbing
    def _call(
        self,
        method: Callable[..., Any],
        request: Any,
        timeout: float | None,
        retried_answer: Callable[[Any], Any] | None = None,
    ) -> Any:
        """One call with the retry policy of :func:`call_async` (``retried_answer`` as there)."""
        self._open()  # a closed channel raises grpc's ValueError, outside the exception tree
        attempt = 0
        while True:
            attempt += 1
            try:
                response = method(request, timeout=timeout or self.timeout, metadata=self.metadata)
            except grpc.RpcError as e:
                if not stream_cut(e, self._closed) or attempt > self.retries:  # call_async's policy
                    raise translate(e, attempt) from None
                time.sleep(retry_wait(self.retry_backoff, attempt))
                continue
            return retried_answer(response) if retried_answer is not None and attempt > 1 else response

    def close(self) -> None:
        """Closes the consumers (their iteration ends, as the asyncio client's), waits for
        the answers of sends, cancels and reschedules still queued in the batching paths,
        then closes. A batched call from another thread meanwhile, or after it, raises
        FailedPrecondition (a batcher made again would be one nobody closes: its stream cut
        by the channel's close, its callers left waiting for their timeout). Called on the
        client's own I/O loop (a callback run there), it does not wait: the loop closes the
        batchers, then ends."""
        self._closed = True
        close_consumers(list(self._consumers))  # together: one timeout for all
        batchers = []
        for name in ("_batcher", "_canceller", "_rescheduler"):
            batcher = getattr(self, name)
            if batcher is not None:
                setattr(self, name, None)
                batchers.append(batcher)
        if self._bulk.on_loop():
            # called on the I/O loop itself (a callback run there): waiting for that loop
            # here would wait for ever; the loop closes the batchers, then ends
            self._bulk.close_later([b.close for b in batchers])
        else:
            for batcher in batchers:
                try:
                    self._bulk.run(lambda _channel, b=batcher: b.close())
                except errors.QdelayError:
                    pass  # each waiting caller got its own error
            self._bulk.close()
        self.channel.close()

    def _open(self) -> None:
        if self._closed:
            raise errors.FailedPrecondition("the client is closed")

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Wait until the channel is connected; DeadlineExceeded if it is not within
        ``timeout`` seconds (grpc's FutureTimeoutError is outside the exception tree)."""
        self._open()  # a closed channel is never ready: say so at once
        future = grpc.channel_ready_future(self.channel)
        try:
            future.result(timeout=timeout)
        except grpc.FutureTimeoutError:
            future.cancel()  # stops its polling thread
            raise not_ready(timeout) from None

    # ------------------------------------------------------------------ producer
    def message(
        self,
        subject: str,
        payload: bytes = b"",
        *,
        delay: timedelta | None = None,
        delay_ms: int | timedelta | None = None,
        deliver_at: datetime | None = None,
        deliver_at_ms: int | None = None,
        headers: dict[str, str] | None = None,
        message_id: str | None = None,
    ) -> pb.Message:
        """Build a Message; at most one of ``delay`` (a timedelta), ``delay_ms`` (ms or a timedelta),
        ``deliver_at`` (an aware datetime) and ``deliver_at_ms`` (default: delay 0)."""
        o = outgoing(subject, payload, delay, delay_ms, deliver_at, deliver_at_ms, headers, message_id or "")
        msg = pb.Message(
            subject=o.subject,
            payload=o.payload,
            headers=o.headers or {},
            message_id=o.message_id or (self._ids() if self.retries else ""),
        )
        _set_due(msg, o)
        return msg

    def _with_ids(self, messages: Iterable[pb.Message], always: bool = False) -> list[pb.Message]:
        out = list(messages)
        if self.retries or always:
            for m in out:
                if not m.message_id:
                    m.message_id = self._ids()
        return out

    def _ids_of(self, messages: list[pb.Message]) -> list[str]:
        """Every message's id, giving one to those without."""
        ids = [m.message_id for m in messages]
        if not all(ids):
            for i, m in enumerate(messages):
                if not ids[i]:
                    ids[i] = m.message_id = self._ids()
        return ids

    def send(
        self,
        subject: str,
        payload: bytes = b"",
        *,
        delay: timedelta | None = None,
        delay_ms: int | timedelta | None = None,
        deliver_at: datetime | None = None,
        deliver_at_ms: int | None = None,
        headers: dict[str, str] | None = None,
        message_id: str | None = None,
        timeout: float | None = None,
    ) -> Receipt:
        """Schedule one message; its :class:`Receipt` once it is durable.

        The due time: one of ``delay`` (a :class:`~datetime.timedelta`), ``delay_ms`` (ms, or
        a timedelta), ``deliver_at`` (an aware datetime) or ``deliver_at_ms`` (Unix epoch ms);
        none is "now".

        With batching (the default) concurrent calls from many threads share SendStream
        batches; each caller gets its own receipt or its own error. ``timeout``: how long
        to wait for the receipt (DeadlineExceeded after it: whether it was written is
        unknown; its id is the message's, so sending it again with the same
        ``message_id`` is safe)."""
        o = outgoing(subject, payload, delay, delay_ms, deliver_at, deliver_at_ms, headers, message_id or self._ids())
        if self.batching is None:
            msg = pb.Message(subject=o.subject, payload=o.payload, headers=o.headers or {}, message_id=o.message_id)
            _set_due(msg, o)
            return Receipt.from_pb(self._call(self.stub.Send, pb.SendRequest(message=msg), timeout).receipt)
        batcher = self._batcher or self._bulk.run(self._make_batcher)
        waiter = batcher.submit_threadsafe(self._bulk.loop, o)
        timeout = timeout or self.timeout
        try:
            return waiter.wait(timeout)  # gives up (left out of its batch if not sent yet) on timeout
        except WaitTimeout:
            raise DeadlineExceeded(f"DEADLINE_EXCEEDED: no receipt within {timeout} s") from None

    async def _make_batcher(self, channel: grpc.aio.Channel) -> SendBatcher:
        """The batcher of ``send()``, made once on the bulk loop (its owner)."""
        if self.batching is None:
            raise errors.InvariantViolation("send() made a batcher with batching off")
        self._open()  # on the loop, after close() began: no batcher made again
        if self._batcher is None:
            self._batcher = SendBatcher(
                lambda: channel,
                lambda batch: self._encode_outgoing(batch)[0],
                translate,
                self.metadata,
                self.batching,
                self.retries,
                self.retry_backoff,
            )
        return self._batcher

    def send_batch(self, messages: Iterable[pb.Message], timeout: float | None = None) -> list[Receipt]:
        """One SendBatch: all-or-nothing validation, one durable group commit."""
        request = pb.SendBatchRequest(messages=self._with_ids(messages))
        return [Receipt.from_pb(r) for r in self._call(self.stub.SendBatch, request, timeout).receipts]

    def send_many(
        self,
        messages: Iterable[pb.Message | Outgoing],
        batch_size: int = 1000,
        max_in_flight: int = 4,
        timeout: float | None = None,
    ) -> SentReceipts:
        """Send any number of messages as pipelined batches; their receipts in input order
        (:class:`SentReceipts`: a sequence of :class:`SentReceipt`).

        ``messages`` are ``Message`` objects or :class:`Outgoing` tuples (not mixed within
        one batch); tuples are encoded without a protobuf object per message, the cheapest
        way to send in bulk.

        The batches go over SendStream, up to ``max_in_flight`` of them unanswered: a
        streamed batch costs the server about half the CPU of a SendBatch call. A stream
        is ended and a new one opened after ``timeout``/2 seconds, so that ``timeout`` (the
        deadline of each stream) bounds how long a stalled server can block this call.
        Stops at the first failed batch and raises its error (with ``.receipts`` holding the
        receipts of every batch acknowledged before it, in order). An error raised by
        ``messages`` itself is raised as it is once the batches taken before it are answered
        (their receipts in its ``.receipts``); the messages it had given for the batch it
        broke are not sent. If a stream breaks with
        UNAVAILABLE, is cut with CANCELLED by a stopping server, or ends with a lost status,
        its unanswered batches are sent again on a new one (at most ``retries`` times in a
        row; they keep their message ids, so what was written is answered with its
        original receipt).
        """
        if batch_size < 1 or max_in_flight < 1:
            raise errors.InvalidArgument("batch_size and max_in_flight must be at least 1")
        next_request = self._next_requests(messages, batch_size)
        return self._bulk.run(
            lambda channel: self._send_many(channel, next_request, max_in_flight, timeout or self.timeout)
        )

    def _next_requests(self, messages: Iterable[pb.Message | Outgoing], batch_size: int) -> NextRequest:
        """send_many's source of requests (both clients'): each call takes the next
        ``batch_size`` messages (``islice``: no Python step a message; the asyncio client's
        loop a message cost ~2 us more a batch of 100) and gives the request and its ids."""
        source = iter(messages)

        def next_request() -> tuple[bytes, list[str]] | None:
            batch = list(itertools.islice(source, batch_size))
            if not batch:
                return None
            # compact receipts: the answer carries due times and the first sequence only,
            # so every message needs its own id here
            if isinstance(batch[0], tuple):
                return self._encode_outgoing(batch)
            messages = cast("list[pb.Message]", batch)
            ids = self._ids_of(messages)
            return pb.SendBatchRequest(messages=messages, compact_receipts=True).SerializeToString(), ids

        return next_request

    async def _send_many(
        self, channel: grpc.aio.Channel, next_request: NextRequest, max_in_flight: int, timeout: float
    ) -> SentReceipts:
        """send_many on the bulk channel's loop: streams one after another until every
        batch is answered; a stream cut (``stream_cut``: UNAVAILABLE, CANCELLED, a lost
        status), or one the server ended before answering every batch (a server shutting
        down answers what it read and ends its streams: the rest was not written), opens a
        new stream that sends the unanswered again (same ids)."""
        stream = channel.stream_stream(
            _SEND_STREAM, request_serializer=None, response_deserializer=pb.SendBatchResponse.FromString
        )
        receipts = SentReceipts()
        unanswered: deque[tuple[bytes, list[str]]] = deque()
        attempt = 1
        while True:
            if self._closed:  # close() closes the channel under this call: no new stream on it
                raise closed_during_call(receipts)  # (grpc's UsageError "Channel is closed." else)
            answered = len(receipts)
            try:
                done = await self._stream_batches(stream, next_request, unanswered, receipts, max_in_flight, timeout)
                if done:
                    return receipts
                if done is None:  # ended by the server with batches unanswered: as UNAVAILABLE
                    if len(receipts) > answered:
                        attempt = 1  # as below: it answered batches before it ended
                    if attempt > self.retries:
                        # raised as is: the QdelayError clause below gives it the receipts
                        raise errors.Unavailable(
                            f"SendStream ended by the server with {len(unanswered)} batches unanswered"
                        )
                    await asyncio.sleep(retry_wait(self.retry_backoff, attempt))
                    attempt += 1
                    continue
                attempt = 1  # a stream ended on time: the next one starts a fresh count
            except grpc.RpcError as e:
                # as SendBatcher's: a lost status (a refusal racing the next batch's write:
                # INTERNAL "Internal error from Core", ~1 in 7 refused streams) is tried again,
                # and the refused batch is refused again with the server's own status; a stream
                # a stopping server cut (CANCELLED) is sent again (it raised, once in 60 restarts)
                if self._closed:  # the stream's end is close()'s doing (its channel closed), whatever it says
                    raise closed_during_call(receipts) from None
                if len(receipts) > answered:
                    attempt = 1  # it answered batches before it broke: the count of tries in a row starts again
                if not stream_cut(e, self._closed) or attempt > tries_allowed(self.retries, e):
                    err = translate(e, attempt)
                    err.receipts = receipts
                    raise err from None
                await asyncio.sleep(retry_wait(self.retry_backoff, attempt))
                attempt += 1
            except errors.QdelayError as err:  # a message the client could not encode
                err.receipts = receipts
                raise
            except grpc.aio.UsageError as e:  # grpc's "Channel is closed." as a new stream opened
                if self._closed:
                    raise closed_during_call(receipts) from None
                closed = channel_closed(e)  # closed otherwise (the asyncio client's channel, by its holder)
                closed.receipts = receipts
                raise closed from None
            except Exception as err:
                # the caller's iterator raised: its own error, with the receipts of the
                # batches taken before it (all answered)
                with contextlib.suppress(AttributeError, TypeError):
                    err.receipts = receipts  # type: ignore[attr-defined]
                raise

    def _encode_outgoing(self, batch: list) -> tuple[bytes, list[str]]:
        """A SendBatchRequest (compact receipts) of :class:`Outgoing` tuples, as wire bytes, and
        its message ids (an empty one is given a fresh id)."""
        try:
            return _encode_request(batch, self._ids)
        except (TypeError, ValueError, OverflowError) as err:
            raise errors.InvalidArgument(
                f"send_many: a message is not an Outgoing tuple of the right types "
                f"(subject str, payload bytes, one time an int, the other None): "
                f"{err}"
            ) from None

    async def _stream_batches(
        self,
        stream: Any,
        next_request: NextRequest,
        unanswered: deque,
        receipts: SentReceipts,
        max_in_flight: int,
        timeout: float,
    ) -> bool | None:
        """One SendStream: first the batches still unanswered from a broken one, then new
        ones. Returns True when every batch is answered, False when it ended on time
        (``timeout``/2 after it started) with batches left to send, None when the server
        ended it with batches unanswered (they stay in ``unanswered``). A message that
        cannot be encoded, or an error of the caller's iterator, ends the requests; the
        batches before it are answered, then it is raised (raised inside the request
        iterator, grpc.aio would swallow it: it cancels the call, which reads as a stream
        cut, and the messages taken from the iterator for that batch were lost without a
        word)."""
        credit = asyncio.Semaphore(max_in_flight)
        # "packs": whether the server said it takes packed requests (wire.PACKED_REQUESTS);
        # False until its first answer, then True or None (an older server: never)
        state: dict = {"exhausted": False, "error": None, "ended": False, "packs": False}
        ends_at = time.monotonic() + timeout / 2

        def take() -> tuple[bytes, list[str]] | None:
            try:
                item = next_request()
            except Exception as err:  # noqa: BLE001 - raised once the batches before it are answered
                state["error"] = err
                return None
            if item is None:
                state["exhausted"] = True
                return None
            unanswered.append(item)  # before it is sent: a break re-sends it
            return item

        async def requests():
            for request, _ids in list(unanswered):  # sent again, in order, ahead of anything new
                await credit.acquire()
                if state["ended"]:
                    return
                yield request
            while time.monotonic() < ends_at:
                await credit.acquire()
                if state["ended"]:
                    return
                item = take()
                if item is None:
                    return
                if not state["packs"] or credit.locked():
                    yield item[0]
                    continue
                # credit for more than one batch (the answers of a group commit came together):
                # the batches ready now go as one stream message (SendBatchRequest.more), each
                # still its own batch: validated, written and answered as if sent alone
                pack, size = [item[0]], len(item[0])
                while not credit.locked() and size < PACK_BYTES:
                    await credit.acquire()  # free: no wait
                    more = take()
                    if more is None:
                        credit.release()
                        break
                    pack.append(more[0])
                    size += len(more[0])
                yield pack[0] if len(pack) == 1 else wire.pack_send_batch_requests(pack)
                if state["exhausted"] or state["error"] is not None:
                    return

        # merged answers (wire.MERGE_ANSWERS): the answers ready together come as one message
        call = stream(requests(), timeout=timeout, metadata=(*self.metadata, wire.MERGE_ANSWERS))
        try:
            async for response in call:
                if state["packs"] is False:  # known once: its initial metadata came before its first answer
                    state["packs"] = wire.PACKED_REQUESTS in list(await call.initial_metadata() or ()) or None
                for answer in (response, *response.more) if response.more else (response,):
                    if not unanswered:
                        raise errors.InvariantViolation("SendStream answered a batch that was not sent")
                    receipts._add(unanswered.popleft()[1], answer)
                    credit.release()
        except asyncio.CancelledError:
            if not cancelled_by_grpc():
                raise
            raise CancelledByGrpc() from None  # a stream cut: its unanswered batches go again
        finally:
            call.cancel()  # a no-op once the call ended; stops the request generator otherwise
            # a generator waiting for credit the ended call will never give back ends now:
            # else grpc's task that reads it stayed pending for the loop's life, one per
            # refused stream ("Task was destroyed but it is pending!" when the loop closed)
            state["ended"] = True
            credit.release()
        if state["error"] is not None:
            raise state["error"]
        if unanswered:
            return None
        return state["exhausted"]

    def cancel(
        self, receipt: Target | None = None, timeout: float | None = None, *, message_id: str | None = None
    ) -> str:
        """'CANCELLED', 'ALREADY_DELIVERED', 'NOT_FOUND', 'ALREADY_CANCELLED' or 'DEAD_LETTERED'.

        ``receipt``: a :class:`Receipt`, its string form, the message id alone, or a
        ``qdelay.v1.Receipt``; or ``message_id=`` (by id).

        With batching (the default) cancels made at the same moment from many threads share
        CancelBatch calls (:class:`~qdelay.client.batching.CancelBatcher`); each caller gets
        its own outcome or its own error. ``batching=False``: one unary Cancel per call.
        ``timeout``: how long this caller waits (DeadlineExceeded after it, even when its
        target rides in a call that goes on for other callers: whether it was cancelled is
        then unknown, as for a unary call that timed out; cancelling again is safe)."""
        if self.batching is None:
            request = cancel_request(receipt, message_id)
            outcome = self._call(self.stub.Cancel, request, timeout, first_try_cancel).outcome
            return CANCEL_OUTCOMES.get(outcome, str(outcome))
        outcome = self._gathered("_canceller", cancel_batcher, cancel_target(receipt, message_id), timeout)
        return CANCEL_OUTCOMES.get(outcome, str(outcome))

    def _gathered(
        self,
        name: str,
        make: Callable[[pb_grpc.DelayServiceStub, Any, Batching], TargetBatcher],
        request: Any,
        timeout: float | None,
    ) -> Any:
        """``request``'s answer through the batcher of ``cancel()`` or ``reschedule()`` (the
        attribute ``name``; made by ``make`` once, on the bulk loop, its owner, calling on the
        bulk channel), or its error; DeadlineExceeded once ``timeout`` passed (the caller gives
        up: left out of its call if that was not cut yet)."""
        batcher = getattr(self, name)
        if batcher is None:

            async def made(channel: grpc.aio.Channel) -> TargetBatcher:
                if self.batching is None:
                    raise errors.InvariantViolation(f"{name} made with batching off")
                self._open()  # on the loop, after close() began: no batcher made again
                if getattr(self, name) is None:
                    setattr(self, name, make(pb_grpc.DelayServiceStub(channel), self, self.batching))
                return getattr(self, name)

            batcher = self._bulk.run(made)
        timeout = timeout or self.timeout
        waiter = batcher.submit_threadsafe(self._bulk.loop, request, timeout)
        try:
            return waiter.wait(timeout)
        except WaitTimeout:
            raise deadline_exceeded(timeout) from None

    def cancel_many(self, targets: Iterable[Target], timeout: float | None = None, batch_size: int = 1000) -> list[str]:
        """Cancel many messages with CancelBatch calls of up to ``batch_size`` (at most the
        server's ``limits.max_batch``) targets each; one outcome per target, in order (as
        :meth:`cancel` answers: after a retried call, ALREADY_CANCELLED reads CANCELLED). Each
        target is anything :meth:`cancel` takes."""
        out: list[str] = []
        for req in cancel_batches(targets, batch_size):
            out.extend(cancel_outcomes(self._call(self.stub.CancelBatch, req, timeout, first_try_cancel)))
        return out

    def reschedule(
        self,
        target: Target | None = None,
        *,
        message_id: str | None = None,
        delay: timedelta | None = None,
        delay_ms: int | timedelta | None = None,
        deliver_at: datetime | None = None,
        deliver_at_ms: int | None = None,
        timeout: float | None = None,
    ) -> tuple[str, Receipt | None]:
        """Move a pending message to a new due time: ('RESCHEDULED', its new receipt), or
        ('ALREADY_DELIVERED' | 'CANCELLED' | 'NOT_FOUND', None). ``target`` is anything
        :meth:`cancel` takes, or ``message_id=`` (by id, as ``cancel``); the time as for
        :meth:`send` (one of them). The message keeps
        its id; it is never delivered at the old time once this returns RESCHEDULED.

        With batching (the default) reschedules made at the same moment from many threads
        share RescheduleBatch calls (:class:`~qdelay.client.batching.RescheduleBatcher`, the
        policy of ``cancel()``'s); each caller gets its own answer or its own error, within
        its own ``timeout`` (DeadlineExceeded after it: whether it moved is then unknown, as
        for a unary call that timed out; its receipt, or a Get by id, tells).
        ``batching=False``: one unary Reschedule per call."""
        req = reschedule_request(target, reschedule_when(delay, delay_ms, deliver_at, deliver_at_ms), message_id)
        if self.batching is None:
            return reschedule_result(self._call(self.stub.Reschedule, req, timeout))
        return reschedule_result(self._gathered("_rescheduler", reschedule_batcher, req, timeout))

    def reschedule_many(
        self,
        targets: Iterable[Target],
        *,
        delay: timedelta | None = None,
        delay_ms: int | timedelta | None = None,
        deliver_at: datetime | None = None,
        deliver_at_ms: int | None = None,
        timeout: float | None = None,
        batch_size: int = 1000,
    ) -> list[tuple[str, Receipt | None]]:
        """Move many messages to one new time with RescheduleBatch calls of up to
        ``batch_size`` (at most the server's ``limits.max_batch``) targets each; one answer
        per target, in order (as :meth:`reschedule` answers). A batch with one bad target is
        refused whole (INVALID_ARGUMENT naming ``requests[i]``), nothing of it moved."""
        out: list[tuple[str, Receipt | None]] = []
        when = reschedule_when(delay, delay_ms, deliver_at, deliver_at_ms)
        for req in reschedule_batches(targets, when, batch_size):
            resp = self._call(self.stub.RescheduleBatch, req, timeout)
            out.extend(reschedule_result(r) for r in resp.responses)
        return out

    def get(
        self, receipt: Target | None = None, timeout: float | None = None, *, message_id: str | None = None
    ) -> Status:
        """The message's :class:`Status` (``.state``: 'PENDING', 'DELIVERED', ...); takes what
        :meth:`cancel` takes."""
        r, mid = ref_or_id(receipt, message_id)
        return Status.from_pb(self._call(self.stub.Get, pb.GetRequest(receipt=r, message_id=mid), timeout))

    @staticmethod
    def state_name(resp: Status | pb.GetResponse) -> str:
        if isinstance(resp, Status):
            return str(resp.state)
        return STATES[resp.state]

    def stats(self, timeout: float | None = None, *, subject: str = "", group: str = "") -> dict:
        """The server's figures, and its consumer groups (``groups``): every one, or only
        those of ``subject``, those named ``group``, or that one group (a narrow question
        costs the server the groups it lists, not all of them)."""
        return stats_dict(self._call(self.stub.Stats, pb.StatsRequest(subject=subject, group=group), timeout))

    def create_group(self, subject: str, group: str, timeout: float | None = None) -> bool:
        """Create a consumer group of ``subject`` (as its first subscribe would): from now on
        it receives every message of the subject that becomes due. False if it existed."""
        req = pb.ChangeGroupRequest(op=pb.ChangeGroupRequest.CREATE, subject=subject, group=group)
        return self._call(self.stub.ChangeGroup, req, timeout).changed

    def delete_group(self, subject: str, group: str, timeout: float | None = None) -> bool:
        """Delete a consumer group; what it had due and in flight is dropped. False if it
        did not exist."""
        req = pb.ChangeGroupRequest(op=pb.ChangeGroupRequest.DELETE, subject=subject, group=group)
        return self._call(self.stub.ChangeGroup, req, timeout).changed

    def groups(self, timeout: float | None = None, *, subject: str = "", group: str = "") -> list[dict]:
        """Consumer groups (every one, or narrowed as :meth:`stats` narrows them): subject,
        group, consumers, backlog, in_flight, backlog_on_disk, backlog_on_disk_count,
        backlog_retrying."""
        return self.stats(timeout, subject=subject, group=group)["groups"]

    def health(self, timeout: float = 5.0, service: str = "") -> str:
        """The server's gRPC health status ('SERVING', 'NOT_SERVING'...) for ``service``:
        ``""`` the server, ``"qdelay.master"`` whether it takes writes now (docs/api.md)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        self._open()
        stub = health_pb2_grpc.HealthStub(self.channel)
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout, metadata=self.metadata)
        except grpc.RpcError as e:
            raise translate(e) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    # ------------------------------------------------------------------ consumer
    def subscribe(
        self, subject: str, group: str = "default", max_in_flight: int = 1000, *, wait_for_group: bool = False
    ) -> Consumer:
        """A consumer of ``subject``/``group`` (the first Subscribe creates the group).
        ``wait_for_group``: a refusal (FAILED_PRECONDITION: a slave, which may not create the
        group, before the GROUP record reached it) is waited out like a lost stream."""
        self._open()
        consumer = Consumer(self, subject, group, max_in_flight, wait_for_group=wait_for_group)
        self._consumers.add(consumer)
        return consumer


_END = object()
log = logging.getLogger("qdelay.client")


def close_consumers(consumers: Iterable[Consumer], timeout: float = 5.0) -> None:
    """Close blocking consumers together (:meth:`Consumer.close` of each): every stream
    half-closed first, then one ``timeout`` for all of them to end (a call not ended by then
    is cancelled). One after another, a server that does not answer (stopped, a network
    gone silent) cost each consumer its whole timeout: Client.close() with 3 took 15 s."""
    ending = [e for e in (c.half_close() for c in consumers) if e is not None]
    deadline = time.monotonic() + timeout
    for ended, call in ending:
        if not ended.wait(max(0.0, deadline - time.monotonic())):
            call.cancel()


def resubscribes(error: grpc.RpcError, wait_for_group: bool) -> bool:
    """Whether a consumer whose stream ended with ``error`` subscribes again (with backoff)
    instead of raising it, for the blocking and the asyncio consumers: a server gone or
    shutting down (UNAVAILABLE, CANCELLED); with ``wait_for_group`` a refusal too
    (FAILED_PRECONDITION: a slave, which may not create a group, before the GROUP record
    reached it; or a fenced master); or a lost status
    (:func:`~qdelay.client.batching.lost_status`: grpc.aio failed to write an ack on a stream
    that a server stopping had just ended, or that a killed one broke, and reports INTERNAL
    instead of the stream's own status; it ended asyncio consumers at a server restart).
    Safe: what was in flight is delivered again, and a refusal lost this way is seen on the
    next subscription."""
    code = error.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED) or lost_status(error):
        return True
    return wait_for_group and code == grpc.StatusCode.FAILED_PRECONDITION


def how_it_ended(error: grpc.RpcError) -> str:
    """How a consumer's stream ended with ``error``, for its log line ("ended" alone: the
    server ended it with OK)."""
    return f"ended ({error.code().name}: {error.details()})"


class Consumer:
    """One subscription: iterate deliveries (or batches of them) and ack them; it survives
    the server.

    Deliveries not acknowledged within the server's ack timeout are delivered again
    (``attempt`` + 1), to this or another consumer of the subject. At most
    ``max_in_flight`` unacknowledged deliveries are outstanding at once.

    When the stream breaks with UNAVAILABLE or the server ends it (a shutdown ends every
    stream), the consumer subscribes again by itself with backoff (up to 2 s between
    tries), with the same subject, group and credit; acks not yet sent go on the new
    stream; what was in flight is delivered again by the server (at-least-once). A lost
    status (INTERNAL "Internal error from Core": an ack written as the stream ended, its
    real status lost) is subscribed again too: the decision is :func:`resubscribes`, the
    asyncio consumer's, which meets it at server restarts (this one's blocking channel
    reports the stream's own status). Iteration ends only after :meth:`close`; other
    errors (UNAUTHENTICATED, any other INTERNAL, ...) are raised.
    With ``wait_for_group`` a FAILED_PRECONDITION (a slave refusing a group it has not got
    yet, or a fenced master) is retried the same way: the cluster clients' consumers on
    slaves wait for the group to be replicated, or for a promotion.
    """

    def __init__(
        self, client: Client, subject: str, group: str, max_in_flight: int, *, wait_for_group: bool = False
    ) -> None:
        self._client = client
        self._wait_for_group = wait_for_group
        self.subject = subject
        self.group = group
        self.max_in_flight = max_in_flight
        self._closed = threading.Event()
        self._read_lock = threading.Lock()  # one reader of the response stream at a time
        self._lock = threading.Lock()  # guards _requests/_call swaps against ack() and close()
        self._pending_acks: list[str] = []
        self.reconnects = 0  # how many times it subscribed again
        self._subscribe = client.channel.stream_stream(
            SUBSCRIBE,
            request_serializer=pb.SubscribeRequest.SerializeToString,
            response_deserializer=deliveries_of(group),
        )
        self._open()

    def _open(self) -> None:
        """A new Subscribe stream with its own request queue (the old one's generator may
        still be parked in grpc's thread: it ends on its own _END)."""
        requests: queue.Queue = queue.Queue()
        with self._lock:
            first = pb.SubscribeRequest(subject=self.subject, group=self.group, max_in_flight=self.max_in_flight)
            if self._pending_acks:
                first.ack_ids.extend(self._pending_acks)
                self._pending_acks = []
            requests.put(first)
            self._requests = requests
            self._call = self._subscribe(self._request_iter(requests), metadata=self._client.metadata)

    @staticmethod
    def _request_iter(requests: queue.Queue) -> Iterator[pb.SubscribeRequest]:
        while True:
            item = requests.get()
            if item is _END:
                return
            yield item

    def _reopen(self, attempt: int, how: str) -> bool:
        """After the stream ended or broke (``how``, for the log): wait (backoff) and
        subscribe again; False once closed."""
        with self._lock:
            old = self._requests
            while True:  # acks queued for the old stream go on the new one
                try:
                    item = old.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, pb.SubscribeRequest):
                    self._pending_acks.extend(item.ack_ids)
            old.put(_END)
        self.reconnects += 1
        delay = retry_wait(self._client.retry_backoff, attempt)
        log.info("subscription %s/%s %s; subscribing again in %.2f s", self.subject, self.group, how, delay)
        # the backoff, or less once the channel has connected again (a restarted server)
        if not reconnect.wait_blocking(self._client.channel, delay, self._closed):
            return False
        try:
            self._open()
        except ValueError:  # grpc's 'Channel closed!': the client's close() is ending this one
            if self._closed.is_set() or self._client._closed:
                return False
            raise
        if self._closed.is_set():
            self._call.cancel()
            return False
        return True

    def batches(self) -> Iterator[list[Delivery]]:
        """Each SubscribeResponse's deliveries as one list of :class:`Delivery` (the
        efficient way)."""
        attempt = 0
        while True:
            how = "ended"
            try:
                with self._read_lock:
                    resp = next(self._call, None)
            except grpc.RpcError as e:
                if self._closed.is_set():
                    return
                if not resubscribes(e, self._wait_for_group):
                    raise translate(e) from None
                resp, how = None, how_it_ended(e)
            if resp is None:
                if self._closed.is_set():
                    return
                attempt += 1
                if not self._reopen(attempt, how):
                    return
                continue
            attempt = 0
            if resp:
                yield resp

    def __iter__(self) -> Iterator[Delivery]:
        for batch in self.batches():
            yield from batch

    def receive(self, count: int, timeout: float) -> list[Delivery]:
        """Deliveries until ``count`` arrived or ``timeout`` seconds passed (whole batches, so
        possibly more than ``count``). Do not mix with iterating the consumer."""
        got: list[Delivery] = []
        deadline = time.monotonic() + timeout

        if not hasattr(self, "_pump"):
            self._inbox: queue.Queue = queue.Queue()

            def pump() -> None:
                try:
                    for batch in self.batches():
                        self._inbox.put(batch)
                except errors.QdelayError as e:
                    self._inbox.put(e)
                self._inbox.put(_END)

            self._pump = threading.Thread(target=pump, daemon=True)
            self._pump.start()
        while len(got) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                item = self._inbox.get(timeout=left)
            except queue.Empty:
                break
            if item is _END:
                self._inbox.put(_END)
                break
            if isinstance(item, Exception):
                raise item
            got.extend(item)
        return got

    def ack(self, deliveries: Iterable) -> None:
        """Acknowledge deliveries (Delivery objects or ack ids); one request for all of them."""
        ids = [d if isinstance(d, str) else d.ack_id for d in deliveries]
        if ids:
            with self._lock:
                self._requests.put(pb.SubscribeRequest(ack_ids=ids))

    def add_credit(self, max_in_flight: int) -> None:
        """Change how many unacknowledged deliveries this consumer accepts (kept across
        resubscriptions)."""
        with self._lock:
            self.max_in_flight = max_in_flight
            self._requests.put(pb.SubscribeRequest(max_in_flight=max_in_flight))

    def close(self, timeout: float = 5.0) -> None:
        """End the stream: acks queued by :meth:`ack` are sent first, then the request side
        is closed and the server ends the stream once it has applied them (it gives what is
        left unacknowledged to other consumers at once). Cancels the call if the server has
        not ended it within ``timeout`` seconds (acks not yet sent then are lost, and those
        deliveries come again: at-least-once)."""
        close_consumers([self], timeout)

    def half_close(self) -> tuple[threading.Event, Any] | None:
        """:meth:`close` but the wait (what :func:`close_consumers` does to many at once): the
        stream half-closed; (an event set once the call has ended, the call), or None when
        closed already."""
        if self._closed.is_set():
            return None
        self._closed.set()
        with self._lock:
            self._requests.put(_END)
            call = self._call
        ended = threading.Event()
        call.add_done_callback(lambda _call: ended.set())

        def drain() -> None:
            # the call's status arrives only after every response was read: read (and drop:
            # they are unacknowledged, the server gives them to others) what nobody else reads
            while not ended.is_set():
                with self._read_lock:
                    if ended.is_set():
                        return
                    try:
                        if next(call, None) is None:
                            return
                    except grpc.RpcError:
                        return

        threading.Thread(target=drain, name="qdelay-consumer-close", daemon=True).start()
        return ended, call

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
