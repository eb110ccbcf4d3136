"""The engine's delivery rules, driven by hand with a simulated clock.

Dead letters, the rate limit, fairness across subjects, chunked loading under
``max_loaded``, overdue messages (oldest first), late records into finished buckets,
and the lifecycle of an engine that was never started.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from conftest import wait_until
from simclock import MINUTE, T0, CollectingSink, Driver, FakeClock, config, message

from qdelay.segments import framing, records
from qdelay.segments.framing import RecordKind
from qdelay.segments.naming import bucket_of
from qdelay.server.engine import FAR_AHEAD_MIN_MS, CancelOutcome, Engine, MessageState
from qdelay.server.scheduler import DEAD_LETTER_HEADER


@pytest.fixture
def clock():
    return FakeClock(T0 + 5_000)


def dispatch_records(engine, bucket):
    seg = engine.dispatch.get(bucket)
    if seg is None:
        return []
    return [(f.sequence, records.decode_dispatch(f.body)) for f in seg.frames() if f.kind == RecordKind.DISPATCH]


# --- lifecycle -------------------------------------------------------------------------------------


def test_close_of_a_never_started_engine(tmp_path, clock):
    e = Engine(config(tmp_path), clock=clock)
    e.close()
    e.close()  # twice is harmless


def test_acks_after_the_scheduler_stopped_are_refused_without_a_disk_full_warning(tmp_path, clock, caplog):
    """An ack that arrives after stop() (an in-process consumer racing close()) is not
    recorded (its message is delivered again after a restart: at least once) and the
    shutdown does not claim that the disk was full."""
    d = Driver(tmp_path, clock, CollectingSink(clock))
    d.send([message("s", clock.now + 1000, "m1")])
    d.advance(1000)
    (seen,) = d.sink.take()
    d.engine.scheduler.stop()
    with caplog.at_level("INFO", logger="qdelay"):
        assert d.engine.ack([seen.ack_id]) == 0
        d.engine.scheduler.post_ack([seen.ack_id])
        d.engine.scheduler.writer.stop()
    assert d.engine.stats()["acks_after_stop"] == 2
    assert not [r for r in caplog.records if "no space" in r.getMessage()]
    d.close()
    d = Driver(tmp_path, clock, CollectingSink(clock))
    d.advance(1000)
    assert d.sink.ids() == ["m1"]  # delivered again: its ack was not recorded
    d.close()


def test_close_of_a_never_started_engine_with_iterate_lag_does_not_hang(tmp_path, clock):
    """close() waits for the iterate service to catch up; when it was never started it
    must not sit out its 10 s timeout, and what it did not copy is replayed next time."""
    e = Engine(config(tmp_path), clock=clock)
    r = e.send_sync([message("a", clock.now + 1000, "m1")])
    started = time.monotonic()
    e.close()
    took = time.monotonic() - started
    d = Driver(tmp_path, clock, CollectingSink(clock))
    d.advance(1000)
    assert d.sink.ids() == ["m1"]
    assert d.get(r[0]).state == MessageState.PENDING
    d.close()
    assert took < 2.0, f"close() of a never-started engine with iterate lag took {took:.1f} s"


def test_a_lookup_after_the_iterate_service_stopped_on_an_error_says_so(tmp_path, clock):
    """A Get or Cancel by id waits for the iterate service to have indexed what was sent;
    once that service has stopped on an error (its data folder removed under it, a disk
    error) the answer said "behind; retry shortly", sending users retrying against a server
    that needs an operator. It names the stop and the error, at once."""
    from qdelay.errors import StorageError

    e = Engine(config(tmp_path), clock=clock)
    try:
        e.send_sync([message("a", clock.now + 1000, "m1")])  # not iterated: never started
        e.iterate.error = OSError(2, "No such file or directory")  # what its loop sets on a failure
        started = time.monotonic()
        with pytest.raises(
            StorageError, match=r"iterate service stopped \(.*No such file.*\); the server needs a restart"
        ):
            e.resolve_id("m1")
        assert time.monotonic() - started < 1.0  # not after the 5 s wait
    finally:
        e.iterate.error = None
        e.close()


def test_a_lookup_while_the_iterate_service_is_behind_is_unavailable(tmp_path, clock, monkeypatch):
    """A lookup that waited out its wait for the iterate service (the replay after a restart,
    or a burst) answered INTERNAL, which no client retries: a user's Get right after a
    restart failed. Nothing is wrong: UNAVAILABLE, which the clients retry by themselves."""
    from qdelay.errors import Unavailable
    from qdelay.server import engine as engine_mod

    monkeypatch.setattr(engine_mod, "LOOKUP_WAIT_S", 0.05)
    e = Engine(config(tmp_path), clock=clock)
    try:
        r = e.send_sync([message("a", clock.now + 1000, "m1")])  # not iterated: never started
        for lookup in (lambda: e.resolve_id("m1"), lambda: e.get_sync("m1", r[0].deliver_at_ms, r[0].sequence)):
            with pytest.raises(Unavailable, match="iterate service is behind"):
                lookup()
    finally:
        e.close()


@pytest.mark.parametrize(
    ("gather_far_ms", "ahead_ms", "far"),
    [
        (20.0, FAR_AHEAD_MIN_MS, True),  # a second ahead: copied up to 20 ms later
        (20.0, 90 * MINUTE, True),
        (20.0, FAR_AHEAD_MIN_MS - 1, False),  # sooner: copied within iterate_gather_ms
        (20.0, 0, False),
        (500.0, FAR_AHEAD_MIN_MS, False),  # a longer wait needs them due further ahead (10x)
        (500.0, 5_000, True),
    ],
)
def test_sends_due_well_ahead_are_declared_far(tmp_path, clock, gather_far_ms, ahead_ms, far):
    """A send whose every message is due at least far_ahead_ms ahead (max(1 s, ten times
    iterate_gather_far_ms)) lets the iterate service gather it longer; the soonest due time
    decides. Declared at once, as the records are queued."""
    e = Engine(config(tmp_path, iterate_gather_far_ms=gather_far_ms), clock=clock)
    bodies = [records.encode_message(b"s", f"m{i}".encode(), b"", b"p", clock.now + ahead_ms + i) for i in range(3)]
    first = asyncio.run(e.send_bodies(bodies, clock.now + ahead_ms))
    assert (e.iterate._far == (first, first + 2)) is far
    assert e.iterate._only_far() is far  # nothing else was committed since
    e.close()


# --- dead letters ------------------------------------------------------------------------------------


def test_dead_letter_after_max_attempts(tmp_path, clock):
    sink = CollectingSink(clock)
    d = Driver(tmp_path, clock, sink, max_attempts=3, ack_timeout_ms=1_000, retry_backoff_ms=100)
    other = d.send([message("ok", clock.now, "fine")])[0]
    r = d.send([message("orders", clock.now, "bad", payload=b"body", headers={"k": "v"})])[0]
    attempts = []
    for _ in range(40):
        d.advance(100)
        for s in sink.take():
            if s.message_id == "fine":
                d.engine.ack([s.ack_id])
                continue
            attempts.append((s.subject, s.attempt, s.at))
        if d.engine.scheduler.dead_lettered:
            break
    assert [a[:2] for a in attempts] == [("orders", 1), ("orders", 2), ("orders", 3)]
    # the copy goes through the message log; its callback closes the original
    assert wait_until(lambda: d.engine.scheduler.dead_lettered == 1)
    d.advance(1)
    dlq = [s for s in sink.take()]
    assert len(dlq) == 1, dlq
    s = dlq[0]
    assert s.subject == "DLQ.orders"
    assert s.message_id == "bad"
    assert s.payload == b"body"
    assert s.headers[DEAD_LETTER_HEADER] == str(r.sequence)
    assert s.headers["k"] == "v"
    assert s.attempt == 1
    # the original is closed: Get, Cancel and the dispatch log say dead-lettered
    assert d.get(r).state == MessageState.DEAD_LETTERED
    assert d.cancel(r) == CancelOutcome.DEAD_LETTERED
    outcomes = {seq: rec.outcome for seq, rec in dispatch_records(d.engine, bucket_of(r.deliver_at_ms))}
    assert outcomes[r.sequence] == records.Outcome.DEAD_LETTERED
    assert outcomes[other.sequence] == records.Outcome.DELIVERED
    d.engine.ack([s.ack_id])
    # never again, not after a restart either
    d.advance(60_000)
    d.restart()
    d.advance(60_000)
    d.advance(60_000)
    assert sink.take() == []
    assert d.engine.stats()["pending"] == 0
    d.close()


def test_dead_letter_with_max_attempts_one(tmp_path, clock):
    sink = CollectingSink(clock)
    d = Driver(tmp_path, clock, sink, max_attempts=1, ack_timeout_ms=1_000, retry_backoff_ms=100)
    d.send([message("s", clock.now, "once")])
    d.advance(0)
    assert [(x.subject, x.attempt) for x in sink.take()] == [("s", 1)]
    d.advance(1_000)
    assert wait_until(lambda: d.engine.scheduler.dead_lettered == 1)
    d.advance(1)
    assert [(x.subject, x.message_id) for x in sink.take()] == [("DLQ.s", "once")]
    d.close()


# --- rate limit ----------------------------------------------------------------------------------------


def test_rate_limit_spreads_a_burst(tmp_path, clock):
    """The limiter counts real (monotonic) time, so this test runs passes in real time."""
    rate = 2_000
    n = 1_000
    sink = CollectingSink(clock)
    d = Driver(tmp_path, clock, sink, dispatch_rate=rate)
    for k in range(0, n, 250):
        d.send(message("burst", clock.now, f"m{i}") for i in range(k, k + 250))
    d.catch_up()
    t0 = time.monotonic()
    counts = []
    while len(sink.seen) < n and time.monotonic() - t0 < 10:
        d.engine.scheduler.run_once(clock.now)
        counts.append((time.monotonic() - t0, len(sink.seen)))
        time.sleep(0.01)
    took = time.monotonic() - t0
    assert len(sink.seen) == n
    assert len(set(sink.ids())) == n
    # the bucket holds at most 0.1 s of tokens; the rest comes at the configured rate
    burst = rate * 0.1
    for t, k in counts:
        assert k <= burst + rate * (t + 0.05) + 1, (t, k)
    assert took >= (n - burst) / rate * 0.9, f"{n} messages took only {took:.3f} s at {rate}/s"
    assert max(size for _s, size in sink.batches) <= burst + 1
    d.close()


# --- fairness -------------------------------------------------------------------------------------------


def _send_many(d, subject, due, n, prefix, batch=2_000):
    for k in range(0, n, batch):
        d.send(message(subject, due, f"{prefix}{i}", payload=b"") for i in range(k, min(n, k + batch)))


@pytest.mark.parametrize("hot_first", [True, False])
def test_hot_subject_does_not_starve_another(tmp_path, clock, hot_first):
    sink = CollectingSink(clock)
    d = Driver(tmp_path, clock, sink)
    due = clock.now + 2_000
    if hot_first:
        _send_many(d, "hot", due, 20_000, "h")
        _send_many(d, "cold", due, 10, "c")
    else:
        _send_many(d, "cold", due, 10, "c")
        _send_many(d, "hot", due, 20_000, "h")
    d.advance(2_000)
    subjects = [s for s, _n in sink.batches]
    assert "cold" in subjects[:3], f"cold first served in batch {subjects.index('cold')}: {subjects[:8]}"
    cold = [s for s in sink.seen if s.subject == "cold"]
    assert len(cold) == 10 and max(c.batch for c in cold) <= 2
    assert len(sink.seen) == 20_010
    d.close()


def test_hot_subject_does_not_starve_another_under_rate_limit(tmp_path, clock):
    sink = CollectingSink(clock)
    d = Driver(tmp_path, clock, sink, dispatch_rate=20_000)
    due = clock.now + 1_000
    _send_many(d, "hot", due, 20_000, "h")
    _send_many(d, "cold", due, 10, "c")
    d.catch_up()
    clock.set(due)
    t0 = time.monotonic()
    while not any(s.subject == "cold" for s in sink.seen) and time.monotonic() - t0 < 5:
        d.engine.scheduler.run_once(clock.now)
        time.sleep(0.005)
    subjects = [s for s, _n in sink.batches]
    assert "cold" in subjects, "cold never served"
    assert subjects.index("cold") <= 3, subjects[:10]
    before = next(i for i, s in enumerate(sink.seen) if s.subject == "cold")
    assert before <= 3 * 512, f"{before} hot deliveries before the first cold one"
    d.close()


def test_credit_of_one_subject_does_not_block_another(tmp_path, clock):
    sink = CollectingSink(clock, per_subject={"stuck": 0})
    d = Driver(tmp_path, clock, sink)
    _send_many(d, "stuck", clock.now, 100, "s")
    _send_many(d, "free", clock.now, 100, "f")
    d.advance(0)
    assert sorted(s.subject for s in sink.seen) == ["free"] * 100
    sink.per_subject["stuck"] = 30
    d.advance(1)
    assert sum(1 for s in sink.seen if s.subject == "stuck") >= 30
    d.close()


# --- chunked loading -------------------------------------------------------------------------------------


def _load_big_bucket(tmp_path, clock, n, bound, chunk_bytes):
    sink = CollectingSink(clock)
    d = Driver(tmp_path, clock, sink, max_loaded=bound, load_ahead_ms=2 * MINUTE)
    d.engine.scheduler.cfg.load_chunk_bytes = chunk_bytes
    due0 = (bucket_of(clock.now) + 6) * MINUTE + 1_000  # beyond the load-ahead window
    receipts = []
    for k in range(0, n, 1_000):
        receipts += d.send(message("big", due0 + i // 10, f"m{i}", payload=b"") for i in range(k, k + 1_000))
    d.advance(0)
    assert d.engine.scheduler.stats()["wheel_size"] == 0, "a minute beyond the window is only on disk"
    return d, sink, receipts, due0


def _drain(d, sink, clock, want, max_passes=300):
    """Run passes 100 ms apart, acking everything; check the bound on the way."""
    sched = d.engine.scheduler
    seen: dict[str, int] = {}
    peak = passes = 0
    while len(seen) < want and passes < max_passes:
        clock.advance(100)
        d.catch_up()
        sched.run_once(clock.now)
        s = sched.stats()
        peak = max(peak, s["wheel_size"] + s["ready"])
        batch = sink.take()
        for x in batch:
            assert x.message_id not in seen, f"{x.message_id} delivered twice"
            assert x.at >= x.due
            seen[x.message_id] = x.at
        d.engine.ack([x.ack_id for x in batch])
        passes += 1
    # a few more passes: nothing else may come
    for _ in range(3):
        clock.advance(MINUTE)
        d.run()
    extra = sink.take()
    return seen, peak, passes, extra


@pytest.mark.parametrize("chunk_bytes", [8 * 1024, 64 * 1024])
def test_chunked_loading_respects_max_loaded(tmp_path, clock, chunk_bytes):
    """A bucket of 6,000 with max_loaded 500, written before its load time: the loader
    streams it in as it drains, and every message is delivered once.

    The bound is checked before a chunk is read, so it may be passed by one chunk's worth
    of records (a frame is at least 36 bytes; with the default 1 MiB chunk that is up to
    ~29,000 entries over ``max_loaded``)."""
    n, bound = 6_000, 500
    d, sink, _receipts, due0 = _load_big_bucket(tmp_path, clock, n, bound, chunk_bytes)
    slack = chunk_bytes // framing.HEADER_SIZE
    clock.set(due0 - 90_000)  # inside the window now
    d.run()
    s = d.engine.scheduler.stats()
    assert s["load_blocked"], s
    assert 0 < s["wheel_size"] <= bound + slack, s
    clock.set(due0)
    seen, peak, passes, extra = _drain(d, sink, clock, n)
    assert peak <= bound + slack, (peak, bound, slack)
    assert set(seen) == {f"m{i}" for i in range(n)}
    assert extra == []
    assert passes >= n // (bound + slack), "the bucket was not streamed in chunks"
    assert d.engine.stats()["pending"] == 0
    d.close()


def test_chunked_loading_cancel_outcome_is_exact(tmp_path, clock):
    """Cancel of records not loaded yet (bucket beyond the window, or past the loader's
    cursor) answers CANCELLED, and Get agrees — before and after the load."""
    n, bound = 3_000, 300
    d, sink, receipts, due0 = _load_big_bucket(tmp_path, clock, n, bound, 8 * 1024)
    early, mid, last = receipts[3], receipts[2_000], receipts[2_999]
    assert d.cancel(early) == CancelOutcome.CANCELLED  # bucket not loaded at all
    clock.set(due0 - 90_000)
    d.run()
    assert d.engine.scheduler.stats()["load_blocked"]
    assert d.cancel(mid) == CancelOutcome.CANCELLED  # beyond the loader's cursor
    assert d.cancel(last) == CancelOutcome.CANCELLED
    for r in (early, mid, last):
        assert d.get(r).state == MessageState.CANCELLED
        assert d.cancel(r) == CancelOutcome.ALREADY_CANCELLED
    d.close()


def test_chunked_loading_never_delivers_a_cancelled_message(tmp_path, clock):
    n, bound = 3_000, 300
    d, sink, receipts, due0 = _load_big_bucket(tmp_path, clock, n, bound, 8 * 1024)
    early, mid, last = receipts[3], receipts[2_000], receipts[2_999]
    assert d.cancel(early) == CancelOutcome.CANCELLED  # bucket not loaded at all
    clock.set(due0 - 90_000)
    d.run()
    assert d.cancel(mid) == CancelOutcome.CANCELLED  # beyond the loader's cursor
    assert d.cancel(last) == CancelOutcome.CANCELLED
    clock.set(due0)
    seen, _peak, _passes, extra = _drain(d, sink, clock, n - 3)
    wrongly = sorted({early.message_id, mid.message_id, last.message_id} & set(seen))
    assert wrongly == [], f"cancelled (CANCELLED acknowledged before dispatch) yet delivered: {wrongly}"
    assert len(seen) == n - 3 and extra == []
    d.close()


def test_live_records_into_the_window_respect_max_loaded(tmp_path, clock):
    """A burst sent for the next minute (already inside the window) must not grow the
    in-memory index past max_loaded either: the loader can pick the rest up from disk."""
    n, bound = 6_000, 500
    sink = CollectingSink(clock)
    d = Driver(tmp_path, clock, sink, max_loaded=bound, load_ahead_ms=2 * MINUTE)
    slack = d.engine.scheduler.cfg.load_chunk_bytes // framing.HEADER_SIZE
    due = (bucket_of(clock.now) + 1) * MINUTE + 1_000
    for k in range(0, n, 1_000):
        d.send(message("big", due, f"m{i}", payload=b"") for i in range(k, k + 1_000))
    d.advance(0)
    s = d.engine.scheduler.stats()
    assert s["wheel_size"] + s["ready"] <= bound + min(slack, 1_000), s
    d.close()


# --- overdue messages ------------------------------------------------------------------------------------


def test_past_due_delivered_at_once_oldest_first(tmp_path, clock):
    sink = CollectingSink(clock)
    d = Driver(tmp_path, clock, sink)
    d.advance(10 * MINUTE)  # the scheduler has moved past some empty minutes
    rng = random.Random(7)
    offsets = rng.sample(range(1, 9 * MINUTE), 300)
    d.send(message("late", clock.now - off, f"m{off}") for off in offsets)
    d.advance(0)
    got = sink.take()
    assert len(got) == 300
    dues = [g.due for g in got]
    assert dues == sorted(dues), "overdue messages go oldest first"
    d.close()


def test_overdue_after_downtime_oldest_first_under_rate_limit(tmp_path, clock):
    sink = CollectingSink(clock, auto_ack=None)
    d = Driver(tmp_path, clock, sink)
    rng = random.Random(3)
    offsets = [rng.randrange(1_000, 20 * MINUTE) for _ in range(600)]
    d.send(message("s", clock.now + off, f"m{i}") for i, off in enumerate(offsets))
    d.close()
    clock.advance(30 * MINUTE)  # down for half an hour: everything is overdue
    d.cfg["dispatch_rate"] = 5_000
    d.open()
    t0 = time.monotonic()
    while len(sink.seen) < 600 and time.monotonic() - t0 < 10:
        d.run()
        time.sleep(0.005)
    got = sink.seen
    assert len(got) == 600
    assert len(sink.batches) > 2, "the rate limit should spread the backlog"
    dues = [g.due for g in got]
    assert dues == sorted(dues), "overdue messages go oldest first, across minutes"
    d.close()


# --- late records into finished buckets --------------------------------------------------------------------


def _finish_minute(d, sink, clock):
    """Deliver and ack everything due so far and move the clock past a few minutes."""
    for _ in range(4):
        d.advance(MINUTE)
        d.engine.ack([x.ack_id for x in sink.take()])
    d.advance(1)


def test_late_record_into_finished_bucket_is_delivered_and_survives_restart(tmp_path, clock):
    sink = CollectingSink(clock)
    d = Driver(tmp_path, clock, sink)
    first = d.send([message("s", clock.now + 1_000, "early")])[0]
    b = bucket_of(first.deliver_at_ms)
    _finish_minute(d, sink, clock)
    stats = d.engine.scheduler.stats()
    assert stats["done_before"] > b, stats
    assert d.get(first).state == MessageState.DELIVERED
    # a record for the finished minute (sent now, due then: e.g. a replay or a clock skew)
    late = d.send([message("s", first.deliver_at_ms + 5, "late")])[0]
    assert bucket_of(late.deliver_at_ms) == b
    d.catch_up()
    assert b in d.engine.scheduler.reopened
    # restart before it was delivered: it must still come
    d.restart()
    assert b in d.engine.scheduler.reopened, "reopened buckets are saved with the checkpoint"
    d.advance(1)
    got = sink.take()
    assert [g.message_id for g in got] == ["late"]
    assert d.get(late).state == MessageState.PENDING  # in flight, not acknowledged
    d.engine.ack([got[0].ack_id])
    d.advance(1)
    assert d.get(late).state == MessageState.DELIVERED
    # restart after it was delivered: not again, and "early" neither
    d.restart()
    d.advance(MINUTE)
    d.advance(MINUTE)
    assert sink.take() == []
    assert b not in d.engine.scheduler.reopened
    assert d.engine.scheduler.stats()["done_before"] > b
    d.close()


def test_late_record_delivered_without_restart(tmp_path, clock):
    sink = CollectingSink(clock)
    d = Driver(tmp_path, clock, sink)
    first = d.send([message("s", clock.now + 1_000, "early")])[0]
    _finish_minute(d, sink, clock)
    late = d.send([message("s", first.deliver_at_ms, "late")])[0]
    d.advance(0)
    assert [g.message_id for g in sink.take()] == ["late"]
    # and a cancel of a late record before its dispatch
    late2 = d.send([message("s", first.deliver_at_ms + 1, "late2")])[0]
    assert d.cancel(late2) == CancelOutcome.CANCELLED
    d.advance(0)
    d.restart()
    d.advance(MINUTE)
    assert [g.message_id for g in sink.take()] == ["late"]  # unacked "late" again, never "late2"
    assert d.get(late2).state == MessageState.CANCELLED
    assert d.get(late).state == MessageState.PENDING
    d.close()


def test_a_message_cancelled_before_its_bucket_finished_stays_cancelled_when_a_late_record_reopens_it(tmp_path, clock):
    """A late record reopens a finished bucket, loaded from where the append began: the
    tombstones before it are not read, yet the bucket said it knew them all, and Get (and
    Cancel) answered from that set: PENDING for a message cancelled long before."""
    d = Driver(tmp_path, clock, CollectingSink(clock))
    try:
        (gone,) = d.send([message("s", clock.now - 1, "gone")])
        assert d.cancel(gone) == CancelOutcome.CANCELLED
        d.advance(MINUTE)
        assert d.engine.scheduler.book.done_before > bucket_of(gone.deliver_at_ms)  # finished
        d.send([message("s", gone.deliver_at_ms - 5, "late")])
        d.catch_up()
        assert d.get(gone).state == MessageState.CANCELLED
        assert d.cancel(gone) == CancelOutcome.ALREADY_CANCELLED
    finally:
        d.close()


def test_a_message_cancelled_before_a_restart_never_fires_when_its_bucket_loads_in_pieces(tmp_path, clock):
    """``max_loaded`` cuts a bucket read in one chunk: the tombstones behind the cut were
    neither read first (only a bucket read in several chunks gathers them first) nor
    seen before its first entries fired, so a message cancelled before a restart was
    delivered, and Get called it PENDING."""
    sink = CollectingSink(clock)
    d = Driver(tmp_path, clock, sink, max_loaded=8)
    try:
        sent = d.send([message("s", clock.now + 30_000, f"m{i}") for i in range(12)])
        assert d.cancel(sent[0]) == CancelOutcome.CANCELLED
        d.restart()
        d.advance(31_000)
        assert d.get(sent[0]).state == MessageState.CANCELLED
        d.advance(1_000, passes=6)
        d.advance(1_000, passes=6)
        assert sorted(s.message_id for s in sink.take()) == sorted(f"m{i}" for i in range(1, 12))
    finally:
        d.close()
