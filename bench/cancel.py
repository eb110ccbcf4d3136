"""Cancel and Get against N: what a user pays to cancel or look up one message, by the size
of the message's minute bucket (issue 13).

Run: ``python -m bench.cancel [--sizes 1000,10000,100000] [--cancels N] [--gets N]
[--pending N] [--aio-tasks 64] [--json FILE]``. A real server (``qdelay server``, sync
flush) on a temporary folder; ``--pending`` messages spread over other minutes a day ahead first (once); then for
each bucket size N, two minutes an hour ahead with N messages each:

- in the first: Get p50/p99 of random receipts, one call at a time (an idle server), and
  as many gRPC health checks right after (the floor of any call on the box at that moment);
  for both, what the machine explains of the tail (``bench.common.timed_calls``): the p99
  less each call's longest run-queue wait of one server or client thread, and the share of
  the slowest 1 % that had such a wait of at least half their excess over the p50;
  ``client.reschedule`` of random receipts from 16 threads (an hour later; the client
  gathers concurrent reschedules into RescheduleBatch calls, as it gathers cancels):
  reschedules/s and server CPU, and as many, same moment, from a ``batching=False``
  client (a unary Reschedule call each);
  ``client.cancel`` of random receipts from 16 threads (the client gathers concurrent
  cancels into CancelBatch calls, as it gathers sends): cancels/s and server CPU;
- in the second: CancelBatch of ``--batch`` receipts per call, one call in flight, of
  ``--cancels`` random receipts: cancels/s and server CPU per cancel; and
  ``reschedule_many`` (RescheduleBatch of ``--batch``) of ``--reschedules`` others;
- ``qdelay.aio`` ``client.cancel`` of random receipts from ``--aio-tasks`` asyncio tasks (64),
  gathered into CancelBatch calls and, same run, unary (``batching=False``): cancels/s and
  server CPU per cancel, ``--cancels`` of each (fewer when the minute is small);
- ``client.send`` from 16 threads and a batched send of 50,000, same run, as yardsticks;
  for both 16-thread phases, how many targets or messages a gathered call carried; and, right
  after each size's ``cancel()`` phase, as many ``send()`` calls from 16 threads: the cancel
  phase's own yardstick (the same length at the same moment: at 1,000 in the minute the
  cancel phase is 500 calls, against the run's yardstick of ``--cancels`` sends at the end).

Get only: ``--cancels 0 --reschedules 0 --aio-tasks 0`` (the fills and the yardsticks
still run: ~25 s for the three sizes). The full run of issue 13:
``--pending 1000000 --sizes 1000,10000,100000 --cancels 50000``.

The cold-minute scenario is described in ``COLD_DOC`` (``--cold``).

Goals (issue 13): cost per operation flat across N; batched cancel >= 100,000/s with server
CPU per cancel <= 2x a batched send's; unary cancel within 1.2x of unary Send's rate; Get
p99 <= 2 ms at any bucket size.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time

from bench.common import (
    Meter,
    RunQueueWait,
    machine,
    median,
    percentile,
    print_table,
    threads,
    timed_calls,
    until_idle,
    write_json,
)
from bench.peers import QdelayDriver
from qdelay.client import Client, Outgoing

BUCKET_MS = 60_000


def _fill(client: Client, n: int, minute_start: int, tag: str) -> list:
    """N messages due inside one minute bucket; their receipts."""
    msgs = (
        Outgoing(
            "bench.cancel", b"x" * 100, deliver_at_ms=minute_start + (i * 7919) % BUCKET_MS, message_id=f"{tag}-{i}"
        )
        for i in range(n)
    )
    return list(client.send_many(msgs, batch_size=1000, max_in_flight=8, timeout=300))


def _calls(client: Client) -> tuple[int, int, int]:
    """(calls of the blocking client's ``cancel()`` batcher, batches of its ``send()`` batcher,
    calls of its ``reschedule()`` batcher) made so far, read from the batchers' counters (0
    before the first): how many targets or messages a gathered call carried in a phase (each
    phase's rate is one call's cycle times that)."""
    canceller, sender = getattr(client, "_canceller", None), getattr(client, "_batcher", None)
    mover = getattr(client, "_rescheduler", None)
    return (
        canceller.batches if canceller is not None else 0,
        sender.batches if sender is not None else 0,
        mover.batches if mover is not None else 0,
    )


def _aio_cancels(address: str, targets: list, tasks: int, batching: bool, pid: int) -> tuple[float, float]:
    """``cancel()`` of every target from ``tasks`` asyncio tasks of one ``qdelay.aio`` client:
    (wall seconds, server CPU seconds) of the cancels alone."""
    import asyncio

    from qdelay.aio import Client as AioClient

    async def main() -> tuple[float, float, list[str]]:
        async with AioClient(address, timeout=120, batching=batching) as c:
            await c.wait_ready()
            it = iter(targets)
            outcomes: list[str] = []

            async def worker() -> None:
                for r in it:
                    outcomes.append(await c.cancel(r))

            with Meter(pid) as m:
                await asyncio.gather(*(worker() for _ in range(tasks)))
        return m.wall, m.cpu, outcomes

    wall, cpu, outcomes = asyncio.run(main())
    bad = [o for o in outcomes if o != "CANCELLED"]
    if bad or len(outcomes) != len(targets):
        raise SystemExit(f"aio cancel answered {bad[:3]} ({len(bad)} not CANCELLED, {len(outcomes)} answers)")
    return wall, cpu


def run(
    sizes: list[int], cancels: int, gets: int, pending: int, batch: int, resched: int, aio_tasks: int = 64
) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="qdelay-bench-cancel-") as tmp:
        server = QdelayDriver()
        server.start(tmp)
        try:
            address = f"127.0.0.1:{server.port}"
            with Client(address, timeout=120) as c:
                c.wait_ready()
                hour = (int(time.time() * 1000) // BUCKET_MS + 60) * BUCKET_MS
                pending_cpu_us = float("nan")
                if pending:
                    far = (
                        Outgoing(
                            "bench.far", b"x" * 100, deliver_at_ms=hour + 86_400_000 + i * 1000, message_id=f"f{i}"
                        )
                        for i in range(pending)
                    )
                    with Meter(server.pid) as mp:
                        c.send_many(far, batch_size=1000, max_in_flight=8, timeout=600)
                    pending_cpu_us = mp.cpu / pending * 1e6
                for k, n in enumerate(sizes):
                    minute = hour + (k + 1) * 10 * BUCKET_MS
                    receipts = _fill(c, n, minute, f"n{n}")
                    batch_pool = _fill(c, n, minute + 5 * BUCKET_MS, f"b{n}")
                    random.seed(n)
                    picks = random.sample(receipts, n)
                    g, m = min(gets, n // 4), min(resched, n // 4)  # a small minute keeps half to cancel
                    get_set, resched_set = picks[:g], picks[g : g + m]
                    unary_set = picks[g + m : g + m + cancels]
                    rest = picks[g + m + cancels :]
                    a = min(cancels, len(rest) // 2) if aio_tasks else 0
                    aio_sets = {"batched": rest[:a], "unary": rest[a : 2 * a]}
                    batch_set = random.sample(batch_pool, min(n, cancels))

                    idle_s = until_idle(server.pid)
                    # the run-queue waits of the server's and this process's threads around
                    # each call: how much of the tail is the machine (issue 13: Get p99)
                    probe = RunQueueWait([server.pid, os.getpid()])
                    got = timed_calls(c.get, get_set, probe)
                    # the floor of a call on this box: the gRPC health check (no lookup, no
                    # worker thread), as many, right after
                    floor = timed_calls(lambda _r: c.health(), get_set, probe)
                    probe.close()

                    # half gathered (the client's default), half unary (batching=False), same moment
                    gathered_set, unary_r_set = resched_set[::2], resched_set[1::2]
                    moved: list[str] = []
                    calls_r0 = _calls(c)[2]
                    with Meter(server.pid) as mr:
                        wall_r = threads(
                            16, lambda r, out=moved: out.append(c.reschedule(r, delay_ms=7_200_000)[0]), gathered_set
                        )
                    resched_calls = _calls(c)[2] - calls_r0
                    with Client(address, timeout=120, batching=False) as cu, Meter(server.pid) as mru:
                        wall_ru = threads(
                            16, lambda r, out=moved: out.append(cu.reschedule(r, delay_ms=7_200_000)[0]), unary_r_set
                        )
                    if any(o != "RESCHEDULED" for o in moved):
                        raise SystemExit(f"reschedule answered {sorted(set(moved))}")

                    outcomes: list[str] = []
                    calls0 = _calls(c)[0]
                    with Meter(server.pid) as mu:
                        wall_u = threads(16, lambda r, out=outcomes: out.append(c.cancel(r)), unary_set)
                    cancel_calls = _calls(c)[0] - calls0
                    bad = [o for o in outcomes if o != "CANCELLED"]
                    if bad:
                        raise SystemExit(f"unary cancel answered {bad[:3]} ({len(bad)} not CANCELLED)")
                    # the same number of send() calls from 16 threads right after: the cancel
                    # phase's own yardstick (same length, same moment of the run), beside the
                    # run's one of --cancels sends at the end
                    beside = [hour + 2 * 86_400_000 + k * 1_000_000 + i for i in range(len(unary_set))]
                    with Meter(server.pid) as mbs:
                        wall_bs = threads(16, lambda at: c.send("bench.yard", b"x" * 100, deliver_at_ms=at), beside)

                    row = {
                        "bucket_size": n,
                        **{f"get_{k}": v for k, v in got.items()},
                        **{f"health_{k}": v for k, v in floor.items()},
                        "loadavg": round(os.getloadavg()[0], 2),
                        "idle_wait_s": round(idle_s, 1),
                        "unary_cancels_per_s": len(unary_set) / wall_u if unary_set else 0,
                        "unary_cpu_us": mu.cpu / len(unary_set) * 1e6 if unary_set else 0,
                        "unary_cancels_a_call": len(unary_set) / max(1, cancel_calls),
                        "beside_sends_per_s": len(beside) / wall_bs if beside else 0,
                        "beside_send_cpu_us": mbs.cpu / len(beside) * 1e6 if beside else 0,
                        "reschedules_per_s": len(gathered_set) / wall_r if gathered_set else 0,
                        "reschedule_cpu_us": mr.cpu / len(gathered_set) * 1e6 if gathered_set else 0,
                        "reschedules_a_call": len(gathered_set) / max(1, resched_calls),
                        "unary_reschedules_per_s": len(unary_r_set) / wall_ru if unary_r_set else 0,
                        "unary_reschedule_cpu_us": mru.cpu / len(unary_r_set) * 1e6 if unary_r_set else 0,
                    }
                    for how, targets in aio_sets.items():
                        if targets:
                            wall_a, cpu_a = _aio_cancels(address, targets, aio_tasks, how == "batched", server.pid)
                            row[f"aio_{how}_cancels_per_s"] = len(targets) / wall_a
                            row[f"aio_{how}_cpu_us"] = cpu_a / len(targets) * 1e6
                    if hasattr(c, "cancel_many") and batch_set:
                        with Meter(server.pid) as mb:
                            res = []
                            for i in range(0, len(batch_set), batch):
                                res.extend(c.cancel_many(batch_set[i : i + batch]))
                        bad = [o for o in res if o != "CANCELLED"]
                        if bad:
                            raise SystemExit(f"cancel_many answered {bad[:3]} ({len(bad)} not CANCELLED)")
                        row["batch_cancels_per_s"] = len(batch_set) / mb.wall
                        row["batch_cpu_us"] = mb.cpu / len(batch_set) * 1e6
                    chosen = {r.sequence for r in batch_set}
                    move_set = [r for r in batch_pool if r.sequence not in chosen][:resched]
                    if hasattr(c, "reschedule_many") and move_set:
                        with Meter(server.pid) as mrb:
                            res2 = []
                            for i in range(0, len(move_set), batch):
                                part = c.reschedule_many(move_set[i : i + batch], delay_ms=7_200_000)
                                res2.extend(o for o, _r in part)
                        if any(o != "RESCHEDULED" for o in res2):
                            raise SystemExit(f"reschedule_many answered {sorted(set(res2))}")
                        row["batch_reschedules_per_s"] = len(move_set) / mrb.wall
                        row["batch_reschedule_cpu_us"] = mrb.cpu / len(move_set) * 1e6
                    rows.append(row)

                # yardsticks, same run: unary Send from 16 threads, batched send's CPU
                sends = [hour + 3 * 86_400_000 + i for i in range(max(cancels, 500))]
                calls0 = _calls(c)[1]
                with Meter(server.pid) as ms:
                    wall_s = threads(16, lambda at: c.send("bench.yard", b"x" * 100, deliver_at_ms=at), sends)
                send_calls = _calls(c)[1] - calls0
                with Meter(server.pid) as mbs:
                    _fill(c, 50_000, hour + 4 * 86_400_000, "yard")
                yard = {
                    "unary_sends_per_s": len(sends) / wall_s,
                    "unary_send_cpu_us": ms.cpu / len(sends) * 1e6,
                    "unary_sends_a_batch": len(sends) / max(1, send_calls),
                    "batched_send_cpu_us": mbs.cpu / 50_000 * 1e6,
                    "pending_fill_cpu_us": pending_cpu_us,  # the --pending send_many, a batched send too
                }
                for row in rows:
                    row.update(yard)
        finally:
            server.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1000,10000,100000", help="bucket sizes N, comma-separated")
    ap.add_argument(
        "--cancels",
        type=int,
        default=2000,
        help="cancels per size, unary (16 threads) and batched (each); 0 with --reschedules 0 --aio-tasks 0: Get only",
    )
    ap.add_argument("--gets", type=int, default=500, help="Get calls per size (one at a time)")
    ap.add_argument(
        "--reschedules",
        type=int,
        default=1000,
        help="reschedule() calls per size from 16 threads (half gathered, half unary), and as many in RescheduleBatch",
    )
    ap.add_argument("--batch", type=int, default=1000, help="targets per CancelBatch call")
    ap.add_argument("--pending", type=int, default=0, help="far-future messages sent first (e.g. 1000000)")
    ap.add_argument("--aio-tasks", type=int, default=64, help="asyncio tasks cancelling (0: no asyncio phase)")
    ap.add_argument("--json", help="write the figures to this file (default: bench/out/cancel-*.json)")
    ap.add_argument("--cold", default="", help="cold-minute shapes MxK (M minutes of K), e.g. 10x1000,500x2000")
    ap.add_argument("--cold-ops", type=int, default=200, help="calls of each kind per cold shape")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of each cold shape (a fresh server each)")
    ap.add_argument("--base-pythonpath", help="cold: also run a server whose qdelay package is in this folder")
    args = ap.parse_args(argv)
    if args.cold:
        return cold_main(args)
    sizes = [int(x) for x in args.sizes.split(",") if x]
    rows = run(sizes, args.cancels, args.gets, args.pending, args.batch, args.reschedules, args.aio_tasks)
    headers = [
        "N in bucket",
        "Get p50 ms",
        "Get p99 ms",
        "unary cancel/s",
        "µs CPU",
        "batch cancel/s",
        "µs CPU",
        "reschedule/s",
        "µs CPU",
    ]
    table = [
        [
            r["bucket_size"],
            r["get_p50_ms"],
            r["get_p99_ms"],
            r["unary_cancels_per_s"],
            r["unary_cpu_us"],
            r.get("batch_cancels_per_s", "-"),
            r.get("batch_cpu_us", "-"),
            r["reschedules_per_s"],
            r["reschedule_cpu_us"],
        ]
        for r in rows
    ]
    print_table(headers, table, title=f"cancel and get against bucket size ({args.pending} other pending)")
    for r in rows:
        print(
            f"N {r['bucket_size']:,}: Get p50/p99 {r['get_p50_ms']:.2f}/{r['get_p99_ms']:.2f} ms;"
            f" a health check, same moment: {r['health_p50_ms']:.2f}/{r['health_p99_ms']:.2f} ms (load {r['loadavg']})"
        )
        if "get_p99_less_wait_ms" in r:
            print(
                f"    less each call's longest run-queue wait (server or client thread): Get p99"
                f" {r['get_p99_less_wait_ms']:.2f}, health {r['health_p99_less_wait_ms']:.2f} ms;"
                f" slowest 1 % with such a wait >= half their excess over p50:"
                f" Get {r['get_slow_waited']:.0%}, health {r['health_slow_waited']:.0%}"
            )
    y = rows[0] if rows else {}
    if y:
        print(
            f"yardsticks, same run: unary Send {y['unary_sends_per_s']:.0f}/s at {y['unary_send_cpu_us']:.0f} µs CPU;"
            f" batched send {y['batched_send_cpu_us']:.1f} µs CPU/msg"
            f" ({y['pending_fill_cpu_us']:.1f} for the --pending fill);"
            f" unary cancel/send rate (median over sizes): "
            f"{median([r['unary_cancels_per_s'] for r in rows]) / y['unary_sends_per_s']:.2f}"
            f" (gathered: {y['unary_sends_a_batch']:.1f} sends a batch,"
            f" {median([r['unary_cancels_a_call'] for r in rows]):.1f} cancels a call)"
        )
    for r in rows:
        if r.get("beside_sends_per_s"):
            print(
                f"N {r['bucket_size']:,}: cancel() x16 threads {r['unary_cancels_per_s']:,.0f}/s at"
                f" {r['unary_cpu_us']:.0f} µs CPU; send() x16, as many right after:"
                f" {r['beside_sends_per_s']:,.0f}/s at {r['beside_send_cpu_us']:.0f} µs:"
                f" cancel/send {r['unary_cancels_per_s'] / r['beside_sends_per_s']:.2f}"
                f" (against the run's yardstick: {r['unary_cancels_per_s'] / r['unary_sends_per_s']:.2f})"
            )
    for r in rows:
        if r.get("unary_reschedules_per_s"):
            print(
                f"N {r['bucket_size']:,}: reschedule() x16 threads gathered {r['reschedules_per_s']:,.0f}/s at"
                f" {r['reschedule_cpu_us']:.0f} µs CPU ({r['reschedules_a_call']:.1f} a call);"
                f" unary (batching=False) {r['unary_reschedules_per_s']:,.0f}/s at"
                f" {r['unary_reschedule_cpu_us']:.0f} µs CPU; reschedule_many of {args.batch}:"
                f" {r.get('batch_reschedules_per_s', float('nan')):,.0f}/s at"
                f" {r.get('batch_reschedule_cpu_us', float('nan')):.1f} µs CPU"
            )
    for r in rows:
        if "aio_batched_cancels_per_s" in r:
            print(
                f"N {r['bucket_size']:,}: cancel() from {args.aio_tasks} asyncio tasks:"
                f" gathered {r['aio_batched_cancels_per_s']:,.0f}/s at {r['aio_batched_cpu_us']:.0f} µs CPU,"
                f" unary {r.get('aio_unary_cancels_per_s', float('nan')):,.0f}/s"
                f" at {r.get('aio_unary_cpu_us', float('nan')):.0f} µs CPU"
            )
    write_json(args.json or "cancel", {"machine": machine(), "rows": rows})
    return 0


# --- cold minutes: operations at random over many minutes ---------------------------------------

COLD_DOC = """Cold minutes (``--cold MxK,...``): M minutes of K messages each, a day ahead (never
loaded by the scheduler: every lookup goes through the schedule log), then, one call at a
time, at random over all the minutes: Get, Cancel and Reschedule by receipt and by id. Per
operation: p50/p99 latency and the server's CPU. A minute is "cold" when nothing of it was
looked at before; with M beyond a per-minute cache's size every call finds one.
``--base-pythonpath DIR`` runs, in the same run and alternately, a second server whose
``qdelay`` package comes from DIR (``pip install --no-deps --target DIR <checkout>`` of
another commit): before/after on the same machine and load."""


def _cold_fill(c: Client, minutes: int, per_minute: int, start: int) -> list:
    msgs = (
        Outgoing(
            "bench.cold",
            b"x" * 100,
            deliver_at_ms=start + (i // per_minute) * BUCKET_MS + (i * 7919) % BUCKET_MS,
            message_id=f"c{i}",
        )
        for i in range(minutes * per_minute)
    )
    return list(c.send_many(msgs, batch_size=1000, max_in_flight=8, timeout=600))


def _timed(pid: int, calls: list) -> dict:
    """Run each zero-argument call in turn: p50/p99 ms and server CPU µs per call."""
    lat = []
    with Meter(pid) as m:
        for call in calls:
            t0 = time.perf_counter()
            call()
            lat.append((time.perf_counter() - t0) * 1000)
    return {"p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99), "cpu_us": m.cpu / len(calls) * 1e6}


def _cold_round(server: QdelayDriver, minutes: int, per_minute: int, ops: int, seed: int) -> dict:
    """One fill of ``minutes`` x ``per_minute`` on a running server, then ``ops`` calls of
    each kind on distinct random targets."""
    out: dict = {}
    with Client(f"127.0.0.1:{server.port}", timeout=120, batching=False) as c:
        c.wait_ready()
        start = (int(time.time() * 1000) // BUCKET_MS + 24 * 60) * BUCKET_MS
        receipts = _cold_fill(c, minutes, per_minute, start)
        out["idle_wait_s"] = round(until_idle(server.pid), 1)
        rnd = random.Random(seed)
        picks = rnd.sample(receipts, 6 * ops)
        sets = [picks[k * ops : (k + 1) * ops] for k in range(6)]
        later = 3 * 86_400_000

        def check(want: str, got: str) -> None:
            if got != want:
                raise SystemExit(f"answered {got}, wanted {want}")

        kinds = {
            "get_receipt": [lambda r=r: check("PENDING", str(c.get(r).state)) for r in sets[0]],
            "get_id": [lambda r=r: check("PENDING", str(c.get(message_id=r.message_id).state)) for r in sets[1]],
            "cancel_receipt": [lambda r=r: check("CANCELLED", c.cancel(r)) for r in sets[2]],
            "cancel_id": [lambda r=r: check("CANCELLED", c.cancel(message_id=r.message_id)) for r in sets[3]],
            "reschedule_receipt": [
                lambda r=r: check("RESCHEDULED", c.reschedule(r, delay_ms=later)[0]) for r in sets[4]
            ],
            "reschedule_id": [
                lambda r=r: check("RESCHEDULED", c.reschedule(r.message_id, delay_ms=later)[0]) for r in sets[5]
            ],
        }
        for name, calls in kinds.items():
            out[name] = _timed(server.pid, calls)
    return out


def run_cold(shapes: list[tuple[int, int]], ops: int, rounds: int, base_pythonpath: str | None) -> list[dict]:
    """Per shape and server ("new": this tree; "base": ``base_pythonpath``), the median over
    ``rounds`` of each operation's figures; each round a fresh server and folder, the
    servers alternating."""
    import os

    servers = [("new", None)] + ([("base", base_pythonpath)] if base_pythonpath else [])
    rows = []
    for minutes, per_minute in shapes:
        got: dict[str, list[dict]] = {name: [] for name, _ in servers}
        for k in range(rounds):
            for name, path in servers:
                with tempfile.TemporaryDirectory(prefix="qdelay-bench-cold-") as tmp:
                    server = QdelayDriver()
                    if path:
                        server.env = dict(os.environ, PYTHONPATH=path)
                    server.start(tmp)
                    try:
                        got[name].append(_cold_round(server, minutes, per_minute, ops, seed=k))
                    finally:
                        server.stop()
        for name, runs in got.items():
            row: dict = {"server": name, "minutes": minutes, "per_minute": per_minute, "rounds": rounds, "ops": ops}
            row["idle_wait_s"] = [r.pop("idle_wait_s") for r in runs]
            row["each_round"] = runs
            for kind in runs[0]:
                for field in runs[0][kind]:
                    row[f"{kind}_{field}"] = median([r[kind][field] for r in runs])
            rows.append(row)
    return rows


def cold_main(args: argparse.Namespace) -> int:
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.cold.split(",") if s]
    rows = run_cold(shapes, args.cold_ops, args.rounds, args.base_pythonpath)  # type: ignore[arg-type]
    kinds = ["get_receipt", "get_id", "cancel_receipt", "cancel_id", "reschedule_receipt", "reschedule_id"]
    headers = ["server", "minutes x N"] + [f"{k} p50 ms / µs CPU" for k in kinds]
    table = [
        [r["server"], f"{r['minutes']}x{r['per_minute']}"]
        + [f"{r[k + '_p50_ms']:.2f} / {r[k + '_cpu_us']:.0f}" for k in kinds]
        for r in rows
    ]
    print_table(headers, table, title=f"cold minutes: one call at a time, median of {args.rounds} rounds")
    for r in rows:
        print(
            f"{r['server']} {r['minutes']}x{r['per_minute']}: p99 ms "
            + ", ".join(f"{k} {r[k + '_p99_ms']:.2f}" for k in kinds)
        )
    write_json(args.json or "cancel-cold", {"machine": machine(), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
