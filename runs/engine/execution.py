"""Execution: one execution of one run, what its concerns share.

Its identity, lease and mode flags, the collaborators that own the rest of its state (the
replay cursor, the one writer, the undo list, the async host), the gate every call passes
(may it take its position?) and how a thread of it waits (an async call, a retry delay). The
concerns built on it (steps.py, waits.py, calls.py, recorded.py) each hold it and own their
own state; context.py assembles them. It knows none of them, so none of them imports another
to reach it.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from typing import Any

from runs.engine.aio.host import AsyncHost, released, wait_for
from runs.engine.checkpoints import Checkpoints
from runs.engine.compensation import Compensations
from runs.engine.fences import Lease
from runs.engine.history import History
from runs.engine.records import CURRENT_STEP, Identity, Running
from runs.errors import (
    Cancelled,
    LeaseLost,
    NonDeterminismError,
    Released,
    StepguardError,
    StepMisuse,
)
from runs.models import Run, Step, StepStatus


class Execution:
    """One execution of one run: who it is, its lease, its flags and the gate of each call."""

    def __init__(
        self,
        run: Run,
        history: dict[int, Step],
        lease: Lease,
        *,
        trace: Any = None,
        give_up: StepguardError | None = None,
    ):
        #: Who this execution is (run, workflow, attempt, labels, worker), read once here.
        self.who = Identity.of(run)
        self.input: Any = run.input
        #: The replay cursor: which position each call takes, what is recorded there.
        self.history = History(
            history,
            attempt=run.attempt,
            failed_step=(run.error or {}).get("step") if run.error else None,
        )
        self.lease = lease
        lease.workflow = run.workflow
        #: A cancel was asked for: the next call raises Cancelled (lifecycle sets it too, to
        #: run the compensations).
        self.cancel_requested = run.cancel_requested_at is not None
        #: Set past the poison-run bound: the first step not yet completed fails the run
        #: instead of being re-sent, so the compensations run without the step that kept
        #: killing workers.
        self.give_up = give_up
        self.undo = Compensations()  # the undo list, the steps in doubt, whether undoing
        #: The one writer of the execution's step rows and events, fenced by its lease.
        self.checkpoints = Checkpoints(lease, self.who, self.undo, give_up=give_up)
        self.trace = trace  # the OpenTelemetry context steps descend from (runs/tracing.py)
        self.budgeted_usd = run.budget_micros is not None
        self.budgeted = self.budgeted_usd or run.budget_tokens is not None
        #: An async workflow's runtime: its event loop, turnstile and database threads
        #: (aio.bridge.run_async sets it for the workflow's duration).
        self.host: AsyncHost | None = None
        #: Whether a step may be left `started` when the run ends (found so, or cut off in
        #: flight): the run's end then marks it (lifecycle._finish).
        self.left_started = any(s.status == StepStatus.STARTED for s in history.values())

    # --- the gate: whether a call may take its position -------------------------------------

    def enter(self, key: str, *, internal: bool = False) -> tuple[str, int, Step | None]:
        """Take the next position for `key` and admit the call there (replay's checks)."""
        key, seq, record = self.position(key, internal=internal)
        self.admit(key, seq, record)
        return key, seq, record

    def position(self, key: str, *, internal: bool = False) -> tuple[str, int, Step | None]:
        """Take the next position in the call sequence for `key` (with its repeat suffix)."""
        if (running := self.running()) is not None:
            raise StepMisuse(
                f"step {key!r} was called inside step {running.key!r}; steps do not nest"
            )
        return self.history.take(key, internal=internal)

    def admit(self, key: str, seq: int, record: Step | None) -> None:
        """Decide whether the call at this position may go on; raise what replay must raise."""
        if self.history.replays(key, seq, record):
            return
        if self.give_up is not None and not self.undo.running:
            if record is not None and record.key != key:
                raise NonDeterminismError(seq=seq, recorded=record.key, requested=key)
            raise self.give_up
        if self.cancel_requested and not self.undo.running:
            # Before the determinism check: after a cancel, the positions past this one hold
            # the compensations, not the steps the code would take next.
            raise Cancelled("cancel requested")
        if record is not None and record.key != key:
            raise NonDeterminismError(seq=seq, recorded=record.key, requested=key)
        if self.lease.lost.is_set():
            raise LeaseLost(f"run {self.who.run_id}: lease lost")
        if self.lease.stopping.is_set():
            raise Released("worker shutting down")

    # --- how a thread of the execution waits ------------------------------------------------

    def running(self) -> Running | None:
        """This run's step whose function runs in this thread or asyncio task, if any."""
        running = CURRENT_STEP.get()
        return running if running is not None and running.owner == id(self) else None

    def wait_for(self, value: Any) -> Any:
        """Run an `async def` step (or an async client's call) to completion on the event
        loop (aio.host.wait_for); a step of an async workflow gives its turn up meanwhile."""
        return wait_for(value, self.host)

    def released(self, force: bool = False) -> AbstractContextManager[None]:
        """While this thread only waits (an async call, a retry delay), let the async
        workflow's other steps use the run's context (aio.host.released)."""
        return released(self.host, force)

    def sleep(self, seconds: float) -> None:
        """A retry delay that a lost lease or a shutdown cuts short."""
        with self.released():
            deadline = time.monotonic() + seconds
            while (left := deadline - time.monotonic()) > 0:
                if self.lease.lost.wait(min(left, 0.1)):
                    raise LeaseLost(f"run {self.who.run_id}: lease lost during a retry delay")
                if self.lease.stopping.is_set():
                    raise Released("worker shutting down during a retry delay")
