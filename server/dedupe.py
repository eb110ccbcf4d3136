"""Idempotent send: a message whose id belongs to a message already written is not written
again; its sender gets the original receipt with ``duplicate = true`` (issue 13, item 4).

Where an id can be found, in the order it is looked in:

1. the message-id index (segments/idindex.py), for everything the iterate service has
   copied; a hit is a duplicate if that message is still pending, or if it was closed
   (delivered, dead-lettered, cancelled) less than ``window_ms`` ago (Engine.duplicates_among);
2. ``_recent``: batches this server appended that the index may not hold yet (the iterate
   service lags the message log by milliseconds); a batch leaves once the index holds it
   and no lookup that started before that is still running;
3. ``_writing``: batches being written right now; a second batch with one of their ids
   waits for the first and then answers its receipt (or writes, if the first failed).

All of it runs on the event loop (one owner, no lock) except the state of an index hit,
read on a worker thread. If the index stopped after a write error (a full disk), sends go
on and only ``_recent`` (ids not yet iterated) is consulted until a restart rebuilds the
index (docs/recovery.md row 14): a retry of an older message is then not recognised.

After a restart or a promotion the index may lag the message log by what was committed
before: the first lookups wait until the iterate service has indexed up to that point, so
a retry that arrives right after a restart is still recognised.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
from dataclasses import dataclass

from qdelay.server import allocator
from qdelay.server.engine import Engine, Receipt


@dataclass(slots=True)
class Claim:
    """The ids a batch is about to write (settled by ``written`` or ``failed``); one future
    for the whole batch, which other batches with one of the ids wait on."""

    ids: list[str]
    future: asyncio.Future | None


@dataclass(slots=True)
class _Written:
    """A batch written and maybe not yet indexed: its ids, in sequence order from ``first``,
    and their due times. Every id of it maps to this one object in ``Deduper._recent`` (a
    C loop to fill, no tuple per id); a hit, which is rare, finds its place with index()."""

    first: int
    ids: list[str]
    dues: list[int]

    @property
    def last(self) -> int:
        return self.first + len(self.ids) - 1

    def receipt(self, message_id: str) -> Receipt:
        k = self.ids.index(message_id)
        return Receipt(message_id, self.dues[k], self.first + k)


TIDY_AFTER = 1.0  # seconds: how soon ids are forgotten once sends stop coming


class Deduper:
    def __init__(self, engine: Engine, window_ms: int) -> None:
        self.engine = engine
        self.window_ms = window_ms
        # ids written and maybe not yet indexed -> the batch that wrote them last, and those
        # batches oldest first, for forgetting them; ids being written -> the future settled
        # when their batch is written or failed. Filled, searched and emptied a batch at a
        # time (dict.update, keys() & list, map over pop: C loops, the cost of the batch)
        # however far the index lags.
        self._recent: dict[str, _Written] = {}
        self._order: collections.deque[_Written] = collections.deque()
        # ids whose entry in _recent replaced an older batch's (a reschedule, or a re-send
        # after the window): forgetting a batch that has one checks it is still its own
        self._again: set[str] = set()
        self._writing: dict[str, asyncio.Future] = {}
        self._active: dict[int, int] = {}  # lookup token -> indexed sequence when it began
        self._token = 0
        self._tidy: asyncio.TimerHandle | None = None  # a prune once sends stop coming
        self._epoch: int | None = None
        self._floor = 0
        self.duplicates = 0

    @property
    def enabled(self) -> bool:
        return self.window_ms > 0 and self.engine.ids is not None

    async def check(self, ids: list[str], generated: set[str] | None = None) -> tuple[dict[int, Receipt], Claim]:
        """(duplicates: batch index -> original receipt, claim on the other ids).

        ``ids`` are distinct (validation refuses a batch that repeats one). ``generated``
        are the ones the server made for this batch: never a re-send, so not looked up.
        Looking them up would be wrong as well as slow: a client may have chosen, before,
        an id of the same shape (copied from a receipt), and the server's new message would
        then be answered as that one's duplicate and never written."""
        if generated:
            if len(generated) == len(ids):
                return {}, self._claim(ids)
            chosen = [k for k, m in enumerate(ids) if m not in generated]
            some, claim = await self.check([ids[k] for k in chosen])
            # (no await since that claim) the generated ids join it, and its ids are put
            # back in batch order: ``written`` gives them sequences in that order
            known = {chosen[k]: r for k, r in some.items()}
            claim.ids = [m for k, m in enumerate(ids) if k not in known] if known else ids
            if claim.future is None:
                claim.future = asyncio.get_running_loop().create_future()
            self._writing.update(dict.fromkeys(generated, claim.future))
            return known, claim
        engine = self.engine
        if self._epoch != engine.epoch:  # first use, or a new role: the index must catch up
            self._epoch, self._floor = engine.epoch, engine.wal.committed_sequence
        if engine.iterate.sequence < self._floor:
            await asyncio.to_thread(engine.iterate.wait_for, self._floor, 5.0)
        self._prune()
        self._token += 1
        token = self._token
        self._active[token] = engine.iterate.sequence
        try:
            # on the loop: a miss is answered from the bloom filters (~0.4 us a key); only
            # hits need the message's state, read on a worker thread
            index = engine.ids  # there is one: dedupe is enabled
            if index is not None and index.failed is None:
                hits = index.get_many(ids)
            else:  # the index stopped after a write error (a full disk): only ids written in
                hits = [None] * len(ids)  # the last moments (not yet iterated) are recognised
            found: dict[int, Receipt] = {}
            if hits.count(None) != len(hits):
                found = await asyncio.to_thread(engine.duplicates_among, ids, hits, self.window_ms)
            writing = self._writing
            while writing and not writing.keys().isdisjoint(ids):  # one of these ids is being written
                busy = {writing[m] for m in writing.keys() & ids}
                if not busy:
                    break
                await asyncio.gather(*busy)
        finally:
            del self._active[token]
        # (no await from here to the claim: no other batch can claim one of these ids between)
        recent = self._recent.keys() & ids if self._recent and not self._recent.keys().isdisjoint(ids) else ()
        dups: dict[int, Receipt] = {}
        if found or recent:
            for k, message_id in enumerate(ids):
                hit = found.get(k)
                if hit is None and message_id in recent:
                    hit = self._recent[message_id].receipt(message_id)
                if hit is not None:
                    dups[k] = hit
        claimed = [m for k, m in enumerate(ids) if k not in dups] if dups else ids
        self.duplicates += len(dups)
        return dups, self._claim(claimed)

    def _claim(self, claimed: list[str]) -> Claim:
        fut = asyncio.get_running_loop().create_future() if claimed else None
        if fut is not None:
            self._writing.update(dict.fromkeys(claimed, fut))
        return Claim(claimed, fut)

    def written(self, claim: Claim, first: int, dues: list[int]) -> None:
        """The claimed ids were written with sequences from ``first``, due at ``dues``."""
        if claim.ids:
            self._remember(_Written(first, claim.ids, dues))
        self._release(claim)
        if claim.future is not None:
            claim.future.set_result(True)

    def failed(self, claim: Claim) -> None:
        self._release(claim)
        if claim.future is not None and not claim.future.done():
            claim.future.set_result(False)

    def _release(self, claim: Claim) -> None:
        # each claimed id maps to this claim's future alone: check() claims only ids no
        # other batch is writing, with no await between its look and its claim
        collections.deque(map(self._writing.pop, claim.ids, itertools.repeat(None)), maxlen=0)

    def rescheduled(self, receipt: Receipt) -> None:
        """A Reschedule wrote the id's message again: its new receipt is the one a retried
        send of that id is answered with (until the index holds it)."""
        self._remember(_Written(receipt.sequence, [receipt.message_id], [receipt.deliver_at_ms]))

    def _remember(self, batch: _Written) -> None:
        recent = self._recent
        if recent and not recent.keys().isdisjoint(batch.ids):
            self._again.update(recent.keys() & batch.ids)  # written again: see _prune
        recent.update(dict.fromkeys(batch.ids, batch))
        self._order.append(batch)
        if self._tidy is None:
            self._tidy = asyncio.get_running_loop().call_later(TIDY_AFTER, self._tidy_up)

    def _tidy_up(self) -> None:
        """Prune without a send to do it (after the last ones, the index catches up while
        nobody checks): the ids of a burst would otherwise stay in memory until the next."""
        self._tidy = None
        self._prune()
        if self._order:
            self._tidy = asyncio.get_running_loop().call_later(TIDY_AFTER, self._tidy_up)
        elif self._writing or self._recent:
            return
        else:  # a burst forgotten: its ids were many small blocks glibc would keep (RSS)
            allocator.trim()

    def _prune(self) -> None:
        """Forget recent ids the index holds, unless a lookup begun before it got them runs."""
        floor = self.engine.iterate.sequence
        if self._active:
            floor = min(floor, *self._active.values())
        order, recent, again = self._order, self._recent, self._again
        while order and order[0].last <= floor:
            batch = order.popleft()
            if again and not again.isdisjoint(batch.ids):
                for message_id in batch.ids:  # some were written again since: keep those
                    if recent.get(message_id) is batch:
                        del recent[message_id]
                        again.discard(message_id)
            else:
                collections.deque(map(recent.pop, batch.ids, itertools.repeat(None)), maxlen=0)
        if not order and (recent or again):  # (every id in _recent belongs to a batch in _order)
            self._recent, self._again = {}, set()  # a dict keeps its table however many keys leave
