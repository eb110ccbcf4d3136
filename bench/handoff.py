"""The floor of the blocking client's round with 16 threads, no server and no client code:
16 threads each block on a pre-acquired lock, one thread releases all 16 at once (as the
client's I/O loop releases a batch's callers), and each released thread hands a new
pre-acquired lock back and blocks again (as a caller comes back with its next send()); a
round ends when the last one is back. What a round costs here is what 16 CPython threads
trading the GIL cost on this machine, whatever the client does between two sends.

    .venv/bin/python -m bench.handoff                  # 3 rounds of each setting, alternating
    .venv/bin/python -m bench.handoff --rounds 5 --loops 3000

Settings: ``bare`` (nothing between two sends), ``outgoing`` (the blocking client's own
argument check of a send, ``qdelay.client.client.outgoing``, between two sends), each on
the process's CPUs and pinned to one (``os.sched_setaffinity``, set before the threads
start), and each with the two ways of waking a round's 16 threads: ``locks`` (a
``threading.Lock`` each, released one by one with the GIL held: the client before 26 Nov
11:00) and ``gates`` (a ``handoff.Gate`` each, all opened by one ``handoff.open_all`` with
the GIL released: the client since). Printed per run: µs a round, CPU µs and voluntary
context switches a message, and the msgs/s 16 threads would make if the server answered
every batch at once.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

THREADS = 16


def _one(work: str, loops: int, wake: str = "locks") -> dict:
    """One run in this process: ``loops`` rounds of 16 threads released and back, woken as
    ``wake`` says (see the module's docstring)."""
    from qdelay.client.client import outgoing
    from qdelay.client.handoff import Gate, open_all

    body = b"p" * 100
    mu = threading.Lock()
    back: list = []
    gate: list = [None]
    stop = False

    def hand_back() -> Any:
        if wake == "gates":
            lock = Gate()
        else:
            lock = threading.Lock()
            lock.acquire()
        with mu:
            back.append(lock)
            if len(back) == THREADS:
                gate[0].release()
        return lock

    def caller() -> None:
        lock = hand_back()
        while True:
            if wake == "gates":
                lock.wait(None)
            else:
                lock.acquire()
            if stop:
                return
            if work == "outgoing":
                outgoing("bench", body, None, None, None, 1_900_000_000_000, None, "id-1")
            lock = hand_back()

    first = threading.Lock()
    first.acquire()
    gate[0] = first
    threads = [threading.Thread(target=caller, daemon=True) for _ in range(THREADS)]
    for t in threads:
        t.start()
    first.acquire()  # all 16 are waiting
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(loops):
        with mu:
            locks = back[:]
            back.clear()
            done = threading.Lock()
            done.acquire()
            gate[0] = done
        if wake == "gates":
            open_all(locks)
        else:
            for lock in locks:
                lock.release()
        done.acquire()
    t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    stop = True
    with mu:
        if wake == "gates":
            open_all(back)
        else:
            for lock in back:
                lock.release()
    for t in threads:
        t.join(5)
    msgs = loops * THREADS
    return dict(
        round_us=round((t1 - t0) / loops * 1e6, 1),
        cpu_us_per_msg=round((r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) * 1e6 / msgs, 1),
        vcsw_per_msg=round((r1.ru_nvcsw - r0.ru_nvcsw) / msgs, 2),
        msgs_per_s_if_answered_at_once=round(msgs / (t1 - t0)),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--loops", type=int, default=3000, help="rounds of 16 sends a run")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:  # one run, in a fresh process (its own affinity, no threads left over)
        work, pin, wake = args.child.split(",")
        if pin == "1cpu":
            os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
        print(json.dumps(_one(work, args.loops, wake)))
        return 0
    settings = [(w, p, k) for w in ("bare", "outgoing") for p in ("all", "1cpu") for k in ("locks", "gates")]
    results: dict[str, list[dict]] = {",".join(s): [] for s in settings}
    for r in range(args.rounds):
        for setting in settings:
            key = ",".join(setting)
            out = subprocess.run(
                [sys.executable, "-m", "bench.handoff", "--child", key, "--loops", str(args.loops)],
                capture_output=True,
                text=True,
                check=True,
            )
            got = json.loads(out.stdout)
            results[key].append(got)
            w, p, k = setting
            print(f"[{r + 1}/{args.rounds}] {w:8s} cpus={p:4s} {k:5s} {got}", flush=True)
    print(f"\nmedians (load {os.getloadavg()[0]:.2f}):")
    for key, runs in results.items():
        med = {k: sorted(run[k] for run in runs)[len(runs) // 2] for k in runs[0]}
        print(f"  {key:20s} {med}")
    out_dir = Path(__file__).resolve().parent / "out"
    out_dir.mkdir(exist_ok=True)
    (out_dir / "handoff.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
