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
subscribed to when the topology is read again. The merged consumer tags each delivery's
ack id with its stream (servers number their deliveries alike) and acks on that stream.

Both clients answer to the single-server client's method names (send, send_batch,
send_many, cancel, cancel_many, get, reschedule, reschedule_many, stats, create_group,
delete_group, groups, subscribe); the many-message ones group by shard, call the shards at
the same time and answer in the caller's order; the group ones go to every shard's master.
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import itertools
import queue
import threading
import time
import weakref
import zlib
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, cast

from qdelay import errors
from qdelay.addresses import check_target
from qdelay.client.client import Client, Consumer, Outgoing, _Ids, _set_due, close_consumers
from qdelay.client.failover import Backoff, acancel_tries, cancel_tries, consumers_everywhere, retryable
from qdelay.client.types import Delivery, LazyReceipts, Receipt, Status, Target, by_id, ref
from qdelay.v1 import qdelay_pb2 as pb

if TYPE_CHECKING:
    from qdelay.client.aio import Client as AioClient


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


def shard_of_target(target: Target | None, topology: Topology) -> str:
    """The shard a receipt (object, string form, protobuf, dict, tuple) names, else the id's
    shard; InvalidArgument for what names no message (as ``Client.cancel`` says)."""
    if type(target) is Receipt:  # the usual target: its fields, without the protobuf ref() makes
        shard, mid = target.shard, target.message_id
        return shard if shard in topology.shards else topology.shard_for(mid)
    r, mid = ref(target)
    if r is not None:
        return r.shard if r.shard in topology.shards else topology.shard_for(r.message_id)
    return topology.shard_for(mid)


def _named_shard(target: Target | None, message_id: str | None) -> Callable[[Topology], str]:
    """Where a cancel or get of ``target`` (or ``message_id=``) goes, for ``_retry``: by id
    alone the id's shard, the id taken as it is (never read as a receipt's text, checked
    now as the client checks it), else the shard the target names (:func:`shard_of_target`).
    The client that is called takes ``message_id=`` over the target, as this does."""
    if message_id is None:
        return lambda t: shard_of_target(target, t)
    by_id(message_id)
    return lambda t: t.shard_for(message_id)


def _by_shard(shards: Iterable[str]) -> dict[str, list[int]]:
    """Positions grouped by shard, in order within each."""
    out: dict[str, list[int]] = {}
    for i, shard in enumerate(shards):
        out.setdefault(shard, []).append(i)
    return out


def _with_id(m: pb.Message | Outgoing, new_id: Callable[[], str]) -> pb.Message | Outgoing:
    """``m`` with a message id (made here when it has none): the id picks the shard, and a
    retry must repeat it."""
    if isinstance(m, tuple):
        return m if m.message_id else m._replace(message_id=new_id())
    if not m.message_id:
        m.message_id = new_id()
    return m


def _id_of(m: pb.Message | Outgoing) -> str:
    return m.message_id


def _as_message(m: pb.Message | Outgoing) -> pb.Message:
    """A protobuf Message for SendBatch (an Outgoing tuple's fields as they are)."""
    if not isinstance(m, tuple):
        return m
    msg = pb.Message(subject=m.subject, payload=m.payload, headers=m.headers or {}, message_id=m.message_id)
    _set_due(msg, m)
    return msg


def resumed(msgs: list, into: Joined, send: Callable[[Any, list], Sequence[Receipt]]) -> Callable[[Any], None]:
    """One try of a ``send_many`` that failover retries (``_retry``): ``send(client, rest)``
    of what the tries before had not had acknowledged (same ids); what a try had
    acknowledged, a failed one's ``receipts`` too, joins ``into`` in order."""
    done = 0

    def call(c: Any) -> None:
        nonlocal done
        rs: Sequence[Receipt] = []
        try:
            rs = send(c, msgs[done:])
        except errors.QdelayError as err:
            rs = getattr(err, "receipts", None) or []
            raise
        finally:
            into.add(rs)
            done += len(rs)

    return call


def aresumed(msgs: list, into: Joined, send: Callable[[Any, list], Any]) -> Callable[[Any], Any]:
    """:func:`resumed`, awaited (``send`` a coroutine function)."""
    done = 0

    async def call(c: Any) -> None:
        nonlocal done
        rs: Sequence[Receipt] = []
        try:
            rs = await send(c, msgs[done:])
        except errors.QdelayError as err:
            rs = getattr(err, "receipts", None) or []
            raise
        finally:
            into.add(rs)
            done += len(rs)

    return call


class Joined(LazyReceipts):
    """Sequences one after another as one (send_many's receipts of a shard that failed over
    part-way, or of several chunks), without copying them: an index finds its part by
    bisection."""

    def __init__(self, parts: Sequence[Sequence[Receipt]] = ()) -> None:
        self._parts: list[Sequence[Receipt]] = []
        self._ends: list[int] = []
        for part in parts:
            self.add(part)

    def add(self, part: Sequence[Receipt]) -> None:
        if len(part):
            self._parts.append(part)
            self._ends.append(len(self) + len(part))

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def _at(self, index: int) -> Receipt:
        k = bisect.bisect_right(self._ends, index)
        return self._parts[k][index - (self._ends[k] - len(self._parts[k]))]

    def __iter__(self) -> Iterator[Receipt]:
        for part in self._parts:
            yield from part

    def __repr__(self) -> str:
        return f"<receipts of {len(self)} messages>"


class Spread(LazyReceipts):
    """send_many's receipts over the shards in the caller's order, each made when it is read
    (as the single-server client's ``SentReceipts``): a ``Receipt`` object per message, put
    in place as the shards answered, cost the producer more CPU than sending the message
    (bench.shards). ``route[i]`` is the shard (its number) of the caller's message ``i``,
    ``positions[s]`` the caller's positions sent to shard ``s`` (ascending) and
    ``parts[s]`` their receipts in that order."""

    def __init__(self, route: Sequence[int], positions: list[list[int]], parts: list[Sequence[Receipt]]) -> None:
        self._route = route
        self._positions = positions
        self._parts = parts

    def __len__(self) -> int:
        return len(self._route)

    def _at(self, index: int) -> Receipt:
        s = self._route[index]
        return self._parts[s][bisect.bisect_left(self._positions[s], index)]

    def __iter__(self) -> Iterator[Receipt]:
        parts = [iter(p) for p in self._parts]
        for s in self._route:
            yield next(parts[s])

    def __repr__(self) -> str:
        return f"<receipts of {len(self)} messages over {len(self._parts)} shards>"


def route(topology: Topology, ids: Iterable[str]) -> tuple[Sequence[int], list[list[int]]]:
    """Each id's shard (its number in ``topology.names``) and the positions per shard, in
    one pass (``Topology.shard_for`` per message, inlined: this runs once per message)."""
    n = len(topology.names)
    if not n:
        raise errors.Unavailable("the cluster has no shard yet")
    crc = zlib.crc32
    shards = [crc(i.encode()) % n for i in ids]
    positions: list[list[int]] = [[] for _ in range(n)]
    for i, s in enumerate(shards):
        positions[s].append(i)
    return (bytes(shards) if n <= 256 else shards), positions


def _per_name(topology: Topology, positions: list[list[int]]) -> dict[str, list[int]]:
    """The positions per shard name, shards that got none left out."""
    return {topology.names[s]: idx for s, idx in enumerate(positions) if idx}


def _placed(
    topology: Topology, where: Sequence[int], positions: list[list[int]], parts: dict[str, Joined]
) -> Sequence[Receipt]:
    """A chunk's receipts in the caller's order: the one shard's own when all went to one."""
    used = [name for name, idx in zip(topology.names, positions) if idx]
    if len(used) == 1:
        return parts[used[0]]
    return Spread(where, positions, [parts[name] for name in topology.names])


def _acknowledged(
    before: Sequence[Receipt], count: int, per_name: dict[str, list[int]], parts: Mapping[str, Sequence[Receipt]]
) -> list[Receipt | None]:
    """A failed send's ``.receipts``: those of the chunks sent before (``before``), then the
    failed chunk's ``count`` messages in the caller's order, each its receipt where its
    shard acknowledged it (a prefix of that shard's positions, ``per_name``), else None."""
    mine: list[Receipt | None] = [None] * count
    for name, idx in per_name.items():
        for i, r in zip(idx, parts[name]):
            mine[i] = r
    return [*before, *mine]


def _chunks(messages: Iterable, size: int) -> Iterator[list]:
    source = iter(messages)
    while chunk := list(itertools.islice(source, size)):
        yield chunk


# send_many routes this many messages per shard at a time (its memory bound: a generator of
# any length is read chunk by chunk, each chunk's shards sent at the same time). Per shard:
# a chunk of a fixed total gave each shard's stream 1/S of it, so with more shards each
# stream carried fewer batches (at 4 shards, 2,500 messages: 3 batches, never the 4 in
# flight) and more streams were opened and drained per message (bench.shards).
SEND_MANY_CHUNK = 10_000


def _chunk_size(batch_size: int, max_in_flight: int, topology: Topology) -> int:
    """How many messages send_many routes at a time: ``SEND_MANY_CHUNK`` (or a pipeline's
    worth) for every shard."""
    return max(SEND_MANY_CHUNK, batch_size * max_in_flight) * max(1, len(topology.names))


_CLUSTER_SUMS = ("pending", "wheel_size", "iterate_lag_bytes")


def _stats_of(topo: Topology, answers: dict[str, dict | Exception]) -> dict:
    """The sharded stats from each server's answer (or its error), by address."""
    shards = {
        name: _stats_entry(
            s := topo.shards[name],
            answers.get(s.master) if s.master else None,
            {a: answers[a] for a in s.slaves},
        )
        for name in topo.names
    }
    return {"cluster": _stats_total(shards), "shards": shards}


def _stats_entry(s: pb.Shard, master: dict | Exception | None, slaves: dict[str, dict | Exception]) -> dict:
    entry: dict = {"master": s.master, "epoch": s.epoch, "slaves": {}}
    if isinstance(master, dict):
        entry.update(master)
    elif master is not None:
        entry["error"] = str(master)
    entry["slaves"] = {a: (st if isinstance(st, dict) else str(st)) for a, st in slaves.items()}
    return entry


def _stats_total(shards: dict[str, dict]) -> dict:
    total = {key: 0 for key in _CLUSTER_SUMS} | {"shards": len(shards), "shards_without_master": 0}
    for entry in shards.values():
        if not entry["master"]:
            total["shards_without_master"] += 1
        elif "error" not in entry:
            for key in _CLUSTER_SUMS:
                total[key] += int(entry.get(key, 0))
    return total


def _seeds(seeds: Sequence[str] | str) -> list[str]:
    if isinstance(seeds, str):
        seeds = [t.strip() for t in seeds.split(",") if t.strip()]
    if not seeds:
        raise errors.InvalidArgument("a sharded client needs at least one seed address")
    # each at once: the asyncio client makes its servers' clients only at its first call
    return [check_target(seed, "a seed address") for seed in seeds]


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
        self._consumers: weakref.WeakSet = weakref.WeakSet()  # merged consumers, ended by close()
        self._ids = _Ids()
        self.topology: Topology | None = None
        self.retries = 0  # writes repeated (same ids) after a refusal or a failure

    def _backoff(self) -> Backoff:
        return Backoff(self.failover_timeout, self.backoff, self.max_backoff)

    def _give_up(self, err: Exception) -> bool:
        """Whether a failed try ends the call: not retryable, or the client is closed."""
        return self.closed or not retryable(err)

    def _open(self) -> None:
        """FailedPrecondition once closed, as the single-server clients: a server's client
        made again after close() would be a channel nobody closes (a merged consumer's
        reader asked for one, and went on consuming from a closed client)."""
        if self.closed:
            raise errors.FailedPrecondition("the client is closed")

    def _closing(self) -> list:
        """close()'s first step: refuse from now on; the merged consumers to end and the
        servers' clients to close."""
        self.closed = True
        consumers, self._consumers = list(self._consumers), weakref.WeakSet()
        return consumers


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
            self._open()
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
        """Ends the merged consumers, then closes every server's client."""
        with self._lock:
            consumers = self._closing()
        ShardedConsumer.close_all(consumers)
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
        """Many messages, grouped by shard (one SendBatch per shard, the shards' at the same
        time); receipts in input order. A message without an id gets one before the first
        try (a ``Message`` in place; an ``Outgoing`` tuple is copied). An error raised once
        every shard answered carries ``.receipts`` as :meth:`send_many`'s does."""
        msgs = [_as_message(_with_id(m, self._ids)) for m in messages]
        topo = self.topology or self.refresh()
        out: list[Receipt | None] = [None] * len(msgs)

        def send(shard: str, idx: list[int]) -> None:
            request = pb.SendBatchRequest(messages=[msgs[i] for i in idx])
            rs = self._retry(lambda _t: shard, lambda c: c._call(c.stub.SendBatch, request, timeout).receipts)
            for i, r in zip(idx, rs):
                out[i] = Receipt.from_pb(r)

        try:
            self._each_shard(send, _by_shard(topo.shard_for(m.message_id) for m in msgs))
        except errors.QdelayError as err:
            err.receipts = list(out)  # the shards that acknowledged theirs: see send_many
            raise
        return cast("list[Receipt]", out)  # every index was filled above

    def send_many(
        self,
        messages: Iterable[pb.Message | Outgoing],
        batch_size: int = 1000,
        max_in_flight: int = 4,
        timeout: float | None = None,
    ) -> Sequence[Receipt]:
        """As ``Client.send_many`` (pipelined SendStream batches; ``Outgoing`` tuples are the
        cheap form), over the shards: each message goes to its id's shard, the shards'
        streams at the same time, ``SEND_MANY_CHUNK`` messages per shard routed at a time;
        receipts in input order, each made when it is read (as ``SentReceipts``). A shard's
        stream that fails over is retried on its new master with the messages it had not
        acknowledged (same ids). Raises the first error that is not retried, or the last one
        after ``failover_timeout``, once every shard of that chunk answered, with
        ``.receipts``: one entry per message read so far, in the caller's order, its receipt
        where its shard acknowledged it, else None (sent again with the same id, an
        acknowledged message is deduplicated; docs/api.md)."""
        if batch_size < 1 or max_in_flight < 1:
            raise errors.InvalidArgument("batch_size and max_in_flight must be at least 1")
        out = Joined()
        size = _chunk_size(batch_size, max_in_flight, self.topology or self.refresh())
        for chunk in _chunks(messages, size):
            msgs = [_with_id(m, self._ids) for m in chunk]
            topo = self.topology or self.refresh()
            where, positions = route(topo, [_id_of(m) for m in msgs])
            parts = {name: Joined() for name in topo.names}

            def send(shard: str, idx: list[int], msgs: list = msgs, parts: dict = parts) -> None:
                mine = [msgs[i] for i in idx]
                call = resumed(
                    mine, parts[shard], lambda c, rest: c.send_many(rest, batch_size, max_in_flight, timeout)
                )
                self._retry(lambda _t: shard, call)

            per_name = _per_name(topo, positions)
            try:
                self._each_shard(send, per_name)
            except errors.QdelayError as err:
                err.receipts = _acknowledged(out, len(msgs), per_name, parts)
                raise
            out.add(_placed(topo, where, positions, parts))
        return out

    def _each_shard(self, fn: Callable[[str, list[int]], None], by_shard: dict[str, list[int]]) -> None:
        """``fn(shard, positions)`` for each shard, at the same time when there are several;
        the first error is raised once all are done."""
        groups = list(by_shard.items())
        if len(groups) == 1:
            fn(*groups[0])
            return
        futures = [self._pool().submit(fn, shard, idx) for shard, idx in groups]
        concurrent.futures.wait(futures)
        for f in futures:
            f.result()

    def _pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=16, thread_name_prefix="qdelay-shards")
            return self._executor

    def cancel(
        self, target: Target | None = None, timeout: float | None = None, *, message_id: str | None = None
    ) -> str:
        """As ``Client.cancel``, on the master of the receipt's shard (by id alone: the id's);
        tried again after a failure whose outcome is unknown, ALREADY_CANCELLED is answered
        CANCELLED (``failover.cancel_tries``)."""
        return self._retry(
            _named_shard(target, message_id), cancel_tries(lambda c: c.cancel(target, timeout, message_id=message_id))
        )

    def cancel_many(self, targets: Iterable[Target], timeout: float | None = None, batch_size: int = 1000) -> list[str]:
        """As ``Client.cancel_many``: the targets grouped by shard (CancelBatch calls of up to
        ``batch_size`` on each shard's master, the shards at the same time); one outcome per
        target, in the caller's order. A shard whose call fails over is asked again; after a
        try whose outcome is unknown, ALREADY_CANCELLED (maybe that try's work) is answered
        CANCELLED (``failover.cancel_tries``)."""
        items = list(targets)
        topo = self.topology or self.refresh()
        out: list[str] = [""] * len(items)

        def cancel(shard: str, idx: list[int]) -> None:
            got = self._retry(
                lambda _t: shard, cancel_tries(lambda c: c.cancel_many([items[i] for i in idx], timeout, batch_size))
            )
            for i, outcome in zip(idx, got):
                out[i] = outcome

        self._each_shard(cancel, _by_shard(shard_of_target(t, topo) for t in items))
        return out

    def get(
        self, target: Target | None = None, timeout: float | None = None, *, message_id: str | None = None
    ) -> Status:
        """As ``Client.get``, on the master of the receipt's shard (by id alone: the id's)."""
        return self._retry(_named_shard(target, message_id), lambda c: c.get(target, timeout, message_id=message_id))

    def reschedule(
        self, target: Target | None = None, *, message_id: str | None = None, **kw: Any
    ) -> tuple[str, Receipt | None]:
        """As ``Client.reschedule``, on the master of the receipt's shard (by id alone: the id's)."""
        return self._retry(
            _named_shard(target, message_id), lambda c: c.reschedule(target, message_id=message_id, **kw)
        )

    def reschedule_many(
        self, targets: Iterable[Target], *, batch_size: int = 1000, **kw: Any
    ) -> list[tuple[str, Receipt | None]]:
        """As ``Client.reschedule_many`` (one new time for all: ``delay=``, ``deliver_at=``,
        ...): the targets grouped by shard as :meth:`cancel_many` groups them
        (RescheduleBatch calls on each shard's master, the shards at the same time); one
        answer per target, in the caller's order. A shard whose call fails over is asked
        again (a target its lost try moved then answers CANCELLED by receipt, or is moved
        again by id, as after the single-server client's retries)."""
        items = list(targets)
        topo = self.topology or self.refresh()
        out: list[tuple[str, Receipt | None]] = [("", None)] * len(items)

        def move(shard: str, idx: list[int]) -> None:
            got = self._retry(
                lambda _t: shard, lambda c: c.reschedule_many([items[i] for i in idx], batch_size=batch_size, **kw)
            )
            for i, answer in zip(idx, got):
                out[i] = answer

        self._each_shard(move, _by_shard(shard_of_target(t, topo) for t in items))
        return out

    def create_group(self, subject: str, group: str, timeout: float | None = None) -> bool:
        """As ``Client.create_group``, on every shard's master (each shard dispatches its own
        messages, so the group must exist on all), the shards at the same time: True when
        any shard had no such group."""
        return any(
            changed for _shard, changed in self._on_every_shard(lambda c: c.create_group(subject, group, timeout))
        )

    def delete_group(self, subject: str, group: str, timeout: float | None = None) -> bool:
        """As ``Client.delete_group``, on every shard's master: True when any shard had it."""
        return any(
            changed for _shard, changed in self._on_every_shard(lambda c: c.delete_group(subject, group, timeout))
        )

    def groups(self, timeout: float | None = None, *, subject: str = "", group: str = "") -> list[dict]:
        """As ``Client.groups``, from every shard's master: each entry also names its
        ``shard`` (a group has its own backlog and consumers on each shard)."""
        per_shard = self._on_every_shard(lambda c: c.groups(timeout, subject=subject, group=group))
        return [{**g, "shard": name} for name, gs in per_shard for g in gs]

    def _on_every_shard(self, call: Callable[[Client], Any]) -> list:
        """``call(master)`` for every shard (failover retried per shard), the shards at the
        same time; (shard, answer) in ``topology.names`` order."""
        topo = self.topology or self.refresh()
        out: dict[str, Any] = {}

        def one(shard: str, _idx: list[int]) -> None:
            out[shard] = self._retry(lambda _t: shard, call)

        self._each_shard(one, {name: [] for name in topo.names})
        return [(name, out[name]) for name in topo.names]

    def stats(self, timeout: float | None = 2.0, *, subject: str = "", group: str = "") -> dict:
        """Stats per shard (``shards``: its master's figures and groups, narrowed by
        ``subject``/``group`` as ``Client.stats`` narrows them, with ``master``, ``epoch`` and
        each slave's stats or error under ``slaves``) and for the whole cluster (``cluster``:
        pending, wheel_size and iterate_lag_bytes summed over the masters; shards without a
        master counted). Every server is asked at the same time (as the asyncio client
        does): a call takes about one server's answer, not the sum of them."""
        topo = self.refresh()

        def one(address: str) -> dict | Exception:
            try:
                return self.client(address).stats(timeout, subject=subject, group=group)
            except errors.QdelayError as e:
                return e

        addresses = topo.addresses()
        if len(addresses) == 1:
            answers = {addresses[0]: one(addresses[0])}
        else:
            answers = dict(zip(addresses, self._pool().map(one, addresses)))
        return _stats_of(topo, answers)

    def subscribe(self, subject: str, group: str = "default", max_in_flight: int = 1000) -> ShardedConsumer:
        """Deliveries of ``subject``/``group`` from every shard as one consumer (see
        :class:`ShardedConsumer`); ended by :meth:`close` if not closed before."""
        self._open()
        consumer = ShardedConsumer(self, subject, group, max_in_flight)
        self._consumers.add(consumer)
        return consumer

    def subscribe_all(self, subject: str, group: str = "default", max_in_flight: int = 1000) -> list[Consumer]:
        """One resubscribing consumer per server of every shard (only masters dispatch), as
        :meth:`AioShardedClient.subscribe_all`: read them concurrently (a thread each). The
        group is made on every shard's master first, and a slave's consumer waits out the
        slave's refusal until the group reached it (``failover.consumers_everywhere``)."""
        self.create_group(subject, group)
        topo = self.topology or self.refresh()
        return consumers_everywhere((self.client(a) for a in topo.addresses()), subject, group, max_in_flight)


class _AckRouter:
    """The acks of a merged consumer. Every server numbers its own deliveries, so two shards
    hand out the same ack ids: each delivery's ``ack_id`` is given its stream's tag
    (``'<tag>|<server's ack id>'``, opaque to the user as before) and an ack goes back to
    the stream of that tag with the server's id. An ack for a stream that has ended is
    dropped: that stream's unacknowledged deliveries come again anyway."""

    def __init__(self) -> None:
        self._streams: dict[str, Any] = {}
        self._tags = itertools.count(1)
        self._lock = threading.Lock()

    def register(self, consumer: Any) -> str:
        tag = str(next(self._tags))
        with self._lock:
            self._streams[tag] = consumer
        return tag

    def forget(self, tag: str) -> None:
        with self._lock:
            self._streams.pop(tag, None)

    @staticmethod
    def tag(tag: str, batch: list[Delivery]) -> list[Delivery]:
        for d in batch:
            d.ack_id = f"{tag}|{d.ack_id}"
        return batch

    def ack(self, deliveries: Iterable) -> None:
        by: dict[str, list[str]] = {}
        for d in deliveries:
            ack_id = d if isinstance(d, str) else d.ack_id
            tag, sep, server_id = ack_id.partition("|")
            if not sep:
                raise errors.InvalidArgument(f"not an ack id of this sharded consumer: {ack_id!r}")
            by.setdefault(tag, []).append(server_id)
        for tag, ids in by.items():
            with self._lock:
                consumer = self._streams.get(tag)
            if consumer is not None:
                consumer.ack(ids)


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
        self._acks = _AckRouter()
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
            try:
                cons = self.sc.client(address).subscribe(self.subject, self.group, self.max_in_flight)
            except errors.FailedPrecondition:  # the sharded client was closed
                return
            with self._lock:
                self._consumers[address] = cons
            tag = self._acks.register(cons)
            try:
                while not self._closed.is_set():
                    # each response passed on as it comes (asked for a credit's worth, the
                    # pump held what came for up to 0.2 s: lateness p50 ~100 ms, p99 ~200)
                    batch = cons.receive(1, 0.2)
                    if batch:
                        self._inbox.put(self._acks.tag(tag, batch))
                    elif not getattr(cons, "_pump", None) or not cons._pump.is_alive():
                        break  # its stream ended for good
            except errors.QdelayError:
                pass
            cons.close(timeout=0.5)
            self._acks.forget(tag)
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
                batch = self._inbox.get(timeout=left)
            except queue.Empty:
                break
            if batch is None:  # closed
                self._inbox.put(None)
                break
            got.extend(batch)
        return got

    def ack(self, deliveries: Iterable) -> None:
        """Acknowledge deliveries (Delivery objects or their ack ids), each on the stream it
        came from."""
        self._acks.ack(deliveries)

    def close(self) -> None:
        """Close every stream (queued acks are sent first); receive() returns at once after."""
        ShardedConsumer.close_all([self])

    @staticmethod
    def close_all(merged: Iterable[ShardedConsumer]) -> None:
        """Close merged consumers together: every server stream of all of them half-closed
        first, then one timeout for all (ShardedClient.close() with 3 of them against a
        server that does not answer took 3 x 5 s, one after another)."""
        merged = list(merged)
        streams: list = []
        for m in merged:
            m._closed.set()
            with m._lock:
                streams += [c for c in m._consumers.values() if c is not None]
        close_consumers(streams)
        for m in merged:
            m._inbox.put(None)

    def __enter__(self) -> ShardedConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AioShardedClient(_Sharded):
    """The asyncio twin of :class:`ShardedClient` (``qdelay.aio.Client`` per server)."""

    def client(self, address: str) -> AioClient:
        from qdelay.client.aio import Client as AioClient

        self._open()
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
        """Ends the merged consumers, then closes every server's client."""
        # together: one after another, a server that does not answer cost each its timeout
        ended = await asyncio.gather(*(consumer.close() for consumer in self._closing()), return_exceptions=True)
        clients, self._clients = list(self._clients.values()), {}
        ended += await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
        for e in ended:  # every one closed first, then the first error
            if isinstance(e, BaseException):
                raise e

    async def __aenter__(self) -> AioShardedClient:
        await self.refresh()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def send(self, subject: str, payload: bytes = b"", *, message_id: str | None = None, **kw: Any) -> Receipt:
        """As :meth:`ShardedClient.send`."""
        mid = message_id or self._ids()
        return await self._retry(lambda t: t.shard_for(mid), lambda c: c.send(subject, payload, message_id=mid, **kw))

    async def _each_shard(self, fn: Callable[[str, list[int]], Any], by_shard: dict[str, list[int]]) -> None:
        """``await fn(shard, positions)`` for every shard at the same time; the first error is
        raised once all are done."""
        results = await asyncio.gather(*(fn(shard, idx) for shard, idx in by_shard.items()), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r

    async def send_batch(
        self, messages: Iterable[pb.Message | Outgoing], timeout: float | None = None
    ) -> list[Receipt]:
        """As :meth:`ShardedClient.send_batch`: one SendBatch per shard, at the same time."""
        msgs = [_as_message(_with_id(m, self._ids)) for m in messages]
        topo = self.topology or await self.refresh()
        out: list[Receipt | None] = [None] * len(msgs)

        async def send(shard: str, idx: list[int]) -> None:
            request = pb.SendBatchRequest(messages=[msgs[i] for i in idx])

            async def call(c: AioClient) -> Any:
                return (await c._call(c.stub.SendBatch, request, timeout)).receipts

            for i, r in zip(idx, await self._retry(lambda _t: shard, call)):
                out[i] = Receipt.from_pb(r)

        try:
            await self._each_shard(send, _by_shard(topo.shard_for(m.message_id) for m in msgs))
        except errors.QdelayError as err:
            err.receipts = list(out)  # as ShardedClient.send_batch
            raise
        return cast("list[Receipt]", out)

    async def send_many(
        self,
        messages: Iterable[pb.Message | Outgoing],
        batch_size: int = 1000,
        max_in_flight: int = 4,
        timeout: float | None = None,
    ) -> Sequence[Receipt]:
        """As :meth:`ShardedClient.send_many`, awaited."""
        if batch_size < 1 or max_in_flight < 1:
            raise errors.InvalidArgument("batch_size and max_in_flight must be at least 1")
        out = Joined()
        size = _chunk_size(batch_size, max_in_flight, self.topology or await self.refresh())
        for chunk in _chunks(messages, size):
            msgs = [_with_id(m, self._ids) for m in chunk]
            topo = self.topology or await self.refresh()
            where, positions = route(topo, [_id_of(m) for m in msgs])
            parts = {name: Joined() for name in topo.names}

            async def send(shard: str, idx: list[int], msgs: list = msgs, parts: dict = parts) -> None:
                mine = [msgs[i] for i in idx]
                call = aresumed(
                    mine, parts[shard], lambda c, rest: c.send_many(rest, batch_size, max_in_flight, timeout)
                )
                await self._retry(lambda _t: shard, call)

            per_name = _per_name(topo, positions)
            try:
                await self._each_shard(send, per_name)
            except errors.QdelayError as err:
                err.receipts = _acknowledged(out, len(msgs), per_name, parts)
                raise
            out.add(_placed(topo, where, positions, parts))
        return out

    async def cancel(
        self, target: Target | None = None, timeout: float | None = None, *, message_id: str | None = None
    ) -> str:
        """As :meth:`ShardedClient.cancel`."""
        return await self._retry(
            _named_shard(target, message_id), acancel_tries(lambda c: c.cancel(target, timeout, message_id=message_id))
        )

    async def cancel_many(
        self, targets: Iterable[Target], timeout: float | None = None, batch_size: int = 1000
    ) -> list[str]:
        """As :meth:`ShardedClient.cancel_many`: grouped per shard, outcomes in the caller's order."""
        items = list(targets)
        topo = self.topology or await self.refresh()
        out: list[str] = [""] * len(items)

        async def cancel(shard: str, idx: list[int]) -> None:
            got = await self._retry(
                lambda _t: shard, acancel_tries(lambda c: c.cancel_many([items[i] for i in idx], timeout, batch_size))
            )
            for i, outcome in zip(idx, got):
                out[i] = outcome

        await self._each_shard(cancel, _by_shard(shard_of_target(t, topo) for t in items))
        return out

    async def get(
        self, target: Target | None = None, timeout: float | None = None, *, message_id: str | None = None
    ) -> Status:
        """As :meth:`ShardedClient.get`."""
        return await self._retry(
            _named_shard(target, message_id), lambda c: c.get(target, timeout, message_id=message_id)
        )

    async def reschedule(
        self, target: Target | None = None, *, message_id: str | None = None, **kw: Any
    ) -> tuple[str, Receipt | None]:
        """As :meth:`ShardedClient.reschedule`."""
        return await self._retry(
            _named_shard(target, message_id), lambda c: c.reschedule(target, message_id=message_id, **kw)
        )

    async def reschedule_many(
        self, targets: Iterable[Target], *, batch_size: int = 1000, **kw: Any
    ) -> list[tuple[str, Receipt | None]]:
        """As :meth:`ShardedClient.reschedule_many`: grouped per shard, answers in the caller's order."""
        items = list(targets)
        topo = self.topology or await self.refresh()
        out: list[tuple[str, Receipt | None]] = [("", None)] * len(items)

        async def move(shard: str, idx: list[int]) -> None:
            got = await self._retry(
                lambda _t: shard, lambda c: c.reschedule_many([items[i] for i in idx], batch_size=batch_size, **kw)
            )
            for i, answer in zip(idx, got):
                out[i] = answer

        await self._each_shard(move, _by_shard(shard_of_target(t, topo) for t in items))
        return out

    async def create_group(self, subject: str, group: str, timeout: float | None = None) -> bool:
        """As :meth:`ShardedClient.create_group`: on every shard's master."""
        return any(
            changed for _shard, changed in await self._on_every_shard(lambda c: c.create_group(subject, group, timeout))
        )

    async def delete_group(self, subject: str, group: str, timeout: float | None = None) -> bool:
        """As :meth:`ShardedClient.delete_group`: on every shard's master."""
        return any(
            changed for _shard, changed in await self._on_every_shard(lambda c: c.delete_group(subject, group, timeout))
        )

    async def groups(self, timeout: float | None = None, *, subject: str = "", group: str = "") -> list[dict]:
        """As :meth:`ShardedClient.groups`: every shard master's groups, each naming its ``shard``."""
        per_shard = await self._on_every_shard(lambda c: c.groups(timeout, subject=subject, group=group))
        return [{**g, "shard": name} for name, gs in per_shard for g in gs]

    async def _on_every_shard(self, call: Callable[[AioClient], Any]) -> list:
        """As :meth:`ShardedClient._on_every_shard`, awaited."""
        topo = self.topology or await self.refresh()
        out: dict[str, Any] = {}

        async def one(shard: str, _idx: list[int]) -> None:
            out[shard] = await self._retry(lambda _t: shard, call)

        await self._each_shard(one, {name: [] for name in topo.names})
        return [(name, out[name]) for name in topo.names]

    async def stats(self, timeout: float | None = 2.0, *, subject: str = "", group: str = "") -> dict:
        """As :meth:`ShardedClient.stats` (every server asked at the same time)."""
        topo = await self.refresh()

        async def one(address: str) -> dict | Exception:
            try:
                return await self.client(address).stats(timeout, subject=subject, group=group)
            except errors.QdelayError as e:
                return e

        addresses = topo.addresses()
        answers = dict(zip(addresses, await asyncio.gather(*(one(a) for a in addresses))))
        return _stats_of(topo, answers)

    def subscribe(self, subject: str, group: str = "default", max_in_flight: int = 1000) -> AioShardedConsumer:
        """Deliveries of ``subject``/``group`` from every shard as one consumer (see
        :class:`AioShardedConsumer`); the streams open on first read or ``async with``;
        ended by :meth:`close` if not closed before."""
        self._open()
        consumer = AioShardedConsumer(self, subject, group, max_in_flight)
        self._consumers.add(consumer)
        return consumer

    async def subscribe_all(self, subject: str, group: str = "default", max_in_flight: int = 1000) -> list:
        """One resubscribing consumer per server of every shard (only masters dispatch):
        read them concurrently (e.g. a task per consumer). The group is made on every
        shard's master first, and a slave's consumer waits out the slave's refusal, as
        :meth:`ShardedClient.subscribe_all`."""
        await self.create_group(subject, group)
        topo = self.topology or await self.refresh()
        return consumers_everywhere((self.client(a) for a in topo.addresses()), subject, group, max_in_flight)


class AioShardedConsumer:
    """The asyncio twin of :class:`ShardedConsumer`: one resubscribing ``qdelay.aio``
    Consumer per server of every shard (only masters dispatch), read by a task each and
    fanned into one inbox; an async iterator of deliveries (or of batches with
    :meth:`batches`), ``receive``, and ``ack`` that sends each ack to the stream its delivery
    came from. Servers that join are subscribed to when the topology is read again (every
    ``REFRESH_S``); a server that refuses the subscription (a slave before the group exists
    there) is tried again every ``RETRY_S``. Use it from one event loop."""

    REFRESH_S = 2.0
    RETRY_S = 1.0

    def __init__(self, sc: AioShardedClient, subject: str, group: str, max_in_flight: int) -> None:
        self.sc = sc
        self.subject, self.group, self.max_in_flight = subject, group, max_in_flight
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._pumps: dict[str, asyncio.Task] = {}
        self._consumers: dict[str, Any] = {}  # address -> its current aio Consumer
        self._acks = _AckRouter()
        self._watch: asyncio.Task | None = None
        self._closed = False

    async def _start(self) -> None:
        if self._watch is None and not self._closed:
            topo = self.sc.topology or await self.sc.refresh()
            self._add(topo.addresses())
            self._watch = asyncio.get_running_loop().create_task(self._watch_topology(), name="qdelay-sharded-watch")

    def _add(self, addresses: list[str]) -> None:
        loop = asyncio.get_running_loop()
        for address in addresses:
            if address not in self._pumps and not self._closed:
                self._pumps[address] = loop.create_task(self._pump(address), name=f"qdelay-sharded-{address}")

    async def _pump(self, address: str) -> None:
        """Keep a subscription on ``address`` (its Consumer resubscribes by itself when the
        server goes away; a refusal ends it, and it is made again after ``RETRY_S``)."""
        while not self._closed:
            try:
                cons = self.sc.client(address).subscribe(self.subject, self.group, self.max_in_flight)
            except errors.FailedPrecondition:  # the sharded client was closed
                return
            self._consumers[address] = cons
            tag = self._acks.register(cons)
            try:
                async for batch in cons.batches():
                    self._inbox.put_nowait(self._acks.tag(tag, batch))
            except errors.QdelayError:
                pass
            await cons.close(timeout=0.5)
            self._acks.forget(tag)
            if not self._closed:
                await asyncio.sleep(self.RETRY_S)

    async def _watch_topology(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.REFRESH_S)
            try:
                self._add((await self.sc.refresh()).addresses())
            except errors.QdelayError:
                pass

    async def _next(self, timeout: float | None) -> list[Delivery] | None:
        await self._start()
        try:
            async with asyncio.timeout(timeout):
                item = await self._inbox.get()
        except TimeoutError:
            return None
        if item is None:  # closed
            self._inbox.put_nowait(None)
        return item

    async def receive(self, count: int, timeout: float) -> list[Delivery]:
        """Deliveries from any shard until ``count`` arrived or ``timeout`` seconds passed
        (whole batches, so possibly more than ``count``)."""
        got: list[Delivery] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while len(got) < count:
            left = deadline - loop.time()
            if left <= 0:
                break
            batch = await self._next(left)
            if batch is None:
                break
            got.extend(batch)
        return got

    async def batches(self) -> AsyncIterator[list[Delivery]]:
        """Each batch of deliveries as it comes from any shard, until :meth:`close`."""
        while True:
            batch = await self._next(None)
            if batch is None:
                return
            yield batch

    async def __aiter__(self) -> AsyncIterator[Delivery]:
        async for batch in self.batches():
            for d in batch:
                yield d

    def ack(self, deliveries: Iterable) -> None:
        """Acknowledge deliveries (Delivery objects or their ack ids), each on the stream it
        came from."""
        self._acks.ack(deliveries)

    async def close(self) -> None:
        """Close every stream (queued acks are sent first) and end the iterators."""
        if self._closed:
            return
        self._closed = True
        if self._watch is not None:
            self._watch.cancel()
        await asyncio.gather(*(c.close() for c in self._consumers.values()), return_exceptions=True)
        for task in self._pumps.values():
            task.cancel()
        await asyncio.gather(*self._pumps.values(), *([self._watch] if self._watch else []), return_exceptions=True)
        self._inbox.put_nowait(None)

    async def __aenter__(self) -> AioShardedConsumer:
        await self._start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
