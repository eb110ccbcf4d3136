"""HOST:PORT as people give it: one parser for the server's config (``listen``, ``master``,
``peers``, ...), the commands' address flags and the clients' constructors.

It lives in the light package (the clients and qdelay-client have it) and needs no gRPC.
Without it an address with no port failed late and far from its cause: gRPC reads
``127.0.0.1`` as ``dns:///127.0.0.1`` on port 443, its default, and ``""`` as a call that
fails with UNKNOWN; ``qdelay admin status --servers 127.0.0.1`` reported port 443
unreachable.
"""

from __future__ import annotations

import re

from qdelay.errors import InvalidArgument

# gRPC target schemes (its naming doc) a client's target may start with instead of HOST:PORT.
# No port to check in these: a socket path, a vsock address.
_PATH_SCHEMES = ("unix:", "unix-abstract:", "vsock:")
# These name HOST:PORT endpoints after the scheme, with the same port-443 default: checked.
_ENDPOINT_SCHEMES = ("dns:", "ipv4:", "ipv6:")
# A URL's ``scheme://`` ("http://host:7600", "grpc://host:7600"): HOST:PORT's parse took
# "http://host" for the host, and gRPC later failed to resolve it (UNAVAILABLE, far from the
# cause), so it is refused where it is given, with the HOST:PORT to pass instead.
_URL_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


def _refuse_a_url(text: str, what: str, error: type[Exception], takes: str = "") -> None:
    found = _URL_SCHEME.match(text)
    if found:
        bare = text[found.end() :].partition("/")[0]  # "http://host:7600/" -> "host:7600"
        if bare and not bare.rpartition(":")[2].isdigit():  # "http://host": its port is to be added,
            bare += ":PORT"  # not "host", which is refused next for want of one
        raise error(
            f"{what} must be HOST:PORT{takes}, not {text!r}: gRPC takes no URL, drop the "
            f"{found.group(1)}://; pass {bare or 'HOST:PORT'!r}"
        )


def parse_hostport(
    text: str, what: str = "address", error: type[Exception] = InvalidArgument, least_port: int = 0
) -> tuple[str, int]:
    """``'host:7600'`` -> ``('host', 7600)``; ``'[::1]:7600'`` -> ``('::1', 7600)``.

    Raises ``error`` (InvalidArgument; the server's config passes its ConfigError) saying
    HOST:PORT is expected when the host or port is missing or the port is not a number from
    ``least_port`` (0 for a server's listen address: any free port) to 65535."""
    _refuse_a_url(text, what, error)
    host, sep, port = text.rpartition(":")
    if not sep or not host.strip("[]") or "]" in port or "/" in host:  # "]": an IPv6 literal with no port
        raise error(f"{what} must be HOST:PORT, not {text!r}")
    try:
        number = int(port)
    except ValueError:
        raise error(f"{what} must be HOST:PORT, not {text!r}: the port {port!r} is not a number") from None
    if not least_port <= number <= 65535:
        raise error(f"{what} must be HOST:PORT, not {text!r}: the port is not from {least_port} to 65535")
    return host.strip("[]"), number


def check_target(target: object, what: str = "target") -> str:
    """A client's server address, checked when the client is made (InvalidArgument): HOST:PORT,
    or a gRPC target with a scheme: ``unix:PATH``, ``unix-abstract:NAME``, ``vsock:CID:PORT``
    as they are; ``dns:[//AUTHORITY/]HOST:PORT``, ``ipv4:``/``ipv6:`` lists with their ports.
    Any other ``scheme://`` (``http://host:7600``) is refused, naming the HOST:PORT to pass."""
    if not isinstance(target, str):
        raise InvalidArgument(f"{what} must be a HOST:PORT string, not {type(target).__name__}")
    if target.startswith(_PATH_SCHEMES):
        return target
    if not target.startswith(_ENDPOINT_SCHEMES):
        _refuse_a_url(target, what, InvalidArgument, " (or a gRPC target: unix:, dns:, ipv4:, ...)")
    if target.startswith("dns:"):
        rest = target.removeprefix("dns:")
        endpoints = [rest.removeprefix("//").partition("/")[2] if rest.startswith("//") else rest]
    elif target.startswith(_ENDPOINT_SCHEMES):
        endpoints = target.partition(":")[2].split(",")
    else:
        endpoints = [target]
    named = what if endpoints == [target] else f"{what} {target!r}: its endpoint"
    for endpoint in endpoints:
        parse_hostport(endpoint, named, least_port=1)
    return target
