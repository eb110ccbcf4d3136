"""What each ``qdelay admin`` command costs against what it scales with.

    python -m bench.admin [--levels 0,100000,1000000] [--groups 0,100,1000] [--rounds 3]
                          [--calls 30] [--json FILE]

Every command is run through ``qdelay.replication.admin.run`` (the code ``qdelay admin``
runs, its channel made per call as the command makes it; the interpreter's start-up, ~0.3
s a command, is left out), against real servers on 127.0.0.1 with temporary folders.

For each level N of ``--levels`` (pending messages), a fresh master A and slave B (async
replication, no etcd): A is filled with N far-future messages (at least one: a Snapshot needs
the iterate checkpoint a first write makes) (a day ahead, 60,000 a
minute, each its own id), B catches up, then:

- ``status --servers A,B`` (``--calls`` times: both servers' Replication.Status);
- ``resync --data-dir NEW --master A`` (``--rounds`` times, each into a new folder): the
  Snapshot stream of every pending minute, written and fsynced; seconds, MB, µs per
  pending message;
- ``--rounds`` hand-overs, each: ``fence --target M --epoch e+1 --master S`` of the
  current master M (it stops dispatching), ``promote --target S --force --min-epoch e+1``
  of its slave S, the time from the promotion's answer to the first write S accepts,
  then M restarted as a slave of S (``--role slave --master S``, the runbook) and the time
  until it has caught up (not an admin command: what a hand-over costs after it);
- on the last master, with G of ``--groups`` groups existing (over 100 subjects):
  ``group create`` and ``group delete`` of a new group (``--calls`` each), ``group list``
  (every group, and one subject's; ``--calls`` each).

For each: wall time per command (median of its calls or rounds) and the servers' CPU per
command (A and B, user + system; the mean over the calls, as CPU times tick by 10 ms).
Flat in N is the expectation except where a command copies or lists what N counts (resync
copies every pending minute; an unfiltered group list lists every group). Writes
bench/out/admin.json (or ``--json``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable

import psutil

from bench.common import machine, median, print_table, until_idle, write_json

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from serverproc import ServerProc  # noqa: E402

from qdelay import errors  # noqa: E402
from qdelay.client import Client, Outgoing  # noqa: E402
from qdelay.replication import admin  # noqa: E402

DAY_MS = 86_400_000
_PARSER = argparse.ArgumentParser(prog="qdelay admin")
admin.add_arguments(_PARSER)


def run_admin(*argv: str) -> str:
    """``qdelay admin ARGV`` in this process; its output (an exit code other than 0 raises)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = admin.run(_PARSER.parse_args(list(argv)))
    if code != 0:
        raise RuntimeError(f"qdelay admin {' '.join(argv)} exited {code}: {out.getvalue()}{err.getvalue()}")
    return out.getvalue()


def server_cpu(procs: list[ServerProc]) -> float:
    total = 0.0
    for p in procs:
        t = psutil.Process(p.pid).cpu_times()
        total += t.user + t.system
    return total


def timed(procs: list[ServerProc], work: Callable[..., object], *args: str) -> tuple[float, float]:
    """(wall ms, servers' CPU ms) of one call ``work(*args)``."""
    c0 = server_cpu(procs)
    t0 = time.perf_counter()
    work(*args)
    wall = (time.perf_counter() - t0) * 1000
    return wall, (server_cpu(procs) - c0) * 1000


def summary(samples: list[tuple[float, float]]) -> dict[str, float]:
    return {
        "ms": median([w for w, _c in samples]),
        "cpu_ms": sum(c for _w, c in samples) / len(samples),  # a mean: CPU times tick by 10 ms
        "max_ms": max(w for w, _c in samples),
        "n": len(samples),
    }


def status_of(address: str) -> dict:
    return json.loads(run_admin("status", "--servers", address, "--json"))[address]


def wait_caught_up(master: str, slave: str, timeout: float = 300.0) -> float:
    """Seconds until the slave is connected and has the master's whole message log."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        try:
            m, s = status_of(master), status_of(slave)
        except RuntimeError:
            time.sleep(0.05)
            continue
        if s.get("connected") and int(s.get("end_offset", 0)) == int(m.get("end_offset", -1)):
            return time.perf_counter() - t0
        time.sleep(0.05)
    raise RuntimeError(f"{slave} did not catch up with {master} in {timeout} s")


def first_write(address: str, timeout: float = 60.0) -> float:
    """Seconds until ``address`` accepts a write."""
    t0 = time.perf_counter()
    with Client(address, retries=0, batching=False, timeout=2.0) as c:
        while True:
            try:
                c.send("bench.admin", b"after", delay_ms=DAY_MS)
                return time.perf_counter() - t0
            except errors.QdelayError:
                if time.perf_counter() - t0 > timeout:
                    raise
                time.sleep(0.005)


def fill(address: str, n: int, base: int) -> None:
    with Client(address, timeout=600) as c:
        c.send_many(
            (Outgoing("bench.far", b"x" * 100, deliver_at_ms=base + i, message_id=f"far{i}") for i in range(n)),
            batch_size=1000,
            max_in_flight=8,
            timeout=600,
        )


def level(root: str, n: int, groups: list[int], rounds: int, calls: int) -> dict:
    base = (int(time.time() * 1000) // 60_000 + 60) * 60_000 + DAY_MS
    a = ServerProc(os.path.join(root, "a")).start()
    b = ServerProc(os.path.join(root, "b"), args=["--role", "slave", "--master", a.address]).start()
    procs = [a, b]
    row: dict = {"pending": n}
    try:
        t0 = time.perf_counter()
        fill(a.address, max(n, 1), base)  # at least one: a snapshot needs the iterate checkpoint
        row["fill_s"] = time.perf_counter() - t0
        wait_caught_up(a.address, b.address)
        for p in procs:
            until_idle(p.pid, 120.0)

        servers = f"{a.address},{b.address}"
        row["status"] = summary([timed(procs, run_admin, "status", "--servers", servers) for _ in range(calls)])

        samples, infos = [], []
        for r in range(rounds):
            target = os.path.join(root, f"resync{r}")
            before = server_cpu(procs)
            t0 = time.perf_counter()
            infos.append(json.loads(run_admin("resync", "--data-dir", target, "--master", a.address, "--json")))
            samples.append(((time.perf_counter() - t0) * 1000, (server_cpu(procs) - before) * 1000))
            shutil.rmtree(target, ignore_errors=True)
        row["resync"] = summary(samples) | {"mb": infos[-1]["bytes"] / 1e6, "files": infos[-1]["files"]}

        master, slave = a, b
        fences, promotes, writes, rejoins = [], [], [], []
        for _ in range(rounds):
            epoch = str(int(status_of(master.address).get("epoch", 0)) + 1)
            fences.append(
                timed(
                    procs, run_admin, "fence", "--target", master.address, "--epoch", epoch, "--master", slave.address
                )
            )
            promotes.append(
                timed(procs, run_admin, "promote", "--target", slave.address, "--force", "--min-epoch", epoch)
            )
            writes.append(first_write(slave.address) * 1000)
            # the runbook: the old master comes back as a slave of the new one
            master.stop()
            master.args = ["--role", "slave", "--master", slave.address]
            t0 = time.perf_counter()
            master.start()
            wait_caught_up(slave.address, master.address)
            rejoins.append((time.perf_counter() - t0) * 1000)
            master, slave = slave, master
            for p in procs:
                until_idle(p.pid, 60.0)
        row["fence"] = summary(fences)
        row["promote"] = summary(promotes)
        row["first_write_ms"] = median(writes)
        row["rejoin_ms"] = median(rejoins)

        row["groups"] = {}
        made = 0
        m = master.address
        with Client(m) as c:
            for g in groups:
                while made < g:  # over 100 subjects
                    c.create_group(f"bench.g{made % 100}", f"g{made}")
                    made += 1
                for p in procs:
                    until_idle(p.pid, 30.0)
                new = [f"n{g}.{i}" for i in range(calls)]
                group = ["group", "create", "--server", m, "--subject", "bench.new", "--group"]
                creates = [timed(procs, run_admin, *group, name) for name in new]
                group[1] = "delete"
                deletes = [timed(procs, run_admin, *group, name) for name in new]
                lists = [timed(procs, run_admin, "group", "list", "--server", m) for _ in range(calls)]
                one = [
                    timed(procs, run_admin, "group", "list", "--server", m, "--subject", "bench.g1")
                    for _ in range(calls)
                ]
                row["groups"][str(g)] = {
                    "create": summary(creates),
                    "delete": summary(deletes),
                    "list": summary(lists),
                    "list_one_subject": summary(one),
                }
    finally:
        for p in procs:
            if p.alive():
                p.stop()
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.admin", description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default="0,100000,1000000", help="pending messages N, comma-separated")
    ap.add_argument("--groups", default="0,100,1000", help="existing groups G for the group commands, ascending")
    ap.add_argument("--rounds", type=int, default=3, help="resyncs and hand-overs per level")
    ap.add_argument("--calls", type=int, default=30, help="calls of status and of each group command")
    ap.add_argument("--json", default="admin", help="output name under bench/out, or a path")
    args = ap.parse_args(argv)
    started = machine()
    rows = []
    for n in [int(x) for x in args.levels.split(",") if x]:
        with tempfile.TemporaryDirectory(prefix="qdelay-bench-admin-") as root:
            rows.append(level(root, n, sorted(int(x) for x in args.groups.split(",") if x), args.rounds, args.calls))
        print(f"pending {n:,}: done", flush=True)
    table = []
    for r in rows:
        for op in ("status", "resync", "fence", "promote"):
            s = r[op]
            extra = f"{s['mb']:.1f} MB, {s['files']} files" if op == "resync" else ""
            table.append([op, r["pending"], "-", s["ms"], s["max_ms"], s["cpu_ms"], s["n"], extra])
        table.append(["first write after promote", r["pending"], "-", r["first_write_ms"], "-", "-", "-", ""])
        table.append(["old master rejoins, caught up", r["pending"], "-", r["rejoin_ms"], "-", "-", "-", ""])
        for g, ops in r["groups"].items():
            for op, s in ops.items():
                table.append(
                    [
                        f"group {op.replace('_', ' ')}",
                        r["pending"],
                        int(g),
                        s["ms"],
                        s["max_ms"],
                        s["cpu_ms"],
                        s["n"],
                        "",
                    ]
                )
    print_table(
        ["command", "pending N", "groups G", "ms (median)", "max ms", "servers CPU ms (mean)", "calls", ""],
        table,
        title="qdelay admin commands against pending messages and groups",
    )
    write_json(args.json, {"machine": started, "machine_end": machine(), "params": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
