"""Validation of every request limit of the API contract (docs/api.md, "Limits").

A batch is validated whole before anything is written: one bad message refuses the
batch, and the error names the message's index, the field and the limit, e.g.
``messages[3].subject: 300 bytes, limit 255``. Valid messages come back encoded as
MESSAGE bodies, with the due time resolved on the server's clock and a message id
generated where the client left it empty.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from qdelay import wire  # imported, it checks the native wire codec against the .proto (start-up)
from qdelay.errors import InvalidArgument, InvariantViolation
from qdelay.segments import records
from qdelay.server.config import Limits
from qdelay.units import limit_in_words, ms_in_words
from qdelay.v1 import qdelay_pb2 as pb

INT64_MAX = 2**63 - 1
_SUBJECT_CHARS = re.compile(r"[A-Za-z0-9._-]+")
# printable ASCII (the contract's words), space included
_MESSAGE_ID_CHARS = re.compile(r"[\x20-\x7e]+")


class IdGenerator:
    """Unique message ids: a random per-process prefix and a counter (cheap, never reused).

    ``issued`` is how many it has made; the ids made between two readings are
    ``made(before, after)``, so the server can tell the ids it generated for a batch from
    ids its client chose, even a client that chose one of the same shape."""

    def __init__(self) -> None:
        self._prefix = os.urandom(8).hex() + "-"
        self._count = itertools.count(1)
        self.issued = 0

    def __call__(self) -> str:
        self.issued = n = next(self._count)
        return f"{self._prefix}{n:x}"

    def made(self, before: int, after: int) -> Made:
        """The ids this generator made after it had made ``before`` and up to ``after``."""
        return Made(self._prefix, before, after)


class Made:
    """Ids an IdGenerator made, as the range of its counter (no string made again per id:
    a batch whose ids the server generated costs the duplicate check nothing per id)."""

    __slots__ = ("prefix", "before", "after")

    def __init__(self, prefix: str, before: int, after: int) -> None:
        self.prefix, self.before, self.after = prefix, before, after

    def __len__(self) -> int:
        return self.after - self.before

    def __contains__(self, message_id: object) -> bool:
        if not isinstance(message_id, str) or not message_id.startswith(self.prefix):
            return False
        count = message_id[len(self.prefix) :]
        try:
            n = int(count, 16)
        except ValueError:
            return False
        # written back as the generator writes it: this also refuses what int() lets through
        # (a sign, "0x", "_", spaces, capitals, leading zeros)
        return self.before < n <= self.after and count == f"{n:x}"


def _where(index: int | None, field: str) -> str:
    return f"message.{field}" if index is None else f"messages[{index}].{field}"


def check_subject(subject: str, limits: Limits, where: str = "subject") -> None:
    if not subject:
        raise InvalidArgument(f"{where}: required, 1-{limits.max_subject_len} characters of [A-Za-z0-9._-]")
    if len(subject) > limits.max_subject_len:
        raise InvalidArgument(f"{where}: {len(subject)} characters, limit {limits.max_subject_len}")
    if not _SUBJECT_CHARS.fullmatch(subject):
        bad = next(c for c in subject if not _SUBJECT_CHARS.fullmatch(c))
        raise InvalidArgument(f"{where}: character {bad!r} not allowed; use [A-Za-z0-9._-]")


def check_message_id(message_id: str, limits: Limits, where: str = "message_id", required: bool = False) -> None:
    if not message_id:
        if required:
            raise InvalidArgument(f"{where}: required")
        return
    size = len(message_id.encode())
    if size > limits.max_message_id_bytes:
        raise InvalidArgument(f"{where}: {size} bytes, limit {limits.max_message_id_bytes}")
    if not _MESSAGE_ID_CHARS.fullmatch(message_id):
        raise InvalidArgument(f"{where}: must be printable ASCII (0x20-0x7e)")


def check_headers(headers, limits: Limits, where: str = "headers") -> None:
    if not headers:
        return
    if len(headers) > limits.max_headers:
        raise InvalidArgument(f"{where}: {len(headers)} entries, limit {limits.max_headers}")
    total = 0
    for key, value in headers.items():
        kb = len(key.encode())
        if kb == 0:
            raise InvalidArgument(f"{where}: empty key; keys must be 1-{limits.max_header_key_bytes} bytes")
        if kb > limits.max_header_key_bytes:
            raise InvalidArgument(f"{where}[{key[:32]!r}...]: key is {kb} bytes, limit {limits.max_header_key_bytes}")
        total += kb + len(value.encode())
    if total > limits.max_headers_bytes:
        raise InvalidArgument(f"{where}: {total} bytes in all, limit {limits.max_headers_bytes}")


def resolve_due(msg, limits: Limits, now_ms: int, where_prefix: str) -> int:
    which = msg.WhichOneof("when")
    if which is None:
        raise InvalidArgument(f"{where_prefix}: set exactly one of deliver_at_ms or delay_ms")
    if which == "delay_ms":
        delay = msg.delay_ms
        if delay < 0:
            raise InvalidArgument(f"{where_prefix}.delay_ms: {delay} is negative; use 0 for 'now'")
        if delay > limits.max_delay_ms:
            raise InvalidArgument(
                f"{where_prefix}.delay_ms: {delay} ms ({ms_in_words(delay)}) is beyond the limit of "
                f"{limit_in_words(limits.max_delay_ms)}"
            )
        due = now_ms + delay
    else:
        due = msg.deliver_at_ms
        if due < 0:
            raise InvalidArgument(f"{where_prefix}.deliver_at_ms: {due} is before 1970 (Unix epoch ms expected)")
        if due - now_ms > limits.max_delay_ms:
            raise InvalidArgument(
                f"{where_prefix}.deliver_at_ms: {due} is {due - now_ms} ms ({ms_in_words(due - now_ms)}) ahead, "
                f"beyond the limit of {limit_in_words(limits.max_delay_ms)}"
            )
    if due > INT64_MAX:  # cannot happen with sane limits; never let an int64 overflow through
        raise InvalidArgument(f"{where_prefix}: due time overflows int64")
    return due


@dataclass(slots=True)
class EncodedBatch:
    """A validated batch, already in the message log's format: one MESSAGE body per
    message (``segments.records``), with the ids and due times its receipts need."""

    bodies: list[bytes]
    ids: list[str]
    dues: list[int]
    payload_bytes: int
    # ids the server generated for this batch (the client left them empty): they cannot be
    # a re-send, so the duplicate check skips them (set by the service after validation)
    generated: Made | None = None


def encode_messages(
    messages: Sequence,
    limits: Limits,
    now_ms: int,
    new_id: Callable[[], str],
    single: bool = False,
    ids_required: bool = False,
) -> EncodedBatch:
    """Validate a batch of ``qdelay.v1.Message`` and encode each as a MESSAGE body.

    One pass over the batch does both (this is the ingest hot path: every step per message
    shows in the server's CPU per message). Raises :class:`InvalidArgument` on the first
    bad message; nothing is returned for a refused batch. ``ids_required``: every message
    must carry its message_id (compact receipts do not return generated ids).

    The native wire codec takes the common case (valid, no headers); anything else, refusals
    included, goes through :func:`encode_messages_py`, the reference, which words the errors.
    """
    codec = wire.native
    if codec is not None and 0 < len(messages) <= limits.max_batch:
        fast = codec.encode_messages(
            messages,
            now_ms,
            limits.max_subject_len,
            limits.max_payload_bytes,
            limits.max_message_id_bytes,
            limits.max_delay_ms,
            new_id,
            ids_required,
        )
        if fast is not None:
            return EncodedBatch(*fast)
    return encode_messages_py(messages, limits, now_ms, new_id, single, ids_required)


def decode_batch(raw: bytes, limits: Limits, now_ms: int, new_id: Callable[[], str]) -> tuple[EncodedBatch, bool]:
    """A SendBatchRequest's wire bytes -> (validated batch, compact_receipts).

    The native wire codec parses, validates and encodes in one pass without a protobuf
    object per message; anything it does not take (headers, unknown fields, refusals) is
    parsed with protobuf and goes through :func:`encode_messages`, which words the errors.
    """
    codec = wire.native
    if codec is not None:
        fast = codec.decode_batch(
            raw,
            now_ms,
            limits.max_subject_len,
            limits.max_payload_bytes,
            limits.max_message_id_bytes,
            limits.max_delay_ms,
            limits.max_batch,
            new_id,
        )
        if fast is not None:
            bodies, ids, dues, total, compact = fast
            return EncodedBatch(bodies, ids, dues, total), compact
    try:
        request = pb.SendBatchRequest.FromString(raw)
    except DecodeError as err:
        raise InvalidArgument(f"malformed SendBatchRequest: {err}") from None
    if request.more:  # (a packed request is split before this, by SendStream alone)
        raise InvalidArgument(
            "more: only a SendStream request may carry batches in `more`, and then nothing else "
            "(no messages of its own, no `more` inside a batch)"
        )
    compact = request.compact_receipts
    return encode_messages(request.messages, limits, now_ms, new_id, ids_required=compact), compact


def encode_messages_py(
    messages: Sequence,
    limits: Limits,
    now_ms: int,
    new_id: Callable[[], str],
    single: bool = False,
    ids_required: bool = False,
) -> EncodedBatch:
    """The reference: every check of the contract, with the error naming the message, the
    field and the limit (the native wire codec's fast path takes exactly what this accepts
    without headers; qdelay/wire.py ``encode_messages_py`` is its twin restricted so)."""
    count = len(messages)
    if count == 0:
        raise InvalidArgument("messages: empty batch; send at least one message")
    if count > limits.max_batch:
        raise InvalidArgument(
            f"messages: {count} messages in one batch, limit {limits.max_batch} messages (limits.max_batch)"
        )
    bodies: list[bytes] = []
    ids: list[str] = []
    dues: list[int] = []
    add_body, add_id, add_due = bodies.append, ids.append, dues.append
    total = 0
    max_payload = limits.max_payload_bytes
    max_id = limits.max_message_id_bytes
    max_delay = limits.max_delay_ms
    # subjects repeat: each valid one is checked and encoded once per Limits object
    subjects: dict[str, bytes] = limits.__dict__.setdefault("_good_subjects", {})
    encode = records.encode_message
    for i, msg in enumerate(messages):
        # cheap checks inline; anything unusual goes to the precise checkers, which raise
        # with the field, the index and the limit
        subject = msg.subject
        subject_b = subjects.get(subject)
        if subject_b is None:
            check_subject(subject, limits, _where(None if single else i, "subject"))
            if len(subjects) >= 4096:
                subjects.clear()
            subject_b = subjects[subject] = subject.encode()
        payload = msg.payload
        size = len(payload)
        if size > max_payload:
            raise InvalidArgument(f"{_where(None if single else i, 'payload')}: {size} bytes, limit {max_payload}")
        message_id = msg.message_id
        if message_id:
            if not (len(message_id) <= max_id and message_id.isascii() and message_id.isprintable()):
                check_message_id(message_id, limits, _where(None if single else i, "message_id"))
        elif ids_required:
            raise InvalidArgument(
                f"{_where(None if single else i, 'message_id')}: required with "
                f"compact_receipts (the answer does not carry generated ids)"
            )
        else:
            message_id = new_id()
        if msg.WhichOneof("when") == "deliver_at_ms":
            due = msg.deliver_at_ms
            if due < 0 or due - now_ms > max_delay:
                resolve_due(msg, limits, now_ms, "message" if single else f"messages[{i}]")
        else:
            due = resolve_due(msg, limits, now_ms, "message" if single else f"messages[{i}]")
        if msg.headers:
            check_headers(msg.headers, limits, _where(None if single else i, "headers"))
            headers_b = records.encode_headers(dict(msg.headers))
        else:
            headers_b = b""
        total += size
        add_body(encode(subject_b, message_id.encode(), headers_b, payload, due))
        add_id(message_id)
        add_due(due)
    if len(set(ids)) != count:
        _refuse_repeated_id(ids, single)
    return EncodedBatch(bodies, ids, dues, total)


def _refuse_repeated_id(ids: list[str], single: bool) -> None:
    first: dict[str, int] = {}
    for i, message_id in enumerate(ids):
        if message_id in first:
            raise InvalidArgument(
                f"{_where(None if single else i, 'message_id')}: {message_id!r} repeats messages[{first[message_id]}]"
            )
        first[message_id] = i
    raise InvariantViolation("a repeated message id was not found again")


def validate_receipt(request, limits: Limits) -> tuple[str, int | None, int | None]:
    """(message_id, deliver_at_ms, sequence) named by a Cancel/Get request: its receipt,
    or, without one, its ``message_id`` alone (then due time and sequence are None)."""
    if not request.HasField("receipt"):
        if not request.message_id:
            raise InvalidArgument(
                "receipt or message_id: required (the Receipt that Send returned, or the message id alone)"
            )
        check_message_id(request.message_id, limits, "message_id", required=True)
        return request.message_id, None, None
    r = request.receipt
    check_message_id(r.message_id, limits, "receipt.message_id", required=True)
    if r.deliver_at_ms < 0:
        raise InvalidArgument(f"receipt.deliver_at_ms: {r.deliver_at_ms} is negative")
    if request.message_id and request.message_id != r.message_id:
        raise InvalidArgument(
            f"message_id: {request.message_id!r} disagrees with receipt.message_id {r.message_id!r}; give one of them"
        )
    return r.message_id, r.deliver_at_ms, r.sequence


def validate_reschedule(request, limits: Limits, now_ms: int) -> tuple[str, int | None, int | None, int]:
    """(message_id, deliver_at_ms, sequence, new due time) of a Reschedule request: the
    message as for Cancel (receipt or id), the new time as for Send (limits, 2 years)."""
    message_id, due, sequence = validate_receipt(request, limits)
    return message_id, due, sequence, resolve_due(request, limits, now_ms, "RescheduleRequest")


def validate_reschedule_batch(request, limits: Limits, now_ms: int) -> list[tuple[str, int | None, int | None, int]]:
    """The moves of a RescheduleBatch request: 1..max_batch of them, each as for Reschedule
    (``validate_reschedule``); one bad target refuses the whole batch, naming its index
    (``requests[3].delay_ms: ...``), and nothing is written."""
    _check_batch_size(request, limits, "Reschedule")
    return [
        (*_receipt_at(i, r, limits), resolve_due(r, limits, now_ms, f"requests[{i}]"))
        for i, r in enumerate(request.requests)
    ]


def _check_batch_size(request, limits: Limits, kind: str) -> None:
    """A CancelBatch's or RescheduleBatch's ``requests``: 1 to ``limits.max_batch`` of them."""
    count = len(request.requests)
    if count == 0:
        raise InvalidArgument(f"requests: empty; give 1 to max_batch {kind}Requests")
    if count > limits.max_batch:
        raise InvalidArgument(
            f"requests: {count} {kind.lower()} requests in one batch, limit {limits.max_batch} requests "
            "(limits.max_batch)"
        )


def _receipt_at(i: int, r, limits: Limits) -> tuple[str, int | None, int | None]:
    """``validate_receipt`` of a batch's ``requests[i]``, its errors naming that index."""
    try:
        return validate_receipt(r, limits)
    except InvalidArgument as err:
        raise InvalidArgument(f"requests[{i}].{err}") from None


def decode_cancel_batch(raw: bytes, limits: Limits) -> list[tuple[str, int | None, int | None]]:
    """A CancelBatchRequest's wire bytes -> its targets, as :func:`validate_cancel_batch`.

    The native wire codec reads a batch of plain receipts without a protobuf object per
    target; anything it does not take (by id, unknown fields, refusals) is parsed with
    protobuf and goes through :func:`validate_cancel_batch`, which words the errors."""
    codec = wire.native
    if codec is not None:
        fast = codec.decode_cancel_batch(raw, limits.max_message_id_bytes, limits.max_batch)
        if fast is not None:
            return fast
    try:
        request = pb.CancelBatchRequest.FromString(raw)
    except DecodeError as err:
        raise InvalidArgument(f"malformed CancelBatchRequest: {err}") from None
    return validate_cancel_batch(request, limits)


def validate_cancel_batch(request, limits: Limits) -> list[tuple[str, int | None, int | None]]:
    """The targets of a CancelBatch request: 1..max_batch receipts, each as for Cancel."""
    _check_batch_size(request, limits, "Cancel")
    fast = _receipts_at_once(request.requests, limits)
    if fast is not None:
        return fast
    return [_receipt_at(i, r, limits) for i, r in enumerate(request.requests)]


def _receipts_at_once(requests, limits: Limits) -> list[tuple[str, int | None, int | None]] | None:
    """The targets of a batch made of plain receipts, checked as whole columns (about 2 us a
    target less than ``validate_receipt`` one by one); None if any entry is something else
    or may be wrong: the caller then checks one by one, for the precise error. (An entry
    without a receipt reads as an empty one here: its empty id sends the batch that way.)"""
    if any(r.message_id for r in requests):
        return None
    targets = [(x.message_id, x.deliver_at_ms, x.sequence) for x in [r.receipt for r in requests]]
    ids = [t[0] for t in targets]
    lengths = list(map(len, ids))
    # printable ASCII is exactly 0x20-0x7e (_MESSAGE_ID_CHARS), so characters are bytes
    if min(lengths) == 0 or max(lengths) > limits.max_message_id_bytes or min(t[1] for t in targets) < 0:
        return None
    joined = "".join(ids)
    if not (joined.isascii() and joined.isprintable()):
        return None
    return targets


# DISPATCH records store a group's name with a one-byte length (docs/formats.md)
MAX_GROUP_LEN = 255


def check_group(group: str, limits: Limits) -> None:
    most = min(limits.max_subject_len, MAX_GROUP_LEN)
    if len(group) > most or not _SUBJECT_CHARS.fullmatch(group):
        raise InvalidArgument(f"group: 1-{most} characters of [A-Za-z0-9._-]")


def validate_stats(request, limits: Limits) -> tuple[str | None, str | None]:
    """(subject, group) a StatsRequest narrows its groups to (None: not narrowed)."""
    subject = request.subject or None
    group = request.group or None
    if subject is not None:
        check_subject(subject, limits, "StatsRequest.subject")
    if group is not None:
        check_group(group, limits)
    return subject, group


def validate_subscribe(request, limits: Limits) -> tuple[str, str]:
    subject = request.subject
    check_subject(subject, limits, "subject")
    group = request.group or "default"
    check_group(group, limits)
    return subject, group


def validate_change_group(request, limits: Limits) -> tuple[int, str, str]:
    """(op, subject, group) of a ChangeGroupRequest."""
    if request.op not in (1, 2):
        raise InvalidArgument("ChangeGroupRequest.op: CREATE or DELETE")
    check_subject(request.subject, limits, "subject")
    if not request.group:
        raise InvalidArgument("ChangeGroupRequest.group: required")
    check_group(request.group, limits)
    return request.op, request.subject, request.group
