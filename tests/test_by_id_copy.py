"""A by-id call right after a Reschedule by id, while the iterate service is copying the
move (issue 13's guarantees; the rare failure of tests/test_message_ops_model.py's
``reschedule_then_by_id``): the id index already maps the id to the moved message, whose
record is not yet in its minute's schedule segment. The Cancel, CancelBatch or Reschedule
must wait for that copy and act on the moved message; they answered NOT_FOUND for a pending
message (the user believes there is nothing to cancel; the message is delivered later).

The window is a few microseconds of one iterate step (its ids put into the index, then its
records written and the step published): a real server run through tests/gated_server.py
holds its iterate service there, at the step that copies the move, until a reader waits
for that step.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from conftest import wait_until

from tests.serverproc import ServerProc

HOUR = 3_600_000
GATED = [sys.executable, str(Path(__file__).with_name("gated_server.py"))]


@pytest.mark.parametrize("then", ["cancel_many", "cancel", "reschedule", "reschedule_many", "get", "send"])
def test_a_by_id_call_during_the_copy_of_a_move_acts_on_the_moved_message(tmp_path, then):
    due = (time.time_ns() // 1_000_000 // 60_000 + 5 * 60) * 60_000 + 123  # a minute of its own
    mark = tmp_path / "gate.paused"
    env = {"QDELAY_TEST_GATE_DUE_MS": str(due), "QDELAY_TEST_GATE_MARK": str(mark)}
    with ServerProc(tmp_path / "data", command=GATED, env=env) as srv:
        c = srv.client()
        c.send("t.later", b"p", delay_ms=2 * HOUR, message_id="k")
        assert c.get(message_id="k").state == "PENDING"  # copied and indexed
        outcome, moved = c.reschedule("k", deliver_at_ms=due)
        assert outcome == "RESCHEDULED" and moved is not None and moved.deliver_at_ms == due
        # the step copying the move has put k -> the moved message into the id index and
        # stops there: nothing of its minute is on disk yet
        wait_until(mark.exists, timeout=30, what="the iterate step of the move to pause")
        if then == "cancel_many":
            assert c.cancel_many(["k"]) == ["CANCELLED"]
            want = ("CANCELLED", due)
        elif then == "cancel":
            assert c.cancel(message_id="k") == "CANCELLED"
            want = ("CANCELLED", due)
        elif then in ("reschedule", "reschedule_many"):
            if then == "reschedule":
                again, r = c.reschedule("k", delay_ms=7 * HOUR)
            else:
                [(again, r)] = c.reschedule_many(["k"], delay_ms=7 * HOUR)
            assert again == "RESCHEDULED" and r is not None and r.sequence > moved.sequence
            want = ("PENDING", r.deliver_at_ms)
        elif then == "get":  # (the controls: Get waited for the copy before as well, a
            got = c.get(message_id="k")  # re-send's dedupe found the move in Engine._moved)
            assert (got.state, got.deliver_at_ms) == ("PENDING", due)
            want = ("PENDING", due)
        else:
            r = c.send("t.later", b"p", delay_ms=3 * HOUR, message_id="k")
            assert r.duplicate and (r.deliver_at_ms, r.sequence) == (due, moved.sequence)
            want = ("PENDING", due)
        got = c.get(message_id="k")
        assert (got.state, got.deliver_at_ms) == want
        # by receipt: the moved message (moved again: its record closed, as a move's old one)
        assert c.get(moved).state == ("CANCELLED" if then.startswith("reschedule") else want[0])
        c.close()
