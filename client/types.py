"""The typed results of the Python clients (blocking and asyncio): receipts, statuses and
deliveries.

A :class:`Receipt` is what a send returns and what cancel/get/reschedule take. Its string
form is short and stable, meant to be kept in a database row next to the order it belongs
to, and read back with :meth:`Receipt.parse`::

    r = client.send("order.close", b"42", delay=timedelta(minutes=30))
    row.receipt = str(r)                       # 'qd1:1234:1764000000000::c3f...-1'
    client.cancel(Receipt.parse(row.receipt))  # or client.cancel(row.receipt)

``ref(x)`` turns anything a user may hold (a Receipt, its string, a bare message id, the
protobuf ``qdelay.v1.Receipt``, a ``(message_id, deliver_at_ms, sequence)`` tuple) into
the (receipt, message_id) pair a CancelRequest/GetRequest/RescheduleRequest carries.
"""

from __future__ import annotations

import re
from abc import abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, unquote

from qdelay import errors
from qdelay.v1 import qdelay_pb2 as pb

# qd1:<sequence>:<deliver_at_ms>:<shard, percent-quoted>:<message_id, as it is>
# The message id goes last and unquoted: it is printable ASCII that may hold ':'.
_PREFIX = "qd1:"
_TEXT = re.compile(r"qd1:(\d+):(-?\d+):([^:]*):(.+)", re.S)

STATES: dict[int, str] = {v.number: v.name for v in pb.GetResponse.State.DESCRIPTOR.values}


@dataclass(frozen=True, slots=True)
class Receipt:
    """Where a sent message is: its id, the due time the server will honour and its
    position (``sequence``) in the message log; ``shard`` in a cluster. ``duplicate`` says
    the server already had this id (nothing new was written; this is the original
    receipt); it is not part of the receipt's identity or of its string form."""

    message_id: str
    deliver_at_ms: int
    sequence: int
    shard: str = ""
    duplicate: bool = field(default=False, compare=False)

    def __str__(self) -> str:
        return f"{_PREFIX}{self.sequence}:{self.deliver_at_ms}:{quote(self.shard, safe='')}:{self.message_id}"

    @classmethod
    def parse(cls, text: str) -> Receipt:
        """The receipt whose ``str()`` is ``text``; InvalidArgument if it is not one."""
        m = _TEXT.fullmatch(text) if isinstance(text, str) else None
        if m is None:
            raise errors.InvalidArgument(
                f"not a qdelay receipt string: {text!r} (expected "
                "'qd1:<sequence>:<deliver_at_ms>:<shard>:<message_id>', as str(receipt) writes it)"
            )
        return cls(m.group(4), int(m.group(2)), int(m.group(1)), unquote(m.group(3)))

    @classmethod
    def from_pb(cls, r: pb.Receipt) -> Receipt:
        return cls(r.message_id, r.deliver_at_ms, r.sequence, r.shard, r.duplicate)

    def to_pb(self) -> pb.Receipt:
        return pb.Receipt(
            message_id=self.message_id, deliver_at_ms=self.deliver_at_ms, sequence=self.sequence, shard=self.shard
        )


class LazyReceipts(Sequence):
    """A read-only sequence of receipts made when read (send_many's answers): a ``Receipt``
    object per message, made as the server answered, would cost the producer more CPU than
    sending it. Subclasses give ``__len__`` and ``_at(i)`` for 0 <= i < len; indexing by
    negatives and slices is done here once for all of them."""

    @abstractmethod
    def _at(self, index: int) -> Receipt:
        """The receipt at ``index``, 0 <= index < len(self)."""

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self._at(i) for i in range(*index.indices(len(self)))]
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError("receipt index out of range")
        return self._at(index)


@dataclass(slots=True)
class Delivery:
    """One message handed to a consumer (what ``receive``, ``batches`` and iterating a
    consumer give, in both clients): the fields of ``qdelay.v1.Delivery`` by the same names,
    and ``group``, the consumer group it was delivered to. ``attempt`` is 1 on the first
    delivery; ``deliver_at_ms`` is the due time, ``dispatched_at_ms`` when the server handed
    it out. Acknowledge it (or a batch of them) with ``consumer.ack``: its ``ack_id`` names
    this delivery, not the message (a redelivery has another).

    The clients decode each SubscribeResponse straight into these (``wire.decode_deliveries``,
    native, no protobuf object per delivery). A plain slots class: cheap to make and to read,
    mutable like the protobuf it replaces."""

    message_id: str
    subject: str
    payload: bytes
    headers: dict[str, str]
    deliver_at_ms: int
    dispatched_at_ms: int
    attempt: int
    ack_id: str
    group: str = ""

    @classmethod
    def from_pb(cls, d: pb.Delivery, group: str = "") -> Delivery:
        return cls(
            d.message_id,
            d.subject,
            d.payload,
            dict(d.headers),
            d.deliver_at_ms,
            d.dispatched_at_ms,
            d.attempt,
            d.ack_id,
            group,
        )


# What names a message (what cancel, get and reschedule take): a Receipt, its string form
# or the message id alone, the protobuf Receipt, a dict of its fields, or a
# (message_id, deliver_at_ms, sequence) tuple.
Target = Receipt | str | pb.Receipt | dict[str, Any] | tuple[str, int, int]


def ref(target: Target | None) -> tuple[pb.Receipt | None, str]:
    """(receipt, message_id) for a request that names a message: exactly one is set.

    A string is a receipt's string form when it starts with 'qd1:', else a bare message id.
    A 'qd1:' text that does not parse (a receipt cut short in a too-narrow column) is
    refused rather than sent as an id: as an id it would answer NOT_FOUND, and a cancel
    that says NOT_FOUND while its message is still delivered is worse than an error. A
    message id that itself starts with 'qd1:' is given as ``message_id=``."""
    if target is None:
        raise errors.InvalidArgument("receipt: required; give a Receipt, its string form or message_id=")
    if isinstance(target, Receipt):
        return target.to_pb(), ""
    if isinstance(target, str):
        if not target:
            raise errors.InvalidArgument(
                "receipt: empty string; give a Receipt, its string form (qd1:…) or the message id"
            )
        if target.startswith(_PREFIX):
            try:
                receipt = Receipt.parse(target)  # one match of the text (a cut one is refused here)
            except errors.InvalidArgument:
                raise errors.InvalidArgument(
                    f"receipt: {target[:80]!r} starts like a receipt's string form but is not one "
                    "(qd1:<sequence>:<deliver_at_ms>:<shard>:<message_id>, as str(receipt) writes it); "
                    "a message id that starts with 'qd1:' goes as message_id="
                ) from None
            return receipt.to_pb(), ""
        return None, target
    if isinstance(target, pb.Receipt):
        return target, ""
    if isinstance(target, dict):
        return pb.Receipt(**target), ""
    if isinstance(target, tuple) and len(target) == 3:
        message_id, deliver_at_ms, sequence = target
        return pb.Receipt(message_id=message_id, deliver_at_ms=deliver_at_ms, sequence=sequence), ""
    raise errors.InvalidArgument(
        f"cannot name a message with a {type(target).__name__}: give a Receipt, its string form, "
        "the message id, or a qdelay.v1.Receipt"
    )


def by_id(message_id: str) -> tuple[None, str]:
    """(None, message_id) for a request by id (``message_id=``): the text is the id as it is,
    never read as a receipt's string form, so an id that starts with 'qd1:' works."""
    if not message_id:
        raise errors.InvalidArgument("message_id: empty string; give the message's id (1-128 printable ASCII bytes)")
    return None, message_id


@dataclass(frozen=True, slots=True)
class GroupStatus:
    """One consumer group's view of a message (``Status.groups``)."""

    name: str
    state: str
    delivered_at_ms: int


@dataclass(frozen=True, slots=True)
class Status:
    """What ``get`` answers: ``state`` is 'PENDING', 'DELIVERED', 'CANCELLED', 'NOT_FOUND'
    or 'DEAD_LETTERED'; the message's fields when the server still has them."""

    state: str
    message_id: str = ""
    subject: str = ""
    payload: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    deliver_at_ms: int = 0
    delivered_at_ms: int = 0
    groups: tuple[GroupStatus, ...] = ()

    @property
    def found(self) -> bool:
        return self.state != "NOT_FOUND"

    @classmethod
    def from_pb(cls, resp: pb.GetResponse) -> Status:
        m = resp.message
        return cls(
            state=STATES.get(resp.state, str(resp.state)),
            message_id=m.message_id,
            subject=m.subject,
            payload=m.payload,
            headers=dict(m.headers),
            deliver_at_ms=resp.deliver_at_ms,
            delivered_at_ms=resp.delivered_at_ms,
            groups=tuple(
                GroupStatus(g.name, STATES.get(g.state, str(g.state)), g.delivered_at_ms) for g in resp.groups
            ),
        )


# gRPC's default reconnect backoff grows to 120 s, and channels to one address share their
# subchannel: after a server restart, every new client in the process failed fast with
# "connection refused" until the backoff of the old ones ran out (a minute and more). A
# message client reconnects within a second, as Kafka's (reconnect.backoff.max.ms = 1 s).
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


# HTTP/2 keepalive: a ping every KEEPALIVE_S while a call is open (a Subscribe stream waiting
# for its next delivery, a SendStream between batches), so a connection that died without a
# word (a peer's host gone, a NAT or load balancer that dropped it) is noticed within
# KEEPALIVE_S + 10 s and the call fails with UNAVAILABLE: the consumer resubscribes, the
# sender retries. The server accepts a ping every 10 s at most on a connection it sends
# nothing on (its min_ping_interval_ms) and answers faster ones with GOAWAY
# "too_many_pings"; 30 s leaves it 3x. No pings without a call (nothing to protect), and no
# cap on pings while the client itself sends nothing (grpc's default stops pinging after 2,
# which is every idle consumer).
KEEPALIVE_S = 30.0


def keepalive_options(seconds: float | None) -> list[tuple[str, int]]:
    """Channel options for a ping every ``seconds`` on a connection with a call open (None
    or 0: no keepalive pings)."""
    if not seconds:
        return []
    return [
        ("grpc.keepalive_time_ms", int(seconds * 1000)),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def stats_dict(resp: pb.StatsResponse) -> dict:
    """StatsResponse as plain values (groups as a list of dicts)."""
    out: dict = {}
    for f in resp.DESCRIPTOR.fields:
        value = getattr(resp, f.name)
        if f.name == "groups":
            value = [{g.name: getattr(x, g.name) for g in x.DESCRIPTOR.fields} for x in value]
        out[f.name] = value
    return out


def _receipt_fields(r: Receipt) -> dict:
    """A Receipt's fields as the dict protobuf builds a qdelay.v1.Receipt from, in place in
    the request that holds it (no Receipt message made first and copied in)."""
    return {"message_id": r.message_id, "deliver_at_ms": r.deliver_at_ms, "sequence": r.sequence, "shard": r.shard}


def ref_or_id(target: Target | None, message_id: str | None = None) -> tuple[pb.Receipt | None, str]:
    """(receipt, message_id) for ``cancel``/``get``: by ``message_id=`` alone when it is given
    (:func:`by_id`; the target is then not looked at), else the target's (:func:`ref`)."""
    return ref(target) if message_id is None else by_id(message_id)


def cancel_request(target: Target | None, message_id: str | None = None) -> pb.CancelRequest:
    """The CancelRequest naming ``target`` or ``message_id=`` (as :func:`ref_or_id`). A
    Receipt, the usual target, costs 0.73 us this way against 1.42 through ``ref``
    (``to_pb``, then the copy into the request): ``cancel()`` from 16 threads pays it in
    every caller."""
    if type(target) is Receipt and message_id is None:
        return pb.CancelRequest(receipt=_receipt_fields(target))  # protobuf builds the message from the dict
    r, mid = ref_or_id(target, message_id)
    return pb.CancelRequest(receipt=r, message_id=mid)


# what ``cancel()`` hands its batcher (client/batching.py): a Receipt's fields (message_id,
# deliver_at_ms, sequence, shard), written by the batcher straight into the call's request,
# or a CancelRequest for any other target
CancelTarget = pb.CancelRequest | tuple[str, int, int, str]


def cancel_target(target: Target | None, message_id: str | None = None) -> CancelTarget:
    """``cancel_request`` for a batched ``cancel()``: a Receipt (the usual target) as its
    fields, ~0.05 us, where its CancelRequest cost each of 16 calling threads ~0.9 us and the
    batcher copied it again into the call's request (~0.4 us); any other target as its
    CancelRequest."""
    if type(target) is Receipt and message_id is None:
        return (target.message_id, target.deliver_at_ms, target.sequence, target.shard)
    return cancel_request(target, message_id)


def cancel_batches(targets: Iterable[Target], batch_size: int) -> list[pb.CancelBatchRequest]:
    """CancelBatch requests of at most ``batch_size`` targets each (what ``cancel`` takes)."""
    if batch_size < 1:
        raise errors.InvalidArgument("batch_size must be at least 1")
    reqs: list[pb.CancelRequest | dict] = []
    for target in targets:
        if type(target) is Receipt:  # the usual target: its fields as a dict, ~1.2 us cheaper than
            reqs.append({"receipt": _receipt_fields(target)})  # a Receipt and a CancelRequest made for it
            continue
        r, mid = ref(target)
        reqs.append(pb.CancelRequest(receipt=r, message_id=mid))
    return [pb.CancelBatchRequest(requests=reqs[i : i + batch_size]) for i in range(0, len(reqs), batch_size)]


RESCHEDULE_OUTCOMES = {v.number: v.name for v in pb.RescheduleResponse.Outcome.DESCRIPTOR.values}


def reschedule_request(
    target: Target | None, when_ms: tuple[int | None, int | None], message_id: str | None = None
) -> pb.RescheduleRequest:
    """A RescheduleRequest for ``target`` or ``message_id=`` (what ``cancel`` takes, as
    :func:`ref_or_id`) and (deliver_at_ms, delay_ms), exactly one of them set."""
    r, mid = ref_or_id(target, message_id)
    at, rel = when_ms
    if (at is None) == (rel is None):
        raise errors.InvalidArgument("give one of delay, delay_ms, deliver_at or deliver_at_ms")
    req = pb.RescheduleRequest(receipt=r, message_id=mid)
    if at is not None:
        req.deliver_at_ms = at
    elif rel is not None:
        req.delay_ms = rel
    return req


def reschedule_batches(
    targets: Iterable[Target], when_ms: tuple[int | None, int | None], batch_size: int
) -> list[pb.RescheduleBatchRequest]:
    """RescheduleBatch requests of at most ``batch_size`` targets each (what ``cancel``
    takes), every one moved to ``when_ms`` ((deliver_at_ms, delay_ms), one of them set)."""
    if batch_size < 1:
        raise errors.InvalidArgument("batch_size must be at least 1")
    reqs = [reschedule_request(t, when_ms) for t in targets]
    return [pb.RescheduleBatchRequest(requests=reqs[i : i + batch_size]) for i in range(0, len(reqs), batch_size)]


def reschedule_result(resp: pb.RescheduleResponse) -> tuple[str, Receipt | None]:
    """('RESCHEDULED', the new receipt) or (the outcome, None)."""
    outcome = RESCHEDULE_OUTCOMES.get(resp.outcome, str(resp.outcome))
    return outcome, (Receipt.from_pb(resp.receipt) if outcome == "RESCHEDULED" else None)
