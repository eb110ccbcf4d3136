"""How often each server thread is woken per batch under ingest, and its CPU a message.

    python -m bench.wakeups [--messages 200000] [--rounds 3] [--tree A=DIR --tree B=DIR]

Runs the ``send_many`` 100 x 16 shape of bench.ingest (Outgoing tuples, due 10-11 min
ahead) against a fresh ``qdelay server`` and reads, around the run, each server thread's
context switches (``/proc/<pid>/task/<tid>/status``: voluntary = it blocked and was woken
again, nonvoluntary = preempted) and CPU time, by OS name (qdelay/threads.py). Printed a
batch of 100 (switches) and a message (µs).

``--tree NAME=DIR`` (repeatable) runs the server from another source tree (a tree of links
laid out as the installed package, ``DIR/qdelay``, put first on the server's PYTHONPATH),
alternating the trees round by round, in an order drawn at random each round: an A/B of
two versions in one run.

``QDELAY_BENCH_PROFILE=COMMAND`` runs COMMAND (``{pid}``: the server's) 0.3 s into each main
run and waits for it at the end of the run, e.g. ``perf record -e sched:sched_switch
--call-graph dwarf,8192 -p {pid} -o FILE -- sleep 0.7`` to see why each thread blocks
(docs/benchmarks.md, "Thread wake-ups a batch under ingest"), or ``py-spy record``.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile

from bench.common import machine, median, thread_cpu_by_name
from bench.ingest import CTX
from bench.peers import QdelayDriver


def thread_switches_by_name(pid: int) -> dict[str, tuple[int, int]]:
    """(voluntary, nonvoluntary) context switches so far of a process's threads by OS name
    (pools summed, as ``thread_cpu_by_name``)."""
    import re

    out: dict[str, tuple[int, int]] = {}
    root = f"/proc/{pid}/task"
    for tid in os.listdir(root):
        try:
            with open(f"{root}/{tid}/status") as f:
                text = f.read()
        except OSError:
            continue
        name = re.search(r"^Name:\s*(.*)$", text, re.M)[1].strip()  # type: ignore[index]
        vol = int(re.search(r"^voluntary_ctxt_switches:\s*(\d+)", text, re.M)[1])  # type: ignore[index]
        non = int(re.search(r"^nonvoluntary_ctxt_switches:\s*(\d+)", text, re.M)[1])  # type: ignore[index]
        if int(tid) == pid:
            name = "main"
        else:
            name = re.sub(r"^Thread-\d+ \(", "", name).rstrip(")").rstrip("0123456789").rstrip("_-") or name
        v0, n0 = out.get(name, (0, 0))
        out[name] = (v0 + vol, n0 + non)
    return out


# a command run 0.3 s into each main run, {pid} the server's (see the module's docstring)
PROFILE = os.environ.get("QDELAY_BENCH_PROFILE", "")
FSYNCS = "qdelay_wal_fsync_seconds_count"
STEPS = "qdelay_iterate_steps"


def _producer(address: str, n: int, spread: bool, first_id: int, go, q) -> None:  # noqa: ANN001
    """send_many of Outgoing tuples, 100 x 16; due 10-11 min ahead (bench.ingest's shape) or,
    ``spread``, uniformly 1-60 min ahead (bench.compare's ingest)."""
    try:
        import random
        import time

        from qdelay.client import Client, Outgoing

        client = Client(address, retries=0, timeout=120)
        client.wait_ready()
        body = b"p" * 100
        rnd = random.Random(first_id)
        rel = [rnd.uniform(60_000, 3_600_000) if spread else 600_000 + i % 60_000 for i in range(n)]
        q.put("ready")
        go.wait(60)
        now = int(time.time() * 1000)
        start = time.time()
        cpu0 = time.process_time()
        client.send_many(
            (Outgoing("bench", body, now + int(rel[i]), None, str(first_id + i)) for i in range(n)),
            batch_size=100,
            max_in_flight=16,
        )
        q.put(dict(start=start, end=time.time(), cpu=time.process_time() - cpu0, n=n))
        client.close()
    except BaseException as e:  # noqa: BLE001 - report to the parent
        q.put(dict(error=repr(e)))


def _metric(gauges: dict[str, float], name: str) -> float:
    return gauges.get(name, gauges.get(name + "_total", 0.0))


def run(driver: QdelayDriver, n: int, offset: int, spread: bool = False) -> dict:
    q = CTX.Queue()
    go = CTX.Event()
    p = CTX.Process(target=_producer, daemon=True, args=(f"127.0.0.1:{driver.port}", n, spread, offset, go, q))
    p.start()
    assert q.get(timeout=120) == "ready"
    g0 = driver.gauges()
    sw0 = thread_switches_by_name(driver.pid)
    cpu0 = thread_cpu_by_name(driver.pid)
    go.set()
    perf = None
    if PROFILE and n >= 100_000:
        import shlex
        import subprocess
        import time

        time.sleep(0.3)
        perf = subprocess.Popen(shlex.split(PROFILE.format(pid=driver.pid)))
    res = q.get(timeout=900)
    if perf is not None:
        perf.wait(60)
    sw1 = thread_switches_by_name(driver.pid)
    cpu1 = thread_cpu_by_name(driver.pid)
    g1 = driver.gauges()
    p.join(30)
    if "error" in res:
        raise RuntimeError(res["error"])
    batches = n / 100
    threads = {}
    for name in sw1:
        v = (sw1[name][0] - sw0.get(name, (0, 0))[0]) / batches
        nv = (sw1[name][1] - sw0.get(name, (0, 0))[1]) / batches
        us = (cpu1.get(name, 0) - cpu0.get(name, 0)) / 1e3 / n
        if v + nv >= 0.005 or us >= 0.005:
            threads[name] = (round(v, 3), round(nv, 3), round(us, 3))
    return dict(
        msgs_per_s=round(n / (res["end"] - res["start"])),
        server_us=round(sum(t[2] for t in threads.values()), 2),
        client_us=round(res["cpu"] * 1e6 / n, 2),
        threads=threads,
        # group commits (fdatasyncs of the message log) and iterate steps a batch
        commits=round((_metric(g1, FSYNCS) - _metric(g0, FSYNCS)) / batches, 3),
        steps=round((_metric(g1, STEPS) - _metric(g0, STEPS)) / batches, 3),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=DIR")
    parser.add_argument("--spread", action="store_true", help="due 1-60 min ahead (bench.compare's ingest)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    trees = [tuple(t.split("=", 1)) for t in args.tree] or [("this", "")]
    print(f"load {os.getloadavg()}, {machine().get('cpus', '')}", flush=True)
    got: dict[str, list[dict]] = {name: [] for name, _ in trees}
    for r in range(args.rounds):
        # each round's order drawn at random: in a fixed order the server started second in a
        # round ran a few per cent cheaper whatever it ran (docs/benchmarks.md, "The server's
        # gRPC listener without the EventEngine"), which a fixed A-then-B order adds to B
        order = list(trees)
        random.Random(r).shuffle(order)
        for name, tree in order:
            workdir = tempfile.mkdtemp(prefix="qdbench-wake-")
            driver = QdelayDriver(extra=[a for kv in args.set for a in ("--set", kv)])
            if tree:
                env = dict(os.environ)
                env["PYTHONPATH"] = tree + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
                driver.env = env
            try:
                driver.start(workdir)
                run(driver, 20_000, 10_000_000, args.spread)  # warm-up: the first minute files, the loop's caches
                res = run(driver, args.messages, 0, args.spread)
            finally:
                driver.stop()
                shutil.rmtree(workdir, ignore_errors=True)
            res["load1"] = round(os.getloadavg()[0], 2)
            got[name].append(res)
            print(
                f"round {r} {name}: {res['msgs_per_s']} msgs/s server {res['server_us']} client "
                f"{res['client_us']} us/msg load {res['load1']}; a batch: {res['commits']} commits, "
                f"{res['steps']} iterate steps",
                flush=True,
            )
            for t, (v, nv, us) in sorted(res["threads"].items(), key=lambda kv: -kv[1][2]):
                print(f"    {t:16s} vol {v:7.3f} nonvol {nv:7.3f} /batch  cpu {us:6.3f} us/msg")
    print("\nmedians: voluntary / nonvoluntary switches a batch, CPU us a message, by tree")
    names = sorted({t for runs in got.values() for r in runs for t in r["threads"]})
    for name, runs in got.items():
        server = median([r["server_us"] for r in runs])
        print(f"= {name}: server {server:.2f} us/msg, {median([r['msgs_per_s'] for r in runs]):.0f} msgs/s")
    for t in names:
        cells = []
        for runs in got.values():
            vs = [r["threads"].get(t, (0, 0, 0)) for r in runs]
            cells.append(
                f"{median([v[0] for v in vs]):6.3f} / {median([v[1] for v in vs]):6.3f}"
                f"  {median([v[2] for v in vs]):6.3f}"
            )
        print(f"= {t:14s} " + "  |  ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
