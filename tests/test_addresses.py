"""HOST:PORT from a user: one parser (qdelay.addresses) for the server's config, the commands'
address flags and the five Python clients' constructors.

Walking the product: ``qdelay admin status --servers 127.0.0.1`` reported the server
unreachable on port 443 (gRPC's default), and ``Client("")`` / ``Client("host")`` were made
without complaint and failed at their first call (UNKNOWN, or UNAVAILABLE after resolving).
Each is refused at once now, saying HOST:PORT is expected. (The commands' flags:
tests/test_replication.py and tests/test_spark.py, with their other usage errors.)"""

from __future__ import annotations

import asyncio
import re

import pytest

from qdelay import addresses, errors
from qdelay.aio import Client as AioClient
from qdelay.client import AioShardedClient, Client, ClusterClient, ShardedClient
from qdelay.server import config as config_mod
from qdelay.server.config import ConfigError, ServerConfig

BAD = ["", "host", "127.0.0.1", "127.0.0.1:", "127.0.0.1:abc", "host:0", "host:70000", "[::1]", "dns:///host"]


@pytest.mark.parametrize(
    "text, want",
    [("host:7600", ("host", 7600)), ("[::1]:7600", ("::1", 7600)), ("0.0.0.0:0", ("0.0.0.0", 0))],
)
def test_parse_hostport(text, want):
    assert addresses.parse_hostport(text) == want


@pytest.mark.parametrize("text", ["", "host", ":7600", "[::1]", "host:", "host:x", "host:65536", "host:-1"])
def test_parse_hostport_refuses_what_is_not_host_port(text):
    with pytest.raises(errors.InvalidArgument, match="listen must be HOST:PORT"):
        addresses.parse_hostport(text, "listen")


def test_the_config_uses_the_same_parser():
    assert config_mod.parse_hostport is addresses.parse_hostport
    for key in ("listen", "master", "metrics_listen"):
        with pytest.raises(ConfigError, match=f"{key} must be HOST:PORT, not '127.0.0.1'"):
            ServerConfig(**{key: "127.0.0.1"}).validate()
    with pytest.raises(ConfigError, match="peers must be HOST:PORT, not 'b'"):
        ServerConfig(peers="a:1,b").validate()


@pytest.mark.parametrize("target", BAD)
def test_every_client_refuses_an_address_without_its_port_when_made(target):
    """No server is needed: each refuses before any channel or call."""
    for make in (Client, AioClient):
        with pytest.raises(errors.InvalidArgument, match="must be HOST:PORT") as err:
            make(target)
        assert repr(target) in str(err.value)
    for make in (ClusterClient, ShardedClient, AioShardedClient):  # "": a list of none
        with pytest.raises(errors.InvalidArgument, match="must be HOST:PORT|at least one"):
            make(target)
    with pytest.raises(errors.InvalidArgument, match="a server address must be HOST:PORT, not 'b'"):
        ClusterClient(["a:1", "b"])
    with pytest.raises(errors.InvalidArgument, match="a seed address must be HOST:PORT, not 'b'"):
        AioShardedClient("a:1,b")


@pytest.mark.parametrize("target", ["127.0.0.1:1", "[::1]:1", "unix:/nonexistent/q.sock", "dns:///localhost:1"])
def test_the_clients_still_take_host_port_and_grpc_targets(target):
    """gRPC's own target forms (the clients passed any to gRPC before) are still taken."""
    Client(target).close()

    async def aio() -> None:
        await AioClient(target).close()

    asyncio.run(aio())


URLS = ["http://127.0.0.1:7600", "https://host:7600/", "grpc://host:7600", "HTTP://[::1]:7600", "xds:///host"]


@pytest.mark.parametrize("target", URLS)
def test_every_client_refuses_a_url_naming_the_host_port_to_pass(target):
    """``http://host:7600`` was taken as HOST:PORT with the host ``http://host`` and failed only
    at the first call, when gRPC could not resolve it. gRPC's own target forms still pass
    (test_the_clients_still_take_host_port_and_grpc_targets: ``unix:``, ``dns:///``)."""
    bare = target.partition("://")[2].partition("/")[0] or "HOST:PORT"
    for make in (Client, AioClient, ClusterClient, ShardedClient, AioShardedClient):
        with pytest.raises(errors.InvalidArgument, match="must be HOST:PORT") as err:
            make(target)
        assert f"drop the {target.partition('://')[0]}://; pass {bare!r}" in str(err.value)
    with pytest.raises(ConfigError, match=re.escape(f"master must be HOST:PORT, not {target!r}: gRPC takes no URL")):
        ServerConfig(master=target).validate()
    with pytest.raises(errors.InvalidArgument, match="endpoint must be HOST:PORT"):
        addresses.check_target("ipv4://127.0.0.1:7600")  # a path, not HOST:PORT, after ipv4:


@pytest.mark.parametrize(("url", "bare"), [("http://host", "host:PORT"), ("grpc://[::1]/", "[::1]:PORT")])
def test_a_url_without_a_port_names_a_host_port_to_pass_not_the_bare_host(url, bare):
    """The refusal of ``http://host`` said to pass ``'host'``, which is refused in turn (no
    port): it names the port to add."""
    with pytest.raises(errors.InvalidArgument) as err:
        addresses.check_target(url)
    assert f"pass {bare!r}" in str(err.value)
    with pytest.raises(errors.InvalidArgument, match="must be HOST:PORT"):
        addresses.check_target(bare.removesuffix(":PORT"))
