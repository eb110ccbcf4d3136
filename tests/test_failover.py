"""Failover under load (sync replication), following docs/operations.md's runbook.

Each trial: master A (sync) and slave B; a producer sends through the cluster-aware
client while consumers are subscribed to both servers; A is SIGKILLed at a random
instant; B is promoted (``qdelay admin promote``); the producer keeps going. Then:
every acknowledged message is delivered, none before its due time; A restarted with its
old command line is fenced; A restarted as a slave of B truncates its divergent tail
and ends with B's message log byte for byte.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
from conftest import wait_until
from serverproc import ServerProc
from test_replication import (
    RPC_ERRORS,
    SMALL_SEGMENTS,
    admin,
    assert_refuses_writes,
    assert_same_message_log,
    status,
    wait_caught_up,
)

from qdelay import errors

pytestmark = pytest.mark.slow

SUBJECT = "failover"


class Consumers:
    """Subscribed to every server, re-subscribing when a stream fails; acks everything."""

    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses
        self.lock = threading.Lock()
        self.deliveries: dict[str, list[tuple[int, int, int]]] = {}  # id -> [(due, dispatched, received)]
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(a,), daemon=True) for a in addresses]
        for t in self.threads:
            t.start()

    def _run(self, address: str) -> None:
        from qdelay.client import Client

        while not self.stop.is_set():
            try:
                with Client(address, retries=0) as c, c.subscribe(SUBJECT, max_in_flight=5000) as cons:
                    while not self.stop.is_set():
                        batch = cons.receive(5000, 0.2)
                        now = int(time.time() * 1000)
                        with self.lock:
                            for d in batch:
                                self.deliveries.setdefault(d.message_id, []).append(
                                    (d.deliver_at_ms, d.dispatched_at_ms, now)
                                )
                        cons.ack(batch)
            except errors.QdelayError:
                time.sleep(0.2)
            except Exception:  # noqa: BLE001 - a dead server's channel
                time.sleep(0.2)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(10)


def _trial(tmp_path, seed: int) -> dict:
    from qdelay.client import ClusterClient

    rnd = random.Random(seed)
    base = [
        *SMALL_SEGMENTS,
        "--set",
        "engine.ack_timeout_ms=3000",
        "--replication",
        "sync",
        "--replication-timeout-ms",
        "3000",
    ]
    a = ServerProc(tmp_path / "a", args=base)
    a.start()
    b = ServerProc(tmp_path / "b", args=[*base, "--role", "slave", "--master", a.address, "--peers", a.address])
    b.start()
    a.args += ["--peers", b.address]
    a.restart()
    wait_until(lambda: status(b.address).connected, 20, "slave attached", ignore=RPC_ERRORS)
    acked: dict[str, int] = {}
    stop_sending = threading.Event()
    send_errors: list[Exception] = []

    def produce() -> None:
        with ClusterClient([a.address, b.address], failover_timeout=30) as cc:
            while not stop_sending.is_set():
                now = int(time.time() * 1000)
                msgs = [cc.message(SUBJECT, b"p", deliver_at_ms=now + rnd.randint(0, 2500)) for _ in range(40)]
                try:
                    rs = cc.send_batch(msgs)
                except errors.QdelayError as e:
                    send_errors.append(e)
                    continue
                for m, r in zip(msgs, rs):
                    assert r.message_id == m.message_id
                    acked[m.message_id] = m.deliver_at_ms

    consumers = Consumers([a.address, b.address])
    producer = threading.Thread(target=produce, daemon=True)
    try:
        producer.start()
        time.sleep(rnd.uniform(0.3, 2.5))
        a.kill9()
        killed_at = len(acked)
        wait_until(
            lambda: admin("promote", "--target", b.address, check=False).returncode == 0,
            20,
            "promotion",
            ignore=RPC_ERRORS,
        )
        assert status(b.address).role == "master"
        # sync mode: B acknowledges nothing until a slave confirms, so writes wait (the client
        # retries them with the same ids) until the runbook's next steps give B a slave.
        # The old master, restarted as it was, learns of epoch 1 from its peer: fenced.
        a.start()
        sa = status(a.address)
        assert sa.role == "fenced" and sa.epoch == 1, sa
        assert_refuses_writes(a.address)
        a.stop()
        # re-attach it as a slave of the new master (a divergent tail is truncated, reported)
        a.args = [*base, "--role", "slave", "--master", b.address]
        a.start()
        wait_until(lambda: status(a.address).connected, 20, "old master re-attached", ignore=RPC_ERRORS)
        note = status(a.address).note
        time.sleep(rnd.uniform(0.5, 1.5))
        stop_sending.set()
        producer.join(60)
        assert not producer.is_alive()
        total = len(acked)
        assert total > killed_at, "no write went through the promoted master"

        def all_delivered():
            with consumers.lock:
                return all(mid in consumers.deliveries for mid in acked)

        wait_until(all_delivered, 40, "every acknowledged message delivered", interval=0.2, ignore=RPC_ERRORS)
        with consumers.lock:
            for mid, due in acked.items():
                for d_due, dispatched_at, received in consumers.deliveries[mid]:
                    assert d_due == due
                    assert dispatched_at >= due and received >= due, (mid, due, dispatched_at, received)
            dup = sum(len(v) - 1 for v in consumers.deliveries.values())
    finally:
        stop_sending.set()
        consumers.close()
    wait_caught_up(b.address, a.address)
    a.stop()
    b.stop()
    assert_same_message_log(tmp_path / "a", tmp_path / "b")
    return {"acked": total, "at_kill": killed_at, "duplicates": dup, "note": note, "send_errors": len(send_errors)}


@pytest.mark.parametrize("seed", [11, 22, 33, 44, 55])
def test_sync_failover_under_load(tmp_path, seed):
    info = _trial(tmp_path, seed)
    print(info)


def test_the_failover_retries_a_lost_status_and_a_cancel_but_no_other_internal_error():
    """``failover.retryable`` on the errors the clients raise (translated): the lost status
    is batching.lost_status's one definition (it had its own, by text), CANCELLED a node
    stopping; another INTERNAL, or a refusal the caller can fix, is not retried elsewhere."""
    import grpc

    from qdelay.client.client import translate
    from qdelay.client.failover import retryable

    def raised(code: grpc.StatusCode, details: str) -> errors.QdelayError:
        return translate(grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details))

    assert retryable(raised(grpc.StatusCode.INTERNAL, "Internal error from Core"))
    assert retryable(raised(grpc.StatusCode.CANCELLED, "CANCELLED"))
    assert retryable(raised(grpc.StatusCode.UNAVAILABLE, "failed to connect"))
    assert retryable(errors.FailedPrecondition("this server is a slave"))
    assert not retryable(raised(grpc.StatusCode.INTERNAL, "Exception calling application: boom"))
    assert not retryable(raised(grpc.StatusCode.INVALID_ARGUMENT, "message.subject: empty"))
    assert not retryable(ValueError("not a qdelay error"))
