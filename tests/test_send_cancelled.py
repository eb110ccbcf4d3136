"""A Send whose caller is cancelled (a client's deadline, a dropped call) while its append
is under way: the append goes on and becomes durable, so its client-chosen ids were
written, and a re-send of one of them (the client's retry after its deadline) must be
answered as a duplicate with the first write's receipt, not written a second time (to be
delivered twice). The service released the ids as failed at the cancellation, so until
the iterate service copied the first write into the id index the retry found the id
nowhere."""

from __future__ import annotations

import asyncio
from unittest import mock

import grpc
from simclock import MINUTE, T0, FakeClock, config

from qdelay.server.config import ServerConfig
from qdelay.server.engine import Engine
from qdelay.server.service import DelayService
from qdelay.v1 import qdelay_pb2 as pb


def _service(tmp_path) -> DelayService:
    engine = Engine(config(tmp_path / "data"), clock=FakeClock(T0))
    engine.start()
    cfg = ServerConfig(data_dir=str(tmp_path / "data"), min_free_bytes=0, min_free_bytes_hard=0)
    return DelayService(engine, cfg, None, mock.MagicMock())


def test_a_resend_after_a_send_cancelled_while_appending_is_a_duplicate(tmp_path):
    service = _service(tmp_path)
    engine = service.engine
    try:

        def batch():
            return service._validate([pb.Message(subject="t.s", payload=b"p", message_id="x1", delay_ms=90 * MINUTE)])

        async def scenario():
            submit_bodies = engine.wal.submit_bodies
            submitted: list[int] = []

            def cancelled(*args):
                appended = submit_bodies(*args)
                submitted.append(appended.first_sequence)
                asyncio.current_task().cancel()  # the caller's deadline, with the append queued
                return appended

            engine.wal.submit_bodies = cancelled  # type: ignore[method-assign]
            try:
                first = asyncio.ensure_future(service._write(batch()))
                try:
                    await first
                    raise AssertionError("the send was not cancelled")
                except asyncio.CancelledError:
                    pass
            finally:
                engine.wal.submit_bodies = submit_bodies  # type: ignore[method-assign]
            # the client retries at once; the first append is durable by then or soon
            again, dups = await service._write(batch())
            while engine.wal.committed_sequence < submitted[0]:
                await asyncio.sleep(0.001)
            return submitted[0], again, dups

        with engine.iterate.append_lock:  # the first write is not copied into the id index meanwhile
            written, again, dups = asyncio.run(scenario())
        assert set(dups) == {0} and dups[0].sequence == written, (written, again, dups)
        engine.iterate.wait_for(engine.wal.committed_sequence, 10)
        assert engine.wal.committed_sequence == written  # one message of that id, not two
    finally:
        engine.close()


def test_a_resend_after_a_send_cancelled_on_the_taskless_path_is_a_duplicate(tmp_path):
    """The same on the path without a task (DelayService._start_write: the engine answers
    once durable, the lookup needs no wait): the caller's future is cancelled with the
    records queued; the claim, the ingest gate and the metrics settle with the append, so
    the retry waits for it and is answered with its receipt."""
    service = _service(tmp_path)
    engine = service.engine
    try:

        def batch():
            return service._validate([pb.Message(subject="t.s", payload=b"p", message_id="x1", delay_ms=90 * MINUTE)])

        async def scenario():
            # the first lookup of a role waits for the index to catch up (the path with a task)
            await service._write(
                service._validate([pb.Message(subject="t.s", payload=b"p", message_id="x0", delay_ms=MINUTE)])
            )
            first = service._start_write(batch())
            assert isinstance(first, asyncio.Future)  # the task-less path, records queued
            written = engine.wal.committed_sequence + 1  # (nothing else writes)
            first.cancel()  # the caller's deadline
            again, dups = await service._start_write(batch())  # waits for the first's append
            while service.gate.messages:
                await asyncio.sleep(0.001)
            return written, again, dups

        with engine.iterate.append_lock:  # the first write is not copied into the id index meanwhile
            written, again, dups = asyncio.run(scenario())
        assert set(dups) == {0} and dups[0].sequence == written, (written, again, dups)
        engine.iterate.wait_for(engine.wal.committed_sequence, 10)
        assert engine.wal.committed_sequence == written  # one message of that id, not two
        assert service.active_writes == 0 and service.gate.bytes == 0
    finally:
        engine.close()


def test_a_stream_batch_refused_on_the_taskless_path_ends_the_stream_and_releases_its_ids(tmp_path):
    """SendStream over the task-less path: a batch the ingest gate refuses (the one before
    it not yet durable) ends the stream with RESOURCE_EXHAUSTED after the answer of the one
    before; nothing of it or after it is written, and its ids are not left claimed (sent
    again later, they are written, not answered as duplicates)."""
    service = _service(tmp_path)
    engine = service.engine
    service.gate.max_messages = 150  # two batches of 100 cannot wait together

    def request(start: int) -> bytes:
        msgs = [
            pb.Message(subject="t.s", payload=b"p", message_id=f"id{i}", delay_ms=90 * MINUTE)
            for i in range(start, start + 100)
        ]
        return pb.SendBatchRequest(messages=msgs).SerializeToString()

    try:

        async def scenario():
            # the first lookup of a role waits for the index to catch up (the path with a task)
            await service._write(
                service._validate([pb.Message(subject="t.s", payload=b"p", message_id="x0", delay_ms=1)])
            )
            read = []

            async def requests():
                # read one after the other with no await between: the first one's append
                # settles on the loop, so it is still in the gate when the second comes
                for start in (0, 100, 200):
                    read.append(start)
                    yield request(start)

            context = mock.AsyncMock()
            context.invocation_metadata = mock.Mock(return_value=())  # (grpc's is not a coroutine)
            answers = [r async for r in service.SendStream(requests(), context)]
            (code, message), _ = context.abort.call_args
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "ingest queue full" in message
            assert len(answers) == 1 and read == [0, 100]  # nothing read after the refused one
            assert engine.wal.committed_sequence == 101 and service.gate.messages == 0
            again = service._validate_request(request(100))[0]
            first, dups = await service._start_write(again)
            return first, dups

        first, dups = asyncio.run(scenario())
        assert dups == {} and first == 102
    finally:
        engine.close()
