"""Body codecs: every record kind round-trips, and sizes match docs/formats.md."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qdelay.segments import checkpoint, framing, records
from qdelay.segments.framing import RecordKind
from qdelay.segments.records import Cancel, Dispatch, Message, Outcome

i64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
u64 = st.integers(min_value=0, max_value=2**64 - 1)
u32 = st.integers(min_value=0, max_value=2**32 - 1)
text = st.text(max_size=40)
message_ids = st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=64)

messages = st.builds(
    Message,
    subject=text,
    payload=st.binary(max_size=4096),
    deliver_at_ms=i64,
    message_id=message_ids,
    headers=st.dictionaries(text, st.text(max_size=100), max_size=8),
)
cancels = st.builds(Cancel, message_id=message_ids, deliver_at_ms=i64, target_sequence=u64)
dispatches = st.builds(
    Dispatch,
    message_id=message_ids,
    deliver_at_ms=i64,
    dispatched_at_ms=i64,
    schedule_offset=u64,
    attempt=u32,
    outcome=st.sampled_from(list(Outcome)),
)
json_values = st.recursive(
    st.none() | st.booleans() | i64 | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def framed_round_trip(kind: RecordKind, body: bytes, sequence: int, timestamp: int):
    """Pass a body through a frame too: what a log stores is what a reader decodes."""
    frame = framing.check_at(framing.encode(kind, sequence, timestamp, body), 0)
    assert (frame.kind, frame.sequence, frame.timestamp) == (kind, sequence, timestamp)
    return records.decode_body(frame.kind, frame.body)


@settings(max_examples=150, deadline=None)
@given(msg=messages, sequence=u64, timestamp=i64)
def test_message_round_trip(msg, sequence, timestamp):
    body = records.encode_message_obj(msg)
    assert records.decode_message(body) == msg
    assert framed_round_trip(RecordKind.MESSAGE, body, sequence, timestamp) == msg
    due, subject, mid = records.message_index_fields(body)
    assert (due, subject, mid) == (msg.deliver_at_ms, msg.subject.encode(), msg.message_id.encode())
    assert records.message_due(body) == msg.deliver_at_ms


@settings(max_examples=100, deadline=None)
@given(cancel=cancels, sequence=u64, timestamp=i64)
def test_cancel_round_trip(cancel, sequence, timestamp):
    body = records.encode_cancel(cancel)
    assert records.decode_cancel(body) == cancel
    assert framed_round_trip(RecordKind.CANCEL, body, sequence, timestamp) == cancel


@settings(max_examples=50, deadline=None)
@given(batch=st.lists(cancels, max_size=20))
def test_cancel_bodies_are_encode_cancel_of_each(batch):
    targets = [(c.message_id, c.deliver_at_ms, c.target_sequence) for c in batch]
    assert records.cancel_bodies(targets) == [records.encode_cancel(c) for c in batch]


@settings(max_examples=100, deadline=None)
@given(dispatch=dispatches, sequence=u64, timestamp=i64)
def test_dispatch_round_trip(dispatch, sequence, timestamp):
    body = records.encode_dispatch(dispatch)
    assert records.decode_dispatch(body) == dispatch
    assert framed_round_trip(RecordKind.DISPATCH, body, sequence, timestamp) == dispatch


@settings(max_examples=100, deadline=None)
@given(state=st.dictionaries(st.text(max_size=12), json_values, max_size=6), timestamp=i64)
def test_checkpoint_round_trip(state, timestamp):
    data = checkpoint.encode(state, timestamp)
    assert checkpoint.decode(data) == state
    assert framing.check_at(data, 0).timestamp == timestamp


def test_fixed_sizes_match_the_spec():
    assert records.MESSAGE_FIXED.size == 20
    assert records.CANCEL_FIXED.size == 18
    assert records.DISPATCH_FIXED.size == 32
    assert framing.HEADER.size == framing.HEADER_SIZE == 36


def test_message_body_layout():
    body = records.encode_message(b"sub", b"id1", b"", b"PAY", -5)
    assert body == (b"\xfb\xff\xff\xff\xff\xff\xff\xff\x03\x00\x03\x00\x00\x00\x00\x00\x03\x00\x00\x00subid1PAY")


@pytest.mark.parametrize(
    "body",
    [
        records.encode_message(b"s", b"i", b"", b"p", 1)[:-1],
        records.encode_message(b"s", b"i", b"", b"p", 1) + b"x",
    ],
)
def test_message_lengths_must_add_up(body):
    with pytest.raises(ValueError):
        records.decode_message(body)


def test_inconsistent_bodies_are_rejected():
    with pytest.raises(ValueError):
        records.decode_cancel(records.encode_cancel(Cancel("abc", 1, 2)) + b"!")
    with pytest.raises(ValueError):
        records.decode_dispatch(records.encode_dispatch(Dispatch("abc", 1, 2, 3, 1, 1))[:-1])
    with pytest.raises(ValueError):
        records.decode_body(99, b"")


def test_checkpoint_must_be_one_checkpoint_frame():
    data = checkpoint.encode({"offset": 1, "sequence": 2}, 0)
    with pytest.raises(framing.FrameError, match="trailing"):
        checkpoint.decode(data + b"\0")
    with pytest.raises(framing.FrameError, match="not a checkpoint"):
        checkpoint.decode(framing.encode(RecordKind.MESSAGE, 0, 0, b"{}"))
    with pytest.raises(framing.FrameError, match="JSON object"):
        checkpoint.decode(framing.encode(RecordKind.CHECKPOINT, 0, 0, b"[1]"))


def test_the_worked_example_in_docs_formats_md_is_what_the_code_writes():
    """docs/formats.md shows a hex dump of two frames; it must stay byte-exact."""
    import os
    import re

    doc = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "formats.md")
    with open(doc, encoding="utf-8") as f:
        text = f.read().split("## Worked example", 1)[1]
    dumped = bytearray()
    for m in re.finditer(r"^([0-9a-f]{4})  ((?:[0-9a-f]{2} ){0,15}[0-9a-f]{2})", text, re.MULTILINE):
        assert int(m.group(1), 16) == len(dumped)
        dumped += bytes.fromhex(m.group(2))
    due = 1_767_225_600_000
    accepted = due - 30 * 60_000
    message = records.encode_message(b"orders.close", b"m-1", records.encode_headers({"k": "v"}), b"order 42", due)
    cancel = records.encode_cancel(Cancel("m-1", due, 1))
    expected = framing.encode(RecordKind.MESSAGE, 1, accepted, message) + framing.encode(
        RecordKind.CANCEL, 2, accepted + 5_000, cancel
    )
    assert bytes(dumped) == expected and len(expected) == 142
    ckpt = checkpoint.encode({"offset": 142, "sequence": 2}, due)
    assert len(ckpt) == 63 and ckpt[36:] == b'{"offset":142,"sequence":2}'


@pytest.mark.parametrize("decode", [records.decode_message, records.decode_cancel, records.decode_dispatch])
def test_short_bodies_are_value_errors(decode):
    for size in range(0, 20):
        with pytest.raises(ValueError):
            decode(b"\x01" * size)


def test_bad_header_blocks_are_value_errors():
    good = records.encode_headers({"key": "value"})
    for cut in range(1, len(good)):
        with pytest.raises(ValueError):
            records.decode_headers(good[:cut])


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(u64, i64, i64, u64, u32, message_ids), min_size=0, max_size=20),
    i64,
    st.sampled_from(list(Outcome)),
)
def test_batch_dispatch_encoder_is_byte_identical_to_one_frame_at_a_time(items, timestamp, outcome):
    """The ack path encodes a whole batch column-wise (ids of one length or of several);
    the bytes must be exactly the frames the plain codec writes, in the same order."""
    expected = b"".join(
        framing.encode(
            RecordKind.DISPATCH, seq, timestamp, records.encode_dispatch(Dispatch(mid, due, at, off, attempt, outcome))
        )
        for seq, due, at, off, attempt, mid in items
    )
    cols = list(zip(*items)) or [()] * 6
    seqs, dues, ats, offs, attempts, mids = cols
    got = records.encode_dispatch_frames(
        list(seqs), list(dues), list(ats), list(offs), list(attempts), [m.encode() for m in mids], timestamp, outcome
    )
    assert got == expected


@pytest.mark.parametrize("native_scan", [True, False])
def test_group_closes_picks_a_groups_dispatch_frames_column_wise(tmp_path, monkeypatch, native_scan):
    """``bucket_log.group_closes*`` (what a draining lane reads back) agrees with decoding
    every DISPATCH frame, for the default group, named groups (one a prefix of another),
    other record kinds in between, and over a file with a corrupt frame in the middle."""
    import random

    from byte_surgery import flip_byte

    from qdelay.segments import bucket_log, native, reader
    from qdelay.segments.segment import HandlePool, Segment

    if not native_scan:
        monkeypatch.setattr(native, "codec", None)
    rng = random.Random(7)
    names = ["default", "bill", "billing", "b", "notify-é"]
    frames, want = [], {n: [] for n in names}
    for seq in range(1, 400):
        if rng.random() < 0.1:
            frames.append(framing.encode(RecordKind.MESSAGE, seq, 5, rng.randbytes(rng.randrange(40, 60))))
            continue
        g = rng.choice(names)
        mid = "m" * rng.randrange(0, 12)
        body = records.encode_dispatch(Dispatch(mid, 1, 2, 3, 1, 1, g))
        frames.append(framing.encode(RecordKind.DISPATCH, seq, 9, body))
        want[g].append(seq)
    data = b"".join(frames)
    for g in names:
        assert bucket_log.group_closes_of(data, g).tolist() == want[g], g
        assert reader.scan_columns(data).end == len(data)
    assert bucket_log.group_closes_of(data, "nobody").tolist() == []

    seg = Segment(str(tmp_path / "d.seg"), 0, HandlePool(4), size=0)
    offsets = [seg.append(f) for f in frames]
    seg.sync()
    bad = 200
    flip_byte(seg.path, offsets[bad] + framing.HEADER_SIZE)  # its body: the checksum fails
    bad_seq = bad + 1
    fresh = Segment(seg.path, 0, HandlePool(4))
    for g in names:
        got = bucket_log.group_closes_in(fresh, 0, fresh.size, g).tolist()
        assert got == [q for q in want[g] if q != bad_seq], g
