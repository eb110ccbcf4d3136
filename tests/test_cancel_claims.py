"""Cancel claims travel on the scheduler's queue (issue 14, item 3): the worker thread of a
Cancel posts its claims and waits for the answer; the scheduler thread applies them
between the steps of a dispatch round, so a claimed message is never handed out."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from qdelay.errors import LeaseLost
from qdelay.segments.naming import bucket_of
from qdelay.server.engine import Engine, MessageState, RescheduleOutcome
from qdelay.server.scheduler import Scheduler
from tests.byte_surgery import HEADER_SIZE, flip_byte
from tests.conftest import wait_until
from tests.simclock import MINUTE, T0, CollectingSink, Driver, FakeClock, config, message, started_engine


def _started(tmp_path) -> tuple[Engine, CollectingSink]:
    return started_engine(tmp_path / "data")


def test_a_claim_posted_while_a_round_reads_its_records_wins_and_a_release_gives_it_back(tmp_path):
    engine, sink = _started(tmp_path)
    sched = engine.scheduler
    try:
        due = int(time.time() * 1000) + 300
        target, other = engine.send_sync([message("t.claim", due, "target"), message("t.claim", due, "other")])
        answers: dict[str, list[int]] = {}
        read = sched.dispatcher.read

        def read_with_a_claim_arriving(taken) -> None:
            """The round's records are being read (no lock held): a Cancel claims the
            target now (the lock is free, so its worker applies the queue itself)."""
            seqs = [q for t in taken for part in t.parts for q in part.seqs]
            if target.sequence in seqs and "mid-round" not in answers:
                claimer = threading.Thread(
                    target=lambda: answers.__setitem__("mid-round", sched.claim_cancels([target.sequence]))
                )
                claimer.start()
                claimer.join(5)
            read(taken)

        sched.dispatcher.read = read_with_a_claim_arriving  # type: ignore[method-assign]
        assert wait_until(lambda: "other" in sink.ids() and "mid-round" in answers, timeout=10)
        assert answers["mid-round"] == [Scheduler.CLAIMED]
        assert "target" not in sink.ids()  # taken for the round, dropped at its hand-out
        assert sched.cancel_claimed(target.sequence)
        assert sched.stats()["cancel_skipped"] == 1

        # the tombstone write failed: the claim is given back (posted, not waited for) and
        # the message is delivered after all
        sched.release_cancels([target.sequence])
        assert wait_until(lambda: "target" in sink.ids(), timeout=10)
        assert not sched.cancel_claimed(target.sequence)
        # handed out and not acknowledged: a claim is refused, and a second claim of an
        # idle message is answered as already claimed, in one request
        (third,) = engine.send_sync([message("t.claim", due + 3_600_000, "third")])
        assert sched.claim_cancels([target.sequence, third.sequence, third.sequence]) == [
            Scheduler.CLAIM_OUT,
            Scheduler.CLAIMED,
            Scheduler.CLAIM_CANCELLING,
        ]
        sched.release_cancels([third.sequence])
        assert not sched.cancel_claimed(third.sequence)
        assert other.sequence not in (target.sequence, third.sequence)
    finally:
        engine.close()


def test_claims_are_answered_when_the_scheduler_thread_is_not_running(tmp_path):
    """Before start() and after stop() the caller applies the queue itself."""
    engine = Engine(config(tmp_path / "data"))
    sched = engine.scheduler
    try:
        assert sched.claim_cancels([7, 7]) == [Scheduler.CLAIMED, Scheduler.CLAIM_CANCELLING]
        sched.release_cancels([7])
        assert not sched.cancel_claimed(7)
        engine.start()
        assert sched.claim_cancels([8]) == [Scheduler.CLAIMED]
        sched.stop()
        assert sched.cancel_claimed(8)
        sched.release_cancels([8])
        assert not sched.cancel_claimed(8)
        assert sched.queued() == 0
    finally:
        engine.close()


def test_a_claim_released_after_a_spill_pass_set_its_entry_aside_is_delivered(tmp_path):
    """A spilled lane's read-back pass meets a claimed message: the entry is set aside, held
    by its bucket (which cannot become done meanwhile), and a release (the tombstone write
    failed) queues it again; without it the message would be lost with no tombstone."""
    clock = FakeClock()
    sink = CollectingSink(clock)
    d = Driver(tmp_path, clock, sink, group_max_ready=4)
    sched = d.engine.scheduler
    rs = d.send([message("t.spill", clock.now + 10, f"m{i}") for i in range(12)])
    d.catch_up()
    target = rs[5]
    assert sched.claim_cancels([target.sequence]) == [Scheduler.CLAIMED]
    d.advance(100, passes=4)  # fired past the lane's bound: spilled, then read back
    got = [s.message_id for s in sink.take()]
    assert sorted(got) == sorted(r.message_id for r in rs if r is not target)
    assert sched.stats()["cancel_skipped"] == 0  # set aside by the pass, not by the dispatcher
    d.engine.ack([f"{r.sequence}.1" for r in rs if r is not target])
    d.advance(2 * MINUTE, passes=2)
    assert d.engine.stats()["pending"] == 1
    bucket = bucket_of(target.deliver_at_ms)
    assert not sched.is_done(bucket)  # the bucket holds the entry set aside
    sched.release_cancels([target.sequence])
    d.advance(1)
    assert [s.message_id for s in sink.take()] == [target.message_id]
    d.engine.ack([f"{target.sequence}.1"])
    d.advance(2 * MINUTE, passes=2)
    assert d.engine.stats()["pending"] == 0
    assert sched.is_done(bucket)
    d.close()


def test_a_claim_made_while_the_lock_is_held_waits_for_the_scheduler_thread(tmp_path):
    """The lock is busy (the scheduler thread in a short hold): the claim stays on the queue,
    its worker waits on a future, and whoever next applies the queue under the lock (here
    the scheduler thread) answers it, in order."""
    engine = Engine(config(tmp_path / "data"))
    engine.start()
    sched = engine.scheduler
    try:
        answers: dict[str, list[int]] = {}
        with sched.lock:
            claimer = threading.Thread(target=lambda: answers.__setitem__("claim", sched.claim_cancels([42, 42])))
            claimer.start()
            assert wait_until(lambda: sched.queued() > 0, timeout=5)
            assert "claim" not in answers
        claimer.join(5)
        assert answers["claim"] == [Scheduler.CLAIMED, Scheduler.CLAIM_CANCELLING]
        assert sched.cancel_claimed(42)
    finally:
        engine.close()


def test_cancels_and_reschedules_claim_on_the_event_loop_when_nothing_would_wait(tmp_path):
    """Engine._claims: receipts of copied messages in an indexed bucket are claimed on the
    calling thread (the event loop), one target through the one-record forms, a batch
    through the arrays; by id, a receipt the index does not confirm, or the scheduler's lock
    busy go to a worker thread from the start (nothing claimed on the loop then), with the
    same answers."""
    import asyncio

    from qdelay.server.engine import CancelOutcome, RescheduleOutcome

    engine = Engine(config(tmp_path / "data"))
    engine.start()
    sched = engine.scheduler
    off_loop: list[int] = []
    off = engine._off_loop_claims

    async def counted(claim, *args):
        off_loop.append(len(args))
        return await off(claim, *args)

    engine._off_loop_claims = counted  # type: ignore[method-assign]
    try:
        due = int(time.time() * 1000) + 3_600_000  # beyond the loading horizon: written behind
        rs = engine.send_sync([message("t.now", due + k, f"n{k}") for k in range(12)])
        engine.iterate.wait_for(engine.wal.committed_sequence, 10)
        engine.iterate.flush_bucket(bucket_of(due))
        target = [(r.message_id, r.deliver_at_ms, r.sequence) for r in rs]

        def run(call):
            return asyncio.run(call)

        def settled(call):
            # nothing would wait: the previous call's tombstones (declared far, so the iterate
            # service may hold them behind) copied and written out, as on an idle server;
            # without this a loaded machine let the iterate copy them before the next call
            engine.iterate.wait_for(engine.wal.committed_sequence, 10)
            for bucket in {bucket_of(due), bucket_of(due + 120_000)}:
                engine.iterate.flush_bucket(bucket)
            return run(call)

        # one target, then a batch (a repeat inside it, one already cancelled): on the loop
        assert settled(engine.cancel_many(target[:1])) == [CancelOutcome.CANCELLED]
        assert settled(engine.cancel_many(target[:4] + target[1:2])) == [
            CancelOutcome.ALREADY_CANCELLED,
            CancelOutcome.CANCELLED,
            CancelOutcome.CANCELLED,
            CancelOutcome.CANCELLED,
            CancelOutcome.ALREADY_CANCELLED,
        ]
        assert settled(engine.cancel_many(target[:1])) == [CancelOutcome.ALREADY_CANCELLED]
        moved, receipt = settled(engine.reschedule(*target[4], due + 120_000))
        assert moved == RescheduleOutcome.RESCHEDULED and receipt is not None
        assert off_loop == []
        assert not any(sched.cancel_claimed(seq) for _m, _d, seq in target[5:])  # nothing else claimed

        # by id; an id that does not match its receipt: the worker thread, same answers
        assert run(engine.cancel_many([(rs[5].message_id, None, None)])) == [CancelOutcome.CANCELLED]
        assert run(engine.cancel_many([("other", rs[6].deliver_at_ms, rs[6].sequence)])) == [CancelOutcome.NOT_FOUND]
        assert len(off_loop) == 2
        assert not sched.cancel_claimed(rs[6].sequence)

        # the lock busy (another thread in a hold): declined on the loop without claiming (a
        # try, never a wait); the worker's claim waits for the lock and answers after it
        held, leave = threading.Event(), threading.Event()

        def hold() -> None:
            with sched.lock:
                held.set()
                leave.wait(10)

        holder = threading.Thread(target=hold)
        holder.start()
        answers: dict[str, object] = {}
        try:
            assert held.wait(5)
            assert sched.claim_cancels_now([rs[7].sequence]) is None
            calls = {
                "one": lambda: engine.cancel_many(target[7:8]),
                "batch": lambda: engine.cancel_many(target[8:10]),
                "move": lambda: engine.reschedule(*target[10], due + 180_000),
            }
            workers = [
                threading.Thread(target=lambda k=k, c=c: answers.__setitem__(k, run(c()))) for k, c in calls.items()
            ]
            for w in workers:
                w.start()
            assert wait_until(lambda: len(off_loop) == 5, timeout=5)  # all three went to workers
            assert not answers
        finally:
            leave.set()
            holder.join(5)
        for w in workers:
            w.join(10)
        assert answers["one"] == [CancelOutcome.CANCELLED]
        assert answers["batch"] == [CancelOutcome.CANCELLED] * 2
        assert answers["move"][0] == RescheduleOutcome.RESCHEDULED  # type: ignore[index]
        # every answer holds: each cancelled or moved message is known as cancelled
        engine.iterate.wait_for(engine.wal.committed_sequence, 10)
        for k, (mid, d, seq) in enumerate(target):
            assert engine.get_sync(mid, d, seq).state.name == ("PENDING" if k in (6, 11) else "CANCELLED"), k
    finally:
        engine.close()


def test_tombstones_of_far_messages_may_wait_for_the_iterate_service_the_claim_answers_meanwhile(tmp_path):
    """A Cancel of messages all due beyond the loading horizon declares its tombstones far
    (the iterate service may let them gather, as far-future sends): until they pass it the
    claim alone answers for them. Here the service does not run at all (a driven engine):
    after CANCELLED, Get says CANCELLED, a second Cancel ALREADY_CANCELLED, a Reschedule
    CANCELLED, and the clock moved past the due time with the tombstone still uncopied
    delivers the rest of its minute but not it. A Cancel of a message due soon is not
    declared far."""
    import asyncio

    from qdelay.server.engine import CancelOutcome, MessageState, RescheduleOutcome

    clock = FakeClock()
    sink = CollectingSink()
    d = Driver(tmp_path / "data", clock=clock, sink=sink)
    engine = d.engine
    try:
        due = clock() + 60 * MINUTE
        target, kept = d.send([message("t.far", due, "target"), message("t.far", due + 1, "kept")])
        (near,) = d.send([message("t.far", clock() + 20_000, "near")])
        d.catch_up()
        it = engine.iterate
        assert asyncio.run(engine.cancel(near.message_id, near.deliver_at_ms, near.sequence)) == (
            CancelOutcome.CANCELLED
        )
        assert it.sequence < engine.wal.committed_sequence and not it._only_far()  # due soon: not far
        d.catch_up()
        assert asyncio.run(engine.cancel(target.message_id, target.deliver_at_ms, target.sequence)) == (
            CancelOutcome.CANCELLED
        )
        tomb = engine.wal.committed_sequence
        assert it.sequence < tomb and it._only_far()  # committed, declared far, not copied
        assert engine.get_sync(target.message_id, target.deliver_at_ms, target.sequence).state == (
            MessageState.CANCELLED
        )
        again = asyncio.run(engine.cancel_many([(target.message_id, target.deliver_at_ms, target.sequence)]))
        assert again == [CancelOutcome.ALREADY_CANCELLED]
        moved = asyncio.run(engine.reschedule(target.message_id, target.deliver_at_ms, target.sequence, due + MINUTE))
        assert moved == (RescheduleOutcome.CANCELLED, None)
        assert it.sequence < tomb and engine.scheduler.cancel_claimed(target.sequence)

        # the due time passes before the tombstone is copied: the loader reads the minute
        # from its segment (the message there, its tombstone not), the claim keeps it back
        for step in range(1, 4):
            clock.set(due + step * 1000)
            engine.scheduler.run_once(clock())
        assert wait_until(lambda: "kept" in sink.ids(), timeout=10)
        assert "target" not in sink.ids() and it.sequence < tomb
        d.catch_up()  # now it passes: the claim is settled, the bucket knows the tombstone
        assert not engine.scheduler.cancel_claimed(target.sequence)
        d.advance(1000, passes=2)
        assert "target" not in sink.ids()
        assert d.get(target).state == MessageState.CANCELLED
    finally:
        d.close()


def test_a_few_receipts_claimed_on_the_loop_answer_as_the_batch_form(tmp_path):
    """Engine._claim_few (a gathered cancel() batch claimed on the event loop, lists instead
    of arrays) answers every kind of target as the batch form (_claim_cancels off the loop)
    does, claims the same ones, and leaves to the batch form what it does not handle (a
    repeat, a receipt its minute's index does not confirm) before claiming anything."""
    from qdelay.server.engine import CancelOutcome

    engine, sink = _started(tmp_path)
    sched = engine.scheduler
    try:
        now = int(time.time() * 1000)
        far = now + 3_600_000  # two unloaded minutes: the index flags give the tombstones
        soon = now + 90_000  # a loaded minute: the scheduler's set gives them
        rs = engine.send_sync(
            [message("t.few", far + k, f"far{k}") for k in range(4)]
            + [message("t.few", far + 60_000 + k, f"next{k}") for k in range(3)]
            + [message("t.few", soon + k, f"soon{k}") for k in range(3)]
            + [message("t.few", now + 200 + k, f"now{k}") for k in range(2)]
        )
        t = [(r.message_id, r.deliver_at_ms, r.sequence) for r in rs]
        # delivered and acknowledged (DISPATCH records in its minute); handed out and unacked
        assert wait_until(lambda: {"now0", "now1"} <= set(sink.ids()), timeout=10)
        engine.ack([f"{rs[10].sequence}.1"])

        def cancel(targets):
            import asyncio

            return asyncio.run(engine.cancel_many(targets))

        # cancelled with their tombstones written: one far, one soon
        assert cancel([t[1], t[8]]) == [CancelOutcome.CANCELLED] * 2
        engine.iterate.wait_for(engine.wal.committed_sequence, 10)
        assert wait_until(lambda: not sched.cancel_claimed(rs[1].sequence) and not sched.cancel_claimed(rs[8].sequence))
        # claimed by another Cancel, its tombstone not written yet
        assert sched.claim_cancels([rs[2].sequence]) == [Scheduler.CLAIMED]
        for bucket in {bucket_of(d) for _m, d, _s in t}:
            engine.iterate.flush_bucket(bucket)
        assert engine.scheduler.known_tombstones(bucket_of(soon)) is not None  # loaded
        assert engine.scheduler.known_tombstones(bucket_of(far)) is None  # not loaded

        looks: list[str] = []  # which closed-state look _claim_few took
        closed_states, closed_few = engine._closed_states, engine._closed_few
        engine._closed_states = lambda *a, **k: looks.append("arrays") or closed_states(*a, **k)  # type: ignore[method-assign]
        engine._closed_few = lambda *a: looks.append("lists") or closed_few(*a)  # type: ignore[method-assign]

        def both(targets):
            """(outcomes, claimed) of _claim_few, then of the batch form, each claim given back."""
            answers = []
            for claim in (engine._claim_few, engine._claim_cancels):
                looks.clear()
                while True:
                    try:
                        got = claim(targets)
                        break
                    except Exception as err:  # noqa: BLE001 - _NotNow: the lock was busy, try again
                        assert type(err).__name__ == "_NotNow"
                answers.append(got)
                if claim == engine._claim_few:
                    answers.append(list(looks))
                if got is not None:
                    sched.release_cancels([seq for _m, _d, seq in got[1]])
            return answers

        batch = [t[0], t[1], t[2], t[3], t[4], t[6], t[7], t[8], t[9], t[10], t[11]]
        few, took, arrays = both(batch)
        assert took == ["lists", "arrays"]  # the DISPATCH records are read by _closed_states
        assert few == arrays
        assert few[0] == [
            CancelOutcome.CANCELLED,
            CancelOutcome.ALREADY_CANCELLED,
            CancelOutcome.ALREADY_CANCELLED,
            CancelOutcome.CANCELLED,
            CancelOutcome.CANCELLED,
            CancelOutcome.CANCELLED,
            CancelOutcome.CANCELLED,
            CancelOutcome.ALREADY_CANCELLED,
            CancelOutcome.CANCELLED,
            CancelOutcome.ALREADY_DELIVERED,
            CancelOutcome.ALREADY_DELIVERED,
        ]
        assert [seq for _m, _d, seq in few[1]] == [rs[k].sequence for k in (0, 3, 4, 6, 7, 9)]
        # without the minute's DISPATCH records: the lists alone
        few, took, arrays = both([t[0], t[1], t[5], t[8], t[9]])
        assert took == ["lists"]
        assert few == arrays
        assert few[0] == [CancelOutcome.CANCELLED, CancelOutcome.ALREADY_CANCELLED] + [CancelOutcome.CANCELLED] + [
            CancelOutcome.ALREADY_CANCELLED,
            CancelOutcome.CANCELLED,
        ]
        # left to the batch form: a repeat, an id that does not match its receipt
        assert both([t[0], t[3], t[0]])[0] is None
        assert both([t[0], ("other", t[3][1], t[3][2])])[0] is None
        assert not any(sched.cancel_claimed(seq) for k, (_m, _d, seq) in enumerate(t) if k != 2)
    finally:
        engine.close()


def test_a_retry_answered_already_cancelled_after_the_slave_wait_asks_the_write_guard_again(tmp_path):
    """The write guard (cluster mode: the etcd lease) is asked before a write and again right
    before its answer. A retried cancel or reschedule that writes nothing but waits for a
    slave (sync mode, Engine._nothing_claimed) answered without that second ask: a master
    whose lease ran out during the wait still said "cancelled"."""
    clock = FakeClock(T0)
    engine = Engine(config(tmp_path / "data"), clock=clock)
    engine.start()
    lease = {"ok": True}

    async def wait(offset: int) -> None:
        lease["ok"] = False  # the lease runs out while the slave is awaited

    def guard() -> None:
        if not lease["ok"]:
            raise LeaseLost("no lease")

    try:
        (r,) = engine.send_sync([message("t.g", T0 + 5 * MINUTE, "m1")])
        target = (r.message_id, r.deliver_at_ms, r.sequence)
        assert [o.name for o in asyncio.run(engine.cancel_many([target]))] == ["CANCELLED"]
        engine.iterate.wait_for(engine.wal.committed_sequence, 10)
        engine.replication_wait, engine.write_guard = wait, guard
        with pytest.raises(LeaseLost):
            asyncio.run(engine.cancel_many([target]))  # ALREADY_CANCELLED, after the wait
        lease["ok"] = True
        with pytest.raises(LeaseLost):
            asyncio.run(engine.reschedule(r.message_id, r.deliver_at_ms, r.sequence, T0 + 9 * MINUTE))
    finally:
        engine.replication_wait = engine.write_guard = None
        engine.close()


def test_a_damaged_record_in_a_reschedule_batch_answers_not_found_and_the_rest_move(tmp_path):
    """A pending message whose record rotted after it was indexed is never delivered (the
    loader skips it) and Get answers NOT_FOUND; a reschedule claimed it by its index entry,
    then failed the whole batch with 'vanished ...; retry' when reading it, so one bad record
    refused every retry of a batch. It answers NOT_FOUND (its claim given back) and the
    others move."""
    clock = FakeClock(T0)
    engine = Engine(config(tmp_path / "data"), clock=clock)
    engine.start()
    due = T0 + 90 * MINUTE
    try:
        receipts = engine.send_sync([message("t.r", due + k, f"r{k}") for k in range(3)])
        engine.iterate.wait_for(engine.wal.committed_sequence, 10)
        engine.iterate.flush_bucket(bucket_of(due))
        seg = engine.schedule.get(bucket_of(due))
        bad = receipts[1]
        flip_byte(seg.path, engine.finder.find(seg, bad.sequence).offset + HEADER_SIZE + 2)
        assert engine.get_sync(bad.message_id, bad.deliver_at_ms, bad.sequence).state == MessageState.NOT_FOUND
        moves = [(r.message_id, r.deliver_at_ms, r.sequence, due + 10 * MINUTE) for r in receipts]
        got = asyncio.run(engine.reschedule_many(moves))
        assert [o for o, _r in got] == [
            RescheduleOutcome.RESCHEDULED,
            RescheduleOutcome.NOT_FOUND,
            RescheduleOutcome.RESCHEDULED,
        ]
        assert not engine.scheduler.cancel_claimed(bad.sequence)
        moved = [r for _o, r in got if r is not None]
        assert [r.message_id for r in moved] == ["r0", "r2"] and moved[1].sequence == moved[0].sequence + 1
    finally:
        engine.close()
