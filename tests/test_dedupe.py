"""Idempotent send against a real server (issue 13, item 4): an id that belongs to a pending
message, or to one closed (delivered, cancelled) within ``engine.dedupe_window_ms``, writes nothing and answers the
original receipt with ``duplicate = true`` — across concurrent senders, batches, and a
SIGKILL restart."""

from __future__ import annotations

import threading
import time

import pytest
from conftest import wait_until

from qdelay import errors
from qdelay.client import Outgoing
from qdelay.v1 import qdelay_pb2 as pb
from tests.serverproc import ServerProc

HOUR = 3_600_000


def _pending(c) -> int:
    return c.stats()["pending"]


def test_a_batch_with_known_ids_writes_only_the_new_ones(tmp_path):
    with ServerProc(tmp_path / "data") as srv:
        c = srv.client()
        first = c.send_batch([c.message("t.d", b"p", delay_ms=HOUR, message_id=f"m{i}") for i in range(3)])
        resp = c._call(
            c.stub.SendBatch,
            pb.SendBatchRequest(
                messages=[
                    pb.Message(subject="t.d", payload=b"p", delay_ms=HOUR, message_id=f"m{i}") for i in (1, 7, 2)
                ],
                compact_receipts=True,
            ),
            10,
        )
        got = [(r.message_id, r.sequence, r.duplicate) for r in resp.receipts]
        assert got == [
            ("m1", first[1].sequence, True),
            ("m7", first[2].sequence + 1, False),
            ("m2", first[2].sequence, True),
        ]
        assert wait_until(lambda: _pending(c) == 4)
        with pytest.raises(errors.InvalidArgument, match="message_id"):  # within one batch: refused, as before
            c.send_batch([c.message("t.d", b"p", delay_ms=HOUR, message_id="x") for _ in range(2)])
        c.close()


def test_concurrent_senders_of_one_id_make_one_message(tmp_path):
    with ServerProc(tmp_path / "data") as srv:
        c = srv.client()
        receipts = []

        def send() -> None:
            receipts.append(c.send("t.race", b"once", delay_ms=1000, message_id="race-1"))

        threads = [threading.Thread(target=send) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len({(r.deliver_at_ms, r.sequence) for r in receipts}) == 1
        assert sum(not r.duplicate for r in receipts) == 1
        with c.subscribe("t.race") as consumer:
            got = consumer.receive(1, timeout=10)
            consumer.ack(got)
            assert consumer.receive(1, timeout=1.5) == []
        assert [d.message_id for d in got] == ["race-1"]
        c.close()


def test_the_window_after_delivery_and_a_sigkill(tmp_path):
    with ServerProc(tmp_path / "data", args=["--set", "engine.dedupe_window_ms=2000"]) as srv:
        c = srv.client()
        sent = list(c.send_many([Outgoing("t.w", b"p", delay_ms=HOUR, message_id=f"w{i}") for i in range(200)]))
        c.close()
        srv.kill9()  # what was only in the server's memory is gone; the logs and index stay
        srv.start()
        c = srv.client()
        again = c.send_batch([c.message("t.w", b"p", delay_ms=HOUR, message_id=f"w{i}") for i in (0, 199)])
        assert [(r.sequence, r.duplicate) for r in again] == [(sent[0].sequence, True), (sent[199].sequence, True)]
        # delivered, then sent again inside the window: a duplicate; after it: a new message
        r = c.send("t.w2", b"p", delay_ms=0, message_id="late")
        with c.subscribe("t.w2") as consumer:
            consumer.ack(consumer.receive(1, timeout=10))
        assert wait_until(lambda: c.get(r).state == "DELIVERED")
        assert c.send("t.w2", b"p", delay_ms=HOUR, message_id="late").duplicate
        time.sleep(2.1)  # let the 2 s window pass: waiting on the clock is the point here
        new = c.send("t.w2", b"p", delay_ms=HOUR, message_id="late")
        assert not new.duplicate and new.sequence > r.sequence
        c.close()


def test_dedupe_off_writes_every_send(tmp_path):
    with ServerProc(tmp_path / "data", args=["--set", "engine.dedupe_window_ms=0"]) as srv:
        c = srv.client()
        a = c.send("t.off", b"p", delay_ms=HOUR, message_id="same")
        b = c.send("t.off", b"p", delay_ms=HOUR, message_id="same")
        assert not b.duplicate and b.sequence == a.sequence + 1
        c.close()


def test_the_window_runs_from_the_close_not_the_send(tmp_path):
    """A message closed (delivered, cancelled) long after it was sent is still remembered
    for ``dedupe_window_ms`` from its close; after that its id makes a new message."""
    window_ms, delay_ms = 1500, 2500  # the retries come > window after the send
    with ServerProc(tmp_path / "data", args=["--set", f"engine.dedupe_window_ms={window_ms}"]) as srv:
        c = srv.client()
        cancelled = c.send("t.close", b"p", delay_ms=HOUR, message_id="c1")
        delivered = c.send("t.close", b"p", delay_ms=delay_ms, message_id="d1")
        with c.subscribe("t.close") as consumer:
            got = consumer.receive(1, timeout=10)
            consumer.ack(got)
        assert [d.message_id for d in got] == ["d1"]
        assert wait_until(lambda: c.get(delivered).state == "DELIVERED")
        assert c.cancel(cancelled) == "CANCELLED"
        closed = time.monotonic()
        # both were sent more than the window ago, and closed just now: duplicates
        again = c.send_batch([c.message("t.close", b"p", delay_ms=HOUR, message_id=m) for m in ("c1", "d1")])
        assert time.monotonic() - closed < window_ms / 1000, "the retry came too late to test the window"
        assert [(r.sequence, r.duplicate) for r in again] == [(cancelled.sequence, True), (delivered.sequence, True)]
        time.sleep(window_ms / 1000 + 0.1)  # let the window pass: waiting on the clock is the point here
        new = c.send_batch([c.message("t.close", b"p", delay_ms=HOUR, message_id=m) for m in ("c1", "d1")])
        assert [r.duplicate for r in new] == [False, False]
        assert min(r.sequence for r in new) > delivered.sequence
        assert wait_until(lambda: _pending(c) == 2)
        c.close()


def test_generated_ids_are_never_taken_for_a_re_send(tmp_path):
    """A client may choose an id of the server's generated shape (copied from a receipt, or
    guessed): a message the server later gives that same id is still written, while a re-send
    of an id the server generated is still a duplicate. (A plain generated stub leaves ids
    empty; the project's clients choose their own.)"""

    def send(c, ids):
        request = pb.SendBatchRequest(
            messages=[pb.Message(subject="t.g", payload=b"p", delay_ms=HOUR, message_id=m) for m in ids]
        )
        return list(c._call(c.stub.SendBatch, request, 10).receipts)

    with ServerProc(tmp_path / "data") as srv:
        c = srv.client()
        made = send(c, [""])[0]
        prefix, count = made.message_id.rsplit("-", 1)
        ahead = [f"{prefix}-{int(count, 16) + n:x}" for n in (2, 5)]
        # chosen before the server makes them, one alone and one beside a generated id
        assert not send(c, [ahead[0]])[0].duplicate
        mixed = send(c, [ahead[1], ""])
        assert not any(r.duplicate for r in mixed)
        later = send(c, [""] * 8)
        assert not any(r.duplicate for r in later)
        assert set(ahead) <= {r.message_id for r in later} | {mixed[1].message_id}
        assert wait_until(lambda: _pending(c) == 1 + 1 + 2 + 8)
        # a re-send of a generated id, beside a new generated one: the original's receipt
        again = send(c, ["", made.message_id])
        assert (again[1].duplicate, again[1].sequence) == (True, made.sequence)
        assert not again[0].duplicate
        assert wait_until(lambda: _pending(c) == 13)
        c.close()
