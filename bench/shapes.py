"""Producer shapes other users have (issue 15), as producer processes for bench.ingest and
bench.compare: each shape sends ``n`` messages of ``payload`` bytes due 10-11 min ahead and
reports its wall time and CPU.

qdelay:
- ``aio64``: one asyncio process, 64 tasks each awaiting ``client.send(...)`` one message
  at a time (the batching path gathers them into SendStream batches);
- ``threads16``: the blocking client's ``send()`` from 16 threads of one process;
  ``threads16_1cpu`` the same with the producer process pinned to one CPU (its threads
  then trade the GIL on one core instead of waking each other across two);
- ``stub100``: a generated stub and nothing of the project's client: ``SendBatch`` of 100
  with full receipts, one call in flight;
- ``stream16``: a generated grpc.aio stub and nothing of the project's client: batches of
  16 with compact receipts on one SendStream, the next written once the last is answered:
  16 messages in flight as threads16 has, with no client threads (threads16's ceiling);
- ``unary``: a generated stub's unary ``Send``, one call at a time per process (run with
  8 processes; also against the bare grpc.aio server of bench.grpc_floor, the floor).
Redis (AOF appendfsync always):
- ``redis1``: one ZADD per call (run with 8 processes);
- ``redis100``: a pipeline of 100 ZADDs, one in flight.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import time

CTX = mp.get_context("spawn")
DUE_AHEAD_MS = 600_000


def _mark() -> tuple[float, float, int, int]:
    """Wall time, this process's CPU seconds (all its threads) and its voluntary and
    involuntary context switches so far."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return time.time(), ru.ru_utime + ru.ru_stime, ru.ru_nvcsw, ru.ru_nivcsw


def _since(mark: tuple[float, float, int, int]) -> tuple[float, float, float, int, int]:
    """(start, end, CPU seconds, voluntary and involuntary switches) since ``mark``."""
    now = _mark()
    return mark[0], now[0], now[1] - mark[1], now[2] - mark[2], now[3] - mark[3]


def _qdelay_aio(address: str, n: int, first: int, body: bytes, concurrency: int = 64):
    import asyncio

    from qdelay.aio import Client

    async def main():
        async with Client(address, retries=0, timeout=120) as c:
            await c.wait_ready()
            await c.send("bench.warm", b"w", delay_ms=DUE_AHEAD_MS)
            yield_ready()
            await asyncio.get_running_loop().run_in_executor(None, wait_go)
            due = int(time.time() * 1000) + DUE_AHEAD_MS
            counter = iter(range(first, first + n))
            mark = _mark()

            async def task():
                for i in counter:  # the tasks share one counter: n in all
                    await c.send("bench", body, deliver_at_ms=due + i % 60_000, message_id=str(i))

            await asyncio.gather(*(task() for _ in range(concurrency)))
            return _since(mark)

    return asyncio.run(main())


def _qdelay_threads(address: str, n: int, first: int, body: bytes, threads: int = 16, one_cpu: bool = False):
    import threading

    from qdelay.client import Client

    if one_cpu:  # before any thread starts (grpc's and the client's too): they inherit it
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})

    with Client(address, retries=0, timeout=120) as c:
        c.wait_ready()
        c.send("bench.warm", b"w", delay_ms=DUE_AHEAD_MS)
        yield_ready()
        wait_go()
        due = int(time.time() * 1000) + DUE_AHEAD_MS
        counter = iter(range(first, first + n))
        lock = threading.Lock()

        def run():
            while True:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                c.send("bench", body, deliver_at_ms=due + i % 60_000, message_id=str(i))

        mark = _mark()
        ts = [threading.Thread(target=run) for _ in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return _since(mark)


def _stub(address: str):
    import grpc

    from qdelay.v1 import qdelay_pb2 as pb
    from qdelay.v1 import qdelay_pb2_grpc as pb_grpc

    channel = grpc.insecure_channel(address)
    grpc.channel_ready_future(channel).result(timeout=30)
    return channel, pb_grpc.DelayServiceStub(channel), pb


def _batch_requests(n: int, first: int, body: bytes, batch: int, compact: bool) -> list:
    """SendBatchRequests of ``batch`` messages (ids ``first``.. ``first + n - 1``), due
    DUE_AHEAD_MS ahead spread over a minute: built before the clock starts."""
    from qdelay.v1 import qdelay_pb2 as pb

    due = int(time.time() * 1000) + DUE_AHEAD_MS
    return [
        pb.SendBatchRequest(
            messages=[
                pb.Message(subject="bench", payload=body, message_id=str(i), deliver_at_ms=due + i % 60_000)
                for i in range(k, min(k + batch, first + n))
            ],
            compact_receipts=compact,
        )
        for k in range(first, first + n, batch)
    ]


def _stub_batch(address: str, n: int, first: int, body: bytes, batch: int = 100):
    channel, stub, pb = _stub(address)
    requests = _batch_requests(n, first, body, batch, compact=False)
    stub.SendBatch(pb.SendBatchRequest(messages=[pb.Message(subject="bench.warm", delay_ms=DUE_AHEAD_MS)]))
    yield_ready()
    wait_go()
    mark = _mark()
    for request in requests:
        resp = stub.SendBatch(request, timeout=60)
        assert len(resp.receipts) == len(request.messages)  # full receipts
    out = _since(mark)
    channel.close()
    return out


def _stream16(address: str, n: int, first: int, body: bytes, batch: int = 16):
    import asyncio

    import grpc

    from qdelay.v1 import qdelay_pb2 as pb
    from qdelay.v1 import qdelay_pb2_grpc as pb_grpc

    async def main():
        async with grpc.aio.insecure_channel(address) as channel:
            await asyncio.wait_for(channel.channel_ready(), 30)
            stub = pb_grpc.DelayServiceStub(channel)
            requests = _batch_requests(n, first, body, batch, compact=True)
            warm = pb.Message(subject="bench.warm", delay_ms=DUE_AHEAD_MS)
            await stub.SendBatch(pb.SendBatchRequest(messages=[warm]))
            yield_ready()
            await asyncio.get_running_loop().run_in_executor(None, wait_go)
            mark = _mark()
            call = stub.SendStream()
            for request in requests:  # one batch in flight: the next once this one is answered
                await call.write(request)
                resp = await call.read()
                assert len(resp.deliver_at_ms) == len(request.messages)
            await call.done_writing()
            return _since(mark)

    return asyncio.run(main())


def _unary(address: str, n: int, first: int, body: bytes):
    channel, stub, pb = _stub(address)
    due = int(time.time() * 1000) + DUE_AHEAD_MS
    requests = [
        pb.SendRequest(message=pb.Message(subject="bench", payload=body, message_id=str(i), deliver_at_ms=due + i))
        for i in range(first, first + n)
    ]
    stub.Send(pb.SendRequest(message=pb.Message(subject="bench.warm", delay_ms=DUE_AHEAD_MS)))
    yield_ready()
    wait_go()
    mark = _mark()
    for request in requests:
        stub.Send(request, timeout=60)
    out = _since(mark)
    channel.close()
    return out


def _redis(port: int, n: int, first: int, body: bytes, batch: int = 1):
    import redis

    r = redis.Redis(host="127.0.0.1", port=port, socket_timeout=60)
    r.ping()
    due = int(time.time() * 1000) + DUE_AHEAD_MS
    members = [b"%d:" % i + body for i in range(first, first + n)]
    yield_ready()
    wait_go()
    mark = _mark()
    if batch == 1:
        for i, m in enumerate(members):
            r.zadd("dq", {m: due + i % 60_000})
    else:
        for k in range(0, n, batch):
            p = r.pipeline(transaction=False)
            for i, m in enumerate(members[k : k + batch]):
                p.zadd("dq", {m: due + (k + i) % 60_000})
            p.execute()
    out = _since(mark)
    r.close()
    return out


KINDS = {
    "aio64": _qdelay_aio,
    "threads16": _qdelay_threads,
    "threads16_1cpu": lambda address, n, first, body: _qdelay_threads(address, n, first, body, one_cpu=True),
    "stub100": _stub_batch,
    "stream16": _stream16,
    "unary": _unary,
    "redis1": lambda port, n, first, body: _redis(port, n, first, body, 1),
    "redis100": lambda port, n, first, body: _redis(port, n, first, body, 100),
}

_q = None
_go = None


def yield_ready() -> None:
    _q.put("ready")


def wait_go() -> None:
    if not _go.wait(120):
        raise TimeoutError("no go signal")


def _worker(kind, target, n, first, payload, q, go):
    global _q, _go
    _q, _go = q, go
    try:
        start, end, cpu, vcsw, ivcsw = KINDS[kind](target, n, first, b"p" * payload)
        q.put(dict(start=start, end=end, cpu=cpu, vcsw=vcsw, ivcsw=ivcsw, n=n))
    except BaseException as e:  # noqa: BLE001 - report to the parent
        q.put(dict(error=repr(e)))


def run(kind: str, target, n: int, procs: int, payload: int, first: int, server_cpu) -> dict:
    """``procs`` processes of ``kind`` sending ``n`` messages in all to ``target`` (an address,
    or Redis's port); ``server_cpu()`` gives the server's CPU seconds so far. Returns msgs/s,
    server and producer CPU per message, and the producers' context switches per message
    (voluntary: a thread blocked, on a lock, the GIL or a socket; involuntary: preempted)."""
    q, go = CTX.Queue(), CTX.Event()
    per = n // procs
    ps = [
        CTX.Process(target=_worker, daemon=True, args=(kind, target, per, first + p * per, payload, q, go))
        for p in range(procs)
    ]
    for p in ps:
        p.start()
    for _ in ps:
        got = q.get(timeout=120)
        if got != "ready":
            raise RuntimeError(got.get("error", got))
    cpu0 = server_cpu()
    go.set()
    results = [q.get(timeout=600) for _ in ps]
    srv = server_cpu() - cpu0
    for p in ps:
        p.join(30)
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise RuntimeError(errors[0])
    total = sum(r["n"] for r in results)
    secs = max(r["end"] for r in results) - min(r["start"] for r in results)
    return dict(
        n=total,
        secs=round(secs, 2),
        msgs_per_s=round(total / secs),
        srv_cpu_us_per_msg=round(srv * 1e6 / total, 1),
        client_cpu_us_per_msg=round(sum(r["cpu"] for r in results) * 1e6 / total, 1),
        client_vcsw_per_msg=round(sum(r["vcsw"] for r in results) / total, 2),
        client_ivcsw_per_msg=round(sum(r["ivcsw"] for r in results) / total, 2),
    )
