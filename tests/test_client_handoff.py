"""The blocking client's thread -> I/O loop handoff (client/handoff.py): a Waiter per call,
the Room that bounds the queue, the Inbox that wakes the loop. No server."""

from __future__ import annotations

import threading

import pytest
from conftest import wait_until

from qdelay.client.handoff import Inbox, Room, Waiter, WaitTimeout


def test_a_waiter_gives_its_answer_or_its_error():
    w = Waiter()
    assert not w.done()
    w.set_result(7)
    assert w.done() and w.wait(1) == 7
    e = Waiter()
    e.set_exception(ValueError("refused"))
    with pytest.raises(ValueError, match="refused"):
        e.wait(None)


def test_a_waiter_answered_from_another_thread_wakes_its_caller():
    w = Waiter()
    threading.Timer(0.05, w.set_result, ("receipt",)).start()
    assert w.wait(30) == "receipt"


def test_a_waiter_that_times_out_gives_up_and_a_late_answer_is_harmless():
    w = Waiter()
    with pytest.raises(WaitTimeout):
        w.wait(0.01)
    assert w.done() and w.gave_up  # the loop leaves its message out
    w.set_result("late")  # the loop may answer it anyway: nobody waits, nothing breaks
    with pytest.raises(Exception, match="answered already"):
        w.set_result("twice")


def test_the_room_blocks_a_thread_while_full_until_the_loop_gives_some_back():
    room = Room(2)
    room.take()
    room.take()
    got = threading.Event()

    def third():
        room.take()
        got.set()

    t = threading.Thread(target=third, daemon=True)
    t.start()
    assert not got.wait(0.1)  # full: the third waits
    room.give(1)
    wait_until(got.is_set, what="the third thread took the place given back")
    t.join(5)
    room.give(0)  # nothing to give: no-op


class _Loop:
    """Records call_soon_threadsafe; runs the callbacks when asked (as the loop would)."""

    def __init__(self) -> None:
        self.calls: list = []

    def call_soon_threadsafe(self, callback) -> None:
        self.calls.append(callback)

    def run(self) -> None:
        calls, self.calls = self.calls, []
        for c in calls:
            c()


def test_the_inbox_wakes_the_loop_once_wake_at_items_wait():
    taken: list = []
    inbox = Inbox(taken.extend)
    loop = _Loop()
    inbox.wake_at = 3
    inbox.put(loop, 1)
    inbox.put(loop, 2)
    assert not loop.calls and len(inbox) == 2  # gathering: no wake-up yet
    inbox.put(loop, 3)
    inbox.put(loop, 4)
    assert len(loop.calls) == 1  # one wake-up for the burst
    loop.run()
    assert taken == [1, 2, 3, 4] and not len(inbox)
    inbox.wake_at = 1
    inbox.put(loop, 5)
    assert inbox.drain() == [5]  # the loop pulls what it finds when it looks anyway
    loop.run()  # the wake-up scheduled for 5 finds nothing left
    assert taken == [1, 2, 3, 4]
