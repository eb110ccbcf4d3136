"""The ack ledger on its own (server/ledger.py) against a reference: a dictionary per group
of the deliveries in flight, as the ledger kept them before it registered whole flights.

Acks come as consumers send them (stretches of what was handed out, in order) and in every
other shape (out of order, partly unknown, repeated, split across flights, without a
group); releases, expiries, a deleted group and the questions a Cancel, a Get and a
read-back pass ask are checked after every step.
"""

from __future__ import annotations

import itertools
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from qdelay.server import ledger as ledger_mod
from qdelay.server import stretches as stretches_mod
from qdelay.server.ledger import AckLedger, Flight

GROUPS = (1, 2, 3)
TIMEOUT = 100
# how an ack comes: sequences (take_acked), ack ids (take_acked_ids), ack ids with odd ones
ACK_FORMS = st.tuples(st.sampled_from(["seqs", "ids", "odd"]), st.integers(0, 20))


def bucket_of(seq: int) -> int:
    """The test's bucket of a sequence (fixed, as a message's due minute is): runs of 5."""
    return 7 + (seq - 1) // 5 % 2


def flight(gid: int, seqs: list[int], at: int, attempt: int = 1) -> Flight:
    n = len(seqs)
    return Flight(
        bucket_of(seqs[0]),
        1,
        gid,
        at,
        seqs,
        [q * 10 for q in seqs],
        [q + 1000 for q in seqs],
        [attempt] * n,
        [b"m%d" % q for q in seqs],
    )


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ledger = AckLedger()
        self.now = 0
        self.next_seq = 1
        # reference: gid -> seq -> (attempt, deadline, handed-out order)
        self.ref: dict[int, dict[int, tuple[int, int]]] = {g: {} for g in GROUPS}
        self.order: dict[int, list[list[int]]] = {g: [] for g in GROUPS}  # batches as handed out
        self.dropped: set[int] = set()

    def _in_flight(self, gid: int) -> dict[int, tuple[int, int]]:
        return self.ref[gid]

    @rule(
        gids=st.lists(st.sampled_from(GROUPS), min_size=1, max_size=3, unique=True),
        n=st.integers(1, 12),
        reuse=st.booleans(),
        split=st.integers(0, 12),
    )
    def hand_out(self, gids: list[int], n: int, reuse: bool, split: int) -> None:
        """A dispatch round: the same entries to several groups (fan-out), sometimes in two
        flights (two buckets), sometimes a redelivery of sequences no longer in flight."""
        free = [q for q in range(1, self.next_seq) if all(q not in self.ref[g] for g in gids)]
        if reuse and len(free) >= n:
            seqs = free[-n:]
        else:
            seqs = list(range(self.next_seq, self.next_seq + n))
            self.next_seq += n
        parts = [seqs[:split], seqs[split:]] if 0 < split < n else [seqs]
        # a flight holds one bucket's deliveries: each part cut where the bucket changes
        parts = [list(run) for part in parts for _b, run in itertools.groupby(part, key=bucket_of)]
        flights = []
        for g in gids:
            if g in self.dropped:
                continue
            for part in parts:
                flights.append(flight(g, part, self.now, attempt=1 + (seqs[0] % 3)))
                for q in part:
                    self.ref[g][q] = (1 + (seqs[0] % 3), self.now + TIMEOUT)
                self.order[g].append(part)
        if flights:
            self.ledger.hand_out(flights, self.now + TIMEOUT)

    @rule(gid=st.sampled_from(GROUPS), data=st.data())
    def ack_stretches(self, gid: int, data: st.DataObject) -> None:
        """What a consumer sends back: consecutive deliveries of one or more batches."""
        batches = [b for b in self.order[gid] if b]
        if not batches:
            return
        i = data.draw(st.integers(0, len(batches) - 1))
        flat = [q for b in batches[i:] for q in b]
        start = data.draw(st.integers(0, len(flat) - 1))
        k = data.draw(st.integers(1, len(flat) - start))
        self._ack(gid, flat[start : start + k], data.draw(ACK_FORMS))

    @rule(gid=st.sampled_from(GROUPS), data=st.data())
    def ack_any(self, gid: int, data: st.DataObject) -> None:
        """Any ids: in flight or not, in any order, repeated, unknown."""
        pool = sorted(self.ref[gid]) + [self.next_seq + 5, 1]
        seqs = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=10))
        self._ack(gid, seqs, data.draw(ACK_FORMS))

    def _ack(self, gid: int, seqs: list[int], form: tuple[str, int]) -> None:
        want = []
        mine = self.ref[gid]
        attempts = [mine.get(q, (1, 0))[0] for q in seqs]
        for q in seqs:
            if q in mine and gid not in self.dropped:
                del mine[q]
                want.append(q)
        how, at = form
        if how == "seqs":
            got = self.ledger.take_acked(seqs, gid)
        else:
            # as a consumer sends them: "seq.attempt" ids (take_acked_ids); "odd": one id bare
            # ("seq", read as its sequence) and a malformed one inserted (skipped), which
            # end the stretches matched in C
            ids = [f"{q}.{a}" for q, a in zip(seqs, attempts)]
            if how == "odd":
                j = at % len(ids)
                ids[j] = str(seqs[j])
                ids.insert(at % (len(ids) + 1), "x.1")
            got = self.ledger.take_acked_ids(ids, gid)
        closed = [q for a in got for q in a.keys]
        assert closed == want
        for a in got:
            offs, dues, attempts, mids = a.batch.columns(a.keys, a.start)
            assert offs == [q * 10 for q in a.keys] and dues == [q + 1000 for q in a.keys]
            assert mids == [b"m%d" % q for q in a.keys] and len(attempts) == len(a.keys)
            assert a.batch.gid == gid

    @rule(data=st.data())
    def ack_without_group(self, data: st.DataObject) -> None:
        flying = sorted({q for g in GROUPS for q in self.ref[g]})
        if not flying:
            return
        seqs = data.draw(st.lists(st.sampled_from(flying), min_size=1, max_size=4, unique=True))
        got = self.ledger.take_acked(seqs, None)
        assert sorted(q for a in got for q in a.keys) == sorted(seqs)  # each in flight in some group
        for a in got:
            for q in a.keys:
                assert q in self.ref[a.batch.gid]
                del self.ref[a.batch.gid][q]

    @rule(gid=st.sampled_from(GROUPS), data=st.data(), wrong=st.booleans())
    def release(self, gid: int, data: st.DataObject, wrong: bool) -> None:
        mine = self.ref[gid]
        if not mine:
            return
        seqs = data.draw(st.lists(st.sampled_from(sorted(mine)), min_size=1, max_size=4, unique=True))
        parsed = [(q, mine[q][0] + (1 if wrong else 0)) for q in seqs]
        got = self.ledger.take_released(parsed, gid)
        if wrong:
            assert got == []
            return
        assert [q for q, _item in got] == seqs
        for q, item in got:
            assert item[0] == q and item[4] == mine[q][0] + 1 and item[6] == gid
            del mine[q]

    @rule(dt=st.integers(1, 60))
    def expire(self, dt: int) -> None:
        self.now += dt
        got = sorted((item[6], q) for q, item in self.ledger.expired(self.now))
        want = []
        for g in GROUPS:
            for q, (_attempt, deadline) in list(self.ref[g].items()):
                if deadline <= self.now:
                    want.append((g, q))
                    del self.ref[g][q]
        assert got == sorted(want)

    @precondition(lambda self: len(self.dropped) < 2)
    @rule(gid=st.sampled_from(GROUPS))
    def drop_group(self, gid: int) -> None:
        self.ledger.drop_group(gid)
        self.ref[gid].clear()
        self.order[gid].clear()
        self.dropped.add(gid)

    @rule(small=st.booleans())
    def index_threshold(self, small: bool) -> None:
        """Kept indexes dropped early or late: both must answer the same."""
        stretches_mod.INDEX_IDLE_MIN = 4 if small else 65536

    @rule(small=st.booleans())
    def enter_threshold(self, small: bool) -> None:
        """A question enters a few deliveries in its bucket's index and searches the flights
        not entered yet, or enters them all: both must answer the same."""
        ledger_mod.ENTER_MAX = 2 if small else 8192

    @invariant()
    def questions_agree(self) -> None:
        led = self.ledger
        assert led.count() == sum(len(self.ref[g]) for g in GROUPS)
        for g in GROUPS:
            assert led.count_of(g) == len(self.ref[g])
            assert led.held(g) == set(self.ref[g])
        flying = {q for g in GROUPS for q in self.ref[g]}
        for q in range(1, self.next_seq + 1):
            assert led.is_in_flight(q) == (q in flying)
            # asked with the message's bucket (as Get asks): only that bucket's flights
            assert led.is_in_flight(q, bucket_of(q)) == (q in flying)
        # a Cancel's question, with the buckets of its targets (as the engine asks it)
        for buckets in ({7}, {8}, {7, 8}, {99}):
            got = led.in_flight_of(buckets)
            for q in range(1, self.next_seq + 1):
                if bucket_of(q) in buckets:
                    assert any(q in c for c in got) == (q in flying)
        maps = led.in_flight_maps()
        assert {q for m in maps for q in m} == flying

    def teardown(self) -> None:
        stretches_mod.INDEX_IDLE_MIN = 65536
        ledger_mod.ENTER_MAX = 8192


LedgerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestLedger = LedgerMachine.TestCase


def test_a_burst_acknowledged_as_handed_out_needs_no_index():
    """Whole batches and in-order stretches of them are matched as columns: no
    per-delivery index is built (the cost a fan-out burst paid per group)."""
    led = AckLedger()
    a = flight(1, list(range(1, 513)), 0)
    b = flight(1, list(range(513, 1025)), 0)
    led.hand_out([a, b], TIMEOUT)
    got = led.take_acked(list(range(1, 513)), 1)  # one whole batch
    assert [(x.batch, x.start, len(x.keys)) for x in got] == [(a, 0, 512)]
    got = led.take_acked(list(range(513, 600)), 1)  # a response's stretch ...
    got += led.take_acked(list(range(600, 1025)), 1)  # ... and the next
    assert [(x.batch, x.start) for x in got] == [(b, 0), (b, 87)]
    assert led.count() == 0 and not led.has_index(1)


def test_ack_ids_sent_back_as_handed_out_are_matched_as_stretches():
    """Ack ids ("seq.attempt") returning whole flights and in-order stretches of them are
    matched against the flights' sequences without an index (take_acked_ids); the same
    stretches as take_acked would take, the flights' own sequence lists."""
    led = AckLedger()
    a = flight(1, list(range(1, 513)), 0)
    b = flight(1, list(range(513, 1025)), 0, attempt=2)
    led.hand_out([a, b], TIMEOUT)
    got = led.take_acked_ids([f"{q}.1" for q in range(1, 513)], 1)
    assert [(x.batch, x.start, x.keys) for x in got] == [(a, 0, a.seqs)]
    got = led.take_acked_ids([f"{q}.2" for q in range(513, 600)], 1)
    got += led.take_acked_ids([f"{q}.2" for q in range(600, 1025)], 1)
    assert [(x.batch, x.start, x.keys[0], len(x.keys)) for x in got] == [(b, 0, 513, 87), (b, 87, 600, 425)]
    assert led.count() == 0 and not led.has_index(1)
    assert led.take_acked_ids(["600.2", "5.1", "x"], 1) == []  # acknowledged already, or not ids


def test_closed_flights_leave_at_once_not_at_their_deadline():
    """Dispatched batches whose flights are all closed (acknowledged, released) leave the
    ledger when they reach the front, not when their ack timeout passes: held 30 s, every
    live subject's flights survived into the old generation and set off full garbage
    collections, whose pause grew with each open Subscribe stream. A batch still partly
    in flight keeps its deadline, and those behind it wait for it."""
    led = AckLedger()
    a, b = flight(1, [1, 2, 3], 0), flight(2, [1, 2, 3], 0)  # one round, two groups
    c = flight(1, [4, 5], 0)
    led.hand_out([a, b], TIMEOUT)
    led.hand_out([c], TIMEOUT + 10)
    led.take_acked_ids(["1.1", "2.1", "3.1"], 1)
    assert led.next_wakeup() == TIMEOUT  # group 2 still has the round's sequences
    led.take_acked([4, 5], 1)
    assert led.next_wakeup() == TIMEOUT
    led.take_released([(1, 1), (2, 1)], 2)
    assert led.next_wakeup() == TIMEOUT
    led.take_acked([3], 2)
    assert led.next_wakeup() is None  # both rounds closed: nothing to wake for
    d = flight(1, [6, 7], 1)
    led.hand_out([d], TIMEOUT + 20)
    led.take_acked([6], 1)
    assert led.next_wakeup() == TIMEOUT + 20
    assert [(item[6], q) for q, item in led.expired(TIMEOUT + 20)] == [(1, 7)]
    assert led.next_wakeup() is None and led.count() == 0


def test_a_get_looks_at_the_flights_of_its_bucket_only():
    """ "Is it in flight?" with the message's bucket (Get's question) answers from that
    bucket's flights: right for every shape of close, and the lists leave with the flights
    (acknowledged, released, expired, of a deleted group), so they do not grow with what
    was ever handed out."""
    led = AckLedger()
    a = Flight(7, 1, 1, 0, [1, 2, 3], [0] * 3, [0] * 3, [1] * 3, [b""] * 3)
    b = Flight(8, 1, 1, 0, [4, 5], [0] * 2, [0] * 2, [1] * 2, [b""] * 2)
    c = Flight(8, 1, 2, 0, [4, 5], [0] * 2, [0] * 2, [1] * 2, [b""] * 2)  # another group
    led.hand_out([a, b, c], TIMEOUT)
    assert led.flights_listed() == 3
    assert led.is_in_flight(2, 7) and not led.is_in_flight(2, 8) and led.is_in_flight(4, 8)
    led.take_acked([4], 1)
    assert led.is_in_flight(4, 8)  # group 2 still has it
    led.take_released([(4, 1)], 2)
    assert not led.is_in_flight(4, 8) and led.is_in_flight(5, 8)
    led.drop_group(2)
    led.take_acked([5], 1)
    assert not led.is_in_flight(5, 8)
    led.take_acked([1, 2, 3], 1)
    # the deleted group's flight is still out: the round leaves at its deadline
    assert led.flights_listed() == 3
    assert list(led.expired(TIMEOUT)) == []
    assert led.flights_listed() == 0
    d = Flight(7, 1, 1, 1, [6, 7], [0] * 2, [0] * 2, [1] * 2, [b""] * 2)
    led.hand_out([d], TIMEOUT + 1)
    assert [q for q, _item in led.expired(TIMEOUT + 1)] == [6, 7]
    assert led.flights_listed() == 0 and not led.is_in_flight(6, 7)


def test_a_cancel_of_another_minute_builds_no_index():
    """A Cancel's "is it out?" with its targets' buckets: a minute with nothing out costs
    no index of what is out elsewhere (the first Cancel after an index was dropped built
    one of every delivery in flight, and keeping it cost every later delivery a
    dictionary entry); a minute with many out asks that minute's index, not the groups'."""
    led = AckLedger()
    many = [
        Flight(7, 1, 1, 0, list(range(k, k + 100)), [0] * 100, [0] * 100, [1] * 100, [b""] * 100)
        for k in range(1, 20_001, 100)
    ]
    led.hand_out(many, TIMEOUT)
    assert led.in_flight_of([8]) == [] and not led.has_index(1)
    got = led.in_flight_of([7])
    assert all(any(q in c for c in got) for q in (1, 20_000)) and not any(20_001 in c for c in got)
    assert not led.has_index(1)


class CountedKeys(list[int]):
    """A flight's sequences that count the searches made in them."""

    searches = 0

    def __contains__(self, key: object) -> bool:
        CountedKeys.searches += 1
        return super().__contains__(key)

    def index(self, *args: Any) -> int:
        CountedKeys.searches += 1
        return super().index(*args)


def test_in_flight_questions_cost_no_search_of_the_bucket_s_flights():
    """Get's and Cancel's "is it in flight?" about a message of the minute being delivered
    cost a lookup per group, not a search of every flight of that minute (~3 ms a Get
    with 200,000 out): each delivery is entered in the minute's index once, at the first
    question after it was handed out, whatever the number of questions."""
    led = AckLedger()
    CountedKeys.searches = 0

    def round_of(gid: int, first: int) -> list[Flight]:
        return [
            Flight(7, 1, gid, 0, CountedKeys(range(k, k + 50)), [0] * 50, [0] * 50, [1] * 50, [b""] * 50)
            for k in range(first, first + 5_000, 50)
        ]

    led.hand_out(round_of(1, 1) + round_of(2, 1), TIMEOUT)
    # acknowledged as consumers send acks back (stretches in order: no group keeps an
    # index): both groups the first half; of the rest, group 1 the first half of each
    # flight (one ack each), group 2 every other flight
    late = range(2_501, 5_001, 50)
    led.take_acked(list(range(1, 2_501)), 1)
    for k in late:
        led.take_acked(list(range(k, k + 25)), 1)
    led.take_acked(list(range(1, 2_501)) + [q for k in late[::2] for q in range(k, k + 50)], 2)
    out = {q for k in late for q in range(k + 25, k + 50)} | {q for k in late[1::2] for q in range(k, k + 50)}
    assert not led.has_index(1) and not led.has_index(2)
    for _ in range(3):
        for q in range(1, 5_001, 7):
            assert led.is_in_flight(q, 7) == (q in out)
            assert any(q in c for c in led.in_flight_of([7])) == (q in out)
    led.hand_out(round_of(1, 5_001), TIMEOUT + 1)
    assert led.is_in_flight(5_001, 7) and not led.is_in_flight(10_001, 7)
    # no search of a flight's sequences (the scan made one per flight per question: ~4,300
    # questions x 200 flights); the 8,750 deliveries out when asked (3,750 of the first
    # rounds, 5,000 of the last) entered in the index once each
    assert CountedKeys.searches == 0
    assert led.entered == 8_750


def burst_of_flights(monkeypatch: Any) -> AckLedger:
    """A ledger right after a burst: 10,000 deliveries of minute 7 handed out in 200 flights
    of 50 (sequences 1..10,000), none entered in the minute's index yet, ENTER_MAX 1,000 and
    the searches counted from 0."""
    monkeypatch.setattr(ledger_mod, "ENTER_MAX", 1_000)
    led = AckLedger()
    CountedKeys.searches = 0
    flights = [
        Flight(7, 1, 1, 0, CountedKeys(range(k, k + 50)), [0] * 50, [0] * 50, [1] * 50, [b""] * 50)
        for k in range(1, 10_001, 50)
    ]
    led.hand_out(flights, TIMEOUT)
    return led


def test_a_question_enters_a_bounded_share_and_searches_the_rest(monkeypatch: Any) -> None:
    """After a burst, the first questions do not pay the entry of every delivery at once
    (~10x a search of them): each enters about ENTER_MAX and searches the flights not
    entered yet; once caught up, none searches."""
    led = burst_of_flights(monkeypatch)
    assert not led.is_in_flight(10_001, 7)  # not out: every flight not entered is searched
    assert led.entered == 1_000 and CountedKeys.searches == 180
    for k in range(2, 11):
        assert led.is_in_flight(10_000, 7)  # the last flight: found once entered, or searched
        assert led.entered == 1_000 * k
    CountedKeys.searches = 0
    assert all(led.is_in_flight(q, 7) for q in range(1, 10_001, 97)) and not led.is_in_flight(10_001, 7)
    assert CountedKeys.searches == 0 and led.entered == 10_000


def test_flights_waiting_for_a_question_do_not_pile_up():
    """A minute asked about once, then delivered and acknowledged for long without another
    question: the flights waiting to be entered in its index are about those still listed
    (here two), not every flight handed out since (2,000)."""
    led = AckLedger()

    def of(k: int) -> Flight:
        return Flight(7, 1, 1, k, [2 * k, 2 * k + 1], [0] * 2, [0] * 2, [1] * 2, [b""] * 2)

    led.hand_out([of(1)], TIMEOUT + 1)
    assert led.is_in_flight(2, 7)
    for k in range(2, 2_002):
        led.hand_out([of(k)], TIMEOUT + k)
        led.take_acked([2 * k - 2, 2 * k - 1], 1)  # the one before: it leaves
        assert led.flights_listed() == 1 and led.flights_waiting() <= 2 * 2 + 64 + 1
    assert led.is_in_flight(4_002, 7) and not led.is_in_flight(4_000, 7)


def test_a_cancel_s_question_about_many_targets_does_not_search_the_flights_once_each(monkeypatch: Any) -> None:
    """A Cancel of many messages of the minute being delivered asks ``in_flight_of`` once and
    then ``seq in c`` per target (``CancelClaims.claim``). With the flights not entered yet
    searched at each lookup, a CancelBatch of 1,000 in a minute with 200,000 out searched
    every flight 1,000 times (seconds under the scheduler's lock; 64 targets on the event
    loop ~0.1 s): a question about n targets enters up to n x ENTER_MAX, so the lookups
    search nothing once it has caught up."""
    led = burst_of_flights(monkeypatch)
    targets = list(range(10_001, 10_501))  # none out: each lookup looks at everything
    containers = led.in_flight_of([7], len(targets))
    assert not any(q in c for q in targets for c in containers)
    assert CountedKeys.searches == 0 and led.entered == 10_000
    assert all(any(q in c for c in containers) for q in range(1, 10_001, 97))
    # one target asks as a Get does: a bounded share entered, the rest searched
    led2 = AckLedger()
    led2.hand_out(
        [
            Flight(8, 1, 1, 0, CountedKeys(range(k, k + 50)), [0] * 50, [0] * 50, [1] * 50, [b""] * 50)
            for k in range(1, 10_001, 50)
        ],
        TIMEOUT,
    )
    assert led2.in_flight_of([8], 1) and led2.entered == 1_000
