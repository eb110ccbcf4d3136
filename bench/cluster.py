"""Cluster-mode benchmark (issue 16): failover time, ingest with 1 vs 2 shards, sync cost,
and ``qdelay cluster up`` against its number of shards.

    python -m bench.cluster [--seconds 5] [--producers 4] [--batch 100] [--trials 5]
                            [--ttl-ms 2000] [--only ingest,failover,up] [--up-shards 1,2,4]

All real processes on 127.0.0.1 with one etcd (Debian ``etcd-server``), temporary data
folders on the same disk, the sharded Python client (``qdelay.client.ShardedClient``).

- failover: a 3-node shard in sync mode under load; the master is SIGKILLed ``trials``
  times; the time from the kill to the first write acknowledged by the new master (lease
  TTL ``ttl_ms``, renewal every ttl/8, acknowledgements stop at 0.6 ttl), p50 and max;
- ingest: ``producers`` threads sending batches of ``batch`` 100-byte messages for
  ``seconds`` into 1 shard vs 2 shards (one node each), msgs/s and server CPU per message;
- sync: 1 shard of 1 node vs 1 shard of 2 nodes in sync mode (goal: >= 50 %);
- up: ``qdelay cluster up --shards N --nodes 2`` as a user runs it, for each N of
  ``up_shards``: seconds until it prints its seed address, until every shard has a master
  and its slave (etcd's view, through ``ShardedClient.refresh``), until one write per shard
  is acknowledged, and from SIGINT (Ctrl-C) until the command has exited with every server.

Writes bench/out/cluster.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import psutil

from bench.common import write_json

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from etcdproc import EtcdProc  # noqa: E402
from serverproc import ServerProc  # noqa: E402

from qdelay import errors  # noqa: E402
from qdelay.client import ShardedClient  # noqa: E402
from qdelay.v1 import qdelay_pb2 as pb  # noqa: E402


def leases(ttl_ms: int) -> list[str]:
    return [
        "--lease-ttl-ms",
        str(ttl_ms),
        "--lease-renew-ms",
        str(ttl_ms // 8),
        "--lease-deadline-ms",
        str(ttl_ms * 6 // 10),
    ]


def start_shards(root: str, etcd: str, layout: dict[str, int], extra: list[str]) -> list[ServerProc]:
    procs = []
    for shard, nodes in layout.items():
        for k in range(nodes):
            args = ["--etcd", etcd, "--cluster", "bench", "--shard", shard, *extra]
            procs.append(ServerProc(os.path.join(root, f"{shard}-{k}"), args=args).start())
    want = {s: n - 1 for s, n in layout.items()}
    deadline = time.monotonic() + 30
    with ShardedClient(procs[0].address) as sc:
        while time.monotonic() < deadline:
            t = sc.refresh()
            if all(t.master(s) and len(t.shards[s].slaves) == n for s, n in want.items()):
                return procs
            time.sleep(0.05)
    raise RuntimeError("the cluster did not form")


def ingest(seed: str, seconds: float, producers: int, batch: int, pids: list[int]) -> dict:
    counts = [0] * producers
    stop = time.monotonic() + seconds
    payload = b"x" * 100
    procs = [psutil.Process(p) for p in pids]
    cpu0 = sum(p.cpu_times().user + p.cpu_times().system for p in procs)

    def run(i: int) -> None:
        with ShardedClient(seed) as sc:
            while time.monotonic() < stop:
                msgs = [pb.Message(subject="bench.cl", payload=payload, delay_ms=3_600_000) for _ in range(batch)]
                sc.send_batch(msgs)
                counts[i] += batch

    threads = [threading.Thread(target=run, args=(i,)) for i in range(producers)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    cpu = sum(p.cpu_times().user + p.cpu_times().system for p in procs) - cpu0
    n = sum(counts)
    return {"msgs_per_s": round(n / elapsed), "server_cpu_us_per_msg": round(cpu / n * 1e6, 1)}


def failover(root: str, etcd: str, trials: int, ttl_ms: int) -> dict:
    sync = ["--replication", "sync", "--replication-timeout-ms", "3000", *leases(ttl_ms)]
    nodes = start_shards(root, etcd, {"s1": 3}, sync)
    rnd = random.Random(16)
    acks: list[tuple[float, str]] = []
    stop = threading.Event()
    sc = ShardedClient([n.address for n in nodes], failover_timeout=30, backoff=0.02, max_backoff=0.2)

    def produce() -> None:
        while not stop.is_set():
            try:
                sc.send_batch([pb.Message(subject="bench.fo", payload=b"p", delay_ms=3_600_000) for _ in range(20)])
            except errors.QdelayError:
                continue
            acks.append((time.monotonic(), sc.topology.master("s1")))

    t = threading.Thread(target=produce, daemon=True)
    t.start()
    times = []
    try:
        for _ in range(trials):
            time.sleep(rnd.uniform(0.3, 1.0))  # a random instant under load
            master = sc.refresh().master("s1")
            victim = next(n for n in nodes if n.address == master)
            victim.kill9()
            killed = time.monotonic()
            while True:
                hit = next(((at, who) for at, who in list(acks) if at > killed and who != master), None)
                if hit is not None:
                    break
                if time.monotonic() - killed > 30:
                    raise RuntimeError("no failover within 30 s")
                time.sleep(0.01)
            times.append(hit[0] - killed)
            victim.start()
            print(f"failover {len(times)}: {times[-1]:.2f} s", flush=True)
            while True:  # the restarted node is back as a slave before the next kill
                topo = sc.refresh()
                if len(topo.shards["s1"].slaves) == 2 and victim.address in topo.shards["s1"].slaves:
                    break
                time.sleep(0.05)
    finally:
        stop.set()
        t.join(30)
        sc.close()
        for n in nodes:
            n.kill9()
    times.sort()
    return {
        "ttl_ms": ttl_ms,
        "trials": len(times),
        "p50_s": round(times[len(times) // 2], 2),
        "max_s": round(times[-1], 2),
        "all_s": [round(x, 2) for x in times],
    }


def free_run(width: int) -> int:
    """The first of ``width`` consecutive loopback ports that are free now (cluster up numbers
    its servers from a base port and puts etcd's peer port right after its client port)."""
    rnd = random.Random()
    for _ in range(200):
        base = rnd.randrange(20000, 40000)
        socks = []
        try:
            for port in range(base, base + width):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {width} consecutive free ports")


def cluster_up(shards: int, nodes: int = 2) -> dict:
    """Time ``qdelay cluster up`` from launch to serving, and from Ctrl-C to exited."""
    with tempfile.TemporaryDirectory() as root:
        etcd_port = free_run(2)
        base = free_run(shards * nodes)
        cmd = [sys.executable, "-m", "qdelay.cli", "cluster", "up", "--data-dir", root]
        cmd += ["--shards", str(shards), "--nodes", str(nodes), "--base-port", str(base), "--etcd-port", str(etcd_port)]
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            seed = ""
            for line in proc.stdout:
                if line.startswith("seed address: "):
                    seed = line.split()[2]
                    break
            if not seed:
                raise RuntimeError(f"cluster up printed no seed: {proc.stderr.read()[-2000:]}")
            listening = time.monotonic() - t0
            want = [f"s{k}" for k in range(1, shards + 1)]
            with ShardedClient(seed, failover_timeout=60, backoff=0.02, max_backoff=0.2) as sc:
                while True:
                    t = sc.refresh()
                    if all(s in t.shards and t.master(s) and len(t.shards[s].slaves) == nodes - 1 for s in want):
                        break
                    if time.monotonic() - t0 > 120:
                        raise RuntimeError("the cluster did not form in 120 s")
                    time.sleep(0.02)
                formed = time.monotonic() - t0
                # one write acknowledged by every shard's master (ids chosen until each shard got one)
                hit: set[str] = set()
                k = 0
                while len(hit) < shards:
                    r = sc.send("bench.up", b"p", delay_ms=3_600_000, message_id=f"up-{k}")
                    hit.add(r.shard)
                    k += 1
                writable = time.monotonic() - t0
            t1 = time.monotonic()
            proc.send_signal(signal.SIGINT)
            proc.wait(120)
            stopped = time.monotonic() - t1
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return {
        "shards": shards,
        "servers": shards * nodes,
        "listening_s": round(listening, 2),
        "formed_s": round(formed, 2),
        "writable_s": round(writable, 2),
        "stop_s": round(stopped, 2),
        "exit_code": proc.returncode,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--producers", type=int, default=4)
    p.add_argument("--batch", type=int, default=100)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--ttl-ms", type=int, default=2000)
    p.add_argument("--only", default="ingest,failover,up", help="comma list of ingest, failover, up")
    p.add_argument("--up-shards", default="1,2,4", help="cluster up: the shard counts (2 servers each)")
    args = p.parse_args(argv)
    only = set(args.only.split(","))
    out: dict = {"params": vars(args), "cpus": os.cpu_count(), "load": os.getloadavg()[0]}
    if "ingest" in only:
        ingest_cases(args, out)
    if "failover" in only:
        with tempfile.TemporaryDirectory() as root, EtcdProc(os.path.join(root, "etcd")) as etcd:
            out["failover"] = failover(root, etcd.endpoint, args.trials, args.ttl_ms)
    if "up" in only:
        out["cluster_up"] = []
        for n in (int(x) for x in args.up_shards.split(",")):
            r = cluster_up(n)
            out["cluster_up"].append(r)
            print(
                f"cluster up {n} shard(s) x 2: seed printed {r['listening_s']} s, formed {r['formed_s']} s, "
                f"a write per shard {r['writable_s']} s; Ctrl-C to exited {r['stop_s']} s (exit {r['exit_code']})",
                flush=True,
            )
    print(json.dumps(out, indent=1))
    write_json("cluster", out)
    return 0


def ingest_cases(args: argparse.Namespace, out: dict) -> None:
    # the 2-shard case sends batches twice as large: each shard gets batches of ~``batch``
    cases = [
        ("1 shard x 1 node", {"s1": 1}, [], 1),
        ("2 shards x 1 node", {"s1": 1, "s2": 1}, [], 2),
        ("1 shard x 2 nodes, sync", {"s1": 2}, ["--replication", "sync"], 1),
    ]
    out["ingest"] = {}
    for name, layout, extra, k in cases:
        with tempfile.TemporaryDirectory() as root, EtcdProc(os.path.join(root, "etcd")) as etcd:
            procs = start_shards(root, etcd.endpoint, layout, extra)
            try:
                r = ingest(procs[0].address, args.seconds, args.producers, args.batch * k, [p.pid for p in procs])
            finally:
                for s in procs:
                    s.stop()
        out["ingest"][name] = r
        print(f"ingest {name:>24}: {r['msgs_per_s']:,} msgs/s, {r['server_cpu_us_per_msg']} us CPU/msg", flush=True)
    ing = out["ingest"]
    out["two_shards_vs_one"] = round(ing["2 shards x 1 node"]["msgs_per_s"] / ing["1 shard x 1 node"]["msgs_per_s"], 3)
    out["sync_vs_no_slave"] = round(
        ing["1 shard x 2 nodes, sync"]["msgs_per_s"] / ing["1 shard x 1 node"]["msgs_per_s"], 3
    )


if __name__ == "__main__":
    sys.exit(main())
