"""The ids written and not yet in the id index, for idempotent send (server/dedupe.py): id ->
(sequence, due time) of its newest write, without a Python object per id.

Why not a dict of id -> batch: the iterate service can lag the message log by hundreds of
thousands of messages during a burst (the memory scenario of bench.compare: 600,000 at
100,000 msgs/s), and each id then kept its str and its due time alive as small objects.
Freed seconds later, they left pymalloc's arenas pinned by the few long-lived objects made
meanwhile: ~75 B of RSS per message sent, for good (docs/benchmarks.md, "Memory per pending
message and the dedupe bookkeeping").

Here every id is a fixed-width slot of one bytearray (a large buffer: its own mapping, given
back whole when it is replaced) and each batch keeps one string, its ids joined by a line
feed (ids are printable ASCII), only to confirm a match: a slot holds the id's 64-bit hash
(XXH3 with a random per-process seed), not the id. Layout and probing are the native
codec's (segments/_codec.c ``recent_put`` / ``recent_find`` / ``recent_rehash``, twins here).

A slot whose sequence is at most the caller's ``floor`` (the index holds it, and no lookup
that began before is still running) is dead: lookups ignore it and puts reuse it. A batch's
line leaves once its last sequence is at most the floor; the table is rebuilt (live slots
only) when it is three quarters used, at the size the most ids held at once lately need.
When every slot is dead (the index caught up) a table of at most KEEP_SLOTS is zeroed in
place and kept: the iterate service catches up every few milliseconds under steady sends,
and a new small table grown again by doublings each time cost ~7 us a SendBatch of 100 (a
fresh zeroed buffer and a rehash per doubling). A larger one (a burst's: 2 M slots, 64 MiB
at 1 M ids behind) is given back at once, and made smaller as soon as it is mostly dead.
:meth:`RecentIds.trim`, which the deduper calls about once a second, also makes smaller a
table twice the size its recent peak needs, or more.
"""

from __future__ import annotations

import collections
import operator
import os
import struct
import sys

import numpy as np
import xxhash

from qdelay.segments import native
from qdelay.server.engine import Receipt

SLOT = 32  # bytes: hash u64, sequence i64 (0: empty), due i64, first sequence of its batch i64
_SLOT = struct.Struct("<Qqqq")
MIN_SLOTS = 1024
KEEP_SLOTS = 1 << 16  # the largest table kept when it empties (2 MiB), and sized for by a past peak
_I64_MAX = 2**63 - 1


def _slots(table: bytes | bytearray) -> int:
    n = len(table) // SLOT
    if len(table) % SLOT or n < 1 or n & (n - 1):
        raise ValueError("recent ids: the table is not a power of two of 32-byte slots")
    return n


def _all_str(ids: list, what: str) -> None:
    if not all(isinstance(m, str) for m in ids):
        raise TypeError(f"{what}: ids must be str")


def recent_put_py(table: bytearray, seed: int, floor: int, ids: list[str], first: int, dues: list[int]) -> int:
    """The Python twin of the native ``recent_put``: ids[i] written with sequence
    ``first + i``, due at ``dues[i]``; how many empty slots were taken."""
    if not isinstance(table, bytearray) or not isinstance(ids, list) or not isinstance(dues, list):
        raise TypeError("recent_put: a bytearray table and lists of ids and due times")
    n = _slots(table)
    _all_str(ids, "recent_put")
    if len(dues) != len(ids) or first < 1 or floor < 0 or first > _I64_MAX - len(ids):
        raise ValueError("recent_put: one due time per id, sequences from 1, floor >= 0")
    mask, filled = n - 1, 0
    for i, (message_id, due) in enumerate(zip(ids, dues, strict=True)):
        key = message_id.encode()
        due = operator.index(due)
        if not -(2**63) <= due <= _I64_MAX:
            raise OverflowError("recent_put: a due time beyond 64 bits")
        h = xxhash.xxh3_64_intdigest(key, seed)
        at = h & mask
        for _ in range(n):
            seq = _SLOT.unpack_from(table, at * SLOT)[1]
            if seq <= floor:
                break
            at = (at + 1) & mask
        else:
            raise ValueError("recent_put: the table is full")
        filled += seq == 0
        _SLOT.pack_into(table, at * SLOT, h, first + i, due, first)
    return filled


def recent_find_py(table: bytes | bytearray, seed: int, floor: int, ids: list[str]) -> list[tuple[int, int, int, int]]:
    """The Python twin of the native ``recent_find``: (i, sequence, due, first) of every live
    slot whose hash is that of ids[i]."""
    if not isinstance(ids, list):
        raise TypeError("recent_find: ids must be a list")
    n = _slots(table)
    _all_str(ids, "recent_find")
    mask = n - 1
    out = []
    for i, message_id in enumerate(ids):
        h = xxhash.xxh3_64_intdigest(message_id.encode(), seed)
        at = h & mask
        for _ in range(n):
            held, seq, due, first = _SLOT.unpack_from(table, at * SLOT)
            if seq == 0:
                break
            if seq > floor and held == h:
                out.append((i, seq, due, first))
            at = (at + 1) & mask
    return out


def recent_rehash_py(old: bytes | bytearray, new: bytearray, floor: int) -> int:
    """The Python twin of the native ``recent_rehash``: the live slots of ``old`` copied into
    the empty table ``new`` by their stored hash; how many."""
    if not isinstance(new, bytearray):
        raise TypeError("recent_rehash: the new table must be a bytearray")
    n_old, n = _slots(old), _slots(new)
    if floor < 0:
        raise ValueError("recent_rehash: floor >= 0")
    mask, live = n - 1, 0
    for k in range(n_old):
        h, seq, _due, _first = slot = _SLOT.unpack_from(old, k * SLOT)
        if seq <= floor:
            continue
        at = h & mask
        for _ in range(n):
            if _SLOT.unpack_from(new, at * SLOT)[1] == 0:
                break
            at = (at + 1) & mask
        else:
            raise ValueError("recent_rehash: the new table is full")
        _SLOT.pack_into(new, at * SLOT, *slot)
        live += 1
    return live


def _size_for(count: int) -> int:
    """Slots for ``count`` live ids: a power of two, at most half full."""
    n = MIN_SLOTS
    while n < 2 * count:
        n *= 2
    return n


class RecentIds:
    """id -> (sequence, due) of its newest write among the batches added and not yet
    forgotten; one owner (the deduper, on the event loop)."""

    def __init__(self) -> None:
        self._seed = int.from_bytes(os.urandom(8), "little")
        self._table = bytearray(MIN_SLOTS * SLOT)
        self._used = 0  # slots taken since the table was made (live or dead)
        self._lines: dict[int, str] = {}  # a batch's first sequence -> its ids joined by "\n"
        self._order: collections.deque[tuple[int, int, int]] = collections.deque()  # (last, first, count)
        self._count = 0  # ids of the batches in _order (at least the live slots)
        self._peak = 0  # the most ids held at once since the last trim(): what a table is sized for

    def __len__(self) -> int:
        """How many ids are remembered (those of batches not yet forgotten)."""
        return self._count

    @property
    def slots(self) -> int:
        return len(self._table) // SLOT

    @property
    def nbytes(self) -> int:
        """Bytes held: the table, and each remembered batch's joined ids (a scrape's figure:
        one pass over the batches)."""
        return len(self._table) + sum(map(sys.getsizeof, list(self._lines.values())))

    def add(self, first: int, ids: list[str], dues: list[int], floor: int) -> None:
        """ids[i] written with sequence ``first + i``, due at ``dues[i]`` (ids printable
        ASCII, distinct); slots at or below ``floor`` may be reused."""
        codec = native.codec
        if 4 * (self._used + len(ids)) > 3 * self.slots:
            self._rebuild(_size_for(max(self._count + len(ids), min(self._peak, KEEP_SLOTS // 2))), floor)
        put = codec.recent_put if codec is not None else recent_put_py
        self._used += put(self._table, self._seed, floor, ids, first, dues)
        self._lines[first] = "\n".join(ids)
        self._order.append((first + len(ids) - 1, first, len(ids)))
        self._count += len(ids)
        if self._count > self._peak:
            self._peak = self._count

    def find(self, ids: list[str], floor: int) -> dict[int, Receipt]:
        """ids position -> the receipt of that id's newest write above ``floor``."""
        codec = native.codec
        hits = (codec.recent_find if codec is not None else recent_find_py)(self._table, self._seed, floor, ids)
        found: dict[int, Receipt] = {}
        split: dict[int, list[str]] = {}
        for k, seq, due, first in hits:
            line = self._lines.get(first)
            if line is None:  # (cannot be: a batch leaves only once every slot of it is dead)
                continue
            written = split.get(first)
            if written is None:
                written = split[first] = line.split("\n")
            if written[seq - first] != ids[k]:  # another id with the same 64-bit hash
                continue
            had = found.get(k)
            if had is None or had.sequence < seq:
                found[k] = Receipt(ids[k], due, seq)
        return found

    def forget(self, floor: int) -> None:
        """Forget the batches wholly at or below ``floor``; with nothing left, the table starts
        over empty at its size (see the module's docstring; :meth:`trim` shrinks it)."""
        order, lines = self._order, self._lines
        if not order or order[0][0] > floor:
            return
        while order and order[0][0] <= floor:
            _last, first, count = order.popleft()
            del lines[first]
            self._count -= count
        if not order:
            # every slot is dead; zeroed, none is probed past again (lookups stop at an
            # empty slot) and the used count starts over. A burst's table goes back at once.
            # The zeroing pays for itself: it leaves the table in this core's cache, where
            # the next ~30 batches' puts and lookups land at random. Starting over without
            # it (the floor as a "base" at or below which a slot counts as empty) saved
            # forget ~0.01 us a message and cost add and find ~0.03 (docs/benchmarks.md,
            # "The event loop's metrics and the ids being written").
            if self.slots <= KEEP_SLOTS:
                np.frombuffer(self._table, dtype=np.uint8).fill(0)
            else:
                self._table = bytearray(MIN_SLOTS * SLOT)
            self._used = 0
            self._lines = {}  # a dict keeps its table however many keys leave
        elif self.slots > KEEP_SLOTS and 8 * self._count < self.slots:
            self._rebuild(_size_for(self._count), floor)  # a burst's table, mostly dead: smaller now

    def trim(self, floor: int, idle: bool = False) -> None:
        """Give memory back: a table at least twice the size that the most ids held at once
        since the last trim need (``idle``: that are held now) is rebuilt at that size.
        The deduper calls this about once a second, and with ``idle`` once sends stopped."""
        want = _size_for(self._count if idle else max(self._count, self._peak))
        self._peak = self._count
        if self.slots >= 2 * want:
            if self._order:
                self._rebuild(want, floor)
            else:
                self._table, self._used = bytearray(want * SLOT), 0

    def _rebuild(self, slots: int, floor: int) -> None:
        codec = native.codec
        table = bytearray(slots * SLOT)
        rehash = codec.recent_rehash if codec is not None else recent_rehash_py
        self._used = rehash(self._table, table, floor)
        self._table = table
