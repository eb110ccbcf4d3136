"""The master's holds for its slaves, on disk: ``checkpoint/slave_holds.ckpt``.

A master keeps its message log from the offset each slave confirmed, for attached slaves
and for detached ones during ``slave_hold_ms`` (replication/master.py, ``Hub.floor``).
Kept in memory only, a hold ended with the process: a master restarted while a slave was
away held nothing for it, its cleaner deleted what the slave needed, and the slave came
back to a full resync. This file keeps the holds across a restart.

The file is a checkpoint file (segments/checkpoint.py: one CHECKPOINT frame whose body is
JSON, written to a temporary file, fsynced, renamed, directory fsynced), its JSON object:

    {"slaves": {NAME: {"offset": int, "seen_ms": int}, ...}}

``offset``: the message-log offset the slave confirmed durable (the hold: the cleaner
keeps the segment holding the record that ends there, and every later one); ``seen_ms``:
when the master last heard from it (wall clock, ms; the time of the save for an attached
slave), from which its hold's age is counted across restarts. Holds past their age limit
(or byte limit) are left out of the file.

Written by the event loop's saver (``Hub.keep_saved``, at most once a second and only
after a change, at least once a minute while a slave is attached) on a worker thread, and
at once, before the slave is served, when a hold is added or lowered (a slave attaching
behind its saved offset, a resync's snapshot): a save that comes a second late can only
leave a *lower* offset on disk (more kept), never a higher one. An unreadable file is not
fatal: the master starts with no holds and logs it (docs/recovery.md, row 16).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

from qdelay.errors import CorruptRecord
from qdelay.segments import checkpoint, naming

log = logging.getLogger("qdelay.replication")

FILE_NAME = "slave_holds.ckpt"


@dataclass(frozen=True, slots=True)
class Hold:
    offset: int
    seen_ms: int


def path_in(data_dir: str) -> str:
    return os.path.join(data_dir, naming.CHECKPOINT_DIR, FILE_NAME)


class HoldFile:
    """Reads and replaces ``checkpoint/slave_holds.ckpt``; one writer at a time."""

    def __init__(self, data_dir: str) -> None:
        self.path = path_in(data_dir)
        self._lock = threading.Lock()
        self.saves = 0
        # what the saves took, wall (fsyncs included) and CPU (the saving thread's own):
        # metrics qdelay_replication_holds_save_seconds / _cpu_seconds, bench.replication
        self.save_seconds = 0.0
        self.save_cpu_seconds = 0.0

    def load(self) -> tuple[dict[str, Hold], str]:
        """(holds, note): the saved holds; a note (and no holds) when the file is unreadable."""
        try:
            state = checkpoint.read(self.path)
        except (CorruptRecord, OSError) as err:
            return {}, f"slave holds file unreadable ({err}); no slave is held until it reconnects"
        if state is None:
            return {}, ""
        try:
            slaves = state.get("slaves", {})
            holds = {str(name): Hold(int(h["offset"]), int(h["seen_ms"])) for name, h in slaves.items()}
        except (AttributeError, KeyError, TypeError, ValueError) as err:
            note = f"slave holds file {self.path} has a malformed entry ({err!r})"
            return {}, f"{note}; no slave is held until it reconnects"
        return holds, ""

    def save(self, holds_now, on_saved=None) -> None:
        """Replace the file with ``holds_now()`` (called under the writer's lock, so that of
        two saves the later one on disk is also the later state); ``on_saved(holds)`` once
        they are on disk, under the lock too. An OSError (a full disk) leaves the old file."""
        with self._lock:
            t0, c0 = time.perf_counter(), time.thread_time()
            holds: dict[str, Hold] = holds_now()
            checkpoint.write(
                self.path, {"slaves": {n: {"offset": h.offset, "seen_ms": h.seen_ms} for n, h in sorted(holds.items())}}
            )
            self.saves += 1
            self.save_seconds += time.perf_counter() - t0
            self.save_cpu_seconds += time.thread_time() - c0
            if on_saved is not None:
                on_saved(holds)
