"""Flow control: a workflow's concurrency limits, a resource's rate limit, and schedules."""

from __future__ import annotations

from django.db import transaction
from django.utils import timezone

from runs import schedules
from runs.engine.wakeup import notify_runnable
from runs.errors import NotFound, OperationError
from runs.models import EventType, Policy, RateLimit, Run, RunStatus, Schedule, Step, StepStatus
from runs.operations.common import KEEP, audit, needs_reason, require, retried_on_deadlock
from runs.operations.halts import Target, known_scope


@retried_on_deadlock
def set_limits(workflow: str, user, reason: str, *, max_running=KEEP, max_running_per_key=KEEP):
    """An operator's concurrency limits of a workflow, over the code's; None returns to the
    code's. Applies from the next claim on; running runs finish."""
    user = require(user, "runs.set_flow", "set concurrency limits")
    reason = needs_reason(reason, "a limit change")
    target = Target("workflow", workflow)
    known_scope(target)
    changes = {"max_running": max_running, "max_running_per_key": max_running_per_key}
    changes = {k: v for k, v in changes.items() if v is not KEEP}
    if not changes:
        raise OperationError("give max_running, max_running_per_key or both")
    for name, value in changes.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise OperationError(f"{name} is a positive integer or null")
        if value is not None and not 1 <= value <= 100_000:
            raise OperationError(f"{name} must be between 1 and 100000 (null: the code's)")
    with transaction.atomic():
        policy, _ = Policy.objects.select_for_update().get_or_create(scope=workflow)
        before = {k: getattr(policy, k) for k in changes}
        Policy.objects.filter(pk=policy.pk).update(**changes)
        audit(user.get_username(), EventType.LIMITS_SET, workflow=workflow, reason=reason,
              before=before, after=changes)  # fmt: skip
    return Policy.objects.get(pk=policy.pk)


def save_schedule(user, name: str, **fields) -> Schedule:
    """Create or replace schedule `name` (runs.schedules.save's fields); audited."""
    user = require(user, "runs.set_flow", "manage schedules")
    require(user, "runs.add_run", "start runs on a schedule")
    with transaction.atomic():
        existed = Schedule.objects.filter(name=name).exists()
        schedule = schedules.save(name, **fields, created_by=user, shaped_by=[user.pk])
        audit(user.get_username(), EventType.SCHEDULE_CHANGED, schedule=name,
              change="replaced" if existed else "added", cron=schedule.cron,
              workflow=schedule.workflow)  # fmt: skip
    return schedule


def pause_schedule(user, name: str, paused: bool) -> Schedule:
    user = require(user, "runs.set_flow", "pause or resume schedules")
    with transaction.atomic():
        if not Schedule.objects.filter(name=name).exists():
            raise NotFound(f"no schedule named {name!r}")
        schedule = schedules.set_paused(name, paused, by=user)
        audit(user.get_username(), EventType.SCHEDULE_CHANGED, schedule=name,
              change="paused" if paused else "resumed")  # fmt: skip
    return schedule


def remove_schedule(user, name: str) -> None:
    """Delete a schedule; the runs it started stay."""
    user = require(user, "runs.set_flow", "remove schedules")
    with transaction.atomic():
        if not Schedule.objects.filter(name=name).delete()[0]:
            raise NotFound(f"no schedule named {name!r}")
        audit(user.get_username(), EventType.SCHEDULE_CHANGED, schedule=name, change="removed")


def set_rate_limit(
    resource: str, user, reason: str, *, requests=None, tokens=None, window_seconds: int = 60
) -> RateLimit | None:
    """At most `requests` calls and `tokens` tokens of `resource` (a model's name, or what a
    step declares with `resource=`) in any `window_seconds`, across all workers. Neither
    given: the limit is removed. Applies to the next call."""
    user = require(user, "runs.set_flow", "set rate limits")
    reason = needs_reason(reason, "a rate limit change")
    if not resource or len(resource) > 200 or "\x00" in resource:
        raise OperationError("a resource name is 1 to 200 characters")
    for name, value in (("requests", requests), ("tokens", tokens)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise OperationError(f"{name} is a positive integer or null")
    if isinstance(window_seconds, bool) or not isinstance(window_seconds, int):
        raise OperationError("window_seconds is an integer")
    if not 1 <= window_seconds <= 86400:
        raise OperationError("window_seconds must be between 1 and 86400")
    with transaction.atomic():
        before = RateLimit.objects.select_for_update().filter(resource=resource).first()
        was = None if before is None else {"requests": before.requests, "tokens": before.tokens,
                                           "window_seconds": before.window_seconds}  # fmt: skip
        if requests is None and tokens is None:
            if before is None:
                raise NotFound(f"no rate limit on {resource!r}")
            before.delete()
            limit = None
        else:
            limit, _ = RateLimit.objects.update_or_create(
                resource=resource,
                defaults={"requests": requests, "tokens": tokens, "window_seconds": window_seconds},
            )
        after = None if limit is None else {"requests": requests, "tokens": tokens,
                                            "window_seconds": window_seconds}  # fmt: skip
        audit(user.get_username(), EventType.RATE_LIMIT_SET, resource=resource, reason=reason,
              before=was, after=after)  # fmt: skip
    _wake_throttled(resource)
    return limit


def _wake_throttled(resource: str) -> None:
    """The runs waiting for `resource`'s capacity look again now, under the limit as it is
    (a raised or removed one lets them through; they waited out the old window before). One
    that still finds none waits again, until its new time. After the limit's own transaction:
    no run row is locked while the limit's is."""
    now = timezone.now()
    with transaction.atomic():
        throttled = Step.objects.filter(status=StepStatus.WAITING, error__throttled=resource)
        runs = list(throttled.values_list("run_id", flat=True).distinct())
        if not runs:
            return
        throttled.update(wake_at=now)
        Run.objects.filter(pk__in=runs, status=RunStatus.WAITING).update(wake_at=now)
        transaction.on_commit(notify_runnable)
