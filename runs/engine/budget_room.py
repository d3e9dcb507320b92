"""Room again on a shared daily budget: the runs that others' holds had paused resume."""

from __future__ import annotations

from django.db import transaction
from django.db.models import Case, Q, Value, When
from django.utils import timezone

from runs import labels as run_labels
from runs.engine import holds
from runs.engine.budget import daily_limits
from runs.engine.store import run_event
from runs.engine.wakeup import notify_runnable
from runs.models import GLOBAL, BudgetLedger, EventType, Run, RunStatus

#: The most paused runs one release resumes (oldest first): the rest wait for the next release
#: of the runs resumed, or for a raise, so a step's commit stays short.
RESUME_AT_ONCE = 200


def _in_scope(scope: str) -> Q:
    if scope == GLOBAL:
        return Q()
    if scope.startswith(run_labels.SCOPE_PREFIX):
        return run_labels.carrying(scope.removeprefix(run_labels.SCOPE_PREFIX))
    return Q(workflow=scope)


def resume_fitting(scopes: list[str], day) -> int:
    """Resume the runs paused over a shared daily budget of `scopes` whose ledger for today has
    room again (spent and held under each limit), now that a hold on it was released; return
    how many. A run refused because others' estimates filled the budget would otherwise wait
    for a raise or for midnight, with nothing held any more. Each re-checks at its next start
    (one that still does not fit pauses again; its alert is not sent twice).

    After the ledgers in the releasing transaction, against the lock order (docs/architecture.md):
    the paused runs are locked with SKIP LOCKED, so this never waits. A run locked meanwhile is
    being claimed or resumed already."""
    if not scopes or day != timezone.now().date():
        return 0
    limits = daily_limits(scopes)
    room = Q(pk__in=[])
    for row in BudgetLedger.objects.filter(day=day, scope__in=scopes).values():
        policy = limits.get(row["scope"], {})
        pairs = [
            (policy.get("daily_budget_micros"), row["spent_micros"] + row["reserved_micros"]),
            (policy.get("daily_budget_tokens"), row["spent_tokens"] + row["reserved_tokens"]),
        ]
        counted = [(limit, used) for limit, used in pairs if limit is not None]
        if counted and all(used < limit for limit, used in counted):
            room |= _in_scope(row["scope"])
    # Paused over a shared budget: their wake-up is the next midnight (a run's own budget: none).
    paused = Run.objects.filter(room, status=RunStatus.OVER_BUDGET, wake_at__isnull=False)
    ids = list(
        paused.order_by("created_at")
        .select_for_update(skip_locked=True)
        .values_list("id", flat=True)[:RESUME_AT_ONCE]
    )
    if not ids:
        return 0
    covered = When(holds.covered(), then=Value(RunStatus.HALTED))
    Run.objects.filter(pk__in=ids, status=RunStatus.OVER_BUDGET).update(
        status=Case(covered, default=Value(RunStatus.PENDING)), wake_at=timezone.now()
    )
    for run_id in ids:
        run_event(run_id, EventType.RUN_RESUMED, reason="budget reservations were released")
    transaction.on_commit(notify_runnable)
    return len(ids)
