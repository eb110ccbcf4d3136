"""Batching behind ``send()``, ``cancel()`` and ``reschedule()``: concurrent sends gathered
into SendStream batches (:class:`SendBatcher`), concurrent cancels into CancelBatch requests
on one CancelStream (:class:`CancelBatcher` with :class:`CancelStreamCall`), concurrent
reschedules into RescheduleBatch calls (:class:`RescheduleBatcher`; both gather as
:class:`TargetBatcher` does, whose docstring tells the policy). What follows is the send path.

One Python gRPC call costs the server ~0.35-0.6 ms of CPU whatever the message, so many
concurrent single sends (an order service: one delay message per request) are carried as
pipelined batches on one SendStream, as Kafka's and Pulsar's producers do behind their
``send``. Both clients use this class: the asyncio client on the user's event loop, the
blocking client on its private I/O loop (threads hand their sends to it).

How a send travels:

- ``send(entry)`` waits for room in a bounded queue (``max_queued`` messages: backpressure,
  never unbounded memory), appends its message and waits for its own receipt.
- One sender task owns the stream and cuts batches of what is queued (at most
  ``max_batch``, at most ``max_in_flight`` unanswered) by natural batching: with the
  stream idle a message goes at once (a lone send pays no linger); while a batch is
  unanswered the next one gathers until it is answered, or until as many messages as the
  last batch carried are queued (the load grew: one batch more in the air); just after an
  answer, the batch waits up to ``linger`` for that batch's callers to come back, so that
  callers sending in a loop (16 threads, 64 tasks) ride one batch a round instead of a
  batch of the first few and one of the rest. Callers wake the sender only once the
  queue reaches the size it waits for (see ``SendBatcher._due``), not once per message.
- Threads (the blocking client) hand their messages over with :mod:`handoff`: a
  one-shot gate per call instead of a ``concurrent.futures.Future``, room in the queue
  given back once per batch, and a batch's callers woken together with the GIL released
  (``handoff.settle_all``).
- Each batch asks for compact receipts; every message carries its client-made id, so a
  batch sent again after a broken stream repeats the same ids (the server answers a
  repeated id with the original receipt once it deduplicates).
- A refused batch (INVALID_ARGUMENT: one bad message refuses the whole batch) is sent
  again one message per batch, so the bad message refuses only its own caller, with the
  error unary Send gives (``message.subject: ...``, not the server's ``messages[0]...``
  of a batch the caller never made: :func:`own_field`). Any
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

import abc
import asyncio
import concurrent.futures
import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

import grpc

from qdelay import errors, wire
from qdelay.client.handoff import Inbox, Room, Waiter, settle_all
from qdelay.client.types import CancelTarget, Receipt, cancel_request
from qdelay.v1 import qdelay_pb2 as pb

_SEND_STREAM = "/qdelay.v1.DelayService/SendStream"
MAX_BACKOFF = 2.0  # seconds between two tries at most: a restarted server is found soon after


def retry_wait(backoff: float, attempt: int) -> float:
    """Seconds before try ``attempt + 1`` (``attempt`` from 1): ``backoff`` doubled each
    attempt, at most ``MAX_BACKOFF`` (every retry of the clients and their batchers). The
    doubling stops at 2^63: a consumer counts its attempts for as long as its server is away,
    and 2^1024 is past a float (OverflowError, after ~34 minutes of 2 s waits)."""
    return min(backoff * 2 ** min(attempt - 1, 63), MAX_BACKOFF)


def lost_status(error: grpc.RpcError | errors.QdelayError | None) -> bool:
    """grpc.aio's "Internal error from Core": it failed to write on a stream the server had
    just ended (a refusal racing the client's next write, a server stopping) or that broke
    (a server killed), and the stream's own status is lost. No verdict: what was unanswered
    is sent again, a consumer subscribes again. ``error`` is the call's, or the
    :class:`~qdelay.errors.QdelayError` a client translated it into (what the cluster
    clients' failover sees)."""
    if isinstance(error, errors.QdelayError):
        code, details = getattr(error, "code", None), getattr(error, "details", None)
    elif error is not None:
        code, details = error.code(), error.details()
    else:
        return False
    return code == grpc.StatusCode.INTERNAL and details == "Internal error from Core"


def peer_away(error: grpc.RpcError) -> bool:
    """Whether a failed call says its peer is down, restarting or out of reach (try again,
    or try another endpoint), not that it refused: UNAVAILABLE, DEADLINE_EXCEEDED, or a
    lost status (a write on a stream the peer had just ended, or that broke when it was
    killed). For the server's own calls to other servers: a slave's Pull stream, etcd's."""
    return error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) or lost_status(error)


def stream_cut(error: grpc.RpcError, closing: bool) -> bool:
    """Whether a stream that ended with ``error`` left its unanswered requests without a
    verdict, to be sent again on a new stream (their ids make that safe): broken
    (UNAVAILABLE), cut by the server or its transport (CANCELLED: a server stopping), or a
    lost status. CANCELLED is this side's own doing when it is ``closing`` (its channel
    closed under the call): not sent again then. The clients' unary calls are tried again
    on the same verdict (``call_async``, ``Client._call``): a stopping server cancels the
    calls still running at its deadline (CANCELLED), as it cuts streams, and a Cancel,
    CancelBatch, Send or Reschedule cut so was no refusal (cancel_many raised CANCELLED at
    a restart)."""
    code = error.code()
    return (
        code == grpc.StatusCode.UNAVAILABLE or lost_status(error) or (code == grpc.StatusCode.CANCELLED and not closing)
    )


class CancelledByGrpc(grpc.RpcError):
    """A streaming call grpc.aio cancelled itself, as the stream's error: grpc.aio cancels
    a call whose request iterator raised, and half-closing a SendStream whose connection
    had just broken raises there (``ExecuteBatchError`` of ``SendCloseFromClientOperation``,
    at a server killed or stopping, ~1 in 30 restarts under send_many); the call's reader
    then gets ``asyncio.CancelledError`` although nobody cancelled its task. Its verdict is
    a stream's cut by CANCELLED (:func:`stream_cut`: sent again, unless this side is
    closing); raised as CancelledError it ended send_many (blocking: "the client was closed
    during the call")."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.CANCELLED

    def details(self) -> str:
        return "grpc.aio cancelled the stream itself (its connection broke as it half-closed, or its channel closed)"


def cancelled_by_grpc() -> bool:
    """Whether an ``asyncio.CancelledError`` just raised by a grpc.aio call's reader is the
    call's own end (:class:`CancelledByGrpc`), not a cancellation of the reading task (then
    it must go on: the task's caller asked for it)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() == 0


def channel_closed(error: Exception) -> errors.FailedPrecondition:
    """What a call gets when grpc.aio refuses to open it on a closed channel (its UsageError
    "Channel is closed.", outside the exception tree): the batchers' callers, send_many and
    the asyncio client's unary calls. The client's own close() refuses before that ("the
    client is closed") and closes its channel only after its batchers closed; this is a
    channel closed under the client otherwise (an asyncio client's ``channel`` closed by
    whoever else holds it, an ``async with`` on it ending in another task). A closed
    channel is never opened again: what was not answered gets this, not a hang until the
    caller's timeout."""
    return errors.FailedPrecondition(
        f"the client's channel was closed under the call (grpc: {error}): a closed channel makes no call "
        "again; make a new client"
    )


def tries_allowed(retries: int, error: grpc.RpcError | None) -> int:
    """The retries a stream's unanswered requests get after ``error``: a lost status gets one
    even with ``retries=0``, so that the caller sees the server's own status (an auth
    refusal racing the first write surfaced as INTERNAL in fresh-clone runs, on SendStream
    and on CancelStream)."""
    return max(retries, 1) if lost_status(error) else retries


def own_field(error: errors.QdelayError, in_batch: str = "messages[0].", own: str = "message.") -> errors.QdelayError:
    """A refusal of a batch of one caller's target, worded as the unary call words it: the
    server names the field by its index in the batch (``messages[0].subject: ...``,
    ``requests[0].receipt.message_id: ...``), a batch the caller never made; the caller
    sees ``message.subject: ...`` (``send()``), ``receipt.message_id: ...`` (``cancel()``,
    ``in_batch="requests[0].", own=""``). Changed in place (the error is this caller's
    alone); anything else is left as it is."""
    details = getattr(error, "details", None)
    code = getattr(error, "code", None)
    if code is None or not isinstance(details, str) or not details.startswith(in_batch):
        return error
    error.said(code, own + details[len(in_batch) :])
    return error


@dataclass(frozen=True)
class Batching:
    """How ``send()`` gathers messages (``Client(batching=Batching(...))``; ``batching=False``
    sends one unary Send per message).

    ``max_batch``: messages per SendStream batch. ``linger``: seconds a batch may wait, just
    after an answer, for that batch's callers to come back (≤ 1 ms keeps the added latency
    below the server's group commit; with the stream idle a message never waits; while a
    batch is unanswered the next gathers until the answer). ``max_in_flight``: batches
    unanswered at once. ``max_queued``: messages waiting in the client before ``send()``
    blocks (backpressure)."""

    max_batch: int = 1000
    linger: float = 0.001
    max_in_flight: int = 4
    max_queued: int = 10_000

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_in_flight < 1 or self.max_queued < 1 or not 0 <= self.linger <= 1:
            raise errors.InvalidArgument(
                "Batching: max_batch, max_in_flight and max_queued at least 1, linger between 0 and 1 s"
            )


# a task's send waits on an asyncio.Future, a thread's on a handoff.Waiter
AnyFuture = asyncio.Future | Waiter


class _Entry:
    __slots__ = ("message", "future", "threaded")

    def __init__(self, message: tuple, future: AnyFuture, threaded: bool = False) -> None:
        self.message = message  # an Outgoing tuple with its message id set
        # an asyncio.Future (a task's send) or a Waiter (a thread's)
        self.future = future
        self.threaded = threaded


def _resolve(future: AnyFuture, result: object) -> None:
    try:
        future.set_result(result)
    except (asyncio.InvalidStateError, concurrent.futures.InvalidStateError):
        pass  # its caller gave up (cancelled, timed out) in between


def _resolve_all(futures: list[AnyFuture], results: list) -> None:
    """Each caller its result (those who gave up are skipped); the threads among them are
    woken together, with the GIL released (:func:`handoff.settle_all`), after the tasks'
    futures are set."""
    waiters: list[Waiter] = []
    values: list = []
    for future, result in zip(futures, results):
        if type(future) is Waiter:
            waiters.append(future)
            values.append(result)
        elif not future.done():
            _resolve(future, result)
    if waiters:
        settle_all(waiters, values)


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


async def _wait_set(event: asyncio.Event, timeout: float | None) -> None:
    """Until ``event`` is set, or ``timeout`` seconds (None: no limit): one timer that sets
    it, rather than asyncio.wait_for's task (a batcher's runner sleeps so every batch)."""
    if timeout is None:
        await event.wait()
        return
    timer = asyncio.get_running_loop().call_later(timeout, event.set)
    try:
        await event.wait()
    finally:
        timer.cancel()


class _Deadlines:
    """Callers' deadlines on one event loop: one timer for the earliest instead of a wait_for
    task per call; a future still unanswered at its deadline gets ``error(timeout)``."""

    def __init__(self, error: Callable[[float], BaseException]) -> None:
        self._error = error
        self._heap: list[tuple[float, int, asyncio.Future, float]] = []
        self._order = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    def arm(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future, deadline: float, timeout: float) -> None:
        """``deadline`` in ``loop.time()``; ``timeout`` for the error's message."""
        heap = self._heap
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
        heap, now = self._heap, loop.time()
        self._timer = None
        while heap and (heap[0][0] <= now or heap[0][2].done()):
            _deadline, _n, future, timeout = heapq.heappop(heap)
            if not future.done():
                future.set_exception(self._error(timeout))
        if heap:
            self._timer_at = heap[0][0]
            self._timer = loop.call_at(self._timer_at, self._expire)


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
        self._timers = _Deadlines(timeout_error)
        self._encode = encode
        self._translate = translate
        self._metadata = metadata
        self.config = config
        self._retries = retries
        self._backoff = backoff
        self._waiting: deque[_Entry] = deque()
        self._resend: deque[_Batch] = deque()  # unanswered batches of a broken stream, in order
        self.answers = 0  # batches answered, on every stream (how _send_all sees a broken one's progress)
        self._space = asyncio.Semaphore(config.max_queued)
        # threads (the blocking client) hand messages over through _inbox, with a Room for
        # their backpressure; one call_soon_threadsafe wakes the loop per burst
        self._tspace = Room(config.max_queued)
        self._inbox = Inbox(self._take_handed)
        # a thread's check of _closing and its hand-over are one step against close()'s
        # setting it: a message handed over is one close() sends, else its caller is refused
        # (it met the closed loop, or sat in an inbox nobody read, until its timeout)
        self._handover = threading.Lock()
        self._wakeup = asyncio.Event()
        # natural batching (see _due): the queue size that makes a batch due, callers wake
        # the sender only once it is reached; the callers of the batches answered last and
        # until when they are waited for; the size of the last batch cut
        self._wake_total = 1
        self._back_count = 0
        self._back_by = 0.0
        self._last_cut = 1
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
                    async with asyncio.timeout(timeout):
                        await self._space.acquire()
                except TimeoutError:
                    raise self._timeout_error(timeout) from None
            else:
                await self._space.acquire()
        else:
            await self._space.acquire()
        future = loop.create_future()
        if timeout is not None:
            self._timers.arm(loop, future, deadline, timeout)
        waiting = self._waiting
        waiting.append(_Entry(message, future))
        if len(waiting) > self.peak_queued:
            self.peak_queued = len(waiting)
        if len(waiting) >= self._wake_total:  # else the sender sleeps on: it gathers
            self._wakeup.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="qdelay-send-batcher")
        return await future

    def submit_threadsafe(self, loop: asyncio.AbstractEventLoop, message: tuple) -> Waiter:
        """From any thread: queue one message on ``loop`` (the batcher's); the Waiter of its
        Receipt. Blocks while ``max_queued`` messages wait (backpressure)."""
        if self._closing:
            raise errors.FailedPrecondition("the client is closed")
        self._tspace.take()
        waiter = Waiter()
        with self._handover:
            if self._closing:  # close() began while this waited for room
                self._tspace.give(1)
                raise errors.FailedPrecondition("the client is closed")
            self._inbox.put(loop, _Entry(message, waiter, True))
        return waiter

    def _take_handed(self, entries: list[_Entry]) -> None:
        """On the loop: what threads handed over joins the queue."""
        if not entries:  # drained already (close(), the sender)
            return
        waiting = self._waiting
        waiting.extend(entries)
        if len(waiting) > self.peak_queued:
            self.peak_queued = len(waiting)
        self._wakeup.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="qdelay-send-batcher")

    async def close(self) -> None:
        """Send what is queued (what threads handed over included), wait for its answers,
        then end the stream."""
        with self._handover:  # from here no thread hands a message over
            self._closing = True
        self._take_handed(self._inbox.drain())  # makes a sender if none runs
        self._wakeup.set()
        if self._task is not None:
            await self._task

    # ------------------------------------------------------------------ the sender task
    def _has_work(self) -> bool:
        self._pull_inbox()
        return bool(self._resend) or any(not e.future.done() for e in self._waiting)

    def _pull_inbox(self) -> None:
        """On the loop: what threads handed over and did not wake it for joins the queue."""
        if self._inbox:
            handed = self._inbox.drain()
            waiting = self._waiting
            waiting.extend(handed)
            if len(waiting) > self.peak_queued:
                self.peak_queued = len(waiting)

    def _set_wake(self, total: int) -> None:
        """Callers wake the sender once ``total`` messages are queued (threads' included)."""
        self._wake_total = total
        self._inbox.wake_at = max(1, total - len(self._waiting))

    def _due(self, busy: bool) -> float | None:
        """Natural batching: 0 when a batch should be cut now from what is queued; else how
        long the sender may sleep (None: until woken), having told callers when to wake it.

        - ``max_batch`` queued, or closing: now.
        - A batch unanswered (``busy``): gather until it is answered, or until as many as
          the last batch carried are queued (the load grew: a batch more in the air).
        - The callers of the batches answered less than ``linger`` ago are coming back (a
          thread or task that sends in a loop: 16 threads, 64 tasks): gather until they
          all are, for at most ``linger`` after the answer, so that they ride one batch
          again instead of splitting into a batch of the first few and one of the rest.
        - Otherwise (an idle stream, a lone sender): now, no linger; with nothing queued,
          sleep until the first message comes."""
        n = len(self._waiting)
        config = self.config
        if n >= config.max_batch or (n and self._closing):
            return 0.0
        if busy:
            if n and n >= self._last_cut:
                return 0.0
            self._set_wake(min(self._last_cut, config.max_batch))
            return None
        left = self._back_by - asyncio.get_running_loop().time()
        if left > 0 and n < self._back_count:
            self._set_wake(min(self._back_count, config.max_batch))
            return left
        if n:
            return 0.0
        self._set_wake(1)
        return None

    async def _sleep(self, timeout: float | None) -> None:
        """Until woken (``_wakeup``, cleared by the caller before it looked), or ``timeout``."""
        await _wait_set(self._wakeup, timeout)

    def _answered(self, count: int) -> None:
        """A batch of ``count`` was answered: its callers are likely coming back (see _due)."""
        now = asyncio.get_running_loop().time()
        self._back_count = count + (self._back_count if now < self._back_by else 0)
        self._back_by = now + self.config.linger
        self._wakeup.set()

    async def _run(self) -> None:
        try:
            await self._send_all()
        finally:
            # however the sender ended, the next message must wake the loop (and make a new
            # sender): a wake_at left from a gathering would leave a thread's send unseen
            self._set_wake(1)

    async def _send_all(self) -> None:
        attempt = 0
        while True:
            while True:
                self._wakeup.clear()
                if self._has_work():
                    break
                self._release_done()
                self._set_wake(1)
                if self._inbox:  # handed over before wake_at fell to 1
                    continue
                # nothing to send and no stream open: the sender ends (the next message makes
                # a new one). A sender idling here was referenced by nothing but its client:
                # a client dropped, or its loop closed without cancelling, after the server
                # went away destroyed it pending ("Task was destroyed but it is pending!")
                return
            unanswered: deque[_Batch] = deque()
            error: grpc.RpcError | None = None
            answers = self.answers
            try:
                await self._stream(unanswered)
            except grpc.RpcError as e:
                error = e
            except grpc.aio.UsageError as e:
                # no stream opens on a closed channel (a stream cut by its closing was sent
                # again here): the sender task died with this and its callers waited until
                # their timeout, close() raised it. Every caller waiting now gets the error;
                # the next send() makes a new sender, which asks the channel again
                closed = channel_closed(e)
                self._pull_inbox()
                self._fail(list(unanswered) + self._take_resend(), closed)
                for entry in self._take(len(self._waiting)):
                    _reject(entry.future, closed)
                return
            except asyncio.CancelledError:
                self._fail(list(unanswered) + list(self._resend), errors.Unavailable("the client was closed"))
                raise
            if self.answers > answers:
                # "retries in a row" counts streams that answered nothing: one that answered
                # batches and then broke (a server killed after serving for a while) starts
                # the count again. Counted only when it ended cleanly, callers failed after
                # retries + 1 restarts however long the server served between them
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
                        await asyncio.sleep(retry_wait(self._backoff, attempt))
                continue
            code = error.code()
            # a lost status (nothing from the refused batch on was written): sent again, as
            # for a broken stream. Never this side's CANCELLED, even while close() flushes
            # (_closing): both clients close their channel only after their batchers' close
            # returned, so a CANCELLED here is the server's (a server stopping as the client
            # closes: its callers got CANCELLED instead of the answers close() waits for)
            if stream_cut(error, closing=False):
                self._resend.extendleft(reversed(unanswered))
                attempt += 1
                if attempt > tries_allowed(self._retries, error):
                    self._fail(self._take_resend(), self._translate(error, attempt))
                    attempt = 0
                else:
                    await asyncio.sleep(retry_wait(self._backoff, attempt))
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
                err = self._translate(error, 1)
                if code == grpc.StatusCode.INVALID_ARGUMENT and len(refused.entries) == 1:
                    err = own_field(err)
                self._fail([refused], err)

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
        threaded = 0
        while waiting and len(out) < count:
            e = waiting.popleft()
            if e.threaded:
                threaded += 1  # the threads' room is given back once, below
            else:
                self._space.release()
            if not e.future.done():
                out.append(e)
        self._tspace.give(threaded)
        return out

    def _release_done(self) -> None:
        waiting = self._waiting
        threaded = 0
        while waiting and waiting[0].future.done():
            e = waiting.popleft()
            if e.threaded:
                threaded += 1
            else:
                self._space.release()
        self._tspace.give(threaded)

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
                while True:  # until a batch is due (see _due), with no await once it is
                    self._wakeup.clear()
                    self._pull_inbox()
                    self._release_done()
                    if self._resend:
                        break
                    if not self._waiting and self._closing:
                        return
                    sleep = self._due(bool(unanswered))
                    if sleep == 0:
                        break
                    if self._inbox:  # handed over before wake_at was lowered: look again
                        continue
                    await self._sleep(sleep)
                    if finished:
                        return
                if self._resend:
                    credit.release()
                    continue
                entries = self._take(config.max_batch)
                if not entries:
                    credit.release()
                    continue
                self._last_cut = len(entries)
                self._back_count = max(0, self._back_count - len(entries))
                batch = _Batch(entries, self._encode([e.message for e in entries]))
                unanswered.append(batch)  # before the yield: a broken stream sends it again
                self.batches += 1
                yield batch.request

        stream = self._channel().stream_stream(
            _SEND_STREAM, request_serializer=None, response_deserializer=pb.SendBatchResponse.FromString
        )
        self.streams += 1
        # merged answers (wire.MERGE_ANSWERS): the answers ready together come as one message
        call = stream(requests(), metadata=(*self._metadata, wire.MERGE_ANSWERS))
        answered = 0
        try:
            async for response in call:
                for answer in (response, *response.more) if response.more else (response,):
                    if not unanswered:
                        raise errors.InvariantViolation("SendStream answered a batch that was not sent")
                    batch = unanswered.popleft()
                    credit.release()
                    answered += 1
                    self.answers += 1
                    self._answer(batch, answer)
                    self._answered(len(batch.entries))
        except asyncio.CancelledError:
            if not cancelled_by_grpc():
                raise  # the sender task itself is cancelled (its loop ending)
            # grpc.aio cancelled the call itself (its half-close failed at close() on a
            # connection just broken, or its channel closed under it): a cut, whose batches go
            # again (as send_many's); the sender ended cancelled, failing them "the client
            # was closed", and close() raised CancelledError
            raise CancelledByGrpc() from None
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
            _resolve_all([e.future for e in entries], [Receipt.from_pb(r) for r in response.receipts])
            return
        dues = response.deliver_at_ms
        if len(dues) != len(entries):
            err = errors.InvariantViolation(f"compact answer has {len(dues)} due times for {len(entries)} messages")
            self._fail([batch], err)
            return
        first = response.first_sequence
        shard = response.shard
        _resolve_all(
            [e.future for e in entries],
            [Receipt(e.message[4], dues[i], first + i, shard) for i, e in enumerate(entries)],
        )

    @staticmethod
    def _fail(batches: list[_Batch], error: BaseException) -> None:
        for batch in batches:
            for e in batch.entries:
                if not e.future.done():
                    _reject(e.future, error)


class _Target:
    __slots__ = ("request", "future", "deadline")

    def __init__(self, request: Any, future: AnyFuture, deadline: float | None) -> None:
        self.request = request  # as the batcher's callers hand it (CancelBatcher: CancelTarget)
        self.future = future  # asyncio.Future (a task's call) or Waiter (a thread's)
        self.deadline = deadline  # time.monotonic() at which its caller gives up; None: never


# a call of the client (its retries included): (request, timeout) -> the response
# (CancelBatch / RescheduleBatch, and Cancel / Reschedule for one target)
BatchCall = Callable[[Any, float | None], Awaitable[Any]]
SingleCall = Callable[[Any, float | None], Awaitable[Any]]

_CANCELLED = pb.CancelResponse.CANCELLED
_ALREADY_CANCELLED = pb.CancelResponse.ALREADY_CANCELLED


class _Resend(Exception):
    """The stream a request rode on ended before answering it: send it again. ``error`` is
    the stream's own failure (counted against the retries), None when the request was only
    behind another one's refusal (sent again at once, not counted)."""

    def __init__(self, error: grpc.RpcError | None, counted: bool) -> None:
        super().__init__("CancelStream ended before answering")
        self.error = error
        self.counted = counted


class _NoStream(Exception):
    """The server has no CancelStream (UNIMPLEMENTED): an older version."""


class _Stream:
    """One CancelStream call: requests go out in order, and the k-th response answers the
    k-th request (a future each, in ``waiting``). When the call ends, every request it did
    not answer is given its verdict: the first one the call's refusal (a refusal belongs to
    the first unanswered request), the others :class:`_Resend`."""

    def __init__(
        self,
        open_call: Callable[[AsyncIterator[pb.CancelBatchRequest]], Any],
        translate: Callable[[grpc.RpcError, int], errors.QdelayError],
    ) -> None:
        self._translate = translate
        self._requests: asyncio.Queue = asyncio.Queue()
        self.waiting: deque[asyncio.Future] = deque()
        self.dead = False
        self.call = open_call(self._out())
        self.reader = asyncio.get_running_loop().create_task(self._read(), name="qdelay-cancel-stream")

    def submit(self, request: pb.CancelBatchRequest) -> asyncio.Future:
        """Queue ``request`` on the stream; the future of its response (no await between the
        two appends: the order of ``waiting`` is the order on the wire)."""
        future = asyncio.get_running_loop().create_future()
        self.waiting.append(future)
        self._requests.put_nowait(request)
        return future

    async def _out(self) -> AsyncIterator[pb.CancelBatchRequest]:
        while True:
            request = await self._requests.get()
            if request is None or self.dead:
                return
            yield request

    async def _read(self) -> None:
        error: grpc.RpcError | None = None
        try:
            async for response in self.call:
                if not self.waiting:
                    raise errors.InvariantViolation("CancelStream answered a request that was not sent")
                future = self.waiting.popleft()
                if not future.done():  # else its caller gave up (timeout): the answer is dropped
                    future.set_result(response)
        except grpc.RpcError as e:
            error = e
        except asyncio.CancelledError:
            if not cancelled_by_grpc():
                raise  # the reading task itself is cancelled (its loop ending): it ends so
            # grpc.aio cancelled the call itself (its request-writing task failed, or its
            # channel closed; close()'s own cancel too, with nothing waiting): a stream cut
            # by CANCELLED, its requests sent again, and the reader ends as a task that was
            # not cancelled (it ended cancelled, which no one had asked for)
            error = CancelledByGrpc()
        finally:
            self.dead = True
            self._requests.put_nowait(None)
            self.call.cancel()  # a no-op once the call ended
            self._settle(error)

    def _settle(self, error: grpc.RpcError | None) -> None:
        waiting, self.waiting = list(self.waiting), deque()
        code = error.code() if error is not None else None
        transient = (
            error is None or lost_status(error) or code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        )
        for k, future in enumerate(waiting):
            if future.done():
                continue
            if transient:
                future.set_exception(_Resend(error, counted=True))  # ended by the server, or broken
            elif k:
                future.set_exception(_Resend(None, counted=False))  # behind the refused one
            elif code == grpc.StatusCode.UNIMPLEMENTED:
                future.set_exception(_NoStream())
            else:
                future.set_exception(self._translate(error, 1))

    async def close(self) -> None:
        self.dead = True
        self._requests.put_nowait(None)
        self.call.cancel()
        await asyncio.gather(self.reader, return_exceptions=True)


class CancelStreamCall:
    """CancelBatch requests carried on one long-lived CancelStream (the batch call of a
    :class:`CancelBatcher`, same signature as a CancelBatch call): a gathered batch costs
    the server a stream message instead of a gRPC call (~0.6-1.1 ms of its CPU each), as
    ``send()``'s batches ride one SendStream.

    A request the stream did not answer (the stream broke, or the server ended it while
    shutting down) is sent again, unchanged, on a new stream, with exponential backoff,
    ``retries`` times in a row; then its callers get the error. A request that was behind a
    refused one on the same stream was not read by the server and goes again at once. A
    refusal (INVALID_ARGUMENT, FAILED_PRECONDITION, ...) is raised to the batcher, whose
    policy says who gets it (:class:`TargetBatcher`). Against a server without CancelStream
    (UNIMPLEMENTED) every batch goes as a CancelBatch call (``fallback``) from then on.

    Cancel is idempotent, and a request sent again may find its targets cancelled by its
    own first try, whose answer was lost with the stream: for a request sent again, the
    server's ALREADY_CANCELLED is reported as CANCELLED. So what a caller sees does not
    depend on where a stream broke: CANCELLED when the message is cancelled and this
    caller's request was the first to reach it, or may have been (ALREADY_CANCELLED only
    from a first try); ALREADY_DELIVERED, NOT_FOUND, DEAD_LETTERED as the server says.
    Both CANCELLED and ALREADY_CANCELLED mean the message is never delivered after the
    answer."""

    def __init__(
        self,
        open_call: Callable[[AsyncIterator[pb.CancelBatchRequest]], Any],
        fallback: BatchCall,
        translate: Callable[[grpc.RpcError, int], errors.QdelayError],
        retries: int,
        backoff: float,
        default_timeout: float,
        timeout_error: Callable[[float], BaseException],
    ) -> None:
        self._open_call = open_call
        self._fallback = fallback
        self._translate = translate
        self._retries = retries
        self._backoff = backoff
        self._default_timeout = default_timeout
        self._timeout_error = timeout_error
        self._deadlines = _Deadlines(timeout_error)  # one timer for the earliest, as SendBatcher's callers
        self._stream: _Stream | None = None
        self.unimplemented = False  # the server has no CancelStream: CancelBatch calls
        self.streams = 0  # CancelStream calls opened (a figure for tests and benchmarks)
        self.resent = 0  # requests sent again after a stream ended without answering them

    async def __call__(self, request: pb.CancelBatchRequest, timeout: float | None) -> pb.CancelBatchResponse:
        """``request``'s response, or an error (a refusal, or the last one after ``retries``
        tries in a row), within ``timeout`` (default: the client's)."""
        timeout = timeout or self._default_timeout
        deadline = time.monotonic() + timeout
        attempt = 0
        resent = False
        while True:
            if self.unimplemented:
                return await self._fallback(request, max(0.001, deadline - time.monotonic()))
            stream = self._stream
            if stream is None or stream.dead:
                try:
                    stream = self._stream = _Stream(self._open_call, self._translate)
                except grpc.aio.UsageError as e:  # grpc's "Channel is closed.", outside the tree
                    raise channel_closed(e) from None
                self.streams += 1
            future = stream.submit(request)
            # the deadline on the response's own future (one timer for the earliest of them)
            # rather than asyncio.wait_for, whose wrapper future and callback cost every batch
            # a turn of the loop more; a late response finds its future done and is dropped
            loop = asyncio.get_running_loop()
            self._deadlines.arm(loop, future, loop.time() + max(0.001, deadline - time.monotonic()), timeout)
            try:
                response = await future
            except _NoStream:
                self.unimplemented = True
                continue
            except _Resend as again:
                resent = True
                self.resent += 1
                if not again.counted:
                    continue
                attempt += 1
                if attempt > tries_allowed(self._retries, again.error):
                    if again.error is None:
                        raise errors.Unavailable("CancelStream ended with the request unanswered") from None
                    raise self._translate(again.error, attempt) from None
                await asyncio.sleep(retry_wait(self._backoff, attempt))
                continue
            return as_first_try(response) if resent else response

    async def close(self) -> None:
        """End the stream (the batcher calls this once nothing is under way)."""
        stream, self._stream = self._stream, None
        if stream is not None:
            await stream.close()


def as_first_try(response: pb.CancelBatchResponse) -> pb.CancelBatchResponse:
    """A re-sent request's response with ALREADY_CANCELLED read as CANCELLED (see
    :class:`CancelStreamCall`; the clients' ``cancel_many`` after a retried CancelBatch)."""
    if all(r.outcome != _ALREADY_CANCELLED for r in response.responses):
        return response
    return pb.CancelBatchResponse(
        responses=[
            pb.CancelResponse(outcome=_CANCELLED if r.outcome == _ALREADY_CANCELLED else r.outcome)
            for r in response.responses
        ]
    )


class TargetBatcher(abc.ABC):
    """Concurrent calls that each name one message (``cancel()``, ``reschedule()``) carried
    as batch requests (CancelBatch, RescheduleBatch), on one event loop; the subclasses say
    which request and how an answer reads (:class:`CancelBatcher`, :class:`RescheduleBatcher`).
    The policy, told below for cancels, is the same for both.

    Concurrent ``cancel()`` calls carried as CancelBatch requests, on one event loop: the
    asyncio client's on the user's loop, the blocking client's on its private I/O loop
    (threads hand their cancels over with :meth:`submit_threadsafe`, as their sends). With
    ``stream`` (the clients' default) every batch, a lone cancel's too, is a request on one
    CancelStream (:class:`CancelStreamCall`: re-sends after a broken stream); without it,
    a CancelBatch call (a lone cancel: a Cancel call). "Call" below is either.

    For the reason ``send()`` batches (a gRPC call costs the server ~0.6-1.1 ms of CPU
    whatever it carries; a cancel in a batch ~10 us): cancels made at the same moment
    share a call. A group commit: a cancel that finds fewer than ``max_in_flight`` calls
    under way goes at once, with everything queued (at most ``max_batch``); the others
    wait for a call to come back. A new call lingers up to ``linger`` seconds to fill only
    while another is unanswered, or while the callers of the last one (just answered) are
    likely coming back: a lone cancel never waits. Lingering for those callers ends as soon
    as as many targets as the last call carried are queued (16 threads cancelling in a loop
    are back within a fraction of ``linger``); callers wake the runner only then, not once
    each.

    Each caller gets its own outcome, or its own error, within its own timeout: a caller
    that gives up (its timeout, its task cancelled) before its target was cut into a call
    is left out; after that, the call goes on for the others (its deadline is the latest
    of its callers'), and whether the cancel took effect is unknown to the one who gave up,
    as for a unary call that timed out.

    A batch refused for what a target is (one bad target is INVALID_ARGUMENT for all; a
    server without CancelBatch) goes again one Cancel per target still awaited, so that
    each caller gets its own answer or its own error (a server without the batch RPC,
    UNIMPLEMENTED, gets single calls from then on). FAILED_PRECONDITION for a batch with
    targets named by id (by-id lookups off, or a slave): those callers get it, the others'
    targets are carried again. Any other refusal is the server's (RESOURCE_EXHAUSTED, a
    slave's or fenced master's FAILED_PRECONDITION, UNAUTHENTICATED, ...), as is an error
    after the client's retries (UNAVAILABLE, the call's deadline): every caller's of that
    call, as it would have been each one's, and not one call per target at a server that
    refuses.

    State has one owner: the runner task cuts the calls; callers only append and wake it."""

    KIND = "CancelBatch"  # the batch RPC, in messages

    @staticmethod
    @abc.abstractmethod
    def _batch_request(requests: list) -> Any:
        """The batch request carrying ``requests`` (one per target, in order)."""

    @staticmethod
    def _single_request(request: Any) -> Any:
        """The single call's request of one target as its caller handed it."""
        return request

    @staticmethod
    @abc.abstractmethod
    def _answer(response: Any) -> Any:
        """What a caller gets from its target's response (a batch's item or a single call's)."""

    def __init__(
        self,
        batch_call: BatchCall,
        single_call: SingleCall,
        max_batch: int = 1000,
        max_in_flight: int = 2,
        linger: float = 0.001,
        timeout_error: Callable[[float], BaseException] = lambda t: TimeoutError(f"no answer within {t} s"),
        stream: CancelStreamCall | None = None,
    ) -> None:
        # with a stream, every call (a lone cancel's too) is a message on it
        self._stream = stream
        self._batch_call: BatchCall = stream if stream is not None else batch_call
        self._single_call = single_call
        self.max_batch = max_batch
        self.max_in_flight = max_in_flight
        self.linger = linger
        self._timers = _Deadlines(timeout_error)
        self._queue: deque[_Target] = deque()
        # threads hand cancels over through _inbox; one call_soon_threadsafe wakes the loop per burst;
        # _handover makes a thread's check of _closing and its hand-over one step (SendBatcher's)
        self._inbox = Inbox(self._take_handed)
        self._handover = threading.Lock()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._carriers: set[asyncio.Task] = set()
        self._under_way = 0  # calls made and not yet answered
        self._last = 0  # targets the last call carried
        # while the runner gathers (``_gather``), the queue size that wakes it: callers wake
        # it once that many are queued, not once each (1: every cancel wakes it)
        self._want = 1
        self._closing = False
        self._single_only = False  # the server has no batch RPC (UNIMPLEMENTED): single calls
        self.calls = 0  # batch calls made (a figure for tests and benchmarks)
        self.batches = 0  # calls made, single Cancels included
        self.carried = 0  # targets they carried

    # ------------------------------------------------------------------ callers
    async def call(self, request: Any, timeout: float | None = None) -> Any:
        """On the batcher's loop: the answer (``_answer``) of one target, or its error;
        after ``timeout`` seconds the ``timeout_error``."""
        if self._closing:
            raise errors.FailedPrecondition("the client is closed")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        deadline = None
        if timeout is not None:
            deadline = time.monotonic() + timeout
            self._timers.arm(loop, future, loop.time() + timeout, timeout)
        self._queue.append(_Target(request, future, deadline))
        self._wake(loop)
        return await future  # a cancelled task cancels the future: left out if not yet cut

    def submit_threadsafe(self, loop: asyncio.AbstractEventLoop, request: Any, timeout: float | None) -> Waiter:
        """From any thread: queue one target on ``loop`` (the batcher's); the Waiter of its
        answer. The thread waits on it with its own timeout (and so gives up)."""
        waiter = Waiter()
        target = _Target(request, waiter, None if timeout is None else time.monotonic() + timeout)
        with self._handover:
            if self._closing:
                raise errors.FailedPrecondition("the client is closed")
            self._inbox.put(loop, target)
        return waiter

    def _take_handed(self, targets: list[_Target]) -> None:
        if not targets:  # drained already (close(), the runner)
            return
        self._queue.extend(targets)
        self._wake(asyncio.get_running_loop())

    def _wake(self, loop: asyncio.AbstractEventLoop) -> None:
        if len(self._queue) >= self._want:  # else the runner gathers on
            self._wakeup.set()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run(), name=f"qdelay-{self.KIND}-batcher")

    async def close(self) -> None:
        """Carry what is queued (what threads handed over included), wait for the calls
        under way."""
        with self._handover:  # from here no thread hands a target over
            self._closing = True
        self._take_handed(self._inbox.drain())  # makes a runner if none runs
        self._wakeup.set()
        if self._task is not None:
            await self._task
        if self._carriers:
            await asyncio.gather(*self._carriers, return_exceptions=True)
        if self._stream is not None:
            await self._stream.close()

    # ------------------------------------------------------------------ the runner task
    def _awaited(self) -> bool:
        """Whether a queued target's caller still waits (those who gave up leave from the head)."""
        queue = self._queue
        while queue and queue[0].future.done():
            queue.popleft()
        return bool(queue)

    async def _run(self) -> None:
        queue, loop, inbox = self._queue, asyncio.get_running_loop(), self._inbox
        while True:
            while True:
                self._pull_inbox()  # handed over while an answer's callers were awaited (``_coming``)
                if self._under_way < self.max_in_flight and self._awaited():
                    break
                self._set_wake(1)  # from here every cancel wakes the runner (or makes a new one) ...
                if inbox:  # ... one handed over before this is looked at again
                    continue
                if not self._under_way:
                    # nothing queued, no call under way: the runner ends (the next call makes a
                    # new one), as SendBatcher's sender does, so that an idle client leaves no
                    # task pending on its loop
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
            waiting = len(queue)
            if self.linger and waiting < self.max_batch and (self._under_way or waiting < self._last):
                # while a call is unanswered, fill the next for ``linger`` (up to max_batch);
                # else gather the last call's callers, who are coming back, until they are
                await self._gather(self.max_batch if self._under_way else min(self._last, self.max_batch))
            batch: list[_Target] = []
            while queue and len(batch) < self.max_batch:  # no await: nothing is between queue and call
                e = queue.popleft()
                if not e.future.done():
                    batch.append(e)
            if not batch:
                continue
            self._under_way += 1
            self._last = len(batch)
            task = loop.create_task(self._carry(batch))
            self._carriers.add(task)
            task.add_done_callback(self._carriers.discard)

    async def _gather(self, target: int) -> None:
        """Until ``target`` targets are queued, for at most ``linger`` seconds. Threads wake
        the loop only once enough are handed over (the inbox's ``wake_at``, set before the
        last look at it: none is left unseen), tasks only once enough are queued (``_want``)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self.linger
        queue, inbox = self._queue, self._inbox
        try:
            while True:
                self._pull_inbox()
                left = end - loop.time()
                if len(queue) >= target or left <= 0 or self._closing:
                    return
                self._set_wake(target)
                if inbox:  # handed over before wake_at was set: look again
                    continue
                self._wakeup.clear()
                await _wait_set(self._wakeup, left)
        finally:
            self._set_wake(1)
            self._pull_inbox()  # handed over while wake_at was above 1 and not enough to wake the loop

    @staticmethod
    def _left(batch: list[_Target]) -> float | None:
        """The call's timeout: until the last of its callers still waiting gives up (None:
        one waits without a deadline, the client's default timeout applies)."""
        deadlines = [e.deadline for e in batch if not e.future.done()]
        if not deadlines or None in deadlines:
            return None
        return max(0.001, max(cast("list[float]", deadlines)) - time.monotonic())

    async def _carry(self, batch: list[_Target]) -> None:
        self.batches += 1
        self.carried += len(batch)
        batched = False  # the call made is the batch RPC (a CancelStream request included)
        try:
            try:
                if (len(batch) == 1 and self._stream is None) or self._single_only:
                    if len(batch) > 1:  # a server without the batch RPC: each its own call
                        await asyncio.gather(*(self._one(e) for e in batch if not e.future.done()))
                        return
                    single = self._single_request(batch[0].request)
                    outcomes = [self._answer(await self._single_call(single, self._left(batch)))]
                else:
                    batched = True
                    self.calls += 1
                    request = self._batch_request([e.request for e in batch])
                    responses = (await self._batch_call(request, self._left(batch))).responses
                    if len(responses) != len(batch):
                        got = len(responses)
                        raise errors.InvariantViolation(f"{self.KIND} answered {got} of {len(batch)} targets")
                    outcomes = [self._answer(r) for r in responses]
            except errors.Unavailable as err:  # retried already (a deadline is one): every caller's
                for e in batch:
                    _reject(e.future, err)
                return
            except Exception as err:  # noqa: BLE001 - a refusal of the whole call: one by one
                if batched and getattr(err, "code", None) == grpc.StatusCode.UNIMPLEMENTED:
                    # no batch RPC on this server: single calls from now on, a lone target's
                    # too (with a stream, a lone cancel rides the batch RPC)
                    self._single_only = True
                elif len(batch) == 1:
                    # a lone target in a batch call (cancel()'s, on the stream): the error worded
                    # as its single call words it
                    own = own_field(err, "requests[0].", "") if batched and isinstance(err, errors.QdelayError) else err
                    _reject(batch[0].future, own)
                    return
                elif isinstance(err, errors.FailedPrecondition) and self._requeue_by_receipt(batch, err):
                    return
                elif not isinstance(err, errors.InvalidArgument):
                    # the server's refusal (disk full, overloaded, a slave, auth, ...): each of
                    # its calls would say the same; one per target would be up to max_batch
                    # calls at a server that refuses
                    for e in batch:
                        _reject(e.future, err)
                    return
                await asyncio.gather(*(self._one(e) for e in batch if not e.future.done()))
                return
            self._coming(len(batch))
            _resolve_all([e.future for e in batch], outcomes)
        finally:
            self._under_way -= 1
            self._wakeup.set()

    def _coming(self, count: int) -> None:
        """An answered call's ``count`` callers are likely coming back (threads or tasks
        cancelling in a loop): they wake the runner only once that many are queued, not each
        the first (a thread's wake is a write to the loop's self-pipe and a turn of the loop:
        ~3 a call against ~2 for ``send()``'s batches, 16 threads). The runner is woken
        after the answer anyway; it drains what was handed over before it looks and lowers
        the threshold again before it sleeps (``_run``), so none is left unseen."""
        self._set_wake(count)

    def _pull_inbox(self) -> None:
        """On the loop: the targets threads handed over without waking it join the queue."""
        if self._inbox:
            self._queue.extend(self._inbox.drain())

    def _set_wake(self, total: int) -> None:
        """Callers wake the runner once ``total`` targets are queued (threads' included):
        tasks by ``_want``, threads by the inbox's ``wake_at``."""
        self._want = total
        self._inbox.wake_at = max(1, total - len(self._queue))

    def _requeue_by_receipt(self, batch: list[_Target], err: Exception) -> bool:
        """A batch refused with FAILED_PRECONDITION that names targets by id: the server may
        have by-id lookups off (a fault of those targets), or be a slave (every target's).
        The by-id targets get the error (their own call would get it either way), those
        named by receipt go back to the head of the queue, to be carried again (refused
        again by a slave, now with no by-id target among them: every caller's). Whether
        any was by id."""
        by_id = [self._by_id(e.request) for e in batch]
        if not any(by_id):
            return False
        for e, named_by_id in zip(batch, by_id):
            if named_by_id:
                _reject(e.future, err)
        self._queue.extendleft(reversed([e for e, named_by_id in zip(batch, by_id) if not named_by_id]))
        self._wake(asyncio.get_running_loop())
        return True

    @staticmethod
    def _by_id(request: Any) -> bool:
        """Whether a target names its message by id alone (a request without a receipt; a
        Receipt's fields, ``cancel()``'s usual target, never)."""
        return not isinstance(request, tuple) and not request.HasField("receipt")

    async def _one(self, e: _Target) -> None:
        try:
            outcome = self._answer(await self._single_call(self._single_request(e.request), self._left([e])))
        except Exception as err:  # noqa: BLE001 - that caller's own error
            _reject(e.future, err)
            return
        _resolve(e.future, outcome)


class CancelBatcher(TargetBatcher):
    """``cancel()``'s batcher: CancelBatch requests (on a CancelStream with ``stream``),
    a lone cancel a Cancel call; each caller gets its CancelResponse.Outcome number."""

    KIND = "CancelBatch"

    @staticmethod
    def _batch_request(requests: list) -> pb.CancelBatchRequest:
        """A Receipt's fields (``cancel()``'s usual target, ``types.cancel_target``) written
        straight into the request, a CancelRequest copied: its callers made no CancelRequest
        each (16 of them and the request cost ~21 us, ~13 this way)."""
        request = pb.CancelBatchRequest()
        add = request.requests.add
        for r in requests:
            if isinstance(r, tuple):
                receipt = add().receipt
                receipt.message_id, receipt.deliver_at_ms, receipt.sequence = r[0], r[1], r[2]
                if r[3]:
                    receipt.shard = r[3]
            else:
                add().CopyFrom(r)
        return request

    @staticmethod
    def _single_request(request: CancelTarget) -> pb.CancelRequest:
        if isinstance(request, tuple):
            return cancel_request(Receipt(*request))
        return request

    @staticmethod
    def _answer(response: pb.CancelResponse) -> int:
        return int(response.outcome)

    async def cancel(self, request: CancelTarget, timeout: float | None = None) -> int:
        """On the batcher's loop: the outcome (CancelResponse.Outcome number) of one target,
        or its error; after ``timeout`` seconds the ``timeout_error``."""
        return await self.call(request, timeout)


class RescheduleBatcher(TargetBatcher):
    """``reschedule()``'s batcher: concurrent reschedules share RescheduleBatch calls (one
    group commit for all their moves; a lone one is a Reschedule call), and each caller
    gets its own RescheduleResponse. No stream: a call costs the server ~0.3-0.4 ms of CPU
    whatever it carries, a move in a batch a small part of that.

    A RescheduleBatch tried again after UNAVAILABLE (the client's retries) may find a
    target already moved by the try whose answer was lost, as a unary Reschedule tried
    again does: named by receipt, it answers CANCELLED (its old receipt's message is gone);
    named by id, it is moved again (RESCHEDULED, a ``delay`` counted from the retry)."""

    KIND = "RescheduleBatch"

    @staticmethod
    def _batch_request(requests: list) -> pb.RescheduleBatchRequest:
        return pb.RescheduleBatchRequest(requests=requests)

    @staticmethod
    def _answer(response: pb.RescheduleResponse) -> pb.RescheduleResponse:
        return response

    async def reschedule(self, request: pb.RescheduleRequest, timeout: float | None = None) -> pb.RescheduleResponse:
        """On the batcher's loop: the response of one move, or its error; after ``timeout``
        seconds the ``timeout_error``."""
        return await self.call(request, timeout)
