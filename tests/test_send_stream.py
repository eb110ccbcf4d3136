"""SendStream's pipeline (DelayService._pipelined) at a shutdown: every request read is
answered, in order, and the stream then ends, whether it was idle (a batching client keeps
one open) or had batches under way; nothing read after begin_shutdown is written."""

from __future__ import annotations

import asyncio
import threading
from unittest import mock

from simclock import MINUTE, T0, FakeClock, config

from qdelay import wire
from qdelay.segments import segment
from qdelay.server.config import ServerConfig
from qdelay.server.engine import Engine
from qdelay.server.service import DelayService
from qdelay.v1 import qdelay_pb2 as pb


def _service(tmp_path) -> DelayService:
    engine = Engine(config(tmp_path / "data"), clock=FakeClock(T0))
    engine.start()
    cfg = ServerConfig(data_dir=str(tmp_path / "data"), min_free_bytes=0, min_free_bytes_hard=0)
    return DelayService(engine, cfg, None, mock.MagicMock())


def stream_context(*metadata: tuple[str, str]) -> mock.MagicMock:
    """A stream's grpc context as far as SendStream reads it: its invocation metadata."""
    context = mock.MagicMock()
    context.invocation_metadata.return_value = metadata
    context.send_initial_metadata = mock.AsyncMock()
    return context


def request(start: int, n: int = 10) -> bytes:
    msgs = [
        pb.Message(subject="t.s", payload=b"p", message_id=f"id{i}", delay_ms=90 * MINUTE)
        for i in range(start, start + n)
    ]
    return pb.SendBatchRequest(messages=msgs, compact_receipts=True).SerializeToString()


async def until(condition, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.001)


def test_an_idle_stream_ends_at_shutdown_with_its_batches_answered(tmp_path):
    service = _service(tmp_path)
    try:

        async def scenario():
            idle = asyncio.Event()
            read = []

            async def requests():
                for start in (0, 10):
                    read.append(start)
                    yield request(start)
                await idle.wait()  # the client keeps the stream open with nothing to send
                read.append(20)
                yield request(20)

            answers = []

            async def consume():
                async for answer in service.SendStream(requests(), stream_context()):
                    answers.append(pb.SendBatchResponse.FromString(answer))

            stream = asyncio.ensure_future(consume())
            await until(lambda: len(answers) == 2)
            service.begin_shutdown()
            await asyncio.wait_for(stream, 10)
            return answers, read

        answers, read = asyncio.run(scenario())
        assert [a.first_sequence for a in answers] == [1, 11] and read == [0, 10]
    finally:
        service.engine.close()


def test_batches_under_way_at_shutdown_are_all_answered_in_order(tmp_path, monkeypatch):
    service = _service(tmp_path)
    engine = service.engine
    real_fdatasync = segment.os.fdatasync
    held, release = threading.Event(), threading.Event()

    def held_fdatasync(fd):
        held.set()
        assert release.wait(10)
        real_fdatasync(fd)

    try:

        async def scenario():
            more = asyncio.Event()
            read = []

            async def requests():
                for start in (0, 10, 20):
                    read.append(start)
                    yield request(start)
                await more.wait()
                read.append(30)
                yield request(30)

            answers = []

            async def consume():
                async for answer in service.SendStream(requests(), stream_context()):
                    answers.append(pb.SendBatchResponse.FromString(answer))

            monkeypatch.setattr(segment, "native_write_sync", False)  # the faults go through os.*
            monkeypatch.setattr(segment.os, "fdatasync", held_fdatasync)
            stream = asyncio.ensure_future(consume())
            await asyncio.to_thread(held.wait, 10)  # the first commit is in its fdatasync
            await until(lambda: len(read) == 3)
            service.begin_shutdown()  # three batches read, none answered yet
            release.set()
            await asyncio.wait_for(stream, 10)
            return answers, read

        answers, read = asyncio.run(scenario())
        assert [a.first_sequence for a in answers] == [1, 11, 21] and read == [0, 10, 20]
        assert engine.wal.committed_sequence == 30
    finally:
        release.set()
        engine.close()


def _answers_of_a_held_commit(tmp_path, monkeypatch, metadata: tuple) -> list[pb.SendBatchResponse]:
    """Three batches on one SendStream: the first's commit held in its fdatasync until the
    other two are queued behind it, so that those two are made durable by one commit."""
    service = _service(tmp_path)
    real_fdatasync = segment.os.fdatasync
    held, release = threading.Event(), threading.Event()

    def held_fdatasync(fd):
        if not release.is_set():
            held.set()
            assert release.wait(10)
        real_fdatasync(fd)

    try:

        async def scenario():
            async def requests():
                for start in (0, 10, 20):
                    yield request(start)

            answers = []

            async def consume():
                async for answer in service.SendStream(requests(), stream_context(*metadata)):
                    answers.append(pb.SendBatchResponse.FromString(answer))

            monkeypatch.setattr(segment, "native_write_sync", False)  # the faults go through os.*
            monkeypatch.setattr(segment.os, "fdatasync", held_fdatasync)
            stream = asyncio.ensure_future(consume())
            await asyncio.to_thread(held.wait, 10)  # the first commit is in its fdatasync
            await until(lambda: service.gate.messages == 30)  # the other two queued behind it
            release.set()
            await asyncio.wait_for(stream, 10)
            return answers

        return asyncio.run(scenario())
    finally:
        release.set()
        service.engine.close()


def test_answers_ready_together_are_merged_for_a_stream_that_asks(tmp_path, monkeypatch):
    """wire.MERGE_ANSWERS: the two batches made durable by one commit are answered by one
    message (the second in ``more``), in order; the batch before them on its own."""
    answers = _answers_of_a_held_commit(tmp_path, monkeypatch, (wire.MERGE_ANSWERS,))
    flat = [(a.first_sequence, len(a.deliver_at_ms)) for r in answers for a in (r, *r.more)]
    assert flat == [(1, 10), (11, 10), (21, 10)]
    assert len(answers) < 3 and all(not a.more for r in answers for a in r.more)


def test_answers_are_one_a_request_for_a_stream_that_does_not_ask(tmp_path, monkeypatch):
    """Without the metadata (clients of other languages, written against one answer a
    request) each request has its own answer, even when they are ready together."""
    answers = _answers_of_a_held_commit(tmp_path, monkeypatch, ())
    assert [(a.first_sequence, len(a.more)) for a in answers] == [(1, 0), (11, 0), (21, 0)]
