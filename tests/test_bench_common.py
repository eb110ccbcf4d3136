"""The benchmarks' timing helpers: what bench.cancel reports of a call's tail."""

from __future__ import annotations

import os

from bench.common import RunQueueWait, timed_calls


def test_most_ms_is_the_longest_wait_of_one_thread_and_skips_exited_ones():
    before = [1_000_000, -1, 5_000_000]
    after = [4_000_000, 9_000_000, 5_500_000]
    assert RunQueueWait.most_ms(before, after) == 3.0


def test_timed_calls_reports_the_tail_and_what_run_queue_waits_explain():
    probe = RunQueueWait([os.getpid()])
    try:
        out = timed_calls(lambda n: sum(range(n)), [2000] * 200, probe)
    finally:
        probe.close()
    assert 0 < out["p50_ms"] <= out["p99_ms"]
    if probe.available:  # Linux with schedstat
        assert 0 <= out["p99_less_wait_ms"] <= out["p99_ms"]
        assert 0.0 <= out["slow_waited"] <= 1.0
    assert set(timed_calls(lambda n: None, [1, 2])) == {"p50_ms", "p99_ms"}
