"""Actions on one run: cancel and retry (and why a queued run is not being served)."""

from __future__ import annotations

from datetime import timedelta
from itertools import chain

from django.conf import settings
from django.db import transaction
from django.db.models import Case, Value, When
from django.utils import timezone

from runs.engine import holds
from runs.engine.store import append_event, run_event, wake_parent
from runs.engine.wakeup import notify_runnable
from runs.errors import Conflict, OperationError
from runs.models import EventType, Run, RunStatus, Step, Worker
from runs.operations.common import find_run, lock_run, needs_reason, require, retried_on_deadlock


@retried_on_deadlock
def cancel_run(run_id, user, reason: str) -> Run:
    """Cancel a run and its unfinished descendants: each stops at its next step boundary (or
    wait), the compensations of its completed steps run newest first, and it ends `cancelled`.
    """
    user = require(user, "runs.cancel_run", "cancel runs")
    reason = needs_reason(reason, "a cancel")
    actor = user.get_username()
    with transaction.atomic():
        holds.serialise_hold_changes()  # it may requeue a run paused over budget
        root = find_run(run_id)
        # Children first, deepest first (the order a finishing child locks: itself, then its
        # parent), so they stop spending and undo their own steps; the parent is woken by them.
        for member in holds.descendants(root.pk):
            _request_cancel(lock_run(member), actor, f"parent run {root.pk} cancelled: {reason}")
        run = lock_run(root.pk)
        if run.is_terminal:
            raise Conflict(f"run {run.pk} is already {run.status}")
        if run.cancel_requested_at is not None:
            raise Conflict(
                f"run {run.pk} is already being cancelled (by {run.cancel_requested_by})"
            )
        _request_cancel(run, actor, reason)
    run.refresh_from_db()
    return run


def _request_cancel(run: Run, actor: str, reason: str) -> None:
    """Record a cancel on a locked run (unless it ended or is being cancelled already)."""
    if run.is_terminal or run.cancel_requested_at is not None:
        return
    now = timezone.now()
    fields = {"cancel_requested_at": now, "cancel_requested_by": actor, "cancel_reason": reason}
    never_ran = (
        run.status in (RunStatus.PENDING, RunStatus.HALTED)
        and not Step.objects.filter(run=run).exists()
    )
    if never_ran:
        # Nothing to stop or undo, and perhaps no worker that serves it: end it here.
        Run.objects.filter(pk=run.pk).update(
            status=RunStatus.CANCELLED, finished_at=now, event_seq=run.event_seq + 1, **fields
        )
        append_event(run.pk, run.event_seq + 1, EventType.RUN_CANCELLED, "", actor, reason=reason)
        wake_parent(run.pk, RunStatus.CANCELLED)
        return
    if run.status == RunStatus.OVER_BUDGET:
        # A run paused over budget wakes too: cancelling is how its compensations run (a hold
        # still stops them: the run goes to `halted` if one covers it).
        fields |= {"status": requeued(), "wake_at": now}
        transaction.on_commit(notify_runnable)
    Run.objects.filter(pk=run.pk).update(**fields)
    run_event(run.pk, EventType.RUN_CANCEL_REQUESTED, wake=True, actor=actor, reason=reason)


def requeued() -> Case:
    """The status of a run made runnable again: `halted` if a hold covers it (checked in the
    statement that writes it), else `pending`."""
    return Case(
        When(holds.covered(), then=Value(RunStatus.HALTED)), default=Value(RunStatus.PENDING)
    )


def unserved_reason(run: Run) -> str | None:
    """Why a runnable run is not moving, when the cause is that no live worker has its code."""
    if run.status not in (RunStatus.PENDING, RunStatus.WAITING):
        return None
    cutoff = timezone.now() - timedelta(seconds=3 * settings.STEPGUARD_LEASE_SECONDS)
    live = Worker.objects.filter(heartbeat_at__gte=cutoff, stopped_at__isnull=True)
    served = set(chain.from_iterable(live.values_list("workflows", flat=True)))
    ref = f"{run.workflow}@{run.version}"
    if ref in served:
        return None
    others = sorted(r for r in served if r.startswith(f"{run.workflow}@"))
    note = f" (live workers serve {', '.join(others)})" if others else ""
    return f"no live worker serves {ref}{note}"


def compensated(run: Run) -> bool:
    """Whether the run's compensations ran: it is forked from a step then, never retried."""
    return run.steps.filter(key__startswith="undo:").exists()


@retried_on_deadlock
def retry_run(run_id, user, reason: str) -> Run:
    """Run a failed run again from the top: completed steps stay memoized, the failed one runs."""
    user = require(user, "runs.retry_run", "retry runs")
    reason = needs_reason(reason, "a retry")
    with transaction.atomic():
        # The rows whose holds cover the run, in the lock order (policies, the run, its
        # ancestors), before the statement that decides `halted` or `pending`.
        chain = holds.lineage(find_run(run_id))
        holds.lock_policies(chain)
        run = lock_run(run_id)
        holds.lock_ancestors(chain)
        if run.status != RunStatus.FAILED:
            raise Conflict(f"run {run.pk} is {run.status}; only failed runs are retried")
        if compensated(run):
            raise OperationError(f"run {run.pk} was compensated; fork it from a step instead")
        Run.objects.filter(pk=run.pk).update(
            status=requeued(),  # halted if a hold covers it: a retry lifts no halt
            attempt=run.attempt + 1,
            max_attempts=max(run.max_attempts, run.attempt + 1),
            recoveries=0,
            finished_at=None,
            wake_at=timezone.now(),
        )
        run_event(run.pk, EventType.RUN_RETRY_REQUESTED, actor=user.get_username(), reason=reason)
        transaction.on_commit(notify_runnable)
    run.refresh_from_db()
    return run
