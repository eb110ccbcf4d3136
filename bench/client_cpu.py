"""The Python client's own CPU per message in ``send_many``, against a bare server.

    python -m bench.client_cpu [--messages 200000] [--batch 100] [--in-flight 16] [--rounds 5] [--aio]

A bare ``grpc.aio`` server (bench.grpc_floor's: stores nothing, answers compact receipts)
in its own process, so that the producer's figure is not blurred by a real server's load
on the shared cores; this process sends ``Outgoing`` tuples with ``Client.send_many`` (or
``--aio``: the asyncio client's) as bench.compare's ingest producer does, and reports
each round's CPU per message: the process's, and each thread's by OS name (the blocking
client's bulk loop is ``client-bulk``, gRPC's own threads ``event_engine`` and ``_poll``).
The median of ``--rounds`` rounds is printed last.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import time
from itertools import repeat

from bench.common import cpu_seconds, thread_cpu_by_name, thread_split
from bench.grpc_floor import start_bare


def outgoing(n: int, first: int, due: int) -> object:
    """The messages as bench.peers' producer makes them: ``map`` over columns."""
    from qdelay.client import Outgoing

    body = b"p" * 100
    return map(
        Outgoing,
        repeat("bench"),
        repeat(body, n),
        (due + i % 3_600_000 for i in range(n)),
        repeat(None),
        map(str, range(first, first + n)),
    )


def one_round(client, aio_client, loop, n: int, first: int, batch: int, inflight: int) -> dict:
    due = int(time.time() * 1000) + 600_000
    msgs = outgoing(n, first, due)
    threads0, cpu0, t0 = thread_cpu_by_name(), cpu_seconds(), time.perf_counter()
    if aio_client is not None:
        got = loop.run_until_complete(aio_client.send_many(msgs, batch_size=batch, max_in_flight=inflight))
    else:
        got = client.send_many(msgs, batch_size=batch, max_in_flight=inflight)
    wall = time.perf_counter() - t0
    cpu, threads1 = cpu_seconds() - cpu0, thread_cpu_by_name()
    if len(got) != n:
        raise RuntimeError(f"{len(got)} receipts for {n} messages")
    return dict(
        msgs_per_s=round(n / wall),
        cpu_us_per_msg=round(cpu * 1e6 / n, 2),
        threads=thread_split(threads0, threads1, n),
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--in-flight", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--aio", action="store_true", help="the asyncio client's send_many")
    args = parser.parse_args(argv)

    from qdelay.client import Client
    from qdelay.client.aio import Client as AioClient
    from qdelay.threads import name_os_threads

    name_os_threads()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    server = start_bare(address)
    loop = asyncio.new_event_loop() if args.aio else None
    client = Client(address, retries=0, timeout=120)
    aio_client = AioClient(address, retries=0, timeout=120) if args.aio else None
    try:
        client.wait_ready()
        # warm up: the channel, the bulk loop, the server's code paths
        one_round(client, aio_client, loop, 20_000, 0, args.batch, args.in_flight)
        rows = []
        for r in range(args.rounds):
            res = one_round(client, aio_client, loop, args.messages, (r + 1) * 10_000_000, args.batch, args.in_flight)
            rows.append(res)
            print(f"round {r + 1}: {res} (load {os.getloadavg()[0]:.2f})", flush=True)
        print(
            f"median: {statistics.median(r['cpu_us_per_msg'] for r in rows)} µs/msg, "
            f"{statistics.median(r['msgs_per_s'] for r in rows)} msgs/s"
        )
    finally:
        client.close()
        if aio_client is not None:
            loop.run_until_complete(aio_client.close())
            loop.close()
        server.kill()
        server.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
