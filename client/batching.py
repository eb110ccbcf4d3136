"""Producer batching behind ``send()``: concurrent sends gathered into SendStream batches.

One Python gRPC call costs the server ~0.35-0.6 ms of CPU whatever the message, so many
concurrent single sends (an order service: one delay message per request) are carried as
pipelined batches on one SendStream, as Kafka's and Pulsar's producers do behind their
``send``. Both clients use this class: the asyncio client on the user's event loop, the
blocking client on its private I/O loop (threads hand their sends to it).

How a send travels:

- ``send(entry)`` waits for room in a bounded queue (``max_queued`` messages: backpressure,
  never unbounded memory), appends its message and waits for its own receipt.
- One sender task owns the stream. It cuts a batch of what is queued (at most
  ``max_batch``) as soon as the stream has credit (``max_in_flight`` batches unanswered).
  While a batch is unanswered, a new one may wait up to ``linger`` seconds to fill;
  with nothing unanswered it goes at once, so a lone send pays no linger.
- Each batch asks for compact receipts; every message carries its client-made id, so a
  batch sent again after a broken stream repeats the same ids (the server answers a
  repeated id with the original receipt once it deduplicates).
- A refused batch (INVALID_ARGUMENT: one bad message refuses the whole batch) is sent
  again one message per batch, so the bad message refuses only its own caller. Any
  other refusal fails the callers of that batch. Batches behind it on the same stream
  were not written and are sent again on a new stream.
- A stream broken with UNAVAILABLE (server gone, shutting down) is reopened with
  exponential backoff and its unanswered batches are sent again, in order; after
  ``retries`` attempts in a row with no answer, their callers get the error.
- A caller that gives up (task cancelled, timeout) before its message was cut into a
  batch is simply left out; after that, its receipt is dropped when it arrives.

State has one owner: the sender task; ``send`` only appends to the queue and wakes it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from qdelay import errors
from qdelay.client.types import Receipt
from qdelay.v1 import qdelay_pb2 as pb

_SEND_STREAM = "/qdelay.v1.DelayService/SendStream"
MAX_BACKOFF = 2.0  # seconds between two tries at most: a restarted server is found soon after


@dataclass(frozen=True)
class Batching:
    """How ``send()`` gathers messages (``Client(batching=Batching(...))``; ``batching=False``
    sends one unary Send per message).

    ``max_batch``: messages per SendStream batch. ``linger``: seconds a batch may wait for
    more messages while another is unanswered (≤ 1 ms keeps the added latency below the
    server's group commit). ``max_in_flight``: batches unanswered at once. ``max_queued``:
    messages waiting in the client before ``send()`` blocks (backpressure)."""

    max_batch: int = 1000
    linger: float = 0.001
    max_in_flight: int = 4
    max_queued: int = 10_000

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_in_flight < 1 or self.max_queued < 1 or not 0 <= self.linger <= 1:
            raise errors.InvalidArgument(
                "Batching: max_batch, max_in_flight and max_queued at least 1, linger between 0 and 1 s"
            )


# a task's send waits on an asyncio.Future, a thread's on a concurrent.futures.Future
AnyFuture = asyncio.Future | concurrent.futures.Future


class _Entry:
    __slots__ = ("message", "future", "threaded")

    def __init__(self, message: tuple, future: AnyFuture, threaded: bool = False) -> None:
        self.message = message  # an Outgoing tuple with its message id set
        # an asyncio.Future (a task's send) or a concurrent.futures.Future (a thread's)
        self.future = future
        self.threaded = threaded


def _resolve(future: AnyFuture, result: Receipt) -> None:
    try:
        future.set_result(result)
    except (asyncio.InvalidStateError, concurrent.futures.InvalidStateError):
        pass  # its caller gave up (cancelled, timed out) in between


def _reject(future: AnyFuture, error: BaseException) -> None:
    try:
        future.set_exception(error)
    except (asyncio.InvalidStateError, concurrent.futures.InvalidStateError):
        pass


class _Batch:
    __slots__ = ("entries", "request")

    def __init__(self, entries: list[_Entry], request: bytes) -> None:
        self.entries = entries
        self.request = request


class SendBatcher:
    """The batching path of ``send()`` on one event loop (see the module's docstring).

    ``channel`` gives the grpc.aio channel; ``encode(messages)`` gives a SendBatchRequest's
    wire bytes with compact receipts; ``translate`` maps a grpc error to the qdelay one."""

    def __init__(
        self,
        channel: Callable[[], grpc.aio.Channel],
        encode: Callable[[list[tuple]], bytes],
        translate: Callable[[grpc.RpcError, int], errors.QdelayError],
        metadata: tuple,
        config: Batching,
        retries: int,
        backoff: float,
        timeout_error: Callable[[float], BaseException] = lambda t: TimeoutError(f"no receipt within {t} s"),
    ) -> None:
        self._channel = channel
        self._timeout_error = timeout_error
        # callers' deadlines: one timer for the earliest instead of a wait_for task per send
        self._deadlines: list[tuple[float, int, asyncio.Future, float]] = []
        self._order = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._encode = encode
        self._translate = translate
        self._metadata = metadata
        self.config = config
        self._retries = retries
        self._backoff = backoff
        self._waiting: deque[_Entry] = deque()
        self._resend: deque[_Batch] = deque()  # unanswered batches of a broken stream, in order
        self._space = asyncio.Semaphore(config.max_queued)
        # threads (the blocking client) hand messages over through _inbox, with a threading
        # semaphore for their backpressure; one call_soon_threadsafe wakes the loop per burst
        self._tspace = threading.Semaphore(config.max_queued)
        self._inbox: deque[_Entry] = deque()
        self._inbox_scheduled = False
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closing = False
        self.streams = 0  # SendStream calls opened (a figure for tests and benchmarks)
        self.batches = 0  # batches sent, re-sent ones included
        self.peak_queued = 0  # most messages waiting at once (bounded by max_queued)

    # ------------------------------------------------------------------ callers
    async def send(self, message: tuple, timeout: float | None = None) -> Receipt:
        """Queue one message (an Outgoing tuple with its id set) and wait for its receipt;
        after ``timeout`` seconds the ``timeout_error`` (it is left out of its batch if it
        was not sent yet; if it was, whether it was written is unknown)."""
        if self._closing:
            raise errors.FailedPrecondition("the client is closed")
        loop = asyncio.get_running_loop()
        if timeout is not None:
            deadline = loop.time() + timeout
            if self._space.locked():
                try:
                    await asyncio.wait_for(self._space.acquire(), timeout)
                except TimeoutError:
                    raise self._timeout_error(timeout) from None
            else:
                await self._space.acquire()
        else:
            await self._space.acquire()
        future = loop.create_future()
        if timeout is not None:
            self._arm(loop, future, deadline, timeout)
        self._waiting.append(_Entry(message, future))
        if len(self._waiting) > self.peak_queued:
            self.peak_queued = len(self._waiting)
        self._wakeup.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="qdelay-send-batcher")
        return await future

    def _arm(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future, deadline: float, timeout: float) -> None:
        heap = self._deadlines
        while heap and heap[0][2].done():  # answered ones leave from the head (FIFO-ish)
            heapq.heappop(heap)
        heapq.heappush(heap, (deadline, next(self._order), future, timeout))
        if self._timer is None or deadline < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer_at = deadline
            self._timer = loop.call_at(deadline, self._expire)

    def _expire(self) -> None:
        loop = asyncio.get_running_loop()
        heap, now = self._deadlines, loop.time()
        self._timer = None
        while heap and (heap[0][0] <= now or heap[0][2].done()):
            _deadline, _n, future, timeout = heapq.heappop(heap)
            if not future.done():
                future.set_exception(self._timeout_error(timeout))
        if heap:
            self._timer_at = heap[0][0]
            self._timer = loop.call_at(self._timer_at, self._expire)

    def submit_threadsafe(self, loop: asyncio.AbstractEventLoop, message: tuple) -> concurrent.futures.Future:
        """From any thread: queue one message on ``loop`` (the batcher's); a future of its
        Receipt. Blocks while ``max_queued`` messages wait (backpressure)."""
        if self._closing:
            raise errors.FailedPrecondition("the client is closed")
        self._tspace.acquire()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.append(_Entry(message, future, True))
        if not self._inbox_scheduled:
            self._inbox_scheduled = True
            loop.call_soon_threadsafe(self._pull_inbox)
        return future

    def _pull_inbox(self) -> None:
        """On the loop: move what threads handed over into the queue."""
        self._inbox_scheduled = False  # first: a message appended from now on schedules again
        inbox, waiting = self._inbox, self._waiting
        while inbox:
            waiting.append(inbox.popleft())
        if len(waiting) > self.peak_queued:
            self.peak_queued = len(waiting)
        self._wakeup.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="qdelay-send-batcher")

    async def close(self) -> None:
        """Send what is queued, wait for its answers, then end the stream."""
        self._closing = True
        self._wakeup.set()
        if self._task is not None:
            await self._task

    # ------------------------------------------------------------------ the sender task
    def _has_work(self) -> bool:
        return bool(self._resend) or any(not e.future.done() for e in self._waiting)

    async def _run(self) -> None:
        attempt = 0
        while True:
            while not self._has_work():
                self._release_done()
                if self._closing:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
            unanswered: deque[_Batch] = deque()
            error: grpc.RpcError | None = None
            answered = 0
            try:
                answered = await self._stream(unanswered)
            except grpc.RpcError as e:
                error = e
            except asyncio.CancelledError:
                self._fail(list(unanswered) + list(self._resend), errors.Unavailable("the client was closed"))
                raise
            if answered:
                attempt = 0
            if error is None:
                # the server ended the stream (a shutdown ends every stream): what it did not
                # answer was not written; send it again on a new stream
                self._resend.extendleft(reversed(unanswered))
                if unanswered:
                    attempt += 1
                    if attempt > self._retries:
                        self._fail(self._take_resend(), errors.Unavailable("SendStream ended with batches unanswered"))
                        attempt = 0
                    else:
                        await asyncio.sleep(min(self._backoff * 2 ** (attempt - 1), MAX_BACKOFF))
                continue
            code = error.code()
            # "Internal error from Core": grpc.aio failed to write a batch on a call the server
            # had just ended (a refusal racing our next write); the server's status is lost, and
            # nothing from the refused batch on was written: sent again, as for a broken stream
            lost_status = code == grpc.StatusCode.INTERNAL and error.details() == "Internal error from Core"
            if (
                code == grpc.StatusCode.UNAVAILABLE
                or lost_status
                or code == grpc.StatusCode.CANCELLED
                and not self._closing
            ):
                self._resend.extendleft(reversed(unanswered))
                attempt += 1
                if attempt > self._retries:
                    self._fail(self._take_resend(), self._translate(error, attempt))
                    attempt = 0
                else:
                    await asyncio.sleep(min(self._backoff * 2 ** (attempt - 1), MAX_BACKOFF))
                continue
            if not unanswered:  # refused before any batch (e.g. UNAUTHENTICATED): the next ones
                unanswered.append(self._cut(self._resend.popleft() if self._resend else None))
            refused = unanswered.popleft()
            self._resend.extendleft(reversed(unanswered))  # not written: they were behind it
            if code == grpc.StatusCode.INVALID_ARGUMENT and len(refused.entries) > 1:
                # one bad message refuses its batch: send them one by one so it refuses only its caller
                singles = [e for e in refused.entries if not e.future.done()]
                self._resend.extendleft(reversed([_Batch([e], self._encode([e.message])) for e in singles]))
            else:
                self._fail([refused], self._translate(error, 1))

    def _cut(self, batch: _Batch | None) -> _Batch:
        if batch is not None:
            return batch
        entries = self._take(self.config.max_batch)
        return _Batch(entries, self._encode([e.message for e in entries]))

    def _take(self, count: int) -> list[_Entry]:
        """Up to ``count`` queued messages whose callers still wait (synchronous: no message is
        between the queue and a batch across an await)."""
        out: list[_Entry] = []
        waiting = self._waiting
        while waiting and len(out) < count:
            e = waiting.popleft()
            (self._tspace if e.threaded else self._space).release()
            if not e.future.done():
                out.append(e)
        return out

    def _release_done(self) -> None:
        waiting = self._waiting
        while waiting and waiting[0].future.done():
            e = waiting.popleft()
            (self._tspace if e.threaded else self._space).release()

    def _take_resend(self) -> list[_Batch]:
        out = list(self._resend)
        self._resend.clear()
        return out

    async def _stream(self, unanswered: deque[_Batch]) -> int:
        """One SendStream until it ends; returns how many batches it answered."""
        config = self.config
        credit = asyncio.Semaphore(config.max_in_flight)

        finished = False  # set when the call ended: its generator must take nothing more

        async def requests():
            # grpc.aio may resume this generator after the call ended: every await is followed
            # by a check, and a batch moves from the queue to ``unanswered`` with no await between
            while True:
                await credit.acquire()
                if finished:
                    return
                if self._resend:
                    batch = self._resend.popleft()
                    unanswered.append(batch)
                    self.batches += 1
                    yield batch.request
                    continue
                while not self._has_work():
                    if self._closing:
                        return
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    if finished:
                        return
                if self._resend:
                    credit.release()
                    continue
                if unanswered and config.linger and len(self._waiting) < config.max_batch:
                    await asyncio.sleep(config.linger)  # gather while the stream is busy anyway
                    if finished:
                        return
                entries = self._take(config.max_batch)
                if not entries:
                    credit.release()
                    continue
                batch = _Batch(entries, self._encode([e.message for e in entries]))
                unanswered.append(batch)  # before the yield: a broken stream sends it again
                self.batches += 1
                yield batch.request

        stream = self._channel().stream_stream(
            _SEND_STREAM, request_serializer=None, response_deserializer=pb.SendBatchResponse.FromString
        )
        self.streams += 1
        call = stream(requests(), metadata=self._metadata)
        answered = 0
        try:
            async for response in call:
                if not unanswered:
                    raise errors.InvariantViolation("SendStream answered a batch that was not sent")
                batch = unanswered.popleft()
                credit.release()
                answered += 1
                self._answer(batch, response)
        finally:
            finished = True
            call.cancel()  # a no-op once the call ended; stops the request generator otherwise
            # wake the generator wherever it waits, so that it sees ``finished`` and ends (else
            # grpc.aio's task that reads it stays pending until the loop closes)
            credit.release()
            self._wakeup.set()
        return answered

    def _answer(self, batch: _Batch, response: pb.SendBatchResponse) -> None:
        entries = batch.entries
        if response.receipts:  # full receipts (a duplicate id, or a server without compact ones)
            for e, r in zip(entries, response.receipts):
                if not e.future.done():
                    _resolve(e.future, Receipt.from_pb(r))
            return
        dues = response.deliver_at_ms
        if len(dues) != len(entries):
            err = errors.InvariantViolation(f"compact answer has {len(dues)} due times for {len(entries)} messages")
            self._fail([batch], err)
            return
        first = response.first_sequence
        shard = response.shard
        for i, e in enumerate(entries):
            if not e.future.done():
                _resolve(e.future, Receipt(e.message[4], dues[i], first + i, shard))

    @staticmethod
    def _fail(batches: list[_Batch], error: BaseException) -> None:
        for batch in batches:
            for e in batch.entries:
                if not e.future.done():
                    _reject(e.future, error)


class _Waiter:
    __slots__ = ("request", "timeout", "event", "lead", "done", "result", "error")

    def __init__(self, request: pb.CancelRequest, timeout: float | None) -> None:
        self.request = request
        self.timeout = timeout
        self.event = threading.Event()  # set when answered, or when handed the lead
        self.lead = False  # this caller carries batches (changed under the combiner's lock)
        self.done = False
        self.result: int | None = None
        self.error: BaseException | None = None


class CancelCombiner:
    """Concurrent ``cancel()`` calls of the blocking client, carried as CancelBatch calls.

    For the reason ``send()`` batches (a gRPC call costs the server ~0.35-0.6 ms of CPU
    whatever it carries; a cancel in a batch costs it ~10 us): threads that cancel at the
    same moment share a call. It is a group commit among the calling threads, no thread
    of its own: a caller that finds fewer than ``max_in_flight`` calls under way makes one
    with everything queued (its own target included, at most ``max_batch``); the others
    wait for their answers, or to be handed the lead when a caller finishes with targets
    still queued. A lone cancel goes at once, in a batch of one.

    A batch refused as a whole (one bad target is INVALID_ARGUMENT for all; by id on a
    server without the id index; a server without CancelBatch) is sent again one Cancel
    per target, so that each caller gets its own answer or its own error. An error after
    the client's retries (UNAVAILABLE, a deadline) is every caller's of that batch, as it
    would have been each one's."""

    def __init__(
        self,
        batch_call: Callable[[pb.CancelBatchRequest, float | None], pb.CancelBatchResponse],
        single_call: Callable[[pb.CancelRequest, float | None], pb.CancelResponse],
        max_batch: int = 1000,
        max_in_flight: int = 2,
        linger: float = 0.001,
    ) -> None:
        self._batch_call = batch_call
        self._single_call = single_call
        self.max_batch = max_batch
        self.max_in_flight = max_in_flight
        self.linger = linger
        self._under_way = 0  # calls made and not yet answered
        self._last = 0  # targets the last call carried
        self._lock = threading.Lock()
        self._queue: deque[_Waiter] = deque()
        self._leaders = 0
        self.calls = 0  # CancelBatch calls made (a figure for tests and benchmarks)
        self.batches = 0  # calls made, single Cancels included
        self.carried = 0  # targets they carried

    def cancel(self, request: pb.CancelRequest, timeout: float | None = None) -> int:
        """The outcome (CancelResponse.Outcome number) of one target, or its error."""
        me = _Waiter(request, timeout)
        lock = self._lock
        with lock:
            self._queue.append(me)
            if self._leaders < self.max_in_flight:
                self._leaders += 1
                me.lead = True
        while True:
            if me.lead:
                self._lead(me)
            with lock:
                if me.done:
                    break
                if me.lead:  # handed the lead again since
                    continue
                me.event.clear()
            me.event.wait()
        return self._answer(me)

    def _lead(self, me: _Waiter) -> None:
        """Carry batches of what is queued until ``me`` is answered or nothing is queued;
        then give the lead up (to a waiting caller if targets are still queued)."""
        lock, queue = self._lock, self._queue
        while True:
            waiting = len(queue)
            if self.linger and waiting < self.max_batch and (self._under_way or waiting < self._last):
                # gather while another call is unanswered anyway, or while the callers of the
                # last batch (just answered) are likely coming back: a lone caller never waits
                time.sleep(self.linger)
            with lock:
                batch = [queue.popleft() for _ in range(min(self.max_batch, len(queue)))]
                if not batch:  # a batch under way carries what is left, ``me`` included
                    self._leaders -= 1
                    me.lead = False
                    return
                self._under_way += 1
            try:
                self._carry(batch)
            finally:
                with lock:
                    self._under_way -= 1
            if me.done:
                with lock:
                    me.lead = False
                    nxt = next((w for w in queue if not w.lead), None)
                    if nxt is not None:  # someone must carry what is queued
                        nxt.lead = True
                        nxt.event.set()
                    else:  # nothing, or only leaders' own targets: they carry them
                        self._leaders -= 1
                return

    @staticmethod
    def _answer(me: _Waiter) -> int:
        if me.error is not None:
            raise me.error
        if me.result is None:
            raise errors.InvariantViolation("a cancel was woken without an answer")
        return me.result

    def _carry(self, batch: list[_Waiter]) -> None:
        self.batches += 1
        self.carried += len(batch)
        self._last = len(batch)
        timeouts = [w.timeout for w in batch if w.timeout is not None]
        timeout = max(timeouts) if timeouts else None
        try:
            outcomes: list[int]
            if len(batch) == 1:
                outcomes = [int(self._single_call(batch[0].request, timeout).outcome)]
            else:
                self.calls += 1
                request = pb.CancelBatchRequest(requests=[w.request for w in batch])
                outcomes = [int(r.outcome) for r in self._batch_call(request, timeout).responses]
                if len(outcomes) != len(batch):
                    raise errors.InvariantViolation(f"CancelBatch answered {len(outcomes)} of {len(batch)} targets")
        except errors.Unavailable as err:  # retried already: the batch's callers all get it
            self._settle(batch, None, err)
            return
        except BaseException as err:  # noqa: BLE001 - a refusal of the whole batch: one by one
            if len(batch) == 1:
                self._settle(batch, None, err)
                return
            for w in batch:
                try:
                    self._settle([w], [int(self._single_call(w.request, w.timeout).outcome)], None)
                except BaseException as one:  # noqa: BLE001 - that caller's own error
                    self._settle([w], None, one)
            return
        self._settle(batch, outcomes, None)

    @staticmethod
    def _settle(batch: list[_Waiter], outcomes: list[int] | None, error: BaseException | None) -> None:
        for i, w in enumerate(batch):
            if outcomes is not None:
                w.result = outcomes[i]
            w.error = error
            w.done = True
            w.event.set()
