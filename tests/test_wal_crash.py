"""kill -9 at random instants: every acknowledged append survives, in order, without gaps.

A child process (tests/wal_child.py) appends from several threads through group commit
and prints each sequence once ``append`` returned. The parent kills it with SIGKILL at a
random moment, reopens the log (running recovery), and checks:

- the log holds sequences 1..last with no gap, in file order;
- every sequence the child acknowledged is among them;
- the next child continues the sequence after ``last``.

Small segments make rolls (and crashes in the middle of a roll) frequent.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time

from qdelay.segments.wal import MessageLog

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "wal_child.py")
TRIALS = 24
THREADS = 6
SEGMENT_BYTES = 64 * 1024


def run_child_until_killed(directory: str, seed: int) -> tuple[int, list[int]]:
    """Start a child, kill it with SIGKILL after a random time; (its start sequence, its acks)."""
    rng = random.Random(seed)
    child = subprocess.Popen(
        [sys.executable, CHILD, directory, str(THREADS), str(SEGMENT_BYTES)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    lines: list[bytes] = []
    ready = threading.Event()

    def drain() -> None:
        for line in child.stdout:
            lines.append(line)
            ready.set()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        assert ready.wait(30), f"child never became ready: {child.stderr.read().decode()}"
        # kill somewhere in the first ~150 ms of appending, sometimes at once
        time.sleep(rng.choice([0.0, rng.uniform(0.0, 0.03), rng.uniform(0.02, 0.15)]))
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        reader.join(10)
        child.stdout.close()
        child.stderr.close()
    assert child.returncode == -signal.SIGKILL
    assert lines and lines[0].startswith(b"ready "), lines[:1]
    start = int(lines[0].split()[1])
    # the kill may cut the last line short: only whole lines count as acknowledged
    acks = [int(line.split()[1]) for line in lines[1:] if line.endswith(b"\n")]
    return start, acks


def recovered_sequences(directory: str) -> list[int]:
    log = MessageLog(directory, segment_bytes=SEGMENT_BYTES)
    try:
        seqs = []
        offset = log.first_offset
        while True:
            frames, offset = log.read(offset)
            if not frames:
                break
            seqs.extend(f.sequence for f in frames)
        assert log.committed_sequence == (seqs[-1] if seqs else 0)
        return seqs
    finally:
        log.close()


def test_acknowledged_appends_survive_sigkill(tmp_path):
    directory = str(tmp_path / "message")
    seed = random.randrange(1 << 30)
    last = 0
    total_acks = 0
    for trial in range(TRIALS):
        start, acks = run_child_until_killed(directory, seed + trial)
        assert start == last, f"trial {trial} (seed {seed}): child started at {start}, log ended at {last}"
        assert all(a > last for a in acks), f"trial {trial}: a sequence was handed out twice"
        seqs = recovered_sequences(directory)
        assert seqs == list(range(1, len(seqs) + 1)), f"trial {trial} (seed {seed}): gap or disorder"
        missing = set(acks) - set(seqs)
        assert not missing, f"trial {trial} (seed {seed}): acknowledged but lost: {sorted(missing)[:10]}"
        last = len(seqs)
        total_acks += len(acks)
    assert total_acks > TRIALS  # the children really appended
    assert len(os.listdir(directory)) > 2  # and rolled segments
