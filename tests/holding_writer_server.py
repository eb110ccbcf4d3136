"""A real ``qdelay server`` whose message-log writer holds the commit of a message with a
marked payload until a batch with a second mark has been queued behind it: the batches
queued in between are then made durable by one group commit, their answers ready at the
same moment (what merged SendStream answers are for). Used by tests/test_merged_answers.py
through ``ServerProc(command=...)``.

Usage: python tests/holding_writer_server.py server --data-dir ... (qdelay's own arguments)

A hold ends after HOLD_MAX_S at the latest (a test that fails leaves no server stuck).
QDELAY_TEST_PACKS_FILE and QDELAY_TEST_OLD_SERVER: see below.
"""

from __future__ import annotations

import os
import sys
import threading

from qdelay import cli, wire
from qdelay.segments.segment import Segment
from qdelay.segments.wal import MessageLog

HOLD = b"hold-the-commit"  # the commit writing this payload waits...
RELEASE = b"release-the-commit"  # ...until a batch with this one is queued
HOLD_MAX_S = 30.0

_queued = threading.Event()
_append_synced = Segment.append_synced
_append_bodies_then = MessageLog.append_bodies_then


def append_synced(self, chunks):
    if any(HOLD in bytes(chunk) for chunk in chunks):
        _queued.wait(HOLD_MAX_S)
    return _append_synced(self, chunks)


def append_bodies_then(self, kind, timestamp, bodies, done, queued=None):
    appended = _append_bodies_then(self, kind, timestamp, bodies, done, queued)
    if any(RELEASE in body for body in bodies):
        _queued.set()  # after the append: every batch before it is queued too
    return appended


Segment.append_synced = append_synced  # type: ignore[method-assign]
MessageLog.append_bodies_then = append_bodies_then  # type: ignore[method-assign]

# QDELAY_TEST_PACKS_FILE: a line with the number of batches of each packed request read
_packs_file = os.environ.get("QDELAY_TEST_PACKS_FILE")
_unpack = wire.unpack_send_batch_requests
if _packs_file:

    def unpack(raw):
        requests = _unpack(raw)
        if requests is not None:
            with open(_packs_file, "a") as f:
                f.write(f"{len(requests)}\n")
        return requests

    wire.unpack_send_batch_requests = unpack
# QDELAY_TEST_OLD_SERVER=1: the server does not say it takes packed requests (as one from
# before them), though it merges answers
if os.environ.get("QDELAY_TEST_OLD_SERVER") == "1":
    wire.PACKED_REQUESTS = ("qdelay-test-not-announced", "1")

if __name__ == "__main__":
    sys.exit(cli.main())
