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
from collections.abc import Container, Iterable, Iterator

import numpy as np

from qdelay.segments import native
from qdelay.server.stretches import Batch, Stretches, Taken

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


def ack_match_py(ids: list[str], i: int, keys: list[int], p: int, k: int) -> bool:
    """The Python twin of ``native.codec.ack_match``: whether ``ids[i:i+k]`` are well formed
    ("digits.digits", as :func:`ack_sequences_py` takes them) and name the sequences
    ``keys[p:p+k]`` in order; False if either range runs past its list. A non-str id met
    before the first mismatch raises TypeError."""
    if i < 0 or p < 0 or k < 0 or i + k > len(ids) or p + k > len(keys):
        return False
    for j in range(k):
        ack_id = ids[i + j]
        if not isinstance(ack_id, str):
            raise TypeError(f"ack_match: ids[{i + j}] is not a str")
        seq = ack_sequences_py([ack_id])
        if seq is None or seq[0] != keys[p + j]:
            return False
    return True


def _ack_seq_at(ids: list[str], i: int) -> int | None:
    """The sequence ``ids[i]`` names if it is well formed, else None."""
    codec = native.codec
    got = codec.ack_sequences(ids[i : i + 1]) if codec is not None else ack_sequences_py(ids[i : i + 1])
    return got[0] if got else None


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


class Flight(Batch[int]):
    """Deliveries of one bucket handed out together to one group, still awaiting their acks:
    one object per batch, registered once (its keys are the sequences; see
    ``server/stretches.py``). A redelivery is a new flight: the old one had the position
    marked gone before the message could be queued again."""

    __slots__ = ("bucket", "subj", "gid", "at", "seqs", "offs", "dues", "attempts", "mids")

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
        super().__init__(seqs)
        self.bucket = bucket
        self.subj = subj
        self.gid = gid
        self.at = at  # dispatched at (ms)
        self.seqs = seqs
        self.offs = offs
        self.dues = dues
        self.attempts = attempts
        self.mids = mids

    def item_at(self, i: int) -> Item:
        """(seq, off, bucket, due, attempt + 1, subj, gid): the entry for its next attempt."""
        return (self.seqs[i], self.offs[i], self.bucket, self.dues[i], self.attempts[i] + 1, self.subj, self.gid)

    def columns(self, seqs: list[int], start: int | None) -> tuple[list[int], list[int], list[int], list[bytes]]:
        """(offs, dues, attempts, mids) of ``seqs``, all of this flight: positions ``start``
        onwards if they are a stretch of it, else looked up one by one."""
        if start is not None:
            j = start + len(seqs)
            if start == 0 and j == len(self.seqs):
                return self.offs, self.dues, self.attempts, self.mids
            return self.offs[start:j], self.dues[start:j], self.attempts[start:j], self.mids[start:j]
        idx = list(map(self.index, seqs))
        return (
            list(map(self.offs.__getitem__, idx)),
            list(map(self.dues.__getitem__, idx)),
            list(map(self.attempts.__getitem__, idx)),
            list(map(self.mids.__getitem__, idx)),
        )


Acked = Taken[Flight, int]  # sequences of one flight an ack closed (``.batch``, ``.keys``, ``.start``)

# a question enters at most about this many deliveries in its bucket's index; flights not
# entered yet are searched (so the first question after a burst of 200,000 costs about
# what the search of them all did, not the ~10x of entering them all at once)
ENTER_MAX = 8192


class BucketIndex:
    """Per group, sequence -> the latest flight of one bucket that holds it: what answers
    "is it in flight?" about a message of that bucket (Get, Cancel) with a lookup per
    group, not a search of the bucket's flights. Built when the bucket is first asked
    about; a flight handed out later waits in ``fresh`` (one list append per flight), so
    handing out and acknowledging pay nothing per delivery for it. Each question enters
    up to ``ENTER_MAX`` deliveries of the fresh flights still out (in hand-out order) and
    searches the rest, as the ledger searched every flight before: a delivery is entered
    at most once, and a question costs a lookup per group once the index caught up.
    Entries are never removed one by one: the flight an entry names says whether the
    delivery is still out (acknowledged, released, expired, its group deleted). Flights
    that left the ledger count in ``stale``; past half of what was entered (and
    ``ENTER_MAX``), the next question builds the index again from the bucket's flights."""

    __slots__ = ("of_group", "fresh", "entered", "stale")

    def __init__(self, flights: Iterable[Flight]) -> None:
        self.of_group: dict[int, dict[int, Flight]] = {}
        self.fresh: list[Flight] = list(flights)
        self.entered = 0  # deliveries entered (of flights still listed or not)
        self.stale = 0  # deliveries of flights that left the ledger since it was built

    def catch_up(self, limit: int) -> int:
        """Enter fresh flights still out, in the order they were handed out (a sequence
        handed out again comes in a later flight of its group, which replaces the earlier
        one), until ``limit`` deliveries were; the rest stay fresh, those closed meanwhile
        dropped (nothing of them is out). How many deliveries were entered."""
        n = 0
        of_group = self.of_group
        fresh = self.fresh
        i = 0
        while i < len(fresh) and n < limit:
            fl = fresh[i]
            i += 1
            if not fl.left:
                continue
            mine = of_group.get(fl.gid)
            if mine is None:
                mine = of_group[fl.gid] = {}
            mine.update(zip(fl.keys, itertools.repeat(fl)))
            n += len(fl.keys)
        self.fresh = [fl for fl in fresh[i:] if fl.left] if i < len(fresh) else []
        self.entered += n
        return n


class AckLedger:
    """Deliveries in flight per group, their deadlines, and retries waiting to be offered.

    Per group, the flights handed out, as ``Stretches`` (``server/stretches.py``): an ack
    request that returns stretches of flights in order, as consumers send them, is matched
    without a per-delivery lookup; anything else (acks out of order, releases) uses a
    per-group index of sequence -> flight, built on first need
    and kept while it is asked for. Registering each delivery in a dictionary, and popping
    it when acked, was the largest per-group cost of a fan-out burst (each group of a
    subject registers the same deliveries). A Get's or a Cancel's "is it in flight?" asks
    an index of its message's bucket (``BucketIndex``), built when first asked.
    """

    def __init__(self) -> None:
        self._groups: dict[int, Stretches[Flight, int]] = {}
        # (ack deadline, flights) per dispatched batch, in deadline order; a batch whose
        # flights are all closed leaves it once it is at the front (``_prune``), not at its
        # deadline
        self._deadlines: collections.deque[tuple[int, list[Flight]]] = collections.deque()
        self._retry_heap: list[tuple[int, int, Item]] = []
        # group id -> sequences of its deliveries waiting out a retry's backoff (ack timeout
        # passed, not queued again yet): due and owed to the group, so counted in its
        # backlog (``retrying_of``). A cancelled one, or a deleted group's, leaves at once;
        # its entry in ``_retry_heap`` is passed over when its time comes
        self._retrying: dict[int, set[int]] = {}
        # bucket -> its flights still in ``_deadlines`` (a dict as an ordered set; one entry
        # per flight, not per delivery): "is this message in flight?" (every Get asks it)
        # looks at the flights of the message's bucket, not at every flight of every group
        # (with 200,000 in flight a search of them all cost a Get ~3 ms of the event loop)
        self._of_bucket: dict[int, dict[Flight, None]] = {}
        # bucket -> its index of sequence -> flight, for buckets asked about while they have
        # flights listed (``_index_of``); dropped with the bucket's list
        self._indexes: dict[int, BucketIndex] = {}
        self.entered = 0  # deliveries entered in bucket indexes (for tests: the work of questions)

    # --- groups -----------------------------------------------------------------------------------

    def drop_group(self, gid: int) -> None:
        """A deleted group: acks for its deliveries find nothing, expiries skip them, its
        retries are not offered again."""
        self._groups.pop(gid, None)
        self._retrying.pop(gid, None)
        # (its entries in bucket indexes stay, answering "not out", until their bucket's
        # flights leave: freeing them here cost a delete with 200,000 out a few ms more)

    # --- handing out and closing -------------------------------------------------------------------

    def hand_out(self, flights: list[Flight], deadline: int) -> None:
        groups = self._groups
        of_bucket = self._of_bucket
        for fl in flights:  # (the caller checked that each group still exists)
            grp = groups.get(fl.gid)
            if grp is None:
                grp = groups[fl.gid] = Stretches()
            grp.add(fl)
            mine = of_bucket.get(fl.bucket)
            if mine is None:
                mine = of_bucket[fl.bucket] = {}
            mine[fl] = None
        indexes = self._indexes
        if indexes:  # a bucket asked about: its index enters the flight at a later question
            for fl in flights:
                bi = indexes.get(fl.bucket)
                if bi is not None:
                    fresh = bi.fresh
                    fresh.append(fl)
                    # no question for a while (deliveries go on): the flights that left the
                    # bucket's list go, so ``fresh`` holds at most about what is listed
                    listed = of_bucket[fl.bucket]
                    if len(fresh) > 2 * len(listed) + 64:
                        bi.fresh = [f for f in fresh if f in listed]
        self._deadlines.append((deadline, flights))

    def _forget(self, flights: list[Flight]) -> None:
        """Flights that left ``_deadlines`` (closed, or expired) leave their bucket's list."""
        of_bucket = self._of_bucket
        indexes = self._indexes
        for fl in flights:
            mine = of_bucket.get(fl.bucket)
            if mine is not None:
                mine.pop(fl, None)
                if not mine:
                    del of_bucket[fl.bucket]
                    if indexes:
                        indexes.pop(fl.bucket, None)
                elif indexes:
                    bi = indexes.get(fl.bucket)
                    if bi is not None:
                        bi.stale += len(fl.keys)

    def _prune(self) -> None:
        """Drop the dispatched batches at the front of the deadlines whose flights are all
        closed (acknowledged or released). Kept until their deadline (the ack timeout,
        30 s by default), every flight of a live subject outlived the young garbage
        collections and set off full ones, whose cost grows with every object the server
        holds (~90 of gRPC's per open Subscribe stream): with 1,000 idle streams open, a
        full collection paused every thread for 50-120 ms. (It also woke the scheduler at
        each stale deadline.)"""
        dl = self._deadlines
        while dl and not any(fl.left for fl in dl[0][1]):
            self._forget(dl.popleft()[1])

    def take_acked(self, seqs: list[int], gid: int | None) -> list[Acked]:
        """Remove acknowledged sequences of group ``gid`` (None: whichever group has each);
        per flight, the sequences acknowledged of it. Ids already acknowledged, expired or
        from another server find nothing."""
        out = self._take_acked(seqs, gid)
        if out:
            self._prune()
        return out

    def _take_acked(self, seqs: list[int], gid: int | None) -> list[Acked]:
        if gid is None:
            # each group in turn takes what it has of those not taken yet: a whole request
            # per group (stretches matched as columns), not a lookup per sequence per group
            # (that cost the burst bench, whose sink acks this way, 2.5 -> 7 us a message)
            out: list[Acked] = []
            rest = seqs
            for g in self._groups.values():
                if not rest:
                    break
                if not g.live:
                    continue
                got = g.take(rest)
                if got:
                    out += got
                    n = sum(len(a.keys) for a in got)
                    if n == len(rest):
                        rest = []
                    else:
                        taken = {q for a in got for q in a.keys}
                        rest = [q for q in rest if q not in taken]
            return out
        grp = self._groups.get(gid)
        if grp is None or not seqs:
            return []
        return grp.take(seqs)

    def take_acked_ids(self, ack_ids: list[str], gid: int | None) -> list[Acked]:
        """``take_acked`` of the sequences ``ack_ids`` name (as ``ack_sequences`` reads them),
        with the same results: what a consumer sends back, stretches of what was handed out
        in order, is matched id by id against the flights' sequences in C (``ack_match``),
        without an int made per id and a list compared; the ids after the first that is
        not such a stretch are parsed and taken as ``take_acked`` takes them."""
        codec = native.codec
        if gid is None or codec is None:
            return self.take_acked(ack_sequences(ack_ids), gid)
        grp = self._groups.get(gid)
        if grp is None or not ack_ids:
            return []
        out: list[Acked] = []
        i = grp.take_stretches(ack_ids, _ack_seq_at, codec.ack_match, out)
        if i < len(ack_ids):
            out += grp.take(ack_sequences(ack_ids[i:] if i else ack_ids))
        if out:
            self._prune()
        return out

    def take_released(self, parsed: list[tuple[int, int]], gid: int | None) -> list[tuple[int, Item]]:
        """Remove deliveries still in flight *with that attempt* (others are ignored); their
        (seq, item for the next attempt)."""
        out = []
        for seq, attempt in parsed:
            grp: Stretches[Flight, int] | None
            if gid is None:
                grp = next((g for g in self._groups.values() if seq in g.index()), None)
            else:
                grp = self._groups.get(gid)
            found = grp.find(seq) if grp is not None else None
            if grp is None or found is None:
                continue
            fl, i = found
            if fl.attempts[i] != attempt:
                continue
            grp.remove(fl, i)
            out.append((seq, fl.item_at(i)))
        if out:
            self._prune()
        return out

    def expired(self, now: int) -> Iterator[tuple[int, Item]]:
        """Deliveries whose ack deadline passed, removed: (seq, item for the next attempt)."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _deadline, flights = self._deadlines.popleft()
            self._forget(flights)
            for fl in flights:
                if not fl.left:
                    continue  # acknowledged (or released) in full
                grp = self._groups.get(fl.gid)
                if grp is None:
                    continue  # the group was deleted
                for i in grp.expire(fl):
                    yield fl.seqs[i], fl.item_at(i)

    # --- retries ----------------------------------------------------------------------------------

    def retry_at(self, at: int, seq: int, item: Item) -> None:
        """Offer ``item`` (an expired delivery's next attempt) again at ``at``; until then it
        counts in its group's backlog (``retrying_of``)."""
        heapq.heappush(self._retry_heap, (at, seq, item))
        gid = item[6]
        mine = self._retrying.get(gid)
        if mine is None:
            mine = self._retrying[gid] = set()
        mine.add(seq)

    def due_retries(self, now: int) -> Iterator[Item]:
        """Retries whose backoff ended, removed; those cancelled meanwhile
        (``cancel_retries``) or of a deleted group are passed over."""
        heap = self._retry_heap
        retrying = self._retrying
        while heap and heap[0][0] <= now:
            _at, seq, item = heapq.heappop(heap)
            mine = retrying.get(item[6])
            if mine is None or seq not in mine:
                continue
            mine.discard(seq)
            if not mine:
                del retrying[item[6]]
            yield item

    def cancel_retries(self, targets: set[int]) -> list[tuple[int, int]]:
        """Cancelled messages (``targets``) waiting out a retry's backoff leave their groups'
        backlog now and are never offered again: (group id, how many) per group that had
        some. Costs the groups with retries waiting, each the smaller of its retries and
        the targets."""
        out = []
        retrying = self._retrying
        for gid, mine in list(retrying.items()):
            hit = mine & targets
            if hit:
                mine -= hit
                if not mine:
                    del retrying[gid]
                out.append((gid, len(hit)))
        return out

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
        return [g.index() for g in self._groups.values() if g.live]

    def in_flight_of(self, buckets: Iterable[int], asked: int = 1) -> list[Container[int]]:
        """Containers holding every sequence in flight (in some group) of ``buckets``: what
        a Cancel of ``asked`` messages of those buckets must not claim (``seq in c`` for
        each).

        The groups' indexes when every group keeps one (then a question costs nothing);
        else the indexes of those buckets (``_index_of``): a lookup per group per target,
        whatever is in flight, in those buckets or elsewhere (an index of every delivery
        out, built for a Cancel after the groups' were dropped, cost ~20 ms at 200,000 in
        flight; a set of those buckets' deliveries made per question grew with them). Up
        to ``asked`` x ENTER_MAX deliveries are entered first: each lookup searches the
        flights not entered, so a Cancel of 1,000 targets with 200,000 out searched them
        1,000 times (1.8 s under the scheduler's lock) where entering them costs a few
        searches' worth once."""
        if self._all_indexed():
            return list(self.in_flight_maps())
        out: list[Container[int]] = []
        for bucket in set(buckets):
            bi = self._index_of(bucket, ENTER_MAX * max(1, asked))
            if bi is not None:
                out.append(_InFlight(self, bi))
        return out

    def flights_waiting(self) -> int:
        """Flights waiting to be entered in bucket indexes (for tests: without questions,
        they do not outgrow the flights listed)."""
        return sum(len(bi.fresh) for bi in self._indexes.values())

    def flights_listed(self) -> int:
        """Flights in the per-bucket lists (for tests: they leave with ``_deadlines``, so
        the lists do not outgrow what is in flight within one ack timeout)."""
        return sum(map(len, self._of_bucket.values()))

    def is_in_flight(self, seq: int, bucket: int | None = None) -> bool:
        """Handed out to some group and not yet acknowledged. With the message's ``bucket``
        (a flight holds deliveries of one bucket), that bucket's index answers: a lookup
        per group, whatever is in flight (a search of the bucket's flights cost a Get of
        the minute being delivered ~3 ms at 200,000 in flight). Without it, or when every
        group keeps its index, every group's (a kept index, or a search of every flight)."""
        if bucket is None or self._all_indexed():
            return any(seq in g for g in self._groups.values())  # (a kept index answers at once)
        bi = self._index_of(bucket)
        return bi is not None and self.out_in(bi, seq)

    def _index_of(self, bucket: int, enter: int | None = None) -> BucketIndex | None:
        """``bucket``'s index, up to date (built if not kept, or if half of it is stale),
        with up to ``enter`` (default ENTER_MAX) more deliveries entered; None if the
        bucket has no flight listed."""
        if bucket not in self._of_bucket:
            return None
        bi = self._indexes.get(bucket)
        if bi is None or bi.stale > max(bi.entered // 2, ENTER_MAX):
            bi = self._indexes[bucket] = BucketIndex(self._of_bucket[bucket])
        if bi.fresh:
            self.entered += bi.catch_up(ENTER_MAX if enter is None else enter)
        return bi

    def out_in(self, bi: BucketIndex, seq: int) -> bool:
        """``seq`` is out in some group, as ``bi`` names its flights: its entries (a lookup
        per group), then its flights not entered yet (searched)."""
        groups = self._groups
        for gid, mine in bi.of_group.items():
            fl = mine.get(seq)
            if fl is None or not fl.left:
                continue
            if fl.gone is not None and fl.gone[fl.index(seq)]:
                continue
            grp = groups.get(gid)
            if grp is not None and fl in grp.batches:
                return True
        for fl in bi.fresh:
            keys = fl.keys
            if fl.left and seq in keys and fl.live_at(keys.index(seq)):
                grp = groups.get(fl.gid)
                if grp is not None and fl in grp.batches:
                    return True
        return False

    def _all_indexed(self) -> bool:
        """Every group with deliveries out keeps its index (then a question costs nothing)."""
        return all(g.has_index() for g in self._groups.values() if g.live)

    def count(self) -> int:
        return sum(g.live for g in self._groups.values())

    def count_of(self, gid: int) -> int:
        grp = self._groups.get(gid)
        return grp.live if grp is not None else 0

    def retrying_of(self, gid: int) -> int:
        """Deliveries of group ``gid`` waiting out a retry's backoff (not in flight: their
        ack timeout passed; due, and not yet queued again)."""
        mine = self._retrying.get(gid)
        return len(mine) if mine is not None else 0

    def retrying_among(self, gid: int, seqs: list[int]) -> set[int]:
        """Which of ``seqs`` group ``gid`` has waiting out a retry's backoff."""
        mine = self._retrying.get(gid)
        return mine.intersection(seqs) if mine else set()

    def retrying_count(self) -> int:
        return sum(map(len, self._retrying.values()))

    def has_index(self, gid: int) -> bool:
        """Group ``gid``'s sequence index is kept (for tests: a burst acknowledged as handed
        out needs none)."""
        grp = self._groups.get(gid)
        return grp is not None and grp.has_index()

    def held(self, gid: int) -> set[int]:
        """Sequences of group ``gid`` in flight or waiting to be retried."""
        grp = self._groups.get(gid)
        out: set[int] = set(grp.keys_out()) if grp is not None else set()
        out.update(self._retrying.get(gid, ()))
        return out


class _InFlight:
    """The sequences in flight of one bucket, as a container (``seq in c``): what
    ``in_flight_of`` gives a Cancel. Asked at once, while the ledger's owner holds it."""

    __slots__ = ("_ledger", "_bi")

    def __init__(self, ledger: AckLedger, bi: BucketIndex) -> None:
        self._ledger = ledger
        self._bi = bi

    def __contains__(self, seq: object) -> bool:
        return isinstance(seq, int) and self._ledger.out_in(self._bi, seq)
