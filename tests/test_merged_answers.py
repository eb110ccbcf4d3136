"""Merged SendStream answers on a real server (tests/holding_writer_server.py holds the
commit of a marked batch until a later marked batch is queued, so that the batches between
are made durable by one commit): a raw stream that asks for them gets fewer messages than
batches, each answer in order; ``send_many``, which asks, gets every receipt right."""

from __future__ import annotations

import sys
from pathlib import Path

import grpc
from holding_writer_server import HOLD, RELEASE
from serverproc import ServerProc

from qdelay import wire
from qdelay.client import Client, Outgoing
from qdelay.v1 import qdelay_pb2 as pb
from qdelay.v1 import qdelay_pb2_grpc as pb_grpc

HOLDING = [sys.executable, str(Path(__file__).with_name("holding_writer_server.py"))]
HOUR_MS = 3_600_000


def _batch(k: int, payload: bytes = b"p") -> pb.SendBatchRequest:
    msgs = [pb.Message(subject="ma.s", payload=payload, message_id=f"b{k}-{i}", delay_ms=HOUR_MS) for i in range(5)]
    return pb.SendBatchRequest(messages=msgs, compact_receipts=True)


def test_a_raw_stream_that_asks_gets_the_answers_ready_together_in_one_message(tmp_path):
    with ServerProc(tmp_path / "data", command=HOLDING) as srv, grpc.insecure_channel(srv.address) as ch:
        requests = [_batch(0, HOLD), *(_batch(k) for k in range(1, 5)), _batch(5, RELEASE)]
        stub = pb_grpc.DelayServiceStub(ch)
        answers = list(stub.SendStream(iter(requests), metadata=(wire.MERGE_ANSWERS,), timeout=30))
        flat = [a for r in answers for a in (r, *r.more)]
        assert [a.first_sequence for a in flat] == [1, 6, 11, 16, 21, 26]
        assert all(len(a.deliver_at_ms) == 5 for a in flat)
        # batches 1-5 were queued behind the held commit: at most the first answered alone
        assert len(answers) <= 2, [len(r.more) for r in answers]


def test_send_many_reads_merged_answers_into_every_receipt_in_order(tmp_path):
    with ServerProc(tmp_path / "data", command=HOLDING) as srv, Client(srv.address) as c:
        messages = [Outgoing("ma.s", b"p", None, HOUR_MS, f"m{i}") for i in range(60)]
        messages[0] = Outgoing("ma.s", HOLD, None, HOUR_MS, "m0")
        messages[59] = Outgoing("ma.s", RELEASE, None, HOUR_MS, "m59")
        receipts = c.send_many(messages, batch_size=10, max_in_flight=8)
        assert [r.message_id for r in receipts] == [f"m{i}" for i in range(60)]
        assert [r.sequence for r in receipts] == list(range(1, 61))
        assert c.get(message_id="m42").state == "PENDING"
