"""Idempotent send: a message whose id belongs to a message already written is not written
again; its sender gets the original receipt with ``duplicate = true`` (issue 13, item 4).

Where an id can be found, in the order it is looked in:

1. the message-id index (segments/idindex.py), for everything the iterate service has
   copied; a hit is a duplicate if that message is still pending, or if it was closed
   (delivered, dead-lettered, cancelled) less than ``window_ms`` ago (Engine.duplicates_among);
2. ``_recent`` (server/recent_ids.py: one table of fixed-width slots, no Python object per
   id): ids this server wrote that the index may not hold yet (the iterate service lags
   the message log by milliseconds, or by seconds in a burst); an id leaves once the index
   holds it and no lookup that started before that is still running;
3. ``_writing``: client-chosen ids being written right now (one set for every batch being
   written); a second batch with one of them waits for the first and then answers its
   receipt (or writes, if the first failed). A batch's ids are entered there only once
   another batch's lookup begins while it is being written (``_flying`` until then): with
   one batch at a time (a generated stub's SendBatch, one call in flight) no id is ever
   entered. A future to wait on is made only for a batch some other batch waits for (the
   rare case of one id sent twice at once): the set costs a batch of 100 ids ~7 us less
   on the event loop than an id -> future entry per id did (docs/benchmarks.md, "Ingest
   per thread, and the event loop's two cuts").

Ids the server generates for a batch are never looked up for it, and never wait in
``_writing``: nobody can send one again before its batch is answered, and by then it is in
``_recent``. They do go into ``_recent``, so a re-send that carries one (copied from a
receipt) is a duplicate like any other.

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
from dataclasses import dataclass, field

from qdelay.server import allocator
from qdelay.server.engine import Engine, Receipt
from qdelay.server.recent_ids import RecentIds
from qdelay.server.validation import Made


@dataclass(slots=True, eq=False)
class Claim:
    """The ids a batch is about to write, in batch order (settled by ``written`` or
    ``failed``), and the ones of them it holds, with one future for the whole batch, which
    other batches with one of those ids wait on: in ``Deduper._flying`` until another
    batch's lookup enters its ids in ``Deduper._writing`` (then in ``Deduper._entered``);
    the future is made by the first batch that waits for it."""

    ids: list[str]
    future: asyncio.Future | None
    held: list[str] = field(default_factory=list)
    entered: bool = False  # its held ids are in ``Deduper._writing``


TIDY_AFTER = 1.0  # seconds: how soon ids are forgotten once sends stop coming


class Deduper:
    def __init__(self, engine: Engine, window_ms: int) -> None:
        self.engine = engine
        self.window_ms = window_ms
        # ids written and maybe not yet indexed -> their newest write; the client-chosen ids
        # being written (a set; their claims, each with the future other batches wait on,
        # in ``_entered``). Both are filled, searched and emptied a batch at a time (C
        # loops, the cost of the batch) however far the index lags.
        self._recent = RecentIds()
        self._writing: set[str] = set()  # the held ids of the claims in ``_entered``
        self._entered: dict[int, Claim] = {}
        # claims being written whose ids are not in ``_writing`` (yet): entered by the next
        # lookup that begins while they are (``_enter_flying``), or just dropped when written
        self._flying: dict[int, Claim] = {}
        self._active: dict[int, int] = {}  # lookup token -> indexed sequence when it began
        self._token = 0
        self._tidy: asyncio.TimerHandle | None = None  # a prune once sends stop coming
        self._epoch: int | None = None
        self._floor = 0
        self.duplicates = 0

    @property
    def recent(self) -> RecentIds:
        """The ids written and maybe not yet indexed (read-only use: the metrics' sizes)."""
        return self._recent

    @property
    def enabled(self) -> bool:
        return self.window_ms > 0 and self.engine.ids is not None

    async def check(self, ids: list[str], generated: Made | None = None) -> tuple[dict[int, Receipt], Claim]:
        """(duplicates: batch index -> original receipt, claim on the other ids).

        ``ids`` are distinct (validation refuses a batch that repeats one). ``generated``
        are the ones the server made for this batch: never a re-send, so not looked up.
        Looking them up would be wrong as well as slow: a client may have chosen, before,
        an id of the same shape (copied from a receipt), and the server's new message would
        then be answered as that one's duplicate and never written."""
        if generated:
            if len(generated) == len(ids):
                return {}, Claim(ids, None)
            chosen = [k for k, m in enumerate(ids) if m not in generated]
            some, claim = await self.check([ids[k] for k in chosen])
            # (no await since that claim) the generated ids join it, and its ids are put
            # back in batch order: ``written`` gives them sequences in that order
            known = {chosen[k]: r for k, r in some.items()}
            claim.ids = [m for k, m in enumerate(ids) if k not in known] if known else ids
            return known, claim
        engine = self.engine
        if self._epoch != engine.epoch:  # first use, or a new role: the index must catch up
            self._epoch, self._floor = engine.epoch, engine.wal.committed_sequence
        if engine.iterate.sequence < self._floor:
            await asyncio.to_thread(engine.iterate.wait_for, self._floor, 5.0)
        self._prune()
        self._token += 1
        token = self._token
        self._active[token] = begun = engine.iterate.sequence
        try:
            # the engine's moves not yet copied, read before the index (MovedIds.get_many: a
            # move dropped after this look is one the index holds by then); read after it
            # alone, another lookup could drop a move the iterate service copied meanwhile,
            # which the index, read before the copy, answered with the old message
            moved_before = engine.moved_since(ids, begun)
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
            while True:
                if self._flying:  # batches claimed since the last look (none while alone)
                    self._enter_flying()
                if not writing or writing.isdisjoint(ids):
                    break
                # one of these ids is being written. asyncio.wait, not gather: a cancelled
                # waiter must not cancel the writer's future, which other batches wait on
                # too (they were cancelled with it) and which ``written`` then settles
                await asyncio.wait(self._futures_holding(writing.intersection(ids)))
        finally:
            del self._active[token]
        return self._decide(ids, begun, found, moved_before)

    def check_now(self, ids: list[str], generated: Made | None = None) -> tuple[dict[int, Receipt], Claim] | None:
        """:meth:`check` when it need not wait, on the loop without an await (a SendStream
        batch then needs no task: DelayService._start_write); None, with nothing claimed,
        where it would wait: the first lookup of a role (the index catching up), an id the
        index holds (the message's state is read on a worker thread), an id another batch
        is writing, or a batch of generated and chosen ids together. The same answer as
        :meth:`check` otherwise (no lookup of another batch can run in between, so none
        needs the floor this one began at kept: no token in ``_active``)."""
        if generated:
            return ({}, Claim(ids, None)) if len(generated) == len(ids) else None
        engine = self.engine
        if self._epoch != engine.epoch or engine.iterate.sequence < self._floor:
            return None
        self._prune()
        begun = engine.iterate.sequence
        moved_before = engine.moved_since(ids, begun)
        index = engine.ids
        if index is not None and index.failed is None:
            hits = index.get_many(ids)
            if hits.count(None) != len(hits):
                return None
        if self._flying:
            self._enter_flying()
        writing = self._writing
        if writing and not writing.isdisjoint(ids):
            return None
        return self._decide(ids, begun, {}, moved_before)

    def _decide(
        self, ids: list[str], begun: int, found: dict[int, Receipt], moved_before: dict[int, Receipt]
    ) -> tuple[dict[int, Receipt], Claim]:
        """The end of a lookup begun at index sequence ``begun``, with what the index held
        (``found``) and the moves read before it: the duplicates, and the claim on the rest."""
        engine = self.engine
        # (no await from here to the claim: no other batch can claim one of these ids between)
        # what the index held when this lookup began is in ``found``; the rest is recent
        recent = self._recent.find(ids, begun) if len(self._recent) else None
        if recent:
            found = {**found, **recent} if found else recent
        # and the engine's moves not yet copied: ``rescheduled`` is told only of a Reschedule
        # that answered (one whose caller was cancelled, or whose sync replication timed out,
        # moved the message all the same), and the index still maps the id to the old one
        # (read before the index, and again now for the moves entered while this lookup ran)
        moved = engine.moved_since(ids, begun)
        if moved or moved_before:
            found = dict(found)
            for k, r in (*moved_before.items(), *moved.items()):
                have = found.get(k)
                if have is None or have.sequence < r.sequence:
                    found[k] = r
        claimed = [m for k, m in enumerate(ids) if k not in found] if found else ids
        self.duplicates += len(found)
        return found, self._claim(claimed)

    def _claim(self, claimed: list[str]) -> Claim:
        claim = Claim(claimed, None, claimed)
        if claimed:
            self._flying[id(claim)] = claim
        return claim

    def _enter_flying(self) -> None:
        """Enter the ids of the claims being written in ``_writing``, for a lookup that must
        not claim one of them (on the loop, no await: the claims were made with no await
        between their look and the claim, so no id is in two of them)."""
        for key, claim in self._flying.items():
            self._writing.update(claim.held)
            claim.entered = True
            self._entered[key] = claim
        self._flying.clear()

    def _futures_holding(self, busy: set[str]) -> list[asyncio.Future]:
        """The futures of the entered claims holding one of ``busy`` (made for them now if no
        batch waited for them before)."""
        loop = asyncio.get_running_loop()
        futures = []
        for claim in self._entered.values():
            if not busy.isdisjoint(claim.held):
                if claim.future is None:
                    claim.future = loop.create_future()
                futures.append(claim.future)
        return futures

    def written(self, claim: Claim, first: int, dues: list[int]) -> None:
        """The claimed ids were written with sequences from ``first``, due at ``dues``."""
        if claim.ids:
            self._remember(first, claim.ids, dues)
        self._release(claim)
        if claim.future is not None:
            claim.future.set_result(True)

    def failed(self, claim: Claim) -> None:
        self._release(claim)
        if claim.future is not None and not claim.future.done():
            claim.future.set_result(False)

    def _release(self, claim: Claim) -> None:
        if not claim.entered:  # never entered in ``_writing``
            self._flying.pop(id(claim), None)
            return
        # each held id is this claim's alone: check() claims only ids no other batch is
        # writing, with no await between its look and its claim
        del self._entered[id(claim)]
        self._writing.difference_update(claim.held)

    def rescheduled(self, receipt: Receipt) -> None:
        """A Reschedule wrote the id's message again: its new receipt is the one a retried
        send of that id is answered with (until the index holds it)."""
        self._remember(receipt.sequence, [receipt.message_id], [receipt.deliver_at_ms])

    def rescheduled_many(self, receipts: list[Receipt]) -> None:
        """``rescheduled`` of a RescheduleBatch's moves, whose new messages have consecutive
        sequences (one append), remembered as one batch when their ids are distinct (the
        table's rule; two messages of one reused id moved together are each their own)."""
        ids = [r.message_id for r in receipts]
        if len(set(ids)) < len(ids):
            for r in receipts:
                self.rescheduled(r)
            return
        self._remember(receipts[0].sequence, ids, [r.deliver_at_ms for r in receipts])

    def _remember(self, first: int, ids: list[str], dues: list[int]) -> None:
        floor = self._floor_now()
        self._recent.forget(floor)  # (batches of generated ids alone are never checked: no prune there)
        self._recent.add(first, ids, dues, floor)
        if self._tidy is None:
            self._tidy = asyncio.get_running_loop().call_later(TIDY_AFTER, self._tidy_up)

    def _tidy_up(self) -> None:
        """Prune without a send to do it (after the last ones, the index catches up while
        nobody checks): the ids of a burst would otherwise stay in memory until the next."""
        self._tidy = None
        self._prune()
        if len(self._recent):
            self._recent.trim(self._floor_now())  # a table larger than this second's peak needs
            self._tidy = asyncio.get_running_loop().call_later(TIDY_AFTER, self._tidy_up)
            return
        self._recent.trim(self._floor_now(), idle=True)  # sends stopped: the smallest table
        if not self._entered and not self._flying:  # a burst forgotten: hand the freed heap back (RSS)
            allocator.trim()

    def _floor_now(self) -> int:
        """The sequence up to which every lookup running now finds ids in the index."""
        floor = self.engine.iterate.sequence
        return min(floor, *self._active.values()) if self._active else floor

    def _prune(self) -> None:
        """Forget recent ids the index holds, unless a lookup begun before it got them runs."""
        self._recent.forget(self._floor_now())
