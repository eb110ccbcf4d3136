"""bench.all (``make bench``): runs every benchmark with flags each one accepts."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_plan_covers_every_benchmark_with_accepted_flags():
    from bench.all import plan

    for quick in (False, True):
        steps = plan(quick)
        assert [n for n, _a, _o in steps] == [
            "wal",
            "scheduler",
            "compare",
            "cancel",
            "pending",
            "ingest",
            "idfilter",
            "iterate",
            "grpc_floor",
            "handoff",
            "replication",
            "spark",
            "spark_import",
            "cluster",
            "shards",
            "admin",
            "ops",
            "restart_lateness",
        ]
        for name, extra, out in steps:
            assert out.endswith(os.path.join("bench", "out", f"{name}.json"))
            flags = [a for a in extra if a.startswith("--")]
            if quick:
                assert flags, f"{name}: nothing makes the quick run smaller"
            else:
                assert "--quick" not in flags
            if flags:
                help_text = run(f"bench.{name}", "--help").stdout
                for flag in flags:
                    assert flag in help_text, (name, flag)


def test_dry_run_lists_commands_and_output_paths():
    res = run("bench.all", "--dry-run", "--quick")
    assert res.returncode == 0, res.stderr
    for name in ("wal", "scheduler", "compare", "ingest", "grpc_floor", "replication", "spark"):
        assert f"=== python -m bench.{name}" in res.stdout
        assert os.path.join("bench", "out", f"{name}.json") in res.stdout
    assert "--quick" in res.stdout
    res = run("bench.all", "--dry-run", "--only", "wal,spark")
    assert res.returncode == 0 and "bench.scheduler" not in res.stdout and "bench.spark" in res.stdout
    assert run("bench.all", "--only", "nope").returncode != 0
