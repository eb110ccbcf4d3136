"""Typed receipts: send_many's SentReceipts, Receipt's string form, what cancel/get accept."""

from __future__ import annotations

from datetime import timedelta

import pytest

from qdelay import errors
from qdelay.client import Receipt, SentReceipts, Status
from qdelay.client.client import outgoing
from qdelay.client.types import ref
from qdelay.units import limit_in_words, ms_in_words, to_ms
from qdelay.v1 import qdelay_pb2 as pb


def compact(first, dues):
    return pb.SendBatchResponse(first_sequence=first, deliver_at_ms=dues)


def test_indexing_slicing_and_iteration_across_batches():
    r = SentReceipts()
    r._add(["a", "b"], compact(10, [100, 101]))
    r._add(["c"], pb.SendBatchResponse(receipts=[pb.Receipt(message_id="c", deliver_at_ms=7, sequence=12)]))
    r._add(["d", "e", "f"], compact(13, [5, 6, 7]))
    want = [Receipt("a", 100, 10), Receipt("b", 101, 11), Receipt("c", 7, 12)]
    want += [Receipt("d", 5, 13), Receipt("e", 6, 14), Receipt("f", 7, 15)]
    assert len(r) == 6
    assert list(r) == want
    assert all(type(x) is Receipt for x in r)
    assert r[-1] == Receipt("f", 7, 15) and r[3] == Receipt("d", 5, 13)
    assert [x.sequence for x in r[1:5:2]] == [11, 13]
    with pytest.raises(IndexError):
        r[6]


def test_a_compact_answer_must_cover_its_batch():
    with pytest.raises(errors.InvariantViolation):
        SentReceipts()._add(["a", "b"], compact(1, [5]))


@pytest.mark.parametrize(
    "receipt",
    [
        Receipt("c0123-1", 1764000000000, 42),
        Receipt("order:42: with colons and spaces ", 0, 0),
        Receipt("x", 5, 2**64 - 1, shard="eu:west/1 %"),
        Receipt("q" * 128, -1, 7, shard="s1"),
    ],
)
def test_receipt_string_form_round_trips(receipt):
    text = str(receipt)
    assert text.startswith("qd1:") and "\n" not in text
    assert Receipt.parse(text) == receipt
    assert ref(text) == (receipt.to_pb(), "")


def test_receipt_equality_ignores_duplicate_and_converts_to_and_from_protobuf():
    p = pb.Receipt(message_id="m", deliver_at_ms=9, sequence=3, duplicate=True, shard="a")
    r = Receipt.from_pb(p)
    assert r.duplicate and r == Receipt("m", 9, 3, "a")
    assert r.to_pb() == pb.Receipt(message_id="m", deliver_at_ms=9, sequence=3, shard="a")
    with pytest.raises(AttributeError):
        r.sequence = 4  # frozen: safe to keep and share


@pytest.mark.parametrize("text", ["", "qd1:", "qd1:1:2:", "qd2:1:2::m", "qd1:x:2::m", "qd1:1:2:a:b\x00"[:8]])
def test_receipt_parse_refuses_what_is_not_a_receipt(text):
    with pytest.raises(errors.InvalidArgument, match="not a qdelay receipt string"):
        Receipt.parse(text)


def test_ref_accepts_every_form_a_user_holds():
    p = pb.Receipt(message_id="m", deliver_at_ms=9, sequence=3)
    assert ref(Receipt("m", 9, 3)) == (p, "")
    assert ref(p) == (p, "")
    assert ref(("m", 9, 3)) == (p, "")
    assert ref({"message_id": "m", "deliver_at_ms": 9, "sequence": 3}) == (p, "")
    assert ref("order-42") == (None, "order-42")  # the id alone
    for bad in ("", 42, None):
        with pytest.raises(errors.InvalidArgument):
            ref(bad)


def test_status_from_get_response():
    resp = pb.GetResponse(
        state=pb.GetResponse.DELIVERED,
        message=pb.Message(subject="s", payload=b"p", message_id="m", headers={"k": "v"}),
        deliver_at_ms=5,
        delivered_at_ms=6,
        groups=[pb.GroupDelivery(name="g", state=pb.GetResponse.PENDING, delivered_at_ms=0)],
    )
    st = Status.from_pb(resp)
    assert (st.state, st.message_id, st.subject, st.payload, st.headers) == ("DELIVERED", "m", "s", b"p", {"k": "v"})
    assert (st.deliver_at_ms, st.delivered_at_ms, st.found) == (5, 6, True)
    assert st.groups[0].name == "g" and st.groups[0].state == "PENDING"
    assert not Status.from_pb(pb.GetResponse(state=pb.GetResponse.NOT_FOUND)).found


def test_durations_in_words_and_timedelta_delays():
    assert ms_in_words(2 * 365 * 86_400_000) == "2 years"
    assert ms_in_words(90_061_001) == "1 day 1 hour"
    assert ms_in_words(1500) == "1 second 500 ms"
    assert limit_in_words(63_072_000_000) == "2 years (max_delay_ms=63072000000)"
    assert to_ms(timedelta(minutes=30)) == 1_800_000
    assert to_ms(timedelta(microseconds=1999)) == 1
    with pytest.raises(TypeError, match="timedelta"):
        to_ms(1.5)
    o = outgoing("s", b"p", timedelta(hours=1), None, None, None, None, "id")
    assert (o.delay_ms, o.deliver_at_ms, o.message_id) == (3_600_000, None, "id")
    with pytest.raises(errors.InvalidArgument, match="not several"):
        outgoing("s", b"p", 1, 2, None, None, None, "id")
    with pytest.raises(errors.InvalidArgument, match="payload"):
        outgoing("s", "text", None, None, None, None, None, "id")
    # the error names the argument given: a float delay_ms was refused as "delay: ..."
    with pytest.raises(errors.InvalidArgument, match=r"^delay_ms: an int of milliseconds"):
        outgoing("s", b"p", None, 1.5, None, None, None, "id")
    # deliver_at_ms is a time, not a duration: a timedelta there was taken as ms since 1970
    # (due at once)
    with pytest.raises(errors.InvalidArgument, match=r"^deliver_at_ms: an int of Unix epoch milliseconds"):
        outgoing("s", b"p", None, None, None, timedelta(minutes=5), None, "id")
