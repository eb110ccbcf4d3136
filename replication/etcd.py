"""A minimal asyncio etcd v3 client: the calls a qdelay cluster makes, nothing more.

Why not a library: ``etcd3`` breaks on protobuf >= 4, ``etcd3gw`` is blocking HTTP, and
``aetcd`` would bring its own generated code and keep-alive loop -- while qdelay's fencing
needs to know exactly when each lease renewal was *sent* (the old master stops
acknowledging writes a margin before its lease can expire, counted from that instant).
``proto/qdelay/v1/etcd.proto`` declares the few v3 RPCs used (Range, Put, DeleteRange, Txn,
LeaseGrant, LeaseRevoke, LeaseKeepAlive) and is compiled with the project's grpcio-tools.

Endpoints: a comma-separated list; a call that fails with UNAVAILABLE, a deadline or a lost
status (`replication.common.peer_away`) moves to the next endpoint for the following call.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from qdelay.replication.common import peer_away
from qdelay.v1 import etcd_pb2 as epb
from qdelay.v1 import etcd_pb2_grpc as epb_grpc

Compare = epb.Compare


class EtcdError(Exception):
    """etcd could not be reached or refused a call."""


def prefix_end(prefix: bytes) -> bytes:
    """The range_end that makes a Range cover every key starting with ``prefix``."""
    b = bytearray(prefix)
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\0"


def put(key: bytes, value: bytes, lease: int = 0) -> epb.RequestOp:
    return epb.RequestOp(request_put=epb.PutRequest(key=key, value=value, lease=lease))


def delete(key: bytes) -> epb.RequestOp:
    return epb.RequestOp(request_delete_range=epb.DeleteRangeRequest(key=key))


def get(key: bytes) -> epb.RequestOp:
    return epb.RequestOp(request_range=epb.RangeRequest(key=key))


def absent(key: bytes) -> epb.Compare:
    """Holds when ``key`` does not exist (its create revision is 0)."""
    return epb.Compare(result=Compare.EQUAL, target=Compare.CREATE, key=key, create_revision=0)


def unchanged_since(key: bytes, mod_revision: int) -> epb.Compare:
    """Holds while ``key`` was last written at ``mod_revision`` (0: while it does not exist)."""
    if not mod_revision:
        return absent(key)
    return epb.Compare(result=Compare.EQUAL, target=Compare.MOD, key=key, mod_revision=mod_revision)


def created_at(key: bytes, revision: int) -> epb.Compare:
    """Holds while ``key`` is the very key created at ``revision`` (not a later re-creation)."""
    return epb.Compare(result=Compare.EQUAL, target=Compare.CREATE, key=key, create_revision=revision)


class Etcd:
    def __init__(self, endpoints: str | list[str], timeout: float = 2.0) -> None:
        if isinstance(endpoints, str):
            endpoints = [e.strip() for e in endpoints.split(",") if e.strip()]
        if not endpoints:
            raise EtcdError("no etcd endpoint given")
        self.endpoints = [e.removeprefix("http://") for e in endpoints]
        self.timeout = timeout
        self._i = 0
        self._channel = None
        self._kv = self._lease = None
        self._ka_call = None

    # --- channel ------------------------------------------------------------------------------------
    def _stubs(self):
        if self._channel is None:
            target = self.endpoints[self._i % len(self.endpoints)]
            self._channel = grpc.aio.insecure_channel(
                target,
                [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)],
            )
            self._kv = epb_grpc.KVStub(self._channel)
            self._lease = epb_grpc.LeaseStub(self._channel)
        return self._kv, self._lease

    async def _rotate(self) -> None:
        """Drop the channel after a failure; the next call tries the next endpoint."""
        ch, self._channel = self._channel, None
        self._ka_call = None
        self._i += 1
        if ch is not None:
            await ch.close(None)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close(None)
            self._channel = None

    @property
    def endpoint(self) -> str:
        """The endpoint the next call goes to."""
        return self.endpoints[self._i % len(self.endpoints)]

    async def _call(self, which: str, method: str, request, timeout: float | None = None):
        kv, lease = self._stubs()
        stub = kv if which == "kv" else lease
        try:
            return await getattr(stub, method)(request, timeout=timeout or self.timeout)
        except grpc.aio.AioRpcError as e:
            if peer_away(e):
                await self._rotate()
            raise EtcdError(f"etcd {method}: {e.code().name}: {e.details()}") from None

    # --- KV ---------------------------------------------------------------------------------------------
    async def range_prefix(self, prefix: bytes) -> epb.RangeResponse:
        return await self._call("kv", "Range", epb.RangeRequest(key=prefix, range_end=prefix_end(prefix)))

    async def get(self, key: bytes) -> epb.KeyValue | None:
        r = await self._call("kv", "Range", epb.RangeRequest(key=key))
        return r.kvs[0] if r.kvs else None

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> epb.PutResponse:
        return await self._call("kv", "Put", epb.PutRequest(key=key, value=value, lease=lease))

    async def delete_prefix(self, prefix: bytes) -> int:
        r = await self._call("kv", "DeleteRange", epb.DeleteRangeRequest(key=prefix, range_end=prefix_end(prefix)))
        return r.deleted

    async def txn(self, compare: list, success: list, failure: list | None = None) -> epb.TxnResponse:
        return await self._call("kv", "Txn", epb.TxnRequest(compare=compare, success=success, failure=failure or []))

    # --- leases -----------------------------------------------------------------------------------------
    async def grant(self, ttl_s: int) -> tuple[int, float]:
        """(lease id, monotonic time the request was sent): the lease lives at least ttl from then."""
        sent = time.monotonic()
        r = await self._call("lease", "LeaseGrant", epb.LeaseGrantRequest(TTL=ttl_s))
        if r.error:
            raise EtcdError(f"etcd LeaseGrant: {r.error}")
        return r.ID, sent

    async def revoke(self, lease_id: int) -> None:
        await self._call("lease", "LeaseRevoke", epb.LeaseRevokeRequest(ID=lease_id), timeout=1.0)

    async def keepalive(self, lease_id: int, timeout: float) -> tuple[int, float]:
        """Renew once on the long-lived keep-alive stream: (TTL granted, send time).

        TTL <= 0 means etcd no longer knows the lease (it expired)."""
        _kv, lease = self._stubs()
        sent = time.monotonic()
        try:
            if self._ka_call is None:
                self._ka_call = lease.LeaseKeepAlive()
            call = self._ka_call
            async with asyncio.timeout(timeout):
                await call.write(epb.LeaseKeepAliveRequest(ID=lease_id))
                resp = await call.read()
        except Exception as e:  # noqa: BLE001 - timeout, RPC error, or a stream that already ended
            call, self._ka_call = self._ka_call, None
            if call is not None:
                call.cancel()
            # a lost status (the write of a renewal on a stream a dying etcd broke) moves on
            # too: it stayed on the same endpoint for one more renewal period
            if not isinstance(e, grpc.aio.AioRpcError) or peer_away(e):
                await self._rotate()
            raise EtcdError(f"etcd LeaseKeepAlive: {e!r}") from None
        if resp is grpc.aio.EOF:
            self._ka_call = None
            raise EtcdError("etcd LeaseKeepAlive: stream ended")
        return resp.TTL, sent
