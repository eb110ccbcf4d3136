"""The blocking sharded and cluster clients ask every server at the same time where a call
needs all of them (stats, finding the master): a call waits for the slowest server once,
not for each in turn (bench.shards measured stats at 1 / 2 / 4 shards: the sequential
form's latency grew with every server). send_many routes a chunk per shard at a time."""

from __future__ import annotations

import threading

import pytest

from qdelay import errors
from qdelay.client import Outgoing, Receipt
from qdelay.client.cluster import ClusterClient
from qdelay.client.sharded import ShardedClient, Topology
from qdelay.v1 import qdelay_pb2 as pb


class BarrierServer:
    """A stand-in for one server's client whose ``stats`` returns only once every server
    of the call is being asked (a ``threading.Barrier``): asked one after another, the
    first waits until the barrier's timeout and the call fails."""

    def __init__(self, barrier: threading.Barrier, role: str = "slave", epoch: int = 0) -> None:
        self.barrier, self.role, self.epoch = barrier, role, epoch

    def stats(self, timeout=None, *, subject: str = "", group: str = "") -> dict:
        self.barrier.wait()
        return {"role": self.role, "epoch": self.epoch, "pending": 1, "wheel_size": 0, "iterate_lag_bytes": 0}

    def close(self) -> None:
        pass


def _sharded(shards: dict[str, pb.Shard], fakes: dict) -> ShardedClient:
    """A ShardedClient over ``shards`` whose per-address clients are ``fakes``."""

    class Fake(ShardedClient):
        def refresh(self) -> Topology:
            self.topology = Topology("c", shards)
            return self.topology

        def client(self, address: str):  # type: ignore[override]
            return fakes[address]

    return Fake("seed:1")


def test_sharded_stats_asks_every_server_at_once():
    shards = {f"s{i}": pb.Shard(name=f"s{i}", master=f"m{i}:1", slaves=[f"r{i}:1"], epoch=1) for i in range(3)}
    barrier = threading.Barrier(6, timeout=5)
    fakes = {a: BarrierServer(barrier) for s in shards.values() for a in [s.master, *s.slaves]}

    with _sharded(shards, fakes) as sc:
        st = sc.stats()
    assert not barrier.broken
    assert st["cluster"]["pending"] == 3 and st["cluster"]["shards"] == 3
    assert set(st["shards"]["s1"]["slaves"]) == {"r1:1"} and st["shards"]["s1"]["pending"] == 1


def test_cluster_client_stats_and_find_master_ask_every_server_at_once():
    targets = [f"127.0.0.1:{port}" for port in (1, 2, 3, 4)]
    with ClusterClient(targets) as cc:
        real = cc.clients
        try:
            barrier = threading.Barrier(4, timeout=5)
            cc.clients = [BarrierServer(barrier, "master" if i == 2 else "slave", epoch=7) for i in range(4)]
            st = cc.stats()
            assert not barrier.broken and list(st) == targets and st[targets[2]]["role"] == "master"
            assert cc.find_master() == 2 and cc.epoch == 7
            assert not barrier.broken
        finally:
            cc.clients = real


class RecordingShard:
    """A stand-in for one shard master's client: records the size of every send_many call."""

    def __init__(self, name: str) -> None:
        self.name, self.calls = name, []

    def send_many(self, messages, batch_size=1000, max_in_flight=4, timeout=None):
        self.calls.append(len(messages))
        return [Receipt(m.message_id, m.deliver_at_ms, i, self.name) for i, m in enumerate(messages)]

    def close(self) -> None:
        pass


def test_sharded_send_many_routes_a_chunk_per_shard(monkeypatch):
    """send_many routes SEND_MANY_CHUNK messages per shard at a time: with more shards each
    shard's stream still carries a chunk's worth per call (a fixed total split S ways gave
    each stream 1/S of it: fewer batches in flight, more streams opened per message)."""
    from qdelay.client import sharded

    monkeypatch.setattr(sharded, "SEND_MANY_CHUNK", 100)
    shards = {f"s{i}": pb.Shard(name=f"s{i}", master=f"m{i}:1", epoch=1) for i in range(4)}
    fakes = {s.master: RecordingShard(name) for name, s in shards.items()}

    msgs = [Outgoing("s", b"", deliver_at_ms=10**13 + i, message_id=f"id{i}") for i in range(800)]
    with _sharded(shards, fakes) as sc:
        receipts = sc.send_many(msgs, batch_size=10, max_in_flight=2)
    assert [r.message_id for r in receipts] == [m.message_id for m in msgs]
    assert all(r.shard == sc.topology.shard_for(r.message_id) for r in receipts)
    for fake in fakes.values():
        # two chunks of 400 (100 per shard): two calls of ~100 each, not eight of ~25
        assert len(fake.calls) == 2 and min(fake.calls) > 50, fake.calls


class FlakyShard(RecordingShard):
    """A shard master's stand-in whose first send_many acknowledges ``first`` messages and
    then fails over (UNAVAILABLE carrying those receipts, as ``Client.send_many`` raises)."""

    def __init__(self, name: str, first: int) -> None:
        super().__init__(name)
        self.first = first

    def send_many(self, messages, batch_size=1000, max_in_flight=4, timeout=None):
        got = super().send_many(messages, batch_size, max_in_flight, timeout)
        if len(self.calls) == 1:
            err = errors.Unavailable("UNAVAILABLE: the master went away")
            err.receipts = got[: self.first]
            raise err
        return got


def test_sharded_send_many_receipts_in_order_across_a_failover(monkeypatch):
    """The receipts are made when read (no Receipt object per message while sending) and
    are the caller's order whatever the shards answered, also for a shard whose stream failed
    over part-way (its receipts come from two calls: the acknowledged ones, then the rest sent
    again with the same ids); indexing, negative indices, slices and iteration agree."""
    from qdelay.client import sharded

    monkeypatch.setattr(sharded, "SEND_MANY_CHUNK", 100)  # 400 routed at a time: 3 chunks
    shards = {f"s{i}": pb.Shard(name=f"s{i}", master=f"m{i}:1", epoch=1) for i in range(4)}
    fakes = {s.master: RecordingShard(name) for name, s in shards.items()}
    fakes["m2:1"] = FlakyShard("s2", first=7)

    msgs = [Outgoing("s", b"", deliver_at_ms=10**13 + i, message_id=f"id{i}") for i in range(1000)]
    with _sharded(shards, fakes) as sc:
        sc.backoff = 0.001
        receipts = sc.send_many(msgs, batch_size=10, max_in_flight=2)
        topo = sc.topology
    assert not isinstance(receipts, list) and len(receipts) == 1000
    ids = [m.message_id for m in msgs]
    assert [r.message_id for r in receipts] == ids
    assert [receipts[i].message_id for i in range(1000)] == ids
    assert receipts[-1].message_id == "id999" and receipts[-1000].message_id == "id0"
    assert [r.message_id for r in receipts[10:20:3]] == ids[10:20:3]
    assert all(
        r.shard == topo.shard_for(r.message_id) and r.deliver_at_ms == 10**13 + i for i, r in enumerate(receipts)
    )
    flaky = fakes["m2:1"]
    # the failed call's 7 acknowledged messages were not sent again: the retry sent the rest
    assert flaky.calls[1] == flaky.calls[0] - 7 and sc.retries == 1
    for bad in (1000, -1001):
        with pytest.raises(IndexError):
            receipts[bad]


def test_sharded_send_many_one_shard_returns_its_receipts():
    """All messages of one shard (or a cluster of one shard): that shard's own receipts, no
    routing table kept."""
    shards = {"s0": pb.Shard(name="s0", master="m0:1", epoch=1)}
    fakes = {"m0:1": RecordingShard("s0")}
    msgs = [Outgoing("s", b"", deliver_at_ms=10**13 + i, message_id=f"id{i}") for i in range(50)]
    with _sharded(shards, fakes) as sc:
        receipts = sc.send_many(msgs)
    assert [r.message_id for r in receipts] == [m.message_id for m in msgs] and fakes["m0:1"].calls == [50]


def test_shard_of_target_is_the_same_for_every_form_of_a_receipt():
    """A Receipt is routed from its fields (no protobuf made per target: cancel_many routes
    every target); its string form, protobuf and dict go the same way: to the shard it names,
    or by its id when the cluster has no such shard (a receipt from a single server)."""
    from qdelay.client.sharded import shard_of_target

    topo = Topology("c", {f"s{i}": pb.Shard(name=f"s{i}", master=f"m{i}:1", epoch=1) for i in range(4)})
    for k in range(40):
        for shard in ("s2", "", "gone"):
            r = Receipt(f"id-{k}", 10**13 + k, k + 1, shard)
            forms = [r, str(r), r.to_pb(), {"message_id": r.message_id, "sequence": k + 1, "shard": shard}]
            want = shard if shard in topo.shards else topo.shard_for(r.message_id)
            assert [shard_of_target(t, topo) for t in forms] == [want] * 4
