"""Cluster mode on a real etcd (loopback): membership, leadership, Topology, failover.

Every server here is a real ``qdelay server --etcd … --cluster … --shard …`` process;
etcd is the Debian ``etcd-server`` binary (the tests skip, saying so, where it is missing).
Leases are short (TTL 2 s) so that a failover takes about 2.5 s.
"""

from __future__ import annotations

import grpc
import pytest
from etcdproc import EtcdProc
from serverproc import ServerProc
from test_replication import status, wait_for

from qdelay import errors
from qdelay.client import Outgoing
from qdelay.v1 import qdelay_pb2 as pb
from qdelay.v1 import qdelay_pb2_grpc as pb_grpc

TTL_MS, RENEW_MS, DEADLINE_MS = 2000, 250, 1200
LEASES = [
    "--lease-ttl-ms",
    str(TTL_MS),
    "--lease-renew-ms",
    str(RENEW_MS),
    "--lease-deadline-ms",
    str(DEADLINE_MS),
    "--sync-bound-ms",
    "1000",
]
SUBJECT = "cluster"


@pytest.fixture
def etcd(tmp_path):
    with EtcdProc(tmp_path / "etcd") as e:
        yield e


def node(tmp_path, name: str, etcd_endpoint: str, shard: str = "s1", cluster: str = "c", extra=()) -> ServerProc:
    args = ["--etcd", etcd_endpoint, "--cluster", cluster, "--shard", shard, *LEASES, *extra]
    return ServerProc(tmp_path / name, args=args)


def topology(address: str) -> pb.TopologyResponse:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.DelayServiceStub(ch).Topology(pb.TopologyRequest(), timeout=5)


def shard_of(address: str, name: str) -> pb.Shard | None:
    for s in topology(address).shards:
        if s.name == name:
            return s
    return None


def wait_shard(address: str, name: str, slaves: int, timeout: float = 20.0) -> pb.Shard:
    """Until ``address`` sees shard ``name`` with a master and ``slaves`` slaves."""

    def ready():
        s = shard_of(address, name)
        return s if s is not None and s.master and len(s.slaves) == slaves else None

    return wait_for(ready, timeout, f"shard {name} with a master and {slaves} slave(s)")


def test_membership_leadership_topology(tmp_path, etcd):
    a = node(tmp_path, "a", etcd.endpoint).start()
    b = node(tmp_path, "b", etcd.endpoint).start()
    c = node(tmp_path, "c", etcd.endpoint, shard="s2").start()
    try:
        s1 = wait_shard(b.address, "s1", 1)
        assert s1.master in (a.address, b.address) and s1.epoch > 0
        master, slave = (a, b) if s1.master == a.address else (b, a)
        assert list(s1.slaves) == [slave.address]
        s2 = wait_shard(a.address, "s2", 0)
        assert s2.master == c.address and s2.epoch > 0 and s2.epoch != s1.epoch
        wait_shard(c.address, "s1", 1)
        t = topology(c.address)
        assert t.cluster == "c" and [s.name for s in t.shards] == ["s1", "s2"]
        # the master's epoch is its leader key's revision, and replication carries it
        assert status(master.address).role == "master" and status(master.address).epoch == s1.epoch
        wait_for(lambda: status(slave.address).connected, 20, "slave attached")
        assert status(slave.address).epoch == s1.epoch
        # receipts name their shard; the slave refuses writes
        with master.client(retries=0) as cl:
            r = cl.send(SUBJECT, b"x", delay_ms=60_000)
            assert r.shard == "s1"
            assert cl.send_many([Outgoing(SUBJECT, b"y", delay_ms=60_000)])[0].shard == "s1"
        with slave.client(retries=0) as cl, pytest.raises(errors.FailedPrecondition):
            cl.send(SUBJECT, b"x", delay_ms=1000)
        # a standalone server is one shard named "" (itself)
        with ServerProc(tmp_path / "solo") as solo:
            t = topology(solo.address)
            assert t.cluster == "" and [(s.name, s.master) for s in t.shards] == [("", solo.address)]
    finally:
        for p in (a, b, c):
            p.kill9()
