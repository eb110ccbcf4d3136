"""A CANCELLED answer holds across a SIGKILL that comes before the iterate service copied the
tombstone (issue 13 item 6; docs/recovery.md row 17).

Claims live in memory: after a restart, a tombstone that was durable in the message log alone
is known only once the replay from the iterate checkpoint has copied it. Before the fix, the
lookups of Get, Cancel, Reschedule and their batches by receipt waited only for their
target's own record, and the scheduler handed out what the loader fired at once: in that
window a Get said PENDING, a Reschedule moved the cancelled message (delivered a second
later) and a past-due cancelled message went to its consumer. Now both wait until the replay
has passed the message log's end at open.

The construction is deterministic, with a real process and settings only: the iterate
checkpoint is left before the targets' tombstones (a clean stop writes it; the next run
takes none, ``checkpoint_interval_ms``), a backlog of 100,000 records lies between it and
them (the replay takes about a second), and the tombstones are not copied before the kill
(the iterate service gathers commits for ``iterate_gather_ms`` after a step: 2 s here; the
Stats calls that show them uncopied do not hurry it).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from conftest import wait_until

from qdelay.client import Outgoing
from tests.serverproc import ServerProc

HOUR = 3_600_000
SUBJECT = "t.restart"
BACKLOG = 100_000


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def test_cancelled_before_a_sigkill_stays_cancelled_while_the_replay_runs(tmp_path):
    data = tmp_path / "data"
    srv = ServerProc(data)
    with srv:
        c = srv.client()
        names = ["get", "resched", "resched_id", "batch1", "batch2", "cancel", "cancel_batch", "soon"]
        far = {n: c.send(SUBJECT, n.encode(), delay_ms=HOUR, message_id=n) for n in names[:-1]}
        soon = c.send(SUBJECT, b"soon", delay_ms=3_000, message_id="soon")  # past due at the restart
        c.close()
        srv.stop()  # the checkpoint covers the targets: the replay starts after them

        srv.args = ["--set", "engine.checkpoint_interval_ms=600000", "--set", "engine.iterate_gather_ms=2000"]
        srv.start()
        c = srv.client()
        for _k in range(0, BACKLOG, 10_000):
            c.send_many([Outgoing("t.fill", b"x" * 64, delay_ms=2 * HOUR + i * 60_000) for i in range(10_000)])
        # copied to its end by a step just now (Stats does not hurry the service): the next
        # step comes after a gather of 2 s, long after the kill
        wait_until(lambda: c.stats()["iterate_lag_bytes"] == 0, timeout=60, what="the backlog copied")
        assert c.cancel_many([*far.values(), soon]) == ["CANCELLED"] * len(names)
        assert c.stats()["iterate_lag_bytes"] > 0  # the tombstones are in the message log alone
        srv.kill9()
        c.close()

        wait_until(lambda: now_ms() > soon.deliver_at_ms + 100, timeout=30, what="soon is due")
        srv.args = []
        srv.start()
        c = srv.client(batching=False)
        batched = srv.client()
        consumer = c.subscribe(SUBJECT)
        assert c.stats()["iterate_lag_bytes"] > 0, "the replay ended before the first call: no window tested"
        calls = {
            "get": lambda: c.get(far["get"]).state,
            "get_id": lambda: c.get(message_id="get").state,
            "resched": lambda: c.reschedule(far["resched"], delay_ms=500)[0],
            "resched_id": lambda: c.reschedule("resched_id", delay_ms=500)[0],
            "batch": lambda: [o for o, _r in batched.reschedule_many([far["batch1"], far["batch2"]], delay_ms=500)],
            "cancel": lambda: c.cancel(far["cancel"]),
            "cancel_batch": lambda: batched.cancel_many([far["cancel_batch"]]),
            "get_soon": lambda: c.get(soon).state,
        }
        with ThreadPoolExecutor(len(calls)) as pool:
            futures = {k: pool.submit(fn) for k, fn in calls.items()}
            answers = {k: f.result(timeout=30) for k, f in futures.items()}
        assert answers == {
            "get": "CANCELLED",
            "get_id": "CANCELLED",
            "resched": "CANCELLED",
            "resched_id": "CANCELLED",
            "batch": ["CANCELLED", "CANCELLED"],
            "cancel": "ALREADY_CANCELLED",
            "cancel_batch": ["ALREADY_CANCELLED"],
            "get_soon": "CANCELLED",
        }
        # a message due after what a wrong move would have made due: once it is delivered,
        # nothing cancelled was (past due ones are handed out first)
        c.send(SUBJECT, b"marker", delay_ms=1_000, message_id="marker")
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
