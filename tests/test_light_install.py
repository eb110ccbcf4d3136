"""A client that installs light (issue 15 item 6).

`pip install ./packaging/client` (distribution qdelay-client, same import package
`qdelay`) is the clients alone: gRPC and protobuf, the wire codec, no storage or server code
and no storage C extension. The root distribution's base requirements are the clients'
too (`pip install .` pulls none of the server's dependencies, which are the `server` extra),
but its wheel also builds the storage extension, which extras cannot leave out; hence the
second distribution (packaging/client/pyproject.toml says why).

Checked here: a real, clean install of qdelay-client into a fresh virtualenv, used against a
real server (slow: ~15-20 s); and, in this process's full install, that both clients work
where none of the server's dependencies (numpy, psutil, xxhash, prometheus-client,
grpcio-tools, grpcio-reflection) nor the storage code (qdelay.segments, its native codec
included) can be imported: with the native wire codec and handoff and without them (their
Python twins)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
import venv
from importlib.metadata import requires
from pathlib import Path

import pytest
from serverproc import ServerProc

ROOT = Path(__file__).resolve().parent.parent
CLIENT_DIST = ROOT / "packaging" / "client"

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
from qdelay.client import handoff
assert (wire.native is None) == bool(MORE), wire.native
assert (handoff.native is None) == bool(MORE), handoff.native
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
    more = ("qdelay._wire", "qdelay._handoff") if wire_codec == "twins" else ()
    with ServerProc(tmp_path / "data") as srv:
        code = f"BLOCKED = {SERVER_ONLY!r}\nMORE = {more!r}\nADDRESS = {srv.address!r}\n" + CHILD
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "light client: OK" in result.stdout


def test_the_client_distribution_has_the_roots_version_and_base_requirements():
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    client = tomllib.loads((CLIENT_DIST / "pyproject.toml").read_text())["project"]
    assert client["name"] == "qdelay-client" and client["version"] == root["version"]
    assert client["dependencies"] == root["dependencies"]
    assert client["requires-python"] == root["requires-python"]


CLEAN = """
import importlib.util, sys
for name in BLOCKED + ["qdelay.segments", "qdelay.server", "qdelay.replication", "qdelay.tools"]:
    assert importlib.util.find_spec(name.split(".")[0]) is None or importlib.util.find_spec(name) is None, name
from qdelay import wire
from qdelay.client import handoff
assert wire.native is not None, "the wire codec was not built"
assert handoff.native is not None, "the handoff extension was not built"
"""


@pytest.mark.slow
def test_a_clean_install_of_the_client_distribution_in_a_fresh_venv(tmp_path):
    """pip installs qdelay-client from this tree into a new virtualenv (its requirements come
    from the package index): only gRPC and protobuf come with it, no storage or server code
    is installed, no storage extension is built, and both clients work against a server."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = str(env_dir / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    install = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", str(CLIENT_DIST)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    strays = [p for p in CLIENT_DIST.rglob("*.o") if "build" not in p.relative_to(CLIENT_DIST).parts]
    assert not strays, f"the build wrote outside build/: {strays}"
    listed = subprocess.run(
        [python, "-m", "pip", "list", "--format=freeze", "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        env=env,
    ).stdout
    names = {line.split("==")[0].lower() for line in listed.split()}
    assert {"qdelay-client", "grpcio", "grpcio-health-checking", "protobuf"} <= names
    assert not names & {"qdelay", "numpy", "psutil", "xxhash", "prometheus-client", "rocksdict", "grpcio-tools"}
    site = next((env_dir / "lib").glob("python*/site-packages"))
    assert sorted(p.name for p in (site / "qdelay").iterdir() if p.is_dir() and p.name != "__pycache__") == [
        "client",
        "v1",
    ]
    assert not list(site.rglob("_codec*")), "the storage extension came with the client"
    with ServerProc(tmp_path / "data") as srv:
        code = f"BLOCKED = {SERVER_ONLY!r}\nMORE = ()\nADDRESS = {srv.address!r}\n" + CLEAN + CHILD
        result = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "light client: OK" in result.stdout
