"""The async bridge: what an `async def` workflow receives, the same calls awaited."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

from django.db import connection

from runs.engine.context import Engine
from runs.engine.host import AsyncHost, Turnstile
from runs.engine.loop import engine_loop
from runs.engine.records import CURRENT_STEP
from runs.errors import StepMisuse

#: Threads an async workflow's checkpoints may use at once: one per step in flight.
MAX_CONCURRENT_STEPS = 32


class AsyncRunContext:
    """What an `async def` workflow receives: the same calls as RunContext, awaited.

    The checkpoint writes run on one database thread of their own while the workflow's event
    loop stays free for async steps (AsyncOpenAI, AsyncAnthropic, async tools), so both kinds
    of workflow share one engine and one set of semantics.
    """

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop, db: ThreadPoolExecutor):
        self._engine, self._loop, self._db = engine, loop, db
        who = engine.execution.who
        self.run_id, self.workflow, self.version = who.run_id, who.workflow, who.version
        self.input, self.attempt = engine.execution.input, who.attempt
        self.scheduled_at, self.labels = who.scheduled_at, dict(who.labels)
        self._in_flight: set[Future] = set()  # calls running on a database thread

    async def drain(self) -> None:
        """Wait for every call still running on a database thread (a step gathered beside one
        that failed, one whose awaiting task was cancelled): each records how it ended, so
        none is left `started` to be sent again, nor cut off and counted as a failure."""
        while pending := [f for f in self._in_flight if not f.done()]:
            await asyncio.wait([asyncio.wrap_future(f) for f in pending])

    @property
    def idempotency_key(self) -> str:
        return self._engine.steps.idempotency_key

    async def _call(self, method: Callable, *args: Any, **kwargs: Any) -> Any:
        """Every call runs on a database thread: checkpoints block, the event loop must not."""
        return await self._enter(False, method, *args, **kwargs)

    async def _step(self, method: Callable, *args: Any, **kwargs: Any) -> Any:
        """A step: others may run while it waits for its async call (asyncio.gather)."""
        return await self._enter(True, method, *args, **kwargs)

    async def _enter(self, releasable: bool, method: Callable, *args: Any, **kwargs: Any):
        running = CURRENT_STEP.get()
        if running is not None and running.owner == id(self._engine.execution):
            raise StepMisuse(f"a step was called inside step {running.key!r}; steps do not nest")
        host = self._engine.execution.host
        assert host is not None  # run_async set it before handing this out
        turnstile = host.turnstile
        ticket = turnstile.ticket()

        def serve():
            if not turnstile.enter(ticket, releasable):
                return None  # cancelled before its turn: nobody waits for this
            try:
                return method(*args, **kwargs)
            finally:
                turnstile.leave()

        call = self._db.submit(serve)
        self._in_flight.add(call)
        call.add_done_callback(self._in_flight.discard)
        try:
            return await asyncio.wrap_future(call)
        except asyncio.CancelledError:
            turnstile.abandon(ticket)
            raise

    async def step(self, key: str, fn: Callable, /, *args: Any, **kwargs: Any) -> Any:
        """`ctx.step`; `fn` may be an `async def`: it runs on this workflow's event loop."""
        return await self._step(self._engine.steps.step, key, fn, *args, **kwargs)

    async def transaction(self, key: str, fn: Callable, /, *args: Any, **kwargs: Any) -> Any:
        """`ctx.transaction`: `fn` runs on the database thread, inside the transaction."""
        return await self._call(self._engine.steps.transaction, key, fn, *args, **kwargs)

    async def now(self) -> datetime:
        return await self._call(self._engine.recorded.now)

    async def random(self) -> float:
        return await self._call(self._engine.recorded.random)

    async def uuid(self) -> UUID:
        return await self._call(self._engine.recorded.uuid)

    async def patched(self, change_id: str) -> bool:
        return await self._call(self._engine.recorded.patched, change_id)

    async def set_event(self, name: str, value: Any = None) -> None:
        return await self._call(self._engine.recorded.set_event, name, value)

    async def sleep(self, key: str, duration: float | timedelta) -> None:
        return await self._call(self._engine.waits.sleep, key, duration)

    async def sleep_until(self, key: str, when: datetime) -> None:
        return await self._call(self._engine.waits.sleep_until, key, when)

    async def wait_for_event(self, key: str, name: str, **options: Any) -> Any:
        return await self._call(self._engine.waits.wait_for_event, key, name, **options)

    async def approval(self, key: str, **options: Any) -> Any:
        return await self._call(self._engine.waits.approval, key, **options)

    async def approvals(self, asks: Iterable[Any]) -> list[Any]:
        return await self._call(self._engine.waits.approvals, list(asks))

    async def child(self, key: str, workflow: str, input: Any = None) -> Any:
        return await self._call(self._engine.waits.child, key, workflow, input)

    async def children(self, specs: Iterable[tuple[str, str, Any]]) -> list[Any]:
        return await self._call(self._engine.waits.children, list(specs))

    async def llm(self, key: str, call: Callable, /, **request: Any) -> Any:
        """`ctx.llm`; an async client's call runs on this workflow's event loop, concurrently
        with the workflow's other steps in flight (asyncio.gather)."""
        return await self._step(self._engine.calls.llm, key, call, **request)

    async def tool(self, key: str, fn: Callable, /, *args: Any, **kwargs: Any) -> Any:
        return await self._step(self._engine.calls.tool, key, fn, *args, **kwargs)

    async def agent_loop(self, **options: Any) -> dict:
        return await self._call(self._engine.calls.agent_loop, **options)


def run_async(fn: Callable, engine: Engine, input: Any) -> Any:
    """Run an async workflow on the process's event loop (runs/engine/loop.py) until it
    returns, its checkpoints written from database threads of its own."""
    db = ThreadPoolExecutor(MAX_CONCURRENT_STEPS, thread_name_prefix="stepguard-db")
    loop = engine_loop()

    async_ctx = AsyncRunContext(engine, loop, db)

    async def main():
        try:
            return await fn(async_ctx, input)
        finally:
            await async_ctx.drain()

    execution = engine.execution
    execution.host = AsyncHost(loop, Turnstile(), async_ctx)
    try:
        return asyncio.run_coroutine_threadsafe(main(), loop).result()
    finally:
        execution.host = None
        _close_connections(db)
        db.shutdown()


def _close_connections(db: ThreadPoolExecutor) -> None:
    """Each database thread closes its own connection (Django's are per thread): as many
    tasks as threads, each held at a barrier until all run, so every thread takes one."""
    threads = len(db._threads)
    if not threads:
        return
    barrier = threading.Barrier(threads)

    def close():
        connection.close()
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait(timeout=10)

    for future in [db.submit(close) for _ in range(threads)]:
        future.result()
