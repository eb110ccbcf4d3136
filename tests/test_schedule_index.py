"""The schedule index file (segments/schedule_index.py) on its own: written ahead of its
segment and published after, found by binary search through a kept map while the file
grows, CANCELLED flags seen through a map made before they were written, and a rebuild
from the segment giving the same bytes."""

from __future__ import annotations

import numpy as np

from qdelay.segments import framing, records, schedule_index
from qdelay.segments.bucket_log import BucketLog
from qdelay.segments.framing import RecordKind
from qdelay.segments.segment import HandlePool

DUE = 1_767_225_600_000


def _frames(first_seq: int, n: int, cancels: tuple[int, ...] = ()) -> bytes:
    """``n`` MESSAGE frames from ``first_seq`` on, then a CANCEL of each of ``cancels``."""
    out = bytearray()
    seq = first_seq
    for i in range(n):
        body = records.encode_message(b"s", f"id{seq}".encode(), b"", b"p" * (i % 7), DUE + seq)
        framing.encode_into(out, RecordKind.MESSAGE, seq, 0, body)
        seq += 1
    for target in cancels:
        framing.encode_into(
            out, RecordKind.CANCEL, seq, 0, records.encode_cancel(records.Cancel(f"id{target}", DUE + target, target))
        )
        seq += 1
    return bytes(out)


def test_lookups_follow_a_growing_file_and_flags_written_in_place(tmp_path):
    pool = HandlePool(8)
    log = BucketLog(str(tmp_path), ".sched", pool, indexed=True)
    bucket = DUE // 60_000
    log.append(bucket, _frames(1, 500))
    seg = log.get(bucket)
    idx = seg.index
    assert idx.count == 500
    first = idx.lookup([1, 250, 500, 501, 0])
    assert first.hit.tolist() == [True, True, True, False, False]
    assert first.a.tolist() == [DUE + 1, DUE + 250, DUE + 500]  # MESSAGE: the due time
    # the file grows: tombstones of old messages (seen through the map kept above: their
    # flags are written in place) and new messages (the map is made again for them)
    log.append(bucket, _frames(501, 300, cancels=(7, 250, 650)))
    assert idx.count == 803
    flags = idx.lookup([7, 250, 8])
    assert (flags.flags & schedule_index.CANCELLED).tolist() == [1, 1, 0]
    newer = idx.lookup([650, 800, 801, 803, 804])
    assert newer.hit.tolist() == [True, True, True, True, False]
    assert (newer.flags & schedule_index.CANCELLED).tolist() == [1, 0, 0, 0]  # 650: cancelled in the same append
    assert newer.kinds.tolist() == [RecordKind.MESSAGE, RecordKind.MESSAGE, RecordKind.CANCEL, RecordKind.CANCEL]
    assert newer.a.tolist()[2:] == [7, 650]  # CANCEL: its target
    # every entry names its record: sequence and offset agree with the segment's frames
    seqs = np.arange(1, 804, dtype=np.int64)
    found = idx.lookup(seqs)
    assert found.hit.all()
    for k in (0, 1, 499, 500, 802):
        frame = seg.read_frame(int(found.offsets[k]))
        assert frame.sequence == k + 1
    # derived state: a rebuild from the segment writes the same bytes
    path = schedule_index.path_of(seg.path)
    with open(path, "rb") as f:
        before = f.read()
    assert idx.matches(seg)
    idx.rebuild(seg)
    with open(path, "rb") as f:
        assert f.read() == before
    assert idx.lookup([250]).hit.tolist() == [True]
    pool.close()
