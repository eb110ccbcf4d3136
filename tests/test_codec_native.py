"""The two native codecs against their Python twins: same results on the same inputs.

Each C function (segments/_codec.c: storage; qdelay/_wire.c: the protobuf wire codec) has a
Python twin with its signature (``native.twins()``, ``wire.twins()``). One table below
gives, for every function, how to draw its inputs (valid and not: damaged frames, refused
messages, junk bytes) and what to compare; one property test walks the table and runs
each pair on the same inputs: same results, same side effects on the arguments, or the
same kind of exception. The twins are the reference (they follow docs/formats.md and the
generated protobuf code), so this is what holds the C code to them.
"""

from __future__ import annotations

import copy
import dataclasses
import errno
import itertools
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import pytest
import xxhash
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from qdelay import errors, wire
from qdelay.client import Outgoing
from qdelay.client.types import Delivery
from qdelay.segments import framing, idfilter, native, records
from qdelay.segments.framing import RecordKind
from qdelay.server import recent_ids
from qdelay.server.config import Limits
from qdelay.server.validation import encode_messages, encode_messages_py
from qdelay.v1 import qdelay_pb2 as pb

codec = native.codec
wire_codec = wire.native
pytestmark = pytest.mark.skipif(
    (codec is None or wire_codec is None) and os.environ.get("QDELAY_NATIVE") == "0",
    reason="QDELAY_NATIVE=0: the native codecs are switched off on purpose",
)

NOW = 1_800_000_000_000
LIMITS = Limits()
bodies = st.lists(st.binary(max_size=300), max_size=30)


def test_the_native_codecs_are_built():
    """`make setup` builds both (gcc and the Python headers are on every supported machine);
    the server would still run without them, only slower, so a silent build failure must
    show here."""
    assert codec is not None, "qdelay.segments._codec was not built: see the pip install output"
    assert wire_codec is not None, "qdelay._wire was not built: see the pip install output"


def test_the_native_codec_was_compiled_with_the_python_layout():
    """segments/layout.h names the frame and body offsets for C; framing.py and records.py
    name them for Python. The compiled module exports its names (LAYOUT), and records.py
    refuses at import a build whose layout differs; this also refuses a build without them."""
    assert codec is not None
    assert codec.LAYOUT == records.layout()
    assert records.layout()["SEQUENCE_AT"] == framing.SEQUENCE_AT == 20  # docs/formats.md's table


# --- inputs -------------------------------------------------------------------------------


def frames(draw_bodies, kinds) -> bytes:
    out = bytearray()
    for i, (body, kind) in enumerate(zip(draw_bodies, kinds)):
        framing.encode_into(out, kind, 100 + i, 7, body)
    return bytes(out)


@st.composite
def damaged_frames(draw) -> bytes:
    """Frames of MESSAGE and CANCEL kinds, maybe with a flipped byte, maybe cut short."""
    many = draw(st.lists(st.binary(min_size=0, max_size=200), max_size=20))
    data = bytearray(frames(many, itertools.cycle([RecordKind.MESSAGE, RecordKind.CANCEL])))
    flip = draw(st.one_of(st.none(), st.integers(0, 5000)))
    if flip is not None and flip < len(data):
        data[flip] ^= 0x5A
    return bytes(data[: draw(st.integers(0, 5000))])


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


@st.composite
def good_messages(draw):
    """Messages the fast path takes (most batches must get past validation to compare bytes)."""
    m = pb.Message(
        subject=draw(st.text(alphabet="abcXYZ019._-", min_size=1, max_size=10)),
        payload=draw(st.binary(max_size=20)),
        message_id=draw(st.sampled_from(["", "id"])) + draw(st.text(alphabet="abc-123 ~", max_size=8)),
    )
    if draw(st.booleans()):
        m.deliver_at_ms = draw(st.integers(0, NOW + LIMITS.max_delay_ms))
    else:
        m.delay_ms = draw(st.integers(0, LIMITS.max_delay_ms))
    return m


batches = st.one_of(
    st.lists(messages(), min_size=1, max_size=8),
    st.lists(good_messages(), min_size=1, max_size=8, unique_by=lambda m: m.message_id or id(m)),
)


def new_ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"gen-{next(counter)}"


def limit_args(small_payload: bool) -> tuple[int, int, int, int]:
    return (LIMITS.max_subject_len, 20 if small_payload else LIMITS.max_payload_bytes, 128, LIMITS.max_delay_ms)


@st.composite
def request_bytes(draw) -> bytes:
    """SendBatchRequest wire bytes: as protobuf writes them, with junk after, or cut short."""
    good = st.lists(good_messages(), min_size=1, max_size=8, unique_by=lambda m: m.message_id or id(m))
    batch = draw(st.one_of(st.just([]), batches, good, good))
    raw = pb.SendBatchRequest(messages=batch, compact_receipts=draw(st.booleans())).SerializeToString()
    mode = draw(st.sampled_from(["plain", "plain", "plain", "junk-suffix", "truncated"]))
    if mode == "junk-suffix":
        raw += draw(st.binary(max_size=8))
    elif mode == "truncated" and raw:
        raw = raw[: len(raw) // 2]
    return raw


@st.composite
def cancel_request_bytes(draw) -> bytes:
    """CancelBatchRequest wire bytes: plain receipts (some with a shard or the duplicate
    flag), ids the fast path refuses (empty, too long, not printable ASCII), negative due
    times, by-id requests, a message_id beside a receipt, no receipt; as protobuf writes
    them, with junk after, cut short, or a receipt written twice (protobuf merges them)."""
    ids = st.one_of(
        st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=12),
        st.sampled_from(["", "x" * 129, "x" * 128, "caf\u00e9", "tab\t", "del\x7f"]),
    )
    receipt = st.builds(
        pb.Receipt,
        message_id=ids,
        deliver_at_ms=st.one_of(st.integers(0, 2**63 - 1), st.integers(-(2**63), -1)),
        sequence=st.integers(0, 2**64 - 1),
        duplicate=st.booleans(),
        shard=st.sampled_from(["", "s1"]),
    )
    request = st.one_of(
        st.builds(pb.CancelRequest, receipt=receipt),
        st.builds(pb.CancelRequest, receipt=receipt),
        st.builds(pb.CancelRequest, receipt=receipt, message_id=ids),
        st.builds(pb.CancelRequest, message_id=ids),
        st.just(pb.CancelRequest()),
    )
    raw = pb.CancelBatchRequest(requests=draw(st.lists(request, max_size=6))).SerializeToString()
    mode = draw(st.sampled_from(["plain", "plain", "plain", "junk-suffix", "truncated", "twice"]))
    if mode == "junk-suffix":
        raw += draw(st.binary(max_size=8))
    elif mode == "truncated" and raw:
        raw = raw[: len(raw) // 2]
    elif mode == "twice":
        # one CancelRequest whose receipt field comes twice on the wire: protobuf merges the two
        twice = pb.CancelRequest(receipt=draw(receipt)).SerializeToString()
        twice += pb.CancelRequest(receipt=draw(receipt)).SerializeToString()
        length = len(twice)
        varint = bytearray()
        while True:
            varint.append((length & 0x7F) | (0x80 if length > 0x7F else 0))
            length >>= 7
            if not length:
                break
        raw += b"\x0a" + bytes(varint) + twice
    return raw


class FakeSegment:
    def __init__(self, last: int) -> None:
        self.last_sequence = last


@st.composite
def route_cases(draw):
    recs = draw(
        st.lists(
            st.tuples(st.sampled_from([1, 2, 3]), st.integers(0, 6 * 60_000), st.binary(max_size=30)),
            min_size=1,
            max_size=40,
        )
    )
    data = bytearray()
    for i, (kind, due, tail) in enumerate(recs):
        body = due.to_bytes(8, "little", signed=True) + tail  # a due first, like MESSAGE and CANCEL
        framing.encode_into(data, kind, 100 + i, 0, body)
    data = bytes(data)
    end, count, starts, kinds, seqs, dues, bad = framing_scan(data)
    scale = draw(st.sampled_from([1, 2, 5]))
    near = draw(st.one_of(st.none(), st.integers(0, 6)))
    return {
        "data": data,
        "end": end,
        "columns": (
            np.frombuffer(starts, np.int64),
            np.frombuffer(kinds, np.uint8),
            np.frombuffer(seqs, np.int64),
            np.frombuffer(dues, np.int64),
        ),
        "scale": scale,
        "near": None if near is None else near * scale,
        "held": {b * scale: v for b, v in draw(st.dictionaries(st.integers(0, 6), st.integers(-1, 140))).items()},
        "behind": {b * scale: v for b, v in draw(st.dictionaries(st.integers(0, 6), st.binary(max_size=10))).items()},
        # buffers written out before, for route to take (emptied) for buckets without one
        "spares": draw(st.lists(st.binary(max_size=10), max_size=4)),
    }


@st.composite
def id_entries_cases(draw):
    """MESSAGE frames (ids empty or not) and their starts, dues and sequences; sometimes a
    start off the frames, data cut short, or columns of different lengths."""
    recs = draw(st.lists(st.tuples(st.binary(max_size=6), st.binary(max_size=12), st.binary(max_size=20)), max_size=12))
    data = bytearray()
    starts = []
    for i, (subject, mid, payload) in enumerate(recs):
        starts.append(len(data))
        framing.encode_into(data, RecordKind.MESSAGE, i + 1, 0, records.encode_message(subject, mid, b"", payload, i))
    cut = draw(st.one_of(st.just(len(data)), st.integers(0, len(data))))
    starts += draw(st.lists(st.integers(-3, len(data) + 3), max_size=2))
    n = len(starts)
    dues = draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=n, max_size=n))
    seqs = draw(st.lists(st.integers(0, 2**63 - 1), min_size=n, max_size=n + draw(st.sampled_from([0, 0, 0, 1]))))
    return bytes(data[:cut]), *(np.array(a, dtype=np.int64) for a in (starts, dues, seqs))


filter_bits = st.one_of(
    st.sampled_from([8, 16, 64, 1024]).map(bytearray),  # empty filters of valid sizes
    st.binary(min_size=8, max_size=8).map(bytearray),  # some bits set already
    st.binary(max_size=12).map(bytearray),  # mostly sizes that are not a power of two
)
filter_keys = st.lists(st.one_of(st.binary(max_size=12), st.text(max_size=6).map(str.encode)), max_size=20)


@st.composite
def filter_maybe_layers_cases(draw):
    """Layers of the id filter (some of a wrong size or not a buffer), some holding ids
    added by the twin, asked about those and others."""
    layers = draw(st.lists(filter_bits, min_size=0, max_size=4))
    held = draw(st.lists(st.text(max_size=6), max_size=12))
    for k, layer in enumerate(layers):
        try:
            idfilter.filter_add_py(layer, [m.encode() for m in held[k :: len(layers)]])
        except ValueError:
            pass  # a layer of a wrong size: both sides refuse it
    if layers and draw(st.integers(0, 9)) == 0:
        layers[draw(st.integers(0, len(layers) - 1))] = draw(st.sampled_from(["bits", 3, None]))  # not a buffer
    asked = draw(st.lists(st.one_of(st.sampled_from(held or ["x"]), st.text(max_size=6)), max_size=40))
    if draw(st.integers(0, 9)) == 0:
        asked = [*asked, draw(st.sampled_from([b"id", 3, None]))]  # not a str
    return [bytes(x) if isinstance(x, bytearray) and draw(st.booleans()) else x for x in layers], asked


recent_ids_drawn = st.lists(st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=4), max_size=8)


@st.composite
def recent_tables(draw):
    """A recent-id table (sometimes of a wrong size) holding some ids put by the twin, with
    its seed, and a floor that leaves some of them dead."""
    table = bytearray(draw(st.sampled_from([32, 64, 128, 256, 512, 96, 0])))
    seed = draw(st.integers(0, 2**64 - 1))
    held = draw(recent_ids_drawn)
    try:
        recent_ids.recent_put_py(table, seed, 0, held, draw(st.integers(1, 20)), list(range(len(held))))
    except ValueError:
        pass  # a table of a wrong size, or too small for them: both sides refuse it below too
    return table, seed, draw(st.integers(0, 30)), held


@st.composite
def recent_put_cases(draw):
    table, seed, floor, held = draw(recent_tables())
    ids = draw(st.lists(st.one_of(st.sampled_from(held or ["x"]), st.text(max_size=4)), max_size=8))
    dues = draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=len(ids), max_size=len(ids)))
    odd = draw(st.integers(0, 11))
    if odd == 0:
        ids = [*ids, draw(st.sampled_from([b"id", 3, None]))]  # not a str
        dues = [*dues, 0]
    elif odd == 1:
        dues = [*dues, draw(st.sampled_from([2**63, 1.5, "1"]))]  # beyond 64 bits, or not an int
        ids = [*ids, "late"]
    elif odd == 2:
        dues = dues[1:]  # one short
    first = draw(st.one_of(st.integers(1, 40), st.sampled_from([0, 2**63 - 2])))
    return table, seed, floor, ids, first, dues


@st.composite
def recent_find_cases(draw):
    table, seed, floor, held = draw(recent_tables())
    asked = draw(st.lists(st.one_of(st.sampled_from(held or ["x"]), st.text(max_size=4)), max_size=10))
    if draw(st.integers(0, 9)) == 0:
        asked = [*asked, 7]  # not a str
    return bytes(table) if draw(st.booleans()) else table, seed, floor, asked


@st.composite
def recent_rehash_cases(draw):
    table, _seed, floor, _held = draw(recent_tables())
    return table, bytearray(draw(st.sampled_from([32, 64, 256, 1024, 96]))), floor


@st.composite
def index_entries_cases(draw):
    """MESSAGE, CANCEL and DISPATCH frames (the schedule log holds the first two), a frame
    cut short or a body too short for its kind sometimes, and a base offset (near the 48-bit
    limit sometimes)."""
    data = bytearray()
    for i in range(draw(st.integers(0, 8))):
        kind = draw(st.sampled_from([RecordKind.MESSAGE, RecordKind.MESSAGE, RecordKind.CANCEL, RecordKind.DISPATCH]))
        if kind == RecordKind.MESSAGE:
            body = records.encode_message(
                draw(st.binary(max_size=5)), draw(st.binary(max_size=12)), b"", draw(st.binary(max_size=9)), i * 7
            )
        elif kind == RecordKind.CANCEL:
            body = records.encode_cancel(records.Cancel(draw(st.text("ab", max_size=6)), -i, 2**63 - 1 - i))
        else:
            body = draw(st.binary(max_size=40))
        if draw(st.integers(0, 9)) == 0:
            body = body[: draw(st.integers(0, len(body)))]  # too short for its kind
        framing.encode_into(data, kind, draw(st.integers(0, 2**63 - 1)), 0, body)
    cut = draw(st.one_of(st.just(len(data)), st.integers(0, len(data))))
    base = draw(st.one_of(st.integers(0, 2**40), st.just(2**48 - 1 - len(data) // 2), st.just(-1)))
    return bytes(data[:cut]), base


@st.composite
def index_find_cases(draw):
    """Entries ascending by sequence (gaps, equal neighbours never) and sequences to find,
    present or not; sometimes entries not whole. More sequences than the C code searches in
    step (16) at times, so that its groups and their last, partial one are all compared."""
    top = draw(st.sampled_from([60, 400]))
    seqs = sorted(set(draw(st.lists(st.integers(-5, top), max_size=20 if top == 60 else 150))))
    raw = b"".join(struct.pack("<qQqQ", q, 7, 8, 9) for q in seqs)
    if draw(st.integers(0, 9)) == 0:
        raw = raw[: draw(st.integers(0, len(raw)))]
    return raw, np.array(draw(st.lists(st.integers(-8, top + 4), max_size=40)), dtype=np.int64)


@st.composite
def index_gather_cases(draw):
    """Several indexes (as index_find_cases draws one) and sequences grouped by index, with
    their counts; sometimes counts that do not add up, or not one per index."""
    views = [draw(index_find_cases()) for _ in range(draw(st.integers(0, 4)))]
    entries = [raw for raw, _q in views]
    groups = [q for _raw, q in views]
    seqs = np.concatenate(groups) if groups else np.zeros(0, dtype=np.int64)
    counts = [len(q) for q in groups]
    if counts and draw(st.integers(0, 9)) == 0:
        counts[draw(st.integers(0, len(counts) - 1))] += draw(st.sampled_from([-1, 1, -(10**6)]))
    if draw(st.integers(0, 19)) == 0:
        counts.append(0)
    return entries, seqs, np.array(counts, dtype=np.int64)


@st.composite
def index_confirm_cases(draw):
    """Indexes of MESSAGE entries (due time, id hash; sometimes flagged CANCELLED) among
    CANCEL and DISPATCH ones, and receipts grouped by index: each naming an entry exactly,
    or with another due time or id, an empty id, or a sequence not there; more than 16 at
    times (one search group and a partial one). Sometimes counts or lists that do not agree,
    an index not whole entries, a number past int64 or an id not a str."""
    kinds = st.sampled_from([RecordKind.MESSAGE, RecordKind.MESSAGE, RecordKind.CANCEL, RecordKind.DISPATCH])
    views, counts, seqs, dues, names = [], [], [], [], []
    for _ in range(draw(st.integers(0, 3))):
        rows = []  # (sequence, due, id) of each entry
        raw = b""
        for seq in sorted(set(draw(st.lists(st.integers(1, 80), max_size=30)))):
            kind, due, mid = draw(kinds), draw(st.integers(-5, 5)), draw(st.text(max_size=6))
            where = 64 * seq | int(kind) << 48 | draw(st.sampled_from([0, 0, 1])) << 56
            raw += struct.pack("<qQqQ", seq, where, due, xxhash.xxh3_64_intdigest(mid.encode()))
            rows.append((seq, due, mid))
        if draw(st.sampled_from([False] * 19 + [True])):
            raw = raw[: draw(st.integers(0, len(raw)))]
        asked = draw(st.lists(st.sampled_from(rows), max_size=20)) if rows else []
        for seq, due, mid in asked:
            how = draw(st.sampled_from(["same"] * 6 + ["due", "id", "empty", "absent"]))
            seqs.append(draw(st.integers(81, 90)) if how == "absent" else seq)
            dues.append(due + 1 if how == "due" else due)
            names.append("" if how == "empty" else mid + "x" if how == "id" else mid)
        views.append(raw)
        counts.append(len(asked))
    bad = draw(st.sampled_from(["none"] * 24 + ["count", "views", "seq", "due", "not str", "ids"]))
    if bad == "count" and counts:
        counts[-1] += 1
    elif bad == "views":
        counts.append(0)
    elif bad == "seq" and seqs:
        seqs[0] = 2**63
    elif bad == "due" and dues:
        dues[-1] = -(2**64)
    elif bad == "not str" and names:
        names[0] = b"x"
    elif bad == "ids":
        names.append("y")
    return views, counts, seqs, dues, names


def framing_scan(data: bytes) -> tuple:
    from qdelay.segments import reader

    return reader.scan_py(data, framing.MAX_BODY)


def route_args(case: dict) -> tuple:
    """Fresh mutable state per call: the write-behind buffers and the segments."""
    segments = {b: FakeSegment(last) for b, last in case["held"].items()}
    asked: list[int] = []

    def segment_of(bucket):
        asked.append(bucket)
        return segments.setdefault(bucket, FakeSegment(-1))

    segment_of.segments = segments  # type: ignore[attr-defined]  (read back by route_outcome)
    behind = {b: bytearray(v) for b, v in case["behind"].items()}
    spares = [bytearray(v) for v in case["spares"]]
    # the segments known already: some of those held, looked up without segment_of
    known = {b: sg for b, sg in segments.items() if b % 2 == 0}
    return (case["data"], case["end"], *case["columns"], case["scale"], case["near"], behind, segment_of, spares, known)


def route_outcome(result, args) -> tuple:
    """The result, the buffers written, the spares left and the segments' last sequences
    written back."""
    behind, segments, spares = args[8], args[9].segments, args[10]
    return (
        [tuple(h) for h in result[0]],
        tuple(result[1:4]),
        list(result[4]),
        tuple(result[5:]),
        {b: bytes(v) for b, v in behind.items()},
        [bytes(v) for v in spares],
        {b: sg.last_sequence for b, sg in segments.items()},
    )


@st.composite
def read_back_cases(draw):
    recs = draw(
        st.lists(
            st.tuples(
                st.binary(min_size=1, max_size=8), st.binary(max_size=12), st.binary(max_size=40), st.integers(0, 3)
            ),
            min_size=1,
            max_size=12,
        )
    )
    data = bytearray()
    offsets, seqs = [], []
    for i, (mid, headers, payload, kind_choice) in enumerate(recs):
        body = records.encode_message(b"subj", mid, headers, payload, 1000 + i)
        kind = RecordKind.CANCEL if kind_choice == 3 else RecordKind.MESSAGE
        offsets.append(len(data))
        seqs.append(50 + i)
        framing.encode_into(data, kind, 50 + i, 0, body)
    flip = draw(st.one_of(st.none(), st.integers(0, 2000)))
    if flip is not None and flip < len(data):
        data[flip] ^= 0x21
    data = data[: max(0, len(data) - draw(st.integers(0, 40)))]
    pick = draw(st.randoms(use_true_random=False))
    if draw(st.booleans()):
        seqs[pick.randrange(len(seqs))] += 1
    order = list(range(len(recs)))
    pick.shuffle(order)
    if draw(st.booleans()):
        order.append(order[0])  # the same record asked twice
    rel = np.asarray([offsets[k] for k in order] + draw(st.lists(st.integers(-60, 3000), max_size=2)), np.int64)
    sq = np.asarray([seqs[k] for k in order] + [50] * (len(rel) - len(order)), np.int64)
    return bytes(data), rel, sq


deliveries_st = st.lists(
    st.tuples(
        st.text(max_size=6),
        st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=6).map(str.encode),
        st.binary(max_size=20),
        st.one_of(st.none(), st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=3)),
        st.integers(-(2**40), 2**45),
        st.integers(0, 2**32 - 1),
    ),
    max_size=10,
)


@st.composite
def subscribe_response_bytes(draw) -> bytes:
    """SubscribeResponse wire bytes: as protobuf writes them (any text, headers, times), or
    with junk after, cut short, or carrying a field this .proto does not have."""
    resp = pb.SubscribeResponse()
    for ack_id, mid, payload, headers, due, attempt in draw(deliveries_st):
        d = resp.deliveries.add(
            ack_id=ack_id,
            message_id=draw(st.one_of(st.just(mid.decode()), st.text(max_size=4))),
            subject=draw(st.text(max_size=6)),
            payload=payload,
            deliver_at_ms=due,
            dispatched_at_ms=draw(st.integers(-(2**63), 2**63 - 1)),
            attempt=attempt,
        )
        if headers:
            d.headers.update(headers)
    raw = resp.SerializeToString()
    mode = draw(st.sampled_from(["plain", "plain", "plain", "junk-suffix", "truncated", "unknown-field"]))
    if mode == "junk-suffix":
        raw += draw(st.binary(max_size=8))
    elif mode == "truncated" and raw:
        raw = raw[: draw(st.integers(0, len(raw) - 1))]
    elif mode == "unknown-field":
        # a Delivery with a field 9, or a SubscribeResponse with a field 2
        raw += draw(st.sampled_from([b"\x0a\x02\x48\x01", b"\x10\x01"]))
    return raw


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


class OtherNamedTuple(NamedTuple):
    a: int
    b: int = 0


def _id_maker() -> Callable[[], str]:
    """encode_outgoing_request's make_id: "made-1", "made-2", ..."""
    count = itertools.count(1)
    return lambda: f"made-{next(count)}"


# new_outgoing: a NamedTuple class (or not a class) and 0-8 positional fields of any type
outgoing_new_st = st.tuples(
    st.sampled_from([Outgoing, OtherNamedTuple, 5]),
    st.lists(st.one_of(st.none(), st.text(max_size=3), st.binary(max_size=3), st.integers()), max_size=8),
)


@st.composite
def send_batch_response_cases(draw):
    n = draw(st.integers(0, 12))
    mids = draw(st.lists(st.text(max_size=10), min_size=n, max_size=n))
    dues = draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=n, max_size=n))
    dups = draw(
        st.one_of(
            st.none(),
            st.dictionaries(
                st.integers(0, max(0, n - 1)),
                st.tuples(st.text(max_size=6), st.integers(-(2**63), 2**63 - 1), st.integers(0, 2**64 - 1)),
                max_size=n,
            ),
        )
    )
    first = draw(st.integers(0, 2**64 - 1 - n))
    return mids, dues, first, draw(st.booleans()), dups, draw(st.sampled_from(["", "shard-1", "é"]))


# --- the table ----------------------------------------------------------------------------


@dataclass
class Pair:
    """How to run one native function and its twin on the same inputs: ``cases`` draws a
    case, ``args`` makes a fresh argument tuple from it (so each side gets its own mutable
    arguments), ``outcome`` is what must agree (the result and what the call changed)."""

    cases: st.SearchStrategy
    args: Callable[[Any], tuple] = lambda case: copy.deepcopy(case)
    outcome: Callable[[Any, tuple], Any] = lambda result, args: result


@st.composite
def ack_match_cases(draw):
    """(ids, i, keys, p, k) for ack_match: ids naming a stretch of the keys as the ledger
    hands them out ("seq.attempt"), some altered (another sequence, malformed, bare, not a
    str, 18/19 digits), and ranges inside and past either list."""
    keys = draw(
        st.lists(
            st.one_of(st.integers(0, 10**6), st.integers(10**17, 10**18 + 5), st.integers(-3, -1), st.just(2**64)),
            max_size=10,
        )
    )
    ids: list = [f"{q}.{draw(st.integers(0, 10**9 - 1))}" for q in keys]
    for j in draw(st.lists(st.integers(0, max(0, len(ids) - 1)), max_size=3)) if ids else []:
        ids[j] = draw(
            st.one_of(
                st.integers(0, 10**6).map(lambda q: f"{q}.1"),
                st.sampled_from(
                    ["", ".", "1.", ".1", "1", "1..2", "+1.1", " 1.1", "١.1", "1" * 19 + ".1", "1.1234567890"]
                ),
                st.text(max_size=5),
                st.just(7),
            )
        )
    lead = draw(st.lists(st.sampled_from(["1.1", "x"]), max_size=2))
    if draw(st.booleans()):  # the ids of a stretch against the keys they were made of
        start = draw(st.integers(0, len(keys)))
        k = draw(st.integers(0, len(keys) - start))
        return lead + ids, len(lead) + start, keys, start, k
    n = max(len(ids), len(keys)) + 2
    return (
        lead + ids,
        draw(st.integers(-1, n)),
        keys,
        draw(st.integers(-1, n)),
        draw(st.integers(-1, n)),
    )


PAIRS: dict[tuple[str, str], Pair] = {
    ("segments", "frame_bodies"): Pair(
        st.tuples(
            st.binary(max_size=5).map(bytearray),
            st.sampled_from(list(RecordKind)),
            st.integers(0, 2**63),
            st.integers(-(2**63), 2**63 - 1),
            bodies,
            st.sampled_from([framing.MAX_BODY, framing.MAX_BODY, 10]),
        ),
        outcome=lambda result, args: (result, bytes(args[0])),
    ),
    ("segments", "scan"): Pair(st.tuples(damaged_frames(), st.sampled_from([framing.MAX_BODY, 100]))),
    ("segments", "gather"): Pair(
        st.tuples(
            st.binary(min_size=60, max_size=64),
            st.one_of(st.lists(st.integers(0, 40), max_size=12), st.lists(st.integers(-2, 70), max_size=12)).map(
                lambda s: np.array(s, dtype=np.int64)
            ),
            st.integers(-3, 12),
            st.sampled_from([1, 2, 4, 8, 3]),
            st.booleans(),
        ),
        outcome=lambda result, args: bytes(result),
    ),
    ("segments", "route"): Pair(route_cases(), route_args, route_outcome),
    ("segments", "read_messages"): Pair(read_back_cases()),
    ("segments", "id_entries"): Pair(id_entries_cases()),
    ("segments", "filter_add"): Pair(
        st.tuples(filter_bits, filter_keys.map(lambda ks: ks + [3] if len(ks) == 7 else ks)),
        outcome=lambda result, args: (result, bytes(args[0])),
    ),
    ("segments", "filter_maybe_layers"): Pair(filter_maybe_layers_cases()),
    ("segments", "recent_put"): Pair(recent_put_cases(), outcome=lambda result, args: (result, bytes(args[0]))),
    ("segments", "recent_find"): Pair(recent_find_cases()),
    ("segments", "recent_rehash"): Pair(recent_rehash_cases(), outcome=lambda result, args: (result, bytes(args[1]))),
    ("segments", "index_entries"): Pair(index_entries_cases()),
    ("segments", "index_find"): Pair(index_find_cases(), outcome=lambda result, args: bytes(result)),
    ("segments", "index_gather"): Pair(
        index_gather_cases(), outcome=lambda result, args: (bytes(result[0]), bytes(result[1]))
    ),
    ("segments", "index_confirm"): Pair(index_confirm_cases()),
    ("segments", "dispatch_frames"): Pair(
        st.tuples(
            st.lists(
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
            st.integers(-(2**62), 2**62),
            st.sampled_from(list(records.Outcome)),
            # the default group (no name) or a named one, up to the format's 255 bytes
            st.one_of(st.just(b""), st.text(min_size=1, max_size=8).map(str.encode), st.just(b"g" * 255)),
        ),
        args=lambda case: (*([list(c) for c in zip(*case[0])] if case[0] else [[] for _ in range(6)]), *case[1:]),
    ),
    ("segments", "ack_ids"): Pair(
        st.one_of(
            st.lists(st.tuples(st.integers(0, 2**63), st.integers(0, 2**32)), max_size=20).map(
                lambda c: ([q for q, _ in c], [a for _, a in c])
            ),
            st.tuples(st.lists(st.integers(0, 99), max_size=3), st.lists(st.integers(0, 99), max_size=3)),
        ),
        args=lambda case: case,
    ),
    ("segments", "ack_sequences"): Pair(
        # well-formed ids, and the malformed ones a client may send (the slow path's)
        st.lists(
            st.one_of(
                st.tuples(st.integers(0, 10**18 - 1), st.integers(0, 10**9 - 1)).map(lambda t: f"{t[0]}.{t[1]}"),
                st.sampled_from(["", ".", "1.", ".1", "1", "1.1 2.2", "1..2", "1.2.3", "+1.1", " 1.1", "1.1 ", "١.1"]),
                st.sampled_from(["1" * 19 + ".1", "1" * 18 + ".1", "1.1234567890", "1.123456789", "é.1"]),
                st.text(max_size=6),
            ),
            max_size=12,
        ).map(lambda ids: (ids,)),
    ),
    ("segments", "ack_match"): Pair(ack_match_cases()),
    ("wire", "encode_send_batch"): Pair(
        st.tuples(
            st.just(bytearray()),
            outgoing_st.map(lambda ms: [m if m[2] is None or m[3] is None else m[:3] + (None,) + m[4:] for m in ms]),
            st.lists(st.text(max_size=8), min_size=12, max_size=12),
        ).map(lambda c: (c[0], c[1], c[2][: len(c[1])])),
        outcome=lambda result, args: (
            result,
            pb.SendBatchRequest.FromString(bytes(args[0])),
            [m.WhichOneof("when") for m in pb.SendBatchRequest.FromString(bytes(args[0])).messages],
            bytes(args[0]) if not any(m[5] for m in args[1]) else None,
        ),
    ),
    ("wire", "encode_outgoing_request"): Pair(
        st.tuples(
            outgoing_st.map(lambda ms: [m if m[2] is None or m[3] is None else m[:3] + (None,) + m[4:] for m in ms]),
            st.lists(st.sampled_from(["", "", "own-1", "é"]), min_size=12, max_size=12),
        ).map(lambda c: [m[:4] + (mid,) + m[5:] for m, mid in zip(c[0], c[1])]),
        # each side its own id maker, counting from 1: the same ids made in the same order
        args=lambda case: (copy.deepcopy(case), _id_maker()),
        outcome=lambda result, args: (
            pb.SendBatchRequest.FromString(result[0]),
            result[0] if not any(m[5] for m in args[0]) else None,
            result[1],
        ),
    ),
    ("wire", "new_outgoing"): Pair(
        outgoing_new_st,
        args=lambda c: (c[0], *c[1]),
        outcome=lambda result, args: (type(result), tuple(result)),
    ),
    ("wire", "encode_deliveries"): Pair(
        st.tuples(deliveries_st, st.text(max_size=8), st.integers(-5, 2**45)),
        args=lambda c: (
            bytearray(),
            c[1],
            [d[0] for d in c[0]],
            [d[1] for d in c[0]],
            [d[2] for d in c[0]],
            [copy.copy(d[3]) for d in c[0]],
            [d[4] for d in c[0]],
            c[2],
            [d[5] for d in c[0]],
        ),
        outcome=lambda result, args: (
            result,
            pb.SubscribeResponse.FromString(bytes(args[0])),
            bytes(args[0]) if not any(args[5]) else None,
        ),
    ),
    ("wire", "decode_deliveries"): Pair(
        st.tuples(subscribe_response_bytes(), st.text(max_size=4)),
        args=lambda c: (c[0], Delivery, c[1]),
        # None from the native side means "protobuf decides": what the twin answers then
        outcome=lambda result, args: wire.decode_deliveries_py(*args) if result is None else result,
    ),
    ("wire", "encode_send_batch_response"): Pair(send_batch_response_cases()),
    ("wire", "encode_messages"): Pair(
        st.tuples(batches, st.booleans(), st.booleans()),
        args=lambda c: (c[0], NOW, *limit_args(c[2]), new_ids(), c[1]),
    ),
    ("wire", "decode_batch"): Pair(
        st.tuples(request_bytes(), st.sampled_from([LIMITS.max_batch, LIMITS.max_batch, 3])),
        args=lambda c: (c[0], NOW, *limit_args(False), c[1], new_ids()),
    ),
    ("wire", "decode_cancel_batch"): Pair(
        st.tuples(cancel_request_bytes(), st.sampled_from([LIMITS.max_batch, LIMITS.max_batch, 3])),
        args=lambda c: (c[0], LIMITS.max_message_id_bytes, c[1]),
    ),
}


def _write_sync_cases():
    """(chunk sizes, offset, where the zeros go): empty, small, one write piece's worth and
    more (a chunk in pieces), more chunks than one pwritev takes; zeros none, one byte, to
    the next MiB, beyond one MiB (past the native side's static zeros)."""
    sizes = st.one_of(
        st.lists(st.sampled_from([0, 1, 37, 4096, 70_000, 262_144, 300_000]), max_size=8),
        st.sampled_from([1023, 1024, 1025, 1030]).map(lambda n: [10] * n),
    )
    return st.tuples(sizes, st.sampled_from([0, 5, 4096]), st.sampled_from(["none", "byte", "mib", "beyond"]))


def _write_sync_args(case):
    """A fresh file (unlinked: the descriptor keeps it) holding a head, and the call's args."""
    import tempfile

    sizes, offset, zeros = case
    fd, path = tempfile.mkstemp(prefix="qdelay-write-sync-")
    os.unlink(path)
    os.pwrite(fd, b"h" * offset, 0)
    chunks = [bytearray(bytes([i % 251]) * n) for i, n in enumerate(sizes)]
    end = offset + sum(sizes)
    zero_to = {"none": 0, "byte": end + 1, "mib": (end // (1 << 20) + 1) << 20, "beyond": end + (3 << 20) // 2}[zeros]
    return (fd, chunks, offset, zero_to, True)


def _write_sync_outcome(result, args):
    """What the call answered but its time, and the file's bytes (the descriptor closed)."""
    fd = args[0]
    try:
        data = os.pread(fd, os.fstat(fd).st_size, 0)
    finally:
        os.close(fd)
    return result[:3], xxhash.xxh3_64_hexdigest(data), len(data)


PAIRS["segments", "write_sync"] = Pair(_write_sync_cases(), args=_write_sync_args, outcome=_write_sync_outcome)


def _natives() -> dict[tuple[str, str], tuple[Callable, Callable]]:
    pairs = {}
    for (module, name), _pair in PAIRS.items():
        c, table = (codec, native.twins()) if module == "segments" else (wire_codec, wire.twins())
        pairs[module, name] = (getattr(c, name), table[name])
    return pairs


def _run(fn: Callable, args: tuple) -> tuple[str, Any]:
    try:
        return "ok", fn(*args)
    except (TypeError, ValueError, OverflowError) as err:
        return "raised", type(err).__name__


@pytest.mark.parametrize("key", list(PAIRS), ids=[f"{m}.{n}" for m, n in PAIRS])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_native_and_twin_agree(key, data):
    pair = PAIRS[key]
    fast, twin = _natives()[key]
    case = data.draw(pair.cases)
    outcomes = []
    for fn in (fast, twin):
        args = pair.args(case)
        status, result = _run(fn, args)
        outcomes.append((status, result if status == "raised" else pair.outcome(result, args)))
    assert outcomes[0] == outcomes[1]


def test_the_table_covers_every_native_function():
    """A function added to a C module without a twin and a row here (or a twin left after its
    C function went) fails here."""
    for module, c, table in (("segments", codec, native.twins()), ("wire", wire_codec, wire.twins())):
        exported = {name for name in dir(c) if not name.startswith("_") and callable(getattr(c, name))}
        assert exported == set(table), module
        assert {name for m, name in PAIRS if m == module} == exported, module


# --- beyond the twins: refusals, the reference, the contract with the .proto ---------------


@pytest.mark.parametrize("side", ["native", "twin"])
def test_write_sync_tells_a_failed_fdatasync_from_a_failed_write(side):
    """A failed fdatasync is answered as its errno, after the bytes were written (the message
    log is poisoned by it); a failed write raises OSError (the log cuts the file back and
    goes on)."""
    from qdelay.segments import segment

    fn = codec.write_sync if side == "native" else segment.write_sync_py
    fd = os.open(os.devnull, os.O_RDWR)  # writes go through, fdatasync is refused (EINVAL)
    try:
        assert fn(fd, [bytearray(b"ab"), bytearray(b"c")], 10, 0, True)[:3] == (13, 13, errno.EINVAL)
        assert fn(fd, [bytearray(b"ab")], 10, 0, False)[2:] == (0, 0.0)  # no fdatasync asked for
    finally:
        os.close(fd)
    r, w = os.pipe()
    try:
        with pytest.raises(OSError) as info:
            fn(r, [bytearray(b"x")], 0, 0, True)
        assert info.value.errno == errno.ESPIPE
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.parametrize("side", ["native", "twin"])
def test_frame_bodies_refuses_what_it_cannot_frame(side):
    fn = codec.frame_bodies if side == "native" else framing.frame_bodies_py
    out = bytearray(b"kept")
    with pytest.raises(TypeError):
        fn(out, 1, 0, 0, [b"ok", "not bytes"], framing.MAX_BODY)
    with pytest.raises(ValueError):
        fn(out, 1, 0, 0, [b"ok", b"x" * 11], 10)
    assert out == b"kept"  # every body is checked before any frame is written


@pytest.mark.parametrize("bad_at", [0, 3, 8, 9, 17])
def test_filter_add_that_fails_leaves_the_bits_of_the_keys_before_as_the_twin_does(bad_at):
    """The native filter_add hashes (and prefetches) keys ahead of those whose bits it sets:
    a key that is not bytes still leaves every key before it set, as the twin does (a filter
    may say "maybe" for a key, never "no")."""
    keys: list[Any] = [f"id-{i}".encode() for i in range(20)]
    keys[bad_at] = "not bytes"
    bits = []
    for fn in (codec.filter_add, idfilter.filter_add_py):
        layer = bytearray(1024)
        with pytest.raises(TypeError):
            fn(layer, keys)
        bits.append(bytes(layer))
    assert bits[0] == bits[1]
    if bad_at:
        assert any(bits[0])


@pytest.mark.parametrize("side", ["native", "twin"])
def test_route_that_fails_leaves_the_buffers_and_segments_as_they_were(side):
    """A segment_of that raises on a bucket met after others (a stop while the disk is full)
    fails the whole call: no buffer grows (the native side sizes them all before copying)
    and no segment's last sequence moves, so nothing is copied twice when it is tried again."""
    from qdelay.segments import reader

    fn = codec.route if side == "native" else reader.route_py
    data = bytearray()
    for i, minute in enumerate([0, 0, 1, 2, 1]):
        framing.encode_into(data, RecordKind.MESSAGE, 10 + i, 0, (minute * 60_000 + 5).to_bytes(8, "little") + b"x")
    data = bytes(data)
    end, _count, starts, kinds, seqs, dues, _bad = framing_scan(data)
    cols = [np.frombuffer(a, t) for a, t in ((starts, np.int64), (kinds, np.uint8), (seqs, np.int64), (dues, np.int64))]
    segments = {0: FakeSegment(-1), 1: FakeSegment(-1)}

    def segment_of(bucket):
        if bucket == 2:
            raise OSError("no space left")
        return segments[bucket]

    behind = {0: bytearray(b"before")}
    with pytest.raises(OSError):
        fn(data, end, *cols, 1, None, behind, segment_of, [], {})
    assert behind == {0: bytearray(b"before")}
    assert [sg.last_sequence for sg in segments.values()] == [-1, -1]
    # and with every segment there, the same call copies each frame once
    segments[2] = FakeSegment(-1)
    fn(data, end, *cols, 1, None, behind, lambda b: segments[b], [], {})
    assert bytes(behind[0]) == b"before" + data[: starts_at(starts, 2)]
    assert [sg.last_sequence for sg in segments.values()] == [11, 14, 13]


def test_route_takes_a_spare_buffer_with_its_allocation_for_a_bucket_without_one():
    """A bucket without a buffer takes the last of the spares (a buffer written out before),
    emptied: the same object, its allocation kept (no pages faulted in, no reallocs as it
    grows again), holding only the new frames; the other buckets' buffers are not touched."""
    data = bytearray()
    for i, minute in enumerate([0, 1, 1]):
        framing.encode_into(data, RecordKind.MESSAGE, 10 + i, 0, (minute * 60_000 + 5).to_bytes(8, "little") + b"x")
    data = bytes(data)
    end, _count, starts, kinds, seqs, dues, _bad = framing_scan(data)
    cols = [np.frombuffer(a, t) for a, t in ((starts, np.int64), (kinds, np.uint8), (seqs, np.int64), (dues, np.int64))]
    spare = bytearray(b"w" * 100_000)
    first = bytearray(b"kept")
    spares = [first, spare]
    behind = {0: bytearray(b"before")}
    size_before = spare.__sizeof__()
    codec.route(data, end, *cols, 1, None, behind, lambda b: FakeSegment(-1), spares, {})
    assert behind[1] is spare and bytes(spare) == data[starts_at(starts, 1) :]
    assert spare.__sizeof__() == size_before  # its allocation, not a new one
    assert spares == [first] and bytes(behind[0]) == b"before" + data[: starts_at(starts, 1)]


@pytest.mark.parametrize("side", ["native", "twin"])
def test_route_asks_segment_of_only_for_a_bucket_the_segments_lack(side):
    """``segments`` (the schedule log's, by bucket) gives a bucket's segment without a Python
    call; ``segment_of`` (which creates one) is asked for the others only."""
    from qdelay.segments import reader

    fn = codec.route if side == "native" else reader.route_py
    data = bytearray()
    for i, minute in enumerate([0, 1, 0, 2]):
        framing.encode_into(data, RecordKind.MESSAGE, 10 + i, 0, (minute * 60_000 + 5).to_bytes(8, "little") + b"x")
    data = bytes(data)
    end, _count, starts, kinds, seqs, dues, _bad = framing_scan(data)
    cols = [np.frombuffer(a, t) for a, t in ((starts, np.int64), (kinds, np.uint8), (seqs, np.int64), (dues, np.int64))]
    known = {0: FakeSegment(-1), 2: FakeSegment(13)}
    asked: list[int] = []

    def segment_of(bucket):
        asked.append(bucket)
        return FakeSegment(-1)

    result = fn(data, end, *cols, 1, None, {}, segment_of, [], known)
    assert asked == [1]
    assert result[3] == 1  # bucket 2's segment holds sequence 13 already: a replay, skipped
    assert [known[0].last_sequence, known[2].last_sequence] == [12, 13]


def starts_at(starts: bytes, i: int) -> int:
    return int(np.frombuffer(starts, np.int64)[i])


@pytest.mark.parametrize("side", ["native", "twin"])
def test_new_outgoing_takes_keywords_and_refuses_as_the_namedtuple_does(side):
    new = wire_codec.new_outgoing if side == "native" else wire.new_outgoing_py
    full = Outgoing("s", b"p", None, 5, "id", {"k": "v"})
    assert new(Outgoing, "s", b"p", delay_ms=5, headers={"k": "v"}, message_id="id") == full
    assert new(Outgoing, payload=b"p", subject="s", delay_ms=5, message_id="id", headers={"k": "v"}) == full
    assert new(Outgoing, "s", b"p") == ("s", b"p", None, None, "", None)
    for args, kwargs in [
        ((Outgoing, "s"), {}),  # no payload
        ((Outgoing,), {"payload": b""}),  # no subject
        ((Outgoing, "s", b""), {"subject": "t"}),  # twice
        ((Outgoing, "s", b""), {"delay": 5}),  # no such field
        ((Outgoing, "s", b"", 1, None, "", None, "extra"), {}),
        ((), {}),
    ]:
        with pytest.raises(TypeError):
            new(*args, **kwargs)


def test_outgoing_is_built_natively_and_stays_a_namedtuple():
    """Outgoing.__new__ is the native one where the codec is built (the producer's cheapest
    message); the class keeps its NamedTuple surface and its signature."""
    import inspect
    import pickle

    assert Outgoing.__new__ is wire_codec.new_outgoing
    o = Outgoing("s", b"p", delay_ms=3)
    assert type(o) is Outgoing and o.delay_ms == 3 and o.message_id == "" and o.headers is None
    assert o._replace(subject="t") == ("t", b"p", None, 3, "", None)
    assert Outgoing._make(["a", b"", 1, None, "", None]).deliver_at_ms == 1
    assert pickle.loads(pickle.dumps(o)) == o and type(pickle.loads(pickle.dumps(o))) is Outgoing
    assert o._asdict()["delay_ms"] == 3
    assert list(inspect.signature(Outgoing).parameters) == list(Outgoing._fields)
    with pytest.raises(TypeError):
        Outgoing("s")


@pytest.mark.parametrize("side", ["native", "twin"])
def test_encode_send_batch_refuses_what_it_cannot_encode(side):
    fn = wire_codec.encode_send_batch if side == "native" else wire.encode_send_batch_py
    for bad in [
        [("s", "not bytes", 1, None, "", None)],
        [("s", b"", "1", None, "", None)],
        [("s", b"")],
        [("s", b"", 1, None, "", ["not", "a", "dict"])],
        [("s", b"", 1, 2, "", None)],
    ]:
        with pytest.raises((TypeError, ValueError)):
            fn(bytearray(), bad, ["id"] * len(bad))
    with pytest.raises(ValueError):
        fn(bytearray(), [("s", b"", 1, None, "", None)], [])


@pytest.mark.parametrize("side", ["native", "twin"])
def test_encode_outgoing_request_refuses_what_it_cannot_encode_and_makes_missing_ids(side):
    fn = wire_codec.encode_outgoing_request if side == "native" else wire.encode_outgoing_request_py
    for bad in [
        [("s", "not bytes", 1, None, "", None)],
        [("s", b"", "1", None, "", None)],
        [("s", b"")],
        ["not a tuple"],
        [("s", b"", 1, None, "", ["not", "a", "dict"])],
        [("s", b"", 1, 2, "", None)],
        [("s", b"", 1, None, 5, None)],
    ]:
        with pytest.raises((TypeError, ValueError)):
            fn(bad, _id_maker())
    request, ids = fn([("s", b"a", 1, None, "", None), ("s", b"b", None, 2, "mine", {"k": "v"})], _id_maker())
    assert ids == ["made-1", "mine"]
    parsed = pb.SendBatchRequest.FromString(request)
    assert parsed.compact_receipts and [m.message_id for m in parsed.messages] == ids
    assert parsed.messages[1].headers == {"k": "v"} and parsed.messages[1].delay_ms == 2
    assert fn([], _id_maker()) == (b"\x10\x01", [])


def test_encode_outgoing_request_refuses_headers_changed_by_its_id_maker():
    """make_id runs Python code between sizing a message and writing it: a headers dict it
    grows must not overrun the request (sized again before it is written)."""
    headers = {"k": "v"}

    def make_id() -> str:
        headers["more"] = "x" * 100
        return "made"

    with pytest.raises(RuntimeError, match="headers"):
        wire_codec.encode_outgoing_request(
            [("s", b"a", 1, None, "own", headers), ("s", b"b", 1, None, "", None)], make_id
        )


@settings(max_examples=200, deadline=None)
@given(batch=batches, ids_required=st.booleans(), small_payload=st.booleans())
def test_the_fast_path_takes_only_what_validation_accepts_and_encodes_it_alike(batch, ids_required, small_payload):
    """The wire codec's encode_messages against the worded reference (server/validation):
    what the fast path takes, the reference accepts with the same bytes; the public entry
    point gives the same whichever path it took."""
    limits = Limits(max_payload_bytes=20) if small_payload else LIMITS
    fast = wire_codec.encode_messages(batch, NOW, *limit_args(small_payload), new_ids(), ids_required)
    try:
        slow = encode_messages_py(batch, limits, NOW, new_ids(), ids_required=ids_required)
    except errors.InvalidArgument:
        assert fast is None
        return
    if any(m.headers for m in batch):
        assert fast is None
    else:
        assert fast == (slow.bodies, slow.ids, slow.dues, slow.payload_bytes)
        assert [records.decode_message(b).message_id for b in fast[0]] == slow.ids
    # the public entry point gives the same whichever path it took (up to the numbering of
    # generated ids: the fast path may use some before it hands a batch over)
    again = encode_messages(batch, limits, NOW, new_ids(), ids_required=ids_required)

    def unnumbered(bodies: list[bytes]) -> list:
        return [
            dataclasses.replace(records.decode_message(b), message_id="") if not m.message_id else b
            for m, b in zip(batch, bodies)
        ]

    assert (again.dues, again.payload_bytes) == (slow.dues, slow.payload_bytes)
    assert unnumbered(again.bodies) == unnumbered(slow.bodies)


@settings(max_examples=200, deadline=None)
@given(raw=cancel_request_bytes())
def test_the_cancel_batch_fast_path_takes_only_what_validation_accepts_alike(raw):
    """decode_cancel_batch against the worded reference (validate_cancel_batch of the parsed
    request): what the fast path takes, the reference accepts with the same targets; the
    server's entry point (validation.decode_cancel_batch) answers as the reference."""
    from qdelay.server.validation import decode_cancel_batch, validate_cancel_batch

    fast = wire_codec.decode_cancel_batch(raw, LIMITS.max_message_id_bytes, LIMITS.max_batch)
    try:
        slow = validate_cancel_batch(pb.CancelBatchRequest.FromString(raw), LIMITS)
    except (errors.InvalidArgument, DecodeError):
        assert fast is None
        with pytest.raises(errors.InvalidArgument):
            decode_cancel_batch(raw, LIMITS)
        return
    if fast is not None:
        assert fast == slow
    assert decode_cancel_batch(raw, LIMITS) == slow


def test_a_cancel_batch_response_is_what_protobuf_writes():
    outcomes = [1, 2, 3, 4, 5, 1]
    want = pb.CancelBatchResponse(responses=[pb.CancelResponse(outcome=o) for o in outcomes])  # type: ignore[misc]
    assert wire.encode_cancel_batch_response(outcomes) == want.SerializeToString()
    assert wire.encode_cancel_batch_response([]) == b""


def test_a_full_send_batch_response_is_what_protobuf_writes():
    """Spot check against a response built by hand with protobuf: duplicates answer their
    original receipt, the others take the sequences in order, each names the shard."""
    got = wire_codec.encode_send_batch_response(["a", "b", "c"], [5, -1, 7], 100, False, {1: ("orig", 3, 9)}, "s1")
    want = pb.SendBatchResponse(
        receipts=[
            pb.Receipt(message_id="a", deliver_at_ms=5, sequence=100, shard="s1"),
            pb.Receipt(message_id="orig", deliver_at_ms=3, sequence=9, duplicate=True, shard="s1"),
            pb.Receipt(message_id="c", deliver_at_ms=7, sequence=101, shard="s1"),
        ]
    )
    assert got == want.SerializeToString()
    compact = wire_codec.encode_send_batch_response(["a", "b"], [5, 6], 100, True, None, "")
    assert pb.SendBatchResponse.FromString(compact) == pb.SendBatchResponse(first_sequence=100, deliver_at_ms=[5, 6])


@settings(max_examples=100, deadline=None)
@given(data=damaged_frames())
def test_reader_columns_gather_a_field_of_the_frames(data):
    """segments/reader.py: the columns of a walk, and the CANCEL targets gathered from them."""
    from qdelay.segments import reader

    a = reader.scan_columns(data)
    lengths = np.array([int.from_bytes(data[s + 12 : s + 16], "little") for s in a.starts.tolist()], dtype=np.int64)
    rows = (a.kinds == RecordKind.CANCEL) & (lengths >= 16)  # bodies that hold the field
    want = [int.from_bytes(data[s + 44 : s + 52], "little", signed=True) for s in a.starts[rows].tolist()]
    assert a.u64_at(rows, 8).tolist() == want
    fields = reader.gather(data, a.starts, framing.SEQUENCE_AT, 8)
    assert fields.tolist() == [struct.unpack_from("<q", data, s + framing.SEQUENCE_AT)[0] for s in a.starts.tolist()]


def test_decode_deliveries_decodes_what_protobuf_writes():
    """The native decoder takes what a server writes (None only for what it leaves to
    protobuf), fills the client's slots class directly, and calls any other class."""
    resp = pb.SubscribeResponse()
    resp.deliveries.add(
        ack_id="12.3", message_id="é:1", subject="s.x", payload=b"\x00p", deliver_at_ms=-1, attempt=2**32 - 1
    )
    resp.deliveries.add(ack_id="1.1", headers={"k": "v", "": "é"}, dispatched_at_ms=2**63 - 1)
    raw = resp.SerializeToString()
    got = wire_codec.decode_deliveries(raw, Delivery, "g")
    assert got == wire.decode_deliveries_py(raw, Delivery, "g")
    assert got[0] == Delivery("é:1", "s.x", b"\x00p", {}, -1, 0, 2**32 - 1, "12.3", "g")
    assert got[1].headers == {"k": "v", "": "é"} and got[1].dispatched_at_ms == 2**63 - 1
    got[0].headers["x"] = "y"  # each its own dict
    assert got[1].headers == {"k": "v", "": "é"}
    del got[0].headers["x"]

    class Plain:  # no slots: called with the fields in order
        def __init__(self, *fields):
            self.fields = fields

    assert [p.fields for p in wire_codec.decode_deliveries(raw, Plain, "g")] == [dataclasses.astuple(d) for d in got]
    assert wire_codec.decode_deliveries(raw + b"\x10\x01", Delivery, "g") is None
    assert wire.decode_deliveries(raw + b"\x10\x01", Delivery, "g") == got  # protobuf skips it
    with pytest.raises(DecodeError):
        wire.decode_deliveries(raw[:-1], Delivery, "g")


def test_the_wire_codecs_field_numbers_follow_the_proto():
    """Every field number the C wire codec uses by hand is the generated descriptors' (the
    same check runs when the server or a client imports qdelay.wire)."""
    assert wire.mismatches(wire_codec.WIRE_FIELDS) == []
    messages = {name.rsplit(".", 2)[1] for name in wire_codec.WIRE_FIELDS}
    assert messages == {
        "Message",
        "SendBatchRequest",
        "SendBatchResponse",
        "Receipt",
        "SubscribeResponse",
        "Delivery",
        "CancelBatchRequest",
        "CancelRequest",
    }
    # SendBatchResponse.more is never written by the C codec: wire.merge_send_batch_responses
    # joins whole responses under it, its number read from the descriptor
    outside = {"qdelay.v1.SendBatchResponse.more"}
    for message in (pb.Message, pb.Delivery, pb.Receipt, pb.SendBatchResponse):
        assert set(wire_codec.WIRE_FIELDS) | outside >= {
            f"qdelay.v1.{message.DESCRIPTOR.name}.{f.name}" for f in message.DESCRIPTOR.fields
        }


def test_a_proto_change_the_codec_does_not_follow_fails_loudly():
    class Renumbered:
        WIRE_FIELDS = dict(wire_codec.WIRE_FIELDS, **{"qdelay.v1.Message.delay_ms": 7, "qdelay.v1.Delivery.gone": 9})

    with pytest.raises(errors.InvariantViolation, match="delay_ms: the codec uses field 7, the .proto says 6"):
        wire.check(Renumbered)
    with pytest.raises(errors.InvariantViolation, match="Delivery.gone: no such field"):
        wire.check(Renumbered)


@pytest.mark.parametrize("count", [2, 100, 511, 512, 3000])  # its table on the stack up to 512 ids, else on the heap
def test_decode_batch_leaves_a_repeated_id_to_the_python_path(count):
    """A batch that repeats an id (chosen twice, or chosen like the one generated before
    it) is left to the Python path, which refuses it; one without a repeat is decoded, as
    its twin does, whatever its size."""

    def raw(message_ids):
        msgs = [pb.Message(subject="s", payload=b"p", message_id=m, delay_ms=1) for m in message_ids]
        return pb.SendBatchRequest(messages=msgs).SerializeToString()

    def decode(message_ids, make=None):
        args = (raw(message_ids), NOW, *limit_args(False), 10_000, make or new_ids())
        return wire_codec.decode_batch(*args), wire.decode_batch_py(*args)

    distinct = [f"id-{i}" for i in range(count)]
    fast, twin = decode(distinct)
    assert fast is not None and fast == twin and fast[1] == distinct
    for repeated in (distinct[:-1] + [distinct[0]], distinct[:-1] + [distinct[-2]]):
        assert decode(repeated) == (None, None)
    # the server's id for an empty one, then a client's of the same text
    assert decode([*distinct[:-2], "", "made-1"], lambda: "made-1") == (None, None)


def test_merged_send_batch_responses_read_back_as_the_first_with_the_rest_in_more():
    """wire.merge_send_batch_responses joins wire bytes: protobuf reads them as the first
    response with the others, whole, in ``more`` (a long one needs a 2-byte length)."""
    first = pb.SendBatchResponse(first_sequence=1, deliver_at_ms=[5, 6], shard="s0")
    rest = [
        pb.SendBatchResponse(first_sequence=3, deliver_at_ms=list(range(200)), shard="s0"),
        pb.SendBatchResponse(receipts=[pb.Receipt(message_id="a", deliver_at_ms=9, sequence=2, duplicate=True)]),
    ]
    raw = wire.merge_send_batch_responses(first.SerializeToString(), [r.SerializeToString() for r in rest])
    merged = pb.SendBatchResponse.FromString(raw)
    assert merged.first_sequence == 1 and list(merged.deliver_at_ms) == [5, 6] and list(merged.more) == rest
    assert wire.merge_send_batch_responses(first.SerializeToString(), []) == first.SerializeToString()


def test_packed_send_batch_requests_unpack_to_the_same_bytes():
    """wire.pack_send_batch_requests / unpack_send_batch_requests: the batches' wire bytes
    back, in order (a long one needs a 2-byte length); a request that is not packed is
    None; a packed one with a field of its own, or cut short, is refused."""
    raws = [
        pb.SendBatchRequest(messages=[pb.Message(subject="s", payload=b"x" * n, message_id=str(n))]).SerializeToString()
        for n in (1, 300, 70_000)
    ]
    packed = wire.pack_send_batch_requests(raws)
    assert wire.unpack_send_batch_requests(packed) == raws
    assert list(pb.SendBatchRequest.FromString(packed).more) == [pb.SendBatchRequest.FromString(r) for r in raws]
    assert wire.unpack_send_batch_requests(raws[0]) is None
    with pytest.raises(errors.InvalidArgument, match="no field of its own"):
        wire.unpack_send_batch_requests(packed + b"\x10\x01")
    with pytest.raises(errors.InvalidArgument, match="past the end"):
        wire.unpack_send_batch_requests(packed[:-1])
    with pytest.raises(errors.InvalidArgument, match="cut"):
        wire.unpack_send_batch_requests(packed[:1] + b"\xff")
