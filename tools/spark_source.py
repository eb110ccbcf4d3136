"""The ``qdelay`` Spark data source (PySpark >= 4, Python Data Source API).

    spark.read.format("qdelay").option("log", "schedule").load("/data/qdelay-1")
    spark.read.format("qdelay").option("log", "all").load(["/data/q1", "/data/q2"])   # or "a,b"

Options (all strings):

- ``log``: ``message``, ``schedule``, ``dispatch``, a comma list of them, or ``all``
  (default ``schedule``);
- ``corrupt``: ``row`` (default: each unreadable stretch of bytes becomes one row whose
  ``error`` column says why, every other data column null) or ``skip`` (no row; the count
  per segment is written to the executor's stderr). A job never fails on a bad record;
- ``splitBytes``: segments larger than this are split into several partitions on record
  boundaries (default 64 MiB); ``packBytes``: pack consecutive small segments of one
  folder into one partition up to this size (default 0: one partition per segment);
- ``batchRows``: rows per Arrow batch (default 8192);
- ``payload``: ``false`` leaves ``payload`` and ``headers`` null and skips decoding them
  (what the jobs use: a faster scan).

The schema is :data:`SCHEMA` (documented in docs/tools.md). Every byte is read through
``qdelay.segments`` (the same walker as ``qdelay inspect``); the reader never writes.
Paths are read on the executors: on a cluster the data folders must be mounted at the
same path on every node (the listing happens on the driver).
"""

from __future__ import annotations

import json
import os
import sys

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from qdelay.segments import framing, records
from qdelay.segments.framing import FrameError, RecordKind
from qdelay.segments.records import Cancel, Dispatch, Message

SCHEMA = (
    "server string, log string, segment string, offset long, size int, sequence long, "
    "kind string, message_id string, subject string, headers map<string,string>, "
    "payload binary, created_ms long, due_ms long, target_sequence long, dispatched_ms long, "
    "acked_ms long, schedule_offset long, attempt int, outcome string, error string"
)
COLUMNS = [c.strip().split(" ", 1)[0] for c in SCHEMA.split(", ")]
LOGS = ("message", "schedule", "dispatch")
_KINDS = {1: "MESSAGE", 2: "CANCEL", 3: "DISPATCH", 4: "CHECKPOINT"}
_OUTCOMES = {1: "DELIVERED", 2: "DEAD_LETTERED"}


def _arrow_schema():
    import pyarrow as pa

    s, i64, i32, b = pa.string(), pa.int64(), pa.int32(), pa.binary()
    types = {
        "server": s,
        "log": s,
        "segment": s,
        "offset": i64,
        "size": i32,
        "sequence": i64,
        "kind": s,
        "message_id": s,
        "subject": s,
        "headers": pa.map_(s, s),
        "payload": b,
        "created_ms": i64,
        "due_ms": i64,
        "target_sequence": i64,
        "dispatched_ms": i64,
        "acked_ms": i64,
        "schedule_offset": i64,
        "attempt": i32,
        "outcome": s,
        "error": s,
    }
    return pa.schema([pa.field(c, types[c]) for c in COLUMNS])


def parse_paths(options) -> list[str]:
    """``load(path)`` arrives as option ``path`` (comma-separated allowed), ``load([..])`` as
    option ``paths`` (a JSON list)."""
    out: list[str] = []
    raw = options.get("paths")
    if raw:
        out.extend(json.loads(raw))
    raw = options.get("path")
    if raw:
        out.extend(p for p in raw.split(",") if p.strip())
    if not out:
        raise ValueError("qdelay source: give one or more data folders to load(...)")
    return [os.path.abspath(p.strip()) for p in out]


def parse_logs(text: str | None) -> tuple[str, ...]:
    text = (text or "schedule").strip().lower()
    if text == "all":
        return LOGS
    logs = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [t for t in logs if t not in LOGS]
    if bad or not logs:
        raise ValueError(
            f"qdelay source: option log={text!r}: use message, schedule, dispatch, a comma list of them, or all"
        )
    return logs


class Piece:
    """A byte range [start, stop) of one segment, starting on a record boundary."""

    __slots__ = ("server", "log", "path", "rel", "start", "stop")

    def __init__(self, server, log, path, rel, start, stop):
        self.server, self.log, self.path, self.rel, self.start, self.stop = server, log, path, rel, start, stop

    def __getstate__(self):
        return (self.server, self.log, self.path, self.rel, self.start, self.stop)

    def __setstate__(self, state):
        self.server, self.log, self.path, self.rel, self.start, self.stop = state

    def __repr__(self) -> str:
        return f"Piece({self.rel}[{self.start}:{self.stop}] of {self.server})"


class QdelayPartition(InputPartition):
    def __init__(self, pieces: list[Piece]):
        super().__init__(len(pieces))
        self.pieces = pieces


def split_points(path: str, size: int, split_bytes: int) -> list[int]:
    """Record boundaries that cut a segment into ranges of about ``split_bytes``.

    Walks the frames with the codec's ``check_at``; at the first bad frame it stops
    splitting (the rest is one range, whose reader reports the damage)."""
    if size <= split_bytes:
        return [0, size]
    from qdelay.tools.inspect import open_buffer

    points = [0]
    with open_buffer(path) as buf:
        end = min(len(buf), size)
        pos = 0
        target = split_bytes
        while pos < end:
            try:
                frame = framing.check_at(buf, pos)
            except FrameError:
                break
            pos += frame.size
            if pos >= target and pos < end:
                points.append(pos)
                target = pos + split_bytes
    points.append(size)
    return points


def plan(servers: list[str], logs, split_bytes: int, pack_bytes: int) -> list[QdelayPartition]:
    from qdelay.tools.inspect import segment_files

    parts: list[QdelayPartition] = []
    for server in servers:
        if not os.path.isdir(server):
            raise ValueError(f"qdelay source: {server} is not a directory")
        pack: list[Piece] = []
        packed = 0
        for sf in segment_files(server, logs):
            if sf.size == 0:
                continue
            points = split_points(sf.path, sf.size, split_bytes)
            for a, b in zip(points, points[1:]):
                piece = Piece(server, sf.log, sf.path, sf.rel, a, b)
                if pack_bytes and b - a < pack_bytes:
                    if pack and packed + (b - a) > pack_bytes:
                        parts.append(QdelayPartition(pack))
                        pack, packed = [], 0
                    pack.append(piece)
                    packed += b - a
                else:
                    parts.append(QdelayPartition([piece]))
        if pack:
            parts.append(QdelayPartition(pack))
    return parts


# the columns each kind of row fills (besides server, log, segment, which are the piece's)
_FILLED = {
    "MESSAGE": ("offset", "size", "sequence", "message_id", "subject", "headers", "payload", "created_ms", "due_ms"),
    "CANCEL": ("offset", "size", "sequence", "message_id", "created_ms", "due_ms", "target_sequence"),
    "DISPATCH": (
        "offset",
        "size",
        "sequence",
        "message_id",
        "due_ms",
        "dispatched_ms",
        "acked_ms",
        "schedule_offset",
        "attempt",
        "outcome",
    ),
    "ERROR": ("offset", "size", "sequence", "kind", "error"),
}


def read_piece(piece: Piece, corrupt: str, batch_rows: int, payload: bool = True):
    """Yield Arrow record batches (of the columns in :data:`COLUMNS`) for one piece.

    Rows are gathered per record kind (each kind fills only its own columns; the rest are
    all-null arrays), so a batch holds one kind; within a kind, rows keep file order.
    ``payload=False`` leaves ``payload`` and ``headers`` null and reads MESSAGE bodies with
    the codec's ``message_index_fields`` (due, subject, id only): faster for the jobs."""
    import pyarrow as pa

    from qdelay.tools.inspect import walk

    schema = _arrow_schema()
    try:
        with open(piece.path, "rb") as f:
            f.seek(piece.start)
            buf = f.read(piece.stop - piece.start)
    except FileNotFoundError:  # cleaned by a live server after listing
        return
    acc = {k: {c: [] for c in cols} for k, cols in _FILLED.items()}
    constant = {"server": piece.server, "log": piece.log, "segment": piece.rel}

    def batch(kind: str):
        cols = acc[kind]
        n = len(cols["offset"])
        arrays = []
        for field in schema:
            name = field.name
            if name in cols:
                arrays.append(pa.array(cols[name], type=field.type))
            elif name in constant:
                arrays.append(pa.array([constant[name]] * n, type=field.type))
            elif name == "kind":
                arrays.append(pa.array([kind] * n, type=field.type))
            else:
                arrays.append(pa.nulls(n, type=field.type))
        acc[kind] = {c: [] for c in _FILLED[kind]}
        return pa.RecordBatch.from_arrays(arrays, schema=schema)

    m, c, d, e = acc["MESSAGE"], acc["CANCEL"], acc["DISPATCH"], acc["ERROR"]
    m_off, m_size, m_seq, m_mid, m_subj, m_head, m_pay, m_created, m_due = (m[k] for k in _FILLED["MESSAGE"])
    skipped = 0
    index_fields = records.message_index_fields
    for item in walk(buf, piece.start, decode_bodies=payload):
        rec = item.record
        if not payload and item.status == "ok":
            f = item.frame
            try:
                if f.kind == RecordKind.MESSAGE:
                    due, subject, mid = index_fields(f.body)
                    m_off.append(item.offset)
                    m_size.append(item.end - item.offset)
                    m_seq.append(f.sequence)
                    m_mid.append(mid.decode())
                    m_subj.append(subject.decode())
                    m_head.append(None)
                    m_pay.append(None)
                    m_created.append(f.timestamp)
                    m_due.append(due)
                    if len(m_off) >= batch_rows:
                        yield batch("MESSAGE")
                        m = acc["MESSAGE"]
                        m_off, m_size, m_seq, m_mid, m_subj, m_head, m_pay, m_created, m_due = (
                            m[k] for k in _FILLED["MESSAGE"]
                        )
                    continue
                rec = records.decode_body(f.kind, f.body)
            except Exception as err:
                item.status, item.error = "bad-body", f"undecodable body: {err}"
        if isinstance(rec, Message):
            f = item.frame
            m_off.append(item.offset)
            m_size.append(item.end - item.offset)
            m_seq.append(f.sequence)
            m_mid.append(rec.message_id)
            m_subj.append(rec.subject)
            m_head.append(list(rec.headers.items()) if rec.headers else [])
            m_pay.append(rec.payload)
            m_created.append(f.timestamp)
            m_due.append(rec.deliver_at_ms)
            if len(m_off) >= batch_rows:
                yield batch("MESSAGE")
                m = acc["MESSAGE"]
                m_off, m_size, m_seq, m_mid, m_subj, m_head, m_pay, m_created, m_due = (
                    m[k] for k in _FILLED["MESSAGE"]
                )
            continue
        if item.status == "zero":
            continue
        if isinstance(rec, Dispatch):
            f = item.frame
            for k, v in zip(
                _FILLED["DISPATCH"],
                (
                    item.offset,
                    item.end - item.offset,
                    f.sequence,
                    rec.message_id,
                    rec.deliver_at_ms,
                    rec.dispatched_at_ms,
                    f.timestamp,
                    rec.schedule_offset,
                    rec.attempt,
                    _OUTCOMES.get(rec.outcome, f"OUTCOME_{rec.outcome}"),
                ),
            ):
                d[k].append(v)
            if len(d["offset"]) >= batch_rows:
                yield batch("DISPATCH")
                d = acc["DISPATCH"]
        elif isinstance(rec, Cancel):
            f = item.frame
            for k, v in zip(
                _FILLED["CANCEL"],
                (
                    item.offset,
                    item.end - item.offset,
                    f.sequence,
                    rec.message_id,
                    f.timestamp,
                    rec.deliver_at_ms,
                    rec.target_sequence,
                ),
            ):
                c[k].append(v)
            if len(c["offset"]) >= batch_rows:
                yield batch("CANCEL")
                c = acc["CANCEL"]
        elif corrupt == "skip":
            skipped += 1
        else:  # an error row: only where and why
            f = item.frame
            for k, v in zip(
                _FILLED["ERROR"],
                (
                    item.offset,
                    item.end - item.offset,
                    f.sequence if f is not None else None,
                    _KINDS.get(f.kind, f"KIND_{f.kind}") if f is not None else None,
                    item.error or "record of an unexpected kind",
                ),
            ):
                e[k].append(v)
    for kind in ("MESSAGE", "CANCEL", "DISPATCH", "ERROR"):
        if acc[kind]["offset"]:
            yield batch(kind)  # ERROR rows fill "kind" themselves: the frame's kind, or null
    if skipped:
        sys.stderr.write(
            f"qdelay source: skipped {skipped} unreadable stretches in {piece.rel} "
            f"[{piece.start}:{piece.stop}] of {piece.server}\n"
        )


class QdelayReader(DataSourceReader):
    def __init__(
        self,
        servers: list[str],
        logs,
        corrupt: str,
        split_bytes: int,
        pack_bytes: int,
        batch_rows: int,
        payload: bool = True,
    ):
        self.payload = payload
        self.servers = servers
        self.logs = logs
        self.corrupt = corrupt
        self.split_bytes = split_bytes
        self.pack_bytes = pack_bytes
        self.batch_rows = batch_rows

    def partitions(self):
        parts = plan(self.servers, self.logs, self.split_bytes, self.pack_bytes)
        # Spark wants at least one partition; an empty one reads nothing
        return parts or [QdelayPartition([])]

    def read(self, partition):
        for piece in partition.pieces:
            yield from read_piece(piece, self.corrupt, self.batch_rows, self.payload)


class QdelayDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return "qdelay"

    def schema(self):
        return SCHEMA

    def reader(self, schema):
        opts = {k.lower(): v for k, v in self.options.items()}
        corrupt = (opts.get("corrupt") or "row").lower()
        if corrupt not in ("row", "skip"):
            raise ValueError(f"qdelay source: option corrupt={corrupt!r}: use row or skip")
        return QdelayReader(
            parse_paths(opts),
            parse_logs(opts.get("log")),
            corrupt,
            int(opts.get("splitbytes") or 64 * 1024 * 1024),
            int(opts.get("packbytes") or 0),
            int(opts.get("batchrows") or 8192),
            (opts.get("payload") or "true").lower() not in ("false", "0", "no"),
        )


def register(spark) -> None:
    spark.dataSource.register(QdelayDataSource)


def prepare_environment() -> None:
    """What a local session needs before it is built (docs: reference of the toolchain):
    workers run this interpreter (it has pyarrow and qdelay), Spark binds to loopback."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")


def session(master: str | None = "local[*]", app_name: str = "qdelay", conf: dict | None = None):
    """A SparkSession with the qdelay source registered. ``master=None`` leaves the master
    to spark-submit (or an existing session)."""
    prepare_environment()
    from pyspark.sql import SparkSession

    builder = (
        SparkSession.builder.appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
    )
    if master:
        builder = builder.master(master)
    for k, v in (conf or {}).items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    register(spark)
    return spark


def read(spark, paths, log: str = "all", corrupt: str = "row", **options):
    """``spark.read.format("qdelay")`` with the given options; ``paths`` a str or a list."""
    reader = spark.read.format("qdelay").option("log", log).option("corrupt", corrupt)
    for k, v in options.items():
        reader = reader.option(k, str(v))
    return reader.load(list(paths) if not isinstance(paths, str) else paths)
