"""Message-log (WAL) throughput: durable records/s next to this disk's raw limits.

    python -m bench.wal [--seconds 1.5] [--dir DIR]

Runs in a temporary directory (on the disk of ``--dir``, default the system temp dir):

1. the disk's raw limits: fdatasync calls/s with a 100-byte write before each, and
   sequential MB/s writing 1 MiB at a time with an fdatasync after each;
2. the message log with 1, 8 and 64 appender threads, 100-byte and 1 KiB records, each
   appender appending single records or (separately) batches of 100 records as
   SendBatch does; flush policy ``sync`` (acknowledged = durable);
3. the same 64 single-record appenders with fsync off (``interval`` policy with an
   interval longer than the run), to see what group commit costs.

Reports records/s, MB/s, records per fdatasync and process CPU per record, then the two
goals of issue #2 as ratios. Writes bench/out/wal.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import threading
import time

from bench.common import Meter, machine, print_table, write_json
from qdelay.segments.framing import RecordKind
from qdelay.segments.wal import MessageLog

GOAL_BATCH_RECORDS_PER_S = 200_000  # 8 appenders x 100-record batches of 100 B, durable
GOAL_GROUP_COMMIT_RATIO = 0.5  # 64 single appenders: durable / fsync-off
FSYNC_OFF = "interval:3600000"  # an interval longer than any run: no fdatasync at all
MIB = 1024 * 1024


def raw_fdatasync_rate(directory: str, seconds: float) -> float:
    """fdatasync calls/s, each after a 100-byte append (the floor of one durable write)."""
    path = os.path.join(directory, "raw-fdatasync")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        record = b"r" * 100
        calls = 0
        deadline = time.perf_counter() + seconds
        start = time.perf_counter()
        while time.perf_counter() < deadline:
            os.write(fd, record)
            os.fdatasync(fd)
            calls += 1
        return calls / (time.perf_counter() - start)
    finally:
        os.close(fd)
        os.unlink(path)


def raw_sequential_mb_s(directory: str, seconds: float, limit_bytes: int = 1024 * MIB) -> float:
    """Sequential write MB/s (10^6 bytes) with an fdatasync after every MiB."""
    path = os.path.join(directory, "raw-sequential")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        chunk = os.urandom(MIB)
        written = 0
        deadline = time.perf_counter() + seconds
        start = time.perf_counter()
        while time.perf_counter() < deadline and written < limit_bytes:
            os.write(fd, chunk)
            os.fdatasync(fd)
            written += MIB
        return written / (time.perf_counter() - start) / 1e6
    finally:
        os.close(fd)
        os.unlink(path)


def run_appenders(directory: str, record_bytes: int, appenders: int, batch: int, flush: str, seconds: float) -> dict:
    """``appenders`` threads each append ``batch`` records per call for ``seconds``."""
    workdir = tempfile.mkdtemp(prefix="wal-", dir=directory)
    log = MessageLog(workdir, flush=flush)
    now_ms = int(time.time() * 1000)
    entries = [(RecordKind.MESSAGE, now_ms, os.urandom(record_bytes)) for _ in range(batch)]
    counts = [0] * appenders
    stop = threading.Event()
    go = threading.Barrier(appenders + 1)

    def appender(i: int) -> None:
        go.wait()
        append = log.append
        n = 0
        while not stop.is_set():
            append(entries)
            n += batch
        counts[i] = n

    threads = [threading.Thread(target=appender, args=(i,), daemon=True) for i in range(appenders)]
    for t in threads:
        t.start()
    fsyncs_before = log.fsyncs
    with Meter() as meter:
        go.wait()
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join()
    fsyncs = log.fsyncs - fsyncs_before
    log.close()
    shutil.rmtree(workdir, ignore_errors=True)
    records = sum(counts)
    return {
        "record_bytes": record_bytes,
        "appenders": appenders,
        "batch": batch,
        "flush": flush,
        "records": records,
        "seconds": meter.wall,
        "cpu_seconds": meter.cpu,
        "records_per_s": records / meter.wall,
        "mb_per_s": records * record_bytes / meter.wall / 1e6,
        "fdatasyncs": fsyncs,
        "records_per_fdatasync": records / fsyncs if fsyncs else float("nan"),
        "cpu_us_per_record": meter.cpu / records * 1e6 if records else float("nan"),
    }


def run_coroutines(directory: str, record_bytes: int, appenders: int, flush: str, seconds: float) -> dict:
    """``appenders`` coroutines on one event loop each ``await append_async`` one record at a
    time: the shape of the server's Send path."""
    workdir = tempfile.mkdtemp(prefix="wal-", dir=directory)
    log = MessageLog(workdir, flush=flush)
    entries = [(RecordKind.MESSAGE, int(time.time() * 1000), os.urandom(record_bytes))]
    counts = [0] * appenders

    async def appender(i: int, deadline: float) -> None:
        n = 0
        while time.perf_counter() < deadline:
            await log.append_async(entries)
            n += 1
        counts[i] = n

    async def main() -> None:
        deadline = time.perf_counter() + seconds
        await asyncio.gather(*(appender(i, deadline) for i in range(appenders)))

    fsyncs_before = log.fsyncs
    with Meter() as meter:
        asyncio.run(main())
    fsyncs = log.fsyncs - fsyncs_before
    log.close()
    shutil.rmtree(workdir, ignore_errors=True)
    records = sum(counts)
    return {
        "record_bytes": record_bytes,
        "appenders": appenders,
        "batch": 1,
        "flush": flush,
        "asyncio": True,
        "records": records,
        "seconds": meter.wall,
        "cpu_seconds": meter.cpu,
        "records_per_s": records / meter.wall,
        "mb_per_s": records * record_bytes / meter.wall / 1e6,
        "fdatasyncs": fsyncs,
        "records_per_fdatasync": records / fsyncs if fsyncs else float("nan"),
        "cpu_us_per_record": meter.cpu / records * 1e6 if records else float("nan"),
    }


def pick_median(runs: list[dict]) -> dict:
    """The run with the median records/s (keeps its other columns consistent)."""
    ordered = sorted(runs, key=lambda r: r["records_per_s"])
    chosen = dict(ordered[len(ordered) // 2])
    chosen["runs"] = len(runs)
    chosen["records_per_s_all"] = [round(r["records_per_s"]) for r in runs]
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=1.5, help="duration of each run")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each goal scenario (median)")
    parser.add_argument("--dir", default=None, help="directory on the disk to measure")
    args = parser.parse_args()

    started = time.perf_counter()
    before = machine()
    directory = tempfile.mkdtemp(prefix="qdelay-bench-wal-", dir=args.dir)
    try:
        fdatasync_per_s = raw_fdatasync_rate(directory, 1.0)
        sequential_mb_s = raw_sequential_mb_s(directory, 1.0)
        print_table(
            ["raw limit of this disk", "value"],
            [
                ["fdatasync calls/s (100-byte append each)", fdatasync_per_s],
                ["sequential MB/s (fdatasync per MiB)", sequential_mb_s],
            ],
            title=f"# raw disk ({directory})",
        )
        print()

        runs: dict[tuple, list[dict]] = {}

        def measure(record_bytes: int, appenders: int, batch: int, flush: str) -> None:
            key = (record_bytes, appenders, batch, flush)
            runs.setdefault(key, []).append(
                run_appenders(directory, record_bytes, appenders, batch, flush, args.seconds)
            )

        for record_bytes in (100, 1024):
            for batch in (1, 100):
                for appenders in (1, 8, 64):
                    measure(record_bytes, appenders, batch, "sync")
            measure(record_bytes, 64, 1, FSYNC_OFF)
        for _ in range(args.repeats - 1):  # the goal scenarios again, interleaved, for a median
            measure(100, 8, 100, "sync")
            measure(100, 64, 1, "sync")
            measure(100, 64, 1, FSYNC_OFF)

        results = {key: pick_median(rs) for key, rs in runs.items()}
        # the server's path: coroutines awaiting append_async on one event loop
        for flush in ("sync", FSYNC_OFF):
            results[(100, 64, 1, flush, "asyncio")] = pick_median(
                [run_coroutines(directory, 100, 64, flush, args.seconds)]
            )
        rows = []
        for key, r in results.items():
            record_bytes, appenders, batch, flush = key[:4]
            rows.append(
                [
                    record_bytes,
                    appenders,
                    batch,
                    "sync" if flush == "sync" else "off",
                    "coroutines" if len(key) > 4 else "threads",
                    r["records_per_s"],
                    r["mb_per_s"],
                    r["records_per_fdatasync"],
                    r["cpu_us_per_record"],
                    r["runs"],
                ]
            )
        print_table(
            [
                "record B",
                "appenders",
                "batch",
                "fsync",
                "appender kind",
                "records/s",
                "MB/s",
                "records/fdatasync",
                "CPU µs/record",
                "runs",
            ],
            rows,
            title="# message log (median of runs)",
        )
        print()

        goal1 = results[(100, 8, 100, "sync")]["records_per_s"]
        durable64 = results[(100, 64, 1, "sync")]["records_per_s"]
        off64 = results[(100, 64, 1, FSYNC_OFF)]["records_per_s"]
        goals = [
            [
                "1: 8 appenders x 100-record batches, 100 B, durable",
                f"{goal1:,.0f} rec/s",
                f">= {GOAL_BATCH_RECORDS_PER_S:,}",
                f"{goal1 / GOAL_BATCH_RECORDS_PER_S:.2f}x",
                "met" if goal1 >= GOAL_BATCH_RECORDS_PER_S else "MISSED",
            ],
            [
                "2: 64 single appenders, 100 B, durable / fsync off",
                f"{durable64:,.0f} / {off64:,.0f}",
                f">= {GOAL_GROUP_COMMIT_RATIO:.0%}",
                f"{durable64 / off64:.0%}",
                "met" if durable64 >= GOAL_GROUP_COMMIT_RATIO * off64 else "MISSED",
            ],
        ]
        print_table(["goal", "measured", "target", "ratio", ""], goals, title="# goals (issue #2)")
        after = machine()
        elapsed = time.perf_counter() - started
        print(
            f"\nload average before {before['loadavg']}, after {after['loadavg']}; "
            f"{before['cpus']} CPUs; bench took {elapsed:.0f} s"
        )
        out = write_json(
            "wal",
            {
                "machine_before": before,
                "machine_after": after,
                "elapsed_s": elapsed,
                "raw": {"fdatasync_per_s": fdatasync_per_s, "sequential_mb_s": sequential_mb_s},
                "runs": [dict(r, key=list(k)) for k, r in results.items()],
                "goals": {
                    "batch_records_per_s": goal1,
                    "durable64_records_per_s": durable64,
                    "off64_records_per_s": off64,
                    "group_commit_ratio": durable64 / off64,
                },
            },
        )
        print(f"wrote {os.path.relpath(out)}")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
