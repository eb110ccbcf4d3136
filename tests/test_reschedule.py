"""Reschedule against a real server (issue 13, item 5): a pending message moves to a new
due time with its id, is never delivered at the old time once answered, is delivered at
the new one; the other outcomes; the refusals; a restart in between."""

from __future__ import annotations

import time

import pytest

from qdelay import errors
from qdelay.v1 import qdelay_pb2 as pb
from tests.serverproc import ServerProc

HOUR = 3_600_000
YEAR = 365 * 24 * HOUR


def test_a_far_message_moved_near_is_delivered_once_at_the_new_time(tmp_path):
    with ServerProc(tmp_path / "data") as srv:
        c = srv.client()
        old = c.send("t.r", b"pay", delay_ms=HOUR, message_id="order-1", headers={"k": "v"})
        soon = int(time.time() * 1000) + 1500
        outcome, new = c.reschedule("order-1", deliver_at_ms=soon)  # by id
        assert outcome == "RESCHEDULED" and new.message_id == "order-1" and new.deliver_at_ms == soon
        assert new.sequence > old.sequence
        assert c.get(old).state == "CANCELLED" and c.get(new).state == "PENDING"
        assert c.get(message_id="order-1").deliver_at_ms == soon  # the id names the new one
        with c.subscribe("t.r") as consumer:
            got = consumer.receive(1, timeout=10)
            consumer.ack(got)
            assert consumer.receive(1, timeout=1.0) == []
        d = got[0]
        assert (d.message_id, d.payload, dict(d.headers), d.deliver_at_ms) == ("order-1", b"pay", {"k": "v"}, soon)
        assert d.dispatched_at_ms >= soon  # never early
        assert c.reschedule(new, delay_ms=HOUR) == ("ALREADY_DELIVERED", None)
        c.close()


def test_a_near_message_moved_far_is_not_delivered_at_the_old_time_and_survives_a_restart(tmp_path):
    with ServerProc(tmp_path / "data") as srv:
        c = srv.client()
        r = c.send("t.r2", b"p", delay_ms=1000, message_id="near")
        outcome, new = c.reschedule(r, delay_ms=HOUR)  # by receipt
        assert outcome == "RESCHEDULED"
        with c.subscribe("t.r2") as consumer:
            assert consumer.receive(1, timeout=2.5) == []  # the old time passed with nothing
        c.close()
        srv.kill9()
        srv.start()
        c = srv.client()
        assert c.get(new).state == "PENDING" and c.get(r).state == "CANCELLED"
        assert c.reschedule(r, delay_ms=HOUR) == ("CANCELLED", None)
        assert c.reschedule("nobody", delay_ms=HOUR) == ("NOT_FOUND", None)
        assert c.cancel(message_id="near") == "CANCELLED"
        assert c.reschedule(new, delay_ms=5) == ("CANCELLED", None)
        c.close()


def test_refusals_name_the_field_and_write_nothing(tmp_path):
    with ServerProc(tmp_path / "data") as srv:
        c = srv.client()
        r = c.send("t.r3", b"p", delay_ms=HOUR, message_id="m")
        with pytest.raises(errors.InvalidArgument, match=r"RescheduleRequest.delay_ms: .* beyond the limit of 2 years"):
            c.reschedule(r, delay_ms=3 * YEAR)
        with pytest.raises(errors.InvalidArgument, match=r"receipt or message_id: required"):
            c._call(c.stub.Reschedule, pb.RescheduleRequest(delay_ms=5), 10)
        with pytest.raises(errors.InvalidArgument, match=r"set exactly one of deliver_at_ms or delay_ms"):
            c._call(c.stub.Reschedule, pb.RescheduleRequest(message_id="m"), 10)
        with pytest.raises(errors.InvalidArgument, match=r"give the new time"):
            c.reschedule(r)
        st = c.get(r)
        assert (st.state, st.deliver_at_ms) == ("PENDING", r.deliver_at_ms)
        c.close()
