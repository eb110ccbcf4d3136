"""The native codec (segments/_codec.c) against its Python twins: same bytes, same verdicts.

The Python twins are the reference (they follow docs/formats.md line by line); every
function of the C module is checked against its twin on generated input, valid and not.
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qdelay import errors, wire
from qdelay.segments import framing, native, records
from qdelay.segments.framing import RecordKind
from qdelay.server.config import Limits
from qdelay.server.validation import encode_messages, encode_messages_py
from qdelay.v1 import qdelay_pb2 as pb

codec = native.codec
pytestmark = pytest.mark.skipif(
    codec is None and os.environ.get("QDELAY_NATIVE") == "0",
    reason="QDELAY_NATIVE=0: the native codec is switched off on purpose",
)

NOW = 1_800_000_000_000
LIMITS = Limits()
bodies = st.lists(st.binary(max_size=300), max_size=30)


def test_the_native_codec_is_built():
    """`make setup` builds it (gcc and the Python headers are on every supported machine);
    the server would still run without it, only slower, so a silent build failure must
    show here."""
    assert codec is not None, "qdelay.segments._codec was not built: see the pip install output"


@settings(max_examples=100, deadline=None)
@given(
    kind=st.sampled_from(list(RecordKind)),
    first=st.integers(0, 2**63),
    ts=st.integers(-(2**63), 2**63 - 1),
    many=bodies,
    prefix=st.binary(max_size=5),
)
def test_frame_bodies_matches_python(kind, first, ts, many, prefix):
    a, b = bytearray(prefix), bytearray(prefix)
    assert codec.frame_bodies(a, kind, first, ts, many, framing.MAX_BODY) == framing.encode_many_into_py(
        b, kind, first, ts, many
    )
    assert a == b


def test_frame_bodies_refuses_what_it_cannot_frame():
    with pytest.raises(TypeError):
        codec.frame_bodies(bytearray(), 1, 0, 0, [b"ok", "not bytes"], framing.MAX_BODY)
    with pytest.raises(ValueError):
        codec.frame_bodies(bytearray(), 1, 0, 0, [b"x" * 11], 10)


def frames(draw_bodies, kinds):
    out = bytearray()
    for i, (body, kind) in enumerate(zip(draw_bodies, kinds)):
        framing.encode_into(out, kind, 100 + i, 7, body)
    return bytes(out)


@settings(max_examples=150, deadline=None)
@given(
    many=st.lists(st.binary(min_size=0, max_size=200), max_size=20),
    cut=st.integers(0, 5000),
    flip=st.one_of(st.none(), st.integers(0, 5000)),
)
def test_scan_matches_a_python_walk(many, cut, flip):
    data = bytearray(frames(many, itertools.cycle([RecordKind.MESSAGE, RecordKind.CANCEL])))
    if flip is not None and flip < len(data):
        data[flip] ^= 0x5A
    data = bytes(data[:cut])
    end, count, starts, kinds, seqs, dues, bad = codec.scan(data, framing.MAX_BODY)
    # the reference: framing.check_at frame after frame, stopping at a cut or a bad frame
    pos, want, want_bad = 0, [], -1
    while pos + framing.HEADER_SIZE <= len(data):
        try:
            f = framing.check_at(data, pos)
        except framing.FrameError as err:
            length = int.from_bytes(data[pos + 12 : pos + 16], "little")
            # a length no record can have is damage even where the data is cut short
            cut_short = pos + framing.HEADER_SIZE + length > len(data) and length <= framing.MAX_BODY
            header_ok = data[pos : pos + 4] == framing._MAGIC_BYTES and data[pos + 17] == framing.VERSION
            if not (cut_short and header_ok):
                want_bad = pos
            assert err.offset == pos
            break
        want.append(
            (pos, f.kind, f.sequence, int.from_bytes(f.body[:8], "little", signed=True) if len(f.body) >= 8 else 0)
        )
        pos += f.size
    assert bad == want_bad
    assert count == len(want) and end == pos
    got = list(
        zip(
            np.frombuffer(starts, np.int64).tolist(),
            np.frombuffer(kinds, np.uint8).tolist(),
            np.frombuffer(seqs, np.int64).tolist(),
            np.frombuffer(dues, np.int64).tolist(),
        )
    )
    assert got == want


subjects = st.one_of(
    st.sampled_from(["a.b", "order.close", "x" * 255, "x" * 256, "", "bad subject", "é"]),
    st.text(alphabet="abcXYZ019._-", min_size=1, max_size=10),
)
ids = st.one_of(
    st.just(""),
    st.text(alphabet="abc-123", min_size=1, max_size=8),
    st.sampled_from(["x" * 128, "x" * 129, "tab\there", "ü"]),
)
whens = st.one_of(
    st.tuples(st.just("deliver_at_ms"), st.integers(-5, NOW + LIMITS.max_delay_ms + 5)),
    st.tuples(st.just("delay_ms"), st.integers(-5, LIMITS.max_delay_ms + 5)),
    st.just(None),
)


@st.composite
def messages(draw):
    m = pb.Message(subject=draw(subjects), payload=draw(st.binary(max_size=40)), message_id=draw(ids))
    when = draw(whens)
    if when is not None:
        setattr(m, when[0], when[1])
    if draw(st.integers(0, 9)) == 0:
        m.headers["k"] = "v"
    return m


@settings(max_examples=300, deadline=None)
@given(batch=st.lists(messages(), min_size=1, max_size=8), ids_required=st.booleans(), small_payload=st.booleans())
def test_encode_messages_takes_only_what_python_accepts_and_encodes_it_alike(batch, ids_required, small_payload):
    limits = Limits(max_payload_bytes=20) if small_payload else LIMITS

    def gen():
        counter = itertools.count()
        return lambda: f"gen-{next(counter)}"

    fast = codec.encode_messages(
        batch,
        NOW,
        limits.max_subject_len,
        limits.max_payload_bytes,
        limits.max_message_id_bytes,
        limits.max_delay_ms,
        gen(),
        ids_required,
    )
    try:
        slow = encode_messages_py(batch, limits, NOW, gen(), ids_required=ids_required)
    except errors.InvalidArgument:
        assert fast is None
        return
    if any(m.headers for m in batch):
        assert fast is None
        return
    assert fast is not None
    assert (fast[0], fast[1], fast[2], fast[3]) == (slow.bodies, slow.ids, slow.dues, slow.payload_bytes)
    assert [records.decode_message(b).message_id for b in fast[0]] == slow.ids
    # and the public entry point gives the same whichever path it took
    again = encode_messages(batch, limits, NOW, gen(), ids_required=ids_required)
    assert again.bodies == slow.bodies


class FakeSegment:
    def __init__(self, last: int) -> None:
        self.last_sequence = last


@settings(max_examples=200, deadline=None)
@given(
    recs=st.lists(
        st.tuples(st.sampled_from([1, 2, 3]), st.integers(0, 6 * 60_000), st.binary(max_size=30)),
        min_size=1,
        max_size=40,
    ),
    held=st.dictionaries(st.integers(0, 6), st.integers(-1, 140), max_size=4),
    scale=st.sampled_from([1, 2, 5]),
    near=st.one_of(st.none(), st.integers(0, 6)),
    preexisting=st.dictionaries(st.integers(0, 6), st.binary(max_size=10), max_size=3),
)
def test_route_matches_python(recs, held, scale, near, preexisting):
    """The iterate service's routing into write-behind buffers: same buffers, same
    handed-over records, same counts, same segments' last sequences."""
    from qdelay.server.iterate import IterateService

    data = bytearray()
    for i, (kind, due, tail) in enumerate(recs):
        body = due.to_bytes(8, "little", signed=True) + tail  # a due first, like MESSAGE and CANCEL
        framing.encode_into(data, kind, 100 + i, 0, body)
    data = bytes(data)
    end, count, starts, kinds, seqs, dues, bad = codec.scan(data, framing.MAX_BODY)
    assert bad == -1 and count == len(recs)
    arrays = (
        np.frombuffer(starts, np.int64),
        np.frombuffer(kinds, np.uint8),
        np.frombuffer(seqs, np.int64),
        np.frombuffer(dues, np.int64),
    )
    outcomes = []
    for route in (codec.route, IterateService._route_numpy):
        segments = {b * scale: FakeSegment(last) for b, last in held.items()}
        asked = []

        def segment_of(bucket, asked=asked, segments=segments):
            asked.append(bucket)
            return segments.setdefault(bucket, FakeSegment(-1))

        behind = {b * scale: bytearray(v) for b, v in preexisting.items()}
        near_bucket = None if near is None else near * scale
        got = route(data, end, *arrays, scale, near_bucket, behind, segment_of)
        outcomes.append(
            (
                list(map(tuple, got[0])),
                tuple(got[1:4]),
                list(got[4]),
                tuple(got[5:]),
                {b: bytes(v) for b, v in behind.items()},
                {b: s.last_sequence for b, s in segments.items()},
            )
        )
    assert outcomes[0] == outcomes[1]


@settings(max_examples=300, deadline=None)
@given(
    batch=st.lists(messages(), min_size=0, max_size=8),
    compact=st.booleans(),
    junk=st.binary(max_size=8),
    mode=st.sampled_from(["plain", "junk-suffix", "truncated"]),
)
def test_decode_batch_takes_only_what_python_accepts_and_encodes_it_alike(batch, compact, junk, mode):
    """SendBatchRequest wire bytes: the native decoder agrees with protobuf + the Python
    twin, and gives up (None, never an exception) on anything else."""
    raw = pb.SendBatchRequest(messages=batch, compact_receipts=compact).SerializeToString()
    if mode == "junk-suffix":
        raw += junk
    elif mode == "truncated" and raw:
        raw = raw[: len(raw) // 2]

    def gen():
        counter = itertools.count()
        return lambda: f"gen-{next(counter)}"

    fast = codec.decode_batch(
        raw,
        NOW,
        LIMITS.max_subject_len,
        LIMITS.max_payload_bytes,
        LIMITS.max_message_id_bytes,
        LIMITS.max_delay_ms,
        LIMITS.max_batch,
        gen(),
    )
    try:
        request = pb.SendBatchRequest.FromString(raw)
        slow = encode_messages_py(request.messages, LIMITS, NOW, gen(), ids_required=request.compact_receipts)
    except Exception:  # noqa: BLE001 - malformed bytes or a refused batch: the fast path must give up
        assert fast is None
        return
    if fast is None:  # allowed for headers and for wire forms the fast path leaves to protobuf
        assert any(m.headers for m in request.messages) or mode != "plain"
        return
    assert fast[:4] == (slow.bodies, slow.ids, slow.dues, slow.payload_bytes)
    assert fast[4] == request.compact_receipts


@settings(max_examples=150, deadline=None)
@given(
    recs=st.lists(
        st.tuples(st.binary(min_size=1, max_size=8), st.binary(max_size=12), st.binary(max_size=40), st.integers(0, 3)),
        min_size=1,
        max_size=12,
    ),
    flip=st.one_of(st.none(), st.integers(0, 2000)),
    cut=st.integers(0, 40),
    wrong_seq=st.booleans(),
    pick=st.randoms(use_true_random=False),
)
def test_read_messages_matches_python(recs, flip, cut, wrong_seq, pick):
    """The dispatcher's read-back of MESSAGE records: same ids, payloads, raw headers and
    failures as the numpy twin, whatever is damaged."""
    from qdelay.server.scheduler import Scheduler

    data = bytearray()
    offsets, seqs = [], []
    for i, (mid, headers, payload, kind_choice) in enumerate(recs):
        body = records.encode_message(b"subj", mid, headers, payload, 1000 + i)
        kind = RecordKind.CANCEL if kind_choice == 3 else RecordKind.MESSAGE
        offsets.append(len(data))
        seqs.append(50 + i)
        framing.encode_into(data, kind, 50 + i, 0, body)
    if flip is not None and flip < len(data):
        data[flip] ^= 0x21
    data = bytes(data[: max(0, len(data) - cut)])
    if wrong_seq:
        seqs[pick.randrange(len(seqs))] += 1
    order = list(range(len(recs)))
    pick.shuffle(order)
    rel = np.asarray([offsets[k] for k in order], dtype=np.int64)
    sq = np.asarray([seqs[k] for k in order], dtype=np.int64)
    n = len(order)
    mids, payloads, raw = [None] * n, [None] * n, [None] * n
    failed = Scheduler._check_run_numpy(_HeadersAsRaw(), data, rel, sq, mids, payloads, raw, 0)
    got = codec.read_messages(data, rel, sq)
    assert got == (mids, payloads, raw, failed)


class _HeadersAsRaw:
    """Stands in for a Scheduler in _check_run_numpy: keeps the raw header block (the
    native codec returns it raw; both decode it with the same Python code)."""

    @staticmethod
    def _headers(raw, seq, off, mids, k):
        return raw


printable_ids = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=6).map(str.encode)
deliveries_st = st.lists(
    st.tuples(
        st.text(max_size=6),
        printable_ids,
        st.binary(max_size=20),
        st.one_of(st.none(), st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=3)),
        st.integers(-(2**40), 2**45),
        st.integers(0, 2**32 - 1),
    ),
    max_size=10,
)


@settings(max_examples=150, deadline=None)
@given(batches=st.lists(deliveries_st, max_size=3), subject=st.text(max_size=8), at=st.integers(-5, 2**45))
def test_encode_deliveries_parses_back_to_what_protobuf_builds(batches, subject, at):
    from qdelay.server.consumers import fill_response
    from qdelay.server.scheduler import Deliveries

    cols = [
        Deliveries(
            subject,
            [d[0] for d in b],
            [d[1] for d in b],
            [d[2] for d in b],
            [d[3] for d in b],
            [d[4] for d in b],
            at,
            [d[5] for d in b],
        )
        for b in batches
    ]
    want = pb.SubscribeResponse()
    count, _ = fill_response(want, cols)
    out = bytearray()
    got = sum(
        codec.encode_deliveries(
            out,
            c.subject,
            c.ack_ids,
            c.message_id_bytes,
            c.payloads,
            c.headers,
            c.deliver_at_ms,
            c.dispatched_at_ms,
            c.attempts,
        )
        for c in cols
    )
    assert got == count
    assert pb.SubscribeResponse.FromString(bytes(out)) == want
    if not any(d[3] for b in batches for d in b):  # without maps the bytes are protobuf's own
        assert bytes(out) == want.SerializeToString()


@settings(max_examples=150, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.integers(0, 2**63),
            st.integers(-(2**62), 2**62),
            st.integers(-(2**62), 2**62),
            st.integers(0, 2**63),
            st.integers(0, 2**32 - 1),
            st.binary(max_size=20),
        ),
        max_size=20,
    ),
    ts=st.integers(-(2**62), 2**62),
    outcome=st.sampled_from(list(records.Outcome)),
)
def test_dispatch_frames_match_python(rows, ts, outcome):
    cols = [list(c) for c in zip(*rows)] if rows else [[] for _ in range(6)]
    assert codec.dispatch_frames(*cols, ts, outcome) == records.encode_dispatch_frames_py(*cols, ts, outcome)


outgoing_st = st.lists(
    st.tuples(
        st.text(max_size=8),
        st.binary(max_size=30),
        st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
        st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
        st.just(""),
        st.one_of(st.none(), st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=3)),
    ),
    max_size=12,
)


@settings(max_examples=150, deadline=None)
@given(messages=outgoing_st, ids=st.lists(st.text(max_size=8), min_size=12, max_size=12))
def test_encode_send_batch_parses_back_to_what_protobuf_builds(messages, ids):
    from qdelay.client.client import encode_send_batch_py

    messages = [m if m[2] is None or m[3] is None else m[:3] + (None,) + m[4:] for m in messages]
    ids = ids[: len(messages)]
    want, got = bytearray(), bytearray()
    assert encode_send_batch_py(want, messages, ids) == codec.encode_send_batch(got, messages, ids) == len(messages)
    parsed = pb.SendBatchRequest.FromString(bytes(got))
    assert parsed == pb.SendBatchRequest.FromString(bytes(want))
    # a time given as 0 is still sent: it is a oneof member, and which one was set matters
    for m, (_s, _p, at, delay, _mid, _h) in zip(parsed.messages, messages):
        assert m.WhichOneof("when") == (
            "deliver_at_ms" if at is not None else "delay_ms" if delay is not None else None
        )
    if not any(m[5] for m in messages):  # without maps the bytes are protobuf's own
        assert bytes(got) == bytes(want)


def test_encode_send_batch_refuses_what_it_cannot_encode():
    for bad in [
        [("s", "not bytes", 1, None, "", None)],
        [("s", b"", "1", None, "", None)],
        [("s", b"")],
        [("s", b"", 1, None, "", ["not", "a", "dict"])],
        [("s", b"", 1, 2, "", None)],
    ]:
        with pytest.raises((TypeError, ValueError)):
            codec.encode_send_batch(bytearray(), bad, ["id"] * len(bad))
    with pytest.raises(ValueError):
        codec.encode_send_batch(bytearray(), [("s", b"", 1, None, "", None)], [])


@settings(max_examples=150, deadline=None)
@given(
    many=st.lists(st.binary(min_size=0, max_size=200), max_size=20),
    cut=st.integers(0, 5000),
    flip=st.one_of(st.none(), st.integers(0, 5000)),
)
def test_reader_columns_native_and_twin_agree(many, cut, flip):
    """segments/reader.py: the columns of the native walk and of its Python twin, on clean,
    cut and damaged data, and the CANCEL targets gathered from them."""
    from qdelay.segments import reader

    data = bytearray(frames(many, itertools.cycle([RecordKind.MESSAGE, RecordKind.CANCEL])))
    if flip is not None and flip < len(data):
        data[flip] ^= 0x5A
    data = bytes(data[:cut])
    a, b = reader.scan_columns(data), reader.scan_columns_py(data)
    assert (a.end, a.bad) == (b.end, b.bad)
    for name in ("starts", "kinds", "seqs", "dues"):
        assert getattr(a, name).tolist() == getattr(b, name).tolist(), name
    lengths = np.array([int.from_bytes(data[s + 12 : s + 16], "little") for s in a.starts.tolist()], dtype=np.int64)
    rows = (a.kinds == RecordKind.CANCEL) & (lengths >= 16)  # bodies that hold the field
    want = [int.from_bytes(data[s + 44 : s + 52], "little", signed=True) for s in a.starts[rows].tolist()]
    assert a.u64_at(rows, 8).tolist() == want


@settings(max_examples=100, deadline=None)
@given(
    data=st.binary(min_size=0, max_size=64),
    starts=st.lists(st.integers(-2, 70), max_size=12),
    offset=st.integers(-3, 12),
    width=st.sampled_from([1, 2, 4, 8, 3]),
    signed=st.booleans(),
)
def test_reader_gather_native_and_twin_agree(data, starts, offset, width, signed):
    """segments/reader.py ``gather``: the same int64 column from the native codec and from
    numpy, and the same refusal of a field outside the data or of an odd width."""
    from qdelay.segments import reader

    s = np.array(starts, dtype=np.int64)
    results = []
    for fn in (lambda *a: np.frombuffer(codec.gather(*a), np.int64), reader.gather_py):
        try:
            results.append(fn(data, s, offset, width, signed).tolist())
        except ValueError:
            results.append("refused")
    assert results[0] == results[1]
    if results[0] != "refused":
        fmt = {1: "b", 2: "h", 4: "i", 8: "q"}[width]
        fmt = fmt if signed or width == 8 else fmt.upper()
        import struct

        assert results[0] == [struct.unpack_from("<" + fmt, data, x + offset)[0] for x in starts]


def test_the_wire_codecs_field_numbers_follow_the_proto():
    """Every field number the C wire codec uses by hand is the generated descriptors' (the
    same check runs when the server or a client imports qdelay.wire)."""
    assert wire.mismatches(codec.WIRE_FIELDS) == []
    messages = {name.rsplit(".", 2)[1] for name in codec.WIRE_FIELDS}
    assert messages == {"Message", "SendBatchRequest", "SubscribeResponse", "Delivery"}
    assert set(codec.WIRE_FIELDS) >= {f"qdelay.v1.Message.{f.name}" for f in pb.Message.DESCRIPTOR.fields}
    assert set(codec.WIRE_FIELDS) >= {f"qdelay.v1.Delivery.{f.name}" for f in pb.Delivery.DESCRIPTOR.fields}


def test_a_proto_change_the_codec_does_not_follow_fails_loudly():
    class Renumbered:
        WIRE_FIELDS = dict(codec.WIRE_FIELDS, **{"qdelay.v1.Message.delay_ms": 7, "qdelay.v1.Delivery.gone": 9})

    with pytest.raises(errors.InvariantViolation, match="delay_ms: the codec uses field 7, the .proto says 6"):
        wire.check(Renumbered)
    with pytest.raises(errors.InvariantViolation, match="Delivery.gone: no such field"):
        wire.check(Renumbered)


def _twins() -> dict:
    """Every function of the C module and its Python twin, the reference (each pair has its
    property test above)."""
    from qdelay.client.client import encode_send_batch_py
    from qdelay.segments import reader
    from qdelay.server.consumers import fill_response
    from qdelay.server.iterate import IterateService
    from qdelay.server.scheduler import Scheduler

    return {
        "frame_bodies": framing.encode_many_into_py,
        "scan": reader.scan_columns_py,
        "gather": reader.gather_py,
        "route": IterateService._route_numpy,
        "read_messages": Scheduler._check_run_numpy,
        "dispatch_frames": records.encode_dispatch_frames_py,
        "encode_messages": encode_messages_py,
        "decode_batch": encode_messages_py,  # after protobuf parsed the request
        "encode_deliveries": fill_response,
        "encode_send_batch": encode_send_batch_py,
    }


def test_every_native_function_has_a_python_twin():
    """A function added to the C module without a twin (or a twin left after its C function
    went) fails here."""
    exported = {name for name in dir(codec) if not name.startswith("_") and callable(getattr(codec, name))}
    twins = _twins()
    assert exported == set(twins)
    assert all(callable(twin) for twin in twins.values())
