"""The asyncio client of qdelay (grpc.aio): the blocking client's surface, awaited.

    from qdelay.aio import Client

    async with Client("127.0.0.1:7600") as c:
        r = await c.send("order.close", b"order 42", delay=timedelta(minutes=30))
        await c.cancel(r)                      # or str(r), or r.message_id
        receipts = await c.send_many(Outgoing("s", b"x", delay_ms=1000) for _ in range(10_000))
        async with c.subscribe("order.close") as consumer:
            async for batch in consumer.batches():
                await handle(batch)
                consumer.ack(batch)

Concurrent ``send()`` calls (tasks) share SendStream batches and concurrent ``cancel()``
calls share CancelBatch calls (:mod:`qdelay.client.batching`, the blocking client's code
too), each task getting its own Receipt or outcome, or its own error; ``batching=False``
makes one unary Send or Cancel per call. Results are the same types as the blocking client's:
Receipt, Status, SentReceipts, outcome names. Errors are the classes of
:mod:`qdelay.errors`; UNAVAILABLE is retried with backoff (sends keep their ids). A
consumer resubscribes by itself when the server goes away (see :class:`Consumer`).
All of it must be used from one event loop (the one the client was first used on).
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any

import grpc

from qdelay import errors
from qdelay.addresses import check_target
from qdelay.cancellation import cancel_and_wait
from qdelay.client import client as blocking
from qdelay.client import reconnect
from qdelay.client.batching import (
    Batching,
    CancelBatcher,
    CancelledByGrpc,
    RescheduleBatcher,
    SendBatcher,
    cancelled_by_grpc,
    channel_closed,
    retry_wait,
)
from qdelay.client.client import (
    CANCEL_OUTCOMES,
    DEFAULT_TARGET,
    MAX_MESSAGE_BYTES,
    SUBSCRIBE,
    Outgoing,
    SentReceipts,
    _set_due,
    call_async,
    cancel_batcher,
    cancel_outcomes,
    deadline_exceeded,
    deliveries_of,
    first_try_cancel,
    how_it_ended,
    not_ready,
    outgoing,
    reschedule_batcher,
    reschedule_when,
    resubscribes,
    translate,
)
from qdelay.client.types import (
    KEEPALIVE_S,
    RECONNECT_OPTIONS,
    Delivery,
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
from qdelay.v1 import qdelay_pb2 as pb
from qdelay.v1 import qdelay_pb2_grpc as pb_grpc

log = logging.getLogger("qdelay.client")


__all__ = ["Client", "Consumer", "Delivery", "Outgoing", "Receipt", "Status", "Batching"]


class Client:
    # the request building and send_many's streaming are the blocking client's own code:
    # it already runs them as coroutines on a grpc.aio channel (its bulk loop)
    message = blocking.Client.message
    state_name = staticmethod(blocking.Client.state_name)
    _with_ids = blocking.Client._with_ids
    _ids_of = blocking.Client._ids_of
    _encode_outgoing = blocking.Client._encode_outgoing
    _next_requests = blocking.Client._next_requests
    _send_many = blocking.Client._send_many
    _stream_batches = blocking.Client._stream_batches

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
        check_target(target)  # as the blocking client: HOST:PORT, refused at once without its port
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
            self.channel = grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=root), opts)
        else:
            self.channel = grpc.aio.insecure_channel(target, opts)
        self.stub = pb_grpc.DelayServiceStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.timeout = timeout
        self.retries = retries
        self.retry_backoff = retry_backoff
        self._ids = blocking._Ids()
        self.batching = Batching() if batching is True else (batching or None)
        self._batcher: SendBatcher | None = None
        self._canceller: CancelBatcher | None = None  # concurrent cancel() calls share CancelBatch calls
        self._rescheduler: RescheduleBatcher | None = None  # and reschedule() calls RescheduleBatch calls
        # closed by close(); weak: a consumer dropped unclosed is freed (its stream ends)
        self._consumers: weakref.WeakSet[Consumer] = weakref.WeakSet()
        self._closed = False

    # ------------------------------------------------------------------ plumbing
    async def _call(
        self,
        method: Callable[..., Any],
        request: Any,
        timeout: float | None,
        retried_answer: Callable[[Any], Any] | None = None,
    ) -> Any:
        self._open()
        return await call_async(
            method,
            request,
            timeout or self.timeout,
            self.metadata,
            self.retries,
            self.retry_backoff,
            retried_answer,
            lambda: self._closed,
        )

    async def close(self) -> None:
        """Closes the consumers, waits for the answers of queued sends, cancels and
        reschedules, closes the channel. Each part is closed even when one before it fails
        or this task is cancelled meanwhile; calls after it raise FailedPrecondition (a
        batcher made again would be one nobody closes: its task left pending on the loop)."""
        self._closed = True
        batchers = [self._batcher, self._canceller, self._rescheduler]
        self._batcher = self._canceller = self._rescheduler = None
        try:
            # together: one after another, a server that does not answer cost each its timeout
            await asyncio.gather(*(consumer.close() for consumer in list(self._consumers)))
        finally:
            try:
                for batcher in batchers:
                    if batcher is not None:
                        await batcher.close()
            finally:
                await self.channel.close()

    def _open(self) -> None:
        if self._closed:
            raise errors.FailedPrecondition("the client is closed")

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def wait_ready(self, timeout: float = 10.0) -> None:
        """See :meth:`qdelay.client.Client.wait_ready` (DeadlineExceeded, not asyncio's
        TimeoutError; FailedPrecondition once closed)."""
        self._open()
        try:
            async with asyncio.timeout(timeout):
                await self.channel.channel_ready()
        except TimeoutError:
            raise not_ready(timeout) from None
        except grpc.aio.UsageError as e:  # closed other than by close(): never ready
            raise channel_closed(e) from None

    # ------------------------------------------------------------------ producer
    async def send(
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
        """Schedule one message; its Receipt once durable (see the blocking ``Client.send``).
        Cancelling the task before its message was sent leaves it out of the batch."""
        o = outgoing(subject, payload, delay, delay_ms, deliver_at, deliver_at_ms, headers, message_id or self._ids())
        if self.batching is None:
            msg = pb.Message(subject=o.subject, payload=o.payload, headers=o.headers or {}, message_id=o.message_id)
            _set_due(msg, o)
            resp = await self._call(self.stub.Send, pb.SendRequest(message=msg), timeout)
            return Receipt.from_pb(resp.receipt)
        if self._batcher is None:
            self._open()
            self._batcher = SendBatcher(
                lambda: self.channel,
                lambda batch: self._encode_outgoing(batch)[0],  # type: ignore[misc]  # borrowed from the blocking Client
                translate,
                self.metadata,
                self.batching,
                self.retries,
                self.retry_backoff,
                deadline_exceeded,
            )
        return await self._batcher.send(o, timeout or self.timeout)

    async def send_batch(self, messages: Iterable[pb.Message], timeout: float | None = None) -> list[Receipt]:
        """One SendBatch: all-or-nothing validation, one durable group commit."""
        request = pb.SendBatchRequest(messages=self._with_ids(messages))  # type: ignore[misc]  # borrowed from the blocking Client
        resp = await self._call(self.stub.SendBatch, request, timeout)
        return [Receipt.from_pb(r) for r in resp.receipts]

    async def send_many(
        self,
        messages: Iterable[pb.Message | Outgoing],
        batch_size: int = 1000,
        max_in_flight: int = 4,
        timeout: float | None = None,
    ) -> SentReceipts:
        """Pipelined batches on SendStream; receipts in input order (as the blocking
        ``Client.send_many``, whose docstring says how failures are reported)."""
        if batch_size < 1 or max_in_flight < 1:
            raise errors.InvalidArgument("batch_size and max_in_flight must be at least 1")
        next_request = self._next_requests(messages, batch_size)  # type: ignore[misc]  # borrowed from the blocking Client
        return await self._send_many(self.channel, next_request, max_in_flight, timeout or self.timeout)  # type: ignore[misc]  # borrowed from the blocking Client

    async def cancel(
        self, receipt: Target | None = None, timeout: float | None = None, *, message_id: str | None = None
    ) -> str:
        """'CANCELLED', 'ALREADY_DELIVERED', 'NOT_FOUND', 'ALREADY_CANCELLED' or 'DEAD_LETTERED';
        ``receipt`` is a Receipt, its string form, the message id alone or a qdelay.v1.Receipt.

        With batching (the default) cancels awaited at the same moment by many tasks share
        CancelBatch calls, as in the blocking client (same policy, same class:
        :class:`~qdelay.client.batching.CancelBatcher`); each task gets its own outcome or its
        own error, within its own ``timeout`` (DeadlineExceeded after it; whether the target
        was cancelled is then unknown, as for a unary call that timed out). A task cancelled
        before its target was sent leaves it out of the call. ``batching=False``: one unary
        Cancel per call."""
        if self.batching is None:
            # tried again: ALREADY_CANCELLED may be its first try's work (first_try_cancel)
            resp = await self._call(self.stub.Cancel, cancel_request(receipt, message_id), timeout, first_try_cancel)
            return CANCEL_OUTCOMES.get(resp.outcome, str(resp.outcome))
        target = cancel_target(receipt, message_id)
        if self._canceller is None:
            self._open()
            self._canceller = cancel_batcher(self.stub, self, self.batching)
        outcome = await self._canceller.cancel(target, timeout or self.timeout)
        return CANCEL_OUTCOMES.get(outcome, str(outcome))

    async def cancel_many(
        self, targets: Iterable[Target], timeout: float | None = None, batch_size: int = 1000
    ) -> list[str]:
        """Cancel many messages with CancelBatch calls of up to ``batch_size`` (at most the
        server's ``limits.max_batch``) targets each; one outcome per target, in order (as
        :meth:`cancel` answers: after a retried call, ALREADY_CANCELLED reads CANCELLED). Each
        target is anything :meth:`cancel` takes."""
        out: list[str] = []
        for req in cancel_batches(targets, batch_size):
            resp = await self._call(self.stub.CancelBatch, req, timeout, first_try_cancel)
            out.extend(cancel_outcomes(resp))
        return out

    async def reschedule(
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

        With batching (the default) reschedules awaited at the same moment by many tasks
        share RescheduleBatch calls, as in the blocking client (same class:
        :class:`~qdelay.client.batching.RescheduleBatcher`); each task gets its own answer
        or its own error, within its own ``timeout``. ``batching=False``: one unary
        Reschedule per call."""
        req = reschedule_request(target, reschedule_when(delay, delay_ms, deliver_at, deliver_at_ms), message_id)
        if self.batching is None:
            return reschedule_result(await self._call(self.stub.Reschedule, req, timeout))
        if self._rescheduler is None:
            self._open()
            self._rescheduler = reschedule_batcher(self.stub, self, self.batching)
        return reschedule_result(await self._rescheduler.reschedule(req, timeout or self.timeout))

    async def reschedule_many(
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
        """As the blocking client's ``reschedule_many``: many messages moved to one new time
        with RescheduleBatch calls of up to ``batch_size`` targets, one answer each, in order."""
        out: list[tuple[str, Receipt | None]] = []
        when = reschedule_when(delay, delay_ms, deliver_at, deliver_at_ms)
        for req in reschedule_batches(targets, when, batch_size):
            resp = await self._call(self.stub.RescheduleBatch, req, timeout)
            out.extend(reschedule_result(r) for r in resp.responses)
        return out

    async def get(
        self, receipt: Target | None = None, timeout: float | None = None, *, message_id: str | None = None
    ) -> Status:
        """The message's :class:`Status`; takes what :meth:`cancel` takes."""
        r, mid = ref_or_id(receipt, message_id)
        return Status.from_pb(await self._call(self.stub.Get, pb.GetRequest(receipt=r, message_id=mid), timeout))

    async def stats(self, timeout: float | None = None, *, subject: str = "", group: str = "") -> dict:
        """See :meth:`qdelay.client.Client.stats`."""
        return stats_dict(await self._call(self.stub.Stats, pb.StatsRequest(subject=subject, group=group), timeout))

    async def create_group(self, subject: str, group: str, timeout: float | None = None) -> bool:
        """See :meth:`qdelay.client.Client.create_group`."""
        req = pb.ChangeGroupRequest(op=pb.ChangeGroupRequest.CREATE, subject=subject, group=group)
        return (await self._call(self.stub.ChangeGroup, req, timeout)).changed

    async def delete_group(self, subject: str, group: str, timeout: float | None = None) -> bool:
        """See :meth:`qdelay.client.Client.delete_group`."""
        req = pb.ChangeGroupRequest(op=pb.ChangeGroupRequest.DELETE, subject=subject, group=group)
        return (await self._call(self.stub.ChangeGroup, req, timeout)).changed

    async def groups(self, timeout: float | None = None, *, subject: str = "", group: str = "") -> list[dict]:
        """See :meth:`qdelay.client.Client.groups`."""
        return (await self.stats(timeout, subject=subject, group=group))["groups"]

    async def health(self, timeout: float = 5.0, service: str = "") -> str:
        """The server's gRPC health status ('SERVING', 'NOT_SERVING'...) for ``service``:
        ``""`` the server, ``"qdelay.master"`` whether it takes writes now (docs/api.md)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        self._open()  # a closed grpc.aio channel raises its UsageError, outside the exception tree
        stub = health_pb2_grpc.HealthStub(self.channel)
        try:
            req = health_pb2.HealthCheckRequest(service=service)
            resp = await stub.Check(req, timeout=timeout, metadata=self.metadata)
        except grpc.RpcError as e:
            raise translate(e) from None
        except grpc.aio.UsageError as e:  # closed other than by close() (call_async's case)
            raise channel_closed(e) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    # ------------------------------------------------------------------ consumer
    def subscribe(
        self, subject: str, group: str = "default", max_in_flight: int = 1000, *, wait_for_group: bool = False
    ) -> Consumer:
        """A :class:`Consumer` (the stream opens on first read); ``wait_for_group`` as for
        :meth:`qdelay.client.Client.subscribe` (a slave's refusal waited out)."""
        self._open()
        return Consumer(self, subject, group, max_in_flight, wait_for_group=wait_for_group)


_END = object()


class _Live:
    """A consumer's stream as its finalizer sees it (never the consumer itself): the loop
    its reader runs on and the current stream's request queue."""

    def __init__(self, closed: asyncio.Event) -> None:
        self.closed = closed
        self.loop: asyncio.AbstractEventLoop | None = None
        self.requests: asyncio.Queue | None = None

    def end_soon(self) -> None:
        """The consumer was collected unclosed: end its stream on its loop."""
        if self.loop is None:
            return  # never started: no stream
        try:
            self.loop.call_soon_threadsafe(self._end)
        except RuntimeError:  # the loop is closed: its tasks and streams are gone
            pass

    def _end(self) -> None:
        self.closed.set()
        if self.requests is not None:
            self.requests.put_nowait(_END)  # half-close: queued acks go, then the server ends it


class Consumer:
    """One subscription as an async iterator (of deliveries, or of batches with
    :meth:`batches`), surviving the server.

    A reader task owns the Subscribe stream and hands each response's deliveries to the
    iterators (bounded: the server never has more than the credit unacknowledged). When the
    stream breaks with UNAVAILABLE or the server ends it (a shutdown ends every stream),
    the reader subscribes again by itself with backoff (up to 2 s between tries), with the
    same subject, group and credit; acks not yet sent go on the new stream. Deliveries that
    were in flight are delivered again by the server, as for any ended stream
    (at-least-once). So is a lost status: grpc.aio reports INTERNAL "Internal error from
    Core" instead of the stream's own status when an ack is being written as the server
    ends the stream (a shutdown) or the connection breaks (a crash), which ended this
    consumer at a server restart; a refusal lost this way is seen on the next
    subscription. Iteration ends only after :meth:`close`; other errors (UNAUTHENTICATED,
    INVALID_ARGUMENT, any other INTERNAL, ...) are raised to the reader of the iterator.
    With ``wait_for_group`` a FAILED_PRECONDITION is subscribed again too. The decision is
    the blocking consumer's (``resubscribes``). A consumer dropped without :meth:`close` is freed
    by the collector and its stream half-closed (what it held goes to the group's other
    consumers at once); neither its client nor its reader task keeps it.
    """

    def __init__(
        self, client: Client, subject: str, group: str, max_in_flight: int, *, wait_for_group: bool = False
    ) -> None:
        self._client = client
        self._wait_for_group = wait_for_group
        self.subject = subject
        self.group = group
        self.max_in_flight = max_in_flight
        self._pending_acks: list[str] = []
        self._requests: asyncio.Queue | None = None
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._call = None
        self._reader: asyncio.Task | None = None
        self._closed = asyncio.Event()
        self.reconnects = 0  # how many times it subscribed again
        self._subscribe = client.channel.stream_stream(
            SUBSCRIBE,
            request_serializer=pb.SubscribeRequest.SerializeToString,
            response_deserializer=deliveries_of(group),
        )
        client._consumers.add(self)
        # what ends the stream of a consumer dropped without close(): the reader task holds
        # the consumer only weakly (``_read``), so it is collected, and this half-closes
        # its stream, on its loop (the collector may run in any thread)
        self._live = _Live(self._closed)
        self._finalizer = weakref.finalize(self, self._live.end_soon)

    def _open(self):
        requests: asyncio.Queue = asyncio.Queue()
        first = pb.SubscribeRequest(subject=self.subject, group=self.group, max_in_flight=self.max_in_flight)
        if self._pending_acks:
            first.ack_ids.extend(self._pending_acks)
            self._pending_acks = []
        requests.put_nowait(first)

        async def stream():
            while True:
                item = await requests.get()
                if item is _END:
                    return
                yield item

        self._requests = self._live.requests = requests
        self._call = self._subscribe(stream(), metadata=self._client.metadata)
        return self._call

    def _carry_over(self) -> None:
        """Acks queued for a stream that ended go on the next one, and the ended stream's
        request generator ends (as the blocking consumer's does): left waiting on its old
        queue, it kept grpc's task that reads it pending until the collector destroyed both,
        at every resubscription ("Task was destroyed but it is pending!", "aclose():
        asynchronous generator is already running": 30 of each in 60 server restarts)."""
        requests, self._requests = self._requests, None
        if requests is None:
            return
        while not requests.empty():
            item = requests.get_nowait()
            if isinstance(item, pb.SubscribeRequest):
                self._pending_acks.extend(item.ack_ids)
        requests.put_nowait(_END)

    @staticmethod
    async def _read(ref: weakref.ref[Consumer], closed: asyncio.Event, inbox: asyncio.Queue) -> None:
        """The reader task: one stream after another until the consumer is closed, or
        collected (it holds the consumer only while it opens a stream or counts a retry)."""
        attempt = 0
        try:
            while not closed.is_set():
                me = ref()
                if me is None:
                    return
                try:
                    call, wait_for_group = me._open(), me._wait_for_group
                except grpc.aio.UsageError as e:
                    # its channel was closed other than by the client's close(), which ends
                    # the consumers first: the iterators raise it (they ended as if closed,
                    # and close() raised the UsageError)
                    inbox.put_nowait(channel_closed(e))
                    return
                del me
                how = "ended"
                try:
                    try:
                        async for resp in call:
                            attempt = 0
                            if resp:  # a list of Delivery (the deserializer's)
                                inbox.put_nowait(resp)
                    except asyncio.CancelledError:
                        if not cancelled_by_grpc():
                            raise  # the reader task itself is cancelled (close()'s timeout, its loop ending)
                        # grpc.aio cancelled the call itself (its half-close at close() failed on a
                        # connection just broken, its channel closed): a cut with CANCELLED. The
                        # reader ended cancelled: close() raised CancelledError, and the iterators
                        # ended as if the consumer were closed
                        raise CancelledByGrpc() from None
                except grpc.RpcError as e:
                    if not closed.is_set() and not resubscribes(e, wait_for_group):
                        inbox.put_nowait(translate(e))
                        return
                    how = how_it_ended(e)
                me = ref()
                if closed.is_set() or me is None:
                    return
                # the server went away or ended the stream: subscribe again
                me._carry_over()
                attempt += 1
                me.reconnects += 1
                delay = retry_wait(me._client.retry_backoff, attempt)
                log.info("subscription %s/%s %s; subscribing again in %.2f s", me.subject, me.group, how, delay)
                channel = me._client.channel
                del me
                # the backoff, or less once the channel has connected again (a restarted server)
                await reconnect.wait_aio(channel, delay, closed)
        finally:
            inbox.put_nowait(_END)

    def _start(self) -> None:
        if self._reader is None and not self._closed.is_set():
            loop = self._live.loop = asyncio.get_running_loop()
            reading = self._read(weakref.ref(self), self._closed, self._inbox)
            self._reader = loop.create_task(reading, name="qdelay-consumer")

    async def _next(self, timeout: float | None = None) -> list[Delivery] | None:
        """The next batch, None at the end (after close) or on timeout."""
        self._start()
        try:
            async with asyncio.timeout(timeout):  # None: no limit
                item = await self._inbox.get()
        except TimeoutError:
            return None
        if item is _END:
            self._inbox.put_nowait(_END)  # for every other reader
            return None
        if isinstance(item, Exception):
            self._inbox.put_nowait(_END)
            raise item
        return item

    async def batches(self) -> AsyncIterator[list[Delivery]]:
        """Each SubscribeResponse's deliveries as one list (the efficient way)."""
        while True:
            batch = await self._next()
            if batch is None:
                return
            yield batch

    async def __aiter__(self) -> AsyncIterator[Delivery]:
        async for batch in self.batches():
            for d in batch:
                yield d

    async def receive(self, count: int, timeout: float) -> list[Delivery]:
        """Deliveries until ``count`` arrived or ``timeout`` seconds passed (whole batches, so
        possibly more than ``count``)."""
        got: list[Delivery] = []
        deadline = asyncio.get_running_loop().time() + timeout
        while len(got) < count:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                break
            batch = await self._next(left)
            if batch is None:
                break
            got.extend(batch)
        return got

    def ack(self, deliveries: Iterable) -> None:
        """Acknowledge deliveries (Delivery objects or ack ids); one request for all."""
        ids = [d if isinstance(d, str) else d.ack_id for d in deliveries]
        if not ids:
            return
        if self._requests is None:
            self._pending_acks.extend(ids)
        else:
            self._requests.put_nowait(pb.SubscribeRequest(ack_ids=ids))

    def add_credit(self, max_in_flight: int) -> None:
        """Change how many unacknowledged deliveries this consumer accepts (kept across
        resubscriptions)."""
        self.max_in_flight = max_in_flight
        if self._requests is not None:
            self._requests.put_nowait(pb.SubscribeRequest(max_in_flight=max_in_flight))

    async def close(self, timeout: float = 5.0) -> None:
        """Send the queued acks, end the stream (the server gives what is unacknowledged to
        others at once) and end the iterators; cancels the call after ``timeout`` s."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._finalizer.detach()
        self._client._consumers.discard(self)
        if self._requests is not None:
            self._requests.put_nowait(_END)  # half-close: the server applies the acks, then ends
        reader = self._reader
        if reader is None:
            self._inbox.put_nowait(_END)
            return
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(reader)
        except TimeoutError:
            if self._call is not None:
                self._call.cancel()
            await cancel_and_wait([reader])  # closing: what it raised is nobody's any more

    async def __aenter__(self) -> Consumer:
        self._start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
