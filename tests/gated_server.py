"""A real ``qdelay server`` whose iterate service pauses inside one step, after it has put
the step's message ids into the id index and before it writes the step's records to
their schedule segments and publishes the step (``IterateService.sequence``): the moment
a by-id lookup finds an id in the index whose message no segment holds yet. Used by
tests/test_by_id_copy.py through ``ServerProc(command=...)``.

Usage: python tests/gated_server.py server --data-dir ... (qdelay's own arguments)

Environment:
    QDELAY_TEST_GATE_DUE_MS   the step that indexes a MESSAGE due at this time pauses
    QDELAY_TEST_GATE_MARK     a file created once it has paused

The pause ends as soon as a reader waits for the step (``IterateService.wait_for`` of a
sequence the service has not published), or after GATE_MAX_S at the latest (a test that
fails leaves no server stuck).
"""

from __future__ import annotations

import os
import sys
import threading

from qdelay import cli
from qdelay.segments.idindex import IdIndex
from qdelay.server.iterate import IterateService

GATE_MAX_S = 60.0

_due = int(os.environ["QDELAY_TEST_GATE_DUE_MS"])
_mark = os.environ["QDELAY_TEST_GATE_MARK"]
_opened = threading.Event()
_fired = False
_put_frames = IdIndex.put_frames
_wait_for = IterateService.wait_for


def put_frames(self, cols_data, starts, dues, seqs, keep_newer=False):
    global _fired
    _put_frames(self, cols_data, starts, dues, seqs, keep_newer)
    if not _fired and not keep_newer and _due in dues.tolist():
        _fired = True
        with open(_mark, "w") as f:
            f.write("paused\n")
        _opened.wait(GATE_MAX_S)


def wait_for(self, sequence, timeout):
    if sequence > self.sequence:
        _opened.set()
    return _wait_for(self, sequence, timeout)


IdIndex.put_frames = put_frames  # type: ignore[method-assign]
IterateService.wait_for = wait_for  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(cli.main())
