"""Budgets: a run's, and the daily budgets of a workflow, a label or everything."""

from __future__ import annotations

from decimal import Decimal

from django.db import transaction
from django.utils import timezone

from runs.engine import holds
from runs.engine.budget import count_the_day, forget_cached_scopes, to_micros
from runs.engine.store import run_event
from runs.engine.wakeup import notify_runnable
from runs.errors import OperationError
from runs.models import EventType, Policy, Run, RunStatus
from runs.operations.common import KEEP, audit, lock_run, needs_reason, require, retried_on_deadlock
from runs.operations.halts import in_scope, known_scope, parse_target
from runs.operations.run_actions import requeued


@retried_on_deadlock
def set_budget(
    target,
    user,
    reason: str,
    *,
    usd: Decimal | None = KEEP,
    tokens: int | None = KEEP,
    run_usd: Decimal | None = KEEP,
    run_tokens: int | None = KEEP,
) -> dict:
    """Set budgets. A run's `usd`/`tokens` are its own limits; a workflow's or everything's
    are shared daily limits, and `run_usd`/`run_tokens` the default budget of each new run.
    None removes a limit. Runs paused over budget in the target resume and re-check."""
    user = require(user, "runs.set_budget", "set budgets")
    reason = needs_reason(reason, "a budget change")
    target, actor = parse_target(target), user.get_username()

    def micros(value):
        if value in (KEEP, None):
            return value
        try:
            return to_micros(value)
        except ValueError as exc:
            raise OperationError(str(exc)) from None

    def count(value):
        if value in (KEEP, None):
            return value
        if not isinstance(value, int) or value < 0:
            raise OperationError("a token budget is a non-negative integer")
        return value

    if target.kind in ("run", "label") and (run_usd is not KEEP or run_tokens is not KEEP):
        raise OperationError("run defaults are set on a workflow or on everything")
    with transaction.atomic():
        holds.serialise_hold_changes()  # it requeues runs paused over budget, perhaps held
        if target.kind == "run":
            run = lock_run(target.value)
            changes = {"budget_micros": micros(usd), "budget_tokens": count(tokens)}
            changes = {k: v for k, v in changes.items() if v is not KEEP}
            before = {k: getattr(run, k) for k in changes}
            Run.objects.filter(pk=run.pk).update(**changes, budget_warned=False)
            run_event(
                run.pk, EventType.BUDGET_SET, actor=actor, reason=reason, before=before,
                after=changes,
            )  # fmt: skip
            affected = Run.objects.filter(pk=run.pk)
        else:
            known_scope(target)
            policy, _ = Policy.objects.select_for_update().get_or_create(scope=target.scope)
            changes = {
                "daily_budget_micros": micros(usd),
                "daily_budget_tokens": count(tokens),
                "run_budget_micros": micros(run_usd),
                "run_budget_tokens": count(run_tokens),
            }
            changes = {k: v for k, v in changes.items() if v is not KEEP}
            before = {k: getattr(policy, k) for k in changes}
            Policy.objects.filter(pk=policy.pk).update(**changes)
            audit(
                actor,
                EventType.BUDGET_SET,
                target=target.label,
                reason=reason,
                before=before,
                after=changes,
            )
            affected = Run.objects.filter(in_scope(target))
        for run_id in affected.filter(status=RunStatus.OVER_BUDGET).values_list("id", flat=True):
            Run.objects.filter(pk=run_id, status=RunStatus.OVER_BUDGET).update(
                status=requeued(), wake_at=timezone.now()
            )
            run_event(run_id, EventType.RUN_RESUMED, actor=actor, reason="budget raised")
            transaction.on_commit(notify_runnable)
        if target.kind != "run" and any(
            changes.get(k) is not None for k in ("daily_budget_micros", "daily_budget_tokens")
        ):
            count_the_day(target.scope)  # the day's spend so far counts, whenever it is set
    forget_cached_scopes()
    return changes
