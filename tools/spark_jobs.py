"""``qdelay spark JOB``: offline jobs on the ``qdelay`` Spark source.

    qdelay spark audit    --data-dir DIR [--data-dir DIR2 ...] [--now T] [--grace-ms MS]
    qdelay spark lateness --data-dir DIR ... [--out DIR]
    qdelay spark forecast --data-dir DIR ... [--now T] [--hours H]
    qdelay spark export   --data-dir DIR ... [--log message|schedule|dispatch|all]
    qdelay spark import   --input DATASET [--format parquet|csv] [--target 127.0.0.1:7600]

Embedded ``local[*]`` by default; ``--master URL`` for a cluster, or submit this very file
with ``spark-submit --master ... <path of qdelay/tools/spark_jobs.py> JOB ...`` (same code;
the data folders must then be mounted at the same path on every node).
Each job writes its tables and plots under ``--out`` (default ``./qdelay-spark/<job>``).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    # run as a script (spark-submit): its folder is first on the path and holds inspect.py,
    # which would shadow the standard library's inspect for every import below
    del sys.path[0]

import argparse  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402

from qdelay.addresses import check_target  # noqa: E402
from qdelay.errors import InvalidArgument  # noqa: E402
from qdelay.tools import spark_source  # noqa: E402
from qdelay.tools.inspect import time_arg  # noqa: E402
from qdelay.units import counted  # noqa: E402

JOBS = ("audit", "lateness", "forecast", "export", "import")
EXAMPLES = 10  # rows of each finding printed on stdout


# Argument types: a wrong folder, log name, dataset path, token file or count is argparse's
# usage error (exit 2) before Spark starts, not a Python-in-Java traceback a minute later.


def folder_arg(text: str) -> str:
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a folder (give a server's data folder)")
    return text


def target_arg(text: str) -> str:
    # without its port gRPC would try 443, its default, task after task
    try:
        return check_target(text, "the server's address")
    except InvalidArgument as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def logs_arg(text: str) -> str:
    try:
        spark_source.parse_logs(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("qdelay source: ")) from None
    return text


def dataset_arg(text: str) -> str:
    # a URL (hdfs://, s3a://, file://) is Spark's to resolve; a plain path must be there
    if "://" not in text and not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"{text!r}: no such file or folder")
    return text


def token_file_arg(text: str) -> str:
    return _usable(text, token=True)


def ca_file_arg(text: str) -> str:
    return _usable(text)


def _usable(path: str, token: bool = False) -> str:
    from qdelay.replication.common import file_problem  # as qdelay admin checks its files

    problem = file_problem(path, token)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return path


def conf_arg(text: str) -> str:
    key, sep, _value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE (e.g. spark.driver.memory=4g)")
    return text


def count_arg(least: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = least - 1
        if value < least:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least {least}")
        return value

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="spark_job", required=True)

    def common(p, data=True):
        if data:
            p.add_argument(
                "--data-dir",
                action="append",
                required=True,
                type=folder_arg,
                metavar="DIR",
                help="a server's data folder (repeat for several servers)",
            )
        p.add_argument(
            "--master", default=None, help="Spark master URL (default local[*]; left to spark-submit when under it)"
        )
        p.add_argument("--out", default=None, help="output folder (default ./qdelay-spark/JOB)")
        p.add_argument(
            "--conf",
            action="append",
            default=[],
            type=conf_arg,
            metavar="KEY=VALUE",
            help="extra Spark configuration (repeatable)",
        )
        return p

    p = common(sub.add_parser("audit", help="lost, duplicated, delivered-after-cancel, early messages"))
    p.add_argument(
        "--now", default=None, type=time_arg, help="judge 'past due' at this time (epoch ms or ISO; default now)"
    )
    p.add_argument(
        "--allow-duplicates",
        action="store_true",
        help="report duplicated deliveries (at-least-once redeliveries) without failing",
    )
    p.add_argument(
        "--grace-ms",
        type=count_arg(0),
        default=60_000,
        help="a message is lost only when due more than this long before --now (default 60000)",
    )
    p = common(sub.add_parser("lateness", help="p50/p99/max of dispatched - due, per minute and per subject"))
    p = common(sub.add_parser("forecast", help="messages due per future minute (table + heat map)"))
    p.add_argument("--now", default=None, type=time_arg, help="start of the future (epoch ms or ISO; default now)")
    p.add_argument("--hours", type=count_arg(1), default=24, help="hours shown in the heat map (default 24)")
    p = common(sub.add_parser("export", help="a log to Parquet, partitioned by due day"))
    p.add_argument("--log", default="all", type=logs_arg, help="message, schedule, dispatch or all (default all)")
    p.add_argument(
        "--corrupt",
        default="row",
        choices=("row", "skip"),
        help="unreadable records: rows with an error (default) or skipped",
    )
    p = common(sub.add_parser("import", help="schedule a Parquet/CSV dataset through the gRPC API"), data=False)
    p.add_argument("--input", required=True, type=dataset_arg, help="a Parquet or CSV file or folder")
    p.add_argument(
        "--format",
        choices=("parquet", "csv"),
        default=None,
        help="default: from the file extension (csv when it ends in .csv)",
    )
    p.add_argument(
        "--target", default="127.0.0.1:7600", type=target_arg, help="qdelay server HOST:PORT (default 127.0.0.1:7600)"
    )
    p.add_argument("--token-file", default=None, type=token_file_arg, help="file holding the bearer token")
    # qdelay admin's TLS flags; the CA file is read here, on the driver, and its bytes go
    # with each task (a cluster's workers need not have the file)
    p.add_argument(
        "--tls-ca", default=None, type=ca_file_arg, help="CA certificate (PEM) to verify the server; enables TLS"
    )
    p.add_argument("--tls-server-name", default=None, help="expected TLS server name (override)")
    p.add_argument("--batch-size", type=count_arg(1), default=500, help="messages per SendBatch (default 500)")


# --- session and data -----------------------------------------------------------------------


def _session(args):
    master = args.master
    if master is None and "PYSPARK_GATEWAY_PORT" not in os.environ:  # not under spark-submit
        master = "local[*]"
    # Spark's stage progress bar on a terminal; nothing in a pipe or a file
    conf = {"spark.ui.showConsoleProgress": "true" if sys.stderr.isatty() else "false"}
    for item in getattr(args, "conf", None) or []:
        k, _, v = item.partition("=")
        conf[k.strip()] = v.strip()
    spark = spark_source.session(master, f"qdelay-{args.spark_job}", conf)
    if sys.stderr.isatty():
        spark.sparkContext.setLogLevel("WARN")  # the bar is drawn only at WARN or quieter
    return spark


def _out_dir(args) -> str:
    out = args.out or os.path.join("qdelay-spark", args.spark_job)
    os.makedirs(out, exist_ok=True)
    return out


def _now_ms(value: int | None) -> int:
    """--now as time_arg parsed it, else the clock."""
    return int(time.time() * 1000) if value is None else value


# the columns the jobs read: payload and headers are never built (column pruning)
JOB_COLUMNS = [
    "server",
    "log",
    "segment",
    "offset",
    "size",
    "sequence",
    "kind",
    "message_id",
    "subject",
    "created_ms",
    "due_ms",
    "target_sequence",
    "dispatched_ms",
    "acked_ms",
    "attempt",
    "outcome",
    "group",
    "error",
]


def frames(spark, data_dirs, log="all"):
    """The records of every log without payloads and headers (what the jobs need), cached."""
    return spark_source.read(spark, data_dirs, log=log, corrupt="row", columns=JOB_COLUMNS).cache()


def tables(df):
    """(messages, cancels, dispatches, errors) of a frames() DataFrame, keyed by (server, sequence).

    A message appears in the message log and again in the schedule log (same sequence,
    same bytes): it is counted once."""
    from pyspark.sql import functions as F

    ok = df.where(F.col("error").isNull())
    messages = (
        ok.where(F.col("kind") == "MESSAGE")
        .groupBy("server", "sequence")
        .agg(
            F.first("message_id").alias("message_id"),
            F.first("subject").alias("subject"),
            F.min("due_ms").alias("due_ms"),
            F.min("created_ms").alias("created_ms"),
        )
    )
    cancels = (
        ok.where(F.col("kind") == "CANCEL")
        .groupBy("server", F.col("target_sequence").alias("sequence"))
        .agg(F.min("created_ms").alias("cancelled_ms"))
    )
    dispatches = ok.where(F.col("kind") == "DISPATCH").select(
        "server",
        "sequence",
        "message_id",
        F.col("due_ms").alias("dispatch_due_ms"),
        "dispatched_ms",
        "acked_ms",
        "attempt",
        "outcome",
        "segment",
        "offset",
    )
    errors = df.where(F.col("error").isNotNull()).select(
        "server", "log", "segment", "offset", "size", "error", F.col("error").startswith("torn tail").alias("torn")
    )
    return messages, cancels, dispatches, errors


def _write_json(df, path: str) -> None:
    df.coalesce(1).write.mode("overwrite").json(path)


def _print_rows(title: str, rows, columns) -> None:
    print(f"  {title}:")
    for r in rows:
        print("    " + "  ".join(f"{c}={r[c]}" for c in columns))


# --- audit ----------------------------------------------------------------------------------


FINDINGS = ("lost", "duplicated", "delivered_after_cancel", "early")
FINDING_COLUMNS = {
    "lost": ["server", "sequence", "message_id", "subject", "due_ms", "overdue_ms"],
    "duplicated": ["server", "sequence", "message_id", "dispatches", "attempts"],
    "delivered_after_cancel": ["server", "sequence", "message_id", "cancelled_ms", "last_delivered_ms"],
    "early": ["server", "sequence", "message_id", "due_ms", "first_dispatched_ms", "early_by_ms"],
}
# past due, never dispatched nor cancelled, of a subject no group has (yet): kept for the
# subject's first group, which receives them all (docs/api.md, "Groups"). Counted and listed
# apart from the findings; the audit does not fail for them.
WAITING = "waiting_for_first_group"
FINDING_COLUMNS[WAITING] = FINDING_COLUMNS["lost"]


def _servers(data_dirs) -> list[str]:
    """The folders as the source names them in its ``server`` column (absolute paths),
    each once."""
    if isinstance(data_dirs, str):
        paths = spark_source.parse_paths({"path": data_dirs})
    else:
        paths = spark_source.parse_paths({"paths": json.dumps(list(data_dirs))})
    return list(dict.fromkeys(paths))


def life_table(spark, data_dirs):
    """One row per (server, sequence) with the numbers the audit judges by, in one scan of
    the logs and one shuffle: a conditional aggregate over MESSAGE, CANCEL (keyed by its
    target) and DISPATCH rows, and a count of the unreadable stretches (``errors``; the
    scan keeps them as rows, so the audit needs no scan of its own to know there are
    none). Only fixed-width columns go through the aggregate: the folder is grouped by
    its number in ``data_dirs`` and named again after it, and the aggregates are counts,
    min and max (a string or a list would make Spark sort every record, five times
    slower). Names come later, for the findings only."""
    from pyspark.sql import functions as F

    servers = _servers(data_dirs)
    cols = ["server", "kind", "sequence", "due_ms", "created_ms", "target_sequence", "dispatched_ms", "group"]
    df = spark_source.read(spark, servers, log="all", corrupt="row", columns=cols + ["outcome", "error"])
    kind = F.col("kind")
    ok = F.col("error").isNull()
    is_msg, is_cxl, is_disp = ok & (kind == "MESSAGE"), ok & (kind == "CANCEL"), ok & (kind == "DISPATCH")
    number = F.lit(0)
    for i in range(len(servers) - 1, 0, -1):
        number = F.when(F.col("server") == servers[i], i).otherwise(number)
    when = F.when
    return (
        df.select(
            number.alias("server_no"),
            when(is_cxl, F.col("target_sequence")).otherwise(F.col("sequence")).alias("sequence"),
            *[c for c in cols + ["outcome", "error"] if c not in ("server", "sequence")],
        )
        .groupBy("server_no", "sequence")
        .agg(
            F.min(when(is_msg, F.col("due_ms"))).alias("m_due"),
            F.min(when(is_cxl, F.col("created_ms"))).alias("cancelled_ms"),
            F.count(when(is_disp, 1)).alias("dispatches"),
            # every consumer group gets its own delivery: duplicates are within one group.
            # The lowest and highest hash of the groups' names (numbers keep this a hash
            # aggregate; a distinct count would double every row): equal, one group.
            F.min(when(is_disp, F.xxhash64("group"))).alias("g_lo"),
            F.max(when(is_disp, F.xxhash64("group"))).alias("g_hi"),
            F.min(when(is_disp, F.col("dispatched_ms"))).alias("first_dispatched_ms"),
            F.max(when(is_disp & (F.col("outcome") == "DELIVERED"), F.col("dispatched_ms"))).alias("last_delivered_ms"),
            F.min(when(is_disp, F.col("due_ms"))).alias("d_due"),
            F.count("error").alias("errors"),
        )
        .withColumn("server", F.element_at(F.array(*[F.lit(x) for x in servers]), F.col("server_no") + 1))
        .withColumn("has_message", F.col("m_due").isNotNull())
        .withColumn("due_ms", F.coalesce("m_due", "d_due"))
    )


def _duplicated_in_a_group(spark, data_dirs, table):
    """(server, sequence) of the messages dispatched more than once in one group, among
    those dispatched to several groups (``table``'s g_lo != g_hi): the rare exact check."""
    from pyspark.sql import functions as F

    several = table.where((F.col("g_lo") != F.col("g_hi")) & (F.col("dispatches") > 2)).select("server", "sequence")
    cols = ["server", "sequence", "kind", "group"]
    rows = spark_source.read(spark, data_dirs, log="dispatch", corrupt="skip", columns=cols, pushdown=True)
    return (
        rows.where(F.col("kind") == "DISPATCH")
        .join(several, ["server", "sequence"], "left_semi")
        .groupBy("server", "sequence", "group")
        .count()
        .where(F.col("count") > 1)
        .select("server", "sequence")
        .distinct()
        .withColumn("dup_in_group", F.lit(True))
    )


def _damage(spark, data_dirs):
    """Every unreadable stretch of every log (the reader keeps only error rows)."""
    from pyspark.sql import functions as F

    cols = ["server", "log", "segment", "offset", "size", "error"]
    return (
        spark_source.read(spark, data_dirs, log="all", corrupt="row", columns=cols, pushdown=True)
        .where(F.col("error").isNotNull())
        .withColumn("torn", F.col("error").startswith("torn tail"))
    )


def group_tables(data_dirs) -> dict:
    """Each server's consumer groups (server -> the server's own GroupTable) as its
    scheduler has them after its logs: the iterate checkpoint's table, then the GROUP
    records of the message log past the checkpoint, replayed as the scheduler replays them
    (``apply_group``). Read on the driver: the log past the checkpoint is the part not yet
    iterated, normally small. None for a server whose groups are not known: an unreadable
    checkpoint (the older GROUP records may be cleaned away) or one from before groups (its
    server gives each subject the group ``default`` when a message falls due)."""
    from qdelay.segments import records
    from qdelay.segments.framing import RecordKind
    from qdelay.server.groups import GroupTable
    from qdelay.tools.inspect import open_buffer, read_checkpoint, segment_files, walk

    tables: dict = {}
    for server in _servers(data_dirs):
        state, err = read_checkpoint(server)
        if err is not None or (
            state is not None and ("groups" not in state or not isinstance(state.get("offset"), int))
        ):
            tables[server] = None
            continue
        table = GroupTable.from_state(state or {})
        copied = state["offset"] if state else 0  # the message log before it is in the table
        for sf in segment_files(server, ("message",)):
            if sf.key + sf.size <= copied:
                continue
            with open_buffer(sf.path) as buf:
                for item in walk(buf, 0, False, max(0, copied - sf.key)):
                    f = item.frame
                    if f is None or f.kind != RecordKind.GROUP or f.sequence <= table.applied_seq:
                        continue
                    try:
                        rec = records.decode_group(f.body)
                    except ValueError:
                        continue  # reported with the damage
                    table.applied_seq = f.sequence
                    if rec.op == records.GroupOp.CREATE:
                        table.create(rec.subject, rec.group, f.timestamp)
                    else:
                        table.delete(rec.subject, rec.group, f.timestamp)
        tables[server] = table
    return tables


def _waiting_for_a_first_group(spark, data_dirs, unsent):
    """(server, sequence) of the ``unsent`` rows (past due, never dispatched nor cancelled)
    whose subject has no group and that became due since it last had one: the server keeps
    them for the subject's first group, which receives them all (docs/api.md, "Groups").
    Not lost. A scan of the MESSAGE rows for the subjects: only when something is unsent."""
    from pyspark.sql import functions as F

    from qdelay.server.groups import BEGINNING

    # a subject with groups: never waiting; one without: waiting from kept_since on
    known = []
    for server, table in group_tables(data_dirs).items():
        if table is None:  # groups unknown: nothing is excused
            known.append((server, None, True, BEGINNING))
            continue
        known += [(server, g.subject, True, BEGINNING) for g in table.listed()]
        known += [(server, subject, False, at) for subject, at in table.state()["groups_kept_since"]]
    schema = "server string, subject string, has_group boolean, kept_since long"
    groups = spark.createDataFrame(known, schema)
    cols = ["server", "sequence", "kind", "subject"]
    subjects = (
        spark_source.read(spark, data_dirs, log="all", corrupt="skip", columns=cols, pushdown=True)
        .where(F.col("kind") == "MESSAGE")
        .select("server", "sequence", "subject")
        .dropDuplicates(["server", "sequence"])  # iterated: in the message and the schedule log
        .join(unsent.select("server", "sequence", "due_ms"), ["server", "sequence"])
    )
    whole = groups.where(F.col("subject").isNull()).select("server", F.lit(True).alias("unknown"))
    return (
        subjects.join(F.broadcast(groups.where(F.col("subject").isNotNull())), ["server", "subject"], "left")
        .join(F.broadcast(whole), ["server"], "left")
        .where(
            F.col("unknown").isNull()
            & ~F.coalesce(F.col("has_group"), F.lit(False))
            & (F.col("due_ms") >= F.coalesce(F.col("kept_since"), F.lit(BEGINNING)))
        )
        .select("server", "sequence", F.lit(True).alias("waiting"))
    )


def _names(spark, data_dirs, keys, sequences=None, due=None):
    """message_id, subject and the sorted attempts of the (server, sequence) rows of
    ``keys`` (a small DataFrame, broadcast): a second scan of MESSAGE and DISPATCH rows,
    joined to the findings instead of carrying strings through the big aggregate. With
    ``sequences`` (the keys' sequences, a few hundred) the reader keeps only their frames;
    with ``due`` (the lowest and highest due time of the keys: a MESSAGE and its DISPATCH
    records carry the message's due time) it opens only the schedule and dispatch
    segments of that range."""
    from pyspark.sql import functions as F

    cols = ["server", "sequence", "kind", "message_id", "subject", "attempt", "due_ms"]
    rows = spark_source.read(spark, data_dirs, log="all", corrupt="skip", columns=cols, pushdown=True).where(
        F.col("kind").isin("MESSAGE", "DISPATCH")
    )
    if sequences is not None:
        rows = rows.where(F.col("sequence").isin(sequences))
    if due is not None and due[0] is not None:
        rows = rows.where(F.col("due_ms").between(due[0], due[1]))
    is_msg, is_disp = F.col("kind") == "MESSAGE", F.col("kind") == "DISPATCH"
    return (
        rows.join(F.broadcast(keys), ["server", "sequence"])
        .groupBy("server", "sequence")
        .agg(
            F.first(F.when(is_msg, F.col("message_id")), ignorenulls=True).alias("m_id"),
            F.first(F.when(is_disp, F.col("message_id")), ignorenulls=True).alias("d_id"),
            F.first(F.when(is_msg, F.col("subject")), ignorenulls=True).alias("subject"),
            F.sort_array(F.collect_list(F.when(is_disp, F.col("attempt")))).alias("attempts"),
        )
        .withColumn("message_id", F.coalesce("m_id", "d_id"))
        .drop("m_id", "d_id")
    )


def audit(
    spark, data_dirs, now_ms: int, grace_ms: int = 60_000, out: str | None = None, allow_duplicates: bool = False
) -> dict:
    """Find lost (past due, never dispatched nor cancelled, though its subject has a group
    to receive it), duplicated (more than one dispatch record), delivered-after-cancel and
    early (dispatched before due) messages. Past-due messages kept for their subject's first
    group are counted apart (``waiting_for_first_group``), not as findings.

    ``allow_duplicates``: duplicates are what at-least-once delivery promises for a message
    in flight when a consumer or the server restarted; they are still counted and listed,
    but do not make the audit fail (``failed`` in the summary).

    Returns the summary (exact counts, the first examples of each finding); with ``out``,
    writes every finding as JSON lines (``out/findings``) and ``out/summary.json``."""
    from pyspark.sql import Observation
    from pyspark.sql import functions as F

    col = F.col
    flags = (
        life_table(spark, data_dirs)
        .withColumn(
            "lost",
            col("has_message")
            & (col("dispatches") == 0)
            & col("cancelled_ms").isNull()
            & (col("due_ms") < now_ms - grace_ms),
        )
        # dispatched more than once to one group; a message dispatched to several groups
        # (g_lo != g_hi) with more dispatches than groups could be: checked exactly below
        .withColumn("duplicated", F.coalesce((col("g_lo") == col("g_hi")) & (col("dispatches") > 1), F.lit(False)))
        .withColumn("several_groups", F.coalesce((col("g_lo") != col("g_hi")) & (col("dispatches") > 2), F.lit(False)))
        .withColumn("delivered_after_cancel", F.coalesce(col("last_delivered_ms") >= col("cancelled_ms"), F.lit(False)))
        .withColumn("early", F.coalesce(col("first_dispatched_ms") < col("due_ms"), F.lit(False)))
        .withColumn("overdue_ms", F.lit(now_ms) - col("due_ms"))
        .withColumn("early_by_ms", col("due_ms") - col("first_dispatched_ms"))
    )
    # One pass over the logs: the totals are observed on the way (Spark's Observation) to
    # the rows with a finding, which are kept (cached: a few, normally); the per-message
    # table itself is never cached (building the cache of a million rows cost 40 % more
    # than the aggregate)
    obs = Observation("audit")
    found = (
        flags.observe(
            obs,
            F.count(F.when(col("has_message"), 1)).alias("messages"),
            F.count(col("cancelled_ms")).alias("cancelled"),
            F.sum("dispatches").alias("dispatch_records"),
            F.sum("errors").alias("errors"),
            *[F.count(F.when(col(n), 1)).alias(n) for n in FINDINGS + ("several_groups",)],
        )
        .where(" or ".join(FINDINGS + ("several_groups",)))
        .cache()
    )
    found.count()
    totals = obs.get
    counts = {n: totals[n] for n in FINDINGS}
    if totals["several_groups"]:  # consumer groups: the exact check, a scan of the dispatch log
        dups = _duplicated_in_a_group(spark, data_dirs, found)
        checked = (
            found.join(dups, ["server", "sequence"], "left")
            .withColumn("duplicated", col("duplicated") | F.coalesce(col("dup_in_group"), F.lit(False)))
            .where(" or ".join(FINDINGS))
            .drop("dup_in_group")
            .cache()
        )
        counts["duplicated"] = checked.where("duplicated").count()
        found.unpersist()
        found = checked
    found = found.withColumn(WAITING, F.lit(False))
    if counts["lost"]:  # what a subject without a group keeps for its first one is not lost
        waiting = _waiting_for_a_first_group(spark, data_dirs, found.where("lost"))
        split = (
            found.join(waiting, ["server", "sequence"], "left")
            .withColumn(WAITING, F.coalesce(col("waiting"), F.lit(False)))
            .withColumn("lost", col("lost") & ~col(WAITING))
            .drop("waiting")
            .cache()
        )
        n_waiting = split.where(WAITING).count()
        counts["lost"] -= n_waiting
        found.unpersist()
        found = split
    else:
        n_waiting = 0
    summary: dict = {
        "now_ms": now_ms,
        "grace_ms": grace_ms,
        "messages": totals["messages"],
        "cancelled": totals["cancelled"],
        "dispatch_records": int(totals["dispatch_records"] or 0),
        "findings": counts,
        WAITING: n_waiting,
        "examples": {n: [] for n in FINDINGS + (WAITING,)},
        "allow_duplicates": allow_duplicates,
    }
    if any(summary["findings"].values()) or n_waiting:
        # names for every finding when they are all written, else for the examples only
        picked = found if out else found.orderBy("server", "sequence").limit(100 * EXAMPLES)
        sequences = due = None
        if not out:
            rows = picked.select("sequence", "due_ms").collect()
            sequences = sorted({r.sequence for r in rows})
            dues = [r.due_ms for r in rows if r.due_ms is not None]
            due = (min(dues), max(dues)) if len(dues) == len(rows) else None
        keys = picked.select("server", "sequence")
        named = picked.join(_names(spark, data_dirs, keys, sequences, due), ["server", "sequence"], "left")
        findings = named.select(
            "server",
            "sequence",
            "message_id",
            "subject",
            "due_ms",
            "cancelled_ms",
            "dispatches",
            "attempts",
            "first_dispatched_ms",
            "last_delivered_ms",
            "overdue_ms",
            "early_by_ms",
            *FINDINGS,
            WAITING,
        ).cache()
        for r in findings.orderBy("server", "sequence").limit(100 * EXAMPLES).collect():
            for n in FINDINGS + (WAITING,):
                if r[n] and len(summary["examples"][n]) < EXAMPLES:
                    summary["examples"][n].append({c: r[c] for c in FINDING_COLUMNS[n]})
        if out:
            _write_json(findings, os.path.join(out, "findings"))
        findings.unpersist()
    found.unpersist()
    # where they are (a scan of their own) only when the audit's scan met some
    err_rows = _damage(spark, data_dirs).collect() if totals["errors"] else []
    summary["corrupt_records"] = [r.asDict() for r in err_rows if not r["torn"]]
    summary["torn_tails"] = [r.asDict() for r in err_rows if r["torn"]]
    failing = [n for n in FINDINGS if not (allow_duplicates and n == "duplicated")]
    summary["failed"] = bool(sum(summary["findings"][n] for n in failing) + len(summary["corrupt_records"]))
    if out:
        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2, sort_keys=True)
    return summary


def _audit_cmd(spark, args) -> int:
    out = _out_dir(args)
    s = audit(spark, args.data_dir, _now_ms(args.now), args.grace_ms, out, args.allow_duplicates)
    print(
        f"audit of {counted(len(args.data_dir), 'data folder')} at now={s['now_ms']} (grace {s['grace_ms']} ms): "
        f"{counted(s['messages'], 'message')}, {s['cancelled']} cancelled, "
        f"{counted(s['dispatch_records'], 'dispatch record')}"
    )
    for name, n in s["findings"].items():
        allowed = " (allowed: at-least-once redeliveries)" if name == "duplicated" and args.allow_duplicates else ""
        print(f"{name:<24} {n}{allowed if n else ''}")
        if n:
            rows = s["examples"][name]
            _print_rows(f"first {len(rows)}", rows, list(rows[0]))
    n = s[WAITING]
    print(
        f"{WAITING:<24} {n}" + (" (not lost: their subjects have no group yet; the first one gets them)" if n else "")
    )
    if n:
        rows = s["examples"][WAITING]
        _print_rows(f"first {len(rows)}", rows, list(rows[0]))
    for key, label in (
        ("corrupt_records", "corrupt records (run 'qdelay inspect verify')"),
        ("torn_tails", "torn tails (a live or crashed writer; recovery cuts them)"),
    ):
        if s[key]:
            print(f"{label}: {len(s[key])}")
            _print_rows("where", s[key][:EXAMPLES], ["server", "segment", "offset", "error"])
    _print_outputs(
        [os.path.join(out, "summary.json")]
        + ([os.path.join(out, "findings")] if any(s["findings"].values()) or s[WAITING] else [])
    )
    return 1 if s["failed"] else 0


# --- lateness -------------------------------------------------------------------------------


def lateness(spark, data_dirs):
    """(per minute, per subject) pandas tables of what happened to delivered messages, in
    three separate measures (mixing them made a subject whose consumer came late look like
    a late server):

    - server lateness, ``dispatched - due`` of first deliveries: how late the server handed
      a message to a consumer (a redelivery's dispatch time is its retry's, left out);
    - time to ack, ``acked - dispatched``: the consumer's work and the ack's trip;
    - redelivered share: deliveries that needed more than one attempt.

    Reads only the schedule and dispatch logs (a delivered message was copied there), with
    only the columns used, the filters pushed to the reader."""
    from pyspark.sql import functions as F

    cols = ["server", "sequence", "kind", "subject", "due_ms", "dispatched_ms", "acked_ms", "attempt", "outcome"]

    def logs(kind):
        return spark_source.read(spark, data_dirs, log="schedule,dispatch", columns=cols, pushdown=True).where(
            F.col("kind") == kind
        )

    messages = logs("MESSAGE").groupBy("server", "sequence").agg(F.first("subject").alias("subject"))
    d = (
        logs("DISPATCH")
        .where(F.col("outcome") == "DELIVERED")
        .drop("subject")
        .join(messages, ["server", "sequence"], "left")
        .withColumn("subject", F.coalesce("subject", F.lit("(unknown)")))
        .withColumn("first", F.col("attempt") <= 1)
        .withColumn("server_ms", F.when(F.col("first"), F.col("dispatched_ms") - F.col("due_ms")))
        .withColumn("ack_ms", F.col("acked_ms") - F.col("dispatched_ms"))
    )

    def pct(col, q):
        return F.percentile_approx(col, q, 10000)

    def stats(frame, key):
        return (
            frame.groupBy(key)
            .agg(
                F.count("*").alias("delivered"),
                F.count(F.when(~F.col("first"), 1)).alias("redelivered"),
                pct("server_ms", 0.5).alias("server_p50_ms"),
                pct("server_ms", 0.99).alias("server_p99_ms"),
                F.max("server_ms").alias("server_max_ms"),
                pct("ack_ms", 0.5).alias("ack_p50_ms"),
                pct("ack_ms", 0.99).alias("ack_p99_ms"),
                F.max("ack_ms").alias("ack_max_ms"),
            )
            .withColumn("redelivered_share", F.round(F.col("redelivered") / F.col("delivered"), 4))
            .orderBy(key)
        )

    per_minute = stats(d.withColumn("minute_ms", F.floor(F.col("due_ms") / 60000) * 60000), "minute_ms").toPandas()
    per_subject = stats(d, "subject").toPandas()
    if len(per_minute):
        import pandas as pd

        per_minute.insert(0, "minute", pd.to_datetime(per_minute["minute_ms"], unit="ms", utc=True))
    return per_minute, per_subject


def _plot_lateness(per_minute, per_subject, path: str) -> None:
    """Three panels: server lateness and time to ack per due minute (log scale: spreads
    run from milliseconds to hours), with the deliveries per minute behind them, and the
    20 subjects with the worst server p99, each bar labelled with its count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, c, b) = plt.subplots(3, 1, figsize=(11, 12))
    for ax, prefix, title in ((a, "server", "server lateness (dispatched - due)"), (c, "ack", "time to ack")):
        if len(per_minute):
            counts = ax.twinx()
            counts.bar(per_minute["minute"], per_minute["delivered"], width=1 / 1440, alpha=0.2, color="grey")
            counts.set_ylabel("deliveries per minute")
            for col, style in ((f"{prefix}_p50_ms", "-"), (f"{prefix}_p99_ms", "--"), (f"{prefix}_max_ms", ":")):
                ax.plot(per_minute["minute"], per_minute[col].clip(lower=1), style, label=col[len(prefix) + 1 : -3])
            ax.set_yscale("log")
            ax.legend(loc="upper left")
        ax.set_title(f"{title} per due minute, ms (log scale)")
        ax.set_xlabel("due minute (UTC)")
    top = per_subject.sort_values("server_p99_ms", ascending=False).head(20) if len(per_subject) else per_subject
    if len(top):
        b.barh(top["subject"], top["server_p99_ms"].clip(lower=1), label="server p99")
        b.barh(top["subject"], top["server_p50_ms"].clip(lower=1), label="server p50")
        b.set_xscale("log")
        for y, (n, share) in enumerate(zip(top["delivered"], top["redelivered_share"])):
            b.annotate(f" n={n}, redelivered {share:.1%}", (1, y), va="center", fontsize=8)
        b.legend()
    b.set_title("server lateness per subject (20 worst p99), ms, log scale")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _lateness_cmd(spark, args) -> int:
    out = _out_dir(args)
    per_minute, per_subject = lateness(spark, args.data_dir)
    paths = [os.path.join(out, n) for n in ("lateness_per_minute.csv", "lateness_per_subject.csv", "lateness.png")]
    per_minute.to_csv(paths[0], index=False)
    per_subject.to_csv(paths[1], index=False)
    _plot_lateness(per_minute, per_subject, paths[2])
    cols = ["delivered", "server_p50_ms", "server_p99_ms", "ack_p50_ms", "ack_p99_ms", "redelivered_share"]
    print("server lateness = dispatched - due (first deliveries); ack = acked - dispatched")
    print("per due minute:")
    print(per_minute[["minute"] + cols].to_string(index=False) if len(per_minute) else "  (no deliveries)")
    print("per subject:")
    print(per_subject[["subject"] + cols].to_string(index=False) if len(per_subject) else "  (no deliveries)")
    _print_outputs(paths)
    return 0


def _print_outputs(paths) -> None:
    """Where a job's outputs went (absolute paths: the job may run far from its caller)."""
    print("written:")
    for p in paths:
        print(f"  {os.path.abspath(p)}")


# --- forecast -------------------------------------------------------------------------------


def forecast(spark, data_dirs, now_ms: int):
    """pandas table of pending (not dispatched, not cancelled) messages per due minute >= now,
    and the count already overdue."""
    from pyspark.sql import functions as F

    df = frames(spark, data_dirs)
    messages, cancels, dispatches, _e = tables(df)
    keys = ["server", "sequence"]
    pending = messages.join(dispatches.select(*keys).distinct(), keys, "left_anti").join(cancels, keys, "left_anti")
    overdue = pending.where(F.col("due_ms") < now_ms).count()
    per_minute = (
        pending.where(F.col("due_ms") >= now_ms - now_ms % 60000)
        .groupBy((F.floor(F.col("due_ms") / 60000) * 60000).alias("minute_ms"))
        .agg(F.count("*").alias("due"))
        .orderBy("minute_ms")
        .toPandas()
    )
    df.unpersist()
    if len(per_minute):
        import pandas as pd

        per_minute.insert(0, "minute", pd.to_datetime(per_minute["minute_ms"], unit="ms", utc=True))
    return per_minute, overdue


def _plot_heatmap(per_minute, now_ms: int, hours: int, path: str) -> int:
    """Rows: hours from now's hour; columns: minute of the hour. Returns messages beyond."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    start = now_ms - now_ms % 3_600_000
    grid = np.zeros((hours, 60))
    beyond = 0
    for m, n in zip(per_minute["minute_ms"] if len(per_minute) else [], per_minute["due"] if len(per_minute) else []):
        row = (int(m) - start) // 3_600_000
        if 0 <= row < hours:
            grid[row, (int(m) // 60000) % 60] += n
        else:
            beyond += int(n)
    fig, ax = plt.subplots(figsize=(12, max(3, hours * 0.3)))
    im = ax.imshow(grid, aspect="auto", cmap="magma", interpolation="nearest")
    ax.set_xlabel("minute of the hour")
    labels = [time.strftime("%m-%d %H:00", time.gmtime((start + h * 3_600_000) / 1000)) for h in range(hours)]
    step = max(1, hours // 24)
    ax.set_yticks(range(0, hours, step))
    ax.set_yticklabels(labels[::step])
    ax.set_title(f"messages due per minute (UTC), next {hours} h; {beyond} more beyond")
    fig.colorbar(im, ax=ax, label="messages due")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return beyond


def _forecast_cmd(spark, args) -> int:
    out = _out_dir(args)
    now_ms = _now_ms(args.now)
    per_minute, overdue = forecast(spark, args.data_dir, now_ms)
    per_minute.to_csv(os.path.join(out, "forecast_per_minute.csv"), index=False)
    beyond = _plot_heatmap(per_minute, now_ms, args.hours, os.path.join(out, "forecast.png"))
    total = int(per_minute["due"].sum()) if len(per_minute) else 0
    print(
        f"pending at now={now_ms}: {total} due from now on ({beyond} beyond {args.hours} h), {overdue} already overdue"
    )
    if len(per_minute):
        print("hottest minutes:")
        print(per_minute.sort_values("due", ascending=False).head(EXAMPLES)[["minute", "due"]].to_string(index=False))
        print("next minutes:")
        print(per_minute.head(EXAMPLES)[["minute", "due"]].to_string(index=False))
    _print_outputs([os.path.join(out, "forecast_per_minute.csv"), os.path.join(out, "forecast.png")])
    return 0


# --- export ---------------------------------------------------------------------------------


def export(spark, data_dirs, out: str, log: str = "all", corrupt: str = "row") -> dict:
    """Each log to ``out/<log>/`` as Parquet partitioned by ``due_day`` (UTC, yyyy-MM-dd)."""
    from pyspark.sql import functions as F

    counts = {}
    for name in spark_source.parse_logs(log):
        df = spark_source.read(spark, data_dirs, log=name, corrupt=corrupt).withColumn(
            "due_day", F.date_format(F.timestamp_millis("due_ms"), "yyyy-MM-dd")
        )
        df.write.mode("overwrite").partitionBy("due_day").parquet(os.path.join(out, name))
        # read back with the schema written: a log with no records (a folder nothing was
        # delivered from yet, a message log cleaned) writes no file to infer it from
        counts[name] = spark.read.schema(df.schema).parquet(os.path.join(out, name)).count()
    return counts


def _export_cmd(spark, args) -> int:
    out = _out_dir(args)
    for name, n in export(spark, args.data_dir, out, args.log, args.corrupt).items():
        print(
            f"{name}: {counted(n, 'row')} -> {os.path.abspath(os.path.join(out, name))} "
            "(Parquet, partitioned by due_day)"
        )
    return 0


# --- import ---------------------------------------------------------------------------------

REPORT_DIR = "accepted"  # JSON lines of every accepted message (the resumable report)
REJECT_DIR = "rejected"  # JSON lines of every message the server refused, with why


def with_ids(df):
    """Give every row without a message id a stable one derived from its content
    (``imp-`` + 32 hex digits of a SHA-256), so that a resumed import recognises it."""
    from pyspark.sql import functions as F

    payload = F.col("payload")
    if dict(df.dtypes)["payload"] == "binary":
        payload = F.base64(payload)
    digest = F.sha2(
        F.concat_ws(
            "\x1f",
            F.col("subject"),
            payload,
            F.coalesce(F.col("deliver_at_ms").cast("string"), F.lit("")),
            F.coalesce(F.col("delay_ms").cast("string"), F.lit("")),
        ),
        256,
    )
    return df.withColumn(
        "message_id", F.coalesce(F.col("message_id"), F.concat(F.lit("imp-"), F.substring(digest, 1, 32)))
    )


def _read_report(out: str) -> set[str]:
    ids: set[str] = set()
    for path in glob.glob(os.path.join(out, REPORT_DIR, "*.jsonl")):
        with open(path) as f:
            for line in f:
                if line.strip():
                    try:
                        ids.add(json.loads(line)["message_id"])
                    except (ValueError, KeyError):
                        pass  # a line torn by a crash: that batch is sent again
    return ids


def _accepted_ids(spark, out: str):
    files = glob.glob(os.path.join(out, REPORT_DIR, "*.jsonl"))
    if not files or not any(os.path.getsize(f) for f in files):
        return None
    return spark.read.schema("message_id string").json(files).select("message_id").distinct()


def _send_partition(
    target: str, token: str | None, tls_ca: bytes | None, tls_server_name: str | None, batch_size: int, out: str
):
    """The foreachPartition function: SendBatch in batches, one report file per task attempt.
    ``tls_ca`` is the CA certificate's bytes (TLS when given), shipped with the task."""

    def run(rows):
        import grpc
        from pyspark import TaskContext

        from qdelay.replication import common
        from qdelay.v1 import qdelay_pb2 as pb
        from qdelay.v1 import qdelay_pb2_grpc as pb_grpc

        ctx = TaskContext.get()
        tag = f"p{ctx.partitionId() if ctx else 0:05d}-a{ctx.attemptNumber() if ctx else 0}-{uuid.uuid4().hex[:8]}"
        metadata = common.metadata(token)
        channel = common.make_channel(target, tls=tls_ca is not None, ca=tls_ca, server_name=tls_server_name, aio=False)
        stub = pb_grpc.DelayServiceStub(channel)
        os.makedirs(os.path.join(out, REPORT_DIR), exist_ok=True)
        os.makedirs(os.path.join(out, REJECT_DIR), exist_ok=True)
        accepted_f = open(os.path.join(out, REPORT_DIR, f"{tag}.jsonl"), "a")
        rejected_f = None

        def message(row) -> pb.Message:
            payload = row["payload"]
            if isinstance(payload, str):
                payload = payload.encode()
            payload = bytes(payload or b"")
            kw = {}
            if row["deliver_at_ms"] is not None:
                kw["deliver_at_ms"] = int(row["deliver_at_ms"])
            elif row["delay_ms"] is not None:
                kw["delay_ms"] = int(row["delay_ms"])
            mid = row["message_id"]
            headers = row["headers"] or {}
            return pb.Message(
                subject=row["subject"] or "", payload=payload, message_id=mid, headers=dict(headers), **kw
            )

        def call(method, request):
            delay = 0.2
            for attempt in range(8):
                try:
                    return method(request, metadata=metadata, timeout=60)
                except grpc.RpcError as err:
                    if (
                        err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
                        or attempt == 7
                    ):
                        raise
                    time.sleep(delay)
                    delay = min(delay * 2, 5.0)

        def record(msgs, receipts):
            for m, r in zip(msgs, receipts):
                accepted_f.write(
                    json.dumps(
                        {
                            "message_id": r.message_id or m.message_id,
                            "sequence": r.sequence,
                            "deliver_at_ms": r.deliver_at_ms,
                            "subject": m.subject,
                        }
                    )
                    + "\n"
                )
            accepted_f.flush()
            os.fsync(accepted_f.fileno())

        def reject(m, err):
            nonlocal rejected_f
            if rejected_f is None:
                rejected_f = open(os.path.join(out, REJECT_DIR, f"{tag}.jsonl"), "a")
            rejected_f.write(
                json.dumps(
                    {"message_id": m.message_id, "subject": m.subject, "code": err.code().name, "error": err.details()}
                )
                + "\n"
            )
            rejected_f.flush()

        def flush(batch):
            try:
                resp = call(stub.SendBatch, pb.SendBatchRequest(messages=batch))
                record(batch, resp.receipts)
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.INVALID_ARGUMENT:
                    raise
                # all-or-nothing: find the bad ones one by one, keep the good ones
                for m in batch:
                    try:
                        resp = call(stub.Send, pb.SendRequest(message=m))
                        record([m], [resp.receipt])
                    except grpc.RpcError as one:
                        if one.code() != grpc.StatusCode.INVALID_ARGUMENT:
                            raise
                        reject(m, one)

        try:
            batch = []
            for row in rows:
                batch.append(message(row))
                if len(batch) >= batch_size:
                    flush(batch)
                    batch = []
            if batch:
                flush(batch)
        finally:
            accepted_f.close()
            if rejected_f is not None:
                rejected_f.close()
            channel.close()

    return run


def import_dataset(
    spark,
    path: str,
    target: str,
    out: str,
    fmt: str | None = None,
    token: str | None = None,
    batch_size: int = 500,
    tls_ca: bytes | None = None,
    tls_server_name: str | None = None,
) -> dict:
    """Schedule every row of a dataset not yet in the report; returns the counts. With
    ``tls_ca`` (the CA certificate's PEM bytes) the tasks dial ``target`` over TLS."""
    from pyspark.sql import functions as F

    fmt = fmt or ("csv" if path.rstrip("/").lower().endswith(".csv") else "parquet")
    if fmt == "csv":
        df = spark.read.option("header", True).csv(path)
    else:
        df = spark.read.parquet(path)
    cols = set(df.columns)
    missing = {"subject", "payload"} - cols
    if missing or not ({"deliver_at_ms", "delay_ms"} & cols):
        raise SystemExit(
            f"qdelay spark import: the dataset needs subject, payload and deliver_at_ms "
            f"or delay_ms (missing {sorted(missing) or 'deliver_at_ms/delay_ms'})"
        )
    for c in ("deliver_at_ms", "delay_ms"):
        df = df.withColumn(c, F.col(c).cast("long") if c in cols else F.lit(None).cast("long"))
    if "message_id" not in cols:
        df = df.withColumn("message_id", F.lit(None).cast("string"))
    if "headers" not in cols:
        df = df.withColumn("headers", F.lit(None).cast("map<string,string>"))
    df = with_ids(df).select("subject", "payload", "deliver_at_ms", "delay_ms", "message_id", "headers")
    done = _accepted_ids(spark, out)
    if done is not None:
        df = df.join(done.withColumn("done", F.lit(True)), "message_id", "left")
    else:
        df = df.withColumn("done", F.lit(None).cast("boolean"))
    df = df.cache()
    counts = df.agg(F.count("*").alias("rows"), F.count("done").alias("done")).collect()[0]
    df.where(F.col("done").isNull()).drop("done").foreachPartition(
        _send_partition(target, token, tls_ca, tls_server_name, batch_size, out)
    )
    df.unpersist()
    rej_files = glob.glob(os.path.join(out, REJECT_DIR, "*.jsonl"))
    rejected = sum(1 for f in rej_files for line in open(f) if line.strip())
    return {
        "rows": counts["rows"],
        "already_accepted": counts["done"],
        "accepted": len(_read_report(out)),
        "rejected": rejected,
        "report": os.path.join(out, REPORT_DIR),
    }


def _task_failure(err: Exception) -> str:
    """The gRPC status a failed import task ended with, out of the Java and Python traceback
    Spark wraps it in (or that text's last line)."""
    text = str(err)
    m = re.search(r'status = StatusCode\.(\w+)\s+details = "(.*?)"\n', text)
    if m:
        return f"{m.group(1)}: {m.group(2)}"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return (lines[-1] if lines else type(err).__name__)[:500]


def _import_cmd(spark, args) -> int:
    out = _out_dir(args)
    from qdelay.replication.common import read_token

    # the server's token file as it is (docs/operations.md: one file for every member):
    # its first token, past blank lines and # comments; the first line itself was sent before
    token = read_token(args.token_file)
    ca = _read_ca(args.tls_ca)
    try:
        r = import_dataset(
            spark, args.input, args.target, out, args.format, token, args.batch_size, ca, args.tls_server_name
        )
    except Exception as e:  # noqa: BLE001 - a task failed: Spark wraps its error in pages of traceback
        print(
            f"qdelay spark import: stopped: {_task_failure(e)}; the {counted(len(_read_report(out)), 'message')} "
            f"accepted so far are listed in {os.path.join(out, REPORT_DIR)}: run the same command again to resume",
            file=sys.stderr,
        )
        return 1
    print(
        f"{counted(r['rows'], 'row')}: {r['already_accepted']} accepted by an earlier run, {r['accepted']} accepted "
        f"in all, {r['rejected']} rejected; report in {r['report']}"
    )
    return 0 if r["accepted"] + r["rejected"] >= r["rows"] and not r["rejected"] else 1


COMMANDS = {
    "audit": _audit_cmd,
    "lateness": _lateness_cmd,
    "forecast": _forecast_cmd,
    "export": _export_cmd,
    "import": _import_cmd,
}


def _read_ca(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


def _target_problem(target: str, token_file: str | None, tls_ca: str | None, tls_server_name: str | None) -> str | None:
    """Why ``import``'s target cannot take messages, asked once before Spark starts: with no
    server there, every task retried for ~16 s and the job ended in a 250-line Java and
    Python traceback. None when it answers."""
    import grpc

    from qdelay.replication.common import make_channel, metadata, read_token
    from qdelay.v1 import qdelay_pb2 as pb
    from qdelay.v1 import qdelay_pb2_grpc as pb_grpc

    token = read_token(token_file)
    ca = _read_ca(tls_ca)
    channel = make_channel(target, tls=ca is not None, ca=ca, server_name=tls_server_name, aio=False)
    with channel:
        try:
            pb_grpc.DelayServiceStub(channel).Topology(pb.TopologyRequest(), timeout=10, metadata=metadata(token))
        except grpc.RpcError as e:
            code = e.code()
            if code == grpc.StatusCode.UNAUTHENTICATED:
                more = "pass the server's token file with --token-file" if not token else "check --token-file"
                return f"{target} refused the token ({e.details()}): {more}; nothing was sent"
            hint = ""
            if code == grpc.StatusCode.UNAVAILABLE and ca is None and "Socket closed" in (e.details() or ""):
                hint = " (if the server serves TLS, give its CA certificate with --tls-ca FILE)"
            return f"no qdelay server answers at {target} ({code.name}: {e.details()}){hint}; nothing was sent"
    return None


def run(args) -> int:
    if args.spark_job == "import":
        problem = _target_problem(args.target, args.token_file, args.tls_ca, args.tls_server_name)
        if problem:
            print(f"qdelay spark import: {problem}", file=sys.stderr)
            return 1
    spark = _session(args)
    return COMMANDS[args.spark_job](spark, args)


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``spark-submit spark_jobs.py JOB ...``."""
    parser = argparse.ArgumentParser(prog="qdelay spark")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
