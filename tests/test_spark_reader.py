"""The Spark source's columnar reader against its per-record reference twin, without Spark.

``spark_source.read_piece`` (native frame walk, columns gathered from the bytes) and
``spark_source.read_piece_py`` (the inspection walker, a record object per frame) must
give the same rows on any segment: clean, with checksum-valid bodies that do not decode
(bad lengths, bad UTF-8, bad or repeated headers, unknown kinds), and damaged (flipped
bytes, torn and zero-filled tails), under every option (corrupt=row|skip, payload,
column subsets, pushed filters).
"""

from __future__ import annotations

import os
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("pyspark")
pa = pytest.importorskip("pyarrow")

from qdelay.segments import framing, records  # noqa: E402
from qdelay.segments.framing import RecordKind  # noqa: E402
from qdelay.segments.records import Cancel, Dispatch, Group, Message  # noqa: E402
from qdelay.tools import spark_source as ss  # noqa: E402

T0 = 1_767_225_600_000
texts = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=6)


def _headers_raw(pairs: list[tuple[bytes, bytes]]) -> bytes:
    return b"".join(struct.pack("<H", len(k)) + k + struct.pack("<H", len(v)) + v for k, v in pairs)


@st.composite
def bodies(draw):
    """(kind, body): valid records of the three kinds, and bodies that pass the frame's
    checksum but not the body codecs."""
    choice = draw(st.integers(0, 9))
    due = T0 + draw(st.integers(-5, 5)) * 60_000
    mid = draw(texts)
    if choice <= 3:
        headers = draw(st.dictionaries(texts, texts, max_size=3))
        msg = Message(draw(texts), draw(st.binary(max_size=30)), due, mid, headers)
        return RecordKind.MESSAGE, records.encode_message_obj(msg)
    if choice == 4:
        return RecordKind.CANCEL, records.encode_cancel(Cancel(mid, due, draw(st.integers(0, 2**40))))
    if choice == 5:
        d = Dispatch(
            mid,
            due,
            due + draw(st.integers(-9, 99)),
            draw(st.integers(0, 2**40)),
            1,
            draw(st.integers(0, 3)),
            draw(st.sampled_from(["default", "g1", "é"])),
        )
        body = records.encode_dispatch(d)
        if draw(st.integers(0, 5)) == 0:  # a group name that is not UTF-8
            body = body[:29] + b"\x01" + body[30:] + b"\xff"
        return RecordKind.DISPATCH, body
    if choice == 6:  # headers made by hand: repeated keys, bad UTF-8, blocks that overrun
        pairs = draw(
            st.lists(
                st.tuples(st.sampled_from([b"k", b"k", b"j", b"\xff"]), st.sampled_from([b"", b"1", b"2", b"\xfe"])),
                max_size=4,
            )
        )
        raw = _headers_raw(pairs) + draw(st.sampled_from([b"", b"", b"", b"\x05", b"\x09\x00ab", b"\x01\x00a\x05\x00"]))
        subject = draw(st.sampled_from([b"s", b"s", b"\xc3", b""]))
        return RecordKind.MESSAGE, records.encode_message(subject, mid.encode(), raw, b"p", due)
    if choice == 7:  # a body of a known kind cut or padded: lengths do not add up
        kind, body = draw(st.sampled_from([RecordKind.MESSAGE, RecordKind.CANCEL, RecordKind.DISPATCH])), None
        if kind == RecordKind.MESSAGE:
            body = records.encode_message(b"s", b"id", b"", b"pay", due)
        elif kind == RecordKind.CANCEL:
            body = records.encode_cancel(Cancel("id", due, 3))
        else:
            body = records.encode_dispatch(Dispatch("id", due, due, 0, 1, 1))
        cut = draw(st.integers(-len(body), 3))
        return kind, body[:cut] if cut < 0 else body + b"x" * cut
    if choice == 8:  # bad UTF-8 in a message id
        kind = draw(st.sampled_from([RecordKind.CANCEL, RecordKind.DISPATCH]))
        fixed = records.CANCEL_FIXED if kind == RecordKind.CANCEL else records.DISPATCH_FIXED
        body = bytearray(fixed.size) + b"\xfe\xff"
        body[fixed.size - 2 : fixed.size] = b"\x02\x00"
        return kind, bytes(body)
    if draw(st.booleans()):  # a consumer group created or deleted (an odd op too)
        return RecordKind.GROUP, records.encode_group(Group(draw(st.integers(1, 3)), draw(texts), draw(texts)))
    return draw(st.sampled_from([RecordKind.CHECKPOINT, 9, 0])), draw(st.sampled_from([b"{}", b"not json", b""]))


@st.composite
def segments(draw):
    data = bytearray()
    for i, (kind, body) in enumerate(draw(st.lists(bodies(), max_size=25))):
        framing.encode_into(data, kind, 1 + i, T0 + i, body)
    damage = draw(st.sampled_from(["none", "flip", "cut", "zeros", "garbage"]))
    if damage == "flip" and data:
        data[draw(st.integers(0, len(data) - 1))] ^= 0x41
    elif damage == "cut" and data:
        del data[draw(st.integers(0, len(data) - 1)) :]
    elif damage == "zeros":
        data += bytes(draw(st.integers(1, 80)))
    elif damage == "garbage":
        data += draw(st.binary(min_size=1, max_size=50))
    return bytes(data)


def _table(fn, piece, **kw):
    batches = list(fn(piece, **kw))
    if not batches:
        return None
    t = pa.Table.from_batches(batches)
    return t.sort_by([("offset", "ascending")]) if "offset" in t.column_names else t


def _pushed(lo=None, hi=None, kinds=None, prefix=None, sequences=None):
    p = ss.Pushed()
    p.sequences = frozenset(sequences) if sequences else None
    p.narrow_due(lo, hi)
    p.kinds = frozenset(kinds) if kinds else None
    p.prefixes = (prefix,) if prefix else ()
    return p


OPTIONS = [
    {},
    {"corrupt": "skip"},
    {"payload": False},
    {"columns": ["offset", "subject", "headers", "error"]},
    {"columns": ["offset", "kind", "group", "outcome", "message_id"]},
    {"columns": ["offset", "kind", "due_ms"], "pushed": _pushed(T0 - 60_000, T0 + 120_000)},
    {"columns": ["offset", "message_id", "kind"], "pushed": _pushed(kinds=["CANCEL", "DISPATCH"])},
    {"pushed": _pushed(prefix="a", kinds=["MESSAGE"])},
    {"columns": ["offset", "sequence", "kind", "error"], "pushed": _pushed(sequences=[2, 3, 5, 8])},
    {"batch_rows": 3},
]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=segments())
def test_columnar_reader_gives_the_reference_rows(tmp_path_factory, data):
    root = tmp_path_factory.mktemp("seg")
    path = os.path.join(root, "202601010000.sched")
    with open(path, "wb") as f:
        f.write(data)
    piece = ss.Piece(str(root), "schedule", path, "schedule/20260101/202601010000.sched", 0, len(data))
    for kw in OPTIONS:
        a, b = _table(ss.read_piece, piece, **kw), _table(ss.read_piece_py, piece, **kw)
        assert (a is None) == (b is None), kw
        if a is not None:
            assert a.schema == b.schema, kw
            assert a.to_pylist() == b.to_pylist(), kw


def test_filtered_plan_opens_only_matching_segments(tmp_path):
    """Due-time and kind filters leave whole files out of the plan (never opened)."""
    import datafolder

    root = str(tmp_path / "f")
    datafolder.build_audit_clean(root).close()
    everything = ss.plan([root], ss.LOGS, 64 << 20, 0)
    rels = sorted(p.rel for part in everything for p in part.pieces)
    sched = [r for r in rels if r.startswith("schedule/")]
    assert len(sched) >= 3
    # the second schedule minute only (and its dispatch segment; message log: no names to go by)
    minute = int(sched[1].rsplit("/", 1)[1][:12][-2:])
    lo = datafolder.T0 + minute * 60_000
    p = _pushed(lo, lo + 59_999)
    got = sorted(x.rel for part in ss.plan([root], ss.LOGS, 64 << 20, 0, p) for x in part.pieces)
    assert [r for r in got if not r.startswith("message/")] == sorted(
        r
        for r in rels
        if r.endswith(sched[1].rsplit("/", 1)[1][:12] + ".sched")
        or r.endswith(sched[1].rsplit("/", 1)[1][:12] + ".disp")
    )
    assert [r for r in got if r.startswith("message/")] == [r for r in rels if r.startswith("message/")]
    # only DISPATCH rows: no message or schedule file is opened
    got = sorted(
        x.rel for part in ss.plan([root], ss.LOGS, 64 << 20, 0, _pushed(kinds=["DISPATCH"])) for x in part.pieces
    )
    assert got == [r for r in rels if r.startswith("dispatch/")]
    # the bucket width from the names: at least one minute, at most a day
    assert ss.bucket_width([29_454_720, 29_454_721]) == 1
    assert ss.bucket_width([29_454_720]) == 1440
    assert ss.bucket_width([29_454_720, 29_454_780], 5) == 5


def test_balanced_packing_spreads_pieces_over_the_cores():
    """Option ``partitions``: consecutive pieces, about equal bytes per partition, every
    piece once and in order; fewer partitions when they would be tiny, more when huge."""
    mib = 1 << 20
    pieces = [ss.Piece("s", "schedule", f"p{i}", f"p{i}", 0, (3 + i % 4) * mib) for i in range(60)]
    groups = ss.balanced(pieces, 2)
    assert len(groups) == 2
    assert [p for g in groups for p in g] == pieces
    sizes = [sum(p.stop - p.start for p in g) for g in groups]
    assert abs(sizes[0] - sizes[1]) <= 6 * mib
    # 25 MiB in all: 4 partitions of at least 8 MiB (bar the last) however many cores
    small = pieces[:6]
    assert len(ss.balanced(small, 16)) == 4
    # one huge folder on 2 cores: no partition over MAX_PACK_BYTES (64 MiB pieces)
    big = [ss.Piece("s", "schedule", f"b{i}", f"b{i}", 0, 64 * mib) for i in range(40)]
    assert len(ss.balanced(big, 2)) == 5
    assert ss.balanced([], 2) == []
