"""Model-based test of consumer groups in the scheduler (hypothesis): fan-out, a group
created or deleted at any moment, acks, ack timeouts and retries per group, cancel, and
restarts, against a reference model. Half the examples bound each group's in-memory
queue at 3 entries, so lanes spill to disk and are read back all the time.

Checked on every pass: no delivery before its due time, after its cancel, to a group the
message is not for (due before the group's ``since``, or the group is gone), again after
that group acknowledged it, or twice at once to one group; a retry comes after
``ack_timeout + backoff`` with attempt + 1; and every message due for a group, neither
cancelled nor acknowledged by it, is in flight to that group or waiting for its retry.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule
from simclock import MINUTE, T0, Driver, FakeClock, message

from qdelay.server.engine import CancelOutcome, MessageState
from qdelay.server.groups import BEGINNING

ACK_TIMEOUT = 5_000
BACKOFF = 1_000
SUBJECTS = ["orders", "mail"]
NAMES = ["a", "b", "c"]


class GroupSink:
    """Takes everything; remembers (subject, group, ack id, message id, attempt, due, at)."""

    def __init__(self, clock) -> None:
        self.clock = clock
        self.seen: list[tuple] = []

    def credit(self, subject: str, group: str) -> int:
        return 1 << 30

    def deliver(self, subject: str, group: str, deliveries) -> None:
        now = self.clock()
        for d in deliveries:
            self.seen.append((subject, group, d.ack_id, d.message_id, d.attempt, d.deliver_at_ms, now))

    def take(self) -> list[tuple]:
        out, self.seen = self.seen, []
        return out


class Group:
    def __init__(self, since: int) -> None:
        self.since = since
        # seq -> (dispatched_at, attempt, ack_id) / (earliest retry, next attempt) / acked
        self.in_flight: dict[int, tuple[int, int, str]] = {}
        self.retry: dict[int, tuple[int, int]] = {}
        self.acked: set[int] = set()


class GroupsMachine(RuleBasedStateMachine):
    @initialize(start=st.integers(0, MINUTE - 1), bound=st.sampled_from([3, 100_000]))
    def setup(self, start, bound):
        self.dir = tempfile.mkdtemp(prefix="qdelay-groups-model-")
        self.clock = FakeClock(T0 + start)
        self.sink = GroupSink(self.clock)
        self.d = Driver(
            self.dir,
            self.clock,
            self.sink,
            ack_timeout_ms=ACK_TIMEOUT,
            retry_backoff_ms=BACKOFF,
            max_attempts=1000,
            load_ahead_ms=2 * MINUTE,
            group_max_ready=bound,
            implicit_group="",
        )
        self.msgs: dict[int, tuple[str, int, str]] = {}  # seq -> (subject, due, message id)
        self.cancelled: dict[int, int] = {}
        self.first_ack: dict[int, int] = {}  # seq -> dispatched_at of its first acknowledged delivery
        self.groups: dict[tuple[str, str], Group] = {}
        self.kept_since: dict[str, int] = {}
        self.n = 0

    def teardown(self):
        if getattr(self, "d", None) is not None:
            self.d.close()
        if getattr(self, "dir", None):
            shutil.rmtree(self.dir, ignore_errors=True)

    def _for(self, g: Group, seq: int) -> bool:
        return self.msgs[seq][1] >= g.since

    # --- rules --------------------------------------------------------------------------------

    @rule(
        offsets=st.lists(
            st.tuples(st.integers(-2 * MINUTE, 3 * MINUTE), st.sampled_from(SUBJECTS)), min_size=1, max_size=5
        )
    )
    def send(self, offsets):
        batch = []
        for off, subject in offsets:
            self.n += 1
            batch.append(message(subject, self.clock.now + off, f"m{self.n}"))
        for r, m in zip(self.d.send(batch), batch):
            self.msgs[r.sequence] = (m.subject, m.deliver_at_ms, m.message_id)

    @rule(subject=st.sampled_from(SUBJECTS), name=st.sampled_from(NAMES))
    def create_group(self, subject, name):
        created = asyncio.run(self.d.engine.ensure_group(subject, name))
        assert created == ((subject, name) not in self.groups)
        if created:
            others = any(s == subject for s, _n in self.groups)
            since = self.clock.now if others else self.kept_since.pop(subject, BEGINNING)
            self.groups[(subject, name)] = Group(since)

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def delete_group(self, data):
        key = data.draw(st.sampled_from(sorted(self.groups)))
        assert asyncio.run(self.d.engine.delete_group(*key)) is True
        del self.groups[key]
        if not any(s == key[0] for s, _n in self.groups):
            self.kept_since[key[0]] = self.clock.now

    @precondition(lambda self: any(g.in_flight for g in self.groups.values()))
    @rule(data=st.data())
    def ack(self, data):
        key = data.draw(st.sampled_from(sorted(k for k, g in self.groups.items() if g.in_flight)))
        g = self.groups[key]
        chosen = data.draw(st.lists(st.sampled_from(sorted(g.in_flight)), unique=True, min_size=1))
        ids = [g.in_flight[s][2] for s in chosen]
        assert self.d.engine.ack(ids, *key) == len(chosen)
        for s in chosen:
            at = g.in_flight.pop(s)[0]
            g.acked.add(s)
            self.first_ack.setdefault(s, at)
        assert self.d.engine.ack(ids, *key) == 0

    @precondition(lambda self: self.msgs)
    @rule(data=st.data())
    def cancel(self, data):
        seq = data.draw(st.sampled_from(sorted(self.msgs)))
        subject, due, mid = self.msgs[seq]
        self.d.catch_up()
        got = asyncio.run(self.d.engine.cancel(mid, due, seq))
        delivered = any(seq in g.acked or seq in g.in_flight for g in self.groups.values()) or seq in self.first_ack
        if seq in self.cancelled:
            expected = CancelOutcome.ALREADY_CANCELLED
        elif delivered:
            expected = CancelOutcome.ALREADY_DELIVERED
        else:
            expected = CancelOutcome.CANCELLED
        assert got == expected, (seq, got, expected)
        if expected == CancelOutcome.CANCELLED:
            self.cancelled[seq] = self.clock.now
            for g in self.groups.values():
                g.retry.pop(seq, None)

    @precondition(lambda self: self.msgs)
    @rule(data=st.data())
    def get(self, data):
        seq = data.draw(st.sampled_from(sorted(self.msgs)))
        subject, due, mid = self.msgs[seq]
        self.d.catch_up()
        got = self.d.engine.get_sync(mid, due, seq)
        if seq in self.cancelled:
            expected = MessageState.CANCELLED
        elif seq in self.first_ack:
            expected = MessageState.DELIVERED
        else:
            expected = MessageState.PENDING
        assert got.state == expected, (seq, got.state, expected)

    @rule(step=st.one_of(st.integers(0, 2_000), st.integers(4_000, 12_000), st.integers(MINUTE, 3 * MINUTE)))
    def advance_and_run(self, step):
        self.d.advance(step)
        self._observe()

    @rule()
    def restart(self):
        self.d.restart()
        assert self.sink.take() == [], "closing or opening delivered something"
        for g in self.groups.values():
            g.in_flight.clear()  # unacknowledged deliveries are forgotten: attempt 1 again
            g.retry.clear()

    # --- checks -------------------------------------------------------------------------------

    def _observe(self) -> None:
        now = self.clock.now
        for g in self.groups.values():
            for seq, (at, attempt, _ack) in list(g.in_flight.items()):
                if at + ACK_TIMEOUT <= now:
                    g.retry[seq] = (now + BACKOFF * 2 ** (attempt - 1), attempt + 1)
                    del g.in_flight[seq]
        for subject, name, ack_id, mid, attempt, due, at in self.sink.take():
            seq = int(ack_id.split(".")[0])
            assert seq in self.msgs and self.msgs[seq][2] == mid and self.msgs[seq][0] == subject
            g = self.groups.get((subject, name))
            assert g is not None, f"{mid} delivered to {name!r}, which does not exist"
            assert self._for(g, seq), f"{mid} (due {due}) delivered to {name!r}, created since {g.since}"
            assert at >= due, f"{mid} delivered {due - at} ms early"
            assert seq not in self.cancelled, f"{mid} delivered after its cancel"
            assert seq not in g.acked, f"{mid} delivered to {name!r} again after its ack"
            assert seq not in g.in_flight, f"{mid} delivered to {name!r} twice at once"
            retry = g.retry.pop(seq, None)
            if retry is not None:
                assert now >= retry[0], f"{mid} redelivered to {name!r} before its backoff"
                assert attempt == retry[1], (mid, name, attempt, retry)
            else:
                assert attempt == 1, (mid, name, attempt)
            g.in_flight[seq] = (at, attempt, ack_id)
        for (subject, name), g in self.groups.items():
            for seq, (s, due, mid) in self.msgs.items():
                if s != subject or due > now or seq in self.cancelled or seq in g.acked or not self._for(g, seq):
                    continue
                waiting = seq in g.in_flight or (seq in g.retry and g.retry[seq][0] > now)
                assert waiting, f"{mid} due {now - due} ms ago, not in flight to {name!r} nor waiting for a retry"


TestGroupsModel = GroupsMachine.TestCase
TestGroupsModel.settings = settings(
    max_examples=30,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def test_a_message_due_before_a_group_existed_is_not_for_it(tmp_path):
    """Fired after the group's creation but due before it: only the older group gets it."""
    clock = FakeClock(T0)
    sink = GroupSink(clock)
    d = Driver(tmp_path, clock, sink, implicit_group="")
    try:
        assert asyncio.run(d.engine.ensure_group("orders", "a"))
        d.send([message("orders", T0 - 30_000, "late"), message("orders", T0 + 5_000, "later")])
        clock.advance(1)
        assert asyncio.run(d.engine.ensure_group("orders", "b"))
        d.advance(10_000)
        got = sorted((group, mid) for _s, group, _a, mid, *_rest in sink.take())
        assert got == [("a", "late"), ("a", "later"), ("b", "later")]
    finally:
        d.close()


def test_a_data_folder_from_before_groups_keeps_its_pending_messages_for_the_group_default(tmp_path):
    """Upgrade (issue 14, item 5): a checkpoint without groups, DISPATCH records without a
    group name. Its subjects get the group "default", which inherits what was delivered."""
    from qdelay.segments import checkpoint

    clock = FakeClock(T0)
    sink = GroupSink(clock)
    d = Driver(tmp_path, clock, sink, implicit_group="default")  # how the old server delivered
    d.send([message("orders", T0 + 1_000, "old-done"), message("orders", T0 + 3 * MINUTE, "old-pending")])
    d.advance(2_000)
    delivered = sink.take()
    assert [m for _s, _g, _a, m, *_r in delivered] == ["old-done"]
    d.engine.ack([a for _s, _g, a, *_r in delivered])
    d.advance(1)
    d.close()
    # what the old server's checkpoint held: no group table
    path = os.path.join(str(tmp_path), "checkpoint", "iterate.ckpt")
    state = checkpoint.read(path)
    for key in ("groups", "groups_kept_since", "groups_seq"):
        state.pop(key)
    checkpoint.write(path, state)

    d = Driver(tmp_path, clock, sink, implicit_group="")
    try:
        d.send([message("orders", T0 + 4 * MINUTE, "new")])
        d.advance(5 * MINUTE)
        got = sorted((g, m) for _s, g, _a, m, *_r in sink.take())
        # the old pending message goes to "default"; the new one (written after the upgrade,
        # with the subject's group already there) too; the delivered one does not come back
        assert got == [("default", "new"), ("default", "old-pending")]
        assert [(g["subject"], g["group"]) for g in d.engine.groups()] == [("orders", "default")]
    finally:
        d.close()
