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
  folder into one partition up to this size (default 32 MiB; 0: one partition per segment);
- ``partitions``: spread the pieces over about this many partitions of equal bytes (the
  cores: :func:`read` passes the session's default parallelism) instead of packing them
  up to ``packBytes``; an explicit ``packBytes`` wins;
- ``batchRows``: rows per Arrow batch (default 65536);
- ``payload``: ``false`` leaves ``payload`` and ``headers`` null (they are not built);
- ``pushdown``: ``true`` applies the query's filters in the reader (:class:`Pushed`);
- ``reader``: ``columnar`` (default) or ``python`` (the per-record reference);
- a user schema (``spark.read.schema(...)``) with a subset of the columns builds only those.

The schema is :data:`SCHEMA` (documented in docs/tools.md). Every byte is read through
``qdelay.segments`` (the same walker as ``qdelay inspect``); the reader never writes.
Paths are read on the executors: on a cluster the data folders must be mounted at the
same path on every node (the listing happens on the driver).
"""

from __future__ import annotations

import json
import math
import os
import sys

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from qdelay.segments import framing, naming, reader, records
from qdelay.segments.framing import RecordKind
from qdelay.segments.records import Cancel, Dispatch, Group, Message

SCHEMA = (
    "server string, log string, segment string, offset long, size int, sequence long, "
    "kind string, message_id string, subject string, headers map<string,string>, "
    "payload binary, created_ms long, due_ms long, target_sequence long, dispatched_ms long, "
    "acked_ms long, schedule_offset long, attempt int, outcome string, group string, error string"
)
COLUMNS = [c.strip().split(" ", 1)[0] for c in SCHEMA.split(", ")]
LOGS = ("message", "schedule", "dispatch")
# Segments smaller than this are packed together into one partition up to this size: a
# Spark task of the Python source costs tens of milliseconds besides its reading (about
# 70 ms on 2 busy cores), more than reading a per-minute segment of 3 MB takes (10 ms).
PACK_BYTES = 32 * 1024 * 1024
# With option ``partitions`` (the session helper passes the session's cores) the pieces are
# spread over that many partitions instead, each between these sizes (see balanced()).
MIN_PACK_BYTES = 8 * 1024 * 1024
MAX_PACK_BYTES = 512 * 1024 * 1024
_KINDS = {1: "MESSAGE", 2: "CANCEL", 3: "DISPATCH", 4: "CHECKPOINT", 5: "GROUP"}
_GROUP_OPS = {1: "CREATE", 2: "DELETE"}
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
        "group": s,
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
    def __init__(self, pieces: list[Piece], pushed=None):
        super().__init__(len(pieces))
        self.pieces = pieces
        self.pushed = pushed  # the filters the reader applies (a Pushed), or None


def split_points(path: str, size: int, split_bytes: int) -> list[int]:
    """Record boundaries that cut a segment into ranges of about ``split_bytes``.

    The frame reader walks the file (verified, chunk by chunk); at the first bad frame it
    stops splitting (the rest is one range, whose reader reports the damage)."""
    if size <= split_bytes:
        return [0, size]
    import numpy as np

    from qdelay.tools.inspect import open_buffer

    points = [0]
    with open_buffer(path) as buf:
        end = min(len(buf), size)
        target = split_bytes
        for got in reader.walk_reads(lambda at, n: buf[at : at + n], 0, end):
            if isinstance(got, reader.Damage):
                break
            ends = got.base + np.append(got.starts[1:], got.end)  # where each frame ends
            i = int(np.searchsorted(ends, target))
            while i < len(ends):
                cut = int(ends[i])
                if cut >= end:
                    break
                points.append(cut)
                target = cut + split_bytes
                i = int(np.searchsorted(ends, target))
    points.append(size)
    return points


def bucket_width(keys: list[int], override: int | None = None) -> int:
    """Minutes a schedule or dispatch segment spans: the server's ``scale_minutes`` is not
    written in the folder, but every bucket key is a multiple of it, so the keys' greatest
    common divisor is a safe bound (never narrower than the real width; at most a day, the
    widest scale). ``override`` (option ``bucketMinutes``) for a folder whose scale changed."""
    if override:
        return override
    width = 0
    for k in keys:
        width = math.gcd(width, k)
        if width == 1:
            break
    return min(width or 1440, 1440)


def plan(
    servers: list[str],
    logs,
    split_bytes: int,
    pack_bytes: int,
    pushed=None,
    bucket_minutes: int | None = None,
    partitions: int | None = None,
) -> list[QdelayPartition]:
    """The pieces to read, packed into partitions. With ``pushed`` filters, a whole log is
    left out when it cannot hold the kinds asked for, and a schedule or dispatch segment
    when its bucket (from its file name) lies outside the due-time range: such files are
    never opened.

    Packing: ``pack_bytes`` 0 gives one partition per piece; ``partitions`` (the session's
    cores) spreads the pieces over about that many partitions of equal bytes
    (:func:`balanced`); otherwise consecutive pieces of one folder are packed greedily up
    to ``pack_bytes``."""
    from qdelay.tools.inspect import segment_files

    pieces: list[Piece] = []
    for server in servers:
        if not os.path.isdir(server):
            raise ValueError(f"qdelay source: {server} is not a directory")
        wanted = [log for log in logs if pushed is None or pushed.may_hold(log)]
        files = segment_files(server, wanted)
        widths = {log: bucket_width([sf.key for sf in files if sf.log == log], bucket_minutes) for log in wanted}
        for sf in files:
            if sf.size == 0:
                continue
            if pushed is not None and sf.log != "message":
                lo = sf.key * naming.MS_PER_MINUTE
                if not pushed.may_hold(sf.log, lo, lo + widths[sf.log] * naming.MS_PER_MINUTE):
                    continue
            points = split_points(sf.path, sf.size, split_bytes)
            pieces.extend(Piece(server, sf.log, sf.path, sf.rel, a, b) for a, b in zip(points, points[1:]))
    if not pack_bytes:
        return [QdelayPartition([p]) for p in pieces]
    if partitions:
        return [QdelayPartition(group) for group in balanced(pieces, partitions)]
    parts: list[QdelayPartition] = []
    pack: list[Piece] = []
    packed = 0
    for piece in pieces:
        size = piece.stop - piece.start
        if size >= pack_bytes:
            parts.append(QdelayPartition([piece]))
            continue
        if pack and (packed + size > pack_bytes or pack[-1].server != piece.server):
            parts.append(QdelayPartition(pack))
            pack, packed = [], 0
        pack.append(piece)
        packed += size
    if pack:
        parts.append(QdelayPartition(pack))
    return parts


def balanced(pieces: list[Piece], partitions: int) -> list[list[Piece]]:
    """Consecutive runs of ``pieces`` of about equal bytes: ``partitions`` of them (the
    cores that run them), fewer when they would hold less than :data:`MIN_PACK_BYTES`
    each, more when they would hold over :data:`MAX_PACK_BYTES`. Each Spark task of the
    Python source costs tens of milliseconds besides its reading, so one task per core
    reads fastest; a task reads its pieces one after another (memory stays one piece)."""
    total = sum(p.stop - p.start for p in pieces)
    if not pieces:
        return []
    k = min(partitions, -(-total // MIN_PACK_BYTES))
    k = max(k, -(-total // MAX_PACK_BYTES), 1)
    k = min(k, len(pieces))
    groups: list[list[Piece]] = [[] for _ in range(k)]
    done = 0
    for p in pieces:
        size = p.stop - p.start
        # the piece goes to the partition its middle byte falls in
        groups[min(k - 1, (2 * done + size) * k // (2 * total or 1))].append(p)
        done += size
    return [g for g in groups if g]


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
        "group",
    ),
    # a consumer group created or deleted (message log): outcome holds the op
    "GROUP": ("offset", "size", "sequence", "subject", "group", "created_ms", "outcome"),
    "ERROR": ("offset", "size", "sequence", "kind", "error"),
}
_KIND_CODES = {"MESSAGE": RecordKind.MESSAGE, "CANCEL": RecordKind.CANCEL, "DISPATCH": RecordKind.DISPATCH}
# the record kinds each log holds (inspect.ALLOWED_KINDS): a kind filter skips whole logs
_LOG_KINDS = {"message": {"MESSAGE", "CANCEL", "GROUP"}, "schedule": {"MESSAGE", "CANCEL"}, "dispatch": {"DISPATCH"}}


class Pushed:
    """The filters the reader applies itself (pushed down by Spark, or given by a caller):
    a due-time range, record kinds, subjects (exact or by prefix), logs, and "not null".
    A row passes when every one holds, with SQL's rule that null passes no comparison, so
    the reader's answer is exactly what Spark would have kept. Plain data: it is pickled
    from the planner to every task."""

    __slots__ = ("due_lo", "due_hi", "kinds", "subjects", "prefixes", "logs", "not_null", "sequences")

    def __init__(self) -> None:
        self.due_lo: int | None = None  # inclusive
        self.due_hi: int | None = None  # inclusive
        self.kinds: frozenset | None = None
        self.subjects: frozenset | None = None
        self.prefixes: tuple = ()
        self.logs: frozenset | None = None
        self.not_null: frozenset = frozenset()
        self.sequences: frozenset | None = None  # sequence = n or IN (...)

    def __getstate__(self):
        return tuple(getattr(self, k) for k in self.__slots__)

    def __setstate__(self, state):
        for k, v in zip(self.__slots__, state):
            setattr(self, k, v)

    def __repr__(self) -> str:
        return "Pushed(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__ if getattr(self, k)) + ")"

    @property
    def active(self) -> bool:
        return any(getattr(self, k) for k in self.__slots__ if k not in ("due_lo", "due_hi")) or (
            self.due_lo is not None or self.due_hi is not None
        )

    def columns(self) -> set[str]:
        cols = set(self.not_null)
        if self.due_lo is not None or self.due_hi is not None:
            cols.add("due_ms")
        if self.kinds is not None:
            cols.add("kind")
        if self.subjects is not None or self.prefixes:
            cols.add("subject")
        if self.logs is not None:
            cols.add("log")
        if self.sequences is not None:
            cols.add("sequence")
        return cols

    def add(self, f) -> bool:
        """Take one ``pyspark.sql.datasource`` filter; True when the reader applies it
        exactly (Spark then leaves it out), False to leave it to Spark."""
        from pyspark.sql import datasource as ds

        if len(f.attribute) != 1:
            return False
        col = f.attribute[0]
        if isinstance(f, ds.IsNotNull) and col in ("due_ms", "kind", "subject", "log", "error"):
            self.not_null = self.not_null | {col}
            return True
        if col == "sequence":
            values = f.value if isinstance(f, ds.In) else (f.value,) if isinstance(f, ds.EqualTo) else None
            if values is None or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
                return False
            values = frozenset(values)
            self.sequences = values if self.sequences is None else self.sequences & values
            return True
        if col == "due_ms":
            v = getattr(f, "value", None)
            if not isinstance(v, int) or isinstance(v, bool):
                return False
            lo, hi = {
                ds.GreaterThan: (v + 1, None),
                ds.GreaterThanOrEqual: (v, None),
                ds.LessThan: (None, v - 1),
                ds.LessThanOrEqual: (None, v),
                ds.EqualTo: (v, v),
            }.get(type(f), (False, False))
            if lo is False:
                return False
            self.narrow_due(lo, hi)
            return True
        if col not in ("kind", "subject", "log"):
            return False
        if col == "subject" and isinstance(f, ds.StringStartsWith) and isinstance(f.value, str):
            self.prefixes = self.prefixes + (f.value,)
            return True
        if isinstance(f, ds.EqualTo) and isinstance(f.value, str):
            values = frozenset([f.value])
        elif isinstance(f, ds.In) and all(isinstance(v, str) for v in f.value):
            values = frozenset(f.value)
        else:
            return False
        attr = {"kind": "kinds", "subject": "subjects", "log": "logs"}[col]
        old = getattr(self, attr)
        setattr(self, attr, values if old is None else old & values)
        return True

    def narrow_due(self, lo: int | None, hi: int | None) -> None:
        if lo is not None:
            self.due_lo = lo if self.due_lo is None else max(self.due_lo, lo)
        if hi is not None:
            self.due_hi = hi if self.due_hi is None else min(self.due_hi, hi)

    def may_hold(self, log: str, due_lo: int | None = None, due_hi: int | None = None) -> bool:
        """Whether a segment of ``log`` whose records are due in [due_lo, due_hi) can hold a
        passing row (None: unknown)."""
        if self.logs is not None and log not in self.logs:
            return False
        if self.kinds is not None and not (self.kinds & _LOG_KINDS[log]):
            return False
        if self.due_lo is not None and self.due_hi is not None and self.due_lo > self.due_hi:
            return False
        if due_hi is not None and self.due_lo is not None and due_hi <= self.due_lo:
            return False
        if due_lo is not None and self.due_hi is not None and due_lo > self.due_hi:
            return False
        return True

    def frame_mask(self, kinds, dues, seqs=None):
        """Which whole frames (of the three kinds) can give a passing row: by kind, due
        time and sequence alone, before any body is read. A superset: :meth:`mask` decides
        exactly."""
        import numpy as np

        keep = np.ones(len(kinds), dtype=bool)
        if self.sequences is not None and seqs is not None:
            keep &= np.isin(seqs, np.fromiter(self.sequences, dtype=np.int64, count=len(self.sequences)))
        if self.kinds is not None:
            keep &= np.isin(kinds, [_KIND_CODES[k] for k in self.kinds if k in _KIND_CODES])
        if self.due_lo is not None:
            keep &= dues >= self.due_lo
        if self.due_hi is not None:
            keep &= dues <= self.due_hi
        return keep

    def mask(self, batch):
        """The exact row filter of an Arrow batch (None when every row passes)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        if not self.active:
            return None
        parts = [pc.is_valid(batch.column(c)) for c in sorted(self.not_null)]
        due = batch.column("due_ms") if "due_ms" in batch.schema.names else None
        if self.due_lo is not None:
            parts.append(pc.greater_equal(due, self.due_lo))
        if self.due_hi is not None:
            parts.append(pc.less_equal(due, self.due_hi))
        for col, values in (("kind", self.kinds), ("subject", self.subjects), ("log", self.logs)):
            if values is not None:
                parts.append(pc.is_in(batch.column(col), value_set=pa.array(sorted(values), pa.string())))
        for p in self.prefixes:
            parts.append(pc.starts_with(batch.column("subject"), pattern=p))
        if self.sequences is not None:
            parts.append(pc.is_in(batch.column("sequence"), value_set=pa.array(sorted(self.sequences), pa.int64())))
        m = parts[0]
        for p in parts[1:]:
            m = pc.and_kleene(m, p)
        return pc.fill_null(m, False)


def _read_bytes(piece: Piece) -> bytes | None:
    try:
        with open(piece.path, "rb") as f:
            f.seek(piece.start)
            return f.read(piece.stop - piece.start)
    except FileNotFoundError:  # cleaned by a live server after listing
        return None


def _item_row(item, corrupt: str) -> tuple[str, tuple] | None:
    """The row one walked item gives: (kind of row, values in ``_FILLED[kind]`` order),
    or None (unwritten space, or a bad stretch under ``corrupt=skip``). The per-record
    reference of every row; the columnar reader sends its rare odd frames here too."""
    rec = item.record
    f = item.frame
    size = item.end - item.offset
    if isinstance(rec, Message):
        headers = list(rec.headers.items()) if rec.headers else []
        return "MESSAGE", (
            item.offset,
            size,
            f.sequence,
            rec.message_id,
            rec.subject,
            headers,
            rec.payload,
            f.timestamp,
            rec.deliver_at_ms,
        )
    if item.status == "zero":
        return None
    if isinstance(rec, Dispatch):
        outcome = _OUTCOMES.get(rec.outcome, f"OUTCOME_{rec.outcome}")
        return "DISPATCH", (
            item.offset,
            size,
            f.sequence,
            rec.message_id,
            rec.deliver_at_ms,
            rec.dispatched_at_ms,
            f.timestamp,
            rec.schedule_offset,
            rec.attempt,
            outcome,
            rec.group,
        )
    if isinstance(rec, Group):
        op = _GROUP_OPS.get(rec.op, f"OP_{rec.op}")
        return "GROUP", (item.offset, size, f.sequence, rec.subject, rec.group, f.timestamp, op)
    if isinstance(rec, Cancel):
        return "CANCEL", (
            item.offset,
            size,
            f.sequence,
            rec.message_id,
            f.timestamp,
            rec.deliver_at_ms,
            rec.target_sequence,
        )
    if corrupt == "skip":
        return None
    kind = _KINDS.get(f.kind, f"KIND_{f.kind}") if f is not None else None
    return "ERROR", (
        item.offset,
        size,
        f.sequence if f is not None else None,
        kind,
        item.error or "record of an unexpected kind",
    )


class _Rows:
    """Rows gathered one by one (the reference twin, and the columnar reader's odd frames),
    turned into one Arrow batch per kind."""

    def __init__(self, piece: Piece):
        self.piece = piece
        self.acc = {k: [] for k in _FILLED}

    def add(self, row) -> str | None:
        if row is None:
            return None
        self.acc[row[0]].append(row[1])
        return row[0]

    def __len__(self) -> int:
        return sum(map(len, self.acc.values()))

    def batch(self, kind: str):
        import pyarrow as pa

        rows = self.acc[kind]
        self.acc[kind] = []
        schema = _arrow_schema()
        cols = dict(zip(_FILLED[kind], zip(*rows))) if rows else {}
        n = len(rows)
        arrays = []
        for field in schema:
            name = field.name
            if name in cols:
                arrays.append(pa.array(cols[name], type=field.type))
            elif name in ("server", "log", "segment"):
                arrays.append(pa.repeat(pa.scalar(_constant(self.piece, name), field.type), n))
            elif name == "kind" and kind != "ERROR":  # ERROR rows fill "kind" themselves
                arrays.append(pa.repeat(pa.scalar(kind, field.type), n))
            else:
                arrays.append(pa.nulls(n, type=field.type))
        return pa.RecordBatch.from_arrays(arrays, schema=schema)

    def batches(self):
        for kind in _FILLED:
            if self.acc[kind]:
                yield self.batch(kind)


def _constant(piece: Piece, name: str) -> str:
    return {"server": piece.server, "log": piece.log, "segment": piece.rel}[name]


def _finish(batch, columns, pushed, payload: bool):
    """A full-schema batch filtered by ``pushed`` and cut to ``columns`` (payload and
    headers null when ``payload`` is False); None when no row is left."""
    import pyarrow as pa

    mask = pushed.mask(batch) if pushed is not None else None
    if mask is not None:
        batch = batch.filter(mask)
    n = batch.num_rows
    if not n:
        return None
    schema = _arrow_schema()
    fields = [schema.field(c) for c in columns]
    arrays = [
        batch.column(f.name) if payload or f.name not in ("payload", "headers") else pa.nulls(n, type=f.type)
        for f in fields
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=pa.schema(fields))


def _report_skipped(piece: Piece, skipped: int) -> None:
    if skipped:
        sys.stderr.write(
            f"qdelay source: skipped {skipped} unreadable stretches in {piece.rel} "
            f"[{piece.start}:{piece.stop}] of {piece.server}\n"
        )


def read_piece_py(
    piece: Piece,
    corrupt: str = "row",
    batch_rows: int = 8192,
    payload: bool = True,
    columns=None,
    pushed: Pushed | None = None,
):
    """The reference twin of :func:`read_piece`: the inspection walker (frame checks, then
    a record object per frame through the body codecs), one row at a time. Slow (a few
    hundred thousand records a second); kept to define what the columnar reader must give
    (tests/test_spark.py compares both on clean and damaged folders)."""
    from qdelay.tools.inspect import walk

    columns = list(columns or COLUMNS)
    data = _read_bytes(piece)
    if data is None:
        return
    rows = _Rows(piece)
    skipped = 0
    for item in walk(data, piece.start, decode_bodies=True):
        row = _item_row(item, corrupt)
        if row is None:
            skipped += item.status != "zero"
            continue
        kind = rows.add(row)
        if len(rows.acc[kind]) >= batch_rows:
            out = _finish(rows.batch(kind), columns, pushed, payload)
            if out is not None:
                yield out
    for b in rows.batches():
        out = _finish(b, columns, pushed, payload)
        if out is not None:
            yield out
    _report_skipped(piece, skipped)


# --- the columnar reader ----------------------------------------------------------------------


def _binary(data: bytes, offs, lens):
    """An Arrow binary array of ``data[offs[i] : offs[i] + lens[i]]``, for fields in file
    order that do not overlap (each lies in its own frame): the fields and the gaps between
    them make one offsets array over ``data`` as it is, and Arrow's ``take`` copies every
    other element out. No Python object per field."""
    import numpy as np
    import pyarrow as pa

    n = len(offs)
    if not n:
        return pa.array([], pa.binary())
    big = len(data) >= 2**31
    bounds = np.empty(2 * n + 1, dtype=np.int64 if big else np.int32)
    bounds[0] = 0
    bounds[1::2] = offs
    bounds[2::2] = offs + lens
    whole = pa.Array.from_buffers(
        pa.large_binary() if big else pa.binary(), 2 * n, [None, pa.py_buffer(bounds), pa.py_buffer(data)]
    )
    out = whole.take(pa.array(np.arange(1, 2 * n, 2, dtype=np.int64)))
    return out.cast(pa.binary()) if big else out


def _text(arr):
    """(string array, per-row validity as numpy bool or None when all valid) of a binary
    array: Arrow checks UTF-8 for the whole array at C speed; only when that fails are the
    rows looked at one by one to find the bad ones (damage, or a writer's bug)."""
    import numpy as np
    import pyarrow as pa

    try:
        return arr.cast(pa.string()), None
    except pa.ArrowInvalid:
        ok = []
        for v in arr.to_pylist():
            try:
                v.decode()
                ok.append(True)
            except UnicodeDecodeError:
                ok.append(False)
        return None, np.array(ok, dtype=bool)


def _header_walk(data: bytes, hs, he):
    """Walk the header blocks [hs, he) of many messages at once, one entry of every block
    per step (numpy): (well-formed per block, entries as (block, key start, key length,
    value start, value length) in block then file order). The layout is
    records.decode_headers': key_len u16, key, value_len u16, value, repeated to the end."""
    import numpy as np

    n = len(hs)
    ok = np.ones(n, dtype=bool)
    pos = np.array(hs, dtype=np.int64)
    he = np.asarray(he, dtype=np.int64)
    active = pos < he
    parts = []
    while active.any():
        a = np.nonzero(active)[0]
        p, e = pos[a], he[a]
        fits = p + 2 <= e
        kl = np.zeros(len(a), dtype=np.int64)
        kl[fits] = reader.gather(data, p[fits], 0, 2)
        ks = p + 2
        fits &= ks + kl + 2 <= e
        vl = np.zeros(len(a), dtype=np.int64)
        vl[fits] = reader.gather(data, (ks + kl)[fits], 0, 2)
        vs = ks + kl + 2
        fits &= vs + vl <= e
        ok[a[~fits]] = False
        active[a[~fits]] = False
        a, ks, kl, vs, vl = a[fits], ks[fits], kl[fits], vs[fits], vl[fits]
        parts.append((a, ks, kl, vs, vl))
        pos[a] = vs + vl
        active[a] = pos[a] < he[a]
    if not parts:
        empty = np.empty(0, dtype=np.int64)
        return ok, (empty, empty, empty, empty, empty)
    cat = [np.concatenate(x) for x in zip(*parts)]
    order = np.argsort(cat[0], kind="stable")  # steps are in file order within a block
    return ok, tuple(x[order] for x in cat)


def _message_columns(data: bytes, st, need: set):
    """MESSAGE columns of the frames at ``st`` (whole, verified frames), or the rows that
    need the per-record path: (columns dict, suspect mask over ``st``)."""
    import numpy as np
    import pyarrow as pa

    g = reader.gather
    n = len(st)
    suspect = np.zeros(n, dtype=bool)
    length = g(data, st, framing.LENGTH_AT, 4)
    suspect |= length < records.MESSAGE_FIXED.size
    body = st + framing.HEADER_SIZE
    while True:  # another pass only when one found bad rows (each pass drops at least one)
        sel = np.nonzero(~suspect)[0]
        b = body[sel]
        slen, mlen, hlen, plen = (
            g(data, b, records.MESSAGE_SUBJECT_LEN_AT, 2),
            g(data, b, records.MESSAGE_ID_LEN_AT, 2),
            g(data, b, records.MESSAGE_HEADERS_LEN_AT, 4),
            g(data, b, records.MESSAGE_PAYLOAD_LEN_AT, 4),
        )
        fits = records.MESSAGE_FIXED.size + slen + mlen + hlen + plen == length[sel]
        if not fits.all():
            suspect[sel[~fits]] = True
            continue
        s_at = b + records.MESSAGE_FIXED.size
        subject, bad_s = _text(_binary(data, s_at, slen))
        mid, bad_m = _text(_binary(data, s_at + slen, mlen))
        h_at = s_at + slen + mlen
        has_h = np.nonzero(hlen > 0)[0]
        h_ok, (e_row, ks, kl, vs, vl) = _header_walk(data, h_at[has_h], h_at[has_h] + hlen[has_h])
        bad = np.zeros(len(sel), dtype=bool)
        for v in (bad_s, bad_m):
            if v is not None:
                bad |= ~v
        bad[has_h[~h_ok]] = True
        keys = values = None
        if "headers" in need and len(e_row):
            keys, bad_k = _text(_binary(data, ks, kl))
            values, bad_v = _text(_binary(data, vs, vl))
            rows = has_h[e_row]
            for v in (bad_k, bad_v):
                if v is not None:
                    bad[rows[~v]] = True
            if not bad.any():  # a repeated key: a dict keeps the first place, the last value
                counts = np.bincount(e_row, minlength=len(has_h))
                if (counts > 1).any():
                    t = pa.table({"r": pa.array(rows), "k": keys})
                    dup = t.group_by(["r", "k"]).aggregate([("k", "count")])
                    dup = dup.filter(pa.compute.greater(dup.column("k_count"), 1))
                    bad[dup.column("r").to_numpy()] = True
        elif len(e_row):
            for arr in (_binary(data, ks, kl), _binary(data, vs, vl)):
                _t, v = _text(arr)
                if v is not None:
                    bad[has_h[e_row][~v]] = True
        if bad.any():
            suspect[sel[bad]] = True
            continue
        out = {
            "size": (length[sel] + framing.HEADER_SIZE).astype(np.int32),
            "message_id": mid,
            "subject": subject,
        }
        if "payload" in need:
            out["payload"] = _binary(data, h_at + hlen, plen)
        if "headers" in need:
            counts = np.bincount(e_row, minlength=len(has_h)) if len(has_h) else np.empty(0, dtype=np.int64)
            per_row = np.zeros(len(sel), dtype=np.int64)
            per_row[has_h] = counts
            offsets = np.zeros(len(sel) + 1, dtype=np.int32)
            np.cumsum(per_row, out=offsets[1:])
            if keys is None:
                keys = values = pa.array([], pa.string())
            out["headers"] = pa.MapArray.from_arrays(pa.array(offsets), keys, values)
        if "created_ms" in need:
            out["created_ms"] = g(data, st[sel], framing.TIMESTAMP_AT, 8)
        return sel, out, suspect


def _tail_columns(kind: int, data: bytes, st, need: set):
    """CANCEL or DISPATCH columns (message id last in the body), like _message_columns."""
    import numpy as np

    g = reader.gather
    fixed = records.CANCEL_FIXED.size if kind == RecordKind.CANCEL else records.DISPATCH_FIXED.size
    length = g(data, st, framing.LENGTH_AT, 4)
    suspect = length < fixed
    body = st + framing.HEADER_SIZE
    while True:  # as in _message_columns
        sel = np.nonzero(~suspect)[0]
        b = body[sel]
        mlen = g(data, b, fixed - 2, 2)
        # a DISPATCH names its consumer group after the id (0: the default group)
        glen = (
            g(data, b, records.DISPATCH_GROUP_LEN_AT, 1)
            if kind == RecordKind.DISPATCH
            else np.zeros(len(sel), dtype=np.int64)
        )
        fits = fixed + mlen + glen == length[sel]
        if not fits.all():
            suspect[sel[~fits]] = True
            continue
        mid, ok = _text(_binary(data, b + fixed, mlen))
        if ok is not None:
            suspect[sel[~ok]] = True
            continue
        group = None
        if kind == RecordKind.DISPATCH:
            group, ok = _text(_binary(data, b + fixed + mlen, glen))
            if ok is not None:
                suspect[sel[~ok]] = True
                continue
        ts = g(data, st[sel], framing.TIMESTAMP_AT, 8) if {"created_ms", "acked_ms"} & need else None
        out = {"size": (length[sel] + framing.HEADER_SIZE).astype(np.int32), "message_id": mid}
        if kind == RecordKind.CANCEL:
            out["created_ms"] = ts
            if "target_sequence" in need:
                out["target_sequence"] = g(data, b, records.CANCEL_TARGET_SEQUENCE_AT, 8)
        else:
            out["acked_ms"] = ts
            if "dispatched_ms" in need:
                out["dispatched_ms"] = g(data, b, records.DISPATCH_DISPATCHED_AT, 8)
            if "schedule_offset" in need:
                out["schedule_offset"] = g(data, b, records.DISPATCH_SCHEDULE_OFFSET_AT, 8)
            if "attempt" in need:
                out["attempt"] = g(data, b, records.DISPATCH_ATTEMPT_AT, 4).astype(np.int32)
            if "group" in need:
                import pyarrow as pa
                import pyarrow.compute as pc

                out["group"] = pc.if_else(pa.array(glen == 0), records.DEFAULT_GROUP, group)
            if "outcome" in need:
                import pyarrow as pa

                codes = g(data, b, records.DISPATCH_OUTCOME_AT, 1)
                distinct, where = np.unique(codes, return_inverse=True)
                names = [_OUTCOMES.get(int(c), f"OUTCOME_{int(c)}") for c in distinct]
                out["outcome"] = pa.array(names, pa.string()).take(pa.array(where.reshape(-1)))
        return sel, out, suspect


def read_piece(
    piece: Piece,
    corrupt: str = "row",
    batch_rows: int = 65536,
    payload: bool = True,
    columns=None,
    pushed: Pushed | None = None,
):
    """Yield Arrow record batches of ``columns`` (default :data:`COLUMNS`) for one piece,
    built column-wise from the segment's bytes.

    The native codec walks the frames (``reader.scan_columns``: offsets, kinds, sequences,
    due times; checksums verified), fixed-width fields are gathered at their offsets
    (``reader.gather``), strings and payloads become Arrow arrays cut straight from the
    bytes (:func:`_binary`); only the columns asked for (and those ``pushed`` filters
    read) are built, and frames whose kind or due time cannot pass ``pushed`` are dropped
    before any body is read. A frame that fails a vectorised body check (or of a kind
    other than the three) goes through the per-record path of the reference twin
    :func:`read_piece_py`, which decides its row (a bad-body error, usually), and so do the
    bad stretches between frames (:func:`inspect.bad_stretch`). Same rows as the twin;
    a batch holds one kind; within a kind, rows keep file order."""
    import numpy as np
    import pyarrow as pa

    from qdelay.tools import inspect

    columns = list(columns or COLUMNS)
    data = _read_bytes(piece)
    if data is None:
        return
    need = set(columns) | (pushed.columns() if pushed is not None else set())
    if not payload:
        need -= {"payload", "headers"}
    runs, stretches = [], []
    pos, size = 0, len(data)
    view = memoryview(data)
    while pos < size:
        c = reader.scan_columns(view[pos:] if pos else data)
        if len(c):
            runs.append((c.starts + pos, c.kinds, c.seqs, c.dues))
        pos += c.end
        if pos >= size:
            break
        item = inspect.bad_stretch(data, pos, piece.start)
        if item.status == inspect.ZERO:
            break
        stretches.append(item)
        if item.status != inspect.CORRUPT:
            break
        pos = item.end - piece.start
    del view
    if runs:
        starts, kinds, seqs, dues = (np.concatenate(x) for x in zip(*runs))
    else:
        starts = seqs = dues = np.empty(0, dtype=np.int64)
        kinds = np.empty(0, dtype=np.uint8)
    schema = _arrow_schema()
    odd = np.nonzero((kinds < RecordKind.MESSAGE) | (kinds > RecordKind.DISPATCH))[0].tolist()
    keep = pushed.frame_mask(kinds, dues, seqs) if pushed is not None else np.ones(len(kinds), dtype=bool)
    for code, name in (
        (RecordKind.MESSAGE, "MESSAGE"),
        (RecordKind.CANCEL, "CANCEL"),
        (RecordKind.DISPATCH, "DISPATCH"),
    ):
        idx = np.nonzero((kinds == code) & keep)[0]
        for at in range(0, len(idx), batch_rows):
            rows = idx[at : at + batch_rows]
            st = starts[rows]
            if code == RecordKind.MESSAGE:
                sel, cols, suspect = _message_columns(data, st, need)
            else:
                sel, cols, suspect = _tail_columns(code, data, st, need)
            odd.extend(rows[suspect].tolist())
            n = len(sel)
            if not n:
                continue
            picked = rows[sel]
            cols["offset"] = starts[picked] + piece.start
            cols["sequence"] = seqs[picked]
            cols["due_ms"] = dues[picked]
            arrays = []
            for field in schema:
                name_ = field.name
                if name_ not in need or (name_ not in cols and name_ not in ("server", "log", "segment", "kind")):
                    arrays.append(pa.nulls(n, type=field.type))
                elif name_ in cols:
                    v = cols[name_]
                    arrays.append(v if isinstance(v, pa.Array) else pa.array(v, type=field.type))
                elif name_ == "kind":
                    arrays.append(pa.repeat(pa.scalar(name, field.type), n))
                else:
                    arrays.append(pa.repeat(pa.scalar(_constant(piece, name_), field.type), n))
            out = _finish(pa.RecordBatch.from_arrays(arrays, schema=schema), columns, pushed, payload)
            if out is not None:
                yield out
    # the per-record path: frames of other kinds or odd bodies, and the bad stretches
    slow = _Rows(piece)
    skipped = 0
    for i in sorted(odd):
        at = int(starts[i])
        frame = reader.frame_at(data, at, piece.start)
        record, why = inspect.decode(frame)
        item = inspect.Item(
            inspect.OK if why is None else inspect.BAD_BODY, frame.offset, frame.offset + frame.size, frame, record, why
        )
        row = _item_row(item, corrupt)
        skipped += row is None
        slow.add(row)
    for item in stretches:
        row = _item_row(item, corrupt)
        skipped += row is None
        slow.add(row)
    for b in slow.batches():
        out = _finish(b, columns, pushed, payload)
        if out is not None:
            yield out
    _report_skipped(piece, skipped)


_FROZEN = False


def _freeze_imports() -> None:
    """Once per Python worker: move every object alive now (the modules of pyspark,
    pyarrow, numpy and qdelay, by the first task) out of the cyclic garbage collector's
    reach. PySpark's worker runs a full ``gc.collect()`` after every task (pyspark/daemon.py),
    which walked all of them: 40-130 ms per task on this project's 2-core box, a third
    of the worker's CPU for a one-column count. Garbage made by the tasks is still
    collected; objects alive now are freed by reference counting as before."""
    global _FROZEN
    if not _FROZEN:
        import gc

        gc.freeze()
        _FROZEN = True


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
        columns: list[str] | None = None,
        engine: str = "columnar",
        bucket_minutes: int | None = None,
        partitions: int | None = None,
    ):
        self.payload = payload
        self.spread = partitions  # not "partitions": that is the method Spark calls
        self.servers = servers
        self.logs = logs
        self.corrupt = corrupt
        self.split_bytes = split_bytes
        self.pack_bytes = pack_bytes
        self.batch_rows = batch_rows
        self.columns = columns or list(COLUMNS)
        self.engine = engine
        self.bucket_minutes = bucket_minutes
        self.pushed = Pushed()

    def partitions(self):
        pushed = self.pushed if self.pushed.active else None
        parts = plan(
            self.servers, self.logs, self.split_bytes, self.pack_bytes, pushed, self.bucket_minutes, self.spread
        )
        # Spark wants at least one partition; an empty one reads nothing
        parts = parts or [QdelayPartition([])]
        # the filters travel with the partitions, not with the reader: Spark (4.1-4.3) may
        # run an unfiltered query of the same DataFrame with the read function of a reader
        # that took a later query's filters, but its partitions are always its own
        for part in parts:
            part.pushed = pushed
        return parts

    def read(self, partition):
        _freeze_imports()
        fn = read_piece if self.engine == "columnar" else read_piece_py
        pushed = getattr(partition, "pushed", None)
        for piece in partition.pieces:
            yield from fn(piece, self.corrupt, self.batch_rows, self.payload, self.columns, pushed)


class QdelayFilteringReader(QdelayReader):
    """The reader with filter pushdown (option ``pushdown=true``; the jobs and
    :func:`read` use it). Apart because Spark 4.1-4.3 keeps the read plan of a pushed-down
    query on the DataFrame's source: a later query of that same DataFrame without a
    pushable filter reads with it and gets the filtered rows (fixed upstream by scoping
    the plan to the scan). Fresh ``load()`` per query, as the jobs do, is safe."""

    def pushFilters(self, filters):
        """Due-time ranges, kinds, subjects (exact, IN, prefix), logs and IS NOT NULL on
        them are applied by the reader (whole segments skipped by name where the due range
        or kind allows); every other filter is left to Spark."""
        self.pushed = Pushed()
        for f in filters:
            if not self.pushed.add(f):
                yield f


def _columns_of(schema) -> list[str] | None:
    """The columns a user's schema (``spark.read.schema(...)``) picks: a subset of
    :data:`SCHEMA` with its types, in any order; only those are built (column pruning).
    Runs in Spark's planner worker, which has no session: types compare by their text."""
    if schema is None:
        return None
    full = {name: {"long": "bigint"}.get(t, t) for name, t in (c.split(" ", 1) for c in SCHEMA.split(", "))}
    names = []
    for f in getattr(schema, "fields", []):
        if f.name not in full:
            raise ValueError(f"qdelay source: no column {f.name!r} (columns: {', '.join(COLUMNS)})")
        if f.dataType.simpleString() != full[f.name]:
            raise ValueError(f"qdelay source: column {f.name} is {full[f.name]}, not {f.dataType.simpleString()}")
        names.append(f.name)
    return None if names == COLUMNS else names


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
        engine = (opts.get("reader") or "columnar").lower()
        if engine not in ("columnar", "python"):
            raise ValueError(f"qdelay source: option reader={engine!r}: use columnar or python")
        pushdown = (opts.get("pushdown") or "false").lower() in ("true", "1", "yes")
        return (QdelayFilteringReader if pushdown else QdelayReader)(
            parse_paths(opts),
            parse_logs(opts.get("log")),
            corrupt,
            int(opts.get("splitbytes") or 64 * 1024 * 1024),
            int(opts["packbytes"]) if opts.get("packbytes") is not None else PACK_BYTES,
            int(opts.get("batchrows") or 65536),
            (opts.get("payload") or "true").lower() not in ("false", "0", "no"),
            _columns_of(schema),
            engine,
            int(opts.get("bucketminutes") or 0) or None,
            # an explicit packBytes wins over the spread over the cores
            int(opts.get("partitions") or 0) or None if opts.get("packbytes") is None else None,
        )


def register(spark) -> None:
    """Register the source, with Python filter pushdown on (Spark refuses a source that
    pushes filters while it is off)."""
    spark.conf.set("spark.sql.python.filterPushdown.enabled", "true")
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


def _cores(spark) -> int | None:
    """The session's default parallelism (its cores), or None where it cannot be asked
    (Spark Connect has no SparkContext)."""
    try:
        return int(spark.sparkContext.defaultParallelism)
    except Exception:
        return None


def read(spark, paths, log: str = "all", corrupt: str = "row", columns=None, pushdown: bool = False, **options):
    """``spark.read.format("qdelay")`` with the given options; ``paths`` a str or a list;
    ``columns`` (names of :data:`COLUMNS`) builds only those columns; ``pushdown`` lets
    the reader apply the query's filters (see :class:`QdelayFilteringReader`: then run one
    query per DataFrame). Unless ``packBytes`` or ``partitions`` is given, the pieces are
    spread over one partition per core of the session (option ``partitions``)."""
    reader = spark.read.format("qdelay").option("log", log).option("corrupt", corrupt)
    if "packBytes" not in options and "partitions" not in options:
        cores = _cores(spark)
        if cores:
            reader = reader.option("partitions", str(cores))
    if pushdown:
        reader = reader.option("pushdown", "true")
    if columns is not None:
        types = dict(c.split(" ", 1) for c in SCHEMA.split(", "))
        reader = reader.schema(", ".join(f"{c} {types[c]}" for c in columns))
    for k, v in options.items():
        reader = reader.option(k, str(v))
    return reader.load(list(paths) if not isinstance(paths, str) else paths)
