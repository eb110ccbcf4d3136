"""Stopping asyncio tasks without losing a cancellation, the caller's or the task's.

Two ways a cancellation gets lost in Python 3.11, both seen in this tree:

- ``try: await task`` / ``except (CancelledError, Exception): pass`` after ``task.cancel()``
  also catches the *caller's* own cancellation (the caller cancelled while it waits): the
  caller goes on as if nothing happened, e.g. starts a new puller during a shutdown.
- ``asyncio.wait_for`` (3.11) returns the result instead of raising when a cancellation
  meets an awaited future that has just completed (the task not yet resumed): a loop
  around it goes on for ever, and whoever waits for that task waits for ever. A SIGTERMed
  cluster server hung this way (26 Nov). ``asyncio.timeout`` does not lose it; the tree uses
  it instead (``asyncio.wait_for`` is banned by the lint gate, pyproject.toml).

:func:`cancel_and_wait` is the one way the tree stops its own tasks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

log = logging.getLogger("qdelay.cancellation")

# a task still running this long after its cancellation is cancelled again: it swallowed one
RECANCEL_SECONDS = 0.1


async def cancel_and_wait(tasks: Iterable[asyncio.Future | None]) -> None:
    """Cancel ``tasks`` (None entries skipped) and return once every one has ended.

    What the tasks raised once cancelled is retrieved and dropped (they are being stopped:
    their outcome is no longer anyone's). A task that had already failed before the stop is
    logged (ERROR, with its traceback): that failure is a background loop that died unseen
    (a saver, a sampler, a watchdog), and retrieving it silently took away the one trace
    it left (asyncio's "exception was never retrieved" at its collection). The caller's own
    cancellation propagates at once, the tasks having been cancelled. A task that swallowed
    its cancellation is cancelled again every ``RECANCEL_SECONDS`` until it ends."""
    given = [t for t in tasks if t is not None]
    for t in given:
        if t.done() and not t.cancelled():
            err = t.exception()  # ended before: retrieved, and said
            if err is not None:
                log.error("a task had failed before its stop: %r", t, exc_info=err)
    pending = {t for t in given if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        done, pending = await asyncio.wait(pending, timeout=RECANCEL_SECONDS)
        for t in done:
            if not t.cancelled():
                t.exception()  # retrieved: no "exception was never retrieved" at collection
