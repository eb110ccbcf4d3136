"""The health service's ``qdelay.master`` name follows who takes writes.

A load balancer (or a Kubernetes readiness probe) in front of producers checks
``qdelay.master``: SERVING on a master that takes writes, NOT_SERVING on a slave and on a
fenced master, while ``""`` and ``qdelay.v1.DelayService`` stay SERVING on every healthy
server (slaves answer Get and serve consumers). Real processes: a master, its slave, a
forced promotion of the slave (which fences the old master).
"""

from __future__ import annotations

from conftest import wait_until
from serverproc import ServerProc
from test_replication import RPC_ERRORS, SMALL_SEGMENTS, admin, status

from qdelay.client import Client

MASTER = "qdelay.master"


def health(address: str, service: str) -> str:
    with Client(address, retries=0) as c:
        return c.health(service=service)


def test_master_health_name_follows_the_role(tmp_path):
    a = ServerProc(tmp_path / "a", args=SMALL_SEGMENTS).start()
    b = ServerProc(tmp_path / "b", args=[*SMALL_SEGMENTS, "--role", "slave", "--master", a.address]).start()
    try:
        wait_until(lambda: status(b.address).connected, 20, "slave attached", ignore=RPC_ERRORS)
        assert health(a.address, MASTER) == "SERVING"
        assert health(b.address, MASTER) == "NOT_SERVING"
        for address in (a.address, b.address):
            assert health(address, "") == "SERVING"
            assert health(address, "qdelay.v1.DelayService") == "SERVING"

        admin("promote", "--target", b.address, "--force")
        wait_until(lambda: health(b.address, MASTER) == "SERVING", 10, "the promoted slave serves writes")
        wait_until(lambda: health(a.address, MASTER) == "NOT_SERVING", 10, "the fenced master stops")
        assert status(a.address).role == "fenced"
        # the fenced master is still a healthy process: its reads and its "" name serve
        assert health(a.address, "") == "SERVING"
        with Client(b.address) as c:
            assert c.send("health.roles", b"x", delay_ms=60_000).message_id
    finally:
        b.stop()
        a.stop()
