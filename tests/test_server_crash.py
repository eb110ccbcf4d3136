"""Crash trials: a real server under sending (and consuming) load is killed with SIGKILL at
random instants; after the last restart every acknowledged message is delivered, none early,
and nothing that was never sent shows up."""

from __future__ import annotations

import collections
import random
import threading
import time

import pytest
from serverproc import ServerProc

from qdelay import errors

pytestmark = pytest.mark.slow

TRIALS = 10
SUBJECT = "crash.test"


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class Load:
    """A producer and a consumer thread against one server incarnation."""

    def __init__(self, srv: ServerProc, trial: int, acked: dict, delivered: dict, early: list, rng) -> None:
        self.srv, self.trial, self.acked, self.delivered, self.early, self.rng = (
            srv,
            trial,
            acked,
            delivered,
            early,
            rng,
        )
        self.stop = threading.Event()
        self.consumer = None
        self.threads = [
            threading.Thread(target=self.produce, daemon=True),
            threading.Thread(target=self.consume, daemon=True),
        ]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def join(self) -> None:
        self.stop.set()
        # the consumer resubscribes by itself after the kill: closing it is what ends it
        deadline = time.monotonic() + 20
        while any(t.is_alive() for t in self.threads) and time.monotonic() < deadline:
            if self.consumer is not None:
                self.consumer.close(timeout=1)
            for t in self.threads:
                t.join(0.1)
        assert not any(t.is_alive() for t in self.threads), "a load thread did not stop"

    def produce(self) -> None:
        c = self.srv.client(retries=0, timeout=5)
        n = 0
        try:
            while not self.stop.is_set():
                base = now_ms()
                msgs = [
                    c.message(
                        SUBJECT,
                        b"p",
                        message_id=f"t{self.trial}-{n + i}",
                        deliver_at_ms=base + self.rng.randint(-200, 2500),
                    )
                    for i in range(50)
                ]
                n += 50
                try:
                    receipts = c.send_batch(msgs)
                except errors.QdelayError:
                    return  # the server died: this batch is not acknowledged
                for r in receipts:
                    self.acked[r.message_id] = r.deliver_at_ms
        finally:
            c.close()

    def consume(self) -> None:
        c = self.srv.client(retries=0)
        consumer = self.consumer = c.subscribe(SUBJECT, max_in_flight=2000)
        try:
            for batch in consumer.batches():
                t = now_ms()
                for d in batch:
                    if t < d.deliver_at_ms or d.dispatched_at_ms < d.deliver_at_ms:
                        self.early.append((d.message_id, d.deliver_at_ms, t))
                    self.delivered[d.message_id] = self.delivered.get(d.message_id, 0) + 1
                consumer.ack(batch)
                if self.stop.is_set():
                    break
        except errors.QdelayError:
            pass
        finally:
            consumer.close()
            c.close()


def test_sigkill_under_load_loses_no_acknowledged_message(tmp_path):
    rng = random.Random(20261122)
    data = tmp_path / "data"
    srv = ServerProc(data, args=["--set", "engine.ack_timeout_ms=1500", "--set", "engine.retry_backoff_ms=0"])
    acked: dict[str, int] = {}
    delivered: dict[str, int] = {}
    early: list = []
    for trial in range(TRIALS):
        srv.start()
        load = Load(srv, trial, acked, delivered, early, rng)
        load.start()
        time.sleep(rng.uniform(0.3, 1.5))
        srv.kill9()
        load.join()
    assert len(acked) > 1000, "the load did not get going"
    # final incarnation: drain everything
    srv.start()
    try:
        load = Load(srv, TRIALS, {}, delivered, early, rng)
        load.threads = load.threads[1:]  # consumer only
        load.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            missing = [m for m in acked if m not in delivered]
            if not missing and now_ms() > max(acked.values()) + 500:
                break
            time.sleep(0.2)
        load.join()
        c = srv.client()
        stats = c.stats()
        missing = [m for m in acked if m not in delivered]
        # what the server says of a few missing ones: enough to tell a lost record from a
        # stuck scheduler when this fails on a machine we cannot look at
        seen = {m: c.get(message_id=m).state for m in missing[:10]} if missing else {}
    finally:
        assert srv.stop() == 0
    assert not missing, (
        f"{len(missing)} of {len(acked)} acknowledged messages never delivered, e.g. "
        f"{[(m, acked[m] - now_ms(), seen.get(m)) for m in missing[:10]]} (id, due - now ms, state); "
        f"by trial {collections.Counter(m.split('-')[0] for m in missing)}; stats {stats}"
    )
    assert not early, f"delivered before due: {early[:5]}"
    unknown = [m for m in delivered if not m.startswith("t")]
    assert not unknown
    dups = sum(n - 1 for n in delivered.values())
    print(
        f"\n{TRIALS} SIGKILL trials: {len(acked)} acknowledged, all delivered, {dups} duplicates, "
        f"pending after drain {stats['pending']}"
    )


def test_sigkill_right_after_far_future_sends_keeps_every_message(tmp_path):
    """Far-future records wait in the iterate service's write-behind buffers (up to one
    checkpoint interval): a SIGKILL right after the acks loses those copies, and the
    restart must copy them again from the message log (a real process, a real kill)."""
    with ServerProc(tmp_path / "data") as srv:
        client = srv.client(timeout=20)
        base = now_ms() + 3_600_000
        receipts = []
        for k in range(10):  # spread over many minute buckets, all beyond the loading horizon
            receipts += client.send_many(
                (client.message(SUBJECT, b"far", deliver_at_ms=base + (k * 100 + i) * 7_000) for i in range(100)),
                batch_size=100,
            )
        client.close()
        srv.kill9()
        srv.start()
        client = srv.client(timeout=20)
        states = {client.state_name(client.get(r)) for r in receipts}
        assert states == {"PENDING"}, states
        assert client.stats()["pending"] == len(receipts)
        client.close()
