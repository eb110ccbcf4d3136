"""RecordFinder.holds, holds_at, holds_across, cancelled_among and cancelled_at
(segments/lookup.py): a batch of receipts checked against a schedule segment's index (or
one receipt at a time, or a batch over several segments) answers as reading each record
does (RecordFinder.find + decode), and the index's CANCELLED flags are exactly the
tombstones written, while the segment grows."""

from __future__ import annotations

import asyncio
import random

import numpy as np
from simclock import MINUTE, T0, FakeClock, config, message

from qdelay.segments import records
from qdelay.segments.framing import RecordKind
from qdelay.segments.naming import bucket_of
from qdelay.server.engine import Engine


def _reference(engine: Engine, seg, seq: int, due: int, message_id: str) -> bool:
    frame = engine.finder.find(seg, seq)
    if frame is None or frame.kind != RecordKind.MESSAGE:
        return False
    msg = records.decode_message(frame.body)
    return msg.message_id == message_id and msg.deliver_at_ms == due


def test_holds_answers_as_reading_each_record(tmp_path):
    clock = FakeClock(T0)
    engine = Engine(config(tmp_path / "data"), clock=clock)
    engine.start()
    rnd = random.Random(5)
    due0 = T0 + 90 * MINUTE
    bucket = bucket_of(due0)
    try:
        sent = []
        cancelled: set[int] = set()
        places: dict[int, int] = {}  # sequence -> its entry's place, as holds_at found it
        for round_ in range(3):  # the segment grows between the checks
            batch = [
                message("t.h", due0 + rnd.randrange(MINUTE), "i" * rnd.randrange(1, 40) + f"-{round_}-{k}")
                for k in range(150)
            ]
            sent += engine.send_sync(batch)
            victims = rnd.sample(sent, 5)
            asyncio.run(engine.cancel_many([(r.message_id, r.deliver_at_ms, r.sequence) for r in victims]))
            engine.iterate.wait_for(engine.wal.committed_sequence, 10)
            engine.iterate.flush_bucket(bucket)
            seg = engine.schedule.get(bucket)
            queries = []
            for r in rnd.sample(sent, 60):
                queries.append((r.sequence, r.deliver_at_ms, r.message_id))  # right
                queries.append((r.sequence, r.deliver_at_ms, r.message_id[:-1] + "#"))  # same length, wrong id
                queries.append((r.sequence, r.deliver_at_ms, r.message_id + "x"))  # longer id
                queries.append((r.sequence, r.deliver_at_ms + 1, r.message_id))  # wrong due
                queries.append((r.sequence + 1, r.deliver_at_ms, r.message_id))  # a neighbour, or a tombstone
            queries.append((engine.wal.committed_sequence + 5, due0, "nothing"))  # beyond the end
            queries.append((1, due0, "i-0-0"))
            rnd.shuffle(queries)
            got = engine.finder.holds(seg, [q[0] for q in queries], [q[1] for q in queries], [q[2] for q in queries])
            want = [_reference(engine, seg, *q) for q in queries]
            assert got == want
            # one at a time: the same answers
            each = []
            for q in queries:
                each += engine.finder.holds(seg, [q[0]], [q[1]], [q[2]])
            assert each == want
            cancelled.update(r.sequence for r in victims)
            seqs = np.array([r.sequence for r in sent] + [engine.wal.committed_sequence + 9], dtype=np.int64)
            flags = engine.finder.cancelled_among(seg, seqs).tolist()
            assert flags == [int(q) in cancelled for q in seqs.tolist()]
            # the places holds_at found in an earlier round (before these tombstones), read
            # again by cancelled_at (CancelBatch's one search a target): the same flags
            if places:
                olds = np.array(list(places), dtype=np.int64)
                got_flags = engine.finder.cancelled_at(seg, np.array([places[q] for q in olds.tolist()]))
                assert got_flags.tolist() == [q in cancelled for q in olds.tolist()]
            ok, at = engine.finder.holds_at(
                seg, [r.sequence for r in sent], [r.deliver_at_ms for r in sent], [r.message_id for r in sent]
            )
            assert ok.all() and (at >= 0).all()
            miss_ok, miss_at = engine.finder.holds_at(seg, [sent[0].sequence], [sent[0].deliver_at_ms + 1], ["x"])
            assert miss_ok.tolist() == [False] and miss_at.tolist() == [-1]
            places = dict(zip([r.sequence for r in sent], at.tolist()))
            # one sequence at a time (IndexFile.entry, what Get uses): the same entries
            assert [engine.finder.cancelled(seg, q) for q in seqs.tolist()] == flags
            idx = seg.index
            assert idx is not None
            for q in seqs.tolist() + [q[0] for q in queries]:
                found = idx.lookup([q])
                one = idx.entry(q)
                if not found.hit[0]:
                    assert one is None
                else:
                    assert one == (
                        int(found.offsets[0]),
                        int(found.kinds[0]),
                        int(found.flags[0]),
                        int(found.a[0]),
                        int(found.b[0]),
                    )
            assert sum(got) >= 60  # the right ones (and no more than the reference finds)
    finally:
        engine.close()


def test_a_batch_over_many_minutes_answers_as_one_minute_at_a_time(tmp_path):
    """holds_across (rows of several segments, in any order) and Engine.duplicates_among (a
    batch of retried sends over many minutes) answer as their one-segment, one-id forms."""
    clock = FakeClock(T0)
    engine = Engine(config(tmp_path / "data"), clock=clock)
    engine.start()
    rnd = random.Random(7)
    try:
        sent = engine.send_sync(
            [
                message("t.m", T0 + (90 + rnd.randrange(6)) * MINUTE + rnd.randrange(MINUTE), f"m-{k}")
                for k in range(120)
            ]
        )
        victims = rnd.sample(sent, 15)
        asyncio.run(engine.cancel_many([(r.message_id, r.deliver_at_ms, r.sequence) for r in victims]))
        engine.iterate.wait_for(engine.wal.committed_sequence, 10)
        queries = [(r.sequence, r.deliver_at_ms, r.message_id) for r in sent]
        queries += [(r.sequence, r.deliver_at_ms, r.message_id + "x") for r in rnd.sample(sent, 20)]  # wrong id
        queries += [(r.sequence + 1, r.deliver_at_ms, r.message_id) for r in rnd.sample(sent, 20)]  # wrong place
        rnd.shuffle(queries)
        seqs = np.array([q[0] for q in queries], dtype=np.int64)
        dues = np.array([q[1] for q in queries], dtype=np.int64)
        ids = [q[2] for q in queries]
        buckets = [bucket_of(d) for d in dues.tolist()]
        parts = []
        for b in rnd.sample(sorted(set(buckets)), len(set(buckets))):  # segments in any order
            engine.iterate.flush_bucket(b)
            parts.append((engine.schedule.get(b), np.array([k for k, x in enumerate(buckets) if x == b])))
        assert len(parts) == 6
        ok, at, flagged = engine.finder.holds_across(parts, seqs, dues, ids)
        for k, q in enumerate(queries):
            seg = engine.schedule.get(buckets[k])
            one_ok, one_at = engine.finder.holds_at(seg, [q[0]], [q[1]], [q[2]])
            assert (bool(ok[k]), int(at[k])) == (bool(one_ok[0]), int(one_at[0]))
            # the CANCELLED flag as read by the search: the tombstones written, for held rows
            want = bool(one_ok[0]) and bool(engine.finder.cancelled_at(seg, one_at)[0])
            assert bool(flagged[k]) == want
        assert int(ok.sum()) == len(sent) and int(flagged.sum()) == len(victims)
        # every row found (the rows of the parts, taken together, a permutation of the batch)
        mine = [k for k, q in enumerate(queries) if q[2] in {r.message_id for r in sent} and ok[k]]
        sub = [(seg, np.array([mine.index(k) for k in rows.tolist() if k in mine])) for seg, rows in parts]
        ok2, at2, flagged2 = engine.finder.holds_across(sub, seqs[mine], dues[mine], [ids[k] for k in mine])
        assert ok2.all() and at2.tolist() == at[mine].tolist() and flagged2.tolist() == flagged[mine].tolist()
        # retried sends: the pending ones and the cancelled ones (closed within the window)
        # are duplicates, each with its original receipt; an unknown id is none
        asked = [r.message_id for r in rnd.sample(sent, len(sent))] + ["unknown-1"]
        hits = engine.ids.get_many(asked)
        batch = engine.duplicates_among(asked, hits, 600_000)
        one_by_one = {}
        for k, (mid, hit) in enumerate(zip(asked, hits)):
            for receipt in engine.duplicates_among([mid], [hit], 600_000).values():
                one_by_one[k] = receipt
        assert batch == one_by_one
        by_id = {r.message_id: r for r in sent}
        assert {k: (r.message_id, r.deliver_at_ms, r.sequence) for k, r in batch.items()} == {
            k: (mid, by_id[mid].deliver_at_ms, by_id[mid].sequence) for k, mid in enumerate(asked[:-1])
        }
        clock.advance(11 * MINUTE)  # the cancelled ones' window has passed: their ids are free
        later = engine.duplicates_among(asked, hits, 600_000)
        assert sorted(later) == sorted(k for k, mid in enumerate(asked[:-1]) if by_id[mid] not in victims)
    finally:
        engine.close()


def test_find_many_answers_as_find_of_each(tmp_path):
    clock = FakeClock(T0)
    engine = Engine(config(tmp_path / "data"), clock=clock)
    engine.start()
    rnd = random.Random(9)
    due0 = T0 + 90 * MINUTE
    bucket = bucket_of(due0)
    try:
        sent = engine.send_sync(
            [message("t.f", due0 + rnd.randrange(MINUTE), f"f-{k}" + "p" * rnd.randrange(50)) for k in range(400)]
        )
        asyncio.run(engine.cancel_many([(r.message_id, r.deliver_at_ms, r.sequence) for r in sent[:3]]))
        engine.iterate.wait_for(engine.wal.committed_sequence, 10)
        engine.iterate.flush_bucket(bucket)
        seg = engine.schedule.get(bucket)
        # messages, tombstones (the last sequences), absent ones, in any order, one alone
        asked = [r.sequence for r in rnd.sample(sent, 150)] + [engine.wal.committed_sequence, 10_000, 0]
        rnd.shuffle(asked)
        for seqs in (asked, asked[:1]):
            want = [engine.finder.find(seg, s) for s in seqs]
            got = engine.finder.find_many(seg, seqs)
            assert [(f.offset, f.kind, f.body) if f else None for f in got] == [
                (f.offset, f.kind, f.body) if f else None for f in want
            ]
    finally:
        engine.close()
