"""The loader's reads: a bucket's schedule segment in chunks, its tombstones, and what its
dispatch log says was closed.

Called by the scheduler thread *outside* the scheduler lock (these are the disk reads of
loading); what they return is applied to the bucket's state under the lock, by the
scheduler, which checks that the bucket's cursor did not move meanwhile.
"""

from __future__ import annotations

import logging

from qdelay.segments import records
from qdelay.segments.bucket_log import BucketLog
from qdelay.segments.framing import Frame, RecordKind
from qdelay.segments.reader import read_frames_past_damage
from qdelay.segments.segment import CorruptionPolicy, Segment
from qdelay.server import dispatch_log

log = logging.getLogger("qdelay.scheduler")


class Loader:
    def __init__(self, dispatch: BucketLog, policy: CorruptionPolicy) -> None:
        self.dispatch = dispatch
        self.policy = policy
        self.corrupt_skipped = 0  # schedule records that failed their checks (never served)

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
