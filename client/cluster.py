"""A client for a replicated qdelay cluster: a list of servers, follows the master.

    from qdelay.client.cluster import ClusterClient
    with ClusterClient(["10.0.0.1:7600", "10.0.0.2:7600"], token=...) as c:
        c.send("order.close", b"42", delay_ms=60_000)

Writes go to the current master. A write refused with FAILED_PRECONDITION (the server is a
slave, or a fenced master), UNAVAILABLE (unreachable, shutting down, sync replication
timed out), or ended by a server shutting down (a lost status, CANCELLED: ``failover.retryable``)
is retried on the master found next (else the next server), with backoff, until ``failover_timeout``
seconds passed. Every message gets its ``message_id`` on the client before the first try,
so a retry of a write whose first try did land carries the same id: the consumer may see
one id twice (at-least-once), never two different ids for one send.

Every other call (send_many, get, cancel, cancel_many, reschedule, reschedule_many, the
groups) follows the same rule: it goes to the master. Receipts are ``Receipt`` objects, as
the other clients'. ``subscribe_all`` creates the group on the master, then opens one Subscribe stream per
server: only the master dispatches, so after a promotion deliveries simply start flowing
from the new master's stream (a slave's refusal before the group reached it is waited out).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from qdelay import errors
from qdelay.addresses import check_target
from qdelay.client.client import Client, Consumer, Outgoing, _Ids
from qdelay.client.failover import Backoff, cancel_tries, consumers_everywhere, retryable
from qdelay.client.sharded import SEND_MANY_CHUNK, Joined, _chunks, _with_id, resumed
from qdelay.client.types import Receipt, Status, Target
from qdelay.v1 import qdelay_pb2 as pb


class ClusterClient:
    def __init__(
        self,
        targets: Sequence[str] | str,
        *,
        failover_timeout: float = 30.0,
        backoff: float = 0.05,
        max_backoff: float = 1.0,
        timeout: float = 10.0,
        **client_kw: Any,
    ) -> None:
        if isinstance(targets, str):
            targets = [t.strip() for t in targets.split(",") if t.strip()]
        if not targets:
            raise errors.InvalidArgument("ClusterClient needs at least one server")
        # all before any channel is made: one bad address must not leave the others' open
        self.targets = [check_target(t, "a server address") for t in targets]
        self.clients = [Client(t, retries=0, timeout=timeout, **client_kw) for t in self.targets]
        self.failover_timeout = failover_timeout
        self.backoff = backoff
        self.max_backoff = max_backoff
        self._current = 0
        self._lock = threading.Lock()
        self._ids = _Ids()
        self.failovers = 0  # how many times writes moved to another server
        self.retries = 0  # writes repeated (same message ids)
        self.epoch = 0
        self._executor: ThreadPoolExecutor | None = None
        self.closed = False  # set by close(): every call refuses, nothing is retried

    def _open(self) -> None:
        """FailedPrecondition once closed: its clients' own refusal would be retried as a
        slave's, for the whole failover_timeout."""
        if self.closed:
            raise errors.FailedPrecondition("the client is closed")

    # --- plumbing --------------------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            self.closed = True
            pool, self._executor = self._executor, None
        if pool is not None:
            pool.shutdown(wait=True)
        for c in self.clients:
            c.close()

    def _each_server(self, fn: Callable[[Client], object]) -> list:
        """``fn(client)`` for every server at the same time (stats, finding the master): a
        call waits for the slowest server once, not for each in turn (a server that does not
        answer costs its timeout once per call, not once per server behind it)."""
        self._open()
        if len(self.clients) == 1:
            return [fn(self.clients[0])]
        with self._lock:
            self._open()  # a pool made again after close() would be one nobody shuts down
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max_workers=min(16, len(self.clients)), thread_name_prefix="qdelay-cluster"
                )
            pool = self._executor
        return list(pool.map(fn, self.clients))

    def __enter__(self) -> ClusterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def current(self) -> str:
        return self.targets[self._current]

    def find_master(self, timeout: float = 2.0) -> int | None:
        """Index of the server that says it is master with the highest epoch (None: none)."""

        def one(c: Client) -> dict | None:
            try:
                return c.stats(timeout=timeout)
            except errors.QdelayError:
                return None

        best = None
        for i, s in enumerate(self._each_server(one)):
            if s is not None and s["role"] == "master" and (best is None or s["epoch"] > best[1]):
                best = (i, s["epoch"])
        if best is not None:
            self.epoch = max(self.epoch, best[1])
            return best[0]
        return None

    def _retry(self, call):
        backoff = Backoff(self.failover_timeout, self.backoff, self.max_backoff)
        while True:
            with self._lock:
                self._open()
                i = self._current
            try:
                return call(self.clients[i])
            except errors.QdelayError as err:
                if self.closed or not retryable(err) or backoff.expired():
                    raise err
                self.retries += 1
                found = self.find_master()
                with self._lock:
                    if found is not None and found != self._current:
                        self._current = found
                        self.failovers += 1
                    elif found is None:
                        self._current = (i + 1) % len(self.clients)
                time.sleep(backoff.next_wait())

    # --- API ----------------------------------------------------------------------------------------
    def message(self, subject: str, payload: bytes = b"", **kw: Any) -> pb.Message:
        msg = self.clients[0].message(subject, payload, **kw)
        if not msg.message_id:
            msg.message_id = self._ids()
        return msg

    def send(self, subject: str, payload: bytes = b"", *, timeout: float | None = None, **kw: Any) -> Receipt:
        """As ``Client.send`` (one unary Send), on the master; the id is made before the first try."""
        msg = self.message(subject, payload, **kw)
        request = pb.SendRequest(message=msg)
        return self._retry(lambda c: Receipt.from_pb(c._call(c.stub.Send, request, timeout).receipt))

    def send_batch(self, messages: Iterable[pb.Message], timeout: float | None = None) -> list[Receipt]:
        """One SendBatch on the master (all or nothing), tried again with the same ids."""
        msgs = list(messages)
        for m in msgs:
            if not m.message_id:
                m.message_id = self._ids()
        return self._retry(lambda c: c.send_batch(msgs, timeout))

    def send_many(
        self,
        messages: Iterable[pb.Message | Outgoing],
        batch_size: int = 1000,
        max_in_flight: int = 4,
        timeout: float | None = None,
    ) -> Sequence[Receipt]:
        """As ``Client.send_many`` (pipelined SendStream batches; ``Outgoing`` tuples are the
        cheap form), on the master; receipts in input order. The messages are read
        ``SEND_MANY_CHUNK`` at a time (held until acknowledged: a stream that fails over is
        sent again on the new master with what it had not acknowledged, same ids). An error
        carries ``.receipts``, those of every message acknowledged before it."""
        if batch_size < 1 or max_in_flight < 1:
            raise errors.InvalidArgument("batch_size and max_in_flight must be at least 1")
        out = Joined()
        for chunk in _chunks(messages, max(SEND_MANY_CHUNK, batch_size * max_in_flight)):
            msgs = [_with_id(m, self._ids) for m in chunk]
            try:
                self._retry(resumed(msgs, out, lambda c, rest: c.send_many(rest, batch_size, max_in_flight, timeout)))
            except errors.QdelayError as err:
                # every message acknowledged before it, from the first (the failed try's own
                # receipts are of the chunk's rest only), as Client.send_many's error
                err.receipts = out
                raise
        return out

    def cancel(
        self, receipt: Target | None = None, timeout: float | None = None, *, message_id: str | None = None
    ) -> str:
        """As ``Client.cancel`` (a receipt, its text, an id, or ``message_id=``), on the master;
        tried again after a failure whose outcome is unknown, ALREADY_CANCELLED is answered
        CANCELLED (``failover.cancel_tries``)."""
        return self._retry(cancel_tries(lambda c: c.cancel(receipt, timeout, message_id=message_id)))

    def cancel_many(self, targets: Iterable[Target], timeout: float | None = None, batch_size: int = 1000) -> list[str]:
        """As ``Client.cancel_many``, on the master. A call that fails over is made again on
        the new master; after a try whose outcome is unknown, ALREADY_CANCELLED (maybe that
        try's work) is answered CANCELLED (``failover.cancel_tries``)."""
        items = list(targets)
        return self._retry(cancel_tries(lambda c: c.cancel_many(items, timeout, batch_size)))

    def get(
        self, receipt: Target | None = None, timeout: float | None = None, *, message_id: str | None = None
    ) -> Status:
        """As ``Client.get``, on the master."""
        return self._retry(lambda c: c.get(receipt, timeout, message_id=message_id))

    def reschedule(self, target: Target, **kw: Any) -> tuple[str, Receipt | None]:
        """As ``Client.reschedule`` (``delay=``, ``deliver_at=``, ...), on the master."""
        return self._retry(lambda c: c.reschedule(target, **kw))

    def reschedule_many(
        self, targets: Iterable[Target], *, batch_size: int = 1000, **kw: Any
    ) -> list[tuple[str, Receipt | None]]:
        """As ``Client.reschedule_many``, on the master. A call that fails over is made again
        on the new master (a target the lost try moved then answers CANCELLED by receipt, or is
        moved again by id)."""
        items = list(targets)
        return self._retry(lambda c: c.reschedule_many(items, batch_size=batch_size, **kw))

    def create_group(self, subject: str, group: str, timeout: float | None = None) -> bool:
        """As ``Client.create_group``, on the master (groups are replicated)."""
        return self._retry(lambda c: c.create_group(subject, group, timeout))

    def delete_group(self, subject: str, group: str, timeout: float | None = None) -> bool:
        """As ``Client.delete_group``, on the master."""
        return self._retry(lambda c: c.delete_group(subject, group, timeout))

    def groups(self, timeout: float | None = None, *, subject: str = "", group: str = "") -> list[dict]:
        """As ``Client.groups``, from the master (only it dispatches: its consumers and backlog)."""
        return self._retry(lambda c: c.groups(timeout, subject=subject, group=group))

    def stats(self, timeout: float | None = 2.0, *, subject: str = "", group: str = "") -> dict[str, dict | str]:
        """Every server's stats (or its error), by address, the servers asked at the same
        time; ``subject``/``group`` narrow the groups as ``Client.stats`` does."""

        def one(c: Client) -> dict | str:
            try:
                return c.stats(timeout, subject=subject, group=group)
            except errors.QdelayError as e:
                return str(e)

        return dict(zip(self.targets, self._each_server(one)))

    def subscribe_all(self, subject: str, group: str = "default", max_in_flight: int = 1000) -> list[Consumer]:
        """One consumer per server (only the master delivers). The group is created on the
        master first (a slave refuses a Subscribe that would create it); a slave's consumer
        subscribes again with backoff while it refuses (FAILED_PRECONDITION: the GROUP record
        has not reached it yet), as the sharded consumer does. Other errors end a consumer."""
        self._open()
        self.create_group(subject, group)
        return consumers_everywhere(self.clients, subject, group, max_in_flight)
