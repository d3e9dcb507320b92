"""The async bridge: what an `async def` workflow receives, the same calls awaited."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

from django.db import connection

from runs.engine.context import RunContext


class AsyncRunContext:
    """What an `async def` workflow receives: the same calls as RunContext, awaited.

    The checkpoint writes run on one database thread of their own while the workflow's event
    loop stays free for async steps (AsyncOpenAI, AsyncAnthropic, async tools), so both kinds
    of workflow share one engine and one set of semantics.
    """

    def __init__(self, ctx: RunContext, loop: asyncio.AbstractEventLoop, db: ThreadPoolExecutor):
        self._ctx, self._loop, self._db = ctx, loop, db
        self.run_id, self.workflow, self.version = ctx.run_id, ctx.workflow, ctx.version
        self.input, self.attempt = ctx.input, ctx.attempt

    @property
    def idempotency_key(self) -> str:
        return self._ctx.idempotency_key

    async def _call(self, method: Callable, *args: Any, **kwargs: Any) -> Any:
        """Every call runs on the database thread: checkpoints block, the event loop must not."""
        return await self._loop.run_in_executor(
            self._db, functools.partial(method, *args, **kwargs)
        )

    async def step(self, key: str, fn: Callable, /, *args: Any, **kwargs: Any) -> Any:
        """`ctx.step`; `fn` may be an `async def`: it runs on this workflow's event loop."""
        return await self._call(self._ctx.step, key, fn, *args, **kwargs)

    async def transaction(self, key: str, fn: Callable, /, *args: Any, **kwargs: Any) -> Any:
        """`ctx.transaction`: `fn` runs on the database thread, inside the transaction."""
        return await self._call(self._ctx.transaction, key, fn, *args, **kwargs)

    async def now(self) -> datetime:
        return await self._call(self._ctx.now)

    async def random(self) -> float:
        return await self._call(self._ctx.random)

    async def uuid(self) -> UUID:
        return await self._call(self._ctx.uuid)

    async def patched(self, change_id: str) -> bool:
        return await self._call(self._ctx.patched, change_id)

    async def sleep(self, key: str, duration: float | timedelta) -> None:
        return await self._call(self._ctx.sleep, key, duration)

    async def sleep_until(self, key: str, when: datetime) -> None:
        return await self._call(self._ctx.sleep_until, key, when)

    async def wait_for_event(self, key: str, name: str, **options: Any) -> Any:
        return await self._call(self._ctx.wait_for_event, key, name, **options)

    async def approval(self, key: str, **options: Any) -> Any:
        return await self._call(self._ctx.approval, key, **options)

    async def child(self, key: str, workflow: str, input: Any = None) -> Any:
        return await self._call(self._ctx.child, key, workflow, input)

    async def children(self, specs: Iterable[tuple[str, str, Any]]) -> list[Any]:
        return await self._call(self._ctx.children, list(specs))

    async def llm(self, key: str, call: Callable, /, **request: Any) -> dict:
        """`ctx.llm`; an async client's call runs on this workflow's event loop."""
        return await self._call(self._ctx.llm, key, call, **request)

    async def tool(self, key: str, fn: Callable, /, *args: Any, **kwargs: Any) -> Any:
        return await self._call(self._ctx.tool, key, fn, *args, **kwargs)

    async def agent_loop(self, **options: Any) -> dict:
        return await self._call(self._ctx.agent_loop, **options)


def run_async(fn: Callable, ctx: RunContext, input: Any) -> Any:
    db = ThreadPoolExecutor(1, thread_name_prefix="stepguard-db")

    async def main():
        ctx._loop = asyncio.get_running_loop()
        return await fn(AsyncRunContext(ctx, ctx._loop, db), input)

    try:
        return asyncio.run(main())
    finally:
        ctx._loop = None
        db.submit(lambda: connection.close()).result()  # the database thread's own connection
        db.shutdown()
