"""The id filter in front of the id index (segments/idfilter.py): a lookup never misses an
indexed id because of it — whether the id was put before the filter's scan, during it, or
after, and across a rebuild into a larger filter once the first is full."""

from __future__ import annotations

import threading

import pytest
from conftest import wait_until
from test_idindex import _frames

from qdelay.segments import idfilter
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


def test_a_full_filter_is_replaced_by_a_larger_one_that_misses_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(idfilter, "MIN_CAPACITY", 1_000)
    index = IdIndex(str(tmp_path / "ids"))
    try:
        ids = _put(index, 0, 500)
        index.get_many(ids[:1])
        wait_until(lambda: index._filter is not None, timeout=30, what="the first id filter")
        small = index._filter
        ids += _put(index, 500, 3_000)  # past its capacity: a scan builds one twice as large
        wait_until(lambda: index._filter is not small, timeout=30, what="the larger id filter")
        assert index._filter is not None and index._filter.capacity == 2 * small.capacity
        assert None not in index.get_many(ids)
    finally:
        index.close()


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
        idfilter.filter_maybe_py(bytearray(size), ["a"])
