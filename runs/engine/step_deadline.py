"""A step's deadline (`timeout=` on ctx.step, ctx.llm, ctx.tool): Temporal's start-to-close
timeout, per attempt.

An async step's coroutine is cancelled at the deadline (asyncio.wait_for), so nothing of it
runs on. Python cannot stop a thread, so a sync step's function runs on a daemon thread of its
own while the step's thread waits for it until the deadline; past it, the attempt is abandoned
and fails with StepTimeout, and the thread is left to finish with its result discarded. That
is the one choice that frees the run without touching anything else: cancelling the worker's
lease would stop every other run of the process and have a second worker re-send the step
anyway, and waiting on would be no deadline. A call left running may still do its side effect;
the retry is sent with the same idempotency key, exactly as after a crash mid-call, so the
service that checks the key sees it once. Being a daemon, a stuck thread never holds up the
worker's shutdown.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import inspect
import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from django.db import connections

from runs.errors import StepMisuse, StepTimeout

log = logging.getLogger("stepguard.executor")

#: The longest deadline a step may be given: a day (longer work is a child run or a wait).
MAX_TIMEOUT_SECONDS = 86_400.0


def seconds_of(timeout: float | timedelta | None, what: str) -> float | None:
    """`timeout` as seconds, refused unless positive and at most a day; None for none."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, timedelta)):
        raise StepMisuse(f"{what}: timeout must be seconds or a timedelta, not {timeout!r}")
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if not 0 < seconds <= MAX_TIMEOUT_SECONDS:
        raise StepMisuse(f"{what}: timeout must be over 0 s and at most a day, not {seconds:g} s")
    return seconds


def expired(key: str, seconds: float) -> StepTimeout:
    return StepTimeout(f"step {key!r} took more than {seconds:g} s (its timeout)")


async def bounded(awaitable: Any, deadline: float, key: str, seconds: float) -> Any:
    """`awaitable` cancelled at the monotonic `deadline`: StepTimeout then."""
    try:
        return await asyncio.wait_for(awaitable, max(0.0, deadline - time.monotonic()))
    except TimeoutError:
        raise expired(key, seconds) from None


def call_by(fn: Callable, args: tuple, kwargs: dict, deadline: float, key: str, seconds: float):
    """`fn(*args, **kwargs)` for a step with a deadline. An `async def` is called here (it only
    makes its coroutine; the caller's wait_for bounds that); any other function runs on a
    daemon thread in a copy of this context (the step's CURRENT_STEP), waited for until the
    deadline. What it returns may be awaitable: the caller awaits that, bounded too."""
    if inspect.iscoroutinefunction(fn):
        return fn(*args, **kwargs)
    done: concurrent.futures.Future = concurrent.futures.Future()
    context = contextvars.copy_context()

    def work() -> None:
        try:
            done.set_result(context.run(fn, *args, **kwargs))
        except BaseException as exc:  # raised on the step's thread, where it belongs
            done.set_exception(exc)
        finally:
            connections.close_all()  # this thread's own, if the function opened any

    thread = threading.Thread(target=work, name=f"stepguard-step-{key}"[:60], daemon=True)
    thread.start()
    try:
        return done.result(timeout=max(0.0, deadline - time.monotonic()))
    except concurrent.futures.TimeoutError:
        log.warning("step %r passed its %g s timeout: its thread is left to finish", key, seconds)
        raise expired(key, seconds) from None
