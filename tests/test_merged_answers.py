"""Merged SendStream answers and packed requests on a real server
(tests/holding_writer_server.py holds the commit of a marked batch until a later marked
batch is queued, so that the batches between are made durable by one commit): a raw stream
that asks for merged answers gets fewer messages than batches, each answer in order, and
is told the server takes packed requests; a packed request is its batches, each validated,
written and answered as if sent alone, a refused one ending the stream after those before
it; ``more`` is refused where it does not belong; ``send_many`` packs the batches it has
credit for once the server said it takes them, and never for a server that did not."""

from __future__ import annotations

import sys
from pathlib import Path

import grpc
import pytest
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


def _stream(ch: grpc.Channel, messages: list[bytes], merge: bool = True):
    send = ch.stream_stream(
        "/qdelay.v1.DelayService/SendStream",
        request_serializer=None,
        response_deserializer=pb.SendBatchResponse.FromString,
    )
    return send(iter(messages), metadata=(wire.MERGE_ANSWERS,) if merge else (), timeout=30)


def test_a_packed_request_is_its_batches_each_answered_in_order(tmp_path):
    with ServerProc(tmp_path / "data", command=HOLDING) as srv, grpc.insecure_channel(srv.address) as ch:
        raws = [_batch(k).SerializeToString() for k in range(4)]
        call = _stream(ch, [wire.pack_send_batch_requests(raws[:3]), raws[3]])
        answers = list(call)
        assert wire.PACKED_REQUESTS in list(call.initial_metadata())
        flat = [a for r in answers for a in (r, *r.more)]
        assert [a.first_sequence for a in flat] == [1, 6, 11, 16]
        # a stream that did not ask for merged answers is not told of packed requests, and a
        # packed request is still its batches (one answer each)
        call = _stream(ch, [wire.pack_send_batch_requests([_batch(k).SerializeToString() for k in (4, 5)])], False)
        assert [a.first_sequence for a in call] == [21, 26]
        assert wire.PACKED_REQUESTS not in list(call.initial_metadata())


def test_a_refused_batch_in_a_pack_ends_the_stream_after_the_batches_before_it(tmp_path):
    with ServerProc(tmp_path / "data", command=HOLDING) as srv, grpc.insecure_channel(srv.address) as ch:
        bad = _batch(1)
        bad.messages[2].subject = ""
        pack = wire.pack_send_batch_requests([r.SerializeToString() for r in (_batch(0), bad, _batch(2))])
        call = _stream(ch, [pack])
        answers = []
        with pytest.raises(grpc.RpcError) as info:
            for r in call:
                answers.append(r)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "messages[2].subject" in info.value.details()
        assert [a.first_sequence for r in answers for a in (r, *r.more)] == [1]
        with Client(srv.address) as c:
            assert c.get(message_id="b0-4").state == "PENDING"
            for mid in ("b1-0", "b2-0"):  # neither the refused batch nor the one after it
                assert c.get(message_id=mid).state == "NOT_FOUND"


def test_more_is_refused_where_it_does_not_belong(tmp_path):
    with ServerProc(tmp_path / "data", command=HOLDING) as srv, grpc.insecure_channel(srv.address) as ch:
        stub = pb_grpc.DelayServiceStub(ch)
        inner = _batch(0)
        both = pb.SendBatchRequest(messages=inner.messages, more=[_batch(1)])  # its own messages and more
        nested = wire.pack_send_batch_requests([pb.SendBatchRequest(more=[_batch(2)]).SerializeToString()])
        cases = [
            (lambda: stub.SendBatch(pb.SendBatchRequest(more=[inner]), timeout=10), "more:"),
            (lambda: list(_stream(ch, [both.SerializeToString()])), "more:"),
            (lambda: list(_stream(ch, [nested])), "more:"),
            (
                lambda: list(_stream(ch, [wire.pack_send_batch_requests([inner.SerializeToString()]) + b"\x10\x01"])),
                "no field of its own",
            ),
            (
                lambda: list(_stream(ch, [wire.pack_send_batch_requests([inner.SerializeToString()])[:-3]])),
                "past the end",
            ),
        ]
        for call, words in cases:
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in info.value.details()
        with Client(srv.address) as c:
            assert all(c.get(message_id=f"b{k}-0").state == "NOT_FOUND" for k in range(3))


def _send_many_through_held_commits(tmp_path, old_server: bool) -> list[int]:
    """send_many of 300 messages in batches of 10, 8 unanswered, through a held commit: every
    receipt in order over merged answers (either server merges them); the sizes of the
    packed requests the server read."""
    packs = tmp_path / "packs"
    env = {"QDELAY_TEST_PACKS_FILE": str(packs), "QDELAY_TEST_OLD_SERVER": "1" if old_server else "0"}
    with ServerProc(tmp_path / "data", command=HOLDING, env=env) as srv, Client(srv.address) as c:
        messages = [Outgoing("ma.s", b"p", None, HOUR_MS, f"m{i}") for i in range(300)]
        # batch 0's commit held until batch 7 is queued: batches 1-7 answered together, and
        # send_many has credit for seven at once
        messages[0] = Outgoing("ma.s", HOLD, None, HOUR_MS, "m0")
        messages[75] = Outgoing("ma.s", RELEASE, None, HOUR_MS, "m75")
        receipts = c.send_many(messages, batch_size=10, max_in_flight=8)
        assert [r.message_id for r in receipts] == [f"m{i}" for i in range(300)]
        assert [r.sequence for r in receipts] == list(range(1, 301))
        assert c.get(message_id="m299").state == "PENDING"
    return [int(n) for n in packs.read_text().split()] if packs.exists() else []


def test_send_many_packs_the_batches_it_has_credit_for_once_the_server_takes_them(tmp_path):
    packs = _send_many_through_held_commits(tmp_path, old_server=False)
    assert packs and max(packs) > 1 and all(1 < n <= 8 for n in packs)


def test_send_many_never_packs_for_a_server_that_did_not_say_it_takes_packs(tmp_path):
    assert _send_many_through_held_commits(tmp_path, old_server=True) == []
