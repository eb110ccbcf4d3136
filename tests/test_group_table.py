"""The group table's saved state (server/groups.py): built again after every change, the
same as a table rebuilt from it, and not rebuilt while nothing changed (the iterate
checkpoint asks for it every 0.2 s under the scheduler's lock)."""

from __future__ import annotations

from qdelay.server.groups import GroupTable


def fresh(t: GroupTable) -> dict:
    """What state() holds, built from the table's public lookups (no cache)."""
    return GroupTable.from_state(t.state()).state()


def test_state_follows_every_change_and_round_trips():
    t = GroupTable()
    seen = [t.state()]
    t.create("orders", "billing", 10)
    seen.append(t.state())
    t.create("orders", "mail", 20)
    seen.append(t.state())
    t.applied_seq = 7  # a GROUP record applied: saved with the table
    seen.append(t.state())
    t.delete("orders", "billing", 30)
    seen.append(t.state())
    t.delete("orders", "mail", 40)  # the subject's last group: it keeps due messages from 40
    seen.append(t.state())
    assert [len(s["groups"]) for s in seen] == [0, 1, 2, 2, 1, 0]
    assert [s["groups_seq"] for s in seen] == [0, 0, 0, 7, 7, 7]
    assert seen[-1]["groups_kept_since"] == [["orders", 40]]
    assert seen[2]["groups"] == [["orders", "billing", -(2**62), 10], ["orders", "mail", 20, 20]]
    for s in seen[1:]:
        assert GroupTable.from_state(s).state() == s


def test_state_is_not_rebuilt_while_nothing_changed():
    t = GroupTable()
    for k in range(100):
        t.create(f"s{k % 7}", f"g{k}", k)
    a, b = t.state(), t.state()
    assert a == b == fresh(t)
    assert a["groups"] is b["groups"]  # the same lists: not built again
    t.create("s0", "new", 500)
    c = t.state()
    assert c["groups"] is not a["groups"] and len(c["groups"]) == 101 and c == fresh(t)


def test_every_group_listed_in_order_a_chunk_at_a_time(tmp_path, monkeypatch):
    """group_stats of every group reads them a chunk per hold of the scheduler's lock
    (a listing of thousands held the dispatcher ~10 ms): the same answer, in the table's
    order, as one hold gives; a group deleted between two chunks is left out."""
    from qdelay.server import scheduler as sched_mod
    from qdelay.server.config import engine_config
    from qdelay.server.engine import Engine

    engine = Engine(engine_config(data_dir=str(tmp_path / "data"), cleaner_enabled=False))
    engine.start()
    try:
        sched = engine.scheduler
        for k in range(10):
            sched.add_group(f"s{k % 3}", f"g{k}", 0)
        whole = sched.group_stats()
        assert [(g["subject"], g["group"]) for g in whole] == sorted((f"s{k % 3}", f"g{k}") for k in range(10))
        monkeypatch.setattr(sched_mod, "STATS_CHUNK", 3)
        assert sched.group_stats() == whole
        assert sched.group_stats(group="g4") == [g for g in whole if g["group"] == "g4"]

        class Between:  # the pause between two chunks: another caller deletes a group then
            @staticmethod
            def sleep(_s: float) -> None:
                sched.remove_group("s2", "g8", 1)

        monkeypatch.setattr(sched_mod, "time", Between)
        assert sched.group_stats() == [g for g in whole if g["group"] != "g8"]
    finally:
        engine.close()
