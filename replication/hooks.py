"""Entry point the server loads (``qdelay.server.app``): ``install(server, engine, cfg)``."""

from qdelay.replication.node import install

__all__ = ["install"]
