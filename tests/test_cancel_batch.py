"""CancelBatch and the client's cancel_many against a real server (issue 13, item 2)."""

from __future__ import annotations

import time

import pytest

from qdelay import errors
from qdelay.client import Outgoing
from qdelay.v1 import qdelay_pb2 as pb
from tests.serverproc import ServerProc

MINUTE = 60_000


def _one_minute(client, n: int, tag: str) -> list:
    """``n`` messages due in one minute bucket an hour ahead."""
    at = (int(time.time() * 1000) // MINUTE + 60) * MINUTE
    msgs = [Outgoing("t.cancel", b"p", deliver_at_ms=at + i * 37 % MINUTE, message_id=f"{tag}{i}") for i in range(n)]
    return list(client.send_many(msgs, batch_size=5))


def test_cancel_many_answers_each_target_in_order_and_survives_a_restart(tmp_path):
    with ServerProc(tmp_path / "data") as srv:
        c = srv.client()
        rs = _one_minute(c, 60, "a")
        bogus = pb.Receipt(message_id="a0", deliver_at_ms=rs[0].deliver_at_ms, sequence=rs[5].sequence)
        targets = [*rs[:20], rs[3], bogus]
        out = c.cancel_many(targets, batch_size=7)  # several calls; order kept across them
        assert out == ["CANCELLED"] * 20 + ["ALREADY_CANCELLED", "NOT_FOUND"]
        assert c.cancel_many(rs[18:22]) == ["ALREADY_CANCELLED"] * 2 + ["CANCELLED"] * 2
        assert [c.get(r).state for r in rs[:23]] == ["CANCELLED"] * 22 + ["PENDING"]
        c.close()
        srv.stop()
        srv.start()
        c = srv.client()
        assert [c.get(r).state for r in rs[:23]] == ["CANCELLED"] * 22 + ["PENDING"]
        assert c.cancel_many(rs[:2]) == ["ALREADY_CANCELLED"] * 2
        c.close()


def test_cancelled_by_batch_are_never_delivered(tmp_path):
    with ServerProc(tmp_path / "data") as srv:
        c = srv.client()
        due = int(time.time() * 1000) + 1500
        rs = list(c.send_many([Outgoing("t.due", b"p", deliver_at_ms=due, message_id=f"d{i}") for i in range(40)]))
        assert c.cancel_many(rs[::2]) == ["CANCELLED"] * 20
        consumer = c.subscribe("t.due")
        got = consumer.receive(20, timeout=15)
        consumer.ack(got)
        assert sorted(d.message_id for d in got) == sorted(r.message_id for r in rs[1::2])
        assert consumer.receive(1, timeout=1.0) == []  # nothing cancelled comes after
        consumer.close()
        assert c.cancel_many(rs[:2]) == ["ALREADY_CANCELLED", "ALREADY_DELIVERED"]
        c.close()


def test_bad_batches_are_refused_naming_the_field_and_write_nothing(tmp_path):
    with ServerProc(tmp_path / "data", args=["--set", "limits.max_batch=5"]) as srv:
        c = srv.client()
        rs = _one_minute(c, 6, "b")
        with pytest.raises(
            errors.InvalidArgument,
            match=r"requests: 6 cancel requests in one batch, limit 5 requests \(limits.max_batch\)",
        ):
            c.cancel_many(rs, batch_size=6)
        req = pb.CancelBatchRequest(requests=[pb.CancelRequest(receipt=rs[0].to_pb()), pb.CancelRequest()])
        with pytest.raises(errors.InvalidArgument, match=r"requests\[1\]\.receipt"):
            c._call(c.stub.CancelBatch, req, 10)
        with pytest.raises(errors.InvalidArgument, match=r"requests: empty"):
            c._call(c.stub.CancelBatch, pb.CancelBatchRequest(), 10)
        assert [c.get(r).state for r in rs] == ["PENDING"] * 6  # nothing of a refused batch happened
        c.close()


def test_a_cancel_given_up_mid_claim_releases_its_claims(tmp_path):
    """A Cancel or Reschedule whose caller goes away (deadline, dropped call) while its
    targets are being claimed on the worker thread: the claims are released when the
    thread finishes, so the message stays deliverable and cancellable (a claim left
    behind would hide it from the dispatcher with no tombstone ever written)."""
    import asyncio
    import threading

    from qdelay.server.engine import CancelOutcome, Engine, _NotNow
    from tests.simclock import config, message

    engine = Engine(config(tmp_path / "data"))
    engine.start()
    try:
        due = int(time.time() * 1000) + 3_600_000
        receipt = engine.send_sync([message("t.gone", due, "gone-1")])[0]
        target = (receipt.message_id, receipt.deliver_at_ms, receipt.sequence)
        claimed, go_on = threading.Event(), threading.Event()
        claim = engine._claim_cancels

        def slow_claim(targets, now=False):
            if now:  # the claim on the event loop cannot be given up midway: the worker's can
                raise _NotNow
            out = claim(targets)
            claimed.set()
            go_on.wait(5)  # the caller gives up while the thread still holds the claims
            return out

        engine._claim_cancels = slow_claim  # type: ignore[method-assign]

        async def give_up(call) -> None:
            task = asyncio.ensure_future(call)
            await asyncio.to_thread(claimed.wait, 5)
            assert engine.scheduler.cancel_claimed(receipt.sequence)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            go_on.set()

        for call in (lambda: engine.cancel_many([target]), lambda: engine.reschedule(*target, due + 60_000)):
            claimed.clear()
            go_on.clear()
            asyncio.run(give_up(call()))
            deadline = time.time() + 5
            while engine.scheduler.cancel_claimed(receipt.sequence) and time.time() < deadline:
                time.sleep(0.01)
            assert not engine.scheduler.cancel_claimed(receipt.sequence)
        engine._claim_cancels = claim  # type: ignore[method-assign]
        assert asyncio.run(engine.cancel_many([target])) == [CancelOutcome.CANCELLED]
    finally:
        engine.close()
