"""A Cancel (or Reschedule, or CancelBatch target) of a message another Cancel has claimed
answers only once that claim's outcome is known (issue 13 item 6: CANCELLED, and so
ALREADY_CANCELLED, means never delivered after the answer). It used to answer
ALREADY_CANCELLED at once; when the first Cancel's tombstone write then failed (here a
real ENOSPC from the message log's write, which the log undoes and answers DiskFull), its
claim was given back and the message was delivered anyway."""

from __future__ import annotations

import asyncio
import errno
import os
import threading
import time

import pytest

from qdelay.errors import DiskFull, Fenced, Unavailable
from qdelay.segments import segment
from qdelay.server.engine import CancelOutcome, Engine, MessageState, RescheduleOutcome
from tests.conftest import wait_until
from tests.simclock import T0, CollectingSink, Driver, FakeClock, message, started_engine


class HeldWrite:
    """The message log's writer thread, at its next ``fail`` writes: stops in the write
    until ``go`` is set, then fails it with ENOSPC (the log cuts it back and answers its
    appenders DiskFull). Other threads' writes (the iterate service's) pass."""

    def __init__(self, monkeypatch, fail: int) -> None:
        self.fail = fail
        self.entered = threading.Event()
        self.go = threading.Event()
        real = os.pwrite

        def pwrite(fd, data, offset):
            if self.fail and threading.current_thread().name == "qdelay-wal-writer":
                self.fail -= 1
                self.entered.set()
                assert self.go.wait(10)
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(fd, data, offset)

        monkeypatch.setattr(segment, "native_write_sync", False)  # the faults go through os.*
        monkeypatch.setattr(segment.os, "pwrite", pwrite)


def _started(tmp_path) -> tuple[Engine, CollectingSink]:
    return started_engine(tmp_path / "data")


def _send(engine: Engine, ahead_ms: int):
    """A target due ``ahead_ms`` from now and a message due just after it (once that one is
    delivered, the target's time has passed)."""
    due = int(time.time() * 1000) + ahead_ms
    target, after = engine.send_sync([message("t.race", due, "target"), message("t.race", due + 50, "after")])
    engine.iterate.wait_for(engine.wal.committed_sequence, 10)
    return target, after


async def _race(engine: Engine, held: HeldWrite, target, second):
    """The first Cancel of ``target`` claims it and stops in its write; ``second`` (a
    coroutine function) starts then and must wait for it. The write fails: (the first's
    error, the second's result or error, whether the second was still waiting when the
    first's write failed)."""
    first = asyncio.ensure_future(engine.cancel(target.message_id, target.deliver_at_ms, target.sequence))
    assert await asyncio.to_thread(held.entered.wait, 10)
    other = asyncio.ensure_future(second())
    # the second found the claim and waits for it (before the fix: answered at once)
    claims = engine.scheduler.claims
    assert await asyncio.to_thread(wait_until, lambda: other.done() or getattr(claims, "watched", False), 10)
    waited = not other.done()
    held.go.set()
    got = await asyncio.gather(first, other, return_exceptions=True)
    return got[0], got[1], waited


def _ops(engine: Engine, target):
    key = (target.message_id, target.deliver_at_ms, target.sequence)
    return {
        "cancel": lambda: engine.cancel(*key),
        "reschedule": lambda: engine.reschedule(*key, target.deliver_at_ms + 3_600_000),
        # the batch form (a repeat leaves the event loop's few-receipt claim): both targets wait
        "batch": lambda: engine.cancel_many([key, key]),
    }


@pytest.mark.parametrize("op", ["cancel", "reschedule", "batch"])
def test_a_second_cancel_waits_for_a_failed_first_and_never_answers_cancelled_for_a_delivered_message(
    tmp_path, monkeypatch, op
):
    """Both writes fail (the disk stays full): the message is delivered, so the second
    call must not have said it was cancelled: it fails as its own write did."""
    engine, sink = _started(tmp_path)
    try:
        target, _after = _send(engine, 1500)
        held = HeldWrite(monkeypatch, fail=2)
        first, second, waited = asyncio.run(_race(engine, held, target, _ops(engine, target)[op]))
        assert isinstance(first, DiskFull)
        assert isinstance(second, DiskFull), second  # claimed again after the release, and refused
        assert waited and held.fail == 0
        assert wait_until(lambda: "target" in sink.ids(), timeout=10)
        assert not engine.scheduler.claims.watched
    finally:
        engine.close()


@pytest.mark.parametrize("op", ["cancel", "reschedule", "batch"])
def test_a_second_cancel_claims_again_when_the_first_fails_and_its_answer_holds(tmp_path, monkeypatch, op):
    """Only the first write fails: the second claims the message as if fresh and writes its
    own tombstone; the message is never delivered at its time."""
    engine, sink = _started(tmp_path)
    try:
        target, after = _send(engine, 1500)
        held = HeldWrite(monkeypatch, fail=1)
        first, second, waited = asyncio.run(_race(engine, held, target, _ops(engine, target)[op]))
        assert isinstance(first, DiskFull) and waited
        if op == "cancel":
            assert second == CancelOutcome.CANCELLED
        elif op == "batch":
            assert second == [CancelOutcome.CANCELLED, CancelOutcome.ALREADY_CANCELLED]
        else:
            assert second[0] == RescheduleOutcome.RESCHEDULED
        assert wait_until(lambda: "after" in sink.ids(), timeout=10)
        assert "target" not in sink.ids()
        assert engine.get_sync(target.message_id, target.deliver_at_ms, target.sequence).state == (
            MessageState.CANCELLED
        )
    finally:
        engine.close()


def test_a_second_cancel_waits_a_bounded_time_then_answers_unavailable(tmp_path, monkeypatch):
    engine, sink = _started(tmp_path)
    engine.claim_wait_s = 0.3
    try:
        target, _after = _send(engine, 60_000)
        held = HeldWrite(monkeypatch, fail=1)
        key = (target.message_id, target.deliver_at_ms, target.sequence)

        async def main():
            first = asyncio.ensure_future(engine.cancel(*key))
            assert await asyncio.to_thread(held.entered.wait, 10)
            started = time.monotonic()
            with pytest.raises(Unavailable):
                await engine.cancel(*key)
            waited = time.monotonic() - started
            held.go.set()
            with pytest.raises(DiskFull):
                await first
            return waited

        assert 0.25 <= asyncio.run(main()) < 5
        assert wait_until(lambda: not engine.scheduler.claims.watched, timeout=10)  # its watch forgotten
        # the claim was given back: the message is pending, and a Cancel takes it now
        assert asyncio.run(engine.cancel(*key)) == CancelOutcome.CANCELLED
    finally:
        engine.close()


def test_an_ordinary_double_cancel_still_answers_already_cancelled_promptly(tmp_path):
    """One after the other (the first's tombstone durable, its claim maybe not settled yet),
    and two at once: ALREADY_CANCELLED, with no wait beyond the first's write."""
    engine, _sink = _started(tmp_path)
    try:
        target, after = _send(engine, 3_600_000)  # far: its tombstone may wait for the iterate service
        key = (target.message_id, target.deliver_at_ms, target.sequence)
        key2 = (after.message_id, after.deliver_at_ms, after.sequence)

        async def main():
            assert await engine.cancel(*key) == CancelOutcome.CANCELLED
            # no wait for a claim: with none allowed, one would be Unavailable at once (a
            # clock bound, took < 1 s, could fail on a loaded machine, or pass a short wait)
            engine.claim_wait_s = 0.0
            again = await engine.cancel(*key)
            moved = await engine.reschedule(*key, target.deliver_at_ms + 60_000)
            engine.claim_wait_s = wait
            both = await asyncio.gather(engine.cancel(*key2), engine.cancel(*key2))
            return again, moved, both

        wait = engine.claim_wait_s
        again, moved, both = asyncio.run(main())
        assert again == CancelOutcome.ALREADY_CANCELLED
        assert moved == (RescheduleOutcome.CANCELLED, None)
        assert sorted(both) == [CancelOutcome.CANCELLED, CancelOutcome.ALREADY_CANCELLED]
    finally:
        engine.close()


def test_a_get_during_a_cancel_s_write_does_not_say_cancelled_before_the_tombstone_is_durable(tmp_path, monkeypatch):
    """Get of a message a Cancel has claimed, while that Cancel's tombstone is being written,
    answered CANCELLED (the claim alone); the write then failed, the claim was given back
    and the message was delivered after that answer. Until the tombstone is durable the
    message is pending; once it is (the Cancel answered), Get says CANCELLED."""
    engine, sink = _started(tmp_path)
    try:
        target, _after = _send(engine, 1500)
        key = (target.message_id, target.deliver_at_ms, target.sequence)
        held = HeldWrite(monkeypatch, fail=1)

        async def main():
            first = asyncio.ensure_future(engine.cancel(*key))
            assert await asyncio.to_thread(held.entered.wait, 10)
            during = (await engine.get(*key)).state
            during_now = engine.get_now(*key)
            held.go.set()
            with pytest.raises(DiskFull):
                await first
            return during, during_now

        during, during_now = asyncio.run(main())
        assert during == MessageState.PENDING
        assert during_now is None or during_now.state == MessageState.PENDING
        assert wait_until(lambda: "target" in sink.ids(), timeout=10)  # the write failed: delivered

        # a Cancel that succeeds: Get says CANCELLED as soon as it has answered, before the
        # iterate service settles the claim (held here: the tombstone is far from settled
        # only if the iterate service lags, so look right after the answer)
        target2, _after2 = _send(engine, 60_000)
        key2 = (target2.message_id, target2.deliver_at_ms, target2.sequence)

        async def cancel_then_get():
            assert await engine.cancel(*key2) == CancelOutcome.CANCELLED
            return (await engine.get(*key2)).state

        assert asyncio.run(cancel_then_get()) == MessageState.CANCELLED
        # the rule itself, before the iterate service settles a claim: claimed is not enough
        (third,) = engine.send_sync([message("t.race", target2.deliver_at_ms + 60_000, "third")])
        sched = engine.scheduler
        assert sched.claim_cancels([third.sequence]) == [sched.CLAIMED]
        assert not sched.cancel_written(third.sequence)
        sched.claims_written([third.sequence])
        assert sched.cancel_written(third.sequence)
        sched.release_cancels([third.sequence])
        assert not sched.cancel_written(third.sequence)
    finally:
        engine.close()


@pytest.mark.parametrize("op", ["cancel", "reschedule"])
def test_a_second_cancel_that_waited_asks_whether_it_may_still_write(tmp_path, monkeypatch, op):
    """A call waiting for another's claim (up to claim_wait_s) claims and writes again when
    it ends; this server was fenced meanwhile (a newer master exists): the retry must not
    append a tombstone (or a moved message) to a fenced server's log and answer as if it
    held, but refuse as any write would now (Fenced)."""
    engine, _sink = _started(tmp_path)
    try:
        target, _after = _send(engine, 60_000)
        held = HeldWrite(monkeypatch, fail=1)
        key = (target.message_id, target.deliver_at_ms, target.sequence)
        second = _ops(engine, target)[op]

        async def main():
            first = asyncio.ensure_future(engine.cancel(*key))
            assert await asyncio.to_thread(held.entered.wait, 10)
            other = asyncio.ensure_future(second())
            claims = engine.scheduler.claims
            assert await asyncio.to_thread(wait_until, lambda: claims.watched, 10)
            before = engine.wal.committed_sequence
            await asyncio.to_thread(engine.set_role, "fenced", engine.epoch + 1)
            held.go.set()
            got = await asyncio.gather(first, other, return_exceptions=True)
            return got, before

        (first, other), before = asyncio.run(main())
        assert isinstance(first, DiskFull)
        assert isinstance(other, Fenced), other
        assert engine.wal.committed_sequence == before  # nothing written after the fencing
    finally:
        engine.close()


def test_a_get_after_a_cancel_answered_says_cancelled_while_the_tombstone_settles(tmp_path):
    """Get looks at the message (its tombstone not yet past the iterate service: pending by
    the segment), then asks whether a Cancel holds it: the tombstone passed meanwhile and
    settled the claim, so neither look saw the cancel and Get said PENDING after the Cancel
    had answered CANCELLED. A Get that sees a claim settle while it looks, looks again."""
    clock = FakeClock(T0)
    d = Driver(tmp_path, clock, CollectingSink(clock))
    try:
        (r,) = d.send([message("s", T0 + 3_600_000, "m")])
        d.catch_up()
        key = (r.message_id, r.deliver_at_ms, r.sequence)
        assert asyncio.run(d.engine.cancel(*key)) == CancelOutcome.CANCELLED
        eng = d.engine
        real = eng._locate
        calls = []

        def locate(*args, **kwargs):
            out = real(*args, **kwargs)
            if not calls:
                d.catch_up()  # the tombstone passes the iterate service right after the look
            calls.append(out[0])
            return out

        eng._locate = locate  # type: ignore[method-assign]
        assert eng.get_sync(*key).state == MessageState.CANCELLED
        assert calls == [MessageState.PENDING, MessageState.CANCELLED]
    finally:
        d.close()
