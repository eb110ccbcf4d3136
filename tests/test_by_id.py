"""Cancel and Get by message id alone, through the on-disk id index (issue 13, item 3),
against a real server: right after a send, after an id is reused, after SIGKILL, and after
the index folder is lost (rebuilt from the schedule log; docs/recovery.md)."""

from __future__ import annotations

import shutil

import pytest
from conftest import wait_until

from qdelay import errors
from qdelay.client import Outgoing
from tests.serverproc import ServerProc

HOUR = 3_600_000


def test_cancel_and_get_by_id_right_after_send(tmp_path):
    with ServerProc(tmp_path / "data") as srv:
        c = srv.client()
        r = c.send("t.id", b"p", delay_ms=HOUR, message_id="order-1")
        st = c.get(message_id="order-1")
        assert (st.state, st.deliver_at_ms) == ("PENDING", r.deliver_at_ms)
        assert c.cancel(message_id="order-1") == "CANCELLED"  # no wait between send and cancel
        assert c.cancel(message_id="order-1") == "ALREADY_CANCELLED"
        assert c.get(message_id="order-1").state == "CANCELLED"
        assert c.get(message_id="nobody").state == "NOT_FOUND"
        assert c.cancel(message_id="nobody") == "NOT_FOUND"
        c.send_many([Outgoing("t.id", b"p", delay_ms=HOUR, message_id=f"o{i}") for i in range(5)])
        mixed = ["o0", r, "o1", "nobody", "o0"]
        assert c.cancel_many(mixed) == ["CANCELLED", "ALREADY_CANCELLED", "CANCELLED", "NOT_FOUND", "ALREADY_CANCELLED"]
        c.close()


def test_reschedule_by_message_id_keyword(tmp_path):
    """``reschedule(message_id=...)`` as ``cancel`` and ``get`` take it (the id as a target
    worked; the keyword did not exist, a TypeError)."""
    with ServerProc(tmp_path / "data") as srv:
        c = srv.client()
        r = c.send("t.id", b"p", delay_ms=HOUR, message_id="order-r")
        outcome, moved = c.reschedule(message_id="order-r", delay_ms=2 * HOUR)
        assert outcome == "RESCHEDULED" and moved is not None and moved.message_id == "order-r"
        assert moved.deliver_at_ms > r.deliver_at_ms
        assert c.get(message_id="order-r").deliver_at_ms == moved.deliver_at_ms
        assert c.reschedule(message_id="nobody", delay_ms=HOUR) == ("NOT_FOUND", None)
        with pytest.raises(errors.InvalidArgument):
            c.reschedule(delay_ms=HOUR)  # neither a target nor an id
        c.close()


def test_what_does_not_name_a_message_is_refused_and_message_id_is_the_id_as_it_is(tmp_path):
    """A user's receipt column too narrow for the receipt text: the cut text ('qd1:…' that
    does not parse) was sent as a message id, so cancel answered NOT_FOUND and the message
    was still delivered. Now it is InvalidArgument naming the receipt and its form; an empty
    target names the field. And ``message_id=`` is the id as it is: an id that starts with
    'qd1:' (printable ASCII, allowed) used to be read as a receipt's text."""
    with ServerProc(tmp_path / "data") as srv:
        c = srv.client()
        r = c.send("t.cut", b"p", delay_ms=HOUR)
        cut = str(r)[:20]  # e.g. a VARCHAR(20) column
        for call in (c.cancel, c.get, lambda t: c.reschedule(t, delay_ms=HOUR)):
            with pytest.raises(errors.InvalidArgument, match=r"^receipt: 'qd1:.*' starts like a receipt's string"):
                call(cut)
            with pytest.raises(errors.InvalidArgument, match=r"^receipt: empty string; give a Receipt"):
                call("")
        with pytest.raises(errors.InvalidArgument, match=r"^message_id: empty string"):
            c.cancel(message_id="")
        assert c.get(r).state == "PENDING"  # nothing was cancelled or moved
        odd = "qd1:1:2::looks-like-a-receipt"
        c.send("t.cut", b"p", delay_ms=HOUR, message_id=odd)
        assert c.get(message_id=odd).message_id == odd
        assert c.cancel(message_id=odd) == "CANCELLED"
        c.close()


def test_a_reused_id_names_the_newest_message(tmp_path):
    # a window of 1 ms: once delivered, the id may be sent again as a new message
    with ServerProc(tmp_path / "data", args=["--set", "engine.dedupe_window_ms=1"]) as srv:
        c = srv.client()
        c.send("t.reuse", b"first", delay_ms=0, message_id="job-7")
        with c.subscribe("t.reuse") as consumer:
            got = consumer.receive(1, timeout=10)
            consumer.ack(got)
        assert wait_until(lambda: c.get(message_id="job-7").state == "DELIVERED", timeout=10)
        second = c.send("t.reuse", b"second", delay_ms=HOUR, message_id="job-7")
        assert not second.duplicate
        st = c.get(message_id="job-7")
        assert (st.state, st.deliver_at_ms) == ("PENDING", second.deliver_at_ms)
        assert c.cancel(message_id="job-7") == "CANCELLED"
        c.close()


def test_by_id_survives_sigkill_and_a_lost_index(tmp_path):
    data = tmp_path / "data"
    with ServerProc(data) as srv:
        c = srv.client()
        sent = list(c.send_many([Outgoing("t.k", b"p", delay_ms=HOUR + i, message_id=f"k{i}") for i in range(300)]))
        assert c.cancel(message_id="k3") == "CANCELLED"
        c.close()
        srv.kill9()
        srv.start()
        c = srv.client()
        assert c.get(message_id="k299").deliver_at_ms == sent[299].deliver_at_ms
        assert c.get(message_id="k3").state == "CANCELLED"
        c.close()
        srv.stop()
        shutil.rmtree(data / "index")  # derived state: the next start rebuilds it
        srv.start()
        c = srv.client()
        assert [c.get(message_id=f"k{i}").state for i in (0, 3, 150, 299)] == [
            "PENDING",
            "CANCELLED",
            "PENDING",
            "PENDING",
        ]
        assert c.cancel(message_id="k150") == "CANCELLED"
        c.close()
    assert "id index rebuilt from the schedule log: 300 messages" in srv.log_path.read_text()


def test_with_the_index_off_by_id_is_refused_and_receipts_still_work(tmp_path):
    with ServerProc(tmp_path / "data", args=["--set", "engine.id_index=false"]) as srv:
        c = srv.client()
        r = c.send("t.off", b"p", delay_ms=HOUR, message_id="off-1")
        with pytest.raises(errors.FailedPrecondition, match=r"engine.id_index = false"):
            c.cancel(message_id="off-1")
        assert c.cancel(r) == "CANCELLED"
        c.close()
    assert not (tmp_path / "data" / "index").exists()


def test_with_dedupe_off_by_id_acts_on_the_newest_whatever_its_state(tmp_path):
    """``dedupe_window_ms = 0``: a second message with a pending message's id is written, and
    by-id calls act on the newest of them (the highest sequence), pending or not; the older
    pending one is reached by its receipt only (docs/api.md, "By id")."""
    with ServerProc(tmp_path / "data", args=["--set", "engine.dedupe_window_ms=0"]) as srv:
        c = srv.client()
        older = c.send("t.twice", b"older", delay_ms=HOUR, message_id="dup")
        newer = c.send("t.twice", b"newer", delay_ms=0, message_id="dup")
        assert not newer.duplicate and newer.sequence > older.sequence
        with c.subscribe("t.twice") as consumer:
            got = consumer.receive(1, timeout=10)
            consumer.ack(got)
        assert [d.payload for d in got] == [b"newer"]
        st = wait_until(lambda: (s := c.get(message_id="dup")).state == "DELIVERED" and s)
        assert st.deliver_at_ms == newer.deliver_at_ms
        assert c.cancel(message_id="dup") == "ALREADY_DELIVERED"
        assert c.reschedule("dup", delay_ms=HOUR) == ("ALREADY_DELIVERED", None)
        assert c.get(older).state == "PENDING"  # untouched by the by-id calls
        # two pending: by id reaches the newer; the older only by its receipt
        third = c.send("t.twice", b"third", delay_ms=HOUR, message_id="dup")
        assert c.cancel(message_id="dup") == "CANCELLED"
        assert c.cancel(message_id="dup") == "ALREADY_CANCELLED"
        assert (c.get(third).state, c.get(older).state) == ("CANCELLED", "PENDING")
        assert c.cancel(older) == "CANCELLED"
        c.close()


def test_a_batch_naming_a_closed_message_twice_answers_its_state_twice(tmp_path):
    """A CancelBatch naming one message twice (by receipt and by id, or twice alike) claims
    it once: the second answers as a second Cancel would (ALREADY_CANCELLED after a
    CANCELLED, and ALREADY_DELIVERED again for a delivered one, not ALREADY_CANCELLED)."""
    with ServerProc(tmp_path / "data") as srv:
        c = srv.client()
        done = c.send("t.twice", b"p", delay_ms=0, message_id="done")
        with c.subscribe("t.twice") as consumer:
            consumer.ack(consumer.receive(1, timeout=10))
        assert wait_until(lambda: c.get(done).state == "DELIVERED")
        c.send("t.twice", b"p", delay_ms=HOUR, message_id="live")
        got = c.cancel_many([done, "done", "live", "live", "done"])
        assert got == ["ALREADY_DELIVERED", "ALREADY_DELIVERED", "CANCELLED", "ALREADY_CANCELLED", "ALREADY_DELIVERED"]
        c.close()
