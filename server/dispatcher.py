"""The dispatcher: ready entries become deliveries, one round at a time.

A round has three steps, which the scheduler thread (``server/scheduler.py``) runs with
the scheduling state's lock held for the first and the last only:

1. ``take`` (lock held): entries from the lanes, round-robin, within the sink's credit
   and the rate limit; split by bucket; what a Cancel claimed or a tombstone cancelled is
   dropped;
2. ``read`` (no lock): their records read back (``segments.messages``), once for all the
   groups of a subject that took the same entries (fan-out);
3. ``hand_out`` (lock held): what was cancelled while the records were read and
   unreadable records are dropped, the rest is registered in the ack ledger as in flight
   and becomes one ``Deliveries`` batch per lane.

A Cancel claim is applied under that lock too, so a claim and the in-flight registration
never cross: whichever comes first wins (a claimed message is never handed out, a
message in flight is not claimed).
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qdelay.segments.messages import read_messages
from qdelay.server.buckets import BucketBook, BucketState
from qdelay.server.claims import CancelClaims
from qdelay.server.deliveries import Deliveries
from qdelay.server.groups import Group
from qdelay.server.lanes import Lane
from qdelay.server.ledger import AckLedger, Flight, ack_ids
from qdelay.server.loader import Loader
from qdelay.server.timer import Timer

if TYPE_CHECKING:
    from qdelay.server.scheduler import SchedulerConfig


class Part:
    """Entries of one lane and one bucket taken for delivery, and their records once read
    back (columns; ``keep`` narrows every column at once)."""

    __slots__ = ("st", "seqs", "offs", "dues", "attempts", "read", "clean")

    def __init__(self, st: BucketState, seqs: list[int], offs: list[int], dues: list[int], attempts: list[int]) -> None:
        self.st = st
        self.seqs = seqs
        self.offs = offs
        self.dues = dues
        self.attempts = attempts
        self.read: tuple[list[Any], list[Any], list[Any]] = ([], [], [])
        self.clean = False  # every record read back could be served (no None among the ids)

    def keep(self, idx: list[int]) -> None:
        self.seqs, self.offs, self.dues, self.attempts = (
            [col[i] for i in idx] for col in (self.seqs, self.offs, self.dues, self.attempts)
        )
        if self.read[0]:
            mids, payloads, headers = self.read
            self.read = ([mids[i] for i in idx], [payloads[i] for i in idx], [headers[i] for i in idx])


@dataclass(slots=True)
class Taken:
    """What one lane gave in one dispatch round."""

    lane: Lane
    group: Group
    name: str  # the subject
    parts: list[Part]


class Dispatcher:
    def __init__(
        self,
        cfg: SchedulerConfig,
        timer: Timer,
        book: BucketBook,
        ledger: AckLedger,
        claims: CancelClaims,
        loader: Loader,
    ) -> None:
        self.cfg = cfg
        self.timer = timer
        self.book = book
        self.ledger = ledger
        self.claims = claims
        self.loader = loader  # counts the unreadable records found here
        self._tokens = 0.0
        self._tokens_at = time.monotonic()
        self.dispatched = 0
        self.cancel_skipped = 0

    # --- 1. take (lock held) ----------------------------------------------------------------------

    def take(self, credit: Callable[[str, str], int]) -> list[Taken]:
        """One round's entries, per lane and bucket, claimed and cancelled ones dropped."""
        taken: list[Taken] = []
        split: dict = {}  # columns split by bucket once for the lanes taking the same ones (fan-out)
        for lane, g, name, cols in self.timer.take(credit, self._take_tokens, self.cfg.dispatch_quantum):
            parts = self._by_bucket(lane.sid, lane.gid, *cols, split=split)
            if parts:
                taken.append(Taken(lane, g, name, parts))
        return taken

    def _take_tokens(self, want: int) -> int:
        rate = self.cfg.dispatch_rate
        if rate <= 0:
            return want
        now = time.monotonic()
        self._tokens = min(max(rate * 0.1, 1.0), self._tokens + (now - self._tokens_at) * rate)
        self._tokens_at = now
        n = min(want, int(self._tokens))
        self._tokens -= n
        return n

    def _by_bucket(
        self,
        sid: int,
        gid: int,
        seqs: list[int],
        offs: list[int],
        buckets: list[int],
        dues: list[int],
        attempts: list[int],
        split: dict | None = None,
    ) -> list[Part]:
        """Ready items (columns, all of one lane) split by bucket, cancelled ones dropped.
        ``split`` (one round's): the split of columns already made for another lane that
        took the very same column objects (the groups of a subject take a fired chunk in
        step: ``Ready.take`` shares its columns), made once for all of them."""
        cols = (seqs, offs, buckets, dues, attempts)
        got = split.get(id(seqs)) if split is not None else None
        if got is not None and all(map(operator.is_, got[0], cols)):
            by_bucket = got[1]
        else:
            first = buckets[0]
            if buckets.count(first) == len(buckets):
                by_bucket = [(first, seqs, offs, dues, attempts)]
            else:
                where: dict[int, list[int]] = {}
                for i, b in enumerate(buckets):
                    where.setdefault(b, []).append(i)
                by_bucket = [
                    (
                        b,
                        [seqs[i] for i in idx],
                        [offs[i] for i in idx],
                        [dues[i] for i in idx],
                        [attempts[i] for i in idx],
                    )
                    for b, idx in where.items()
                ]
            if split is not None:
                split[id(seqs)] = (cols, by_bucket)
        parts = []
        for bucket, g_seqs, g_offs, g_dues, g_attempts in by_bucket:
            st = self.book.get(bucket)
            if st is None:
                continue  # cannot happen for indexed entries; guards against a dropped bucket
            part = Part(st, g_seqs, g_offs, g_dues, g_attempts)
            if self._drop_cancelled(part, sid, gid):
                parts.append(part)
        return parts

    def _drop_cancelled(self, part: Part, sid: int, gid: int) -> bool:
        """Drop the part's cancelled entries and set aside its claimed ones (a release gives
        them back); False if none is left."""
        st = part.st
        if st.cancelled or self.claims:
            cancelled, claimed = st.cancelled, self.claims.claimed
            keep = [i for i, q in enumerate(part.seqs) if q not in cancelled and q not in claimed]
            if len(keep) < len(part.seqs):
                kept = set(keep)
                gone = 0
                for i, q in enumerate(part.seqs):
                    if i in kept:
                        continue
                    if q in cancelled or not self.claims.skip(
                        (q, part.offs[i], st.bucket, part.dues[i], part.attempts[i], sid, gid)
                    ):
                        gone += 1  # set aside entries stay owed by the bucket
                st.owe(gid, -gone)
                self.cancel_skipped += len(part.seqs) - len(keep)
                part.keep(keep)
        return bool(part.seqs)

    # --- 2. read (no lock) ------------------------------------------------------------------------

    @staticmethod
    def read(taken: list[Taken]) -> None:
        """Read back the records of every part taken in a round. The groups of one subject
        usually take the same entries in the same round (fan-out: they fired together): a
        part whose entries another part of the round has already read shares that read
        (the same bytes objects; nothing changes them in place)."""
        done: dict[tuple[int, int, int], list[Part]] = {}
        for t in taken:
            for part in t.parts:
                key = (part.st.bucket, part.offs[0], len(part.offs))
                same = next((p for p in done.get(key, ()) if p.offs is part.offs or p.offs == part.offs), None)
                if same is not None:
                    part.read, part.clean = same.read, same.clean
                    continue
                part.read = read_messages(part.st.seg, part.seqs, part.offs)
                part.clean = None not in part.read[0]  # (a scan of the column: once per read)
                done.setdefault(key, []).append(part)

    # --- 3. hand out (lock held) ------------------------------------------------------------------

    def hand_out(self, taken: list[Taken], now: int) -> list[Deliveries]:
        """The round's batches of deliveries, registered as in flight."""
        ids: dict = {}  # ack ids made once for the groups taking the same entries
        return [b for b in (self._hand_out(t, now, ids) for t in taken) if b is not None]

    def _hand_out(self, t: Taken, now: int, ids: dict) -> Deliveries | None:
        """Turn parts read back into one batch of deliveries: drop what was cancelled while
        they were read, and unreadable records; register the rest as in flight for the
        group.

        This is the per-message hot path of a burst, so it works on columns: no object or
        tuple per delivery except the in-flight entry an ack needs. A batch of one part
        (the usual case) uses the part's columns as they are, and the groups of a subject
        that took the same entries in the round (fan-out) share them, their records and
        their ack ids (``ids``: the round's, by the columns' identity); nothing changes a
        column in place.
        """
        lane, gid = t.lane, t.lane.gid
        if self.timer.live_lane(lane) is None:
            return None  # the group was deleted while its records were read
        flights: list[Flight] = []
        kept: list[Part] = []
        for part in t.parts:
            st = part.st
            if not self._drop_cancelled(part, lane.sid, gid):  # cancelled while being read
                continue
            mids = part.read[0]
            if not part.clean and None in mids:  # unreadable records: reported by read_messages, never served
                keep = [i for i, m in enumerate(mids) if m is not None]
                bad = len(mids) - len(keep)
                st.owe(gid, -bad)
                self.loader.count_corrupt(bad)
                part.keep(keep)
                part.clean = True
                if not part.seqs:
                    continue
                mids = part.read[0]
            flights.append(Flight(st.bucket, lane.sid, gid, now, part.seqs, part.offs, part.dues, part.attempts, mids))
            kept.append(part)
        if not kept:
            return None
        o_seqs: list[int]
        o_dues: list[int]
        o_attempts: list[int]
        o_mids: list[Any]
        o_payloads: list[Any]
        o_headers: list[Any]
        if len(kept) == 1:  # one part (the usual case): its columns, not copies
            (part,) = kept
            o_seqs, o_dues, o_attempts = part.seqs, part.dues, part.attempts
            o_mids, o_payloads, o_headers = part.read
        else:
            o_seqs, o_dues, o_attempts, o_mids, o_payloads, o_headers = [], [], [], [], [], []
            for part in kept:
                o_seqs += part.seqs
                o_dues += part.dues
                o_attempts += part.attempts
                o_mids += part.read[0]
                o_payloads += part.read[1]
                o_headers += part.read[2]
        key = (id(o_seqs), id(o_attempts))
        made = ids.get(key)
        if made is not None and made[0] is o_seqs and made[1] is o_attempts:
            o_ids = made[2]
        else:
            o_ids = ack_ids(o_seqs, o_attempts)
            ids[key] = (o_seqs, o_attempts, o_ids)
        self.ledger.hand_out(flights, now + self.cfg.ack_timeout_ms)
        self.dispatched += len(o_seqs)
        return Deliveries(
            t.name,
            o_ids,
            o_mids,
            o_payloads,
            o_headers,
            o_dues,
            now,
            o_attempts,
            t.group.name,
        )
