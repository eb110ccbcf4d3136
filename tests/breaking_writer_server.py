"""A real ``qdelay server`` whose message-log writer meets a bug (not an I/O error) in the
commit that writes a message with a marked payload: the moment a writer thread that died
left every Send waiting for its deadline, health SERVING (a codec built from older source
raised AttributeError there). Used by tests/test_wal_writer_failure.py through
``ServerProc(command=...)``.

Usage: python tests/breaking_writer_server.py server --data-dir ... (qdelay's own arguments)
"""

from __future__ import annotations

import sys

from qdelay import cli
from qdelay.segments.segment import Segment

MARK = b"break-the-writer"
_append_synced = Segment.append_synced


def append_synced(self, chunks):
    if any(MARK in bytes(chunk) for chunk in chunks):
        raise AttributeError("module 'qdelay.segments._codec' has no attribute 'write_sync'")
    return _append_synced(self, chunks)


Segment.append_synced = append_synced  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(cli.main())
