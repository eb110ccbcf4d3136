"""Durable ingest of a real ``qdelay server`` through the Python client, by API shape.

    python -m bench.ingest [--messages 200000] [--payload 100] [--flush sync]

One server process (flush policy ``sync``: every acknowledged message is on disk), fresh
data folder; producers are separate processes. For each shape it reports messages/s,
the server's CPU per message (all its threads) and the producers' CPU per message:

- unary Send, 64 calls in flight (thread pool of futures)
- SendBatch of 100, 1 in flight (one call at a time, as the peers are driven) and 8 in flight
- the client's bulk API ``send_many`` (SendStream): of protobuf Message objects, and of
  ``Outgoing`` tuples (encoded straight into wire bytes; the side-by-side benchmark's
  producer), batches of 100 with 8 and 16 unanswered, batches of 1000 with 4, and
  100 x 16 from 2 processes
- issue 15's shapes (bench.shapes): 64 concurrent asyncio ``send()``, the blocking
  ``send()`` from 16 threads, a generated stub's SendBatch of 100 with full receipts, and
  unary Send from 8 processes (each a single message per call, batched or not by the client)

``--only`` runs the shapes whose name contains one of its comma-separated words.
After the table, each producer shape's CPU a message by thread, server and client (the
server's ``main`` is its event loop; names from qdelay/threads.py). Writes bench/out/ingest.json.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import tempfile
import time

from bench.common import machine, print_table, thread_cpu_by_name, thread_split, write_json
from bench.peers import QdelayDriver

CTX = mp.get_context("spawn")

SHAPES = [
    # name, kind, batch, in flight, producer processes
    ("unary Send, 64 in flight", "unary", 1, 64, 1),
    ("SendBatch 100, 1 in flight", "batch", 100, 1, 1),
    ("SendBatch 100, 8 in flight", "batch", 100, 8, 1),
    ("send_many (SendStream) of Message objects, 100 x 16 in flight", "many-pb", 100, 16, 1),
    ("send_many (SendStream) of Outgoing tuples, 100 x 8 in flight", "many", 100, 8, 1),
    ("send_many (SendStream) of Outgoing tuples, 100 x 16 in flight", "many", 100, 16, 1),
    # deeper: is bench.compare's shape (16) bound by the round trip or by CPU?
    ("send_many (SendStream) of Outgoing tuples, 100 x 32 in flight", "many", 100, 32, 1),
    ("send_many (SendStream) of Outgoing tuples, 1000 x 4 in flight", "many", 1000, 4, 1),
    ("send_many of Outgoing tuples, 100 x 16, 2 producers", "many", 100, 16, 2),
]


# issue 15's shapes: name, bench.shapes kind, messages (fraction of --messages), processes
CLIENT_SHAPES = [
    ("64 concurrent asyncio send(), one process", "aio64", 0.3, 1),
    ("blocking send() from 16 threads, one process", "threads16", 0.15, 1),
    ("generated stub SendBatch 100, full receipts, 1 in flight", "stub100", 0.5, 1),
    ("generated stub unary Send, 8 processes, 1 in flight each", "unary", 0.04, 8),
]


def _producer(address, kind, n, batch, inflight, payload, first_id, go, q):
    try:
        from concurrent.futures import ThreadPoolExecutor

        from bench.common import thread_cpu_by_name
        from qdelay.client import Client, Outgoing
        from qdelay.threads import name_os_threads
        from qdelay.v1 import qdelay_pb2 as pb

        name_os_threads()  # the client's threads by name in the split (its bulk loop: client-bulk)
        client = Client(address, retries=0, timeout=120)
        client.wait_ready()
        body = b"p" * payload
        q.put("ready")
        go.wait(60)
        due = int(time.time() * 1000) + 600_000
        start = time.time()
        cpu0 = time.process_time()
        threads0 = thread_cpu_by_name()
        msgs = (
            pb.Message(subject="bench", payload=body, message_id=str(first_id + i), deliver_at_ms=due + i % 60_000)
            for i in range(n)
        )
        if kind == "many":  # the bulk path: tuples encoded straight into the request's bytes
            client.send_many(
                (Outgoing("bench", body, due + i % 60_000, None, str(first_id + i)) for i in range(n)),
                batch_size=batch,
                max_in_flight=inflight,
            )
        elif kind == "many-pb":
            client.send_many(msgs, batch_size=batch, max_in_flight=inflight)
        elif kind == "unary":
            with ThreadPoolExecutor(inflight) as pool:
                list(pool.map(lambda m: client.stub.Send(pb.SendRequest(message=m), timeout=60), msgs, chunksize=256))
        else:  # SendBatch calls, ``inflight`` of them unanswered
            from collections import deque
            from itertools import islice

            waiting: deque = deque()
            while chunk := list(islice(msgs, batch)):
                if len(waiting) >= inflight:
                    waiting.popleft().result()
                waiting.append(client.stub.SendBatch.future(pb.SendBatchRequest(messages=chunk), timeout=120))
            for f in waiting:
                f.result()
        threads = {k: v - threads0.get(k, 0) for k, v in thread_cpu_by_name().items()}
        q.put(dict(start=start, end=time.time(), cpu=time.process_time() - cpu0, n=n, threads=threads))
        client.close()
    except BaseException as e:  # noqa: BLE001 - report to the parent
        q.put(dict(error=repr(e)))


def run_shape(driver, kind, n, batch, inflight, procs, payload, offset):
    q = CTX.Queue()
    go = CTX.Event()
    per = n // procs
    ps = [
        CTX.Process(
            target=_producer,
            daemon=True,
            args=(f"127.0.0.1:{driver.port}", kind, per, batch, inflight, payload, offset + p * per, go, q),
        )
        for p in range(procs)
    ]
    for p in ps:
        p.start()
    for _ in ps:
        assert q.get(timeout=120) == "ready"
    cpu0 = driver.cpu_seconds()
    threads0 = thread_cpu_by_name(driver.pid)
    go.set()
    results = [q.get(timeout=900) for _ in ps]
    server_cpu = driver.cpu_seconds() - cpu0
    threads1 = thread_cpu_by_name(driver.pid)
    for p in ps:
        p.join(30)
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise RuntimeError(errors[0])
    total = sum(r["n"] for r in results)
    secs = max(r["end"] for r in results) - min(r["start"] for r in results)
    client_threads: dict[str, int] = {}
    for r in results:
        for name, ns in r["threads"].items():
            client_threads[name] = client_threads.get(name, 0) + ns
    return dict(
        n=total,
        secs=round(secs, 2),
        msgs_per_s=round(total / secs),
        server_cpu_us_per_msg=round(server_cpu * 1e6 / total, 1),
        client_cpu_us_per_msg=round(sum(r["cpu"] for r in results) * 1e6 / total, 1),
        # µs a message of each thread (the server's main thread is its event loop)
        server_threads=thread_split(threads0, threads1, total),
        client_threads=thread_split({}, client_threads, total),
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--unary-messages", type=int, default=20_000, help="unary Send is ~100x slower")
    parser.add_argument("--payload", type=int, default=100)
    parser.add_argument("--flush", default="sync")
    parser.add_argument("--tmp", default=None)
    parser.add_argument("--only", default="", help="comma-separated words: run the shapes whose name has one")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="server setting (qdelay server --set), e.g. engine.dedupe_window_ms=0; repeatable",
    )
    args = parser.parse_args(argv)
    words = [w for w in args.only.split(",") if w]

    def chosen(name: str) -> bool:
        return not words or any(w in name for w in words)

    info = machine()
    rows, results = [], {}
    workdir = tempfile.mkdtemp(prefix="qdbench-ingest-", dir=args.tmp)
    driver = QdelayDriver(flush=args.flush, extra=[a for kv in args.set for a in ("--set", kv)])
    info["server_set"] = args.set
    try:
        driver.start(workdir)
        offset = 0
        from bench import shapes

        for name, kind, fraction, procs in CLIENT_SHAPES:
            if not chosen(name):
                continue
            print(f"{name} ...", flush=True)
            n = int(args.messages * fraction)
            res = shapes.run(kind, f"127.0.0.1:{driver.port}", n, procs, args.payload, offset, driver.cpu_seconds)
            res["server_cpu_us_per_msg"] = res.pop("srv_cpu_us_per_msg")
            offset += n
            res["load1"] = round(__import__("os").getloadavg()[0], 2)
            results[name] = res
            rows.append([name, *(res[k] for k in ("msgs_per_s", "server_cpu_us_per_msg", "client_cpu_us_per_msg"))])
            rows[-1] += [res["n"], res["load1"]]
        for name, kind, batch, inflight, procs in SHAPES:
            if not chosen(name):
                continue
            n = args.unary_messages if kind == "unary" else args.messages
            print(f"{name} ...", flush=True)
            res = run_shape(driver, kind, n, batch, inflight, procs, args.payload, offset)
            offset += n
            res["load1"] = round(__import__("os").getloadavg()[0], 2)
            results[name] = res
            rows.append(
                [
                    name,
                    res["msgs_per_s"],
                    res["server_cpu_us_per_msg"],
                    res["client_cpu_us_per_msg"],
                    res["n"],
                    res["load1"],
                ]
            )
    finally:
        driver.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    text = print_table(
        ["shape", "msgs/s", "server CPU µs/msg", "client CPU µs/msg", "messages", "load"],
        rows,
        title=f"### qdelay durable ingest (flush {args.flush}, {args.payload}-byte payloads)",
    )
    for name, res in results.items():
        for side in ("server", "client"):
            split = res.get(f"{side}_threads")
            if split:
                print(f"{name}: {side} CPU µs/msg by thread: " + ", ".join(f"{k} {v}" for k, v in split.items()))
    path = write_json("ingest", {"machine": info, "args": vars(args), "results": results, "report": text})
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
