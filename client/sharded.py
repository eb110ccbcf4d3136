"""Clients for a sharded qdelay cluster (``qdelay server --etcd … --cluster … --shard …``).

    from qdelay.client import ShardedClient
    with ShardedClient("10.0.0.1:7600") as c:            # any server of the cluster
        r = c.send("order.close", b"42", delay_ms=60_000)  # r.shard names where it went
        c.cancel(r)                                         # routed by the receipt
        with c.subscribe("order.close") as consumer:        # fans in from every shard
            batch = consumer.receive(100, 1.0)
            consumer.ack(batch)

    async with AioShardedClient("10.0.0.1:7600") as c:    # the same, awaited
        ...

Routing, the same in every language (docs/api.md): the client asks any server for the
``Topology`` (cluster, shards, each shard's master, slaves and epoch) and never talks to
etcd. A message goes to shard ``names[crc32(message_id) % len(names)]`` (CRC-32/IEEE of the
UTF-8 id, shard names sorted), so a retried id always lands on the same shard, where the
server deduplicates it. Ids are made by the client before the first try. A write refused
with FAILED_PRECONDITION (a slave, a fenced master) or UNAVAILABLE (a master that lost its
lease, a dead server) is retried with the same id on the shard's master after the topology
is read again, with backoff, for up to ``failover_timeout`` seconds. Cancel, Get and
Reschedule go to the shard the receipt names (by id alone: the id's shard).

Subscribe opens one stream per server of every shard: only masters dispatch, so after a
failover deliveries simply come from the new master's stream; servers that join later are
subscribed to when the topology is read again.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import zlib
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, cast

from qdelay import errors
from qdelay.client.client import Client, Consumer, Outgoing, _Ids
from qdelay.client.failover import RETRYABLE, Backoff
from qdelay.client.types import Delivery, Receipt, Status, Target
from qdelay.v1 import qdelay_pb2 as pb

if TYPE_CHECKING:
    from qdelay.client.aio import Client as AioClient


def _retryable(err: Exception) -> bool:
    """A refusal to retry elsewhere, or a call the server ended as it shut down: a stream
    grpc-core failed ('Internal error from Core': the status is lost) or a call it
    cancelled (CANCELLED, seen from a node stopped in a rolling restart once the client's
    own retries on that node ran out). Same request and ids, so a retry is safe."""
    if isinstance(err, RETRYABLE):
        return True
    if not isinstance(err, errors.QdelayError):
        return False
    return "Internal error from Core" in str(err) or getattr(getattr(err, "code", None), "name", None) == "CANCELLED"


class Topology:
    """One reading of the cluster's shards (merged: per shard the highest epoch seen wins)."""

    def __init__(self, cluster: str = "", shards: dict[str, pb.Shard] | None = None) -> None:
        self.cluster = cluster
        self.shards: dict[str, pb.Shard] = dict(shards or {})
        self.names = sorted(self.shards)

    @classmethod
    def merge(cls, old: Topology | None, resp: pb.TopologyResponse) -> Topology:
        shards = dict(old.shards) if old is not None else {}
        for s in resp.shards:
            have = shards.get(s.name)
            if have is None or s.epoch >= have.epoch:  # an older epoch is a stale reading
                shards[s.name] = s
        return cls(resp.cluster, shards)

    def shard_for(self, message_id: str) -> str:
        if not self.names:
            raise errors.Unavailable("the cluster has no shard yet")
        return self.names[zlib.crc32(message_id.encode()) % len(self.names)]

    def master(self, shard: str) -> str:
        s = self.shards.get(shard)
        return s.master if s is not None else ""

    def addresses(self) -> list[str]:
        out: dict[str, None] = {}
        for name in self.names:
            s = self.shards[name]
            if s.master:
                out[s.master] = None
            for a in s.slaves:
                out[a] = None
        return list(out)


def shard_of_target(target: Target, topology: Topology) -> str:
    """The shard a receipt (object, string form, protobuf) names, else the id's shard."""
    if isinstance(target, str) and target.startswith("qd1:"):
        target = Receipt.parse(target)
    if isinstance(target, (Receipt, pb.Receipt)):
        return target.shard if target.shard in topology.shards else topology.shard_for(target.message_id)
    return topology.shard_for(str(target))


def _seeds(seeds: Sequence[str] | str) -> list[str]:
    if isinstance(seeds, str):
        seeds = [t.strip() for t in seeds.split(",") if t.strip()]
    if not seeds:
        raise errors.InvalidArgument("a sharded client needs at least one seed address")
    return list(seeds)


class _Sharded:
    """What the blocking and the asyncio sharded clients share: seeds, the failover policy,
    the per-server clients, the topology last read."""

    def __init__(
        self,
        seeds: Sequence[str] | str,
        *,
        failover_timeout: float = 30.0,
        backoff: float = 0.05,
        max_backoff: float = 1.0,
        timeout: float = 10.0,
        **client_kw: Any,
    ) -> None:
        self.seeds = _seeds(seeds)
        self.failover_timeout = failover_timeout
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.timeout = timeout
        self.client_kw = client_kw
        self._clients: dict[str, Any] = {}
        self.closed = False  # set by close(): nothing is retried after it
        self._ids = _Ids()
        self.topology: Topology | None = None
        self.retries = 0  # writes repeated (same ids) after a refusal or a failure

    def _backoff(self) -> Backoff:
        return Backoff(self.failover_timeout, self.backoff, self.max_backoff)

    def _give_up(self, err: Exception) -> bool:
        """Whether a failed try ends the call: not retryable, or the client is closed."""
        return self.closed or not _retryable(err)


class ShardedClient(_Sharded):
    """Blocking client of a sharded cluster; see the module's docstring."""

    def __init__(self, seeds: Sequence[str] | str, **kw: Any) -> None:
        super().__init__(seeds, **kw)
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self.refresh()

    # --- plumbing -----------------------------------------------------------------------------------
    def client(self, address: str) -> Client:
        with self._lock:
            c = self._clients.get(address)
            if c is None:
                c = self._clients[address] = Client(address, retries=0, timeout=self.timeout, **self.client_kw)
            return c

    def refresh(self) -> Topology:
        """Read the topology again (known servers first, then the seeds)."""
        known = self.topology.addresses() if self.topology is not None else []
        last: Exception | None = None
        for address in dict.fromkeys([*known, *self.seeds]):
            c = self.client(address)
            try:
                resp = c._call(c.stub.Topology, pb.TopologyRequest(), 2.0)
            except errors.QdelayError as e:
                last = e
                continue
            with self._lock:
                self.topology = Topology.merge(self.topology, resp)
            return self.topology
        if self.topology is None:
            raise errors.Unavailable(f"no server of {self.seeds} answered Topology: {last}")
        return self.topology

    def _retry(self, shard_of, call):
        """``call(client of the shard's master)``; refused or failed: read the topology
        again and retry (same request, same ids) until ``failover_timeout``."""
        backoff = self._backoff()
        while True:
            topo = self.topology or self.refresh()
            shard = shard_of(topo)
            master = topo.master(shard)
            err: Exception | None = None
            if master:
                try:
                    return call(self.client(master))
                except errors.QdelayError as e:
                    if self._give_up(e):
                        raise
                    err = e
            else:
                err = errors.Unavailable(f"shard {shard!r} has no master (electing)")
            if backoff.expired():
                raise err
            self.retries += 1
            time.sleep(backoff.next_wait())
            try:
                self.refresh()
            except errors.QdelayError:
                pass

    def close(self) -> None:
        self.closed = True
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
            pool, self._executor = self._executor, None
        if pool is not None:
            pool.shutdown(wait=True)
        for c in clients:
            c.close()

    def __enter__(self) -> ShardedClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- API -----------------------------------------------------------------------------------------
    def send(self, subject: str, payload: bytes = b"", *, message_id: str | None = None, **kw: Any) -> Receipt:
        """As ``Client.send``; the receipt names its shard."""
        mid = message_id or self._ids()
        return self._retry(lambda t: t.shard_for(mid), lambda c: c.send(subject, payload, message_id=mid, **kw))

    def send_batch(self, messages: Iterable[pb.Message | Outgoing], timeout: float | None = None) -> list[Receipt]:
        """Many messages, grouped by shard (one SendBatch per shard); receipts in input order."""
        msgs = []
        for m in messages:
            if isinstance(m, tuple):
                m = self.client(self.seeds[0]).message(
                    m.subject,
                    m.payload,
                    delay_ms=m.delay_ms,
                    deliver_at_ms=m.deliver_at_ms,
                    headers=m.headers,
                    message_id=m.message_id,
                )
            if not m.message_id:
                m.message_id = self._ids()
            msgs.append(m)
        by_shard: dict[str, list[int]] = {}
        topo = self.topology or self.refresh()
        for i, m in enumerate(msgs):
            by_shard.setdefault(topo.shard_for(m.message_id), []).append(i)
        out: list[Receipt | None] = [None] * len(msgs)

        def send(shard: str, idx: list[int]) -> None:
            request = pb.SendBatchRequest(messages=[msgs[i] for i in idx])
            rs = self._retry(lambda _t: shard, lambda c: c._call(c.stub.SendBatch, request, timeout).receipts)
            for i, r in zip(idx, rs):
                out[i] = Receipt.from_pb(r)

        groups = list(by_shard.items())
        if len(groups) == 1:
            send(*groups[0])
        else:  # the shards' batches at the same time
            for f in [self._pool().submit(send, shard, idx) for shard, idx in groups]:
                f.result()
        return cast("list[Receipt]", out)  # every index was filled above

    def _pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=16, thread_name_prefix="qdelay-shards")
            return self._executor

    def cancel(self, target: Target, timeout: float | None = None) -> str:
        return self._retry(lambda t: shard_of_target(target, t), lambda c: c.cancel(target, timeout))

    def get(self, target: Target, timeout: float | None = None) -> Status:
        return self._retry(lambda t: shard_of_target(target, t), lambda c: c.get(target, timeout))

    def reschedule(self, target: Target, **kw: Any) -> tuple[str, Receipt | None]:
        return self._retry(lambda t: shard_of_target(target, t), lambda c: c.reschedule(target, **kw))

    def stats(self) -> dict:
        """Stats per shard (its master's, with ``master``, ``epoch`` and each slave's stats or
        error under ``slaves``) and for the whole cluster (``cluster``: pending, wheel_size and
        iterate_lag_bytes summed over the masters; shards without a master counted)."""
        topo = self.refresh()
        shards: dict[str, dict] = {}
        total = {"pending": 0, "wheel_size": 0, "iterate_lag_bytes": 0, "shards": 0, "shards_without_master": 0}
        for name in topo.names:
            s = topo.shards[name]
            entry: dict = {"master": s.master, "epoch": s.epoch, "slaves": {}}
            total["shards"] += 1
            if s.master:
                try:
                    st = self.client(s.master).stats(timeout=2.0)
                    entry.update(st)
                    for key in ("pending", "wheel_size", "iterate_lag_bytes"):
                        total[key] += int(st.get(key, 0))
                except errors.QdelayError as e:
                    entry["error"] = str(e)
            else:
                total["shards_without_master"] += 1
            for a in s.slaves:
                try:
                    entry["slaves"][a] = self.client(a).stats(timeout=2.0)
                except errors.QdelayError as e:
                    entry["slaves"][a] = str(e)
            shards[name] = entry
        return {"cluster": total, "shards": shards}

    def subscribe(self, subject: str, group: str = "default", max_in_flight: int = 1000) -> ShardedConsumer:
        return ShardedConsumer(self, subject, group, max_in_flight)


class ShardedConsumer:
    """Deliveries of a subject/group from every shard: one resubscribing Consumer per
    server (only masters dispatch), fanned into one inbox; ``ack`` sends each ack to the
    stream its delivery came from."""

    REFRESH_S = 2.0
    RETRY_S = 1.0

    def __init__(self, sc: ShardedClient, subject: str, group: str, max_in_flight: int) -> None:
        self.sc = sc
        self.subject, self.group, self.max_in_flight = subject, group, max_in_flight
        self._inbox: queue.Queue = queue.Queue()
        self._consumers: dict[str, Consumer | None] = {}  # None: its subscription is being made
        self._owner: dict[str, Consumer] = {}  # ack id -> the consumer it came from
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._add((sc.topology or sc.refresh()).addresses())
        self._watch = threading.Thread(target=self._watch_topology, daemon=True)
        self._watch.start()

    def _add(self, addresses: list[str]) -> None:
        for address in addresses:
            with self._lock:
                if address in self._consumers or self._closed.is_set():
                    continue
                self._consumers[address] = None
            threading.Thread(target=self._pump, args=(address,), daemon=True).start()

    def _pump(self, address: str) -> None:
        """Keep a subscription on ``address``. A slave refuses one (FAILED_PRECONDITION) while
        the group does not exist there yet: try again, it may be master after a failover."""
        while not self._closed.is_set():
            cons = self.sc.client(address).subscribe(self.subject, self.group, self.max_in_flight)
            with self._lock:
                self._consumers[address] = cons
            try:
                while not self._closed.is_set():
                    batch = cons.receive(self.max_in_flight, 0.2)
                    if batch:
                        self._inbox.put((cons, batch))
                    elif not getattr(cons, "_pump", None) or not cons._pump.is_alive():
                        break  # its stream ended for good
            except errors.QdelayError:
                pass
            cons.close(timeout=0.5)
            self._closed.wait(self.RETRY_S)

    def _watch_topology(self) -> None:
        while not self._closed.wait(self.REFRESH_S):
            try:
                self._add(self.sc.refresh().addresses())
            except errors.QdelayError:
                pass

    def receive(self, count: int, timeout: float) -> list[Delivery]:
        """Deliveries from any shard until ``count`` arrived or ``timeout`` seconds passed."""
        got: list[Delivery] = []
        deadline = time.monotonic() + timeout
        while len(got) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                cons, batch = self._inbox.get(timeout=left)
            except queue.Empty:
                break
            with self._lock:
                for d in batch:
                    self._owner[d.ack_id] = cons
            got.extend(batch)
        return got

    def ack(self, deliveries: Iterable) -> None:
        by: dict[int, tuple[Consumer, list[str]]] = {}
        with self._lock:
            for d in deliveries:
                ack_id = d if isinstance(d, str) else d.ack_id
                cons = self._owner.pop(ack_id, None)
                if cons is not None:
                    by.setdefault(id(cons), (cons, []))[1].append(ack_id)
        for cons, ids in by.values():
            cons.ack(ids)

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            consumers = [c for c in self._consumers.values() if c is not None]
        for c in consumers:
            c.close()

    def __enter__(self) -> ShardedConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AioShardedClient(_Sharded):
    """The asyncio twin of :class:`ShardedClient` (``qdelay.aio.Client`` per server)."""

    def client(self, address: str) -> AioClient:
        from qdelay.client.aio import Client as AioClient

        c = self._clients.get(address)
        if c is None:
            c = self._clients[address] = AioClient(address, retries=0, timeout=self.timeout, **self.client_kw)
        return c

    async def refresh(self) -> Topology:
        known = self.topology.addresses() if self.topology is not None else []
        last: Exception | None = None
        for address in dict.fromkeys([*known, *self.seeds]):
            c = self.client(address)
            try:
                resp = await c._call(c.stub.Topology, pb.TopologyRequest(), 2.0)
            except errors.QdelayError as e:
                last = e
                continue
            self.topology = Topology.merge(self.topology, resp)
            return self.topology
        if self.topology is None:
            raise errors.Unavailable(f"no server of {self.seeds} answered Topology: {last}")
        return self.topology

    async def _retry(self, shard_of, call):
        if self.topology is None:
            await self.refresh()
        backoff = self._backoff()
        while True:
            topo = self.topology or await self.refresh()
            shard = shard_of(topo)
            master = topo.master(shard)
            err: Exception | None = None
            if master:
                try:
                    return await call(self.client(master))
                except errors.QdelayError as e:
                    if self._give_up(e):
                        raise
                    err = e
            else:
                err = errors.Unavailable(f"shard {shard!r} has no master (electing)")
            if backoff.expired():
                raise err
            self.retries += 1
            await asyncio.sleep(backoff.next_wait())
            try:
                await self.refresh()
            except errors.QdelayError:
                pass

    async def close(self) -> None:
        self.closed = True
        clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            await c.close()

    async def __aenter__(self) -> AioShardedClient:
        await self.refresh()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def send(self, subject: str, payload: bytes = b"", *, message_id: str | None = None, **kw: Any) -> Receipt:
        mid = message_id or self._ids()
        return await self._retry(lambda t: t.shard_for(mid), lambda c: c.send(subject, payload, message_id=mid, **kw))

    async def cancel(self, target: Target, timeout: float | None = None) -> str:
        return await self._retry(lambda t: shard_of_target(target, t), lambda c: c.cancel(target, timeout))

    async def get(self, target: Target, timeout: float | None = None) -> Status:
        return await self._retry(lambda t: shard_of_target(target, t), lambda c: c.get(target, timeout))

    async def reschedule(self, target: Target, **kw: Any) -> tuple[str, Receipt | None]:
        return await self._retry(lambda t: shard_of_target(target, t), lambda c: c.reschedule(target, **kw))

    async def subscribe_all(self, subject: str, group: str = "default", max_in_flight: int = 1000) -> list:
        """One resubscribing consumer per server of every shard (only masters dispatch):
        read them concurrently (e.g. a task per consumer)."""
        topo = self.topology or await self.refresh()
        return [self.client(a).subscribe(subject, group, max_in_flight) for a in topo.addresses()]
