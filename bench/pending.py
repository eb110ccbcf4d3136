"""What a send, a re-send and a lookup cost against the number of pending messages.

    python -m bench.pending [--levels 0,1000000,3000000] [--messages 100000] [--json FILE]

One real server (``qdelay server``, sync flush, the defaults: id index and dedupe on) on a
temporary folder. It is filled in steps with far-future messages (a day and more ahead,
each with its own id, so the id index and the schedule log grow with them) up to each
level N of ``--levels``; at each level, on the same server:

- ``send_many`` of ``--messages`` new messages (Outgoing tuples, batches of 100, 16
  unanswered: the bulk path), msgs/s and server CPU per message: a new id is a miss in the
  id index, whose cost may grow with the index;
- ``send_batch`` of 100, one call in flight (a generated client's shape), 1/5 of the count;
- ``client.send()`` from 16 threads (the client gathers them into SendStream batches),
  1/20 of the count;
- unary ``Send`` through the generated stub, one call at a time, 1/200 of the count: p50
  and server CPU per call;
- a re-send of 10,000 ids already pending, in batches of 100 (every one a duplicate: the
  index hit, the message's state read, the original receipt answered), per message;
- Get by id, one call at a time on an idle server: p50/p99 (by receipt is bench.cancel's);
- Reschedule by id and Cancel by id (``cancel(message_id=...)``: the client gathers
  concurrent cancels, here one at a time), 200 each of pending ids not otherwise touched,
  one call at a time: p50 and the server's CPU per call;
- Topology, one call at a time: p50 (answered from memory);
- the asyncio client (``qdelay.aio.Client``, grpc.aio and its asyncio batchers), on ids
  not otherwise touched: Get by id, Stats, Reschedule by id, Cancel by id and Cancel by
  receipt one call at a time (p50 and server CPU per call), then the same five from 64
  tasks at once (calls/s, server and client CPU per call: the batchers gather the
  reschedules and cancels into RescheduleBatch / CancelBatch calls; Get and Stats stay
  unary); the three batched ones again on 3,000 messages sent for them over 50 minutes of
  a day of their own at every level (the targets above lie in one minute at N = 0, this
  level's send_many, and over the fill's 50 minutes at 3 M: a batch costs the minutes it
  touches, which these hold the same at every level); and ``send_batch`` of 100 new
  messages (20 calls, one at a time: server CPU a message), ``create_group``, ``groups``
  (one subject) and ``delete_group``, 20 each;
- the server's RSS.

Cost per operation should be flat in N (docs/benchmarks.md, "Cost against the number of
pending messages"). Writes bench/out/pending.json (or ``--json``).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import psutil

from bench.common import Meter, machine, percentile, print_table, threads, until_idle, write_json
from bench.peers import QdelayDriver
from qdelay import aio
from qdelay.client import Client, Outgoing
from qdelay.v1 import qdelay_pb2 as pb

DAY_MS = 86_400_000


def _timed_calls(call, items: list) -> list[float]:
    lat = []
    for item in items:
        t0 = time.perf_counter()
        call(item)
        lat.append((time.perf_counter() - t0) * 1000)
    return lat


async def _aio_timed(call, items: list) -> list[float]:
    lat = []
    for item in items:
        t0 = time.perf_counter()
        await call(item)
        lat.append((time.perf_counter() - t0) * 1000)
    return lat


async def _aio_tasks(call, items: list, tasks: int = 64) -> None:
    """``call`` of every item from ``tasks`` tasks at once (each takes the next item)."""
    it = iter(items)

    async def worker() -> None:
        for item in it:
            await call(item)

    await asyncio.gather(*(worker() for _ in range(tasks)))


AIO_ONE = 100  # calls of each kind one at a time
AIO_MANY = 1_000  # calls of each kind from 64 tasks
SPREAD_MINUTES = 50  # the fill's minutes at 3 M: the batched calls' targets spread as widely at every level


def _aio_part(
    address: str, pid: int, targets: list[tuple[str, object]], spread: list[tuple[str, object]], at: int, tag: str
) -> dict:
    """The asyncio client's single calls against this level's pending messages.
    ``targets`` are (message id, receipt) of pending messages no other part touched: at
    least 3 * AIO_ONE + 3 * AIO_MANY of them, each used once (a cancelled or rescheduled
    one is not measured again). ``spread``: 3 * AIO_MANY more, sent for this part over
    SPREAD_MINUTES minutes, for the batched calls on targets of one shape at every level."""
    if len(targets) < 3 * AIO_ONE + 3 * AIO_MANY:
        raise SystemExit(f"only {len(targets)} untouched pending ids for the asyncio part")
    row: dict = {}

    async def go() -> None:
        async with aio.Client(address, timeout=60) as c:
            await c.wait_ready()
            await c.get(message_id=targets[0][0])  # the channel's first call: not charged
            pool = iter(targets)

            def take(n: int) -> list[tuple[str, object]]:
                return [next(pool) for _ in range(n)]

            def phases(n: int) -> list[tuple[str, Callable[[Any], Awaitable[Any]], list]]:
                """Each single call of a phase with its ``n`` targets, ``n`` none took before
                for each call that changes them; the Gets read the ones the reschedules move
                after them, still pending then (the first ids of the list were cancelled and
                moved by the phase before: a Get of them is not a pending message's)."""
                moved = take(n)
                return [
                    ("get", lambda t: c.get(message_id=t), [mid for mid, _ in moved]),
                    ("stats", lambda _t: c.stats(), list(range(n))),
                    ("reschedule", lambda t: c.reschedule(t[0], deliver_at_ms=at), moved),
                    ("cancel_id", lambda t: c.cancel(message_id=t[0]), take(n)),
                    ("cancel_receipt", lambda t: c.cancel(t[1]), take(n)),
                ]

            for name, call, items in phases(AIO_ONE):
                with Meter(pid) as m:
                    lat = await _aio_timed(call, list(items))
                row[f"aio_{name}_p50_ms"] = percentile(lat, 50)
                row[f"aio_{name}_cpu_us"] = m.cpu / len(lat) * 1e6
            # send_batch of 100 new far-future messages (ids of this level), one call at a time
            msgs = [
                c.message("bench.aio", b"x" * 100, deliver_at_ms=at, message_id=f"aio{tag}.{i}") for i in range(2_000)
            ]
            with Meter(pid) as m:
                lat = await _aio_timed(c.send_batch, [msgs[i : i + 100] for i in range(0, len(msgs), 100)])
            row["aio_send_batch_p50_ms"] = percentile(lat, 50)
            row["aio_send_batch_cpu_us"] = m.cpu / len(msgs) * 1e6  # a message
            # the group calls, one at a time: create, list (one subject), delete
            names = [f"g{i}" for i in range(20)]
            for name, call in (
                ("create_group", lambda g: c.create_group(f"bench.aio.{tag}", g)),
                ("groups", lambda _g: c.groups(subject=f"bench.aio.{tag}")),
                ("delete_group", lambda g: c.delete_group(f"bench.aio.{tag}", g)),
            ):
                with Meter(pid) as m:
                    lat = await _aio_timed(call, names)
                row[f"aio_{name}_p50_ms"] = percentile(lat, 50)
                row[f"aio_{name}_cpu_us"] = m.cpu / len(lat) * 1e6
            for name, call, items in phases(AIO_MANY):
                with Meter(pid) as m, Meter() as mine:
                    await _aio_tasks(call, list(items))
                row[f"aio64_{name}_per_s"] = len(items) / m.wall
                row[f"aio64_{name}_cpu_us"] = m.cpu / len(items) * 1e6
                row[f"aio64_{name}_client_us"] = mine.cpu / len(items) * 1e6
            # the batched calls again on targets of the same shape at every level (the ones
            # above come from this level's send_many at N = 0, all in one minute, and from
            # the fill's 50 minutes at 3 M: a batch's cost grows with the minutes it touches)
            pool = iter(spread)
            for name, call, items in phases(AIO_MANY)[2:]:
                with Meter(pid) as m:
                    await _aio_tasks(call, list(items))
                row[f"aio64s_{name}_cpu_us"] = m.cpu / len(items) * 1e6

    asyncio.run(go())
    return row


def run(levels: list[int], messages: int) -> list[dict]:
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="qdelay-bench-pending-") as tmp:
        server = QdelayDriver()
        server.start(tmp)
        try:
            address = f"127.0.0.1:{server.port}"
            proc = psutil.Process(server.pid)
            with Client(address, timeout=300) as c:
                c.wait_ready()
                base = (int(time.time() * 1000) // 60_000 + 60) * 60_000 + DAY_MS
                filled = 0
                serial = 0  # ids of the measured sends, never reused

                def fresh(n: int, tag: str) -> list[Outgoing]:
                    nonlocal serial
                    out = [
                        Outgoing(
                            "bench.pending",
                            b"x" * 100,
                            deliver_at_ms=base + 2 * DAY_MS,
                            message_id=f"{tag}{serial + i}",
                        )
                        for i in range(n)
                    ]
                    serial += n
                    return out

                # warm-up (first calls, the id index's first files): not charged to level 0
                warm = fresh(5_000, "w")
                c.send_many(warm, batch_size=100, max_in_flight=16, timeout=300)
                c.send_batch(
                    [
                        c.message(o.subject, o.payload, message_id=o.message_id, deliver_at_ms=o.deliver_at_ms)
                        for o in warm[:100]
                    ]
                )
                for level in levels:
                    if level > filled:
                        far = (
                            Outgoing("bench.far", b"x" * 100, deliver_at_ms=base + i % DAY_MS, message_id=f"far{i}")
                            for i in range(filled, level)
                        )
                        c.send_many(far, batch_size=1000, max_in_flight=8, timeout=900)
                        filled = level
                    until_idle(server.pid, 60.0)
                    row: dict = {"pending": filled}

                    stream = fresh(messages, "m")
                    with Meter(server.pid) as m:
                        c.send_many(stream, batch_size=100, max_in_flight=16, timeout=300)
                    row["stream_msgs_per_s"] = messages / m.wall
                    row["stream_cpu_us"] = m.cpu / messages * 1e6

                    n = max(100, messages // 5 // 100 * 100)
                    batch = fresh(n, "b")
                    with Meter(server.pid) as m:
                        for i in range(0, n, 100):
                            c.send_batch(
                                [
                                    c.message(
                                        o.subject, o.payload, deliver_at_ms=o.deliver_at_ms, message_id=o.message_id
                                    )
                                    for o in batch[i : i + 100]
                                ]
                            )
                    row["batch_msgs_per_s"] = n / m.wall
                    row["batch_cpu_us"] = m.cpu / n * 1e6

                    n = max(160, messages // 20)
                    batch = fresh(n, "t")
                    with Meter(server.pid) as m:
                        threads(
                            16,
                            lambda o: c.send(
                                o.subject, o.payload, deliver_at_ms=o.deliver_at_ms, message_id=o.message_id
                            ),
                            batch,
                        )
                    row["send16_msgs_per_s"] = n / m.wall
                    row["send16_cpu_us"] = m.cpu / n * 1e6

                    # unary Send through the generated stub, one call at a time: no batching at all
                    n = max(50, messages // 200)
                    unary = fresh(n, "u")
                    with Meter(server.pid) as m:
                        lat = _timed_calls(
                            lambda o: c.stub.Send(
                                pb.SendRequest(
                                    message=c.message(
                                        o.subject, o.payload, deliver_at_ms=o.deliver_at_ms, message_id=o.message_id
                                    )
                                ),
                                timeout=30,
                            ),
                            unary,
                        )
                    row["unary_p50_ms"] = percentile(lat, 50)
                    row["unary_cpu_us"] = m.cpu / n * 1e6

                    # re-sends of pending ids (from the fill when there is one): all duplicates
                    rng = random.Random(level)
                    # from the fill when there is one, else from this level's send_many
                    pool = [f"far{i}" for i in rng.sample(range(filled), min(10_000, filled))] if filled else None
                    picks = pool or [o.message_id for o in rng.sample(stream, min(10_000, len(stream)))]
                    again = [
                        Outgoing("bench.far", b"x" * 100, deliver_at_ms=base + 3 * DAY_MS, message_id=mid)
                        for mid in picks
                    ]
                    with Meter(server.pid) as m:
                        receipts = []
                        for i in range(0, len(again), 100):
                            receipts += c.send_batch(
                                [
                                    c.message(
                                        o.subject, o.payload, deliver_at_ms=o.deliver_at_ms, message_id=o.message_id
                                    )
                                    for o in again[i : i + 100]
                                ]
                            )
                    if not all(r.duplicate for r in receipts):
                        raise SystemExit(f"{sum(not r.duplicate for r in receipts)} re-sends were not duplicates")
                    row["resend_msgs_per_s"] = len(again) / m.wall
                    row["resend_cpu_us"] = m.cpu / len(again) * 1e6

                    until_idle(server.pid, 60.0)
                    ids = [rng.choice(picks) for _ in range(500)]
                    lat = _timed_calls(lambda mid: c.get(message_id=mid), ids)
                    row["get_by_id_p50_ms"] = percentile(lat, 50)
                    row["get_by_id_p99_ms"] = percentile(lat, 99)
                    # Reschedule and Cancel by id, one call at a time, of ids not yet touched: the
                    # id index's lookup, then the message's minute (by receipt is bench.cancel's)
                    touched = set(ids)
                    fresh_ids = [mid for mid in picks if mid not in touched][:400]
                    half = len(fresh_ids) // 2
                    with Meter(server.pid) as m:
                        lat = _timed_calls(
                            lambda mid, at=base + 4 * DAY_MS: c.reschedule(mid, deliver_at_ms=at), fresh_ids[:half]
                        )
                    row["reschedule_by_id_p50_ms"] = percentile(lat, 50)
                    row["reschedule_by_id_cpu_us"] = m.cpu / max(1, half) * 1e6
                    with Meter(server.pid) as m:
                        lat = _timed_calls(lambda mid: c.cancel(message_id=mid), fresh_ids[half:])
                    row["cancel_by_id_p50_ms"] = percentile(lat, 50)
                    row["cancel_by_id_cpu_us"] = m.cpu / max(1, len(fresh_ids) - half) * 1e6
                    lat = _timed_calls(lambda _i: c.stub.Topology(pb.TopologyRequest(), timeout=5), range(200))
                    row["topology_p50_ms"] = percentile(lat, 50)
                    # the asyncio client, on pending ids none of the above touched (the re-sends'
                    # receipts are the messages' own: a duplicate answers the original receipt)
                    used = touched | set(fresh_ids)
                    targets = [(mid, r) for mid, r in zip(picks, receipts, strict=True) if mid not in used]
                    # and 3 * AIO_MANY more, over SPREAD_MINUTES minutes of a day of their own,
                    # a batch's targets in random minutes as the fill's are
                    day = base + (6 + levels.index(level)) * DAY_MS
                    spread = [
                        c.message(
                            "bench.spread",
                            b"x" * 100,
                            deliver_at_ms=day + i % SPREAD_MINUTES * 60_000 + i // SPREAD_MINUTES,
                            message_id=f"s{level}.{i}",
                        )
                        for i in range(3 * AIO_MANY)
                    ]
                    rng.shuffle(spread)
                    sent = []
                    for i in range(0, len(spread), 100):
                        sent += c.send_batch(spread[i : i + 100])
                    spread_targets = [(m.message_id, r) for m, r in zip(spread, sent, strict=True)]
                    until_idle(server.pid, 60.0)
                    row.update(_aio_part(address, server.pid, targets, spread_targets, base + 5 * DAY_MS, str(level)))
                    row["rss_mb"] = proc.memory_info().rss / 2**20
                    rows.append(row)
                    print(row, flush=True)
        finally:
            server.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.pending", description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default="0,1000000,3000000", help="pending counts N, ascending, comma-separated")
    ap.add_argument("--messages", type=int, default=100_000, help="new messages sent through send_many per level")
    ap.add_argument("--json", default="pending", help="output name under bench/out, or a path")
    args = ap.parse_args(argv)
    levels = sorted(int(x) for x in args.levels.split(",") if x)
    rows = run(levels, args.messages)
    headers = [
        "pending N",
        "send_many msgs/s",
        "µs CPU",
        "batch 100 msgs/s",
        "µs CPU",
        "send() x16 msgs/s",
        "µs CPU",
        "unary Send p50 ms",
        "µs CPU",
        "re-send (dup) µs CPU",
        "Get by id p50/p99 ms",
        "Reschedule by id p50 ms",
        "µs CPU",
        "Cancel by id p50 ms",
        "µs CPU",
        "Topology p50 ms",
        "RSS MB",
    ]
    table = [
        [
            r["pending"],
            r["stream_msgs_per_s"],
            r["stream_cpu_us"],
            r["batch_msgs_per_s"],
            r["batch_cpu_us"],
            r["send16_msgs_per_s"],
            r["send16_cpu_us"],
            r["unary_p50_ms"],
            r["unary_cpu_us"],
            r["resend_cpu_us"],
            f"{r['get_by_id_p50_ms']:.2f} / {r['get_by_id_p99_ms']:.2f}",
            r["reschedule_by_id_p50_ms"],
            r["reschedule_by_id_cpu_us"],
            r["cancel_by_id_p50_ms"],
            r["cancel_by_id_cpu_us"],
            r["topology_p50_ms"],
            r["rss_mb"],
        ]
        for r in rows
    ]
    print_table(headers, table, title="send, re-send and lookups against the number of pending messages")
    kinds = (
        *("get", "stats", "reschedule", "cancel_id", "cancel_receipt"),
        *("send_batch", "create_group", "groups", "delete_group"),
    )
    print_table(
        ["pending N"] + [f"aio {k} p50 ms / µs CPU" for k in kinds],
        [[r["pending"]] + [f"{r[f'aio_{k}_p50_ms']:.2f} / {r[f'aio_{k}_cpu_us']:.0f}" for k in kinds] for r in rows],
        title="qdelay.aio.Client, one call at a time (server CPU a call)",
    )
    kinds = ("get", "stats", "reschedule", "cancel_id", "cancel_receipt")
    print_table(
        ["pending N"] + [f"aio x64 {k} calls/s · µs server · µs client" for k in kinds],
        [
            [r["pending"]]
            + [
                f"{r[f'aio64_{k}_per_s']:.0f} · {r[f'aio64_{k}_cpu_us']:.0f} · {r[f'aio64_{k}_client_us']:.0f}"
                for k in kinds
            ]
            for r in rows
        ],
        title="qdelay.aio.Client, 64 tasks at once",
    )
    kinds = ("reschedule", "cancel_id", "cancel_receipt")
    print_table(
        ["pending N"] + [f"aio x64 {k} µs server" for k in kinds],
        [[r["pending"]] + [f"{r[f'aio64s_{k}_cpu_us']:.0f}" for k in kinds] for r in rows],
        title=f"qdelay.aio.Client, 64 tasks at once, targets over {SPREAD_MINUTES} minutes at every level",
    )
    write_json(args.json, {"machine": machine(), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
