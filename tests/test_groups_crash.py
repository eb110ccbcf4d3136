"""SIGKILL under load with several consumer groups (issue 14, Must show): a producer sends
batches due within 1.5 s while two groups consume and acknowledge (one with two competing
consumers), and the server is killed at random instants. Whatever the server answered a
Send for is delivered to every group at least once by the end (no acknowledged message
lost for any group), never before its due time, and afterwards no group has anything left
due or in flight."""

from __future__ import annotations

import random
import threading
import time

import pytest
from conftest import wait_until

from qdelay import errors
from tests.serverproc import ServerProc

SUBJECT = "crash.groups"
CONSUMERS = {"billing": 2, "notify": 1}  # group -> competing consumers
TRIALS = 4
pytestmark = pytest.mark.slow  # about 20 s of SIGKILL trials


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class Book:
    """What the server answered, and what each group's consumers saw."""

    def __init__(self) -> None:
        self.sent: dict[str, int] = {}  # id -> due, for every Send the server answered
        self.seen: dict[str, dict[str, int]] = {g: {} for g in CONSUMERS}  # group -> id -> deliveries
        self.early: list = []
        self.lock = threading.Lock()


def produce(srv: ServerProc, trial: int, book: Book, rng: random.Random, stop: threading.Event) -> None:
    c = srv.client(retries=0, timeout=5)
    n = 0
    try:
        while not stop.is_set():
            base = now_ms()
            msgs = [
                c.message(SUBJECT, b"p", message_id=f"g{trial}-{n + i}", deliver_at_ms=base + rng.randint(0, 1500))
                for i in range(50)
            ]
            n += 50
            receipts = c.send_batch(msgs)
            with book.lock:
                book.sent.update((r.message_id, r.deliver_at_ms) for r in receipts)
    except errors.QdelayError:
        return  # the server died: the batch in progress was not answered
    finally:
        c.close()


def consume(srv: ServerProc, group: str, book: Book, stop: threading.Event) -> None:
    c = srv.client(retries=0)
    consumer = c.subscribe(SUBJECT, group=group, max_in_flight=2000)
    # the consumer outlives a killed server (it resubscribes by itself): close it when the
    # trial stops, or the join would wait out its timeout
    threading.Thread(target=lambda: (stop.wait(), consumer.close(timeout=1.0)), daemon=True).start()
    seen = book.seen[group]
    try:
        for batch in consumer.batches():
            t = now_ms()
            with book.lock:
                for d in batch:
                    if t < d.deliver_at_ms or d.dispatched_at_ms < d.deliver_at_ms:
                        book.early.append((group, d.message_id, d.deliver_at_ms, t))
                    seen[d.message_id] = seen.get(d.message_id, 0) + 1
            consumer.ack(batch)
            if stop.is_set():
                break
    except errors.QdelayError:
        pass
    finally:
        consumer.close()
        c.close()


def consumers(srv: ServerProc, book: Book, stop: threading.Event) -> list[threading.Thread]:
    threads = [
        threading.Thread(target=consume, args=(srv, g, book, stop), daemon=True)
        for g, n in CONSUMERS.items()
        for _ in range(n)
    ]
    for t in threads:
        t.start()
    return threads


def test_sigkill_under_load_with_two_groups(tmp_path):
    rng = random.Random(20261125)
    srv = ServerProc(tmp_path / "data", args=["--set", "engine.ack_timeout_ms=1500"])
    book = Book()
    srv.start()
    with srv.client() as c:
        for g in CONSUMERS:
            assert c.create_group(SUBJECT, g)
    for trial in range(TRIALS):
        if trial:
            srv.start()
        stop = threading.Event()
        threads = consumers(srv, book, stop)
        threads.append(threading.Thread(target=produce, args=(srv, trial, book, rng, stop), daemon=True))
        threads[-1].start()
        time.sleep(rng.uniform(0.8, 2.0))  # let the load run a random while, then kill
        srv.kill9()
        stop.set()
        for t in threads:
            t.join(10)
    assert len(book.sent) > 300, "the load did not get going"
    srv.start()
    try:
        stop = threading.Event()
        threads = consumers(srv, book, stop)

        def everywhere() -> bool:
            with book.lock:
                return now_ms() > max(book.sent.values()) + 500 and all(
                    book.sent.keys() <= seen.keys() for seen in book.seen.values()
                )

        wait_until(everywhere, timeout=30, what="every message delivered to every group", interval=0.1)
        with srv.client() as c:

            def settled() -> bool:
                rows = [g for g in c.groups() if g["subject"] == SUBJECT]
                return len(rows) == len(CONSUMERS) and all(g["backlog"] == 0 and g["in_flight"] == 0 for g in rows)

            wait_until(settled, timeout=15, what="both groups with nothing due or in flight")
        stop.set()
        for t in threads:
            t.join(10)
    finally:
        assert srv.stop() == 0
    with book.lock:
        for g, seen in book.seen.items():
            missing = sorted(book.sent.keys() - seen.keys())
            assert not missing, f"group {g}: {len(missing)} acknowledged messages never delivered: {missing[:5]}"
        assert not book.early, f"delivered before due: {book.early[:5]}"
        again = {g: sum(n - 1 for n in seen.values()) for g, seen in book.seen.items()}
        print(
            f"\n{TRIALS} SIGKILL trials: {len(book.sent)} acknowledged, each to {len(CONSUMERS)} groups; "
            f"redelivered {again}"
        )
