"""Concurrent cancel() calls share CancelBatch calls (client/batching.py CancelBatcher, the
blocking client's on its I/O loop): each caller gets its own outcome or its own error
within its own timeout, nobody waits forever."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from conftest import wait_until

from qdelay import errors
from qdelay.client import Batching, Client, DeadlineExceeded, Outgoing, Receipt
from qdelay.client.batching import CancelBatcher
from qdelay.v1 import qdelay_pb2 as pb

HOUR_MS = 3_600_000


def _pending(client: Client, n: int, tag: str) -> list:
    at = int(time.time() * 1000) + HOUR_MS
    return list(
        client.send_many([Outgoing("cc.t", b"p", deliver_at_ms=at + i, message_id=f"{tag}{i}") for i in range(n)])
    )


def test_concurrent_cancels_share_calls_and_each_caller_gets_its_own_outcome(server):
    with Client(server.address, batching=Batching(linger=0.002)) as c:
        receipts = _pending(c, 300, "share")
        targets = receipts + receipts[:40]  # 40 named twice: one CANCELLED, one ALREADY_CANCELLED
        random.Random(7).shuffle(targets)
        with ThreadPoolExecutor(16) as pool:
            out = list(pool.map(lambda r: (r.sequence, c.cancel(r)), targets))
        by_seq: dict[int, list[str]] = {}
        for seq, outcome in out:
            by_seq.setdefault(seq, []).append(outcome)
        assert len(by_seq) == 300
        assert all(
            sorted(v) == (["ALREADY_CANCELLED", "CANCELLED"] if len(v) == 2 else ["CANCELLED"]) for v in by_seq.values()
        )
        batcher = c._canceller
        assert batcher is not None and batcher.carried == len(targets)
        assert batcher.batches < len(targets) / 3  # gathered: far fewer calls than cancels
        assert {c.get(r).state for r in receipts[::30]} == {"CANCELLED"}


def test_a_bad_target_fails_only_its_caller_and_batching_off_is_one_call_each(server):
    with Client(server.address, batching=Batching(linger=0.005)) as c:
        receipts = _pending(c, 24, "bad")
        barrier = threading.Barrier(24)

        def one(i: int):
            barrier.wait()  # together: they share calls, the bad one among them
            target = pb.Receipt(message_id="caf\u00e9", deliver_at_ms=1, sequence=1) if i == 5 else receipts[i]
            try:
                return c.cancel(target)
            except errors.InvalidArgument as err:
                return err

        with ThreadPoolExecutor(24) as pool:
            out = list(pool.map(one, range(24)))
        assert isinstance(out[5], errors.InvalidArgument) and "message_id" in str(out[5])
        assert [o for i, o in enumerate(out) if i != 5] == ["CANCELLED"] * 23
    with Client(server.address, batching=False) as c:
        assert c.cancel(receipts[5]) == "CANCELLED"
        assert c.cancel(receipts[5]) == "ALREADY_CANCELLED"
        assert c._canceller is None


def test_a_lone_bad_cancel_is_refused_as_a_cancel_call_words_it(server):
    """A lone cancel rides the CancelStream as a batch of one: its refusal named the field
    in a batch the caller never made (``requests[0].receipt.message_id``), where a Cancel
    call (batching off) and reschedule() say ``receipt.message_id``."""
    bad = pb.Receipt(message_id="x" * 200, deliver_at_ms=1, sequence=1)
    said = []
    for batching in (True, False):
        with Client(server.address, batching=batching) as c:
            for target in (bad, "y" * 300):
                with pytest.raises(errors.InvalidArgument) as err:
                    c.cancel(target)
                said.append(err.value.details)
    assert said[:2] == said[2:] and said[0].startswith("receipt.message_id: ") and said[1].startswith("message_id: ")


def test_a_short_timeout_in_a_call_with_longer_ones_gets_deadline_exceeded_on_time(server):
    """The server is stopped (SIGSTOP) while a call carries a 30 s caller and a 2.5 s one: the
    2.5 s caller gets DEADLINE_EXCEEDED by its own timeout, the call goes on for the other,
    which gets its outcome once the server runs again (and the short caller's target was
    cancelled too: its outcome was unknown to it, as for a unary call that timed out)."""
    # linger 1 s: the second call waits for the short caller while the first is unanswered
    with Client(server.address, batching=Batching(linger=1.0)) as c:
        x, a, b, warm = _pending(c, 4, "deadline")
        assert c.cancel(warm) == "CANCELLED"  # the batcher exists, its channel is connected
        batcher = c._canceller
        assert batcher is not None
        results: dict[str, object] = {}

        def cancel(name: str, target, timeout: float) -> None:
            started = time.monotonic()
            try:
                results[name] = c.cancel(target, timeout=timeout)
            except errors.QdelayError as err:
                results[name] = err
            results[name + "_s"] = time.monotonic() - started

        threads = []

        def start(*args) -> None:
            threads.append(threading.Thread(target=cancel, args=args))
            threads[-1].start()

        os.kill(server.pid, signal.SIGSTOP)
        try:
            start("x", x, 30.0)
            wait_until(lambda: batcher._under_way == 1, what="x's call under way")
            start("a", a, 30.0)
            wait_until(lambda: batcher._queue, what="a queued, the call lingering")
            start("b", b, 2.5)
            wait_until(lambda: batcher.carried == 4, what="a and b's call under way")  # warm, x, then a and b
            assert batcher.batches == 3
            wait_until(lambda: "b" in results, timeout=10, what="the short caller answered")
            assert isinstance(results["b"], DeadlineExceeded)
            assert results["b_s"] < 2.5 + 1.5
            assert "a" not in results and "x" not in results  # their calls go on
        finally:
            os.kill(server.pid, signal.SIGCONT)
        for t in threads:
            t.join(30)
        assert results["a"] == results["x"] == "CANCELLED"
        assert c.get(b).state == "CANCELLED"  # the call went on for a; b rode along


def test_a_caller_whose_timeout_passes_while_queued_is_left_out(server):
    with Client(server.address, batching=Batching(linger=0.0)) as c:
        x, y, z = _pending(c, 3, "queued")
        results: dict[str, object] = {}

        def cancel(name: str, target, timeout: float) -> None:
            try:
                results[name] = c.cancel(target, timeout=timeout)
            except errors.QdelayError as err:
                results[name] = err

        assert c.cancel(_pending(c, 1, "queued-warm")[0]) == "CANCELLED"
        batcher = c._canceller
        os.kill(server.pid, signal.SIGSTOP)
        try:
            threads = [threading.Thread(target=cancel, args=(n, t, 30.0)) for n, t in (("x", x), ("y", y))]
            for k, t in enumerate(threads, 1):
                t.start()
                wait_until(lambda k=k: batcher._under_way == k, what=f"{k} calls under way (2: no credit left)")
            cancel("z", z, 0.5)  # queued behind them: no call carries it before its deadline
            assert isinstance(results["z"], DeadlineExceeded)
        finally:
            os.kill(server.pid, signal.SIGCONT)
        for t in threads:
            t.join(30)
        assert results["x"] == results["y"] == "CANCELLED"
        wait_until(lambda: batcher._under_way == 0, what="the calls answered")
        assert c.get(z).state == "PENDING"  # left out: never sent
        assert batcher.carried == 3


class _FakeServer:
    """CancelBatch / Cancel stand-ins (coroutines, as the clients' calls): outcome =
    sequence % 5 + 1 after a short random delay; targets with sequence 13 make their call
    UNAVAILABLE."""

    def __init__(self) -> None:
        self.rng = random.Random(3)
        self.sizes: list[int] = []

    async def batch(self, request: pb.CancelBatchRequest, _timeout):
        await asyncio.sleep(self.rng.random() * 0.002)
        self.sizes.append(len(request.requests))
        if any(r.receipt.sequence == 13 for r in request.requests):
            raise errors.Unavailable("down")
        return pb.CancelBatchResponse(
            responses=[pb.CancelResponse(outcome=r.receipt.sequence % 5 + 1) for r in request.requests]
        )

    async def single(self, request: pb.CancelRequest, _timeout):
        await asyncio.sleep(self.rng.random() * 0.002)
        self.sizes.append(1)
        if request.receipt.sequence == 13:
            raise errors.Unavailable("down")
        return pb.CancelResponse(outcome=request.receipt.sequence % 5 + 1)


def _request(seq: int) -> pb.CancelRequest:
    return pb.CancelRequest(receipt=pb.Receipt(message_id=f"m{seq}", deliver_at_ms=1, sequence=seq))


def test_many_threads_all_answered_and_an_unavailable_call_fails_its_callers():
    """Threads hand cancels to the batcher's loop (as the blocking client does)."""
    fake = _FakeServer()
    batcher = CancelBatcher(fake.batch, fake.single, max_batch=7, max_in_flight=2, linger=0.0005)
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()

    def one(seq: int):
        try:
            return batcher.submit_threadsafe(loop, _request(seq), 30).wait(30)
        except errors.Unavailable as err:
            return err

    try:
        seqs = list(range(1, 2001))
        with ThreadPoolExecutor(32) as pool:
            out = dict(zip(seqs, pool.map(one, seqs)))
        assert isinstance(out[13], errors.Unavailable)
        failed = [s for s, o in out.items() if isinstance(o, errors.Unavailable)]
        assert all(out[s] == s % 5 + 1 for s in seqs if s not in failed)
        assert len(failed) <= 7  # only the call that carried 13
        assert max(fake.sizes) <= 7 and sum(fake.sizes) == 2000 and len(fake.sizes) < 2000
        asyncio.run_coroutine_threadsafe(batcher.close(), loop).result(10)
        assert not batcher._queue and batcher._under_way == 0 and not batcher._carriers
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join(10)
        loop.close()


def test_many_tasks_all_answered_and_a_refused_call_goes_again_one_by_one():
    """Tasks on the batcher's loop (as the asyncio client's): a call refused as a whole
    (INVALID_ARGUMENT) is sent again one Cancel per target; only the bad one's caller fails."""
    fake = _FakeServer()

    async def batch(request, timeout):
        if any(r.receipt.sequence == 0 for r in request.requests):
            raise errors.InvalidArgument("receipt.sequence: 0")
        return await fake.batch(request, timeout)

    async def single(request, timeout):
        if request.receipt.sequence == 0:
            raise errors.InvalidArgument("receipt.sequence: 0")
        return await fake.single(request, timeout)

    async def main():
        batcher = CancelBatcher(batch, single, max_batch=50, max_in_flight=2, linger=0.0005)
        seqs = list(range(14, 800))
        seqs.insert(400, 0)

        async def one(seq: int):
            try:
                return await batcher.cancel(_request(seq), 30)
            except errors.QdelayError as err:
                return err

        out = dict(zip(seqs, await asyncio.gather(*(one(s) for s in seqs))))
        assert isinstance(out[0], errors.InvalidArgument)
        assert all(out[s] == s % 5 + 1 for s in seqs if s)
        assert batcher.calls < len(seqs) / 10 and sum(fake.sizes) == len(seqs) - 1
        await batcher.close()
        assert not batcher._queue and batcher._under_way == 0

    asyncio.run(asyncio.wait_for(main(), 60))


def test_cancel_batches_of_receipts_match_the_messages_ref_makes():
    """cancel_batches builds Receipt targets from their fields (a dict each, the fast way) and
    any other target through ``ref``: the requests are the same as ref-made ones throughout."""
    from qdelay.client.types import Receipt, cancel_batches, ref

    rs = [Receipt(f"m{i}", 1_764_000_000_000 + i, 10 + i, "s1" if i % 2 else "") for i in range(5)]
    targets = [
        rs[0],
        "plain-id",
        pb.Receipt(message_id="x", deliver_at_ms=5, sequence=7),
        str(rs[1]),
        ("t", 1, 2),
        *rs[2:],
    ]
    made = [pb.CancelRequest(receipt=r, message_id=m) for r, m in map(ref, targets)]
    assert cancel_batches(targets, 4) == [
        pb.CancelBatchRequest(requests=made[i : i + 4]) for i in range(0, len(made), 4)
    ]


def test_gathering_for_the_last_calls_callers_ends_once_they_are_back():
    """A linger of 1 s, far above a round trip: 16 threads (then 16 tasks) cancelling in a
    loop ride one call a round, and each next call goes as soon as the last one's 16
    callers are back, not when the linger ends (25 rounds would take 25 s); only the
    last call, short of callers, waits it out. (~1 s here; the bound leaves room for a
    loaded machine.)"""
    fake = _FakeServer()
    batcher = CancelBatcher(fake.batch, fake.single, max_batch=1000, max_in_flight=1, linger=1.0)
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    seqs = iter(range(100, 500))  # 400 targets (none is 13, which the fake fails)
    lock = threading.Lock()
    got: dict[int, int] = {}

    def worker(_k: int) -> None:
        while True:
            with lock:
                seq = next(seqs, None)
            if seq is None:
                return
            got[seq] = batcher.submit_threadsafe(loop, _request(seq), 30).wait(30)

    try:
        started = time.monotonic()
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(worker, range(16)))
        assert time.monotonic() - started < 12.0
        assert got == {seq: seq % 5 + 1 for seq in range(100, 500)}
        assert sum(fake.sizes) == 400 and len(fake.sizes) <= 50  # ~one call a round once all 16 are going
        # gathering leaves no threshold behind: the runner lowers it on the loop once the last
        # call's answers are out, which their callers may see before the loop gets there
        wait_until(lambda: batcher._want == 1 and batcher._inbox.wake_at == 1, 10, "the threshold back at 1")
    finally:
        asyncio.run_coroutine_threadsafe(batcher.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        runner.join(10)
        loop.close()

    async def tasks() -> None:
        fake.sizes.clear()
        aio = CancelBatcher(fake.batch, fake.single, max_batch=1000, max_in_flight=1, linger=1.0)
        todo = iter(range(100, 500))

        async def one() -> None:
            for seq in todo:
                assert await aio.cancel(_request(seq), 30) == seq % 5 + 1

        started = time.monotonic()
        await asyncio.gather(*(one() for _ in range(16)))
        assert time.monotonic() - started < 12.0
        assert sum(fake.sizes) == 400 and len(fake.sizes) <= 50
        await aio.close()

    asyncio.run(asyncio.wait_for(tasks(), 30))


def test_a_receipts_fields_make_the_same_request_as_its_cancel_request():
    """cancel() hands the batcher a Receipt as its fields (types.cancel_target), which the
    batcher writes into the call's request: the same bytes as the CancelRequests the targets
    make (a shard or none, mixed with targets by id and by text), and the same request for
    a target sent alone."""
    from qdelay.client import Receipt
    from qdelay.client.types import cancel_request, cancel_target

    targets = [
        Receipt("m1", 1_800_000_000_000, 7),
        Receipt("m2", 5, 2**63 + 1, "shard-b"),
        str(Receipt("m3", 9, 3, "s/1")),
        None,
        Receipt("", 0, 0),
    ]
    ids = [None, None, None, "by-id", None]
    handed = [cancel_target(t, mid) for t, mid in zip(targets, ids)]
    assert [type(h) for h in handed] == [tuple, tuple, pb.CancelRequest, pb.CancelRequest, tuple]
    want = pb.CancelBatchRequest(requests=[cancel_request(t, mid) for t, mid in zip(targets, ids)])
    got = CancelBatcher._batch_request(handed)
    assert got == want and got.SerializeToString() == want.SerializeToString()
    assert [CancelBatcher._single_request(h) for h in handed] == list(want.requests)


def test_a_lone_cancel_on_a_server_without_the_batch_rpcs_is_a_cancel_call():
    """With a stream every call, a lone cancel's too, is a CancelBatch request: against a
    server with neither CancelStream nor CancelBatch (UNIMPLEMENTED) a lone cancel was
    failed with UNIMPLEMENTED, every time, where a Cancel call answers it; only a batch of
    several fell back to Cancel calls."""
    calls = {"batch": 0, "single": 0}

    class _Unimplemented(errors.QdelayError):
        code = grpc.StatusCode.UNIMPLEMENTED

    class _NoBatchStream:
        async def __call__(self, _request, _timeout):
            calls["batch"] += 1
            raise _Unimplemented("no CancelStream, no CancelBatch here")

        async def close(self) -> None:
            pass

    async def single(_request, _timeout):
        calls["single"] += 1
        return pb.CancelResponse(outcome=pb.CancelResponse.CANCELLED)

    async def main() -> None:
        b = CancelBatcher(_NoBatchStream(), single, stream=_NoBatchStream())  # type: ignore[arg-type]
        assert await b.cancel(_request(7), 5) == pb.CancelResponse.CANCELLED
        assert await b.cancel(_request(8), 5) == pb.CancelResponse.CANCELLED
        await b.close()

    asyncio.run(asyncio.wait_for(main(), 30))
    assert calls == {"batch": 1, "single": 2}  # asked once, then Cancel calls


def _counted(batcher, calls: list) -> None:
    """Every call ``batcher`` makes (batch or single) appended to ``calls``."""
    for name in ("_batch_call", "_single_call"):
        made = getattr(batcher, name)

        async def call(request, timeout, made=made, name=name):
            calls.append(name)
            return await made(request, timeout)

        setattr(batcher, name, call)


def test_a_refusal_of_the_whole_server_fails_every_gathered_caller_without_single_calls(tmp_path):
    """A server that refuses every write (here its disk below the free-space floors:
    RESOURCE_EXHAUSTED; a slave or a fenced master says FAILED_PRECONDITION) refuses a
    gathered batch for a reason no target of it is to blame for: each caller gets that
    error from the batch's one call. Splitting it into one Cancel/Reschedule per target
    (as a batch refused for one bad target is) sent up to max_batch calls at a server that
    was refusing, for the same error each."""
    from serverproc import ServerProc

    huge = str(1 << 60)
    args = ["--min-free-bytes", huge, "--set", f"min_free_bytes_hard={huge}"]
    at = int(time.time() * 1000) + HOUR_MS
    targets = [Receipt(f"full{i}", at + i, i + 1, "") for i in range(40)]
    with ServerProc(tmp_path / "full", args=args) as srv, Client(srv.address, batching=Batching(linger=0.01)) as c:
        for what, do in (("cancel", lambda t: c.cancel(t)), ("reschedule", lambda t: c.reschedule(t, delay_ms=1000))):
            with pytest.raises(errors.ResourceExhausted):
                do(targets[0])  # the batcher made (a lone target: its own call)
            batcher = c._canceller if what == "cancel" else c._rescheduler
            calls: list[str] = []
            _counted(batcher, calls)
            carried = batcher.batches
            barrier = threading.Barrier(len(targets))

            def one(target, do=do, barrier=barrier):
                barrier.wait()  # together: they share calls
                try:
                    return do(target)
                except errors.QdelayError as err:
                    return err

            with ThreadPoolExecutor(len(targets)) as pool:
                out = list(pool.map(one, targets))
            assert all(isinstance(o, errors.ResourceExhausted) for o in out), out
            made = batcher.batches - carried
            assert made < len(targets) / 2, what  # gathered
            assert len(calls) == made, (what, calls)  # one call each, none split


def test_by_id_targets_refused_by_a_server_without_the_id_index_fail_only_their_callers(tmp_path):
    """FAILED_PRECONDITION for a batch with targets named by id (by-id lookups off) is
    theirs: those callers get it, the targets named by receipt are carried again and
    cancelled."""
    from serverproc import ServerProc

    with ServerProc(tmp_path / "noids", args=["--set", "engine.id_index=false"]) as srv:
        with Client(srv.address, batching=Batching(linger=0.01)) as c:
            receipts = _pending(c, 30, "noids")
            barrier = threading.Barrier(len(receipts))

            def one(k: int):
                barrier.wait()
                try:
                    return c.cancel(message_id=receipts[k].message_id) if k % 3 == 0 else c.cancel(receipts[k])
                except errors.QdelayError as err:
                    return err

            with ThreadPoolExecutor(len(receipts)) as pool:
                out = list(pool.map(one, range(len(receipts))))
            assert all(isinstance(o, errors.FailedPrecondition) and "by-id" in str(o) for o in out[::3]), out
            assert [o for k, o in enumerate(out) if k % 3] == ["CANCELLED"] * 20
