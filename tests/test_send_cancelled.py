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
