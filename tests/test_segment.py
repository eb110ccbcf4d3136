"""Segments, the handle pool and recovery: torn tails are cut, corruption is reported.

The rules under test (docs/formats.md, "Recovery"): a bad frame with no valid frame after
it is a torn tail and is truncated; a bad frame followed by a valid one is corruption,
reported with the file and offset (policy FAIL) or cut there (policy TRUNCATE). What is
cut is kept in ``<file>.broken`` unless it is all zeros. Bad bytes are never served.
"""

from __future__ import annotations

import os
import random
import shutil

import pytest
from byte_surgery import file_bytes, flip_byte, truncate_at, zero_fill_tail

from qdelay.errors import CorruptRecord
from qdelay.segments import framing, reader
from qdelay.segments.framing import RecordKind
from qdelay.segments.segment import CorruptionPolicy, HandlePool, Segment, recover


def build(
    path: str, pool: HandlePool, count: int, seed: int = 1, big_at: int | None = None
) -> tuple[Segment, list[int], list[bytes]]:
    """A segment of ``count`` MESSAGE frames with random bodies; returns (segment, offsets, frames)."""
    rng = random.Random(seed)
    seg = Segment(path, 0, pool, size=0)
    offsets, frames = [], []
    for i in range(count):
        size = 200_000 if i == big_at else rng.randrange(0, 120)
        frame = framing.encode(RecordKind.MESSAGE, i + 1, 1_700_000_000_000 + i, rng.randbytes(size))
        offsets.append(seg.append(frame))
        frames.append(frame)
    seg.sync()
    return seg, offsets, frames


def sequences(path: str, pool: HandlePool) -> list[int]:
    return [f.sequence for f in Segment(path, 0, pool).frames()]


# --- segment basics ---------------------------------------------------------------------


def test_append_read_frame_and_frames(tmp_path, pool):
    path = str(tmp_path / "a.seg")
    seg, offsets, frames = build(path, pool, 20)
    assert offsets[0] == 0 and seg.size == sum(map(len, frames))
    for i, offset in enumerate(offsets):
        frame = seg.read_frame(offset)
        assert (frame.offset, frame.sequence) == (offset, i + 1)
    assert [f.offset for f in seg.frames()] == offsets
    assert [f.offset for f in seg.frames(offsets[5], offsets[9])] == offsets[5:9]
    assert seg.read(offsets[3], len(frames[3])) == frames[3]


def test_frames_across_small_chunks_and_a_frame_larger_than_a_chunk(tmp_path, pool, monkeypatch):
    monkeypatch.setattr(reader, "READ_CHUNK", 100)
    path = str(tmp_path / "a.seg")
    seg, offsets, _ = build(path, pool, 30, big_at=17)
    assert [f.offset for f in seg.frames()] == offsets
    rec = recover(path)
    assert (rec.records, rec.valid_size, rec.cut_bytes) == (30, seg.size, 0)


def test_frames_never_read_past_the_range(tmp_path, pool):
    path = str(tmp_path / "a.seg")
    seg, offsets, _ = build(path, pool, 5)
    served = []
    with pytest.raises(CorruptRecord) as err:
        for frame in seg.frames(0, offsets[3] + 40):
            served.append(frame.sequence)
    assert served == [1, 2, 3] and err.value.offset == offsets[3]


def test_read_frame_at_a_bad_offset_is_corrupt_record(tmp_path, pool):
    path = str(tmp_path / "a.seg")
    seg, offsets, _ = build(path, pool, 3)
    with pytest.raises(CorruptRecord) as err:
        seg.read_frame(offsets[1] + 1)
    assert err.value.path == path and err.value.offset == offsets[1] + 1
    with pytest.raises(CorruptRecord):
        seg.read_frame(seg.size)  # past the end


def test_read_frames_at_matches_read_frame_in_any_order(tmp_path, pool, monkeypatch):
    monkeypatch.setattr(reader, "SPAN_GAP", 300)  # several runs, and a frame past its run's read
    monkeypatch.setattr(reader, "SPAN_BYTES", 2_000)
    path = str(tmp_path / "a.seg")
    seg, offsets, _ = build(path, pool, 60, big_at=33)
    picks = random.Random(3).sample(offsets, 40) + [offsets[33], offsets[-1]]
    got = reader.read_frames_at(seg, picks)
    assert [(f.offset, f.sequence, f.body) for f in got] == [
        (f.offset, f.sequence, f.body) for f in (seg.read_frame(o) for o in picks)
    ]
    assert reader.read_frames_at(seg, []) == []
    flip_byte(path, offsets[20] + framing.HEADER_SIZE)  # a body byte: its checksum fails
    with pytest.raises(CorruptRecord) as err:
        reader.read_frames_at(Segment(path, 0, pool), [offsets[5], offsets[20], offsets[40]])
    assert err.value.offset == offsets[20]


# --- torn tails -------------------------------------------------------------------------


def test_torn_tail_cut_at_every_byte_of_the_last_record(tmp_path, pool):
    original = str(tmp_path / "orig.seg")
    _, offsets, frames = build(original, pool, 6, seed=7)
    data = file_bytes(original)
    last = offsets[-1]
    for cut in range(last, len(data)):
        path = str(tmp_path / f"cut{cut}.seg")
        shutil.copyfile(original, path)
        truncate_at(path, cut)
        rec = recover(path)
        assert (rec.records, rec.valid_size, rec.last_sequence) == (5, last, 5), cut
        assert os.path.getsize(path) == last
        assert rec.corrupt_at is None
        if cut == last:
            assert rec.cut_bytes == 0 and rec.broken_path is None
        else:
            assert rec.torn and rec.cut_bytes == cut - last
            assert file_bytes(rec.broken_path) == data[last:cut]
        assert sequences(path, pool) == [1, 2, 3, 4, 5]
        pool.forget(path)


def test_torn_tail_followed_by_zero_fill_at_every_byte(tmp_path, pool):
    original = str(tmp_path / "orig.seg")
    _, offsets, _ = build(original, pool, 4, seed=3)
    data = file_bytes(original)
    last = offsets[-1]
    for cut in range(last, len(data)):
        path = str(tmp_path / f"cut{cut}.seg")
        shutil.copyfile(original, path)
        truncate_at(path, cut)
        zero_fill_tail(path, 4096)
        rec = recover(path)
        assert (rec.records, rec.valid_size) == (3, last), cut
        assert rec.torn and rec.cut_bytes == cut - last + 4096
        if cut == last:
            assert rec.broken_path is None  # only zeros were cut: nothing worth keeping
        else:
            assert file_bytes(rec.broken_path) == data[last:cut] + bytes(4096)


def test_preallocated_zeros_after_complete_records(tmp_path, pool):
    path = str(tmp_path / "a.seg")
    _, _, frames = build(path, pool, 5)
    size = sum(map(len, frames))
    zero_fill_tail(path, 1 << 20)
    rec = recover(path)
    assert (rec.records, rec.valid_size, rec.torn, rec.broken_path) == (5, size, True, None)
    assert os.path.getsize(path) == size


def test_clean_file_is_left_alone(tmp_path, pool):
    path = str(tmp_path / "a.seg")
    _, _, frames = build(path, pool, 5)
    before = file_bytes(path)
    rec = recover(path)
    assert (rec.records, rec.cut_bytes, rec.torn, rec.reason) == (5, 0, False, None)
    assert file_bytes(path) == before
    empty = str(tmp_path / "empty.seg")
    open(empty, "wb").close()
    assert recover(empty).records == 0


def test_on_frame_sees_every_valid_frame_with_its_offset(tmp_path, pool):
    path = str(tmp_path / "a.seg")
    _, offsets, _ = build(path, pool, 8)
    seen = []
    recover(path, on_frame=lambda f: seen.append((f.offset, f.sequence)))
    assert seen == list(zip(offsets, range(1, 9)))


# --- corruption in the middle -------------------------------------------------------------


def corrupt_copy(tmp_path, name: str, original: str, offset: int) -> str:
    path = str(tmp_path / name)
    shutil.copyfile(original, path)
    flip_byte(path, offset)
    return path


def test_flipped_byte_in_a_middle_record_fails_with_file_and_offset(tmp_path, pool):
    original = str(tmp_path / "orig.seg")
    _, offsets, frames = build(original, pool, 7, seed=11)
    middle = offsets[3]
    for at in range(middle, middle + len(frames[3])):  # every byte of the record
        path = corrupt_copy(tmp_path, f"flip{at}.seg", original, at)
        before = file_bytes(path)
        with pytest.raises(CorruptRecord) as err:
            recover(path, CorruptionPolicy.FAIL)
        assert err.value.path == path
        assert err.value.offset == middle, at
        assert f"offset {middle}" in str(err.value) and path in str(err.value)
        assert file_bytes(path) == before  # policy FAIL changes nothing
        assert not os.path.exists(path + ".broken")


def test_flipped_byte_with_policy_truncate_cuts_and_keeps_the_rest(tmp_path, pool):
    original = str(tmp_path / "orig.seg")
    _, offsets, frames = build(original, pool, 7, seed=11)
    data = file_bytes(original)
    middle = offsets[3]
    path = corrupt_copy(tmp_path, "flip.seg", original, middle + 40)
    rec = recover(path, CorruptionPolicy.TRUNCATE)
    assert (rec.records, rec.valid_size, rec.corrupt_at, rec.torn) == (3, middle, middle, False)
    assert rec.reason == "checksum mismatch"
    broken = bytearray(data[middle:])
    broken[40] ^= 0xFF
    assert file_bytes(rec.broken_path) == bytes(broken)
    assert sequences(path, pool) == [1, 2, 3]


def test_corrupt_record_is_never_served(tmp_path, pool):
    original = str(tmp_path / "orig.seg")
    seg, offsets, _ = build(original, pool, 7, seed=5)
    path = corrupt_copy(tmp_path, "flip.seg", original, offsets[3] + 20)
    bad = Segment(path, 0, pool)
    served = []
    with pytest.raises(CorruptRecord) as err:
        for frame in bad.frames():
            served.append(frame.sequence)
    assert served == [1, 2, 3] and err.value.offset == offsets[3]
    with pytest.raises(CorruptRecord) as err:
        bad.read_frame(offsets[3])
    assert err.value.offset == offsets[3]
    assert bad.read_frame(offsets[4]).sequence == 5  # the records around it are fine
    assert [f.sequence for f in bad.frames(offsets[4])] == [5, 6, 7]


def test_corruption_in_a_small_chunk_read(tmp_path, pool, monkeypatch):
    monkeypatch.setattr(reader, "READ_CHUNK", 64)
    original = str(tmp_path / "orig.seg")
    _, offsets, _ = build(original, pool, 12, seed=9, big_at=6)
    for index in (2, 6, 10):
        path = corrupt_copy(tmp_path, f"flip{index}.seg", original, offsets[index] + 30)
        with pytest.raises(CorruptRecord) as err:
            recover(path)
        assert err.value.offset == offsets[index]
        with pytest.raises(CorruptRecord) as err:
            list(Segment(path, 0, pool).frames())
        assert err.value.offset == offsets[index]


def test_broken_files_are_never_overwritten(tmp_path, pool):
    path = str(tmp_path / "a.seg")
    _, offsets, _ = build(path, pool, 3)
    for n in range(3):
        os.truncate(path, offsets[-1])
        with open(path, "ab") as f:
            f.write(b"torn%d" % n)
        recover(path)
    assert sorted(os.listdir(tmp_path)) == ["a.seg", "a.seg.broken", "a.seg.broken.1", "a.seg.broken.2"]
    assert file_bytes(path + ".broken.2") == b"torn2"


# --- the handle pool ------------------------------------------------------------------------


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_handle_pool_never_holds_more_than_its_capacity(tmp_path):
    pool = HandlePool(4)
    paths = []
    for i in range(50):
        path = str(tmp_path / f"{i:02d}.seg")
        Segment(path, i, pool, size=0).append(framing.encode(RecordKind.MESSAGE, i, 0, b"x" * i))
        paths.append(path)
        assert pool.open_count <= 4
    pool.close()
    baseline = open_fds()
    peak = 0
    for _round in range(2):
        for i, path in enumerate(paths):
            seg = Segment(path, i, pool)
            assert seg.read_frame(0).body == b"x" * i
            assert [f.sequence for f in seg.frames()] == [i]
            peak = max(peak, pool.open_count, open_fds() - baseline)
    assert peak <= 4
    assert pool.opens >= 100  # LRU of 4 over 50 files in a cycle: every read reopens
    pool.close()
    assert open_fds() == baseline


def test_handle_pool_keeps_pinned_handles_and_forgets_safely(tmp_path):
    pool = HandlePool(2)
    paths = [str(tmp_path / f"{i}.seg") for i in range(4)]
    for p in paths:
        open(p, "wb").close()
    baseline = open_fds()
    with pool.fd(paths[0]) as fd0, pool.fd(paths[1]), pool.fd(paths[2]):
        assert pool.open_count == 3  # over capacity only while pinned
        pool.forget(paths[0])  # in use: closed when released, not now
        os.fstat(fd0)
        with pool.fd(paths[0]) as again:
            assert again != fd0  # a forgotten path gets a new descriptor
    assert pool.open_count <= 2
    pool.close()
    assert open_fds() == baseline
    with pytest.raises(ValueError):
        HandlePool(1)


def test_append_many_writes_chunks_back_to_back_in_pieces_and_survives_short_writes(tmp_path, monkeypatch):
    """``Segment.append_many`` (the dispatch log's flush): chunks written as if joined,
    grouped into writes of at most 256 KiB, a chunk larger than that in pieces, and a
    short write finished by the rest."""
    from qdelay.segments import segment as segment_mod

    pool = HandlePool(4)
    seg = Segment(str(tmp_path / "s"), 0, pool, size=0)
    rng = random.Random(7)
    chunks = [rng.randbytes(rng.choice((0, 10, 37_000, 300_000, 700_000))) for _ in range(40)]
    calls = []
    real_pwritev, real_pwrite = os.pwritev, os.pwrite

    def pwritev(fd, bufs, offset):
        calls.append(sum(map(len, bufs)))
        if len(calls) % 3 == 0:  # now and then a short write
            return real_pwrite(fd, b"".join(bufs)[: max(1, calls[-1] // 2)], offset)
        return real_pwritev(fd, bufs, offset)

    def pwrite(fd, data, offset):
        calls.append(len(data))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(segment_mod.os, "pwritev", pwritev)
    monkeypatch.setattr(segment_mod.os, "pwrite", pwrite)
    assert seg.append(b"head") == 0
    assert seg.append_many(chunks) == 4
    monkeypatch.undo()
    assert seg.size == 4 + sum(map(len, chunks))
    assert open(tmp_path / "s", "rb").read() == b"head" + b"".join(chunks)
    assert max(calls) <= segment_mod._WRITE_PIECE
