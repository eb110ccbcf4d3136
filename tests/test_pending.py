"""Stats.pending = messages - cancels - closed, exact in normal operation and after a clean
restart, and recounted from the dispatch logs after a crash (engine with a fake clock)."""

from __future__ import annotations

import asyncio
import os
import shutil

import pytest
from simclock import MINUTE, T0, CollectingSink, Driver, FakeClock, files, message

from qdelay.server.engine import CancelOutcome, MessageState


@pytest.fixture
def clock():
    return FakeClock(T0 + 5_000)


def pending(d) -> int:
    return d.engine.stats()["pending"]


def test_pending_exact_with_cancels_dead_letters_and_clean_restarts(tmp_path, clock):
    sink = CollectingSink(clock)
    d = Driver(tmp_path, clock, sink, max_attempts=2, ack_timeout_ms=1_000, retry_backoff_ms=100)
    now = clock.now
    good = d.send([message("s", now + 1_000 + i * 500, f"g{i}") for i in range(100)])  # two minutes
    bad = d.send([message("b", now + 2_000, f"bad{i}") for i in range(3)])
    d.catch_up()
    assert pending(d) == 103
    for r in good[:10]:
        assert d.cancel(r) == CancelOutcome.CANCELLED
    assert d.cancel(good[0]) == CancelOutcome.ALREADY_CANCELLED
    assert pending(d) == 93
    d.restart()
    assert pending(d) == 93
    d.advance(1)
    # deliver: ack everything but the "b" originals, which end in the dead-letter subject
    for _ in range(1000):
        d.advance(100)
        acks = [s.ack_id for s in sink.take() if s.subject != "b"]
        d.engine.ack(acks)
        if d.engine.scheduler.dead_lettered == 3 and pending(d) == 0:
            break
    assert d.engine.scheduler.dead_lettered == 3
    assert pending(d) == 0, d.engine.stats()
    assert all(d.get(r).state == MessageState.DELIVERED for r in good[10:])
    assert all(d.get(r).state == MessageState.DEAD_LETTERED for r in bad)
    d.advance(3 * MINUTE)  # buckets finish and are forgotten (their closes move to the checkpoint)
    assert d.engine.stats()["done_before"] > good[-1].deliver_at_ms // MINUTE  # in minutes
    assert pending(d) == 0
    d.restart()
    d.advance(1)
    assert pending(d) == 0
    more = d.send([message("s", clock.now + 500, f"m{i}") for i in range(5)])
    d.catch_up()
    assert pending(d) == 5
    d.restart()
    assert pending(d) == 5
    d.advance(1_000)
    d.engine.ack([s.ack_id for s in sink.take()])
    d.advance(1)
    assert pending(d) == 0
    assert all(d.get(r).state == MessageState.DELIVERED for r in more)
    d.close()


def test_late_records_into_finished_buckets_keep_pending_exact(tmp_path, clock):
    sink = CollectingSink(clock, auto_ack=None)
    d = Driver(tmp_path, clock, sink)
    sink.auto_ack = d.engine
    d.send([message("s", clock.now + 100, f"a{i}") for i in range(20)])
    d.advance(3 * MINUTE)
    assert pending(d) == 0
    # due in a bucket that is done: it is reopened, delivered, and done again
    d.send([message("s", T0 + 1_000, f"late{i}") for i in range(7)])
    d.catch_up()
    assert pending(d) == 7
    d.restart()
    sink.auto_ack = d.engine
    assert pending(d) == 7
    d.advance(1)
    assert pending(d) == 0
    d.restart()
    sink.auto_ack = d.engine
    d.advance(1)
    assert pending(d) == 0
    d.close()


@pytest.mark.parametrize("path", ["worker", "loop"])
def test_cancel_racing_an_ack_is_not_counted_twice(tmp_path, clock, path):
    """Cancel finds the message, then it is delivered and acknowledged, then Cancel claims
    it: the answer is ALREADY_DELIVERED and no tombstone is written. Both ways a claim runs
    (Engine._claims): on a worker thread (``_find_targets``, then the claim) and on the
    event loop (``finder.holds_one``, then ``claim_cancels_now``); each is forced, since
    which one a Cancel takes depends on timing."""
    sink = CollectingSink(clock)
    d = Driver(tmp_path, clock, sink)
    r, other = d.send([message("s", clock.now, "x"), message("s", clock.now + 10 * MINUTE, "y")])
    d.catch_up()
    engine = d.engine
    calls = []

    def racing(original):
        def find(*a, **kw):
            out = original(*a, **kw)
            if not calls:  # between finding it and the claim: delivered and acknowledged
                engine.scheduler.run_once(clock())
                engine.ack([s.ack_id for s in sink.take()])
            calls.append(out)
            return out

        return find

    if path == "worker":
        engine._claimable_now = lambda targets: False
        engine._find_targets = racing(engine._find_targets)
    else:
        assert engine._claimable_now([(r.message_id, r.deliver_at_ms, r.sequence)])
        engine._claimable_now = lambda targets: True
        engine.finder.holds_one = racing(engine.finder.holds_one)
    outcome = asyncio.run(engine.cancel(r.message_id, r.deliver_at_ms, r.sequence))
    del engine._claimable_now
    if path == "worker":
        del engine._find_targets
        assert [c.as_list() for c in calls] == [[(r.deliver_at_ms, r.sequence)]]  # it was found, pending
    else:
        del engine.finder.holds_one
        assert calls == [True]  # it was found, pending
    assert outcome == CancelOutcome.ALREADY_DELIVERED
    d.catch_up()
    assert engine.iterate.counts["cancels"] == 0
    assert pending(d) == 1
    assert d.get(r).state == MessageState.DELIVERED
    d.close()


def _crash_copy(src, dst):
    """The data folder as a crash would leave it (every write done, nothing more)."""
    shutil.copytree(src, dst)
    return dst


def test_pending_recounted_from_dispatch_logs_after_a_crash(tmp_path, clock):
    src = tmp_path / "live"
    sink = CollectingSink(clock)
    # no periodic checkpoint: the only one is taken before the acks
    d = Driver(src, clock, sink, checkpoint_interval_ms=10**9)
    d.send([message("s", clock.now + 100, f"a{i}") for i in range(50)])
    d.send([message("s", clock.now + 2 * MINUTE, f"b{i}") for i in range(30)])
    d.catch_up()
    d.engine.iterate.checkpoint()
    d.advance(200)
    got = sink.take()
    assert len(got) == 50
    d.engine.ack([s.ack_id for s in got[:40]])
    d.advance(1)  # dispatch records written and fsynced
    assert pending(d) == 40
    crashed = _crash_copy(src, tmp_path / "crashed")
    d.advance(3 * MINUTE)  # the live engine goes on; the copy is what a crash left

    sink2 = CollectingSink(clock)
    c = Driver(crashed, clock, sink2)
    c.run(clock.now)
    # 30 not due yet, 10 delivered and never acked (delivered again now), 40 closed
    assert pending(c) == 40
    redelivered = sink2.take()
    assert len(redelivered) == 10 + 30
    c.engine.ack([s.ack_id for s in redelivered])
    c.advance(1)
    assert pending(c) == 0
    c.restart()
    c.advance(1)
    assert pending(c) == 0
    c.close()
    d.close()


def test_pending_after_a_crash_that_lost_dispatch_records(tmp_path, clock):
    """Acks whose dispatch records did not reach the disk: the messages come again and stay
    pending until then, whatever the last checkpoint said."""
    src = tmp_path / "live"
    sink = CollectingSink(clock)
    d = Driver(src, clock, sink, checkpoint_interval_ms=10**9)
    d.send([message("s", clock.now + 100, f"a{i}") for i in range(20)])
    d.advance(200)
    got = sink.take()
    d.engine.ack([s.ack_id for s in got[:5]])
    d.advance(1)
    (path,) = files(src, "dispatch", "")
    size = os.path.getsize(path)
    d.engine.ack([s.ack_id for s in got[5:15]])
    d.advance(1)
    d.catch_up()
    d.engine.iterate.checkpoint()  # taken after the acks
    assert pending(d) == 5
    crashed = _crash_copy(src, tmp_path / "crashed")
    (cpath,) = files(crashed, "dispatch", "")
    os.truncate(cpath, size)  # the last 10 dispatch records were lost
    d.close()

    sink2 = CollectingSink(clock)
    c = Driver(crashed, clock, sink2)
    c.advance(1)
    assert pending(c) == 15
    again = sink2.take()
    assert len(again) == 15
    c.engine.ack([s.ack_id for s in again])
    c.advance(1)
    assert pending(c) == 0
    c.close()
