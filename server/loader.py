"""The loader: buckets brought into the timer wheel, a chunk at a time.

A step has three parts, which the scheduler thread runs with the scheduling state's lock
held for the first and the last only: ``next_step`` (open the loading window up to
``load_ahead_ms``, pick the lowest bucket not read to its end, unless the in-memory budget
is full), ``read`` (the chunk; on a bucket's first visit also what its dispatch log says
was closed and, for a bucket read in several chunks, its tombstones; no lock), ``apply``
(the chunk indexed by ``Timer.index`` within the budget, the cursor moved on; it checks
that the cursor did not move meanwhile: only this thread moves it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from qdelay.errors import InvariantViolation
from qdelay.segments import records
from qdelay.segments.bucket_log import BucketLog
from qdelay.segments.framing import Frame, RecordKind
from qdelay.segments.naming import bucket_of
from qdelay.segments.reader import read_frames_past_damage
from qdelay.segments.segment import CorruptionPolicy, Segment
from qdelay.server import dispatch_log
from qdelay.server.buckets import BucketBook, BucketState

if TYPE_CHECKING:
    from qdelay.server.scheduler import SchedulerConfig
    from qdelay.server.timer import Timer

log = logging.getLogger("qdelay.scheduler")


@dataclass(slots=True)
class LoadStep:
    """One chunk of one bucket to load, and what was read."""

    st: BucketState
    start: int  # the chunk: [start, stop) of the schedule segment
    stop: int
    first_visit: bool  # the dispatch log and tombstones are read too
    counted_below: int  # closes before this dispatch-log offset were counted already
    frames: list[Frame] = field(default_factory=list)
    after: int = 0  # where the next chunk starts
    closed: dict[str, set[int]] | None = None
    counted: dict[str, set[int]] | None = None
    tombstones: set[int] | None = None


class Loader:
    def __init__(
        self, cfg: SchedulerConfig, book: BucketBook, timer: Timer, dispatch: BucketLog, policy: CorruptionPolicy
    ) -> None:
        self.cfg = cfg
        self.book = book
        self.timer = timer
        self.dispatch = dispatch
        self.policy = policy
        self.corrupt_skipped = 0  # schedule records that failed their checks (never served)
        self.blocked = False  # the in-memory budget is full: loading paused

    # --- a step: next_step (lock held), read (no lock), apply (lock held) ---------------------------

    def next_step(self, now: int) -> LoadStep | None:
        """The next chunk to load at time ``now`` (lock held), or None: nothing to load, or
        no room in memory (``blocked``; the fullest lanes spill first)."""
        book, timer = self.book, self.timer
        horizon = bucket_of(now + self.cfg.load_ahead_ms, self.cfg.scale_minutes)
        if horizon > book.horizon:
            book.open_up_to(horizon)
        pending = book.to_load()
        if not pending:
            self.blocked = False
            return None
        if timer.room() <= 0:
            timer.relieve()
        if timer.room() <= 0:
            if not self.blocked:
                log.warning(
                    "loading paused: in-memory index is full",
                    extra={"entries": timer.in_memory(), "max": self.cfg.max_loaded},
                )
            self.blocked = True
            return None
        self.blocked = False
        st = min(pending, key=lambda s: s.bucket)
        return LoadStep(st, st.cursor, st.seg.size, not st.dispatch_ready, book.reopened_at.get(st.bucket, 0))

    def read(self, step: LoadStep) -> None:
        """The disk reads of a step (no lock)."""
        st, start, stop, chunk = step.st, step.start, step.stop, self.cfg.load_chunk_bytes
        if step.first_visit:
            step.closed, step.counted = self.read_closed(st.bucket, step.counted_below)
            # A bucket loaded in several chunks fires its first entries before the loader
            # reaches the tombstones behind them: collect those tombstones first.
            step.tombstones = self.read_tombstones(st.seg, start, stop, chunk) if stop - start > chunk else set()
        step.frames, step.after = self.read_chunk(st.seg, start, stop, chunk) if start < stop else ([], start)

    def apply(self, step: LoadStep) -> bool:
        """Index what the step read (lock held); True if the bucket is read to its end."""
        st, frames, after = step.st, step.frames, step.after
        if st.cursor != step.start:  # only this thread advances a loading cursor
            raise InvariantViolation(f"bucket {st.bucket} cursor moved during load")
        if step.first_visit:
            st.closed = step.closed
            st.counted = step.counted
            st.cancelled |= step.tombstones or set()
            st.dispatch_ready = True
            st.tombstones_known = True
        room = self.timer.room()
        if len(frames) > room:
            # no more entries than the budget has room for (at least one, to move on): the
            # rest of the chunk is read again when there is room, so records appended to a
            # loaded bucket (a burst into the loading window) cannot pass the bound by a chunk
            cut = [i for i, f in enumerate(frames) if f.kind == RecordKind.MESSAGE][max(room, 1) :]
            if cut:
                after = frames[cut[0]].offset
                # the tombstones of the rest count now: one read after its target (a cancel
                # written before a restart, in a bucket read in one chunk, so not gathered
                # first) would otherwise let the target fire, and Get would answer from a
                # set said to hold every tombstone of the bucket
                st.cancel(
                    records.decode_cancel(f.body).target_sequence
                    for f in frames[cut[0] :]
                    if f.kind == RecordKind.CANCEL
                )
                frames = frames[: cut[0]]
        self.timer.index(st, frames)
        st.cursor = after
        if st.cursor >= st.seg.size:
            st.complete = True
            st.closed = st.counted = None
            return True
        return False

    # --- the reads ----------------------------------------------------------------------------------

    def read_chunk(self, seg: Segment, start: int, stop: int, chunk_bytes: int) -> tuple[list[Frame], int]:
        """One chunk of a schedule segment; a corrupt record is reported and stepped over.

        The message in a corrupt record cannot be delivered (it is never served as data);
        the audit job reports it as lost. Everything after it still is.
        """
        frames, nxt, damage = read_frames_past_damage(seg, start, stop, chunk_bytes)
        if damage is not None:
            log.error(
                "corrupt schedule record skipped",
                extra={"path": damage.path, "offset": damage.offset, "reason": damage.reason},
            )
            self.corrupt_skipped += 1
        return frames, nxt

    def count_corrupt(self, n: int) -> None:
        """``n`` schedule records found unreadable elsewhere (read back for delivery or for a
        dead-letter copy): one count of records never served, whoever found them."""
        self.corrupt_skipped += n

    def read_tombstones(self, seg: Segment, start: int, stop: int, chunk_bytes: int) -> set[int]:
        """The sequences CANCEL records in [start, stop) of ``seg`` cancel."""
        found: set[int] = set()
        pos = start
        while pos < stop:
            frames, pos = self.read_chunk(seg, pos, stop, chunk_bytes)
            for f in frames:
                if f.kind == RecordKind.CANCEL:
                    found.add(records.decode_cancel(f.body).target_sequence)
        return found

    def read_closed(self, bucket: int, counted_below: int) -> tuple[dict[str, set[int]], dict[str, set[int]]]:
        return dispatch_log.read_closed(self.dispatch, bucket, self.policy, counted_below)
