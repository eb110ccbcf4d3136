"""server/dedupe.py's own bookkeeping, on a stand-in engine: ids written and not yet indexed
are recognised (the newest write of an id answers), forgotten once the index holds them,
and a batch with an id being written waits for that write."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from qdelay.server.dedupe import Deduper
from qdelay.server.engine import Receipt


class _Index:
    failed = None

    def get_many(self, ids):
        return [None] * len(ids)  # nothing indexed: only the deduper's own memory answers


def _engine():
    iterate = SimpleNamespace(sequence=0, wait_for=lambda seq, timeout: True)
    return SimpleNamespace(
        epoch=0,
        wal=SimpleNamespace(committed_sequence=0),
        iterate=iterate,
        ids=_Index(),
        duplicates_among=lambda ids, hits, window: {},
        moved_since=lambda ids, floor: {},
    )


def test_recent_batches_answer_the_newest_receipt_and_leave_once_indexed():
    async def main():
        engine = _engine()
        d = Deduper(engine, 600_000)
        dups, claim = await d.check(["a", "b", "c"])
        assert dups == {} and claim.ids == ["a", "b", "c"]
        d.written(claim, 10, [100, 200, 300])
        d.rescheduled(Receipt("b", 900, 14))  # b written again later: its new receipt answers
        dups, claim = await d.check(["x", "b", "a"])
        assert dups == {1: Receipt("b", 900, 14), 2: Receipt("a", 100, 10)} and claim.ids == ["x"]
        d.written(claim, 15, [50])
        engine.iterate.sequence = 12  # the index holds a, b@11, c: the first batch leaves
        dups, claim = await d.check(["a", "b", "x"])
        assert dups == {1: Receipt("b", 900, 14), 2: Receipt("x", 50, 15)} and claim.ids == ["a"]
        d.failed(claim)
        engine.iterate.sequence = 15
        dups, claim = await d.check(["a", "b", "x"])
        assert dups == {} and len(d._recent) == 0 and d.duplicates == 4

    asyncio.run(main())


def test_a_batch_with_an_id_being_written_waits_for_that_write():
    async def main():
        d = Deduper(_engine(), 600_000)
        _dups, first = await d.check(["p", "q"])
        second = asyncio.ensure_future(d.check(["r", "q"]))
        await asyncio.sleep(0.01)
        assert not second.done()  # q is being written by the first batch
        d.written(first, 20, [1, 2])
        dups, claim = await second
        assert dups == {1: Receipt("q", 2, 21)} and claim.ids == ["r"]
        third = asyncio.ensure_future(d.check(["r"]))
        await asyncio.sleep(0.01)
        d.failed(claim)  # the write of r failed: the waiting batch writes r itself
        dups, claim = await third
        assert dups == {} and claim.ids == ["r"]
        # r is being written by the third alone: entered for a lookup that began meanwhile
        # (below), not before (no other batch looked while it was being written)
        assert d._writing == set() and [c.ids for c in d._flying.values()] == [["r"]]
        fourth = asyncio.ensure_future(d.check(["r", "s"]))
        await asyncio.sleep(0.01)
        assert not fourth.done() and d._writing == {"r"} and not d._flying
        d.written(claim, 30, [3])
        dups, claim = await fourth
        assert dups == {0: Receipt("r", 3, 30)} and claim.ids == ["s"]
        d.written(claim, 31, [4])
        assert d._writing == set() and not d._flying and not d._entered

    asyncio.run(main())


def test_batches_one_at_a_time_enter_no_id_and_make_no_future():
    """A generated stub's SendBatch, one call in flight: each batch's claim is dropped when
    written, nothing entered in ``_writing`` and no future made for nobody to wait on."""

    async def main():
        d = Deduper(_engine(), 600_000)
        for k in range(3):
            _dups, claim = await d.check([f"a{k}", f"b{k}"])
            assert claim.future is None and d._writing == set() and len(d._flying) == 1
            d.written(claim, 10 + 2 * k, [1, 2])
            assert not d._flying
        dups, _claim = await d.check(["a1", "z"])
        assert dups == {0: Receipt("a1", 1, 12)}

    asyncio.run(main())


def test_batches_written_together_make_no_future_unless_one_waits():
    """Batches in flight together (a SendStream's 16): each lookup enters the batches claimed
    since the last one in the set of ids being written, but a future is made only for a
    batch another one waits for; every id leaves the set when its batch is written or
    failed."""

    async def main():
        d = Deduper(_engine(), 600_000)
        claims = []
        for k in range(4):
            _dups, claim = await d.check([f"m{k}", f"n{k}"])
            claims.append(claim)
        assert d._writing == {"m0", "n0", "m1", "n1", "m2", "n2"}  # entered by the later lookups
        assert all(c.future is None for c in claims)
        waiting = asyncio.ensure_future(d.check(["n1", "z"]))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        assert claims[1].future is not None and [c.future for c in claims if c is not claims[1]] == [None] * 3
        d.written(claims[0], 10, [1, 2])
        d.failed(claims[2])
        assert d._writing == {"m1", "n1", "m3", "n3"}  # the fourth entered by the waiting lookup
        await asyncio.sleep(0.01)
        assert not waiting.done()
        d.written(claims[1], 12, [3, 4])
        dups, claim = await waiting
        assert dups == {0: Receipt("n1", 4, 13)} and claim.ids == ["z"]
        d.written(claims[3], 14, [5, 6])
        d.written(claim, 16, [7])
        assert d._writing == set() and not d._entered and not d._flying

    asyncio.run(main())


def test_a_cancelled_waiter_leaves_the_write_it_waited_for_and_the_other_waiters_alone():
    """A batch waiting for another batch's write of one of its ids is cancelled (its
    caller's deadline): the write it waited for still settles (its ``written`` does not
    raise), and a third batch waiting for the same write is answered, not cancelled.
    (``asyncio.gather`` cancelled the claim's shared future with the waiter.)"""

    async def main():
        d = Deduper(_engine(), 600_000)
        _dups, first = await d.check(["p", "q"])
        second = asyncio.ensure_future(d.check(["q", "r"]))
        third = asyncio.ensure_future(d.check(["q", "s"]))
        await asyncio.sleep(0.01)
        assert not second.done() and not third.done()
        second.cancel()
        await asyncio.sleep(0.01)
        assert not third.done()  # still waiting for the first batch's write, not cancelled
        d.written(first, 10, [1, 2])
        dups, claim = await third
        assert dups == {0: Receipt("q", 2, 11)} and claim.ids == ["s"]
        d.written(claim, 12, [3])
        assert second.cancelled()
        assert d._writing == set() and not d._entered and not d._flying

    asyncio.run(main())
