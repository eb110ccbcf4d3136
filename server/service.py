"""DelayService: the gRPC API v1 on top of the engine.

Writes: validate the whole request (nothing is written for a refused one), check the
free-space guard and the bounded ingest queue, then ``await engine.send`` — concurrent
calls share the engine's group commit, so RPCs are never serialised here. A Send is
answered only once its records are durable.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import shutil
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import numpy as np

from qdelay import wire
from qdelay.errors import DiskFull, InvalidArgument, InvariantViolation, Overloaded, ShuttingDown
from qdelay.segments.wal import Appended
from qdelay.server import status
from qdelay.server.config import ServerConfig
from qdelay.server.dedupe import Claim, Deduper
from qdelay.server.engine import Receipt
from qdelay.server.validation import (
    EncodedBatch,
    IdGenerator,
    decode_batch,
    decode_cancel_batch,
    encode_messages,
    validate_cancel_batch,
    validate_change_group,
    validate_receipt,
    validate_reschedule,
    validate_reschedule_batch,
    validate_stats,
    validate_subscribe,
)
from qdelay.v1 import qdelay_pb2 as pb
from qdelay.v1 import qdelay_pb2_grpc as pb_grpc

log = logging.getLogger("qdelay.service")

_CLOSING = object()  # what a SendStream's pipeline gives once shut down with nothing left to answer
_EMPTY = object()  # _Pipeline.take: nothing read and not yet answered
STREAM_PIPELINE = 16  # SendStream: batches submitted ahead of their responses, per stream
MAX_IN_FLIGHT_CAP = 100_000  # Subscribe credit is clamped here: it bounds the server's memory per stream


class DiskGuard:
    """Free-space guard: new messages need ``min_free`` bytes free, cancels ``hard`` bytes.

    The statvfs result is cached briefly (it is checked on every write).
    """

    def __init__(self, path: str, min_free: int, hard: int, ttl: float = 0.2) -> None:
        self.path = path
        self.min_free = min_free
        self.hard = hard
        self.ttl = ttl
        self._free: int | None = None
        self._at = 0.0

    def free(self) -> int:
        now = time.monotonic()
        free = self._free
        if free is None or now - self._at > self.ttl:
            try:
                free = shutil.disk_usage(self.path).free
            except OSError:
                free = 1 << 62  # cannot tell: let the write itself fail if the disk is full
            self._free, self._at = free, now
        return free

    def check(self, cancel: bool = False) -> None:
        need = self.hard if cancel else self.min_free
        if need <= 0:
            return
        free = self.free()
        if free < need:
            what, key = ("cancels", "min_free_bytes_hard") if cancel else ("new messages", "min_free_bytes")
            # the limit is a floor of free space: lowering it is what lets writes in (the
            # advice said "raise", and named min_free_bytes for cancels too)
            raise DiskFull(
                f"free space on the data disk is {free} bytes, below the {need} bytes needed "
                f"for {what}; free some space, or lower {key}"
            )


class IngestGate:
    """The bounded ingest queue: messages (and bytes) accepted but not yet durable."""

    def __init__(self, max_messages: int, max_bytes: int) -> None:
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self.messages = 0
        self.bytes = 0

    def enter(self, count: int, size: int) -> None:
        if self.messages and (self.messages + count > self.max_messages or self.bytes + size > self.max_bytes):
            raise Overloaded(
                f"ingest queue full: {self.messages} messages / {self.bytes} bytes waiting to be "
                f"durable (limits {self.max_messages} / {self.max_bytes}); retry later"
            )
        self.messages += count
        self.bytes += size

    def leave(self, count: int, size: int) -> None:
        self.messages -= count
        self.bytes -= size


class _Pipeline:
    """The requests of one SendStream or CancelStream read and started, not yet answered
    (``DelayService._pipelined``): a deque between the stream's reader task, which puts
    (a started request, a refusal, or None at the end) and waits for room past
    STREAM_PIPELINE, and its writer, which takes in order. Each side waits on a future
    of its own only when it must; asyncio.Queue cost every batch its getter's future and
    wake-up, its putter checks and a loop turn more (bench.stream_loop)."""

    __slots__ = ("items", "closed", "_taker", "_putter")

    def __init__(self) -> None:
        self.items: collections.deque = collections.deque()
        self.closed = False  # the server is shutting down: the writer ends once all read is answered
        self._taker: asyncio.Future | None = None  # the writer's, while there is nothing to take
        self._putter: asyncio.Future | None = None  # the reader's, while full

    def put(self, item: object) -> None:
        self.items.append(item)
        self._wake_taker()

    def close(self) -> None:
        self.closed = True
        self._wake_taker()

    def _wake_taker(self) -> None:
        taker = self._taker
        if taker is not None:
            self._taker = None
            if not taker.done():
                taker.set_result(None)

    def full(self) -> bool:
        return len(self.items) >= STREAM_PIPELINE

    async def room(self) -> None:
        while self.full():
            self._putter = putter = asyncio.get_running_loop().create_future()
            await putter

    def take(self) -> Any:
        """The oldest item, _CLOSING once closed with none left, else _EMPTY."""
        if not self.items:
            return _CLOSING if self.closed else _EMPTY
        item = self.items.popleft()
        putter = self._putter
        if putter is not None:
            self._putter = None
            if not putter.done():
                putter.set_result(None)
        return item

    async def wait(self) -> Any:
        """``take`` once there is something to take (or the pipeline is closed)."""
        while True:
            item = self.take()
            if item is not _EMPTY:
                return item
            self._taker = taker = asyncio.get_running_loop().create_future()
            await taker


MERGED_ANSWER_BYTES = 1 << 20  # a merged SendStream answer stops growing past this (the client's limit is 4 MiB)


def _ready_answers(pipe: _Pipeline, answer: Callable[[Any, Any], bytes]) -> list[bytes]:
    """The answers of the requests next in ``pipe`` whose work is done and succeeded, taken
    from it in order (a request not done yet, a failed one or a refusal ends the run: it is
    answered, or ends the stream, on its own turn)."""
    out: list[bytes] = []
    size = 0
    items = pipe.items
    while items and size < MERGED_ANSWER_BYTES:
        head = items[0]
        if not isinstance(head, tuple):
            break
        future, context = head
        if not future.done() or future.cancelled() or future.exception() is not None:
            break
        pipe.take()
        body = answer(future.result(), context)
        out.append(body)
        size += len(body)
    return out


def _batch_response(
    batch: EncodedBatch, first: int, compact: bool, dups: dict[int, Receipt] | None = None, shard: str = ""
) -> bytes:
    """The SendBatchResponse of a written batch, as wire bytes (app.py registers SendBatch and
    SendStream without a response serializer): full receipts, or compact ones when asked for
    and no message was a duplicate; duplicates answer their original receipt. One call of
    the native wire codec, no protobuf object per receipt, so a generated client asking for
    full receipts costs the server little more than compact ones."""
    codec = wire.native
    encode = codec.encode_send_batch_response if codec is not None else wire.encode_send_batch_response_py
    originals = {k: (d.message_id, d.deliver_at_ms, d.sequence) for k, d in dups.items()} if dups else None
    return encode(batch.ids, batch.dues, first, compact, originals, shard)


class DelayService(pb_grpc.DelayServiceServicer):
    def __init__(self, engine, cfg: ServerConfig, consumers, metrics) -> None:
        self.engine = engine
        self.cfg = cfg
        self.limits = cfg.limits
        self.consumers = consumers
        self.metrics = metrics
        self.guard = DiskGuard(cfg.data_dir, cfg.min_free_bytes, cfg.min_free_bytes_hard)
        self.gate = IngestGate(cfg.ingest_queue_messages, cfg.ingest_queue_bytes)
        self.new_id = IdGenerator()
        self.dedupe = Deduper(engine, engine.config.dedupe_window_ms)
        self.closing = False
        self.active_writes = 0
        self.shard = (cfg.shard or "") if cfg.etcd else ""
        self.address = cfg.listen  # the real one is set by the app once it listens
        self.agent = None  # cluster mode: the etcd agent (replication/cluster.py), for Topology
        self._streams: set[_Pipeline] = set()  # the pipelines of the open SendStreams and CancelStreams

    def begin_shutdown(self) -> None:
        """Refuse new work, and end every SendStream and CancelStream once the batches it
        has read are answered: a batching client keeps one open while idle, and the server's stop would
        otherwise wait its whole grace period for it (the client opens a new one when it has
        something to send)."""
        self.closing = True
        for pipe in self._streams:
            pipe.close()  # (a busy one's writer also checks ``closing`` after each answer)

    # --- writes -----------------------------------------------------------------------------------
    def _validate(self, messages, single: bool = False, ids_required: bool = False) -> EncodedBatch:
        if self.closing:
            raise ShuttingDown("the server is shutting down; retry on another server or later")
        before = self.new_id.issued
        try:
            batch = encode_messages(messages, self.limits, self.engine.now_ms(), self.new_id, single, ids_required)
        except InvalidArgument:
            self.metrics.refused.labels("invalid").inc(len(messages) or 1)
            raise
        return self._mark_generated(batch, before)

    def _mark_generated(self, batch: EncodedBatch, before: int) -> EncodedBatch:
        """Name the ids generated while ``batch`` was validated (validation is synchronous:
        no other batch's ids in between)."""
        after = self.new_id.issued
        if after != before:
            batch.generated = self.new_id.made(before, after)
        return batch

    def _validate_request(self, request) -> tuple[EncodedBatch, bool]:
        """A SendBatchRequest as wire bytes (how app.py registers SendBatch and SendStream:
        the native codec decodes them without protobuf objects) or as a message."""
        if not isinstance(request, bytes):
            compact = request.compact_receipts
            return self._validate(request.messages, ids_required=compact), compact
        if self.closing:
            raise ShuttingDown("the server is shutting down; retry on another server or later")
        before = self.new_id.issued
        try:
            batch, compact = decode_batch(request, self.limits, self.engine.now_ms(), self.new_id)
        except InvalidArgument:
            self.metrics.refused.labels("invalid").inc()
            raise
        return self._mark_generated(batch, before), compact

    def _start_write(self, batch: EncodedBatch) -> Awaitable[tuple[int, dict[int, Receipt]]]:
        """Start writing a validated batch: what ``_write`` returns, as a future its records
        are already queued for (or it raises: nothing of the batch was written), or where
        the write must wait for something first (``Deduper.check_now``; sync replication
        or a cluster lease, ``Engine.answers_when_durable``), as ``_write``'s coroutine.

        The future needs no task, shield or coroutine chain: the append's outcome is
        handed to a callback on the loop (``Engine.send_bodies_then``), which settles the
        dedupe claim, the ingest gate and the metrics however the caller fares, and then
        the future: per batch, a task and its steps, a shield and two loop turns fewer
        than ``_write`` (bench.stream_loop measures the loop's CPU per message)."""
        engine, dedupe = self.engine, self.dedupe
        if not engine.answers_when_durable:
            return self._write(batch)
        if not dedupe.enabled:
            return self._append_now(batch, {}, None)
        engine.check_writable()  # before the lookup (see _write)
        checked = dedupe.check_now(batch.ids, batch.generated)
        if checked is None:
            return self._write(batch)
        dups, claim = checked
        try:
            return self._append_now(batch, dups, claim)
        except BaseException:
            dedupe.failed(claim)  # refused before its records were queued
            raise

    def _append_now(
        self, batch: EncodedBatch, dups: dict[int, Receipt], claim: Claim | None
    ) -> asyncio.Future[tuple[int, dict[int, Receipt]]]:
        """``_write`` after the lookup, where the engine answers a write once durable: the
        batch's records but the duplicates' are queued now (or it raises); the future is
        (first sequence, ``dups``) once they are durable, and the claim settles with them."""
        answer: asyncio.Future[tuple[int, dict[int, Receipt]]] = asyncio.get_running_loop().create_future()
        keep = [k for k in range(len(batch.ids)) if k not in dups] if dups else None
        dues = batch.dues if keep is None else [batch.dues[k] for k in keep]
        bodies = batch.bodies if keep is None else [batch.bodies[k] for k in keep]
        dedupe = self.dedupe
        if not bodies:  # duplicates alone: answered now (the engine waits for no replica)
            if claim is not None:
                dedupe.written(claim, 0, dues)
            self.engine.check_writable()
            answer.set_result((0, dups))
            return answer
        count, size = len(batch.bodies), batch.payload_bytes
        self._admit(count, size)
        started = time.perf_counter()

        def done(appended: Appended | None, error: Exception | None) -> None:
            # on the loop once the records are durable or failed, whether or not anyone
            # still waits for the answer (a cancelled caller's ids stay claimed until now)
            try:
                self._admitted(count, size, started if appended is not None else None)
                if claim is not None:
                    if appended is None:
                        dedupe.failed(claim)
                    else:
                        dedupe.written(claim, appended.first_sequence, dues)
                if appended is not None and dups:
                    self.engine.check_writable()  # right before the answer, as _write
            except Exception as err:  # noqa: BLE001 - the answer carries it
                error = err
            if answer.done():  # its caller was cancelled
                return
            if appended is None or error is not None:
                answer.set_exception(error or InvariantViolation("append settled without an outcome"))
            else:
                answer.set_result((appended.first_sequence, dups))

        try:
            self.engine.send_bodies_then(bodies, min(batch.dues), done)
        except BaseException:
            self._admitted(count, size, None)
            raise
        return answer

    async def _write(self, batch: EncodedBatch) -> tuple[int, dict[int, Receipt]]:
        """Append a validated batch, leaving out the messages whose id is a duplicate
        (server/dedupe.py); (first sequence written, batch index -> original receipt)."""
        dedupe = self.dedupe
        if not dedupe.enabled:
            return await self._append(batch, batch.bodies), {}
        # before the lookup: a batch of duplicates alone is never appended, so a slave or a
        # fenced master answered a retried send with the original receipt (duplicate = true)
        # instead of refusing it; from a fenced master, whose tail the new master may lack,
        # that acknowledged a message a failover had lost
        self.engine.check_writable()
        dups, claim = await dedupe.check(batch.ids, batch.generated)
        keep = [k for k in range(len(batch.ids)) if k not in dups] if dups else None
        dues = batch.dues if keep is None else [batch.dues[k] for k in keep]
        settled = False

        def durable(appended: Appended | None) -> None:
            # the claim settles with the append, not with this call: one cancelled (a
            # client's deadline) while its records were queued released the ids at once, and
            # the client's retry, finding them nowhere, wrote them again (delivered twice)
            nonlocal settled
            settled = True
            if appended is None:
                dedupe.failed(claim)
            else:
                dedupe.written(claim, appended.first_sequence, dues)

        try:
            bodies = batch.bodies if keep is None else [batch.bodies[k] for k in keep]
            first = await self._append(batch, bodies, durable) if bodies else 0
        except BaseException as err:
            # refused before its records were queued, or failed writing them; a cancellation
            # comes at an await of _append, every one after its records were queued:
            # ``durable`` was called, or will be once they are written or failed
            if not settled and not isinstance(err, asyncio.CancelledError):
                dedupe.failed(claim)
            raise
        if not bodies:
            dedupe.written(claim, first, dues)
        if dups:  # the originals may be durable on this server only (sync mode)
            await self.engine.wait_replicated()
            self.engine.check_writable()  # right before the answer, as for a write (a lease lost meanwhile)
        return first, dups

    def _admit(self, count: int, size: int) -> None:
        """The free-space guard and the ingest queue, for ``count`` messages of ``size``
        payload bytes about to be appended (``_admitted`` once they are durable or failed)."""
        try:
            self.guard.check()
        except DiskFull:
            self.metrics.refused.labels("disk").inc(count)
            raise
        try:
            self.gate.enter(count, size)
        except Overloaded:
            self.metrics.refused.labels("overload").inc(count)
            raise
        self.active_writes += 1

    async def _append(
        self, batch: EncodedBatch, bodies: list[bytes], durable: Callable[[Appended | None], None] | None = None
    ) -> int:
        """Append bodies of a validated batch; return the first sequence once durable.
        ``durable``: as Engine.send_bodies'."""
        count, size = len(batch.bodies), batch.payload_bytes
        self._admit(count, size)
        started = time.perf_counter()
        ok = False
        try:
            # (the batch's earliest due time: the iterate service may copy a far-future
            # batch later, in a larger step)
            first = await self.engine.send_bodies(bodies, min(batch.dues), durable)
            ok = True
        finally:
            self._admitted(count, size, started if ok else None)
        return first

    def _admitted(self, count: int, size: int, started: float | None) -> None:
        """An admitted append settled: written (``started``: when it was admitted) or not."""
        self.gate.leave(count, size)
        self.active_writes -= 1
        if started is not None:
            self.metrics.ingest.add(count, size, time.perf_counter() - started)

    @status.unary
    async def Send(self, request, context):
        if not request.HasField("message"):
            raise InvalidArgument("message: required")
        batch = self._validate([request.message], single=True)
        first, dups = await self._write(batch)
        if dups:
            d = dups[0]
            return pb.SendResponse(
                receipt=pb.Receipt(
                    message_id=d.message_id,
                    deliver_at_ms=d.deliver_at_ms,
                    sequence=d.sequence,
                    duplicate=True,
                    shard=self.shard,
                )
            )
        return pb.SendResponse(
            receipt=pb.Receipt(message_id=batch.ids[0], deliver_at_ms=batch.dues[0], sequence=first, shard=self.shard)
        )

    @status.unary
    async def SendBatch(self, request, context):
        batch, compact = self._validate_request(request)
        first, dups = await self._start_write(batch)
        return _batch_response(batch, first, compact, dups, self.shard)

    @status.streaming
    def SendStream(self, request_iterator, context):
        """Batches are validated in order and written concurrently; responses keep the order.

        The first refused batch ends the stream with its status; every batch before it has
        its response, nothing from it or after it is written.
        """

        def start(request) -> tuple[asyncio.Future, tuple]:
            batch, compact = self._validate_request(request)
            return asyncio.ensure_future(self._start_write(batch)), (batch, compact)

        def answer(written: tuple[int, dict[int, Receipt]], ctx: tuple):
            (first, dups), (batch, compact) = written, ctx
            return _batch_response(batch, first, compact, dups, self.shard)

        # the pipeline itself is the stream's generator (status.streaming closes it at once
        # when the stream ends): a generator around it cost every answer a resumption more
        merge = wire.MERGE_ANSWERS in (context.invocation_metadata() or ())
        announce = (lambda: context.send_initial_metadata((wire.PACKED_REQUESTS,))) if merge else None
        return self._pipelined(request_iterator, start, answer, merge, wire.unpack_send_batch_requests, announce)

    @status.unary
    async def Cancel(self, request, context):
        message_id, due, sequence = validate_receipt(request, self.limits)
        if self.closing:
            raise ShuttingDown("the server is shutting down; retry later")
        self.guard.check(cancel=True)
        outcome = await self.engine.cancel(message_id, due, sequence)
        return pb.CancelResponse(outcome=int(outcome))  # type: ignore[arg-type]  # protoc's .pyi wants its enum class; protobuf takes the int

    def _cancel_targets(self, request) -> list[tuple[str, int | None, int | None]]:
        """A CancelBatchRequest's targets: as wire bytes (how app.py registers CancelBatch
        and CancelStream: a batch of receipts is read without protobuf objects) or as a
        message."""
        if isinstance(request, bytes):
            return decode_cancel_batch(request, self.limits)
        return validate_cancel_batch(request, self.limits)

    @status.unary
    async def CancelBatch(self, request, context):
        targets = self._cancel_targets(request)
        if self.closing:
            raise ShuttingDown("the server is shutting down; retry later")
        self.guard.check(cancel=True)
        outcomes = await self.engine.cancel_many(targets)
        return wire.encode_cancel_batch_response(outcomes)

    @status.streaming
    def CancelStream(self, request_iterator, context):
        """CancelBatch requests on one stream: each validated in order and cancelled
        concurrently (each its own group commit, shared with whatever else is being
        written); responses keep the order. A gathering client's cancel batches cost the
        server a stream message each instead of a call each (a gRPC call costs this server
        ~0.6-1.1 ms of CPU whatever it carries).

        The first refused request ends the stream with its status: every request before it
        has its response; nothing of it is written, and nothing read after it is. Requests
        already under way when a later one fails finish (their tombstones may be written)
        without a response: a client sends them again, and cancelling again is safe.
        """

        def start(request) -> tuple[asyncio.Future, None]:
            targets = self._cancel_targets(request)
            if self.closing:
                raise ShuttingDown("the server is shutting down; retry later")
            self.guard.check(cancel=True)
            # once handed to the engine, a cancel settles even if the stream ends: its claims
            # are released or its tombstones written (see Engine.cancel_many)
            return asyncio.ensure_future(self.engine.cancel_many(targets)), None

        def answer(outcomes: list, _ctx: None) -> bytes:
            return wire.encode_cancel_batch_response(outcomes)

        return self._pipelined(request_iterator, start, answer)

    async def _pipelined(self, request_iterator, start, answer, merge: bool = False, unpack=None, announce=None):
        """The ordered pipeline of SendStream and CancelStream: each request is started in
        the order read (``start`` validates it and hands it to the engine: (a future, what
        ``answer`` needs besides its result)), up to STREAM_PIPELINE at once, and answered
        in that order (``answer(result, context)``). The first refused request ends the
        stream with its status: every request before it has its response, nothing of it
        or after it is started. On shutdown every request read is answered. Work already
        handed to the engine when the stream ends is let settle (it may still become
        durable).

        ``merge`` (a SendStream opened with ``wire.MERGE_ANSWERS``): an answer carries in
        ``more`` the answers of the requests behind it that are ready at the same moment
        (one group commit makes several durable at once: under bench.compare's load a
        stream had ~7 answers ready at a time), so that the stream writes, and its client
        reads, one message for them instead of one each: each is a gRPC operation and a
        wake-up of the poller and the loop on either side.

        ``unpack`` (SendStream: ``wire.unpack_send_batch_requests``): a stream message
        standing for several requests (a packed SendBatchRequest), or None; its requests are
        started one after another as if each had come alone (a refused one ends the stream,
        nothing after it started). ``announce``: a coroutine function run first (SendStream
        sends a stream that asked for merged answers its initial metadata, saying it takes
        packed requests: ``wire.PACKED_REQUESTS``)."""
        if announce is not None:
            await announce()
        pipe = _Pipeline()

        async def read() -> None:
            try:
                async for message in request_iterator:
                    try:
                        requests = unpack(message) if unpack is not None else None
                    except Exception as error:  # noqa: BLE001 - reported in order by the writer below
                        pipe.put(error)
                        return
                    for request in (message,) if requests is None else requests:
                        try:
                            item = start(request)
                        except Exception as error:  # noqa: BLE001 - reported in order by the writer below
                            pipe.put(error)
                            return
                        pipe.put(item)
                        if pipe.full():
                            await pipe.room()
            finally:
                pipe.put(None)

        reader = asyncio.ensure_future(read())
        self._streams.add(pipe)
        try:
            while True:
                item = pipe.take()
                if item is _EMPTY:
                    item = await pipe.wait()
                if item is None or item is _CLOSING:
                    break
                if isinstance(item, Exception):
                    raise item
                future, context = item
                out = answer(await future, context)
                if merge and pipe.items:
                    out = wire.merge_send_batch_responses(out, _ready_answers(pipe, answer))
                yield out
                if self.closing and not pipe.items:
                    break  # shutting down: every request read is answered
        finally:
            self._streams.discard(pipe)
            if not reader.done():
                reader.cancel()
            while pipe.items:
                item = pipe.items.popleft()
                if isinstance(item, tuple):
                    try:
                        await item[0]
                    except Exception:  # noqa: BLE001 - the stream already failed
                        pass

    @status.unary
    async def Reschedule(self, request, context):
        message_id, due, sequence, new_due = validate_reschedule(request, self.limits, self.engine.now_ms())
        if self.closing:
            raise ShuttingDown("the server is shutting down; retry later")
        self.guard.check()
        outcome, receipt = await self.engine.reschedule(message_id, due, sequence, new_due)
        resp = pb.RescheduleResponse(outcome=int(outcome))  # type: ignore[arg-type]  # protoc's .pyi wants its enum class; protobuf takes the int
        if receipt is not None:
            self._moved_to(resp, receipt)
            self.dedupe.rescheduled(receipt)
        return resp

    @status.unary
    async def RescheduleBatch(self, request, context):
        moves = validate_reschedule_batch(request, self.limits, self.engine.now_ms())
        if self.closing:
            raise ShuttingDown("the server is shutting down; retry later")
        self.guard.check()
        results = await self.engine.reschedule_many(moves)
        resp = pb.RescheduleBatchResponse()
        for outcome, receipt in results:
            r = resp.responses.add(outcome=int(outcome))
            if receipt is not None:
                self._moved_to(r, receipt)
        moved = [receipt for _outcome, receipt in results if receipt is not None]
        if moved:
            self.dedupe.rescheduled_many(moved)
        return resp

    def _moved_to(self, resp: pb.RescheduleResponse, receipt: Receipt) -> None:
        """A RescheduleResponse's new receipt (a Reschedule's, or one of a RescheduleBatch's)."""
        r = resp.receipt
        r.message_id = receipt.message_id
        r.deliver_at_ms = receipt.deliver_at_ms
        r.sequence = receipt.sequence
        r.shard = self.shard

    @status.unary
    async def Get(self, request, context):
        message_id, due, sequence = validate_receipt(request, self.limits)
        # on the event loop when the lookup would neither wait nor read much (most Gets),
        # else on a worker thread
        st = self.engine.get_now(message_id, due, sequence)
        if st is None:
            st = await self.engine.get(message_id, due, sequence)
        resp = pb.GetResponse(
            state=int(st.state),  # type: ignore[arg-type]  # protoc's .pyi wants its enum class; protobuf takes the int
            deliver_at_ms=st.deliver_at_ms or 0,
            delivered_at_ms=st.delivered_at_ms or 0,
        )
        m = st.message
        if m is not None:
            resp.message.subject = m.subject
            resp.message.payload = m.payload
            resp.message.headers.update(m.headers)
            resp.message.message_id = m.message_id
            resp.message.deliver_at_ms = m.deliver_at_ms
        for name, state, at in st.groups:
            resp.groups.add(name=name, state=int(state), delivered_at_ms=at)
        return resp

    @status.unary
    async def ChangeGroup(self, request, context):
        op, subject, group = validate_change_group(request, self.limits)
        if op == pb.ChangeGroupRequest.CREATE:
            changed = await self.engine.ensure_group(subject, group)
        else:
            changed = await self.engine.delete_group(subject, group)
        return pb.ChangeGroupResponse(changed=changed)

    @status.unary
    async def Stats(self, request, context):
        subject, group = validate_stats(request, self.limits)
        # on a worker thread: both take the scheduler's lock and cost the groups listed
        # (~6 us each), which the event loop, serving every other stream, must not wait for
        engine = self.engine
        s, groups = await asyncio.to_thread(lambda: (engine.stats(), engine.groups(subject, group)))
        lag = s.get("replication_lag_bytes", -1)
        return pb.StatsResponse(
            pending=max(0, int(s.get("pending", 0))),
            wheel_size=int(s.get("wheel_size", 0)),
            iterate_lag_bytes=max(0, int(s.get("iterate_lag_bytes", 0))),
            role=str(s.get("role", self.cfg.role)),
            epoch=int(s.get("epoch", 0)),
            replication_lag_bytes=-1 if lag is None else int(lag),
            dispatch_unsynced_buckets=int(s.get("dispatch_unsynced_buckets", 0)),
            groups=[
                pb.GroupStats(
                    subject=g["subject"],
                    group=g["group"],
                    consumers=self.consumers.consumers(g["subject"], g["group"]) if self.consumers else 0,
                    backlog=g["backlog"],
                    in_flight=g["in_flight"],
                    backlog_on_disk=g["spilled"],
                    backlog_on_disk_count=g["on_disk"],
                    backlog_retrying=g["retrying"],
                )
                for g in groups
            ],
        )

    @status.unary
    async def Topology(self, request, context):
        """The shards, their masters, slaves, epochs and in-sync sets, as this server last read
        them from etcd (cluster mode); a standalone server is one shard named "" (itself)."""
        agent = self.agent
        if agent is None:
            engine = self.engine
            shard = pb.Shard(name="", epoch=engine.epoch)
            if engine.role == "master" or not self.cfg.master:
                shard.master = self.address
            else:
                shard.master = self.cfg.master
                shard.slaves.append(self.address)
            return pb.TopologyResponse(cluster="", shards=[shard])
        cluster, shards = agent.topology()
        resp = pb.TopologyResponse(cluster=cluster)
        for s in shards:
            resp.shards.add(name=s.name, master=s.master, slaves=s.slaves(), epoch=s.epoch, in_sync=s.insync or [])
        return resp

    # --- Subscribe ----------------------------------------------------------------------------------
    @status.streaming
    async def Subscribe(self, request_iterator, context):
        from qdelay.server.consumers import response_bytes, take_for_response

        try:
            first = await request_iterator.__anext__()
        except StopAsyncIteration:
            return
        subject, group = validate_subscribe(first, self.limits)
        if self.closing:
            raise ShuttingDown("the server is shutting down; subscribe again elsewhere or later")
        window = min(first.max_in_flight or self.cfg.default_max_in_flight, MAX_IN_FLIGHT_CAP)
        engine = self.engine
        # the first Subscribe of a group creates it (durably): from now on every message of
        # the subject that becomes due is delivered to it too
        await engine.ensure_group(subject, group)
        registry = self.consumers
        sub = registry.register(subject, group, window, context.peer())
        metrics = self.metrics
        if first.ack_ids:
            self._ack(sub, list(first.ack_ids))

        async def read_acks() -> None:
            try:
                async for request in request_iterator:
                    if request.ack_ids:
                        self._ack(sub, list(request.ack_ids))
                    if request.max_in_flight:
                        registry.set_window(sub, min(request.max_in_flight, MAX_IN_FLIGHT_CAP))
            except (asyncio.CancelledError, grpc.RpcError):
                pass
            finally:
                sub.closed = True
                sub.event.set()

        reader = asyncio.ensure_future(read_acks())
        lateness = metrics.lateness
        max_n = self.cfg.max_deliveries_per_response
        max_bytes = self.cfg.max_response_bytes
        try:
            while True:
                if sub.closed:
                    # the client half-closed (every ack it sent was applied by read_acks
                    # before it set this), or the server is stopping: deliveries still in
                    # the inbox could not be acknowledged any more; unregister gives them
                    # back with the unacknowledged ones
                    break
                if not sub.inbox:
                    sub.event.clear()
                    if not sub.inbox and not sub.closed:
                        await sub.event.wait()
                    continue
                # the inbox holds whole batches from the dispatcher; their columns go
                # straight into the response
                resp, count, firsts = response_bytes(take_for_response(sub.inbox, max_n, max_bytes))
                if firsts:
                    lateness.observe_many((engine.now_ms() - np.asarray(firsts, dtype=np.int64)).clip(0) / 1000.0)
                metrics.delivered.inc(count)
                yield resp
        finally:
            reader.cancel()
            left = registry.unregister(sub)
            if left:
                # hand the unacknowledged deliveries out again now, not after the timeout
                engine.post_release(left, sub.subject, sub.group)
            engine.notify_credit()

    def _ack(self, sub, ack_ids: list[str]) -> None:
        self.consumers.acked(sub, ack_ids)
        self.metrics.acks.inc(len(ack_ids))
        # queued for the scheduler thread, which wakes for it (the event loop takes no lock)
        self.engine.post_ack(ack_ids, sub.subject, sub.group)
