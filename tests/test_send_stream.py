"""SendStream's pipeline (DelayService._pipelined) at a shutdown: every request read is
answered, in order, and the stream then ends, whether it was idle (a batching client keeps
one open) or had batches under way; nothing read after begin_shutdown is written."""

from __future__ import annotations

import asyncio
import threading
from unittest import mock

from simclock import MINUTE, T0, FakeClock, config

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
                async for answer in service.SendStream(requests(), mock.AsyncMock()):
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
                async for answer in service.SendStream(requests(), mock.AsyncMock()):
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
