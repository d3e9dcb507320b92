"""A run's lifecycle: execute it, and end it (completed, failed, cancelled, paused, released)."""

from __future__ import annotations

import inspect
import logging
import random
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any

from django.conf import settings
from django.db import DatabaseError, transaction
from django.db.models import Case, DateTimeField, F, Q, Value, When
from django.db.models.functions import Cast
from django.utils import timezone

from runs import tracing
from runs.approvals.models import ApprovalRequest, ApprovalStatus
from runs.engine import holds, registry
from runs.engine.aio.bridge import run_async
from runs.engine.budget import NOTHING, next_day_start
from runs.engine.checkpoints import book_possibly_spent, fail_in_doubt, release_reservations
from runs.engine.context import Engine, RunContext
from runs.engine.execution import Execution
from runs.engine.fences import Fence, Lease
from runs.engine.history import REPLAY_FIELDS
from runs.engine.outage import is_disconnect
from runs.engine.records import brief, error_record
from runs.engine.serialization import to_json
from runs.engine.store import (
    append_event,
    atomic,
    fence,
    fenced_write,
    flush_unrecorded,
    wake_parent,
)
from runs.engine.wakeup import notify_runnable
from runs.errors import (
    Cancelled,
    Halted,
    LeaseLost,
    NonDeterminismError,
    OverBudget,
    Released,
    StepFailed,
    Suspended,
    WorkerLost,
)
from runs.models import (
    GLOBAL,
    TERMINAL_STATUSES,
    Event,
    EventType,
    Policy,
    Run,
    RunStatus,
    Step,
    StepStatus,
)

#: The engine's own generator for a run retry's jitter (see recorded._RANDOM).
_JITTER = random.Random()

log = logging.getLogger("stepguard.executor")


class Outcome(StrEnum):
    """How one execution of a run ended (a string: logs and tests compare it as one)."""

    COMPLETED = "completed"
    FAILED = "failed"
    RETRYING = "retrying"  # failed, and will run again from the top (a run retry)
    WAITING = "waiting"  # a durable wait: the lease is given up until something wakes it
    CANCELLED = "cancelled"
    PENDING = "pending"  # paused, but what stopped it was lifted meanwhile: runnable again
    HALTED = "halted"
    OVER_BUDGET = "over_budget"
    RELEASED = "released"  # the worker is stopping: handed back for another to resume
    LOST = "lost"  # another worker owns the run now
    DISCONNECTED = "disconnected"  # the database connection broke: the worker may carry on
    ABANDONED = "abandoned"  # another database error: lease recovery resumes it


def execute(run: Run, lease: Lease) -> Outcome:
    """Run one claimed run until it completes, fails, waits, is cancelled or released: see
    `_execute`. Traced as one span, under the trace the run was started in (runs/tracing.py)."""
    worker = str(run.worker_id) if run.worker_id else None
    with tracing.execution(run, worker) as parent:
        outcome = _execute(run, lease, parent)
        tracing.outcome(parent, outcome)
        return outcome


def _execute(run: Run, lease: Lease, trace_parent=None) -> Outcome:
    """Run one claimed run until it completes, fails, waits, is cancelled or released.

    Returns what happened: completed, failed, retrying, waiting, cancelled, released, lost,
    disconnected (the database connection broke: the caller may wait for it and execute the
    run again under the same lease) or abandoned (any other database error: lease recovery
    resumes it). Costs one query to load every checkpoint, then one statement and commit per
    new step (its completion travels with the next write: `store.complete_later`).
    """
    try:
        # The execution before this one, under the same lease, broke off (the connection
        # was lost) with a step's completion not yet written: written before the checkpoints
        # are read, or that step would be re-sent.
        flush_unrecorded(lease)
        history = {}
        if not _brand_new(run):
            checkpoints = Step.objects.filter(run_id=run.id).order_by("seq").only(*REPLAY_FIELDS)
            history = {s.seq: s for s in checkpoints}
    except DatabaseError as exc:
        return _database_error(run, exc, "loading checkpoints")
    except LeaseLost:
        return Outcome.LOST
    give_up = None
    if run.recoveries >= settings.STEPGUARD_MAX_RECOVERIES:
        started = next((s.key for s in history.values() if s.status == StepStatus.STARTED), None)
        give_up = WorkerLost(
            f"its worker was lost {run.recoveries} times in a row without progress"
            + (f", each time during step {started!r}" if started else "")
            + " (STEPGUARD_MAX_RECOVERIES)"
        )
    engine = Engine(Execution(run, history, lease, trace=trace_parent, give_up=give_up))
    try:
        definition = registry.get(run.workflow, run.version)
        if inspect.iscoroutinefunction(definition.fn):
            result = run_async(definition.fn, engine, run.input)
        else:
            result = run_sync(definition.fn, engine, run.input)
        engine.execution.history.check_all_replayed()
        output = to_json(result, what=f"the result of workflow {run.workflow!r}")
    except Suspended:
        return Outcome.WAITING
    except LeaseLost:
        log.warning("run %s: lease lost; another worker owns it now, stopping here", run.id)
        return Outcome.LOST
    except (Released, Cancelled, Halted, OverBudget) as stop:
        return _interrupted(run, engine, lease, stop)
    except DatabaseError as exc:
        return _database_error(run, exc, "writing a checkpoint")
    except KeyboardInterrupt:
        raise  # the process is being stopped: like a crash, lease recovery resumes the run
    except BaseException as exc:
        # `sys.exit()` in workflow code, a cancelled task, any error at all: the run's own
        # error, under its retry policy, never a worker's log line and a lease left to lapse.
        return _fail(run, engine, lease, exc)
    try:
        _finish(
            lease,
            EventType.RUN_COMPLETED,
            {},
            parent_id=run.parent_id,
            in_doubt=engine.execution.left_started,
            status=RunStatus.COMPLETED,
            output=output,
            error=None,
            finished_at=timezone.now(),
            worker=None,
            lease_until=None,
        )
    except LeaseLost:
        return Outcome.LOST
    return Outcome.COMPLETED


def _brand_new(run: Run) -> bool:
    """A run whose history is its creation and this claim: it has no checkpoints to load.
    (Steps are written with events, so any step would have moved `event_seq` past 2; a fork's
    inherited steps are copied without, hence the fork test.)"""
    return run.event_seq == 2 and run.forked_from_id is None


def _database_error(run: Run, exc: DatabaseError, doing: str) -> Outcome:
    """A checkpoint read or write failed, so nothing of it is recorded. A broken connection
    (the server restarting) is the caller's to wait out; anything else is logged in full and
    left to lease recovery, which resumes the run through the normal claim path."""
    if is_disconnect(exc):
        log.debug("run %s: connection lost %s: %s", run.id, doing, exc)
        return Outcome.DISCONNECTED
    log.exception("run %s: database error %s, abandoning the run to lease recovery", run.id, doing)
    return Outcome.ABANDONED


def _finish(
    lease: Lease, event: str, payload: dict, *, parent_id=None, in_doubt: bool = True, **fields
) -> None:
    """End the run: its row and its event in one fenced write (with the last step's pending
    completion), after giving back what unfinished steps still hold. `in_doubt=False`: the
    execution knows no step is left `started` (a completed run's usual case: no statement)."""
    ending = fields.get("status") in TERMINAL_STATUSES
    with atomic(lease):
        possibly = NOTHING
        if ending and in_doubt:
            possibly = book_possibly_spent(lease.run_id)
        if ending:
            release_reservations(lease.run_id, zero_run=False)  # the write below zeroes the run's
            fields |= {"reserved_micros": 0, "reserved_tokens": 0}
        checks = Fence(progress=True, run=tuple(fields.items()), possibly=possibly)
        fenced_write(lease, (event, "", payload), checks)
        if ending and in_doubt:
            at = fields.get("finished_at") or timezone.now()
            fail_in_doubt(lease.run_id, fields["status"], at)
        if ending:
            # Nothing will act on what the run asked for any more: nobody may approve it.
            ApprovalRequest.objects.filter(
                run_id=lease.run_id, status=ApprovalStatus.PENDING
            ).update(status=ApprovalStatus.EXPIRED)
        if parent_id is not None and ending:
            wake_parent(lease.run_id, fields["status"], parent_id)


def _give_back(
    lease: Lease,
    event: str,
    payload: dict,
    *,
    status: str,
    wake_at: datetime | None,
    over: OverBudget | None = None,
    **fields,
) -> str:
    """Give the run up without ending it (paused, released, retrying); return its new status.

    Where it goes is decided in the one statement that writes it, against the holds and
    budgets as they are then, not as the worker saw them: a hold covering the run makes it
    `halted` whatever the caller asked; an over-budget pause whose limit was changed since the
    refusal makes it `pending` (the next start re-checks). The rows those decisions read are
    share-locked first, so an unhalt or a budget raise committed at the same moment is either
    seen here or sees the paused run and resumes it: never lost.
    """
    with atomic(lease):
        # The lock order (docs/architecture.md): policies, then this run, then its ancestors.
        chain = holds.chain_of(lease.run_id)
        holds.lock_policies(chain)
        event_seq = fence(lease, Fence(progress=True))
        holds.lock_ancestors(chain)
        # Read again under the lock: a halt of this run may have landed since `chain_of`.
        columns = ("id", "parent_id", "workflow", "halted_at", "halted_by", "halt_reason")
        run = Run.objects.only(*columns, "created_at").get(pk=lease.run_id)

        def moment(value: datetime | None):
            return Cast(Value(value), output_field=DateTimeField())  # a typed NULL too

        status_cases = [When(holds.covered(), then=Value(RunStatus.HALTED))]
        wake_cases = [When(holds.covered(), then=moment(None))]
        if over is not None:
            still = _still_over(run, over)
            status_cases.append(When(still, then=Value(RunStatus.OVER_BUDGET)))
            wake = None if over.budget == "run" else next_day_start()
            wake_cases.append(When(still, then=moment(wake)))
        Run.objects.filter(pk=lease.run_id).update(
            status=Case(*status_cases, default=Value(status)),
            wake_at=Case(*wake_cases, default=moment(wake_at)),
            worker=None,
            lease_until=None,
            **fields,
        )
        outcome = Run.objects.filter(pk=lease.run_id).values_list("status", flat=True)[0]
        if outcome == RunStatus.HALTED and event in (
            EventType.RUN_HALTED,
            EventType.BUDGET_EXCEEDED,
        ):
            hold = holds.holds_on(run)[0]
            event, payload = (
                EventType.RUN_HALTED,
                {"scope": hold.scope, "by": hold.by, "reason": hold.reason},
            )
        elif outcome == RunStatus.PENDING and event in (
            EventType.RUN_HALTED,
            EventType.BUDGET_EXCEEDED,
        ):
            lifted = "hold was lifted" if event == EventType.RUN_HALTED else "budget was changed"
            event, payload = EventType.RUN_REQUEUED, {"reason": f"the {lifted} as the run paused"}
        elif outcome == RunStatus.HALTED:
            payload = {**payload, "halted": [h.as_json() for h in holds.holds_on(run)]}
        if event == EventType.BUDGET_EXCEEDED and _crossed_before(run, payload):
            payload = {**payload, "repeat": True}  # recorded, not alerted again
        append_event(lease.run_id, event_seq, event, **payload)
    if outcome == RunStatus.PENDING:
        transaction.on_commit(notify_runnable)
    return outcome


def _crossed_before(run: Run, payload: dict) -> bool:
    """Whether the run's last over-budget pause was the same crossing: the same budget and
    limit (and, for a daily one, the same UTC day). An unhalt or a release requeues a run that
    a budget still refuses; its pause is recorded again, but one crossing is alerted once."""
    last = (
        Event.objects.of(run)
        .filter(type=EventType.BUDGET_EXCEEDED)
        .order_by("-seq")
        .values_list("payload", "created_at")
        .first()
    )
    if last is None:
        return False
    before, at = last
    same = all(before.get(k) == payload.get(k) for k in ("budget", "unit", "limit"))
    daily = payload.get("budget") != "run"
    today = timezone.now().astimezone(UTC).date()
    return same and (not daily or at.astimezone(UTC).date() == today)


def _still_over(run: Run, stop: OverBudget) -> Q:
    """The condition under which an over-budget pause still stands: the limit that refused
    the step is unchanged (a run's own in the statement; a shared one under its row lock)."""
    if stop.budget == "run":
        column = "budget_micros" if stop.unit == "micro-USD" else "budget_tokens"
        return Q(**{column: stop.limit})
    scope = stop.scope or (GLOBAL if stop.budget == "global daily" else run.workflow)
    column = "daily_budget_micros" if stop.unit == "micro-USD" else "daily_budget_tokens"
    current = Policy.objects.filter(scope=scope).values_list(column, flat=True).first()
    return Q(pk=run.pk) if current == stop.limit else ~Q(pk=run.pk)


def release(lease: Lease, reason: str) -> bool:
    """Give the run back to the queue now (SIGTERM), bumping the epoch so we cannot write again.
    A run a hold covers goes to `halted` instead of `pending`."""
    try:
        _give_back(
            lease,
            EventType.RUN_RELEASED,
            {"reason": reason},
            status=RunStatus.PENDING,
            wake_at=timezone.now(),
            lease_epoch=F("lease_epoch") + 1,
        )
    except (LeaseLost, Cancelled):
        return False
    return True


def run_sync(fn: Callable, engine: Engine, input: Any) -> Any:
    return fn(RunContext(engine), input)


def _pause(run: Run, lease: Lease, stop: Halted | OverBudget) -> Outcome:
    """Park a run that must not take its next step: halted by a hold, or over budget.

    It holds no worker; only an unhalt or a changed budget makes it runnable again (and if
    either landed while we were pausing, `_give_back` sees it and requeues the run)."""
    try:
        if isinstance(stop, Halted):
            # `pending` unless a hold still covers the run when the pause is written.
            return Outcome(
                _give_back(
                    lease,
                    EventType.RUN_HALTED,
                    {"scope": stop.scope, "by": stop.by, "reason": stop.reason},
                    status=RunStatus.PENDING,
                    wake_at=timezone.now(),
                )
            )
        payload: dict[str, Any] = {
            "budget": stop.budget,
            "unit": stop.unit,
            "limit": stop.limit,
            "spent": stop.spent,
            "estimate": stop.estimate,
        }
        outcome = _give_back(
            lease, EventType.BUDGET_EXCEEDED, payload, status=RunStatus.PENDING,
            wake_at=timezone.now(), over=stop,
        )  # fmt: skip
        if outcome == RunStatus.OVER_BUDGET:
            log.warning("run %s paused: %s", run.id, stop)
        return Outcome(outcome)
    except LeaseLost:
        return Outcome.LOST


def _cancelled(run: Run, engine: Engine, lease: Lease) -> Outcome:
    engine.execution.cancel_requested = True
    try:
        undone, failure = run_compensations(engine)
        who = Run.objects.filter(pk=run.pk).values("cancel_requested_by", "cancel_reason").get()
        if failure is not None:
            _finish(
                lease,
                EventType.RUN_FAILED,
                {"reason": "a compensation failed after a cancel", "error": failure["message"]},
                parent_id=run.parent_id,
                status=RunStatus.FAILED,
                error={**failure, "reason": "a compensation failed after a cancel"},
                finished_at=timezone.now(),
                worker=None,
                lease_until=None,
            )
            return Outcome.FAILED
        _finish(
            lease,
            EventType.RUN_CANCELLED,
            {
                "by": who["cancel_requested_by"],
                "reason": who["cancel_reason"],
                "compensated": undone,
            },
            parent_id=run.parent_id,
            status=RunStatus.CANCELLED,
            finished_at=timezone.now(),
            worker=None,
            lease_until=None,
        )
    except (LeaseLost, Released, Halted, OverBudget) as stop:
        return _interrupted(run, engine, lease, stop)
    return Outcome.CANCELLED


def _fail(run: Run, engine: Engine, lease: Lease, exc: BaseException) -> Outcome:
    """A run whose workflow raised: retried from the top while it has attempts left, unless
    the error says a retry cannot help. A step's failure the workflow let out uncaught ends
    the run at once (its policy already retried it, or called it final), as an activity's
    failure ends a Temporal workflow: the run's own attempts are for its own errors."""
    error = error_record(exc)
    retryable = getattr(exc, "retryable", True) and not isinstance(exc, StepFailed)
    try:
        if retryable and run.attempt < run.max_attempts:
            base = settings.STEPGUARD_RUN_RETRY_BASE_SECONDS * 2 ** (run.attempt - 1)
            delay = min(base, 300) * _JITTER.uniform(0.8, 1.2)
            wake_at = timezone.now() + timedelta(seconds=delay)
            outcome = _give_back(
                lease,
                EventType.RUN_RETRYING,
                {"attempt": run.attempt + 1, "wake_at": wake_at.isoformat(), "error": brief(exc)},
                status=RunStatus.PENDING,
                wake_at=wake_at,
                attempt=F("attempt") + 1,
                error=error,
            )
            if outcome == RunStatus.HALTED:
                return Outcome.HALTED
            log.info(
                "run %s: attempt %s failed (%s); retrying in %.1fs",
                run.id, run.attempt, error["message"], delay,
            )  # fmt: skip
            return Outcome.RETRYING
        reason = _why_final(exc) if not retryable else f"{run.max_attempts} attempts used"
        if isinstance(exc, StepFailed):
            error["final"] = not exc.retryable
        # After a non-determinism error the recorded positions no longer match the code, so
        # compensating would itself misfire: leave that to a person.
        if isinstance(exc, NonDeterminismError):
            undone: list[str] = []
            failure: dict | None = None
        else:
            undone, failure = run_compensations(engine)
        if failure is not None:
            error["compensation_error"] = failure
        _finish(
            lease,
            EventType.RUN_FAILED,
            {"error": brief(exc), "reason": reason, "compensated": undone},
            parent_id=run.parent_id,
            status=RunStatus.FAILED,
            error={**error, "reason": reason},
            finished_at=timezone.now(),
            worker=None,
            lease_until=None,
        )
    except (LeaseLost, Released, Cancelled, Halted, OverBudget) as stop:
        return _interrupted(run, engine, lease, stop)
    log.warning("run %s failed (%s): %s", run.id, reason, error["message"])
    return Outcome.FAILED


def _why_final(exc: BaseException) -> str:
    """Why a run is failed without a retry from the top, in the words of its error."""
    if not isinstance(exc, StepFailed):
        return "not retryable"
    cause = exc.error.get("type", "its error")
    if not exc.retryable:
        return f"step {exc.key!r} failed with {cause}, which its retry policy calls final"
    tries = exc.error.get("attempts")
    after = f"after {tries} attempt{'s' if tries != 1 else ''}" if tries else "after its retries"
    return f"step {exc.key!r} failed {after} ({cause}): its retry policy gave up"


def _interrupted(
    run: Run,
    engine: Engine,
    lease: Lease,
    stop: LeaseLost | Released | Cancelled | Halted | OverBudget,
) -> Outcome:
    """What a control-flow exception means for a run, raised while it ran or while it ended:
    the lease is gone, the worker is stopping, a cancel came, or a hold or a budget stops it."""
    if isinstance(stop, LeaseLost):
        return Outcome.LOST
    if isinstance(stop, Released):
        return Outcome.RELEASED if release(lease, "worker shutting down") else Outcome.LOST
    if isinstance(stop, Cancelled):
        return _cancelled(run, engine, lease)
    return _pause(run, lease, stop)


def run_compensations(engine: Engine) -> tuple[list[str], dict | None]:
    """Returns the undone step keys and, if an undo failed, its error. Control flow passes."""
    try:
        undo, ex = engine.steps.run_step, engine.execution
        return ex.undo.run(
            ex.who.run_id,
            ex.history.seek_undo,
            lambda key, compensate, output: undo(
                f"undo:{key}", compensate, (output,), {}, internal=True
            ),
        ), None
    except Exception as exc:
        return [], error_record(exc)
