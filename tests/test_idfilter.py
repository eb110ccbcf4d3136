"""The id filter in front of the id index (segments/idfilter.py): a lookup never misses an
indexed id because of it — whether the id was put before the filter's scan, during it, or
after, and across a rebuild into a larger filter once the first is full."""

from __future__ import annotations

import sys
import threading

import pytest
from conftest import wait_until
from hypothesis import given, settings
from hypothesis import strategies as st
from test_idindex import _frames

from qdelay.segments import idfilter, native
from qdelay.segments.idfilter import IdFilter
from qdelay.segments.idindex import IdIndex


def _put(index: IdIndex, first: int, n: int) -> list[str]:
    ids = [f"order-{i}" for i in range(first, first + n)]
    index.put_frames(*_frames([(m, 1_000 + i, first + i + 1) for i, m in enumerate(ids)]))
    return ids


def test_an_added_id_is_always_maybe_and_most_others_are_not():
    f = IdFilter(1000)
    added = [f"id-{i}".encode() for i in range(20_000)]  # beyond its capacity, too
    f.add(added)
    assert f.maybe([k.decode() for k in added]) == list(range(len(added)))
    others = [f"other-{i}" for i in range(20_000)]
    assert len(f.maybe(others)) < 200  # ~1M bits for 20,000 ids: a fraction of a percent


def test_lookups_find_every_id_put_before_during_and_after_the_scan(tmp_path):
    index = IdIndex(str(tmp_path / "ids"))
    try:
        before = _put(index, 0, 20_000)
        assert index.get_many(before[:3]) == [(1_000, 1), (1_001, 2), (1_002, 3)]  # starts the scan
        during: list[str] = []
        stop = threading.Event()

        def writer() -> None:  # puts while the scan runs
            k = 20_000
            while not stop.is_set() and k < 60_000:
                during.extend(_put(index, k, 200))
                k += 200

        t = threading.Thread(target=writer)
        t.start()
        try:
            wait_until(lambda: index._filter is not None, timeout=30, what="the id filter is built")
        finally:
            stop.set()
            t.join()
        after = _put(index, 300_000, 1_000)
        every = before + during + after
        found = index.get_many(every)
        assert [i for i, v in enumerate(found) if v is None] == []
        assert index.get_many(["order-x", "never"]) == [None, None]
    finally:
        index.close()


def test_a_full_filter_grows_by_a_layer_without_a_scan(tmp_path, monkeypatch):
    """Past its capacity the filter adds a layer of twice the bits at once, in the put: no
    second scan of the index (it held the GIL ~170 ns a key against the event loop)."""
    monkeypatch.setattr(idfilter, "MIN_CAPACITY", 1_000)
    index = IdIndex(str(tmp_path / "ids"))
    try:
        ids = _put(index, 0, 500)
        index.get_many(ids[:1])
        wait_until(lambda: index._filter is not None, timeout=30, what="the first id filter")
        built = index._filter
        assert index.scans == 1 and index.filter_layers == 1
        ids += _put(index, 500, 4_500)  # 5,000 ids: layers of 1,000, 1,761 and 3,034 ids
        assert index._filter is built and index.scans == 1
        assert index.filter_layers == 3 and index.filter_keys == 5_000
        assert None not in index.get_many(ids)
        assert index.get_many(["order-x", "never"]) == [None, None]
    finally:
        index.close()


def _tiny(capacity: int) -> IdFilter:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(idfilter, "MIN_CAPACITY", 1)
        return IdFilter(capacity)


@settings(max_examples=150, deadline=None)
@given(
    capacity=st.integers(1, 20),
    batches=st.lists(st.lists(st.text(max_size=8), max_size=40), max_size=8),
    asked=st.lists(st.text(max_size=8), max_size=30),
)
def test_a_layered_filter_never_misses_an_added_key(capacity, batches, asked):
    """Tiny capacities force several layers (each of twice the bits of the one before):
    every added id is "maybe", and the answer lists positions in order, once each."""
    f = _tiny(capacity)
    for batch in batches:
        f.add([m.encode() for m in batch])
    added = [m for batch in batches for m in batch]
    assert f.count == len(added)
    layers, room, nbits = 1, capacity, idfilter.first_layer_bits(capacity)
    while room < len(added):
        nbits, more = idfilter.next_layer(nbits, layers)
        room += more
        layers += 1
    assert f.layers == layers
    got = f.maybe(added + asked)
    assert set(range(len(added))) <= set(got)
    assert got == sorted(set(got)) and all(0 <= k < len(added) + len(asked) for k in got)


def test_false_positives_stay_bounded_as_layers_are_added():
    """At 1x the first capacity ~2.3 % at most; past it each layer is tighter, so that at 4x
    (3 layers) the whole stays well under the bound of ~4.6 %."""
    cap = 20_000
    f = _tiny(cap)
    others = [f"other-{i}" for i in range(50_000)]
    f.add([f"id-{i}".encode() for i in range(cap)])
    one = len(f.maybe(others)) / len(others)
    f.add([f"id-{i}".encode() for i in range(cap, 4 * cap)])
    four = len(f.maybe(others)) / len(others)
    assert f.layers == 3
    assert one < 0.03 and four < 0.046
    assert idfilter.FP_AT_CAPACITY / (1 - idfilter.LAYER_TIGHTENING) < 0.047


def test_layers_grow_by_twice_the_bits_and_fewer_false_positives():
    """Layer n >= 1: twice the bits of layer n - 1 and ids enough for its rate at capacity
    to halve (8, ~9.3, ~10.8 ... bits an id): at 10 M ids from an empty start, 1 + 2 + 4 + 8
    MiB (4 layers, room for 11.4 M ids)."""
    assert idfilter.layer_bits_per_key(0) == pytest.approx(idfilter.BITS_PER_KEY)
    nbits, room, sizes = idfilter.first_layer_bits(1 << 20), 1 << 20, [1 << 20]
    for n in range(1, 4):
        nbits, cap = idfilter.next_layer(nbits, n)
        sizes.append(nbits // 8)
        room += cap
        assert nbits / cap == pytest.approx(idfilter.layer_bits_per_key(n), rel=1e-6)
    assert [s >> 20 for s in sizes] == [1, 2, 4, 8] and 11_000_000 < room < 12_000_000


def test_adds_from_two_threads_across_layers_lose_no_id():
    """The owner's scan adds its chunks while the puts add theirs: both may reach a full
    layer at once, and each id must land in a layer the filter keeps."""
    f = _tiny(50)
    start = threading.Barrier(2)

    def adder(tag: str) -> None:
        start.wait()
        for k in range(300):
            f.add([f"{tag}-{k}-{j}".encode() for j in range(7)])

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter will
    try:
        threads = [threading.Thread(target=adder, args=(t,)) for t in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    every = [f"{t}-{k}-{j}" for t in ("a", "b") for k in range(300) for j in range(7)]
    assert f.count == len(every) == sum(layer.count for layer in f._layers)
    assert f.maybe(every) == list(range(len(every)))
    assert f.layers > 5


def test_the_layered_lookup_agrees_with_the_python_twins(monkeypatch):
    f = _tiny(300)
    f.add([f"id-{i}".encode() for i in range(2_000)])
    assert f.layers == 3
    asked = [f"id-{i}" for i in range(0, 4_000, 3)] + [f"x-{i}" for i in range(3_000)]
    native_answer = f.maybe(asked)
    monkeypatch.setattr(native, "codec", None)
    g = _tiny(300)
    g.add([f"id-{i}".encode() for i in range(2_000)])
    assert [bytes(x.bits) for x in g._layers] == [bytes(x.bits) for x in f._layers]
    assert g.maybe(asked) == native_answer == f.maybe(asked)
    assert set(range(667)) <= set(native_answer)


def test_start_filter_builds_it_without_a_lookup_once(tmp_path):
    """The server opens the index and starts the filter's scan at once (a slave never looks
    ids up); asked again, it neither scans again nor replaces the filter."""
    index = IdIndex(str(tmp_path / "ids"))
    try:
        ids = _put(index, 0, 5_000)
        assert index.filter_keys == 0
        index.start_filter()
        wait_until(lambda: index.filter_keys == 5_000, timeout=30, what="the id filter, with no lookup")
        built = index._filter
        index.start_filter()
        ids += _put(index, 5_000, 100)
        assert index._filter is built and index.filter_keys == 5_100
        assert None not in index.get_many(ids)
    finally:
        index.close()


@pytest.mark.parametrize("size", [0, 7, 12])
def test_a_filter_of_a_wrong_size_is_refused(size):
    with pytest.raises(ValueError):
        idfilter.filter_maybe_layers_py([bytearray(size)], ["a"])
