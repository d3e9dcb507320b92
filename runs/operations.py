"""Operator actions on runs, shared by the CLI, the dashboard and the API.

Each action resolves the acting user, checks the matching permission, locks the run row, and
records an event with the actor, so the same action taken anywhere is the same function with
the same check and the same audit entry.
"""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from runs.engine.store import append_event, run_event, wake_parent
from runs.errors import OperationError
from runs.models import Run, RunStatus, Step


def resolve_user(user: AbstractBaseUser | str):
    """A User from a User or a username; inactive or unknown users are refused."""
    if isinstance(user, str):
        found = get_user_model().objects.filter(username=user).first()
        if found is None:
            raise OperationError(f"no user named {user!r}")
        user = found
    if not user.is_active:
        raise OperationError(f"user {user.get_username()!r} is inactive")
    return user


def require(user, permission: str, action: str):
    user = resolve_user(user)
    if not user.has_perm(permission):
        raise OperationError(f"{user.get_username()} may not {action} (needs {permission})")
    return user


def lock_run(run_id) -> Run:
    """The run, row-locked until the end of the caller's transaction (SQLite: the whole DB)."""
    try:
        run = Run.objects.select_for_update().filter(pk=run_id).first()
    except (ValidationError, ValueError):
        run = None
    if run is None:
        raise OperationError(f"no run with id {run_id}")
    return run


def cancel_run(run_id, user, reason: str) -> Run:
    """Cancel a run: it stops at its next step boundary (or wait), the compensations of its
    completed steps run newest first, and it ends `cancelled`."""
    user = require(user, "runs.cancel_run", "cancel runs")
    if not reason or not reason.strip():
        raise OperationError("a cancel needs a reason")
    actor = user.get_username()
    with transaction.atomic():
        run = lock_run(run_id)
        if run.is_terminal:
            raise OperationError(f"run {run.pk} is already {run.status}")
        if run.cancel_requested_at is not None:
            raise OperationError(
                f"run {run.pk} is already being cancelled (by {run.cancel_requested_by})"
            )
        now = timezone.now()
        fields = {"cancel_requested_at": now, "cancel_requested_by": actor, "cancel_reason": reason}
        never_ran = run.status == RunStatus.PENDING and not Step.objects.filter(run=run).exists()
        if never_ran:
            # Nothing to stop or undo, and perhaps no worker that serves it: end it here.
            Run.objects.filter(pk=run.pk).update(
                status=RunStatus.CANCELLED, finished_at=now, event_seq=run.event_seq + 1, **fields
            )
            append_event(run.pk, run.event_seq + 1, "run.cancelled", actor=actor, reason=reason)
            wake_parent(run.pk, RunStatus.CANCELLED)
        else:
            Run.objects.filter(pk=run.pk).update(**fields)
            run_event(run.pk, "run.cancel_requested", wake=True, actor=actor, reason=reason)
    run.refresh_from_db()
    return run


def unserved_reason(run: Run) -> str | None:
    """Why a runnable run is not moving, when the cause is that no live worker has its code."""
    from datetime import timedelta
    from itertools import chain

    from django.conf import settings

    from runs.models import Worker

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
