"""RescheduleBatch against a real server, and reschedule() gathered into it by both clients:
one outcome per target, in order; after RESCHEDULED a message is never delivered at its old
time and is delivered once at the new one; a bad target refuses the whole batch, naming
it, and nothing is written."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from qdelay import errors
from qdelay.aio import Client as AioClient
from qdelay.client import Batching, Client, Outgoing
from qdelay.client.batching import RescheduleBatcher
from qdelay.v1 import qdelay_pb2 as pb
from tests.serverproc import ServerProc

HOUR = 3_600_000
YEAR = 365 * 24 * HOUR


def _now() -> int:
    return int(time.time() * 1000)


def test_one_outcome_per_target_in_order(tmp_path):
    with ServerProc(tmp_path / "data") as srv:
        c = srv.client()
        a = c.send("t.rb", b"a", delay_ms=HOUR, message_id="a", headers={"k": "v"})
        c.send("t.rb", b"b", delay_ms=HOUR, message_id="b")
        gone = c.send("t.rb", b"g", delay_ms=HOUR, message_id="gone")
        done = c.send("t.rb.done", b"d", delay_ms=0, message_id="done")
        assert c.cancel(gone) == "CANCELLED"
        with c.subscribe("t.rb.done") as consumer:
            consumer.ack(consumer.receive(1, timeout=10))
        at = _now() + 2 * HOUR
        req = pb.RescheduleBatchRequest(
            requests=[
                pb.RescheduleRequest(receipt=a.to_pb(), deliver_at_ms=at),
                pb.RescheduleRequest(message_id="b", delay_ms=3 * HOUR),
                pb.RescheduleRequest(message_id="nobody", deliver_at_ms=at),
                pb.RescheduleRequest(receipt=gone.to_pb(), deliver_at_ms=at),
                pb.RescheduleRequest(receipt=done.to_pb(), deliver_at_ms=at),
                pb.RescheduleRequest(receipt=a.to_pb(), deliver_at_ms=at + 1),  # a repeat: moved once
            ]
        )
        resp = c._call(c.stub.RescheduleBatch, req, 10)
        outcomes = [pb.RescheduleResponse.Outcome.Name(r.outcome) for r in resp.responses]
        assert outcomes == ["RESCHEDULED", "RESCHEDULED", "NOT_FOUND", "CANCELLED", "ALREADY_DELIVERED", "CANCELLED"]
        new_a, new_b = resp.responses[0].receipt, resp.responses[1].receipt
        assert (new_a.message_id, new_a.deliver_at_ms) == ("a", at)
        assert new_b.message_id == "b" and new_b.deliver_at_ms >= at + HOUR - 60_000
        assert new_b.sequence == new_a.sequence + 1  # one append: the new messages, then the tombstones
        assert all(not r.HasField("receipt") for r in resp.responses[2:])
        assert c.get(a).state == "CANCELLED"
        st = c.get(message_id="a")
        assert (st.state, st.deliver_at_ms, st.payload, st.headers) == (
            "PENDING",
            at,
            b"a",
            {"k": "v"},
        )
        assert c.get(message_id="b").deliver_at_ms == new_b.deliver_at_ms
        # the client's batch form: one time for every target
        got = c.reschedule_many(["a", "b", "nobody"], delay_ms=HOUR)
        assert [o for o, _r in got] == ["RESCHEDULED", "RESCHEDULED", "NOT_FOUND"]
        assert got[1][1].sequence == got[0][1].sequence + 1 and got[2][1] is None
        # the first batch again, as a retry whose first answer was lost: a target named by
        # receipt answers CANCELLED, one named by id is moved again (docs/api.md)
        again = c._call(c.stub.RescheduleBatch, req, 10).responses
        assert [pb.RescheduleResponse.Outcome.Name(r.outcome) for r in again[:2]] == ["CANCELLED", "RESCHEDULED"]
        c.close()


def test_moved_messages_are_never_delivered_at_the_old_time_and_once_at_the_new(tmp_path):
    with ServerProc(tmp_path / "data") as srv:
        c = srv.client()
        far = [c.send("t.rb2", b"f", delay_ms=HOUR, message_id=f"far{i}") for i in range(5)]
        # due 2 s after one call, moved by the next (ten sends one by one before the move
        # let a slow disk deliver them first); their old time passes while the test listens
        near = c.send_batch([c.message("t.rb2", b"n", delay_ms=2000, message_id=f"near{i}") for i in range(5)])
        soon = _now() + 2500
        moved_away = c.reschedule_many(near, delay_ms=HOUR)
        moved_near = c.reschedule_many(far, deliver_at_ms=soon)
        assert {o for o, _r in moved_away + moved_near} == {"RESCHEDULED"}
        with c.subscribe("t.rb2") as consumer:
            got: list = []
            deadline = time.monotonic() + 15
            while len(got) < 5 and time.monotonic() < deadline:
                batch = consumer.receive(5, timeout=1.0)
                consumer.ack(batch)
                got += batch
            assert consumer.receive(5, timeout=1.5) == []  # no second delivery, none of the near ones
        assert sorted(d.message_id for d in got) == [f"far{i}" for i in range(5)]
        assert all(d.deliver_at_ms == soon and d.dispatched_at_ms >= soon for d in got)  # never early
        c.close()
        srv.kill9()  # the moves are durable
        srv.start()
        c = srv.client()
        assert {c.get(r).state for r in near} == {"CANCELLED"}
        assert {c.get(r).state for _o, r in moved_away} == {"PENDING"}
        assert {c.get(r).state for _o, r in moved_near} == {"DELIVERED"}
        c.close()


def test_refusals_name_the_target_and_write_nothing(tmp_path):
    with ServerProc(tmp_path / "data", args=["--set", "limits.max_batch=5"]) as srv:
        c = srv.client()
        r = c.send("t.rb3", b"p", delay_ms=HOUR, message_id="m")

        def call(*requests: pb.RescheduleRequest) -> pb.RescheduleBatchResponse:
            return c._call(c.stub.RescheduleBatch, pb.RescheduleBatchRequest(requests=requests), 10)

        ok = pb.RescheduleRequest(receipt=r.to_pb(), delay_ms=5)
        with pytest.raises(errors.InvalidArgument, match=r"^INVALID_ARGUMENT: requests: empty"):
            call()
        with pytest.raises(errors.InvalidArgument, match=r"requests: 6 reschedule requests in one batch, limit 5"):
            call(*[ok] * 6)
        with pytest.raises(errors.InvalidArgument, match=r"requests\[1\]\.delay_ms: .* beyond the limit of 2 years"):
            call(ok, pb.RescheduleRequest(message_id="m", delay_ms=3 * YEAR))
        with pytest.raises(errors.InvalidArgument, match=r"requests\[2\]\.receipt or message_id: required"):
            call(ok, ok, pb.RescheduleRequest(delay_ms=5))
        with pytest.raises(
            errors.InvalidArgument, match=r"requests\[1\]: set exactly one of deliver_at_ms or delay_ms"
        ):
            call(ok, pb.RescheduleRequest(message_id="m"))
        with pytest.raises(errors.InvalidArgument, match=r"give the new time"):
            c.reschedule_many([r])
        st = c.get(r)  # nothing of a refused batch was written
        assert (st.state, st.deliver_at_ms) == ("PENDING", r.deliver_at_ms)
        c.close()


def test_concurrent_reschedules_share_calls_in_both_clients(tmp_path):
    with ServerProc(tmp_path / "data") as srv:
        with Client(srv.address, batching=Batching(linger=0.002)) as c:
            at = _now() + HOUR
            receipts = list(
                c.send_many(Outgoing("t.rb4", b"p", deliver_at_ms=at + i, message_id=f"r{i}") for i in range(200))
            )
            with ThreadPoolExecutor(16) as pool:
                out = list(pool.map(lambda r: c.reschedule(r, delay_ms=2 * HOUR), receipts))
            assert [o for o, _r in out] == ["RESCHEDULED"] * 200
            assert [n.message_id for _o, n in out] == [r.message_id for r in receipts]
            batcher = c._rescheduler
            assert batcher is not None and batcher.carried == 200
            assert batcher.batches < 200 / 3  # gathered: far fewer calls than reschedules
            assert len({n.sequence for _o, n in out}) == 200
            assert {c.get(r).state for r in receipts[::20]} == {"CANCELLED"}
            assert c.reschedule(receipts[0], delay_ms=HOUR) == ("CANCELLED", None)  # a lone one: its own call

        async def aio() -> None:
            async with AioClient(srv.address, batching=Batching(linger=0.002)) as a:
                moved = [r for _o, r in out]
                answers = await asyncio.gather(*(a.reschedule(r, delay_ms=3 * HOUR) for r in moved))
                assert [o for o, _r in answers] == ["RESCHEDULED"] * 200
                assert a._rescheduler is not None and a._rescheduler.batches < 200 / 3
                assert (await a.reschedule(moved[0], delay_ms=HOUR)) == ("CANCELLED", None)
                got = await a.reschedule_many([answers[1][1], "nobody"], delay_ms=HOUR)
                assert [o for o, _r in got] == ["RESCHEDULED", "NOT_FOUND"]

        asyncio.run(aio())
        with Client(srv.address, batching=False) as c:  # batching off: unary Reschedule
            assert c.reschedule("r5", delay_ms=HOUR)[0] == "RESCHEDULED"


class _Unimplemented(errors.QdelayError):
    code = grpc.StatusCode.UNIMPLEMENTED


def test_a_server_without_reschedule_batch_gets_single_calls_from_then_on():
    calls = {"batch": 0, "single": 0}

    async def batch(_request, _timeout):
        calls["batch"] += 1
        raise _Unimplemented("no RescheduleBatch here")

    async def single(request, _timeout):
        calls["single"] += 1
        return pb.RescheduleResponse(outcome=pb.RescheduleResponse.RESCHEDULED, receipt=request.receipt)

    async def main() -> None:
        b = RescheduleBatcher(batch, single, max_batch=100, max_in_flight=1, linger=0.01)
        reqs = [
            pb.RescheduleRequest(receipt=pb.Receipt(message_id=f"m{i}", deliver_at_ms=1, sequence=i + 1), delay_ms=5)
            for i in range(40)
        ]
        for _round in range(2):
            got = await asyncio.gather(*(b.reschedule(r, 5) for r in reqs))
            assert [g.receipt.message_id for g in got] == [f"m{i}" for i in range(40)]
        await b.close()

    asyncio.run(main())
    assert calls["batch"] == 1 and calls["single"] == 80  # tried once, then one by one
