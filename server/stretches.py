"""Batches handed out together and acknowledged in stretches: the bookkeeping of what is
still unacknowledged, with no dictionary operation per delivery in the usual case.

Both the scheduler's ack ledger (``server/ledger.py``: a group's flights, keyed by
sequence) and a Subscribe stream's credit (``server/consumers.py``: its leases, keyed by
ack id) hand out deliveries in batches and hear back acks as consumers send them: the
ids of what one response carried, in order. Registering every delivery in a dictionary
and popping it on its ack was, for each group of a fan-out, the largest per-delivery cost
after the delivery itself. Here a batch is registered once (``Stretches.add``); an ack
whose ids are a stretch of a batch, beginning where the last stretch ended (or at its
start), is matched by comparing lists (in C); anything else (acks out of order, partly
unknown, a release of one delivery, "is this one still out?") uses an index of key ->
batch, built on first need and kept up to date while it is asked for, dropped once it has
not been for a while (keeping it costs what the batches save; rebuilding it costs one
dictionary operation per key still out).

No I/O, no lock: the owner's lock or thread guards it.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Generic, TypeVar

K = TypeVar("K", bound=Hashable)

_ONES = memoryview(b"\x01" * 65536)  # to mark a stretch of a batch gone at once

# an index not asked for while this many keys (or 4x those out) were added or taken is
# dropped (tests lower it to exercise both paths)
INDEX_IDLE_MIN = 65536


class Batch(Generic[K]):
    """Keys handed out together. ``gone`` marks the positions no longer out; None while
    every position still is (or none is: ``left`` says which)."""

    __slots__ = ("keys", "left", "gone", "resume", "_pos")

    def __init__(self, keys: list[K]) -> None:
        self.keys = keys
        self.left = len(keys)  # positions still out
        self.gone: bytearray | None = None  # per position: 1 once no longer out
        self.resume = 0  # the position ``Stretches.starts`` lists it at (-1: none)
        self._pos: dict[K, int] | None = None  # key -> position, built when first needed

    def index(self, key: K) -> int:
        if self._pos is None:
            self._pos = dict(zip(self.keys, range(len(self.keys))))
        return self._pos[key]

    def live_at(self, i: int) -> bool:
        if self.gone is None:
            return self.left > 0
        return not self.gone[i]

    def live_keys(self) -> list[K]:
        """The keys still out."""
        if self.gone is None:
            return self.keys if self.left else []
        return [q for q, g in zip(self.keys, self.gone, strict=True) if not g]

    def live_positions(self) -> list[int]:
        if self.gone is None:
            return list(range(len(self.keys))) if self.left else []
        return [i for i, g in enumerate(self.gone) if not g]

    def stretch_live(self, i: int, k: int) -> bool:
        """Every position of [i, i + k) still out."""
        if self.gone is None:
            return self.left == len(self.keys)
        return self.gone.find(1, i, i + k) < 0

    def _mark_gone(self, i: int, k: int) -> None:
        """Positions [i, i + k) are no longer out (all were)."""
        self.left -= k
        if self.left == 0:
            self.gone = None  # all gone: ``left`` says it
            return
        gone = self.gone
        if gone is None:
            gone = self.gone = bytearray(len(self.keys))
        if k == 1:
            gone[i] = 1
            return
        while k > 0:  # (a stretch longer than _ONES in pieces)
            m = min(k, len(_ONES))
            gone[i : i + m] = _ONES[:m]
            i += m
            k -= m


B = TypeVar("B", bound=Batch)


def _same_keys(keys: list[K], i: int, batch_keys: list[K], p: int, k: int) -> bool:
    """``keys[i:i+k]`` are ``batch_keys[p:p+k]`` (no slices when both are whole)."""
    if i == 0 and p == 0 and k == len(keys) == len(batch_keys):
        return keys == batch_keys
    return batch_keys[p : p + k] == keys[i : i + k]


class Taken(Generic[B, K]):
    """Keys of one batch an ack took: ``keys``, at positions ``start`` onwards when they
    are a stretch of it (else ``start`` is None)."""

    __slots__ = ("batch", "keys", "start")

    def __init__(self, batch: B, keys: list[K], start: int | None) -> None:
        self.batch = batch
        self.keys = keys
        self.start = start


class Stretches(Generic[B, K]):
    """The batches of one owner (a group's flights, a stream's leases) with keys still out.
    A key is out in at most one batch at a time (a key handed out again comes in a new
    batch after it left the old one)."""

    __slots__ = ("batches", "starts", "live", "_index", "_idle")

    def __init__(self) -> None:
        self.batches: set[B] = set()  # batches with keys still out
        # key -> (batch, position) where an ack's stretch is expected to begin: each
        # batch's first position, then the position after each stretch taken
        self.starts: dict[K, tuple[B, int]] = {}
        self.live = 0  # keys out
        self._index: dict[K, B] | None = None  # key -> batch, while kept
        self._idle = 0  # keys the index was kept up to date for since it was last asked

    # --- the index --------------------------------------------------------------------------------

    def index(self) -> dict[K, B]:
        """key -> batch of every key out (built if not kept): to ask about many keys."""
        idx = self._index
        if idx is None:
            idx = self._index = {}
            for b in self.batches:
                idx.update(zip(b.live_keys(), itertools.repeat(b)))
        self._idle = 0
        return idx

    def has_index(self) -> bool:
        return self._index is not None

    def _kept(self, n: int) -> dict[K, B] | None:
        """The index if it is kept, counting ``n`` keys maintained for it unasked; None
        (dropped) once that outgrew what a rebuild costs."""
        idx = self._index
        if idx is not None:
            self._idle += n
            if self._idle > max(INDEX_IDLE_MIN, 4 * self.live):
                self._index = idx = None
        return idx

    # --- in and out -------------------------------------------------------------------------------

    def add(self, b: B) -> None:
        """Register a batch whose keys are all out now."""
        self.batches.add(b)
        self.live += b.left
        self.starts[b.keys[0]] = (b, 0)
        b.resume = 0
        idx = self._kept(b.left)
        if idx is not None:
            idx.update(zip(b.keys, itertools.repeat(b)))

    def _gone(self, b: B, i: int, k: int) -> None:
        """Positions [i, i + k) of ``b`` leave (the caller keeps the index)."""
        b._mark_gone(i, k)
        self.live -= k
        if not b.left:
            self.batches.discard(b)
            self._unstart(b)

    def _unstart(self, b: B) -> None:
        """Remove the batch's entry in ``starts``, if it has one (stale ones must not pile
        up where acks are never stretches)."""
        if b.resume >= 0:
            key = b.keys[b.resume]
            got = self.starts.get(key)
            if got is not None and got[0] is b:
                del self.starts[key]
            b.resume = -1

    def take(self, keys: list[K]) -> list[Taken[B, K]]:
        """Take the keys still out among ``keys`` (others are ignored); per batch, the keys
        taken of it, in the order given."""
        out: list[Taken[B, K]] = []
        i = self.take_stretches(keys, list.__getitem__, _same_keys, out)
        if i < len(keys):
            self._take_indexed(keys[i:] if i else keys, out)
        return out

    def take_stretches(
        self,
        ids: list[Any],
        key_at: Callable[[list[Any], int], K | None],
        same: Callable[[list[Any], int, list[K], int, int], bool],
        out: list[Taken[B, K]],
    ) -> int:
        """Take stretches of batches, in order, from the start of ``ids``, as long as they
        are: ``key_at(ids, i)`` is the key ``ids[i]`` names (None: none), ``same(ids, i,
        keys, p, k)`` whether ``ids[i:i+k]`` name ``keys[p:p+k]``. Per stretch, one lookup
        and one comparison of lists (in C), no lookup per key; the keys taken are the
        batch's own (its list when the stretch is all of it). Returns how many ids were
        taken; the caller takes the rest otherwise (``take``). ``ids`` are the keys
        themselves for ``take``; the ack ledger passes ack ids as consumers sent them,
        without making an int per id first."""
        n = len(ids)
        i = 0
        starts = self.starts
        while i < n:
            key = key_at(ids, i)
            if key is None:
                break
            got = starts.get(key)
            if got is None:
                break
            b, p = got
            size = len(b.keys)
            k = min(n - i, size - p)
            if not same(ids, i, b.keys, p, k) or not b.stretch_live(p, k):
                break
            part = b.keys if p == 0 and k == size else b.keys[p : p + k]
            del starts[key]
            b.resume = -1
            self._gone(b, p, k)
            if p + k < size and b.live_at(p + k):
                starts[b.keys[p + k]] = (b, p + k)
                b.resume = p + k
            idx = self._kept(k)
            if idx is not None:
                collections.deque(map(idx.pop, part, itertools.repeat(None)), maxlen=0)
            out.append(Taken(b, part, p))
            i += k
        return i

    def _take_indexed(self, keys: list[K], out: list[Taken[B, K]]) -> None:
        """Keys that are not stretches of batches: each looked up in the index."""
        idx = self.index()
        found = list(map(idx.pop, keys, itertools.repeat(None)))
        start = 0
        for b, run in itertools.groupby(found):
            k = sum(1 for _ in run)
            if b is not None:
                got = keys[start : start + k]
                for q in got:
                    self._gone(b, b.index(q), 1)
                out.append(Taken(b, got, None))
            start += k

    def find(self, key: K) -> tuple[B, int] | None:
        """(batch, position) of a key out, or None."""
        b = self.index().get(key)
        return None if b is None else (b, b.index(key))

    def remove(self, b: B, i: int) -> None:
        """Position ``i`` of ``b`` (out) leaves."""
        idx = self._index
        if idx is not None:
            idx.pop(b.keys[i], None)
        self._gone(b, i, 1)

    def expire(self, b: B) -> list[int]:
        """Every position of ``b`` still out leaves (its deadline passed): those positions.
        Nothing if ``b`` is not registered here (any more)."""
        if not b.left or b not in self.batches:
            return []
        live = b.live_positions()
        idx = self._index
        if idx is not None:
            collections.deque(map(idx.pop, (b.keys[i] for i in live), itertools.repeat(None)), maxlen=0)
        self.live -= len(live)
        b.left = 0
        b.gone = None
        self.batches.discard(b)
        self._unstart(b)
        return live

    # --- questions ----------------------------------------------------------------------------------

    def __contains__(self, key: object) -> bool:
        """Out now. A kept index answers; else the batches are searched (in C, a list's
        ``in`` per batch) rather than an index built for one question."""
        if not self.live:
            return False
        if self._index is not None:
            return key in self.index()
        for b in self.batches:
            if key in b.keys:
                i = b.index(key)
                if b.live_at(i):
                    return True
        return False

    def keys_out(self) -> Iterator[K]:
        """Every key out (batches in no particular order)."""
        for b in self.batches:
            yield from b.live_keys()
