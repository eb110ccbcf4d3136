"""The cleaner deletes nothing a message still needs (one test per rule).

- a message-log segment only once wholly behind the *saved* iterate checkpoint and older
  than its retention (file mtime, real time), and never the active segment;
- a schedule segment (and its dispatch segment) only once ``done_before`` passed its
  bucket (everything in it delivered or dead-lettered for every group it is for, or
  cancelled, with dispatch records on disk) and its keep time passed;
- a late record for a bucket already deleted still works.
"""

from __future__ import annotations

import asyncio
import os
import time

from simclock import MINUTE, T0, CollectingSink, Driver, FakeClock, files, message

from qdelay.segments.naming import bucket_of
from qdelay.server.engine import CancelOutcome, MessageState, Receipt


def make(tmp_path, **cfg):
    clock = FakeClock(T0 + 1_000)
    cfg.setdefault("segment_bytes", 2048)
    return Driver(tmp_path, clock, CollectingSink(clock), **cfg)


def fill_wal(d, batches=8):
    out = []
    for k in range(batches):
        out += d.send(message("s", d.clock.now + 10 * MINUTE, f"w{k}.{i}", payload=b"x" * 300) for i in range(4))
    return out


def age(paths, seconds):
    t = time.time() - seconds
    for p in paths:
        os.utime(p, (t, t))


def test_message_segment_not_checkpointed_is_kept(tmp_path):
    d = make(tmp_path, message_retention_ms=0, checkpoint_interval_ms=10**9)
    fill_wal(d)
    wals = files(tmp_path, "message", ".wal")
    assert len(wals) >= 4
    age(wals, 10_000)
    d.catch_up()  # iterated, but the checkpoint on disk still says offset 0
    assert d.engine.iterate.saved_offset == 0
    assert d.engine.cleaner.run_once(d.clock.now)["message_segments"] == []
    assert files(tmp_path, "message", ".wal") == wals
    d.engine.iterate.checkpoint()
    removed = d.engine.cleaner.run_once(d.clock.now)["message_segments"]
    assert removed, "checkpointed and old: deleted"
    for p in removed:
        assert not os.path.exists(p)
    left = d.engine.wal.segments()
    assert left[0].key <= d.engine.iterate.saved_offset
    d.close()


def test_message_segment_within_retention_is_kept(tmp_path):
    d = make(tmp_path, message_retention_ms=3_600_000)
    fill_wal(d)
    d.catch_up()
    d.engine.iterate.checkpoint()
    wals = files(tmp_path, "message", ".wal")
    assert d.engine.cleaner.run_once(d.clock.now)["message_segments"] == []
    age(wals[:2], 3_700)  # only the two oldest are past retention
    removed = d.engine.cleaner.run_once(d.clock.now)["message_segments"]
    assert sorted(removed) == wals[:2]
    d.close()


def test_active_message_segment_never_deleted(tmp_path):
    d = make(tmp_path, message_retention_ms=0)
    receipts = fill_wal(d)
    d.catch_up()
    d.engine.iterate.checkpoint()
    wals = files(tmp_path, "message", ".wal")
    age(wals, 10_000)
    d.engine.cleaner.run_once(d.clock.now)
    d.engine.cleaner.run_once(d.clock.now)
    left = files(tmp_path, "message", ".wal")
    assert left and left[-1] == wals[-1], "the active segment stays"
    # the replication floor holds segments too
    d.engine.replication_floor = lambda: 0
    d.close()
    d.open()
    # restart works with the cleaned log, and sequences continue
    assert d.send([message("s", d.clock.now, "after")])[0].sequence == len(receipts) + 1
    d.run(d.clock.now + 11 * MINUTE)
    assert len(d.sink.take()) == len(receipts) + 1
    d.close()


def test_replication_floor_holds_message_segments(tmp_path):
    d = make(tmp_path, message_retention_ms=0)
    fill_wal(d)
    d.catch_up()
    d.engine.iterate.checkpoint()
    age(files(tmp_path, "message", ".wal"), 10_000)
    d.engine.replication_floor = lambda: 0  # a slave that confirmed nothing
    assert d.engine.cleaner.run_once(d.clock.now)["message_segments"] == []
    d.engine.replication_floor = lambda: None
    assert d.engine.cleaner.run_once(d.clock.now)["message_segments"]
    d.close()


def test_replication_floor_at_a_segment_end_keeps_that_segment(tmp_path):
    """A slave that confirmed exactly up to a segment's end is compared at its last record,
    in that segment, when it reconnects: the segment stays; one byte further, it goes."""
    d = make(tmp_path, message_retention_ms=0)
    fill_wal(d)
    d.catch_up()
    d.engine.iterate.checkpoint()
    age(files(tmp_path, "message", ".wal"), 10_000)
    segs = d.engine.wal.segments()
    assert len(segs) >= 4
    end = segs[1].key + segs[1].size
    assert end == segs[2].key
    d.engine.replication_floor = lambda: end
    removed = d.engine.cleaner.run_once(d.clock.now)["message_segments"]
    assert removed == [segs[0].path] and d.engine.wal.first_offset == segs[1].key
    d.engine.replication_floor = lambda: end + 1  # its last record is in the next segment
    assert d.engine.cleaner.run_once(d.clock.now)["message_segments"] == [segs[1].path]
    assert d.engine.wal.first_offset == end
    d.close()


def _deliver(d, upto, ack_at=None):
    """Deliver what is due at ``upto``; ack it at ``ack_at`` (default: at once).

    (Acking after the bucket's end works around the done_before bug documented by
    test_done_before_advances_when_last_ack_precedes_bucket_end.)"""
    d.run(upto)
    got = d.sink.take()
    if ack_at is not None:
        d.clock.set(ack_at)
    d.engine.ack([g.ack_id for g in got])
    d.run()
    return got


def test_done_before_advances_when_last_ack_precedes_bucket_end(tmp_path):
    d = make(tmp_path, schedule_keep_ms=0)
    r = d.send([message("s", d.clock.now + 1_000, "a")])[0]
    b = bucket_of(r.deliver_at_ms)
    _deliver(d, d.clock.now + 2_000)  # acked at once, well before the minute ends
    for _ in range(3):
        d.advance(MINUTE)
    assert d.engine.scheduler.done_before > b, "an idle server never finishes the minute"
    assert d.engine.cleaner.run_once(d.clock.now)["buckets"] == [b]
    d.close()


def test_done_before_advances_when_last_ack_follows_bucket_end(tmp_path):
    d = make(tmp_path)
    r = d.send([message("s", d.clock.now + 1_000, "a")])[0]
    b = bucket_of(r.deliver_at_ms)
    _deliver(d, d.clock.now + 2_000, ack_at=(b + 1) * MINUTE + 5)
    assert d.engine.scheduler.done_before > b
    d.close()


def test_schedule_segment_deleted_only_when_done_and_kept_long_enough(tmp_path):
    keep = 10 * MINUTE
    d = make(tmp_path, schedule_keep_ms=keep, segment_bytes=64 * 1024 * 1024)
    now = d.clock.now
    done = d.send([message("s", now + 1_000, "done")])[0]
    open_ = d.send([message("t", now + MINUTE + 1_000, "open")])[0]  # next minute: left unacked
    b_done, b_open = bucket_of(done.deliver_at_ms), bucket_of(open_.deliver_at_ms)
    got = _deliver(d, now + 2_000, ack_at=(b_done + 1) * MINUTE + 5)
    assert [g.message_id for g in got] == ["done"]
    d.run(now + MINUTE + 2_000)
    assert [g.message_id for g in d.sink.take()] == ["open"]  # delivered, never acked  # delivered, never acked
    for _ in range(3):
        d.advance(MINUTE)
        d.sink.take()  # redeliveries of "open", never acked
    sched = d.engine.scheduler
    assert sched.done_before > b_done
    assert sched.done_before <= b_open, "a bucket with an unacked message is not done"
    cleaner = d.engine.cleaner
    # b_done is finished but its keep time has not passed
    assert cleaner.run_once((b_done + 1) * MINUTE + keep - 1)["buckets"] == []
    assert d.get(done).state == MessageState.DELIVERED
    # keep time passed: b_done goes (both files), b_open stays although far past
    removed = cleaner.run_once((b_open + 1) * MINUTE + keep + 10 * MINUTE)["buckets"]
    assert removed == [b_done]
    names = [os.path.basename(p) for p in files(tmp_path, "schedule", ".sched") + files(tmp_path, "dispatch", ".disp")]
    assert not any(n.startswith(_stamp(b_done)) for n in names), names
    assert any(n.startswith(_stamp(b_open)) for n in files_basenames(tmp_path, "schedule", ".sched"))
    # after the keep time, Get and Cancel no longer know the message
    assert d.get(done).state == MessageState.NOT_FOUND
    assert d.get(open_).state == MessageState.PENDING
    # and a retried send of its id is new again (the id index still maps it; whatever the
    # window), while the open one's is a duplicate
    hits = d.engine.ids.get_many(["done", "open"])
    assert hits[0] is not None
    assert d.engine.duplicates_among(["done", "open"], hits, 10**12) == {
        1: Receipt("open", open_.deliver_at_ms, open_.sequence)
    }
    d.close()


def _stamp(bucket):
    from qdelay.segments.naming import minute_stamp

    return minute_stamp(bucket)


def files_basenames(root, sub, suffix):
    return [os.path.basename(p) for p in files(root, sub, suffix)]


def test_schedule_segment_of_not_done_bucket_kept_even_when_old(tmp_path):
    d = make(tmp_path, schedule_keep_ms=0, segment_bytes=64 * 1024 * 1024)
    r = d.send([message("s", d.clock.now + 1_000, "never-acked")])[0]
    b = bucket_of(r.deliver_at_ms)
    d.run(d.clock.now + 2_000)
    for _ in range(5):
        d.advance(MINUTE)
    assert d.engine.scheduler.done_before <= b
    assert d.engine.cleaner.run_once(d.clock.now + 86_400_000)["buckets"] == []
    assert files(tmp_path, "schedule", ".sched")
    d.close()


def test_late_record_after_bucket_deleted(tmp_path):
    d = make(tmp_path, schedule_keep_ms=0, segment_bytes=64 * 1024 * 1024)
    first = d.send([message("s", d.clock.now + 1_000, "first")])[0]
    b = bucket_of(first.deliver_at_ms)
    _deliver(d, d.clock.now + 2_000, ack_at=(b + 1) * MINUTE + 5)
    for _ in range(3):
        d.advance(MINUTE)
    assert d.engine.cleaner.run_once(d.clock.now)["buckets"] == [b]
    assert files(tmp_path, "schedule", ".sched") == []
    late = d.send([message("s", first.deliver_at_ms + 10, "late")])[0]
    d.advance(1)
    got = d.sink.take()
    assert [g.message_id for g in got] == ["late"]
    assert d.get(late).state == MessageState.PENDING
    # and across a restart before its ack
    d.restart()
    d.advance(1)
    got = d.sink.take()
    assert [g.message_id for g in got] == ["late"]
    d.engine.ack([got[0].ack_id])
    d.advance(1)
    assert d.get(late).state == MessageState.DELIVERED
    late2 = d.send([message("s", first.deliver_at_ms + 20, "late2")])[0]
    assert d.cancel(late2) == CancelOutcome.CANCELLED
    d.advance(MINUTE)
    assert d.sink.take() == []
    d.close()


class GroupSink:
    """A sink with credit per group (0: no consumer connected), remembering each delivery
    as (group, message id, ack id)."""

    def __init__(self, credit: dict[str, int]) -> None:
        self.credit_of = dict(credit)
        self.seen: list[tuple[str, str, str]] = []

    def credit(self, subject: str, group: str = "default") -> int:
        return self.credit_of.get(group, 0)

    def deliver(self, subject: str, group: str, deliveries) -> None:
        self.seen += [(group, d.message_id, d.ack_id) for d in deliveries]

    def take(self, group: str) -> list[tuple[str, str]]:
        """(message id, ack id) of the group's deliveries since the last call."""
        mine = [(m, a) for g, m, a in self.seen if g == group]
        self.seen = [s for s in self.seen if s[0] != group]
        return mine


def test_schedule_segment_kept_until_every_group_has_finished_it(tmp_path):
    """With two groups, a minute one group has acknowledged and the other has not even
    received (no consumer) is not finished: the cleaner keeps its schedule and dispatch
    segments however old, and Get answers per group. Once the second group acknowledges,
    the minute is finished and the cleaner deletes both files."""
    clock = FakeClock(T0 + 1_000)
    sink = GroupSink({"fast": 1000})
    d = Driver(tmp_path, clock, sink, schedule_keep_ms=0, segment_bytes=64 * 1024 * 1024)
    for g in ("fast", "slow"):
        assert asyncio.run(d.engine.ensure_group("s", g))
    sent = d.send(message("s", d.clock.now + 1_000 + i, f"m{i}") for i in range(5))
    b = bucket_of(sent[0].deliver_at_ms)
    ids = sorted(r.message_id for r in sent)
    d.run(d.clock.now + 2_000)
    got = sink.take("fast")
    assert sorted(m for m, _a in got) == ids
    d.engine.ack([a for _m, a in got], "s", "fast")
    for _ in range(3):
        d.advance(MINUTE)
    assert sink.take("slow") == []
    cleaner = d.engine.cleaner
    assert d.engine.scheduler.done_before <= b, "a group has not received the minute"
    assert cleaner.run_once(d.clock.now + 86_400_000)["buckets"] == []
    assert files_basenames(tmp_path, "schedule", ".sched") and files_basenames(tmp_path, "dispatch", ".disp")
    st = d.get(sent[0])
    assert st.state == MessageState.DELIVERED
    assert [(name, state) for name, state, _at in st.groups] == [
        ("fast", MessageState.DELIVERED),
        ("slow", MessageState.PENDING),
    ]
    # the second group's consumer comes: it gets the minute, acknowledges, and then it goes
    sink.credit_of["slow"] = 1000
    d.advance(1)
    got = sink.take("slow")
    assert sorted(m for m, _a in got) == ids
    d.engine.ack([a for _m, a in got], "s", "slow")
    for _ in range(2):
        d.advance(MINUTE)
    assert d.engine.scheduler.done_before > b
    assert cleaner.run_once(d.clock.now)["buckets"] == [b]
    assert files(tmp_path, "schedule", ".sched") == [] and files(tmp_path, "dispatch", ".disp") == []
    assert d.get(sent[0]).state == MessageState.NOT_FOUND
    assert sink.take("fast") == [] and sink.take("slow") == [], "nothing delivered twice"
    d.close()
