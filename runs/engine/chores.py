"""Chores: work a worker process does besides its runs, described by the part of Stepguard
that owns it and run by `worker.WorkerProcess`, which knows no more of a chore than this."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.utils import timezone


@dataclass(frozen=True)
class ChoreContext:
    """What a chore is told about the worker process that runs it."""

    worker: str  #: the worker's id
    workflows: frozenset[str]  #: the names of the workflows it serves


@dataclass(frozen=True)
class Chore:
    """Work a worker process does besides its runs, registered by the part of Stepguard that
    owns it (`runworker` gathers them); the worker knows no more of it than this.

    `run(context)` is called at start, then every `interval` seconds until the worker has
    stopped, on a thread of its own; it handles and logs its own errors, and decides for itself
    whether this worker is the one of all that does the work. A chore `between_claims` is
    called on the worker's loop instead, before it claims, at most every `interval` seconds
    (every poll interval if that is shorter), and stops when the worker stops claiming: an
    error there is logged under `name` and claiming goes on (a lost connection is the loop's
    to wait out). Its `next_due(context)`, if given, is when it next has work: an idle loop
    sleeps no longer than that. `start(context)`, if given, is called once on the worker's own
    thread before its first claim; an error there stops the worker.
    """

    name: str  #: what it does, as the log says it (a phrase: "<name> failed; ..."); unique
    interval: float
    run: Callable[[ChoreContext], object]
    between_claims: bool = False
    next_due: Callable[[ChoreContext], datetime | None] | None = None
    start: Callable[[ChoreContext], object] | None = None


def my_turn(name: str, worker: str, seconds: float) -> datetime | None:
    """`now` for the one worker that takes the chore `name`'s turn, None for every other: a
    conditional UPDATE moves its due time `seconds` on, so of many workers on many hosts
    exactly one sees a row count of 1."""
    from runs.models import Chore as ChoreRow

    now = timezone.now()
    ChoreRow.objects.get_or_create(name=name, defaults={"due_at": now})
    due = ChoreRow.objects.filter(name=name, due_at__lte=now)
    taken = due.update(due_at=now + timedelta(seconds=seconds), claimed_by=worker, claimed_at=now)
    return now if taken else None
