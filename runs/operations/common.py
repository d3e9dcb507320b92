"""What every operator action shares: the acting user and the permission it needs, the run's
lock, the reason it must give, its audit event, and a retry when two actions deadlock.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, ParamSpec, TypeVar

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import OperationalError, connection
from django.utils import timezone

from runs.errors import Forbidden, NotFound, OperationError
from runs.models import Event, Run

log = logging.getLogger("stepguard.operations")


#: How often an operator action that lost a deadlock is tried again before the error stands.
DEADLOCK_TRIES = 3


def _deadlocked(exc: OperationalError) -> bool:
    return getattr(exc.__cause__, "sqlstate", None) == "40P01"


P = ParamSpec("P")


R = TypeVar("R")


def retried_on_deadlock(action: Callable[P, R]) -> Callable[P, R]:
    """An operator action chosen as a deadlock's victim is run again (its transaction rolled
    back whole), so a person never sees a 500, nor a kill switch that stayed on, because a
    worker happened to lock the same rows. Every path takes the documented lock order
    (docs/architecture.md); this is the second line. Not inside a caller's transaction: that
    one is aborted, and only its owner can try again."""

    @functools.wraps(action)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        attempt = 1
        while True:
            try:
                return action(*args, **kwargs)
            except OperationalError as exc:
                if not _deadlocked(exc) or attempt == DEADLOCK_TRIES or connection.in_atomic_block:
                    raise
                log.warning("%s lost a deadlock (try %s); trying again", action.__name__, attempt)
                attempt += 1

    return run


def in_utc(when: datetime, what: str) -> datetime:
    """A filter's date and time, made aware and in UTC; OperationError if it cannot be stored
    (year 1 at +14:00 is before the first representable instant, and would overflow later)."""
    try:
        if timezone.is_naive(when):
            when = timezone.make_aware(when)
        return when.astimezone(UTC)
    except (OverflowError, ValueError):
        raise OperationError(f"{what} {when.isoformat()!r} is out of range") from None


def resolve_user(user: AbstractBaseUser | str):
    """A User from a User or a username; inactive or unknown users are refused."""
    if isinstance(user, str):
        found = get_user_model().objects.filter(username=user).first()
        if found is None:
            raise NotFound(f"no user named {user!r}")
        user = found
    if not user.is_active:
        raise OperationError(f"user {user.get_username()!r} is inactive")
    return user


def require(user, permission: str, action: str):
    user = resolve_user(user)
    if not user.has_perm(permission):
        raise Forbidden(f"{user.get_username()} may not {action} (needs {permission})")
    return user


def lock_run(run_id) -> Run:
    """The run, row-locked until the end of the caller's transaction (SQLite: the whole DB)."""
    try:
        run = Run.objects.select_for_update().filter(pk=run_id).first()
    except (ValidationError, ValueError):
        run = None
    if run is None:
        raise NotFound(f"no run with id {run_id}")
    return run


def needs_reason(reason: str, action: str) -> str:
    if not reason or not reason.strip():
        raise OperationError(f"{action} needs a reason")
    return reason.strip()


def audit(actor: str, type: str, **payload) -> None:
    """An operator action on a workflow or on everything: an event of no single run."""
    Event.objects.create(
        run=None, seq=0, type=type, actor=actor, payload=payload, created_at=timezone.now()
    )


def find_run(run_id) -> Run:
    """The run, or NotFound naming the id (also for an id that is not a UUID at all)."""
    try:
        run = Run.objects.filter(pk=run_id).first()
    except (ValidationError, ValueError):
        run = None
    if run is None:
        raise NotFound(f"no run with id {run_id}")
    return run


KEEP: Any = object()
