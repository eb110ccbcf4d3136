"""Build realistic qdelay data folders with the real storage code (for tests and tools).

The layout is a server's ``--data-dir``:

- ``message/<base>.wal``: MESSAGE and CANCEL frames, written by :class:`MessageLog`;
- ``schedule/<day>/<minute>.sched``: byte-identical copies of those frames, in the
  segment of the message's due bucket (a CANCEL goes to its target's bucket);
- ``dispatch/<day>/<minute>.disp``: DISPATCH frames (sequence = the message's sequence,
  timestamp = the ack time), in the same bucket as the schedule segment;
- ``checkpoint/iterate.ckpt``: ``{"offset": global offset, "sequence": last iterated}``.

Everything is deterministic: callers pass every time, ids default to ``msg-0001`` ...,
so two builds of the same scenario are byte-identical (golden files depend on it).

    b = DataFolderBuilder(root)
    s = b.send("order.close", b"{}", due_ms=T0 + 60_000, created_ms=T0)
    b.cancel(s, at_ms=T0 + 1_000)
    b.iterate(at_ms=T0 + 2_000)      # copy the message log into the schedule log
    b.dispatch(s, dispatched_ms=..., acked_ms=...)
    b.close()
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from qdelay.segments import checkpoint, framing, naming, records
from qdelay.segments.framing import RecordKind
from qdelay.segments.records import Cancel, Dispatch, Group, GroupOp, Message, Outcome
from qdelay.segments.segment import HandlePool, Segment
from qdelay.segments.wal import MessageLog
from qdelay.server.groups import GroupTable

T0 = 1_767_225_600_000  # 2026-01-01T00:00:00Z: the fixed origin of the golden scenarios


@dataclass(slots=True)
class Written:
    """One record of the message log as the builder remembers it."""

    sequence: int
    kind: int
    timestamp: int
    body: bytes
    due_ms: int
    message_id: str
    offset: int  # global offset in the message log
    schedule: tuple[str, int] | None = None  # (relative path, offset) once iterated
    extra: dict = field(default_factory=dict)


class DataFolderBuilder:
    def __init__(self, root: str, *, segment_bytes: int = 64 * 1024 * 1024, scale_minutes: int = 1) -> None:
        self.root = root
        self.scale = scale_minutes
        os.makedirs(root, exist_ok=True)
        self.log = MessageLog(os.path.join(root, naming.MESSAGE_DIR), segment_bytes=segment_bytes, flush="sync")
        self.pool = HandlePool(32)
        self.written: dict[int, Written] = {}
        self.order: list[int] = []
        self._segments: dict[str, Segment] = {}
        self._ids = 0
        self._iterated = 0  # index into self.order
        self._iterate_offset = 0
        self._iterate_sequence = 0
        self.groups = GroupTable()

    # --- message log ---------------------------------------------------------------------

    def next_id(self) -> str:
        self._ids += 1
        return f"msg-{self._ids:04d}"

    def send(
        self,
        subject: str,
        payload: bytes,
        *,
        due_ms: int,
        created_ms: int,
        message_id: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> int:
        return self.send_many([(subject, payload, due_ms, created_ms, message_id, headers)])[0]

    def send_many(self, items) -> list[int]:
        """Append many messages in one group commit; items are
        (subject, payload, due_ms, created_ms[, message_id[, headers]])."""
        entries = []
        metas = []
        for item in items:
            subject, payload, due_ms, created_ms, *rest = item
            message_id = rest[0] if rest and rest[0] else self.next_id()
            headers = rest[1] if len(rest) > 1 and rest[1] else {}
            body = records.encode_message_obj(Message(subject, payload, due_ms, message_id, headers))
            entries.append((RecordKind.MESSAGE, created_ms, body))
            metas.append((due_ms, message_id))
        return self._append(entries, metas)

    def group(self, subject: str, name: str, *, at_ms: int, op: GroupOp = GroupOp.CREATE) -> int:
        """A GROUP record (a consumer group created or deleted), as Subscribe or ChangeGroup
        writes it; iterate() leaves it in the message log, as the iterate service does."""
        body = records.encode_group(Group(op, subject, name))
        return self._append([(RecordKind.GROUP, at_ms, body)], [(0, "")])[0]

    def cancel(self, sequence: int, *, at_ms: int) -> int:
        target = self.written[sequence]
        body = records.encode_cancel(Cancel(target.message_id, target.due_ms, sequence))
        return self._append([(RecordKind.CANCEL, at_ms, body)], [(target.due_ms, target.message_id)])[0]

    def _append(self, entries, metas) -> list[int]:
        appended = self.log.append(entries)
        seqs = []
        offset = appended.start_offset
        for i, ((kind, ts, body), (due, mid)) in enumerate(zip(entries, metas)):
            seq = appended.first_sequence + i
            self.written[seq] = Written(seq, kind, ts, body, due, mid, offset)
            self.order.append(seq)
            offset += framing.HEADER_SIZE + len(body)
            seqs.append(seq)
        return seqs

    # --- iterate: message log -> schedule log --------------------------------------------

    def _segment(self, log_dir: str, bucket: int, suffix: str) -> tuple[Segment, str]:
        rel = os.path.join(log_dir, naming.bucket_relpath(bucket, suffix))
        seg = self._segments.get(rel)
        if seg is None:
            path = os.path.join(self.root, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            seg = Segment(path, bucket, self.pool, size=os.path.getsize(path) if os.path.exists(path) else 0)
            self._segments[rel] = seg
        return seg, rel

    def iterate(self, *, at_ms: int, upto_sequence: int | None = None) -> None:
        """Copy message-log records (up to ``upto_sequence``) into their schedule segments
        and save the iterate checkpoint (its frame stamped ``at_ms``)."""
        while self._iterated < len(self.order):
            seq = self.order[self._iterated]
            if upto_sequence is not None and seq > upto_sequence:
                break
            w = self.written[seq]
            if w.kind == RecordKind.GROUP:  # applied to the group table, never copied
                g = records.decode_group(w.body)
                if g.op == GroupOp.CREATE:
                    self.groups.create(g.subject, g.group, w.timestamp)
                else:
                    self.groups.delete(g.subject, g.group, w.timestamp)
                self.groups.applied_seq = seq
                self._iterated += 1
                self._iterate_offset = w.offset + len(framing.encode(w.kind, w.sequence, w.timestamp, w.body))
                self._iterate_sequence = seq
                continue
            seg, rel = self._segment(
                naming.SCHEDULE_DIR, naming.bucket_of(w.due_ms, self.scale), naming.SCHEDULE_SUFFIX
            )
            frame = framing.encode(w.kind, w.sequence, w.timestamp, w.body)
            w.schedule = (rel, seg.append(frame))
            self._iterated += 1
            self._iterate_offset = w.offset + len(frame)
            self._iterate_sequence = seq
        for seg in self._segments.values():
            seg.sync()
        self.write_checkpoint(at_ms)

    def write_checkpoint(self, at_ms: int) -> None:
        path = os.path.join(self.root, naming.CHECKPOINT_DIR, "iterate" + naming.CHECKPOINT_SUFFIX)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        state = {"offset": self._iterate_offset, "sequence": self._iterate_sequence}
        if self.groups.applied_seq:  # the group table, as the server saves it (the golden
            state.update(self.groups.state())  # files' folders, written before groups, have none)
        with open(path, "wb") as f:  # fixed frame timestamp: deterministic bytes
            f.write(checkpoint.encode(state, at_ms))

    # --- dispatch log --------------------------------------------------------------------

    def dispatch(
        self,
        sequence: int,
        *,
        dispatched_ms: int,
        acked_ms: int,
        attempt: int = 1,
        outcome: int = Outcome.DELIVERED,
        group: str = records.DEFAULT_GROUP,
    ) -> None:
        w = self.written[sequence]
        if w.schedule is None:
            raise ValueError(f"sequence {sequence} was not iterated into the schedule log yet")
        seg, _rel = self._segment(naming.DISPATCH_DIR, naming.bucket_of(w.due_ms, self.scale), naming.DISPATCH_SUFFIX)
        body = records.encode_dispatch(
            Dispatch(w.message_id, w.due_ms, dispatched_ms, w.schedule[1], attempt, int(outcome), group)
        )
        seg.append(framing.encode(RecordKind.DISPATCH, sequence, acked_ms, body))

    # --- paths and teardown --------------------------------------------------------------

    def schedule_path(self, sequence: int) -> str:
        return os.path.join(self.root, self.written[sequence].schedule[0])

    def wal_paths(self) -> list[str]:
        return [p for _b, p in naming.list_wal(os.path.join(self.root, naming.MESSAGE_DIR))]

    def close(self) -> None:
        for seg in self._segments.values():
            seg.sync()
        self.log.close()
        self.pool.close()
        self.log.pool.close()


# --- ready-made scenarios ---------------------------------------------------------------


def build_golden(root: str) -> DataFolderBuilder:
    """The deterministic scenario of the golden files (times from T0 = 2026-01-01 UTC).

    seq 1  order.close  due 00:01:00.000  delivered (dispatched +120 ms, acked +150 ms)
    seq 2  order.close  due 00:01:00.500  binary payload, delivered on attempt 2
    seq 3  price.switch due 00:02:00.000  headers, cancelled by seq 4
    seq 5  retry.call   due 00:03:00.000  pending
    seq 6  retry.call   due 00:03:30.000  dead-lettered on attempt 3
    seq 7  order.close  due 00:04:00.000  in the message log only (after the checkpoint)
    """
    b = DataFolderBuilder(root, segment_bytes=400)
    s1 = b.send("order.close", b'{"order":1}', due_ms=T0 + 60_000, created_ms=T0 + 1_000)
    s2 = b.send("order.close", b"\x00\xff\x10binary", due_ms=T0 + 60_500, created_ms=T0 + 1_100)
    s3 = b.send(
        "price.switch",
        b"price=42",
        due_ms=T0 + 120_000,
        created_ms=T0 + 2_000,
        headers={"tenant": "acme", "trace": "t-1"},
    )
    b.cancel(s3, at_ms=T0 + 3_000)
    s5 = b.send("retry.call", b"call me", due_ms=T0 + 180_000, created_ms=T0 + 4_000)
    s6 = b.send("retry.call", b"fails", due_ms=T0 + 210_000, created_ms=T0 + 4_500, message_id="client-id-6")
    b.iterate(at_ms=T0 + 5_000)
    b.send("order.close", b'{"order":7}', due_ms=T0 + 240_000, created_ms=T0 + 6_000)
    b.dispatch(s1, dispatched_ms=T0 + 60_120, acked_ms=T0 + 60_150)
    b.dispatch(s2, dispatched_ms=T0 + 90_700, acked_ms=T0 + 90_800, attempt=2)
    b.dispatch(s6, dispatched_ms=T0 + 300_000, acked_ms=T0 + 300_010, attempt=3, outcome=Outcome.DEAD_LETTERED)
    assert s5 == 5
    return b


def build_audit_planted(root: str) -> DataFolderBuilder:
    """A folder with one of each audit finding (judged at ``now = T0 + 600_000``).

    seq 1 clean delivered; seq 2 lost (due T0+120 s, never dispatched nor cancelled);
    seq 3 delivered twice; seq 4 cancelled by seq 5 at T0+10 s, yet delivered at T0+180 s;
    seq 6 delivered early (dispatched 5 s before due); seq 7 due after ``now`` (pending, fine);
    seq 8 cancelled (fine); seq 10 the group ``billing`` of seq 2's subject (without a group,
    seq 2 would be kept for the subject's first group, not lost).
    """
    b = DataFolderBuilder(root)
    s1 = b.send("a.ok", b"1", due_ms=T0 + 60_000, created_ms=T0)
    b.send("a.lost", b"2", due_ms=T0 + 120_000, created_ms=T0, message_id="lost-one")
    s3 = b.send("a.dup", b"3", due_ms=T0 + 120_000, created_ms=T0, message_id="dup-one")
    s4 = b.send("a.cxl", b"4", due_ms=T0 + 180_000, created_ms=T0, message_id="cancelled-one")
    b.cancel(s4, at_ms=T0 + 10_000)
    s6 = b.send("a.early", b"6", due_ms=T0 + 240_000, created_ms=T0, message_id="early-one")
    b.send("a.later", b"7", due_ms=T0 + 3_600_000, created_ms=T0)
    s8 = b.send("a.cxl", b"8", due_ms=T0 + 300_000, created_ms=T0)
    b.cancel(s8, at_ms=T0 + 20_000)
    b.group("a.lost", "billing", at_ms=T0 + 25_000)
    b.iterate(at_ms=T0 + 30_000)
    b.dispatch(s1, dispatched_ms=T0 + 60_010, acked_ms=T0 + 60_020)
    b.dispatch(s3, dispatched_ms=T0 + 120_010, acked_ms=T0 + 120_020)
    b.dispatch(s3, dispatched_ms=T0 + 150_010, acked_ms=T0 + 150_020, attempt=2)
    b.dispatch(s4, dispatched_ms=T0 + 180_010, acked_ms=T0 + 180_020)
    b.dispatch(s6, dispatched_ms=T0 + 235_000, acked_ms=T0 + 235_010)
    return b


def build_audit_clean(root: str) -> DataFolderBuilder:
    """Every past-due message delivered on time or cancelled (judged at ``now = T0 + 600_000``)."""
    b = DataFolderBuilder(root)
    seqs = b.send_many([(f"c.s{i % 3}", b"x" * i, T0 + 60_000 * (1 + i % 5), T0) for i in range(20)])
    cancelled = b.cancel(seqs[0], at_ms=T0 + 1_000)
    assert cancelled
    b.send("c.future", b"f", due_ms=T0 + 7_200_000, created_ms=T0)
    b.iterate(at_ms=T0 + 2_000)
    for i, s in enumerate(seqs[1:], 1):
        due = T0 + 60_000 * (1 + i % 5)
        b.dispatch(s, dispatched_ms=due + 5 * i, acked_ms=due + 5 * i + 3)
    return b
