"""The timer on its own (server/timer.py): no files, no threads, no clock but a number.

What is due fires to every group of its subject (fan-out), a dispatch round takes within
each group's credit, a lane over its bound spills (and keeps its bucket from being done),
and a deleted group's lanes, retries and counts go.
"""

from __future__ import annotations

import collections

import numpy as np

from qdelay.segments import records
from qdelay.segments.framing import Frame
from qdelay.segments.naming import MS_PER_MINUTE
from qdelay.segments.records import Cancel, RecordKind
from qdelay.server.buckets import BucketBook, BucketState
from qdelay.server.groups import GroupTable
from qdelay.server.lanes import Ready
from qdelay.server.scheduler import SchedulerConfig
from qdelay.server.timer import Timer
from qdelay.server.wheel import Entries

B = 29_000_000  # a bucket (epoch minutes)
T = B * MS_PER_MINUTE


def rig(**cfg) -> tuple[Timer, BucketState, GroupTable]:
    book = BucketBook(None, None, 1, done_before=B, reopened=set(), closed_retired=0, reopened_at={})
    st = book.loaded[B] = BucketState(B, None)
    groups = GroupTable()
    timer = Timer(SchedulerConfig(**cfg), book, groups, legacy_upto=0, clock=lambda: T)
    return timer, st, groups


def load(timer: Timer, st: BucketState, subject: bytes, seqs: list[int], due: int) -> None:
    """Entries as the loader indexes them: due at ``due``, in bucket ``st``."""
    n = len(seqs)
    sid = timer.subject_id(subject)
    timer.wheel.add_many(
        Entries(
            np.full(n, due, dtype=np.int64),
            np.array(seqs, dtype=np.int64),
            np.arange(n, dtype=np.int64) * 100,
            np.full(n, st.bucket, dtype=np.int32),
            np.full(n, sid, dtype=np.int32),
        )
    )
    st.unfired += n


def test_due_entries_fan_out_to_every_group_and_rounds_take_within_credit():
    timer, st, groups = rig()
    for name in ("a", "b", "c"):
        groups.create("s", name, 0)
    load(timer, st, b"s", list(range(1, 11)), T + 5)
    timer.fire(T + 4)
    assert timer.ready_total == 0 and st.unfired == 10  # not due yet
    timer.fire(T + 5)
    assert st.unfired == 0 and timer.ready_total == 30 and timer.in_memory() == 30
    assert sorted(st.owed.values()) == [10, 10, 10]  # each group owes every message
    credit = {"a": 4, "b": 0, "c": 100}
    taken = timer.take(lambda subject, group: credit[group], lambda n: n, quantum=512)
    got = {g.name: cols[0] for _lane, g, _name, cols in taken}
    assert got == {"a": [1, 2, 3, 4], "c": list(range(1, 11))}
    assert timer.ready_total == 30 - 14
    # the rate limit's tokens bound a round too
    taken = timer.take(lambda subject, group: 100, lambda n: min(n, 2), quantum=512)
    assert sorted((g.name, cols[0]) for _lane, g, _name, cols in taken) == [("a", [5, 6]), ("b", [1, 2])]


def test_a_lane_over_its_bound_spills_and_holds_its_bucket_until_read_back():
    timer, st, groups = rig(group_max_ready=5)
    g, _ = groups.create("s", "slow", 0)
    load(timer, st, b"s", list(range(1, 9)), T)
    timer.fire(T)
    (lane,) = timer.lanes_of(g.gid)
    assert lane.spilled and lane.ready.count == 0 and timer.ready_total == 0
    assert st.owed.get(g.gid, 0) == 0  # nothing held in memory for it ...
    assert timer.spill_floor() == B  # ... but its bucket is not done: the entries are on disk
    assert timer.spilled_to_read(lambda subject, group: 0) is None  # no credit: stays on disk
    assert timer.spilled_to_read(lambda subject, group: 1) is lane
    seqs = np.array([1, 2, 3], dtype=np.int64)
    timer.take_back(lane, st, seqs, seqs * 100, np.full(3, T, dtype=np.int64))
    assert lane.ready.count == 3 and st.owed[g.gid] == 3 and lane.recent == {1, 2, 3}
    timer.take_back(lane, st, seqs, seqs * 100, np.full(3, T, dtype=np.int64))
    assert lane.ready.count == 3, "entries already queued are not queued twice"


def test_a_spilled_lane_counts_what_waits_on_disk():
    """``Lane.on_disk`` (Stats' backlog of a spilled group): its queue when it spilled, what
    became due for it meanwhile, less what was read back; 0 once it is whole again."""
    timer, st, groups = rig(group_max_ready=5)
    g, _ = groups.create("s", "slow", 0)
    load(timer, st, b"s", list(range(1, 9)), T)
    timer.fire(T)
    (lane,) = timer.lanes_of(g.gid)
    assert lane.spilled and lane.on_disk == 8  # 8 > 5: its queue spilled
    load(timer, st, b"s", [20, 21], T + 1)
    timer.fire(T + 1)
    assert lane.on_disk == 10 and lane.ready.count == 0
    w = timer.pass_of(lane)
    assert w is not None
    seqs = np.array([1, 2, 3], dtype=np.int64)
    timer.take_back(lane, st, seqs, seqs * 100, np.full(3, T, dtype=np.int64))
    assert lane.on_disk == 7 and lane.ready.count == 3
    timer.take_back(lane, st, seqs, seqs * 100, np.full(3, T, dtype=np.int64))  # queued already
    assert lane.on_disk == 7
    timer.end_pass(lane)
    assert timer.pass_of(lane) is None and not lane.spilled and lane.on_disk == 0  # whole again


def test_the_first_group_of_a_subject_counts_what_the_subject_kept_for_it():
    timer, st, groups = rig()
    load(timer, st, b"s", [1, 2, 3], T)
    timer.fire(T)
    g, _ = groups.create("s", "first", T + 10)
    timer.group_created(g)
    (lane,) = timer.lanes_of(g.gid)
    assert lane.spilled and lane.on_disk == 3 and timer.kept_count == {}
    groups.delete("s", "first", T + 20)  # kept again from T + 20 on: the next first group's since
    timer.group_deleted(g)
    load(timer, st, b"s", [4, 5], T + 15)
    load(timer, st, b"s", [6], T + 25)
    timer.fire(T + 30)
    g2, _ = groups.create("s", "again", T + 40)
    timer.group_created(g2)
    (lane,) = timer.lanes_of(g2.gid)
    assert g2.since == T + 20 and lane.on_disk == 1  # only 6 is due at or after its since


def test_a_message_cancelled_in_the_wheel_is_left_out_when_it_falls_due_with_or_without_a_group():
    """A late cancel (its target already in the wheel) is left out when it falls due: out of
    the lanes of the subject's groups, and, for a subject with no group yet, out of what
    the subject keeps for its first group (counted there, it was that group's backlog on
    disk, and the late cancel itself stayed noted for the bucket's life)."""
    timer, st, groups = rig()
    g, _ = groups.create("s", "g", 0)
    load(timer, st, b"s", [1, 2, 3], T)
    load(timer, st, b"lonely", [4, 5, 6], T)
    st.top_indexed = 6  # as the load read them
    st.cancel([2, 5])
    assert st.late_cancels == {2, 5}
    timer.fire(T)
    (lane,) = timer.lanes_of(g.gid)
    assert lane.ready.count == 2 and st.owed[g.gid] == 2  # 1 and 3
    g2, _ = groups.create("lonely", "first", T + 10)
    timer.group_created(g2)
    (lane2,) = timer.lanes_of(g2.gid)
    assert lane2.spilled and lane2.on_disk == 2  # 4 and 6
    assert st.late_cancels == set()


def test_a_late_cancel_of_a_message_already_fired_is_forgotten_once_its_bucket_has_fired():
    """A cancel of a message already out of the wheel (fired, waiting in a lane) is noted as
    late too (nothing cheap tells the two apart); it was kept, and every later fire of the
    bucket paid the check for it, for the bucket's life. Once nothing of the bucket is left
    in the wheel, no late cancel can matter."""
    timer, st, groups = rig()
    groups.create("s", "g", 0)
    load(timer, st, b"s", [1, 2], T)
    load(timer, st, b"s", [3], T + 5)
    st.top_indexed = 3
    timer.fire(T)
    st.cancel([1])  # fired already: in the lane
    timer.fire(T + 5)
    assert st.unfired == 0 and st.late_cancels == set()


def test_a_group_with_its_own_bound_spills_at_it_and_the_others_at_the_default():
    """``group_max_ready_of``: "SUBJECT/GROUP" -> entries, for the one group that needs
    another bound (issue 14 item 2: the bound is per group); capped at a quarter of
    ``max_loaded`` like the default."""
    timer, st, groups = rig(group_max_ready=5, group_max_ready_of={"s/big": 20, "s/huge": 10**9}, max_loaded=400)
    small, _ = groups.create("s", "small", 0)
    big, _ = groups.create("s", "big", 0)
    huge, _ = groups.create("s", "huge", 0)
    load(timer, st, b"s", list(range(1, 9)), T)
    timer.fire(T)
    ((ls,), (lb,), (lh,)) = (timer.lanes_of(g.gid) for g in (small, big, huge))
    assert (ls.bound, lb.bound, lh.bound) == (5, 20, 100)
    assert ls.spilled and ls.ready.count == 0  # 8 > its 5
    assert not lb.spilled and lb.ready.count == 8  # 8 <= its 20
    assert not lh.spilled and lh.ready.count == 8


def test_a_subject_without_a_group_keeps_its_entries_for_the_first_group():
    timer, st, groups = rig()
    load(timer, st, b"s", [1, 2], T)
    timer.fire(T)
    assert timer.ready_total == 0 and timer.kept == {timer.subject_id(b"s"): B}
    assert timer.spill_floor() == B
    g, _ = groups.create("s", "late", T + 10)
    timer.group_created(g)
    (lane,) = timer.lanes_of(g.gid)
    assert lane.spilled and lane.drop_from == B and timer.kept == {}


def test_a_deleted_group_loses_its_lanes_retries_and_counts():
    timer, st, groups = rig()
    g, _ = groups.create("s", "gone", 0)
    keep, _ = groups.create("s", "kept", 0)
    load(timer, st, b"s", [1, 2, 3], T)
    timer.fire(T)
    assert timer.ready_total == 6
    groups.delete("s", "gone", T)
    timer.group_deleted(g)
    assert timer.ready_total == 3 and timer.lanes_of(g.gid) == [] and g.gid not in st.owed
    sid = timer.subject_id(b"s")
    timer.requeue((1, 100, B, T, 2, sid, g.gid))  # a retry of the deleted group: dropped
    timer.requeue((1, 100, B, T, 2, sid, keep.gid))
    assert timer.ready_total == 4
    taken = timer.take(lambda subject, group: 10, lambda n: n, quantum=512)
    assert [(gr.name, cols[0], cols[4]) for _lane, gr, _name, cols in taken] == [("kept", [1, 1, 2, 3], [2, 1, 1, 1])]


def test_a_group_created_beside_others_reads_back_only_what_fired_for_its_subject_since():
    """A new group of a subject that has groups receives from its ``since`` on. Its lane
    starts spilled (read back from disk) only if an entry of its subject due at or after
    that ``since`` has fired already; a lane spilled for nothing would be looked at every
    scheduler turn and keep the buckets from its since on from becoming done."""
    timer, st, groups = rig()
    groups.create("s", "first", 0)
    groups.create("quiet", "first", 0)
    load(timer, st, b"s", [1, 2], T + 5)
    timer.fire(T + 10)  # the timer (and subject s) passed T + 5
    quiet, _ = groups.create("quiet", "second", T + 5)
    timer.group_created(quiet)
    assert timer.lanes_of(quiet.gid) == [] and timer.spilled == set()
    assert timer.spill_floor() > B  # nothing held back for it
    late, _ = groups.create("s", "second", T + 5)  # entries due at T + 5 fired without it
    timer.group_created(late)
    (lane,) = timer.lanes_of(late.gid)
    assert lane.spilled and lane.drop_from == B
    later, _ = groups.create("s", "third", T + 6)  # nothing of s due at or after T + 6 fired
    timer.group_created(later)
    assert timer.lanes_of(later.gid) == []


def test_group_changes_and_lookups_cost_the_group_not_all_of_them():
    """A group's lanes are indexed by group: deleting one does not walk every lane, and
    narrowed group lookups (Stats filters) find their answer through an index."""
    timer, st, groups = rig()
    made = [groups.create(f"s{k % 7}", f"g{k}", 0)[0] for k in range(50)]
    for k in range(7):
        load(timer, st, f"s{k}".encode(), [100 + k], T)
    timer.fire(T)
    assert sum(len(timer.lanes_of(g.gid)) for g in made) == 50
    groups.delete(made[3].subject, made[3].name, T)
    timer.group_deleted(made[3])
    assert timer.lanes_of(made[3].gid) == [] and len(timer.lanes) == 49
    taken = timer.take(lambda subject, group: 10, lambda n: n, quantum=512)
    assert sorted(g.name for _lane, g, _name, _cols in taken) == sorted(g.name for g in made if g is not made[3])
    assert [g.name for g in groups.select("s1")] == sorted(g.name for g in made if g.subject == "s1")
    assert [(g.subject, g.name) for g in groups.select(name="g8")] == [("s1", "g8")]
    assert groups.select("s1", "g8") == [made[8]] and groups.select("s2", "g8") == []
    assert groups.select(name="g3") == []  # deleted
    assert groups.select() == groups.all()


def test_a_message_cancelled_later_in_the_same_loaded_chunk_never_enters_the_wheel():
    """A bucket loaded in one chunk holding a message and then its tombstone: the message
    was read first (not yet in the wheel, nothing of the bucket unfired), so the cancel was
    not noted late, and the message fell due into its group's backlog."""
    timer, st, groups = rig()
    g, _ = groups.create("s", "g", 0)
    frames = [
        Frame(i * 100, int(RecordKind.MESSAGE), i, 0, records.encode_message(b"s", f"m{i}".encode(), b"", b"x", T))
        for i in (1, 2, 3)
    ]
    frames.append(Frame(400, int(RecordKind.CANCEL), 4, 0, records.encode_cancel(Cancel("m2", T, 2))))
    timer.index(st, frames)
    assert st.unfired == 2 and 2 in st.cancelled
    timer.fire(T)
    (lane,) = timer.lanes_of(g.gid)
    assert lane.ready.count == 2 and st.owed[g.gid] == 2  # 1 and 3


def test_a_message_cancelled_while_it_waits_in_ready_queues_leaves_every_groups_backlog_at_once():
    """Issue 14: a message cancelled after it fell due, while it waited in a group's ready
    queue for a consumer or credit, stayed in that group's backlog (and its bucket's
    ``owed``) until the group's next dispatch round dropped it: for ever in a group without
    consumers. The tombstone now takes it out of every group's queue at once; the entry is
    dropped when a round (or a spill) reaches it, never delivered nor counted twice."""
    timer, st, groups = rig(group_max_ready=6)
    a, _ = groups.create("s", "a", 0)
    b, _ = groups.create("s", "b", 0)
    load(timer, st, b"s", [1, 2, 3, 4, 5], T)
    timer.fire(T)
    st.top_indexed = 5
    ((la,), (lb,)) = (timer.lanes_of(g.gid) for g in (a, b))
    taken = timer.take(lambda subject, group: 2 if group == "a" else 0, lambda n: n, quantum=512)
    assert [cols[0] for _l, _g, _n, cols in taken] == [[1, 2]]  # a holds 1 and 2 in flight
    st.cancel([3, 9])  # 3 in both queues, 9 in none
    assert timer.cancel_ready(B, {3, 9}) == 2  # 3 in a's queue and in b's
    assert (la.ready.count, lb.ready.count, timer.ready_total) == (2, 4, 6)
    assert st.owed == {a.gid: 4, b.gid: 4}
    assert timer.cancel_ready(B, {3}) == 0, "a repeated tombstone counts nothing"
    taken = timer.take(lambda subject, group: 10, lambda n: n, quantum=512)
    assert sorted((g.name, cols[0]) for _l, g, _n, cols in taken) == [("a", [4, 5]), ("b", [1, 2, 4, 5])]
    assert timer.ready_total == 0 and la.ready.count == lb.ready.count == 0
    # a spill after a cancel counts on disk only what is still due for the group
    load(timer, st, b"s", [10, 11, 12, 13, 14], T + 1)
    st.top_indexed = 14
    timer.fire(T + 1)
    st.cancel([12])
    assert timer.cancel_ready(B, {12}) == 2
    load(timer, st, b"s", [15, 16, 17], T + 2)
    st.top_indexed = 17
    timer.fire(T + 2)  # 4 + 3 > 6: both lanes spill
    assert la.spilled and lb.spilled and la.on_disk == lb.on_disk == 7
    # only what the rounds took stays owed (in flight: 1, 2, 4, 5 in each)
    assert timer.ready_total == 0 and st.owed == {a.gid: 4, b.gid: 4}


def test_a_retry_cancelled_while_it_waits_leaves_the_backlog():
    timer, st, groups = rig()
    g, _ = groups.create("s", "g", 0)
    sid = timer.subject_id(b"s")
    st.owe(g.gid, 2)  # two deliveries in flight come back for another attempt
    st.top_indexed = 2
    timer.lane(sid, g.gid)
    assert timer.requeue((1, 100, B, T, 2, sid, g.gid)) and timer.requeue((2, 200, B, T, 2, sid, g.gid))
    assert timer.cancel_ready(B, {2}) == 1
    (lane,) = timer.lanes_of(g.gid)
    assert lane.ready.count == 1 and timer.ready_total == 1 and st.owed[g.gid] == 1
    taken = timer.take(lambda subject, group: 10, lambda n: n, quantum=512)
    assert [(cols[0], cols[4]) for _l, _g, _n, cols in taken] == [([1], [2])]


def test_cancels_of_a_large_ready_queue_look_up_their_targets_not_the_queue():
    """100,000 entries ready in 1,000 chunks, cancelled in 200 batches while the queue is
    taken from and pushed to: every count stays exact against a plain model, and the look-up
    structure (sorted runs) holds about the queue, not what passed through it."""
    timer, st, groups = rig(group_max_ready=200_000, max_loaded=10**7)
    g, _ = groups.create("s", "g", 0)
    rng = np.random.default_rng(7)
    model: collections.deque[int] = collections.deque()  # queued, in order (cancelled ones too)
    live: set[int] = set()  # queued and not cancelled
    flying = 0
    nxt = 1
    for _ in range(1000):
        seqs = list(range(nxt, nxt + 100))
        nxt += 100
        rng.shuffle(seqs)
        load(timer, st, b"s", seqs, T)
        timer.fire(T)
        model += seqs
        live.update(seqs)
    st.top_indexed = nxt
    (lane,) = timer.lanes_of(g.gid)
    for k in range(200):
        targets = {int(q) for q in rng.integers(1, nxt + 500, size=50)}
        hit = live & targets  # (the rest: taken already, or not fired yet)
        assert timer.cancel_ready(B, targets) == len(hit)
        live -= hit
        if k % 3 == 0:
            taken = timer.take(lambda subject, group: 700, lambda n: n, quantum=700)
            got = [q for _l, _g, _n, cols in taken for q in cols[0]]
            want: list[int] = []
            while model and len(want) < 700:  # a round takes 700 live ones, passing over the rest
                q = model.popleft()
                if q in live:
                    want.append(q)
                    live.discard(q)
            assert got == want
            flying += len(got)
        else:
            seqs = list(range(nxt, nxt + 300))
            nxt += 300
            load(timer, st, b"s", seqs, T)
            timer.fire(T)
            st.top_indexed = nxt
            model += seqs
            live.update(seqs)
        assert lane.ready.count == len(live) == timer.ready_total
        assert st.owed[g.gid] == len(live) + flying  # what the rounds took stays owed until acknowledged
    assert sum(len(run[0]) for run in lane.ready._runs) <= 2 * len(model) + 1024


def test_a_queue_nobody_takes_from_holds_about_what_it_counts_after_cancels():
    """Entries cancelled while queued stay in their chunks, marked, until a round passes
    them; in a group without consumers no round comes, and a lane's bound counts only what
    is not cancelled, so without a limit the marked ones would pile up for ever. Once they
    outnumber the rest, the chunks are copied without them."""
    timer, st, groups = rig(group_max_ready=100_000, max_loaded=10**7)
    g, _ = groups.create("s", "idle", 0)
    for k in range(10):
        load(timer, st, b"s", list(range(k * 1000 + 1, k * 1000 + 1001)), T)
        timer.fire(T)
    st.top_indexed = 10_000
    (lane,) = timer.lanes_of(g.gid)
    held = lambda: sum(len(e) - pos for e, pos, *_rest in lane.ready.chunks)  # noqa: E731
    assert timer.cancel_ready(B, set(range(1, 4001))) == 4000
    assert lane.ready.count == 6000 and held() == 10_000  # marked, not copied yet
    assert timer.cancel_ready(B, set(range(4001, 8001))) == 4000
    assert lane.ready.count == 2000 and held() == 2000 and len(lane.ready.chunks) == 1
    assert timer.cancel_ready(B, {8001, 9999}) == 2  # found in the copy
    taken = timer.take(lambda subject, group: 10_000, lambda n: n, quantum=10_000)
    assert [q for *_x, cols in taken for q in cols[0]] == [q for q in range(8002, 10_001) if q != 9999]
    assert timer.ready_total == 0 and st.owed[g.gid] == 1998


def test_a_cancel_finds_entries_queued_after_most_of_a_lane_was_taken():
    """Ready's sorted runs, dropped once most of what they held was taken, are built again
    from the queue: they were dropped as if every queued chunk were in them, so a cancel of
    an entry still queued found nothing and it stayed in the group's backlog."""
    q = Ready()
    for k in range(10):
        seqs = np.arange(k * 1000 + 1, k * 1000 + 1001, dtype=np.int64)
        zeros = np.zeros(1000, dtype=np.int64)
        q.push(Entries(zeros, seqs, zeros, zeros.astype(np.int32), zeros.astype(np.int32)))
    assert q.cancel({5}) == 1 and q.count == 9999  # builds the runs over the queue
    assert len(q.take(9000)[0]) == 9000  # most of what they hold taken (the 5 passed over)
    assert q.count == 999
    assert q.cancel({9500, 9999}) == 2 and q.count == 997
    assert 9500 not in q.take(1000)[0] and q.count == 0


def test_a_lane_whose_every_queued_entry_was_cancelled_lets_go_of_its_chunks():
    """Cancels that leave a lane's ready queue with nothing to count free its chunks at once:
    the lane leaves the round-robin at count 0, so no round would pass over its marked
    entries, and a fired chunk (shared by the subject's groups) stayed held by it for as
    long as the group got nothing new, after its bucket was done."""
    q = Ready()
    seqs = np.arange(1, 11, dtype=np.int64)
    zeros = np.zeros(10, dtype=np.int64)
    q.push(Entries(zeros, seqs, zeros, zeros.astype(np.int32), zeros.astype(np.int32)))
    q.push_retry((99, 0, 0, 0, 2))
    assert q.cancel(set(range(1, 6))) == 5 and len(q.chunks) == 1  # some left: kept
    assert q.cancel({*range(6, 11), 99}) == 6 and q.count == 0
    assert not q.chunks and not q.retries and q.in_memory() == set()
    q.push(Entries(zeros[:2], seqs[:2] + 100, zeros[:2], zeros[:2].astype(np.int32), zeros[:2].astype(np.int32)))
    assert q.cancel({101}) == 1 and q.take(10)[0] == [102] and q.count == 0


def test_a_lane_emptied_by_cancels_is_in_the_round_robin_once_when_it_fills_again():
    """A lane joins the round-robin when an entry comes to its empty queue; one emptied by
    cancels (not by a round) stayed in it, so the next entry put it in a second time: an
    idle group whose fired messages were cancelled went in once more at every such turn, and
    every dispatch round walked it that many times (and a lane with credit took that many
    turns a round)."""
    timer, st, groups = rig()
    groups.create("s", "idle", 0)
    for k in range(1, 5):
        load(timer, st, b"s", [k], T + k)
        timer.fire(T + k)  # into the queue the previous turn's cancel emptied
        assert timer.take(lambda s, g: 0, lambda n: n, 100) == []  # no credit: a round takes nothing
        assert len(timer.rr) == 1 and timer.ready_total == 1
        assert timer.cancel_ready(st.bucket, {k}) == 1 and timer.ready_total == 0


def test_a_lane_emptied_by_a_spill_is_in_the_round_robin_once_when_a_retry_comes():
    """The same for a spill: the lane over its bound forgets its queue and stays in the
    round-robin; a retry requeued before the next round put it in a second time."""
    timer, st, groups = rig(group_max_ready=4)
    groups.create("s", "g", 0)
    load(timer, st, b"s", list(range(1, 11)), T + 1)
    timer.fire(T + 1)
    (lane,) = timer.spilled
    assert lane.ready.count == 0 and len(timer.rr) == 1
    timer.requeue((50, 0, st.bucket, T, 2, lane.sid, lane.gid))
    assert len(timer.rr) == 1
    assert [cols[0] for _l, _g, _n, cols in timer.take(lambda s, g: 10, lambda n: n, 100)] == [[50]]
    assert len(timer.rr) == 0
