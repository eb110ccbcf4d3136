"""The event loop's own CPU per message on the SendStream ingest path, in process.

    python -m bench.stream_loop [--messages 200000] [--batch 100] [--window 16] [--rounds 5]

A real Engine (flush ``sync``, a temporary data folder) and DelayService, with no gRPC:
``SendStream`` is driven by an async iterator of SendBatchRequest wire bytes (bench.ingest's
producer's shape: 100-byte payloads, every message with an id, due 10-11 minutes ahead),
which keeps ``--window`` batches unanswered as the client's ``send_many`` does. What is
measured is the CPU time of the thread running the loop (``time.thread_time_ns``): this
server's Python on the ingest path (validation, dedupe, the WAL hand-off, the pipeline and
its tasks), without gRPC aio's own part, which an end-to-end run adds on the same thread.
The WAL writer, iterate service and scheduler run on their own threads as in the server.

Each round opens a fresh data folder and sends ``--messages`` new ids on one stream, after
a warm-up stream of a tenth of that; the median of the rounds is reported, with the load.
Used for the A/B figures of the ingest cuts (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time
from unittest import mock

from qdelay import wire
from qdelay.server.config import ServerConfig
from qdelay.server.engine import Engine
from qdelay.server.service import DelayService
from qdelay.v1 import qdelay_pb2 as pb


def requests(first_id: int, n: int, batch: int, payload: int, due: int) -> list[bytes]:
    body = b"p" * payload
    out = []
    for at in range(0, n, batch):
        msgs = [
            pb.Message(subject="bench", payload=body, message_id=str(first_id + i), deliver_at_ms=due + i % 60_000)
            for i in range(at, min(n, at + batch))
        ]
        out.append(pb.SendBatchRequest(messages=msgs, compact_receipts=True).SerializeToString())
    return out


async def drive(service: DelayService, raws: list[bytes], window: int, merge: bool = True) -> int:
    """One SendStream of ``raws`` with at most ``window`` unanswered; how many requests were
    answered. ``merge``: the stream asks for merged answers, as the Python clients do (each
    response is then parsed, a few µs a response, for how many requests it answers)."""
    room = asyncio.Semaphore(window)

    async def sender():
        for raw in raws:
            await room.acquire()
            yield raw

    context = mock.MagicMock()
    context.invocation_metadata.return_value = (wire.MERGE_ANSWERS,) if merge else ()
    context.send_initial_metadata = mock.AsyncMock()
    count = 0
    async for response in service.SendStream(sender(), context):
        answered = 1 + len(pb.SendBatchResponse.FromString(response).more) if merge else 1
        count += answered
        for _ in range(answered):
            room.release()
    return count


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--payload", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tmp", default=None)
    parser.add_argument(
        "--no-merge", action="store_true", help="one answer a request (a stream without wire.MERGE_ANSWERS)"
    )
    parser.add_argument(
        "--dry", action="store_true", help="build the requests but send none (the baseline of an instruction count)"
    )
    args = parser.parse_args(argv)
    from qdelay.server.metrics import Metrics

    due = int(time.time() * 1000) + 600_000
    per_msg = []

    async def one_round(service: DelayService, r: int) -> None:
        # a warm-up stream first (the id filter's scan, the first segment, caches), then the
        # measured one: new ids into a fresh folder, as bench.compare's ingest on a new server
        warm = requests(-args.messages, args.messages // 10, args.batch, args.payload, due)
        await drive(service, warm, args.window, not args.no_merge)
        raws = requests(0, args.messages, args.batch, args.payload, due)
        cpu0, wall0 = time.thread_time_ns(), time.perf_counter()
        got = await drive(service, raws, args.window, not args.no_merge) if not args.dry else len(raws)
        cpu, wall = time.thread_time_ns() - cpu0, time.perf_counter() - wall0
        assert got == len(raws), (got, len(raws))
        per_msg.append(cpu / 1e3 / args.messages)
        print(
            f"round {r}: loop {cpu / 1e3 / args.messages:.3f} us/msg, "
            f"{args.messages / wall:,.0f} msgs/s, load {os.getloadavg()[0]:.2f}",
            flush=True,
        )

    for r in range(1, args.rounds + 1):
        workdir = tempfile.mkdtemp(prefix="qdbench-stream-loop-", dir=args.tmp)
        cfg = ServerConfig(data_dir=os.path.join(workdir, "data"), min_free_bytes=0, min_free_bytes_hard=0)
        cfg.engine_options["flush"] = "sync"
        engine = Engine(cfg.engine)
        engine.start(cleaner=False)
        try:
            asyncio.run(one_round(DelayService(engine, cfg, None, Metrics()), r))
        finally:
            engine.close()
            shutil.rmtree(workdir, ignore_errors=True)
    print(
        f"median loop CPU {statistics.median(per_msg):.3f} us/msg "
        f"({args.batch} x {args.window}, {args.rounds} rounds of {args.messages:,}); "
        f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
