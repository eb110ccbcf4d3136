"""What each call of the sharded and cluster clients costs against the number of shards.

    python -m bench.shards [--shards 1,2,4] [--messages 20000] [--calls 300] [--rounds 3]
                           [--nodes 1,2,4] [--node 1] [--json FILE]

Part 1, the sharded clients (``ShardedClient`` and ``AioShardedClient``, client/sharded.py):
for each S of ``--shards``, one etcd (Debian ``etcd-server``) and S shards of one node each
in cluster mode on 127.0.0.1 (temporary folders, sync flush, the defaults), and the clients
seeded with one server's address. Per round, on the same cluster:

- ``send_many`` of ``--messages`` far-future messages (Outgoing tuples, a day ahead: nothing
  fires), which routes each message to its id's shard and streams to the shards at once
  (the call alone: its receipts, made when read, are read after the measure); and as many
  whose ids all belong to one shard (what the spreading itself costs);
- ``cancel_many`` of half of them (grouped per shard, CancelBatch calls at the same time);
- ``get`` of ``--calls`` receipts one call at a time (routed by the receipt's shard), of
  as many bare message ids (routed by the id's CRC-32), and of receipts all of one shard;
- ``stats`` (every master's figures, the cluster's sums), ``--calls``/3 calls;
- ``refresh()`` (one Topology call: what every failover retry and the consumers' watch do);
- ``send``, ``reschedule`` and ``cancel`` by id of ``--calls`` messages, one call at a time,
  and a ``ShardedConsumer`` (``AioShardedConsumer``) receiving and acknowledging
  ``--messages``/4 messages due at once, spread over the shards (a stream to each master);
  and ``subscribe_all`` (a plain consumer per server, read by a thread or a task each)
  receiving and acknowledging as many;
- ``qdelay admin status --servers SEED`` (``--calls``/10 times, at least 10): in cluster
  mode it asks every server of every shard.

For each operation: calls (or messages) per second, the client's CPU per operation (this
process, all threads: the bench holds only the client) and the servers' CPU per operation
(every server process, user + system; etcd not counted), the median of ``--rounds`` rounds.
A cost that grows with S where the work does not (a lookup that asks every shard, a
topology read per call) shows as a per-op cost rising from S=1 to S=4.

With ``--node 1`` (the default; skipped, saying why, without node or the module's npm
packages) the Node module's ``ShardedClient`` (examples/node/qdelay.js) is measured on the
same clusters through bench/shards_node.js: batched ``send`` of ``--messages``,
``cancelMany`` of half, ``rescheduleMany`` of the other half, ``get`` by receipt and by id, ``refresh`` (its CPU from
``process.cpuUsage``).

Part 2, the cluster client (``ClusterClient``, client/cluster.py: one master and its
slaves, no etcd): for each k of ``--nodes``, a master with k-1 slaves (async
replication), ``send_batch`` of 100, ``get``, ``cancel``, ``stats``, ``send`` one at a time,
``find_master`` and ``subscribe_all`` (a consumer per server, a thread each; the group
made first and waited for on every slave, which refuses a Subscribe that would create it)
receiving and acknowledging ``--messages``/4 due at once, from a client given all k
addresses, the same figures.

Writes bench/out/shards.json (or ``--json``); docs/benchmarks.md, "Sharded and cluster
clients against the number of shards", records a run.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

from bench.common import machine, median, print_table, until_idle, write_json

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from etcdproc import EtcdProc  # noqa: E402
from serverproc import ServerProc  # noqa: E402

from bench.cluster import start_shards  # noqa: E402
from qdelay.client import AioShardedClient, Outgoing, ShardedClient  # noqa: E402
from qdelay.client.cluster import ClusterClient  # noqa: E402

DAY_MS = 86_400_000


class Cost:
    """Wall time, this process's CPU and the servers' CPU of a block."""

    def __init__(self, pids: list[int]) -> None:
        self.procs = [psutil.Process(p) for p in pids]

    def settle(self) -> None:
        """Wait until every server is idle (a write's background work: the iterate service,
        the id index's compactions, replication), so that lookups are not charged for it."""
        for p in self.procs:
            until_idle(p.pid, 60.0)

    def idle(self, seconds: float = 2.0) -> dict[str, float]:
        """The servers' and this process's CPU use with no call made (% of a core): lease
        renewals, timers; charged to every operation measured, more so with more servers."""
        self.settle()
        me = psutil.Process()
        c0, s0 = sum(me.cpu_times()[:2]), self._servers()
        time.sleep(seconds)
        return {
            "servers_pct": (self._servers() - s0) / seconds * 100,
            "client_pct": (sum(me.cpu_times()[:2]) - c0) / seconds * 100,
        }

    def _servers(self) -> float:
        return sum(t.user + t.system for t in (p.cpu_times() for p in self.procs))

    def measure(self, ops: int, work: Callable[[], Any]) -> dict[str, float]:
        me = psutil.Process()
        c0, s0 = sum(me.cpu_times()[:2]), self._servers()
        t0 = time.perf_counter()
        work()
        wall = time.perf_counter() - t0
        c1, s1 = sum(me.cpu_times()[:2]), self._servers()
        return {
            "ops_per_s": ops / wall,
            "client_us": (c1 - c0) / ops * 1e6,
            "server_us": (s1 - s0) / ops * 1e6,
        }


def _far(n: int, base: int, tag: str) -> list[Outgoing]:
    return [Outgoing("bench.shards", b"x" * 100, deliver_at_ms=base + i, message_id=f"{tag}-{i}") for i in range(n)]


def _drain_all(cost: Cost, subscribe_all: Callable[[], list], n: int) -> dict[str, float]:
    """A blocking client's ``subscribe_all()``: its consumers read by a thread each (as
    its docstring says), from the call to the last of ``n`` due messages delivered and
    acknowledged; the consumers are closed after the measure."""
    done, lock, count = threading.Event(), threading.Lock(), [0]
    consumers: list = []
    readers: list[threading.Thread] = []

    def read(c) -> None:
        while not done.is_set():
            batch = c.receive(1, timeout=0.05)
            c.ack(batch)
            with lock:
                count[0] += len(batch)
                if count[0] >= n:
                    done.set()

    def drain_all() -> None:
        consumers.extend(subscribe_all())
        readers.extend(threading.Thread(target=read, args=(c,), daemon=True) for c in consumers)
        for t in readers:
            t.start()
        done.wait(120)

    try:
        figures = cost.measure(n, drain_all)
    finally:
        done.set()
        for t in readers:
            t.join()
        for c in consumers:
            c.close()
    if count[0] < n:
        raise SystemExit(f"subscribe_all's consumers received {count[0]} of {n}")
    return figures


def sharded_round(sc: ShardedClient, cost: Cost, messages: int, calls: int, base: int, tag: str) -> dict:
    rng = random.Random(tag)
    out: dict[str, dict] = {}
    msgs = _far(messages, base, tag)
    sent: list = []
    out["send_many"] = cost.measure(messages, lambda: sent.append(sc.send_many(msgs)))
    receipts = list(sent[0])  # each made when read (as the single-server client's): not timed
    # the same count, every id of one shard: one stream at a time, the other servers idle
    topo = sc.topology or sc.refresh()
    first = topo.names[0]
    same = (o for o in _far(messages * len(topo.names) * 3, base, tag + "one") if topo.shard_for(o.message_id) == first)
    alone = list(itertools.islice(same, messages))
    out["send_many, one shard"] = cost.measure(len(alone), lambda: sc.send_many(alone))
    doomed = receipts[::2]
    outcomes: list[str] = []
    out["cancel_many"] = cost.measure(len(doomed), lambda: outcomes.extend(sc.cancel_many(doomed)))
    if outcomes.count("CANCELLED") != len(doomed):
        raise SystemExit(f"cancel_many: {len(doomed) - outcomes.count('CANCELLED')} not CANCELLED")
    cost.settle()
    picks = rng.sample(receipts, min(calls, len(receipts)))
    out["get by receipt"] = cost.measure(len(picks), lambda: [sc.get(r) for r in picks])
    ids = [r.message_id for r in rng.sample(receipts, min(calls, len(receipts)))]
    out["get by id"] = cost.measure(len(ids), lambda: [sc.get(message_id=m) for m in ids])
    # the same calls all to one shard: what a call costs when its server stays busy, against
    # the spread calls above, each server asked in turn (processes taking turns on the cores)
    one = [r for r in receipts if r.shard == receipts[0].shard][: len(picks)]
    out["get by receipt, one shard"] = cost.measure(len(one), lambda: [sc.get(r) for r in one])
    n = max(10, calls // 3)
    out["stats"] = cost.measure(n, lambda: [sc.stats() for _ in range(n)])
    out["topology (refresh)"] = cost.measure(calls, lambda: [sc.refresh() for _ in range(calls)])
    # the single-message calls, one at a time: send (routed by the id), reschedule (by the
    # receipt's shard), cancel by id
    singles = _far(calls, base + DAY_MS, tag + "single")
    sent_one: list = []
    out["send (one at a time)"] = cost.measure(
        len(singles),
        lambda: sent_one.extend(
            sc.send(o.subject, o.payload, message_id=o.message_id, deliver_at_ms=o.deliver_at_ms) for o in singles
        ),
    )
    moved: list[str] = []
    out["reschedule"] = cost.measure(
        len(sent_one), lambda: moved.extend(sc.reschedule(r, deliver_at_ms=base + 2 * DAY_MS)[0] for r in sent_one)
    )
    gone: list[str] = []
    out["cancel by id (one at a time)"] = cost.measure(
        len(sent_one), lambda: gone.extend(sc.cancel(message_id=r.message_id) for r in sent_one)
    )
    if set(moved) != {"RESCHEDULED"} or set(gone) != {"CANCELLED"}:
        raise SystemExit(f"single calls answered {sorted(set(moved))} / {sorted(set(gone))}")
    # a ShardedConsumer (a stream to every shard's master) receiving and acknowledging
    # messages due now, spread over the shards by their ids
    subject = f"bench.sub.{tag}"
    due = [Outgoing(subject, b"x" * 100, delay_ms=0, message_id=f"{tag}-sub-{i}") for i in range(messages // 4)]
    sc.send_many(due)
    consumer = sc.subscribe(subject, "g", max_in_flight=1000)
    got = [0]

    def drain() -> None:
        deadline = time.monotonic() + 120
        while got[0] < len(due) and time.monotonic() < deadline:
            batch = consumer.receive(1, timeout=5)  # what has come (whole batches): no wait for more
            consumer.ack(batch)
            got[0] += len(batch)

    try:
        out["subscribe: receive + ack"] = cost.measure(len(due), drain)
    finally:
        consumer.close()
    if got[0] < len(due):
        raise SystemExit(f"the ShardedConsumer received {got[0]} of {len(due)}")
    # subscribe_all: a plain consumer per server, read by a thread each
    subject = f"bench.all.{tag}"
    due = [Outgoing(subject, b"x" * 100, delay_ms=0, message_id=f"{tag}-all-{i}") for i in range(messages // 4)]
    sc.send_many(due)
    out["subscribe_all: receive + ack"] = _drain_all(
        cost, lambda: sc.subscribe_all(subject, "g", max_in_flight=1000), len(due)
    )
    return out


def aio_round(seed: str, cost: Cost, messages: int, calls: int, base: int, tag: str) -> dict:
    rng = random.Random(tag)
    out: dict[str, dict] = {}

    async def go() -> None:
        async with AioShardedClient(seed) as sc:
            await sc.send_many(_far(2_000, base, "w" + tag))  # this client's first calls, channels
            await sc.get(message_id="w" + tag + "-0")
            msgs = _far(messages, base, tag)
            sent: list = []

            async def send() -> None:
                sent.append(await sc.send_many(msgs))

            async def each(fn, items) -> None:
                for x in items:
                    await fn(x)

            out["send_many"] = await ameasure(cost, messages, send())
            receipts = list(sent[0])  # each made when read: not timed
            doomed = receipts[::2]
            out["cancel_many"] = await ameasure(cost, len(doomed), sc.cancel_many(doomed))
            await asyncio.to_thread(cost.settle)
            picks = rng.sample(receipts, min(calls, len(receipts)))
            out["get by receipt"] = await ameasure(cost, len(picks), each(sc.get, picks))
            ids = [r.message_id for r in rng.sample(receipts, min(calls, len(receipts)))]
            out["get by id"] = await ameasure(cost, len(ids), each(lambda m: sc.get(message_id=m), ids))
            n = max(10, calls // 3)
            out["stats"] = await ameasure(cost, n, each(lambda _i: sc.stats(), range(n)))
            out["topology (refresh)"] = await ameasure(cost, calls, each(lambda _i: sc.refresh(), range(calls)))
            # the single-message calls, one at a time, and the merged consumer (as the
            # blocking client's round)
            singles = _far(calls, base + DAY_MS, tag + "single")
            sent_one: list = []

            async def send_one(o) -> None:
                sent_one.append(
                    await sc.send(o.subject, o.payload, message_id=o.message_id, deliver_at_ms=o.deliver_at_ms)
                )

            out["send (one at a time)"] = await ameasure(cost, len(singles), each(send_one, singles))
            moved: list[str] = []

            async def move(r) -> None:
                moved.append((await sc.reschedule(r, deliver_at_ms=base + 2 * DAY_MS))[0])

            out["reschedule"] = await ameasure(cost, len(sent_one), each(move, sent_one))
            gone: list[str] = []

            async def cancel_one(r) -> None:
                gone.append(await sc.cancel(message_id=r.message_id))

            out["cancel by id (one at a time)"] = await ameasure(cost, len(sent_one), each(cancel_one, sent_one))
            if set(moved) != {"RESCHEDULED"} or set(gone) != {"CANCELLED"}:
                raise SystemExit(f"aio single calls answered {sorted(set(moved))} / {sorted(set(gone))}")
            subject = f"bench.asub.{tag}"
            due = [
                Outgoing(subject, b"x" * 100, delay_ms=0, message_id=f"{tag}-asub-{i}") for i in range(messages // 4)
            ]
            await sc.send_many(due)
            consumer = sc.subscribe(subject, "g", max_in_flight=1000)
            got = [0]

            async def drain() -> None:
                deadline = time.monotonic() + 120
                while got[0] < len(due) and time.monotonic() < deadline:
                    batch = await consumer.receive(1, timeout=5)
                    consumer.ack(batch)
                    got[0] += len(batch)

            try:
                out["subscribe: receive + ack"] = await ameasure(cost, len(due), drain())
            finally:
                await consumer.close()
            if got[0] < len(due):
                raise SystemExit(f"the AioShardedConsumer received {got[0]} of {len(due)}")
            # subscribe_all: a plain qdelay.aio consumer per server, a task each
            subject = f"bench.aall.{tag}"
            due = [
                Outgoing(subject, b"x" * 100, delay_ms=0, message_id=f"{tag}-aall-{i}") for i in range(messages // 4)
            ]
            await sc.send_many(due)
            done, count = asyncio.Event(), [0]
            consumers: list = []
            readers: list[asyncio.Task] = []

            async def read(c) -> None:
                while not done.is_set():
                    batch = await c.receive(1, timeout=0.05)
                    c.ack(batch)
                    count[0] += len(batch)
                    if count[0] >= len(due):
                        done.set()

            async def drain_all() -> None:
                consumers.extend(await sc.subscribe_all(subject, "g", max_in_flight=1000))
                readers.extend(asyncio.create_task(read(c)) for c in consumers)
                await asyncio.wait_for(done.wait(), 120)

            try:
                out["subscribe_all: receive + ack"] = await ameasure(cost, len(due), drain_all())
            finally:
                done.set()
                await asyncio.gather(*readers)
                for c in consumers:
                    await c.close()
            if count[0] < len(due):
                raise SystemExit(f"subscribe_all's aio consumers received {count[0]} of {len(due)}")

    asyncio.run(go())
    return out


async def ameasure(cost: Cost, ops: int, coro) -> dict[str, float]:
    me = psutil.Process()
    c0, s0 = sum(me.cpu_times()[:2]), cost._servers()
    t0 = time.perf_counter()
    await coro
    wall = time.perf_counter() - t0
    c1, s1 = sum(me.cpu_times()[:2]), cost._servers()
    return {"ops_per_s": ops / wall, "client_us": (c1 - c0) / ops * 1e6, "server_us": (s1 - s0) / ops * 1e6}


NODE_DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shards_node.js")
NODE_MODULES = os.path.join(os.path.dirname(os.path.dirname(NODE_DRIVER)), "examples", "node", "node_modules")


def node_available() -> str:
    """'' when the Node part can run, else why not (node, or the module's npm packages)."""
    if shutil.which("node") is None:
        return "node is not installed"
    if not os.path.isdir(os.path.join(NODE_MODULES, "@grpc", "grpc-js")):
        return "examples/node has no node_modules (make node-deps)"
    return ""


class NodeDriver:
    """bench/shards_node.js: the Node ShardedClient, one command a line (see its header)."""

    def __init__(self, seed: str) -> None:
        self.proc = subprocess.Popen(
            ["node", NODE_DRIVER, seed], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )

    def call(self, cost: Cost, command: str) -> dict[str, float]:
        """One command; its rate, the Node process's CPU and the servers' CPU per operation."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        s0 = cost._servers()
        self.proc.stdin.write(command + "\n")
        line = self.proc.stdout.readline()
        s1 = cost._servers()
        if not line:
            raise RuntimeError(f"the Node driver ended (exit {self.proc.wait()}) at {command!r}")
        got = json.loads(line)
        ops = got["ops"]
        return {
            "ops_per_s": ops / got["wall_s"],
            "client_us": got["cpu_s"] / ops * 1e6,
            "server_us": (s1 - s0) / ops * 1e6,
        }

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(30)


def node_round(node: NodeDriver, cost: Cost, messages: int, calls: int, base: int) -> dict:
    out = {"send (batched)": node.call(cost, f"send {messages} {base}")}
    out["cancelMany"] = node.call(cost, "cancelMany")
    out["rescheduleMany"] = node.call(cost, "rescheduleMany")
    cost.settle()
    out["get by receipt"] = node.call(cost, f"getReceipt {calls}")
    out["get by id"] = node.call(cost, f"getId {calls}")
    out["topology (refresh)"] = node.call(cost, f"refresh {calls}")
    return out


def admin_round(seed: str, cost: Cost, n: int) -> dict:
    """``qdelay admin status --servers SEED``: in cluster mode it reads the Topology and asks
    every server of every shard for its replication status (a channel each, in turn)."""
    from bench.admin import run_admin

    return {
        "status (every server)": cost.measure(n, lambda: [run_admin("status", "--servers", seed) for _ in range(n)])
    }


def cluster_round(cc: ClusterClient, cost: Cost, messages: int, calls: int, base: int, tag: str) -> dict:
    rng = random.Random(tag)
    out: dict[str, dict] = {}
    batches = [
        [
            cc.message("bench.cc", b"x" * 100, deliver_at_ms=base + i + j, message_id=f"{tag}-{i + j}")
            for j in range(100)
        ]
        for i in range(0, max(100, messages // 4), 100)
    ]
    receipts: list = []
    out["send_batch (100)"] = cost.measure(
        sum(map(len, batches)), lambda: [receipts.extend(cc.send_batch(b)) for b in batches]
    )
    cost.settle()
    picks = rng.sample(receipts, min(calls, len(receipts)))
    out["get"] = cost.measure(len(picks), lambda: [cc.get(r) for r in picks])
    doomed = rng.sample(receipts, min(calls, len(receipts)))
    out["cancel"] = cost.measure(len(doomed), lambda: [cc.cancel(r) for r in doomed])
    n = max(10, calls // 3)
    out["stats"] = cost.measure(n, lambda: [cc.stats() for _ in range(n)])
    # one message at a time, and finding the master (what its failover does: every server asked)
    singles = [(f"{tag}-one-{i}", base + 2 * DAY_MS + i) for i in range(calls)]
    out["send (one at a time)"] = cost.measure(
        len(singles), lambda: [cc.send("bench.cc", b"x" * 100, message_id=m, deliver_at_ms=d) for m, d in singles]
    )
    out["find_master"] = cost.measure(n, lambda: [cc.find_master() for _ in range(n)])
    # subscribe_all: a consumer per server (the slaves' never deliver), messages/4 due now;
    # the group made first (a slave refuses a Subscribe that would create it: a write)
    subject = f"bench.ccall.{tag}"
    cc.create_group(subject, "g")
    due = [cc.message(subject, b"x" * 100, message_id=f"{tag}-all-{i}") for i in range(max(100, messages // 4))]
    for i in range(0, len(due), 100):
        cc.send_batch(due[i : i + 100])
    deadline = time.monotonic() + 30  # every slave has the group (replication is asynchronous)
    while not all(c.groups(subject=subject, group="g") for c in cc.clients):
        if time.monotonic() > deadline:
            raise SystemExit(f"the group {subject}/g did not reach every slave within 30 s")
        time.sleep(0.05)
    out["subscribe_all: receive + ack"] = _drain_all(
        cost, lambda: cc.subscribe_all(subject, "g", max_in_flight=1000), len(due)
    )
    return out


def medians(rounds: list[dict]) -> dict[str, dict[str, float]]:
    return {
        op: {k: median([r[op][k] for r in rounds]) for k in rounds[0][op]}
        for op in rounds[0]  # every round measures the same operations
    }


def part_sharded(counts: list[int], messages: int, calls: int, rounds: int, node_part: bool) -> tuple[dict, dict]:
    results: dict = {}
    idle: dict = {}
    base = (int(time.time() * 1000) // 60_000 + 60) * 60_000 + DAY_MS
    for s in counts:
        with tempfile.TemporaryDirectory(prefix="qdelay-bench-shards-") as root:
            with EtcdProc(os.path.join(root, "etcd")) as etcd:
                procs = start_shards(root, etcd.endpoint, {f"s{i}": 1 for i in range(s)}, [])
                try:
                    cost = Cost([p.pid for p in procs])
                    blocking, aio, nodes, admin = [], [], [], []
                    with ShardedClient(procs[0].address) as sc:
                        sharded_round(sc, cost, 2_000, 20, base, f"warm{s}")  # first calls, channels
                        idle[str(s)] = cost.idle()
                        for r in range(rounds):
                            blocking.append(sharded_round(sc, cost, messages, calls, base, f"b{s}.{r}"))
                            aio.append(aio_round(procs[0].address, cost, messages, calls, base, f"a{s}.{r}"))
                            admin.append(admin_round(procs[0].address, cost, max(10, calls // 10)))
                            print(f"shards={s} round {r + 1}: done", flush=True)
                    if node_part:
                        node = NodeDriver(procs[0].address)
                        try:
                            node_round(node, cost, 2_000, 20, base + 10 * DAY_MS)  # first calls, channels
                            for r in range(rounds):
                                nodes.append(node_round(node, cost, messages, calls, base + (11 + r) * DAY_MS))
                        finally:
                            node.close()
                finally:
                    for p in procs:
                        p.stop()
        results[str(s)] = {
            "ShardedClient": medians(blocking),
            "AioShardedClient": medians(aio),
            "qdelay admin": medians(admin),
        }
        if nodes:
            results[str(s)]["Node ShardedClient"] = medians(nodes)
    return results, idle


def part_cluster(counts: list[int], messages: int, calls: int, rounds: int) -> tuple[dict, dict]:
    results: dict = {}
    idle: dict = {}
    base = (int(time.time() * 1000) // 60_000 + 60) * 60_000 + DAY_MS
    for k in counts:
        with tempfile.TemporaryDirectory(prefix="qdelay-bench-cc-") as root:
            master = ServerProc(os.path.join(root, "m")).start()
            slaves = [
                ServerProc(os.path.join(root, f"s{i}"), args=["--role", "slave", "--master", master.address]).start()
                for i in range(k - 1)
            ]
            procs = [master, *slaves]
            try:
                cost = Cost([p.pid for p in procs])
                done = []
                with ClusterClient([p.address for p in procs]) as cc:
                    cluster_round(cc, cost, 400, 20, base, f"warm{k}")
                    idle[str(k)] = cost.idle()
                    for r in range(rounds):
                        done.append(cluster_round(cc, cost, messages, calls, base, f"c{k}.{r}"))
                        print(f"nodes={k} round {r + 1}: done", flush=True)
            finally:
                for p in procs:
                    p.stop()
        results[str(k)] = {"ClusterClient": medians(done)}
    return results, idle


def table(results: dict, idle: dict, what: str, title: str) -> str:
    """The medians per client, operation and count; the servers' CPU also net of what they
    use idle (``idle``: % of a core per count, spread over the operations of the time)."""
    rows = []
    for n, by_client in results.items():
        for client, ops in by_client.items():
            for op, v in ops.items():
                net = v["server_us"] - idle[n]["servers_pct"] * 1e4 / v["ops_per_s"]
                rows.append([client, op, int(n), v["ops_per_s"], v["client_us"], v["server_us"], net])
    rows.sort(key=lambda r: (r[0], r[1], r[2]))
    headers = ["client", "operation", what, "ops/s", "client µs/op", "servers µs/op", "net of idle"]
    return print_table(headers, rows, title=title)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.shards", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", default="1,2,4", help="shard counts S for the sharded clients (etcd cluster mode)")
    ap.add_argument("--nodes", default="1,2,4", help="server counts for ClusterClient (a master and its slaves)")
    ap.add_argument("--messages", type=int, default=20_000, help="messages sent per round (half are cancelled)")
    ap.add_argument(
        "--calls",
        type=int,
        default=300,
        help="calls per kind per round: get, refresh, and send, reschedule, cancel one at a time (stats: a third)",
    )
    ap.add_argument("--rounds", type=int, default=3, help="rounds per count; medians are printed")
    ap.add_argument(
        "--node", type=int, default=1, help="1: also the Node module's ShardedClient (needs node, make node-deps)"
    )
    ap.add_argument("--json", default="shards", help="output name under bench/out, or a path")
    args = ap.parse_args(argv)
    started = machine()
    why_not = "" if args.node else "--node 0"
    why_not = why_not or node_available()
    if why_not:
        print(f"the Node sharded client is not measured: {why_not}", flush=True)
    sharded, sharded_idle = part_sharded(
        [int(x) for x in args.shards.split(",") if x], args.messages, args.calls, args.rounds, not why_not
    )
    cluster, cluster_idle = part_cluster(
        [int(x) for x in args.nodes.split(",") if x], args.messages, args.calls, args.rounds
    )
    table(sharded, sharded_idle, "shards", "sharded clients against the number of shards (medians of the rounds)")
    print()
    table(cluster, cluster_idle, "servers", "ClusterClient against the number of servers (a master and its slaves)")
    print()
    print_table(
        ["layout", "count", "servers idle CPU %", "client idle CPU %"],
        [["shards", int(n), v["servers_pct"], v["client_pct"]] for n, v in sharded_idle.items()]
        + [["master + slaves", int(n), v["servers_pct"], v["client_pct"]] for n, v in cluster_idle.items()],
        title="CPU with no call made (charged to every operation above; etcd not counted)",
    )
    write_json(
        args.json,
        {
            "machine": started,
            "machine_end": machine(),
            "params": vars(args),
            "sharded": sharded,
            "cluster": cluster,
            "idle": {"sharded": sharded_idle, "cluster": cluster_idle},
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
