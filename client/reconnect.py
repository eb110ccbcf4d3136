"""How long a consumer whose stream ended waits before it subscribes again: its backoff, cut
short once its channel has connected again after being away.

The backoff (``batching.retry_wait``: doubling from the client's ``retry_backoff``, at most
``MAX_BACKOFF``) paces the tries against a server that answers and refuses (a server
draining at SIGTERM answers UNAVAILABLE "shutting down"; a slave without the group yet,
FAILED_PRECONDITION). It is not a good wait for a server that was away: each try while the
server is down fails at once ("connection refused", or grpc's cached failure while its own
reconnect backoff runs), so the consumer's wait had grown to its cap by the time the server
was back, and the try after it could fail again on the channel's stale failure: a restart
cost every consumer up to ~2.5 s past the server's start, more than the start itself
(docs/benchmarks.md, "Lateness across restarts").

So the wait also ends when the channel reports READY after a state that was not READY since
the stream ended (a new connection: the server is back), but not before ``FLOOR`` seconds
(a server that accepts connections and drops them at once must not be tried in a loop).
A channel that stays READY (the server answers) leaves the backoff whole. The watch asks
the channel to connect (grpc does not reconnect an idle channel by itself: after a
SIGTERM's drain closed the connection, nothing else would), so the new connection is made
by grpc's own reconnect backoff (``types.RECONNECT_OPTIONS``) while the consumer waits.
"""

from __future__ import annotations

import asyncio
import threading
import time

import grpc

FLOOR = 0.05  # seconds after the stream ended before a new connection may end the wait

_READY = grpc.ChannelConnectivity.READY
_READY_CODE = _READY.value[0]  # the core's code for READY (the enum's value is (code, name))
WATCH_S = 0.1  # the blocking waiter's longest wait for a change: how soon it sees a close


def wait_blocking(channel: grpc.Channel, delay: float, closed: threading.Event) -> bool:
    """Wait ``delay`` seconds, or less once ``channel`` has connected again (not before
    ``FLOOR``); False if ``closed`` was set meanwhile (seen within ``WATCH_S``).

    The waiting thread watches the channel's core itself (``check_connectivity_state``,
    asking an idle channel to connect, and ``watch_connectivity_state``, which returns at a
    change) rather than through ``grpc.Channel.subscribe``: that one's polling thread runs on
    for up to 0.2 s after the last unsubscription and raised ValueError ("Channel closed!")
    in that thread when the client closed the channel meanwhile (seen at Client.close
    after a restart). A closed channel ends the wait here instead."""
    if closed.is_set():
        return False
    start = time.monotonic()
    core = getattr(channel, "_channel", None)  # grpc's cygrpc.Channel behind the public one
    if core is None or not hasattr(core, "watch_connectivity_state"):
        return not closed.wait(delay)  # another grpc: the backoff alone
    try:
        state = core.check_connectivity_state(True)
        away = state != _READY_CODE
        while not closed.is_set():
            left = delay - (time.monotonic() - start)
            if left <= 0:
                break  # the whole backoff
            core.watch_connectivity_state(state, time.time() + min(left, WATCH_S))
            state = core.check_connectivity_state(True)  # an idle channel is asked to connect
            if state != _READY_CODE:
                away = True
            elif away:
                break  # connected again
    except ValueError:  # the channel was closed (the client's close): the caller finds out
        return not closed.is_set()
    left = min(delay, FLOOR) - (time.monotonic() - start)
    if left > 0 and closed.wait(left):
        return False
    return not closed.is_set()


async def _connected_again(channel: grpc.aio.Channel) -> None:
    """Return once ``channel`` is READY after a state that was not READY."""
    state = channel.get_state(try_to_connect=True)
    away = state is not _READY
    while True:
        await channel.wait_for_state_change(state)
        state = channel.get_state(try_to_connect=True)
        if state is not _READY:
            away = True
        elif away:
            return


async def wait_aio(channel: grpc.aio.Channel, delay: float, closed: asyncio.Event) -> bool:
    """The asyncio form of :func:`wait_blocking` (``closed`` ends the wait at once)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    watch = asyncio.ensure_future(_connected_again(channel))
    ending = asyncio.ensure_future(closed.wait())
    try:
        await asyncio.wait((watch, ending), timeout=delay, return_when=asyncio.FIRST_COMPLETED)
        if closed.is_set():
            return False
        left = min(delay, FLOOR) - (loop.time() - start)
        if left > 0:
            await asyncio.wait((ending,), timeout=left)
        return not closed.is_set()
    finally:
        for task in (watch, ending):
            task.cancel()
        await asyncio.gather(watch, ending, return_exceptions=True)
