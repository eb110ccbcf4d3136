"""qdelay from Python: send delayed messages, receive them at their due time, ack, cancel.

qdelay server --data-dir ./data &            # listens on 127.0.0.1:7600
python examples/python/example.py [HOST:PORT] [--token TOKEN] [--tls-ca FILE]

A server started with --auth-token-file needs --token (one of the file's tokens); without
it, or with a wrong one, the example says so in one line and exits with 1, as it does when
nothing answers at the address or the server there takes no writes (a slave).
"""

from __future__ import annotations

import argparse
import sys
import time

from qdelay import errors
from qdelay.client import Client, Outgoing


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("address", nargs="?", default="127.0.0.1:7600")
    parser.add_argument("--token", help="bearer token (server started with --auth-token-file)")
    parser.add_argument("--tls-ca", help="PEM certificate to trust (server started with --tls-cert)")
    args = parser.parse_args()

    try:
        with Client(args.address, token=args.token, tls_ca=args.tls_ca, timeout=10) as client:
            return walk_through(client, f"py.example.{int(time.time())}")
    except errors.Unauthenticated as e:
        # the server was started with --auth-token-file: one line saying what to do, not a traceback
        said = "refused the token given" if args.token else "requires a token"
        print(
            f"example.py: the server at {args.address} {said} ({e.details}); pass one of its tokens with --token TOKEN",
            file=sys.stderr,
        )
        return 1
    except errors.FailedPrecondition as e:
        # a slave, or a fenced master (after a failover): it answers but takes no writes
        print(
            f"example.py: the server at {args.address} takes no writes ({e.details}); give the master's address",
            file=sys.stderr,
        )
        return 1
    except errors.Unavailable as e:
        if not args.tls_ca and "Socket closed" in e.details:
            # a plaintext call to a TLS port: gRPC says only "Socket closed" (not 'make run')
            print(
                f"example.py: the server at {args.address} closed the connection ({e.details}); "
                f"if it serves TLS, pass its CA certificate with --tls-ca FILE",
                file=sys.stderr,
            )
            return 1
        # nothing listening (the server not started yet, another address): say so in a line
        said = f"no qdelay server answers at {args.address} ({e.details})"
        print(f"example.py: {said}; start one with 'make run'", file=sys.stderr)
        return 1


def walk_through(client: Client, subject: str) -> int:
    """Send, cancel, consume and ack on ``subject``; the exit code."""
    # one message due in 500 ms, on the server's clock
    keep = client.send(subject, b"close order 42", delay_ms=500, headers={"order": "42"})
    print(f"sent {keep.message_id} due at {keep.deliver_at_ms}")

    # many at once: pipelined batches, each acknowledged once durable (Outgoing tuples
    # are the cheapest form; Message objects from client.message work too)
    receipts = client.send_many((Outgoing(subject, b"bulk %d" % i, delay_ms=800) for i in range(1000)), batch_size=500)
    print(f"sent {len(receipts)} more in batches")

    # cancel one before it is due
    drop = client.send(subject, b"never delivered", delay_ms=1000)
    print(f"cancel {drop.message_id}: {client.cancel(drop)}")

    # bad input is refused with a precise error, nothing is written
    try:
        client.send("not a subject!", b"", delay_ms=0)
    except errors.InvalidArgument as e:
        print(f"refused: {e}")

    # consume: batches of deliveries, acknowledged in one request each
    want = 1 + len(receipts)
    seen: set[str] = set()
    with client.subscribe(subject, group="example", max_in_flight=1000) as consumer:
        for batch in consumer.batches():
            now = time.time_ns() // 1_000_000
            assert all(now >= d.deliver_at_ms for d in batch), "delivered early"
            seen.update(d.message_id for d in batch)
            consumer.ack(batch)
            if len(seen) >= want:
                break
    print(f"received {len(seen)} messages; cancelled one delivered: {drop.message_id in seen}")
    print(f"state of the first: {client.state_name(client.get(keep))}")
    print(f"stats: {client.stats()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
