"""The ``qdelay`` Spark source and the ``qdelay spark`` jobs, on local[2] with one session.

Data folders are written by the real storage code (tests/datafolder.py); the import
round trip runs a real ``qdelay server`` process.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")

import byte_surgery  # noqa: E402
import datafolder  # noqa: E402
from conftest import wait_until  # noqa: E402
from datafolder import T0  # noqa: E402
from serverproc import ServerProc, make_tls_cert  # noqa: E402

from qdelay.segments import naming  # noqa: E402
from qdelay.segments.records import GroupOp  # noqa: E402

pytestmark = pytest.mark.spark

NOW = T0 + 600_000  # the audit fixtures are judged at this instant


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("spark")
    out = {}
    for name, build in (
        ("golden", datafolder.build_golden),
        ("planted", datafolder.build_audit_planted),
        ("clean", datafolder.build_audit_clean),
        ("damaged", datafolder.build_golden),
    ):
        path = str(root / name)
        build(path).close()
        out[name] = path
    d = out["damaged"]
    byte_surgery.flip_byte(os.path.join(d, "schedule", "20260101", "202601010001.sched"), 50)
    wal = os.path.join(d, "message", "00000000000000000342.wal")
    byte_surgery.truncate_at(wal, os.path.getsize(wal) - 20)
    return out


# Two threads call a gRPC server in this process while the main thread starts 100 children
# as PySpark starts its JVM (stdin a pipe, SIGINT ignored by a preexec_fn: a real fork()),
# each of which exits 7; prints their exit codes.
_FORK_PROBE = """
import json, signal, subprocess, threading
from concurrent import futures
import grpc

server = grpc.server(futures.ThreadPoolExecutor(2))
echo = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("probe.Echo", {"Echo": echo}),))
port = server.add_insecure_port("127.0.0.1:0")
server.start()
started = threading.Barrier(3)

def call():
    rpc = grpc.insecure_channel(f"127.0.0.1:{port}").unary_unary("/probe.Echo/Echo")
    rpc(b"x")
    started.wait()
    while True:
        rpc(b"x" * 100)

for _ in range(2):
    threading.Thread(target=call, daemon=True).start()
started.wait()
codes = []
for _ in range(100):
    p = subprocess.Popen(["/bin/sh", "-c", "exit 7"], stdin=subprocess.PIPE,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    p.stdin.close()
    codes.append(p.wait())
print(json.dumps(codes), flush=True)
"""


def test_a_child_forked_while_grpc_is_busy_starts():
    """The ``spark`` fixture's JVM is started by PySpark with ``Popen(preexec_fn=...)``, a
    real fork() of the pytest worker, whose earlier tests leave gRPC channels and servers
    running. With gRPC's fork support on (grpcio's default) its atfork handlers aborted the
    child (SIGABRT, before the exec: "Java gateway process exited before sending its port
    number", now and then in a full run, more often under load) or left it hung (and the
    parent's Popen with it) whenever another thread was inside gRPC. conftest.py turns it
    off for the run: with this environment, the same forks made while two threads call all
    start (in a child process of its own, so that a hang ends at the timeout)."""
    p = subprocess.Popen(
        [sys.executable, "-c", _FORK_PROBE],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a hung fork of it is in its process group, killed with it
    )
    try:
        out, err = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise AssertionError("a fork hung in gRPC's fork handler (GRPC_ENABLE_FORK_SUPPORT on?)") from None
    assert p.returncode == 0, err[-3000:]
    codes = json.loads(out)
    # -6: aborted by gRPC's fork handler
    assert codes == [7] * 100, (collections.Counter(codes), err[-3000:])


def _job(argv: list[str]) -> int:
    from qdelay.tools import spark_jobs

    parser = argparse.ArgumentParser()
    spark_jobs.add_arguments(parser)
    return spark_jobs.run(parser.parse_args(argv))


def test_reads_all_three_logs_with_the_documented_schema(spark, folders):
    from pyspark.sql.types import _parse_datatype_string

    from qdelay.tools.spark_source import COLUMNS, SCHEMA

    expected = _parse_datatype_string(SCHEMA)
    df = spark.read.format("qdelay").option("log", "all").option("packBytes", 0).load(folders["golden"])
    assert [f.name for f in df.schema.fields] == COLUMNS
    assert [f.dataType for f in df.schema.fields] == [f.dataType for f in expected.fields]
    rows = df.collect()
    by_log = {}
    for r in rows:
        by_log.setdefault(r.log, []).append(r)
    assert {k: len(v) for k, v in by_log.items()} == {"message": 7, "schedule": 6, "dispatch": 3}
    assert all(r.error is None for r in rows)
    assert all(r.server == os.path.abspath(folders["golden"]) for r in rows)
    # one partition per segment file: 2 WAL + 3 schedule + 2 dispatch segments
    assert df.rdd.getNumPartitions() == 7

    m3 = [r for r in by_log["schedule"] if r.sequence == 3][0]
    assert (m3.kind, m3.message_id, m3.subject, m3.headers, bytes(m3.payload)) == (
        "MESSAGE",
        "msg-0003",
        "price.switch",
        {"tenant": "acme", "trace": "t-1"},
        b"price=42",
    )
    assert (m3.created_ms, m3.due_ms, m3.segment, m3.offset) == (
        T0 + 2_000,
        T0 + 120_000,
        "schedule/20260101/202601010002.sched",
        0,
    )
    m2 = [r for r in by_log["message"] if r.sequence == 2][0]
    assert bytes(m2.payload) == b"\x00\xff\x10binary"
    c4 = [r for r in by_log["message"] if r.sequence == 4][0]
    assert (c4.kind, c4.target_sequence, c4.created_ms, c4.due_ms) == ("CANCEL", 3, T0 + 3_000, T0 + 120_000)
    # payload=false: same rows, payload and headers left null (what the jobs read)
    light = (
        spark.read.format("qdelay").option("log", "all").option("payload", "false").load(folders["golden"]).collect()
    )
    assert all(r.payload is None and r.headers is None for r in light)
    strip = lambda r: r.asDict() | {"payload": None, "headers": None}  # noqa: E731
    assert sorted(map(str, map(strip, light))) == sorted(map(str, map(strip, rows)))
    d6 = [r for r in by_log["dispatch"] if r.sequence == 6][0]
    assert (
        d6.kind,
        d6.message_id,
        d6.due_ms,
        d6.dispatched_ms,
        d6.acked_ms,
        d6.attempt,
        d6.outcome,
        d6.schedule_offset,
    ) == ("DISPATCH", "client-id-6", T0 + 210_000, T0 + 300_000, T0 + 300_010, 3, "DEAD_LETTERED", 81)


def test_many_folders_and_split_segments(spark, folders):
    from qdelay.tools import spark_source

    two = [folders["golden"], folders["clean"]]
    as_list = spark.read.format("qdelay").option("log", "schedule").load(two)
    as_text = spark.read.format("qdelay").option("log", "schedule").load(",".join(two))
    assert sorted(as_list.groupBy("server").count().collect()) == sorted(as_text.groupBy("server").count().collect())
    # a segment split on record boundaries reads the same records as a whole one
    whole = spark_source.read(spark, folders["clean"], log="schedule", packBytes=0).select(
        "segment", "offset", "sequence"
    )
    split = spark_source.read(spark, folders["clean"], log="schedule", splitBytes=200, packBytes=0)
    assert split.rdd.getNumPartitions() > whole.rdd.getNumPartitions()
    assert sorted(split.select("segment", "offset", "sequence").collect()) == sorted(whole.collect())
    assert split.where("error is not null").count() == 0


def test_corrupt_records_are_rows_or_skipped_never_a_crash(spark, folders):
    d = folders["damaged"]
    rows = (
        spark.read.format("qdelay")
        .option("log", "all")
        .option("corrupt", "row")
        .load(d)
        .where("error is not null")
        .select("segment", "offset", "error")
        .orderBy("segment")
        .collect()
    )
    assert [(r.segment, r.offset) for r in rows] == [
        ("message/00000000000000000342.wal", 163),
        ("schedule/20260101/202601010001.sched", 0),
    ]
    assert rows[0].error.startswith("torn tail") and rows[1].error.startswith("checksum mismatch")
    skipped = spark.read.format("qdelay").option("log", "all").option("corrupt", "skip").load(d)
    assert skipped.count() == 16 - 2 and skipped.where("error is not null").count() == 0


def test_columnar_and_python_readers_give_identical_dataframes(spark, folders):
    """The columnar reader (native frame walk) and the per-record reference twin, through
    Spark, on clean and damaged folders, with rows and skips for the damage."""
    for name in ("golden", "clean", "planted", "damaged"):
        for corrupt in ("row", "skip"):
            a, b = (
                spark_frame(spark, folders[name], corrupt=corrupt, reader=engine)
                .orderBy("log", "segment", "offset")
                .collect()
                for engine in ("columnar", "python")
            )
            assert len(a) > 0
            assert a == b, (name, corrupt)


def spark_frame(spark, path, **options):
    from qdelay.tools import spark_source

    return spark_source.read(spark, path, log="all", **options)


def test_pruned_columns_and_pushed_filters(spark, folders):
    """A user schema builds only its columns; due-time, kind and subject filters are applied
    by the reader, and a due range reads only the segments of its minutes (one fresh
    DataFrame per query: see QdelayFilteringReader)."""
    from qdelay.tools import spark_source

    path = folders["clean"]
    cols = ["subject", "due_ms", "kind"]

    def rows(df):
        return sorted(map(str, df.collect()))

    def narrow():
        return spark_source.read(spark, path, columns=cols, pushdown=True, packBytes=0)

    full = spark_source.read(spark, path, packBytes=0)
    assert narrow().columns == cols
    assert rows(narrow()) == rows(full.select(*cols))
    lo, hi = T0 + 60_000, T0 + 119_999
    where = f"due_ms between {lo} and {hi} and kind = 'MESSAGE'"
    assert rows(narrow().where(where)) == rows(full.where(where).select(*cols))
    assert narrow().where(where).count() > 0
    for other in ("subject like 'order%'", "subject in ('a', 'order.close') and due_ms > 0", "kind = 'DISPATCH'"):
        assert rows(narrow().where(other)) == rows(full.where(other).select(*cols)), other
    # the filters went to the reader: the due range keeps one schedule minute and the
    # kind leaves the dispatch log out (message-log segments have no due time in their name)
    n_wal = len([s for s in os.listdir(os.path.join(path, "message")) if s.endswith(".wal")])
    assert narrow().where(where).rdd.getNumPartitions() == n_wal + 1 < full.rdd.getNumPartitions()
    n_disp = sum(len(files) for _d, _s, files in os.walk(os.path.join(path, "dispatch")))
    assert narrow().where("kind = 'DISPATCH'").rdd.getNumPartitions() == n_disp
    # without the option the same query reads every segment and Spark filters
    plain = spark_source.read(spark, path, columns=cols, packBytes=0).where(where)
    assert plain.rdd.getNumPartitions() == full.rdd.getNumPartitions()
    assert rows(plain) == rows(narrow().where(where))


def test_audit_finds_every_planted_problem(spark, folders, tmp_path, capsys):
    out = str(tmp_path / "audit")
    assert _job(["audit", "--data-dir", folders["planted"], "--now", str(NOW), "--out", out]) == 1
    assert "lost                     1" in capsys.readouterr().out
    s = json.load(open(os.path.join(out, "summary.json")))
    assert s["findings"] == {"lost": 1, "duplicated": 1, "delivered_after_cancel": 1, "early": 1}
    assert (s["messages"], s["cancelled"], s["dispatch_records"]) == (7, 2, 5)
    ex = s["examples"]
    assert [(r["message_id"], r["sequence"]) for r in ex["lost"]] == [("lost-one", 2)]
    assert [(r["message_id"], r["dispatches"], r["attempts"]) for r in ex["duplicated"]] == [("dup-one", 2, [1, 2])]
    assert [r["message_id"] for r in ex["delivered_after_cancel"]] == ["cancelled-one"]
    assert [(r["message_id"], r["early_by_ms"]) for r in ex["early"]] == [("early-one", 5_000)]
    assert s["corrupt_records"] == [] and s["torn_tails"] == []
    rows = [
        json.loads(line)
        for p in os.listdir(os.path.join(out, "findings"))
        if p.endswith(".json")
        for line in open(os.path.join(out, "findings", p))
    ]
    assert sorted(r["message_id"] for r in rows) == ["cancelled-one", "dup-one", "early-one", "lost-one"]


def test_audit_keeps_messages_waiting_for_a_first_group_apart(spark, tmp_path, capsys):
    """A past-due message of a subject no group has yet was reported lost (exit 1), though
    the server keeps it for the subject's first group, which receives it (docs/api.md,
    "Groups"); so is one that fell due after the subject's last group was deleted. Both are
    counted apart as waiting for a first group and do not fail the audit; a message whose
    subject has a group on its server (the same subject on another server is no excuse)
    and that never went out is still lost."""
    from qdelay.tools import spark_jobs

    waiting = str(tmp_path / "waiting")
    a = datafolder.DataFolderBuilder(waiting)
    never = a.send("w.none", b"1", due_ms=T0 + 60_000, created_ms=T0, message_id="no-group-yet")
    a.group("w.had", "billing", at_ms=T0)
    sent = a.send("w.had", b"2", due_ms=T0 + 60_000, created_ms=T0)
    a.group("w.had", "billing", at_ms=T0 + 100_000, op=GroupOp.DELETE)
    after = a.send("w.had", b"3", due_ms=T0 + 200_000, created_ms=T0 + 1_000, message_id="after-delete")
    a.iterate(at_ms=T0 + 110_000)
    a.dispatch(sent, dispatched_ms=T0 + 60_010, acked_ms=T0 + 60_020, group="billing")
    a.close()
    out = str(tmp_path / "audit")
    assert _job(["audit", "--data-dir", waiting, "--now", str(NOW), "--out", out]) == 0
    text = capsys.readouterr().out
    assert "lost                     0" in text, text
    assert "waiting_for_first_group  2 (not lost: " in text, text
    s = json.load(open(os.path.join(out, "summary.json")))
    assert s["findings"]["lost"] == 0 and s[spark_jobs.WAITING] == 2 and not s["failed"]
    assert [(r["message_id"], r["sequence"], r["subject"]) for r in s["examples"][spark_jobs.WAITING]] == [
        ("no-group-yet", never, "w.none"),
        ("after-delete", after, "w.had"),
    ]

    lost = str(tmp_path / "lost")
    b = datafolder.DataFolderBuilder(lost)
    b.group("w.other", "billing", at_ms=T0)
    b.send("w.none", b"4", due_ms=T0 + 60_000, created_ms=T0, message_id="really-lost")
    b.iterate(at_ms=T0 + 1_000)
    b.group("w.none", "billing", at_ms=T0 + 2_000)  # past the checkpoint: replayed by the audit
    b.close()
    s = spark_jobs.audit(spark, [waiting, lost], NOW, 60_000)
    assert s["findings"]["lost"] == 1 and s[spark_jobs.WAITING] == 2 and s["failed"]
    assert [r["message_id"] for r in s["examples"]["lost"]] == ["really-lost"]


def test_audit_is_quiet_on_a_clean_folder(spark, folders, tmp_path):
    out = str(tmp_path / "audit")
    assert _job(["audit", "--data-dir", folders["clean"], "--now", str(NOW), "--out", out]) == 0
    s = json.load(open(os.path.join(out, "summary.json")))
    assert s["findings"] == {"lost": 0, "duplicated": 0, "delivered_after_cancel": 0, "early": 0}
    assert (s["messages"], s["cancelled"], s["dispatch_records"]) == (21, 1, 19)


def test_audit_allow_duplicates_reports_them_without_failing(spark, tmp_path, capsys):
    """An at-least-once redelivery (the same message acked twice after a restart) is a
    finding the audit lists either way; with --allow-duplicates it does not fail the run."""
    root = str(tmp_path / "dups")
    b = datafolder.DataFolderBuilder(root)
    s = b.send("d.x", b"p", due_ms=T0 + 60_000, created_ms=T0)
    b.iterate(at_ms=T0 + 1_000)
    b.dispatch(s, dispatched_ms=T0 + 60_010, acked_ms=T0 + 60_020)
    b.dispatch(s, dispatched_ms=T0 + 90_010, acked_ms=T0 + 90_020, attempt=2)
    b.close()
    out = str(tmp_path / "audit")
    assert _job(["audit", "--data-dir", root, "--now", str(NOW), "--out", out]) == 1
    assert _job(["audit", "--data-dir", root, "--now", str(NOW), "--out", out, "--allow-duplicates"]) == 0
    text = capsys.readouterr().out
    assert "duplicated               1 (allowed: at-least-once redeliveries)" in text
    assert os.path.abspath(os.path.join(out, "summary.json")) in text  # where the outputs went
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["findings"]["duplicated"] == 1 and not summary["failed"] and summary["allow_duplicates"]
    assert [(r["message_id"], r["attempts"]) for r in summary["examples"]["duplicated"]] == [("msg-0001", [1, 2])]


def test_audit_counts_duplicates_within_a_consumer_group(spark, tmp_path):
    """Each consumer group gets its own delivery of a message: one per group is not a
    duplicate, two in one group are; the source reads the group of every DISPATCH."""
    from qdelay.tools import spark_jobs, spark_source

    root = str(tmp_path / "groups")
    b = datafolder.DataFolderBuilder(root)
    once, twice = (b.send("g.x", b"p", due_ms=T0 + 60_000, created_ms=T0) for _ in range(2))
    b.iterate(at_ms=T0 + 1_000)
    for group in ("default", "billing", "audit"):
        b.dispatch(once, dispatched_ms=T0 + 60_010, acked_ms=T0 + 60_020, group=group)
    b.dispatch(twice, dispatched_ms=T0 + 60_010, acked_ms=T0 + 60_020, group="billing")
    b.dispatch(twice, dispatched_ms=T0 + 60_010, acked_ms=T0 + 60_020)
    b.dispatch(twice, dispatched_ms=T0 + 70_010, acked_ms=T0 + 70_020, attempt=2, group="billing")
    b.close()
    groups = spark_source.read(spark, root, log="dispatch", columns=["sequence", "group"]).collect()
    assert sorted((r.sequence, r.group) for r in groups) == [
        (once, "audit"),
        (once, "billing"),
        (once, "default"),
        (twice, "billing"),
        (twice, "billing"),
        (twice, "default"),
    ]
    s = spark_jobs.audit(spark, [root], NOW, 60_000)
    assert s["findings"] == {"lost": 0, "duplicated": 1, "delivered_after_cancel": 0, "early": 0}
    assert [r["sequence"] for r in s["examples"]["duplicated"]] == [twice]


def test_audit_reports_damage_and_goes_on(spark, folders):
    from qdelay.tools import spark_jobs

    s = spark_jobs.audit(spark, [folders["damaged"]], T0, 60_000)
    assert s["findings"] == {"lost": 0, "duplicated": 0, "delivered_after_cancel": 0, "early": 0}
    assert s["messages"] == 5  # seq 7 was torn off; seq 1 survives in the message log
    assert [(r["segment"], r["offset"]) for r in s["corrupt_records"]] == [("schedule/20260101/202601010001.sched", 0)]
    assert [(r["segment"], r["offset"]) for r in s["torn_tails"]] == [("message/00000000000000000342.wal", 163)]


def test_lateness_forecast_export(spark, folders, tmp_path, capsys):
    import pandas as pd

    out = str(tmp_path / "lat")
    assert _job(["lateness", "--data-dir", folders["golden"], "--out", out]) == 0
    per_minute = pd.read_csv(os.path.join(out, "lateness_per_minute.csv"))
    # seq 1: dispatched 120 ms after due, acked 30 ms later; seq 2 was delivered by its
    # second attempt 30.2 s after due: a redelivery, not server lateness (acked 100 ms later)
    cols = ["minute_ms", "delivered", "server_max_ms", "ack_max_ms", "redelivered_share"]
    assert per_minute[cols].values.tolist() == [[T0 + 60_000, 2, 120, 100, 0.5]]
    per_subject = pd.read_csv(os.path.join(out, "lateness_per_subject.csv"))
    assert per_subject["subject"].tolist() == ["order.close"]
    assert os.path.getsize(os.path.join(out, "lateness.png")) > 1000

    out = str(tmp_path / "fc")
    assert (
        _job(["forecast", "--data-dir", folders["golden"], "--now", str(T0 + 150_000), "--hours", "2", "--out", out])
        == 0
    )
    fc = pd.read_csv(os.path.join(out, "forecast_per_minute.csv"))
    assert fc[["minute_ms", "due"]].values.tolist() == [[T0 + 180_000, 1], [T0 + 240_000, 1]]
    assert os.path.getsize(os.path.join(out, "forecast.png")) > 1000

    out = str(tmp_path / "ex")
    assert (
        _job(
            [
                "export",
                "--data-dir",
                folders["golden"],
                "--data-dir",
                folders["planted"],
                "--log",
                "schedule,dispatch",
                "--out",
                out,
            ]
        )
        == 0
    )
    sched = spark.read.parquet(os.path.join(out, "schedule"))
    assert sched.count() == 6 + 9
    assert os.path.isdir(os.path.join(out, "schedule", "due_day=2026-01-01"))
    assert spark.read.parquet(os.path.join(out, "dispatch")).count() == 3 + 5
    # a log with no records (here the message log, cleaned) exports as 0 rows, not a failure
    # to infer the schema of what it wrote (found timing the jobs on bench.spark's folder)
    bare = tmp_path / "bare"
    shutil.copytree(folders["golden"], bare)
    shutil.rmtree(bare / naming.MESSAGE_DIR)
    out = str(tmp_path / "ex2")
    assert _job(["export", "--data-dir", str(bare), "--out", out]) == 0
    assert "message: 0 rows" in capsys.readouterr().out


# --- import then audit, through a real server -----------------------------------------------


TOKEN = "imp-secret"


@pytest.fixture
def server(tmp_path):
    """A real server of its own (this module's tests read its data folder), requiring a token
    whose file starts with a comment, as an operator's shared token file may
    (docs/operations.md: one token file for every member and tool)."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# the cluster's token; add the next one below to rotate\n{TOKEN}\n")
    with ServerProc(tmp_path / "server-data", args=["--auth-token-file", str(tokens)]) as srv:
        yield srv.address, str(srv.data_dir), srv.proc, str(tokens)


def test_import_then_audit_round_trip(spark, server, tmp_path, capsys):
    """A CSV dataset scheduled through gRPC (resumably), delivered by the server to a real
    consumer, then audited from the server's data folder: nothing lost, early or doubled.
    ``--token-file`` is the server's own file: the job sent its first line, a comment, as
    the token (every row UNAUTHENTICATED) until it read tokens as the server and ``qdelay
    admin`` do."""
    from qdelay.tools import spark_jobs

    target, data_dir, proc, tokens = server
    now = int(time.time() * 1000)
    n = 120
    csv = tmp_path / "in.csv"
    with open(csv, "w") as f:
        f.write("subject,payload,deliver_at_ms,delay_ms,message_id\n")
        for i in range(n):
            if i % 2:
                f.write(f"imp.t,p{i},{now + 500 + i * 5},,imp-{i:04d}\n")
            else:
                f.write(f"imp.t,p{i},,{500 + i * 5},imp-{i:04d}\n")
        f.write(f"bad subject!,x,,{500},imp-bad\n")  # refused by the server: reported, not fatal
    out = str(tmp_path / "import")
    # first run: half the rows (a run cut short), then the whole set resumes
    half = tmp_path / "half.csv"
    lines = open(csv).read().splitlines()
    half.write_text("\n".join(lines[: 1 + n // 2]) + "\n")
    r1 = spark_jobs.import_dataset(spark, str(half), target, out, "csv", token=TOKEN, batch_size=16)
    assert (r1["rows"], r1["already_accepted"], r1["accepted"], r1["rejected"]) == (n // 2, 0, n // 2, 0)
    assert (
        _job(
            ["import", "--input", str(csv), "--format", "csv", "--target", target, "--out", out, "--batch-size", "16"]
            + ["--token-file", tokens]
        )
        == 1
    )  # one row rejected
    assert (
        f"{n + 1} rows: {n // 2} accepted by an earlier run, {n} accepted in all, 1 rejected" in capsys.readouterr().out
    )
    rejected = [
        json.loads(line)
        for p in os.listdir(os.path.join(out, "rejected"))
        for line in open(os.path.join(out, "rejected", p))
    ]
    assert [(r["message_id"], r["code"]) for r in rejected] == [("imp-bad", "INVALID_ARGUMENT")]
    ids = [
        json.loads(line)["message_id"]
        for p in os.listdir(os.path.join(out, "accepted"))
        for line in open(os.path.join(out, "accepted", p))
    ]
    assert sorted(ids) == [f"imp-{i:04d}" for i in range(n)]  # each once: the resume skipped the first half

    # consume everything, acking, so the server writes its dispatch records
    from qdelay.client import Client

    def dispatched() -> int:  # distinct sequences in the dispatch log, read with the inspect walker
        from qdelay.tools.inspect import segment_files, walk_file

        return len(
            {
                i.frame.sequence
                for sf in segment_files(data_dir, ("dispatch",))
                for i in walk_file(sf)
                if i.record is not None
            }
        )

    got = set()
    with Client(target, token=TOKEN) as c, c.subscribe("imp.t") as consumer:
        deadline = time.monotonic() + 30
        while len(got) < n and time.monotonic() < deadline:
            batch = consumer.receive(n - len(got), timeout=2.0)
            if batch:
                consumer.ack(batch)
                got.update(d.message_id for d in batch)
        assert len(got) == n
        # keep the stream open until the server has recorded every ack
        wait_until(lambda: dispatched() >= n, 30, "every message dispatched", interval=0.2)
    s = spark_jobs.audit(spark, [data_dir], int(time.time() * 1000), 0)
    assert s["messages"] == n
    assert s["findings"] == {"lost": 0, "duplicated": 0, "delivered_after_cancel": 0, "early": 0}, s
    # the server's own (live) folder passes inspect's checks, and find tells a life from it
    from qdelay import cli

    capsys.readouterr()
    assert cli.main(["inspect", "verify", "--data-dir", data_dir]) == 0
    assert cli.main(["inspect", "find", "--data-dir", data_dir, "--id", "imp-0007"]) == 0
    life = capsys.readouterr().out
    assert "imp-0007" in life and ": DELIVERED" in life and "scheduled" in life
    assert proc.poll() is None


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_import_into_a_tls_server_with_a_token(spark, tmp_path, capsys):
    """Walking ``qdelay spark import`` against a server run with TLS and a token: it always
    dialled in plaintext and had no flag to do otherwise, so such a server could not be
    imported into. It takes ``qdelay admin``'s ``--tls-ca`` / ``--tls-server-name``; without
    them the one line before Spark starts names the flag. The tasks get the CA certificate's
    bytes, read on the driver, never its path (a cluster's workers may not have the file):
    ``import_dataset`` is given the bytes alone, the file gone."""
    from qdelay.client import Client
    from qdelay.tools import spark_jobs

    cert, key = make_tls_cert(tmp_path)
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# the cluster's token\n{TOKEN}\n")
    n = 20
    csv = tmp_path / "in.csv"
    csv.write_text("subject,payload,delay_ms,message_id\n" + "".join(f"tls.t,p{i},600000,tls-{i}\n" for i in range(n)))
    out = str(tmp_path / "import")
    args = ["--tls-cert", str(cert), "--tls-key", str(key), "--auth-token-file", str(tokens)]
    with ServerProc(tmp_path / "server-data", args=args) as srv:
        argv = ["import", "--input", str(csv), "--format", "csv", "--target", srv.address, "--out", out]
        argv += ["--token-file", str(tokens), "--batch-size", "8"]
        capsys.readouterr()
        assert _job(argv) == 1  # plaintext to the TLS port
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"qdelay spark import: no qdelay server answers at {srv.address} (UNAVAILABLE: ")
        assert err.endswith("(if the server serves TLS, give its CA certificate with --tls-ca FILE); nothing was sent")

        assert _job(argv + ["--tls-ca", str(cert)]) == 0
        assert f"{n} rows: 0 accepted by an earlier run, {n} accepted in all, 0 rejected" in capsys.readouterr().out

        ca = cert.read_bytes()
        cert.rename(tmp_path / "elsewhere.crt")
        more = tmp_path / "more.csv"
        more.write_text("subject,payload,delay_ms,message_id\ntls.t,late,600000,tls-late\n")
        r = spark_jobs.import_dataset(
            spark,
            str(more),
            srv.address,
            str(tmp_path / "more"),
            "csv",
            token=TOKEN,
            tls_ca=ca,
            tls_server_name="localhost",
        )
        assert (r["rows"], r["accepted"], r["rejected"]) == (1, 1, 0)
        with Client(srv.address, token=TOKEN, tls_ca=ca) as c:
            for mid in [f"tls-{i}" for i in range(n)] + ["tls-late"]:
                assert c.get(message_id=mid).state == "PENDING", mid


@pytest.mark.parametrize(
    "argv, want",
    [
        (["audit", "--data-dir", "{tmp}/absent"], "argument --data-dir: '{tmp}/absent' is not a folder"),
        (["export", "--data-dir", "{tmp}", "--log", "bogus"], "argument --log: option log='bogus': use message,"),
        (["import", "--input", "{tmp}/absent.csv"], "argument --input: '{tmp}/absent.csv': no such file or folder"),
        (
            ["import", "--input", "{tmp}", "--token-file", "{tmp}/gone"],
            "argument --token-file: {tmp}/gone: cannot read",
        ),
        (
            ["import", "--input", "{tmp}", "--tls-ca", "{tmp}/gone.pem"],
            "argument --tls-ca: {tmp}/gone.pem: cannot read",
        ),
        (["audit", "--data-dir", "{tmp}", "--grace-ms", "-5"], "argument --grace-ms: '-5' is not a whole number"),
        (
            ["forecast", "--data-dir", "{tmp}", "--hours", "0"],
            "argument --hours: '0' is not a whole number of at least 1",
        ),
        (["lateness", "--data-dir", "{tmp}", "--conf", "foo"], "argument --conf: 'foo' is not KEY=VALUE"),
        (
            ["import", "--input", "{tmp}", "--target", "127.0.0.1"],
            "argument --target: the server's address must be HOST:PORT, not '127.0.0.1'",
        ),
    ],
)
def test_bad_arguments_are_usage_errors_before_spark_starts(tmp_path, argv, want):
    """Walking the Spark CLI: a --data-dir that is not there, ``export --log bogus`` and
    ``import --input`` of a missing file each started Spark, then died in a Python-in-Java
    traceback (exit 1); a missing --token-file in a FileNotFoundError one; ``--grace-ms -5``,
    ``--hours 0`` and ``--conf foo`` (set as key 'foo', value '') were taken, and
    ``--target`` without its port was tried on port 443. Each is
    argparse's usage error now: exit 2, one line naming the flag, and no JVM started (the
    run takes a second, not a minute)."""
    import subprocess
    import sys

    argv = [a.format(tmp=tmp_path) for a in argv]
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "qdelay.cli", "spark", *argv], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and proc.stdout == "", (proc.returncode, proc.stdout, proc.stderr)
    assert want.format(tmp=tmp_path) in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert time.monotonic() - started < 30  # no Spark session was started


def test_the_import_defaults_are_in_its_help_and_in_the_docs():
    """``spark import --target`` defaulted to 127.0.0.1:7600 while its help did not say so and
    docs/tools.md showed it as required. Every import flag with a default now says it in its
    help and shows it in the docs' synopsis (``[--flag DEFAULT]``)."""
    from pathlib import Path

    from qdelay.tools import spark_jobs

    parser = argparse.ArgumentParser()
    spark_jobs.add_arguments(parser)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    docs = (Path(__file__).resolve().parent.parent / "docs" / "tools.md").read_text()
    synopsis = " ".join(docs[docs.index("qdelay spark import ") :].split("```")[0].split())
    flags = 0
    for action in sub.choices["import"]._actions:
        if action.default in (None, [], False, argparse.SUPPRESS) or not action.option_strings:
            continue
        flag = action.option_strings[0]
        assert f"(default {action.default})" in action.help, (flag, action.help)
        assert f"[{flag} {action.default}]" in synopsis, (flag, synopsis)
        flags += 1
    assert flags >= 2  # --target and --batch-size


def test_import_to_a_server_that_does_not_answer_says_so_before_spark_starts(tmp_path):
    """``qdelay spark import --target`` with no server there started Spark, retried every
    batch for ~16 s and ended in a 250-line Java and Python traceback (exit 1). The target
    is asked once first: one line, exit 1, nothing sent, no JVM."""
    import subprocess
    import sys

    from ports import free_port

    csv = tmp_path / "in.csv"
    csv.write_text("subject,payload,delay_ms\na.b,x,1000\n")
    target = f"127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    cp = subprocess.run(
        [sys.executable, "-m", "qdelay.cli", "spark", "import", "--input", str(csv), "--target", target]
        + ["--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cp.returncode == 1 and cp.stdout == "" and "Traceback" not in cp.stderr, cp.stderr
    lines = cp.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"qdelay spark import: no qdelay server answers at {target} ")
    assert lines[0].endswith("; nothing was sent") and time.monotonic() - started < 30, lines


def test_import_that_stops_midway_says_why_in_a_line(tmp_path):
    """An import whose batches are refused for good (here: --target is a slave, which answers
    Topology but refuses writes) ended in the driver's py4j traceback, its last line a
    Python worker's repr. It ends in one line now: the gRPC status of the failed task,
    where the accepted messages are listed, and that running the same command resumes.
    (Spark's own executor log of the failed task, log4j ERROR lines, still comes before.)"""
    import subprocess
    import sys

    from test_replication import master, slave

    csv = tmp_path / "in.csv"
    csv.write_text("subject,payload,delay_ms\na.b,x,1000\n")
    out = tmp_path / "out"
    with master(tmp_path) as a, slave(tmp_path, a) as b:
        cp = subprocess.run(
            [sys.executable, "-m", "qdelay.cli", "spark", "import", "--input", str(csv), "--target", b.address]
            + ["--out", str(out)],
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert cp.returncode == 1 and cp.stdout == "", (cp.stdout, cp.stderr[-3000:])
    last = cp.stderr.splitlines()[-1]
    want = "qdelay spark import: stopped: FAILED_PRECONDITION: this server is a slave; send writes to the master; "
    assert last.startswith(want), cp.stderr[-3000:]
    assert last.endswith(
        f"the 0 messages accepted so far are listed in {out}/accepted: run the same command again to resume"
    )
    assert "pyspark.errors.exceptions" not in cp.stderr, cp.stderr[-3000:]  # the driver's traceback
