"""The etcd client moves to its next endpoint when one is away, a lost status included."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from qdelay.replication.etcd import Etcd, EtcdError


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class FailingStream:
    """A LeaseKeepAlive stream whose next write fails with ``error`` (what grpc.aio raises
    when the etcd at its other end died under it)."""

    def __init__(self, error: grpc.aio.AioRpcError) -> None:
        self.error = error
        self.cancelled = False

    async def write(self, _request) -> None:
        raise self.error

    async def read(self):
        raise AssertionError("never read after a failed write")

    def cancel(self) -> bool:
        self.cancelled = True
        return True


@pytest.mark.parametrize(
    ("code", "details", "moves"),
    [
        (grpc.StatusCode.UNAVAILABLE, "connection refused", True),
        (grpc.StatusCode.INTERNAL, "Internal error from Core", True),  # the lost status: it stayed
        (grpc.StatusCode.INTERNAL, "etcdserver: something refused", False),  # an answer, not an absence
    ],
)
def test_a_failed_renewal_moves_to_the_next_endpoint_when_its_etcd_is_away(code, details, moves):
    async def main() -> tuple[str, str, bool]:
        etcd = Etcd("127.0.0.1:2379,127.0.0.1:22379")
        first = etcd.endpoint
        stream = FailingStream(rpc_error(code, details))
        etcd._ka_call = stream  # the renewal stream it holds open, broken under it
        with pytest.raises(EtcdError, match="LeaseKeepAlive"):
            await etcd.keepalive(7, timeout=1.0)
        after = etcd.endpoint
        await etcd.close()
        return first, after, stream.cancelled

    first, after, cancelled = asyncio.run(main())
    assert cancelled  # the broken stream is dropped either way; the next renewal opens one
    assert (after != first) == moves
