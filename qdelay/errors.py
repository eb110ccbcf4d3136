"""The one exception tree of qdelay.

Every error the server can report derives from :class:`QdelayError`. Each class
names the gRPC status it maps to (``grpc_code``, a string so that this module,
and the storage layer that raises these errors, never import gRPC); the mapping
to real ``grpc.StatusCode`` values lives in one place, ``qdelay.server.status``.
"""

from __future__ import annotations

from typing import Any


class QdelayError(Exception):
    """Base of every qdelay error. ``grpc_code`` is the gRPC status name."""

    grpc_code = "INTERNAL"
    # set on the errors the clients raise for a failed call (qdelay.client.client.translate)
    code: Any  # the grpc.StatusCode (this module never imports gRPC)
    details: str
    attempts: int
    # send_many (send_batch of the sharded clients): message i's receipt at i, for the messages
    # acknowledged before the failure (the sharded clients: None where a shard did not)
    receipts: Any

    def said(self, code: Any, details: str) -> None:
        """Take a call's status as this error's (``CODE: details`` its message): one wording
        for the clients' errors, whether translated from gRPC or reworded after."""
        Exception.__init__(self, f"{code.name}: {details}")
        self.code = code
        self.details = details


# --- Request errors: the caller can fix them -------------------------------------------------


class InvalidArgument(QdelayError):
    """A request broke a documented limit; nothing was written."""

    grpc_code = "INVALID_ARGUMENT"


class NotFound(QdelayError):
    grpc_code = "NOT_FOUND"


class Unauthenticated(QdelayError):
    grpc_code = "UNAUTHENTICATED"


class PermissionDenied(QdelayError):
    grpc_code = "PERMISSION_DENIED"


class FailedPrecondition(QdelayError):
    """The server is in a state where this call cannot succeed (slave, fenced master)."""

    grpc_code = "FAILED_PRECONDITION"


class FolderInUse(FailedPrecondition):
    """Another process (a running server) holds the data folder's lock."""


class NotMaster(FailedPrecondition):
    """A write was sent to a slave."""


class Fenced(FailedPrecondition):
    """This server learned of a higher epoch; it must not act as master any more."""


# --- Capacity errors: retry later -------------------------------------------------------------


class ResourceExhausted(QdelayError):
    grpc_code = "RESOURCE_EXHAUSTED"


class Overloaded(ResourceExhausted):
    """The bounded ingest queue is full."""


class DiskFull(ResourceExhausted):
    """The disk is full, or below the configured free-space guard."""


class Unavailable(QdelayError):
    grpc_code = "UNAVAILABLE"


class ShuttingDown(Unavailable):
    pass


class LeaseLost(Unavailable):
    """Cluster mode: the master cannot prove it still holds its etcd lease; it does not
    acknowledge writes (a newer master may be elected once the lease expires)."""


class ReplicationTimeout(Unavailable):
    """Sync replication: the slave did not confirm in time; the write is not acknowledged."""


# --- Storage errors: data on disk is not what it must be -------------------------------------


class StorageError(QdelayError):
    grpc_code = "INTERNAL"


class CorruptRecord(StorageError):
    """A record failed its checksum or framing checks somewhere other than the torn tail."""

    grpc_code = "DATA_LOSS"

    def __init__(self, path: str, offset: int, reason: str) -> None:
        super().__init__(f"corrupt record in {path} at offset {offset}: {reason}")
        self.path = path
        self.offset = offset
        self.reason = reason


class WalFailed(StorageError):
    """A write or fsync of the message log failed; the log refuses appends until restart.

    After a failed fsync the kernel may have dropped the dirty pages, so retrying the
    fsync could report success for data that is gone. The only safe recovery is to
    reopen the log and recover from what is really on disk.
    """

    grpc_code = "UNAVAILABLE"


class InvariantViolation(StorageError):
    """An internal invariant did not hold: a bug, reported rather than stripped by -O."""


def check(condition: bool, message: str) -> None:
    """Raise :class:`InvariantViolation` unless ``condition`` holds (survives ``python -O``)."""
    if not condition:
        raise InvariantViolation(message)
