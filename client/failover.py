"""The failover policy the cluster clients share: which refusals are retried on another
server, and how long and how often (a deadline, exponential backoff)."""

from __future__ import annotations

import time

from qdelay import errors

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
    grpc-core failed ('Internal error from Core': the status is lost) or a call it
    cancelled (CANCELLED, seen from a node stopped in a rolling restart once the client's
    own retries on that node ran out). Same request and ids, so a retry is safe."""
    if isinstance(err, RETRYABLE):
        return True
    if not isinstance(err, errors.QdelayError):
        return False
    return "Internal error from Core" in str(err) or getattr(getattr(err, "code", None), "name", None) == "CANCELLED"
