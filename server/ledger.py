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


class Flight:
    """Deliveries of one bucket handed out together, still awaiting their acks.

    ``AckLedger.in_flight[gid]`` maps each sequence to its flight: one object per batch
    rather than a tuple per delivery, and an ack request that returns a whole batch in
    order (the usual case) reads the columns as they are. A sequence belongs to the
    flight ``in_flight`` maps it to; a redelivery is a new flight, so an older flight
    still listing the sequence no longer owns it.
    """

    __slots__ = ("bucket", "subj", "gid", "at", "seqs", "offs", "dues", "attempts", "mids", "_pos")

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
        self._pos: dict[int, int] | None = None  # seq -> position, built when first needed

    def _positions(self) -> dict[int, int]:
        if self._pos is None:
            self._pos = dict(zip(self.seqs, range(len(self.seqs))))
        return self._pos

    def index(self, seq: int) -> int:
        return self._positions()[seq]

    def attempt_of(self, seq: int) -> int:
        return self.attempts[self.index(seq)]

    def item(self, seq: int) -> Item:
        """(seq, off, bucket, due, attempt + 1, subj, gid): the entry for its next attempt."""
        i = self.index(seq)
        return (seq, self.offs[i], self.bucket, self.dues[i], self.attempts[i] + 1, self.subj, self.gid)

    def columns(self, seqs: list[int]) -> tuple[list[int], list[int], list[int], list[bytes]]:
        """(offs, dues, attempts, mids) of ``seqs``, all of this flight."""
        if seqs == self.seqs:
            return self.offs, self.dues, self.attempts, self.mids
        i = self.index(seqs[0])
        j = i + len(seqs)
        if self.seqs[i:j] == seqs:  # a stretch of the batch, as a consumer's response held it
            return self.offs[i:j], self.dues[i:j], self.attempts[i:j], self.mids[i:j]
        idx = list(map(self._positions().__getitem__, seqs))
        return (
            list(map(self.offs.__getitem__, idx)),
            list(map(self.dues.__getitem__, idx)),
            list(map(self.attempts.__getitem__, idx)),
            list(map(self.mids.__getitem__, idx)),
        )


class AckLedger:
    """Deliveries in flight per group, their deadlines, and retries waiting to be offered."""

    def __init__(self) -> None:
        # group id -> seq -> the batch it was handed out in
        self.in_flight: dict[int, dict[int, Flight]] = {}
        # (ack deadline, flights) per dispatched batch, in deadline order
        self._deadlines: collections.deque[tuple[int, list[Flight]]] = collections.deque()
        self._retry_heap: list[tuple[int, int, Item]] = []

    # --- groups -----------------------------------------------------------------------------------

    def drop_group(self, gid: int) -> None:
        """A deleted group: acks for its deliveries find nothing, expiries skip them."""
        self.in_flight.pop(gid, None)

    # --- handing out and closing -------------------------------------------------------------------

    def hand_out(self, flights: list[Flight], deadline: int) -> None:
        for fl in flights:  # (the caller checked that each group still exists)
            self.in_flight.setdefault(fl.gid, {}).update(zip(fl.seqs, itertools.repeat(fl)))
        self._deadlines.append((deadline, flights))

    def take_acked(self, seqs: list[int], gid: int | None) -> list[tuple[Flight, list[int]]]:
        """Remove acknowledged sequences of group ``gid`` (None: whichever group has each);
        per flight, the sequences acknowledged of it. Ids already acknowledged, expired or
        from another server find nothing."""
        if gid is None:
            flights = [self._pop_any(q) for q in seqs]
        else:
            in_flight = self.in_flight.get(gid)
            if in_flight is None:
                return []
            flights = list(map(in_flight.pop, seqs, itertools.repeat(None)))
        first = flights[0] if flights else None
        if first is not None and flights.count(first) == len(flights):
            return [(first, seqs)]  # the usual case: one batch acknowledged as handed out
        out = []  # several batches (or unknown ids): one group per run of the same batch
        start = 0
        for fl, run in itertools.groupby(flights):
            k = sum(1 for _ in run)
            if fl is not None:
                out.append((fl, seqs[start : start + k]))
            start += k
        return out

    def _pop_any(self, seq: int) -> Flight | None:
        for flights in self.in_flight.values():
            fl = flights.pop(seq, None)
            if fl is not None:
                return fl
        return None

    def take_released(self, parsed: list[tuple[int, int]], gid: int | None) -> list[tuple[int, Item]]:
        """Remove deliveries still in flight *with that attempt* (others are ignored); their
        (seq, item for the next attempt)."""
        out = []
        for seq, attempt in parsed:
            if gid is None:
                in_flight = next((m for m in self.in_flight.values() if seq in m), {})
            else:
                in_flight = self.in_flight.get(gid, {})
            fl = in_flight.get(seq)
            if fl is None or fl.attempt_of(seq) != attempt:
                continue
            del in_flight[seq]
            out.append((seq, fl.item(seq)))
        return out

    def expired(self, now: int) -> Iterator[tuple[int, Item]]:
        """Deliveries whose ack deadline passed, removed: (seq, item for the next attempt)."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _deadline, flights = self._deadlines.popleft()
            for fl in flights:
                in_flight = self.in_flight.get(fl.gid)
                if in_flight is None:
                    continue  # the group was deleted
                for seq in fl.seqs:
                    if in_flight.get(seq) is not fl:
                        continue  # acknowledged, or handed out again since
                    del in_flight[seq]
                    yield seq, fl.item(seq)

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
        return [m for m in self.in_flight.values() if m]

    def is_in_flight(self, seq: int) -> bool:
        """Handed out to some group and not yet acknowledged."""
        return any(seq in flights for flights in self.in_flight.values())

    def count(self) -> int:
        return sum(map(len, self.in_flight.values()))

    def count_of(self, gid: int) -> int:
        return len(self.in_flight.get(gid, ()))

    def held(self, gid: int) -> set[int]:
        """Sequences of group ``gid`` in flight or waiting to be retried."""
        out = set(self.in_flight.get(gid, ()))
        out.update(it[1] for it in self._retry_heap if it[2][6] == gid)
        return out
