"""The deduper's table of recent ids (server/recent_ids.py) against the dict of id -> newest
write it replaced, through adds (batches and single reschedules, ids written again),
lookups at floors, forgetting, growing and shrinking, with the native codec and with the
Python twins; and the generated-id ranges of server/validation.py against the strings."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qdelay.segments import native
from qdelay.server import recent_ids
from qdelay.server.engine import Receipt
from qdelay.server.recent_ids import RecentIds
from qdelay.server.validation import IdGenerator

ID = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=6)
# add a batch of distinct ids | look some up | the index catches up by some sequences
STEP = st.one_of(
    st.tuples(st.just("add"), st.lists(ID, min_size=1, max_size=40, unique=True)),
    st.tuples(st.just("find"), st.lists(ID, max_size=12)),
    st.tuples(st.just("index"), st.integers(0, 60)),
)


class Model:
    """What the deduper held before: id -> its newest write; a write leaves once indexed."""

    def __init__(self) -> None:
        self.newest: dict[str, Receipt] = {}

    def add(self, first: int, ids: list[str], dues: list[int]) -> None:
        for k, m in enumerate(ids):
            self.newest[m] = Receipt(m, dues[k], first + k)

    def find(self, ids: list[str], floor: int) -> dict[int, Receipt]:
        return {k: r for k, m in enumerate(ids) if (r := self.newest.get(m)) is not None and r.sequence > floor}


@pytest.mark.parametrize("side", ["native", "twin"])
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(STEP, max_size=60), small=st.booleans())
def test_the_table_answers_as_the_dict_it_replaced(side, steps, small, monkeypatch):
    if side == "twin":
        monkeypatch.setattr(native, "codec", None)
    elif native.codec is None:
        pytest.skip("the native codec is not built")
    if small:  # grow, rebuild and shrink within a few batches
        monkeypatch.setattr(recent_ids, "MIN_SLOTS", 4)
    table, model = RecentIds(), Model()
    written = indexed = 0  # sequences: the last written, and the last the index holds
    for op, arg in steps:
        if op == "add":
            dues = [written * 7 + k for k in range(len(arg))]
            table.add(written + 1, arg, dues, indexed)
            model.add(written + 1, arg, dues)
            written += len(arg)
        elif op == "find":
            assert table.find(arg, indexed) == model.find(arg, indexed)
        else:
            indexed = min(written, indexed + arg)
            table.forget(indexed)
        everything = list(model.newest)
        assert table.find(everything, indexed) == model.find(everything, indexed)
    table.forget(written)
    assert len(table) == 0 and table.find(list(model.newest), written) == {}
    table.trim(written, idle=True)  # memory back once sends stop (the deduper's tidy-up)
    assert table.slots == recent_ids.MIN_SLOTS


def test_an_emptied_table_keeps_its_size_until_trimmed():
    """The index catching up empties the table every few milliseconds under steady sends:
    it is kept at its size (zeroed), not grown again from the smallest; trim() shrinks a
    table twice what the recent peak needs, and to the smallest once idle."""
    table = RecentIds()
    ids = [str(i) for i in range(3000)]
    table.add(1, ids, list(range(3000)), 0)
    big = table.slots
    assert big >= 4 * recent_ids.MIN_SLOTS
    table.forget(3000)
    assert len(table) == 0 and table.slots == big and table.find(ids, 3000) == {}
    table.add(3001, ["a"], [5], 3000)  # the next batch goes into the same table, found
    assert table.slots == big and table.find(["a", "0"], 3000) == {0: Receipt("a", 5, 3001)}
    table.trim(3000)  # the peak since the last trim (3,000 ids) still needs this size
    assert table.slots == big
    table.trim(3000)  # a quiet second: one id held, a table for 3,000 is given back
    assert table.slots == recent_ids.MIN_SLOTS and table.find(["a"], 3000) == {0: Receipt("a", 5, 3001)}
    table.forget(3001)
    table.trim(3001, idle=True)
    assert len(table) == 0 and table.slots == recent_ids.MIN_SLOTS


def test_a_bursts_table_is_given_back_as_soon_as_it_empties(monkeypatch):
    """Only a table of at most KEEP_SLOTS is kept when the index catches up: a burst's is
    made smaller once mostly dead and goes back at once when empty (RSS right after a
    burst), and its peak does not size the next one beyond KEEP_SLOTS."""
    monkeypatch.setattr(recent_ids, "KEEP_SLOTS", 4096)
    table = RecentIds()

    def burst(first: int) -> None:  # 5,000 ids in batches of 500, sequences from ``first``
        for k in range(0, 5000, 500):
            batch = [str(i) for i in range(k, k + 500)]
            table.add(first + k, batch, list(range(k, k + 500)), first - 1)

    burst(1)
    assert table.slots > recent_ids.KEEP_SLOTS
    table.forget(4500)  # mostly dead: made smaller at once
    assert len(table) == 500 and table.slots <= recent_ids.KEEP_SLOTS
    assert table.find(["4999", "0"], 4500) == {0: Receipt("4999", 4999, 5000)}
    table.forget(5000)
    burst(5001)
    assert table.slots > recent_ids.KEEP_SLOTS
    table.forget(10000)  # empty: back to the smallest at once
    assert len(table) == 0 and table.slots == recent_ids.MIN_SLOTS
    table.add(10001, [str(i) for i in range(800)], list(range(800)), 10000)  # a rebuild: sized by
    assert table.slots <= recent_ids.KEEP_SLOTS  # the peak only up to KEEP_SLOTS
    assert table.find(["5", "0"], 10000) == {0: Receipt("5", 5, 10006), 1: Receipt("0", 0, 10001)}


def test_a_hash_match_of_another_id_is_not_a_hit(monkeypatch):
    """A slot matches on a 64-bit hash; the id itself is confirmed from its batch's line."""
    monkeypatch.setattr(native, "codec", None)
    monkeypatch.setattr(recent_ids.xxhash, "xxh3_64_intdigest", lambda key, seed: 5)  # every id collides
    twin = RecentIds()
    twin.add(1, ["a", "b"], [10, 20], 0)
    assert twin.find(["b", "c", "a"], 0) == {0: Receipt("b", 20, 2), 2: Receipt("a", 10, 1)}


def test_a_lookup_begun_before_the_index_caught_up_still_finds_its_ids():
    """Puts reuse only slots dead for every running lookup (the caller's floor): a slot at or
    below a later floor is still found by a lookup at its own, earlier floor."""
    table = RecentIds()
    table.add(1, ["a"], [1], 0)
    table.add(2, ["b"], [2], 0)  # a lookup that began when the index held nothing runs
    assert table.find(["a", "b"], 0) == {0: Receipt("a", 1, 1), 1: Receipt("b", 2, 2)}
    assert table.find(["a", "b"], 1) == {1: Receipt("b", 2, 2)}


def test_generated_id_ranges_match_the_strings():
    gen = IdGenerator()
    before = gen.issued
    ids = [gen() for _ in range(300)]
    made = gen.made(before, gen.issued)
    assert len(made) == 300 and all(m in made for m in ids)
    prefix, first = ids[0].rsplit("-", 1)
    n = int(first, 16)
    outside = [
        f"{prefix}-{n - 1:x}",  # made before
        f"{prefix}-{n + 300:x}",  # not made yet
        f"{prefix}-0{n:x}",  # a leading zero: not how the generator writes it
        f"{prefix}-{n:X}" if f"{n:x}" != f"{n:X}" else f"{prefix}-+{n:x}",
        f"{prefix}-",
        f"{prefix}-{n:x} ",
        f"other-{n:x}",
        ids[0][:-1] + "g",
    ]
    assert not any(m in made for m in outside)
