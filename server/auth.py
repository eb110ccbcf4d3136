"""Client authentication: bearer tokens on every RPC, and TLS server credentials.

The token file holds one token per line (blank lines and ``#`` comments ignored); more
than one line allows rotation. A call must carry ``authorization: Bearer <token>``
metadata; a missing or wrong token gets UNAUTHENTICATED. Tokens are compared in constant
time against every configured token and never logged.
"""

from __future__ import annotations

import hmac
import logging

import grpc

from qdelay.errors import Unauthenticated

log = logging.getLogger("qdelay.auth")


def load_tokens(path: str) -> list[bytes]:
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise Unauthenticated(f"cannot read auth token file {path}: {e.strerror}") from None
    tokens = [line.strip().encode() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not tokens:
        raise Unauthenticated(f"auth token file {path} holds no token")
    return tokens


def token_matches(presented: bytes, tokens: list[bytes]) -> bool:
    ok = False
    for token in tokens:  # compare against all of them: no early exit that a timer could see
        ok |= hmac.compare_digest(presented, token)
    return ok


def check_metadata(metadata, tokens: list[bytes]) -> str | None:
    """None when the call may proceed, else the reason (without the token) to refuse it."""
    value = None
    for key, val in metadata or ():
        if key == "authorization":
            value = val
            break
    if value is None:
        return "missing 'authorization: Bearer <token>' metadata"
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token:
        return "authorization metadata must be 'Bearer <token>'"
    if not token_matches(token.strip().encode(), tokens):
        return "invalid token"
    return None


def _deny_handler(handler: grpc.RpcMethodHandler, reason: str) -> grpc.RpcMethodHandler:
    async def deny_unary(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    async def deny_stream(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)
        yield  # pragma: no cover - makes this an async generator

    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny_stream, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny_unary, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **kw)
    return grpc.unary_unary_rpc_method_handler(deny_unary, **kw)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without a valid bearer token (UNAUTHENTICATED)."""

    def __init__(self, tokens: list[bytes]) -> None:
        self.tokens = tokens
        self.refused = 0

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        reason = check_metadata(handler_call_details.invocation_metadata, self.tokens)
        if reason is None:
            return handler
        self.refused += 1
        log.warning("refused %s: %s", handler_call_details.method, reason)
        return _deny_handler(handler, reason)


def server_credentials(cert_file: str, key_file: str) -> grpc.ServerCredentials:
    with open(cert_file, "rb") as f:
        cert = f.read()
    with open(key_file, "rb") as f:
        key = f.read()
    return grpc.ssl_server_credentials([(key, cert)])
