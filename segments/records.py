"""Body codecs of the record kinds (docs/formats.md, "Record bodies").

One codec per record kind, used by the server, the inspection tool and the Spark
reader alike. Bodies are little-endian; strings are UTF-8 (message ids: printable ASCII).
The frame (``segments.framing``) carries the sequence and a timestamp around each body.
"""

from __future__ import annotations

import enum
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from qdelay.errors import InvariantViolation
from qdelay.segments import framing, native
from qdelay.segments.framing import RecordKind

IntColumn = Sequence[int] | np.ndarray  # a column of integers: a list or a numpy array

# MESSAGE body: deliver_at_ms i64, subject_len u16, message_id_len u16, headers_len u32,
# payload_len u32, then subject, message_id, headers, payload.
MESSAGE_FIXED = struct.Struct("<qHHII")
# CANCEL body: target deliver_at_ms i64, target sequence u64, message_id_len u16, message_id.
CANCEL_FIXED = struct.Struct("<qQH")
# DISPATCH body: deliver_at_ms i64, dispatched_at_ms i64, schedule_offset u64, attempt u32,
# outcome u8, group_len u8, message_id_len u16, message_id, group (none: the default group).
DISPATCH_FIXED = struct.Struct("<qqQIBBH")
# GROUP body: op u8, reserved u8, subject_len u16, group_len u16, subject, group.
GROUP_FIXED = struct.Struct("<BBHH")
# the group whose DISPATCH records carry no name (and that inherits data folders of before groups)
DEFAULT_GROUP = "default"
HEADER_ENTRY = struct.Struct("<H")

_SIZES = {
    "MESSAGE_FIXED": (MESSAGE_FIXED, 20),
    "CANCEL_FIXED": (CANCEL_FIXED, 18),
    "DISPATCH_FIXED": (DISPATCH_FIXED, 32),
    "GROUP_FIXED": (GROUP_FIXED, 6),
}
for _name, (_struct, _size) in _SIZES.items():
    if _struct.size != _size:
        raise InvariantViolation(f"{_name} is {_struct.size} bytes, docs/formats.md says {_size}")


def _fields_at(fixed: struct.Struct) -> list[int]:
    """Where each field of a fixed part starts (one letter per field in its format)."""
    fmt = fixed.format.lstrip("<")
    return [struct.calcsize("<" + fmt[:k]) for k in range(len(fmt))]


# where the fixed parts' fields start, named once for the readers of raw record bytes
# (column readers gather them at these offsets; segments/layout.h names them for C)
_, CANCEL_TARGET_SEQUENCE_AT, CANCEL_ID_LEN_AT = _fields_at(CANCEL_FIXED)
_, MESSAGE_SUBJECT_LEN_AT, MESSAGE_ID_LEN_AT, MESSAGE_HEADERS_LEN_AT, MESSAGE_PAYLOAD_LEN_AT = _fields_at(MESSAGE_FIXED)
(
    _,
    DISPATCH_DISPATCHED_AT,
    DISPATCH_SCHEDULE_OFFSET_AT,
    DISPATCH_ATTEMPT_AT,
    DISPATCH_OUTCOME_AT,
    DISPATCH_GROUP_LEN_AT,
    DISPATCH_ID_LEN_AT,
) = _fields_at(DISPATCH_FIXED)


def layout() -> dict[str, int]:
    """The frame and body layout by the names segments/layout.h gives it: what the native
    codec must have been compiled with (its ``LAYOUT``)."""
    return {
        "MAGIC": framing.MAGIC,
        "VERSION": framing.VERSION,
        "HEADER_SIZE": framing.HEADER_SIZE,
        "CHECKED_FROM": framing.CHECKED_FROM,
        "CHECKSUM_AT": framing.CHECKSUM_AT,
        "LENGTH_AT": framing.LENGTH_AT,
        "KIND_AT": framing.KIND_AT,
        "VERSION_AT": framing.VERSION_AT,
        "FLAGS_AT": framing.FLAGS_AT,
        "SEQUENCE_AT": framing.SEQUENCE_AT,
        "TIMESTAMP_AT": framing.TIMESTAMP_AT,
        "KIND_MESSAGE": int(RecordKind.MESSAGE),
        "KIND_CANCEL": int(RecordKind.CANCEL),
        "KIND_DISPATCH": int(RecordKind.DISPATCH),
        "CANCEL_FIXED": CANCEL_FIXED.size,
        "CANCEL_TARGET_SEQUENCE_AT": CANCEL_TARGET_SEQUENCE_AT,
        "MESSAGE_FIXED": MESSAGE_FIXED.size,
        "MESSAGE_SUBJECT_LEN_AT": MESSAGE_SUBJECT_LEN_AT,
        "MESSAGE_ID_LEN_AT": MESSAGE_ID_LEN_AT,
        "MESSAGE_HEADERS_LEN_AT": MESSAGE_HEADERS_LEN_AT,
        "MESSAGE_PAYLOAD_LEN_AT": MESSAGE_PAYLOAD_LEN_AT,
        "DISPATCH_FIXED": DISPATCH_FIXED.size,
        "DISPATCH_DISPATCHED_AT": DISPATCH_DISPATCHED_AT,
        "DISPATCH_SCHEDULE_OFFSET_AT": DISPATCH_SCHEDULE_OFFSET_AT,
        "DISPATCH_ATTEMPT_AT": DISPATCH_ATTEMPT_AT,
        "DISPATCH_OUTCOME_AT": DISPATCH_OUTCOME_AT,
        "DISPATCH_GROUP_LEN_AT": DISPATCH_GROUP_LEN_AT,
        "DISPATCH_ID_LEN_AT": DISPATCH_ID_LEN_AT,
    }


# a native codec compiled with another layout must not touch a byte (a build older than
# LAYOUT has none to compare: tests/test_codec_native.py requires it of every build)
_native_layout = getattr(native.codec, "LAYOUT", None)
if _native_layout is not None and _native_layout != layout():
    _diff = sorted(k for k in set(_native_layout) | set(layout()) if _native_layout.get(k) != layout().get(k))
    raise InvariantViolation(f"the native codec was compiled with another record layout ({_diff}): rebuild it")


class Outcome(enum.IntEnum):
    """How a dispatch record closed a message."""

    DELIVERED = 1  # a consumer acknowledged it
    DEAD_LETTERED = 2  # it failed max_attempts times and was moved to the dead-letter subject


@dataclass(frozen=True, slots=True)
class Message:
    subject: str
    payload: bytes
    deliver_at_ms: int
    message_id: str
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Cancel:
    message_id: str
    deliver_at_ms: int  # the target's due time: routes the tombstone to its schedule segment
    target_sequence: int


@dataclass(frozen=True, slots=True)
class Dispatch:
    message_id: str
    deliver_at_ms: int
    dispatched_at_ms: int
    schedule_offset: int
    attempt: int
    outcome: int
    group: str = DEFAULT_GROUP


class GroupOp(enum.IntEnum):
    CREATE = 1
    DELETE = 2


@dataclass(frozen=True, slots=True)
class Group:
    """A consumer group created or deleted; the frame's timestamp says when."""

    op: int
    subject: str
    group: str


def encode_headers(headers: dict[str, str]) -> bytes:
    if not headers:
        return b""
    out = bytearray()
    for key, value in headers.items():
        k = key.encode()
        v = value.encode()
        out += HEADER_ENTRY.pack(len(k)) + k + HEADER_ENTRY.pack(len(v)) + v
    return bytes(out)


def decode_headers(raw: bytes) -> dict[str, str]:
    headers: dict[str, str] = {}
    pos = 0
    end = len(raw)
    try:
        while pos < end:
            (klen,) = HEADER_ENTRY.unpack_from(raw, pos)
            pos += 2
            key = raw[pos : pos + klen].decode()
            pos += klen
            (vlen,) = HEADER_ENTRY.unpack_from(raw, pos)
            pos += 2
            headers[key] = raw[pos : pos + vlen].decode()
            pos += vlen
    except struct.error:
        raise ValueError("headers block overruns its length") from None
    if pos != end:
        raise ValueError("headers block overruns its length")
    return headers


def _fixed(layout: struct.Struct, body: bytes, name: str) -> tuple:
    """Unpack a body's fixed part; a body too short for it is a ValueError like any other."""
    if len(body) < layout.size:
        raise ValueError(f"{name} body of {len(body)} bytes is shorter than its fixed part ({layout.size})")
    return layout.unpack_from(body, 0)


def encode_message(subject: bytes, message_id: bytes, headers: bytes, payload: bytes, deliver_at_ms: int) -> bytes:
    """MESSAGE body from already-encoded parts (the ingest path encodes each once)."""
    return b"".join(
        (
            MESSAGE_FIXED.pack(deliver_at_ms, len(subject), len(message_id), len(headers), len(payload)),
            subject,
            message_id,
            headers,
            payload,
        )
    )


def encode_message_obj(msg: Message) -> bytes:
    return encode_message(
        msg.subject.encode(), msg.message_id.encode(), encode_headers(msg.headers), msg.payload, msg.deliver_at_ms
    )


def decode_message(body: bytes) -> Message:
    due, slen, mlen, hlen, plen = _fixed(MESSAGE_FIXED, body, "message")
    pos = MESSAGE_FIXED.size
    if pos + slen + mlen + hlen + plen != len(body):
        raise ValueError("message body lengths do not add up")
    subject = body[pos : pos + slen].decode()
    pos += slen
    message_id = body[pos : pos + mlen].decode()
    pos += mlen
    headers = decode_headers(body[pos : pos + hlen])
    pos += hlen
    return Message(subject, body[pos : pos + plen], due, message_id, headers)


def message_index_fields(body: bytes) -> tuple[int, bytes, bytes]:
    """(deliver_at_ms, subject, message_id) without decoding headers or payload."""
    due, slen, mlen, _h, _p = MESSAGE_FIXED.unpack_from(body, 0)
    pos = MESSAGE_FIXED.size
    return due, body[pos : pos + slen], body[pos + slen : pos + slen + mlen]


def message_due(body: bytes) -> int:
    return struct.unpack_from("<q", body, 0)[0]


def encode_cancel(cancel: Cancel) -> bytes:
    mid = cancel.message_id.encode()
    return CANCEL_FIXED.pack(cancel.deliver_at_ms, cancel.target_sequence, len(mid)) + mid


def cancel_bodies(targets: list[tuple[str, int, int]]) -> list[bytes]:
    """``encode_cancel`` of each (message_id, deliver_at_ms, target_sequence), without a
    Cancel object each (a batch of tombstones)."""
    pack = CANCEL_FIXED.pack
    out = []
    for mid, due, seq in targets:
        raw = mid.encode()
        out.append(pack(due, seq, len(raw)) + raw)
    return out


def decode_cancel(body: bytes) -> Cancel:
    due, seq, mlen = _fixed(CANCEL_FIXED, body, "cancel")
    if CANCEL_FIXED.size + mlen != len(body):
        raise ValueError("cancel body length does not add up")
    return Cancel(body[CANCEL_FIXED.size :].decode(), due, seq)


def group_bytes(group: str) -> bytes:
    """A group's name as DISPATCH records store it: empty for the default group."""
    return b"" if group == DEFAULT_GROUP else group.encode()


def encode_dispatch(d: Dispatch) -> bytes:
    mid = d.message_id.encode()
    g = group_bytes(d.group)
    return (
        DISPATCH_FIXED.pack(
            d.deliver_at_ms, d.dispatched_at_ms, d.schedule_offset, d.attempt, d.outcome, len(g), len(mid)
        )
        + mid
        + g
    )


def decode_dispatch(body: bytes) -> Dispatch:
    due, dispatched, offset, attempt, outcome, glen, mlen = _fixed(DISPATCH_FIXED, body, "dispatch")
    if DISPATCH_FIXED.size + mlen + glen != len(body):
        raise ValueError("dispatch body length does not add up")
    a = DISPATCH_FIXED.size + mlen
    group = body[a:].decode() if glen else DEFAULT_GROUP
    return Dispatch(body[DISPATCH_FIXED.size : a].decode(), due, dispatched, offset, attempt, outcome, group)


def dispatch_group(body: bytes) -> str:
    """The group a DISPATCH body closes its message for (no full decode)."""
    glen = body[29] if len(body) > 29 else 0
    return body[len(body) - glen :].decode() if glen else DEFAULT_GROUP


def encode_group(g: Group) -> bytes:
    s, n = g.subject.encode(), g.group.encode()
    return GROUP_FIXED.pack(g.op, 0, len(s), len(n)) + s + n


def decode_group(body: bytes) -> Group:
    op, _r, slen, glen = _fixed(GROUP_FIXED, body, "group")
    if GROUP_FIXED.size + slen + glen != len(body) or op not in (GroupOp.CREATE, GroupOp.DELETE):
        raise ValueError("group body does not add up")
    a = GROUP_FIXED.size + slen
    return Group(op, body[GROUP_FIXED.size : a].decode(), body[a:].decode())


def decode_body(kind: int, body: bytes) -> Message | Cancel | Dispatch | Group | dict:
    """Decode any body by its frame kind (for the inspection tool and readers)."""
    if kind == RecordKind.MESSAGE:
        return decode_message(body)
    if kind == RecordKind.CANCEL:
        return decode_cancel(body)
    if kind == RecordKind.DISPATCH:
        return decode_dispatch(body)
    if kind == RecordKind.CHECKPOINT:
        return json.loads(body)
    if kind == RecordKind.GROUP:
        return decode_group(body)
    raise ValueError(f"unknown record kind {kind}")


# --- fast paths for the dispatcher (same formats as above, fewer Python steps) ---------------

_xxh = framing._xxh
# frame header + DISPATCH fixed part, the 68 bytes before the message id
_DISPATCH_HEAD_FIELDS = framing.HEADER_FIELDS + [
    ("deliver_at_ms", "<i8"),
    ("dispatched_at_ms", "<i8"),
    ("schedule_offset", "<u8"),
    ("attempt", "<u4"),
    ("outcome", "u1"),
    ("group_len", "u1"),
    ("message_id_len", "<u2"),
]
if np.dtype(_DISPATCH_HEAD_FIELDS).itemsize != framing.HEADER_SIZE + DISPATCH_FIXED.size:
    raise InvariantViolation("DISPATCH frame layout (numpy) does not match the spec's layout")


def _dispatch_frames_of_one_length(
    id_len: int,
    sequences: IntColumn,
    deliver_at_ms: IntColumn,
    dispatched_at_ms: IntColumn,
    schedule_offsets: IntColumn,
    attempts: IntColumn,
    message_ids: Sequence[bytes],
    timestamp: int,
    outcome: int,
    group: bytes = b"",
) -> tuple[bytes, int]:
    """DISPATCH frames whose message ids all have ``id_len`` bytes, and the frame size:
    every field of every frame is filled column-wise, then each frame is hashed."""
    fields = _DISPATCH_HEAD_FIELDS + [("message_id", f"S{id_len}")]
    if group:
        fields.append(("group", f"S{len(group)}"))
    dt = np.dtype(fields)
    n = len(sequences)
    arr = np.empty(n, dtype=dt)
    arr["magic"] = framing.MAGIC
    arr["length"] = DISPATCH_FIXED.size + id_len + len(group)
    arr["kind"] = RecordKind.DISPATCH
    arr["version"] = framing.VERSION
    arr["flags"] = 0
    arr["sequence"] = sequences
    arr["timestamp"] = timestamp
    arr["deliver_at_ms"] = deliver_at_ms
    arr["dispatched_at_ms"] = dispatched_at_ms
    arr["schedule_offset"] = schedule_offsets
    arr["attempt"] = attempts
    arr["outcome"] = outcome
    arr["group_len"] = len(group)
    arr["message_id_len"] = id_len
    arr["message_id"] = np.frombuffer(b"".join(message_ids), dtype=f"S{id_len}")
    if group:
        arr["group"] = group
    size = dt.itemsize
    raw = arr.tobytes()
    # the checksum covers bytes [12, size) of each frame
    arr["checksum"] = np.fromiter(
        map(
            _xxh,
            map(
                raw.__getitem__,
                map(slice, range(framing.CHECKED_FROM, n * size, size), range(size, n * size + 1, size)),
            ),
        ),
        dtype=np.uint64,
        count=n,
    )
    return arr.tobytes(), size


def encode_dispatch_frames(
    sequences: IntColumn,
    deliver_at_ms: IntColumn,
    dispatched_at_ms: IntColumn,
    schedule_offsets: IntColumn,
    attempts: IntColumn,
    message_ids: Sequence[bytes],
    timestamp: int,
    outcome: int,
    group: bytes = b"",
) -> bytes:
    """Whole DISPATCH frames, back to back, one per position of the (equally long) columns;
    ``message_ids`` are bytes. Every frame gets the frame ``timestamp``, ``outcome`` and
    ``group`` (as :func:`group_bytes` gives it). The native codec's ``dispatch_frames``,
    or :func:`encode_dispatch_frames_py`."""
    codec = native.codec
    columns = (sequences, deliver_at_ms, dispatched_at_ms, schedule_offsets, attempts, message_ids)
    if codec is not None:
        return codec.dispatch_frames(*columns, timestamp, outcome, group)
    return encode_dispatch_frames_py(*columns, timestamp, outcome, group)


def encode_dispatch_frames_py(
    sequences: IntColumn,
    deliver_at_ms: IntColumn,
    dispatched_at_ms: IntColumn,
    schedule_offsets: IntColumn,
    attempts: IntColumn,
    message_ids: Sequence[bytes],
    timestamp: int,
    outcome: int,
    group: bytes = b"",
) -> bytes:
    """The Python twin of ``native.codec.dispatch_frames``.

    Byte-identical to ``framing.encode(DISPATCH, sequence, timestamp, encode_dispatch(...))``
    for each position in turn; built column-wise with numpy (the ack path of a burst closes
    hundreds of thousands of messages a second), so only the hash is a call per frame.
    """
    n = len(sequences)
    if n == 0:
        return b""
    lengths = list(map(len, message_ids))
    distinct = set(lengths)
    if len(distinct) == 1:
        (id_len,) = distinct
        if id_len > 0:
            return _dispatch_frames_of_one_length(
                id_len,
                sequences,
                deliver_at_ms,
                dispatched_at_ms,
                schedule_offsets,
                attempts,
                message_ids,
                timestamp,
                outcome,
                group,
            )[0]
    # ids of several lengths: one array per length, then the frames back in input order
    frames: list = [None] * n
    for id_len in distinct:
        idx = [i for i, k in enumerate(lengths) if k == id_len]
        if id_len == 0:  # numpy has no zero-width string field
            for i in idx:
                frames[i] = framing.encode(
                    RecordKind.DISPATCH,
                    sequences[i],
                    timestamp,
                    DISPATCH_FIXED.pack(
                        deliver_at_ms[i], dispatched_at_ms[i], schedule_offsets[i], attempts[i], outcome, len(group), 0
                    )
                    + group,
                )
            continue
        raw, size = _dispatch_frames_of_one_length(
            id_len,
            [sequences[i] for i in idx],
            [deliver_at_ms[i] for i in idx],
            [dispatched_at_ms[i] for i in idx],
            [schedule_offsets[i] for i in idx],
            [attempts[i] for i in idx],
            [message_ids[i] for i in idx],
            timestamp,
            outcome,
            group,
        )
        for pos, i in enumerate(idx):
            frames[i] = raw[pos * size : (pos + 1) * size]
    return b"".join(frames)
