"""A real ``qdelay server`` that ends a Subscribe stream when its client says so, as a
server shutting down ends every stream, while the client may still be writing acks on
it: the moment grpc.aio loses the stream's status (INTERNAL "Internal error from Core":
a write on a stream the server had just ended failed) and a consumer that does not know
it ends. Used by tests/test_consumer_lost_status.py through ``ServerProc(command=...)``.

Ack ids read and dropped (never acknowledged):
    END_ACK     the stream it came on ends at once, with OK (``sub.closed``, what a
                shutdown sets)
    NOISE...    acks that keep the client writing on the stream as it ends

Usage: python tests/ending_server.py server --data-dir ... (qdelay's own arguments)
"""

from __future__ import annotations

import sys

from qdelay import cli
from qdelay.server.service import DelayService

END_ACK = "end-this-stream"
NOISE = "noise-"
_ack = DelayService._ack


def ack(self, sub, ack_ids):
    if END_ACK in ack_ids:
        sub.closed = True  # the handler sends what it holds back and ends the stream
        sub.event.set()
    real = [a for a in ack_ids if a != END_ACK and not a.startswith(NOISE)]
    if real:
        _ack(self, sub, real)


DelayService._ack = ack  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(cli.main())
