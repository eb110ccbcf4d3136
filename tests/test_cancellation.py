"""Stopping tasks without losing a cancellation (qdelay/cancellation.py).

A SIGTERMed cluster server hung once (26 Nov): its lease-renewal loop awaited
``asyncio.wait_for``, which in Python 3.11 returns the result instead of raising when the
cancellation meets a just-completed wait, so the loop went on and the stop that waited for
it never ended. These tests pin the two rules the tree follows since."""

from __future__ import annotations

import asyncio
import sys

import pytest

from qdelay.cancellation import cancel_and_wait


def _cancel_as_the_wait_completes(wait) -> str:
    """Run a loop around ``wait(fut)``; complete ``fut`` and cancel the loop in the same
    turn of the event loop (the race the renewal loop lost). 'ended' or 'went on'."""

    async def main() -> str:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[int] = loop.create_future()
        turns = 0

        async def looping() -> None:
            nonlocal turns
            while True:
                await wait(fut)
                turns += 1
                if turns > 3:
                    return

        task = asyncio.ensure_future(looping())
        await asyncio.sleep(0)  # the loop is waiting on fut
        fut.set_result(1)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return "ended"
        return "went on"

    return asyncio.run(main())


async def _with_timeout(fut) -> None:
    async with asyncio.timeout(5):
        await fut


async def _with_wait_for(fut) -> None:
    await asyncio.wait_for(fut, 5)


def test_asyncio_timeout_keeps_the_cancellation_that_wait_for_loses():
    assert _cancel_as_the_wait_completes(_with_timeout) == "ended"
    if sys.version_info < (3, 12):  # fixed in 3.12 (wait_for is asyncio.timeout there)
        assert _cancel_as_the_wait_completes(_with_wait_for) == "went on"


def test_a_task_that_swallows_its_cancellation_is_cancelled_again_until_it_ends():
    async def main() -> int:
        swallowed = 0

        async def stubborn() -> None:
            nonlocal swallowed
            while True:
                try:
                    await asyncio.sleep(10)
                except asyncio.CancelledError:
                    swallowed += 1
                    if swallowed >= 3:
                        raise

        task = asyncio.ensure_future(stubborn())
        await asyncio.sleep(0)
        async with asyncio.timeout(5):
            await cancel_and_wait([task, None])
        assert task.cancelled()
        return swallowed

    assert asyncio.run(main()) == 3


def test_the_callers_own_cancellation_propagates():
    """The old ``try: await task / except (CancelledError, Exception): pass`` after
    ``task.cancel()`` swallowed the caller's cancellation too: a cluster agent stopped while
    it stopped its puller went on (and started another puller)."""

    async def main() -> None:
        release = asyncio.Event()
        went_on = False

        async def slow_to_end() -> None:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                await release.wait()  # its clean-up takes a while
                raise

        async def stopper(task: asyncio.Task) -> None:
            nonlocal went_on
            await cancel_and_wait([task])
            went_on = True

        task = asyncio.ensure_future(slow_to_end())
        await asyncio.sleep(0)
        caller = asyncio.ensure_future(stopper(task))
        await asyncio.sleep(0.05)  # the caller waits for the task's clean-up
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert not went_on
        release.set()
        await asyncio.sleep(0)
        async with asyncio.timeout(5):
            await cancel_and_wait([task])

    asyncio.run(main())


def test_the_tasks_failures_are_retrieved_not_raised():
    async def main() -> None:
        async def fails() -> None:
            try:
                await asyncio.sleep(10)
            finally:
                raise RuntimeError("while stopping")

        task = asyncio.ensure_future(fails())
        await asyncio.sleep(0)
        await cancel_and_wait([task])
        assert isinstance(task.exception(), RuntimeError)

    asyncio.run(main())


def test_a_task_that_failed_before_the_stop_is_retrieved_too():
    """A task that ended with an error before the stop: nothing logs it later as never
    retrieved (asyncio's handler at the task's collection)."""
    import gc

    async def main() -> list[str]:
        unretrieved: list[str] = []
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: unretrieved.append(ctx["message"]))

        async def fails_at_once() -> None:
            raise RuntimeError("before the stop")

        task: asyncio.Task | None = asyncio.ensure_future(fails_at_once())
        assert task is not None
        await asyncio.wait([task])  # it has ended (a condition, not a sleep)
        await cancel_and_wait([task])
        task = None
        gc.collect()
        return unretrieved

    assert asyncio.run(main()) == []


def test_a_task_that_failed_before_the_stop_is_said_not_dropped(caplog):
    """A background loop that died before the stop (a saver, a sampler, a watchdog: an
    exception nothing caught) left one trace, asyncio's "exception was never retrieved" at
    its collection; retrieved at the stop, it must still be said: ERROR with the traceback.
    A failure the stop itself caused (the task cancelled, raising on its way out) stays
    dropped: it is no one's any more."""
    import logging

    async def main() -> None:
        async def dies() -> None:
            raise RuntimeError("the sampler died")

        async def fails_on_its_way_out() -> None:
            try:
                await asyncio.Event().wait()
            finally:
                raise ValueError("raised while stopped")  # noqa: B012

        died = asyncio.ensure_future(dies())
        stopping = asyncio.ensure_future(fails_on_its_way_out())
        await asyncio.wait([died])  # (stopping, started in the same turn: at its wait)
        await cancel_and_wait([died, stopping])
        assert isinstance(stopping.exception(), ValueError) and not died.cancelled()

    with caplog.at_level(logging.ERROR, logger="qdelay.cancellation"):
        asyncio.run(main())
    said = [r for r in caplog.records if r.name == "qdelay.cancellation"]
    assert len(said) == 1, [r.getMessage() for r in said]
    assert said[0].levelno == logging.ERROR and "failed before its stop" in said[0].getMessage()
    assert said[0].exc_info is not None and str(said[0].exc_info[1]) == "the sampler died"


def test_a_stop_that_overruns_prints_every_tasks_stack(capsys):
    from qdelay.server.app import dump_tasks

    async def main() -> None:
        async def waiting_for_ever() -> None:
            await asyncio.Event().wait()

        task = asyncio.ensure_future(waiting_for_ever())
        await asyncio.sleep(0)
        dump_tasks()
        task.cancel()

    asyncio.run(main())
    err = capsys.readouterr().err
    assert "stop overran its deadline" in err
    assert "waiting_for_ever" in err
