"""The ``qdelay`` command: ``server``, ``inspect``, ``spark`` and ``admin`` subcommands.

Each subcommand's module registers its own arguments; they are imported only when used,
so ``qdelay inspect`` never loads gRPC and ``qdelay server`` never loads Spark.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import MutableMapping

# subcommand -> module with add_arguments(parser) and run(args) -> int
SUBCOMMANDS = {
    "server": ("qdelay.server.main", "run a qdelay server"),
    "inspect": ("qdelay.tools.inspect", "read-only inspection of a data folder"),
    "spark": ("qdelay.tools.spark_jobs", "offline jobs on Spark (audit, lateness, forecast, export, import)"),
    "admin": ("qdelay.replication.admin", "cluster administration (status, promote, fence, group, resync)"),
    "cluster": ("qdelay.replication.cluster_up", "run etcd + a sharded cluster on loopback (cluster up)"),
}


# The server's gRPC transport: accepted connections read and written by grpc-core's own
# poller rather than handed to the EventEngine's threads. Under ingest (SendStream, 100 x
# 16) the EventEngine thread did ~0.5 us a message of I/O and hand-offs that the poller
# thread, which must wake the event loop anyway, does in ~0.2 more: the server's CPU a
# message 5.47 -> 5.40 and 5.40 -> 5.13 us, medians of 14 and 16 rounds in random order
# (docs/benchmarks.md, "The server's gRPC listener without the EventEngine"). grpc-core
# reads GRPC_EXPERIMENTS once, as it loads: it is set before anything imports grpc, and
# never over the operator's own value.
SERVER_GRPC_EXPERIMENTS = "-event_engine_listener"


def set_server_grpc_experiments(environ: MutableMapping[str, str], grpc_loaded: bool) -> bool:
    """Set ``SERVER_GRPC_EXPERIMENTS`` in ``environ`` for a server process, unless the
    operator set GRPC_EXPERIMENTS (any value, empty included) or gRPC is loaded already
    (too late to matter: e.g. ``main`` called inside a program); whether it did."""
    if grpc_loaded or "GRPC_EXPERIMENTS" in environ:
        return False
    environ["GRPC_EXPERIMENTS"] = SERVER_GRPC_EXPERIMENTS
    return True


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="qdelay", description="qdelay delay-message server")
    sub = parser.add_subparsers(dest="command", required=True)
    if argv and argv[0] in SUBCOMMANDS:
        name = argv[0]
        if name == "server":
            set_server_grpc_experiments(os.environ, "grpc" in sys.modules)
        try:
            module = importlib.import_module(SUBCOMMANDS[name][0])
        except ModuleNotFoundError as err:
            # the base install (and qdelay-client) has the clients only; the commands need the
            # server's dependencies
            print(f"qdelay {name}: {err.name} is not installed; pip install 'qdelay[server]'", file=sys.stderr)
            return 2
        module.add_arguments(sub.add_parser(name, help=SUBCOMMANDS[name][1]))
    else:
        for name, (_module, help_text) in SUBCOMMANDS.items():
            sub.add_parser(name, help=help_text)
    args = parser.parse_args(argv)
    return int(importlib.import_module(SUBCOMMANDS[args.command][0]).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
