"""Replication benchmark: ingest with no slave vs async vs sync, and slave lag under load.

    python -m bench.replication [--seconds 8] [--producers 4] [--batch 100] [--rate 20000]
                                [--catchup 100000,1000000] [--catchup-minutes 1]
                                [--slaves 0,1,2,4] [--slave-rounds 3]
                                [--get-rates 0,1000,10000,50000] [--get-calls 300]
                                [--get-slave-set KEY=VALUE ...]
                                [--only ingest,lag,catchup,slaves,gets]

- ingest: ``producers`` threads each send SendBatch of ``batch`` 100-byte messages for
  ``seconds``; messages/s durable-acknowledged, for a lone master, a master with an async
  slave and a master with a sync slave (goal: sync >= 50 % of no-slave).
- lag: an async master with a slave under a steady ``rate`` msgs/s (batches every 10 ms);
  the slave's ingest-to-durable delay p99 (from Replication.Status, sampled every 0.5 s;
  goal <= 50 ms) and the master's lag in bytes.
- catchup: for each L of ``--catchup``, an async master alone given L messages (100-byte
  payloads a day ahead, over ``--catchup-minutes`` minutes, batches of 1,000), idle
  again; then a new slave on an empty folder is started and pulls the whole message log:
  the seconds from its start (listening) to having the master's end offset, µs and the
  master's and the slave's CPU per message (the slave's also until it is idle again: its
  iterate service copies what it pulled), MB/s. Copying the log is linear in it by
  design; the per-message figures should be flat in L. Then ``Frames`` (100 frames at
  the log's start, middle and end, 30 calls): p50 ms, flat in L.
- slaves: for each S of ``--slaves`` (attached slaves), ``--slave-rounds`` rounds of: an
  async master under a steady 2,000 msgs/s for 3 s (the slaves' acks change their holds,
  so the saver replaces ``checkpoint/slave_holds.ckpt`` about once a second), the slaves
  caught up, then the master stopped with SIGTERM and started again on its port (the
  slaves re-attach). Per S: the holds file's save, wall (fsyncs included) and the saving
  thread's CPU, from the server's own counters (metrics
  ``qdelay_replication_holds_save_seconds`` / ``_cpu_seconds`` / ``_saves``); the stop,
  SIGTERM to the process reaped (wall; its CPU from ``wait4``'s rusage) and the
  server's own "stopped stop_seconds=" (the drain, without the interpreter's exit).
  The master and its S slaves are S + 1 processes on the same disk: on a box with fewer
  cores than that the slaves' work competes with the master's.
- gets: Get on a slave against the replicated write rate. An async master and one slave;
  1,000 messages a day ahead sent first and copied by the slave; then for each rate N of
  ``--get-rates`` (msgs/s into the master, SendBatch every 10 ms from a separate process,
  100-byte payloads an hour ahead), ``--get-calls`` Gets one at a time of those messages,
  by receipt and by id, on the slave and on the master: p50/p99 ms and the server's CPU
  per Get. Under load the server is busy anyway: its CPU per Get is what it used during
  the Gets less its rate over the same time just before and just after them (windows of
  the same length, no Gets), so at high N single figures are +-100-200 us. A slave's Get
  waits until its iterate service has copied everything its log held at the call (its
  lookup floor): this is what that costs while replication keeps bringing records.
  ``--get-slave-set engine.iterate_gather_ms=50`` shows that the wait hurries the service
  (one step), not a gather of the slave's.

Servers are real processes on 127.0.0.1 with temporary data folders (same disk).
Writes bench/out/replication.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from bench.common import cpu_seconds, median, until_idle, write_json

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from serverproc import ServerProc  # noqa: E402

from qdelay.client import Client, Outgoing  # noqa: E402
from qdelay.v1 import replication_pb2 as rpb  # noqa: E402
from qdelay.v1 import replication_pb2_grpc as rpb_grpc  # noqa: E402


def status(address: str) -> rpb.ReplicationStatus:
    ch = grpc.insecure_channel(address)
    try:
        return rpb_grpc.ReplicationStub(ch).Status(rpb.ReplicationStatusRequest(), timeout=5)
    finally:
        ch.close()


def cluster(root: str, mode: str | None, slave_args: Sequence[str] = ()):
    a = ServerProc(os.path.join(root, "a"), args=["--replication", mode or "async"]).start()
    b = None
    if mode:
        b = ServerProc(os.path.join(root, "b"), args=["--role", "slave", "--master", a.address, *slave_args]).start()
        deadline = time.monotonic() + 20
        while not status(b.address).connected and time.monotonic() < deadline:
            time.sleep(0.05)
    return a, b


def ingest(address: str, seconds: float, producers: int, batch: int) -> float:
    counts = [0] * producers
    stop = time.monotonic() + seconds
    payload = b"x" * 100

    def run(i: int) -> None:
        with Client(address) as c:
            while time.monotonic() < stop:
                c.send_batch([c.message("bench.rep", payload, delay_ms=3_600_000) for _ in range(batch)])
                counts[i] += batch

    threads = [threading.Thread(target=run, args=(i,)) for i in range(producers)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.monotonic() - t0)


def lag(master: str, slave: str, seconds: float, rate: int) -> dict:
    per_tick = max(1, rate // 100)
    payload = b"x" * 100
    stop = time.monotonic() + seconds
    samples, lag_bytes = [], []
    sent = 0

    def sample() -> None:
        while time.monotonic() < stop:
            time.sleep(0.5)
            s, m = status(slave), status(master)
            if s.delay_p99_ms >= 0:
                samples.append(s.delay_p99_ms)
            lag_bytes.append(max(0, m.end_offset - s.end_offset))

    sampler = threading.Thread(target=sample)
    sampler.start()
    with Client(master) as c:
        t0 = time.monotonic()
        tick = 0
        while time.monotonic() < stop:
            c.send_batch([c.message("bench.lag", payload, delay_ms=3_600_000) for _ in range(per_tick)])
            sent += per_tick
            tick += 1
            wait = t0 + tick * 0.01 - time.monotonic()
            if wait > 0:
                time.sleep(wait)
        achieved = sent / (time.monotonic() - t0)
    sampler.join()
    samples.sort()
    return {
        "target_rate": rate,
        "achieved_rate": round(achieved),
        "slave_delay_p99_ms_median_window": samples[len(samples) // 2] if samples else None,
        "slave_delay_p99_ms_worst_window": samples[-1] if samples else None,
        "master_lag_bytes_max": max(lag_bytes) if lag_bytes else None,
    }


def frame_probes(frames_from: Callable[[int], Sequence[Any]], first: int, end: int, count: int = 100) -> list[int]:
    """Offsets of the log's start, middle and end for Frames of ``count`` frames: each one
    has at least ``count`` frames from it to the log's end. ``frames_from(offset)`` is a
    Frames call (frames with ``offset`` and ``size``, up to 10,000 from ``offset``)."""
    marks: list[int] = []  # per step: its first frame and the last with ``count`` after it in the step
    offset = first
    while offset < end:
        step = frames_from(offset)
        if not step:
            break
        if len(step) >= count:
            marks += [step[0].offset, step[-count].offset]
        offset = step[-1].offset + step[-1].size
    if not marks:
        raise RuntimeError(f"the log holds fewer than {count} frames")
    return [marks[0], marks[len(marks) // 2], marks[-1]]


def catchup(root: str, messages: int, minutes: int = 1) -> dict:
    """A new slave's catch-up on a master holding ``messages`` in its log, due over
    ``minutes`` minutes a day ahead."""
    a = ServerProc(os.path.join(root, "a"), args=["--replication", "async"]).start()
    b = None
    try:
        with Client(a.address, timeout=600) as c:
            due = int(time.time() * 1000) + 86_400_000
            c.send_many(
                (
                    Outgoing("bench.catchup", b"x" * 100, deliver_at_ms=due + i % minutes * 60_000)
                    for i in range(messages)
                ),
                batch_size=1000,
                max_in_flight=8,
            )
        until_idle(a.pid, 120.0)
        end = status(a.address).end_offset
        cpu_a = cpu_seconds(a.pid)
        t0 = time.perf_counter()
        b = ServerProc(os.path.join(root, "b"), args=["--role", "slave", "--master", a.address]).start()
        started = time.perf_counter() - t0
        cpu_b = cpu_seconds(b.pid)  # its start-up (the interpreter, opening the folder) left out
        t1 = time.perf_counter()
        deadline = t1 + 600
        while True:
            try:
                got = status(b.address)
                if got.connected and got.end_offset >= end:
                    break
            except grpc.RpcError:
                pass
            if time.perf_counter() > deadline:
                raise RuntimeError(f"the slave did not catch up with {end} bytes in 600 s")
            time.sleep(0.01)
        took = time.perf_counter() - t1
        cpu_caught = cpu_seconds(b.pid) - cpu_b
        master_cpu = cpu_seconds(a.pid) - cpu_a
        settle = until_idle(b.pid, 300.0)  # its iterate service copying what it pulled
        # Frames (what a slave asks to find where its log and the master's fork): 100 frames
        # at the log's start, middle and end, one call at a time
        lat = []
        ch = grpc.insecure_channel(a.address)
        try:
            stub = rpb_grpc.ReplicationStub(ch)
            first = stub.Frames(rpb.FramesRequest(offset=0, max_frames=1), timeout=10).frames[0].offset
            probes = frame_probes(
                lambda off: stub.Frames(rpb.FramesRequest(offset=off, max_frames=10_000), timeout=30).frames,
                first,
                end,
            )
            for off in probes * 10:
                t2 = time.perf_counter()
                got_frames = stub.Frames(rpb.FramesRequest(offset=off, max_frames=100), timeout=10)
                lat.append((time.perf_counter() - t2) * 1000)
                if len(got_frames.frames) != 100:
                    raise RuntimeError(f"Frames at {off} answered {len(got_frames.frames)} frames, not 100")
        finally:
            ch.close()
        lat.sort()
        return {
            "messages": messages,
            "log_mb": round(end / 1e6, 1),
            "slave_start_s": round(started, 3),
            "catchup_s": round(took, 3),
            "us_per_msg": round(took / messages * 1e6, 2),
            "mb_per_s": round(end / 1e6 / took, 1),
            "master_cpu_us_per_msg": round(master_cpu / messages * 1e6, 2),
            "slave_cpu_us_per_msg": round(cpu_caught / messages * 1e6, 2),
            "slave_settle_s": round(settle, 2),
            "frames_p50_ms": round(lat[len(lat) // 2], 3),
            "slave_cpu_until_idle_us_per_msg": round((cpu_seconds(b.pid) - cpu_b) / messages * 1e6, 2),
        }
    finally:
        for s in (b, a):
            if s is not None:
                s.stop()


def _metrics(srv: ServerProc, names: Sequence[str]) -> dict[str, float]:
    """The unlabelled metrics ``names`` of a server started with --metrics-listen."""
    import urllib.request

    port = int(srv.tail_log(1_000_000).rsplit("metrics on 127.0.0.1:", 1)[1].split()[0])
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            out[name] = float(value)
    return out


HOLDS = (
    "qdelay_replication_holds_saves_total",
    "qdelay_replication_holds_save_seconds_total",
    "qdelay_replication_holds_save_cpu_seconds_total",
)


def _until(cond: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = cond()
            if got:
                return got
        except grpc.RpcError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def _sigterm_timed(srv: ServerProc) -> tuple[float, float]:
    """SIGTERM to the process reaped: (wall s, CPU s of the stop, from wait4's rusage less
    what /proc said just before the signal: +-10 ms, its clock ticks)."""
    import signal

    assert srv.proc is not None
    pid = srv.pid
    cpu0 = cpu_seconds(pid)
    t0 = time.perf_counter()
    os.kill(pid, signal.SIGTERM)
    _pid, code, usage = os.wait4(pid, 0)
    wall = time.perf_counter() - t0
    srv.proc.returncode = os.waitstatus_to_exitcode(code)
    srv.stop()  # reaped already: closes its pipe and log
    if srv.proc.returncode != 0:
        raise RuntimeError(f"the master exited with {srv.proc.returncode}; log: {srv.tail_log()}")
    return wall, usage.ru_utime + usage.ru_stime - cpu0


def _stop_seconds(srv: ServerProc) -> float:
    """The server's own figure of its last stop (its log's "stopped stop_seconds=")."""
    return float(srv.tail_log(20_000).rsplit("stopped stop_seconds=", 1)[1].split()[0])


def slaves_level(root: str, n: int, rounds: int, seconds: float = 3.0, rate: int = 2000) -> dict:
    """The holds file's saves and the master's SIGTERM stop with ``n`` attached slaves."""
    a = ServerProc(os.path.join(root, "a"), args=["--replication", "async", "--metrics-listen", "127.0.0.1:0"])
    a.start()
    slaves = []
    saves = wall = cpu = 0.0
    stops, stop_cpus, drains = [], [], []
    try:
        for i in range(n):
            slaves.append(ServerProc(os.path.join(root, f"s{i}"), args=["--role", "slave", "--master", a.address]))
            slaves[-1].start()

        def attached() -> bool:
            return sum(1 for s in status(a.address).slaves if s.connected) == n

        payload = b"x" * 100
        per_tick = rate // 20
        for _ in range(rounds):
            _until(attached, 60, f"{n} slave(s) attached")
            before = _metrics(a, HOLDS)
            with Client(a.address) as c:
                t0 = time.monotonic()
                tick = 0
                while time.monotonic() - t0 < seconds:
                    c.send_batch([c.message("bench.holds", payload, delay_ms=3_600_000) for _ in range(per_tick)])
                    tick += 1
                    wait = t0 + tick * 0.05 - time.monotonic()
                    if wait > 0:
                        time.sleep(wait)
            end = status(a.address).end_offset
            for s in slaves:
                _until(lambda s=s, end=end: status(s.address).end_offset >= end, 60, "a slave caught up")
            after = _metrics(a, HOLDS)
            saves += after[HOLDS[0]] - before[HOLDS[0]]
            wall += after[HOLDS[1]] - before[HOLDS[1]]
            cpu += after[HOLDS[2]] - before[HOLDS[2]]
            took, stop_cpu = _sigterm_timed(a)
            stops.append(took)
            stop_cpus.append(stop_cpu)
            drains.append(_stop_seconds(a))
            a.start()  # on its port: the slaves re-attach
    finally:
        for s in [*slaves, a]:
            s.stop()
    return {
        "slaves": n,
        "rounds": rounds,
        "holds_saves": int(saves),
        "holds_save_ms": round(wall / saves * 1000, 3) if saves else None,
        "holds_save_cpu_us": round(cpu / saves * 1e6, 1) if saves else None,
        "stop_s_median": round(median(stops), 3),
        "stop_s_max": round(max(stops), 3),
        "stop_cpu_ms_median": round(median(stop_cpus) * 1000, 1),
        "stop_drain_s_median": round(median(drains), 3),
        "loadavg": os.getloadavg(),
    }


def _load(address: str, rate: int, stop_at: float, sent: Any) -> None:
    """``rate`` msgs/s into ``address`` (SendBatch every 10 ms) until ``stop_at``
    (time.time()); the count sent in ``sent`` (a shared int). Runs in its own process so
    that building the batches does not hold the timed Gets' GIL."""
    per_tick = max(1, rate // 100)
    payload = b"x" * 100
    with Client(address) as c:
        t0 = time.monotonic()
        tick = 0
        while time.time() < stop_at:
            c.send_batch([c.message("bench.getload", payload, delay_ms=3_600_000) for _ in range(per_tick)])
            sent.value += per_tick
            tick += 1
            wait = t0 + tick * 0.01 - time.monotonic()
            if wait > 0:
                time.sleep(wait)


def gets(root: str, rates: Sequence[int], calls: int, targets: int = 1000, slave_set: Sequence[str] = ()) -> list[dict]:
    """Get on a slave (and the master) by receipt and by id against the replicated write rate;
    ``slave_set``: the slave's --set KEY=VALUE settings."""
    import multiprocessing

    from bench.common import Meter, percentile

    a, b = cluster(root, "async", [arg for kv in slave_set for arg in ("--set", kv)])
    rows = []
    ctx = multiprocessing.get_context("spawn")
    try:
        with Client(a.address, timeout=30) as c:
            receipts = c.send_batch(
                [c.message("bench.get", b"x" * 100, delay_ms=86_400_000, message_id=f"g{i}") for i in range(targets)]
            )
        end = status(a.address).end_offset
        _until(lambda: status(b.address).iterate_offset >= end, 60, "the slave copied the targets")
        until_idle(b.pid, 60.0)
        until_idle(a.pid, 60.0)
        servers = {"master": a, "slave": b}
        clients = {name: Client(s.address, timeout=30, retries=0) for name, s in servers.items()}
        try:
            for c in clients.values():
                for r in receipts[:20]:  # warm: channels, the minute's index
                    c.get(r)
                    c.get(message_id=r.message_id)
            for rate in rates:
                # the phases: (server, by); each one's Gets in one window, bracketed by load-only windows
                phases = [(srv, by) for srv in ("slave", "master") for by in ("receipt", "id")]
                phase_s = 1.0 + calls * 0.004  # the load's span: every phase's three windows and a margin
                sent = ctx.Value("q", 0, lock=False)
                loader = None
                if rate:
                    stop_at = time.time() + 3.0 + len(phases) * 3 * phase_s + 30
                    loader = ctx.Process(target=_load, args=(a.address, rate, stop_at, sent), daemon=True)
                    loader.start()
                    _until(lambda sent=sent: sent.value > 0, 30, "the load started")
                    time.sleep(2.0)  # past the load's start (the slave's pull under way)
                t_load = time.monotonic()
                n0 = sent.value
                for srv, by in phases:
                    s = servers[srv]
                    c = clients[srv]
                    items = [receipts[i % targets] for i in range(calls)]
                    if by == "receipt":
                        call = lambda r, c=c: c.get(r)  # noqa: E731
                    else:
                        call = lambda r, c=c: c.get(message_id=r.message_id)  # noqa: E731
                    with Meter(s.pid) as before:
                        time.sleep(phase_s / 2)
                    lat = []
                    with Meter(s.pid) as m:
                        for r in items:
                            t0 = time.perf_counter()
                            got = call(r)
                            lat.append((time.perf_counter() - t0) * 1000)
                            if got.state != "PENDING":
                                raise RuntimeError(f"Get on the {srv} by {by} answered {got.state}, not PENDING")
                    with Meter(s.pid) as after:
                        time.sleep(phase_s / 2)
                    idle_rate = (before.cpu + after.cpu) / (before.wall + after.wall)
                    rows.append(
                        {
                            "rate": rate,
                            "server": srv,
                            "by": by,
                            "p50_ms": round(percentile(lat, 50), 3),
                            "p99_ms": round(percentile(lat, 99), 3),
                            "cpu_us": round((m.cpu - idle_rate * m.wall) / calls * 1e6),
                            "busy_cpu_share": round(idle_rate, 3),
                            "loadavg": os.getloadavg()[0],
                        }
                    )
                    print(f"gets {rate:>6,}/s {srv:>6} by {by:<7}: {rows[-1]}", flush=True)
                achieved = (sent.value - n0) / (time.monotonic() - t_load)
                for row in rows[-len(phases) :]:
                    row["achieved_rate"] = round(achieved)
                if loader is not None:
                    loader.terminate()
                    loader.join()
                    # the slave caught up before the next level
                    end = status(a.address).end_offset
                    _until(lambda e=end: status(b.address).iterate_offset >= e, 120, "the slave caught up")
        finally:
            for c in clients.values():
                c.close()
    finally:
        b.stop()
        a.stop()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--producers", type=int, default=4)
    p.add_argument("--batch", type=int, default=100)
    p.add_argument("--rate", type=int, default=20_000)
    p.add_argument("--catchup", default="100000,1000000", help="catchup: messages in the master's log, ascending")
    p.add_argument("--catchup-minutes", type=int, default=1, help="catchup: due minutes the messages are spread over")
    p.add_argument("--slaves", default="0,1,2,4", help="slaves: attached slaves per level")
    p.add_argument("--slave-rounds", type=int, default=3, help="slaves: master stops per level")
    p.add_argument("--get-rates", default="0,1000,10000,50000", help="gets: msgs/s into the master per level")
    p.add_argument("--get-calls", type=int, default=300, help="gets: Gets per server, way and level")
    p.add_argument(
        "--get-slave-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="gets: a setting of the slave (--set), e.g. engine.iterate_gather_ms=50; repeatable",
    )
    p.add_argument(
        "--only", default="ingest,lag,catchup,slaves,gets", help="comma-separated: ingest,lag,catchup,slaves,gets"
    )
    args = p.parse_args(argv)
    wanted = {w for w in args.only.split(",") if w}
    parts = {"ingest", "lag", "catchup", "slaves", "gets"}
    if wanted - parts:
        p.error(f"unknown part(s): {', '.join(sorted(wanted - parts))}")
    out: dict = {"ingest_msgs_per_s": {}, "params": vars(args), "cpus": os.cpu_count(), "loadavg": os.getloadavg()}
    for mode in (None, "async", "sync") if "ingest" in wanted else ():
        with tempfile.TemporaryDirectory() as root:
            a, b = cluster(root, mode)
            try:
                rate = ingest(a.address, args.seconds, args.producers, args.batch)
            finally:
                for s in (b, a):
                    if s is not None:
                        s.stop()
        out["ingest_msgs_per_s"][mode or "no_slave"] = round(rate)
        print(f"ingest {mode or 'no slave':>8}: {rate:,.0f} msgs/s", flush=True)
    r = out["ingest_msgs_per_s"]
    if r:
        out["sync_vs_no_slave"] = round(r["sync"] / r["no_slave"], 3)
    if "lag" in wanted:
        with tempfile.TemporaryDirectory() as root:
            a, b = cluster(root, "async")
            try:
                out["lag"] = lag(a.address, b.address, args.seconds, args.rate)
            finally:
                b.stop()
                a.stop()
    if "catchup" in wanted:
        out["catchup"] = []
        for n in sorted(int(x) for x in args.catchup.split(",") if x):
            with tempfile.TemporaryDirectory() as root:
                row = catchup(root, n, args.catchup_minutes)
            out["catchup"].append(row)
            print(f"catchup {n:,}: {row}", flush=True)
        rows = out["catchup"]
        if len(rows) > 1:
            print(
                f"catchup {rows[0]['messages']:,} -> {rows[-1]['messages']:,}:"
                f" us a message x{rows[-1]['us_per_msg'] / rows[0]['us_per_msg']:.2f},"
                f" slave CPU a message (until idle) x"
                f"{rows[-1]['slave_cpu_until_idle_us_per_msg'] / rows[0]['slave_cpu_until_idle_us_per_msg']:.2f}",
                flush=True,
            )
    if "slaves" in wanted:
        out["slaves"] = []
        for n in sorted(int(x) for x in args.slaves.split(",") if x):
            with tempfile.TemporaryDirectory() as root:
                row = slaves_level(root, n, args.slave_rounds)
            out["slaves"].append(row)
            print(f"slaves {n}: {row}", flush=True)
    if "gets" in wanted:
        with tempfile.TemporaryDirectory() as root:
            rates = [int(x) for x in args.get_rates.split(",") if x]
            out["gets"] = gets(root, rates, args.get_calls, slave_set=args.get_slave_set)
    print(json.dumps(out, indent=1))
    write_json("replication", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
