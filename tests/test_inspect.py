"""``qdelay inspect``: golden output of every subcommand on deterministic data folders
(clean, with a torn tail, with flipped bytes), written by the real storage code.

Regenerate the golden files after an intended change of output with
``QDELAY_UPDATE_GOLDEN=1 python -m pytest tests/test_inspect.py`` and review the diff.
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys

import byte_surgery
import datafolder
import pytest
from datafolder import T0

from qdelay import cli
from qdelay.tools.progress import Progress

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
UPDATE = os.environ.get("QDELAY_UPDATE_GOLDEN") == "1"


def _build(root: str, damage: str) -> str:
    datafolder.build_golden(root).close()
    if damage == "torn":
        # the writer died in the middle of seq 7, the message log's last record
        wal = os.path.join(root, "message", "00000000000000000342.wal")
        byte_surgery.truncate_at(wal, os.path.getsize(wal) - 20)
        # and a preallocated, never-written tail on a schedule segment is not an error
        byte_surgery.zero_fill_tail(os.path.join(root, "schedule", "20260101", "202601010003.sched"), 64)
    elif damage == "flipped":
        # one byte inside seq 2's body in the message log, one in seq 1's schedule copy
        byte_surgery.flip_byte(os.path.join(root, "message", "00000000000000000000.wal"), 100)
        byte_surgery.flip_byte(os.path.join(root, "schedule", "20260101", "202601010001.sched"), 50)
    return root


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {d: _build(str(tmp_path_factory.mktemp(d)), d) for d in ("clean", "torn", "flipped")}


def _run(argv: list[str], capsys) -> tuple[int, str]:
    code = cli.main(["inspect"] + argv)
    out, err = capsys.readouterr()
    assert err == ""  # no progress bar when stderr is not a terminal
    return code, out


CASES = {
    "ls": ["ls"],
    "ls_json": ["ls", "--json"],
    "dump": ["dump"],
    "dump_schedule_limit": ["dump", "--log", "schedule", "--limit", "3"],
    "verify": ["verify"],
    "verify_json": ["verify", "--json"],
    # one segment, one record, one problem: said in the singular ("1 problems", "1 segments")
    "verify_segment_342": ["verify", "message/00000000000000000342.wal"],
    "verify_segment_disp3": ["verify", "dispatch/20260101/202601010003.disp"],
    "find_seq3": ["find", "--sequence", "3"],
    "find_id6_json": ["find", "--id", "client-id-6", "--json"],
    "find_seq7": ["find", "--sequence", "7"],
    "find_seq5_json": ["find", "--sequence", "5", "--json"],
    "stats": ["stats", "--now", "2026-01-01T00:03:30Z"],
    "stats_range_json": ["stats", "--json", "--from", "2026-01-01T00:02:00Z", "--to", str(T0 + 240_000)],
}


@pytest.mark.parametrize("damage", ["clean", "torn", "flipped"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_golden(folders, capsys, damage, case):
    root = folders[damage]
    code, out = _run(CASES[case] + ["--data-dir", root], capsys)
    got = f"$ qdelay inspect {' '.join(CASES[case])}\nexit {code}\n{out}"
    path = os.path.join(GOLDEN, f"{damage}__{case}.txt")
    if UPDATE or not os.path.exists(path):
        os.makedirs(GOLDEN, exist_ok=True)
        with open(path, "w") as f:
            f.write(got)
        if not UPDATE:
            pytest.fail(f"wrote the missing golden file {os.path.basename(path)}; review and rerun")
    with open(path) as f:
        assert got == f.read()


def test_verify_exit_codes_and_offsets(folders, capsys):
    assert _run(["verify", "--data-dir", folders["clean"]], capsys)[0] == 0
    code, out = _run(["verify", "--data-dir", folders["flipped"]], capsys)
    assert code == 1
    assert "BAD message/00000000000000000000.wal offset 86: record of 16711764 bytes runs past" in out
    assert "BAD schedule/20260101/202601010001.sched offset 0: checksum mismatch" in out
    assert "sequence 3 after 1" in out  # the lost record leaves a gap in the message log
    code, out = _run(["verify", "--data-dir", folders["torn"]], capsys)
    assert code == 1 and "torn tail" in out and "202601010003.sched" not in out


def test_verify_one_segment(folders, capsys):
    root = folders["flipped"]
    code, out = _run(["verify", "--data-dir", root, "schedule/20260101/202601010002.sched"], capsys)
    assert code == 0 and "OK: 1 segment, 2 records, " in out
    seg = os.path.join(root, "schedule", "20260101", "202601010001.sched")
    code, out = _run(["verify", "--data-dir", root, seg], capsys)
    assert code == 1 and out.count("BAD") == 1


@pytest.mark.parametrize("damage", ["clean", "torn", "flipped"])
def test_find_sequence_shortcut_agrees(folders, damage):
    """``find --sequence`` skips to the records (tools/inspect.py ``sequence_shortcut``) or,
    where the folder does not allow it, reads everything; either way the same lives."""
    from qdelay.tools import inspect

    root = folders[damage]
    for seq in range(10):
        assert inspect.find_life(root, sequence=seq) == inspect.find_life(root, sequence=seq, shortcut=False)


def test_find_unknown(folders, capsys):
    assert _run(["find", "--data-dir", folders["clean"], "--id", "nope"], capsys) == (1, "no message with id nope\n")


def _tree_digest(root: str) -> dict[str, str]:
    out = {}
    for d, _dirs, files in os.walk(root):
        for name in files:
            p = os.path.join(d, name)
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def test_read_only(tmp_path, capsys):
    """No subcommand changes a byte, creates or removes a file, even on a damaged folder."""
    root = _build(str(tmp_path / "f"), "flipped")
    byte_surgery.truncate_at(os.path.join(root, "message", "00000000000000000342.wal"), 200)
    before = _tree_digest(root)
    for argv in CASES.values():
        _run(argv + ["--data-dir", root], capsys)
    assert _tree_digest(root) == before


def test_dump_survives_a_closed_pipe(tmp_path):
    root = str(tmp_path / "big")
    b = datafolder.DataFolderBuilder(root)
    b.send_many([("bulk.s", b"p" * 200, T0 + 60_000, T0) for _ in range(3000)])
    b.iterate(at_ms=T0)
    b.close()
    proc = subprocess.run(
        f"{sys.executable} -m qdelay.cli inspect dump --data-dir {root} | head -n 2",
        shell=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0
    assert len(proc.stdout.splitlines()) == 2
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("flag", ["--from", "--to", "--now"])
def test_a_bad_time_is_a_usage_error_not_a_traceback(folders, flag):
    """`qdelay inspect stats --from yesterday` printed a Python traceback (ValueError:
    Invalid isoformat string); now it is argparse's usage error, exit 2, saying what a time
    looks like. The golden stats cases show that good times parse as before."""
    proc = subprocess.run(
        [sys.executable, "-m", "qdelay.cli", "inspect", "stats", "--data-dir", folders["clean"], flag, "yesterday"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert "Traceback" not in proc.stderr, proc.stderr
    assert f"argument {flag}: 'yesterday' is not a time: give epoch ms or ISO 8601, e.g. 2026-01-01T00:00:00Z" in (
        proc.stderr
    )


@pytest.mark.parametrize(
    "argv, want",
    [
        (["dump", "--limit", "-1"], "argument --limit: '-1' is not a positive number of records"),
        (["dump", "--limit", "0"], "argument --limit: '0' is not a positive number of records"),
        (["verify", "--scale-minutes", "7"], "argument --scale-minutes: '7' minutes does not divide a day"),
        (["find"], "one of the arguments --id --sequence is required"),
        (["find", "--id", "msg-0003", "--sequence", "3"], "argument --sequence: not allowed with argument --id"),
    ],
)
def test_bad_arguments_are_usage_errors(folders, argv, want):
    """Walking the operator's side: ``dump --limit -1`` (or 0) printed nothing and exited 0,
    as on an empty folder; ``verify --scale-minutes 7`` (not a bucket width a server
    accepts) reported every good schedule record as in the wrong minute, exit 1; ``find``
    with neither or both of --id/--sequence exited 1, the code for "nothing matches". Each
    is argparse's usage error now (exit 2, nothing on stdout)."""
    proc = subprocess.run(
        [sys.executable, "-m", "qdelay.cli", "inspect", argv[0], "--data-dir", folders["clean"], *argv[1:]],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stdout == "", (proc.returncode, proc.stdout)
    assert want in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_limit_and_missing_folder(folders, capsys, tmp_path):
    code, out = _run(["dump", "--data-dir", folders["clean"], "--limit", "1", "--log", "dispatch"], capsys)
    assert code == 0 and len(out.splitlines()) == 1 and '"kind": "DISPATCH"' in out
    assert cli.main(["inspect", "ls", "--data-dir", str(tmp_path / "absent")]) == 2
    capsys.readouterr()


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_only_on_a_terminal():
    tty, plain = _Tty(), io.StringIO()
    for stream in (tty, plain):
        p = Progress(10_000_000, "scan", stream=stream, delay=0)
        for _ in range(5):
            p.advance(2_000_000)
            p._last_draw = 0  # no rate limit in the test
        p.close()
    assert "scan [" in tty.getvalue() and "100.0%" in tty.getvalue()
    assert plain.getvalue() == ""
