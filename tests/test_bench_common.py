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


def test_replication_frame_probes_each_have_a_hundred_frames_after_them():
    """bench.replication catchup's Frames probes (start, middle, end of the log): the end one
    was the start of the last 10,000-frame step, so a log whose frame count ended in 1-99
    past a multiple of 10,000 (e.g. --catchup 20050) failed the run ('answered 50 frames,
    not 100')."""
    from types import SimpleNamespace

    from bench.replication import frame_probes

    for total in (100, 150, 10_000, 10_050, 20_000, 20_099, 25_000):
        offsets = [7 + 10 * i for i in range(total)]  # frames of 10 bytes from offset 7
        end = offsets[-1] + 10

        def frames_from(off: int, offsets: list[int] = offsets) -> list[SimpleNamespace]:
            i = (off - 7) // 10
            return [SimpleNamespace(offset=o, size=10) for o in offsets[i : i + 10_000]]

        probes = frame_probes(frames_from, 7, end)
        assert probes[0] == 7 and probes[0] <= probes[1] <= probes[2], (total, probes)
        assert all(total - (p - 7) // 10 >= 100 for p in probes), (total, probes)
        assert total < 20_000 or probes[2] >= offsets[-10_000], (total, probes)  # the end is near the end
