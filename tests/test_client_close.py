"""How the clients end: no task of theirs is left pending on a loop, however the client ends
(closed, never closed until the interpreter exits, dropped without ``close()``: its open
streams keep it alive until exit), and a
client used after ``close()`` refuses at once instead of making batchers nobody closes.

The blocking client's batchers run on its private I/O loop (a daemon thread): a client
still open at exit, or collected without ``close()``, left their tasks pending there, and
each was logged at exit as "Task was destroyed but it is pending!" (seen in mixed pytest
runs, where a test leaves a client open). Each case runs in a fresh interpreter, whose
stderr is the evidence."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from qdelay import errors

SCRIPT = """
import asyncio, gc, sys, threading
from qdelay.client import Client
from qdelay.aio import Client as AioClient

address, case = sys.argv[1], sys.argv[2]


def use(c):
    r = c.send("close.case", b"x", delay_ms=3_600_000)
    assert c.cancel(r) == "CANCELLED"
    r = c.send("close.case", b"y", delay_ms=3_600_000)
    assert c.reschedule(r, delay_ms=7_200_000)[0] == "RESCHEDULED"


def bulk_threads():
    return [t for t in threading.enumerate() if t.name == "qdelay-client-bulk"]


if case == "open-at-exit":
    kept = Client(address)
    use(kept)
elif case == "dropped":
    c = Client(address)
    use(c)
    del c
    gc.collect()  # its open streams keep it (they are referenced by grpc) until exit
elif case == "closed":
    with Client(address) as c:
        use(c)
    assert not bulk_threads()
elif case == "aio-used-after-close":
    async def main():
        c = AioClient(address, timeout=20)
        r = await c.send("close.case", b"x", delay_ms=3_600_000)
        await c.close()
        for call in (
            lambda: c.send("close.case", b"x"),
            lambda: c.cancel(r),
            lambda: c.reschedule(r, delay_ms=1000),
        ):
            try:
                await asyncio.wait_for(call(), 5)  # not the client's 20 s timeout
            except Exception as e:
                assert type(e).__name__ == "FailedPrecondition", repr(e)
            else:
                raise AssertionError("a call after close() succeeded")
        gc.collect()

    asyncio.run(main())
print("done", file=sys.stderr)
"""


def run_case(address: str, case: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-X", "dev", "-c", SCRIPT, address, case],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.rstrip().endswith("done"), proc.stderr
    return proc.stderr


@pytest.mark.parametrize("case", ["open-at-exit", "dropped", "closed", "aio-used-after-close"])
def test_no_client_task_is_left_pending(server, case):
    err = run_case(server.address, case)
    assert "Task was destroyed but it is pending" not in err, err
    assert "Task exception was never retrieved" not in err, err
    assert "was never awaited" not in err, err


def test_blocking_client_used_after_close_refuses_at_once(server):
    from qdelay.client import Client

    c = Client(server.address)
    r = c.send("close.case", b"x", delay_ms=3_600_000)
    c.close()
    started = time.monotonic()
    with pytest.raises(errors.FailedPrecondition):
        c.send("close.case", b"x")
    with pytest.raises(errors.FailedPrecondition):
        c.cancel(r)
    with pytest.raises(errors.FailedPrecondition):
        c.reschedule(r, delay_ms=1000)
    assert time.monotonic() - started < 5
