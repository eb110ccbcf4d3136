"""The blocking ShardedConsumer's pumps, against stand-in shards (no server, no clock): each
shard's deliveries reach the caller as they arrive. Its pump used to ask each shard's
Consumer for a credit's worth (``max_in_flight``) and so held every smaller batch until the
Consumer's wait ran out (0-200 ms of lateness a delivery). The stand-in Consumer answers a
request it cannot fill only once the test ends, so a pump that asks for more than has come
keeps the caller waiting for its whole timeout, however loaded the machine."""

from __future__ import annotations

import threading

from qdelay.client.sharded import ShardedConsumer
from qdelay.client.types import Delivery


def _delivery(message_id: str) -> Delivery:
    return Delivery(
        message_id=message_id,
        subject="s",
        payload=b"",
        headers={},
        deliver_at_ms=0,
        dispatched_at_ms=0,
        attempt=1,
        ack_id=message_id,
        group="g",
    )


class _Consumer:
    """A shard's Consumer: ``receive(count, timeout)`` gives what has come once ``count``
    deliveries are there, else waits, as the real one does (here until the test ends)."""

    def __init__(self, ended: threading.Event, deliveries: list[Delivery]) -> None:
        self._ended = ended
        self._deliveries = deliveries
        self.acked: list[str] = []

    def receive(self, count: int, timeout: float) -> list[Delivery]:
        if self._deliveries and len(self._deliveries) >= count:
            out, self._deliveries = self._deliveries, []
            return out
        self._ended.wait()
        return []

    def ack(self, ids: list[str]) -> None:
        self.acked.extend(ids)

    def close(self, timeout: float | None = None) -> None:
        self._ended.set()

    def half_close(self) -> None:  # close_consumers' first step; nothing to wait for here
        self._ended.set()


class _Topology:
    def __init__(self, addresses: list[str]) -> None:
        self._addresses = addresses

    def addresses(self) -> list[str]:
        return list(self._addresses)


class _Shards:
    """What ShardedConsumer asks of its ShardedClient: the topology and a client per server."""

    def __init__(self, consumers: dict[str, _Consumer]) -> None:
        self._consumers = consumers
        self.topology = _Topology(list(consumers))

    def refresh(self) -> _Topology:
        return self.topology

    def client(self, address: str) -> _Shards._Client:
        return self._Client(self._consumers[address])

    class _Client:
        def __init__(self, consumer: _Consumer) -> None:
            self._consumer = consumer

        def subscribe(self, subject: str, group: str, max_in_flight: int) -> _Consumer:
            return self._consumer


def test_each_shards_deliveries_reach_the_caller_as_they_arrive():
    ended = threading.Event()
    consumers = {"a:1": _Consumer(ended, [_delivery("m1")]), "b:2": _Consumer(ended, [_delivery("m2")])}
    merged = ShardedConsumer(_Shards(consumers), "s", "g", max_in_flight=1000)  # type: ignore[arg-type]
    try:
        got = merged.receive(2, timeout=10)  # a pump that held them made this wait the full 10 s
        assert sorted(d.message_id for d in got) == ["m1", "m2"]
        merged.ack(got)  # each ack back to its own shard's stream, with that shard's id
        assert (consumers["a:1"].acked, consumers["b:2"].acked) == (["m1"], ["m2"])
    finally:
        merged.close()
        ended.set()
