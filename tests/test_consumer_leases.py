"""A Subscribe stream's credit (server/consumers.py): deliveries handed to a subscriber are
kept per slice (a lease), acks in any shape free exactly the ids they name, expired ones
stop counting, and a stream that ends gives back what it left, in hand-over order."""

from __future__ import annotations

from qdelay.server.consumers import ConsumerRegistry
from qdelay.server.deliveries import Deliveries


class Loop:
    """Stands in for the event loop: runs what the registry passes to it at once."""

    def call_soon_threadsafe(self, fn, *args) -> None:
        fn(*args)


def batch(ids: list[str]) -> Deliveries:
    n = len(ids)
    return Deliveries("s", ids, [i.encode() for i in ids], [b"p"] * n, [None] * n, [1] * n, 2, [1] * n, "g")


def test_acks_in_stretches_out_of_order_and_unknown_free_exactly_their_ids():
    reg = ConsumerRegistry(Loop(), ack_timeout_ms=30_000)
    a = reg.register("s", "g", 10, "a")
    b = reg.register("s", "g", 10, "b")
    ids = [f"{q}.1" for q in range(1, 11)]
    reg.deliver("s", "g", batch(ids))
    assert a.unacknowledged() + b.unacknowledged() == 10 and reg.credit("s", "g") == 10
    first, second = (a, b) if a.delivered else (b, a)
    got_first = [x for d in first.inbox for x in d.ack_ids]
    got_second = [x for d in second.inbox for x in d.ack_ids]
    assert sorted(got_first + got_second) == sorted(ids) and len(got_first) == 5
    reg.acked(first, got_first[:2])  # a response's stretch ...
    reg.acked(first, got_first[2:])  # ... then the next
    assert first.unacknowledged() == 0
    reg.acked(second, [got_second[3], "99.1", got_second[0], got_second[0]])  # out of order, unknown, repeated
    assert second.unacknowledged() == 3 and reg.credit("s", "g") == 17
    reg.acked(second, got_second[1:3])  # the stretch between what was acked
    assert second.unacknowledged() == 1
    assert reg.unregister(second) == [got_second[4]]
    assert reg.unregister(first) == []


def test_expired_deliveries_stop_counting_and_later_acks_find_nothing():
    reg = ConsumerRegistry(Loop(), ack_timeout_ms=30_000)
    sub = reg.register("s", "g", 100, "a")
    reg.deliver("s", "g", batch(["1.1", "2.1", "3.1"]))
    reg.deliver("s", "g", batch(["4.1", "5.1"]))
    reg.acked(sub, ["2.1"])
    assert sub.available(0) == 96
    lease = sub.leases[0]
    assert sub.available(lease.expiry) == 98 and sub.expired == 2  # the first slice's 1 and 3
    reg.acked(sub, ["1.1", "3.1", "4.1"])
    assert sub.unacknowledged() == 1
    assert reg.unregister(sub) == ["5.1"]


def test_a_stream_that_ends_gives_back_its_ids_in_hand_over_order():
    reg = ConsumerRegistry(Loop(), ack_timeout_ms=30_000)
    sub = reg.register("s", "g", 100, "a")
    for n in range(4):
        reg.deliver("s", "g", batch([f"{n * 10 + q}.1" for q in range(5)]))
    reg.acked(sub, ["12.1", "0.1", "31.1", "32.1"])
    want = [f"{n * 10 + q}.1" for n in range(4) for q in range(5)]
    for gone in ("12.1", "0.1", "31.1", "32.1"):
        want.remove(gone)
    assert reg.unregister(sub) == want and sub.unacknowledged() == 0


class QueuedLoop:
    """Stands in for a busy event loop: keeps the callbacks until ``run``."""

    def __init__(self) -> None:
        self.calls: list = []

    def call_soon_threadsafe(self, fn, *args) -> None:
        self.calls.append((fn, args))

    def run(self) -> None:
        calls, self.calls = self.calls, []
        for fn, args in calls:
            fn(*args)


def test_batches_handed_over_before_the_loop_runs_reach_it_in_one_callback_in_order():
    """A round's batches for several groups (fan-out) and several rounds' batches, handed
    over while the loop is busy, ask the loop once and arrive in hand-over order; credit
    counts them from the hand-over, not from the push."""
    loop = QueuedLoop()
    reg = ConsumerRegistry(loop, ack_timeout_ms=30_000)
    a = reg.register("s", "g1", 100, "a")
    b = reg.register("s", "g2", 100, "b")
    reg.deliver("s", "g1", batch(["1.1", "2.1"]))
    reg.deliver("s", "g2", batch(["1.1", "2.1"]))
    reg.deliver("s", "g1", batch(["3.1"]))
    assert len(loop.calls) == 1 and not a.inbox and not b.inbox
    assert reg.credit("s", "g1") == 97 and reg.credit("s", "g2") == 98
    loop.run()
    assert [d.ack_ids for d in a.inbox] == [["1.1", "2.1"], ["3.1"]]
    assert [d.ack_ids for d in b.inbox] == [["1.1", "2.1"]]
    reg.deliver("s", "g2", batch(["4.1"]))  # the loop ran: the next hand-over asks again
    assert len(loop.calls) == 1
    assert reg.unregister(b) == ["1.1", "2.1", "4.1"]  # handed over, not yet pushed: given back too
    loop.run()
