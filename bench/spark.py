"""Spark source throughput and audit wall time (``python -m bench.spark``).

Writes a data folder of N schedule records (default 1,000,000; 100-byte payloads, spread
over ``--minutes`` due minutes, so one schedule segment per minute) with the real storage
code (``Segment.append(framing.encode(...))``, exactly the server's layout), plus DISPATCH
records for most of them, then measures in the same run:

1. plain Python: the same walker and codec the Spark reader uses (``inspect.walk``: frame
   checksum + body decode), one core, no Spark;
2. the same plus building the Arrow batches (``spark_source.read_piece``), one core;
3. the Spark source on ``local[2]``: ``count()`` and a ``groupBy(subject)`` aggregate over
   every record (first query of the session reported apart: it includes worker start);
4. the ``audit`` job on that folder (wall time).

Results: a Markdown table on stdout and ``bench/out/spark.json``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

from bench.common import machine, print_table, write_json
from qdelay.segments import framing, naming, records
from qdelay.segments.framing import RecordKind
from qdelay.segments.records import Dispatch, Message, Outcome
from qdelay.segments.segment import HandlePool, Segment

T0 = 1_767_225_600_000  # 2026-01-01T00:00Z
SUBJECTS = [f"bench.subject.{i}" for i in range(16)]


def build(root: str, n: int, minutes: int, payload_bytes: int, dispatched_fraction: float) -> dict:
    """Schedule segments (one per due minute) and dispatch segments; returns sizes."""
    pool = HandlePool(8)
    per_minute = -(-n // minutes)
    payload = b"x" * payload_bytes
    seq = 0
    sched_bytes = disp_bytes = dispatched = 0
    for m in range(minutes):
        bucket = T0 // 60_000 + m
        count = min(per_minute, n - seq)
        if count <= 0:
            break
        spath = os.path.join(root, naming.SCHEDULE_DIR, naming.bucket_relpath(bucket, naming.SCHEDULE_SUFFIX))
        dpath = os.path.join(root, naming.DISPATCH_DIR, naming.bucket_relpath(bucket, naming.DISPATCH_SUFFIX))
        os.makedirs(os.path.dirname(spath), exist_ok=True)
        os.makedirs(os.path.dirname(dpath), exist_ok=True)
        sbuf, dbuf = bytearray(), bytearray()
        cut = int(count * dispatched_fraction)
        for i in range(count):
            seq += 1
            due = bucket * 60_000 + (i * 59_999) // count
            mid = f"bench-{seq:08d}"
            body = records.encode_message_obj(Message(SUBJECTS[seq % len(SUBJECTS)], payload, due, mid))
            offset = len(sbuf)
            sbuf += framing.encode(RecordKind.MESSAGE, seq, T0 - 3_600_000 + seq, body)
            if i < cut:
                d = Dispatch(mid, due, due + 3 + seq % 50, offset, 1, Outcome.DELIVERED)
                dbuf += framing.encode(RecordKind.DISPATCH, seq, due + 10 + seq % 50, records.encode_dispatch(d))
                dispatched += 1
        for path, buf in ((spath, sbuf), (dpath, dbuf)):
            seg = Segment(path, bucket, pool, size=0)
            seg.append(buf)
            seg.sync()
        sched_bytes += len(sbuf)
        disp_bytes += len(dbuf)
    pool.close()
    return {
        "schedule_records": seq,
        "schedule_bytes": sched_bytes,
        "dispatch_records": dispatched,
        "dispatch_bytes": disp_bytes,
        "segments": minutes,
    }


def plain_scan(root: str) -> tuple[int, float]:
    from qdelay.tools.inspect import segment_files, walk_file

    t = time.perf_counter()
    n = 0
    for sf in segment_files(root, ("schedule",)):
        for item in walk_file(sf):
            if item.record is not None:
                n += 1
    return n, time.perf_counter() - t


def arrow_scan(root: str) -> tuple[int, float]:
    from qdelay.tools import spark_source

    t = time.perf_counter()
    n = 0
    for part in spark_source.plan([os.path.abspath(root)], ("schedule",), 64 << 20, 0):
        for piece in part.pieces:
            for batch in spark_source.read_piece(piece, "row", 8192):
                n += batch.num_rows
    return n, time.perf_counter() - t


def best(fn, repeat: int):
    times, value = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - t)
    return value, min(times), times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.spark", description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--minutes", type=int, default=60, help="due minutes (= schedule segments)")
    ap.add_argument("--payload", type=int, default=100)
    ap.add_argument("--dispatched", type=float, default=0.9, help="fraction with a dispatch record")
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--data", default=None, help="keep the data folder here (default: a temp dir, removed)")
    args = ap.parse_args(argv)

    root = args.data or tempfile.mkdtemp(prefix="qdelay-bench-spark-")
    result: dict = {"machine_before": machine(), "args": vars(args)}
    try:
        if not os.path.isdir(os.path.join(root, naming.SCHEDULE_DIR)):
            t = time.perf_counter()
            result["data"] = build(root, args.records, args.minutes, args.payload, args.dispatched)
            result["data"]["build_s"] = time.perf_counter() - t
            print(f"built {result['data']} in {result['data']['build_s']:.1f} s", flush=True)
        n_plain, t_plain, _ = best(lambda: plain_scan(root)[0], args.repeat)
        n_arrow, t_arrow, _ = best(lambda: arrow_scan(root)[0], args.repeat)
        print(f"plain scan {n_plain} in {t_plain:.2f} s; with Arrow {n_arrow} in {t_arrow:.2f} s", flush=True)

        from qdelay.tools import spark_jobs, spark_source

        t = time.perf_counter()
        spark = spark_source.session(args.master, "qdelay-bench", {"spark.sql.shuffle.partitions": "8"})
        t_session = time.perf_counter() - t

        def df():
            return spark.read.format("qdelay").option("log", "schedule").load(root)

        t = time.perf_counter()
        first = df().count()
        t_first = time.perf_counter() - t
        n_spark, t_count, counts = best(lambda: df().count(), args.repeat)
        _, t_group, groups = best(
            lambda: df().groupBy("subject").agg({"due_ms": "max", "*": "count"}).collect(), args.repeat
        )
        _, t_light, lights = best(
            lambda: spark.read.format("qdelay").option("log", "schedule").option("payload", "false").load(root).count(),
            args.repeat,
        )
        partitions = df().rdd.getNumPartitions()
        print(f"spark count {n_spark} best {t_count:.2f} s (first query {t_first:.1f} s)", flush=True)
        now = T0 + (args.minutes + 10) * 60_000
        audits = []
        summary = None
        for _ in range(2):
            t = time.perf_counter()
            summary = spark_jobs.audit(spark, [root], now, 60_000)
            audits.append(time.perf_counter() - t)
        spark.stop()
        assert first == n_spark == n_plain == n_arrow
        n_all = summary["messages"] + summary["dispatch_records"]
        result.update(
            {
                "records": n_plain,
                "partitions": partitions,
                "plain_python_s": t_plain,
                "plain_python_rps": n_plain / t_plain,
                "python_arrow_s": t_arrow,
                "python_arrow_rps": n_arrow / t_arrow,
                "spark_session_s": t_session,
                "spark_first_count_s": t_first,
                "spark_count_s": t_count,
                "spark_count_rps": n_spark / t_count,
                "spark_count_runs": counts,
                "spark_count_no_payload_s": t_light,
                "spark_count_no_payload_rps": n_spark / t_light,
                "spark_groupby_s": t_group,
                "spark_groupby_rps": n_spark / t_group,
                "spark_groupby_runs": groups,
                "audit_s": audits,
                "audit_findings": summary["findings"],
                "machine_after": machine(),
            }
        )
        rows = [
            ["plain Python scan (walk: checksum + decode), 1 core", n_plain, t_plain, n_plain / t_plain],
            ["Python scan + Arrow batches (read_piece), 1 core", n_arrow, t_arrow, n_arrow / t_arrow],
            [f"Spark source {args.master}: count()", n_spark, t_count, n_spark / t_count],
            [f"Spark source {args.master}: groupBy(subject) agg", n_spark, t_group, n_spark / t_group],
            [f"Spark source {args.master}: count(), option payload=false", n_spark, t_light, n_spark / t_light],
            [f"audit job {args.master}, first run (schedule + dispatch logs)", n_all, audits[0], n_all / audits[0]],
            [f"audit job {args.master}, second run", n_all, audits[1], n_all / audits[1]],
        ]
        print()
        print_table(
            ["what", "records", "seconds (best)", "records/s"],
            rows,
            title=f"{n_plain:,} schedule records in {partitions} segments, "
            f"payload {args.payload} B; session start {t_session:.1f} s, "
            f"first query {t_first:.1f} s; load before/after "
            f"{result['machine_before']['loadavg']} / {result['machine_after']['loadavg']}",
        )
        print(f"audit findings: {summary['findings']}")
        print("written", write_json("spark", result))
    finally:
        if args.data is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
