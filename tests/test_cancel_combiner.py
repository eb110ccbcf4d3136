"""Concurrent cancel() calls of the blocking client share CancelBatch calls (client/batching.py
CancelCombiner): each caller gets its own outcome or its own error, nobody waits forever."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from qdelay import errors
from qdelay.client import Batching, Client, Outgoing
from qdelay.client.batching import CancelCombiner
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
        combiner = c._canceller
        assert combiner is not None and combiner.carried == len(targets)
        assert combiner.batches < len(targets) / 3  # gathered: far fewer calls than cancels
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
        assert c._canceller is None
        assert c.cancel(receipts[5]) == "CANCELLED"
        assert c.cancel(receipts[5]) == "ALREADY_CANCELLED"


class _FakeServer:
    """CancelBatch / Cancel stand-ins: outcome = sequence % 5 + 1, a short random delay;
    targets with sequence 13 make their batch UNAVAILABLE."""

    def __init__(self) -> None:
        self.rng = random.Random(3)
        self.lock = threading.Lock()
        self.sizes: list[int] = []

    def _pause(self) -> None:
        with self.lock:
            d = self.rng.random() * 0.002
        time.sleep(d)

    def batch(self, request: pb.CancelBatchRequest, _timeout):
        self._pause()
        with self.lock:
            self.sizes.append(len(request.requests))
        if any(r.receipt.sequence == 13 for r in request.requests):
            raise errors.Unavailable("down")
        return pb.CancelBatchResponse(
            responses=[pb.CancelResponse(outcome=r.receipt.sequence % 5 + 1) for r in request.requests]
        )

    def single(self, request: pb.CancelRequest, _timeout):
        self._pause()
        with self.lock:
            self.sizes.append(1)
        if request.receipt.sequence == 13:
            raise errors.Unavailable("down")
        return pb.CancelResponse(outcome=request.receipt.sequence % 5 + 1)


def test_many_threads_all_answered_and_an_unavailable_batch_fails_its_callers():
    fake = _FakeServer()
    combiner = CancelCombiner(fake.batch, fake.single, max_batch=7, max_in_flight=2, linger=0.0005)

    def one(seq: int):
        try:
            return combiner.cancel(
                pb.CancelRequest(receipt=pb.Receipt(message_id=f"m{seq}", deliver_at_ms=1, sequence=seq))
            )
        except errors.Unavailable as err:
            return err

    seqs = list(range(1, 2001))
    with ThreadPoolExecutor(32) as pool:
        out = dict(zip(seqs, pool.map(one, seqs)))
    assert isinstance(out[13], errors.Unavailable)
    failed = [s for s, o in out.items() if isinstance(o, errors.Unavailable)]
    assert all(out[s] == s % 5 + 1 for s in seqs if s not in failed)
    assert len(failed) <= 7  # only the batch that carried 13
    assert max(fake.sizes) <= 7 and sum(fake.sizes) == 2000 and len(fake.sizes) < 2000
    assert combiner._leaders == 0 and not combiner._queue and combiner._under_way == 0


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
