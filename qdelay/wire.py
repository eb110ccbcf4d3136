"""The hand-written protobuf wire codec of qdelay's gRPC messages: the native functions
(``qdelay._wire``, built from qdelay/_wire.c) and, beside them, their Python twins.

The hot messages are read and written without a protobuf object per message:
SendBatchRequest (decoded by the server straight into MESSAGE bodies, encoded by the
client from ``Outgoing`` tuples), SendBatchResponse (full or compact receipts) and
SubscribeResponse (encoded by the server, decoded by the clients into their typed
``Delivery``), and CancelBatchRequest (CancelBatch and CancelStream: a batch of receipts
straight to its targets). :data:`native` is the compiled module, or None when it was not built
(it is an optional extension) or when ``QDELAY_NATIVE=0`` is set (to compare both in one
benchmark run); callers look it up at each call (``wire.native``), so a test can switch it
off. Every native function has a twin here with the same signature and results
(:func:`twins`); tests/test_codec_native.py runs each pair on the same inputs.

The C code names the field numbers it uses once and exports them as ``WIRE_FIELDS``; they
are checked against the generated descriptors when this module is imported (the server's
and the clients' start-up) and in a test: a ``.proto`` change that the C code does not
follow fails loudly instead of putting wrong bytes on the wire.

This module is the client distribution's too (packaging/client): it imports no storage code
at module level. The two server-side twins (:func:`encode_messages_py`,
:func:`decode_batch_py`) import the server's validation, the reference they stand for, when
they run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from google.protobuf.message import DecodeError

from qdelay.errors import InvalidArgument, InvariantViolation
from qdelay.extensions import optional
from qdelay.v1 import qdelay_pb2 as pb

ONE_BYTE_TAG = 15  # the codec writes every tag as one byte: fields 1-15

native: ModuleType | None = optional("qdelay._wire")


def mismatches(fields: dict[str, int]) -> list[str]:
    """What is wrong with ``fields`` (full field name -> number) against the descriptors."""
    pool = pb.DESCRIPTOR.pool
    out = []
    for full, number in sorted(fields.items()):
        message, _, name = full.rpartition(".")
        try:
            desc = pool.FindMessageTypeByName(message)
        except KeyError:
            out.append(f"{full}: no message {message} in the .proto")
            continue
        field = desc.fields_by_name.get(name)
        if field is None:
            out.append(f"{full}: no such field in the .proto")
        elif field.number != number:
            out.append(f"{full}: the codec uses field {number}, the .proto says {field.number}")
        elif number > ONE_BYTE_TAG:
            out.append(f"{full}: field {number} needs a tag of two bytes, the codec writes one")
    return out


def check(codec: ModuleType | type | None = None) -> None:
    """Raise :class:`InvariantViolation` unless the native wire codec (:data:`native` by
    default; nothing to check when it is not built or switched off) follows the .proto."""
    codec = native if codec is None else codec
    if codec is None:
        return
    fields = getattr(codec, "WIRE_FIELDS", None)
    if not fields:
        raise InvariantViolation("the native wire codec names no WIRE_FIELDS: rebuild it (make setup)")
    bad = mismatches(fields)
    if bad:
        raise InvariantViolation(
            "the native wire codec does not follow proto/qdelay/v1/qdelay.proto: " + "; ".join(bad)
        )


check()


# --- the Python twins, one per native function, same signatures and results ---------------


def encode_send_batch_py(out: bytearray, messages: list[tuple], ids: list[str]) -> int:
    """Twin of ``encode_send_batch``: appends the ``messages`` entries of a SendBatchRequest
    (wire bytes) for ``Outgoing`` tuples (subject, payload, deliver_at_ms, delay_ms,
    message_id, headers), with ``ids`` as their message ids; returns how many."""
    request = pb.SendBatchRequest()
    add = request.messages.add
    for (subject, payload, at, delay, _mid, headers), message_id in zip(messages, ids, strict=True):
        m = add(subject=subject, payload=payload, message_id=message_id)
        if headers:
            m.headers.update(headers)
        if at is not None and delay is not None:
            raise ValueError("give deliver_at_ms or delay_ms, not both")
        if at is not None:
            m.deliver_at_ms = at
        if delay is not None:
            m.delay_ms = delay
    out += request.SerializeToString()
    return len(messages)


# SendBatchRequest.compact_receipts = true (field 2, varint)
COMPACT_RECEIPTS = b"\x10\x01"


def encode_outgoing_request_py(messages: list[tuple], make_id: Callable[[], str]) -> tuple[bytes, list[str]]:
    """Twin of ``encode_outgoing_request``: send_many's SendBatchRequest (wire bytes, compact
    receipts) of ``Outgoing`` tuples, and the message ids it carries: a tuple's own
    message_id when it is not empty, else ``make_id()``'s (called in order, one a
    message)."""
    out = bytearray()
    ids: list[str] = []
    for m in list(messages):
        if not isinstance(m, tuple) or len(m) != 6:
            raise TypeError(
                "messages must be 6-tuples (subject, payload, deliver_at_ms, delay_ms, message_id, headers)"
            )
        ids.append(m[4] or make_id())
        encode_send_batch_py(out, [m], ids[-1:])
    out += COMPACT_RECEIPTS
    return bytes(out), ids


def new_outgoing_py(
    cls: type,
    subject: Any,
    payload: Any,
    deliver_at_ms: Any = None,
    delay_ms: Any = None,
    message_id: Any = "",
    headers: Any = None,
) -> tuple:
    """Twin of ``new_outgoing``: what the NamedTuple ``Outgoing``'s generated ``__new__``
    does (a ``cls`` instance of the six fields, unchecked)."""
    return tuple.__new__(cls, (subject, payload, deliver_at_ms, delay_ms, message_id, headers))


def encode_deliveries_py(
    out: bytearray,
    subject: str,
    ack_ids: Sequence[str],
    message_ids: Sequence[bytes],
    payloads: Sequence[bytes],
    headers: Sequence[dict[str, str] | None],
    deliver_at_ms: Sequence[int],
    dispatched_at_ms: int,
    attempts: Sequence[int],
) -> int:
    """Twin of ``encode_deliveries``: appends one SubscribeResponse ``deliveries`` entry per
    delivery (columns of equal length; message ids as stored, ASCII bytes) to ``out``;
    returns how many."""
    n = len(ack_ids)
    if not (len(message_ids) == len(payloads) == len(headers) == len(deliver_at_ms) == len(attempts) == n):
        raise ValueError("encode_deliveries: columns differ in length")
    resp = pb.SubscribeResponse()
    add = resp.deliveries.add
    for ack_id, mid, payload, hd, due, attempt in zip(ack_ids, message_ids, payloads, headers, deliver_at_ms, attempts):
        d = add(
            ack_id=ack_id,
            message_id=mid.decode(),
            subject=subject,
            payload=payload,
            deliver_at_ms=due,
            dispatched_at_ms=dispatched_at_ms,
            attempt=attempt,
        )
        if hd:
            d.headers.update(hd)
    out += resp.SerializeToString()
    return n


def encode_send_batch_response_py(
    ids: list[str],
    dues: list[int],
    first_sequence: int,
    compact: bool,
    dups: dict[int, tuple[str, int, int]] | None,
    shard: str,
) -> bytes:
    """Twin of ``encode_send_batch_response``: a whole SendBatchResponse. Compact
    (``compact`` and no duplicates): first_sequence, the due times and the shard. Full:
    one Receipt per message with ``shard``; ``dups`` maps an index to the original
    receipt of a duplicate (message_id, deliver_at_ms, sequence), the others take the
    sequences from ``first_sequence`` on."""
    if len(dues) != len(ids):
        raise ValueError("encode_send_batch_response: one due time per id")
    resp = pb.SendBatchResponse()
    if compact and not dups:
        resp.first_sequence = first_sequence
        resp.deliver_at_ms.extend(dues)
        resp.shard = shard
        return resp.SerializeToString()
    add = resp.receipts.add
    sequence = first_sequence
    for k, (message_id, due) in enumerate(zip(ids, dues)):
        r = add()  # setting fields beats add(**kwargs) by ~20 % (measured, protobuf upb)
        d = dups.get(k) if dups else None
        if d is not None:
            r.message_id, r.deliver_at_ms, r.sequence = d
            r.duplicate = True
        else:
            r.message_id = message_id
            r.deliver_at_ms = due
            r.sequence = sequence
            sequence += 1
        r.shard = shard
    return resp.SerializeToString()


def encode_messages_py(
    messages: Sequence,
    now_ms: int,
    max_subject: int,
    max_payload: int,
    max_id: int,
    max_delay: int,
    new_id: Callable[[], str],
    ids_required: bool,
) -> tuple[list[bytes], list[str], list[int], int] | None:
    """Twin of ``encode_messages`` (the fast path of a batch of ``qdelay.v1.Message``):
    (bodies, ids, dues, payload_bytes), or None for what the fast path leaves to the server's
    validation (server/validation.encode_messages_py, which words the errors): a message with
    headers, or a batch that validation refuses. By definition the reference restricted to
    what the fast path takes."""
    from qdelay.server.config import Limits  # server-side only: not imported by the clients
    from qdelay.server.validation import encode_messages_py as reference

    if not messages:
        return [], [], [], 0
    if any(m.headers for m in messages):
        return None
    limits = Limits(  # the batch's size is its caller's to check, as for the native function
        max_subject_len=max_subject,
        max_payload_bytes=max_payload,
        max_message_id_bytes=max_id,
        max_delay_ms=max_delay,
        max_batch=len(messages),
    )
    try:
        batch = reference(messages, limits, now_ms, new_id, ids_required=ids_required)
    except InvalidArgument:
        return None
    return batch.bodies, batch.ids, batch.dues, batch.payload_bytes


def decode_batch_py(
    raw: bytes,
    now_ms: int,
    max_subject: int,
    max_payload: int,
    max_id: int,
    max_delay: int,
    max_batch: int,
    new_id: Callable[[], str],
) -> tuple[list[bytes], list[str], list[int], int, bool] | None:
    """Twin of ``decode_batch``: a SendBatchRequest's wire bytes -> (bodies, ids, dues,
    payload_bytes, compact_receipts), or None for what the fast path leaves to protobuf and
    the server's validation: bytes protobuf cannot parse, unknown fields, an empty or too
    large batch, and whatever :func:`encode_messages_py` does not take."""
    try:
        request = pb.SendBatchRequest.FromString(raw)
    except DecodeError:
        return None
    if _has_unknown_fields(request) or not 0 < len(request.messages) <= max_batch:
        return None
    compact = request.compact_receipts
    fast = encode_messages_py(request.messages, now_ms, max_subject, max_payload, max_id, max_delay, new_id, compact)
    return None if fast is None else (*fast, compact)


def decode_deliveries_py(raw: bytes, cls: Callable[..., Any], group: str) -> list | None:
    """Twin of ``decode_deliveries``: a SubscribeResponse's wire bytes -> one ``cls(message_id,
    subject, payload, headers, deliver_at_ms, dispatched_at_ms, attempt, ack_id, group)`` per
    delivery (``cls`` is qdelay.client.types.Delivery), parsed by protobuf; None for bytes
    protobuf cannot parse. The reference: the native function gives the same list, or None
    where it leaves the bytes to this one (unknown fields, anything unusual)."""
    try:
        response = pb.SubscribeResponse.FromString(raw)
    except DecodeError:
        return None
    return [
        cls(
            d.message_id,
            d.subject,
            d.payload,
            dict(h) if (h := d.headers) else {},
            d.deliver_at_ms,
            d.dispatched_at_ms,
            d.attempt,
            d.ack_id,
            group,
        )
        for d in response.deliveries
    ]


def decode_deliveries(raw: bytes, cls: Callable[..., Any], group: str) -> list:
    """The clients' Subscribe deserializer: the native decoder, else (not built, or bytes it
    leaves to protobuf) the twin; DecodeError for bytes that are no SubscribeResponse."""
    codec = native
    out = codec.decode_deliveries(raw, cls, group) if codec is not None else None
    if out is None:
        out = decode_deliveries_py(raw, cls, group)
        if out is None:
            raise DecodeError("not a qdelay.v1.SubscribeResponse")
    return out


def decode_cancel_batch_py(raw: bytes, max_id: int, max_batch: int) -> list[tuple[str, int, int]] | None:
    """Twin of ``decode_cancel_batch``: a CancelBatchRequest's wire bytes -> its targets
    (message_id, deliver_at_ms, sequence), when it is 1 to ``max_batch`` receipts alone, each
    id 1 to ``max_id`` printable-ASCII characters and each due time not negative; else None
    (by id, unknown fields, bytes protobuf cannot parse, anything refused: the server then
    validates the parsed request, which words the error)."""
    try:
        request = pb.CancelBatchRequest.FromString(raw)
    except DecodeError:
        return None
    if _has_unknown_fields(request) or not 0 < len(request.requests) <= max_batch:
        return None
    out = []
    for r in request.requests:
        if not r.HasField("receipt") or r.message_id:
            return None
        t = r.receipt
        mid = t.message_id
        if not 0 < len(mid) <= max_id or not (mid.isascii() and mid.isprintable()) or t.deliver_at_ms < 0:
            return None
        out.append((mid, t.deliver_at_ms, t.sequence))
    return out


# CancelBatchResponse: field 1 (responses), each a CancelResponse of field 1 (outcome), one byte
_CANCEL_RESPONSES = pb.CancelBatchResponse.DESCRIPTOR.fields_by_name["responses"].number
_CANCEL_OUTCOME = pb.CancelResponse.DESCRIPTOR.fields_by_name["outcome"].number
_CANCEL_ANSWER = {
    v.number: bytes([_CANCEL_RESPONSES << 3 | 2, 2, _CANCEL_OUTCOME << 3, v.number])
    for v in pb.CancelResponse.Outcome.DESCRIPTOR.values
    if v.number
}


def encode_cancel_batch_response(outcomes: Sequence[int]) -> bytes:
    """A CancelBatchResponse's wire bytes, one CancelResponse per outcome (a CancelResponse.
    Outcome number, not 0), without a protobuf object per outcome: four bytes each."""
    answer = _CANCEL_ANSWER
    return b"".join([answer[o] for o in outcomes])


# SendBatchResponse.more (field 5, length-delimited): a merged answer's later responses
_MORE = pb.SendBatchResponse.DESCRIPTOR.fields_by_name["more"].number
_MORE_TAG = bytes([_MORE << 3 | 2])
# the metadata a SendStream is opened with to take merged answers (docs/api.md)
MERGE_ANSWERS = ("qdelay-merge-answers", "1")
# the initial metadata a server answers such a stream with: it takes packed requests
# (SendBatchRequest.more) too; a client packs only once it has seen it (an older server
# would read a packed request as an empty batch)
PACKED_REQUESTS = ("qdelay-packed-requests", "1")


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def merge_send_batch_responses(first: bytes, more: Sequence[bytes]) -> bytes:
    """One SendBatchResponse's wire bytes answering several requests of a SendStream: the
    first request's response, then each later one's as an element of ``more`` (a message
    field's elements may follow the other fields in any order: the bytes are joined, not
    parsed again)."""
    parts = [first]
    for answer in more:
        parts += (_MORE_TAG, _varint(len(answer)), answer)
    return b"".join(parts)


# SendBatchRequest.more (field 3, length-delimited): a packed request's batches
_PACKED_TAG = bytes([pb.SendBatchRequest.DESCRIPTOR.fields_by_name["more"].number << 3 | 2])


def pack_send_batch_requests(requests: Sequence[bytes]) -> bytes:
    """One SendBatchRequest's wire bytes standing for several (each a whole request's wire
    bytes) in ``more``, for SendStream: nothing but ``more`` entries, so that the server
    splits it without parsing the batches (:func:`unpack_send_batch_requests`)."""
    parts: list[bytes] = []
    for request in requests:
        parts += (_PACKED_TAG, _varint(len(request)), request)
    return b"".join(parts)


def unpack_send_batch_requests(raw: bytes) -> list[bytes] | None:
    """The batches of a packed SendBatchRequest (:func:`pack_send_batch_requests`), each as
    its wire bytes, in order; None when ``raw`` is not packed (its first field is not
    ``more``). A walk over the top-level fields only: one step a batch."""
    if raw[:1] != _PACKED_TAG:
        return None
    tag = _PACKED_TAG[0]
    out = []
    pos, end = 0, len(raw)
    while pos < end:
        if raw[pos] != tag:
            raise InvalidArgument(
                "SendBatchRequest: a request with `more` has no field of its own (messages, "
                "compact_receipts): put that batch in `more` too"
            )
        length = shift = 0
        pos += 1
        while True:
            if pos >= end or shift > 28:
                raise InvalidArgument("malformed SendBatchRequest: a `more` entry's length is cut")
            byte = raw[pos]
            pos += 1
            length |= (byte & 0x7F) << shift
            if byte < 0x80:
                break
            shift += 7
        if pos + length > end:
            raise InvalidArgument("malformed SendBatchRequest: a `more` entry runs past the end")
        out.append(raw[pos : pos + length])
        pos += length
    return out


def _has_unknown_fields(request: Any) -> bool:
    """Whether a parsed request carries fields this .proto does not know (the native parser
    gives those up): re-serialized without them, the bytes would be shorter."""
    known = type(request)()
    known.CopyFrom(request)
    known.DiscardUnknownFields()
    return known.ByteSize() != request.ByteSize()


def twins() -> dict[str, Callable[..., Any]]:
    """Every function of ``qdelay._wire`` and its Python twin (same signature, same results)."""
    return {
        "encode_send_batch": encode_send_batch_py,
        "encode_outgoing_request": encode_outgoing_request_py,
        "new_outgoing": new_outgoing_py,
        "encode_deliveries": encode_deliveries_py,
        "encode_send_batch_response": encode_send_batch_response_py,
        "encode_messages": encode_messages_py,
        "decode_batch": decode_batch_py,
        "decode_deliveries": decode_deliveries_py,
        "decode_cancel_batch": decode_cancel_batch_py,
    }
