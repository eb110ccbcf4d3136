"""The Spark jobs on a real standalone cluster, not only ``local[*]``.

A Spark master and one worker are started on loopback from the PySpark installation
(``spark-class org.apache.spark.deploy.master.Master`` / ``...worker.Worker``); ``audit`` and
``export`` are submitted with ``spark-submit --master spark://127.0.0.1:PORT`` (the job
module is its own entry point), and must give what the same jobs give on ``local[2]``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

pyspark = pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")

import byte_surgery  # noqa: E402
import datafolder  # noqa: E402
from datafolder import T0  # noqa: E402
from ports import free_port  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.slow]

SPARK_HOME = os.path.dirname(pyspark.__file__)
NOW = T0 + 600_000


def _env() -> dict:
    env = dict(os.environ)
    env.update(
        SPARK_HOME=SPARK_HOME,
        SPARK_LOCAL_IP="127.0.0.1",
        PYSPARK_PYTHON=sys.executable,
        PYSPARK_DRIVER_PYTHON=sys.executable,
        SPARK_NO_DAEMONIZE="1",
    )
    return env


def _wait_for_line(path: str, text: str, proc: subprocess.Popen, timeout: float) -> None:
    """Wait until ``text`` appears in the log at ``path`` (the process must stay alive)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(path, errors="replace") as f:
            if text in f.read():
                return
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    with open(path, errors="replace") as f:
        log = f.read()[-3000:]
    raise AssertionError(f"{text!r} not in {path} after {timeout} s (exit {proc.poll()}):\n{log}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A standalone master and one 2-core worker on 127.0.0.1; yields (master URL, the
    worker's work folder, where it makes one folder per application it runs)."""
    root = tmp_path_factory.mktemp("cluster")
    port, ui, wport, wui = free_port(), free_port(), free_port(), free_port()
    spark_class = os.path.join(SPARK_HOME, "bin", "spark-class")
    procs = []
    try:
        mlog = str(root / "master.log")
        master = subprocess.Popen(
            [spark_class, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1"]
            + ["--port", str(port), "--webui-port", str(ui)],
            stdout=open(mlog, "w"),
            stderr=subprocess.STDOUT,
            env=_env(),
        )
        procs.append(master)
        url = f"spark://127.0.0.1:{port}"
        _wait_for_line(mlog, "I have been elected leader", master, 120)
        wlog = str(root / "worker.log")
        worker = subprocess.Popen(
            [spark_class, "org.apache.spark.deploy.worker.Worker", url, "--host", "127.0.0.1"]
            + ["--port", str(wport), "--webui-port", str(wui), "--cores", "2", "--memory", "1g"]
            + ["--work-dir", str(root / "work")],
            stdout=open(wlog, "w"),
            stderr=subprocess.STDOUT,
            env=_env(),
        )
        procs.append(worker)
        _wait_for_line(wlog, "Successfully registered with master", worker, 120)
        yield url, str(root / "work")
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in reversed(procs):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _submit(master: str, argv: list[str], tmp_path) -> subprocess.CompletedProcess:
    from qdelay.tools import spark_jobs

    cmd = [
        os.path.join(SPARK_HOME, "bin", "spark-submit"),
        "--master",
        master,
        "--conf",
        f"spark.pyspark.python={sys.executable}",
        "--conf",
        "spark.executor.memory=512m",
        "--conf",
        "spark.sql.shuffle.partitions=4",
        spark_jobs.__file__,
        *argv,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=str(tmp_path), timeout=600)
    return r


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    planted = str(root / "planted")
    datafolder.build_audit_planted(planted).close()
    damaged = str(root / "damaged")
    datafolder.build_golden(damaged).close()
    byte_surgery.flip_byte(os.path.join(damaged, "schedule", "20260101", "202601010001.sched"), 50)
    return planted, damaged


def _summary(out: str) -> dict:
    with open(os.path.join(out, "summary.json")) as f:
        s = json.load(f)
    return s


def test_audit_and_export_on_a_standalone_cluster_match_local(cluster, planted, spark, tmp_path):
    """The jobs submitted to the cluster give what the same job functions give on the
    suite's local[2] session (submitting local[2] too cost two more JVMs, ~30 s)."""
    from qdelay.tools import spark_jobs

    cluster, cluster_work = cluster
    folders = list(planted)
    data_args = [a for d in folders for a in ("--data-dir", d)]
    results = {}
    out = str(tmp_path / "cluster" / "audit")
    r = _submit(cluster, ["audit", *data_args, "--now", str(NOW), "--out", out], tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr[-3000:]  # the planted findings
    assert "duplicated               1" in r.stdout
    ex = str(tmp_path / "cluster" / "export")
    r = _submit(cluster, ["export", *data_args, "--log", "schedule,dispatch", "--out", ex], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    results["cluster"] = (_summary(out), r.stdout, ex)
    out = str(tmp_path / "local" / "audit")
    spark_jobs.audit(spark, folders, NOW, out=out)
    ex = str(tmp_path / "local" / "export")
    spark_jobs.export(spark, folders, ex, log="schedule,dispatch")
    results["local"] = (_summary(out), "", ex)
    (s_c, _o, ex_c), (s_l, _o2, ex_l) = results["cluster"], results["local"]
    assert s_c == s_l
    # the planted folder's four findings, plus the damaged golden folder's past-due messages
    assert s_c["findings"] == {"lost": 3, "duplicated": 1, "delivered_after_cancel": 1, "early": 1}, s_c
    assert [(r["segment"], r["offset"]) for r in s_c["corrupt_records"]] == [
        ("schedule/20260101/202601010001.sched", 0)
    ]
    # the same Parquet rows, partitioned by due day, from both
    import pyarrow.parquet as pq

    for log in ("schedule", "dispatch"):
        a, b = (
            sorted(map(repr, pq.read_table(os.path.join(ex, log), partitioning=None).to_pylist()))
            for ex in (ex_c, ex_l)
        )
        assert len(a) > 0 and a == b, log
        assert any(p.startswith("due_day=") for p in os.listdir(os.path.join(ex_c, log)))
    # the cluster really ran the tasks: the worker started an executor per application
    apps = [d for d in os.listdir(cluster_work) if d.startswith("app-")]
    assert len(apps) == 2, apps  # audit and export
