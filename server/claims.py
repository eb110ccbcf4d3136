"""Cancel claims: messages a Cancel (or a Reschedule) has claimed and whose tombstone has
not yet passed the iterate service.

Owned by the scheduler thread (``server/scheduler.py``); no I/O. A Cancel's worker thread
does not touch it: it posts its claims on the scheduler's queue and waits for the answer
(``Scheduler.claim_cancels``). While a sequence is claimed the dispatcher never hands it
out and a spilled lane's pass never reads it back; the claim ends when the tombstone has
been appended (``settled``, from ``Scheduler.on_written``) or the Cancel gives it back
(``release``: its tombstone write failed, or its caller went away), which makes the
message deliverable again.

An entry the dispatcher or a read-back pass met while its message was claimed is not
dropped but set aside here (``skip``), still counted as held by its bucket (so the bucket
cannot become done): a release hands it back to be queued again, the tombstone drops it
for good. Without this, a claim released after its entry was skipped would leave the
message undelivered with neither a tombstone nor a DISPATCH record.

A second Cancel (or Reschedule) that finds a message claimed (CLAIM_CANCELLING) cannot
answer yet: the first one's write may still fail and give the claim back, and the message
would then be delivered after an ALREADY_CANCELLED answer (issue 13 item 6). It ``watch``es
the claims instead: its callback runs when every one of them has ended, settled or
released, or its tombstone durable (``written``: answered CLAIM_WRITTEN from then on,
ALREADY_CANCELLED at once), and it claims again then, as if fresh
(``Engine._after_other_claims``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Container, KeysView

from qdelay.server.ledger import Item

# claim answers, one per sequence
CLAIMED = 0
CLAIM_CANCELLING = 1  # another Cancel claimed it already (or an earlier entry of the list)
CLAIM_OUT = 2  # handed out and not acknowledged, or its dead-letter copy is being written
CLAIM_WRITTEN = 3  # another Cancel claimed it and its tombstone is durable (``written``)


def _disjoint(asked: set[int], out: Container[int]) -> bool:
    """No sequence of ``asked`` in ``out``: a set or a dict of sequences compared from the
    smaller side, in C (a set's or a dict's keys view's isdisjoint); any other container
    (a bucket's in-flight index) asked per sequence."""
    if isinstance(out, (set, frozenset)):
        return asked.isdisjoint(out)
    if isinstance(out, dict):
        keys: KeysView[int] = out.keys()
        return keys.isdisjoint(asked)
    return not any(seq in out for seq in asked)


class Watch:
    """A wait for the end of some claims (``CancelClaims.watch``): ``callback`` runs once, on
    the thread applying the scheduler's queue (lock held), when ``left`` has emptied; it must
    not block (the engine's hands the news to its event loop)."""

    __slots__ = ("left", "callback")

    def __init__(self, sequences: list[int], callback: Callable[[], None]) -> None:
        self.left = set(sequences)
        self.callback = callback


class CancelClaims:
    def __init__(self) -> None:
        # the set itself is read by the dispatcher and the read-back passes (membership
        # tests per entry, lock held); only the methods below change it
        self.claimed: set[int] = set()
        # sequence -> group id -> the entry set aside while claimed
        self._skipped: dict[int, dict[int, Item]] = {}
        # claimed sequences whose tombstones are durable (in the message log), not yet settled
        self.durable: set[int] = set()
        # sequence -> the watches waiting for its claim to end (or its tombstone to be durable)
        self._watches: dict[int, list[Watch]] = {}
        # claims settled so far (their tombstones passed): read without the lock by a Get,
        # which looks again if one settled while it looked (``Scheduler.settles``)
        self.settled_total = 0

    def claim(self, sequences: list[int], out: list[Container[int]]) -> list[int]:
        """Claim each sequence unless it is claimed already or is in one of ``out`` (handed
        out, or being dead-lettered); one of CLAIMED, CLAIM_CANCELLING (claimed, its
        tombstone not known durable), CLAIM_WRITTEN (claimed, its tombstone durable),
        CLAIM_OUT each (a repeat within ``sequences`` is CLAIM_CANCELLING)."""
        claimed = self.claimed
        asked = set(sequences)
        # the common batch: no repeat, none claimed, none out -> claimed at once, with set
        # operations in C rather than three membership tests per sequence
        if len(asked) == len(sequences) and claimed.isdisjoint(asked) and all(_disjoint(asked, o) for o in out):
            claimed |= asked
            return [CLAIMED] * len(sequences)
        answers: list[int] = []
        for seq in sequences:
            if seq in claimed:
                answers.append(CLAIM_WRITTEN if seq in self.durable else CLAIM_CANCELLING)
            elif any(seq in o for o in out):
                answers.append(CLAIM_OUT)
            else:
                claimed.add(seq)
                answers.append(CLAIMED)
        return answers

    def skip(self, item: Item) -> bool:
        """Set aside an entry of a claimed message for its group; False if one is set aside
        for that group already (the caller drops this one)."""
        seq, gid = item[0], item[6]
        by_group = self._skipped.setdefault(seq, {})
        if gid in by_group:
            return False
        by_group[gid] = item
        return True

    def release(self, sequences: list[int]) -> list[Item]:
        """Give back claims whose tombstones will not be written (or were not needed); the
        entries set aside meanwhile, to be queued again. One set operation for a batch, and
        the set-aside entries looked up only when there are any."""
        self.claimed.difference_update(sequences)
        if self.durable:
            self.durable.difference_update(sequences)
        if self._watches:
            self._ended(sequences)
        if not self._skipped:
            return []
        out: list[Item] = []
        for seq in sequences:
            got = self._skipped.pop(seq, None)
            if got:
                out.extend(got.values())
        return out

    def settled(self, targets: list[int]) -> list[Item]:
        """The tombstones of ``targets`` passed the iterate service: their bucket knows them
        as cancelled now, the claims are no longer needed; the entries set aside are
        returned to be dropped (``release``'s bookkeeping: only what the caller does with
        them differs). A batch at once: a CancelBatch of 1,000 paid ~0.5 us a tombstone in
        calls of one target each, under the scheduler's lock."""
        self.settled_total += 1
        return self.release(targets)

    def written(self, sequences: list[int]) -> None:
        """The tombstones of ``sequences`` are durable: a claim of one answers CLAIM_WRITTEN
        until it settles. Those no longer claimed (settled already) are left out."""
        now = self.claimed.intersection(sequences)
        if now:
            self.durable |= now
            if self._watches:
                self._ended(now)

    @property
    def watched(self) -> bool:
        return bool(self._watches)

    def watch(self, watch: Watch) -> None:
        """Run ``watch.callback`` once none of its sequences is claimed with its tombstone
        not yet durable: at once if none is now (their claims ended, or their tombstones
        were written, before this was applied), else when the last one does."""
        watch.left.intersection_update(self.claimed)
        watch.left.difference_update(self.durable)
        if not watch.left:
            watch.callback()
            return
        for seq in watch.left:
            self._watches.setdefault(seq, []).append(watch)

    def unwatch(self, watch: Watch) -> None:
        """Forget ``watch`` (its waiter gave up: a timeout, a caller gone)."""
        for seq in watch.left:
            got = self._watches.get(seq)
            if got is not None and watch in got:
                got.remove(watch)
                if not got:
                    del self._watches[seq]
        watch.left.clear()

    def _ended(self, sequences: Collection[int]) -> None:
        for seq in sequences:
            waiting = self._watches.pop(seq, None)
            if waiting:
                for w in waiting:
                    w.left.discard(seq)
                    if not w.left:
                        w.callback()

    def holds(self, seq: int) -> bool:
        return seq in self.claimed

    def holds_written(self, seq: int) -> bool:
        """Claimed, and its tombstone durable (``written``): the claim will not be given back."""
        return seq in self.durable

    def __bool__(self) -> bool:
        return bool(self.claimed)
