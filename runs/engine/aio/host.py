"""AsyncHost, the runtime of one async execution, and how any execution's thread waits on the
event loop (see docs/async.md).

Apart from bridge.py (the awaited calls workflow code sees, which import the engine): the
execution names its host, and its threads wait through here, without an import cycle.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from runs.engine.aio.loop import engine_loop
from runs.engine.aio.threads import DatabaseThreads
from runs.engine.aio.turnstile import Turnstile
from runs.engine.records import CURRENT_STEP
from runs.engine.step_deadline import bounded
from runs.errors import StepMisuse

#: Threads an async workflow's checkpoints may use at once: one per step in flight.
MAX_CONCURRENT_STEPS = 32


class AsyncHost:
    """What an execution of an async workflow runs on, for the workflow's duration: the
    process's event loop, the turnstile its calls take turns at, the database threads they
    run on, and the calls in flight there. `bridge.run_async` opens it, sets it on the
    execution and closes it; a sync workflow's execution has none.

    `enter` is the one door: every awaited call of the workflow (AsyncRunContext) and every
    concurrent step engine code starts (`concurrently`) goes through it.
    """

    def __init__(
        self,
        owner: int,
        loop: asyncio.AbstractEventLoop | None = None,
        threads: int = MAX_CONCURRENT_STEPS,
    ):
        #: id() of the Execution: a call made inside one of its own steps is a nested step.
        self.owner = owner
        self.loop = loop if loop is not None else engine_loop()
        self.turnstile = Turnstile()
        self.threads = DatabaseThreads(threads)
        self._in_flight: set[concurrent.futures.Future] = set()

    async def enter(self, releasable: bool, method: Callable, *args: Any, **kwargs: Any) -> Any:
        """`method(*args, **kwargs)` on a database thread, in its turn; awaited here, on the
        event loop. The ticket is taken now, so calls enter in the order they were made
        (asyncio.gather starts its awaitables in order). A step (`releasable`) gives its
        turn up while it only waits for its async call; other calls keep it until they
        return. Cancelled before its turn, the call never runs."""
        running = CURRENT_STEP.get()
        if running is not None and running.owner == self.owner:
            raise StepMisuse(f"a step was called inside step {running.key!r}; steps do not nest")
        turnstile = self.turnstile
        ticket = turnstile.ticket()

        def serve():
            if not turnstile.enter(ticket, releasable):
                return None  # cancelled before its turn: nobody waits for this
            try:
                return method(*args, **kwargs)
            finally:
                turnstile.leave()

        call = self.threads.submit(serve)
        self._in_flight.add(call)
        call.add_done_callback(self._in_flight.discard)
        try:
            return await asyncio.wrap_future(call)
        except asyncio.CancelledError:
            turnstile.abandon(ticket)
            raise

    async def drain(self) -> None:
        """Wait for every call still running on a database thread (a step gathered beside one
        that failed, one whose awaiting task was cancelled): each records how it ended, so
        none is left `started` to be sent again, nor cut off and counted as a failure."""
        while pending := [f for f in self._in_flight if not f.done()]:
            await asyncio.wait([asyncio.wrap_future(f) for f in pending])

    def close(self) -> None:
        """End the database threads, each closing its own connection."""
        self.threads.close()


def concurrently(host: AsyncHost | None, jobs: list[Callable[[], Any]]) -> list[Any]:
    """From a thread of the execution: run `jobs`, each making its own steps, as concurrent
    steps of an async workflow (positions in the order given, as asyncio.gather would); one
    after another in a sync workflow. The first exception, in order, is raised once all have
    ended."""
    if host is None or len(jobs) < 2:
        return [job() for job in jobs]

    async def gather():
        steps = (host.enter(True, job) for job in jobs)
        return await asyncio.gather(*steps, return_exceptions=True)

    future = asyncio.run_coroutine_threadsafe(gather(), host.loop)
    with released(host, force=True):
        results = future.result()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


@contextmanager
def released(host: AsyncHost | None, force: bool = False) -> Iterator[None]:
    """While this thread only waits (an async call, a retry delay), let the async workflow's
    other steps use the run's context (see Turnstile). The step's own state lives in its
    task's CURRENT_STEP, which the others do not see."""
    turnstile = host.turnstile if host is not None else None
    if turnstile is None or not (force or turnstile.releasable()) or turnstile.released():
        yield
        return
    turnstile.release()
    try:
        yield
    finally:
        turnstile.reacquire()


def wait_for(value: Any, host: AsyncHost | None) -> Any:
    """Run an `async def` step (or an async client's call) to completion on the event loop,
    where an async workflow runs too (the process's one, loop.py): an async client's pooled
    connections belong to the loop that opened them, so a client kept across executions
    (module-level, or a framework's shared one) must always meet it."""
    if not inspect.isawaitable(value):
        return value

    running = CURRENT_STEP.get()
    if running is not None and running.deadline is not None:
        value = bounded(value, running.deadline, running.key, running.timeout or 0.0)

    async def wait():
        CURRENT_STEP.set(running)  # this task's own: concurrent steps each see theirs
        return await value

    loop = host.loop if host is not None else engine_loop()
    future = asyncio.run_coroutine_threadsafe(wait(), loop)
    with released(host):
        if running is not None and running.thread is not None:
            return running.thread.serve_until(future)  # its reservations are written here
        return future.result()
