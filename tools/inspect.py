"""``qdelay inspect``: read-only inspection of a data folder (ls, dump, verify, find, stats).

Read-only and safe on a live server's folder and on a corrupt one: files are opened for
reading only, nothing is repaired (``segments.segment.recover`` is never called), and a
bad record is reported by file and offset, never raised. Every read goes through the one
codec of ``qdelay.segments`` (``framing.check_at`` / ``find_next_frame``, ``records``).

This module also holds the folder walker the Spark source shares (:func:`segment_files`,
:func:`walk`), so the command line and Spark see the same records and the same errors.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime as _dt
import json
import mmap
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

from qdelay.segments import checkpoint, naming, reader, records
from qdelay.segments.framing import Frame, FrameError, RecordKind
from qdelay.segments.records import Cancel, Dispatch, Message, Outcome
from qdelay.tools.progress import Progress
from qdelay.units import counted

LOGS = ("message", "schedule", "dispatch")
_LOG_DIRS = {"message": naming.MESSAGE_DIR, "schedule": naming.SCHEDULE_DIR, "dispatch": naming.DISPATCH_DIR}
_SUFFIX = {"schedule": naming.SCHEDULE_SUFFIX, "dispatch": naming.DISPATCH_SUFFIX}
# the record kinds each log may hold
ALLOWED_KINDS = {
    "message": {RecordKind.MESSAGE, RecordKind.CANCEL, RecordKind.GROUP},
    "schedule": {RecordKind.MESSAGE, RecordKind.CANCEL},
    "dispatch": {RecordKind.DISPATCH},
}
CHECKPOINT_NAME = "iterate" + naming.CHECKPOINT_SUFFIX

OK, BAD_BODY = "ok", "bad-body"
CORRUPT, TORN, ZERO = reader.CORRUPT, reader.TORN, reader.ZERO  # the frame reader's words


# --- the folder walker (shared with the Spark source) --------------------------------------


@dataclass(frozen=True, slots=True)
class SegmentFile:
    log: str  # message | schedule | dispatch
    path: str  # absolute path
    rel: str  # path relative to the data folder, "/"-separated
    key: int  # base offset (message log) or bucket minute (schedule, dispatch)
    size: int  # bytes when listed (a live segment may have grown since)


def segment_files(data_dir: str, logs=LOGS) -> list[SegmentFile]:
    """Every segment of the given logs, message log by base offset, others by bucket."""
    out = []
    for log in logs:
        directory = os.path.join(data_dir, _LOG_DIRS[log])
        if log == "message":
            listed = naming.list_wal(directory)
        else:
            listed = naming.list_buckets(directory, _SUFFIX[log])
        for key, path in listed:
            try:
                size = os.path.getsize(path)
            except FileNotFoundError:  # cleaned while we listed (live server)
                continue
            rel = os.path.relpath(path, data_dir).replace(os.sep, "/")
            out.append(SegmentFile(log, os.path.abspath(path), rel, key, size))
    return out


@dataclass(slots=True)
class Item:
    """One record, or one stretch of bytes that is not a valid record."""

    status: str  # ok | bad-body | corrupt | torn | zero
    offset: int  # in the file
    end: int  # offset just after it
    frame: Frame | None = None
    record: object = None  # Message | Cancel | Dispatch once decoded
    error: str | None = None

    @property
    def is_error(self) -> bool:
        return self.status in (BAD_BODY, CORRUPT, TORN)


def decode(frame: Frame) -> tuple[object, str | None]:
    """Decode a frame's body with the record codecs; (record, None) or (None, why)."""
    try:
        return records.decode_body(frame.kind, frame.body), None
    except Exception as err:  # a body that passed its checksum but does not decode
        return None, f"undecodable {_kind_name(frame.kind)} body: {err}"


def walk(buf, file_offset: int = 0, decode_bodies: bool = True, start: int = 0) -> Iterator[Item]:
    """Every record of ``buf`` (a segment's bytes, or a range starting on a record boundary
    at ``file_offset``) from ``start`` of ``buf`` (a record boundary), and every bad
    stretch: corrupt (a valid record follows: reading resumes there), torn (bad bytes up to
    the end), or zero (unwritten space at the end). The walk is the frame reader's
    (:func:`qdelay.segments.reader.walk`)."""
    for got in reader.walk(buf, file_offset, start):
        if isinstance(got, reader.Damage):
            yield _damage_item(got)
            continue
        end = got.offset + got.size
        if decode_bodies:
            record, why = decode(got)
            if why is not None:
                yield Item(BAD_BODY, got.offset, end, got, None, why)
            else:
                yield Item(OK, got.offset, end, got, record)
        else:
            yield Item(OK, got.offset, end, got)


def bad_stretch(buf, pos: int, file_offset: int = 0, err: FrameError | None = None) -> Item:
    """The stretch of ``buf`` from ``pos``, where no valid frame starts: ZERO (unwritten
    space up to the end), TORN (bad bytes up to the end) or CORRUPT (a valid frame follows;
    the item ends there). Shared by :func:`walk` and the Spark source's columnar reader, so
    both name the same stretches with the same words (the reader's :func:`damage_at`)."""
    return _damage_item(reader.damage_at(buf, pos, err, file_offset))


def _damage_item(d: reader.Damage) -> Item:
    if d.status == ZERO:
        return Item(ZERO, d.offset, d.end)
    if d.status == TORN:
        return Item(TORN, d.offset, d.end, error=f"torn tail: {d.reason} ({d.end - d.offset} bytes to the end)")
    return Item(
        CORRUPT, d.offset, d.end, error=f"{d.reason} ({d.end - d.offset} bytes skipped to the next valid record)"
    )


@contextlib.contextmanager
def open_buffer(path: str):
    """The file's bytes, memory-mapped read-only (b"" for an empty or vanished file)."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        yield b""
        return
    with f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            yield b""
            return
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
        try:
            yield mm
        finally:
            try:
                mm.close()
            except BufferError:  # a slice still references it: let the GC close it
                pass


def walk_file(sf: SegmentFile, progress: Progress | None = None, decode_bodies: bool = True) -> Iterator[Item]:
    with open_buffer(sf.path) as buf:
        done = 0
        for item in walk(buf, 0, decode_bodies):
            if progress is not None and item.end - done >= 1 << 20:
                progress.advance(item.end - done)
                done = item.end
            yield item
        if progress is not None:
            progress.advance(max(sf.size - done, 0))


def read_checkpoint(data_dir: str) -> tuple[dict | None, str | None]:
    """(state, None), (None, None) when absent, or (None, error) when unreadable."""
    path = os.path.join(data_dir, naming.CHECKPOINT_DIR, CHECKPOINT_NAME)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None, None
    try:
        return checkpoint.decode(data), None
    except (FrameError, ValueError) as err:
        return None, f"{getattr(err, 'offset', 0)}: {err}"


# --- formatting helpers --------------------------------------------------------------------


def iso(ms: int | None) -> str:
    if ms is None:
        return "-"
    t = _dt.datetime.fromtimestamp(ms / 1000, tz=_dt.UTC)
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{ms % 1000:03d}Z"


def _kind_name(kind: int) -> str:
    try:
        return RecordKind(kind).name
    except ValueError:
        return f"KIND_{kind}"


def outcome_name(outcome: int) -> str:
    try:
        return Outcome(outcome).name
    except ValueError:
        return f"OUTCOME_{outcome}"


def payload_text(payload: bytes) -> tuple[str, str]:
    """(text, encoding): UTF-8 when it decodes and prints, else base64."""
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and all(c.isprintable() or c in "\t\n\r" for c in text):
        return text, "utf-8"
    return base64.b64encode(payload).decode("ascii"), "base64"


def record_fields(item: Item) -> dict:
    """The record's fields, named like the Spark source's columns."""
    f = item.frame
    out: dict = {"offset": item.offset, "size": item.end - item.offset}
    if f is None:
        out.update(kind=None, error=item.error)
        return out
    out.update(sequence=f.sequence, kind=_kind_name(f.kind))
    rec = item.record
    if isinstance(rec, Message):
        text, enc = payload_text(rec.payload)
        out.update(
            message_id=rec.message_id,
            subject=rec.subject,
            headers=rec.headers,
            payload=text,
            payload_encoding=enc,
            payload_bytes=len(rec.payload),
            created_ms=f.timestamp,
            due_ms=rec.deliver_at_ms,
        )
    elif isinstance(rec, Cancel):
        out.update(
            message_id=rec.message_id,
            target_sequence=rec.target_sequence,
            created_ms=f.timestamp,
            due_ms=rec.deliver_at_ms,
        )
    elif isinstance(rec, Dispatch):
        out.update(
            message_id=rec.message_id,
            due_ms=rec.deliver_at_ms,
            dispatched_ms=rec.dispatched_at_ms,
            acked_ms=f.timestamp,
            schedule_offset=rec.schedule_offset,
            attempt=rec.attempt,
            outcome=outcome_name(rec.outcome),
            group=rec.group,
        )
    elif isinstance(rec, records.Group):
        out.update(op=records.GroupOp(rec.op).name, subject=rec.subject, group=rec.group, created_ms=f.timestamp)
    else:
        out.update(timestamp_ms=f.timestamp)
    if item.error:
        out["error"] = item.error
    return out


def _emit_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, sort_keys=False, separators=(", ", ": ")) + "\n")


def _table(rows: list[list[str]], header: list[str], right: set[int] = frozenset()) -> None:
    widths = [len(h) for h in header]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def fmt(row):
        cells = [(c.rjust(widths[i]) if i in right else c.ljust(widths[i])) for i, c in enumerate(row)]
        return "  ".join(cells).rstrip()

    sys.stdout.write(fmt(header) + "\n")
    for row in rows:
        sys.stdout.write(fmt(row) + "\n")


def _progress(files: list[SegmentFile], label: str) -> Progress:
    return Progress(sum(f.size for f in files), label)


def _diverged_file(data_dir: str, path: str) -> SegmentFile | None:
    """A ``diverged/<from>-<to>.wal`` file of the folder (docs/operations.md 4.3: the tail a
    re-attached master cut, to inspect and re-send from): message-log bytes from offset
    <from>. It is no segment of the live log, so only read when named."""
    folder = os.path.abspath(os.path.join(data_dir, naming.DIVERGED_DIR))
    span = naming.parse_diverged_name(os.path.basename(path))
    if span is None or os.path.dirname(path) != folder or not os.path.isfile(path):
        return None
    rel = os.path.relpath(path, data_dir).replace(os.sep, "/")
    return SegmentFile("message", path, rel, span[0], os.path.getsize(path))


def _select(data_dir: str, args) -> list[SegmentFile]:
    """The segments named on the command line (paths or data-folder-relative), else all of
    ``--log``'s."""
    logs = LOGS if getattr(args, "log", "all") in (None, "all") else (args.log,)
    files = segment_files(data_dir, logs)
    wanted = getattr(args, "segments", None)
    if not wanted:
        return files
    everything = segment_files(data_dir)
    by_path = {f.path: f for f in everything}
    chosen = []
    for w in wanted:
        cand = os.path.abspath(w if os.path.exists(w) else os.path.join(data_dir, w))
        if cand not in by_path:
            diverged = _diverged_file(data_dir, cand)
            if diverged is None:
                raise SystemExit(f"qdelay inspect: {w} is not a segment of {data_dir}")
            by_path[cand] = diverged
        chosen.append(by_path[cand])
    return chosen


# --- ls --------------------------------------------------------------------------------------


def cmd_ls(args) -> int:
    files = _select(args.data_dir, args)
    infos = []
    with _progress(files, "ls") as prog:
        for sf in files:
            info = {
                "log": sf.log,
                "segment": sf.rel,
                "bytes": sf.size,
                "records": 0,
                "bad": 0,
                "first_sequence": None,
                "last_sequence": None,
                "min_sequence": None,
                "max_sequence": None,
                "first_ms": None,
                "last_ms": None,
                "min_due_ms": None,
                "max_due_ms": None,
            }
            for item in walk_file(sf, prog):
                if item.is_error:
                    info["bad"] += 1
                if item.frame is None:
                    continue
                f = item.frame
                info["records"] += 1
                if info["first_sequence"] is None:
                    info["first_sequence"] = f.sequence
                    info["first_ms"] = f.timestamp
                info["last_sequence"] = f.sequence
                info["last_ms"] = f.timestamp
                # a dispatch log is in ack order, not sequence order: the range is min..max
                lo, hi = info["min_sequence"], info["max_sequence"]
                info["min_sequence"] = f.sequence if lo is None else min(lo, f.sequence)
                info["max_sequence"] = f.sequence if hi is None else max(hi, f.sequence)
                due = getattr(item.record, "deliver_at_ms", None)
                if due is not None:
                    info["min_due_ms"] = due if info["min_due_ms"] is None else min(info["min_due_ms"], due)
                    info["max_due_ms"] = due if info["max_due_ms"] is None else max(info["max_due_ms"], due)
            infos.append(info)
    ckpt, ckpt_err = read_checkpoint(args.data_dir)
    if args.json:
        _emit_json({"segments": infos, "checkpoint": ckpt, "checkpoint_error": ckpt_err})
        return 0
    rows = []
    for i in infos:
        seqs = "-" if i["min_sequence"] is None else f"{i['min_sequence']}..{i['max_sequence']}"
        rows.append(
            [
                i["log"],
                i["segment"],
                str(i["records"]),
                str(i["bad"]),
                str(i["bytes"]),
                seqs,
                iso(i["first_ms"]),
                iso(i["last_ms"]),
                iso(i["min_due_ms"]),
                iso(i["max_due_ms"]),
            ]
        )
    _table(
        rows,
        ["LOG", "SEGMENT", "RECORDS", "BAD", "BYTES", "SEQUENCES", "FIRST_TIME", "LAST_TIME", "FIRST_DUE", "LAST_DUE"],
        right={2, 3, 4},
    )
    for log in LOGS:
        sel = [i for i in infos if i["log"] == log]
        if sel:
            sys.stdout.write(
                f"{log}: {counted(len(sel), 'segment')}, {counted(sum(i['records'] for i in sel), 'record')}, "
                f"{sum(i['bad'] for i in sel)} bad, {counted(sum(i['bytes'] for i in sel), 'byte')}\n"
            )
    if ckpt_err:
        sys.stdout.write(f"checkpoint: unreadable ({ckpt_err})\n")
    elif ckpt is not None:
        sys.stdout.write(f"checkpoint: {checkpoint_summary(ckpt)}\n")
    else:
        sys.stdout.write("checkpoint: none\n")
    return 0


def checkpoint_summary(ckpt: dict) -> str:
    """What the iterate checkpoint means, in words (its raw fields are the server's
    bookkeeping: ``ls --json`` shows them all)."""
    parts = []
    if "offset" in ckpt:
        parts.append(
            f"message log copied into the schedule log up to offset {ckpt['offset']}"
            + (f" (sequence {ckpt['sequence']})" if "sequence" in ckpt else "")
        )
    if ckpt.get("done_before") is not None:
        parts.append(f"every due minute before {iso(int(ckpt['done_before']) * naming.MS_PER_MINUTE)[:16]}Z done")
    reopened = ckpt.get("reopened") or ()
    if reopened:
        parts.append(f"{counted(len(reopened), 'earlier minute')} reopened by late messages")
    return "; ".join(parts) or "(empty)"


# --- dump ------------------------------------------------------------------------------------


def cmd_dump(args) -> int:
    files = _select(args.data_dir, args)
    left = args.limit
    with _progress(files, "dump") as prog:
        for sf in files:
            for item in walk_file(sf, prog):
                if item.status == ZERO:
                    continue
                if left is not None and left <= 0:
                    return 0
                out = {"log": sf.log, "segment": sf.rel}
                out.update(record_fields(item))
                _emit_json(out)
                if left is not None:
                    left -= 1
    return 0


# --- verify ----------------------------------------------------------------------------------


def verify_files(
    data_dir: str, files: list[SegmentFile], scale_minutes: int = 1, progress: Progress | None = None
) -> tuple[list[dict], dict]:
    """Every problem (file, offset, reason) and totals: checksums, framing, bodies, kinds,
    sequences (message log: contiguous across segments; schedule: increasing within a
    segment), due buckets, message-log base offsets."""
    problems: list[dict] = []
    totals = {"segments": 0, "records": 0, "bytes": 0, "bad": 0}

    def bad(sf: SegmentFile | None, offset, reason):
        problems.append({"segment": sf.rel if sf else None, "offset": offset, "reason": reason})

    prev_wal: SegmentFile | None = None
    last_wal_seq: int | None = None
    for sf in files:
        totals["segments"] += 1
        totals["bytes"] += sf.size
        if sf.log == "message" and prev_wal is not None and sf.key != prev_wal.key + prev_wal.size:
            bad(
                sf,
                0,
                f"message log gap: segment starts at offset {sf.key}, the previous one "
                f"ends at {prev_wal.key + prev_wal.size}",
            )
        last_seq = None
        for item in walk_file(sf, progress):
            if item.status == ZERO:
                continue
            if item.is_error:
                totals["bad"] += 1
                bad(sf, item.offset, item.error)
                if item.frame is None:
                    continue
            f = item.frame
            totals["records"] += 1
            if f.kind not in ALLOWED_KINDS[sf.log]:
                bad(sf, f.offset, f"record kind {_kind_name(f.kind)} does not belong in the {sf.log} log")
            if sf.log == "message":
                if last_wal_seq is not None and f.sequence != last_wal_seq + 1:
                    bad(sf, f.offset, f"sequence {f.sequence} after {last_wal_seq}: the message log must be contiguous")
                last_wal_seq = f.sequence
            elif sf.log == "schedule":
                if last_seq is not None and f.sequence <= last_seq:
                    bad(sf, f.offset, f"sequence {f.sequence} after {last_seq}: schedule segments must be increasing")
                last_seq = f.sequence
            due = getattr(item.record, "deliver_at_ms", None)
            if sf.log != "message" and due is not None and naming.bucket_of(due, scale_minutes) != sf.key:
                bad(
                    sf,
                    f.offset,
                    f"due {iso(due)} belongs to bucket "
                    f"{naming.minute_stamp(naming.bucket_of(due, scale_minutes))}, "
                    f"not to this segment",
                )
        if sf.log == "message":
            prev_wal = sf
    ckpt_path = os.path.join(data_dir, naming.CHECKPOINT_DIR, CHECKPOINT_NAME)
    _state, err = read_checkpoint(data_dir)
    if err:
        totals["bad"] += 1
        problems.append(
            {
                "segment": os.path.relpath(ckpt_path, data_dir).replace(os.sep, "/"),
                "offset": int(err.split(":", 1)[0]),
                "reason": err.split(": ", 1)[1],
            }
        )
    return problems, totals


def cmd_verify(args) -> int:
    files = _select(args.data_dir, args)
    with _progress(files, "verify") as prog:
        problems, totals = verify_files(args.data_dir, files, args.scale_minutes, prog)
    if args.json:
        _emit_json({"ok": not problems, "problems": problems, **totals})
    else:
        for p in problems:
            sys.stdout.write(f"BAD {p['segment']} offset {p['offset']}: {p['reason']}\n")
        sys.stdout.write(
            f"{'OK' if not problems else 'FAILED'}: {counted(totals['segments'], 'segment')}, "
            f"{counted(totals['records'], 'record')}, {counted(totals['bytes'], 'byte')}, "
            f"{counted(len(problems), 'problem')}\n"
        )
    return 0 if not problems else 1


# --- find ------------------------------------------------------------------------------------


def _matches(item: Item, message_id: str | None, sequence: int | None) -> bool:
    rec = item.record
    if rec is None:
        return False
    if isinstance(rec, Cancel):
        return rec.message_id == message_id if message_id is not None else rec.target_sequence == sequence
    if message_id is not None:
        return getattr(rec, "message_id", None) == message_id
    return item.frame.sequence == sequence


def _schedule_choice(files: list[SegmentFile], found: dict[int, dict], scale_minutes: int) -> list[SegmentFile]:
    """The schedule segments to read for the lives found in the message log: their due
    buckets, or every one when the message log had none of them (or only a cancel)."""
    buckets = {naming.bucket_of(lf["message"]["due_ms"], scale_minutes) for lf in found.values() if lf["message"]}
    sched = [f for f in files if f.log == "schedule" and (not found or f.key in buckets)]
    if found and any(lf["message"] is None for lf in found.values()):
        sched = [f for f in files if f.log == "schedule"]
    return sched


# --- find --sequence without reading the whole message log ----------------------------------
#
# The message log is in sequence order (one writer numbers and appends), so the segment
# holding a sequence is the last whose first record's sequence is not above it, and inside
# it a bisection over byte offsets (resynchronised on the next valid frame, as a reader
# does after damage) lands on a record at or before it. Its cancels follow it in the log,
# anywhere: each one was copied into the target's due bucket (where the schedule index
# lists it) unless it lies past the iterate checkpoint, which is read too. Every fact an
# index gives is checked against the record it points at; whatever does not check out, or
# cannot be known without the whole log, makes ``find`` read the whole log, as before.


@dataclass(slots=True)
class Shortcut:
    """The records ``find --sequence`` reports, in each log's order, found without reading
    every message-log segment."""

    message_log: list[tuple[SegmentFile, Item]]
    schedule: list[tuple[SegmentFile, Item]]


class _NoShortcut(Exception):
    """The folder does not let the shortcut prove it sees every record: read everything."""


def _first_sequence(sf: SegmentFile, cache: dict[str, int]) -> int:
    if sf.path not in cache:
        with open_buffer(sf.path) as buf:
            for got in reader.walk(buf):
                if not isinstance(got, reader.Damage):
                    cache[sf.path] = got.sequence
                    break
            else:  # empty or unreadable: its place in the order is unknown
                raise _NoShortcut
    return cache[sf.path]


def _segment_of(wal: list[SegmentFile], sequence: int, cache: dict[str, int]) -> SegmentFile:
    """The message-log segment whose records' sequences include ``sequence``, if any."""
    lo, hi = 0, len(wal)
    while lo < hi:  # the last segment whose first sequence is <= sequence
        mid = (lo + hi) // 2
        if _first_sequence(wal[mid], cache) <= sequence:
            lo = mid + 1
        else:
            hi = mid
    if lo == 0:  # before the first segment: cleaned, or never written
        raise _NoShortcut
    return wal[lo - 1]


def _message_log_record(wal: list[SegmentFile], sequence: int, cache: dict[str, int]) -> tuple[SegmentFile, Item]:
    """The decoded message-log record numbered ``sequence``."""
    sf = _segment_of(wal, sequence, cache)
    with open_buffer(sf.path) as buf:
        for item in walk(buf, 0, True, reader.record_before(buf, sequence)):
            if item.frame is None or item.frame.sequence < sequence:
                continue
            if item.frame.sequence == sequence and item.status == OK:
                return sf, item
            break
    raise _NoShortcut  # cleaned, damaged, or not written yet


def _indexed_hits(sf: SegmentFile, sequence: int) -> list[Item] | None:
    """The records of schedule segment ``sf`` that are message ``sequence`` or cancel it,
    from the segment's schedule index (docs/formats.md) when it describes the segment:
    whole entries in sequence order, its last record ending where the written bytes do,
    each record it names verified, and the message's CANCELLED flag agreeing with the
    cancels found. None when it is missing or does not check out."""
    from qdelay.segments import schedule_index as sidx  # numpy: only this path needs it

    try:
        with open(sidx.path_of(sf.path), "rb") as f:
            raw = f.read()
    except OSError:
        return None
    if not raw or len(raw) % sidx.ENTRY_SIZE:
        return None
    import numpy as np

    e = np.frombuffer(raw, dtype=sidx.ENTRY)
    if len(e) > 1 and not bool((e["seq"][1:] > e["seq"][:-1]).all()):
        return None
    where = e["where"]
    offsets = (where & np.uint64(sidx.OFFSET_MASK)).astype(np.int64)
    kinds = ((where >> np.uint64(sidx.OFFSET_BITS)) & np.uint64(0xFF)).astype(np.int64)
    flags = (where >> np.uint64(sidx.FLAGS_SHIFT)).astype(np.int64)
    is_message = (e["seq"] == sequence) & (kinds == int(RecordKind.MESSAGE))
    is_cancel = (kinds == int(RecordKind.CANCEL)) & (e["a"] == sequence)
    rows = np.flatnonzero(is_message | is_cancel).tolist()
    with open_buffer(sf.path) as buf:
        try:
            last = reader.frame_at(buf, int(offsets[-1]))
        except FrameError:
            return None
        if last.sequence != int(e["seq"][-1]) or buf[last.offset + last.size :].strip(b"\0"):
            return None  # behind or ahead of the segment
        items = []
        for r in rows:
            try:
                frame = reader.frame_at(buf, int(offsets[r]))
            except FrameError:
                return None
            record, why = decode(frame)
            if frame.sequence != int(e["seq"][r]) or frame.kind != int(kinds[r]) or why is not None:
                return None
            if isinstance(record, Cancel) and record.target_sequence != sequence:
                return None
            items.append(Item(OK, frame.offset, frame.offset + frame.size, frame, record))
    flagged = [bool(flags[r] & sidx.CANCELLED) for r in rows if is_message[r]]
    if flagged and flagged[0] != any(is_cancel[r] for r in rows):
        return None
    return items


def _walked_hits(sf: SegmentFile, sequence: int) -> list[Item]:
    """The same records, read from the whole segment; a damaged record there may have been
    one of them, so damage (other than unwritten space at the end) gives up."""
    items = []
    for item in walk_file(sf):
        if item.is_error:
            raise _NoShortcut
        if _matches(item, None, sequence):
            items.append(item)
    return items


def _same_record(f: Frame) -> tuple:
    return (f.kind, f.sequence, f.timestamp, f.body)


def sequence_shortcut(data_dir: str, files: list[SegmentFile], sequence: int, scale_minutes: int) -> Shortcut | None:
    """What ``find --sequence`` reports from the message and schedule logs, read from the
    message-log segment holding the sequence, its due bucket's schedule segment (through
    its schedule index when that checks out), the segments holding the cancels listed
    there, and the message log past the iterate checkpoint; None when the folder does not
    let this be sure to see every record (no checkpoint, the message cleaned or damaged,
    the bucket's segment missing or damaged, sequences out of order): read everything."""
    wal = [f for f in files if f.log == "message"]
    ckpt, _err = read_checkpoint(data_dir)
    if not wal or ckpt is None or not isinstance(ckpt.get("offset"), int):
        return None
    copied = ckpt["offset"]  # the message log before it is in the schedule log
    cache: dict[str, int] = {}
    try:
        if copied > wal[-1].key + wal[-1].size:
            raise _NoShortcut  # a checkpoint past the log: not this log's
        sf, item = _message_log_record(wal, sequence, cache)
        if not isinstance(item.record, Message):
            raise _NoShortcut
        found = {sequence: {"message": record_fields(item)}}
        schedule = []
        for ssf in _schedule_choice(files, found, scale_minutes):
            hits = _indexed_hits(ssf, sequence)
            if hits is None:
                hits = _walked_hits(ssf, sequence)
            schedule.extend((ssf, it) for it in hits)
        # A record found by bisection is confirmed by an aligned read: its schedule copy
        # (the same kind, sequence, stamp and body), or the walk from the checkpoint, which
        # starts on a record boundary. (A resynchronising bisection could otherwise stop on
        # a whole frame held inside some payload.)
        copies = {it.frame.sequence: _same_record(it.frame) for _s, it in schedule}
        confirm = {(sf.key, item.offset): item} if copies.get(sequence) != _same_record(item.frame) else {}
        if confirm and sf.key + item.offset < copied:
            raise _NoShortcut  # the checkpoint says it was copied: the schedule log lost it
        picked = {(sf.key, item.offset): (sf, item)}
        for cancel in sorted(q for q, (kind, *_rest) in copies.items() if kind == RecordKind.CANCEL):
            csf, citem = _message_log_record(wal, cancel, cache)
            if not _matches(citem, None, sequence) or copies[cancel] != _same_record(citem.frame):
                raise _NoShortcut
            picked[(csf.key, citem.offset)] = (csf, citem)
        # the cancels not copied yet: the message log past the checkpoint
        for tsf in wal:
            if tsf.key + tsf.size <= copied:
                continue
            with open_buffer(tsf.path) as buf:
                for titem in walk(buf, 0, True, max(0, copied - tsf.key)):
                    if titem.frame is None or titem.frame.sequence < sequence:
                        continue
                    if titem.frame.sequence == sequence:
                        confirm.pop((tsf.key, titem.offset), None)
                    elif _matches(titem, None, sequence):
                        picked[(tsf.key, titem.offset)] = (tsf, titem)
        if confirm:
            raise _NoShortcut  # neither a copy nor the aligned walk met the record found
    except _NoShortcut:
        return None
    return Shortcut([picked[k] for k in sorted(picked)], schedule)


def find_life(
    data_dir: str,
    message_id: str | None = None,
    sequence: int | None = None,
    scale_minutes: int = 1,
    progress_label: str = "find",
    shortcut: bool = True,
) -> list[dict]:
    """Every message matching the id (or sequence), each with its events in order.

    By sequence, the records are found without reading the whole message log when the
    folder allows it (:func:`sequence_shortcut`); otherwise, or with ``shortcut=False``,
    every message-log segment is read. Both give the same lives."""
    files = segment_files(data_dir)
    found: dict[int, dict] = {}  # sequence -> life

    def life(seq: int) -> dict:
        return found.setdefault(
            seq, {"sequence": seq, "message_id": None, "message": None, "events": [], "cancel_sequences": []}
        )

    def on_message_log(sf: SegmentFile, item: Item) -> None:
        rec, f = item.record, item.frame
        if isinstance(rec, Message):
            lf = life(f.sequence)
            lf["message_id"] = rec.message_id
            lf["message"] = record_fields(item)
            lf["events"].append(
                {
                    "event": "received",
                    "at_ms": f.timestamp,
                    "log": "message",
                    "segment": sf.rel,
                    "offset": item.offset,
                    "global_offset": sf.key + item.offset,
                }
            )
        elif isinstance(rec, Cancel):
            lf = life(rec.target_sequence)
            lf["message_id"] = lf["message_id"] or rec.message_id
            lf["cancel_sequences"].append(f.sequence)
            lf["events"].append(
                {
                    "event": "cancel received",
                    "at_ms": f.timestamp,
                    "log": "message",
                    "segment": sf.rel,
                    "offset": item.offset,
                    "cancel_sequence": f.sequence,
                }
            )

    def on_schedule(sf: SegmentFile, item: Item) -> None:
        rec, f = item.record, item.frame
        if isinstance(rec, Message):
            lf = life(f.sequence)
            lf["message_id"] = rec.message_id
            if lf["message"] is None:
                lf["message"] = record_fields(item)
                lf["events"].append(
                    {"event": "received", "at_ms": f.timestamp, "log": "schedule (message log cleaned)"}
                )
            lf["events"].append({"event": "scheduled", "log": "schedule", "segment": sf.rel, "offset": item.offset})
        else:
            lf = life(rec.target_sequence)
            if f.sequence not in lf["cancel_sequences"]:
                lf["cancel_sequences"].append(f.sequence)
                lf["events"].append(
                    {
                        "event": "cancel received",
                        "at_ms": f.timestamp,
                        "log": "schedule (message log cleaned)",
                        "cancel_sequence": f.sequence,
                    }
                )
            lf["events"].append(
                {
                    "event": "cancel scheduled",
                    "log": "schedule",
                    "segment": sf.rel,
                    "offset": item.offset,
                    "cancel_sequence": f.sequence,
                }
            )

    short = None
    if shortcut and message_id is None and sequence is not None:
        short = sequence_shortcut(data_dir, files, sequence, scale_minutes)
    if short is not None:
        for sf, item in short.message_log:
            on_message_log(sf, item)
        for sf, item in short.schedule:
            on_schedule(sf, item)
    else:
        wal = [f for f in files if f.log == "message"]
        # 1. the message log (it may have been cleaned: fall back to the schedule log)
        # a body is decoded only when it can match: it holds the id's bytes, or it is the
        # sequence's record or a cancel (whose target is in its body); decoding every body
        # was most of the read's cost
        want = None if message_id is None else message_id.encode()
        with _progress(wal, progress_label) as prog:
            for sf in wal:
                for item in walk_file(sf, prog, decode_bodies=False):
                    f = item.frame
                    if f is None or f.kind not in (RecordKind.MESSAGE, RecordKind.CANCEL):
                        continue
                    if want is not None and want not in f.body:
                        continue
                    if want is None and f.kind == RecordKind.MESSAGE and f.sequence != sequence:
                        continue
                    item.record, why = decode(f)
                    if why is None and _matches(item, message_id, sequence):
                        on_message_log(sf, item)
        # 2. schedule segments: the due bucket when known, else all of them
        sched = _schedule_choice(files, found, scale_minutes)
        seqs = set(found)
        with _progress(sched, progress_label) as prog:
            for sf in sched:
                for item in walk_file(sf, prog):
                    rec, f = item.record, item.frame
                    if rec is None:
                        continue
                    if (
                        _matches(item, message_id, sequence)
                        or (f.sequence in seqs and isinstance(rec, Message))
                        or (isinstance(rec, Cancel) and rec.target_sequence in seqs)
                    ):
                        on_schedule(sf, item)
    # 3. dispatch records: the same bucket as the schedule segment
    seqs = set(found)
    buckets = {naming.bucket_of(lf["message"]["due_ms"], scale_minutes) for lf in found.values() if lf["message"]}
    disp = [f for f in files if f.log == "dispatch" and f.key in buckets]
    with _progress(disp, progress_label) as prog:
        for sf in disp:
            for item in walk_file(sf, prog):
                rec, f = item.record, item.frame
                if isinstance(rec, Dispatch) and f.sequence in seqs:
                    found[f.sequence]["events"].append(
                        {
                            "event": "delivered" if rec.outcome == Outcome.DELIVERED else "dead-lettered",
                            "at_ms": f.timestamp,
                            "dispatched_ms": rec.dispatched_at_ms,
                            "attempt": rec.attempt,
                            "outcome": outcome_name(rec.outcome),
                            "log": "dispatch",
                            "segment": sf.rel,
                            "offset": item.offset,
                            "schedule_offset": rec.schedule_offset,
                        }
                    )
    ckpt, _err = read_checkpoint(data_dir)
    for lf in found.values():
        kinds = [e["event"] for e in lf["events"]]
        if "delivered" in kinds:
            state = "DELIVERED"
        elif "dead-lettered" in kinds:
            state = "DEAD_LETTERED"
        elif lf["cancel_sequences"]:
            state = "CANCELLED"
        elif lf["message"] is None:
            state = "UNKNOWN (only a cancel was found)"
        elif "scheduled" not in kinds:
            it = ckpt.get("sequence") if ckpt else None
            state = (
                "PENDING (not yet iterated into the schedule log)"
                if it is None or lf["sequence"] > it
                else "MISSING from the schedule log"
            )
        else:
            state = "PENDING"
        lf["state"] = state
    return [found[s] for s in sorted(found)]


def cmd_find(args) -> int:
    lives = find_life(args.data_dir, args.id, args.sequence, args.scale_minutes)
    if args.json:
        _emit_json({"query": {"message_id": args.id, "sequence": args.sequence}, "matches": lives})
        return 0 if lives else 1
    if not lives:
        what = f"id {args.id}" if args.id is not None else f"sequence {args.sequence}"
        sys.stdout.write(f"no message with {what}\n")
        return 1
    for lf in lives:
        m = lf["message"] or {}
        sys.stdout.write(f"message {lf['message_id']} (sequence {lf['sequence']}): {lf['state']}\n")
        if m:
            sys.stdout.write(
                f"  subject {m['subject']}  due {iso(m['due_ms'])}  payload "
                f"{m['payload_bytes']} bytes ({m['payload_encoding']}: {m['payload']})\n"
            )
            if m["headers"]:
                sys.stdout.write("  headers " + json.dumps(m["headers"], sort_keys=True) + "\n")
        for e in lf["events"]:
            where = f"{e['segment']} @ {e['offset']}" if "segment" in e else e["log"]
            when = iso(e["at_ms"]) if "at_ms" in e else " " * 24
            extra = ""
            if "dispatched_ms" in e:
                extra = f"  dispatched {iso(e['dispatched_ms'])} attempt {e['attempt']}"
            if "cancel_sequence" in e:
                extra = f"  cancel sequence {e['cancel_sequence']}"
            sys.stdout.write(f"  {e['event']:<16} {when}  {where}{extra}\n")
    return 0


# --- stats -----------------------------------------------------------------------------------


def parse_time(text: str) -> int:
    """Epoch ms, or an ISO 8601 time (UTC unless it says otherwise); ValueError naming the
    accepted forms for anything else."""
    if text.lstrip("-").isdigit():
        return int(text)
    try:
        t = _dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(
            f"{text!r} is not a time: give epoch ms or ISO 8601, e.g. 2026-01-01T00:00:00Z"
            " (UTC unless it says otherwise)"
        ) from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=_dt.UTC)
    return int(t.timestamp() * 1000)


def time_arg(text: str) -> int:
    """``parse_time`` as an argparse type: a bad time is a usage error (exit 2) that says what
    a time looks like, not a traceback."""
    try:
        return parse_time(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def minute_stats(
    data_dir: str,
    from_ms: int | None = None,
    to_ms: int | None = None,
    progress_label: str = "stats",
    now_ms: int | None = None,
) -> tuple[dict[int, dict], int]:
    """Per due minute: due, cancelled, delivered, dead_lettered, pending and overdue counts.

    Messages come from the schedule log and from the message log past the iterate
    checkpoint (not yet in the schedule log); a message is closed by a dispatch record
    (delivered or dead-lettered) or a cancel; of the rest, those due before ``now_ms``
    (default: now) are overdue (not delivered yet although due: a consumer missing, or a
    server behind), the others pending. Also returns how many unreadable records were
    skipped."""
    if now_ms is None:
        import time

        now_ms = int(time.time() * 1000)
    lo = None if from_ms is None else from_ms // naming.MS_PER_MINUTE
    hi = None if to_ms is None else (to_ms - 1) // naming.MS_PER_MINUTE
    files = segment_files(data_dir)
    ckpt, _err = read_checkpoint(data_dir)
    start = ckpt.get("offset", 0) if ckpt else 0
    chosen = []
    for sf in files:
        if sf.log == "message":
            if sf.key + sf.size > start:
                chosen.append(sf)
        elif (lo is None or sf.key >= lo - 1440) and (hi is None or sf.key <= hi):
            chosen.append(sf)
    due: dict[int, int] = {}  # sequence -> due minute
    cancelled: set[int] = set()
    closed: dict[int, int] = {}  # sequence -> outcome (delivered wins)
    skipped = 0
    with _progress(chosen, progress_label) as prog:
        for sf in chosen:
            for item in walk_file(sf, prog):
                rec = item.record
                if item.is_error:
                    skipped += 1
                if rec is None or (sf.log == "message" and sf.key + item.offset < start):
                    continue
                if isinstance(rec, Message):
                    due[item.frame.sequence] = rec.deliver_at_ms
                elif isinstance(rec, Cancel):
                    cancelled.add(rec.target_sequence)
                elif isinstance(rec, Dispatch):
                    seq = item.frame.sequence
                    if closed.get(seq) != Outcome.DELIVERED:
                        closed[seq] = rec.outcome
    out: dict[int, dict] = {}
    for seq, due_ms in due.items():
        minute = due_ms // naming.MS_PER_MINUTE
        if (lo is not None and minute < lo) or (hi is not None and minute > hi):
            continue
        row = out.setdefault(
            minute, {"due": 0, "cancelled": 0, "delivered": 0, "dead_lettered": 0, "pending": 0, "overdue": 0}
        )
        row["due"] += 1
        outcome = closed.get(seq)
        if outcome == Outcome.DELIVERED:
            row["delivered"] += 1
        elif outcome == Outcome.DEAD_LETTERED:
            row["dead_lettered"] += 1
        elif seq in cancelled:
            row["cancelled"] += 1
        elif due_ms < now_ms:
            row["overdue"] += 1
        else:
            row["pending"] += 1
    return dict(sorted(out.items())), skipped


def cmd_stats(args) -> int:
    now_ms = args.now  # parsed by time_arg, as --from and --to
    rows, skipped = minute_stats(args.data_dir, args.from_time, args.to_time, now_ms=now_ms)
    names = ["due", "pending", "overdue", "delivered", "cancelled", "dead_lettered"]
    totals = {n: sum(r[n] for r in rows.values()) for n in names}
    if args.json:
        _emit_json(
            {
                "minutes": [
                    {"minute": iso(m * naming.MS_PER_MINUTE), "minute_ms": m * 60_000, **r} for m, r in rows.items()
                ],
                "totals": totals,
                "unreadable_records": skipped,
            }
        )
        return 0
    table = [[iso(m * naming.MS_PER_MINUTE)[:16] + "Z"] + [str(r[n]) for n in names] for m, r in rows.items()]
    table.append(["TOTAL"] + [str(totals[n]) for n in names])
    _table(
        table,
        ["MINUTE", "DUE", "PENDING", "OVERDUE", "DELIVERED", "CANCELLED", "DEAD_LETTERED"],
        right={1, 2, 3, 4, 5, 6},
    )
    if totals["overdue"]:
        sys.stdout.write(
            f"{totals['overdue']} overdue: due but neither delivered nor cancelled "
            "(no consumer acknowledged them yet, or the server is behind)\n"
        )
    if skipped:
        sys.stdout.write(f"{counted(skipped, 'unreadable record')} skipped: run 'qdelay inspect verify'\n")
    return 0


# --- command line ----------------------------------------------------------------------------


def limit_arg(text: str) -> int:
    """``--limit``: a positive count (0 or -1 printed nothing and exited 0, read as an empty
    folder)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of records")
    return value


def scale_arg(text: str) -> int:
    """``--scale-minutes``: a bucket width the server accepts (it must divide a day; 7 made
    verify report records of good segments as in the wrong minute)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1 or 1440 % value:
        raise argparse.ArgumentTypeError(f"{text!r} minutes does not divide a day (1, 2, 5, 10, 15, 30, 60 ...)")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="inspect_command", required=True)

    def common(p):
        p.add_argument("--data-dir", required=True, help="a server's data folder")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        return p

    p = common(sub.add_parser("ls", help="segments of each log: records, time ranges, sizes"))
    p.add_argument("--log", choices=("all",) + LOGS, default="all")
    p.set_defaults(segments=None)
    p = common(sub.add_parser("dump", help="records as JSON lines"))
    p.add_argument("segments", nargs="*", help="segment files (default: every segment of --log)")
    p.add_argument("--log", choices=("all",) + LOGS, default="all")
    p.add_argument("--limit", type=limit_arg, default=None, help="stop after N records")
    p = common(sub.add_parser("verify", help="checksums and sequences; non-zero exit when bad"))
    p.add_argument("segments", nargs="*", help="segment files (default: the whole folder)")
    p.add_argument("--log", choices=("all",) + LOGS, default="all")
    p.add_argument("--scale-minutes", type=scale_arg, default=1, help="the server's bucket size")
    p = common(sub.add_parser("find", help="the full life of one message"))
    which = p.add_mutually_exclusive_group(required=True)  # neither, or both: a usage error (exit 2)
    which.add_argument("--id", help="message id: every message that ever carried it (reads the whole message log)")
    which.add_argument(
        "--sequence", type=int, help="message-log sequence, as in a receipt (reads only the segments that hold it)"
    )
    p.add_argument("--scale-minutes", type=scale_arg, default=1, help="the server's bucket size")
    p = common(sub.add_parser("stats", help="per-minute pending / delivered / cancelled counts"))
    p.add_argument("--from", dest="from_time", type=time_arg, help="first due time (epoch ms or ISO 8601, UTC)")
    p.add_argument("--to", dest="to_time", type=time_arg, help="end of the due range, exclusive")
    p.add_argument(
        "--now", default=None, type=time_arg, help="judge overdue at this time (epoch ms or ISO 8601; default now)"
    )


COMMANDS = {"ls": cmd_ls, "dump": cmd_dump, "verify": cmd_verify, "find": cmd_find, "stats": cmd_stats}


def run(args) -> int:
    if not os.path.isdir(args.data_dir):
        sys.stderr.write(f"qdelay inspect: {args.data_dir} is not a directory\n")
        return 2
    try:
        code = COMMANDS[args.inspect_command](args)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # the reader went away (| head): stop quietly, and keep Python's exit-time flush
        # of stdout from raising again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
