"""A simulated clock, collecting sinks and a driver for deterministic engine tests.

The engine is built with ``clock=FakeClock(...)`` and never ``start()``-ed: the test
moves time and runs the pipeline by hand (``Driver.run``): the iterate service copies
what the message log holds, then the scheduler makes one pass (load, fire, expire,
dispatch, write dispatch records) at the simulated ``now``. Only the message log's
writer thread runs by itself.
"""

from __future__ import annotations

import asyncio
import os
import threading
from dataclasses import dataclass, field

from qdelay.server.config import engine_config
from qdelay.server.engine import Engine, EngineConfig, NewMessage

MINUTE = 60_000
# a round minute, so that "the same minute" and "the next minute" are easy to aim at
T0 = 1_700_000_040_000 - 1_700_000_040_000 % MINUTE


class FakeClock:
    """Epoch milliseconds that move only when the test says so."""

    def __init__(self, now_ms: int = T0) -> None:
        self.now = now_ms
        self._lock = threading.Lock()

    def __call__(self) -> int:
        return self.now

    def advance(self, ms: int) -> int:
        with self._lock:
            self.now += ms
            return self.now

    def set(self, now_ms: int) -> None:
        with self._lock:
            if now_ms < self.now:
                raise ValueError("the simulated clock never goes back")
            self.now = now_ms


@dataclass
class Seen:
    """One delivery as the sink saw it, with the simulated time it arrived."""

    subject: str
    message_id: str
    ack_id: str
    attempt: int
    due: int
    at: int
    headers: dict = field(default_factory=dict)
    payload: bytes = b""
    batch: int = 0


class CollectingSink:
    """Accepts everything (or ``credit`` per subject) and remembers every delivery."""

    def __init__(
        self,
        clock=None,
        credit: int = 1 << 30,
        per_subject: dict[str, int] | None = None,
        auto_ack: Engine | None = None,
    ) -> None:
        self.clock = clock
        self.default_credit = credit
        self.per_subject = dict(per_subject or {})
        self.auto_ack = auto_ack
        self.seen: list[Seen] = []
        self.batches: list[tuple[str, int]] = []  # (subject, size) in call order
        self.lock = threading.Lock()

    def credit(self, subject: str, group: str = "default") -> int:
        return self.per_subject.get(subject, self.default_credit)

    def deliver(self, subject: str, group: str, deliveries) -> None:
        now = self.clock() if self.clock is not None else deliveries[0].dispatched_at_ms
        with self.lock:
            n = len(self.batches)
            self.batches.append((subject, len(deliveries)))
            for d in deliveries:
                assert d.subject == subject, (d.subject, subject)
                self.seen.append(
                    Seen(
                        subject,
                        d.message_id,
                        d.ack_id,
                        d.attempt,
                        d.deliver_at_ms,
                        now,
                        dict(d.headers),
                        bytes(d.payload),
                        n,
                    )
                )
        if self.auto_ack is not None:
            self.auto_ack.ack([d.ack_id for d in deliveries])

    def take(self) -> list[Seen]:
        """The deliveries seen since the last call."""
        with self.lock:
            out, self.seen = self.seen, []
        return out

    def ids(self) -> list[str]:
        return [s.message_id for s in self.seen]


def message(subject: str, due: int, mid: str, payload: bytes = b"p", headers: dict | None = None) -> NewMessage:
    return NewMessage(subject, payload, dict(headers or {}), mid, due)


def config(data_dir: str, **kw) -> EngineConfig:
    kw.setdefault("cleaner_enabled", False)
    kw.setdefault("flush", "sync")
    kw.setdefault("implicit_group", "default")  # in-process sinks take every subject's messages
    return engine_config(data_dir=str(data_dir), **kw)


class Driver:
    """Opens, drives and reopens an engine on one folder with one simulated clock."""

    def __init__(self, data_dir, clock: FakeClock | None = None, sink=None, **cfg) -> None:
        self.data_dir = str(data_dir)
        self.clock = clock or FakeClock()
        self.cfg = cfg
        self.sink = sink
        self.engine: Engine | None = None
        self.open()

    def open(self) -> Engine:
        self.engine = Engine(config(self.data_dir, **self.cfg), clock=self.clock)
        self.engine.scheduler.prime(self.clock())
        if self.sink is not None:
            self.engine.set_sink(self.sink)
        return self.engine

    def close(self) -> None:
        if self.engine is not None:
            self.catch_up()
            self.engine.close()
            self.engine = None

    def restart(self) -> Engine:
        self.close()
        return self.open()

    def catch_up(self) -> None:
        """Let the iterate service copy everything committed to the schedule log."""
        while self.engine.iterate.step():
            pass

    def run(self, now: int | None = None, passes: int = 1) -> None:
        if now is not None:
            self.clock.set(now)
        for _ in range(passes):
            self.catch_up()
            self.engine.scheduler.run_once(self.clock())

    def advance(self, ms: int, passes: int = 1) -> None:
        self.run(self.clock.now + ms, passes)

    def send(self, msgs) -> list:
        return self.engine.send_sync(list(msgs), timeout=30)

    def cancel(self, receipt):
        # Cancel and Get wait for the iterate service to pass the sequence; it is not
        # running in a driven engine, so copy what is committed first
        self.catch_up()
        return asyncio.run(self.engine.cancel(receipt.message_id, receipt.deliver_at_ms, receipt.sequence))

    def get(self, receipt):
        self.catch_up()
        return self.engine.get_sync(receipt.message_id, receipt.deliver_at_ms, receipt.sequence)


def files(root: str, sub: str, suffix: str) -> list[str]:
    out = []
    for dirpath, _dirs, names in os.walk(os.path.join(str(root), sub)):
        out.extend(os.path.join(dirpath, n) for n in names if n.endswith(suffix))
    return sorted(out)


def started_engine(data_dir) -> tuple[Engine, CollectingSink]:
    """A started engine on ``data_dir`` (config's defaults) whose deliveries are collected;
    the caller closes it."""
    engine = Engine(config(data_dir))
    sink = CollectingSink()
    engine.set_sink(sink)
    engine.start()
    return engine, sink
