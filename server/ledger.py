"""The ack ledger: deliveries handed out and not yet acknowledged, their ack deadlines,
and the retries waiting out their backoff.

Owned by the scheduler thread (``server/scheduler.py``); it does no I/O. An ack or a
release names deliveries by their ack ids ("seq.attempt"); the ledger finds their
flights and tells the scheduler what to close (an ack) or offer again (a release, an
expiry). What a closed delivery costs on disk (its DISPATCH record) is the dispatch-log
writer's business, not the ledger's.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import re
from collections.abc import Iterator

import numpy as np

from qdelay.segments import native

# (seq, offset, bucket, due, attempt, subject id, group id): one entry on its way to a lane
Item = tuple[int, int, int, int, int, int, int]

_ACK_IDS = re.compile(r"(?:[0-9]{1,18}\.[0-9]{1,9} )*")  # "seq.attempt" ids, each followed by a space


def ack_ids(seqs: list[int], attempts: list[int]) -> list[str]:
    """The ack id ("seq.attempt") of each delivery: the native codec's ``ack_ids`` (one per
    delivery per group in a burst: the f-string per id was the largest single cost of
    handing a batch out), or :func:`ack_ids_py`."""
    codec = native.codec
    if codec is not None:
        made: list[str] = codec.ack_ids(seqs, attempts)
        return made
    return ack_ids_py(seqs, attempts)


def ack_ids_py(seqs: list[int], attempts: list[int]) -> list[str]:
    """The Python twin of ``native.codec.ack_ids`` (non-negative ints, equally long)."""
    return [f"{q}.{a}" for q, a in zip(seqs, attempts, strict=True)]


def ack_sequences(ack_ids: list[str]) -> list[int]:
    """The sequence part of each ack id ("seq.attempt"; a bare "seq" is accepted too);
    ids that are not numbers are skipped. Well-formed ids (all of them, normally) are
    parsed in one call of the native codec (or its twin, one numpy call): every ack of
    every group passes here; per id, ``int(id.partition(".")[0])`` was a tenth of the ack
    path's cost."""
    codec = native.codec
    parsed: list[int] | None = codec.ack_sequences(ack_ids) if codec is not None else ack_sequences_py(ack_ids)
    if parsed is not None:
        return parsed
    seqs = []
    for ack_id in ack_ids:
        try:
            seqs.append(int(ack_id.partition(".")[0]))
        except ValueError:
            continue
    return seqs


def ack_sequences_py(ack_ids: list[str]) -> list[int] | None:
    """The Python twin of ``native.codec.ack_sequences``: the sequences when every id is
    "digits.digits" (1-18 and 1-9 ASCII digits: no int64 overflow), else None."""
    if not ack_ids:
        return []
    joined = " ".join(ack_ids) + " "
    # one space per id: no id held a space of its own (each matched the pattern alone)
    if not _ACK_IDS.fullmatch(joined) or joined.count(" ") != len(ack_ids):
        return None
    parsed: list[int] = np.fromstring(joined.replace(".", " "), dtype=np.int64, sep=" ")[::2].tolist()
    return parsed


def ack_attempts(ack_ids: list[str]) -> list[tuple[int, int]]:
    """(sequence, attempt) of each well-formed "seq.attempt" id; others are skipped."""
    parsed = []
    for ack_id in ack_ids:
        seq_text, _, attempt_text = ack_id.partition(".")
        try:
            parsed.append((int(seq_text), int(attempt_text)))
        except ValueError:
            continue
    return parsed


_ONES = memoryview(b"\x01" * 65536)  # to mark a stretch of a flight gone at once


class Flight:
    """Deliveries of one bucket handed out together to one group, still awaiting their acks.

    One object per batch rather than an entry per delivery: the ledger registers a flight
    once (``AckLedger.hand_out``), and an ack that returns a stretch of it in order (the
    usual case: a consumer acknowledges what one response carried) is matched by comparing
    its sequences with the flight's column (in C), not by a dictionary operation per
    delivery. ``gone`` marks the positions no longer in flight (acknowledged, released or
    expired); None while every position still is. A redelivery is a new flight: the old
    one had the position marked gone before the message could be queued again.
    """

    __slots__ = (
        "bucket",
        "subj",
        "gid",
        "at",
        "seqs",
        "offs",
        "dues",
        "attempts",
        "mids",
        "left",
        "gone",
        "resume",
        "_pos",
    )

    def __init__(
        self,
        bucket: int,
        subj: int,
        gid: int,
        at: int,
        seqs: list[int],
        offs: list[int],
        dues: list[int],
        attempts: list[int],
        mids: list[bytes],
    ) -> None:
        self.bucket = bucket
        self.subj = subj
        self.gid = gid
        self.at = at  # dispatched at (ms)
        self.seqs = seqs
        self.offs = offs
        self.dues = dues
        self.attempts = attempts
        self.mids = mids
        self.left = len(seqs)  # positions still in flight
        self.gone: bytearray | None = None  # per position: 1 once no longer in flight
        self.resume = 0  # the position its group's ``starts`` lists it at (-1: none)
        self._pos: dict[int, int] | None = None  # seq -> position, built when first needed

    def _positions(self) -> dict[int, int]:
        if self._pos is None:
            self._pos = dict(zip(self.seqs, range(len(self.seqs))))
        return self._pos

    def index(self, seq: int) -> int:
        return self._positions()[seq]

    def position(self, seq: int) -> int | None:
        """Where ``seq`` is in flight in this flight, or None (not listed, or gone)."""
        i = self._positions().get(seq)
        if i is None or not self.live_at(i):
            return None
        return i

    def live_at(self, i: int) -> bool:
        if self.gone is None:
            return self.left > 0
        return not self.gone[i]

    def live_seqs(self) -> list[int]:
        """The sequences still in flight."""
        if self.gone is None:
            return self.seqs if self.left else []
        gone = self.gone
        return [q for q, g in zip(self.seqs, gone) if not g]

    def mark_gone(self, i: int, k: int) -> None:
        """Positions [i, i + k) leave the flight (all were live)."""
        self.left -= k
        if self.left == 0:
            self.gone = None  # all gone: ``left`` says it
            return
        gone = self.gone
        if gone is None:
            gone = self.gone = bytearray(len(self.seqs))
        if k == 1:
            gone[i] = 1
        else:
            while k > 0:  # (a stretch longer than _ONES in pieces)
                m = min(k, len(_ONES))
                gone[i : i + m] = _ONES[:m]
                i += m
                k -= m

    def stretch_live(self, i: int, k: int) -> bool:
        """Every position of [i, i + k) still in flight."""
        if self.gone is None:
            return self.left == len(self.seqs)
        return self.gone.find(1, i, i + k) < 0

    def attempt_of(self, seq: int) -> int:
        return self.attempts[self.index(seq)]

    def item(self, seq: int) -> Item:
        """(seq, off, bucket, due, attempt + 1, subj, gid): the entry for its next attempt."""
        return self.item_at(self.index(seq))

    def item_at(self, i: int) -> Item:
        return (self.seqs[i], self.offs[i], self.bucket, self.dues[i], self.attempts[i] + 1, self.subj, self.gid)

    def columns(self, seqs: list[int]) -> tuple[list[int], list[int], list[int], list[bytes]]:
        """(offs, dues, attempts, mids) of ``seqs``, all of this flight."""
        if seqs == self.seqs:
            return self.offs, self.dues, self.attempts, self.mids
        i = self.index(seqs[0])
        j = i + len(seqs)
        if self.seqs[i:j] == seqs:  # a stretch of the batch, as a consumer's response held it
            return self.columns_at(i, j)
        idx = list(map(self._positions().__getitem__, seqs))
        return (
            list(map(self.offs.__getitem__, idx)),
            list(map(self.dues.__getitem__, idx)),
            list(map(self.attempts.__getitem__, idx)),
            list(map(self.mids.__getitem__, idx)),
        )

    def columns_at(self, i: int, j: int) -> tuple[list[int], list[int], list[int], list[bytes]]:
        """(offs, dues, attempts, mids) of positions [i, j)."""
        if i == 0 and j == len(self.seqs):
            return self.offs, self.dues, self.attempts, self.mids
        return self.offs[i:j], self.dues[i:j], self.attempts[i:j], self.mids[i:j]


class Acked:
    """Deliveries of one flight an ack closed: ``seqs``, at positions ``start`` onwards
    when they are a stretch of it (else ``start`` is None)."""

    __slots__ = ("flight", "seqs", "start")

    def __init__(self, flight: Flight, seqs: list[int], start: int | None) -> None:
        self.flight = flight
        self.seqs = seqs
        self.start = start

    def columns(self) -> tuple[list[int], list[int], list[int], list[bytes]]:
        if self.start is None:
            return self.flight.columns(self.seqs)
        return self.flight.columns_at(self.start, self.start + len(self.seqs))


class _GroupFlights:
    """One group's flights: registered once each; acks matched by stretches (``starts``);
    a sequence index built only when a question needs one (see ``AckLedger``)."""

    __slots__ = ("flights", "starts", "live", "index", "idle")

    def __init__(self) -> None:
        self.flights: set[Flight] = set()  # flights with positions still in flight
        # sequence -> (flight, position) where an ack of a stretch is expected to begin: each
        # flight's first position, then the position after each stretch acknowledged
        self.starts: dict[int, tuple[Flight, int]] = {}
        self.live = 0  # deliveries in flight
        self.index: dict[int, Flight] | None = None  # seq -> flight, while kept
        self.idle = 0  # entries the index was kept up to date for since it was last asked


# an index not asked for while this many entries (or 4x those in flight) were registered
# or acknowledged is dropped: keeping it costs a dictionary operation per delivery, the
# cost the flights avoid; rebuilding it costs one per delivery in flight
_INDEX_IDLE_MIN = 65536


class AckLedger:
    """Deliveries in flight per group, their deadlines, and retries waiting to be offered.

    Per group, the flights handed out (one object per batch: ``Flight``). An ack request
    that returns stretches of flights in order, as consumers do, is matched without a
    per-delivery lookup; anything else (acks out of order, releases, a Cancel's or a Get's
    "is it in flight?", a read-back pass's "what is held?") uses a per-group index of
    sequence -> flight, built on first need and kept up to date while it is asked for
    (dropped when it has not been for a while, see ``_INDEX_IDLE_MIN``). Registering each
    delivery in a dictionary, and popping it when acked, was the largest per-group cost of
    a fan-out burst (each group of a subject registers the same deliveries).
    """

    def __init__(self) -> None:
        self._groups: dict[int, _GroupFlights] = {}
        # (ack deadline, flights) per dispatched batch, in deadline order
        self._deadlines: collections.deque[tuple[int, list[Flight]]] = collections.deque()
        self._retry_heap: list[tuple[int, int, Item]] = []

    # --- groups -----------------------------------------------------------------------------------

    def drop_group(self, gid: int) -> None:
        """A deleted group: acks for its deliveries find nothing, expiries skip them."""
        self._groups.pop(gid, None)

    # --- the index --------------------------------------------------------------------------------

    def _index(self, grp: _GroupFlights) -> dict[int, Flight]:
        """The group's sequence -> flight index, built if it is not kept (a question needs it)."""
        idx = grp.index
        if idx is None:
            idx = grp.index = {}
            for fl in grp.flights:
                idx.update(zip(fl.live_seqs(), itertools.repeat(fl)))
        grp.idle = 0
        return idx

    def _kept(self, grp: _GroupFlights, n: int) -> dict[int, Flight] | None:
        """The index if it is kept, counting ``n`` entries maintained for it unasked; None
        (dropped) once that outgrew what a rebuild costs."""
        idx = grp.index
        if idx is not None:
            grp.idle += n
            if grp.idle > max(_INDEX_IDLE_MIN, 4 * grp.live):
                grp.index = idx = None
        return idx

    def _gone(self, grp: _GroupFlights, fl: Flight, i: int, k: int) -> None:
        """Positions [i, i + k) of ``fl`` leave flight (the caller keeps the index)."""
        fl.mark_gone(i, k)
        grp.live -= k
        if not fl.left:
            grp.flights.discard(fl)
            self._unstart(grp, fl)

    @staticmethod
    def _unstart(grp: _GroupFlights, fl: Flight) -> None:
        """Remove the flight's entry in ``starts``, if it has one (stale ones must not pile
        up where acks are never stretches)."""
        if fl.resume >= 0:
            key = fl.seqs[fl.resume]
            got = grp.starts.get(key)
            if got is not None and got[0] is fl:
                del grp.starts[key]
            fl.resume = -1

    # --- handing out and closing -------------------------------------------------------------------

    def hand_out(self, flights: list[Flight], deadline: int) -> None:
        groups = self._groups
        for fl in flights:  # (the caller checked that each group still exists)
            grp = groups.get(fl.gid)
            if grp is None:
                grp = groups[fl.gid] = _GroupFlights()
            grp.flights.add(fl)
            grp.live += fl.left
            grp.starts[fl.seqs[0]] = (fl, 0)
            idx = self._kept(grp, fl.left)
            if idx is not None:
                idx.update(zip(fl.seqs, itertools.repeat(fl)))
        self._deadlines.append((deadline, flights))

    def take_acked(self, seqs: list[int], gid: int | None) -> list[Acked]:
        """Remove acknowledged sequences of group ``gid`` (None: whichever group has each);
        per flight, the sequences acknowledged of it. Ids already acknowledged, expired or
        from another server find nothing."""
        if gid is None:
            return self._take_any(seqs)
        grp = self._groups.get(gid)
        if grp is None or not seqs:
            return []
        out: list[Acked] = []
        n = len(seqs)
        i = 0
        starts = grp.starts
        # stretches of flights, in order: compared as columns, no lookup per delivery
        while i < n:
            got = starts.get(seqs[i])
            if got is None:
                break
            fl, p = got
            size = len(fl.seqs)
            k = min(n - i, size - p)
            if i == 0 and k == n and p == 0 and k == size:
                if seqs != fl.seqs:  # (the whole request is the whole flight: no slices)
                    break
                part = seqs
            else:
                part = seqs[i : i + k]
                if fl.seqs[p : p + k] != part:
                    break
            if not fl.stretch_live(p, k):
                break
            del starts[seqs[i]]
            fl.resume = -1
            self._gone(grp, fl, p, k)
            if p + k < size and fl.live_at(p + k):
                starts[fl.seqs[p + k]] = (fl, p + k)
                fl.resume = p + k
            idx = self._kept(grp, k)
            if idx is not None:
                collections.deque(map(idx.pop, part, itertools.repeat(None)), maxlen=0)
            out.append(Acked(fl, part, p))
            i += k
        if i < n:
            self._take_indexed(grp, seqs[i:] if i else seqs, out)
        return out

    def _take_indexed(self, grp: _GroupFlights, seqs: list[int], out: list[Acked]) -> None:
        """Acks that are not stretches of flights: each looked up in the group's index."""
        idx = self._index(grp)
        flights = list(map(idx.pop, seqs, itertools.repeat(None)))
        start = 0
        for fl, run in itertools.groupby(flights):
            k = sum(1 for _ in run)
            if fl is not None:
                got = seqs[start : start + k]
                for q in got:
                    self._gone(grp, fl, fl.index(q), 1)
                out.append(Acked(fl, got, None))
            start += k

    def _take_any(self, seqs: list[int]) -> list[Acked]:
        out: list[Acked] = []
        for q in seqs:
            for grp in self._groups.values():
                fl = self._index(grp).pop(q, None)
                if fl is not None:
                    self._gone(grp, fl, fl.index(q), 1)
                    out.append(Acked(fl, [q], None))
                    break
        return out

    def take_released(self, parsed: list[tuple[int, int]], gid: int | None) -> list[tuple[int, Item]]:
        """Remove deliveries still in flight *with that attempt* (others are ignored); their
        (seq, item for the next attempt)."""
        out = []
        for seq, attempt in parsed:
            if gid is None:
                grp = next((g for g in self._groups.values() if seq in self._index(g)), None)
            else:
                grp = self._groups.get(gid)
            if grp is None:
                continue
            idx = self._index(grp)
            fl = idx.get(seq)
            if fl is None:
                continue
            i = fl.index(seq)
            if fl.attempts[i] != attempt:
                continue
            del idx[seq]
            self._gone(grp, fl, i, 1)
            out.append((seq, fl.item_at(i)))
        return out

    def expired(self, now: int) -> Iterator[tuple[int, Item]]:
        """Deliveries whose ack deadline passed, removed: (seq, item for the next attempt)."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _deadline, flights = self._deadlines.popleft()
            for fl in flights:
                if not fl.left:
                    continue  # acknowledged (or released) in full
                grp = self._groups.get(fl.gid)
                if grp is None or fl not in grp.flights:
                    continue  # the group was deleted
                live = [i for i in range(len(fl.seqs)) if fl.live_at(i)]
                idx = grp.index
                for i in live:
                    self._gone(grp, fl, i, 1)
                    if idx is not None:
                        idx.pop(fl.seqs[i], None)
                    yield fl.seqs[i], fl.item_at(i)

    # --- retries ----------------------------------------------------------------------------------

    def retry_at(self, at: int, seq: int, item: Item) -> None:
        heapq.heappush(self._retry_heap, (at, seq, item))

    def due_retries(self, now: int) -> Iterator[Item]:
        while self._retry_heap and self._retry_heap[0][0] <= now:
            yield heapq.heappop(self._retry_heap)[2]

    # --- questions ----------------------------------------------------------------------------------

    def next_wakeup(self) -> int | None:
        """The earliest deadline or retry time, if any."""
        t = self._deadlines[0][0] if self._deadlines else None
        if self._retry_heap:
            r = self._retry_heap[0][0]
            t = r if t is None else min(t, r)
        return t

    def in_flight_maps(self) -> list[dict[int, Flight]]:
        """The non-empty maps of sequence -> flight, one per group: to ask about many
        sequences at once (``seq in m`` for each)."""
        return [self._index(g) for g in self._groups.values() if g.live]

    def is_in_flight(self, seq: int) -> bool:
        """Handed out to some group and not yet acknowledged. A kept index answers; else
        the flights are searched (in C, a list's ``in`` per flight) rather than an index
        built for one question."""
        for grp in self._groups.values():
            if not grp.live:
                continue
            if grp.index is not None:
                if seq in self._index(grp):
                    return True
                continue
            for fl in grp.flights:
                if seq in fl.seqs and fl.position(seq) is not None:
                    return True
        return False

    def count(self) -> int:
        return sum(g.live for g in self._groups.values())

    def count_of(self, gid: int) -> int:
        grp = self._groups.get(gid)
        return grp.live if grp is not None else 0

    def held(self, gid: int) -> set[int]:
        """Sequences of group ``gid`` in flight or waiting to be retried."""
        out: set[int] = set()
        grp = self._groups.get(gid)
        if grp is not None:
            for fl in grp.flights:
                out.update(fl.live_seqs())
        out.update(it[1] for it in self._retry_heap if it[2][6] == gid)
        return out
