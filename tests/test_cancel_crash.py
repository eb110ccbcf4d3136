"""SIGKILL under a load that mixes sends, re-sends of known ids, cancels (by receipt, by id,
in batches) and reschedules (issue 13, item 6). Every answered operation must hold after
any number of kills: an acknowledged, uncancelled message is delivered at its latest due
time and never early; a CANCELLED answer means never delivered; an ALREADY_DELIVERED answer (of Cancel or
Reschedule) means the consumer did see it; a rescheduled message is never delivered at its
old time; a re-sent id (answered as a duplicate) never makes a
second message."""

from __future__ import annotations

import random
import threading
import time

import pytest

from qdelay import errors
from tests.serverproc import ServerProc

SUBJECT = "crash.ops"
TRIALS = 4
pytestmark = pytest.mark.slow  # about a minute of SIGKILL trials


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class Book:
    """What the server answered, and what the consumer saw."""

    def __init__(self) -> None:
        self.due: dict[str, int] = {}  # id -> latest acknowledged due time
        self.receipt: dict[str, object] = {}
        self.cancelled: set[str] = set()
        # ids a Cancel or Reschedule answered ALREADY_DELIVERED: the consumer must see each
        # (it may be in a consumer's hands at the answer: acknowledged, or handed out again
        # after a kill, but delivered)
        self.already_delivered: set[str] = set()
        self.old_due: dict[str, set[int]] = {}  # id -> due times it was moved away from
        self.resent: dict[str, set[int]] = {}  # id -> due times of its re-sends (duplicates)
        # id -> every due time it was ever given (sent, re-sent, rescheduled to): a re-send or
        # a reschedule picks a time not in it, or a delivery at a time the id had twice would
        # be judged against the wrong operation (a reschedule landing by chance on the due of
        # an earlier re-send looked like a re-send that made a second message)
        self.used: dict[str, set[int]] = {}
        self.unsure: set[str] = set()  # ids whose last operation a kill left unanswered
        self.delivered: dict[str, list[int]] = {}  # id -> deliver_at_ms of each delivery
        self.early: list = []
        # re-sends answered as new messages: recorded here, asserted by the test's own thread
        # (an assert in the producer thread would only end that thread)
        self.not_recognised: list[str] = []
        self.lock = threading.Lock()


def fresh_due(book: Book, message_id: str, want: int) -> int:
    """``want``, or the first time after it that ``message_id`` was never given (book locked)."""
    used = book.used.setdefault(message_id, set())
    while want in used:
        want += 1
    used.add(want)
    return want


def produce(srv: ServerProc, trial: int, book: Book, rng: random.Random, stop: threading.Event) -> None:
    c = srv.client(retries=0, timeout=5)
    n = 0
    try:
        while not stop.is_set():
            base = now_ms()
            msgs = [
                c.message(SUBJECT, b"p", message_id=f"c{trial}-{n + i}", deliver_at_ms=base + rng.randint(300, 3000))
                for i in range(40)
            ]
            n += 40
            receipts = c.send_batch(msgs)
            with book.lock:
                for r in receipts:
                    book.due[r.message_id] = r.deliver_at_ms
                    book.receipt[r.message_id] = r
                    book.used.setdefault(r.message_id, set()).add(r.deliver_at_ms)
                live = [m for m in book.receipt if m not in book.cancelled and m.startswith(f"c{trial}-")]
            picks = rng.sample(live, min(12, len(live)))
            with book.lock:
                book.unsure.update(picks)  # until each operation on them is answered
            # re-send four known ids with another due time: must be answered as duplicates
            with book.lock:
                resend_at = [fresh_due(book, m, book.due[m] + 1) for m in picks[:4]]
            again = c.send_batch(
                [c.message(SUBJECT, b"p", message_id=m, deliver_at_ms=t) for m, t in zip(picks[:4], resend_at)]
            )
            with book.lock:
                for m, t, r in zip(picks[:4], resend_at, again):
                    if not r.duplicate:
                        book.not_recognised.append(m)
                    book.resent.setdefault(m, set()).add(t)
                    book.unsure.discard(m)
            # cancel: one by receipt, one by id, two in a batch
            out = [c.cancel(book.receipt[picks[4]]), c.cancel(message_id=picks[5])]
            out += c.cancel_many([book.receipt[picks[6]], picks[7]])
            with book.lock:
                for m, o in zip(picks[4:8], out):
                    if o == "CANCELLED":
                        book.cancelled.add(m)
                    elif o == "ALREADY_DELIVERED":
                        book.already_delivered.add(m)
                    book.unsure.discard(m)
            # reschedule four, each to a new random time
            for m in picks[8:12]:
                with book.lock:
                    new_due = fresh_due(book, m, now_ms() + rng.randint(200, 4000))
                outcome, r = c.reschedule(m, deliver_at_ms=new_due)
                with book.lock:
                    if outcome == "RESCHEDULED":
                        book.old_due.setdefault(m, set()).add(book.due[m])
                        book.due[m] = new_due
                        book.receipt[m] = r
                    elif outcome == "ALREADY_DELIVERED":
                        book.already_delivered.add(m)
                    book.unsure.discard(m)
    except errors.QdelayError:
        return  # the server died: the operation in progress was not answered
    finally:
        c.close()


def consume(srv: ServerProc, book: Book, stop: threading.Event) -> None:
    c = srv.client(retries=0)
    consumer = c.subscribe(SUBJECT, max_in_flight=2000)
    # the consumer outlives a killed server (it resubscribes by itself): close it when the
    # trial stops, or the join would wait out its timeout on every trial
    threading.Thread(target=lambda: (stop.wait(), consumer.close(timeout=1.0)), daemon=True).start()
    try:
        for batch in consumer.batches():
            t = now_ms()
            with book.lock:
                for d in batch:
                    if t < d.deliver_at_ms or d.dispatched_at_ms < d.deliver_at_ms:
                        book.early.append((d.message_id, d.deliver_at_ms, t))
                    book.delivered.setdefault(d.message_id, []).append(d.deliver_at_ms)
            consumer.ack(batch)
            if stop.is_set():
                break
    except errors.QdelayError:
        pass
    finally:
        consumer.close()
        c.close()


def test_sigkill_with_cancels_reschedules_and_resends(tmp_path):
    rng = random.Random(20261124)
    srv = ServerProc(tmp_path / "data", args=["--set", "engine.ack_timeout_ms=1500"])
    book = Book()
    for trial in range(TRIALS):
        srv.start()
        stop = threading.Event()
        threads = [
            threading.Thread(target=produce, args=(srv, trial, book, rng, stop), daemon=True),
            threading.Thread(target=consume, args=(srv, book, stop), daemon=True),
        ]
        for t in threads:
            t.start()
        time.sleep(rng.uniform(0.8, 2.0))  # let the load run a random while, then kill
        srv.kill9()
        stop.set()
        for t in threads:
            t.join(10)
    assert len(book.due) > 300, "the load did not get going"
    srv.start()
    try:
        stop = threading.Event()
        t = threading.Thread(target=consume, args=(srv, book, stop), daemon=True)
        t.start()
        want = [m for m in book.due if m not in book.cancelled and m not in book.unsure]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with book.lock:
                if (
                    all(book.due[m] in book.delivered.get(m, ()) for m in want)
                    and book.already_delivered <= book.delivered.keys()
                    and now_ms() > max(book.due.values()) + 500
                ):
                    break
            time.sleep(0.2)
        stop.set()
        t.join(10)
    finally:
        assert srv.stop() == 0
    with book.lock:
        missing = [m for m in want if book.due[m] not in book.delivered.get(m, ())]
        assert not missing, f"{len(missing)} messages never delivered at their latest due time: {missing[:5]}"
        assert not book.early, f"delivered before due: {book.early[:5]}"
        assert not book.not_recognised, f"re-sent and not answered as duplicates: {book.not_recognised[:5]}"
        after_cancel = [m for m in book.cancelled if m in book.delivered]  # answered CANCELLED: never
        assert not after_cancel, f"cancelled and delivered: {after_cancel[:5]}"
        # answered ALREADY_DELIVERED: the consumer saw it by the end of the run
        never = sorted(book.already_delivered - book.delivered.keys())
        assert not never, f"answered ALREADY_DELIVERED and never delivered: {never[:5]}"
        at_old = [m for m, olds in book.old_due.items() if olds & set(book.delivered.get(m, ()))]
        assert not at_old, f"delivered at the time they were moved away from: {at_old[:5]}"
        doubled = [m for m, dues in book.delivered.items() if book.resent.get(m, set()) & set(dues)]
        assert not doubled, f"a re-sent id made a second message: {doubled[:5]}"
        print(
            f"\n{TRIALS} SIGKILL trials: {len(book.due)} acknowledged, {len(book.cancelled)} cancelled, "
            f"{len(book.old_due)} rescheduled, {len(book.already_delivered)} answered ALREADY_DELIVERED, all held"
        )
