"""Entry points the server loads (``qdelay.server.app``): ``install(server, engine, cfg)``,
``before_open(cfg)``, run before the engine opens the data folder (a slave's automatic
full resync, replication/autoresync.py), and ``abort_before_open()``, a stop signal while
that runs."""

from qdelay.replication.autoresync import abort as abort_before_open
from qdelay.replication.autoresync import before_open
from qdelay.replication.node import install

__all__ = ["abort_before_open", "before_open", "install"]
