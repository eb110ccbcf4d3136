"""The five Python clients share one surface: the single-server clients (blocking and
asyncio), the sharded ones (blocking and asyncio) and ClusterClient answer to the same
method names for what they all can do, routed as their siblings route (by receipt or id:
the shard that owns it; in a replicated pair: the master; groups: every shard's master)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator, Sequence

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


@contextlib.contextmanager
def master_and_slave(tmp_path, master_args: Sequence[str] = (), peers: bool = False) -> Iterator[tuple]:
    """A master and its attached slave (``peers``: the master is the slave's peer), stopped
    after (the slave let go first if a test left it SIGSTOPped)."""
    a = master(tmp_path, args=list(master_args))
    a.start()
    b = slave(tmp_path, a, args=["--peers", a.address] if peers else [])
    b.start()
    try:
        wait_until(lambda: status(b.address).connected, 20, "slave attached", ignore=RPC_ERRORS)
        yield a, b
    finally:
        if b.alive():
            os.kill(b.pid, signal.SIGCONT)
        for p in (b, a):
            if p.alive():
                p.stop()


def sync_master_and_slave(tmp_path) -> contextlib.AbstractContextManager[tuple]:
    """:func:`master_and_slave` in sync mode with a 300 ms replication timeout."""
    return master_and_slave(tmp_path, ["--replication", "sync", "--replication-timeout-ms", "300"])


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
    with master_and_slave(tmp_path, peers=True) as (a, b):
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


def receive_one(consumers: list) -> list:
    """The first delivery any of ``consumers`` gets (a consumer's refusal is raised here)."""
    got: list = []

    def delivered() -> bool:
        for cons in consumers:
            got.extend(cons.receive(1, 0.05))
        return bool(got)

    wait_until(delivered, 20, "the delivery")
    return got


def test_cluster_client_subscribe_all_waits_out_a_slave_without_the_group(tmp_path):
    """subscribe_all with a group that does not exist yet: the slave refuses the Subscribe
    that would create it (FAILED_PRECONDITION). Its consumer ended with that error; now the
    group is made on the master and the slave's consumer subscribes again with backoff until
    the GROUP record reached it, while the master's delivers."""
    with master_and_slave(tmp_path, peers=True) as (a, b):
        with ClusterClient([b.address, a.address], failover_timeout=10, backoff=0.01) as cc:
            consumers = cc.subscribe_all("par.sub", "fresh")
            try:
                assert cc.groups(subject="par.sub")[0]["group"] == "fresh"  # made on the master
                sent = cc.send("par.sub", b"now")
                got = receive_one(consumers)
                assert [(d.message_id, d.payload) for d in got] == [(sent.message_id, b"now")]
                # the slave's consumer is still subscribed, not ended by the refusal
                assert consumers[0].receive(1, 0.05) == []
                assert consumers[0]._pump.is_alive()
            finally:
                for cons in consumers:
                    cons.close()
            with pytest.raises(errors.InvalidArgument):  # a real error still ends the call
                cc.subscribe_all("", "fresh")


def test_a_consumer_waiting_for_its_group_outlives_a_slave_refusal(tmp_path):
    """``subscribe(..., wait_for_group=True)`` on a slave, the group nowhere yet: the slave
    refuses (FAILED_PRECONDITION) and the consumer subscribes again (``reconnects``) instead
    of ending; once the group is made on the master and replicated, the slave takes the
    subscription (its stats list the consumer). Blocking and asyncio consumers alike; without
    ``wait_for_group`` the refusal is raised."""
    with master_and_slave(tmp_path, peers=True) as (a, b):
        on_slave = Client(b.address, retry_backoff=0.01)
        on_master = Client(a.address)

        def consumers(group: str) -> int:
            return sum(g["consumers"] for g in on_slave.groups(subject="par.wait", group=group))

        try:
            cons = on_slave.subscribe("par.wait", "late", wait_for_group=True)
            try:
                wait_until(lambda: cons.receive(1, 0.05) == [] and cons.reconnects >= 2, 10, "refused twice")
                assert on_master.create_group("par.wait", "late") is True
                wait_until(lambda: consumers("late") == 1 and cons.receive(1, 0.05) == [], 10, "subscribed")
            finally:
                cons.close()
            with pytest.raises(errors.FailedPrecondition, match="slave"):
                on_slave.subscribe("par.wait", "other").receive(1, 5.0)

            async def aio_round() -> None:
                async with AioClient(b.address, retry_backoff=0.01) as ac:
                    acons = ac.subscribe("par.wait", "late2", wait_for_group=True)
                    try:
                        for _ in range(200):  # until refused twice; a refusal would be raised here
                            if await acons.receive(1, 0.05) == [] and acons.reconnects >= 2:
                                break
                        assert acons.reconnects >= 2
                        assert on_master.create_group("par.wait", "late2") is True
                        for _ in range(200):
                            if await acons.receive(1, 0.05) == [] and consumers("late2") == 1:
                                break
                        assert consumers("late2") == 1
                    finally:
                        await acons.close()
                    with pytest.raises(errors.FailedPrecondition, match="slave"):
                        await ac.subscribe("par.wait", "other").receive(1, 5.0)

            asyncio.run(asyncio.wait_for(aio_round(), 60))
        finally:
            on_slave.close()
            on_master.close()


def test_sharded_subscribe_all_makes_the_group_and_waits_out_a_slave(tmp_path, etcd):  # noqa: F811 - the fixture
    """The sharded clients' subscribe_all with a new group on a shard of a master and a
    slave: the group is made on the master first, the slave's consumer waits out its refusal
    (FAILED_PRECONDITION: it may not create the group) instead of ending with it, and the
    master's consumer delivers (blocking and asyncio)."""
    nodes = [node(tmp_path, "a", etcd.endpoint).start(), node(tmp_path, "b", etcd.endpoint).start()]
    try:
        s1 = wait_shard(nodes[0].address, "s1", 1)
        wait_shard(s1.slaves[0], "s1", 1)  # the seed: the client reads the topology from it
        wait_until(lambda: status(s1.slaves[0]).connected, 20, "slave attached", ignore=RPC_ERRORS)

        with ShardedClient(s1.slaves[0]) as sc:
            consumers = sc.subscribe_all("par.sub", "fresh")
            try:
                assert len(consumers) == 2
                assert [g["group"] for g in sc.groups(subject="par.sub")] == ["fresh"]  # made on the master
                sent = sc.send("par.sub", b"now")
                got = receive_one(consumers)
                assert [(d.message_id, d.payload) for d in got] == [(sent.message_id, b"now")]
                assert all(cons.receive(1, 0.05) == [] for cons in consumers)  # neither ended
            finally:
                for cons in consumers:
                    cons.close()

        async def aio_round() -> None:
            async with AioShardedClient(s1.slaves[0]) as ac:
                consumers = await ac.subscribe_all("par.sub", "fresh2")
                try:
                    assert len(consumers) == 2
                    assert [g["group"] for g in await ac.groups(subject="par.sub", group="fresh2")] == ["fresh2"]
                    sent = await ac.send("par.sub", b"aio")
                    got: list = []
                    for _ in range(400):
                        for cons in consumers:  # a refusal would be raised here
                            got.extend(await cons.receive(1, 0.05))
                        if got:
                            break
                    assert [(d.message_id, d.payload) for d in got] == [(sent.message_id, b"aio")]
                    for cons in consumers:
                        assert await cons.receive(1, 0.05) == []  # neither ended
                finally:
                    for cons in consumers:
                        await cons.close()

        asyncio.run(asyncio.wait_for(aio_round(), 60))
    finally:
        for p in nodes:
            p.kill9()


def test_a_cancel_tried_again_after_an_unknown_outcome_answers_cancelled(tmp_path):
    """The cluster clients' cancel() whose try failed with its outcome unknown (UNAVAILABLE:
    here sync replication unconfirmed, the tombstone durable on the master) is tried again
    and finds the message cancelled by its own first try: CANCELLED, as the single-server
    client answers a re-sent cancel (docs/api.md), not ALREADY_CANCELLED, which says another
    cancel got there first. ClusterClient, ShardedClient and AioShardedClient (on a
    standalone master: one shard); cancel_many likewise, the cluster clients' failover and
    the single-server clients' own retries of a CancelBatch (blocking and asyncio)."""
    import threading

    with sync_master_and_slave(tmp_path) as (a, b):
        with Client(a.address) as plain:
            targets = [plain.send("par.unknown", b"%d" % i, delay_ms=HOUR_MS) for i in range(8)]

        def cancel_while_the_slave_is_stopped(cancel, tried) -> str:
            """``cancel()`` in a thread, the slave stopped until its first try has failed."""
            out: list = []
            before = tried()
            os.kill(b.pid, signal.SIGSTOP)
            try:
                t = threading.Thread(target=lambda: out.append(cancel()))
                t.start()
                wait_until(lambda: tried() > before, 20, "the first try refused (unconfirmed)")
            finally:
                os.kill(b.pid, signal.SIGCONT)
            t.join(30)
            return out[0]

        with ClusterClient([a.address], failover_timeout=20, backoff=0.05) as cc:
            assert cancel_while_the_slave_is_stopped(lambda: cc.cancel(targets[0]), lambda: cc.retries) == "CANCELLED"
            assert cc.cancel(targets[0]) == "ALREADY_CANCELLED"  # a first try: another's cancel
            many = cancel_while_the_slave_is_stopped(lambda: cc.cancel_many([targets[3], "nobody"]), lambda: cc.retries)
            assert many == ["CANCELLED", "NOT_FOUND"]
        with ShardedClient(a.address, failover_timeout=20, backoff=0.05) as sc:
            assert cancel_while_the_slave_is_stopped(lambda: sc.cancel(targets[1]), lambda: sc.retries) == "CANCELLED"
            assert sc.cancel(targets[1]) == "ALREADY_CANCELLED"
            many = cancel_while_the_slave_is_stopped(
                lambda: sc.cancel_many([targets[4], targets[1]]), lambda: sc.retries
            )
            assert many == ["CANCELLED", "CANCELLED"]  # the second: as it may have been this call's
            single = Client(a.address, retries=8, retry_backoff=0.2)  # its own retries
            try:
                many = cancel_while_the_slave_is_stopped(
                    lambda: single.cancel_many([targets[5], "nobody"]),
                    lambda: status(a.address).sync_timeouts,
                )
                assert many == ["CANCELLED", "NOT_FOUND"]
            finally:
                single.close()

        async def aio_round() -> tuple[str, str]:
            async with AioShardedClient(a.address, failover_timeout=20, backoff=0.05) as ac:
                os.kill(b.pid, signal.SIGSTOP)
                try:
                    task = asyncio.ensure_future(ac.cancel(targets[2]))
                    for _ in range(400):
                        if ac.retries >= 1:
                            break
                        await asyncio.sleep(0.05)
                    assert ac.retries >= 1
                finally:
                    os.kill(b.pid, signal.SIGCONT)
                return await task, await ac.cancel(targets[2])

        assert asyncio.run(asyncio.wait_for(aio_round(), 60)) == ("CANCELLED", "ALREADY_CANCELLED")

        async def aio_many() -> list[str]:  # the asyncio client's own retries
            async with AioClient(a.address, retries=8, retry_backoff=0.2) as ac:
                timeouts = status(a.address).sync_timeouts
                os.kill(b.pid, signal.SIGSTOP)
                try:
                    task = asyncio.ensure_future(ac.cancel_many([targets[6], targets[7]]))
                    for _ in range(400):
                        if status(a.address).sync_timeouts > timeouts:
                            break
                        await asyncio.sleep(0.05)
                finally:
                    os.kill(b.pid, signal.SIGCONT)
                return await task

        assert asyncio.run(asyncio.wait_for(aio_many(), 60)) == ["CANCELLED", "CANCELLED"]


def with_the_slave_stopped(a, b, call):
    """``call()`` in a thread, sync master ``a``'s slave ``b`` stopped (SIGSTOP) until ``a``'s
    first answer timed out waiting for it: the call's first try has an unknown outcome (its
    write is durable on the master, the client hears UNAVAILABLE and tries again)."""
    import threading

    out: list = []
    before = status(a.address).sync_timeouts
    os.kill(b.pid, signal.SIGSTOP)
    try:
        t = threading.Thread(target=lambda: out.append(call()))
        t.start()
        wait_until(lambda: status(a.address).sync_timeouts > before, 20, "the first try unconfirmed")
    finally:
        os.kill(b.pid, signal.SIGCONT)
    t.join(30)
    return out[0]


def test_an_unbatched_cancel_tried_again_after_an_unknown_outcome_answers_cancelled(tmp_path):
    """``Client(batching=False).cancel()`` (blocking and asyncio) is one unary Cancel the
    client tries again after UNAVAILABLE (here sync replication unconfirmed: the tombstone
    is durable on the master); the retry found the message cancelled by that first try and
    answered ALREADY_CANCELLED, where the batched cancel(), cancel_many and the cluster
    clients answer CANCELLED (docs/api.md: CANCELLED whenever its cancel was, or may have
    been, the first to reach the message). A later first try still answers
    ALREADY_CANCELLED."""

    with sync_master_and_slave(tmp_path) as (a, b):
        with Client(a.address) as plain:
            targets = [plain.send("par.unbatched", b"%d" % i, delay_ms=HOUR_MS) for i in range(2)]

        with Client(a.address, batching=False, retries=8, retry_backoff=0.2) as c:
            assert with_the_slave_stopped(a, b, lambda: c.cancel(targets[0])) == "CANCELLED"
            assert c.cancel(targets[0]) == "ALREADY_CANCELLED"  # a first try: another's cancel

        async def aio_cancel() -> str:
            async with AioClient(a.address, batching=False, retries=8, retry_backoff=0.2) as ac:
                return await ac.cancel(targets[1])

        assert with_the_slave_stopped(a, b, lambda: asyncio.run(aio_cancel())) == "CANCELLED"


def test_a_failed_send_many_carries_the_acknowledged_prefix_in_every_client(server, monkeypatch):
    """A send_many refused part-way raises with ``.receipts``: message ``i``'s receipt at
    ``i``, for every message acknowledged before the refusal (the sharded clients: None
    for a message its shard did not acknowledge, test_cluster_etcd). ClusterClient's held
    only the last try's of the chunk it failed in: index 0 was some later message's."""
    from qdelay.client import cluster

    monkeypatch.setattr(cluster, "SEND_MANY_CHUNK", 100)  # the refusal in the second chunk
    later = int(time.time() * 1000) + 3_600_000
    makers = (("single", lambda: Client(server.address)), ("cluster", lambda: ClusterClient([server.address])))
    for name, make in makers:
        msgs = [Outgoing("prefix", b"p", deliver_at_ms=later, message_id=f"{name}-{i}") for i in range(200)]
        msgs[150] = msgs[150]._replace(subject="")
        with make() as c, pytest.raises(errors.InvalidArgument) as info:
            c.send_many(msgs, batch_size=10, max_in_flight=4)
        rs = list(info.value.receipts)
        assert [r.message_id for r in rs] == [m.message_id for m in msgs[:150]], name
