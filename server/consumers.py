"""Subscriptions: the engine's delivery sink, credit-based flow control, batched responses.

Each Subscribe stream is a :class:`Subscription` with a credit window (``max_in_flight``):
deliveries handed to it and not yet acknowledged count against the window. The engine's
dispatcher thread asks :meth:`ConsumerRegistry.credit` how many deliveries of a subject
the subscribers accept, and hands them to :meth:`ConsumerRegistry.deliver`, which spreads
them over the subject's subscribers by free credit (competing consumers) and passes them
to the asyncio loop; the stream packs many deliveries into each SubscribeResponse.

Groups: the engine hands each (subject, group) its own deliveries (every group gets every
message: fan-out); the subscribers of one group compete for them.

An unacknowledged delivery stops counting against its subscriber's window once the
engine's ack timeout has passed (the engine offers it again, possibly elsewhere). What a
subscriber has unacknowledged is kept per slice handed to it (a ``Lease``), not per
delivery: acks that return what a response carried, in order, are matched as stretches of
leases (``server/stretches.py``); each group of a fan-out pays this per batch, not a
dictionary entry per delivery.

Locking: ``credit`` is called by the engine with the engine's lock held, so this
registry never calls into the engine while holding its own lock.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import time
from typing import TYPE_CHECKING

from qdelay import wire
from qdelay.server.stretches import Batch, Stretches

if TYPE_CHECKING:
    from qdelay.server.scheduler import Deliveries

log = logging.getLogger("qdelay.consumers")


class Lease(Batch[str]):
    """The ack ids of one slice of deliveries handed to a subscriber, and when the engine's
    ack timeout passes for them."""

    __slots__ = ("expiry",)

    def __init__(self, ack_ids: list[str], expiry: float) -> None:
        super().__init__(ack_ids)
        self.expiry = expiry


class Subscription:
    __slots__ = (
        "id",
        "subject",
        "group",
        "peer",
        "max_in_flight",
        "out",
        "leases",
        "inbox",
        "event",
        "closed",
        "delivered",
        "acked",
        "expired",
    )

    def __init__(self, sid: int, subject: str, group: str, max_in_flight: int, peer: str) -> None:
        self.id = sid
        self.subject = subject
        self.group = group
        self.peer = peer
        self.max_in_flight = max_in_flight
        # the ack ids handed out and not acknowledged, per lease; the leases in hand-over
        # order, so in expiry order too (every lease with ids out is in it)
        self.out: Stretches[Lease, str] = Stretches()
        self.leases: collections.deque[Lease] = collections.deque()
        self.inbox: collections.deque = collections.deque()  # Deliveries batches, oldest first
        self.event = asyncio.Event()
        self.closed = False
        self.delivered = 0
        self.acked = 0
        self.expired = 0

    def available(self, now: float) -> int:
        """Free credit (lock held): drops deliveries whose ack timeout has passed."""
        leases = self.leases
        while leases:
            lease = leases[0]
            if lease.left and lease.expiry > now:
                break
            leases.popleft()
            if lease.left:
                self.expired += len(self.out.expire(lease))
        return self.max_in_flight - self.out.live

    def unacknowledged(self) -> int:
        return self.out.live

    def hand_over(self, ack_ids: list[str], expiry: float) -> None:
        """Count deliveries handed to this subscriber against its window (lock held)."""
        if ack_ids:
            lease = Lease(ack_ids, expiry)
            self.out.add(lease)
            self.leases.append(lease)

    def forget(self) -> list[str]:
        """Every ack id still out, in hand-over order; none is out afterwards (lock held)."""
        left = [q for lease in self.leases for q in lease.live_keys()]
        self.out = Stretches()
        self.leases.clear()
        return left

    def push(self, deliveries) -> None:
        """On the loop thread: queue a batch of deliveries (``scheduler.Deliveries``) for
        the stream to write; kept whole, the stream reads its columns."""
        self.inbox.append(deliveries)
        self.event.set()


class ConsumerRegistry:
    """Implements the engine's ``DeliverySink``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, ack_timeout_ms: int, notify=None, release=None) -> None:
        self.loop = loop
        self.ack_timeout_s = ack_timeout_ms / 1000.0
        self.notify = notify or (lambda: None)  # engine.notify_credit
        # engine.post_release: a batch that found no subscriber is offered again at once
        self.release = release or (lambda ack_ids, subject, group: None)
        self._lock = threading.Lock()
        self._by_subject: dict[tuple[str, str], list[Subscription]] = {}  # (subject, group)
        self._ids = itertools.count(1)
        self._rr = 0
        # slices handed over and not yet pushed to their streams, in hand-over order, and
        # whether the loop has been asked to push them (``_to_streams``)
        self._outbox: list[tuple[Subscription, Deliveries]] = []
        self._outbox_asked = False
        self.paused = False
        self.dropped = 0  # deliveries that found no subscriber (given back to the engine at once)

    # --- streams ----------------------------------------------------------------------------------
    def register(self, subject: str, group: str, max_in_flight: int, peer: str = "") -> Subscription:
        sub = Subscription(next(self._ids), subject, group, max_in_flight, peer)
        with self._lock:
            self._by_subject.setdefault((subject, group), []).append(sub)
        log.info(
            "subscribed",
            extra={
                "subject": subject,
                "group": group,
                "peer": peer,
                "max_in_flight": max_in_flight,
                "subscription": sub.id,
            },
        )
        self.notify()
        return sub

    def unregister(self, sub: Subscription) -> list[str]:
        """Remove a stream; returns the ack ids it left unacknowledged."""
        with self._lock:
            subs = self._by_subject.get((sub.subject, sub.group), [])
            if sub in subs:
                subs.remove(sub)
            if not subs:
                self._by_subject.pop((sub.subject, sub.group), None)
            left = sub.forget()
            sub.closed = True
        sub.event.set()
        log.info(
            "unsubscribed",
            extra={
                "subject": sub.subject,
                "group": sub.group,
                "peer": sub.peer,
                "subscription": sub.id,
                "delivered": sub.delivered,
                "acked": sub.acked,
                "unacked": len(left),
            },
        )
        return left

    def set_window(self, sub: Subscription, max_in_flight: int) -> None:
        with self._lock:
            sub.max_in_flight = max_in_flight
        self.notify()

    def acked(self, sub: Subscription, ack_ids) -> None:
        """Forget acknowledged deliveries of ``sub`` (frees its credit)."""
        with self._lock:
            sub.out.take(ack_ids)
            sub.acked += len(ack_ids)

    def subscriptions(self) -> list[Subscription]:
        with self._lock:
            return [s for subs in self._by_subject.values() for s in subs]

    def outstanding(self) -> int:
        with self._lock:
            now = time.monotonic()
            total = 0
            for subs in self._by_subject.values():
                for s in subs:
                    s.available(now)
                    total += s.unacknowledged()
            return total

    def pause(self) -> None:
        """Shutting down: hand out nothing more (credit 0)."""
        self.paused = True

    def close_all(self) -> None:
        for sub in self.subscriptions():
            sub.closed = True
            self.loop.call_soon_threadsafe(sub.event.set)

    # --- DeliverySink (dispatcher thread) -----------------------------------------------------------
    def consumers(self, subject: str, group: str) -> int:
        with self._lock:
            return len(self._by_subject.get((subject, group), ()))

    def credit(self, subject: str, group: str) -> int:
        if self.paused:
            return 0
        with self._lock:
            subs = self._by_subject.get((subject, group))
            if not subs:
                return 0
            now = time.monotonic()
            total = 0
            for s in subs:
                free = s.available(now)
                if free > 0:
                    total += free
            return total

    def deliver(self, subject: str, group: str, deliveries) -> None:
        """Spread a ``scheduler.Deliveries`` batch over the group's subscribers (a slice
        of it each, by free credit) and pass the slices to the loop thread.

        The slices go to an outbox that the loop empties in one callback; the loop is asked
        only when no callback is pending already. A dispatch round hands out a batch per
        group (fan-out) and per subject: one ``call_soon_threadsafe`` per batch woke the
        loop (a write to its self-pipe, a turn of the loop) once per group per round."""
        plan: list[tuple[Subscription, Deliveries]] = []
        with self._lock:
            subs = self._by_subject.get((subject, group))
            found = bool(subs)  # (the list changes in place: read once, under the lock)
            if subs:
                now = time.monotonic()
                expiry = now + self.ack_timeout_s
                if len(subs) == 1:
                    # the one subscriber takes the whole batch as it is (what the spread gives
                    # it too, in one or two slices), without the spread's lists: paid per
                    # batch per group of a fan-out
                    sub = subs[0]
                    sub.available(now)  # (drops leases whose ack timeout passed, as the spread does)
                    plan.append((sub, deliveries))
                else:
                    self._spread(subs, deliveries, now, plan)
                for sub, part in plan:
                    sub.hand_over(part.ack_ids, expiry)
                    sub.delivered += len(part)
                if not plan:
                    return
                self._outbox += plan
                if self._outbox_asked:
                    return  # the pending callback pushes these too
                self._outbox_asked = True
            else:
                self.dropped += len(deliveries)
        if found:
            self.loop.call_soon_threadsafe(self._to_streams)
            return
        # the group's last stream ended after the dispatcher took its credit: the batch is in
        # flight in the ack ledger all the same. Given back now, outside the lock (as a
        # stream's leftovers are); it waited for the ack timeout (30 s by default) before
        # anyone could have it
        self.release(list(deliveries.ack_ids), subject, group)

    def _to_streams(self) -> None:
        """On the loop thread: push the slices handed over since the last call to their
        streams, in hand-over order."""
        with self._lock:
            out, self._outbox = self._outbox, []
            self._outbox_asked = False
        for sub, part in out:
            sub.push(part)

    def _spread(self, subs: list[Subscription], deliveries, now: float, plan: list) -> None:
        """Plan the slices of a batch for several subscribers of a group (lock held)."""
        n = len(subs)
        start = self._rr % n
        self._rr += 1
        order = subs[start:] + subs[:start]
        free = [max(0, s.available(now)) for s in order]
        pos = 0
        remaining = len(deliveries)
        # spread evenly by free credit: each round gives every subscriber with credit an equal share
        while remaining > 0:
            takers = [i for i in range(n) if free[i] > 0]
            if not takers:
                break
            share = -(-remaining // len(takers))
            for i in takers:
                k = min(share, free[i], remaining)
                if k <= 0:
                    continue
                # a subscriber taking the whole batch takes it as it is (no copies)
                whole = pos == 0 and k == len(deliveries)
                plan.append((order[i], deliveries if whole else deliveries[pos : pos + k]))
                free[i] -= k
                pos += k
                remaining -= k
        if remaining > 0:
            # credit shrank since the dispatcher asked (a window change): the least loaded
            # subscriber takes the rest rather than letting them wait for the ack timeout
            target = min(order, key=lambda s: s.unacknowledged())
            plan.append((target, deliveries[pos:]))


def take_for_response(inbox: collections.deque, max_n: int, max_bytes: int) -> list:
    """Pop up to ``max_n`` deliveries from an inbox of ``Deliveries`` batches, stopping once
    ``max_bytes`` (payload + 64 per delivery) is reached (at least one delivery is taken;
    the last may overshoot, as one delivery cannot be split). A batch taken in part leaves
    the rest at the head of the inbox. Returns the batches (or parts) taken, in order."""
    taken: list = []
    count = 0
    size = 0
    while inbox and count < max_n and (size < max_bytes or not count):
        batch = inbox[0]
        if not len(batch):
            inbox.popleft()
            continue
        k = min(len(batch), max_n - count)
        sizes = list(map(len, batch.payloads[:k]))
        total = sum(sizes) + 64 * k
        if size + total - sizes[-1] - 64 >= max_bytes and k > 1:
            # the byte limit falls inside this batch: count deliveries up to it
            j = 0
            while j < k and (size < max_bytes or not count):
                size += sizes[j] + 64
                count += 1
                j += 1
            k = j
        else:
            size += total
            count += k
        if k >= len(batch):
            taken.append(inbox.popleft())
        else:
            taken.append(batch[:k])
            inbox[0] = batch[k:]
    return taken


def response_bytes(batches: list) -> tuple[bytes, int, list[int]]:
    """A SubscribeResponse carrying the deliveries of ``batches``, serialized (Subscribe is
    registered to yield bytes): encoded by the native wire codec straight from the batches'
    columns (or by its Python twin, protobuf's serializer). Returns (bytes, how many, the
    due times of the first attempts among them)."""
    codec = wire.native
    encode = codec.encode_deliveries if codec is not None else wire.encode_deliveries_py
    out = bytearray()
    count = 0
    firsts: list[int] = []
    for b in batches:
        count += encode(
            out,
            b.subject,
            b.ack_ids,
            b.message_id_bytes,
            b.payloads,
            b.headers,
            b.deliver_at_ms,
            b.dispatched_at_ms,
            b.attempts,
        )
        if 1 in b.attempts:
            firsts += [due for due, attempt in zip(b.deliver_at_ms, b.attempts) if attempt == 1]
    return bytes(out), count, firsts
