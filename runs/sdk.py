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
from typing import Any
from uuid import UUID

from django.db import IntegrityError, transaction
from django.utils import timezone

from runs.engine import registry
from runs.engine.executor import NOT_FOUND, RetryPolicy, RunContext, append_event
from runs.engine.serialization import to_json
from runs.engine.wakeup import notify_runnable
from runs.errors import (
    NonDeterminismError,
    OutputNotSerializable,
    StepFailed,
    StepguardError,
    StepMisuse,
    UnknownWorkflow,
)
from runs.models import Run

__all__ = [
    "NOT_FOUND",
    "NonDeterminismError",
    "OutputNotSerializable",
    "RetryPolicy",
    "RunContext",
    "StepFailed",
    "StepMisuse",
    "StepguardError",
    "UnknownWorkflow",
    "get_run",
    "start_run",
    "wait_for_run",
    "workflow",
]


def workflow(name: str, *, version: str = "1") -> Callable[[Callable], Callable]:
    """Register `fn(ctx: RunContext, input) -> result` as workflow `name` at `version`.

    A run is resumed only by code registered under the name and version it started with;
    change the steps a workflow takes and you give it a new version.
    """

    def decorate(fn: Callable) -> Callable:
        registry.register(name, version, fn)
        return fn

    return decorate


def start_run(
    name: str,
    input: Any = None,
    *,
    key: str | None = None,
    version: str | None = None,
    max_attempts: int | None = None,
) -> Run:
    """Start a run of workflow `name` (its newest registered version unless `version` is given).

    Idempotent by `key`: starting twice with one key returns the first run, whatever the input.
    The returned Run has `was_created` set to tell the two cases apart. Raises UnknownWorkflow
    if this process has not registered the workflow, and OutputNotSerializable for input that
    is not JSON.
    """
    definition = registry.get(name, version)
    data = to_json(input, what=f"the input of workflow {name!r}")
    if key is not None and (not isinstance(key, str) or not 0 < len(key) <= 255):
        raise ValueError("a run key must be a string of 1 to 255 characters")
    if max_attempts is not None and not 1 <= max_attempts <= 100:
        raise ValueError("max_attempts must be between 1 and 100")
    fields: dict[str, Any] = {"max_attempts": max_attempts} if max_attempts else {}
    try:
        with transaction.atomic():
            run = Run.objects.create(
                workflow=definition.name,
                version=definition.version,
                input=data,
                key=key,
                wake_at=timezone.now(),
                event_seq=1,
                **fields,
            )
            append_event(run.id, 1, "run.created", workflow=definition.ref, key=key)
            transaction.on_commit(notify_runnable)
    except IntegrityError:
        existing = Run.objects.filter(key=key).first() if key is not None else None
        if existing is None:
            raise
        if existing.workflow != definition.name:
            raise ValueError(
                f"run key {key!r} already belongs to run {existing.id} of workflow "
                f"{existing.workflow!r}, not {definition.name!r}"
            ) from None
        existing.was_created = False
        return existing
    run.was_created = True
    return run


def get_run(run_id: str | UUID) -> Run:
    return Run.objects.get(pk=run_id)


def wait_for_run(run_id: str | UUID, *, timeout: float = 60.0, poll: float = 0.1) -> Run:
    """Block until the run is completed, failed or cancelled; raise TimeoutError after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        run = Run.objects.get(pk=run_id)
        if run.is_terminal:
            return run
        if time.monotonic() > deadline:
            raise TimeoutError(f"run {run_id} is still {run.status} after {timeout:g}s")
        time.sleep(poll)
