"""The benchmarks refuse to measure a C extension that is missing or older than its source."""

from __future__ import annotations

import subprocess
import sys

import pytest

import bench
from qdelay import extensions


def test_a_stale_build_is_refused_naming_it(monkeypatch):
    monkeypatch.setattr(extensions, "check", lambda: ({"qdelay.segments._codec": "segments/_codec.c changed"}, {}))
    monkeypatch.delenv("QDELAY_NATIVE", raising=False)
    with pytest.raises(SystemExit, match=r"qdelay\.segments\._codec: segments/_codec\.c changed.*make setup"):
        bench.require_built()
    monkeypatch.setenv("QDELAY_NATIVE", "0")  # the Python twins on purpose
    bench.require_built()


def test_python_m_bench_runs_the_check_and_a_test_import_does_not():
    stale = "import qdelay.extensions as e; e.check = lambda: ({'qdelay._wire': 'stale'}, {}); import sys; "
    as_benchmark = subprocess.run(
        [sys.executable, "-c", stale + "sys.argv[0] = '-m'; import bench"], capture_output=True, text=True, timeout=60
    )
    assert as_benchmark.returncode == 1 and "qdelay._wire: stale" in as_benchmark.stderr
    as_import = subprocess.run(
        [sys.executable, "-c", stale + "import bench"], capture_output=True, text=True, timeout=60
    )
    assert as_import.returncode == 0, as_import.stderr
