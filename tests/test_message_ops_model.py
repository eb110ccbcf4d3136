"""A model-based test of what a user does with message ids (issue 13): send, re-send,
cancel (by receipt, old receipt or id, one at a time or in a CancelBatch), reschedule
(hours ahead, one at a time or in a RescheduleBatch, or a moment ahead and then
delivered; by id and at once a by-id call of the same id), get, delivery, and restarts
(SIGTERM or SIGKILL), run by hypothesis against a real server and checked after every
step against a dict that says what the answer must be.

A small id space makes the operations collide on the same messages. Every message is
due hours ahead except the ones of ``deliver_now`` (on their own subject) and the one a
``reschedule_near`` moves to a moment ahead and takes delivery of before the step ends, so
nothing is delivered behind the model's back. The dedupe window (10 minutes) outlasts an example, so
a re-sent id is always a duplicate answered with the id's newest receipt.
``QDELAY_MODEL_EXAMPLES=25`` runs more examples (6 by default: ~20 s).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import wait_until
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule

from tests.serverproc import ServerProc

HOUR = 3_600_000
ids = st.integers(0, 5).map(lambda i: f"k{i}")

pytestmark = pytest.mark.slow  # a real server per example, restarts included


@dataclass
class Entry:
    receipt: object  # the id's newest receipt
    state: str = "PENDING"  # PENDING, CANCELLED or DELIVERED
    old: list = field(default_factory=list)  # receipts it was rescheduled away from


class MessageOps(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="qdelay-model-")
        self.srv = ServerProc(Path(self.tmp) / "data").start()
        self.c = self.srv.client()
        self.model: dict[str, Entry] = {}

    def teardown(self) -> None:
        self.c.close()
        self.srv.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)

    @rule(k=ids, hours=st.integers(1, 48))
    def send(self, k, hours):
        r = self.c.send("model.later", b"p", delay_ms=hours * HOUR, message_id=k)
        e = self.model.get(k)
        if e is None:
            assert not r.duplicate
            self.model[k] = Entry(r)
        else:  # pending, or sent within the window: the newest message answers
            assert r.duplicate and (r.deliver_at_ms, r.sequence) == (e.receipt.deliver_at_ms, e.receipt.sequence)

    @rule(k=ids, by_id=st.booleans())
    def cancel(self, k, by_id):
        e = self.model.get(k)
        if e is None:
            assert self.c.cancel(message_id=k) == "NOT_FOUND"
            return
        out = self.c.cancel(message_id=k) if by_id else self.c.cancel(e.receipt)
        assert (
            out == {"PENDING": "CANCELLED", "CANCELLED": "ALREADY_CANCELLED", "DELIVERED": "ALREADY_DELIVERED"}[e.state]
        )
        if e.state == "PENDING":
            e.state = "CANCELLED"

    @rule(picks=st.lists(st.tuples(ids, st.booleans()), min_size=1, max_size=5))
    def cancel_many(self, picks):
        """One CancelBatch: each target by id or by receipt; a message named twice is
        CANCELLED once, ALREADY_CANCELLED after."""
        want, sent = [], []
        for k, by_id in picks:
            e = self.model.get(k)
            sent.append(k if by_id or e is None else e.receipt)
            if e is None:
                want.append("NOT_FOUND")
                continue
            want.append(
                {"PENDING": "CANCELLED", "CANCELLED": "ALREADY_CANCELLED", "DELIVERED": "ALREADY_DELIVERED"}[e.state]
            )
            if e.state == "PENDING":
                e.state = "CANCELLED"
        assert self.c.cancel_many(sent) == want

    @rule(k=ids)
    def cancel_an_old_receipt(self, k):
        e = self.model.get(k)
        if e is not None and e.old:
            assert self.c.cancel(e.old[-1]) == "ALREADY_CANCELLED"  # moved away: its old record is closed

    @rule(k=ids, by_id=st.booleans(), hours=st.integers(1, 48))
    def reschedule(self, k, by_id, hours):
        e = self.model.get(k)
        if e is None:
            assert self.c.reschedule(k, delay_ms=hours * HOUR) == ("NOT_FOUND", None)
            return
        outcome, r = self.c.reschedule(k if by_id else e.receipt, delay_ms=hours * HOUR)
        want = {"PENDING": "RESCHEDULED", "CANCELLED": "CANCELLED", "DELIVERED": "ALREADY_DELIVERED"}[e.state]
        assert outcome == want
        if outcome == "RESCHEDULED":
            assert r.message_id == k and r.sequence > e.receipt.sequence
            e.old.append(e.receipt)
            e.receipt = r

    @rule(picks=st.lists(st.tuples(ids, st.booleans()), min_size=1, max_size=5), hours=st.integers(1, 48))
    def reschedule_many(self, picks, hours):
        """One RescheduleBatch: each target by id or by receipt; a message named twice is
        moved once (the first), the repeats answer CANCELLED (its old record's state)."""
        want, sent, moved = [], [], []
        for k, by_id in picks:
            e = self.model.get(k)
            sent.append(k if by_id or e is None else e.receipt)
            if e is None:
                want.append("NOT_FOUND")
            elif k in moved:
                want.append("CANCELLED")
            else:
                want.append(
                    {"PENDING": "RESCHEDULED", "CANCELLED": "CANCELLED", "DELIVERED": "ALREADY_DELIVERED"}[e.state]
                )
                if e.state == "PENDING":
                    moved.append(k)
        got = self.c.reschedule_many(sent, delay_ms=hours * HOUR)
        assert [o for o, _r in got] == want
        news = [r for o, r in got if o == "RESCHEDULED"]
        assert [r.message_id for r in news] == moved
        assert all(b.sequence == a.sequence + 1 for a, b in zip(news, news[1:]))  # one append, in order
        for k, r in zip(moved, news):
            e = self.model[k]
            assert r.sequence > e.receipt.sequence
            e.old.append(e.receipt)
            e.receipt = r

    @rule(
        k=ids,
        hours=st.integers(1, 48),
        then=st.sampled_from(["get", "cancel", "reschedule", "send", "cancel_many", "reschedule_many"]),
    )
    def reschedule_then_by_id(self, k, hours, then):
        """A Reschedule by id and, at once, a by-id call of the same id (Get, Cancel,
        Reschedule, a re-send, a CancelBatch, a RescheduleBatch): each answers about the
        moved message, which the iterate service may not have copied yet (4f85b80 keeps it
        in Engine._moved meanwhile)."""
        self.reschedule(k, True, hours)
        {
            "get": lambda: self.get(k, True),
            "cancel": lambda: self.cancel(k, True),
            "reschedule": lambda: self.reschedule(k, True, hours + 1),
            "send": lambda: self.send(k, hours + 2),
            "cancel_many": lambda: self.cancel_many([(k, True)]),
            "reschedule_many": lambda: self.reschedule_many([(k, True)], hours + 3),
        }[then]()
        self.get(k, True)

    @rule(k=ids, by_id=st.booleans(), delay_ms=st.integers(0, 300))
    def reschedule_near(self, k, by_id, delay_ms):
        """Move a message a moment ahead and take its delivery: at its new time (never
        before), with its id, once."""
        e = self.model.get(k)
        if e is None or e.state != "PENDING":
            return  # the outcomes of non-pending targets are the reschedule rule's
        outcome, r = self.c.reschedule(k if by_id else e.receipt, delay_ms=delay_ms)
        assert outcome == "RESCHEDULED" and r.sequence > e.receipt.sequence
        e.old.append(e.receipt)
        e.receipt, e.state = r, "DELIVERED"
        with self.c.subscribe("model.later") as consumer:  # every pending message's subject
            got = consumer.receive(1, timeout=10)
            assert [(d.message_id, d.deliver_at_ms) for d in got] == [(k, r.deliver_at_ms)]
            assert got[0].dispatched_at_ms >= r.deliver_at_ms
            consumer.ack(got)
            assert consumer.receive(1, timeout=0.05) == []  # not at its old time as well
        assert wait_until(lambda: self.c.get(r).state == "DELIVERED", timeout=10)
        assert wait_until(lambda: self.c.stats()["dispatch_unsynced_buckets"] == 0, timeout=10)

    @rule(k=ids, by_id=st.booleans())
    def get(self, k, by_id):
        e = self.model.get(k)
        if e is None:
            assert self.c.get(message_id=k).state == "NOT_FOUND"
            return
        got = self.c.get(message_id=k) if by_id else self.c.get(e.receipt)
        assert (got.state, got.deliver_at_ms) == (e.state, e.receipt.deliver_at_ms)

    @rule(k=ids)
    def deliver_now(self, k):
        if k in self.model:
            return
        r = self.c.send("model.now", b"p", delay_ms=0, message_id=k)
        self.model[k] = Entry(r, "DELIVERED")
        with self.c.subscribe("model.now") as consumer:
            got = consumer.receive(1, timeout=10)
            assert [d.message_id for d in got] == [k]
            consumer.ack(got)
        assert wait_until(lambda: self.c.get(r).state == "DELIVERED", timeout=10)
        # a kill may follow: the model counts the ack only once it is durable (the protocol
        # does not confirm acks; one in the server's buffer dies with it, and the message
        # is delivered again, as at-least-once allows)
        assert wait_until(lambda: self.c.stats()["dispatch_unsynced_buckets"] == 0, timeout=10)

    @rule(kill=st.booleans())
    def restart(self, kill):
        self.c.close()
        if kill:
            self.srv.kill9()
            self.srv.start()
        else:
            self.srv.restart()
        self.c = self.srv.client()


TestMessageOps = MessageOps.TestCase
TestMessageOps.settings = settings(
    max_examples=int(os.environ.get("QDELAY_MODEL_EXAMPLES", "6")),
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
