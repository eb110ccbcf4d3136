"""A CANCELLED answer holds across a SIGKILL that comes before the iterate service copied the
tombstone (issue 13 item 6; docs/recovery.md row 17).

Claims live in memory: after a restart, a tombstone that was durable in the message log alone
is known only once the replay from the iterate checkpoint has copied it. Before the fix, the
lookups of Get, Cancel, Reschedule and their batches by receipt waited only for their
target's own record, and the scheduler handed out what the loader fired at once: in that
window a Get said PENDING, a Reschedule moved the cancelled message (delivered soon after),
a Cancel answered CANCELLED again and a past-due cancelled message went to its consumer. Now
both wait until the replay has passed the message log's end at open.

The window is held open with a real process and settings only, not by timing. The iterate
service copies a step at once when it was idle, then lets commits gather for
``iterate_gather_ms`` (Stats does not hurry it; a lookup that waits for it does). Run 1 ends
with a clean stop: its checkpoint covers the targets. Run 2 gathers for 5 s after its first
send, takes no checkpoint, and within that time gets ~1.2 MiB of records and the targets'
tombstones, then is killed: none of them were copied. Run 3 replays that tail from the
checkpoint: its first step reads 1 MiB (``read_bytes``), and what is left, the tombstones
among it, less than half a read, waits for a gather of 5 s.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from conftest import wait_until

from qdelay.client import Outgoing
from tests.serverproc import ServerProc

HOUR = 3_600_000
SUBJECT = "t.restart"
MIB = 1024 * 1024
GATHER = ["--set", "engine.iterate_gather_ms=5000"]


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def test_cancelled_before_a_sigkill_stays_cancelled_while_the_replay_runs(tmp_path):
    srv = ServerProc(tmp_path / "data")
    with srv:
        c = srv.client()
        names = ["get", "resched", "resched_id", "batch1", "batch2", "cancel", "cancel_batch"]
        far = {n: c.send(SUBJECT, n.encode(), delay_ms=HOUR, message_id=n) for n in names}
        soon = c.send(SUBJECT, b"soon", delay_ms=3_000, message_id="soon")  # past due at the restart
        c.close()
        srv.stop()  # the checkpoint covers the targets: the replay starts after them

        srv.args = ["--set", "engine.checkpoint_interval_ms=600000", *GATHER]
        srv.start()
        c = srv.client()
        c.send("t.fill", b"first", delay_ms=2 * HOUR)  # copied at once: the service now gathers for 5 s
        while c.stats()["iterate_lag_bytes"] < 1.1 * MIB:  # between one read and one and a half
            c.send_many([Outgoing("t.fill", b"x" * 64, delay_ms=2 * HOUR + (i % 50) * 60_000) for i in range(1000)])
        assert c.cancel_many([*far.values(), soon]) == ["CANCELLED"] * (len(names) + 1)
        lag = c.stats()["iterate_lag_bytes"]
        assert 1.1 * MIB < lag < 1.4 * MIB  # the tombstones too are in the message log alone
        srv.kill9()
        c.close()

        wait_until(lambda: now_ms() > soon.deliver_at_ms + 100, timeout=30, what="soon is due")
        srv.args = GATHER
        srv.start()
        c = srv.client(batching=False)
        batched = srv.client()
        consumer = c.subscribe(SUBJECT)
        # the replay's first step has left the tombstones for after its gather (Stats, which
        # does not hurry it, tells when that step is done)
        wait_until(lambda: 0 < c.stats()["iterate_lag_bytes"] < MIB / 2, timeout=4, what="the first step")
        # by receipt first: a look by id waits for the whole log (it was right before), and
        # its wait would hurry the iterate service past the tombstones
        calls = {
            "get": lambda: c.get(far["get"]).state,
            "resched": lambda: c.reschedule(far["resched"], delay_ms=500)[0],
            "batch": lambda: [o for o, _r in batched.reschedule_many([far["batch1"], far["batch2"]], delay_ms=500)],
            "cancel": lambda: c.cancel(far["cancel"]),
            "cancel_batch": lambda: batched.cancel_many([far["cancel_batch"]]),
            "get_soon": lambda: c.get(soon).state,
        }
        with ThreadPoolExecutor(len(calls)) as pool:
            futures = {k: pool.submit(fn) for k, fn in calls.items()}
            answers = {k: f.result(timeout=30) for k, f in futures.items()}
        answers["get_id"] = c.get(message_id="get").state
        answers["resched_id"] = c.reschedule("resched_id", delay_ms=500)[0]
        assert answers == {
            "get": "CANCELLED",
            "resched": "CANCELLED",
            "batch": ["CANCELLED", "CANCELLED"],
            "cancel": "ALREADY_CANCELLED",
            "cancel_batch": ["ALREADY_CANCELLED"],
            "get_soon": "CANCELLED",
            "get_id": "CANCELLED",
            "resched_id": "CANCELLED",
        }
        # due after what a wrong move would have made due, and found by id (which hurries
        # the iterate service past its gather): once it is delivered, nothing cancelled was
        c.send(SUBJECT, b"marker", delay_ms=1_000, message_id="marker")
        assert c.get(message_id="marker").state == "PENDING"
        seen: list[str] = []
        deadline = time.monotonic() + 20
        while "marker" not in seen and time.monotonic() < deadline:
            got = consumer.receive(10, timeout=1)
            consumer.ack(got)
            seen += [d.message_id for d in got]
        assert seen == ["marker"]
        assert c.get(soon).state == "CANCELLED"
        consumer.close()
        c.close()
        batched.close()
