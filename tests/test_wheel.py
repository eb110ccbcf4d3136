"""The timer wheel against a plain reference, with a simulated clock (hypothesis).

Properties: every entry fires exactly once, never before its due time (due times are
rounded *up* to the tick: ``fire_time``), in due order within a pop; ``pop_due(limit)``
takes the earliest; ``next_fire`` is the earliest fire time; ``remove_where`` drops exactly
the entries asked for; interleaved ``add`` / ``add_many`` and run compaction keep all of it.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from qdelay.server.wheel import Entries, TimerWheel

T0 = 1_700_000_000_000


def entries(rows) -> Entries:
    """rows: (due, seq, off, bucket, subj)."""
    cols = list(zip(*rows)) if rows else [[], [], [], [], []]
    return Entries(
        np.array(cols[0], dtype=np.int64),
        np.array(cols[1], dtype=np.int64),
        np.array(cols[2], dtype=np.int64),
        np.array(cols[3], dtype=np.int32),
        np.array(cols[4], dtype=np.int32),
    )


def rows_of(e: Entries) -> list[tuple]:
    return list(e.rows())


def fire_time(due: int, tick: int) -> int:
    return -(-due // tick) * tick


# --- simple properties ----------------------------------------------------------------------------


def test_fire_time_rounds_up_to_the_tick():
    w = TimerWheel(10)
    assert w.fire_time(100) == 100
    assert w.fire_time(101) == 110
    assert w.fire_time(109) == 110
    assert w.fire_time(-5) == 0


def test_empty_wheel():
    w = TimerWheel(1)
    assert len(w) == 0
    assert w.next_fire() is None
    assert len(w.pop_due(T0)) == 0
    assert w.remove_where(1, {1, 2}) == 0


def test_not_before_fire_time_with_coarse_tick():
    w = TimerWheel(100)
    w.add(T0 + 1, 1, 0, 7, 0)
    assert w.next_fire() == T0 + 100
    for now in (T0, T0 + 1, T0 + 50, T0 + 99):
        assert len(w.pop_due(now)) == 0, now
    out = w.pop_due(T0 + 100)
    assert rows_of(out) == [(T0 + 1, 1, 0, 7, 0)]
    assert len(w) == 0


def test_tick_must_be_positive():
    with pytest.raises(ValueError):
        TimerWheel(0)


entry_rows = st.lists(
    st.tuples(
        st.integers(0, 5_000),  # due offset from T0
        st.integers(0, 7),
    ),  # subject
    min_size=0,
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(
    rows=entry_rows, tick=st.sampled_from([1, 3, 10, 250]), steps=st.lists(st.integers(0, 700), min_size=1, max_size=40)
)
def test_every_entry_fires_once_never_early(rows, tick, steps):
    w = TimerWheel(tick)
    all_rows = [(T0 + d, i + 1, i * 100, 3, s) for i, (d, s) in enumerate(rows)]
    half = len(all_rows) // 2
    w.add_many(entries(all_rows[:half]))
    for r in all_rows[half:]:
        w.add(*r)
    fired: dict[int, int] = {}
    now = T0 - 1
    for step in steps + [10_000]:
        now += step
        out = rows_of(w.pop_due(now))
        dues = [r[0] for r in out]
        assert dues == sorted(dues), "a pop is in due order"
        for r in out:
            assert r[1] not in fired, f"seq {r[1]} fired twice"
            assert fire_time(r[0], tick) <= now, f"seq {r[1]} due {r[0]} fired early at {now}"
            fired[r[1]] = now
        # nothing that could fire is left behind
        nf = w.next_fire()
        assert nf is None or nf > now
    assert sorted(fired) == [r[1] for r in all_rows]
    assert len(w) == 0


# --- a stateful model ---------------------------------------------------------------------------


class WheelModel(RuleBasedStateMachine):
    """The wheel vs a dict of pending rows, with adds, bulk adds, pops, limits and removals."""

    @initialize(tick=st.sampled_from([1, 2, 7, 50]), max_runs=st.sampled_from([2, 3, 12]))
    def setup(self, tick, max_runs):
        self.w = TimerWheel(tick, max_runs=max_runs)
        self.tick = tick
        self.now = T0
        self.pending: dict[int, tuple] = {}  # seq -> row
        self.next_seq = 1
        self.fired: set[int] = set()

    def _row(self, due_offset: int, bucket: int, subj: int) -> tuple:
        seq = self.next_seq
        self.next_seq += 1
        return (self.now + due_offset, seq, seq * 64, bucket, subj)

    @rule(due=st.integers(-200, 3000), bucket=st.integers(0, 3), subj=st.integers(0, 3))
    def add(self, due, bucket, subj):
        r = self._row(due, bucket, subj)
        self.w.add(*r)
        self.pending[r[1]] = r

    @rule(dues=st.lists(st.tuples(st.integers(-200, 3000), st.integers(0, 3), st.integers(0, 3)), max_size=40))
    def add_many(self, dues):
        rows = [self._row(d, b, s) for d, b, s in dues]
        self.w.add_many(entries(rows))
        for r in rows:
            self.pending[r[1]] = r

    @rule(step=st.integers(0, 800), limit=st.none() | st.integers(1, 20))
    def pop(self, step, limit):
        self.now += step
        fireable = sorted(
            (r for r in self.pending.values() if fire_time(r[0], self.tick) <= self.now), key=lambda r: r[0]
        )
        out = rows_of(self.w.pop_due(self.now, limit))
        dues = [r[0] for r in out]
        assert dues == sorted(dues), "a pop is in due order"
        for r in out:
            assert r[1] in self.pending, f"seq {r[1]} fired twice or was removed"
            assert r == self.pending[r[1]], "the entry comes back unchanged"
            assert fire_time(r[0], self.tick) <= self.now, "fired early"
            del self.pending[r[1]]
            self.fired.add(r[1])
        if limit is None or len(fireable) <= limit:
            assert len(out) == len(fireable)
        else:
            # the earliest: at least `limit`, and only ties on the last due time beyond it
            assert len(out) >= limit
            assert max(dues) == fireable[limit - 1][0], "only ties on the limit-th due time are added"
            assert dues == [r[0] for r in fireable[: len(out)]]
            left = [r[0] for r in self.pending.values() if fire_time(r[0], self.tick) <= self.now]
            assert not left or min(left) >= max(dues)

    @rule(bucket=st.integers(0, 3), data=st.data())
    def remove(self, bucket, data):
        candidates = sorted(self.pending) + sorted(self.fired)[:3] + [self.next_seq + 5]
        seqs = set(data.draw(st.lists(st.sampled_from(candidates), max_size=8)))
        expected = {s for s in seqs if s in self.pending and self.pending[s][3] == bucket}
        assert self.w.remove_where(bucket, seqs) == len(expected)
        for s in expected:
            del self.pending[s]

    @invariant()
    def size_and_next_fire(self):
        assert len(self.w) == len(self.pending)
        nf = self.w.next_fire()
        if self.pending:
            assert nf == min(fire_time(r[0], self.tick) for r in self.pending.values())
        else:
            assert nf is None

    def teardown(self):
        if not hasattr(self, "w"):
            return
        out = rows_of(self.w.pop_due(self.now + 10**7))
        assert sorted(r[1] for r in out) == sorted(self.pending)


TestWheelModel = WheelModel.TestCase
TestWheelModel.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 400), limit=st.integers(1, 50), seed=st.integers(0, 2**32 - 1))
def test_limit_takes_the_earliest_across_runs(n, limit, seed):
    rng = np.random.default_rng(seed)
    w = TimerWheel(1, max_runs=4)
    dues = T0 + rng.integers(0, 1000, size=n)
    # spread over many runs (and compactions) plus fresh singles
    rows = [(int(d), i + 1, i, 0, int(i % 3)) for i, d in enumerate(dues)]
    for k in range(0, n, 17):
        w.add_many(entries(rows[k : k + 13]))
        for r in rows[k + 13 : k + 17]:
            w.add(*r)
    taken = []
    while len(w):
        out = rows_of(w.pop_due(T0 + 1000, limit))
        assert out, "a non-empty, due wheel gives something"
        taken.extend(out)
    assert [r[0] for r in taken] == sorted(int(d) for d in dues), "pops come out globally in due order"
    assert sorted(r[1] for r in taken) == list(range(1, n + 1))
