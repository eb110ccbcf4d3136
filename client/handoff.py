"""How the blocking client's threads hand work to its private I/O loop and wait for the
answer, at a few microseconds a message.

``send()`` from many threads is a handoff: a thread queues its message for the loop's
batcher and blocks until the loop answers it. A ``concurrent.futures.Future`` per call and
a ``threading.Semaphore`` for the queue's bound cost ~20-30 µs of Python a message between
them (a Condition and its lock made per future, a lock made per wait, ``notify_all`` on
every answer, a Condition per semaphore step on both sides), on the one GIL the loop needs
too. What is here does the same job with one pre-acquired lock per call:

- :class:`Waiter`: the answer of one call. The loop sets it and releases the lock; the
  thread wakes from ``lock.acquire``. A thread that gives up (its timeout, an interrupt)
  marks it so that the loop leaves its message out if it was not cut into a batch yet.
- :class:`Room`: the queue's bound (backpressure): a counter under a plain lock; a thread
  only waits on the Condition when the queue is full, and the loop gives room back once
  per batch, not once per message.
- :class:`Inbox`: one ``call_soon_threadsafe`` per burst of handed-over items.
- :func:`settle_all`: the answers of a batch's callers, then every one of them woken in
  one call of :func:`open_all`, which releases the GIL while it wakes them (the native
  ``qdelay._handoff``). Woken one by one with the GIL held, as ``Lock.release`` does,
  each wake-up is a futex call made while the loop holds the GIL, so every woken thread
  blocks again at once on the GIL (16 callers: ~3.3 voluntary switches a ``send()``);
  with the GIL released the first one woken runs while the loop wakes the rest (~1.6).

The loop owns every answer: only the loop thread calls :meth:`Waiter.set_result`,
:meth:`Waiter.set_exception` and :func:`settle_all`; only the waiting thread calls
:meth:`Waiter.wait`.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import InvalidStateError
from typing import Any

from qdelay.extensions import optional

_allocate_lock = threading.Lock


class PyGate:
    """The Python twin of the native ``qdelay._handoff.Gate``: a one-shot wake-up, made
    closed; :meth:`open` once (again is a no-op), :meth:`wait` until open."""

    __slots__ = ("_lock", "is_open")

    def __init__(self) -> None:
        self._lock = _allocate_lock()
        self._lock.acquire()  # held until open()
        self.is_open = False

    def wait(self, timeout: float | None = None) -> bool:
        """True once open, False after ``timeout`` seconds (None: no limit)."""
        # beyond TIMEOUT_MAX (inf) waits without limit, as the native one (Lock raised
        # OverflowError); NaN stays Lock's ValueError
        if timeout is None or timeout > threading.TIMEOUT_MAX:
            timeout = -1
        elif timeout < 0:
            timeout = 0.0
        if not self._lock.acquire(True, timeout):
            return False
        self._lock.release()  # the gate stays open: a second wait returns True
        return True

    def open(self) -> None:
        if not self.is_open:
            self.is_open = True
            self._lock.release()


def py_open_all(gates: list) -> None:
    """The Python twin of the native ``open_all``: each gate opened, in order (the native
    one does it with the GIL released)."""
    if not isinstance(gates, list):
        raise TypeError("open_all: a list of Gate")
    for i, gate in enumerate(gates):
        if not isinstance(gate, PyGate):
            raise TypeError(f"open_all: item {i} is not a Gate")
    for gate in gates:
        gate.open()


native = optional("qdelay._handoff")
if native is not None:
    Gate: Any = native.Gate
    open_all: Callable[[list], None] = native.open_all
else:  # not built, or QDELAY_NATIVE=0: the twins
    Gate, open_all = PyGate, py_open_all


def twins() -> dict[str, Any]:
    """Every name of ``qdelay._handoff`` and its Python twin (same behaviour)."""
    return {"Gate": PyGate, "open_all": py_open_all}


class WaitTimeout(TimeoutError):
    """:meth:`Waiter.wait`'s timeout passed with no answer (an answer that is itself an error
    is raised as it is)."""


class Waiter:
    """One thread's wait for one answer from the loop (the part of a
    ``concurrent.futures.Future`` the handoff uses: ``done``, ``set_result``,
    ``set_exception``, and :meth:`wait` in place of ``result``).

    The answer is published before the gate opens, and a thread that gives up marks
    ``gave_up`` before it looks at the answer a last time: so either the loop sees the
    mark and leaves the message out, or the thread sees the answer and returns it (the GIL
    orders the two threads' steps)."""

    __slots__ = ("_gate", "_answered", "_value", "_error", "gave_up")

    def __init__(self) -> None:
        self._gate = Gate()  # closed until the answer is in
        self._answered = False
        self._value: Any = None
        self._error: BaseException | None = None
        self.gave_up = False

    def done(self) -> bool:
        """Answered, or its caller gave up (the loop then skips it)."""
        return self._answered or self.gave_up

    def set_result(self, value: Any) -> None:
        """On the loop: the answer (InvalidStateError if it has one)."""
        if self._answered:
            raise InvalidStateError("answered already")
        self._value = value
        self._answered = True
        self._gate.open()

    def set_exception(self, error: BaseException) -> None:
        """On the loop: the caller's error (InvalidStateError if it has an answer)."""
        if self._answered:
            raise InvalidStateError("answered already")
        self._error = error
        self._answered = True
        self._gate.open()

    def settle(self, value: Any) -> Any:
        """On the loop: the answer, the gate left closed; the gate to open (with
        :func:`open_all`, soon after: the thread sleeps until then), or None when it has an
        answer already. A thread that gives up in between sees the answer (see above)."""
        if self._answered:
            return None
        self._value = value
        self._answered = True
        return self._gate

    def wait(self, timeout: float | None) -> Any:
        """In the caller's thread: the answer, or its error; TimeoutError after ``timeout``
        seconds (None: no limit) :class:`WaitTimeout`, after which the loop leaves the message out if it was not
        sent yet. An interrupt (KeyboardInterrupt) gives up the same way."""
        try:
            got = self._gate.wait(timeout)
        except BaseException:
            self.gave_up = True
            raise
        if not got:
            self.gave_up = True
            if not self._answered:  # looked at after the mark: see the class's docstring
                raise WaitTimeout
        if self._error is not None:
            raise self._error
        return self._value


def settle_all(waiters: list[Waiter], values: list) -> None:
    """On the loop: each waiter's answer (those answered already are left as they are),
    then their threads woken in one :func:`open_all` call (see the module's docstring)."""
    gates = []
    for waiter, value in zip(waiters, values):
        gate = waiter.settle(value)
        if gate is not None:
            gates.append(gate)
    if gates:
        open_all(gates)


class Room:
    """At most ``size`` items handed over and not yet taken by the loop: a thread waits in
    :meth:`take` while the queue is full (backpressure, never unbounded memory); the loop
    gives room back with :meth:`give`, once per batch."""

    def __init__(self, size: int) -> None:
        self._free = size
        self._lock = _allocate_lock()
        self._room = threading.Condition(self._lock)
        self._blocked = 0  # threads waiting for room: give() only notifies when there are

    def take(self) -> None:
        """In a caller's thread: one place, waiting while there is none."""
        with self._lock:
            while self._free <= 0:
                self._blocked += 1
                try:
                    self._room.wait()
                finally:
                    self._blocked -= 1
            self._free -= 1

    def give(self, count: int) -> None:
        """On the loop: ``count`` places back (the items were taken or their callers gave up)."""
        if count:
            with self._lock:
                self._free += count
                if self._blocked:
                    self._room.notify(count)

    @property
    def free(self) -> int:
        return self._free


class Inbox:
    """What other threads hand over to one event loop: ``take(items)`` runs on the loop with
    every item handed over since, one ``call_soon_threadsafe`` per burst.

    ``wake_at`` (set on the loop) is how many items waiting here wake the loop: 1 wakes it
    for the first; more lets a loop that is gathering a batch sleep until enough callers
    are back (it pulls what is here with :meth:`drain` whenever it looks anyway). The loop
    sets ``wake_at`` before it looks at ``len()`` a last time and sleeps; a thread appends
    before it reads ``wake_at``: so an item is never left unseen."""

    def __init__(self, take: Callable[[list], None]) -> None:
        self._take = take
        self._items: deque = deque()
        self._scheduled = False
        self.wake_at = 1

    def put(self, loop: asyncio.AbstractEventLoop, item: object) -> None:
        items = self._items
        items.append(item)
        if not self._scheduled and len(items) >= self.wake_at:
            self._scheduled = True
            loop.call_soon_threadsafe(self._pull)

    def drain(self) -> list:
        """On the loop: every item handed over so far (oldest first)."""
        items, inbox = [], self._items
        while inbox:
            items.append(inbox.popleft())
        return items

    def _pull(self) -> None:
        self._scheduled = False  # first: an item appended from now on schedules again
        self._take(self.drain())

    def __len__(self) -> int:
        return len(self._items)
