"""What the dispatcher hands to consumers: batches of deliveries, as columns.

A burst hands out hundreds of thousands of deliveries a second, so a batch is parallel
lists rather than an object per delivery; the gRPC sink (``server/consumers.py``) reads
the columns straight into its responses.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from qdelay.segments import records

DEAD_LETTER_HEADER = "qdelay-dead-letter-of"


@dataclass(slots=True)
class Delivery:
    ack_id: str
    message_id: str
    subject: str
    payload: bytes
    headers: dict[str, str]
    deliver_at_ms: int
    dispatched_at_ms: int
    attempt: int


class Deliveries:
    """A batch of deliveries of one subject, as parallel lists (one entry per delivery).

    A burst hands out hundreds of thousands of deliveries a second; one Python object per
    delivery was a large share of that cost, so the dispatcher fills columns instead and a
    sink reads them directly (``ack_ids``, ``payloads`` ...). Iterating, indexing and
    ``len`` still behave like a list of :class:`Delivery` (built on demand), and a slice is
    a ``Deliveries`` again. ``headers`` holds None for a delivery without headers.
    ``message_id_bytes`` are the ids as stored (ASCII); ``message_ids`` decodes them on
    first use (a sink that encodes protobuf itself needs only the bytes).
    """

    __slots__ = (
        "subject",
        "group",
        "ack_ids",
        "message_id_bytes",
        "_message_ids",
        "payloads",
        "headers",
        "deliver_at_ms",
        "dispatched_at_ms",
        "attempts",
    )

    def __init__(
        self,
        subject: str,
        ack_ids: list[str],
        message_id_bytes: list[bytes],
        payloads: list[bytes],
        headers: list[dict[str, str] | None],
        deliver_at_ms: list[int],
        dispatched_at_ms: int,
        attempts: list[int],
        group: str = records.DEFAULT_GROUP,
    ) -> None:
        self.subject = subject
        self.group = group  # the consumer group these deliveries are for
        self.ack_ids = ack_ids
        self.message_id_bytes = message_id_bytes
        self._message_ids: list[str] | None = None
        self.payloads = payloads
        self.headers = headers
        self.deliver_at_ms = deliver_at_ms
        self.dispatched_at_ms = dispatched_at_ms  # one hand-over time for the whole batch
        self.attempts = attempts

    def __len__(self) -> int:
        return len(self.ack_ids)

    @property
    def message_ids(self) -> list[str]:
        if self._message_ids is None:
            self._message_ids = [m.decode() for m in self.message_id_bytes]
        return self._message_ids

    def _one(self, i: int) -> Delivery:
        return Delivery(
            self.ack_ids[i],
            self.message_ids[i],
            self.subject,
            self.payloads[i],
            self.headers[i] or {},
            self.deliver_at_ms[i],
            self.dispatched_at_ms,
            self.attempts[i],
        )

    def __iter__(self) -> Iterator[Delivery]:
        return map(self._one, range(len(self.ack_ids)))

    def __getitem__(self, key: int | slice) -> Delivery | Deliveries:
        if isinstance(key, slice):
            return Deliveries(
                self.subject,
                self.ack_ids[key],
                self.message_id_bytes[key],
                self.payloads[key],
                self.headers[key],
                self.deliver_at_ms[key],
                self.dispatched_at_ms,
                self.attempts[key],
                self.group,
            )
        return self._one(range(len(self.ack_ids))[key])

    def __repr__(self) -> str:
        return f"Deliveries({self.subject!r}, {len(self)} deliveries)"


class DeliverySink(Protocol):
    def credit(self, subject: str, group: str) -> int:
        """How many more deliveries of ``subject`` the consumers of ``group`` accept now
        (cheap, thread-safe)."""

    def deliver(self, subject: str, group: str, deliveries: Deliveries) -> None:
        """Take a batch; called on the scheduler thread, so it must not block."""
