"""`pip install qdelay` is the client alone: its requirements are gRPC and protobuf, and
both clients work (against a real server) in a process where none of the server's
dependencies (numpy, psutil, xxhash, prometheus-client, grpcio-tools, grpcio-reflection)
nor the storage code (qdelay.segments, its native codec included) can be imported: with
the native wire codec (qdelay._wire, which the light install builds: it needs no library),
and without it (where it could not be built, its Python twins run)."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import requires

import pytest
from serverproc import ServerProc

SERVER_ONLY = ["numpy", "psutil", "xxhash", "prometheus_client", "grpc_tools", "grpc_reflection"]


def test_base_requirements_are_the_clients_only():
    base = {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requires("qdelay") if "extra ==" not in r}
    assert base == {"grpcio", "grpcio-health-checking", "protobuf"}
    server = {
        re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requires("qdelay") if 'extra == "server"' in r
    }
    assert {"numpy", "psutil", "xxhash", "prometheus-client", "grpcio-reflection"} <= server


CHILD = """
import asyncio, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED or name.startswith(("qdelay.segments", *MORE)):
            raise ModuleNotFoundError(f"blocked: {name}", name=name)
sys.meta_path.insert(0, Block())
from qdelay.client import Client, Outgoing
from qdelay import aio, wire
assert (wire.native is None) == bool(MORE), wire.native
with Client(ADDRESS) as c:
    r = c.send("light.s", b"x", delay_ms=60_000)
    assert c.get(str(r)).state == "PENDING"
    assert len(c.send_many([Outgoing("light.s", b"y", delay_ms=60_000)] * 10)) == 10
    with c.subscribe("light.now") as consumer:
        c.send("light.now", b"now")
        assert len(consumer.receive(1, timeout=10)) == 1
async def main():
    async with aio.Client(ADDRESS) as a:
        r = await a.send("light.s", b"z", delay_ms=60_000)
        assert await a.cancel(r) == "CANCELLED"
asyncio.run(main())
loaded = [m for m in sys.modules if m.split(".")[0] in BLOCKED or m.startswith(("qdelay.segments", *MORE))]
assert not loaded, loaded
print("light client: OK")
"""


@pytest.mark.parametrize("wire_codec", ["native", "twins"])
def test_the_clients_work_without_the_servers_dependencies(tmp_path, wire_codec):
    more = ("qdelay._wire",) if wire_codec == "twins" else ()
    with ServerProc(tmp_path / "data") as srv:
        code = f"BLOCKED = {SERVER_ONLY!r}\nMORE = {more!r}\nADDRESS = {srv.address!r}\n" + CHILD
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "light client: OK" in result.stdout
