"""MessageLog.append_raw / truncate_to: the slave's write path and divergent-tail cut."""

from __future__ import annotations

import os

import pytest

from qdelay.errors import CorruptRecord, InvariantViolation
from qdelay.segments import framing
from qdelay.segments.wal import MessageLog


def _fill(log: MessageLog, n: int, size: int = 50) -> None:
    for i in range(n):
        log.append([(framing.RecordKind.MESSAGE, 1000 + i, os.urandom(size))])


def _copy_all(src: MessageLog, dst: MessageLog, chunk: int = 300) -> None:
    while dst.committed_offset < src.committed_offset:
        off = dst.committed_offset
        data = src.read_raw(off, chunk)
        seg = src.segment_at(off)
        # whole frames only (what the master's sender does)
        pos = 0
        while pos + framing.HEADER_SIZE <= len(data):
            length = int.from_bytes(data[pos + 12 : pos + 16], "little")
            if pos + framing.HEADER_SIZE + length > len(data):
                break
            pos += framing.HEADER_SIZE + length
        if pos == 0:
            data = src.read_raw(off, 1 << 20)
            pos = framing.HEADER_SIZE + int.from_bytes(data[12:16], "little")
        dst.append_raw(data[:pos], off, seg.key)


def test_append_raw_copies_byte_for_byte_with_the_same_segments(tmp_path):
    src = MessageLog(str(tmp_path / "m"), segment_bytes=1000)
    dst = MessageLog(str(tmp_path / "s"), segment_bytes=1000)
    try:
        _fill(src, 60)
        _copy_all(src, dst)
        assert dst.committed_sequence == src.committed_sequence == 60
        assert [s.key for s in dst.segments()] == [s.key for s in src.segments()]
        for a, b in zip(src.segments(), dst.segments()):
            assert open(a.path, "rb").read() == open(b.path, "rb").read()
    finally:
        src.close()
        dst.close()
    # reopen: recovery agrees
    again = MessageLog(str(tmp_path / "s"), segment_bytes=1000)
    assert again.committed_sequence == 60
    again.close()


def test_append_raw_refuses_bad_checksum_gap_and_wrong_offset(tmp_path):
    src = MessageLog(str(tmp_path / "m"))
    dst = MessageLog(str(tmp_path / "s"))
    try:
        _fill(src, 3)
        data = bytearray(src.read_raw(0, 1 << 20))
        one = framing.HEADER_SIZE + 50
        bad = bytearray(data)
        bad[one + 40] ^= 0xFF
        with pytest.raises(CorruptRecord):
            dst.append_raw(bytes(bad), 0, 0)
        assert dst.committed_offset == 0 and os.path.getsize(dst.segments()[0].path) == 0
        with pytest.raises(InvariantViolation):
            dst.append_raw(bytes(data[one:]), 0, 0)  # starts at sequence 2
        with pytest.raises(InvariantViolation):
            dst.append_raw(bytes(data), 10, 0)
        with pytest.raises(CorruptRecord):
            dst.append_raw(bytes(data[:-3]), 0, 0)  # partial frame
        dst.append_raw(bytes(data), 0, 0)
        assert dst.committed_sequence == 3
    finally:
        src.close()
        dst.close()


def test_truncate_to_cuts_a_tail_across_segments_and_appends_continue(tmp_path):
    log = MessageLog(str(tmp_path / "m"), segment_bytes=500)
    try:
        _fill(log, 30)
        frames, _ = log.read(0, 1 << 20)
        all_frames = []
        off = 0
        while True:
            fr, nxt = log.read(off, 1 << 20)
            if not fr:
                break
            all_frames += fr
            off = nxt
        cut = all_frames[11]
        removed = log.truncate_to(cut.offset, cut.sequence - 1)
        assert removed > 0
        assert log.committed_offset == cut.offset and log.committed_sequence == 11
        a = log.append([(framing.RecordKind.MESSAGE, 5, b"x")])
        assert a.first_sequence == 12 and a.start_offset == cut.offset
    finally:
        log.close()
    again = MessageLog(str(tmp_path / "m"), segment_bytes=500)
    assert again.committed_sequence == 12
    again.close()
