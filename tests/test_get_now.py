"""Engine.get_now: a Get answered on the calling thread (the server's event loop) only when
it would neither wait nor read much, and then exactly as get_sync answers; otherwise None
(the service hands it to a worker thread)."""

from __future__ import annotations

import asyncio
import threading
import time

from simclock import MINUTE, T0, FakeClock, config, message

from qdelay.segments.naming import bucket_of
from qdelay.server.engine import Engine, MessageState, _NotNow


def _same(a, b) -> bool:
    return (a.state, a.message, a.deliver_at_ms, a.delivered_at_ms, a.groups) == (
        b.state,
        b.message,
        b.deliver_at_ms,
        b.delivered_at_ms,
        b.groups,
    )


def test_get_now_answers_as_get_sync(tmp_path):
    clock = FakeClock(T0)
    engine = Engine(config(tmp_path / "data"), clock=clock)
    engine.start()
    due = T0 + 90 * MINUTE
    try:
        receipts = engine.send_sync([message("t.g", due + k, f"g{k}") for k in range(200)])
        engine.iterate.wait_for(engine.wal.committed_sequence, 10)
        engine.iterate.flush_bucket(bucket_of(due))
        r = receipts[7]
        # the minute's index file is written with its segment: the first Get reads a few of
        # its entries, as every Get does
        first = engine.get_sync(r.message_id, r.deliver_at_ms, r.sequence)
        now = engine.get_now(r.message_id, r.deliver_at_ms, r.sequence)
        assert now is not None and _same(now, first) and now.state == MessageState.PENDING
        # by id, a cancelled one, a receipt whose id disagrees, a sequence never written
        asyncio.run(engine.cancel_many([(r.message_id, r.deliver_at_ms, r.sequence)]))
        engine.iterate.wait_for(engine.wal.committed_sequence, 10)
        engine.iterate.flush_bucket(bucket_of(due))
        for args in (
            ("g8", None, None),
            (r.message_id, None, None),
            (r.message_id, r.deliver_at_ms, r.sequence),
            ("other", r.deliver_at_ms, r.sequence),
            ("g9", due + 9, engine.wal.committed_sequence + 100),
            ("nobody", None, None),
        ):
            now = engine.get_now(*args)
            assert now is not None, args
            assert _same(now, engine.get_sync(*args)), args
        assert engine.get_now(r.message_id, None, None).state == MessageState.CANCELLED
        assert engine.get_now("nobody", None, None).state == MessageState.NOT_FOUND
    finally:
        engine.close()


def test_get_now_declines_what_would_wait(tmp_path):
    """Not yet copied by the iterate service (never started here), or a by-id call while
    the iterate service is behind: None, and get_sync answers."""
    clock = FakeClock(T0)
    engine = Engine(config(tmp_path / "data"), clock=clock)
    try:
        (r,) = engine.send_sync([message("t.g", T0 + 90 * MINUTE, "late")])
        assert engine.get_now(r.message_id, r.deliver_at_ms, r.sequence) is None
        assert engine.get_now(r.message_id, None, None) is None
    finally:
        engine.close()


def test_a_claim_on_the_loop_never_waits_for_the_append_lock(tmp_path):
    """A far minute written behind again after _claimable_now flushed it (a send of that
    minute copied meanwhile by the iterate thread) makes the claim on the event loop decline
    (_NotNow, nothing left claimed) instead of waiting for the append lock, which an
    iterate step holds across its writes (and across a full disk, for as long as it lasts)."""
    clock = FakeClock(T0)
    engine = Engine(config(tmp_path / "data"), clock=clock)
    engine.start()
    due = T0 + 90 * MINUTE
    try:
        receipts = engine.send_sync([message("t.c", due + k, f"c{k}") for k in range(4)])
        engine.iterate.wait_for(engine.wal.committed_sequence, 10)
        engine.iterate.flush_bucket(bucket_of(due))
        targets = [(r.message_id, r.deliver_at_ms, r.sequence) for r in receipts[:2]]
        assert engine._claimable_now(targets)
        engine.send_sync([message("t.c", due + 9, "later")])  # copied behind, after that check
        engine.iterate.wait_for(engine.wal.committed_sequence, 10)
        assert engine.iterate.written_behind(bucket_of(due))
        got: list[object] = []

        def claim() -> None:
            try:
                got.append(engine._claim_cancels(targets, now=True))
            except _NotNow:
                got.append("not now")

        with engine.iterate.append_lock:  # an iterate step under way
            t = threading.Thread(target=claim, daemon=True)
            t.start()
            t.join(2.0)
            stuck = t.is_alive()
        t.join(10.0)
        assert not stuck and got == ["not now"]
        # nothing was left claimed: the worker thread's claim (flushing, waiting) cancels them
        outcomes = asyncio.run(engine.cancel_many(targets))
        assert [str(o.name) for o in outcomes] == ["CANCELLED", "CANCELLED"]
    finally:
        engine.close()


def test_by_id_calls_wait_for_messages_not_for_the_tombstones_claims_cover(tmp_path):
    """A by-id lookup waits for every MESSAGE committed before it (an id just sent or moved
    is found), not for the Cancels' own tombstones: until the iterate service copies one,
    its target stays claimed, and a Get, a Cancel and a Reschedule by id read the claim
    (Engine._ids_current). With the iterate service held (its append lock), a second Cancel
    by id answers ALREADY_CANCELLED at once instead of waiting for the tombstone's copy."""
    clock = FakeClock(T0)
    engine = Engine(config(tmp_path / "data"), clock=clock)
    engine.start()
    due = T0 + 90 * MINUTE
    try:
        engine.send_sync([message("t.i", due + k, f"i{k}") for k in range(3)])
        engine.iterate.wait_for(engine.wal.committed_sequence, 10)
        engine.iterate.flush_bucket(bucket_of(due))
        before = engine.iterate.sequence
        with engine.iterate.append_lock:  # the iterate service copies nothing meanwhile
            assert asyncio.run(engine.cancel_many([("i0", None, None)]))[0].name == "CANCELLED"
            assert engine.wal.committed_sequence > engine.iterate.sequence == before  # not copied
            t0 = time.monotonic()
            assert asyncio.run(engine.cancel_many([("i0", None, None)]))[0].name == "ALREADY_CANCELLED"
            assert engine.get_sync("i0", None, None).state == MessageState.CANCELLED
            moved = asyncio.run(engine.reschedule_many([("i0", None, None, due + MINUTE)]))
            assert moved[0][0].name == "CANCELLED"
            assert time.monotonic() - t0 < 4.0  # none waited out _iterated's 5 s
            # a message committed meanwhile is waited for: sent now, found once copied
            engine.send_sync([message("t.i", due + 5, "i1")])  # the id i1 again, newer
            got: list[object] = []
            t = threading.Thread(target=lambda: got.append(engine.resolve_id("i1")), daemon=True)
            t.start()
            t.join(0.2)
            assert t.is_alive()  # it waits for the new MESSAGE's copy
        t.join(10.0)
        assert got and got[0] is not None and got[0][0] == due + 5
    finally:
        engine.close()


def test_a_get_on_the_loop_never_waits_for_the_append_lock(tmp_path):
    """As for a claim: a far minute written behind again after get_now found it readable (a
    send of that minute copied meanwhile by the iterate thread) makes the Get on the event
    loop decline (None: the caller hands it to a worker thread) instead of waiting for the
    append lock, which an iterate step holds across its writes and a full disk."""
    clock = FakeClock(T0)
    engine = Engine(config(tmp_path / "data"), clock=clock)
    engine.start()
    due = T0 + 90 * MINUTE
    try:
        (r,) = engine.send_sync([message("t.g", due, "g")])
        engine.iterate.wait_for(engine.wal.committed_sequence, 10)
        engine.iterate.flush_bucket(bucket_of(due))
        assert engine.get_now(r.message_id, r.deliver_at_ms, r.sequence).state == MessageState.PENDING
        engine.send_sync([message("t.g", due + 9, "later")])  # copied behind...
        engine.iterate.wait_for(engine.wal.committed_sequence, 10)
        assert engine.iterate.written_behind(bucket_of(due))
        readable = engine._readable_now
        engine._readable_now = lambda bucket: True  # type: ignore[method-assign]  # ...after the check
        got: list[object] = []
        with engine.iterate.append_lock:  # an iterate step under way
            t = threading.Thread(target=lambda: got.append(engine.get_now(r.message_id, due, r.sequence)), daemon=True)
            t.start()
            t.join(2.0)
            stuck = t.is_alive()
        t.join(10.0)
        assert not stuck and got == [None]
        engine._readable_now = readable  # type: ignore[method-assign]
        assert asyncio.run(engine.get(r.message_id, due, r.sequence)).state == MessageState.PENDING
    finally:
        engine.close()


def test_by_id_calls_do_not_wait_for_a_reschedule_but_its_own_id_finds_the_move(tmp_path):
    """A Reschedule's append is not waited for by the by-id lookups of other ids (it forced
    the iterate service into a step per by-id batch after a move): its new messages are in
    Engine._moved until copied, and its old ones stay claimed. A lookup of the moved id
    itself finds the new message: from get_now (declined while not copied), a Get by id
    (waits for the copy, then answers the new time) and a Cancel by id. With the iterate
    service held (its append lock), the other ids' calls answer at once."""
    clock = FakeClock(T0)
    engine = Engine(config(tmp_path / "data"), clock=clock)
    engine.start()
    due, later = T0 + 90 * MINUTE, T0 + 200 * MINUTE
    try:
        engine.send_sync([message("t.m", due + k, f"m{k}") for k in range(3)])
        engine.iterate.wait_for(engine.wal.committed_sequence, 10)
        engine.iterate.flush_bucket(bucket_of(due))
        before = engine.iterate.sequence
        got: list[object] = []
        with engine.iterate.append_lock:  # the iterate service copies nothing meanwhile
            ((outcome, receipt),) = asyncio.run(engine.reschedule_many([("m0", None, None, later)]))
            assert outcome.name == "RESCHEDULED" and receipt is not None and receipt.deliver_at_ms == later
            assert engine.wal.committed_sequence > engine.iterate.sequence == before  # not copied
            t0 = time.monotonic()
            assert asyncio.run(engine.cancel_many([("m1", None, None)]))[0].name == "CANCELLED"
            assert engine.get_sync("m2", None, None).state == MessageState.PENDING
            ((again, moved2),) = asyncio.run(engine.reschedule_many([("m2", None, None, later + 1)]))
            assert again.name == "RESCHEDULED" and moved2 is not None
            assert time.monotonic() - t0 < 4.0  # none waited out _iterated's 5 s
            assert engine.get_now("m0", None, None) is None  # the move, not yet copied: declined
            t = threading.Thread(target=lambda: got.append(engine.get_sync("m0", None, None)), daemon=True)
            t.start()
            t.join(0.2)
            assert t.is_alive()  # it waits for the moved message's copy
        t.join(10.0)
        assert got and got[0].state == MessageState.PENDING and got[0].deliver_at_ms == later, got
        assert got[0].message is not None and got[0].message.message_id == "m0"
        # copied now: found through the index, and the table is empty
        assert engine.resolve_id("m0") == (later, receipt.sequence)
        assert engine.resolve_id("m2") == (later + 1, moved2.sequence)
        assert asyncio.run(engine.cancel_many([("m0", None, None)]))[0].name == "CANCELLED"
        assert engine.get_sync("m0", None, None).state == MessageState.CANCELLED
        assert len(engine._moved) == 0
    finally:
        engine.close()
