"""A real scheduler process for the SIGKILL crash test (tests/test_scheduler_crash.py).

Usage: python scheduler_child.py DATA_DIR BASE_MS WINDOW_MS COUNT START_INDEX SEED

Opens an Engine (recovering the folder), starts it with a sink that, for each delivery,
prints ``D <seq> <message id> <attempt> <due> <now>`` (flushed) *before* acknowledging
it. Prints ``R <pid>`` once started. Then sends messages ``m<i>`` for i in
[START_INDEX, COUNT) in batches, message i due at BASE_MS + a seeded offset in
[0, WINDOW_MS); after each batch is acknowledged it prints ``S <seq> <i> <due>`` per
message. Every CANCEL_EVERY-th message (i % CANCEL_EVERY == 7) is cancelled right after its batch is
acknowledged; ``C <seq> <outcome> <now>`` is printed once the cancel returned.
Then it runs until killed.

With ``QDELAY_TEST_DIE_AFTER_SCHEDULE_SYNC=K`` the process SIGKILLs itself during its
K-th iterate checkpoint, after the schedule segments were fsynced and before the
checkpoint file is replaced: the crash between schedule flush and checkpoint.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
import threading
import time

from qdelay.segments import checkpoint as checkpoint_mod
from qdelay.server import iterate as iterate_mod
from qdelay.server.config import engine_config
from qdelay.server.engine import Engine, NewMessage

BATCH = 500
CANCEL_EVERY = 250  # a Cancel in a hot minute costs a scan of its segment (~30 ms at 25k records)


def due_offsets(seed: int, count: int, window_ms: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, window_ms) for _ in range(count)]


class _DieAfterSync:
    """Stands in for the checkpoint module inside the iterate service."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.calls = 0

    def write(self, path, state):
        self.calls += 1
        if self.calls >= self.k:
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(10)
        return checkpoint_mod.write(path, state)

    def read(self, path):
        return checkpoint_mod.read(path)


def main() -> None:
    data_dir, base, window, count, start, seed = sys.argv[1], *map(int, sys.argv[2:7])
    die_k = int(os.environ.get("QDELAY_TEST_DIE_AFTER_SCHEDULE_SYNC", "0"))
    if die_k:
        iterate_mod.checkpoint = _DieAfterSync(die_k)
    out = sys.stdout
    out_lock = threading.Lock()

    def emit(lines: list[str]) -> None:
        with out_lock:
            out.write("".join(lines))
            out.flush()

    engine = Engine(
        engine_config(
            data_dir=data_dir,
            cleaner_enabled=False,
            checkpoint_interval_ms=50,
            ack_timeout_ms=60_000,
            segment_bytes=1024 * 1024,
            implicit_group="default",
        )
    )

    class PrintingSink:
        def credit(self, subject: str, group: str = "default") -> int:
            return 1 << 30

        def deliver(self, subject, group, deliveries) -> None:
            now = engine.clock()
            emit(
                [f"D {d.ack_id.split('.')[0]} {d.message_id} {d.attempt} {d.deliver_at_ms} {now}\n" for d in deliveries]
            )
            engine.ack([d.ack_id for d in deliveries])

    engine.set_sink(PrintingSink())
    engine.start()
    emit([f"R {os.getpid()}\n"])
    offsets = due_offsets(seed, count, window)
    loop = asyncio.new_event_loop()
    for k in range(start, count, BATCH):
        idx = range(k, min(count, k + BATCH))
        msgs = [NewMessage("crash", b"%d" % i, {}, f"m{i}", base + offsets[i]) for i in idx]
        receipts = engine.send_sync(msgs)
        emit([f"S {r.sequence} {i} {r.deliver_at_ms}\n" for i, r in zip(idx, receipts)])
        for i, r in zip(idx, receipts):
            if i % CANCEL_EVERY == 7:
                outcome = loop.run_until_complete(engine.cancel(r.message_id, r.deliver_at_ms, r.sequence))
                emit([f"C {r.sequence} {outcome.name} {engine.clock()}\n"])
    emit(["SENT\n"])
    threading.Event().wait()


if __name__ == "__main__":
    main()
