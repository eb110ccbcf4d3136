"""kill -9 a real scheduler process at random instants (tests/scheduler_child.py).

50,000 messages due over the next 30 s; the child is SIGKILLed at random instants (at
least 10 trials; two of them kill themselves right after the schedule fsync and before
the checkpoint) and restarted on the same folder until everything is due; a last run
lets the rest drain. Then, over every line every run printed:

- every acknowledged send (``S``) that no cancel was attempted on is delivered;
- no delivery before its due time;
- a message is delivered again only if its previous delivery was in flight at a kill
  (printed within ``IN_FLIGHT_MS`` before the process died: its ack record may not
  have been fsynced) — never twice within one run;
- a message whose cancel was acknowledged as CANCELLED is never delivered after it.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict

import pytest

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scheduler_child.py")
COUNT = 50_000
WINDOW_MS = 30_000
MIN_TRIALS = 10
IN_FLIGHT_MS = 2_000  # the dispatch log is fsynced a few ms after an ack; generous for slow CI
CANCEL_EVERY = 250  # as in scheduler_child.py


class Run:
    def __init__(self, index: int) -> None:
        self.index = index
        self.lines: list[str] = []
        self.died_at_ms = 0
        self.self_killed = False


def start_child(
    data_dir: str, base: int, start: int, seed: int, die_k: int = 0
) -> tuple[subprocess.Popen, list, threading.Event, threading.Thread]:
    env = dict(os.environ)
    env.pop("QDELAY_TEST_DIE_AFTER_SCHEDULE_SYNC", None)
    if die_k:
        env["QDELAY_TEST_DIE_AFTER_SCHEDULE_SYNC"] = str(die_k)
    child = subprocess.Popen(
        [sys.executable, CHILD, data_dir, str(base), str(WINDOW_MS), str(COUNT), str(start), str(seed)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    lines: list[str] = []
    ready = threading.Event()

    def drain() -> None:
        for line in child.stdout:
            if line.endswith("\n"):  # a line cut by the kill was never completed
                lines.append(line)
                if line.startswith("R "):
                    ready.set()
        ready.set()

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    return child, lines, ready, t


def finish(child, reader) -> str:
    child.wait(30)
    reader.join(30)
    err = child.stderr.read()
    child.stdout.close()
    child.stderr.close()
    return err


def next_index(runs: list[Run]) -> int:
    best = -1
    for run in runs:
        for line in run.lines:
            if line.startswith("S "):
                best = max(best, int(line.split()[2]))
    return best + 1


@pytest.mark.slow
def test_sigkill_at_random_instants(tmp_path):
    seed = int(os.environ.get("QDELAY_TEST_SEED") or random.randrange(1 << 30))
    rng = random.Random(seed)
    data_dir = str(tmp_path / "data")
    base = int(time.time() * 1000) + 3_000
    end = base + WINDOW_MS
    runs: list[Run] = []
    die_trials = {0, rng.randrange(1, 4)}
    trial = 0
    while trial < MIN_TRIALS or time.time() * 1000 < end + 500:
        run = Run(trial)
        die_k = rng.randrange(2, 8) if trial in die_trials else 0
        if die_k and next_index(runs) > COUNT // 2:
            # the hook fires at a checkpoint, and checkpoints follow copying: a child with
            # little left to send may never reach its k-th one (trial 0 always does)
            die_k = 0
        child, run.lines, ready, reader = start_child(data_dir, base, next_index(runs), seed, die_k)
        assert ready.wait(60), "child never started"
        wait = rng.choice([rng.uniform(0.05, 0.5), rng.uniform(0.5, 3.0), rng.uniform(0.5, 3.0)])
        if die_k:
            wait = 15.0  # the child kills itself at its die_k-th checkpoint
        try:
            child.wait(wait)
        except subprocess.TimeoutExpired:
            pass
        if child.poll() is None:
            child.send_signal(signal.SIGKILL)
        else:
            run.self_killed = True
        run.died_at_ms = int(time.time() * 1000)
        err = finish(child, reader)
        assert child.returncode == -signal.SIGKILL, f"trial {trial} (seed {seed}): {err[-3000:]}"
        if die_k:
            assert run.self_killed, f"the die-after-schedule-sync hook never fired (seed {seed})"
        runs.append(run)
        trial += 1

    # the last run: let everything drain
    run = Run(trial)
    child, run.lines, ready, reader = start_child(data_dir, base, next_index(runs), seed)
    assert ready.wait(60)
    deadline = time.time() + 60
    try:
        while time.time() < deadline:
            if any(line.startswith("SENT") for line in run.lines) and _complete(runs + [run]):
                time.sleep(1.0)  # a moment more to catch late duplicates
                break
            time.sleep(0.2)
    finally:
        child.send_signal(signal.SIGKILL)
        run.died_at_ms = int(time.time() * 1000)
        err = finish(child, reader)
    runs.append(run)
    _check(runs, seed, err)


def _parse(runs):
    sends: dict[int, tuple[int, int]] = {}  # seq -> (index, due)
    cancels: dict[int, tuple[str, int]] = {}  # seq -> (outcome, time)
    deliveries: dict[int, list[tuple[int, int, int, int]]] = defaultdict(list)  # seq -> (run, attempt, due, now)
    for run in runs:
        for line in run.lines:
            p = line.split()
            if p[0] == "S":
                sends[int(p[1])] = (int(p[2]), int(p[3]))
            elif p[0] == "C":
                cancels[int(p[1])] = (p[2], int(p[3]))
            elif p[0] == "D":
                deliveries[int(p[1])].append((run.index, int(p[3]), int(p[4]), int(p[5])))
    return sends, cancels, deliveries


def _complete(runs) -> bool:
    sends, cancels, deliveries = _parse(runs)
    for seq, (i, _due) in sends.items():
        if i % CANCEL_EVERY == 7:
            continue
        if seq not in deliveries:
            return False
    return True


def _check(runs, seed, err):
    sends, cancels, deliveries = _parse(runs)
    ctx = f"(seed {seed}, {len(runs)} runs)"
    assert len({i for i, _ in sends.values()}) == COUNT, f"not every message was sent {ctx}: {err[-2000:]}"
    died = {r.index: r.died_at_ms for r in runs}
    missing = [seq for seq, (i, _d) in sends.items() if i % CANCEL_EVERY != 7 and seq not in deliveries]
    assert not missing, f"{len(missing)} acknowledged sends never delivered, e.g. {missing[:10]} {ctx}"
    early, bad_dups = [], []
    for seq, ds in deliveries.items():
        for _run, _attempt, due, now in ds:
            if now < due:
                early.append((seq, due, now))
            if seq in sends:
                assert due == sends[seq][1], (seq, due, sends[seq])
        for prev, cur in zip(ds, ds[1:]):
            same_run = prev[0] == cur[0]
            in_flight = prev[3] >= died[prev[0]] - IN_FLIGHT_MS
            if same_run or not in_flight:
                bad_dups.append((seq, prev, cur, died[prev[0]]))
    assert not early, f"{len(early)} deliveries before their due time: {early[:10]} {ctx}"
    assert not bad_dups, f"{len(bad_dups)} duplicates not explained by a kill: {bad_dups[:5]} {ctx}"
    outcomes = defaultdict(int)
    after_cancel = []
    for seq, (outcome, tc) in cancels.items():
        outcomes[outcome] += 1
        assert outcome in ("CANCELLED", "ALREADY_DELIVERED"), (seq, outcome, ctx)
        if outcome == "CANCELLED":
            late = [d for d in deliveries.get(seq, []) if d[3] >= tc]
            if late:
                after_cancel.append((seq, tc, late))
    assert not after_cancel, f"cancelled yet delivered after the cancel: {after_cancel[:5]} {ctx}"
    assert outcomes["CANCELLED"] > 0, outcomes
    total = sum(len(v) for v in deliveries.values())
    print(
        f"{len(runs)} runs, {len(sends)} acknowledged sends, {total} deliveries, "
        f"{total - len(deliveries)} duplicates, cancels {dict(outcomes)} {ctx}"
    )
