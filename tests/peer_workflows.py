"""Workflows of the tests of what users of Temporal and DBOS expect (tests/test_peers.py):
step deadlines, progress events. Imported by those tests and their workers only
(`--import tests.peer_workflows`)."""

import asyncio
import os
import threading
import time
from datetime import timedelta
from pathlib import Path

from runs.sdk import RetryPolicy, RunContext, workflow
from tests.testapp.models import Effect

TWO_TRIES = RetryPolicy(max_attempts=2, initial_interval=timedelta(0))

#: Never set: a call that waits on it never returns.
NEVER = threading.Event()


def hang(ctx: RunContext, label: str) -> str:
    """A tool call that never returns (a socket with no timeout), after recording its try."""
    Effect.objects.create(idempotency_key=ctx.idempotency_key, label=label, pid=os.getpid())
    NEVER.wait()
    return "never"


@workflow("peers.hung-sync")
def hung_sync(ctx: RunContext, input: dict) -> str:
    """A sync step that never returns, bounded by its timeout and tried twice."""
    return ctx.step("call", hang, ctx, "hung", timeout=input["timeout"], retry=TWO_TRIES)


@workflow("peers.slow-once")
def slow_once(ctx: RunContext, input: dict) -> str:
    """The first attempt outlives its deadline, the retry answers: the late result of the
    first is discarded, the run gets the second's."""

    def call() -> str:
        tries = Effect.objects.filter(idempotency_key=ctx.idempotency_key).count()
        Effect.objects.create(idempotency_key=ctx.idempotency_key, label="slow", pid=os.getpid())
        if tries == 0:
            time.sleep(input["sleep"])
            return "late"
        return "on time"

    return ctx.step("call", call, timeout=input["timeout"], retry=TWO_TRIES)


@workflow("peers.hung-async")
async def hung_async(ctx, input: dict) -> str:
    """An async step cancelled at its deadline: it leaves a mark when the cancel reaches it."""

    async def call() -> str:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            Path(input["marker"]).write_text("cancelled")
            raise
        return "never"

    return await ctx.step("call", call, timeout=input["timeout"], retry=RetryPolicy(max_attempts=1))


@workflow("peers.quick")
def quick(ctx: RunContext, input: dict | None) -> str:
    return ctx.step("quick", lambda: "done")


@workflow("peers.when")
def when(ctx: RunContext, input: dict | None) -> dict:
    """The tick a schedule started the run for, and the run's first recorded time."""
    scheduled = ctx.scheduled_at
    return {
        "scheduled_at": scheduled.isoformat() if scheduled else None,
        "now": ctx.now().isoformat(),
    }


def linger(path: str, seconds: float) -> str:
    """A slow step that says it has started (a file), so a test can kill its worker in it."""
    Path(path).write_text("in")
    time.sleep(seconds)
    return "slow done"


@workflow("peers.progress")
def progress(ctx: RunContext, input: dict) -> str:
    """Publishes its progress to clients around a slow step (DBOS's set_event)."""
    ctx.set_event("stage", {"step": 1, "of": 2})
    ctx.step("slow", linger, input["marker"], input.get("seconds", 0))
    ctx.set_event("stage", {"step": 2, "of": 2})
    ctx.set_event("result", "all done")
    return "finished"


@workflow("peers.progress-async")
async def progress_async(ctx, input: dict) -> str:
    await ctx.set_event("stage", "async")
    return "finished"


@workflow("peers.publish")
def publish(ctx: RunContext, input: dict | None) -> str:
    ctx.set_event("stage", "sync")
    return "finished"


@workflow("peers.llm-hang")
def llm_hang(ctx: RunContext, input: dict) -> dict:
    """A model call to a server that accepts and never answers, bounded by its timeout."""
    from openai import AsyncOpenAI, OpenAI

    kind = AsyncOpenAI if input["async"] else OpenAI
    client = kind(base_url=input["url"], api_key="none", max_retries=0)
    return ctx.llm(
        "ask", client.chat.completions.create, model="demo", max_tokens=5,
        messages=[{"role": "user", "content": "hello?"}], timeout=input["timeout"],
        retry=RetryPolicy(max_attempts=1),
    )  # fmt: skip
