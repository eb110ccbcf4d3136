"""End-to-end (real server process): what happens to deliveries when a consumer's stream
ends — unacknowledged ones go to another consumer at once, acknowledged ones stay done."""

from __future__ import annotations

import itertools
import time

import pytest
from conftest import wait_until

ACK_TIMEOUT_MS = 30_000  # long: anything redelivered quickly was released, not expired
_subjects = itertools.count(1)


def subject() -> str:
    return f"cs{next(_subjects)}.{int(time.time() * 1000) % 100000}"


@pytest.fixture(scope="module")
def server_args() -> list[str]:
    return ["--set", f"engine.ack_timeout_ms={ACK_TIMEOUT_MS}"]


def in_flight(client, subject: str) -> int:
    """Deliveries of ``subject`` awaiting their ack (the server's Stats)."""
    return sum(g["in_flight"] for g in client.stats()["groups"] if g["subject"] == subject)


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


@pytest.mark.parametrize("rounds", [1, 5])
def test_acks_sent_just_before_close_are_all_applied(client, rounds):
    """Ack and close at once: every acked message is DELIVERED, none comes again."""
    s = subject()
    receipts = client.send_batch([client.message(s, b"%d" % i, delay_ms=0) for i in range(300)])
    ids = {r.message_id for r in receipts}
    seen: set[str] = set()
    for _ in range(rounds):
        consumer = client.subscribe(s, max_in_flight=1000)
        got = consumer.receive(len(ids - seen), timeout=10)
        assert {d.message_id for d in got} == ids - seen
        # ack in several requests, the last one right before the close
        for k in range(0, len(got), 50):
            consumer.ack(got[k : k + 50])
        started = time.monotonic()
        consumer.close()
        assert time.monotonic() - started < 3.0, "close() waited for its timeout"
        seen |= {d.message_id for d in got}
        if seen == ids:
            break

    def undelivered() -> dict:
        states = {r.message_id: client.state_name(client.get(r)) for r in receipts}
        return {k: v for k, v in states.items() if v != "DELIVERED"}

    wait_until(lambda: undelivered() == {}, what="every ack applied")
    assert client.stats()["pending"] >= 0
    with client.subscribe(s) as again:
        assert again.receive(1, timeout=1.5) == [], "an acknowledged message was delivered again"


def test_close_with_deliveries_not_yet_read(client):
    """Deliveries the server pushed and the client never read: close() ends quickly and a
    second consumer gets them at once (they were never acknowledged)."""
    s = subject()
    receipts = client.send_batch([client.message(s, b"x" * 1000, delay_ms=0) for i in range(2000)])
    ids = {r.message_id for r in receipts}
    a = client.subscribe(s, max_in_flight=5000)
    wait_until(lambda: in_flight(client, s) == 2000, what="everything handed to a, which reads nothing")
    started = time.monotonic()
    a.close()
    assert time.monotonic() - started < 3.0, "close() waited for its timeout"
    got = []
    with client.subscribe(s, max_in_flight=5000) as b:
        deadline = time.monotonic() + 10
        while {d.message_id for d in got} != ids and time.monotonic() < deadline:
            more = b.receive(2000, timeout=1)
            b.ack(more)
            got.extend(more)
    assert {d.message_id for d in got} == ids
