"""A real server whose message-log writer meets a bug: the Send being written is refused
with UNAVAILABLE at once (not left waiting for its deadline), health turns NOT_SERVING, the
next Send is refused too, and a restart recovers and serves again
(tests/breaking_writer_server.py breaks the commit of a marked payload)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import grpc
import pytest
from breaking_writer_server import MARK
from conftest import wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serverproc import ServerProc

from qdelay import errors
from qdelay.client import Client

BREAKING = [sys.executable, str(Path(__file__).with_name("breaking_writer_server.py"))]


SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def test_a_writer_that_breaks_refuses_sends_and_turns_not_serving(tmp_path):
    srv = ServerProc(tmp_path / "data", command=BREAKING).start()
    try:
        with Client(srv.address, retries=0, batching=False) as c:
            kept = c.send("wb.s", b"before", delay_ms=3_600_000)
            started = time.monotonic()
            with pytest.raises(errors.Unavailable, match="writer failed .*AttributeError"):
                c.send("wb.s", MARK, delay_ms=3_600_000, timeout=30)
            assert time.monotonic() - started < 10  # refused, not stranded until the deadline
            # the health watch notices the engine's failure at its next look
            wait_until(lambda: health(srv.address) == NOT_SERVING, timeout=30, what="NOT_SERVING")
            with pytest.raises(errors.Unavailable):
                c.send("wb.s", b"after", delay_ms=3_600_000, timeout=30)
        srv.kill9()
        srv.start()  # a restart recovers the log from what is on disk
        with Client(srv.address, retries=5) as c:
            wait_until(lambda: health(srv.address) == SERVING, timeout=30, what="SERVING")
            assert c.get(kept).state == "PENDING"
            assert c.send("wb.s", b"again", delay_ms=3_600_000).message_id
    finally:
        srv.kill9()
