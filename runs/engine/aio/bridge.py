"""What an `async def` workflow receives (AsyncRunContext, the same calls awaited) and
run_async, which runs one: the lifecycle of its AsyncHost (see docs/async.md)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

from runs.engine.aio.host import AsyncHost
from runs.engine.context import Engine


class AsyncRunContext:
    """What an `async def` workflow receives: the same calls as RunContext, awaited.

    Each call enters its execution's AsyncHost: it runs on a database thread of the host's,
    in its turn, while the event loop stays free for async steps (AsyncOpenAI,
    AsyncAnthropic, async tools), so both kinds of workflow share one engine and one set of
    semantics.
    """

    def __init__(self, engine: Engine, host: AsyncHost):
        self._engine, self._host = engine, host
        who = engine.execution.who
        self.run_id, self.workflow, self.version = who.run_id, who.workflow, who.version
        self.input, self.attempt = engine.execution.input, who.attempt
        self.scheduled_at, self.labels = who.scheduled_at, dict(who.labels)

    @property
    def idempotency_key(self) -> str:
        return self._engine.steps.idempotency_key

    async def _call(self, method: Callable, *args: Any, **kwargs: Any) -> Any:
        """A call that keeps the run's context until it returns (a wait, a child, ...)."""
        return await self._host.enter(False, method, *args, **kwargs)

    async def _step(self, method: Callable, *args: Any, **kwargs: Any) -> Any:
        """A step: others may run while it waits for its async call (asyncio.gather)."""
        return await self._host.enter(True, method, *args, **kwargs)

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


async def in_turn(ctx: AsyncRunContext, fn: Callable, /, *args: Any, **kwargs: Any) -> Any:
    """For an adapter: call blocking `fn` (a database read) on the run's database thread, in
    its turn, as every call of `ctx` is made; the event loop itself cannot query the database.
    (A workflow's own reads belong in a step: this one is not recorded.)"""
    return await ctx._call(fn, *args, **kwargs)


def run_async(fn: Callable, engine: Engine, input: Any) -> Any:
    """Run an async workflow on the process's event loop (loop.py) until it returns, its calls
    entering an AsyncHost opened for it: set on the execution meanwhile, drained of the calls
    still in flight when the workflow ends, closed (its threads and their connections) after."""
    execution = engine.execution
    host = AsyncHost(id(execution))
    async_ctx = AsyncRunContext(engine, host)

    async def main():
        try:
            return await fn(async_ctx, input)
        finally:
            await host.drain()

    execution.host = host
    try:
        return asyncio.run_coroutine_threadsafe(main(), host.loop).result()
    finally:
        execution.host = None
        host.close()
