"""The timer: what is due, what fired, and for whom: the scheduling state with no I/O.

It owns the timer wheel (entries loaded and not yet due), the subjects' ids, the lanes
(per subject and group: entries due and ready in memory, or *spilled*: left on disk and
read back by passes) and the round-robin of lanes with ready work. It reads and updates
the bucket book's per-bucket counts (``unfired``, ``owed``) as entries move.

No disk, no clock, no threads, no lock of its own: every method is called by the
scheduler (``server/scheduler.py``) holding ``Scheduler.lock``; what it cannot know
without I/O (the records of a chunk, what a spilled lane's pass read back, what is
closed or cancelled) the scheduler reads and hands in. So it can be driven and checked on
its own, with numbers instead of files.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from qdelay.segments import records
from qdelay.segments.framing import Frame, RecordKind
from qdelay.segments.naming import bucket_of
from qdelay.server.buckets import BucketBook, BucketState
from qdelay.server.groups import BEGINNING, Group, GroupTable
from qdelay.server.lanes import Lane, Pass
from qdelay.server.ledger import Item
from qdelay.server.wheel import Entries, TimerWheel

if TYPE_CHECKING:
    from qdelay.server.scheduler import SchedulerConfig

log = logging.getLogger("qdelay.scheduler")

# what one lane gave to one dispatch round: the lane, its group, the subject, and the
# items as columns (seqs, offsets, buckets, due times, attempts)
Taken = tuple[Lane, Group, str, tuple[list[int], list[int], list[int], list[int], list[int]]]


class Timer:
    def __init__(
        self, cfg: SchedulerConfig, book: BucketBook, groups: GroupTable, *, legacy_upto: int, clock: Callable[[], int]
    ) -> None:
        self.cfg = cfg  # the scheduler's (scale_minutes, tick_ms, max_loaded, group_max_ready, implicit_group)
        self.book = book
        self.groups = groups
        # messages up to this sequence were written before groups existed: a subject of
        # theirs without a group gets the group "default", which inherits their DISPATCH
        # records (docs/formats.md, upgrade)
        self.legacy_upto = legacy_upto
        self.clock = clock  # only to date a group created implicitly
        self.wheel = TimerWheel(cfg.tick_ms)
        self.subjects: list[str] = []
        self._subject_ids: dict[bytes, int] = {}
        self._targets_cache: dict[int, list[Group]] = {}
        self._targets_version = -1
        self.lanes: dict[tuple[int, int], Lane] = {}  # (subject id, group id) -> lane
        self._lanes_of: dict[int, list[Lane]] = {}  # group id -> its lanes (a group's changes cost its own lanes)
        # subject id -> the latest due time of its entries that fired (or were left out of the
        # wheel as closed for every group they were for): a group created with a later
        # ``since`` has nothing to read back
        self._fired_due: dict[int, int] = {}
        # subject id -> lowest bucket with entries that became due while it had no group
        self.kept: dict[int, int] = {}
        # subject id -> how many of them its first group is for (due at or after the time
        # its last group was deleted, the first group's ``since``): on disk for that group
        self.kept_count: dict[int, int] = {}
        self.ready_total = 0
        self.rr: collections.deque[Lane] = collections.deque()  # lanes with ready work
        self.spilled: set[Lane] = set()
        self._partial_any = False  # some loaded bucket has entries closed for some groups only
        self.fired_to = 0  # every wheel entry due at or before this has fired
        # counts lanes made and lanes made whole (``Lane.serial``): a lane with a later
        # serial than a moment's count counts nothing on disk of before that moment
        self.lane_epoch = 0

    # --- subjects and groups ----------------------------------------------------------------------

    def subject_id(self, subject: bytes) -> int:
        sid = self._subject_ids.get(subject)
        if sid is None:
            sid = self._subject_ids[subject] = len(self.subjects)
            self.subjects.append(subject.decode())
        return sid

    def targets(self, sid: int, seq: int = 0) -> list[Group]:
        """The groups of subject ``sid``, oldest ``since`` first. A subject of data written
        before groups existed gets the group "default" (see legacy_upto)."""
        if self._targets_version != self.groups.version:
            self._targets_cache.clear()
            self._targets_version = self.groups.version
        got = self._targets_cache.get(sid)
        if got is None:
            got = sorted(self.groups.of_subject(self.subjects[sid]), key=lambda g: (g.since, g.gid))
            if not got and (self.cfg.implicit_group or (seq and seq <= self.legacy_upto)):
                implicit = self.cfg.implicit_group or records.DEFAULT_GROUP
                self.groups.create(self.subjects[sid], implicit, self.clock())
                return self.targets(sid)
            self._targets_cache[sid] = got
        return got

    def lane(self, sid: int, gid: int) -> Lane:
        lane = self.lanes.get((sid, gid))
        if lane is None:
            lane = self.lanes[(sid, gid)] = Lane(sid, gid, self.lane_bound(sid, gid))
            self.lane_epoch += 1
            lane.serial = self.lane_epoch
            self._lanes_of.setdefault(gid, []).append(lane)
        return lane

    def live_lane(self, lane: Lane) -> Group | None:
        """The group of ``lane`` if the lane is still its group's (not deleted meanwhile)."""
        g = self.groups.by_gid(lane.gid)
        return g if g is not None and self.lanes.get((lane.sid, lane.gid)) is lane else None

    def group_created(self, g: Group) -> None:
        """A new group: what already fired without it and is for it is read back from disk
        (its lane starts spilled): what its subject kept while it had no group, and, for a
        group whose since is not after the timer (one replayed after a restart, or created
        in the very millisecond the timer fired), what fired from its since on, if any entry
        of its subject due at or after its since has fired. (Checking the timer alone spilled
        nearly every group created beside others, as the timer had usually fired since its
        creation time: each such idle lane then cost every scheduler turn a look, and held
        every bucket from its since on from becoming done until a consumer came.)"""
        sid = self.subject_id(g.subject.encode())
        read_from = self.kept.pop(sid, None)
        kept = self.kept_count.pop(sid, 0)
        count: Pass | None = None
        if self.fired_to >= g.since > BEGINNING and self._fired_due.get(sid, BEGINNING) >= g.since:
            # what fired from its since on, for the subject's other groups only, is read back
            # for it; when the subject has other groups (and kept nothing: what it kept is
            # counted) a counting walk counts it on disk first, over what is loaded now
            b = bucket_of(g.since, self.cfg.scale_minutes)
            if read_from is None and len(self.targets(sid)) > 1:
                top = bucket_of(self.fired_to, self.cfg.scale_minutes)
                upto = {k: st.cursor for k, st in self.book.loaded.items() if b <= k <= top}
                count = Pass(b, self.fired_to, upto)
            read_from = b if read_from is None else min(read_from, b)
        if read_from is not None:
            lane = self.lane(sid, g.gid)
            lane.spilled = True
            lane.drop_from = read_from
            lane.on_disk += kept
            lane.walk = count
            self.spilled.add(lane)

    def group_deleted(self, g: Group) -> None:
        """A deleted group: its lanes go, with their ready entries and spills; the buckets
        stop waiting for it."""
        for lane in self._lanes_of.pop(g.gid, ()):
            del self.lanes[(lane.sid, lane.gid)]
            self.ready_total -= lane.ready.count
            self.spilled.discard(lane)
            # a pass step reading for it now (outside the lock) queues nothing when it ends
            self.end_pass(lane)
            # a lane left in the round-robin is dropped by ``take`` (no longer live)
        for st in self.book.loaded.values():
            st.owed.pop(g.gid, None)
            st.partial.pop(g.name, None)

    def lanes_of(self, gid: int) -> list[Lane]:
        return list(self._lanes_of.get(gid, ()))

    # --- loading ----------------------------------------------------------------------------------

    def in_memory(self) -> int:
        """Index entries held in memory: in the wheel, or ready in lanes (``max_loaded``)."""
        return len(self.wheel) + self.ready_total

    def room(self) -> int:
        return self.cfg.max_loaded - self.in_memory()

    def index(self, st: BucketState, frames: list[Frame]) -> None:
        """Put the MESSAGE frames of a loaded chunk of ``st`` into the wheel: cancelled ones
        and those closed for every group they are for are left out; a CANCEL's target is
        noted as cancelled."""
        due, seq, off, subj = [], [], [], []
        cancels: list[int] = []  # targets of this chunk's CANCELs
        closed = st.closed or {}
        counted = st.counted or {}
        for f in frames:
            if f.kind == RecordKind.MESSAGE:
                q = f.sequence
                st.top_indexed = q  # increasing in a segment: a later cancel of q is "late"
                if q in st.cancelled:
                    continue
                d, subject, _mid = records.message_index_fields(f.body)
                sid = self.subject_id(subject)
                if closed:
                    hit = [name for name, seqs in closed.items() if q in seqs]
                    if hit:
                        targets = [g for g in self.targets(sid, q) if g.since <= d]
                        first = targets[0].name if targets else hit[0]
                        if first in hit and q not in counted.get(first, ()):
                            st.nclosed += 1
                        if targets and all(g.name in hit for g in targets):
                            # closed for every group it is for: as good as fired for them
                            if d > self._fired_due.get(sid, BEGINNING):
                                self._fired_due[sid] = d
                            continue
                        for name in hit:
                            st.partial.setdefault(name, set()).add(q)
                        self._partial_any = True
                due.append(d)
                seq.append(q)
                off.append(f.offset)
                subj.append(sid)
            elif f.kind == RecordKind.CANCEL:
                target = records.decode_cancel(f.body).target_sequence
                st.cancel((target,))
                cancels.append(target)
        if cancels and due:
            # a target read earlier in this same chunk is not in the wheel yet, so the cancel
            # was not noted late (BucketState.cancel: nothing unfired): leave it out here,
            # or it would fall due into its groups' backlog
            gone = set(cancels)
            rows = [i for i, q in enumerate(seq) if q not in gone]
            if len(rows) < len(seq):
                due, seq, off, subj = ([col[i] for i in rows] for col in (due, seq, off, subj))
        st.unfired += len(due)
        if not due:
            return
        n = len(due)
        self.wheel.add_many(
            Entries(
                np.array(due, dtype=np.int64),
                np.array(seq, dtype=np.int64),
                np.array(off, dtype=np.int64),
                np.full(n, st.bucket, dtype=np.int32),
                np.array(subj, dtype=np.int32),
            )
        )

    # --- firing -----------------------------------------------------------------------------------

    def next_fire(self) -> int | None:
        return self.wheel.next_fire()

    def fire(self, now: int) -> None:
        """Move due entries from the wheel to the lanes of their subjects' groups: every
        group the message is for gets it (fan-out)."""
        # the wheel fires whole ticks (``tick_ms``): what is due later in the current tick
        # stays in it, so a read-back pass must not take it as fired (read back, then fired,
        # it was delivered twice)
        self.fired_to = max(self.fired_to, now - now % self.cfg.tick_ms)
        due = self.wheel.pop_due(now)
        if len(due) == 0:
            return
        buckets, counts = np.unique(due.bucket, return_counts=True)
        late: dict[int, BucketState] = {}
        for b, c in zip(buckets.tolist(), counts.tolist()):
            st = self.book.get(b)
            if st is not None:
                st.unfired -= c
                if st.late_cancels:
                    late[b] = st
        # split by subject, keeping due order inside each subject
        order = np.argsort(due.subj, kind="stable")
        sorted_e = due.take(order)
        subjects, starts = np.unique(sorted_e.subj, return_index=True)
        bounds = list(starts[1:]) + [len(sorted_e)]
        fired_due = self._fired_due
        for sid, lo, hi in zip(subjects.tolist(), starts.tolist(), bounds):
            part = sorted_e.take(slice(lo, hi))
            last = int(part.due.max())
            if last > fired_due.get(sid, BEGINNING):
                fired_due[sid] = last
            targets = self.targets(sid, int(part.seq.min()))
            if late:  # (with no group too: what the subject keeps counts for its first group)
                part = self._drop_late_cancels(part, late)
                if not len(part):
                    continue
            if not targets:
                # nobody to deliver to: the entries wait on disk for the subject's first group
                low = int(part.bucket.min())
                self.kept[sid] = min(low, self.kept.get(sid, low))
                since = self.groups.kept_since(self.subjects[sid])
                n = len(part) if since <= int(part.due.min()) else int((part.due >= since).sum())
                self.kept_count[sid] = self.kept_count.get(sid, 0) + n
                continue
            for g in targets:
                self._to_lane(self.lane(sid, g.gid), g, part)
        for st in late.values():
            if st.unfired <= 0:  # nothing of it left in the wheel: the rest targeted fired entries
                st.late_cancels.clear()

    @staticmethod
    def _drop_late_cancels(part: Entries, late: dict[int, BucketState]) -> Entries:
        """Leave out the entries cancelled after they were put in the wheel (the load skips
        those cancelled before): queued, they counted in their groups' backlog until a
        consumer's round dropped them, for ever in a group without consumers. Only buckets
        that had such a cancel pay for the check."""
        keep = np.ones(len(part), dtype=bool)
        for b, st in late.items():
            gone = np.fromiter(st.late_cancels, dtype=np.int64, count=len(st.late_cancels))
            hit = (part.bucket == b) & np.isin(part.seq, gone)
            if hit.any():
                keep &= ~hit
                st.late_cancels.difference_update(part.seq[hit].tolist())
        return part if keep.all() else part.take(keep)

    def _to_lane(self, lane: Lane, g: Group, part: Entries) -> None:
        """Queue fired entries for one group: those it is for, not closed for it already
        and not just read back; a spilled lane forgets them (they are on disk)."""
        if g.since > int(part.due.min()):
            part = part.take(part.due >= g.since)
        if self._partial_any and len(part):
            keep = np.ones(len(part), dtype=bool)
            for b in np.unique(part.bucket).tolist():
                st = self.book.get(b)
                done_for_g = st.partial.get(g.name) if st is not None else None
                if done_for_g:
                    keep &= ~((part.bucket == b) & np.isin(part.seq, list(done_for_g)))
            part = part.take(keep)
        if lane.recent is not None:
            if len(part):
                part = part.take(~np.isin(part.seq, list(lane.recent)))
            lane.recent = None
        if not len(part):
            return
        if lane.spilled:
            w = lane.walk
            if w is not None and w.counting is not None:
                # loaded before the group was made and due in the window its counting walk
                # counts (they were in the wheel then: the walk counts them whenever they fire)
                upto = np.array([w.counting.get(b, -1) for b in part.bucket.tolist()], dtype=np.int64)
                walked = int(((part.due <= w.hi) & (part.off < upto)).sum())
                lane.dropped(part.bucket, len(part) - walked)
            else:
                lane.dropped(part.bucket)
            return
        self._owe(g.gid, part.bucket, 1)
        self._push(lane, part)
        if lane.ready.count > lane.bound:
            self.spill(lane)

    def _push(self, lane: Lane, e: Entries) -> None:
        self._in_turn(lane)
        lane.ready.push(e)
        self.ready_total += len(e)

    def _in_turn(self, lane: Lane) -> None:
        """``lane`` has ready work: in the round-robin once. Not "when its queue was empty":
        a queue emptied outside a round (a spill, cancels) left the lane in it, and the
        next entry put it in again, so it took two turns a round, one more at each such
        emptying."""
        if not lane.in_rr:
            lane.in_rr = True
            self.rr.append(lane)

    def _owe(self, gid: int, buckets: np.ndarray, sign: int) -> None:
        """Count entries of ``gid`` held in memory per bucket, up (1) or down (-1)."""
        if not len(buckets):
            return
        first = int(buckets[0])
        if int(buckets[-1]) == first and (len(buckets) < 3 or bool((buckets == first).all())):
            st = self.book.get(first)
            if st is not None:
                st.owe(gid, sign * len(buckets))
            return
        bs, cs = np.unique(buckets, return_counts=True)
        for b, c in zip(bs.tolist(), cs.tolist()):
            st = self.book.get(b)
            if st is not None:
                st.owe(gid, sign * c)

    def requeue(self, item: Item) -> bool:
        """Put a retry at the front of its lane; a deleted group's is dropped (False), and so
        is a cancelled message's: a retry waiting out its backoff in the ack ledger may be
        claimed and cancelled there, after ``cancel_ready`` looked at the ready queues
        (queued, it counted in the group's backlog until a consumer's round dropped it)."""
        seq, off, bucket, due, attempt, subj, gid = item
        lane = self.lanes.get((subj, gid))
        if lane is None:
            return False
        st = self.book.get(bucket)
        if st is not None and seq in st.cancelled:
            st.owe(gid, -1)  # no longer held for the group
            return False
        self._in_turn(lane)
        lane.ready.push_retry((seq, off, bucket, due, attempt))
        self.ready_total += 1
        return True

    def cancel_ready(self, bucket: int, targets: set[int]) -> int:
        """Cancelled messages of ``bucket`` (tombstones reported by the iterate service)
        leave the ready queues of every group holding them, and with them the groups'
        backlog and the bucket's ``owed`` at once; their entries are dropped when a round
        or a spill reaches them. Only the lanes of groups that hold entries of the bucket
        in memory are asked, each at the cost of the targets (``Ready.cancel``). Returns
        how many entries left a queue."""
        st = self.book.get(bucket)
        if st is None:
            return 0
        total = 0
        for gid in [gid for gid, n in st.owed.items() if n > 0]:
            for lane in self._lanes_of.get(gid, ()):
                if lane.ready.count:
                    n = lane.ready.cancel(targets)
                    if n:
                        st.owe(gid, -n)
                        self.ready_total -= n
                        total += n
        return total

    def fired_among(self, st: BucketState, targets: list[int]) -> list[int]:
        """Of ``targets`` (of ``st``, cancelled now), those that fired already: put in the
        wheel (at or below the highest sequence its load read) and no longer there. Asked
        (lock held, before a later fire) only while some lane is spilled: fired, a target
        may be counted on a lane's disk (``ReadBack.apply_cancelled``)."""
        lo = st.bucket * 60_000
        if lo > self.fired_to:
            return []  # nothing of a minute the wheel has not reached has fired (the usual cancel)
        top = st.top_indexed
        got = [q for q in targets if q <= top]
        if not got or st.unfired <= 0:
            return got
        seqs = np.asarray(got, dtype=np.int64)
        held = self.wheel.holding(st.bucket, lo, lo + self.cfg.scale_minutes * 60_000, seqs)
        return [int(q) for q in seqs[~held]]

    def counting_walks(self) -> dict[Lane, tuple[Pass, int, int]]:
        """Spilled lanes with a counting walk under way: (the walk, the bucket and offset it
        has counted to), what decides whether a message cancelled now was counted by it."""
        return {
            ln: (ln.walk, ln.walk.bucket, ln.walk.offset)
            for ln in self.spilled
            if ln.walk is not None and ln.walk.counting is not None
        }

    def spilled_holding(self, seqs: list[int], epoch: int) -> dict[Lane, set[int]]:
        """Each lane spilled since ``epoch`` or before -> which of ``seqs`` its ready queue
        holds in memory (those a cancel marked too): not on its disk."""
        return {ln: ln.ready.holding(seqs) for ln in self.spilled if ln.serial <= epoch}

    def sid_of(self, subject: bytes) -> int | None:
        return self._subject_ids.get(subject)

    def cancelled_kept(self, sid: int, due: int) -> None:
        """A message of subject ``sid`` (no group since it fired) was cancelled: no longer
        kept for its first group, if it was counted for it (due from the subject's
        ``kept_since``, as ``fire`` counts)."""
        n = self.kept_count.get(sid)
        if n and due >= self.groups.kept_since(self.subjects[sid]):
            self.kept_count[sid] = n - 1

    def cancelled_on_disk(self, lane: Lane, n: int) -> None:
        """``n`` entries the spilled ``lane`` counted on disk were cancelled."""
        lane.cancelled(n)

    def may_hold_fired(self, st: BucketState, targets: list[int]) -> bool:
        """Whether some of ``targets`` (cancelled now) may wait in a lane's ready queue:
        the bucket has entries held in memory for some group, and a target was put in the
        wheel (it may have fired since)."""
        if not any(st.owed.values()):
            return False
        top = st.top_indexed
        return any(q <= top for q in targets)

    def has_lane(self, sid: int, gid: int) -> bool:
        """The lane exists (its group was not deleted since it was made)."""
        return (sid, gid) in self.lanes

    # --- memory bounds: spills --------------------------------------------------------------------

    def lane_bound(self, sid: int, gid: int) -> int:
        """Entries one lane may hold ready: its group's bound (``group_max_ready_of``
        "SUBJECT/GROUP", else ``group_max_ready``), and at most a quarter of the whole
        in-memory budget, so that a few idle groups cannot fill it. Read once, when the lane
        is made (a group's lane lives as long as the group)."""
        bound = self.cfg.group_max_ready
        g = self.groups.by_gid(gid)
        if g is not None and self.cfg.group_max_ready_of:
            bound = self.cfg.group_max_ready_of.get(f"{self.subjects[sid]}/{g.name}", bound)
        return max(1, min(bound, self.cfg.max_loaded // 4))

    def relieve(self) -> None:
        """The in-memory budget is full: the lanes holding the most ready entries spill to
        disk until a quarter of it is free again, so that entries nobody takes never stop
        the loader (and with it every other subject's deliveries)."""
        target = self.cfg.max_loaded * 3 // 4
        for lane in sorted(self.lanes.values(), key=lambda ln: ln.ready.count, reverse=True):
            if self.in_memory() <= target or not lane.ready.chunks:
                return
            self.spill(lane)

    def spill(self, lane: Lane) -> None:
        """A lane over its bound forgets its queued entries; retries stay."""
        dropped = lane.ready.drop_chunks()
        n = sum(map(len, dropped))
        self.ready_total -= n
        for buckets in dropped:
            self._owe(lane.gid, buckets, -1)
            lane.dropped(buckets)
        if not lane.spilled:
            log.info(
                "group over its in-memory bound: its due entries wait on disk",
                extra={"subject": self.subjects[lane.sid], "gid": lane.gid, "dropped": n},
            )
        lane.spilled = True
        self.spilled.add(lane)

    def spill_floor(self) -> int:
        """The lowest bucket that may hold entries some group keeps on disk only: no bucket
        at or above it is done."""
        floor = min(self.kept.values(), default=2**62)
        for lane in self.spilled:
            if lane.drop_from is not None:
                floor = min(floor, lane.drop_from)
            if lane.walk is not None:
                floor = min(floor, lane.walk.bucket)
        return floor

    def spilled_to_read(self, credit: Callable[[str, str], int]) -> Lane | None:
        """A spilled lane to read back for now: one below half its bound whose consumers
        have credit (an idle group's backlog stays on disk until credit returns), or one
        with nothing left to read (its pass ends), or whose group is gone; first, whatever
        the credit, one with a counting walk (``Pass.counting``: it reads, queues nothing)."""
        for ln in self.spilled:
            if ln.walk is not None and ln.walk.counting is not None:
                return ln  # counted whatever the credit: an idle group's backlog is right
            if ln.ready.count >= ln.bound // 2:
                continue
            g = self.groups.by_gid(ln.gid)
            if g is None or credit(self.subjects[ln.sid], g.name) > 0 or (ln.walk is None and ln.drop_from is None):
                return ln
        return None

    def pass_of(self, lane: Lane) -> Pass | None:
        """The spilled lane's pass over the loaded buckets, begun now (up to what has fired)
        if none is under way; None if nothing was forgotten since the last pass began: then
        the lane is whole again and takes its entries from the wheel."""
        if lane.walk is None:
            if lane.drop_from is None:
                lane.whole()
                self.lane_epoch += 1
                lane.serial = self.lane_epoch
                self.spilled.discard(lane)
                return None
            lane.walk = Pass(lane.drop_from, self.fired_to)
            lane.drop_from = None
        return lane.walk

    def end_pass(self, lane: Lane) -> None:
        """The lane's pass read every loaded bucket up to its end."""
        lane.walk = None

    def forget_spill(self, lane: Lane) -> None:
        """A spilled lane whose group was deleted: nothing to read back for it."""
        self.spilled.discard(lane)

    def count_on_disk(self, lane: Lane, n: int) -> None:
        """A counting walk found ``n`` more of the lane's entries on disk."""
        lane.counted(n)

    def take_back(self, lane: Lane, st: BucketState, seqs: np.ndarray, offs: np.ndarray, dues: np.ndarray) -> None:
        """Queue entries of ``st`` a spilled lane's pass read back (the caller dropped those
        closed, cancelled or held already), minus those queued in the lane."""
        queued = [item[0].seq[item[1] :] for item in lane.ready.chunks]
        if queued:
            keep = ~np.isin(seqs, np.concatenate(queued))
            if not keep.all():
                seqs, offs, dues = seqs[keep], offs[keep], dues[keep]
        if not len(seqs):
            return
        n = len(seqs)
        self._push(
            lane,
            Entries(
                dues.astype(np.int64),
                seqs.astype(np.int64),
                offs.astype(np.int64),
                np.full(n, st.bucket, dtype=np.int32),
                np.full(n, lane.sid, dtype=np.int32),
            ),
        )
        st.owe(lane.gid, n)
        lane.read_back(n)
        if lane.recent is None:
            lane.recent = set(seqs.tolist())
        else:
            lane.recent.update(seqs.tolist())  # in place: a drain adds its whole backlog here

    def set_aside(self, lane: Lane, st: BucketState) -> None:
        """A spilled lane's pass met an entry of ``st`` a Cancel has claimed and set it aside
        (``CancelClaims.skip``): held by its bucket until the claim ends, and no longer on
        disk for the lane. Counted as read back: a release queues it again (``requeue``),
        a tombstone drops it, so either way the lane's backlog counts it once, or not at all
        once cancelled (kept counted on disk, a released entry was counted twice, ready and
        on disk, until the lane was whole again)."""
        st.owe(lane.gid, 1)
        lane.read_back(1)

    # --- dispatch ---------------------------------------------------------------------------------

    def take(self, credit: Callable[[str, str], int], tokens: Callable[[int], int], quantum: int) -> list[Taken]:
        """One dispatch round: from each lane with ready work, in turn, up to ``quantum``
        items within its consumers' credit and the rate limit (``tokens``)."""
        out: list[Taken] = []
        rr = self.rr
        shared: dict = {}  # a chunk's columns, made once for every lane taking them (fan-out)
        for _ in range(len(rr)):
            lane = rr.popleft()
            lane.in_rr = False
            g = self.live_lane(lane)
            if g is None:
                continue  # the group was deleted
            q = lane.ready
            name = self.subjects[lane.sid]
            n = min(credit(name, g.name), quantum, q.count)
            n = tokens(n) if n > 0 else 0
            if n > 0:
                cols = q.take(n, shared)
                if cols[0]:  # (none if all it reached were cancelled while queued)
                    self.ready_total -= len(cols[0])
                    out.append((lane, g, name, cols))
            if q.count > 0:
                self._in_turn(lane)
        return out
