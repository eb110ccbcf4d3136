"""A message-log appender for the SIGKILL crash test (tests/test_wal_crash.py).

Usage: python wal_child.py DIRECTORY THREADS SEGMENT_BYTES

Opens the log (recovering it), prints ``ready <committed sequence>``, then runs THREADS
appenders forever. Every appender appends batches of 1 to 4 records through group
commit and, only once ``append`` returned (the records are durable), prints one line
``ack <sequence>`` per record, flushing at once. The parent kills it with SIGKILL.
"""

from __future__ import annotations

import os
import random
import sys
import threading

from qdelay.segments.framing import RecordKind
from qdelay.segments.wal import MessageLog


def main() -> None:
    directory, threads, segment_bytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    log = MessageLog(directory, segment_bytes=segment_bytes, flush="sync")
    out = sys.stdout
    out_lock = threading.Lock()
    out.write(f"ready {log.committed_sequence}\n")
    out.flush()

    def appender(seed: int) -> None:
        rng = random.Random(seed)
        while True:
            entries = [
                (RecordKind.MESSAGE, 0, rng.randbytes(rng.randrange(20, 600))) for _ in range(rng.randrange(1, 5))
            ]
            done = log.append(entries)
            lines = "".join(f"ack {done.first_sequence + i}\n" for i in range(done.count))
            with out_lock:
                out.write(lines)
                out.flush()

    for i in range(threads):
        threading.Thread(target=appender, args=(os.getpid() * 100 + i,), daemon=True).start()
    threading.Event().wait()


if __name__ == "__main__":
    main()
