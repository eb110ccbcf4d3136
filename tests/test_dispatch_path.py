"""The dispatcher's column-wise read-back and its delivery batches.

Records read back for delivery are checked for the whole run at once (numpy over the
gathered frame headers, one checksum call per frame); these tests pin what must not
change with that: a record that fails any check is never served, the others are, in the
order they were asked for, and a batch of deliveries still behaves like a list.
"""

from __future__ import annotations

from qdelay.errors import CorruptRecord
from qdelay.segments import framing, records
from qdelay.segments.framing import FrameError, RecordKind
from qdelay.segments.messages import read_messages
from qdelay.server.scheduler import Deliveries, Delivery


class FakeSegment:
    """The two reads the dispatcher makes of a schedule segment, on a bytes buffer."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def read(self, offset: int, length: int) -> bytes:
        return self.data[offset : offset + length]

    def read_frame(self, offset: int) -> framing.Frame:
        try:
            return framing.check_at(self.data, offset)
        except FrameError as err:
            raise CorruptRecord("fake.sched", offset, err.reason) from None


def build(messages):
    """A schedule segment of MESSAGE frames: (data, offsets, sequences)."""
    buf = bytearray()
    offs, seqs = [], []
    for i, (mid, payload, headers) in enumerate(messages):
        offs.append(len(buf))
        seqs.append(100 + i)
        body = records.encode_message(b"s", mid.encode(), records.encode_headers(headers), payload, 1_000 + i)
        framing.encode_into(buf, RecordKind.MESSAGE, 100 + i, 5, body)
    return bytes(buf), offs, seqs


def read_group(data, seqs, offs):
    return read_messages(FakeSegment(data), seqs, offs)


MSGS = [(f"m{i}", bytes([i]) * (10 + i), {"k": str(i)} if i % 3 == 0 else {}) for i in range(12)]


def test_every_sound_record_is_split_as_the_codec_reads_it():
    data, offs, seqs = build(MSGS)
    mids, payloads, headers = read_group(data, seqs, offs)
    assert [m.decode() for m in mids] == [m for m, _p, _h in MSGS]
    assert payloads == [p for _m, p, _h in MSGS]
    assert headers == [h or None for _m, _p, h in MSGS]


def test_the_order_asked_for_is_kept_even_when_offsets_are_not_sorted():
    data, offs, seqs = build(MSGS)
    order = [5, 0, 11, 3, 3, 7]  # a duplicate too (a retry next to a fresh one)
    mids, payloads, _h = read_group(data, [seqs[k] for k in order], [offs[k] for k in order])
    assert [m.decode() for m in mids] == [MSGS[k][0] for k in order]
    assert payloads == [MSGS[k][1] for k in order]


def test_a_flipped_byte_is_never_served_and_the_rest_still_are():
    data, offs, seqs = build(MSGS)
    broken = bytearray(data)
    broken[offs[4] + 60] ^= 0x01  # inside record 4's body: its checksum fails
    mids, payloads, _h = read_group(bytes(broken), seqs, offs)
    assert mids[4] is None and payloads[4] is None
    assert [m.decode() for k, m in enumerate(mids) if k != 4] == [m for k, (m, _p, _h) in enumerate(MSGS) if k != 4]


def test_a_record_with_another_sequence_is_not_served():
    data, offs, seqs = build(MSGS)
    wrong = list(seqs)
    wrong[2] += 1000  # the index expects another record at that offset
    mids, _p, _h = read_group(data, wrong, offs)
    assert mids[2] is None and all(m is not None for k, m in enumerate(mids) if k != 2)


def test_a_record_longer_than_the_read_ahead_takes_the_checked_slow_path():
    big = [("a", b"x" * 10, {}), ("big", b"y" * 70_000, {"h": "v"}), ("c", b"z", {})]
    data, offs, seqs = build(big)
    mids, payloads, headers = read_group(data, seqs, offs)
    assert [m.decode() for m in mids] == ["a", "big", "c"]
    assert payloads[1] == b"y" * 70_000 and headers[1] == {"h": "v"}
    broken = bytearray(data)
    broken[offs[1] + 50_000] ^= 0xFF
    mids, _p, _h = read_group(bytes(broken), seqs, offs)
    assert mids == [b"a", None, b"c"]


def test_a_torn_end_is_not_served():
    data, offs, seqs = build(MSGS)
    cut = data[: offs[-1] + 40]  # the last frame runs past the end of the file
    mids, _p, _h = read_group(cut, seqs, offs)
    assert mids[-1] is None and all(m is not None for m in mids[:-1])


def test_a_batch_of_deliveries_behaves_like_a_list_of_them():
    batch = Deliveries("s", ["1.1", "2.3"], [b"a", b"b"], [b"p", b"q"], [None, {"k": "v"}], [10, 20], 25, [1, 3])
    assert len(batch) == 2
    assert list(batch) == [
        Delivery("1.1", "a", "s", b"p", {}, 10, 25, 1),
        Delivery("2.3", "b", "s", b"q", {"k": "v"}, 20, 25, 3),
    ]
    assert batch[-1].ack_id == "2.3" and batch[0].headers == {}
    tail = batch[1:]
    assert isinstance(tail, Deliveries) and tail.ack_ids == ["2.3"] and tail.dispatched_at_ms == 25


def test_ack_ids_parse_like_int_of_the_part_before_the_dot():
    from qdelay.server.ledger import ack_sequences as _ack_sequences

    assert _ack_sequences([]) == []
    assert _ack_sequences(["12.1", "7.3", "99999999999.16"]) == [12, 7, 99999999999]
    # anything else takes the per-id path: bare sequences count, junk is skipped
    assert _ack_sequences(["12.1", "7", "bogus", "x.1", "5.2"]) == [12, 7, 5]
    assert _ack_sequences(["1" * 25 + ".1"]) == [int("1" * 25)]


def test_a_flight_gives_the_columns_of_any_of_its_sequences():
    from qdelay.server.ledger import Flight as _Flight

    fl = _Flight(7, 0, 1, 99, [10, 11, 12, 13], [0, 5, 9, 14], [1, 2, 3, 4], [1, 1, 2, 1], [b"a", b"b", b"c", b"d"])
    assert fl.columns([10, 11, 12, 13], 0) == ([0, 5, 9, 14], [1, 2, 3, 4], [1, 1, 2, 1], [b"a", b"b", b"c", b"d"])
    assert fl.columns([11, 12], 1) == ([5, 9], [2, 3], [1, 2], [b"b", b"c"])  # a stretch
    assert fl.columns([13, 10], None) == ([14, 0], [4, 1], [1, 1], [b"d", b"a"])  # looked up
    assert fl.item_at(fl.index(12)) == (12, 9, 7, 3, 3, 0, 1)
