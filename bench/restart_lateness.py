"""Delivery lateness across server restarts (SIGTERM and SIGKILL), apart from the restart's
own downtime.

    python -m bench.restart_lateness [--restarts 4] [--gap 6] [--every-ms 10] [--ahead-ms 4000]
                                     [--server-log FILE] [--json FILE]

One real server (``qdelay server``, sync flush, the defaults) on 127.0.0.1 in a temporary
folder. A producer sends a message every ``--every-ms`` due ``--ahead-ms`` later (its own
id, the blocking client's batched ``send``); two consumers acknowledge every delivery, one
a blocking ``Client.subscribe`` (group ``b``), one an asyncio ``AioClient.subscribe``
(group ``a``). After a steady start the server is restarted ``--restarts`` times by each
signal, alternately, ``--gap`` seconds apart: the signal, the process's exit, a new process
on the same port, until its listening line (``serving``: the time its log says it started
listening). Every delivery is recorded:
its due time, when it was received, its attempt and whether it had been received before.

Per signal, over the restarts:

- downtime: signal to serving again (the restart's own cost: a SIGTERM's drain, the
  process start, the data folder's open);
- reconnect: serving to each consumer's Subscribe accepted again (the server's
  ``subscribed`` log line) and to its first delivery;
- messages due while the server was away (due in [signal, serving)): their lateness past
  serving (received - serving), the part of their lateness the downtime does not explain;
- messages due just after (in [serving, serving + 2 s)): their lateness (received - due);
- redeliveries: deliveries received before (a delivery in flight at the signal whose
  ack the server did not record), and how long after the signal they came again.

and, for reference, the lateness of the messages due away from any restart (steady: not
from a second before a signal to 2 s after serving).
Percentiles are over the deliveries of both groups (first receipts). Bounded: each wait
has a deadline; the run takes about ``8 + 2 x restarts x (gap + downtime)`` seconds. Writes
bench/out/restart_lateness.json (or ``--json``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import os
import re
import shutil
import tempfile
import threading
import time
from typing import Any

from bench.common import machine, percentile, print_table, write_json
from bench.peers import QdelayDriver
from qdelay import aio
from qdelay.client import Client

SUBJECT = "restart.lateness"
GROUPS = ("a", "b")  # a: the asyncio consumer; b: the blocking one
AFTER_MS = 2000  # "just after serving": messages due this long after it
STEADY_S = 3.0  # before the first restart, and after the last before the end
SETTLE_S = 60.0  # at most, for every sent message to reach both groups at the end
SUBSCRIBED = re.compile(r"^(\S+ \S+) INFO qdelay\.consumers: subscribed subject=(\S+) group=(\S+)")
STARTED = re.compile(r"^(\S+ \S+) INFO qdelay\.server: started ")


def _now_ms() -> float:
    return time.time() * 1000.0


class Run:
    """What the producer, the consumers and the restarter record (one lock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sent: dict[str, int] = {}  # id -> due ms, once acknowledged
        self.got: list[tuple[str, str, int, float, int]] = []  # (group, id, due, received ms, attempt)
        self.restarts: list[dict[str, Any]] = []
        self.stop = threading.Event()  # the producer stops
        self.done = threading.Event()  # the consumers stop

    def received(self, group: str, batch: list) -> None:
        t = _now_ms()
        with self.lock:
            self.got.extend((group, d.message_id, d.deliver_at_ms, t, d.attempt) for d in batch)

    def delivered_all(self) -> bool:
        with self.lock:
            have = {(g, m) for g, m, *_ in self.got}
            return all((g, m) in have for m in self.sent for g in GROUPS)


def _producer(run: Run, address: str, every_ms: float, ahead_ms: int) -> None:
    c = Client(address, retries=10_000, retry_backoff=0.05, timeout=60)
    i = 0
    t0 = time.monotonic()
    try:
        while not run.stop.is_set():
            due = int(_now_ms()) + ahead_ms
            mid = f"m{i}"
            try:
                c.send(SUBJECT, b"x", deliver_at_ms=due, message_id=mid)
            except Exception:  # noqa: BLE001 - not acknowledged: not counted
                pass
            else:
                with run.lock:
                    run.sent[mid] = due
            i += 1
            wait = t0 + i * every_ms / 1000 - time.monotonic()
            if wait > 0:
                time.sleep(wait)
    finally:
        c.close()


def _blocking_consumer(run: Run, address: str) -> None:
    c = Client(address, retries=10_000, retry_backoff=0.05, timeout=60)
    consumer = c.subscribe(SUBJECT, group="b", max_in_flight=500)
    try:
        while not run.done.is_set():
            batch = consumer.receive(1, timeout=0.2)
            if batch:
                run.received("b", batch)
                consumer.ack(batch)
    finally:
        consumer.close()
        c.close()


def _asyncio_consumer(run: Run, address: str) -> None:
    async def main() -> None:
        async with aio.Client(address, retries=10_000, retry_backoff=0.05, timeout=60) as c:
            async with c.subscribe(SUBJECT, group="a", max_in_flight=500) as consumer:
                while not run.done.is_set():
                    batch = await consumer.receive(1, timeout=0.2)
                    if batch:
                        run.received("a", batch)
                        consumer.ack(batch)

    asyncio.run(main())


def _restart(driver: QdelayDriver, how: str) -> dict[str, Any]:
    """One restart by ``how`` (term, kill): wall-clock ms of the signal, the exit and serving."""
    signal_ms = _now_ms()
    if how == "term":
        code = driver.stop()
        if code != 0:
            raise SystemExit(f"bench.restart_lateness: the server exited {code} at SIGTERM")
    else:
        driver.kill9()
    exited_ms = _now_ms()
    driver.restart()  # returns once the listening line was read (polled every ~20 ms)
    return {"how": how, "signal_ms": signal_ms, "exited_ms": exited_ms, "serving_ms": _now_ms()}


def _log_ms(stamp: str) -> float:
    return _dt.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp() * 1000.0


def _from_log(log_path: str) -> tuple[list[tuple[float, str]], list[float]]:
    """From the server's log: (wall ms, group) of each Subscribe it accepted on SUBJECT, and
    the wall ms of each start (its ``started`` line, written as it listens)."""
    subscribed, started = [], []
    with open(log_path, errors="replace") as f:
        for line in f:
            m = SUBSCRIBED.match(line)
            if m and m.group(2) == SUBJECT:
                subscribed.append((_log_ms(m.group(1)), m.group(3)))
            m = STARTED.match(line)
            if m:
                started.append(_log_ms(m.group(1)))
    return subscribed, started


def _serving_from_log(restarts: list[dict[str, Any]], started: list[float]) -> None:
    """Each restart's serving time from the server's own ``started`` line where there is one:
    the listening line read here comes later when this process is slow to be scheduled (the
    producer and consumers share it), which made lateness past serving look shorter."""
    for r in restarts:
        own = [t for t in started if t >= r["exited_ms"] - 50]
        r["serving_seen_ms"] = r["serving_ms"]
        if own:
            r["serving_ms"] = min(own[0], r["serving_ms"])


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0, "p50": float("nan"), "p99": float("nan"), "max": float("nan")}
    return {
        "n": len(values),
        "p50": percentile(values, 50),
        "p99": percentile(values, 99),
        "max": max(values),
    }


def analyse(run: Run, subscribed: list[tuple[float, str]]) -> dict[str, Any]:
    """The figures of a run, per signal (see the module's docstring)."""
    first: dict[tuple[str, str], tuple[int, float]] = {}
    redelivered: list[tuple[str, str, float]] = []  # (group, id, received ms)
    for g, m, due, t, _attempt in sorted(run.got, key=lambda r: r[3]):
        if (g, m) in first:
            redelivered.append((g, m, t))
        else:
            first[(g, m)] = (due, t)
    # due from a second before the signal (in flight at it, or not yet handed out) to 2 s after serving
    windows = [(r["signal_ms"] - 1000, r["serving_ms"] + AFTER_MS) for r in run.restarts]

    def near_restart(due: float) -> bool:
        return any(a <= due < b for a, b in windows)

    steady = [t - due for (due, t) in first.values() if not near_restart(due)]
    out: dict[str, Any] = {"steady_ms": _stats(steady), "signals": {}}
    for how in ("term", "kill"):
        rs = [r for r in run.restarts if r["how"] == how]
        if not rs:
            continue
        during: list[float] = []
        after: list[float] = []
        reconnect: dict[str, list[float]] = {g: [] for g in GROUPS}
        first_delivery: dict[str, list[float]] = {g: [] for g in GROUPS}
        again: list[float] = []
        for r in rs:
            sig, serving = r["signal_ms"], r["serving_ms"]
            for (_g, _m), (due, t) in first.items():
                if sig <= due < serving:
                    during.append(t - serving)
                elif serving <= due < serving + AFTER_MS:
                    after.append(t - due)
            for g in GROUPS:
                subs = [t for t, grp in subscribed if grp == g and t >= r["exited_ms"]]
                if subs:
                    reconnect[g].append(min(subs) - serving)
                gots = [t for (gg, _m), (_d, t) in first.items() if gg == g and t >= serving]
                if gots:
                    first_delivery[g].append(min(gots) - serving)
            nxt = min((x["signal_ms"] for x in run.restarts if x["signal_ms"] > sig), default=float("inf"))
            again += [t - sig for _g, _m, t in redelivered if sig <= t < nxt]
        out["signals"][how] = {
            "restarts": len(rs),
            "downtime_ms": _stats([r["serving_ms"] - r["signal_ms"] for r in rs]),
            "stop_ms": _stats([r["exited_ms"] - r["signal_ms"] for r in rs]),
            "reconnect_ms": {g: _stats(v) for g, v in reconnect.items()},
            "first_delivery_ms": {g: _stats(v) for g, v in first_delivery.items()},
            "due_during_past_serving_ms": _stats(during),
            "due_after_ms": _stats(after),
            "redelivered_after_signal_ms": _stats(again),
        }
    out["sent"] = len(run.sent)
    out["deliveries"] = len(run.got)
    out["missing"] = sum(1 for m in run.sent for g in GROUPS if (g, m) not in first)
    return out


def measure(restarts: int, gap: float, every_ms: float, ahead_ms: int, server_log: str | None) -> dict[str, Any]:
    run = Run()
    with tempfile.TemporaryDirectory(prefix="bench-restart-") as tmp:
        # INFO: its "subscribed" lines time the consumers' reconnection
        driver = QdelayDriver(extra=["--log-level", "info"])
        driver.start(tmp)
        address = f"127.0.0.1:{driver.port}"
        threads = [
            threading.Thread(target=_producer, args=(run, address, every_ms, ahead_ms), daemon=True),
            threading.Thread(target=_blocking_consumer, args=(run, address), daemon=True),
            threading.Thread(target=_asyncio_consumer, args=(run, address), daemon=True),
        ]
        try:
            for t in threads:
                t.start()
            time.sleep(STEADY_S + ahead_ms / 1000)
            for i in range(2 * restarts):
                run.restarts.append(_restart(driver, ("term", "kill")[i % 2]))
                time.sleep(gap)
            time.sleep(STEADY_S)
            run.stop.set()
            threads[0].join(60)
            deadline = time.monotonic() + SETTLE_S + ahead_ms / 1000
            while not run.delivered_all() and time.monotonic() < deadline:
                time.sleep(0.1)
            run.done.set()
            for t in threads[1:]:
                t.join(30)
        finally:
            run.stop.set()
            run.done.set()
            driver.stop()
        log_path = os.path.join(tmp, f"{driver.name}.log")
        subscribed, started = _from_log(log_path)
        _serving_from_log(run.restarts, started)
        if server_log:
            shutil.copyfile(log_path, server_log)
    return analyse(run, subscribed)


def _row(what: str, s: dict[str, float]) -> list[Any]:
    return [what, s["n"], s["p50"], s["p99"], s["max"]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.restart_lateness", description=__doc__.split("\n\n")[0])
    ap.add_argument("--restarts", type=int, default=4, help="restarts by each signal (alternating)")
    ap.add_argument(
        "--gap",
        type=float,
        default=6.0,
        help="seconds of serving between two restarts (more than --ahead-ms: the messages not sent while"
        " one restart's server was away would otherwise be missing from the next one's windows)",
    )
    ap.add_argument("--every-ms", type=float, default=10.0, help="one message sent every so many ms")
    ap.add_argument(
        "--ahead-ms",
        type=int,
        default=4000,
        help="each message due so many ms after its send (more than a restart's downtime + 2 s: the messages"
        " due while the server is away and just after were sent before the signal)",
    )
    ap.add_argument("--server-log", help="keep the server's log (INFO, every life) in this file")
    ap.add_argument("--json", default="restart_lateness", help="output name under bench/out, or a path")
    args = ap.parse_args(argv)
    load = os.getloadavg()
    res = measure(args.restarts, args.gap, args.every_ms, args.ahead_ms, args.server_log)
    res.update(
        machine=machine(),
        load_before=load,
        load_after=os.getloadavg(),
        args={"restarts": args.restarts, "gap": args.gap, "every_ms": args.every_ms, "ahead_ms": args.ahead_ms},
    )
    for how, s in res["signals"].items():
        rows = [
            _row("downtime: signal -> serving", s["downtime_ms"]),
            _row("  of which signal -> exit", s["stop_ms"]),
            *[_row(f"reconnect {g}: serving -> subscribed", s["reconnect_ms"][g]) for g in GROUPS],
            *[_row(f"first delivery {g}: serving -> received", s["first_delivery_ms"][g]) for g in GROUPS],
            _row("due while away: received - serving", s["due_during_past_serving_ms"]),
            _row(f"due in {AFTER_MS} ms after serving: lateness", s["due_after_ms"]),
            _row("redelivered: received - signal", s["redelivered_after_signal_ms"]),
        ]
        print_table(
            ["ms", "n", "p50", "p99", "max"],
            rows,
            title=f"SIG{how.upper()}: {s['restarts']} restarts (a: asyncio consumer, b: blocking)",
        )
    st = res["steady_ms"]
    print(
        f"steady (due away from restarts): lateness p50 {st['p50']:.1f} p99 {st['p99']:.1f} max {st['max']:.1f} ms"
        f" over {st['n']:,} deliveries; sent {res['sent']:,}, deliveries {res['deliveries']:,},"
        f" missing {res['missing']}; load {load[0]:.2f} -> {res['load_after'][0]:.2f}"
    )
    print("wrote", write_json(args.json, res))
    return 1 if res["missing"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
