"""SentReceipts: send_many's receipts, made when read from compact (or full) answers."""

from __future__ import annotations

import pytest

from qdelay import errors
from qdelay.client import SentReceipt, SentReceipts
from qdelay.client.client import _receipt
from qdelay.v1 import qdelay_pb2 as pb


def compact(first, dues):
    return pb.SendBatchResponse(first_sequence=first, deliver_at_ms=dues)


def test_indexing_slicing_and_iteration_across_batches():
    r = SentReceipts()
    r._add(["a", "b"], compact(10, [100, 101]))
    r._add(["c"], pb.SendBatchResponse(receipts=[pb.Receipt(message_id="c", deliver_at_ms=7, sequence=12)]))
    r._add(["d", "e", "f"], compact(13, [5, 6, 7]))
    want = [
        SentReceipt("a", 100, 10),
        SentReceipt("b", 101, 11),
        ("c", 7, 12),
        SentReceipt("d", 5, 13),
        SentReceipt("e", 6, 14),
        SentReceipt("f", 7, 15),
    ]
    assert len(r) == 6
    got = [(x.message_id, x.deliver_at_ms, x.sequence) for x in r]
    assert got == [tuple(w) for w in want]
    assert [tuple(_receipt(r[i]).ListFields()[k][1] for k in range(3)) for i in (0, 5)] == [
        ("a", 100, 10),
        ("f", 7, 15),
    ]
    assert r[-1] == SentReceipt("f", 7, 15) and r[3] == SentReceipt("d", 5, 13)
    assert [x.sequence for x in r[1:5:2]] == [11, 13]
    with pytest.raises(IndexError):
        r[6]


def test_a_compact_answer_must_cover_its_batch():
    with pytest.raises(errors.InvariantViolation):
        SentReceipts()._add(["a", "b"], compact(1, [5]))
