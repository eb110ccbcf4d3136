"""A Cancel or a Reschedule whose caller is cancelled (a client's deadline, a dropped call)
while its append is under way: the append goes on and becomes durable, so the tombstone
(and the move) happened, and what follows must see it. Since 4f85b80 a Reschedule's append
is left out of what by-id lookups wait for (its new messages are in Engine._moved until
copied); entered there only by the call that was cancelled, the moved message was found by
no by-id lookup until the iterate service copied it, and the old message's claim was
released although its tombstone was durable: a Cancel by id then claimed the old message
again and answered CANCELLED while the moved one stayed pending, to be delivered. A
Cancel's claims were released the same way: its target was deliverable (and a Get said
PENDING) with its tombstone durable. And a re-send of a moved id is answered with the moved
message's receipt although no Reschedule answered (the deduper hears of a move from the
service once the call answers)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

from simclock import MINUTE, T0, FakeClock, config, message

from qdelay.segments.naming import bucket_of
from qdelay.server.engine import Engine, MessageState


def _engine(tmp_path, due: int) -> Engine:
    engine = Engine(config(tmp_path / "data"), clock=FakeClock(T0))
    engine.start()
    engine.send_sync([message("t.m", due, "m0")])
    engine.iterate.wait_for(engine.wal.committed_sequence, 10)
    engine.iterate.flush_bucket(bucket_of(due))
    return engine


async def _cancelled_while_appending(engine: Engine, call: Callable[[], Awaitable[object]]) -> None:
    """Run ``call`` and cancel it right after it queued its append; return once that
    append is durable (the iterate service may be held: nothing here waits for it)."""
    submit, submit_bodies = engine.wal.submit, engine.wal.submit_bodies
    submitted: list[int] = []

    def cancelled(appended):
        submitted.append(appended.first_sequence + appended.count - 1)
        asyncio.current_task().cancel()  # the caller's deadline, while the append is under way
        return appended

    # a Reschedule's append (submit), a Cancel's tombstones (submit_bodies)
    engine.wal.submit = lambda *args: cancelled(submit(*args))  # type: ignore[method-assign]
    engine.wal.submit_bodies = lambda *args: cancelled(submit_bodies(*args))  # type: ignore[method-assign]
    try:
        task = asyncio.ensure_future(call())
        try:
            await task
            raise AssertionError("the call was not cancelled")
        except asyncio.CancelledError:
            pass
    finally:
        engine.wal.submit, engine.wal.submit_bodies = submit, submit_bodies  # type: ignore[method-assign]
    assert len(submitted) == 1
    while engine.wal.committed_sequence < submitted[0]:
        await asyncio.sleep(0.001)
    await asyncio.sleep(0)  # (the append's future settled on this loop: its callbacks run)


def test_a_cancel_by_id_after_a_reschedule_whose_caller_was_cancelled_cancels_the_moved_message(tmp_path):
    due, later = T0 + 90 * MINUTE, T0 + 200 * MINUTE
    engine = _engine(tmp_path, due)
    try:
        waiting = threading.Event()  # a lookup waits for the iterate service to copy more
        wait_for = engine.iterate.wait_for

        def watched(sequence: int, timeout: float) -> bool:
            if engine.iterate.sequence < sequence:
                waiting.set()
            return wait_for(sequence, timeout)

        engine.iterate.wait_for = watched  # type: ignore[method-assign]

        async def scenario() -> object:
            await _cancelled_while_appending(engine, lambda: engine.reschedule_many([("m0", None, None, later)]))
            cancel = asyncio.ensure_future(engine.cancel_many([("m0", None, None)]))
            # either it answers from what it found, or it waits for the iterate service
            while not cancel.done() and not waiting.is_set():
                await asyncio.sleep(0.001)
            held.pop().release()  # copy from here on
            return (await cancel)[0]

        engine.iterate.append_lock.acquire()  # the iterate service copies nothing meanwhile
        held = [engine.iterate.append_lock]
        try:
            outcome = asyncio.run(scenario())
        finally:
            if held:
                held.pop().release()
        assert outcome.name == "CANCELLED"
        engine.iterate.wait_for(engine.wal.committed_sequence, 10)
        # the Cancel answered CANCELLED: the message of that id is cancelled, not pending at
        # its new time
        got = engine.get_sync("m0", None, None)
        assert got.state == MessageState.CANCELLED, (got.state, got.deliver_at_ms)
        assert len(engine._moved) == 0
    finally:
        engine.close()


def test_a_cancel_whose_caller_was_cancelled_keeps_its_target_claimed_once_its_tombstone_is_durable(tmp_path):
    due = T0 + 90 * MINUTE
    engine = _engine(tmp_path, due)
    try:
        (receipt,) = [engine.resolve_id("m0")]
        assert receipt is not None
        with engine.iterate.append_lock:  # the tombstone is not copied meanwhile
            asyncio.run(
                _cancelled_while_appending(engine, lambda: engine.cancel_many([("m0", receipt[0], receipt[1])]))
            )
            # durable, not copied: the claim stands (the dispatcher skips the message) and
            # says so; released, a Get said PENDING and a Reschedule could move it
            assert engine.get_sync("m0", receipt[0], receipt[1]).state == MessageState.CANCELLED
            ((outcome, moved),) = asyncio.run(engine.reschedule_many([("m0", receipt[0], receipt[1], due + MINUTE)]))
            assert (outcome.name, moved) == ("CANCELLED", None)
        engine.iterate.wait_for(engine.wal.committed_sequence, 10)
        assert engine.get_sync("m0", None, None).state == MessageState.CANCELLED
    finally:
        engine.close()


def test_a_resend_of_an_id_whose_unanswered_reschedule_is_not_copied_is_answered_with_the_moved_receipt(tmp_path):
    """The service tells the deduper of a Reschedule's new receipt once the call answers
    (Deduper.rescheduled); a Reschedule that never answered (its caller cancelled, a sync
    replication timeout after the append) left a re-send of the id answered, until the
    iterate service copied the move, with the old message's receipt, which a Get then
    said CANCELLED. The moves not yet copied are the engine's (Engine.moved_since)."""
    from qdelay.server.dedupe import Deduper

    due, later = T0 + 90 * MINUTE, T0 + 200 * MINUTE
    engine = _engine(tmp_path, due)
    try:
        deduper = Deduper(engine, 600_000)

        async def scenario():
            # as after a cancelled call: the engine moved it, the service answered nothing
            ((outcome, moved),) = await engine.reschedule_many([("m0", None, None, later)])
            assert outcome.name == "RESCHEDULED" and moved is not None
            dups, claim = await deduper.check(["m0"])
            deduper.failed(claim)
            return moved, dups

        with engine.iterate.append_lock:  # the move is not copied meanwhile
            moved, dups = asyncio.run(scenario())
        assert dups == {0: moved}, (dups, moved)
    finally:
        engine.close()


def test_a_resend_checked_while_the_unanswered_move_is_copied_is_answered_with_the_moved_receipt(tmp_path):
    """As above, with the iterate service copying the move while the re-send's lookup runs:
    the id index answered the old message (read before the copy), and by the time the
    deduper asked the engine's moves another by-id lookup had dropped the move (copied, so
    the index holds it: MovedIds asks to be read before the index, and the deduper read it
    after). The re-send was answered with the old receipt."""
    from qdelay.server.dedupe import Deduper

    due, later = T0 + 90 * MINUTE, T0 + 200 * MINUTE
    engine = _engine(tmp_path, due)
    lock = engine.iterate.append_lock
    try:
        deduper = Deduper(engine, 600_000)
        duplicates_among = engine.duplicates_among

        def copied_meanwhile(ids, hits, window_ms):
            # (on a worker thread, after the index was read) the iterate service copies the
            # move, and a Get by id meanwhile drops it from the engine's moves
            lock.release()
            engine.iterate.wait_for(engine.wal.committed_sequence, 10)
            engine.resolve_ids(["m0"])
            return duplicates_among(ids, hits, window_ms)

        async def scenario():
            ((outcome, moved),) = await engine.reschedule_many([("m0", None, None, later)])
            assert outcome.name == "RESCHEDULED" and moved is not None
            engine.duplicates_among = copied_meanwhile  # type: ignore[method-assign]
            dups, claim = await deduper.check(["m0"])
            deduper.failed(claim)
            return moved, dups

        lock.acquire()  # the move is not copied before the re-send's lookup reads the index
        moved, dups = asyncio.run(scenario())
        assert dups == {0: moved}, (dups, moved)
    finally:
        if lock.locked():
            lock.release()
        engine.close()
