"""The id filter (segments/idfilter.py) as the id index grows past its capacity, in process.

    python -m bench.idfilter [--rounds 1] [--up-to 8400000] [--lookup-keys 2000000]

- ``cross``: an id index (segments/idindex.py) in a temporary folder, its filter built at
  open on an empty index (the first capacity, 1,048,576 ids), then filled up to ``--up-to``
  ids. Around each point where the filter grows (a new layer, or, in a filter that rescans,
  each doubling of its capacity: 1, 2, 4, 8 M), from 10,000 ids before it, the index is
  written as a live master does: batches of 100 new ids every millisecond (about the
  server's ingest rate), 160,000 ids; the rest is filled at full speed. Measured in each
  window: the worst and p99 latency of a put, and the worst stall of a thread sleeping 1 ms
  in a loop, and how many stalls passed 5 ms (what the event loop would see: it waits for
  the GIL as that thread does). A filter that grows by rescanning the index holds the GIL
  through the scan here.
- ``lookup``: ``IdIndex.get_many`` of 100 ids it does not hold (the dedupe path of new
  ids), µs a call, median of 3,000, with the filter grown past its capacity (the first
  capacity set to 1/8 of ``--lookup-keys``: 4 layers) and after a reopen (one layer, sized
  at open).
- ``fp``: the false-positive rate of an ``IdFilter`` of the first capacity at 1x and 4x
  it, and its ``maybe`` of 100 ids it does not hold (µs, median of 3,000 calls), and its
  bytes.

Each figure is named ``<figure>@<ids>`` where it depends on the number of ids. The same
module runs against the filter that rescanned (it reads the layers where there are some),
so an A/B runs this file against either side. The figures: docs/benchmarks.md, "The id
filter past its capacity". Prints a table; ``--json`` names the output (default
bench/out/idfilter.json).
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time

import numpy as np

from bench.common import machine, median, percentile, print_table, write_json
from qdelay.segments import framing, idfilter, records
from qdelay.segments.framing import RecordKind
from qdelay.segments.idfilter import IdFilter
from qdelay.segments.idindex import IdIndex

BATCH = 100


def _frames(first: int, n: int, tag: str = "o") -> tuple[bytes, np.ndarray, np.ndarray, np.ndarray]:
    """MESSAGE frames of the ids ``{tag}-{first}`` .. ``{tag}-{first + n - 1}``."""
    parts, starts, at = [], [], 0
    for i in range(first, first + n):
        frame = framing.encode(
            RecordKind.MESSAGE, i + 1, 0, records.encode_message(b"s", f"{tag}-{i}".encode(), b"", b"p", 1_000)
        )
        starts.append(at)
        parts.append(frame)
        at += len(frame)
    seqs = np.arange(first + 1, first + n + 1, dtype=np.int64)
    return b"".join(parts), np.array(starts, dtype=np.int64), np.full(n, 1_000, dtype=np.int64), seqs


def _fill(index: IdIndex, first: int, last: int) -> None:
    for at in range(first, last, 10_000):
        index.put_frames(*_frames(at, min(10_000, last - at)))


def _wait_built(index: IdIndex) -> None:
    deadline = time.monotonic() + 120
    while index.filter_keys == 0:
        if time.monotonic() > deadline:
            raise RuntimeError("the id filter was not built within 120 s")
        index.get_many(["warm"])  # an index without start_filter (an older tree) starts its scan here
        time.sleep(0.01)


def _mib(f) -> float:
    """The filter's size in MiB: its layers' (``nbytes``), or an older tree's one bit array."""
    return (getattr(f, "nbytes", None) or len(getattr(f, "bits", b""))) / 2**20


def growth_points(up_to: int) -> list[int]:
    """The id counts at which a filter whose first capacity is ``MIN_CAPACITY`` grows, up
    to ``up_to``: a layer's start (segments/idfilter.py ``next_layer``), or each doubling of
    the capacity in a filter that rescans the index (the side before the layers)."""
    first = idfilter.MIN_CAPACITY
    points = [first]
    next_layer = getattr(idfilter, "next_layer", None)
    nbits = getattr(idfilter, "first_layer_bits", lambda c: 0)(first)
    while True:
        if next_layer is not None:
            nbits, more = next_layer(nbits, len(points))
            at = points[-1] + more
        else:
            at = 2 * points[-1]
        if at > up_to:
            return [p for p in points if p <= up_to]
        points.append(at)


def _window(index: IdIndex, start: int) -> dict[str, float]:
    """Put 160,000 ids from ``start`` in batches of 100 a millisecond; the puts' latency and
    a 1 ms ticker's stalls over them (and 0.5 s after: a scan still running shows there)."""
    batches = [_frames(start + k * BATCH, BATCH) for k in range(160_000 // BATCH)]
    stalls: list[float] = []
    stop = threading.Event()

    def ticker() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            time.sleep(0.001)
            stalls.append(time.perf_counter() - t0 - 0.001)

    t = threading.Thread(target=ticker)
    t.start()
    puts = []
    t_next = time.perf_counter()
    for b in batches:
        t0 = time.perf_counter()
        index.put_frames(*b)
        t1 = time.perf_counter()
        puts.append(t1 - t0)
        t_next += 0.001
        if t_next > t1:
            time.sleep(t_next - t1)
    time.sleep(0.5)
    stop.set()
    t.join()
    return {
        "put_max_ms": max(puts) * 1e3,
        "put_p99_ms": percentile(puts, 99) * 1e3,
        "stall_max_ms": max(stalls) * 1e3,
        "stalls_over_5ms": sum(s > 0.005 for s in stalls),
    }


def cross(up_to: int) -> dict[str, float]:
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        index = IdIndex(f"{tmp}/ids")
        try:
            index.start_filter()
            _fill(index, 0, 1)
            _wait_built(index)
            at = 1
            for point in growth_points(up_to):
                _fill(index, at, point - 10_000)
                out.update({f"{k}@{point}": v for k, v in _window(index, point - 10_000).items()})
                at = point + 150_000
            out["layers"] = getattr(index, "filter_layers", 0)
            out["scans"] = getattr(index, "scans", -1)
            f = index._filter
            out["filter_MiB"] = _mib(f)
        finally:
            index.close()
    return out


def _median_us(look_up) -> float:
    """The median µs of ``look_up`` of 3,000 calls of ``BATCH`` ids none of which was added."""
    calls = [[f"new-{c}-{i}" for i in range(BATCH)] for c in range(3_000)]
    times = []
    for ids in calls:
        t0 = time.perf_counter()
        look_up(ids)
        times.append(time.perf_counter() - t0)
    return median(times) * 1e6


def lookup(keys: int) -> dict[str, float]:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        saved = idfilter.MIN_CAPACITY
        idfilter.MIN_CAPACITY = keys // 8
        try:
            index = IdIndex(f"{tmp}/ids")
            index.start_filter()
            _fill(index, 0, 1)
            _wait_built(index)
            _fill(index, 1, keys)
            time.sleep(1.0)  # a rescanning filter finishes its last scan
            out["grown_layers"] = getattr(index, "filter_layers", 0)
            out["grown_us"] = _median_us(index.get_many)
            index.close()
        finally:
            idfilter.MIN_CAPACITY = saved
        index = IdIndex(f"{tmp}/ids")
        try:
            index.start_filter()
            _wait_built(index)
            out["reopened_layers"] = getattr(index, "filter_layers", 0)
            out["reopened_us"] = _median_us(index.get_many)
        finally:
            index.close()
    return out


def fp(capacity: int = 1 << 20) -> dict[str, float]:
    """False positives (%) of 200,000 ids not added, and ``maybe`` of 100 of them (µs)."""
    f = IdFilter(capacity)
    others = [f"other-{i}" for i in range(200_000)]
    f.add([f"id-{i}".encode() for i in range(capacity)])
    out = {"fp_1x_pct": 100 * len(f.maybe(others)) / len(others), "maybe_1x_us": _median_us(f.maybe)}
    for k in range(1, 4):
        f.add([f"id-{i}".encode() for i in range(k * capacity, (k + 1) * capacity)])
    out["fp_4x_pct"] = 100 * len(f.maybe(others)) / len(others)
    out["maybe_4x_us"] = _median_us(f.maybe)
    out["layers_4x"] = getattr(f, "layers", 1)
    out["MiB_4x"] = _mib(f)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--up-to", type=int, default=8_400_000, help="ids to fill, crossing each growth point")
    ap.add_argument("--lookup-keys", type=int, default=2_000_000)
    ap.add_argument("--only", default="cross,lookup,fp")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    only = set(args.only.split(","))
    results: list[dict] = []
    for r in range(args.rounds):
        row: dict = {"round": r}
        if "cross" in only:
            row.update(cross(args.up_to))
        if "lookup" in only:
            row.update(lookup(args.lookup_keys))
        if "fp" in only:
            row.update(fp())
        results.append(row)
    keys = list(results[0])
    print_table(["figure", *[f"round {r['round']}" for r in results]], [[k, *[r[k] for r in results]] for k in keys])
    write_json(args.json or "idfilter", {"machine": machine(), "rounds": results})


if __name__ == "__main__":
    main()
