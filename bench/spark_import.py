"""``qdelay spark import`` against the number of records (``python -m bench.spark_import``).

    python -m bench.spark_import [--records 20000,200000] [--master local[2]] [--json FILE]

One real server (``qdelay server`` on 127.0.0.1, sync flush, the defaults, a temporary
folder) and one Spark session on ``--master``. For each count N of ``--records``, a Parquet
dataset of N rows (subject, 100-byte payload, a far-future ``deliver_at_ms`` so nothing
fires, no message id: the job derives one from each row's content) is imported by
``spark_jobs.import_dataset`` (the code of ``qdelay spark import``; the session and the
server warmed first by an import of 500 rows): wall, records/s and the server's CPU per
record; then the same import again with every row already in its report (a resume: a
join against the report, nothing sent): wall and the server's CPU (its timers only).
Writes bench/out/spark_import.json (or ``--json``); bench.spark measures the other jobs.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import psutil

from bench.common import Meter, machine, print_table, write_json
from bench.peers import QdelayDriver

DAY_MS = 86_400_000
SUBJECTS = [f"bench.subject.{i}" for i in range(16)]


def dataset(path: str, n: int, base_ms: int) -> None:
    """A Parquet file of ``n`` distinct rows (distinct content: distinct derived ids)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table(
            {
                "subject": [SUBJECTS[i % len(SUBJECTS)] for i in range(n)],
                "payload": [b"%08d" % i + b"x" * 92 for i in range(n)],
                "deliver_at_ms": pa.array([base_ms + i for i in range(n)], pa.int64()),
            }
        ),
        path,
    )


def run(levels: list[int], master: str) -> list[dict]:
    from qdelay.tools import spark_jobs, spark_source

    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="qdelay-bench-spark-import-") as tmp:
        os.makedirs(os.path.join(tmp, "server"))
        server = QdelayDriver()
        server.start(os.path.join(tmp, "server"))
        spark = None
        try:
            spark = spark_source.session(master, "qdelay-bench-import", {"spark.sql.shuffle.partitions": "8"})
            target = f"127.0.0.1:{server.port}"
            base = (int(time.time() * 1000) // 60_000 + 60) * 60_000 + 2 * DAY_MS
            for k, n in enumerate([500, *levels]):  # 500 first: the session's and server's first import
                data = os.path.join(tmp, f"in{k}.parquet")
                dataset(data, n, base + k * DAY_MS)
                out = os.path.join(tmp, f"report{k}")
                with Meter(server.pid) as m:
                    got = spark_jobs.import_dataset(spark, data, target, out, "parquet")
                if got["accepted"] != n or got["rejected"]:
                    raise SystemExit(f"bench.spark_import: {got} for {n} rows")
                with Meter(server.pid) as again:
                    resumed = spark_jobs.import_dataset(spark, data, target, out, "parquet")
                if resumed["already_accepted"] != n:
                    raise SystemExit(f"bench.spark_import: the resume found {resumed} for {n} rows")
                if k == 0:
                    continue
                row = {
                    "records": n,
                    "import_s": m.wall,
                    "import_rps": n / m.wall,
                    "server_cpu_us": m.cpu / n * 1e6,
                    "resume_s": again.wall,
                    "resume_server_cpu_ms": again.cpu * 1000,
                    "server_rss_mb": psutil.Process(server.pid).memory_info().rss / 2**20,
                }
                rows.append(row)
                print(row, flush=True)
        finally:
            if spark is not None:
                spark.stop()
            server.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.spark_import", description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", default="20000,200000", help="dataset sizes N, ascending, comma-separated")
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--json", default="spark_import", help="output name under bench/out, or a path")
    args = ap.parse_args(argv)
    levels = sorted(int(x) for x in args.records.split(",") if x)
    rows = run(levels, args.master)
    print_table(
        ["records", "import s", "records/s", "server µs CPU a record", "resume (all accepted) s", "its server CPU ms"],
        [
            [r["records"], r["import_s"], r["import_rps"], r["server_cpu_us"], r["resume_s"], r["resume_server_cpu_ms"]]
            for r in rows
        ],
        title=f"qdelay spark import on {args.master} against the number of records",
    )
    print("written", write_json(args.json, {"machine": machine(), "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
