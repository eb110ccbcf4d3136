"""Shared pytest fixtures and the one wait helper (keep small: helpers for one area live in
their own module)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest

# gRPC's fork support (on by default in grpcio) runs pthread_atfork handlers that abort a
# forked child (SIGABRT, before it can exec) when another thread of the parent is inside
# gRPC at that moment (the parent logs "Other threads are currently calling into gRPC,
# skipping fork() handlers"). PySpark starts its JVM with Popen(preexec_fn=...), a real
# fork(): the session-scoped ``spark`` fixture, set up in a pytest-xdist worker whose earlier
# tests left gRPC channels and servers running, failed now and then with "Java gateway
# process exited before sending its port number", more often on a loaded box (a thread is
# more often caught mid-call). No test forks a child that goes on using gRPC without exec,
# which is all fork support is for: off for the run. gRPC reads it once, when it first
# initialises: before any test module imports it (test_spark.py checks that it holds).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if TESTS_DIR not in sys.path:  # lets tests import helper modules such as byte_surgery
    sys.path.insert(0, TESTS_DIR)

from serverproc import ServerProc  # noqa: E402  (needs TESTS_DIR on sys.path)

T = TypeVar("T")


def wait_until(
    cond: Callable[[], T],
    timeout: float = 10.0,
    what: str | None = None,
    interval: float = 0.01,
    ignore: tuple[type[BaseException], ...] = (),
) -> T:
    """Poll ``cond`` until it returns something true and return that; on timeout fail the
    test (AssertionError naming ``what`` and the last value or exception). Exceptions of the
    ``ignore`` types count as "not yet" (e.g. a server still starting). Tests wait on
    conditions through this, never on sleeps: a short poll interval keeps fast cases fast."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            last = cond()
            if last:
                return last  # type: ignore[return-value]
        except ignore as err:
            last = err
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or cond} (last: {last!r})")
        time.sleep(interval)


@pytest.fixture
def pool():
    """A handle pool closed after the test (no leaked file descriptors)."""
    from qdelay.segments.segment import HandlePool

    p = HandlePool(16)
    yield p
    p.close()


@pytest.fixture(scope="module")
def server_args() -> list[str]:
    """The flags of the module's ``server``: a test module overrides this fixture to set them."""
    return []


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, server_args: list[str]) -> Iterator[ServerProc]:
    """One real ``qdelay server`` process per test module (free 127.0.0.1 port), stopped
    with SIGTERM after the module's last test."""
    with ServerProc(tmp_path_factory.mktemp("server") / "data", args=server_args) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProc):
    """A blocking client of the module's ``server``."""
    c = server.client(timeout=20)
    yield c
    c.close()


@pytest.fixture(scope="session")
def spark():
    """One local[2] SparkSession (one JVM) for every Spark test of the run."""
    pytest.importorskip("pyspark")
    pytest.importorskip("pyarrow")
    from qdelay.tools import spark_source

    s = spark_source.session("local[2]", "qdelay-tests", {"spark.sql.shuffle.partitions": "4"})
    yield s
    s.stop()
