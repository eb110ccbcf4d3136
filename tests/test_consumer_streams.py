"""End-to-end (real server process): what happens to deliveries when a consumer's stream
ends — unacknowledged ones go to another consumer at once, acknowledged ones stay done."""

from __future__ import annotations

import itertools
import time

import pytest

from serverproc import ServerProc

ACK_TIMEOUT_MS = 30_000  # long: anything redelivered quickly was released, not expired
_subjects = itertools.count(1)


def subject() -> str:
    return f"cs{next(_subjects)}.{int(time.time() * 1000) % 100000}"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    data = tmp_path_factory.mktemp("streams") / "data"
    with ServerProc(data, args=["--set", f"engine.ack_timeout_ms={ACK_TIMEOUT_MS}"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    c = server.client(timeout=20)
    yield c
    c.close()


def test_unacked_deliveries_go_to_another_consumer_when_one_disconnects(client):
    s = subject()
    receipts = client.send_batch([client.message(s, b"%d" % i, delay_ms=0) for i in range(40)])
    ids = {r.message_id for r in receipts}
    a = client.subscribe(s, max_in_flight=100)
    got = a.receive(40, timeout=10)
    assert {d.message_id for d in got} == ids and all(d.attempt == 1 for d in got)
    a.close()  # no ack
    started = time.monotonic()
    with client.subscribe(s) as b:
        again = b.receive(40, timeout=10)
        took = time.monotonic() - started
        assert {d.message_id for d in again} == ids
        assert all(d.attempt == 2 for d in again)
        assert took < ACK_TIMEOUT_MS / 1000 / 5, f"redelivered after {took:.1f} s: waited for the ack timeout"
        b.ack(again)
