"""qdelay/threads.py: the OS sees each thread under its Python name (top -H, py-spy, bench's
per-thread CPU split)."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from bench.common import thread_cpu_by_name, thread_split
from qdelay.threads import os_name

CHILD = r"""
import os, sys, threading
from concurrent.futures import ThreadPoolExecutor
from qdelay.threads import name_os_threads
assert name_os_threads()
seen = {}
def look():
    seen[threading.current_thread().name] = open(f"/proc/self/task/{threading.get_native_id()}/comm").read().strip()
t = threading.Thread(target=look, name="qdelay-wal-writer"); t.start(); t.join()
with ThreadPoolExecutor(1, thread_name_prefix="qdelay-fsync") as pool:
    pool.submit(look).result()
print(sorted(seen.values()))
"""


def test_os_name_drops_the_common_prefix_and_keeps_fifteen_bytes() -> None:
    assert os_name("qdelay-iterate") == b"iterate"
    assert os_name("qdelay-dispatch-sync") == b"dispatch-sync"
    assert os_name("a-name-longer-than-fifteen") == b"a-name-longer-t"
    assert len(os_name("qdelay-" + "é" * 20)) == 15


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_NAME) and /proc are Linux's")
def test_threads_started_after_the_call_carry_their_python_names() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "['fsync_0', 'wal-writer']"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_thread_split_names_the_main_thread_and_sums_a_pool() -> None:
    stop = threading.Event()
    busy = [threading.Thread(target=stop.wait, name=f"pool_{i}") for i in range(2)]
    for t in busy:
        t.start()
    try:
        before = thread_cpu_by_name()
        sum(range(200_000))  # some CPU on this (the main) thread
        after = thread_cpu_by_name()
    finally:
        stop.set()
        for t in busy:
            t.join()
    # pytest's main thread is the process's first: "main"; Python names are not the OS's
    # here (name_os_threads not called), so the pool's threads are the process's comm
    assert "main" in after and after["main"] > before["main"]
    assert thread_split(before, after, per=1)["main"] > 0


def test_thread_split_ranks_by_cpu_and_sums_the_rest() -> None:
    before = {"main": 1_000, "iterate": 0, "a": 0, "b": 0}
    after = {"main": 401_000, "iterate": 200_000, "a": 30_000, "b": 20_000, "new": 10_000}
    # µs a unit over 100 units, the 2 busiest by name, the other three summed
    assert thread_split(before, after, per=100, top=2) == {"main": 4.0, "iterate": 2.0, "other": 0.6}
