"""The public API agent authors import. Everything else in Stepguard is private.

from runs.sdk import workflow, RunContext

@workflow("book-trip", version="1")
def book_trip(ctx: RunContext, input):
    flights = ctx.step("search", airline.search, input["to"])
    return ctx.step("book", lambda: airline.book(flights[0], key=ctx.idempotency_key))
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from uuid import UUID

from django.db import transaction
from django.utils import timezone

from runs.cron import check_cron, check_name, zone
from runs.engine import registry
from runs.engine.agent import AgentLoopExhausted, Tool, ToolTimeout
from runs.engine.budget import Metered, Usage
from runs.engine.context import RunContext
from runs.engine.outage import once_more
from runs.engine.records import CURRENT_STEP, NOT_FOUND, Decision
from runs.engine.retry import RetryPolicy
from runs.engine.serialization import to_json
from runs.engine.starts import start_run
from runs.engine.store import run_event
from runs.engine.streaming import Delta
from runs.engine.waits import Ask
from runs.errors import (
    ApprovalExpired,
    ApprovalRejected,
    ApprovalRevoked,
    ChildFailed,
    Conflict,
    DecisionError,
    InvalidInput,
    ModelRequestRejected,
    NonDeterminismError,
    OperationError,
    OperatorFailed,
    OutputNotSerializable,
    StepFailed,
    StepguardError,
    StepMisuse,
    StepTimeout,
    UnknownWorkflow,
    UnpricedModel,
    WaitTimeout,
)
from runs.models import EventType, Overlap, Run, Signal
from runs.operations import cancel_run, lock_run

__all__ = [
    "NOT_FOUND",
    "AgentLoopExhausted",
    "ApprovalExpired",
    "ApprovalRejected",
    "ApprovalRevoked",
    "Ask",
    "ChildFailed",
    "Decision",
    "DecisionError",
    "Delta",
    "Metered",
    "ModelRequestRejected",
    "NonDeterminismError",
    "OperationError",
    "OperatorFailed",
    "OutputNotSerializable",
    "RetryPolicy",
    "RunContext",
    "StepFailed",
    "StepMisuse",
    "StepTimeout",
    "StepguardError",
    "Tool",
    "ToolTimeout",
    "UnknownWorkflow",
    "UnpricedModel",
    "Usage",
    "WaitTimeout",
    "cancel_run",
    "get_event",
    "get_run",
    "idempotency_key",
    "send_signal",
    "signal_with_start",
    "start_run",
    "wait_for_run",
    "workflow",
]


def workflow(
    name: str,
    *,
    version: str = "1",
    concurrency: int | None = None,
    concurrency_key: Callable[[Any], Any] | None = None,
    per_key: int | None = None,
    priority: int = 0,
    schedule: str | None = None,
    timezone: str = "UTC",
    overlap: str = "skip",
    debounce: float | timedelta | None = None,
    debounce_key: Callable[[Any], Any] | None = None,
    debounce_max: float | timedelta | None = None,
) -> Callable[[Callable], Callable]:
    """Register `fn(ctx: RunContext, input) -> result` as workflow `name` at `version`.

    A run is resumed only by code registered under the name and version it started with;
    change the steps a workflow takes and you give it a new version.

    Flow control (docs/flow-control.md): at most `concurrency` runs of the workflow execute at
    once on all workers together, and at most `per_key` of those share the key
    `concurrency_key(input)` (a tenant, a user); runs waiting on a timer, a signal or an
    approval do not count. `priority` (-1000 to 1000) is its runs' default. `schedule`, a cron
    expression in `timezone`, starts one run per tick; `overlap` says what a tick does while
    the last one's run is still open: "skip" (default), "buffer_one", "buffer_all" or
    "allow_all". With `debounce` (seconds or a
    timedelta), a start waits for that long a quiet period per `debounce_key(input)`: starts
    in the meantime replace its input (the last one wins) and restart the quiet period, for at
    most `debounce_max` after the first.
    """

    if schedule is not None:
        check_name(name)  # the schedule is named after the workflow
        schedule = check_cron(schedule)
        zone(timezone)
    if overlap not in Overlap.values:
        raise InvalidInput(f"overlap must be one of {', '.join(Overlap.values)}, not {overlap!r}")

    def decorate(fn: Callable) -> Callable:
        registry.register(
            name, version, fn, concurrency=concurrency, concurrency_key=concurrency_key,
            per_key=per_key, priority=priority, schedule=schedule, timezone=timezone,
            overlap=overlap, debounce=debounce, debounce_key=debounce_key,
            debounce_max=debounce_max,
        )  # fmt: skip
        return fn

    return decorate


@once_more
def send_signal(
    run_id: str | UUID,
    name: str,
    payload: Any = None,
    *,
    sent_by: str = "system",
    if_finished: str = "raise",
) -> Signal | None:
    """Deliver signal `name` to a run; the next `ctx.wait_for_event(..., name)` consumes it.

    A signal sent before the run reaches its wait is kept until then. A run that has finished
    would never consume it: with `if_finished="raise"` (the default) that is a Conflict saying
    so; with `"ignore"` nothing is stored and None is returned (a notification that may come
    late). To start the run if it is not there, use `signal_with_start`. Raises NotFound for an
    unknown run.
    """
    if not isinstance(name, str) or not 0 < len(name) <= 200:
        raise OperationError("a signal name is a string of 1 to 200 characters")
    if if_finished not in ("raise", "ignore"):
        raise OperationError(f"if_finished must be 'raise' or 'ignore', not {if_finished!r}")
    data = to_json(payload, what=f"the payload of signal {name!r}")
    with transaction.atomic():
        run = lock_run(run_id)
        if run.is_terminal:
            if if_finished == "ignore":
                return None
            raise Conflict(
                f"run {run_id} is {run.status} (finished at "
                f"{run.finished_at.isoformat() if run.finished_at else 'an unknown time'}): no "
                f"wait_for_event will ever consume signal {name!r}. Send it with "
                "if_finished='ignore' to drop it quietly, or with signal_with_start to start "
                "a run that receives it"
            )
        signal = Signal.objects.create(
            run_id=run.pk, name=name, payload=data, sent_by=sent_by, created_at=timezone.now()
        )
        run_event(
            run.pk,
            EventType.SIGNAL_RECEIVED,
            wake=True,
            actor=sent_by,
            name=name,
            signal_id=signal.pk,
        )
    return signal


def signal_with_start(
    workflow: str,
    name: str,
    payload: Any = None,
    *,
    key: str,
    input: Any = None,
    sent_by: str = "system",
    **start: Any,
) -> Signal:
    """Temporal's signal-with-start: signal the run keyed `key`, starting it first (with
    `input` and `start_run`'s other options) if there is none. The signal is stored before the
    new run reaches its wait, so it is consumed there. A run keyed `key` that has finished is
    a Conflict (a key names one run for good): pick a new key for a new run."""
    run = start_run(workflow, input, key=key, **start)
    signal = send_signal(run.pk, name, payload, sent_by=sent_by)
    assert signal is not None  # if_finished="raise": a finished run raised
    return signal


def idempotency_key() -> str:
    """The idempotency key of the step running now (`<run id>:<step key>`), the same when the
    step is re-sent after a crash: hand it to the service a tool calls. For code that has no
    run context at hand, such as a tool an agent framework calls through an adapter (OpenAI
    Agents, Pydantic AI, LangGraph); with a context, `ctx.idempotency_key` is the same."""
    running = CURRENT_STEP.get()
    if running is None:
        raise StepMisuse("idempotency_key() is only defined inside a running step")
    return running.idempotency_key


def get_event(run_id: str | UUID, name: str, *, timeout: float = 0.0, default: Any = None) -> Any:
    """The latest value run `run_id` published as `name` (`ctx.set_event`), waiting up to
    `timeout` seconds (at most 300) for it to be set; `default` if it is not by then, or never
    will be (the run ended without setting it). Raises NotFound for an unknown run."""
    from runs.published import value_of

    return value_of(run_id, name, wait=timeout, default=default)


@once_more
def get_run(run_id: str | UUID) -> Run:
    return Run.objects.get(pk=run_id)


def wait_for_run(run_id: str | UUID, *, timeout: float = 60.0, poll: float = 0.1) -> Run:
    """Block until the run is completed, failed or cancelled; raise TimeoutError after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        run = get_run(run_id)
        if run.is_terminal:
            return run
        if time.monotonic() > deadline:
            raise TimeoutError(f"run {run_id} is still {run.status} after {timeout:g}s")
        time.sleep(poll)
