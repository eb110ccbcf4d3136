"""A real ``qdelay server`` whose delivery sink pauses a dispatch round's batch holding a
marked message after the round took its credit and before the batch is spread over the
group's subscribers, until that group has no subscriber left: the moment a consumer's
stream ends between the dispatcher's look at the credit and the hand-over (the batch then
finds nobody). Used by tests/test_consumer_restart.py through ``ServerProc(command=...)``.

Usage: python tests/dropping_server.py server --data-dir ... (qdelay's own arguments)

Environment:
    QDELAY_TEST_DROP_DUE_MS   the batch holding a message due at this time pauses
    QDELAY_TEST_DROP_MARK     a file created once it has paused; the same name with
                              ``.done`` once the batch went on to the registry

The pause ends once the group has no subscriber, or after GATE_MAX_S at the latest (a
test that fails leaves no server stuck).
"""

from __future__ import annotations

import os
import sys
import threading

from qdelay import cli
from qdelay.server.consumers import ConsumerRegistry

GATE_MAX_S = 30.0

_due = int(os.environ["QDELAY_TEST_DROP_DUE_MS"])
_mark = os.environ["QDELAY_TEST_DROP_MARK"]
_fired = False
_deliver = ConsumerRegistry.deliver
_unregister = ConsumerRegistry.unregister
_left = threading.Condition()


def deliver(self, subject, group, deliveries):
    global _fired
    if not _fired and _due in list(deliveries.deliver_at_ms):
        _fired = True
        with open(_mark, "w") as f:
            f.write("paused\n")
        with _left:
            _left.wait_for(lambda: self.consumers(subject, group) == 0, GATE_MAX_S)
        try:
            return _deliver(self, subject, group, deliveries)
        finally:
            with open(_mark + ".done", "w") as f:
                f.write("delivered\n")
    return _deliver(self, subject, group, deliveries)


def unregister(self, sub):
    try:
        return _unregister(self, sub)
    finally:
        with _left:
            _left.notify_all()


ConsumerRegistry.deliver = deliver  # type: ignore[method-assign]
ConsumerRegistry.unregister = unregister  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(cli.main())
