"""What Python gRPC itself costs per message, before qdelay does anything.

    python -m bench.grpc_floor [--batches 2000] [--batch 100]

A bare ``grpc.aio`` server implementing qdelay's own SendBatch and SendStream (same
proto, same generated code) that stores nothing, in its own process; the producer is a
sync ``grpc`` client in this process, as the Python client is. For each shape it reports
the server's CPU per message (all its threads), the client's, and messages/s:

- SendBatch calls, 1 and 8 in flight; SendStream with 8 batches unanswered;
- each answered with a full Receipt per message (what SendBatch answers by default),
  with compact receipts (first sequence + packed due times), or with nothing.

This is the floor under ``bench.ingest`` and the ingest scenario of ``bench.compare``:
qdelay's server CPU per message is this plus validation, encoding, the message log, the
iterate service and the scheduler. Writes bench/out/grpc_floor.json.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import subprocess
import sys
import threading
import time

from bench.common import cpu_seconds, machine, print_table, write_json

ANSWERS = ("receipts", "compact", "empty")


def start_bare(address: str):
    """The bare server in its own process, once it serves (the caller kills it)."""
    server = subprocess.Popen(
        [sys.executable, "-m", "bench.grpc_floor", "--serve", address], stdout=subprocess.PIPE, text=True
    )
    if server.stdout.readline().strip() != "ready":
        server.kill()
        raise RuntimeError("the bare server did not start")
    return server


def serve(address: str) -> None:
    """The bare server: answers as the request's first message's subject says, one of
    ANSWERS; any other subject (bench.shapes' producers) gets what the request asks for, as
    from qdelay: compact receipts when ``compact_receipts`` is set, else full ones (a unary
    Send: its receipt)."""
    import grpc

    from qdelay.v1 import qdelay_pb2 as pb
    from qdelay.v1 import qdelay_pb2_grpc as pb_grpc

    def answer(request) -> pb.SendBatchResponse:
        resp = pb.SendBatchResponse()
        how = request.messages[0].subject if request.messages else "empty"
        if how not in ANSWERS:  # a real producer (bench.shapes): what it asks for, as qdelay answers
            how = "compact" if request.compact_receipts else "receipts"
        if how == "receipts":
            add = resp.receipts.add
            for seq, m in enumerate(request.messages, 1):
                r = add()
                r.message_id = m.message_id
                r.deliver_at_ms = m.deliver_at_ms
                r.sequence = seq
        elif how == "compact":
            resp.first_sequence = 1
            resp.deliver_at_ms.extend([m.deliver_at_ms for m in request.messages])
        return resp

    sequence = iter(range(1, 1 << 62))

    class Bare(pb_grpc.DelayServiceServicer):
        async def Send(self, request, context):
            # what a unary Send must answer at least: a receipt (bench.shapes "unary" floor)
            m = request.message
            return pb.SendResponse(
                receipt=pb.Receipt(message_id=m.message_id, deliver_at_ms=m.deliver_at_ms, sequence=next(sequence))
            )

        async def SendBatch(self, request, context):
            return answer(request)

        async def SendStream(self, request_iterator, context):
            async for request in request_iterator:
                yield answer(request)

    async def main() -> None:
        server = grpc.aio.server()
        pb_grpc.add_DelayServiceServicer_to_server(Bare(), server)
        server.add_insecure_port(address)
        await server.start()
        print("ready", flush=True)
        await server.wait_for_termination()

    asyncio.run(main())


def run_shape(stub, pb, shape: str, inflight: int, answer: str, batches: int, batch: int, server_pid: int) -> dict:
    due = int(time.time() * 1000) + 600_000
    request = pb.SendBatchRequest(
        messages=[
            pb.Message(subject=answer, payload=b"p" * 100, message_id=str(10_000_000 + i), deliver_at_ms=due + i)
            for i in range(batch)
        ]
    )
    for _ in range(20):  # warm up the channel and the server's code paths
        stub.SendBatch(request, timeout=30)
    srv0, cli0, t0 = cpu_seconds(server_pid), cpu_seconds(), time.perf_counter()
    if shape == "stream":
        credit = threading.Semaphore(inflight)

        def requests():
            for _ in range(batches):
                credit.acquire()
                yield request

        for _ in stub.SendStream(requests(), timeout=300):
            credit.release()
    elif inflight == 1:
        for _ in range(batches):
            stub.SendBatch(request, timeout=30)
    else:
        waiting: collections.deque = collections.deque()
        for _ in range(batches):
            if len(waiting) >= inflight:
                waiting.popleft().result()
            waiting.append(stub.SendBatch.future(request, timeout=30))
        for f in waiting:
            f.result()
    wall = time.perf_counter() - t0
    n = batches * batch
    return dict(
        shape=shape,
        in_flight=inflight,
        answer=answer,
        msgs_per_s=round(n / wall),
        server_cpu_us_per_msg=round((cpu_seconds(server_pid) - srv0) * 1e6 / n, 2),
        client_cpu_us_per_msg=round((cpu_seconds() - cli0) * 1e6 / n, 2),
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each case's median is reported")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve)
        return 0

    import socket

    import grpc

    from qdelay.v1 import qdelay_pb2 as pb
    from qdelay.v1 import qdelay_pb2_grpc as pb_grpc

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    server = subprocess.Popen(
        [sys.executable, "-m", "bench.grpc_floor", "--serve", address], stdout=subprocess.PIPE, text=True
    )
    try:
        if server.stdout.readline().strip() != "ready":
            raise RuntimeError("the bare server did not start")
        channel = grpc.insecure_channel(address)
        stub = pb_grpc.DelayServiceStub(channel)
        cases = [
            (shape, k, answer) for shape, k in (("SendBatch", 1), ("SendBatch", 8), ("stream", 8)) for answer in ANSWERS
        ]
        runs: dict[tuple, list[dict]] = collections.defaultdict(list)
        started = machine()
        for _ in range(args.repeats):  # interleaved, so that load changes hit every case alike
            for case in cases:
                runs[case].append(run_shape(stub, pb, *case, args.batches, args.batch, server.pid))
        channel.close()
    finally:
        server.kill()
        server.wait()
    rows, results = [], []
    for case in cases:
        best = sorted(runs[case], key=lambda r: r["server_cpu_us_per_msg"])[len(runs[case]) // 2]  # median
        results.append(best)
        rows.append(
            [
                best["shape"],
                best["in_flight"],
                best["answer"],
                best["msgs_per_s"],
                best["server_cpu_us_per_msg"],
                best["client_cpu_us_per_msg"],
            ]
        )
    print_table(
        ["shape", "in flight", "answer", "msgs/s", "server CPU µs/msg", "client CPU µs/msg"],
        rows,
        title=f"bare grpc.aio server, batches of {args.batch} x 100-byte messages "
        f"(median of {args.repeats}; load {started['loadavg']})",
    )
    path = write_json("grpc_floor", dict(machine=started, ended=machine(), batch=args.batch, results=results))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
