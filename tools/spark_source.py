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
- ``batchRows``: rows per Arrow batch (default 8192).

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

from qdelay.segments import framing
from qdelay.segments.framing import FrameError
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
    types = {"server": s, "log": s, "segment": s, "offset": i64, "size": i32, "sequence": i64,
             "kind": s, "message_id": s, "subject": s, "headers": pa.map_(s, s), "payload": b,
             "created_ms": i64, "due_ms": i64, "target_sequence": i64, "dispatched_ms": i64,
             "acked_ms": i64, "schedule_offset": i64, "attempt": i32, "outcome": s, "error": s}
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
        raise ValueError(f"qdelay source: option log={text!r}: use message, schedule, dispatch, "
                         f"a comma list of them, or all")
    return logs


class Piece:
    """A byte range [start, stop) of one segment, starting on a record boundary."""

    __slots__ = ("server", "log", "path", "rel", "start", "stop")

    def __init__(self, server, log, path, rel, start, stop):
        self.server, self.log, self.path, self.rel, self.start, self.stop = \
            server, log, path, rel, start, stop

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


def read_piece(piece: Piece, corrupt: str, batch_rows: int):
    """Yield Arrow record batches (of the columns in :data:`COLUMNS`) for one piece."""
    import pyarrow as pa

    from qdelay.tools.inspect import walk

    schema = _arrow_schema()
    try:
        with open(piece.path, "rb") as f:
            f.seek(piece.start)
            buf = f.read(piece.stop - piece.start)
    except FileNotFoundError:  # cleaned by a live server after listing
        return
    cols: dict[str, list] = {c: [] for c in COLUMNS}
    skipped = 0

    def flush():
        batch = pa.RecordBatch.from_arrays([pa.array(cols[c], type=schema.field(c).type)
                                            for c in COLUMNS], schema=schema)
        for c in COLUMNS:
            cols[c] = []
        return batch

    c_server, c_log, c_seg, c_off, c_size, c_seq, c_kind, c_mid, c_subj, c_head, c_pay, \
        c_created, c_due, c_target, c_disp, c_acked, c_soff, c_att, c_out, c_err = \
        (cols[c] for c in COLUMNS)
    n = 0
    for item in walk(buf, piece.start):
        if item.status == "zero":
            continue
        rec = item.record
        if rec is None and corrupt == "skip":
            skipped += 1
            continue
        if n >= batch_rows:
            yield flush()
            c_server, c_log, c_seg, c_off, c_size, c_seq, c_kind, c_mid, c_subj, c_head, c_pay, \
                c_created, c_due, c_target, c_disp, c_acked, c_soff, c_att, c_out, c_err = \
                (cols[c] for c in COLUMNS)
            n = 0
        n += 1
        c_server.append(piece.server)
        c_log.append(piece.log)
        c_seg.append(piece.rel)
        c_off.append(item.offset)
        c_size.append(item.end - item.offset)
        f = item.frame
        if isinstance(rec, Message):
            c_seq.append(f.sequence); c_kind.append("MESSAGE"); c_mid.append(rec.message_id)
            c_subj.append(rec.subject); c_head.append(list(rec.headers.items()))
            c_pay.append(rec.payload); c_created.append(f.timestamp); c_due.append(rec.deliver_at_ms)
            c_target.append(None); c_disp.append(None); c_acked.append(None); c_soff.append(None)
            c_att.append(None); c_out.append(None); c_err.append(None)
        elif isinstance(rec, Dispatch):
            c_seq.append(f.sequence); c_kind.append("DISPATCH"); c_mid.append(rec.message_id)
            c_subj.append(None); c_head.append(None); c_pay.append(None); c_created.append(None)
            c_due.append(rec.deliver_at_ms); c_target.append(None)
            c_disp.append(rec.dispatched_at_ms); c_acked.append(f.timestamp)
            c_soff.append(rec.schedule_offset); c_att.append(rec.attempt)
            c_out.append(_OUTCOMES.get(rec.outcome, f"OUTCOME_{rec.outcome}")); c_err.append(None)
        elif isinstance(rec, Cancel):
            c_seq.append(f.sequence); c_kind.append("CANCEL"); c_mid.append(rec.message_id)
            c_subj.append(None); c_head.append(None); c_pay.append(None)
            c_created.append(f.timestamp); c_due.append(rec.deliver_at_ms)
            c_target.append(rec.target_sequence); c_disp.append(None); c_acked.append(None)
            c_soff.append(None); c_att.append(None); c_out.append(None); c_err.append(None)
        else:  # an error row: only where and why
            c_seq.append(f.sequence if f is not None else None)
            c_kind.append(_KINDS.get(f.kind, f"KIND_{f.kind}") if f is not None else None)
            for c in (c_mid, c_subj, c_head, c_pay, c_created, c_due, c_target, c_disp, c_acked,
                      c_soff, c_att, c_out):
                c.append(None)
            c_err.append(item.error or "record of an unexpected kind")
    if n:
        yield flush()
    if skipped:
        sys.stderr.write(f"qdelay source: skipped {skipped} unreadable stretches in {piece.rel} "
                         f"[{piece.start}:{piece.stop}] of {piece.server}\n")


class QdelayReader(DataSourceReader):
    def __init__(self, servers: list[str], logs, corrupt: str, split_bytes: int, pack_bytes: int,
                 batch_rows: int):
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
            yield from read_piece(piece, self.corrupt, self.batch_rows)


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
        return QdelayReader(parse_paths(opts), parse_logs(opts.get("log")), corrupt,
                            int(opts.get("splitbytes") or 64 * 1024 * 1024),
                            int(opts.get("packbytes") or 0),
                            int(opts.get("batchrows") or 8192))


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

    builder = SparkSession.builder.appName(app_name) \
        .config("spark.ui.enabled", "false") \
        .config("spark.ui.showConsoleProgress", "false") \
        .config("spark.sql.session.timeZone", "UTC")
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
