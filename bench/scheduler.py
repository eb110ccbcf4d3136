"""Scheduler benchmark: lateness, burst drain, memory per pending message, restart time.

Run: ``python -m bench.scheduler [--quick] [--json FILE] [--only burst,lateness,...]
[--repeat N]``. Every scenario uses a real
Engine on a temporary data folder and an in-process sink that acknowledges everything;
memory and restart run in a child process each so their RSS is not mixed with the others.
Each in-process engine starts as a server does (``server.app.tune_runtime``: the objects
alive then are left out of later full garbage collections; without it, one full collection
of the bench process's heap during a drain took up to ~50 ms, more than a burst's drain).

Goals (issue #3): lateness p99 <= 5 ms for 20,000 messages due over 10 s; 100,000 due at
one instant drained in <= 0.5 s; RSS <= 8 B per far-future pending message and <= 64 B per
message inside the loaded window; restart with 1,000,000 pending in <= 5 s.
Goals (issue #14): a burst to 3 groups drained within 1.5x the one-group time
(``fanout``); lateness p99 <= 5 ms for a live subject while another group holds a due
backlog it does not take, and that backlog drained at >= 200,000 msgs/s once its
consumer's credit returns (``backlog``, in process; 5,000,000 messages); the same lateness
goal against a real server over gRPC while a group holds a due backlog and 1,000 idle
Subscribe streams are open (``isolation``: the backlog is 1,000,000 there, since every
message of it crosses gRPC first).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import queue
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import numpy as np
import psutil

from bench.common import ID_INDEX_MEMORY, percentile, until_steady
from qdelay.segments.idindex import IDLE_FLUSH_BYTES, IdIndex
from qdelay.server import allocator
from qdelay.server.app import tune_runtime
from qdelay.server.config import engine_config
from qdelay.server.consumers import ConsumerRegistry
from qdelay.server.engine import Engine, NewMessage
from qdelay.server.iterate import IDLE_TRIM_EVERY, IDLE_TRIM_FIRST, IDLE_TRIMS


class AckingSink:
    """Records (due, received) of each delivery; a consumer thread acknowledges them, as a
    gRPC consumer's acks arrive from another thread than the dispatcher's."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.lateness: list[float] = []
        self.count = 0
        self.done = threading.Event()  # every expected delivery handed over
        self.all_acked = threading.Event()  # ... and acknowledged
        self.expect = 0
        self.acked = 0
        self._acks: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._ack_loop, name="bench-acker", daemon=True).start()

    def credit(self, subject: str, group: str = "default") -> int:
        return 1_000_000

    def deliver(self, subject: str, group: str, deliveries) -> None:
        # the batch's columns, as the gRPC sink (server/consumers.py) reads them
        now = time.time() * 1000
        self.lateness.extend(now - due for due in deliveries.deliver_at_ms)
        self._acks.put(deliveries.ack_ids)
        self.count += len(deliveries)
        if self.count >= self.expect:
            self.done.set()

    def _ack_loop(self) -> None:
        while True:
            ids = self._acks.get()
            self.acked += self.engine.ack(ids)
            if self.expect and self.acked >= self.expect:
                self.all_acked.set()


def send_all(
    engine: Engine, due_times, batch: int = 1000, payload: bytes = b"x" * 100, subject: str = "bench.sched"
) -> None:
    """Send messages due at ``due_times`` (any iterable: a generator keeps the bench's own
    memory out of the server's RSS figures) in batches."""
    it = iter(due_times)
    i = 0
    while True:
        chunk = [NewMessage(subject, payload, {}, f"m{i + j}", due) for j, due in zip(range(batch), it)]
        if not chunk:
            return
        engine.send_sync(chunk)
        i += len(chunk)


def wait_iterated(engine: Engine, timeout: float = 120) -> None:
    engine.iterate.wait_for(engine.wal.committed_sequence, timeout)


def started_engine(root: str, name: str, expect: int) -> tuple[Engine, AckingSink]:
    """A started engine on ``root/name`` whose sink expects ``expect`` deliveries."""
    tune_runtime()
    engine = Engine(engine_config(data_dir=os.path.join(root, name), cleaner_enabled=False, implicit_group="default"))
    sink = AckingSink(engine)
    sink.expect = expect
    engine.set_sink(sink)
    engine.start()
    return engine, sink


def scenario_lateness(root: str, n: int, span_ms: int) -> dict:
    engine, sink = started_engine(root, "lateness", n)
    start = engine.now_ms() + 3000
    send_all(engine, [start + i * span_ms // n for i in range(n)])
    sink.done.wait(span_ms / 1000 + 30)
    sink.all_acked.wait(30)
    engine.close()
    late = sink.lateness
    return {
        "messages": n,
        "delivered": sink.count,
        "p50_ms": round(percentile(late, 50), 3),
        "p99_ms": round(percentile(late, 99), 3),
        "max_ms": round(max(late), 3),
        "early": sum(1 for x in late if x < 0),
        "goal_p99_ms": 5.0,
    }


def scenario_burst(root: str, n: int) -> dict:
    engine, sink = started_engine(root, "burst", n)
    due = engine.now_ms() + 8000
    send_all(engine, [due] * n)
    wait_iterated(engine)
    proc = psutil.Process()
    cpu0 = proc.cpu_times()
    sink.done.wait(60)
    drained = time.time() * 1000 - due
    sink.all_acked.wait(60)
    acked = time.time() * 1000 - due
    cpu1 = proc.cpu_times()
    engine.close()
    cpu = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
    return {
        "messages": n,
        "delivered": sink.count,
        "drain_s": round(drained / 1000, 3),
        "all_acked_s": round(acked / 1000, 3),
        "cpu_us_per_msg": round(cpu / n * 1e6, 2),
        "goal_drain_s": 0.5,
        "early": sum(1 for x in sink.lateness if x < 0),
    }


class GroupSink:
    """Per (subject, group): counts deliveries and acknowledges them from a consumer thread
    (posting the acks, as the server's Subscribe streams do); a group in ``blocked`` has no
    credit (a consumer that is gone or stuck).

    Credit, hand-over and acks go through the server's own consumer registry
    (``server/consumers.py``: one subscriber per group, a window of 1,000,000), with this
    object standing in for the event loop: the registry's callbacks run on the consumer
    thread, which takes what they pushed to the subscribers' inboxes, tells the registry
    what it acknowledged and posts the acks to the engine. So the scheduler thread does per delivery what it does in a
    server, no more and no less (it used to be a dict entry per ack id here, mirroring the
    registry by hand). Lateness is the bench's own measurement, so the scheduler thread
    keeps only (received at, the batch's due-time column) per batch, and the arithmetic is
    done when asked (``lateness``): a Python expression per delivery, as it was first, cost
    the scheduler thread about as much as the server's own per-delivery work, and an array
    per batch still ~60 ns a delivery per group."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.blocked: set[tuple[str, str]] = set()
        self.counts: dict[tuple[str, str], int] = {}
        self.first: dict[tuple[str, str], float] = {}
        self.last: dict[tuple[str, str], float] = {}
        self._late: dict[tuple[str, str], list[tuple[float, list[int]]]] = {}
        self.registry = ConsumerRegistry(self, ack_timeout_ms=30_000)  # type: ignore[arg-type]
        self._subscribed: set[tuple[str, str]] = set()
        self._subs: list = []  # the registry's Subscriptions, one per (subject, group)
        self._acks: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._ack_loop, name="bench-acker", daemon=True).start()

    def call_soon_threadsafe(self, fn, *args) -> None:
        """The registry asking "the loop" to push the slices handed over to the streams."""
        self._acks.put((fn, args))

    def credit(self, subject: str, group: str) -> int:
        key = (subject, group)
        if key in self.blocked:
            return 0
        if key not in self._subscribed:
            self._subscribed.add(key)
            self._subs.append(self.registry.register(subject, group, 1_000_000, "bench"))
        return self.registry.credit(subject, group)

    def deliver(self, subject: str, group: str, deliveries) -> None:
        now = time.time()
        key = (subject, group)
        self.first.setdefault(key, now)
        self.last[key] = now
        self.counts[key] = self.counts.get(key, 0) + len(deliveries)
        # the column itself (nobody changes a batch's columns in place), not a copy
        self._late.setdefault(key, []).append((now, deliveries.deliver_at_ms))
        self.registry.deliver(subject, group, deliveries)

    def lateness(self, key: tuple[str, str]) -> list[float]:
        """Received - due of every delivery to ``key`` so far (ms)."""
        parts = self._late.get(key)
        if not parts:
            return []
        return np.concatenate([at * 1000 - np.asarray(dues, dtype=np.float64) for at, dues in parts]).tolist()

    def _ack_loop(self) -> None:
        # acks are posted, as the server's event loop posts a stream's acks (post_ack):
        # applied by the scheduler thread, without this thread waiting for its lock
        while True:
            fn, args = self._acks.get()
            fn(*args)  # the registry pushes the slices to the streams' inboxes
            for sub in list(self._subs):
                while sub.inbox:
                    part = sub.inbox.popleft()
                    self.registry.acked(sub, part.ack_ids)
                    self.engine.post_ack(part.ack_ids, sub.subject, sub.group)

    def wait(self, key: tuple[str, str], n: int, timeout: float) -> bool:
        deadline = time.time() + timeout
        while self.counts.get(key, 0) < n and time.time() < deadline:
            time.sleep(0.005)
        return self.counts.get(key, 0) >= n


def _group_engine(root: str, name: str, **cfg) -> tuple[Engine, GroupSink]:
    tune_runtime()
    engine = Engine(engine_config(data_dir=os.path.join(root, name), cleaner_enabled=False, **cfg))
    sink = GroupSink(engine)
    engine.set_sink(sink)
    engine.start()
    return engine, sink


def thread_cpu_s(native_id: int | None) -> float:
    """CPU time of one thread of this process (s): from /proc's schedstat (ns) where there
    is one, else psutil's per-thread times (clock ticks)."""
    if native_id is None:
        return 0.0
    try:
        with open(f"/proc/self/task/{native_id}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except OSError:
        return next((t.user_time + t.system_time for t in psutil.Process().threads() if t.id == native_id), 0.0)


def scenario_fanout(root: str, n: int) -> dict:
    """n messages due at one instant, to 1 group and (another folder) to 3 groups: the
    time until every group has all of them."""
    out: dict = {"messages": n}
    for groups in (1, 3):
        engine, sink = _group_engine(root, f"fanout{groups}")
        names = [f"g{i}" for i in range(groups)]
        for g in names:
            asyncio.run(engine.ensure_group("bench.fan", g))
        due = engine.now_ms() + 8000
        send_all(engine, [due] * n, subject="bench.fan")
        wait_iterated(engine)
        proc = psutil.Process()
        sched_id = engine.scheduler.thread_id()
        cpu0 = proc.cpu_times()
        time.sleep(max(0.0, (due - 100 - engine.now_ms()) / 1000))
        sched0 = thread_cpu_s(sched_id)
        ok = all(sink.wait(("bench.fan", g), n, 60) for g in names)
        drained = max(sink.last[("bench.fan", g)] for g in names) * 1000 - due
        cpu1, sched1 = proc.cpu_times(), thread_cpu_s(sched_id)
        engine.close()
        cpu = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
        out[f"groups{groups}_drain_s"] = round(drained / 1000, 3) if ok else None
        out[f"groups{groups}_cpu_us_per_delivery"] = round(cpu / (n * groups) * 1e6, 2)
        # the scheduler thread's CPU from 100 ms before the due instant to the last
        # delivery: the drain's critical path, less sensitive to the load than its
        # wall-clock time
        out[f"groups{groups}_scheduler_cpu_ms"] = round((sched1 - sched0) * 1000, 1)
    one, three = out["groups1_drain_s"], out["groups3_drain_s"]
    out["ratio_3_to_1"] = round(three / one, 2) if one and three else None
    out["goal_ratio"] = 1.5
    return out


def scenario_backlog(root: str, backlog: int, live: int, span_ms: int) -> dict:
    """A group without credit holds ``backlog`` due messages; meanwhile ``live`` messages
    of another subject fall due over ``span_ms`` (their lateness); then the group's
    credit returns (its drain rate from disk)."""
    engine, sink = _group_engine(root, "backlog")
    stuck, fresh = ("bench.stuck", "idle"), ("bench.live", "live")
    sink.blocked.add(stuck)
    for subject, group in (stuck, fresh):
        asyncio.run(engine.ensure_group(subject, group))
    now = engine.now_ms()
    send_all(engine, (now for _ in range(backlog)), batch=5000, payload=b"x" * 20, subject=stuck[0])
    wait_iterated(engine, 600)
    time.sleep(1.0)  # everything of the backlog is due and has fired
    start = engine.now_ms() + 3000
    send_all(engine, [start + i * span_ms // live for i in range(live)], subject=fresh[0])
    ok = sink.wait(fresh, live, span_ms / 1000 + 30)
    late = sink.lateness(fresh)
    held = engine.groups()
    sink.blocked.discard(stuck)
    t0 = time.time()
    engine.notify_credit()
    drained = sink.wait(stuck, backlog, 300)
    took = time.time() - t0
    engine.close()
    return {
        "backlog": backlog,
        "live": live,
        "live_delivered": sink.counts.get(fresh, 0) if ok else sink.counts.get(fresh, 0),
        "live_p50_ms": round(percentile(late, 50), 3),
        "live_p99_ms": round(percentile(late, 99), 3),
        "idle_group_in_memory": next((g["ready"] for g in held if g["group"] == "idle"), None),
        "idle_group_on_disk": next((g["spilled"] for g in held if g["group"] == "idle"), None),
        "drain_msgs_per_s": round(backlog / took) if drained else None,
        "goal_live_p99_ms": 5.0,
        "goal_drain_msgs_per_s": 200_000,
    }


def settle_index(engine: Engine, max_s: float = 30.0, step: float = 0.25) -> float:
    """Seconds waited until the server's housekeeping after a burst is done, as
    bench.compare's memory reading waits for it: the id index's memtable written out when
    ingest went idle (segments/idindex.py IDLE_FLUSH_BYTES) and the iterate service's idle
    heap trims run (server/iterate.py IDLE_TRIMS). RSS per *pending* message is a
    steady-state figure; read before the idle flush it counted, in some runs, up to 3 MB of
    memtable that a second later is on disk. An engine that does not settle within
    ``max_s`` is read as it is."""
    hold = IDLE_TRIM_FIRST + (IDLE_TRIMS - 1) * IDLE_TRIM_EVERY + 0.25
    return until_steady(lambda: engine.stats().get("id_index_memtable_bytes", 0) < IDLE_FLUSH_BYTES, hold, max_s, step)


def child_memory(data_dir: str, n: int, window: str) -> dict:
    """Run in a child: RSS growth per pending message (window: 'far' or 'near')."""
    # a 10-minute window, so that nothing falls due while the million are sent
    engine = Engine(engine_config(data_dir=data_dir, cleaner_enabled=False, load_ahead_ms=600_000))
    engine.start()
    gc.collect()
    proc = psutil.Process()
    base = proc.memory_info().rss
    now = engine.now_ms()
    rnd = random.Random(3)  # due times drawn uniformly, as the peer benchmarks do
    if window == "far":
        day = 86_400_000
        dues = (now + rnd.randrange(day, 2 * day) for _ in range(n))
    else:
        dues = (now + rnd.randrange(240_000, 540_000) for _ in range(n))
    send_all(engine, dues, batch=2000)
    wait_iterated(engine)
    deadline = time.time() + 60
    while window == "near" and engine.scheduler.stats()["wheel_size"] < n and time.time() < deadline:
        time.sleep(0.1)
    gc.collect()
    time.sleep(0.5)
    rss_unsettled = proc.memory_info().rss
    settle_s = settle_index(engine)
    gc.collect()
    rss_untrimmed = proc.memory_info().rss
    allocator.trim()
    rss = proc.memory_info().rss
    stats = engine.stats()
    engine.close()
    return {
        "pending": n,
        "wheel_size": stats["wheel_size"],
        "rss_base_mb": round(base / 2**20, 1),
        "rss_mb": round(rss / 2**20, 1),
        "bytes_per_msg": round((rss - base) / n, 2),
        "bytes_per_msg_untrimmed": round((rss_untrimmed - base) / n, 2),
        # read 0.5 s after the index caught up, before the idle flush and trims (how this
        # benchmark read it until 26 Nov)
        "bytes_per_msg_unsettled": round((rss_unsettled - base) / n, 2),
        "settle_s": settle_s,
        # where the bytes are (engine.stats(): RocksDB's own figures, the filter's layers)
        **{k.replace("_bytes", "_mb"): round(stats.get(k, 0) / 2**20, 1) for k in ID_INDEX_MEMORY},
        "goal_bytes_per_msg": 8 if window == "far" else 64,
    }


def child_restart(data_dir: str, n: int, lose_index: bool = False, lose_schedule_indexes: bool = False) -> dict:
    """Fill a folder with n pending far-future messages, close, and time a reopen; with
    ``lose_index``, the message-id index is deleted first (rebuilt from the schedule log,
    docs/recovery.md row 14); with ``lose_schedule_indexes``, every schedule segment's
    index file (re-derived from its segment at open, row 15)."""
    engine = Engine(engine_config(data_dir=data_dir, cleaner_enabled=False))
    engine.start()
    now = engine.now_ms()
    day = 86_400_000
    rnd = random.Random(3)
    send_all(engine, (now + rnd.randrange(day, 2 * day) for _ in range(n)), batch=2000)
    wait_iterated(engine)
    engine.close()
    if lose_index:
        IdIndex.destroy(os.path.join(data_dir, "index", "ids"))
    if lose_schedule_indexes:
        for day, _dirs, names in os.walk(os.path.join(data_dir, "schedule")):
            for name in names:
                if name.endswith(".sidx"):
                    os.unlink(os.path.join(day, name))
    t0 = time.perf_counter()
    engine = Engine(engine_config(data_dir=data_dir, cleaner_enabled=False))
    engine.start()
    wait_iterated(engine)
    took = time.perf_counter() - t0
    pending = engine.stats()["pending"]
    notes = list(engine.recovery_notes)
    engine.close()
    return {"pending": pending, "restart_s": round(took, 3), "goal_s": 5.0, "notes": notes}


def run_child(kind: str, root: str, n: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "bench.scheduler", "--child", kind, "--root", root, "--n", str(n)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


SCENARIOS = (
    "lateness",
    "burst",
    "fanout",
    "backlog",
    "isolation",
    "group_ops",
    "memory_far",
    "memory_near",
    "restart",
    "restart_rebuild",
    "restart_reindex",
)


def _median_of(runs: list[dict]) -> dict:
    """Per numeric key, the median over runs."""
    out = {}
    for key, value in runs[0].items():
        if isinstance(value, (int, float)):
            vals = sorted(r[key] for r in runs)
            out[key] = vals[len(vals) // 2]
    return out


def hold_idle_streams(address: str, n: int) -> None:
    """Run in a child (``--idle-streams``): open ``n`` Subscribe streams on subjects that
    get nothing, say ``open`` once the server counts them all as consumers, and hold them
    until stdin closes. A process of their own, as other applications' consumers are: in
    the bench's process their client-side tasks and the gRPC poller would share its GIL
    with the live consumer whose receive time is measured."""

    def opened() -> None:
        print("open", flush=True)

    async def until_stdin_closes() -> None:
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)

    asyncio.run(_hold_idle(address, n, opened, until_stdin_closes))


async def _hold_idle(address: str, n: int, opened, until) -> None:
    """Open ``n`` idle Subscribe streams, call ``opened()`` once the server counts them all
    as consumers, hold them until ``until()`` returns, then close them."""
    from qdelay.client import aio

    async with aio.Client(address) as ac:
        consumers = [ac.subscribe(f"bench.idle.{k}", "waiting", 10) for k in range(n)]
        tasks = [asyncio.ensure_future(c.receive(1, timeout=3600)) for c in consumers]
        while True:
            groups = await ac.groups()
            if sum(g["consumers"] for g in groups if g["subject"].startswith("bench.idle.")) >= n:
                break
            await asyncio.sleep(0.2)
        opened()
        await until()
        for c in consumers:
            await c.close()
        for t in tasks:
            t.cancel()


def _open_idle_streams(address: str, n: int, in_process: bool) -> Callable[[], None]:
    """``n`` idle Subscribe streams held open: by a child process (default), or by a thread
    of this process (``in_process``, as the bench did up to 26 Nov: the live consumer's
    receive time then includes their client-side cost). Returns what closes them, once
    they are closed (so that the next round counts only its own streams)."""
    if n == 0:
        return lambda: None
    if not in_process:
        child = subprocess.Popen(
            [sys.executable, "-m", "bench.scheduler", "--idle-streams", f"{address},{n}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None
        if child.stdout.readline().strip() != "open":
            child.kill()
            raise RuntimeError("the idle streams did not open")

        def close_child() -> None:
            assert child.stdin is not None
            child.stdin.close()
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()

        return close_child
    stop = threading.Event()
    opened = threading.Event()

    async def until_stopped() -> None:
        while not stop.is_set():
            await asyncio.sleep(0.1)

    def idle_loop() -> None:
        asyncio.run(_hold_idle(address, n, opened.set, until_stopped))

    holder = threading.Thread(target=idle_loop, daemon=True)
    holder.start()
    if not opened.wait(120):
        raise RuntimeError("the idle streams did not open")

    def close_thread() -> None:
        stop.set()
        holder.join(30)

    return close_thread


def _live_phase(client, driver, subject: str, live: int, span_ms: int) -> dict:
    """A live consumer of ``subject`` receives ``live`` messages due over ``span_ms``:
    lateness as the server saw it (dispatched - due, first attempts) and as received."""
    from qdelay.client import Outgoing

    server_lateness: list[float] = []
    seen_lateness: list[float] = []
    sub = client.subscribe(subject, "live", max_in_flight=2000)
    sub.receive(1, timeout=0.5)  # the stream (and its group) exists before anything is due
    start = int(time.time() * 1000) + 3000
    client.send_many(
        (Outgoing(subject, b"l" * 100, deliver_at_ms=start + i * span_ms // live) for i in range(live)),
        batch_size=1000,
    )
    proc = psutil.Process(driver.pid)
    cpu0 = proc.cpu_times()
    got = 0
    deadline = time.time() + span_ms / 1000 + 60
    while got < live and time.time() < deadline:
        batch = sub.receive(1, timeout=0.5)  # whatever arrived: one batch, as it comes
        now = time.time() * 1000
        for d in batch:
            if d.attempt == 1:
                server_lateness.append(d.dispatched_at_ms - d.deliver_at_ms)
                seen_lateness.append(now - d.deliver_at_ms)
        got += len(batch)
        sub.ack(batch)
    cpu1 = proc.cpu_times()
    sub.close()
    return {
        "live_delivered": got,
        "live_server_p50_ms": round(percentile(server_lateness, 50), 2),
        "live_server_p99_ms": round(percentile(server_lateness, 99), 2),
        "live_received_p50_ms": round(percentile(seen_lateness, 50), 2),
        "live_received_p99_ms": round(percentile(seen_lateness, 99), 2),
        "server_cpu_s_live_phase": round((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system), 2),
        "load_avg": round(os.getloadavg()[0], 2),
    }


def scenario_isolation(
    root: str,
    backlog: int,
    idle_counts: tuple[int, ...],
    live: int,
    span_ms: int,
    rounds: int = 1,
    idle_in_process: bool = False,
) -> dict:
    """A real server: a group ``idle`` of one subject holds ``backlog`` due messages it
    never takes; then, for each N of ``idle_counts`` in turn (``rounds`` times over), N
    Subscribe streams wait on subjects that get nothing while a live consumer receives
    ``live`` messages due over ``span_ms`` (``_live_phase``): lateness against N, which
    should not grow with it. ``isolation`` is the last N's figures (the issue's goal is
    stated for 1,000); ``by_idle_streams`` has every N's runs and medians."""
    from bench.peers import QdelayDriver
    from qdelay.client import Client, Outgoing

    os.makedirs(root, exist_ok=True)
    driver = QdelayDriver()
    driver.start(root)
    address = f"127.0.0.1:{driver.port}"
    client = Client(address, timeout=600)
    out: dict = {"backlog": backlog, "idle_streams_in_process": idle_in_process, "live": live}
    runs: dict[int, list[dict]] = {n: [] for n in idle_counts}
    try:
        client.create_group("bench.stuck", "idle")
        t0 = time.time()
        msgs = (Outgoing("bench.stuck", b"x" * 20, delay_ms=0) for _ in range(backlog))
        client.send_many(msgs, batch_size=2000, max_in_flight=8, timeout=600)
        out["backlog_send_s"] = round(time.time() - t0, 1)
        for r in range(rounds):
            for n in idle_counts:
                close_idle = _open_idle_streams(address, n, idle_in_process)
                try:
                    held = {g["group"]: g for g in client.groups() if g["subject"] == "bench.stuck"}["idle"]
                    got = _live_phase(client, driver, "bench.live", live, span_ms)
                    got["idle_group_backlog"] = held["backlog"]
                    got["idle_group_backlog_on_disk"] = held["backlog_on_disk_count"]
                finally:
                    close_idle()
                runs[n].append(got)
                print(f"isolation round {r} idle_streams {n}: {got}", file=sys.stderr, flush=True)
        out["by_idle_streams"] = {
            str(n): {"runs": each, "median": _median_of(each)} for n, each in runs.items() if each
        }
        out.update(out["by_idle_streams"][str(idle_counts[-1])]["median"])
        out["idle_streams"] = idle_counts[-1]
        out["server_rss_mb"] = round(driver.rss_bytes() / 2**20, 1)
        out["goal_live_p99_ms"] = 5.0
    finally:
        client.close()
        driver.stop()
    return out


def scenario_group_ops(root: str, sizes: tuple[int, ...] = (10, 1000)) -> dict:
    """A real server: what creating and deleting a consumer group (ChangeGroup: a GROUP
    record, group-committed) and reading Stats cost, with N groups existing already; Stats
    unfiltered (it lists every group) and narrowed to one group (StatsRequest.subject and
    .group); p50 / p99 of one call at a time."""
    from bench.peers import QdelayDriver
    from qdelay.client import Client

    out: dict = {}
    for n in sizes:
        os.makedirs(os.path.join(root, f"g{n}"), exist_ok=True)
        driver = QdelayDriver()
        driver.start(os.path.join(root, f"g{n}"))
        client = Client(f"127.0.0.1:{driver.port}", timeout=60)
        try:
            for k in range(n):
                client.create_group(f"bench.groups.{k % 100}", f"g{k}")
            create, delete, stats, one = [], [], [], []
            for k in range(200):
                t0 = time.perf_counter()
                client.create_group("bench.groups.new", f"n{k}")
                t1 = time.perf_counter()
                client.delete_group("bench.groups.new", f"n{k}")
                t2 = time.perf_counter()
                client.stats()
                t3 = time.perf_counter()
                client.stats(subject="bench.groups.7", group="g7")
                t4 = time.perf_counter()
                create.append((t1 - t0) * 1000)
                delete.append((t2 - t1) * 1000)
                stats.append((t3 - t2) * 1000)
                one.append((t4 - t3) * 1000)
            out[f"groups{n}"] = {
                name: {"p50_ms": round(percentile(v, 50), 3), "p99_ms": round(percentile(v, 99), 3)}
                for name, v in (("create", create), ("delete", delete), ("stats", stats), ("stats_one_group", one))
            }
        finally:
            client.close()
            driver.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller counts (a smoke run)")
    ap.add_argument("--json-part", help=argparse.SUPPRESS)  # a child running one scenario
    ap.add_argument("--pending", type=int, default=0, help="messages of the memory and restart scenarios (1,000,000)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--only", default="", help="comma-separated subset: " + ",".join(SCENARIOS))
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run each chosen in-process scenario N times and add the median (burst, lateness, fanout)",
    )
    ap.add_argument(
        "--idle-counts",
        default="",
        help="isolation: numbers of idle Subscribe streams to measure against, in turn (0,100,1000; quick 0,100)",
    )
    ap.add_argument("--isolation-rounds", type=int, default=1, help="isolation: rounds over the idle counts")
    ap.add_argument(
        "--idle-in-process",
        action="store_true",
        help="isolation: hold the idle streams in a thread of the bench's process (as before 26 Nov), not a child",
    )
    ap.add_argument("--idle-streams", help=argparse.SUPPRESS)  # a child holding ADDRESS,N idle streams
    args = ap.parse_args()
    if args.idle_streams:
        address, n = args.idle_streams.rsplit(",", 1)
        hold_idle_streams(address, int(n))
        return
    if args.child:
        path = os.path.join(args.root, args.child)
        if args.child in ("restart", "restart_rebuild", "restart_reindex"):
            print(
                json.dumps(
                    child_restart(
                        path,
                        args.n,
                        lose_index=args.child == "restart_rebuild",
                        lose_schedule_indexes=args.child == "restart_reindex",
                    )
                )
            )
        else:
            print(json.dumps(child_memory(path, args.n, args.child)))
        return
    big = args.pending or (100_000 if args.quick else 1_000_000)
    idle_counts = tuple(int(x) for x in (args.idle_counts or ("0,100" if args.quick else "0,100,1000")).split(","))
    wanted = [n for n in args.only.split(",") if n] or list(SCENARIOS)
    unknown = sorted(set(wanted) - set(SCENARIOS))
    if unknown:
        ap.error(f"unknown scenario(s): {', '.join(unknown)}")
    root = tempfile.mkdtemp(prefix="qdelay-bench-")
    runs = {
        "lateness": lambda i: scenario_lateness(os.path.join(root, f"r{i}"), 20_000, 10_000),
        "burst": lambda i: scenario_burst(os.path.join(root, f"r{i}"), 100_000),
        "fanout": lambda i: scenario_fanout(os.path.join(root, f"r{i}"), 100_000),
        "backlog": lambda i: scenario_backlog(os.path.join(root, f"r{i}"), 5 * big, 20_000, 10_000),
        "group_ops": lambda i: scenario_group_ops(os.path.join(root, f"r{i}"), (10, 100 if args.quick else 1000)),
        "isolation": lambda i: scenario_isolation(
            os.path.join(root, f"r{i}"),
            big,
            idle_counts,
            20_000,
            10_000,
            rounds=args.isolation_rounds,
            idle_in_process=args.idle_in_process,
        ),
        "memory_far": lambda i: run_child("far", os.path.join(root, f"r{i}"), big),
        "memory_near": lambda i: run_child("near", os.path.join(root, f"r{i}"), big),
        "restart": lambda i: run_child("restart", os.path.join(root, f"r{i}"), big),
        "restart_rebuild": lambda i: run_child("restart_rebuild", os.path.join(root, f"r{i}"), big),
        "restart_reindex": lambda i: run_child("restart_reindex", os.path.join(root, f"r{i}"), big),
    }
    if len(wanted) > 1 and not args.json_part:
        # one process per scenario: an earlier scenario's engines, threads and heap in the
        # same process made a later one's figures worse (a 5 M backlog's live p99: 63 ms
        # after lateness, burst and fanout in one process, 5.5 ms alone, same load)
        results = {"load_avg_before": os.getloadavg()}
        for name in [n for n in SCENARIOS if n in wanted]:
            with tempfile.NamedTemporaryFile("r", suffix=".json") as part:
                cmd = [sys.executable, "-m", "bench.scheduler", "--only", name, "--repeat", str(args.repeat)]
                cmd += (["--quick"] if args.quick else []) + (["--pending", str(args.pending)] if args.pending else [])
                cmd += ["--idle-counts", ",".join(map(str, idle_counts))]
                cmd += ["--isolation-rounds", str(args.isolation_rounds)]
                cmd += ["--idle-in-process"] if args.idle_in_process else []
                subprocess.run(cmd + ["--json-part", part.name], check=True, stdout=subprocess.DEVNULL)
                results[name] = json.load(part)[name]
            print(f"{name:16s} {results[name]}", flush=True)
        results["load_avg_after"] = os.getloadavg()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
        return
    try:
        results = {"load_avg_before": os.getloadavg()}
        for name in SCENARIOS:
            if name not in wanted:
                continue
            repeat = args.repeat if name in ("lateness", "burst", "fanout") else 1
            if repeat <= 1:
                results[name] = runs[name](0)
                continue
            # each run on its own folder; the median smooths a machine shared with others
            each = [runs[name](i) for i in range(repeat)]
            results[name] = {"runs": each, "median": _median_of(each)}
        results["load_avg_after"] = os.getloadavg()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for name, r in results.items():
        print(f"{name:16s} {r}")
    if args.json or args.json_part:
        with open(args.json or args.json_part, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
