"""The iterate service's CPU per message, by part, in process (server/iterate.py).

    python -m bench.iterate [--messages 200000] [--per-step 3000] [--checkpoint-every 30000]
                            [--rounds 3] [--id-bytes 22]

What bench.compare's ingest makes the ``qdelay-iterate`` thread do, without a server or a
client: a message log in a temporary folder is filled with ``--messages`` MESSAGE records
(100-byte payloads, message ids like the client's, due 1-60 min ahead, batches of 100),
then an ``IterateService`` with an id index (its filter built) copies them ``--per-step``
records a step (a busy server's step under ``iterate_gather_far_ms``: ~20 ms of ~150k
messages/s), with a checkpoint every ``--checkpoint-every`` records (its part on the
iterate thread: the write-behind flush; the fsyncs run on their own thread, as in the
server, and are left out). The loading horizon is the scheduler's default (2 min ahead).

The calling thread's CPU (``time.thread_time_ns``) is summed around each step and
checkpoint (``total``) and around each part, in µs a message:

- ``read``: the message log's ``read_raw_into``; ``scan``: the frame walk (``_scan``);
- ``ids``: ``IdIndex.put_frames``, and inside it ``ids.entries`` (``id_entries``),
  ``ids.filter`` (the id filter's ``add``), ``ids.write`` (RocksDB's write of the batch);
  ``ids.batch``: the rest (the WriteBatch and its puts, the chunking);
- ``route``: the routing into per-bucket buffers (native ``route`` or its twin), and inside
  it ``route.segments``: the segments ``route`` asks for, of buckets the schedule log has none of
  (their files created);
- ``append``: the schedule segments' appends, at once or at a checkpoint, and inside them
  ``append.entries`` (the schedule index's entries of the bytes, ``index_entries``) and
  ``append.pwrite`` (the segment's own write, ``Segment.append_many``);
- ``faults``: the thread's minor page faults a message (memory the heap handed back and
  took again: each costs ~0.5-1 µs in the kernel, counted in the parts above);
- ``other``: ``total`` minus the parts above (the numpy around route, the locks, ...).

Medians over ``--rounds`` rounds, each on a fresh folder. Prints a table; ``--json`` names
the output (default bench/out/iterate.json). Run it as the other benchmarks are run (see
docs/benchmarks.md): under the benchmark lock, with the machine's load quoted.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

from bench.common import machine, median, print_table, write_json
from qdelay.segments import naming, native, records, schedule_index
from qdelay.segments.bucket_log import BucketLog
from qdelay.segments.framing import RecordKind
from qdelay.segments.idindex import IdIndex
from qdelay.segments.segment import HandlePool, Segment
from qdelay.segments.wal import MessageLog
from qdelay.server import allocator
from qdelay.server.iterate import IterateService

BATCH = 100
PAYLOAD = 100
LOAD_AHEAD_MS = 120_000  # the scheduler's default loading horizon
PARTS = (
    "read",
    "scan",
    "ids",
    "ids.entries",
    "ids.filter",
    "ids.write",
    "ids.batch",
    "route",
    "route.segments",
    "append",
    "append.entries",
    "append.pwrite",
    "other",
)


class Clock:
    """Thread CPU ns per part, summed over calls of wrapped functions."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = dict.fromkeys(PARTS, 0)

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        tick = time.thread_time_ns
        ns = self.ns

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = tick()
            try:
                return fn(*args, **kwargs)
            finally:
                ns[part] += tick() - t0

        return timed


class _Codec:
    """The native codec (or None) with ``route`` and ``id_entries`` timed; the rest as is."""

    def __init__(self, codec: Any, clock: Clock) -> None:
        self._codec = codec
        self.route = clock.wrap("route", codec.route)
        self.id_entries = clock.wrap("ids.entries", codec.id_entries)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._codec, name)


class _Db:
    """The id index's Rdict with ``write`` timed (an Rdict takes no new attributes)."""

    def __init__(self, db: Any, clock: Clock) -> None:
        self._db = db
        self.write = clock.wrap("ids.write", db.write)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._db, name)


def _fill(wal: MessageLog, n: int, id_bytes: int, seed: int) -> None:
    rnd = random.Random(seed)
    now = int(time.time() * 1000)
    prefix = ("c" + os.urandom(8).hex() + "-")[: max(1, id_bytes - 6)]
    payload = b"p" * PAYLOAD
    for k in range(0, n, BATCH):
        bodies = [
            records.encode_message(
                b"bench", f"{prefix}{i:x}".encode(), b"", payload, now + int(rnd.uniform(60_000, 3_600_000))
            )
            for i in range(k, min(n, k + BATCH))
        ]
        wal.append([(RecordKind.MESSAGE, now, b) for b in bodies])


def one_round(args: argparse.Namespace, seed: int) -> dict[str, float]:
    root = tempfile.mkdtemp(prefix="qdelay-bench-iterate-", dir=args.dir)
    pool = HandlePool(256)
    wal = MessageLog(os.path.join(root, "message"), pool=pool, flush=args.flush)
    schedule = BucketLog(os.path.join(root, "schedule"), naming.SCHEDULE_SUFFIX, pool, indexed=True)
    ids = IdIndex(os.path.join(root, "ids"))
    codec = native.codec
    entries, append_many = schedule_index.index_entries, Segment.append_many
    try:
        ids.start_filter()
        deadline = time.monotonic() + 60
        while ids.filter_keys == 0 and ids._filter is None:  # noqa: SLF001 - the bench waits for the scan
            if time.monotonic() > deadline:
                raise RuntimeError("the id filter was not built")
            time.sleep(0.01)
        _fill(wal, args.messages, args.id_bytes, seed)
        frame_bytes = wal.committed_offset // args.messages
        it = IterateService(
            wal,
            schedule,
            os.path.join(root, "iterate.ckpt"),
            start_offset=wal.first_offset,
            start_sequence=0,
            checkpoint_interval=1e9,  # checkpoints by record count below
            read_bytes=args.per_step * frame_bytes,
            horizon=lambda: naming.bucket_of(int(time.time() * 1000) + LOAD_AHEAD_MS),
            ids=ids,
        )
        it.max_read_bytes = it.read_bytes
        clock = Clock()
        wal.read_raw_into = clock.wrap("read", wal.read_raw_into)  # type: ignore[method-assign]
        it._scan = clock.wrap("scan", it._scan)  # type: ignore[method-assign]  # noqa: SLF001
        ids.put_frames = clock.wrap("ids", ids.put_frames)  # type: ignore[method-assign]
        schedule.append = clock.wrap("append", schedule.append)  # type: ignore[method-assign]
        ids._db = _Db(ids._db, clock)  # type: ignore[assignment]  # noqa: SLF001
        flt = ids._filter  # noqa: SLF001
        if flt is not None:
            flt.add = clock.wrap("ids.filter", flt.add)  # type: ignore[method-assign]
        if codec is not None:
            native.codec = _Codec(codec, clock)  # type: ignore[assignment]
        it._segment_of = clock.wrap("route.segments", it._segment_of)  # type: ignore[method-assign]  # noqa: SLF001
        # module- and class-level: put back in ``finally``
        schedule_index.index_entries = clock.wrap("append.entries", entries)  # type: ignore[assignment]
        Segment.append_many = clock.wrap("append.pwrite", append_many)  # type: ignore[method-assign]
        tick = time.thread_time_ns
        faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        total = 0
        since = 0
        t0 = time.perf_counter()
        while True:
            a = tick()
            seq0 = it.sequence
            more = it.step()
            since += it.sequence - seq0
            if since >= args.checkpoint_every or not more:
                since = 0
                while not it._request_checkpoint():  # noqa: SLF001 - the previous one still syncing
                    time.sleep(0.001)
            total += tick() - a
            if not more:
                break
        wall = time.perf_counter() - t0
        faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults
        it.checkpoint()  # waits for the last background one
        n = it.counts["messages"]
        if n != args.messages:
            raise RuntimeError(f"copied {n} messages of {args.messages}")
        out = {p: ns / 1000 / n for p, ns in clock.ns.items()}
        out["ids.batch"] = out["ids"] - out["ids.entries"] - out["ids.filter"] - out["ids.write"]
        parts = ("read", "scan", "ids", "route", "append")
        out["total"] = total / 1000 / n
        out["other"] = out["total"] - sum(out[p] for p in parts)
        out["wall_s"] = wall
        out["faults"] = faults / n
        return out
    finally:
        native.codec = codec
        schedule_index.index_entries = entries  # type: ignore[assignment]
        Segment.append_many = append_many  # type: ignore[method-assign]
        wal.close()
        ids.close()
        pool.close()
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--per-step", type=int, default=3_000)
    parser.add_argument("--checkpoint-every", type=int, default=30_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--id-bytes", type=int, default=22, help="message id length (the client's ~22)")
    parser.add_argument("--flush", default="interval:3600000", help="the message log's flush policy while filling")
    parser.add_argument("--dir", default=None, help="where the temporary folder goes")
    parser.add_argument("--json", default="iterate")
    args = parser.parse_args(argv)
    allocator.tune()  # the server's heap settings (Engine): its page faults are part of the cost
    rounds = [one_round(args, seed) for seed in range(args.rounds)]
    keys = ["total", *PARTS, "faults"]
    rows = [[k, *(round(r[k], 3) for r in rounds), round(median([r[k] for r in rounds]), 3)] for k in keys]
    where = machine()
    print_table(
        ["part (µs/msg)", *(f"round {i + 1}" for i in range(len(rounds))), "median"],
        rows,
        title=f"iterate thread CPU, {args.messages} messages, {args.per_step} a step, "
        f"native={'yes' if native.codec is not None else 'no'}, load {where['loadavg']}",
    )
    write_json(args.json, {"machine": where, "args": vars(args), "rounds": rounds})


if __name__ == "__main__":
    main()
