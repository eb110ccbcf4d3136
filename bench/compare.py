"""Side by side, in one run: qdelay vs Redis (sorted set + Lua poller, AOF appendfsync always)
vs beanstalkd (binlog, -f 0), on the same disk, with the goals of issue #4 as ratios.

    make bench-deps                      # apt-installs redis-server and beanstalkd
    python -m bench.compare [--drivers qdelay,redis-always,beanstalkd-f0]
                            [--scenarios ingest,lateness,burst,memory,crash] [--scale 1.0] [--repeat 1]
                            [--shapes threads16]   # with --scenarios shapes: only these (and their Redis peers)

Scenarios (sizes at --scale 1):
  ingest   200,000 messages of 100 bytes due 1-60 min ahead, batches of 100, one producer
           process; durable acks. msgs/s, server and client CPU per message (the server's
           includes the work it does after the last ack, until it is idle again).
  lateness 20,000 due evenly over 10 s, starting 3 s after sending starts; one consumer;
           lateness = time in the consumer's hands - due time (p50/p99/max).
  burst    100,000 due at one instant (after all are acknowledged); drain time after it.
  memory   1,000,000 due 1-2 days ahead (two producers); server RSS growth per pending message.
  crash    50,000 due 1-6 s after each batch is sent, a busy consumer; SIGKILL 2 s after the last
           ack, restart on the same folder; lost and duplicated messages.
Producers and the consumer are separate processes (multiprocessing spawn). Writes
bench/out/compare.json and prints Markdown tables (pasted into docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import os
import queue as queue_mod
import random
import shutil
import tempfile
import threading
import time
from array import array

from bench.common import (
    ID_INDEX_MEMORY,
    cpu_counters,
    cpu_seconds,
    machine,
    print_table,
    steal_percent,
    thread_cpu_by_name,
    thread_split,
    until_steady,
    write_json,
)
from bench.peers import DRIVERS, Chunk, make_client, make_payload

CTX = mp.get_context("spawn")
BATCH = 100


# ------------------------------------------------------------------------------------- workers
def _sender(spec, ids, rel_ms, per_batch_base, batch, q, go, t0, max_s):
    try:
        client = make_client(spec)
        payloads = [make_payload(i) for i in ids]
        q.put(("ready", os.getpid()))
        if not go.wait(120):
            raise TimeoutError("no go signal")
        base0 = t0.value
        sent: list[list[int]] = []  # each chunk's due times, kept as made (the lateness records)
        start = time.time()
        cpu0 = time.process_time()
        deadline = start + max_s

        def chunks():
            # a chunk is columns (Chunk): every client builds its own messages from them
            for k in range(0, len(ids), batch):
                if time.time() > deadline:
                    return
                base = time.time() * 1000.0 if per_batch_base else base0
                due = [int(base + r) for r in rel_ms[k : k + batch]]
                sent.append(due)
                yield Chunk(ids[k : k + batch], due, payloads[k : k + batch])

        results = client.send_batches(chunks(), batch)
        end = time.time()
        cpu = time.process_time() - cpu0  # the producer's work; the records below are the benchmark's
        dues, eff = array("d"), array("d")
        for due, e in zip(sent, results):
            dues.extend(due)
            eff.extend(e if e is not None else due)
        n = len(dues)
        client.close()
        q.put(("done", dict(start=start, end=end, n=n, cpu=cpu, ids=array("q", ids[:n]), dues=dues, eff=eff)))
    except BaseException as ex:  # noqa: BLE001 - report, never hang the parent
        q.put(("error", repr(ex)))


def _consumer(spec, expected, q, ready, stop_evt, deadline, grace_s):
    try:
        ids, ts = array("q"), array("d")
        seen: set[int] = set()
        state = {"done_at": None}
        local_stop = threading.Event()
        client = make_client(spec)

        def on_batch(batch_ids, t):
            for i in batch_ids:
                ids.append(i)
                ts.append(t)
                seen.add(i)
            if state["done_at"] is None and len(seen) >= expected:
                state["done_at"] = time.time()

        worker = threading.Thread(target=client.consume, args=(on_batch, local_stop), daemon=True)
        worker.start()
        ready.set()
        while time.time() < deadline and not stop_evt.is_set():
            if state["done_at"] is not None and time.time() > state["done_at"] + grace_s:
                break
            time.sleep(0.05)
        local_stop.set()
        worker.join(15)
        client.close()
        q.put(("done", dict(ids=ids, ts=ts)))
    except BaseException as ex:  # noqa: BLE001
        q.put(("error", repr(ex)))


def _get(q, deadline, what):
    while True:
        left = deadline - time.time()
        if left <= 0:
            raise TimeoutError(f"timed out waiting for {what}")
        try:
            kind, val = q.get(timeout=min(left, 5))
        except queue_mod.Empty:
            continue
        if kind == "error":
            raise RuntimeError(f"{what} failed: {val}")
        return kind, val


class Senders:
    def __init__(self, spec, ids, rel_ms, procs=1, batch=BATCH, per_batch_base=False, max_s=900):
        self.q = CTX.Queue()
        self.go_evt = CTX.Event()
        self.t0 = CTX.Value("d", 0.0)
        self.max_s = max_s
        step = (len(ids) + procs - 1) // procs
        self.procs = [
            CTX.Process(
                target=_sender,
                daemon=True,
                args=(
                    spec,
                    ids[p * step : (p + 1) * step],
                    rel_ms[p * step : (p + 1) * step],
                    per_batch_base,
                    batch,
                    self.q,
                    self.go_evt,
                    self.t0,
                    max_s,
                ),
            )
            for p in range(procs)
        ]

    def start(self):
        for p in self.procs:
            p.start()
        deadline = time.time() + 120
        for _ in self.procs:
            _get(self.q, deadline, "sender start")

    def go(self) -> float:
        self.t0.value = time.time() * 1000.0
        self.go_evt.set()
        return self.t0.value

    def results(self):
        deadline = time.time() + self.max_s + 120
        out = [_get(self.q, deadline, "sender")[1] for _ in self.procs]
        for p in self.procs:
            p.join(30)
        return out


class Consumer:
    def __init__(self, spec, expected, deadline, grace_s=1.0):
        self.q = CTX.Queue()
        self.ready = CTX.Event()
        self.stop_evt = CTX.Event()
        self.deadline = deadline
        self.proc = CTX.Process(
            target=_consumer, daemon=True, args=(spec, expected, self.q, self.ready, self.stop_evt, deadline, grace_s)
        )

    def start(self):
        self.proc.start()
        if not self.ready.wait(120):
            raise TimeoutError("consumer did not start")
        time.sleep(0.3)  # let it subscribe / connect

    def results(self, stop_at=None):
        if stop_at is not None:
            while time.time() < min(stop_at, self.deadline):
                try:
                    kind, val = self.q.get(timeout=1)
                except queue_mod.Empty:
                    continue
                if kind == "error":
                    raise RuntimeError(f"consumer failed: {val}")
                self.proc.join(30)
                return val
            self.stop_evt.set()
        val = _get(self.q, self.deadline + 120, "consumer")[1]
        self.proc.join(30)
        return val


# ------------------------------------------------------------------------------------- helpers
class Server:
    def __init__(self, name, tmp):
        self.driver = DRIVERS[name]()
        self.workdir = tempfile.mkdtemp(prefix=f"qdbench-{name}-", dir=tmp)

    def __enter__(self):
        self.driver.startup_s = self.driver.start(self.workdir)
        return self.driver

    def __exit__(self, *exc):
        try:
            if self.driver.proc is not None:
                self.driver.stop()
        finally:
            if self.driver.proc is not None:
                self.driver.kill9()
            shutil.rmtree(self.workdir, ignore_errors=True)


def pct(values, p):
    if not values:
        return float("nan")
    return values[min(len(values) - 1, max(0, int(round(p / 100.0 * (len(values) - 1)))))]


def lateness_stats(first, due, prefix=""):
    lat = sorted(first[i] * 1000.0 - due[i] for i in first if i in due)
    return {
        f"{prefix}p50_ms": round(pct(lat, 50), 1),
        f"{prefix}p99_ms": round(pct(lat, 99), 1),
        f"{prefix}max_ms": round(lat[-1], 1) if lat else None,
        f"{prefix}min_ms": round(lat[0], 1) if lat else None,
    }


def first_receipts(res):
    first = {}
    for i, t in zip(res["ids"], res["ts"]):
        if i not in first:
            first[i] = t
    return first, len(res["ids"]), len(first)


def merge_sent(results):
    due, eff = {}, {}
    for r in results:
        for i, d, e in zip(r["ids"], r["dues"], r["eff"]):
            due[i] = d
            eff[i] = e
    return due, eff, min(r["start"] for r in results), max(r["end"] for r in results), sum(r["n"] for r in results)


def load1():
    return round(os.getloadavg()[0], 2)


def idle_cpu_rate(d, seconds=1.0):
    """The server's CPU seconds per second while nobody calls it (timers, housekeeping)."""
    c0, t0 = d.cpu_seconds(), time.monotonic()
    time.sleep(seconds)
    return (d.cpu_seconds() - c0) / (time.monotonic() - t0)


def settled_cpu(d, cpu0, t0, idle, min_s=1.5, max_s=15.0, step=0.25):
    """The server's CPU since ``t0`` for the work the load caused, done before or after the
    last answer: work left for later (qdelay's iterate catch-up and its checkpoint, every
    second) counts too. Waits at least ``min_s`` after the last answer and until a
    ``step`` passes with no more than idle CPU, then subtracts the idle rate over it all."""
    start = time.monotonic()
    last = d.cpu_seconds()
    while time.monotonic() - start < max_s:
        time.sleep(step)
        now = d.cpu_seconds()
        quiet = now - last <= idle * step + 0.002
        last = now
        if quiet and time.monotonic() - start >= min_s:
            break
    return last - cpu0 - idle * (time.monotonic() - t0)


# ------------------------------------------------------------------------------------- scenarios
def ingest(name, tmp, scale=1.0, seed=1):
    n = int(200_000 * scale)
    rnd = random.Random(seed)
    ids = list(range(n))
    rel = [rnd.uniform(60_000, 3_600_000) for _ in ids]
    la0 = load1()
    with Server(name, tmp) as d:
        s = Senders(d.client_spec(), ids, rel)
        s.start()
        idle = idle_cpu_rate(d)
        cpu0 = d.cpu_seconds()
        threads0 = thread_cpu_by_name(d.pid)
        t_go = time.monotonic()
        s.go()
        res = s.results()
        threads1 = thread_cpu_by_name(d.pid)  # at the last answer
        srv_cpu = settled_cpu(d, cpu0, t_go, idle)
        threads2 = thread_cpu_by_name(d.pid)  # work left for later included (idle time too)
    _, _, t_start, t_end, sent = merge_sent(res)
    secs = t_end - t_start
    split, settled = thread_split(threads0, threads1, sent), thread_split(threads0, threads2, sent)
    print(f"{name} ingest, server CPU µs/msg by thread, to the last answer: {split}; settled: {settled}", flush=True)
    return dict(
        srv_threads=split,
        srv_threads_settled=settled,
        n=sent,
        secs=round(secs, 2),
        msgs_per_s=round(sent / secs),
        srv_cpu_us_per_msg=round(srv_cpu * 1e6 / sent, 1),
        client_cpu_us_per_msg=round(sum(r["cpu"] for r in res) * 1e6 / sent, 1),
        load0=la0,
        load1=load1(),
    )


def lateness(name, tmp, scale=1.0, seed=2, lead_s=3.0, spread_s=10.0):
    n = int(20_000 * scale)
    rnd = random.Random(seed)
    ids = list(range(n))
    rnd.shuffle(ids)  # due order differs from send order
    rel = [lead_s * 1000.0 + spread_s * 1000.0 * i / n for i in ids]
    la0 = load1()
    with Server(name, tmp) as d:
        spec = d.client_spec()
        cons = Consumer(spec, n, deadline=time.time() + 180 + lead_s + spread_s)
        cons.start()
        s = Senders(spec, ids, rel)
        s.start()
        t0 = s.go()
        sres = s.results()
        cres = cons.results(stop_at=t0 / 1000.0 + lead_s + spread_s + 60.0)
    due, eff, t_start, t_end, _ = merge_sent(sres)
    first, total, uniq = first_receipts(cres)
    out = dict(
        n=n,
        send_s=round(t_end - t_start, 2),
        sent_before_first_due=t_end * 1000.0 <= t0 + lead_s * 1000.0,
        received=uniq,
        lost=n - uniq,
        duplicates=total - uniq,
    )
    out.update(lateness_stats(first, due))
    out.update(lateness_stats(first, eff, "srv_"))
    out.update(load0=la0, load1=load1())
    return out


def burst(name, tmp, scale=1.0, min_lead_s=5.0):
    n = int(100_000 * scale)
    la0 = load1()
    with Server(name, tmp) as d:
        spec = d.client_spec()
        c = make_client(spec)  # probe the ingest rate, so the instant lies after the last ack
        far = time.time() * 1000.0 + 86_400_000
        t = time.time()
        base = 10**11
        for k in range(0, 2000, BATCH):
            js = range(base + k, base + k + BATCH)
            c.send_batch(Chunk(list(js), [int(far)] * BATCH, [make_payload(j) for j in js]))
        rate = 2000 / (time.time() - t)
        c.close()
        lead_s = max(min_lead_s, 1.5 * n / rate + 3.0)
        cons = Consumer(spec, n, deadline=time.time() + lead_s + 300)
        cons.start()
        s = Senders(spec, list(range(n)), [lead_s * 1000.0] * n)
        s.start()
        t0 = s.go()
        sres = s.results()
        cres = cons.results(stop_at=t0 / 1000.0 + lead_s + 60.0 + n / 1000.0)
    due, eff, t_start, t_end, _ = merge_sent(sres)
    first, total, uniq = first_receipts(cres)
    instant = (t0 + lead_s * 1000.0) / 1000.0
    ts = sorted(first.values())
    return dict(
        n=n,
        lead_s=round(lead_s, 1),
        send_s=round(t_end - t_start, 2),
        sent_before_due=t_end <= instant,
        received=uniq,
        lost=n - uniq,
        duplicates=total - uniq,
        first_after_due_ms=round((ts[0] - instant) * 1000.0, 1) if ts else None,
        drain_s=round(ts[-1] - instant, 3) if ts else None,
        load0=la0,
        load1=load1(),
    )


# qdelay's gauges of where its memory is (docs/api.md), read with the RSS: MB each (counts as they are)
MEMORY_GAUGES = (
    *(f"qdelay_{k}" for k in ID_INDEX_MEMORY),
    "qdelay_dedupe_recent_bytes",
    # counts, not bytes: whether RSS was read while the iterate service still lagged
    "qdelay_dedupe_recent_ids",
    "qdelay_iterate_lag_records",
)


def _memory_parts(d) -> dict:
    gauges = getattr(d, "gauges", None)
    if gauges is None:
        return {}
    try:
        got = gauges()
    except OSError:
        return {}
    return {
        g.removeprefix("qdelay_").replace("_bytes", "_mb"): (
            round(got.get(g, 0.0) / 2**20, 2) if g.endswith("_bytes") else int(got.get(g, 0))
        )
        for g in MEMORY_GAUGES
    }


# the recent-id table's smallest size (server/recent_ids.py MIN_SLOTS slots of 32 B), with room
RECENT_SETTLED_BYTES = 64 * 1024


def _settle(d, max_s: float = 30.0, step: float = 0.25) -> float:
    """Seconds waited, after the 2 s every driver gets, until qdelay's housekeeping after a
    burst is done: the iterate service caught up (every id findable in the id index) and
    the idempotent send's table of ids not yet there handed back by its once-a-second
    tidy-up. RSS per *pending* message is a steady-state figure; read 2 s after the last send
    it measured, in half the runs, that table at its burst size (64-128 B an id the iterate
    lagged behind), which is gone a second or two later. Both readings are reported
    (``bytes_per_msg`` settled, ``bytes_per_msg_2s``). A driver without gauges (Redis) is
    read at once; a qdelay that does not settle within ``max_s`` is read as it is."""
    gauges = getattr(d, "gauges", None)
    if gauges is None:
        return 0.0

    def done() -> bool:
        got = gauges()
        return (
            got.get("qdelay_iterate_lag_records", 0) == 0
            and got.get("qdelay_dedupe_recent_ids", 0) == 0
            and got.get("qdelay_dedupe_recent_bytes", 0) <= RECENT_SETTLED_BYTES
        )

    # held 1.2 s: one more tidy-up (the allocator's trim follows the table's)
    return until_steady(done, 1.2, max_s, step)


def memory(name, tmp, scale=1.0, seed=3):
    n = int(1_000_000 * scale)
    rnd = random.Random(seed)
    ids = list(range(n))
    rel = [rnd.uniform(86_400_000, 2 * 86_400_000) for _ in ids]
    la0 = load1()
    with Server(name, tmp) as d:
        time.sleep(0.5)
        rss0 = d.rss_bytes()
        s = Senders(d.client_spec(), ids, rel, procs=2, max_s=300)  # slow servers: bytes/msg of what got in
        s.start()
        s.go()
        res = s.results()
        time.sleep(2.0)
        rss_2s = d.rss_bytes()
        settle_s = _settle(d)
        rss1 = d.rss_bytes()
        parts = _memory_parts(d)
    _, _, t_start, t_end, sent = merge_sent(res)
    return dict(
        **parts,
        n=sent,
        load_s=round(t_end - t_start, 1),
        rss_empty_mb=round(rss0 / 2**20, 1),
        rss_mb=round(rss1 / 2**20, 1),
        bytes_per_msg=round((rss1 - rss0) / max(sent, 1), 1),
        bytes_per_msg_2s=round((rss_2s - rss0) / max(sent, 1), 1),
        settle_s=settle_s,
        load0=la0,
        load1=load1(),
    )


def crash(name, tmp, scale=1.0, seed=4, lo_s=1.0, hi_s=6.0, kill_after_s=2.0):
    n = int(50_000 * scale)
    rnd = random.Random(seed)
    ids = list(range(n))
    rel = [rnd.uniform(lo_s * 1000.0, hi_s * 1000.0) for _ in ids]
    la0 = load1()
    with Server(name, tmp) as d:
        spec = d.client_spec()
        cons = Consumer(spec, n, deadline=time.time() + 300, grace_s=3.0)
        cons.start()
        s = Senders(spec, ids, rel, per_batch_base=True)
        s.start()
        s.go()
        sres = s.results()
        due, eff, t_start, t_end, _ = merge_sent(sres)
        time.sleep(max(0.0, t_end + kill_after_s - time.time()))
        t_kill = time.time()
        d.kill9()
        recovery_s = d.restart()
        cres = cons.results(stop_at=max(max(due.values()) / 1000.0, time.time()) + 60.0)
    first, total, uniq = first_receipts(cres)
    before = sum(1 for t in first.values() if t < t_kill)
    return dict(
        n=n,
        send_s=round(t_end - t_start, 2),
        received_before_kill=before,
        recovery_s=round(recovery_s, 2),
        received=uniq,
        lost=n - uniq,
        duplicates=total - uniq,
        load0=la0,
        load1=load1(),
    )


# the Redis shape each qdelay shape is held to (bench.compare --shapes)
SHAPE_PEERS = {
    "concurrent_aio": "one_per_call8",
    "threads16": "one_per_call8",
    "unary8": "one_per_call8",
    "stub_batch100": "stub_batch100",
}


def shapes(name, tmp, scale=1.0, only=None):
    """Issue 15's producer shapes (bench.shapes), each against a fresh server: qdelay's
    batching clients, a plain generated stub and unary Send (with the bare grpc.aio floor);
    Redis one ZADD per call from 8 processes and a pipeline of 100. Keys pair each qdelay
    shape with the Redis shape it is compared with. ``only``: the qdelay shapes to run (and
    the Redis shapes they are held to); None runs them all."""
    from bench import shapes as sh
    from bench.grpc_floor import start_bare
    from bench.peers import free_port

    payload = 100
    out = dict(load0=load1())
    if name.startswith("qdelay"):
        plan = [
            ("concurrent_aio", "aio64", int(60_000 * scale), 1),
            ("threads16", "threads16", int(30_000 * scale), 1),
            # the same with the producer pinned to one CPU: what the GIL's cross-core handoffs cost
            ("threads16_1cpu", "threads16_1cpu", int(30_000 * scale), 1),
            # 16 messages in flight with no client threads: batches of 16 on one SendStream
            # from a generated stub, one unanswered (16 / the server's answer time: threads16's ceiling)
            ("threads16_ceiling", "stream16", int(30_000 * scale), 1),
            ("stub_batch100", "stub100", int(100_000 * scale), 1),
            ("unary8", "unary", int(8_000 * scale), 8),
        ]
    else:
        n1 = int(24_000 * scale)
        plan = [("one_per_call8", "redis1", n1, 8), ("stub_batch100", "redis100", int(100_000 * scale), 1)]
    if only is not None:
        keep = set(only) | {SHAPE_PEERS[k] for k in only if k in SHAPE_PEERS}
        keep |= {"threads16_1cpu", "threads16_ceiling"} if "threads16" in keep else set()
        plan = [p for p in plan if p[0] in keep]
    first = 0
    for key, kind, n, procs in plan:
        with Server(name, tmp) as d:
            target = f"127.0.0.1:{d.port}" if name.startswith("qdelay") else d.port
            idle = idle_cpu_rate(d, 0.5)
            t0 = time.monotonic()
            res = sh.run(kind, target, n, procs, payload, first, d.cpu_seconds)
            if name.startswith("qdelay"):  # the work left after the last answer counts too
                cpu0 = d.cpu_seconds() - res["srv_cpu_us_per_msg"] * res["n"] / 1e6
                res["srv_cpu_us_per_msg"] = round(settled_cpu(d, cpu0, t0, idle) * 1e6 / res["n"], 1)
        first += n
        for k, v in res.items():
            if k != "n":
                out[f"{key}_{k}"] = v
    if not name.startswith("qdelay"):
        if "one_per_call8_msgs_per_s" in out:
            # Redis's one-per-call figure is what each single-message qdelay shape is held to
            for key in ("concurrent_aio", "threads16", "unary8"):
                out[f"{key}_msgs_per_s"] = out["one_per_call8_msgs_per_s"]
                out[f"{key}_srv_cpu_us_per_msg"] = out["one_per_call8_srv_cpu_us_per_msg"]
    else:
        # each shape's floor: the same producers against a bare grpc.aio server that stores
        # nothing (bench.grpc_floor), so a run says how far gRPC and the client alone get
        floors = [p for p in plan if p[0] in ("threads16", "threads16_ceiling", "stub_batch100", "unary8")]
        for key, kind, n, procs in floors:
            address = f"127.0.0.1:{free_port()}"
            bare = start_bare(address)
            try:
                res = sh.run(kind, address, n, procs, payload, 0, functools.partial(cpu_seconds, bare.pid))
            finally:
                bare.kill()
                bare.wait()
            for k, v in res.items():
                if k != "n":
                    out[f"{key}_floor_{k}"] = v
    out["load1"] = load1()
    return out


SCENARIOS = {
    "ingest": ingest,
    "lateness": lateness,
    "burst": burst,
    "memory": memory,
    "crash": crash,
    "shapes": shapes,
}

# what the issue asks, as ratios of the same run (scenario, metric, how qdelay must compare to redis)
GOALS = [
    ("ingest", "msgs_per_s", "durable ingest >= 3x Redis", lambda q, r: q >= 3 * r, lambda q, r: q / r),
    ("ingest", "srv_cpu_us_per_msg", "server CPU per message <= Redis", lambda q, r: q <= r, lambda q, r: q / r),
    ("lateness", "p99_ms", "lateness p99 <= 5 ms", lambda q, r: q <= 5.0, lambda q, r: q / r if r else None),
    ("burst", "drain_s", "burst drained no slower than Redis", lambda q, r: q <= r, lambda q, r: q / r),
    (
        "memory",
        "bytes_per_msg",
        "RSS per pending message <= 1/20 of Redis",
        lambda q, r: q <= r / 20,
        lambda q, r: q / r,
    ),
    ("crash", "lost", "zero loss after SIGKILL", lambda q, r: q == 0, lambda q, r: None),
    # issue 15: producer shapes (Redis: 8 processes, one ZADD per call; pipeline of 100)
    (
        "shapes",
        "concurrent_aio_msgs_per_s",
        "64 concurrent asyncio send() >= 3x Redis one-ZADD-per-call (8 procs)",
        lambda q, r: q >= 3 * r,
        lambda q, r: q / r,
    ),
    (
        "shapes",
        "concurrent_aio_srv_cpu_us_per_msg",
        "  its server CPU per message <= Redis's",
        lambda q, r: q <= r,
        lambda q, r: q / r,
    ),
    (
        "shapes",
        "threads16_msgs_per_s",
        "blocking send() from 16 threads >= 2x Redis one-ZADD-per-call",
        lambda q, r: q >= 2 * r,
        lambda q, r: q / r,
    ),
    (
        "shapes",
        "stub_batch100_msgs_per_s",
        "generated stub SendBatch 100, full receipts >= 2x Redis pipeline 100",
        lambda q, r: q >= 2 * r,
        lambda q, r: q / r,
    ),
    (
        "shapes",
        "stub_batch100_srv_cpu_us_per_msg",
        "  its server CPU per message <= 1.5x Redis's",
        lambda q, r: q <= 1.5 * r,
        lambda q, r: q / r,
    ),
    (
        "shapes",
        "unary8_msgs_per_s",
        "unary Send, 8 processes (report; floor in the shapes table)",
        lambda q, r: None,
        lambda q, r: q / r,
    ),
]

COLUMNS = {
    "ingest": ["msgs_per_s", "srv_cpu_us_per_msg", "client_cpu_us_per_msg", "secs", "load0", "steal_pct"],
    "lateness": ["p50_ms", "p99_ms", "max_ms", "srv_p99_ms", "lost", "duplicates", "load0", "steal_pct"],
    "burst": ["drain_s", "first_after_due_ms", "lost", "duplicates", "sent_before_due", "load0", "steal_pct"],
    "memory": [
        "bytes_per_msg",
        "bytes_per_msg_2s",
        "settle_s",
        "rss_empty_mb",
        "rss_mb",
        "load_s",
        "load0",
        "steal_pct",
    ],
    "crash": ["lost", "duplicates", "received_before_kill", "recovery_s", "load0", "steal_pct"],
}
# the shapes scenario is printed one row per (server, shape)
SHAPE_ROWS = (
    "concurrent_aio",
    "threads16",
    "threads16_1cpu",
    "threads16_floor",
    "threads16_ceiling",
    "threads16_ceiling_floor",
    "stub_batch100",
    "stub_batch100_floor",
    "unary8",
    "unary8_floor",
    "one_per_call8",
)
SHAPE_COLS = ("msgs_per_s", "srv_cpu_us_per_msg", "client_cpu_us_per_msg", "client_vcsw_per_msg", "secs")


def median_of(runs, key):
    vals = sorted(r[key] for r in runs if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool))
    if not vals:
        return runs[0].get(key) if runs else None
    return vals[len(vals) // 2]


def report(results: dict) -> str:
    texts = []
    for scen, cols in COLUMNS.items():
        if scen not in results:
            continue
        rows = [[drv] + [median_of(runs, c) for c in cols] for drv, runs in results[scen].items()]
        texts.append(print_table(["server", *cols], rows, title=f"### {scen}"))
        print()
    if "shapes" in results:
        rows = []
        for drv, runs in results["shapes"].items():
            for shape in SHAPE_ROWS:
                vals = [median_of(runs, f"{shape}_{c}") for c in SHAPE_COLS]
                redis_shape = shape in ("one_per_call8", "stub_batch100")
                if any(v is not None for v in vals) and (drv == "qdelay" or redis_shape):
                    rows.append([drv, shape, *vals])
        texts.append(print_table(["server", "shape", *SHAPE_COLS], rows, title="### producer shapes (issue 15)"))
        print()
    rows = []
    for scen, key, text, ok, ratio in GOALS:
        runs = results.get(scen, {})
        q = median_of(runs.get("qdelay", []), key)
        r = median_of(runs.get("redis-always", []), key)
        if q is None:
            continue
        met = ok(q, r) if r is not None or scen in ("lateness", "crash") else None
        rat = ratio(q, r) if r not in (None, 0) else None
        rows.append(
            [
                text,
                q,
                r if r is not None else "-",
                round(rat, 3) if rat is not None else "-",
                "yes" if met else ("no" if met is not None else "-"),
            ]
        )
    texts.append(print_table(["goal", "qdelay", "redis-always", "qdelay / redis", "met"], rows, title="### goals"))
    return "\n\n".join(texts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drivers", default="qdelay,redis-always,beanstalkd-f0")
    parser.add_argument("--scenarios", default="ingest,lateness,burst,memory,crash")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every scenario's message count")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--tmp", default=None, help="folder for the servers' data (default: system temp)")
    parser.add_argument("--out", default="compare")
    parser.add_argument(
        "--shapes",
        default="",
        help="the shapes scenario's qdelay shapes to run, comma-separated (e.g. threads16; "
        f"of {','.join(SHAPE_PEERS)}), with the Redis shapes they are held to; default all",
    )
    args = parser.parse_args(argv)
    only_shapes = [k for k in args.shapes.split(",") if k] or None
    if only_shapes is not None and set(only_shapes) - set(SHAPE_PEERS):
        parser.error(f"--shapes: unknown {sorted(set(only_shapes) - set(SHAPE_PEERS))}")
    results: dict = {}
    info = {"machine": machine(), "args": vars(args), "skipped": {}}
    drivers = [d for d in args.drivers.split(",") if d]
    for name in drivers:
        why = DRIVERS[name]().available()
        if why:
            print(f"skipping {name}: {why}", flush=True)
            info["skipped"][name] = why
    drivers = [d for d in drivers if d not in info["skipped"]]
    for rep in range(args.repeat):
        for scen in [s for s in args.scenarios.split(",") if s]:
            for name in drivers:
                print(f"[{rep + 1}/{args.repeat}] {scen} {name} ...", flush=True)
                t = time.time()
                counters = cpu_counters()
                try:
                    if scen == "shapes":
                        res = shapes(name, args.tmp, scale=args.scale, only=only_shapes)
                    else:
                        res = SCENARIOS[scen](name, args.tmp, scale=args.scale)
                except Exception as e:  # noqa: BLE001 - one failed run must not lose the others
                    res = {"error": repr(e)}
                res["wall_s"] = round(time.time() - t, 1)
                res["steal_pct"] = steal_percent(counters)
                print(f"    {res}", flush=True)
                results.setdefault(scen, {}).setdefault(name, []).append(res)
    print()
    text = report(results)
    path = write_json(args.out, {**info, "results": results, "report": text})
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
