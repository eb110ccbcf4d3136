"""Read-back passes: a spilled lane's entries read again from the schedule segments.

A lane over its bound forgets its entries (``server/lanes.py``); while its group's
consumers have credit, passes walk the loaded buckets and put its entries back into its
ready queue: those due at or before the time the pass began with (everything due then
had fired), neither held in memory, nor closed for the group (its dispatch log, plus the
records still buffered), nor claimed by a Cancel, cancelled or being dead-lettered. A
pass stops while the lane is at half its bound and goes on when the consumers have taken
them.

One step of a pass has three parts, which the scheduler thread runs with the scheduling
state's lock held for the first and the last only: ``next_step`` (which chunk of which
bucket, lock held), ``read`` (the chunk and the group's closes in the bucket's dispatch
log, no lock), ``apply`` (what is not to be read back dropped, the rest handed to
``Timer.take_back``, lock held). Only the scheduler thread appends to the dispatch log
(``DispatchLogWriter.flush``) and it does not while it runs a step, so every close made
between ``read`` and ``apply`` is in the writer's buffers, which ``apply`` consults.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from qdelay.errors import QdelayError
from qdelay.segments import bucket_log, framing, records
from qdelay.segments.bucket_log import BucketLog
from qdelay.segments.framing import RecordKind
from qdelay.segments.lookup import RecordFinder
from qdelay.segments.naming import bucket_of
from qdelay.segments.reader import Columns, columns_past_damage
from qdelay.server.buckets import BucketBook, BucketState
from qdelay.server.claims import CancelClaims
from qdelay.server.dispatch_log import DispatchLogWriter
from qdelay.server.groups import Group
from qdelay.server.lanes import Lane, Pass
from qdelay.server.ledger import AckLedger
from qdelay.server.timer import Timer

if TYPE_CHECKING:
    from qdelay.server.scheduler import SchedulerConfig

log = logging.getLogger("qdelay.scheduler")

Rows = tuple[np.ndarray, np.ndarray, np.ndarray]  # (seqs, file offsets, due times)


@dataclass(slots=True)
class Step:
    """One chunk of one bucket to read back for a lane, and what was read."""

    lane: Lane
    group: Group
    walk: Pass
    st: BucketState
    subject: bytes
    start: int  # the chunk: [start, stop) of the schedule segment
    stop: int
    closes_from: int  # the dispatch log is read from here
    after: int = 0  # where the next chunk starts
    rows: Rows | None = None  # the lane's entries in the chunk
    closes_to: int = 0  # the dispatch log's size when it was read
    closes: set[int] | None = None  # the group's closes in [closes_from, closes_to)


@dataclass(slots=True)
class Cancelled:
    """Messages of one bucket cancelled after they fired while some lane was spilled
    (``Scheduler.on_written``): a spilled lane of a message's subject counted it on disk
    unless it held it in memory then (``held``), and the tombstone names no subject, so
    which lane loses which is known once the records are read (``ReadBack.read_cancelled``).
    """

    st: BucketState
    seqs: list[int]
    held: dict[Lane, set[int]]  # each lane spilled then -> those of ``seqs`` it held in memory
    walks: dict[Lane, tuple[Pass, int, int]]  # counting walks then: (walk, bucket, offset reached)
    epoch: int  # Timer.lane_epoch then: a lane made or made whole since counts none of them
    kept: frozenset[int]  # subjects then keeping their due messages for a first group (Timer.kept_count)
    rows: list[tuple[int, bytes, int, int]] | None = None  # (seq, subject, due, offset) read


class ReadBack:
    def __init__(
        self,
        cfg: SchedulerConfig,
        timer: Timer,
        book: BucketBook,
        dispatch: BucketLog,
        writer: DispatchLogWriter,
        ledger: AckLedger,
        claims: CancelClaims,
        dead_lettering: set[int],
    ) -> None:
        self.cfg = cfg
        self.timer = timer
        self.book = book
        self.dispatch = dispatch
        self.writer = writer
        self.ledger = ledger
        self.claims = claims
        self.dead_lettering = dead_lettering  # read only: messages whose dead-letter copy is being written
        self.grown = 0  # steps whose dispatch log grew between read and apply (never, see above)
        self.cancelled: collections.deque[Cancelled] = collections.deque()  # waiting for their records
        self._finder = RecordFinder()

    # --- messages cancelled while counted on a spilled lane's disk ---------------------------------

    def note_cancelled(self, c: Cancelled) -> None:
        """Take ``c`` off the lanes' counts on disk once its records are read (lock held)."""
        self.cancelled.append(c)

    def read_cancelled(self, c: Cancelled) -> None:
        """The records of ``c`` (no lock): subject, due time and offset of each; a damaged
        one is left counted (its subject cannot be told)."""
        rows: list[tuple[int, bytes, int, int]] = []
        c.rows = rows
        try:
            frames = self._finder.find_many(c.st.seg, c.seqs)
        except (OSError, ValueError, QdelayError) as err:  # (a bucket done and cleaned meanwhile)
            log.warning("cancelled records not read: left counted on disk", extra={"error": str(err)})
            return
        for seq, frame in zip(c.seqs, frames):
            if frame is None or frame.kind != RecordKind.MESSAGE:
                continue
            msg = records.decode_message(frame.body)
            rows.append((seq, msg.subject.encode(), msg.deliver_at_ms, frame.offset))

    def apply_cancelled(self, c: Cancelled) -> None:
        """Each lane spilled when the tombstones passed, and still in the same spill, stops
        counting on disk the messages of its subject and group it counted there: due for
        the group (from its ``since``), not held in memory, and not left to a counting walk
        that had not reached them (it skips them now, uncounted). A subject with no group
        then and still none stops keeping them for its first group. Lock held."""
        timer, bucket = self.timer, c.st.bucket
        for _seq, subject, due, _off in c.rows or ():
            sid = timer.sid_of(subject)
            if sid is not None and sid in c.kept:
                timer.cancelled_kept(sid, due)
        for lane, held in c.held.items():
            g = timer.live_lane(lane)
            if g is None or not lane.spilled or lane.serial > c.epoch:
                continue
            walk = c.walks.get(lane)
            n = 0
            for seq, subject, due, off in c.rows or ():
                if seq in held or due < g.since or timer.sid_of(subject) != lane.sid:
                    continue
                if walk is not None:
                    w, at_bucket, at_offset = walk
                    upto = w.counting.get(bucket, -1) if w.counting is not None else -1
                    ahead = bucket > at_bucket or (bucket == at_bucket and off >= at_offset)
                    if off < upto and due <= w.hi and ahead:
                        continue
                n += 1
            if n:
                timer.cancelled_on_disk(lane, n)

    def next_step(self, credit: Callable[[str, str], int]) -> Step | bool:
        """The next chunk to read for a spilled lane (lock held); or True if the step was
        done here (a pass began, ended or moved to the next bucket, a deleted group's lane
        dropped), False if no lane has anything to read back now."""
        timer = self.timer
        lane = timer.spilled_to_read(credit)
        if lane is None:
            return False
        g = timer.live_lane(lane)
        if g is None:
            timer.forget_spill(lane)
            return True
        w = timer.pass_of(lane)
        if w is None:
            return True
        last = bucket_of(w.hi, self.cfg.scale_minutes)
        loaded = self.book.loaded
        if w.counting is None:
            nxt = min((b for b in loaded if w.bucket <= b <= last), default=None)
        else:  # a counting walk: the buckets loaded when the group was made, as far as read then
            nxt = min((b for b in w.counting if w.bucket <= b and b in loaded), default=None)
        if nxt is None:
            timer.end_pass(lane)
            return True
        w.at(nxt)
        st = loaded[nxt]
        stop = st.cursor if w.counting is None else min(st.cursor, w.counting[nxt])
        if w.offset >= stop:
            w.past(self.cfg.scale_minutes)
            return True
        subject = timer.subjects[lane.sid].encode()
        return Step(lane, g, w, st, subject, w.offset, stop, w.closes_from(nxt))

    def read(self, step: Step) -> None:
        """The disk reads of a step (no lock): the chunk, and the group's closes in the
        bucket's dispatch log (all of it on the first visit, what was appended since after)."""
        cols, step.after = columns_past_damage(step.st.seg, step.start, step.stop, self.cfg.load_chunk_bytes)
        step.rows = lane_rows(cols, step.subject, step.group.since, step.walk.hi) if cols is not None else None
        step.closes_to, step.closes = self._group_closes(step.st.bucket, step.group, step.closes_from)

    def apply(self, step: Step) -> bool:
        """Queue what the step read back (lock held), minus what is held in memory, closed,
        claimed or cancelled by now; True if it queued something."""
        w, bucket = step.walk, step.st.bucket
        if step.lane.walk is not w:
            # the pass ended meanwhile: respilled, or its group deleted while the chunk was
            # read (Timer.group_deleted ends the pass; queued for the gone lane, its entries
            # stayed counted in memory and owed by their bucket for ever)
            return False
        w.note_closes(bucket, step.closes_to, step.closes or set())
        dseg = self.dispatch.get(bucket)
        if dseg is not None and dseg.size > step.closes_to:
            # appended to after the read: only this thread writes the dispatch log, so this
            # does not happen; should it, the chunk is read again by the next step (with the
            # closes appended since) rather than the file being read here, under the lock
            self.grown += 1
            return False
        queued = False
        if step.rows is not None and len(step.rows[0]):
            if w.counting is not None:
                self._count(step.lane, step.group, step.st, w, step.rows[0])
            else:
                queued = self._take_back(step.lane, step.group, step.st, w, *step.rows)
        w.offset = step.after
        return queued

    def _group_closes(self, bucket: int, g: Group, start: int) -> tuple[int, set[int]]:
        """(size read, sequences closed for group ``g``) of the dispatch log of ``bucket``
        from ``start`` (found column-wise)."""
        seg = self.dispatch.get(bucket)
        if seg is None:
            return 0, set()
        size = seg.size
        name = g.stored.decode() or records.DEFAULT_GROUP
        return size, set(bucket_log.group_closes_in(seg, start, size, name).tolist())

    def _live(self, lane: Lane, g: Group, st: BucketState, w: Pass, listed: list[int]) -> np.ndarray:
        """Which of the entries ``listed`` (sequences) are neither held in memory, closed
        for the group, being dead-lettered, cancelled, nor closed for it before they were
        loaded. A membership test per set, on the entries read (unions of the sets cost
        their sizes per chunk: ``w.closed`` grows to the whole backlog while it drains,
        which made a 5 M-message drain quadratic); closes made since the dispatch log was
        read are in the writer's buffers (an ack moves a delivery there under the lock
        held now)."""
        pending = self.writer.pending(st.bucket)
        held: set[int] = {item[0] for item in lane.ready.retries}
        held |= self.ledger.held(lane.gid)
        if pending:
            held.update(bucket_log.group_closes_of(pending, g.name).tolist())
        keep = np.ones(len(listed), dtype=bool)
        for skip in (held, w.closed, self.dead_lettering, st.cancelled, st.partial.get(g.name)):
            if skip:
                keep &= np.fromiter((q not in skip for q in listed), dtype=bool, count=len(listed))
        return keep

    def _count(self, lane: Lane, g: Group, st: BucketState, w: Pass, seqs: np.ndarray) -> None:
        """A counting walk's chunk: its live entries for the lane are on disk (those a
        Cancel claimed too: a pass sets them aside and counts them read back)."""
        self.timer.count_on_disk(lane, int(self._live(lane, g, st, w, seqs.tolist()).sum()))

    def _take_back(
        self, lane: Lane, g: Group, st: BucketState, w: Pass, seqs: np.ndarray, offs: np.ndarray, dues: np.ndarray
    ) -> bool:
        """Queue entries read back for a spilled lane, minus those held in memory, closed,
        claimed or cancelled by now."""
        listed = seqs.tolist()
        keep = self._live(lane, g, st, w, listed)
        claimed = self.claims.claimed
        if claimed:
            # claimed by a Cancel: set aside (a release gives them back), held by the bucket
            # and read back as far as the lane's count on disk goes (else a release, which
            # queues the entry, counted it twice; a tombstone, which drops it, not at all)
            for i in np.flatnonzero(keep).tolist():
                q = listed[i]
                if q in claimed:
                    keep[i] = False
                    if self.claims.skip((q, int(offs[i]), st.bucket, int(dues[i]), 1, lane.sid, lane.gid)):
                        self.timer.set_aside(lane, st)
        if not keep.all():
            seqs, offs, dues = seqs[keep], offs[keep], dues[keep]
        if not len(seqs):
            return False
        self.timer.take_back(lane, st, seqs, offs, dues)
        return True


def lane_rows(cols: Columns, subject: bytes, since: int, hi: int) -> Rows:
    """(seqs, file offsets, due times) of the MESSAGE frames of ``cols`` of ``subject`` due
    in [since, hi]: checked column-wise on the frames' bytes."""
    rows = (cols.kinds == RecordKind.MESSAGE) & (cols.dues <= hi) & (cols.dues >= since)
    idx = np.flatnonzero(rows)
    if len(idx):
        raw = np.frombuffer(cols.data, dtype=np.uint8)
        body = cols.starts[idx] + framing.HEADER_SIZE
        slen = raw[body + 8].astype(np.int64) | (raw[body + 9].astype(np.int64) << 8)
        idx = idx[slen == len(subject)]
        if len(idx) and subject:
            at = (cols.starts[idx] + framing.HEADER_SIZE + records.MESSAGE_FIXED.size)[:, None] + np.arange(
                len(subject)
            )
            want = np.frombuffer(subject, dtype=np.uint8)
            idx = idx[(raw[at] == want).all(axis=1)]
    return cols.seqs[idx], cols.starts[idx] + cols.base, cols.dues[idx]
