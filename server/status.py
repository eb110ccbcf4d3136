"""THE one place that maps qdelay errors to gRPC status codes.

Every RPC handler is wrapped by :func:`unary` or :func:`streaming`: a
:class:`qdelay.errors.QdelayError` becomes its class's status with its message; any other
exception is a bug, logged with its traceback and reported as INTERNAL without details
(never leak internals, never hang the call).
"""

from __future__ import annotations

import contextlib
import functools
import logging

import grpc

from qdelay.errors import QdelayError

log = logging.getLogger("qdelay.server")

CODES: dict[str, grpc.StatusCode] = {code.name: code for code in grpc.StatusCode}


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """(status code, message) for an exception raised while serving a call."""
    if isinstance(error, QdelayError):
        return CODES.get(error.grpc_code, grpc.StatusCode.INTERNAL), str(error) or type(error).__name__
    return grpc.StatusCode.INTERNAL, "internal error (see the server log)"


async def abort(context: grpc.aio.ServicerContext, error: BaseException) -> None:
    code, message = status_of(error)
    if code == grpc.StatusCode.INTERNAL and not isinstance(error, QdelayError):
        log.error("unexpected error in an RPC", exc_info=error)
    await context.abort(code, message)


def _is_abort(error: BaseException) -> bool:
    # context.abort() raises AbortError (grpc.aio) after setting the status: let it through
    return isinstance(error, grpc.aio.AbortError)


def unary(handler):
    """Wrap a unary (or client-streaming) coroutine handler ``(self, request, context)``."""

    @functools.wraps(handler)
    async def wrapper(self, request, context):
        try:
            return await handler(self, request, context)
        except Exception as error:  # noqa: BLE001 - every error becomes a status here
            if _is_abort(error):
                raise
            await abort(context, error)

    return wrapper


def streaming(handler):
    """Wrap a server-streaming handler ``(self, request, context)``: an async-generator
    function, or a function returning an async generator. The generator is closed as soon
    as the stream ends (its ``finally`` runs then, not whenever it is collected)."""

    @functools.wraps(handler)
    async def wrapper(self, request, context):
        try:
            async with contextlib.aclosing(handler(self, request, context)) as items:
                async for item in items:
                    yield item
        except Exception as error:  # noqa: BLE001
            if _is_abort(error):
                raise
            await abort(context, error)

    return wrapper
