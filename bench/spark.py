"""Spark source throughput and audit wall time (``python -m bench.spark``): issue 17's table.

Writes a data folder of N schedule records (default 1,000,000; 100-byte payloads, spread
over ``--minutes`` due minutes, so one schedule segment per minute) with the real storage
code (``Segment.append(framing.encode(...))``, exactly the server's layout), plus DISPATCH
records for most of them, then measures in the same run:

1. the reader alone, one core, no Spark: the columnar reader (``spark_source.read_piece``:
   native frame walk, columns cut from the bytes) with every column and with the jobs'
   columns, and its per-record Python twin (``read_piece_py``) for reference;
2. the Spark source on ``--master`` (default ``local[2]``): ``count()`` and a
   ``groupBy(subject)`` aggregate over every record (first query of the session reported
   apart: it includes worker start), with every column and with only the columns used;
3. the ``audit`` job on that folder (wall time: the first run of the session, and the
   median of ``--repeat`` more);
4. the other jobs of ``qdelay spark`` (``--jobs``: ``lateness``, ``forecast``, ``export`` to
   Parquet in a temporary folder), once each, the session warm: run it at two
   ``--records`` to see each against the number of records.

Results: a Markdown table on stdout and ``bench/out/spark.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from bench.common import machine, print_table, write_json
from qdelay.segments import checkpoint, framing, naming, records
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
    # every subject has a consumer group (the iterate checkpoint's table, as the server saves
    # it): the audit then counts the undispatched past-due messages as lost, not as kept for
    # a first group
    groups = [[subject, records.DEFAULT_GROUP, -(2**62), T0 - 3_600_000] for subject in SUBJECTS]
    state = {"offset": 0, "sequence": seq, "groups": groups, "groups_kept_since": [], "groups_seq": 0}
    checkpoint.write(os.path.join(root, naming.CHECKPOINT_DIR, "iterate" + naming.CHECKPOINT_SUFFIX), state)
    return {
        "schedule_records": seq,
        "schedule_bytes": sched_bytes,
        "dispatch_records": dispatched,
        "dispatch_bytes": disp_bytes,
        "segments": minutes,
    }


def reader_scan(root: str, fn_name: str = "read_piece", columns=None) -> int:
    """Rows of every schedule segment through one of the source's piece readers (1 core)."""
    from qdelay.tools import spark_source

    fn = getattr(spark_source, fn_name)
    n = 0
    for part in spark_source.plan([os.path.abspath(root)], ("schedule",), 64 << 20, 0):
        for piece in part.pieces:
            for batch in fn(piece, "row", 65536, True, columns):
                n += batch.num_rows
    return n


@contextlib.contextmanager
def standalone(workdir: str, cores: int = 2, memory: str = "2g"):
    """A Spark standalone master and one worker on 127.0.0.1, started from the PySpark
    installation (``spark-class``); yields the master URL; stops both on exit."""
    import pyspark

    home = os.path.dirname(pyspark.__file__)
    env = dict(os.environ, SPARK_HOME=home, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)
    ports = []
    for _ in range(4):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    cls = os.path.join(home, "bin", "spark-class")
    url = f"spark://127.0.0.1:{ports[0]}"
    cmds = [
        (
            "master",
            [cls, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(ports[0])]
            + ["--webui-port", str(ports[1])],
            "I have been elected leader",
        ),
        (
            "worker",
            [cls, "org.apache.spark.deploy.worker.Worker", url, "--host", "127.0.0.1", "--cores", str(cores)]
            + ["--memory", memory, "--port", str(ports[2]), "--webui-port", str(ports[3])]
            + ["--work-dir", os.path.join(workdir, "work")],
            "Successfully registered with master",
        ),
    ]
    procs = []
    try:
        for name, cmd, ready in cmds:
            log = os.path.join(workdir, f"{name}.log")
            procs.append(subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env))
            deadline = time.monotonic() + 120
            while ready not in open(log).read():
                if time.monotonic() > deadline or procs[-1].poll() is not None:
                    raise RuntimeError(f"spark {name} did not start: see {log}")
                time.sleep(0.2)
        yield url
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait(timeout=30)


def timed(fn, repeat: int):
    """(last value, median seconds, every run's seconds): the box is shared, so the
    median of the repeats, not the best, is the figure quoted."""
    times, value = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - t)
    return value, statistics.median(times), times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.spark", description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--minutes", type=int, default=60, help="due minutes (= schedule segments)")
    ap.add_argument("--payload", type=int, default=100)
    ap.add_argument("--dispatched", type=float, default=0.9, help="fraction with a dispatch record")
    ap.add_argument("--master", default="local[2]")
    ap.add_argument(
        "--standalone",
        action="store_true",
        help="start a standalone master and a 2-core worker on loopback and use them as --master",
    )
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--jobs", default="lateness,forecast,export", help="the other qdelay spark jobs to time once (comma-separated)"
    )
    ap.add_argument("--data", default=None, help="keep the data folder here (default: a temp dir, removed)")
    args = ap.parse_args(argv)

    root = args.data or tempfile.mkdtemp(prefix="qdelay-bench-spark-")
    result: dict = {"machine_before": machine(), "args": vars(args)}
    stack = contextlib.ExitStack()
    try:
        if args.standalone:
            args.master = stack.enter_context(standalone(tempfile.mkdtemp(prefix="qdelay-bench-cluster-")))
            print(f"standalone cluster at {args.master}", flush=True)
        if not os.path.isdir(os.path.join(root, naming.SCHEDULE_DIR)):
            t = time.perf_counter()
            result["data"] = build(root, args.records, args.minutes, args.payload, args.dispatched)
            result["data"]["build_s"] = time.perf_counter() - t
            print(f"built {result['data']} in {result['data']['build_s']:.1f} s", flush=True)
        import pyarrow  # noqa: F401  (imported before timing: the first call would pay for it)

        from qdelay.tools import spark_jobs, spark_source

        job_cols = spark_jobs.JOB_COLUMNS
        n_col, t_col, _ = timed(lambda: reader_scan(root), args.repeat)
        _, t_col_jobs, _ = timed(lambda: reader_scan(root, columns=job_cols), args.repeat)
        n_py, t_py, _ = timed(lambda: reader_scan(root, "read_piece_py"), 1)
        print(f"reader alone: columnar {t_col:.3f} s (jobs' columns {t_col_jobs:.3f} s), twin {t_py:.2f} s", flush=True)

        t = time.perf_counter()
        spark = spark_source.session(args.master, "qdelay-bench", {"spark.sql.shuffle.partitions": "8"})
        t_session = time.perf_counter() - t

        def df(columns=None):
            return spark_source.read(spark, root, log="schedule", columns=columns)

        t = time.perf_counter()
        first = df().count()
        t_first = time.perf_counter() - t
        n_spark, t_count, counts = timed(lambda: df().count(), args.repeat)
        _, t_count_pruned, _ = timed(lambda: df(["sequence"]).count(), args.repeat)

        def group(columns=None):
            return df(columns).groupBy("subject").agg({"due_ms": "max", "*": "count"}).collect()

        _, t_group, groups = timed(group, args.repeat)
        _, t_group_pruned, _ = timed(lambda: group(["subject", "due_ms"]), args.repeat)
        partitions = df().rdd.getNumPartitions()
        segments = len(spark_source.plan([os.path.abspath(root)], ("schedule",), 64 << 20, 0))
        print(f"spark count {n_spark} median {t_count:.2f} s (first query {t_first:.1f} s)", flush=True)
        now = T0 + (args.minutes + 10) * 60_000
        audits = []
        summary = None
        for _ in range(1 + max(args.repeat, 1)):
            t = time.perf_counter()
            summary = spark_jobs.audit(spark, [root], now, 60_000)
            audits.append(time.perf_counter() - t)
        # the other jobs of ``qdelay spark`` on the same folder, once each (the session warm)
        jobs_s: dict[str, float] = {}
        out_dir = tempfile.mkdtemp(prefix="qdelay-bench-spark-export-")
        try:
            for name, job in (
                ("lateness", lambda: spark_jobs.lateness(spark, [root])),
                ("forecast", lambda: spark_jobs.forecast(spark, [root], T0)),
                ("export", lambda: spark_jobs.export(spark, [root], out_dir)),
            ):
                if name in args.jobs.split(","):
                    t = time.perf_counter()
                    job()
                    jobs_s[name] = time.perf_counter() - t
                    print(f"{name} job: {jobs_s[name]:.1f} s", flush=True)
        finally:
            shutil.rmtree(out_dir, ignore_errors=True)
        spark.stop()
        assert first == n_spark == n_col == n_py
        n_all = summary["messages"] + summary["dispatch_records"]
        result.update(
            {
                "records": n_col,
                "partitions": partitions,
                "reader_columnar_s": t_col,
                "reader_columnar_rps": n_col / t_col,
                "reader_columnar_job_columns_s": t_col_jobs,
                "reader_python_twin_s": t_py,
                "reader_python_twin_rps": n_py / t_py,
                "spark_session_s": t_session,
                "spark_first_count_s": t_first,
                "spark_count_s": t_count,
                "spark_count_rps": n_spark / t_count,
                "spark_count_runs": counts,
                "spark_count_pruned_s": t_count_pruned,
                "spark_groupby_s": t_group,
                "spark_groupby_rps": n_spark / t_group,
                "spark_groupby_runs": groups,
                "spark_groupby_pruned_s": t_group_pruned,
                "audit_s": audits,
                "audit_records": n_all,
                "audit_findings": summary["findings"],
                "jobs_s": jobs_s,
                "machine_after": machine(),
            }
        )
        m = args.master
        rows = [
            [f"Spark source {m}: count(), every column", n_spark, t_count, n_spark / t_count, "≥ 1.5 M/s"],
            [
                f"Spark source {m}: count(), schema 'sequence long'",
                n_spark,
                t_count_pruned,
                n_spark / t_count_pruned,
                "",
            ],
            [f"Spark source {m}: groupBy(subject) agg, every column", n_spark, t_group, n_spark / t_group, "≥ 1 M/s"],
            [
                f"Spark source {m}: groupBy(subject) agg, schema subject+due_ms",
                n_spark,
                t_group_pruned,
                n_spark / t_group_pruned,
                "",
            ],
            [f"audit job {m}, first run (schedule + dispatch)", n_all, audits[0], n_all / audits[0], ""],
            [
                f"audit job {m}, later runs (median of {len(audits) - 1})",
                n_all,
                statistics.median(audits[1:]),
                n_all / statistics.median(audits[1:]),
                "≤ 5 s",
            ],
            *[[f"{name} job {m} (schedule + dispatch), once", n_all, t, n_all / t, ""] for name, t in jobs_s.items()],
            ["reader alone, columnar, every column (1 core)", n_col, t_col, n_col / t_col, "≥ 5 M/s"],
            ["reader alone, columnar, the jobs' columns (1 core)", n_col, t_col_jobs, n_col / t_col_jobs, ""],
            ["reader alone, per-record Python twin (1 core)", n_py, t_py, n_py / t_py, "(reference)"],
        ]
        print()
        print_table(
            ["what", "records", "seconds (median)", "records/s", "goal"],
            rows,
            title=f"{n_col:,} schedule records in {segments} segments read as {partitions} partitions, "
            f"payload {args.payload} B; session start {t_session:.1f} s, "
            f"first query {t_first:.1f} s; load before/after "
            f"{result['machine_before']['loadavg']} / {result['machine_after']['loadavg']}",
        )
        print(f"audit findings: {summary['findings']}")
        print("written", write_json("spark", result))
    finally:
        stack.close()
        if args.data is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
