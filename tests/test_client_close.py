"""How the clients end: no task of theirs is left pending on a loop, however the client ends
(closed, never closed until the interpreter exits, dropped without ``close()``), and a
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
from serverproc import ServerProc

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


async def use_aio(c):  # as use(c), awaited
    r = await c.send("close.case", b"x", delay_ms=3_600_000)
    assert await c.cancel(r) == "CANCELLED"
    r = await c.send("close.case", b"y", delay_ms=3_600_000)
    assert (await c.reschedule(r, delay_ms=7_200_000))[0] == "RESCHEDULED"


def bulk_threads():
    return [t for t in threading.enumerate() if t.name == "qdelay-client-bulk"]


async def settled():
    # until the client's tasks ended by themselves (its streams saw the server go), else
    # 10 s: one still pending is then reported at exit, the failure this test looks for
    for _ in range(200):
        if len(asyncio.all_tasks()) == 1:  # this one
            return
        await asyncio.sleep(0.05)


def server_stopped():
    # until the test stopped the server: its streams ended, nothing in grpc holds the
    # batchers' tasks any more (an open stream kept them from being collected)
    print("used", flush=True)
    sys.stdin.readline()


if case == "open-at-exit":
    kept = Client(address)
    use(kept)
    server_stopped()
elif case == "dropped":
    c = Client(address)
    use(c)
    server_stopped()
    del c
    gc.collect()  # its batchers' tasks ended once idle: collected, its finalizer stops the loop
    for _ in range(100):
        if not bulk_threads():
            break
        threading.Event().wait(0.05)
    assert not bulk_threads(), "the dropped client's I/O loop is still running"
elif case == "closed":
    with Client(address) as c:
        use(c)
    assert not bulk_threads()
    server_stopped()
elif case == "aio-loop-closed":  # never closed; its loop closed without cancelling its tasks
    loop = asyncio.new_event_loop()
    kept = []

    async def open_and_use():
        kept.append(AioClient(address))
        await use_aio(kept[0])

    loop.run_until_complete(open_and_use())
    server_stopped()
    loop.run_until_complete(settled())
    loop.close()
    kept.clear()
    gc.collect()
elif case == "aio-dropped":  # never closed, dropped while its loop runs
    async def main():
        c = AioClient(address)
        await use_aio(c)
        server_stopped()
        await settled()
        del c
        gc.collect()
        await asyncio.sleep(0.1)

    asyncio.run(main())
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
    server_stopped()
print("done", file=sys.stderr)
"""


def run_case(tmp_path: Path, case: str) -> str:
    """The script's stderr: it uses a client of a server of its own, which is stopped (the
    end of a test module's server, clients still open) before the script goes on to exit."""
    with ServerProc(tmp_path / "data") as srv:
        proc = subprocess.Popen(
            [sys.executable, "-X", "dev", "-c", SCRIPT, srv.address, case],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parent.parent,
        )
        try:
            used = proc.stdout.readline() if proc.stdout is not None else ""
        except BaseException:
            proc.kill()
            raise
    try:
        _out, err = proc.communicate("go\n", timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert used == "used\n" and proc.returncode == 0, err
    assert err.rstrip().endswith("done"), err
    return err


@pytest.mark.parametrize(
    "case", ["open-at-exit", "dropped", "closed", "aio-loop-closed", "aio-dropped", "aio-used-after-close"]
)
def test_no_client_task_is_left_pending(tmp_path, case):
    err = run_case(tmp_path, case)
    assert "Task was destroyed but it is pending" not in err, err
    assert "Task exception was never retrieved" not in err, err
    assert "was never awaited" not in err, err


class LetsCallerGo:
    """A lock stand-in for the close races below: a caller is held just before it takes the
    lock; close() (any other thread) taking it sets ``go``, so the held caller goes on while
    close() runs."""

    def __init__(self, lock, go, caller) -> None:
        self._lock, self._go, self._caller = lock, go, caller

    def __enter__(self):
        import threading

        if threading.current_thread() is not self._caller():
            self._go.set()
        return self._lock.__enter__()

    def __exit__(self, *exc):
        return self._lock.__exit__(*exc)


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
    # the unary calls too, as the asyncio client's (they raised grpc's ValueError "Cannot
    # invoke RPC on closed channel!", outside the client's exception tree)
    for call in (lambda: c.get(r), lambda: c.stats(), lambda: c.cancel_many([r]), c.health, lambda: c.subscribe("s")):
        with pytest.raises(errors.FailedPrecondition):
            call()
    assert time.monotonic() - started < 5


def test_blocking_client_refuses_a_call_made_while_it_closes(server):
    """A call made while close() runs, once close() has closed the batchers: it made a new
    batcher nobody closed (its stream then cut by the channel's close, its caller left
    waiting for its timeout), where the asyncio client refuses it from the start of
    close()."""
    from qdelay.client import Client

    c = Client(server.address, timeout=20)
    r = c.send("close.case", b"x", delay_ms=3_600_000)
    moved = c.send("close.case", b"y", delay_ms=3_600_000)
    assert c.cancel(r) == "CANCELLED"  # the canceller exists, as in use
    got: list = []
    close_bulk = c._bulk.close

    def during_close() -> None:  # between the batchers' close and the I/O loop's
        for call in (lambda: c.cancel(moved), lambda: c.reschedule(moved, delay_ms=1000), lambda: c.send("x", b"")):
            try:
                got.append(call())
            except errors.FailedPrecondition as err:
                got.append(err)
        close_bulk()

    c._bulk.close = during_close  # type: ignore[method-assign]
    c.close()
    assert [type(g) for g in got] == [errors.FailedPrecondition] * 3, got
    assert c._canceller is None and c._rescheduler is None and c._batcher is None


def test_blocking_client_close_ends_its_consumers(server):
    """close() ends the client's consumers, as the asyncio client's close() does: their
    streams, cut by the channel's close (CANCELLED), were subscribed again on the closed
    channel, so iterating raised grpc's ValueError 'Cannot invoke RPC: Channel closed!'
    (outside the exception tree) and receive() - whose reader thread had died of it -
    waited out every timeout instead of ending."""
    from qdelay.client import Client

    c = Client(server.address, retry_backoff=0.01)
    read = c.subscribe("close.consumer")
    received = c.subscribe("close.consumer")
    assert received.receive(1, 0.2) == []  # its reader thread runs
    c.close()
    assert list(read.batches()) == []  # ends, raises nothing
    started = time.monotonic()
    assert received.receive(1, 20.0) == []
    assert time.monotonic() - started < 10  # ended, not its whole timeout waited
    with pytest.raises(errors.FailedPrecondition):
        c.subscribe("close.consumer")


def test_sharded_client_close_ends_its_merged_consumers(server):
    """A merged consumer outlived its closed sharded client: its reader, finding its stream
    ended, asked the closed client for the server's client again, which made a new one
    (a channel nobody closes) and subscribed again, a consumer still taking deliveries; its
    receive() waited out every timeout. Now close() ends them (receive returns at once),
    and the closed client refuses to make clients or consumers (FailedPrecondition), as
    the single-server clients do; blocking and asyncio."""
    import asyncio

    from conftest import wait_until

    from qdelay.client import AioShardedClient, Client, ShardedClient

    with Client(server.address) as plain:

        def consumers(group: str) -> int:
            return sum(g["consumers"] for g in plain.groups(subject="close.merged", group=group))

        sc = ShardedClient(server.address)
        merged = sc.subscribe("close.merged", "g1")
        wait_until(lambda: merged.receive(1, 0.05) == [] and consumers("g1") == 1, 10, "subscribed")
        sc.close()
        started = time.monotonic()
        assert merged.receive(1, 20.0) == []
        assert time.monotonic() - started < 10  # ended, not its whole timeout waited
        for call in (lambda: sc.client(server.address), lambda: sc.subscribe("close.merged", "g1")):
            with pytest.raises(errors.FailedPrecondition):
                call()
        wait_until(lambda: consumers("g1") == 0, 10, "the stream closed")

        async def aio_round() -> None:
            ac = AioShardedClient(server.address)
            amerged = ac.subscribe("close.merged", "g2")
            for _ in range(200):
                if await amerged.receive(1, 0.05) == [] and consumers("g2") == 1:
                    break
            assert consumers("g2") == 1
            await ac.close()
            started = time.monotonic()
            assert await amerged.receive(1, 20.0) == []
            assert time.monotonic() - started < 10
            with pytest.raises(errors.FailedPrecondition):
                ac.client(server.address)
            with pytest.raises(errors.FailedPrecondition):
                ac.subscribe("close.merged", "g2")

        asyncio.run(asyncio.wait_for(aio_round(), 60))
        wait_until(lambda: consumers("g2") == 0, 10, "the aio stream closed")


def test_a_collected_blocking_client_does_not_wait_for_its_loop_to_end(server):
    """The finalizer of a blocking client collected without close() stopped its I/O loop
    and joined the loop's thread for up to 10 s, in whatever thread the collection ran: a
    loop slow to end (here a task that takes 3 s to cancel, standing for anything that
    delays it) stalled that thread. It now only tells the loop to stop; the loop's thread
    ends it by itself (and is joined at interpreter exit)."""
    import asyncio
    import gc
    import threading
    import weakref

    from conftest import wait_until

    from qdelay.client import Client

    def bulk_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "qdelay-client-bulk"]

    before = set(bulk_threads())
    c = Client(server.address)

    async def plant(_channel) -> None:
        async def slow_to_cancel() -> None:
            try:
                await asyncio.sleep(3600)
            finally:
                time.sleep(3)  # blocks the loop's thread while it ends the loop

        asyncio.get_running_loop().create_task(slow_to_cancel())

    c._bulk.run(plant)  # starts its loop
    mine = set(bulk_threads()) - before
    assert len(mine) == 1
    collected = weakref.ref(c)
    del c
    gc.collect()
    # collected (its finalizer ran) and returned while the loop's 3 s end is still under
    # way: the finalizer did not wait for it (no clock: a loaded machine cannot fail this)
    assert collected() is None
    assert set(bulk_threads()) & mine, "the finalizer waited for the loop's end"
    wait_until(lambda: not (set(bulk_threads()) & mine), 20, "the loop's thread ended by itself")


def test_wait_ready_answers_in_the_exception_tree(server):
    """wait_ready() of a channel that does not become ready raised grpc's FutureTimeoutError
    (blocking) or the builtin TimeoutError (asyncio), outside the clients' exception tree;
    now DeadlineExceeded (an Unavailable). After close() it waited out its timeout (and a
    grpc thread died of 'Channel closed!'), and the asyncio health() raised grpc.aio's
    UsageError; now FailedPrecondition at once, as every other call."""
    import asyncio

    from qdelay.aio import Client as AioClient
    from qdelay.client import Client, DeadlineExceeded

    nowhere = "127.0.0.1:1"  # nothing listens there: never ready
    with Client(nowhere) as c, pytest.raises(DeadlineExceeded):
        c.wait_ready(0.3)
    c = Client(server.address)
    c.wait_ready(10)
    c.close()
    started = time.monotonic()
    with pytest.raises(errors.FailedPrecondition):
        c.wait_ready(5)
    assert time.monotonic() - started < 2.5  # at once, not its 5 s

    async def aio_round() -> None:
        async with AioClient(nowhere) as ac:
            with pytest.raises(DeadlineExceeded):
                await ac.wait_ready(0.3)
        ac = AioClient(server.address)
        await ac.wait_ready(10)
        await ac.close()
        with pytest.raises(errors.FailedPrecondition):
            await asyncio.wait_for(ac.wait_ready(5), 2.5)
        with pytest.raises(errors.FailedPrecondition):  # it raised grpc.aio's UsageError
            await ac.health()

    asyncio.run(aio_round())


def test_a_closed_cluster_client_refuses_at_once(server):
    """ClusterClient after close(): each call met its closed clients' FailedPrecondition,
    which it retries as a slave's refusal, asking every server for the master, for the
    whole failover_timeout (30 s by default) before raising it; and its server pool was made
    again (threads nobody shuts down). Now FailedPrecondition at once, as the other clients
    (the sharded ones give up once closed)."""
    import threading

    from qdelay.client import ClusterClient

    cc = ClusterClient([server.address, server.address], failover_timeout=20)
    r = cc.send("close.cluster", b"x", delay_ms=3_600_000)
    assert cc.stats()[server.address]["role"] == "master"  # its pool made
    cc.close()
    started = time.monotonic()
    for call in (
        lambda: cc.send("close.cluster", b"y"),
        lambda: cc.get(r),
        lambda: cc.cancel(r),
        lambda: cc.stats(),
        lambda: cc.find_master(),
        lambda: cc.subscribe_all("close.cluster"),
    ):
        with pytest.raises(errors.FailedPrecondition):
            call()
    assert time.monotonic() - started < 10  # not 20 s for each
    assert not [t for t in threading.enumerate() if t.name.startswith("qdelay-cluster")]


@pytest.mark.parametrize("call", ["send", "cancel", "reschedule"])
def test_a_call_handing_over_as_close_runs_is_refused_or_answered(server, call):
    """A thread that passed its batcher's "closed?" check and hands its target to the I/O
    loop only as close() runs (held there by a hook on the batcher's inbox until close()
    ended, or until close() waits for it): it met the closed loop (RuntimeError "Event
    loop is closed", outside the exception tree), or its target sat in an inbox nobody
    read until the caller's timeout. Now the check and the hand-over are one step against
    close()'s flag: the call is answered (close() sends what was handed over) or refused
    with FailedPrecondition."""
    import threading

    from qdelay.client import Client

    c = Client(server.address, timeout=20)
    r = c.send("close.race", b"x", delay_ms=3_600_000)
    do = {
        "send": lambda: c.send("close.race", b"y", delay_ms=3_600_000, timeout=5),
        "cancel": lambda: c.cancel(r, timeout=5),
        "reschedule": lambda: c.reschedule(r, delay_ms=1000, timeout=5),
    }[call]
    do()  # the batcher exists
    batcher = {"send": c._batcher, "cancel": c._canceller, "reschedule": c._rescheduler}[call]
    handing, go = threading.Event(), threading.Event()
    put = batcher._inbox.put

    def held_put(loop, item):  # past the batcher's check, before the hand-over
        handing.set()
        go.wait(30)
        put(loop, item)

    batcher._inbox.put = held_put
    batcher._handover = LetsCallerGo(getattr(batcher, "_handover", threading.Lock()), go, lambda: caller)
    got: list = []

    def call_it() -> None:
        try:
            got.append(do())
        except BaseException as err:  # noqa: BLE001 - what it raises is the test's subject
            got.append(err)

    caller = threading.Thread(target=call_it)
    caller.start()
    assert handing.wait(10)
    c.close()
    go.set()
    caller.join(30)
    assert not caller.is_alive() and len(got) == 1
    assert not isinstance(got[0], BaseException) or isinstance(got[0], errors.FailedPrecondition), repr(got[0])


def test_a_bulk_call_scheduled_as_close_runs_is_refused_or_answered(server):
    """send_many (any work on the I/O loop) from a thread that got the loop, and schedules
    its work there only as close() runs (held by a hook until close() ended, or until
    close() waits for it): it met the closed loop (RuntimeError), or its work was cancelled
    with the loop (CancelledError) or cut by the channel's close (CANCELLED), all outside
    FailedPrecondition. Now it is answered or refused with FailedPrecondition."""
    import threading

    from qdelay.client import Client, Outgoing

    c = Client(server.address, timeout=20)
    c.send_many([Outgoing("close.bulk", b"x", delay_ms=3_600_000)])  # the loop and its channel exist
    bulk = c._bulk
    handing, go = threading.Event(), threading.Event()
    on_channel = bulk._on_channel

    def held(work):  # the loop got, the work not scheduled yet
        if threading.current_thread() is caller:
            handing.set()
            go.wait(30)
        return on_channel(work)

    bulk._on_channel = held
    bulk._lock = LetsCallerGo(bulk._lock, go, lambda: caller)  # the bulk loop's lock
    got: list = []

    def call_it() -> None:
        try:
            got.append(list(c.send_many([Outgoing("close.bulk", b"y", delay_ms=3_600_000)] * 50, batch_size=5)))
        except BaseException as err:  # noqa: BLE001 - what it raises is the test's subject
            got.append(err)

    caller = threading.Thread(target=call_it)
    caller.start()
    assert handing.wait(10)
    c.close()
    go.set()
    caller.join(30)
    assert not caller.is_alive() and len(got) == 1
    assert not isinstance(got[0], BaseException) or isinstance(got[0], errors.FailedPrecondition), repr(got[0])


@pytest.mark.parametrize("batchers", [False, True])
def test_close_called_on_the_clients_own_io_loop_does_not_wait_for_itself(server, batchers):
    """close() from the blocking client's I/O loop thread (a callback run there): it waited
    on that loop for the batchers' close (forever: the loop was the thread waiting) and for
    the channel's close (10 s). It hands that work to the loop and returns; the loop then
    ends by itself, and calls after it are refused."""
    import threading

    from qdelay.client import Client, Outgoing

    c = Client(server.address, timeout=20)
    r = c.send_many([Outgoing("close.self", b"x", delay_ms=3_600_000)])[0]  # the loop and its channel
    if batchers:
        r = c.send("close.self", b"y", delay_ms=3_600_000)
        assert c.cancel(c.send("close.self", b"z", delay_ms=3_600_000)) == "CANCELLED"
    loop, thread = c._bulk.loop, c._bulk._thread
    done = threading.Event()
    got: list = []

    def on_loop() -> None:
        try:
            c.close()
        except BaseException as err:  # noqa: BLE001 - what it raises is the test's subject
            got.append(err)
        done.set()

    loop.call_soon_threadsafe(on_loop)
    assert done.wait(5), "close() on the I/O loop waited for that loop"
    assert got == []
    thread.join(10)
    assert not thread.is_alive()  # the loop ended by itself
    with pytest.raises(errors.FailedPrecondition):
        c.send("close.self", b"w")
    with pytest.raises(errors.FailedPrecondition):
        c.cancel(r)


def close_times_with_the_server_stopped(srv, close, loop, aclose) -> tuple[float, float]:
    """Seconds ``close()`` and then ``aclose()`` (a coroutine function, run on ``loop``)
    take while ``srv`` is stopped (SIGSTOP: its streams neither end nor fail)."""
    import os
    import signal

    os.kill(srv.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        close()
        took = time.monotonic() - started
        started = time.monotonic()
        loop.run_until_complete(aclose())
        return took, time.monotonic() - started
    finally:
        os.kill(srv.pid, signal.SIGCONT)


def test_close_ends_the_consumers_of_a_server_that_does_not_answer_together(tmp_path):
    """close() of a client whose server does not answer (stopped: its streams neither end
    nor fail) waited each consumer's 5 s close one after another (Client.close() with 4:
    20 s); it half-closes them all, then waits once. Blocking and asyncio."""
    import asyncio

    from serverproc import ServerProc

    from qdelay.aio import Client as AioClient
    from qdelay.client import Client

    with ServerProc(tmp_path / "s") as srv:
        c = Client(srv.address)
        consumers = [c.subscribe("close.hung", f"g{i}") for i in range(4)]
        for consumer in consumers:
            assert consumer.receive(1, 0.2) == []  # subscribed

        async def subscribed() -> tuple:
            ac = AioClient(srv.address)  # made on the loop it runs on
            out = [ac.subscribe("close.hung", f"a{i}") for i in range(4)]
            for consumer in out:
                assert await consumer.receive(1, 0.2) == []
            return ac, out

        loop = asyncio.new_event_loop()
        try:
            ac, held = loop.run_until_complete(subscribed())  # held: a dropped one is freed
            took, atook = close_times_with_the_server_stopped(srv, c.close, loop, ac.close)
        finally:
            loop.close()
        # one 5 s wait each, not 4 x 5 s (a margin of 3 consumers' waits for a loaded box)
        assert took < 14 and atook < 14, (took, atook)
        assert len(held) == 4


def test_sharded_close_ends_merged_consumers_of_a_server_that_does_not_answer_together(tmp_path):
    """ShardedClient.close() (and the asyncio one's) closed its merged consumers one after
    another, each waiting up to 5 s for a server that does not answer (stopped): 3 merged
    consumers took 15 s. They are half-closed together, then waited for once."""
    import asyncio

    from serverproc import ServerProc

    from qdelay.client import AioShardedClient, ShardedClient

    with ServerProc(tmp_path / "s") as srv:
        sc = ShardedClient(srv.address)
        merged = [sc.subscribe("close.hung.sharded", f"g{i}") for i in range(3)]
        for m in merged:
            assert m.receive(1, 0.3) == []

        async def subscribed() -> tuple:
            ac = AioShardedClient(srv.address)
            await ac.refresh()
            out = [ac.subscribe("close.hung.sharded", f"a{i}") for i in range(3)]
            for m in out:
                assert await m.receive(1, 0.3) == []
            return ac, out

        loop = asyncio.new_event_loop()
        try:
            ac, held = loop.run_until_complete(subscribed())
            took, atook = close_times_with_the_server_stopped(srv, sc.close, loop, ac.close)
        finally:
            loop.close()
        # one 5 s wait, not 3 x 5 s (a margin of about one more wait for a loaded box)
        assert took < 11 and atook < 11, (took, atook)
        assert len(held) == 3
