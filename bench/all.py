"""Run every benchmark in sequence (``make bench``) and say where each wrote its figures.

    python -m bench.all            # full runs (long: the comparison and Spark take a while)
    python -m bench.all --quick    # smaller counts / shorter runs, a smoke run
    python -m bench.all --only wal,scheduler
    python -m bench.all --dry-run  # print the commands only

Each benchmark runs as its own process (``python -m bench.<name> ...``), so one that
fails does not stop the others; the exit code is 1 if any failed. Figures go to
``bench/out/<name>.json`` (git-ignored); docs/benchmarks.md explains them.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from bench.common import OUT_DIR

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def plan(quick: bool) -> list[tuple[str, list[str], str]]:
    """(name, arguments, the file it writes) per benchmark, in running order."""

    def out(name: str) -> str:
        return os.path.join(OUT_DIR, f"{name}.json")

    return [
        # the message log: no --quick flag, shorter and fewer runs instead
        ("wal", ["--seconds", "0.5", "--repeats", "1"] if quick else [], out("wal")),
        # writes its JSON only when told where
        (
            "scheduler",
            ["--json", os.path.relpath(out("scheduler"), ROOT)] + (["--quick"] if quick else []),
            out("scheduler"),
        ),
        # the default scenarios and issue 15's producer shapes
        (
            "compare",
            ["--out", "compare", "--scenarios", "ingest,lateness,burst,memory,crash,shapes"]
            + (["--scale", "0.1"] if quick else []),
            out("compare"),
        ),
        # cancel, get and reschedule against the size of a minute bucket (issue 13)
        (
            "cancel",
            (["--sizes", "1000,10000", "--cancels", "300", "--gets", "100", "--reschedules", "100"] if quick else []),
            out("cancel"),
        ),
        # send, re-send and lookups against the number of pending messages
        ("pending", ["--levels", "0,100000", "--messages", "20000"] if quick else [], out("pending")),
        ("ingest", ["--messages", "20000", "--unary-messages", "2000"] if quick else [], out("ingest")),
        # the id filter in front of the id index as it grows past its capacity (in process)
        ("idfilter", ["--up-to", "1200000", "--lookup-keys", "200000"] if quick else [], out("idfilter")),
        # the iterate service's CPU per message, by part (in process)
        ("iterate", ["--messages", "20000", "--rounds", "1"] if quick else [], out("iterate")),
        ("grpc_floor", ["--batches", "200", "--repeats", "1"] if quick else [], out("grpc_floor")),
        ("handoff", ["--rounds", "1", "--loops", "300"] if quick else [], out("handoff")),
        (
            "replication",
            ["--seconds", "2", "--catchup", "20000", "--get-rates", "0,1000", "--get-calls", "50"] if quick else [],
            out("replication"),
        ),
        ("spark", ["--records", "100000", "--repeat", "1"] if quick else [], out("spark")),
        # qdelay spark import against the number of records (a real server, the Spark session)
        ("spark_import", ["--records", "2000,5000"] if quick else [], out("spark_import")),
        # etcd cluster mode (issue 16): needs the etcd binary (make etcd-deps)
        ("cluster", ["--seconds", "1", "--trials", "2", "--up-shards", "1,2"] if quick else [], out("cluster")),
        # the sharded and cluster clients' calls against the number of shards (etcd too)
        (
            "shards",
            ["--shards", "1,2", "--nodes", "1,2", "--messages", "2000", "--calls", "30", "--rounds", "1"]
            if quick
            else [],
            out("shards"),
        ),
        # qdelay admin's commands against pending messages and groups
        (
            "admin",
            ["--levels", "0,10000", "--groups", "0,10", "--rounds", "1", "--calls", "5"] if quick else [],
            out("admin"),
        ),
        # Stats, metrics, health, Subscribe, acks, group delete and qdelay inspect against
        # groups, subjects, backlog, in-flight count and records (what no other bench varies)
        (
            "ops",
            ["--groups", "10,100", "--subjects", "10,100", "--backlogs", "0,2000", "--records", "2000,10000"]
            + ["--calls", "20"]
            if quick
            else [],
            out("ops"),
        ),
        # delivery lateness across SIGTERM and SIGKILL restarts, apart from their downtime
        ("restart_lateness", ["--restarts", "1", "--gap", "5"] if quick else [], out("restart_lateness")),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.all", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller counts and shorter runs (a smoke run)")
    ap.add_argument("--only", default="", help="comma-separated subset: " + ",".join(n for n, _a, _o in plan(False)))
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = ap.parse_args(argv)

    steps = plan(args.quick)
    if args.only:
        wanted = [n for n in args.only.split(",") if n]
        unknown = sorted(set(wanted) - {n for n, _a, _o in steps})
        if unknown:
            ap.error(f"unknown benchmark(s): {', '.join(unknown)}")
        steps = [s for s in steps if s[0] in wanted]

    results: list[tuple[str, str, float, str]] = []
    for name, extra, out in steps:
        cmd = [sys.executable, "-m", f"bench.{name}", *extra]
        shown = " ".join(["python", "-m", f"bench.{name}", *extra])
        print(f"=== {shown}", flush=True)
        if args.dry_run:
            results.append((name, "not run", 0.0, out))
            continue
        before = os.path.getmtime(out) if os.path.exists(out) else None
        started = time.monotonic()
        code = subprocess.call(cmd, cwd=ROOT)
        took = time.monotonic() - started
        wrote = os.path.exists(out) and os.path.getmtime(out) != before
        if code != 0:
            status = f"FAILED (exit {code})"
        elif not wrote:
            status = "ran, but did not write its figures"
        else:
            status = "ok"
        results.append((name, status, took, out))
        print(flush=True)

    print("=== benchmarks")
    for name, status, took, out in results:
        where = os.path.relpath(out, ROOT)
        print(f"{name:12s} {status:28s} {took:8.1f} s  {where}")
    return 1 if any(s.startswith("FAILED") or s.startswith("ran,") for _n, s, _t, _o in results) else 0


if __name__ == "__main__":
    sys.exit(main())
