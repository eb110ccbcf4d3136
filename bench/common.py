"""Small helpers shared by the benchmarks: timing, CPU use, a table, a JSON record."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import psutil

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU time used so far by a process (default: this one), all threads."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def schedstat_paths(pid: int | None = None) -> dict[int, str]:
    """Each live thread of a process (default: this one) and its Linux
    ``/proc/<pid>/task/<tid>/schedstat`` (fields: CPU ns, run-queue wait ns, timeslices);
    empty where /proc has none."""
    root = f"/proc/{pid or os.getpid()}/task"
    try:
        return {int(tid): f"{root}/{tid}/schedstat" for tid in os.listdir(root)}
    except OSError:
        return {}


def thread_cpu_ns(pid: int | None = None) -> dict[int, int] | None:
    """CPU time so far of each live thread of a process, in ns (``schedstat``'s first
    field); None where there is none."""
    out: dict[int, int] = {}
    for tid, path in schedstat_paths(pid).items():
        try:
            with open(path) as f:
                out[tid] = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that has just ended
    return out or None


def thread_cpu_by_name(pid: int | None = None) -> dict[str, int]:
    """CPU time so far of a process's threads by OS name (``/proc/<pid>/task/<tid>/comm``;
    the server names its threads, qdelay/threads.py), in ns. The thread whose id is the
    pid is ``main`` (the server's event loop); threads of one pool (``fsync_0``,
    ``fsync_1``...) are summed under the name without the number. Empty where /proc has
    none. A thread that has ended is no longer counted: read around a block in which the
    threads of interest live throughout."""
    pid = pid or os.getpid()
    out: dict[str, int] = {}
    for tid, path in schedstat_paths(pid).items():
        try:
            with open(path) as f:
                ns = int(f.read().split()[0])
            with open(path.removesuffix("schedstat") + "comm") as f:
                name = f.read().strip()
        except (OSError, ValueError, IndexError):
            continue  # a thread that has just ended
        if tid == pid:
            name = "main"
        else:  # "fsync_3" -> "fsync"; a thread named by threading's default: "Thread-4 (_poll" -> "_poll"
            name = re.sub(r"^Thread-\d+ \(", "", name).rstrip(")").rstrip("0123456789").rstrip("_-") or name
        out[name] = out.get(name, 0) + ns
    return out


def thread_split(before: dict[str, int], after: dict[str, int], per: int, top: int = 8) -> dict[str, float]:
    """µs of CPU per unit (``per``: messages, calls) of each named thread between two
    ``thread_cpu_by_name`` readings, the busiest ``top`` first, the rest summed as ``other``."""
    used = {name: (ns - before.get(name, 0)) / 1e3 / per for name, ns in after.items()}
    ranked = sorted(used.items(), key=lambda kv: -kv[1])
    out = {name: round(us, 2) for name, us in ranked[:top] if us >= 0.005}
    rest = sum(us for _, us in ranked[top:])
    if rest >= 0.005:
        out["other"] = round(rest, 2)
    return out


class Meter:
    """Wall and process-CPU time of a block: ``with Meter() as m: ...; m.wall, m.cpu``.

    The CPU time is the sum of the threads' own counters (ns) where Linux has them and no
    thread listed at the start ended inside the block (an ended thread's time is no longer
    listed), else the process's user + system time, which moves in clock ticks (10 ms): a
    block of 0.1 s of CPU read that way is +-10 % (bench.cancel's CancelBatch phases:
    10,000 cancels at ~3-5 us each read as whole microseconds). A thread that both starts
    and ends inside the block is listed at neither end, so its time is left out: the
    server's checkpoint thread (one a checkpoint, server/iterate.py) is such a thread."""

    def __init__(self, pid: int | None = None) -> None:
        self.pid = pid
        self.wall = self.cpu = 0.0

    def __enter__(self) -> Meter:
        self._threads = thread_cpu_ns(self.pid)
        self._cpu = cpu_seconds(self.pid)
        self._wall = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self._wall
        self.cpu = cpu_seconds(self.pid) - self._cpu
        before, after = self._threads, thread_cpu_ns(self.pid)
        if before is not None and after is not None and before.keys() <= after.keys():
            self.cpu = sum(ns - before.get(tid, 0) for tid, ns in after.items()) / 1e9


def cpu_counters() -> list[int]:
    """The machine's CPU time counters (the ``cpu`` line of /proc/stat; [] elsewhere)."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return []


def steal_percent(before: list[int]) -> float | None:
    """Share of CPU time the hypervisor gave to other guests since ``before``
    (``cpu_counters()``): on a shared VM, runs with high steal are not comparable."""
    after = cpu_counters()
    if len(before) < 8 or len(after) < 8:
        return None
    delta = [b - a for a, b in zip(before, after)]
    total = sum(delta[:8])
    return round(100.0 * delta[7] / total, 1) if total > 0 else None


def machine() -> dict[str, Any]:
    """What the figures were measured on, load included (record it next to the numbers)."""
    return {
        "when": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "cpu_percent": psutil.cpu_percent(interval=0.5),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != value:
            return "-"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        return f"{value:.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> str:
    """Print rows as an aligned Markdown table (so it can be pasted into docs); return it."""
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    lines = []
    if title:
        lines += [title, ""]
    lines.append("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |")
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for raw, row in zip(rows, cells):
        lines.append(
            "| "
            + " | ".join(
                c.rjust(w) if isinstance(v, (int, float)) else c.ljust(w)  # numbers right, text left
                for v, c, w in zip(raw, row, widths)
            )
            + " |"
        )
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def write_json(name: str, data: dict[str, Any]) -> str:
    """Write ``bench/out/<name>.json`` (git-ignored) and return its path."""
    if os.sep in name or name.endswith(".json"):  # a path was given (e.g. --out dir/x.json)
        path = name
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    else:
        os.makedirs(OUT_DIR, exist_ok=True)
        path = os.path.join(OUT_DIR, f"{name}.json")
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
    return path


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile of ``values`` (nearest rank; nan when empty)."""
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))] if s else float("nan")


def threads(count: int, work: Any, items: Sequence[Any]) -> float:
    """``work(item)`` over ``items`` from ``count`` threads; wall seconds."""
    it = iter(items)
    lock = threading.Lock()

    def run() -> None:
        while True:
            with lock:
                item = next(it, None)
            if item is None:
                return
            work(item)

    ts = [threading.Thread(target=run) for _ in range(count)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


class RunQueueWait:
    """How long the threads of some processes sat runnable without a core: Linux's
    ``/proc/<pid>/task/<tid>/schedstat`` (its second field, run-queue wait in ns), read
    around a timed call (outside its window) to tell a call slowed by the machine (a thread
    of the server or of the client waiting for one of the cores others use) from one slowed
    by the server's own work. Threads started after construction are not watched; where
    /proc has no schedstat, ``available`` is False and every wait reads 0."""

    def __init__(self, pids: Sequence[int]) -> None:
        self._files = []
        for pid in pids:
            for path in schedstat_paths(pid).values():
                try:
                    self._files.append(open(path, "rb", buffering=0))  # noqa: SIM115 - kept open
                except OSError:
                    pass  # a thread that has just ended
        self.available = bool(self._files)

    def read(self) -> list[int]:
        """Each watched thread's run-queue wait so far, ns (an exited thread: -1)."""
        out = []
        for f in self._files:
            try:
                f.seek(0)
                out.append(int(f.read().split()[1]))
            except (OSError, IndexError, ValueError):
                out.append(-1)
        return out

    @staticmethod
    def most_ms(before: list[int], after: list[int]) -> float:
        """The longest run-queue wait of one thread between two reads, ms."""
        waits = [b - a for a, b in zip(before, after) if a >= 0 and b >= 0]
        return max(waits, default=0) / 1e6

    def close(self) -> None:
        for f in self._files:
            f.close()
        self._files = []


def timed_calls(call: Any, items: Sequence[Any], probe: RunQueueWait | None = None) -> dict[str, float]:
    """``call(item)`` for each item, one at a time: p50/p99 ms and, with a ``probe``, what
    the machine's scheduling explains of the tail: ``p99_less_wait_ms``, the p99 of each
    call's time less the longest run-queue wait of one watched thread around it (an upper
    bound of the OS's share: a runnable thread off the call's path is counted too), and
    ``slow_waited``, the share of the slowest 1 % of calls (at least 5) in which a thread
    waited at least half the call's excess over the p50."""
    lat, waited = [], []
    for item in items:
        before = probe.read() if probe else None
        t0 = time.perf_counter()
        call(item)
        lat.append((time.perf_counter() - t0) * 1000)
        if probe and before is not None:
            waited.append(RunQueueWait.most_ms(before, probe.read()))
    out = {"p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99)}
    if waited:
        p50 = out["p50_ms"]
        out["p99_less_wait_ms"] = percentile([max(0.0, t - w) for t, w in zip(lat, waited)], 99)
        slowest = sorted(range(len(lat)), key=lambda i: -lat[i])[: max(5, len(lat) // 100)]
        out["slow_waited"] = sum(1 for i in slowest if waited[i] >= 0.5 * (lat[i] - p50)) / len(slowest)
    return out


def until_steady(done: Callable[[], bool], hold: float, max_s: float = 30.0, step: float = 0.25) -> float:
    """Seconds waited until ``done()`` (polled every ``step``) has held for ``hold`` seconds
    in a row, at most ``max_s``; a ``done`` that raises OSError (a server gone) ends the wait
    at once. The memory benchmarks read RSS once a burst's housekeeping is over this way."""
    t0 = time.monotonic()
    settled_at = None
    while time.monotonic() - t0 < max_s:
        try:
            now_done = done()
        except OSError:
            break
        if not now_done:
            settled_at = None
        elif settled_at is None:
            settled_at = time.monotonic()
        if settled_at is not None and time.monotonic() - settled_at >= hold:
            break
        time.sleep(step)
    return round(time.monotonic() - t0, 2)


def until_idle(pid: int, timeout: float = 30.0) -> float:
    """Wait until the process uses under 5 % of a core over 0.5 s (a fill's background work:
    iterate catch-up, the id index's compactions), so that what follows is measured on an
    idle server and not charged for it. Returns the seconds waited."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        before = cpu_seconds(pid)
        time.sleep(0.5)
        if cpu_seconds(pid) - before < 0.025:
            break
    return time.perf_counter() - t0


# the server's figures of where the id index's memory is (engine.stats() keys; as metrics
# they are prefixed ``qdelay_``): read next to the RSS by the memory benchmarks
ID_INDEX_MEMORY = (
    "id_filter_bytes",
    "id_index_memtable_bytes",
    "id_index_table_readers_bytes",
    "id_index_block_cache_bytes",
)
