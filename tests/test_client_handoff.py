"""The blocking client's thread -> I/O loop handoff (client/handoff.py): a Waiter per call
on a one-shot Gate (the native qdelay._handoff and its Python twin, held to the same
behaviour here), a batch's callers woken together, the Room that bounds the queue, the
Inbox that wakes the loop. No server."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from conftest import wait_until

from qdelay.client import handoff
from qdelay.client.handoff import Inbox, Room, Waiter, WaitTimeout, settle_all

SIDES = ["native", "twin"]


def _impl(side: str) -> tuple:
    """(Gate, open_all) of one side; the native one skips only where it is switched off."""
    if side == "twin":
        return handoff.PyGate, handoff.py_open_all
    if handoff.native is None:
        if os.environ.get("QDELAY_NATIVE") == "0":
            pytest.skip("QDELAY_NATIVE=0: the native handoff is switched off on purpose")
        pytest.fail("qdelay._handoff was not built: see the pip install output")
    return handoff.native.Gate, handoff.native.open_all


@pytest.fixture(params=SIDES)
def side(request, monkeypatch) -> str:
    """Waiters made in the test use this side's Gate and open_all."""
    gate, open_all = _impl(request.param)
    monkeypatch.setattr(handoff, "Gate", gate)
    monkeypatch.setattr(handoff, "open_all", open_all)
    return request.param


def test_the_native_module_exports_what_its_twins_stand_for():
    if handoff.native is None:
        _impl("native")  # skips or fails, as above
    exported = {n for n in dir(handoff.native) if not n.startswith("_") and callable(getattr(handoff.native, n))}
    assert exported == set(handoff.twins())


@pytest.mark.parametrize("which", SIDES)
def test_a_gate_opens_once_and_stays_open(which):
    gate_type, open_all = _impl(which)
    g = gate_type()
    assert not g.is_open
    t0 = time.monotonic()
    assert g.wait(0.05) is False and time.monotonic() - t0 >= 0.04  # closed: the timeout passes
    assert g.wait(0) is False and g.wait(-1) is False  # no wait at all
    g.open()
    assert g.is_open
    assert g.wait(None) is True and g.wait(0) is True  # open stays open: a second wait too
    g.open()  # again: a no-op
    open_all([g])  # open already: left as it is
    assert g.wait(1) is True
    with pytest.raises(TypeError):
        open_all([gate_type(), "not a gate"])
    with pytest.raises(TypeError):
        open_all((gate_type(),))
    closed = gate_type()
    with pytest.raises(TypeError):
        open_all([closed, 1])
    assert not closed.is_open  # every item checked before any is opened
    del closed, g  # freed closed and open: neither leaks nor crashes


@pytest.mark.parametrize("which", SIDES)
def test_open_all_wakes_every_thread_waiting(which):
    gate_type, open_all = _impl(which)
    gates = [gate_type() for _ in range(20)]
    woke: list = []

    def waiter(g) -> None:
        woke.append(g.wait(30))

    threads = [threading.Thread(target=waiter, args=(g,), daemon=True) for g in gates]
    for t in threads:
        t.start()
    open_all(gates[:10] + gates[:1])  # a gate twice in one list: opened once
    wait_until(lambda: len(woke) == 10, what="the ten threads of the opened gates woke")
    assert not any(g.is_open for g in gates[10:])
    open_all(gates[10:])
    for t in threads:
        t.join(5)
    assert woke == [True] * 20


@pytest.mark.parametrize("which", SIDES)
def test_a_signal_handler_interrupts_a_wait(which):
    """An interrupt (here a handler that raises, as SIGINT's does) ends the wait with its
    exception, as threading.Lock.acquire does: Ctrl-C stops a send() blocked on its
    receipt."""
    gate_type, _open_all = _impl(which)

    class Interrupted(Exception):
        pass

    def handler(signum, frame):
        raise Interrupted

    old = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        t0 = time.monotonic()
        with pytest.raises(Interrupted):
            gate_type().wait(30)
        assert time.monotonic() - t0 < 10
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(Interrupted):
            gate_type().wait(None)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_settle_all_answers_every_waiter_then_wakes_them_together(side):
    waiters = [Waiter() for _ in range(4)]
    waiters[1].set_result("answered before")  # left as it is
    with pytest.raises(WaitTimeout):
        waiters[2].wait(0.01)  # gave up: answered anyway, nobody waits
    got: list = []
    t = threading.Thread(target=lambda: got.append(waiters[3].wait(30)), daemon=True)
    t.start()
    settle_all(waiters, ["a", "b", "c", "d"])
    t.join(30)
    assert got == ["d"]
    assert [w.wait(0) for w in (waiters[0], waiters[1], waiters[3])] == ["a", "answered before", "d"]
    assert all(w.done() for w in waiters)


def test_a_waiter_that_gives_up_after_its_answer_is_in_returns_it(side):
    """settle() publishes the answer before open_all opens the gate: a thread whose timeout
    passes in between returns the answer, it does not raise WaitTimeout."""
    w = Waiter()
    gate = w.settle("receipt")
    assert gate is not None and w.settle("again") is None
    assert w.wait(0.01) == "receipt"  # the gate is still closed: the wait times out, the answer is there


def test_a_waiter_gives_its_answer_or_its_error(side):
    w = Waiter()
    assert not w.done()
    w.set_result(7)
    assert w.done() and w.wait(1) == 7
    e = Waiter()
    e.set_exception(ValueError("refused"))
    with pytest.raises(ValueError, match="refused"):
        e.wait(None)


def test_a_waiter_answered_from_another_thread_wakes_its_caller(side):
    w = Waiter()
    threading.Timer(0.05, w.set_result, ("receipt",)).start()
    assert w.wait(30) == "receipt"


def test_a_waiter_that_times_out_gives_up_and_a_late_answer_is_harmless(side):
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


@pytest.mark.parametrize("which", SIDES)
def test_both_gates_take_the_same_timeouts(which):
    """The twins agree on every timeout, not only the usual ones: ``timeout=`` by keyword
    (the native one refused it), one beyond the platform's limit (inf, 1e300: the twin
    raised OverflowError, outside the exception tree, where the native one waits without
    limit, so ``send(timeout=float('inf'))`` failed only without the extension) and NaN
    (ValueError, as threading.Lock: the native one waited for ever)."""
    gate_type, _open_all = _impl(which)
    g = gate_type()
    assert g.wait(timeout=0) is False and g.wait(timeout=0.01) is False
    with pytest.raises(TypeError):
        g.wait(0, 0)
    with pytest.raises(TypeError):
        g.wait(when=0)
    with pytest.raises(ValueError):
        g.wait(float("nan"))
    got: list = []
    t = threading.Thread(target=lambda: got.append(g.wait(float("inf"))), daemon=True)
    t.start()
    t2 = threading.Thread(target=lambda: got.append(g.wait(1e300)), daemon=True)
    t2.start()
    g.open()
    t.join(30)
    t2.join(30)
    assert got == [True, True]
    assert g.wait(timeout=float("inf")) is True and g.wait(1e300) is True
    with pytest.raises(ValueError):
        g.wait(float("nan"))  # open or not: the argument is checked first
