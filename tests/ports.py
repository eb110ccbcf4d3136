"""Ports for the servers the tests start and restart: one rule for every test helper.

A port from ``bind(("127.0.0.1", 0))`` lies in the kernel's ephemeral range, the one
outgoing connections take their local port from. A test that stops a server and starts it
again on the same address (a restart, a failover, etcd restarted under load) then races
every client connection on the box: one made between the stop and the start may hold the
port, and the restart fails with "address in use" (test_sync_failover_under_load, 27 Nov,
four suites running). Ports below the ephemeral range are never handed to an outgoing
connection; another test worker can still pick the same one only through this function,
which draws at random from ~12,000 and checks with a bind.
"""

from __future__ import annotations

import random
import socket

SPAN = 12_000  # how many ports below the ephemeral range are drawn from


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(consecutive: int = 1) -> int:
    """A port P on 127.0.0.1, free now with the ``consecutive - 1`` after it, below the
    ephemeral range (so no outgoing connection takes it while its server restarts)."""
    high = _ephemeral_low() - consecutive
    low = max(1024, high - SPAN)
    rnd = random.SystemRandom()
    for _ in range(1000):
        port = rnd.randint(low, high)
        if all(_bindable(port + k) for k in range(consecutive)):
            return port
    raise RuntimeError(f"no {consecutive} free consecutive port(s) in {low}..{high + consecutive - 1}")
