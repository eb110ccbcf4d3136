"""MessageLog.append_raw / truncate_to: the slave's write path and divergent-tail cut, and
where the cut goes (replication/slave.py find_fork)."""

from __future__ import annotations

import asyncio
import os

import pytest

from qdelay.errors import CorruptRecord, InvariantViolation
from qdelay.replication import common
from qdelay.replication.slave import find_fork
from qdelay.segments import framing, naming
from qdelay.segments.wal import MessageLog
from qdelay.v1 import replication_pb2 as rpb


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


def _frames_of(log: MessageLog):
    """find_fork's view of a master holding ``log`` (what Replication.Frames answers)."""

    async def master_frames(offset: int, n: int):
        r = rpb.FramesResponse(first_offset=log.first_offset, end_offset=log.committed_offset)
        if log.first_offset <= offset < log.committed_offset:
            for off, seq, checksum, size in common.frame_infos(log.read_raw(offset, 1 << 20), offset)[:n]:
                r.frames.add(offset=off, sequence=seq, checksum=checksum, size=size)
        return [(f.offset, f.sequence, f.checksum, f.size) for f in r.frames], r

    return master_frames


def test_a_log_that_begins_where_the_masters_ends_forks_at_its_start(tmp_path):
    """A slave resynced at offset O holds records from O on; the master it follows now ends
    exactly at O (another server, which never had them, took over). Nothing of the master's
    is left to compare, but every record here is beyond its end: the fork is O, and the
    slave follows the master from there (it was told to resync: 'no common prefix')."""
    src = MessageLog(str(tmp_path / "old"), segment_bytes=1000)
    master = MessageLog(str(tmp_path / "m"), segment_bytes=1000)
    _fill(src, 60)
    cut = src.segments()[2]
    at = cut.key
    seq = common.frame_infos(src.read_raw(at, 1 << 20), at)[0][1] - 1
    _copy_all(src, master)
    master.truncate_to(at, seq)  # the new master: the same log, ending at O
    os.makedirs(tmp_path / "s")
    open(tmp_path / "s" / naming.wal_name(at), "wb").close()  # as a resync leaves it
    slave = MessageLog(str(tmp_path / "s"), segment_bytes=1000, min_next_sequence=seq + 1)
    try:
        _copy_all(src, slave)
        assert slave.first_offset == at < slave.committed_offset
        assert asyncio.run(find_fork(slave, _frames_of(master))) == (at, seq)
        slave.truncate_to(at, seq)
        _fill(master, 5)  # the new master's own records follow on
        _copy_all(master, slave)
        assert slave.committed_offset == master.committed_offset and slave.committed_sequence == seq + 5
        # a master whose log no longer reaches back to this one's oldest record: a resync
        _fill(master, 40)
        master.delete_before(master.segments()[-2].key)
        first = master.first_offset
        assert first > slave.committed_offset
        with pytest.raises(InvariantViolation) as err:
            asyncio.run(find_fork(slave, _frames_of(master)))
        assert str(err.value) == (
            f"no common prefix with the master's log from offset {at} (the master's oldest segment "
            f"starts at {first}): a full resync is needed ('qdelay admin resync')"
        )
    finally:
        src.close()
        master.close()
        slave.close()
