"""Engine.release: deliveries a consumer gave back (its stream ended unacknowledged) are
offered again at once, as the next attempt; after ``max_attempts`` they are dead-lettered."""

from __future__ import annotations

import pytest
from conftest import wait_until
from simclock import T0, CollectingSink, Driver, FakeClock, message

from qdelay.server.engine import MessageState


@pytest.fixture
def clock():
    return FakeClock(T0 + 5_000)


def test_release_redelivers_at_once_as_next_attempt(tmp_path, clock):
    sink = CollectingSink(clock)
    d = Driver(tmp_path, clock, sink, ack_timeout_ms=60_000, retry_backoff_ms=10_000)
    receipts = d.send([message("s", clock.now, f"m{i}") for i in range(5)])
    d.advance(1)
    first = sink.take()
    assert sorted(s.message_id for s in first) == [f"m{i}" for i in range(5)]
    assert all(s.attempt == 1 for s in first)
    # two are acknowledged, the stream ends with three left
    acked = first[:2]
    assert d.engine.ack([s.ack_id for s in acked]) == 2
    left = [s.ack_id for s in first[2:]]
    before = d.engine.stats()["redeliveries"]
    assert d.engine.release(left + [s.ack_id for s in acked] + ["bogus", "7"]) == 3
    assert d.engine.release(left) == 0  # already given back
    d.advance(1)  # 1 ms later: no ack timeout, no backoff
    again = sink.take()
    assert sorted(s.message_id for s in again) == sorted(s.message_id for s in first[2:])
    assert all(s.attempt == 2 for s in again)
    assert d.engine.stats()["redeliveries"] == before + 3
    # an id of the released attempt no longer releases (nor acks twice) the new attempt
    assert d.engine.release(left) == 0
    assert d.engine.stats()["in_flight"] == 3
    assert d.engine.ack([s.ack_id for s in again]) == 3
    d.advance(120_000)
    assert sink.take() == []
    for r in receipts:
        assert d.get(r).state == MessageState.DELIVERED
    assert d.engine.stats()["pending"] == 0
    d.close()


def test_release_after_max_attempts_dead_letters(tmp_path, clock):
    sink = CollectingSink(clock)
    d = Driver(tmp_path, clock, sink, max_attempts=2, ack_timeout_ms=60_000)
    r = d.send([message("orders", clock.now, "bad")])[0]
    d.advance(1)
    (s1,) = sink.take()
    assert d.engine.release([s1.ack_id]) == 1
    d.advance(1)
    (s2,) = sink.take()
    assert (s2.subject, s2.attempt) == ("orders", 2)
    assert d.engine.release([s2.ack_id]) == 1
    assert wait_until(lambda: d.engine.scheduler.dead_lettered == 1)
    d.advance(1)
    (dlq,) = sink.take()
    assert (dlq.subject, dlq.message_id, dlq.attempt) == ("DLQ.orders", "bad", 1)
    assert d.get(r).state == MessageState.DEAD_LETTERED
    d.engine.ack([dlq.ack_id])
    d.advance(120_000)
    assert sink.take() == []
    d.close()
