"""HTTP/2 keepalive of the Python clients (issue 15, item 3): while a call is open they ping
the server, so a dead connection under an idle Subscribe stream is noticed; the server
accepts those pings (its ``min_ping_interval_ms``) and the idle stream lives on.

Scaled down to seconds: pings every second against a server that accepts one every half
second (the defaults are 30 s and 10 s). The control: the same pings against a server that
accepts one every 10 s are refused (GOAWAY too_many_pings after three), which shows the
clients do ping on an idle stream and the server's policy is the one its option names."""

from __future__ import annotations

import asyncio
import time

from conftest import wait_until
from serverproc import ServerProc

from qdelay import aio
from qdelay.client import Client
from qdelay.client.types import KEEPALIVE_S, keepalive_options
from qdelay.server.config import ServerConfig

IDLE_S = 4.0  # four pings or more: a server that refused them would have sent GOAWAY


def test_the_default_pings_leave_the_servers_policy_headroom():
    assert KEEPALIVE_S * 1000 >= 3 * ServerConfig().min_ping_interval_ms
    assert dict(keepalive_options(KEEPALIVE_S))["grpc.http2.max_pings_without_data"] == 0  # no cap when idle
    assert keepalive_options(None) == []


def test_an_idle_blocking_consumer_keeps_its_stream(tmp_path):
    with ServerProc(tmp_path / "data", args=["--set", "min_ping_interval_ms=500"]) as srv:
        with Client(srv.address, keepalive=1.0) as c:
            with c.subscribe("ka.idle", "g") as consumer:
                assert consumer.receive(1, timeout=IDLE_S) == []  # nothing due: the stream idles
                assert consumer.reconnects == 0
                c.send("ka.idle", b"after idle")
                got = consumer.receive(1, timeout=10)
                assert [d.payload for d in got] == [b"after idle"]
                assert consumer.reconnects == 0  # the same stream, never broken
                consumer.ack(got)


def test_an_idle_asyncio_consumer_keeps_its_stream(tmp_path):
    async def main(address: str) -> None:
        async with aio.Client(address, keepalive=1.0) as c:
            async with c.subscribe("ka.idle", "g") as consumer:
                assert await consumer.receive(1, timeout=IDLE_S) == []
                assert consumer.reconnects == 0
                await c.send("ka.idle", b"after idle")
                got = await consumer.receive(1, timeout=10)
                assert [d.payload for d in got] == [b"after idle"]
                assert consumer.reconnects == 0
                consumer.ack(got)

    with ServerProc(tmp_path / "data", args=["--set", "min_ping_interval_ms=500"]) as srv:
        asyncio.run(asyncio.wait_for(main(srv.address), 60))


def test_pings_faster_than_the_server_accepts_are_refused(tmp_path):
    """The control: the server's default policy (10 s) refuses pings every second on an idle
    stream; the consumer notices the GOAWAY and subscribes again, as for any lost stream."""
    with ServerProc(tmp_path / "data") as srv:
        with Client(srv.address, keepalive=1.0) as c:
            with c.subscribe("ka.refused", "g") as consumer:
                t0 = time.monotonic()
                consumer.receive(1, timeout=0.2)  # start reading: reconnects count on the reader
                wait_until(lambda: consumer.reconnects >= 1, timeout=20, what="a GOAWAY for too many pings")
                assert time.monotonic() - t0 < 20
                c.send("ka.refused", b"still works")  # and the consumer goes on on a new stream
                got = consumer.receive(1, timeout=15)
                assert [d.payload for d in got] == [b"still works"]
