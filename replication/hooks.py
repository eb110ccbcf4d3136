"""Entry points the server loads (``qdelay.server.app``): ``install(server, engine, cfg)``,
and ``before_open(cfg)``, run before the engine opens the data folder (a slave's automatic
full resync, replication/autoresync.py)."""

from qdelay.replication.autoresync import before_open
from qdelay.replication.node import install

__all__ = ["before_open", "install"]
