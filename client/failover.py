"""The failover policy the cluster clients share: which refusals are retried on another
server, and how long and how often (a deadline, exponential backoff)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from qdelay import errors
from qdelay.client.batching import lost_status

# FAILED_PRECONDITION: a slave or a fenced master; UNAVAILABLE: unreachable, shutting down,
# sync replication timed out, or a deadline (whether it was written is unknown, and the
# same ids sent again are deduplicated)
RETRYABLE = (errors.FailedPrecondition, errors.Unavailable)


class Backoff:
    """One call's retries: until ``timeout`` seconds from now, waits doubling from
    ``first`` up to ``most`` (never past the deadline)."""

    def __init__(self, timeout: float, first: float, most: float) -> None:
        self.deadline = time.monotonic() + timeout
        self._delay = first
        self._most = most

    def expired(self) -> bool:
        return time.monotonic() >= self.deadline

    def next_wait(self) -> float:
        """How long to wait before the next try (and double the one after)."""
        wait = min(self._delay, max(0.0, self.deadline - time.monotonic()))
        self._delay = min(self._delay * 2, self._most)
        return wait


def retryable(err: Exception) -> bool:
    """A refusal to retry elsewhere, or a call the server ended as it shut down: a stream
    grpc-core failed (a lost status, ``batching.lost_status``) or a call it cancelled
    (CANCELLED, seen from a node stopped in a rolling restart once the client's own retries
    on that node ran out). Same request and ids, so a retry is safe."""
    if isinstance(err, RETRYABLE):
        return True
    if not isinstance(err, errors.QdelayError):
        return False
    return lost_status(err) or getattr(getattr(err, "code", None), "name", None) == "CANCELLED"


def consumers_everywhere(clients: Iterable[Any], subject: str, group: str, max_in_flight: int) -> list:
    """``subscribe_all`` of the cluster clients (ClusterClient, ShardedClient and
    AioShardedClient): one consumer per server, the group made on every master before
    (``create_group``: a slave refuses a Subscribe that would create it). Each is made
    ``wait_for_group``: a slave's consumer subscribes again with backoff while the slave
    refuses (FAILED_PRECONDITION), until the GROUP record reached it or it was promoted,
    instead of ending with the refusal. Other errors still end a consumer."""
    return [c.subscribe(subject, group, max_in_flight, wait_for_group=True) for c in clients]


def outcome_unknown(err: Exception) -> bool:
    """A failed try that may still have taken effect: one failover retries, other than a
    refusal (FAILED_PRECONDITION: a slave or a fenced master wrote nothing)."""
    return retryable(err) and not isinstance(err, errors.FailedPrecondition)


Outcomes = TypeVar("Outcomes", str, list[str])


def _first_try(outcomes: Outcomes) -> Outcomes:
    """ALREADY_CANCELLED read as CANCELLED (one outcome, or a cancel_many's list)."""
    if isinstance(outcomes, str):
        return "CANCELLED" if outcomes == "ALREADY_CANCELLED" else outcomes
    return ["CANCELLED" if o == "ALREADY_CANCELLED" else o for o in outcomes]


def cancel_tries(call: Callable[[Any], Outcomes]) -> Callable[[Any], Outcomes]:
    """One ``cancel()`` or ``cancel_many()`` that failover retries (``_retry``): ``call(client)``
    each try. After a try whose outcome is unknown, ALREADY_CANCELLED may be that try's own
    work, and is answered CANCELLED, as the single-server client answers a re-sent cancel
    (docs/api.md: CANCELLED whenever its cancel was, or may have been, the first to reach
    the message)."""
    unknown = False

    def one(client: Any) -> Outcomes:
        nonlocal unknown
        try:
            outcomes = call(client)
        except errors.QdelayError as err:
            unknown = unknown or outcome_unknown(err)
            raise
        return _first_try(outcomes) if unknown else outcomes

    return one


def acancel_tries(call: Callable[[Any], Awaitable[Outcomes]]) -> Callable[[Any], Awaitable[Outcomes]]:
    """:func:`cancel_tries`, awaited."""
    unknown = False

    async def one(client: Any) -> Outcomes:
        nonlocal unknown
        try:
            outcomes = await call(client)
        except errors.QdelayError as err:
            unknown = unknown or outcome_unknown(err)
            raise
        return _first_try(outcomes) if unknown else outcomes

    return one
