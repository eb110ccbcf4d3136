"""The record frame: round trips, the checksum's coverage, and every reason a frame is bad."""

from __future__ import annotations

import struct

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from qdelay.segments import framing, reader
from qdelay.segments.framing import FrameError, RecordKind

u64 = st.integers(min_value=0, max_value=2**64 - 1)
i64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
kinds = st.sampled_from(list(RecordKind))
bodies = st.binary(max_size=2048)


@settings(max_examples=150, deadline=None)
@given(kind=kinds, sequence=u64, timestamp=i64, body=bodies)
def test_encode_decode_round_trip(kind, sequence, timestamp, body):
    data = framing.encode(kind, sequence, timestamp, body)
    assert len(data) == framing.HEADER_SIZE + len(body)
    frame = framing.check_at(data, 0)
    assert (frame.kind, frame.sequence, frame.timestamp, frame.body) == (kind, sequence, timestamp, body)
    assert frame.offset == 0 and frame.size == len(data)


@settings(max_examples=100, deadline=None)
@given(records=st.lists(st.tuples(kinds, u64, i64, bodies), max_size=20), prefix=st.binary(max_size=8))
def test_encode_into_matches_encode_and_scans_back(records, prefix):
    out = bytearray(prefix)
    for kind, seq, ts, body in records:
        framing.encode_into(out, kind, seq, ts, body)
    assert bytes(out) == prefix + b"".join(framing.encode(*r) for r in records)
    walked = list(reader.walk(out[len(prefix) :], len(prefix)))
    assert [(f.kind, f.sequence, f.timestamp, f.body) for f in walked] == records  # no Damage
    assert reader.scan_columns(bytes(out[len(prefix) :])).end == len(out) - len(prefix)


@settings(max_examples=100, deadline=None)
@given(
    kind=kinds,
    first=st.integers(min_value=0, max_value=2**63),
    timestamp=i64,
    many=st.lists(bodies, max_size=20),
    prefix=st.binary(max_size=8),
)
def test_encode_many_into_matches_encode_into(kind, first, timestamp, many, prefix):
    one, batch = bytearray(prefix), bytearray(prefix)
    for i, body in enumerate(many):
        framing.encode_into(one, kind, first + i, timestamp, body)
    assert framing.encode_many_into(batch, kind, first, timestamp, many) == first + len(many)
    assert batch == one


def test_header_layout_matches_the_spec():
    data = framing.encode(RecordKind.CANCEL, 0x0102030405060708, -2, b"xyz")
    magic, checksum, length, kind, version, flags, seq, ts = struct.unpack_from("<IQIBBHQq", data)
    assert data[:4] == b"QQD1" and magic == framing.MAGIC
    assert (length, kind, version, flags, seq, ts) == (3, 2, 1, 0, 0x0102030405060708, -2)
    assert checksum == xxhash.xxh3_64_intdigest(data[12:])  # bytes [12, 36 + length)
    assert data[36:] == b"xyz"


@pytest.mark.parametrize("offset", range(4, 36 + 5))
def test_every_checked_byte_is_covered(offset):
    """A change to any byte after the magic is caught (the checksum field itself included)."""
    data = bytearray(framing.encode(RecordKind.MESSAGE, 7, 1, b"hello"))
    data[offset] ^= 0x01
    with pytest.raises(FrameError):
        framing.check_at(data, 0)


def test_bad_magic_and_zero_fill():
    data = bytearray(framing.encode(RecordKind.MESSAGE, 1, 1, b"a"))
    data[0] ^= 0xFF
    with pytest.raises(FrameError, match="bad magic") as err:
        framing.check_at(data, 0)
    assert not err.value.zero
    with pytest.raises(FrameError) as err:
        framing.check_at(bytes(100), 0)
    assert err.value.zero and err.value.offset == 0
    with pytest.raises(FrameError) as err:
        framing.check_at(bytes(10), 0)
    assert err.value.zero


def test_short_and_overlong_frames():
    data = framing.encode(RecordKind.MESSAGE, 1, 1, b"abcdef")
    with pytest.raises(FrameError, match="runs past the end"):
        framing.check_at(data[:-1], 0)
    with pytest.raises(FrameError, match="a header needs"):
        framing.check_at(data[:20], 0)
    big = bytearray(data)
    struct.pack_into("<I", big, 12, framing.MAX_BODY + 1)
    with pytest.raises(FrameError, match="exceeds the maximum"):
        framing.check_at(big, 0)


def test_unknown_version_is_rejected_even_with_a_valid_checksum():
    data = bytearray(framing.encode(RecordKind.MESSAGE, 1, 1, b"abc"))
    data[17] = 2
    struct.pack_into("<Q", data, 4, xxhash.xxh3_64_intdigest(bytes(data[12:])))
    with pytest.raises(FrameError, match="version"):
        framing.check_at(data, 0)


def test_the_reader_tells_a_torn_tail_from_corruption():
    frames = [framing.encode(RecordKind.MESSAGE, i, i, bytes([i]) * 10) for i in range(1, 4)]
    torn = b"".join(frames)[:-3]
    got = list(reader.walk(torn))
    assert [type(g) for g in got] == [framing.Frame, framing.Frame, reader.Damage]
    assert got[2].status == reader.TORN and got[2].offset == 2 * len(frames[0])

    corrupt = bytearray(b"".join(frames))
    corrupt[len(frames[0]) + 40] ^= 1  # inside the second frame's body
    got = list(reader.walk(corrupt))
    assert [type(g) for g in got] == [framing.Frame, reader.Damage, framing.Frame]
    damage = got[1]
    assert (damage.status, damage.reason) == (reader.CORRUPT, "checksum mismatch")
    assert damage.offset == len(frames[0]) and damage.end == len(frames[0]) + len(frames[1])  # resynced
    assert reader.next_frame(corrupt, 1) == damage.end


@pytest.mark.parametrize("damaged", [False, True])
def test_record_before_lands_at_or_before_the_sequence(damaged):
    """The bisection ``find --sequence`` uses (reader.record_before), with probes much
    smaller than the segment: from the offset it gives, a walk meets the wanted frame
    before any later one, and it is near, also with a damaged stretch in the range."""
    frames = [framing.encode(RecordKind.MESSAGE, s, s, bytes([s % 251]) * (30 + (s * 37) % 400)) for s in range(1, 400)]
    buf = bytearray(b"".join(frames))
    if damaged:
        buf[len(buf) // 3] ^= 0xFF  # one frame lost, in the middle of a bisection's range
    data = bytes(buf)
    walked = {g.sequence: g.offset for g in reader.walk(data) if isinstance(g, framing.Frame)}
    assert len(walked) == len(frames) - damaged
    for seq in range(0, 402):
        start = reader.record_before(data, seq, probe=1024)
        first = next((g for g in reader.walk(data, 0, start) if isinstance(g, framing.Frame)), None)
        assert start == 0 or (first is not None and first.offset == start and first.sequence <= seq)
        if seq in walked:
            assert start <= walked[seq]
            assert walked[seq] - start < 2 * 1024  # within a probe and a frame of it, not a walk
