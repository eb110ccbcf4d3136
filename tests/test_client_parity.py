"""The five Python clients share one surface: the single-server clients (blocking and
asyncio), the sharded ones (blocking and asyncio) and ClusterClient answer to the same
method names for what they all can do, routed as their siblings route (by receipt or id:
the shard that owns it; in a replicated pair: the master; groups: every shard's master)."""

from __future__ import annotations

import asyncio
import time

import pytest
from conftest import wait_until
from test_cluster_etcd import etcd, node, wait_shard  # noqa: F401 - etcd is the fixture
from test_replication import RPC_ERRORS, master, slave, status

from qdelay import errors
from qdelay.aio import Client as AioClient
from qdelay.client import AioShardedClient, Client, ClusterClient, Outgoing, Receipt, ShardedClient

# what every client of a server or a cluster does (by name); the consumers differ in kind
# (a merged one, or one per server) and are tested with each client
SHARED = {
    "send",
    "send_batch",
    "send_many",
    "cancel",
    "cancel_many",
    "get",
    "reschedule",
    "reschedule_many",
    "stats",
    "create_group",
    "delete_group",
    "groups",
    "close",
}
HOUR_MS = 3_600_000


def test_every_client_has_the_shared_surface():
    for cls in (Client, AioClient, ShardedClient, AioShardedClient, ClusterClient):
        missing = SHARED - set(dir(cls))
        assert not missing, f"{cls.__name__} lacks {sorted(missing)}"
    for cls in (Client, AioClient, ShardedClient, AioShardedClient):
        assert "subscribe" in dir(cls), cls.__name__
    for cls in (ShardedClient, AioShardedClient, ClusterClient):  # a consumer per server
        assert "subscribe_all" in dir(cls), cls.__name__


def test_cluster_client_routes_every_call_to_the_master(tmp_path):
    """ClusterClient with the slave listed first: each call is refused by the slave
    (FAILED_PRECONDITION) and made on the master; cancel and get by id, cancel_many,
    reschedule, reschedule_many (answers in order) and the groups."""
    a = master(tmp_path)
    a.start()
    b = slave(tmp_path, a, args=["--peers", a.address])
    b.start()
    try:
        wait_until(lambda: status(b.address).connected, 20, "slave attached", ignore=RPC_ERRORS)
        later = int(time.time() * 1000) + HOUR_MS
        with ClusterClient([b.address, a.address], failover_timeout=10, backoff=0.01) as cc:
            # send_many first: the slave refuses the stream, the messages go to the master
            many = cc.send_many(
                (Outgoing("par.c", b"m", deliver_at_ms=later + i, message_id=f"m{i}") for i in range(50)),
                batch_size=7,
            )
            assert cc.current == a.address and cc.failovers == 1
            assert [(r.message_id, r.deliver_at_ms) for r in many] == [(f"m{i}", later + i) for i in range(50)]
            msgs = [cc.message("par.c", b"%d" % i, deliver_at_ms=later) for i in range(6)]
            rs = cc.send_batch(msgs)
            assert [r.message_id for r in rs] == [m.message_id for m in msgs] and isinstance(rs[0], Receipt)
            assert cc.send("par.c", b"one", delay_ms=HOUR_MS).shard == rs[0].shard
            assert cc.cancel(message_id=rs[0].message_id) == "CANCELLED"
            assert cc.get(message_id=rs[0].message_id).state == "CANCELLED"
            assert cc.cancel_many([rs[1], rs[2].message_id, "nobody", rs[1]]) == [
                "CANCELLED",
                "CANCELLED",
                "NOT_FOUND",
                "ALREADY_CANCELLED",
            ]
            outcome, moved = cc.reschedule(rs[3], deliver_at_ms=later + 1000)
            assert outcome == "RESCHEDULED" and moved is not None and moved.deliver_at_ms == later + 1000
            answers = cc.reschedule_many([rs[4].message_id, "nobody", rs[5]], deliver_at_ms=later + 2000)
            assert [o for o, _r in answers] == ["RESCHEDULED", "NOT_FOUND", "RESCHEDULED"]
            assert [r.message_id for _o, r in answers if r is not None] == [rs[4].message_id, rs[5].message_id]
            assert cc.get(message_id=rs[5].message_id).deliver_at_ms == later + 2000
            assert cc.create_group("par.c", "billing") is True
            assert cc.create_group("par.c", "billing") is False
            assert [g["group"] for g in cc.groups(subject="par.c")] == ["billing"]
            st = cc.stats(subject="par.c")
            assert [g["group"] for g in st[a.address]["groups"]] == ["billing"]
            assert cc.delete_group("par.c", "billing") is True
            assert cc.groups(subject="par.c") == []
            assert cc.get(many[49]).state == "PENDING"
    finally:
        for p in (a, b):
            if p.alive():
                p.stop()


def test_sharded_clients_reschedule_many_and_groups_per_shard(tmp_path, etcd):  # noqa: F811 - the fixture
    """reschedule_many groups its targets per shard and answers in the caller's order (every
    form of target, both shards, an unknown id); a group is created on, listed from and
    deleted on every shard's master (blocking and asyncio)."""
    nodes = [node(tmp_path, "a", etcd.endpoint, shard="s1").start(), node(tmp_path, "b", etcd.endpoint, shard="s2")]
    nodes[1].start()
    try:
        for shard in ("s1", "s2"):
            wait_shard(nodes[0].address, shard, 0)
        later = int(time.time() * 1000) + HOUR_MS
        with ShardedClient(nodes[1].address) as sc:
            rs = sc.send_batch([Outgoing("par.s", b"x", delay_ms=HOUR_MS) for _ in range(40)])
            assert {r.shard for r in rs} == {"s1", "s2"}
            targets = [rs[0], str(rs[1]), rs[2].message_id, "nobody", rs[3].to_pb(), rs[4]]
            answers = sc.reschedule_many(targets, deliver_at_ms=later, batch_size=2)
            assert [o for o, _r in answers] == ["RESCHEDULED"] * 3 + ["NOT_FOUND"] + ["RESCHEDULED"] * 2
            for r, (_o, moved) in zip(rs[:5], answers[:3] + answers[4:]):
                assert moved is not None and (moved.message_id, moved.shard) == (r.message_id, r.shard)
                assert moved.deliver_at_ms == later
            assert sc.get(rs[4]).state == "CANCELLED"  # the old receipt: moved away
            assert sc.get(message_id=rs[4].message_id).deliver_at_ms == later
            assert sc.create_group("par.s", "billing") is True
            assert sc.create_group("par.s", "billing") is False
            assert sorted((g["shard"], g["group"]) for g in sc.groups(subject="par.s")) == [
                ("s1", "billing"),
                ("s2", "billing"),
            ]
            assert sc.delete_group("par.s", "billing") is True
            assert sc.groups(subject="par.s") == []

        async def aio_round() -> None:
            async with AioShardedClient(nodes[0].address) as ac:
                more = await ac.send_batch([Outgoing("par.a", b"y", delay_ms=HOUR_MS) for _ in range(20)])
                assert {r.shard for r in more} == {"s1", "s2"}
                answers = await ac.reschedule_many([more[0], "nobody", str(more[1])], delay_ms=HOUR_MS)
                assert [o for o, _r in answers] == ["RESCHEDULED", "NOT_FOUND", "RESCHEDULED"]
                assert [r.message_id for _o, r in answers if r is not None] == [more[0].message_id, more[1].message_id]
                assert await ac.create_group("par.a", "g") is True
                assert sorted(g["shard"] for g in await ac.groups(subject="par.a", group="g")) == ["s1", "s2"]
                assert await ac.delete_group("par.a", "g") is True
                assert await ac.groups(subject="par.a") == []

        asyncio.run(asyncio.wait_for(aio_round(), 60))
    finally:
        for p in nodes:
            p.kill9()


def test_cluster_client_subscribe_all_waits_out_a_slave_without_the_group(tmp_path):
    """subscribe_all with a group that does not exist yet: the slave refuses the Subscribe
    that would create it (FAILED_PRECONDITION). Its consumer ended with that error; now the
    group is made on the master and the slave's consumer subscribes again with backoff until
    the GROUP record reached it, while the master's delivers."""
    a = master(tmp_path)
    a.start()
    b = slave(tmp_path, a, args=["--peers", a.address])
    b.start()
    try:
        wait_until(lambda: status(b.address).connected, 20, "slave attached", ignore=RPC_ERRORS)
        with ClusterClient([b.address, a.address], failover_timeout=10, backoff=0.01) as cc:
            consumers = cc.subscribe_all("par.sub", "fresh")
            try:
                assert cc.groups(subject="par.sub")[0]["group"] == "fresh"  # made on the master
                sent = cc.send("par.sub", b"now")
                got: list = []

                def delivered() -> bool:
                    for cons in consumers:  # a refusal would be raised here
                        got.extend(cons.receive(1, 0.05))
                    return bool(got)

                wait_until(delivered, 20, "the delivery")
                assert [(d.message_id, d.payload) for d in got] == [(sent.message_id, b"now")]
                # the slave's consumer is still subscribed, not ended by the refusal
                assert consumers[0].receive(1, 0.05) == []
                assert consumers[0]._pump.is_alive()
            finally:
                for cons in consumers:
                    cons.close()
            with pytest.raises(errors.InvalidArgument):  # a real error still ends the call
                cc.subscribe_all("", "fresh")
    finally:
        for p in (b, a):  # the slave first: a master stopped with its slave attached takes ~10 s
            if p.alive():
                p.stop()
