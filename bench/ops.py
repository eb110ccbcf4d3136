"""The operations no other benchmark varies against what could make them grow.

    python -m bench.ops [--only observe,consumer,inspect,reschedule] [--groups 10,1000,5000]
                        [--subjects 10,1000,5000] [--backlogs 0,20000,200000]
                        [--records 10000,100000,300000] [--pending 0,1000000]
                        [--rounds 1] [--base-pythonpath DIR] [--calls 100] [--json FILE]

Real servers (``qdelay server``, sync flush, the defaults) on 127.0.0.1 with temporary
folders; every figure is one call at a time unless said otherwise. Per scenario:

- ``observe``: Stats (every group; and narrowed to one group), a scrape of the metrics
  endpoint (``--metrics-listen``: its bytes too) and the gRPC health check, ``--calls``
  each, p50/p99 and the server's CPU per call, (a) against G groups existing (over G/10
  subjects; ``--groups``), on one server, and (b) on a fresh server, against K subjects
  each holding one due message for their first group (no group yet: what the timer keeps
  per subject; ``--subjects``).
- ``consumer``: for each backlog B of ``--backlogs``, on one server, a subject with two
  groups, ``g`` and ``h``, and B + 5,000 messages due at once (both groups hold them):
  a consumer of ``g`` takes B deliveries and holds them unacknowledged; with those in
  flight, Get and Cancel (``--calls`` each, one at a time) of far-future messages of
  another subject (each asks whether its message is in flight), and Get of messages of
  the subject's own minute (the one the B are out in); the Subscribe's setup
  (open to first delivery, credit 10) on ``h`` against its backlog of B + 5,000, and on
  an unrelated subject with one due message (the yardstick); ``Consumer.add_credit`` on
  ``h``: a consumer holding its whole credit (1) raises it by 10, ms until those 10
  deliveries arrive (median of 5); then a second consumer of
  ``g`` receives and acknowledges the 5,000 others (credit 100, one ack request a batch):
  deliveries/s and the server's CPU per delivery against B in flight in the same group;
  the health check's p50/p99 during that drain against an idle server's; then
  ``ChangeGroup`` DELETE of ``h`` (holding B + 5,000 due, on disk past
  ``group_max_ready``) and of ``g`` (B in flight): the call, its server CPU, and how
  long the server stays busy after it (0.5 s is the floor of that wait).
- ``inspect``: for each N of ``--records``, a fresh server given N messages due in one
  minute a day ahead, stopped; then ``qdelay inspect`` (its code, in process, output to
  /dev/null) on the folder: ``ls``, ``verify``, ``stats``, ``find --id`` (a message in
  the middle), ``find --sequence`` and ``dump --limit 10``: seconds, and µs per record
  where the command reads them all.
- ``reschedule``: for each N of ``--pending`` (far-future messages, a day and more
  ahead, each with its own id), on one server: Reschedule by id and by receipt, (a) one
  call at a time through a ``batching=False`` client (a unary Reschedule each: p50 and
  the server's CPU a call) and (b) from 64 asyncio tasks (``qdelay.aio``: its batcher
  gathers them into RescheduleBatch calls; calls/s and the server's CPU a call), each
  phase on messages sent for it at that level over 50 minutes of a day of their own (the
  same shape at every N), and the iterate service's steps a call (``qdelay_iterate_steps``:
  by id, a lookup after a reschedule waits for the service to have copied it).
  ``--rounds`` fresh servers; ``--base-pythonpath DIR`` alternates them with servers whose
  ``qdelay`` package comes from DIR (``pip install --no-deps --target DIR <checkout>``):
  a same-run A/B.

A cost that grows with N where the work does not is printed as the ratio of the largest
level's figure to the smallest's, same run. Writes bench/out/ops.json (or ``--json``).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

from bench.common import Meter, cpu_seconds, machine, median, percentile, print_table, until_idle, write_json
from bench.peers import QdelayDriver
from qdelay.client import Client, Outgoing
from qdelay.server.service import MAX_IN_FLIGHT_CAP
from qdelay.tools import inspect as inspect_tool
from qdelay.v1 import qdelay_pb2 as pb

DAY_MS = 86_400_000
DRAIN = 5_000  # deliveries acknowledged in the consumer scenario, whatever B


def _calls(pid: int, call: Callable[[], object], n: int, whole_process: bool = False) -> dict[str, float]:
    """``call()`` ``n`` times, one at a time: p50/p99 ms and the server's CPU µs a call.

    ``whole_process``: the CPU from the process's counters (10 ms ticks: ±100 µs a call
    over 100 calls) instead of its threads' (``Meter``), which leave out a thread that
    starts and ends inside the block, as the metrics endpoint's thread per request does."""
    lat = []
    cpu0 = cpu_seconds(pid)
    with Meter(pid) as m:
        for _ in range(n):
            t0 = time.perf_counter()
            call()
            lat.append((time.perf_counter() - t0) * 1000)
    cpu = cpu_seconds(pid) - cpu0 if whole_process else m.cpu
    return {"p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99), "cpu_us": cpu / n * 1e6}


def _wait(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"bench.ops: timed out waiting for {what}")
        time.sleep(0.02)


class _Server:
    """A QdelayDriver in a temporary folder, with a client and its metrics URL."""

    def __init__(self, tmp: str, extra: list[str] | None = None, env: dict[str, str] | None = None) -> None:
        self.driver = QdelayDriver(extra=extra)
        self.driver.env = env
        self.driver.start(tmp)
        self.pid = self.driver.pid
        self.address = f"127.0.0.1:{self.driver.port}"
        self.metrics_url = f"http://127.0.0.1:{self.driver.metrics_port}/metrics"
        self.client = Client(self.address, timeout=300)
        self.client.wait_ready()
        self.data_dir = os.path.join(tmp, "data")

    def scrape(self) -> int:
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            return len(r.read())

    def stop(self) -> None:
        self.client.close()
        self.driver.stop()


# --- observe ---------------------------------------------------------------------------------


def _observe_row(s: _Server, axis: str, n: int, calls: int, one: tuple[str, str]) -> dict:
    until_idle(s.pid, 60.0)
    c = s.client
    row: dict = {"axis": axis, "n": n}
    stats_all = _calls(s.pid, lambda: c.stub.Stats(pb.StatsRequest(), timeout=30), calls)
    stats_one = _calls(s.pid, lambda: c.stub.Stats(pb.StatsRequest(subject=one[0], group=one[1]), timeout=30), calls)
    scrape = _calls(s.pid, s.scrape, calls, whole_process=True)
    health = _calls(s.pid, c.health, calls)
    master = _calls(s.pid, lambda: c.health(service="qdelay.master"), calls)  # the writes' name
    figures = (("stats_all", stats_all), ("stats_one", stats_one), ("scrape", scrape), ("health", health))
    for name, fig in (*figures, ("health_master", master)):
        for k, v in fig.items():
            row[f"{name}_{k}"] = v
    row["scrape_bytes"] = s.scrape()
    row["groups_listed"] = len(c.stub.Stats(pb.StatsRequest(), timeout=30).groups)
    print(row, flush=True)
    return row


def observe(group_levels: list[int], subject_levels: list[int], calls: int) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="qdelay-bench-ops-") as tmp:
        s = _Server(tmp)
        try:
            made = 0
            s.client.create_group("ops.obs.0", "g0")
            made = 1
            for level in group_levels:
                for k in range(made, level):  # G groups over G/10 subjects
                    s.client.create_group(f"ops.obs.{k // 10}", f"g{k}")
                made = max(made, level)
                rows.append(_observe_row(s, "groups", made, calls, ("ops.obs.0", "g0")))
        finally:
            s.stop()
    with tempfile.TemporaryDirectory(prefix="qdelay-bench-ops-") as tmp:
        s = _Server(tmp)
        try:
            s.client.create_group("ops.keep", "g")  # the narrowed Stats has a group to find
            made = 0
            for level in subject_levels:
                if level > made:
                    # one message due now to each new subject: no group takes it, the
                    # server keeps it for the subject's first group
                    s.client.send_many(
                        (Outgoing(f"ops.sub.{k}", b"x" * 100, delay_ms=0) for k in range(made, level)),
                        batch_size=1000,
                        max_in_flight=4,
                    )
                    made = level
                rows.append(_observe_row(s, "subjects", made, calls, ("ops.keep", "g")))
        finally:
            s.stop()
    return rows


# --- consumer --------------------------------------------------------------------------------


def _setup_ms(c: Client, subject: str, group: str) -> float:
    """Open a Subscribe (credit 10) and wait for its first delivery; ms. Closed after
    (what it held goes back to the group)."""
    t0 = time.perf_counter()
    sub = c.subscribe(subject, group, max_in_flight=10)
    try:
        got = sub.receive(1, timeout=30)
        took = (time.perf_counter() - t0) * 1000
        if not got:
            raise SystemExit(f"bench.ops: no delivery on {subject}/{group} within 30 s")
    finally:
        sub.close()
    return took


def _credit_ms(c: Client, subject: str, group: str, rounds: int = 5) -> float:
    """A consumer holding its whole credit (1) raises it by 10 with ``add_credit``: ms from
    the call to the 10 deliveries it allows, median of ``rounds``. Closed after."""
    sub = c.subscribe(subject, group, max_in_flight=1)
    try:
        if not sub.receive(1, timeout=30):
            raise SystemExit(f"bench.ops: no delivery on {subject}/{group} within 30 s")
        lat, credit = [], 1
        for _ in range(rounds):
            credit += 10
            t0 = time.perf_counter()
            sub.add_credit(credit)
            got, deadline = 0, time.monotonic() + 30
            while got < 10 and time.monotonic() < deadline:
                got += len(sub.receive(10 - got, timeout=5))
            if got < 10:
                raise SystemExit(f"bench.ops: add_credit on {subject}/{group} let {got} of 10 through")
            lat.append((time.perf_counter() - t0) * 1000)
    finally:
        sub.close()
    return percentile(lat, 50)


def _health_during(c: Client, stop: threading.Event) -> list[float]:
    lat = []
    while not stop.is_set():
        t0 = time.perf_counter()
        c.health()
        lat.append((time.perf_counter() - t0) * 1000)
        time.sleep(0.002)
    return lat


def _consumer_level(s: _Server, b: int, calls: int, far: list) -> dict:
    c = s.client
    subject = f"ops.con.{b}"
    live = f"ops.live.{b}"
    c.create_group(subject, "g")
    c.create_group(subject, "h")
    total = b + DRAIN
    sent = list(
        c.send_many(
            (Outgoing(subject, b"x" * 100, delay_ms=0, message_id=f"c{b}.{i}") for i in range(total)),
            batch_size=1000,
            max_in_flight=8,
        )
    )
    c.send(live, b"x" * 100, delay_ms=0)
    c.create_group(live, "g")

    def group(name: str) -> dict:
        got = c.groups(subject=subject, group=name)
        return got[0] if got else {}

    _wait(lambda: group("h").get("backlog") == total, 120, f"{total} due in {subject}")
    until_idle(s.pid, 60.0)
    row: dict = {"backlog": b, "on_disk": group("h").get("backlog_on_disk_count", 0)}
    idle = _calls(s.pid, c.health, calls)
    row["health_idle_p50_ms"], row["health_idle_p99_ms"] = idle["p50_ms"], idle["p99_ms"]
    # B deliveries of g taken and held unacknowledged (a stream's credit is capped at
    # MAX_IN_FLIGHT_CAP: as many streams as that takes)
    holders = []
    for start in range(0, b, MAX_IN_FLIGHT_CAP):
        want = min(MAX_IN_FLIGHT_CAP, b - start)
        holder = c.subscribe(subject, "g", max_in_flight=want)
        holders.append(holder)
        held, deadline = 0, time.monotonic() + 120
        while held < want and time.monotonic() < deadline:
            held += len(holder.receive(want - held, timeout=5))
    if b:
        _wait(lambda: group("g").get("in_flight", 0) >= b, 60, f"{b} in flight")
    row["in_flight"] = in_flight = group("g").get("in_flight", 0)
    until_idle(s.pid, 60.0)
    # Get and Cancel of far-future messages (nothing to do with g) while B are in flight:
    # each asks whether its message is in flight
    targets = itertools.cycle(far[:calls])
    got_far = _calls(s.pid, lambda: c.get(next(targets)), calls)
    row["get_far_p50_ms"], row["get_far_cpu_us"] = got_far["p50_ms"], got_far["cpu_us"]
    # and Get of messages of the minute being delivered, spread over all B + DRAIN (in
    # flight or not): each asks about the minute the B deliveries are out in
    busy = itertools.cycle(sent[:: max(1, total // calls)][:calls])
    got_busy = _calls(s.pid, lambda: c.get(next(busy)), calls)
    row["get_busy_p50_ms"], row["get_busy_cpu_us"] = got_busy["p50_ms"], got_busy["cpu_us"]
    lat = []
    with Meter(s.pid) as m:
        for r in far[calls : 2 * calls]:
            t0 = time.perf_counter()
            if c.cancel(r) != "CANCELLED":
                raise SystemExit("bench.ops: a far-future message was not cancelled")
            lat.append((time.perf_counter() - t0) * 1000)
    del far[calls : 2 * calls]
    row["cancel_far_first_ms"], row["cancel_far_p50_ms"] = lat[0], percentile(lat, 50)
    row["cancel_far_cpu_us"] = m.cpu / len(lat) * 1e6
    # Subscribe setup on h, which holds all B + DRAIN (after the Get and Cancel above: a
    # consumer's close gives back what it held, which builds g's in-flight index if on g)
    row["setup_ms"] = min(_setup_ms(c, subject, "h") for _ in range(3))
    row["setup_other_ms"] = min(_setup_ms(c, live, "g") for _ in range(3))
    # Consumer.add_credit on h (its backlog B + DRAIN, g's B in flight on the server)
    row["add_credit_ms"] = _credit_ms(c, subject, "h")
    # the other DRAIN received and acknowledged by a second consumer of g, health probed meanwhile
    drainer = c.subscribe(subject, "g", max_in_flight=100)
    stop = threading.Event()
    health: list[float] = []
    prober = threading.Thread(target=lambda: health.extend(_health_during(c, stop)))
    got = 0
    with Meter(s.pid) as m:
        prober.start()
        deadline = time.monotonic() + 120
        while got < DRAIN and time.monotonic() < deadline:
            batch = drainer.receive(1, timeout=5)
            drainer.ack(batch)
            got += len(batch)
        _wait(lambda: group("g").get("in_flight", 0) <= in_flight, 60, "acks applied")
        stop.set()
        prober.join()
    row["drained"] = got
    row["drain_per_s"] = got / m.wall
    row["drain_cpu_us"] = m.cpu / max(1, got) * 1e6
    row["health_busy_p50_ms"] = percentile(health, 50)
    row["health_busy_p99_ms"] = percentile(health, 99)
    drainer.close()
    until_idle(s.pid, 60.0)
    # the yardstick: deleting an empty group of another subject, same moment (median of 5)
    empty = []
    for k in range(5):
        c.create_group(f"ops.empty.{b}", f"e{k}")
        with Meter(s.pid) as m:
            c.delete_group(f"ops.empty.{b}", f"e{k}")
        empty.append(m.wall * 1000)
    row["delete_empty_ms"] = percentile(empty, 50)
    for name, key in (("h", "delete_backlog"), ("g", "delete_in_flight")):
        with Meter(s.pid) as m:
            if not c.delete_group(subject, name):
                raise SystemExit(f"bench.ops: {subject}/{name} was not deleted")
        row[f"{key}_ms"], row[f"{key}_cpu_ms"] = m.wall * 1000, m.cpu * 1000
        # what the server does after answering (0.5 s of idle is the floor of this wait)
        row[f"{key}_settle_s"] = until_idle(s.pid, 60.0)
    for holder in holders:
        holder.close(timeout=10)
    c.delete_group(live, "g")
    print(row, flush=True)
    return row


def consumer(backlogs: list[int], calls: int) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="qdelay-bench-ops-") as tmp:
        s = _Server(tmp)
        try:
            due = int(time.time() * 1000) + DAY_MS
            far = list(
                s.client.send_many(
                    (Outgoing("ops.far", b"x" * 100, deliver_at_ms=due) for _ in range(calls * (1 + len(backlogs)))),
                    batch_size=1000,
                )
            )
            return [_consumer_level(s, b, calls, far) for b in backlogs]
        finally:
            s.stop()


# --- inspect ---------------------------------------------------------------------------------

_INSPECT = argparse.ArgumentParser(prog="qdelay inspect")
inspect_tool.add_arguments(_INSPECT)


def _inspect(argv: list[str]) -> float:
    args = _INSPECT.parse_args(argv)
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
        t0 = time.perf_counter()
        code = inspect_tool.run(args)
        took = time.perf_counter() - t0
    if code not in (0, None):
        raise SystemExit(f"bench.ops: qdelay inspect {' '.join(argv)} exited {code}")
    return took


def _filled_folder(tmp: str, n: int) -> tuple[str, Any]:
    """A server's data folder holding ``n`` messages due in one minute a day ahead, the
    server stopped; and the receipt of the message in the middle."""
    s = _Server(tmp)
    try:
        due = (int(time.time() * 1000) // 60_000 + 1) * 60_000 + DAY_MS
        receipts = s.client.send_many(
            (Outgoing("ops.ins", b"x" * 100, deliver_at_ms=due + i % 60_000, message_id=f"i{i}") for i in range(n)),
            batch_size=1000,
            max_in_flight=8,
        )
        middle = receipts[n // 2]
        _wait(lambda: s.client.stats()["iterate_lag_bytes"] == 0, 120, "the schedule log")
        until_idle(s.pid, 60.0)
    finally:
        s.stop()
    return s.data_dir, middle


def inspect(levels: list[int]) -> list[dict]:
    rows = []
    for n in levels:
        with tempfile.TemporaryDirectory(prefix="qdelay-bench-ops-") as tmp:
            data_dir, middle = _filled_folder(tmp, n)
            d = ["--data-dir", data_dir]
            size = sum(os.path.getsize(os.path.join(r, f)) for r, _d, fs in os.walk(data_dir) for f in fs)
            row: dict = {"records": n, "folder_mb": size / 1e6}
            for name, argv in (
                ("ls", ["ls", *d]),
                ("verify", ["verify", *d]),
                ("stats", ["stats", *d]),
                ("find_id", ["find", *d, "--id", middle.message_id]),
                ("find_sequence", ["find", *d, "--sequence", str(middle.sequence)]),
                ("dump10", ["dump", *d, "--limit", "10"]),
            ):
                row[f"{name}_s"] = min(_inspect(argv) for _ in range(2))
                row[f"{name}_us"] = row[f"{name}_s"] / n * 1e6
            rows.append(row)
            print(row, flush=True)
    return rows


# --- main ------------------------------------------------------------------------------------


# --- reschedule --------------------------------------------------------------------------


MOVE_MINUTES = 50  # the measured targets of every level lie over this many minutes
MOVE_MANY = 3_000  # targets of each 64-task phase
MOVE_TASKS = 64


def _steps(driver: QdelayDriver) -> float:
    return driver.gauges().get("qdelay_iterate_steps_total", float("nan"))


def _fill_far(c: Client, n: int, base: int, tag: str) -> None:
    """``n`` pending messages a day and more ahead (``base``), one id each."""
    msgs = (
        Outgoing("bench.fill", b"x" * 100, deliver_at_ms=base + i % (300 * 60_000), message_id=f"{tag}{i}")
        for i in range(n)
    )
    c.send_many(msgs, batch_size=1000, max_in_flight=8, timeout=600)


def _move_targets(c: Client, n: int, day: int, tag: str) -> list:
    """``n`` messages sent now over MOVE_MINUTES minutes of ``day`` (ms): their receipts."""
    per = max(1, n // MOVE_MINUTES)
    msgs = [
        Outgoing("bench.move", b"x" * 100, deliver_at_ms=day + (i // per) * 60_000 + i % 60_000, message_id=f"{tag}{i}")
        for i in range(n)
    ]
    return list(c.send_many(msgs, batch_size=1000, max_in_flight=8, timeout=600))


def _reschedule_level(s: _Server, n: int, calls: int, day: int) -> dict:
    import asyncio

    from qdelay import aio

    c, row = s.client, {"n": n}
    sets = {
        name: _move_targets(c, count, day, f"{name}.{n}.")
        for name, count in (
            ("one_id", calls),
            ("one_receipt", calls),
            ("many_id", MOVE_MANY),
            ("many_receipt", MOVE_MANY),
        )
    }
    until_idle(s.pid, 120.0)
    later = day + 7 * DAY_MS
    with Client(s.address, timeout=60, batching=False) as unary:
        unary.wait_ready()
        for name in ("one_id", "one_receipt"):
            targets = iter([r.message_id if name == "one_id" else r for r in sets[name]])
            steps0 = _steps(s.driver)
            fig = _calls(
                s.pid, lambda t=targets: _moved(unary.reschedule(next(t), deliver_at_ms=later)), len(sets[name])
            )
            row[f"{name}_steps"] = (_steps(s.driver) - steps0) / len(sets[name])
            row.update({f"{name}_{k}": v for k, v in fig.items()})

    async def many(targets: list) -> None:
        async with aio.Client(s.address, timeout=120) as ac:
            await ac.wait_ready()
            it = iter(targets)

            async def worker() -> None:
                for t in it:
                    _moved(await ac.reschedule(t, deliver_at_ms=later))

            await asyncio.gather(*(worker() for _ in range(MOVE_TASKS)))

    for name in ("many_id", "many_receipt"):
        targets = [r.message_id if name == "many_id" else r for r in sets[name]]
        until_idle(s.pid, 60.0)
        steps0 = _steps(s.driver)
        with Meter(s.pid) as m:
            asyncio.run(many(targets))
        row[f"{name}_per_s"] = len(targets) / m.wall
        row[f"{name}_cpu_us"] = m.cpu / len(targets) * 1e6
        row[f"{name}_steps"] = (_steps(s.driver) - steps0) / len(targets)
    row["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    print(row, flush=True)
    return row


def _moved(answer: tuple) -> None:
    if answer[0] != "RESCHEDULED":
        raise SystemExit(f"bench.ops: a reschedule answered {answer[0]}")


def reschedule(levels: list[int], calls: int, rounds: int, base_pythonpath: str | None) -> list[dict]:
    """Per round, per server ("new": this tree; "base": ``base_pythonpath``, alternating),
    per level: the figures of ``_reschedule_level``."""
    rows = []
    variants = [("new", None)] + ([("base", base_pythonpath)] if base_pythonpath else [])
    for k in range(rounds):
        for name, path in variants:
            with tempfile.TemporaryDirectory(prefix="qdelay-bench-move-") as tmp:
                driver_env = dict(os.environ, PYTHONPATH=path) if path else None
                s = _Server(tmp, env=driver_env)
                try:
                    now_min = int(time.time() * 1000) // 60_000 * 60_000
                    filled = 0
                    for level_no, n in enumerate(levels):
                        _fill_far(s.client, n - filled, now_min + DAY_MS + filled, f"f{filled}.")
                        filled = n
                        row = _reschedule_level(s, n, calls, now_min + (10 + 10 * level_no) * DAY_MS)
                        row.update(server=name, round=k)
                        rows.append(row)
                finally:
                    s.stop()
    return rows


def _ints(text: str) -> list[int]:
    return sorted(int(x) for x in text.split(",") if x)


def _ratio(rows: list[dict], key: str) -> float:
    lo, hi = rows[0].get(key), rows[-1].get(key)
    return hi / lo if lo else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ops", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--only", default="observe,consumer,inspect", help="comma-separated: observe,consumer,inspect,reschedule"
    )
    ap.add_argument("--groups", default="10,1000,5000", help="observe: groups G, ascending")
    ap.add_argument("--subjects", default="10,1000,5000", help="observe: subjects K holding a due message, ascending")
    ap.add_argument("--backlogs", default="0,20000,200000", help="consumer: due backlog B per group, ascending")
    ap.add_argument("--records", default="10000,100000,300000", help="inspect: records N in the folder, ascending")
    ap.add_argument("--calls", type=int, default=100, help="calls of each kind per level (observe, health)")
    ap.add_argument("--pending", default="0,1000000", help="reschedule: pending messages N, ascending")
    ap.add_argument("--rounds", type=int, default=1, help="reschedule: fresh servers (each variant)")
    ap.add_argument("--base-pythonpath", help="reschedule: alternate with servers whose qdelay package is in DIR")
    ap.add_argument("--json", default="ops", help="output name under bench/out, or a path")
    args = ap.parse_args(argv)
    wanted = [w for w in args.only.split(",") if w]
    unknown = set(wanted) - {"observe", "consumer", "inspect", "reschedule"}
    if unknown:
        ap.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    out: dict = {"machine": machine()}
    load0 = os.getloadavg()
    if "observe" in wanted:
        rows = out["observe"] = observe(_ints(args.groups), _ints(args.subjects), args.calls)
        print_table(
            [
                "axis",
                "N",
                "Stats all p50 ms",
                "µs CPU",
                "Stats one p50 ms",
                "scrape p50 ms",
                "µs CPU",
                "scrape KB",
                "health p50 ms",
                "qdelay.master p50 ms",
            ],
            [
                [
                    r["axis"],
                    r["n"],
                    r["stats_all_p50_ms"],
                    r["stats_all_cpu_us"],
                    r["stats_one_p50_ms"],
                    r["scrape_p50_ms"],
                    r["scrape_cpu_us"],
                    r["scrape_bytes"] / 1000,
                    r["health_p50_ms"],
                    r["health_master_p50_ms"],
                ]
                for r in rows
            ],
            title="Stats, the metrics scrape and health against groups and subjects",
        )
        for axis in ("groups", "subjects"):
            sel = [r for r in rows if r["axis"] == axis]
            if len(sel) > 1:
                print(
                    f"{axis} {sel[0]['n']:,} -> {sel[-1]['n']:,}: Stats all x{_ratio(sel, 'stats_all_cpu_us'):.2f},"
                    f" Stats one x{_ratio(sel, 'stats_one_cpu_us'):.2f}, scrape x{_ratio(sel, 'scrape_cpu_us'):.2f},"
                    f" health x{_ratio(sel, 'health_cpu_us'):.2f},"
                    f" qdelay.master x{_ratio(sel, 'health_master_cpu_us'):.2f}"
                    " (server CPU a call)"
                )
    if "consumer" in wanted:
        rows = out["consumer"] = consumer(_ints(args.backlogs), args.calls)
        print_table(
            [
                "backlog B",
                "on disk",
                "setup ms",
                "setup, other subject ms",
                "add_credit +10 ms",
                "Get far p50 ms",
                "µs CPU",
                "Get busy-minute p50 ms",
                "µs CPU",
                "Cancel far first / p50 ms",
                "µs CPU",
                "drain /s (B in flight)",
                "µs CPU",
                "health idle p50/p99",
                "health in drain p50/p99",
                "delete empty ms",
                "delete h ms (CPU ms, settle s)",
                "delete g ms (CPU ms, settle s)",
            ],
            [
                [
                    r["backlog"],
                    r["on_disk"],
                    r["setup_ms"],
                    r["setup_other_ms"],
                    r["add_credit_ms"],
                    r["get_far_p50_ms"],
                    r["get_far_cpu_us"],
                    r["get_busy_p50_ms"],
                    r["get_busy_cpu_us"],
                    f"{r['cancel_far_first_ms']:.2f} / {r['cancel_far_p50_ms']:.2f}",
                    r["cancel_far_cpu_us"],
                    r["drain_per_s"],
                    r["drain_cpu_us"],
                    f"{r['health_idle_p50_ms']:.2f} / {r['health_idle_p99_ms']:.2f}",
                    f"{r['health_busy_p50_ms']:.2f} / {r['health_busy_p99_ms']:.2f}",
                    r["delete_empty_ms"],
                    f"{r['delete_backlog_ms']:.1f} ({r['delete_backlog_cpu_ms']:.1f},"
                    f" {r['delete_backlog_settle_s']:.1f})",
                    f"{r['delete_in_flight_ms']:.1f} ({r['delete_in_flight_cpu_ms']:.1f},"
                    f" {r['delete_in_flight_settle_s']:.1f})",
                ]
                for r in rows
            ],
            title="Subscribe, ack, health and group delete against a group's backlog and in-flight count",
        )
        if len(rows) > 1:
            print(
                f"backlog {rows[0]['backlog']:,} -> {rows[-1]['backlog']:,}: setup x{_ratio(rows, 'setup_ms'):.2f},"
                f" add_credit x{_ratio(rows, 'add_credit_ms'):.2f},"
                f" Get (far) CPU x{_ratio(rows, 'get_far_cpu_us'):.2f},"
                f" Get (busy minute) CPU x{_ratio(rows, 'get_busy_cpu_us'):.2f},"
                f" Cancel (far) CPU x{_ratio(rows, 'cancel_far_cpu_us'):.2f},"
                f" drain CPU a delivery x{_ratio(rows, 'drain_cpu_us'):.2f},"
                f" delete h x{_ratio(rows, 'delete_backlog_ms'):.2f},"
                f" delete g x{_ratio(rows, 'delete_in_flight_ms'):.2f}"
            )
    if "inspect" in wanted:
        rows = out["inspect"] = inspect(_ints(args.records))
        names = ["ls", "verify", "stats", "find_id", "find_sequence", "dump10"]
        print_table(
            ["records N", "folder MB"] + [f"{n} s" for n in names],
            [[r["records"], r["folder_mb"]] + [r[f"{n}_s"] for n in names] for r in rows],
            title="qdelay inspect against the records in the folder",
        )
        if len(rows) > 1:
            print(
                f"records {rows[0]['records']:,} -> {rows[-1]['records']:,}"
                f" (x{rows[-1]['records'] / rows[0]['records']:.0f}): "
                + ", ".join(f"{n} x{_ratio(rows, n + '_s'):.1f}" for n in names)
            )
    if "reschedule" in wanted:
        rows = out["reschedule"] = reschedule(_ints(args.pending), args.calls, args.rounds, args.base_pythonpath)
        groups: dict[tuple, list[dict]] = {}
        for r in rows:
            groups.setdefault((r["server"], r["n"]), []).append(r)
        fields = [
            ("one_id_p50_ms", "by id, one: p50 ms"),
            ("one_id_cpu_us", "µs CPU"),
            ("one_id_steps", "steps a call"),
            ("one_receipt_p50_ms", "by receipt, one: p50 ms"),
            ("one_receipt_cpu_us", "µs CPU"),
            ("one_receipt_steps", "steps a call"),
            ("many_id_per_s", "by id, 64 tasks: /s"),
            ("many_id_cpu_us", "µs CPU"),
            ("many_id_steps", "steps a call"),
            ("many_receipt_per_s", "by receipt, 64 tasks: /s"),
            ("many_receipt_cpu_us", "µs CPU"),
            ("many_receipt_steps", "steps a call"),
        ]
        print_table(
            ["server", "pending N", "rounds"] + [title for _f, title in fields],
            [
                [server, n, len(rs)] + [median([r[f] for r in rs]) for f, _t in fields]
                for (server, n), rs in sorted(groups.items())
            ],
            title="Reschedule by id and by receipt against pending messages (medians of the rounds)",
        )
    out["loadavg_before"] = [round(x, 2) for x in load0]
    out["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    print(f"load average before {out['loadavg_before']}, after {out['loadavg_after']}")
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
