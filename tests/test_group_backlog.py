"""A group's backlog after cancels, in process (a real Engine, a simulated clock, the
pipeline driven by hand): a message cancelled after it fell due, while it waits in a
group's ready queue for a consumer or credit, leaves every group's backlog as soon as its
tombstone passes the iterate service, whichever way it was cancelled (Cancel, CancelBatch,
cancel by id, Reschedule), and is never delivered."""

from __future__ import annotations

import asyncio

from simclock import T0, Driver, FakeClock, message


class Sink:
    """Per group credit (none until given); remembers (group, message id) delivered."""

    def __init__(self) -> None:
        self.credit_of: dict[str, int] = {}
        self.got: list[tuple[str, str]] = []

    def credit(self, subject: str, group: str) -> int:
        return self.credit_of.get(group, 0)

    def deliver(self, subject: str, group: str, deliveries) -> None:
        self.got += [(group, d.message_id) for d in deliveries]


def backlog(d: Driver, subject: str) -> dict[str, int]:
    return {g["group"]: g["ready"] + g["on_disk"] for g in d.engine.groups(subject=subject)}


def test_cancels_after_due_leave_every_groups_backlog_at_once(tmp_path):
    clock = FakeClock(T0)
    sink = Sink()
    d = Driver(tmp_path, clock, sink, implicit_group="")
    try:
        for name in ("a", "b"):
            assert asyncio.run(d.engine.ensure_group("s", name))
        receipts = d.send([message("s", T0 + 1_000, f"m{i}") for i in range(8)])
        d.advance(2_000)  # all due: in both groups' ready queues, nobody has credit
        assert backlog(d, "s") == {"a": 8, "b": 8}
        eng = d.engine
        r = receipts

        def run(coro):  # (Cancel and Get wait for the iterate service, not running here)
            d.catch_up()
            return asyncio.run(coro)

        assert run(eng.cancel(r[0].message_id, r[0].deliver_at_ms, r[0].sequence)).name == "CANCELLED"
        batch = [(x.message_id, x.deliver_at_ms, x.sequence) for x in r[1:3]]
        assert [o.name for o in run(eng.cancel_many(batch))] == ["CANCELLED", "CANCELLED"]
        assert run(eng.cancel(r[3].message_id, None, None)).name == "CANCELLED"  # by id
        moved, _new = run(eng.reschedule(r[4].message_id, r[4].deliver_at_ms, r[4].sequence, T0 + 3_600_000))
        assert moved.name == "RESCHEDULED"
        d.catch_up()  # the tombstones pass the iterate service; no dispatch round runs
        assert backlog(d, "s") == {"a": 3, "b": 3}
        sink.credit_of = {"a": 100, "b": 100}
        d.advance(1)
        want = sorted(x.message_id for x in r[5:])
        assert sorted(m for g, m in sink.got if g == "a") == want
        assert sorted(m for g, m in sink.got if g == "b") == want
        assert backlog(d, "s") == {"a": 0, "b": 0}
    finally:
        d.close()
