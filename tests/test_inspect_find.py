"""``qdelay inspect find --sequence`` without reading the whole message log: on a real
server's folder (small segments, schedule indexes, cancels), the shortcut reports exactly
what the whole-log read does, and every index or checkpoint it cannot trust (missing,
behind, damaged, pointing elsewhere) sends it back to the whole-log read, still the same
answer. The golden files (tests/test_inspect.py) cover the shortcut's output on the
deterministic folders, the message log past the iterate checkpoint included.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time

import byte_surgery
import datafolder
import numpy as np
import pytest
from conftest import wait_until
from datafolder import T0
from serverproc import ServerProc

from qdelay import cli
from qdelay.segments import naming, reader
from qdelay.segments import schedule_index as sidx
from qdelay.segments.framing import RecordKind
from qdelay.tools import inspect

DAY_MS = 86_400_000


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """A stopped server's folder: 240 messages due over two minutes a day ahead, in ~4 KiB
    message-log segments, every eighth cancelled."""
    root = tmp_path_factory.mktemp("real") / "data"
    with ServerProc(root, args=["--set", "engine.segment_bytes=4096"]) as srv:
        c = srv.client(timeout=20)
        due = (int(time.time() * 1000) // 60_000 + 1) * 60_000 + DAY_MS
        receipts = [
            c.send("find.s", b"p" * 60, deliver_at_ms=due + (i % 2) * 60_000 + i, message_id=f"m{i}")
            for i in range(240)
        ]
        cancelled = receipts[::8]
        for r in cancelled:
            assert c.cancel(r) == "CANCELLED"
        wait_until(lambda: c.stats()["iterate_lag_bytes"] == 0, what="every record in the schedule log")
        c.close()
    return {"root": str(root), "receipts": receipts, "cancelled": {r.sequence for r in cancelled}}


def _digest(root: str) -> dict[str, str]:
    out = {}
    for d, _dirs, files in os.walk(root):
        for name in files:
            with open(os.path.join(d, name), "rb") as f:
                out[os.path.relpath(os.path.join(d, name), root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _same(root: str, seq: int) -> list[dict]:
    """find_life by the shortcut equals the whole-log read; returns it."""
    got = inspect.find_life(root, sequence=seq)
    assert got == inspect.find_life(root, sequence=seq, shortcut=False)
    return got


def _bucket_file(root: str, seq: int) -> inspect.SegmentFile:
    life = inspect.find_life(root, sequence=seq, shortcut=False)[0]
    bucket = naming.bucket_of(life["message"]["due_ms"])
    return next(f for f in inspect.segment_files(root) if f.log == "schedule" and f.key == bucket)


def test_shortcut_reads_what_the_whole_log_holds(real):
    root, receipts = real["root"], real["receipts"]
    files = inspect.segment_files(root)
    assert sum(f.log == "message" for f in files) >= 5  # the bisection has segments to skip
    before = _digest(root)
    for r in receipts[:3] + receipts[100:110] + receipts[-3:]:
        assert inspect.sequence_shortcut(root, files, r.sequence, 1) is not None
        assert inspect._indexed_hits(_bucket_file(root, r.sequence), r.sequence) is not None
        (life,) = _same(root, r.sequence)
        want = "CANCELLED" if r.sequence in real["cancelled"] else "PENDING"
        assert life["state"] == want and life["message_id"] == r.message_id
        if want == "CANCELLED":  # its tombstone found in the message log, not "cleaned"
            assert [e["log"] for e in life["events"]] == ["message", "message", "schedule", "schedule"]
    # a cancel's own sequence, and sequences no message has: the whole-log read answers
    cancel_seq = inspect.find_life(root, sequence=receipts[8].sequence)[0]["cancel_sequences"][0]
    for seq in (cancel_seq, 0, receipts[-1].sequence + 1000):
        assert inspect.sequence_shortcut(root, files, seq, 1) is None
        _same(root, seq)
    assert _digest(root) == before  # nothing written


def _entries(path: str) -> np.ndarray:
    return np.fromfile(sidx.path_of(path), dtype=sidx.ENTRY)


def _write(path: str, e: np.ndarray) -> None:
    e.tofile(sidx.path_of(path))


def _lose_flag(path, e, seq):  # the CANCELLED flag of the message's entry cleared
    row = int(np.flatnonzero(e["seq"] == seq)[0])
    e["where"][row] &= ~np.uint64(sidx.CANCELLED << sidx.FLAGS_SHIFT)
    _write(path, e)


def _retarget(path, e, seq):  # its cancel's entry names another target
    row = int(np.flatnonzero((e["a"] == seq) & (e["seq"] != seq))[0])
    e["a"][row] = seq + 1
    _write(path, e)


def _misplace(path, e, seq):  # the message's entry points at another record
    row = int(np.flatnonzero(e["seq"] == seq)[0])
    e["where"][row] = e["where"][row + 1]
    _write(path, e)


def _behind(path, e, seq):  # the last entry lost (a crash before it was written)
    _write(path, e[:-1])


def _ahead(path, e, seq):  # an entry past the segment's written records
    extra = e[-1:].copy()
    extra["seq"] += 1
    extra["where"] += np.uint64(10_000)
    _write(path, np.concatenate([e, extra]))


def _torn(path, e, seq):
    with open(sidx.path_of(path), "r+b") as f:
        f.truncate(len(e) * sidx.ENTRY_SIZE - 5)


def _missing(path, e, seq):
    os.unlink(sidx.path_of(path))


@pytest.mark.parametrize("damage", [_lose_flag, _retarget, _misplace, _behind, _ahead, _torn, _missing])
def test_an_index_that_does_not_check_out_is_not_used(real, tmp_path, damage):
    """The bucket's segment is read whole instead: the same answer, the cancel included."""
    root = str(tmp_path / "copy")
    shutil.copytree(real["root"], root)
    seq = sorted(real["cancelled"])[5]
    sf = _bucket_file(root, seq)
    want = inspect.find_life(root, sequence=seq, shortcut=False)
    damage(sf.path, _entries(sf.path), seq)
    assert inspect._indexed_hits(sf, seq) is None
    assert inspect.sequence_shortcut(root, inspect.segment_files(root), seq, 1) is not None
    assert _same(root, seq) == want
    assert want[0]["state"] == "CANCELLED"


def test_no_checkpoint_or_a_damaged_record_reads_everything(real, tmp_path):
    root = str(tmp_path / "copy")
    shutil.copytree(real["root"], root)
    seq = real["receipts"][121].sequence
    os.unlink(os.path.join(root, naming.CHECKPOINT_DIR, inspect.CHECKPOINT_NAME))
    assert inspect.sequence_shortcut(root, inspect.segment_files(root), seq, 1) is None
    assert _same(root, seq)[0]["state"] == "PENDING"
    shutil.rmtree(root)
    shutil.copytree(real["root"], root)
    # the schedule copy's bytes damaged while the index still names it
    sf = _bucket_file(root, seq)
    row = int(np.flatnonzero(_entries(sf.path)["seq"] == seq)[0])
    byte_surgery.flip_byte(sf.path, int(_entries(sf.path)["where"][row] & np.uint64(sidx.OFFSET_MASK)) + 40)
    _same(root, seq)
    # the message-log record itself damaged: the shortcut cannot find it
    life = inspect.find_life(root, sequence=seq, shortcut=False)[0]
    received = life["events"][0]
    byte_surgery.flip_byte(os.path.join(root, received["segment"]), received["offset"] + 40)
    assert inspect.sequence_shortcut(root, inspect.segment_files(root), seq, 1) is None
    _same(root, seq)


def test_a_cancel_past_the_checkpoint_is_found(tmp_path):
    """A cancel the iterate service has not copied yet is only in the message log."""
    b = datafolder.DataFolderBuilder(str(tmp_path / "f"), segment_bytes=400)
    seqs = [b.send("s", b"x" * 40, due_ms=T0 + 60_000 + i, created_ms=T0) for i in range(12)]
    b.iterate(at_ms=T0 + 1_000)
    b.cancel(seqs[3], at_ms=T0 + 2_000)
    b.close()
    root = b.root
    assert inspect.sequence_shortcut(root, inspect.segment_files(root), seqs[3], 1) is not None
    (life,) = _same(root, seqs[3])
    assert [e["event"] for e in life["events"]] == ["received", "cancel received", "scheduled"]


def test_on_a_running_server(tmp_path, capsys):
    """The server holds the folder (its id index open, segments appended): find answers from
    the folder as it is, the same by either read."""
    with ServerProc(tmp_path / "data", args=["--set", "engine.segment_bytes=4096"]) as srv:
        c = srv.client(timeout=20)
        due = int(time.time() * 1000) + DAY_MS
        rs = [c.send("live.s", b"q" * 50, deliver_at_ms=due + i, message_id=f"l{i}") for i in range(80)]
        wait_until(lambda: c.stats()["iterate_lag_bytes"] == 0, what="every record in the schedule log")
        root = str(srv.data_dir)
        assert cli.main(["inspect", "find", "--data-dir", root, "--sequence", str(rs[40].sequence)]) == 0
        out = capsys.readouterr().out
        # PENDING, or "not yet iterated" while the checkpoint on disk lags the schedule log
        assert out.startswith(f"message l40 (sequence {rs[40].sequence}): PENDING")
        # once the checkpoint on disk covers it (it lags the schedule log), by either read
        wait_until(
            lambda: inspect.find_life(root, sequence=rs[40].sequence, shortcut=False)[0]["state"] == "PENDING",
            what="the iterate checkpoint",
        )
        assert _same(root, rs[40].sequence)[0]["state"] == "PENDING"
        c.close()


def test_find_by_id_reads_every_record_that_carries_it(real):
    """``--id`` decodes only the bodies that hold the id's bytes: it still reports every
    message-log record whose decoded id is the one asked for, and nothing else."""
    root = real["root"]
    wal = [f for f in inspect.segment_files(root) if f.log == "message"]
    for mid in ("m5", "m8", "m1", "nope"):
        want = sorted(
            (sf.rel, item.offset)
            for sf in wal
            for item in inspect.walk_file(sf)
            if getattr(item.record, "message_id", None) == mid
        )
        got = sorted(
            (e["segment"], e["offset"])
            for lf in inspect.find_life(root, message_id=mid)
            for e in lf["events"]
            if e["log"] == "message"
        )
        assert got == want and (mid == "nope") == (want == [])


def test_a_frame_inside_a_payload_does_not_pass_for_the_record(tmp_path):
    """Payloads that each hold a whole, valid MESSAGE frame numbered like a real message
    (a message forwarding raw records): the bisection can stop on one, and then neither the
    schedule copy nor an aligned walk confirms it, so the whole log is read; the real
    message is reported either way."""
    from qdelay.segments import framing, records

    b = datafolder.DataFolderBuilder(str(tmp_path / "f"))
    target = 700  # a sequence written below
    fake = framing.encode(
        RecordKind.MESSAGE, target, T0, records.encode_message(b"fake", b"fake-id", b"", b"not me", T0 + 60_000)
    )
    seqs = b.send_many([("s", b"<" + fake + b">" * 40, T0 + 60_000 + i, T0, f"r{i}") for i in range(900)])
    assert target in seqs
    b.iterate(at_ms=T0 + 1_000)
    b.close()
    root = b.root
    (life,) = _same(root, target)
    assert life["message_id"] == f"r{target - 1}"
    with inspect.open_buffer(inspect.segment_files(root)[0].path) as buf:
        landed = next(reader.walk(buf, 0, reader.record_before(buf, target)))
        assert records.decode_body(landed.kind, landed.body).message_id == "fake-id"  # stopped on a fake
    assert inspect.sequence_shortcut(root, inspect.segment_files(root), target, 1) is None


def _real_body(root: str, seq: int) -> bytes:
    wal = [f for f in inspect.segment_files(root) if f.log == "message"]
    return next(i.frame.body for sf in wal for i in inspect.walk_file(sf) if i.frame and i.frame.sequence == seq)
