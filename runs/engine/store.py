"""The few writes everything else is built from: fenced writes, run events, new runs.

Every write to a run's history first updates the run row: that row lock orders it against
claims, wake-ups and operator actions on the same run, on PostgreSQL and on SQLite alike.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from django.db import connection, transaction
from django.utils import timezone

from runs.errors import Cancelled, LeaseLost
from runs.models import Event, Run, RunStatus


@dataclass
class Lease:
    """A worker's hold on one run; `lost` is set by the heartbeat or a refused write."""

    run_id: UUID
    epoch: int
    stopping: threading.Event = field(default_factory=threading.Event)
    lost: threading.Event = field(default_factory=threading.Event)


_TABLE = Run._meta.db_table


def _fence_sql(*, progress: bool, starting: bool) -> str:
    sets = "event_seq = event_seq + %s" + (", recoveries = 0" if progress else "")
    guard = " AND cancel_requested_at IS NULL" if starting else ""
    return (
        f"UPDATE {_TABLE} SET {sets} WHERE id = %s AND lease_epoch = %s AND status = %s{guard} "
        "RETURNING event_seq"
    )


_FENCES = {
    (progress, starting): _fence_sql(progress=progress, starting=starting)
    for progress in (False, True)
    for starting in (False, True)
}


def db_id(run_id) -> Any:
    return Run._meta.pk.get_db_prep_value(run_id, connection)


def fence(lease: Lease, events: int = 1, *, progress: bool = False, starting: bool = False) -> int:
    """Check we still own the run and reserve `events` event seqs; return the first.

    Must run inside a transaction: the UPDATE row-locks the run until commit, so a concurrent
    claim (which bumps the epoch) or operator action is ordered before or after this whole
    write, never inside it. `starting` writes (a step about to run) are also refused once a
    cancel was requested; writes that finish work already done are not.
    """
    with connection.cursor() as cursor:
        cursor.execute(
            _FENCES[(progress, starting)],
            [events, db_id(lease.run_id), lease.epoch, RunStatus.RUNNING],
        )
        row = cursor.fetchone()
    if row is not None:
        return row[0] - events + 1
    current = Run.objects.filter(pk=lease.run_id).values("lease_epoch", "status").first()
    if current and current["lease_epoch"] == lease.epoch and current["status"] == RunStatus.RUNNING:
        raise Cancelled("cancel requested")
    lease.lost.set()
    raise LeaseLost(f"run {lease.run_id}: lease epoch {lease.epoch} is no longer current")


def append_event(run_id, seq: int, type: str, step_key: str = "", actor: str = "system", **payload):
    return Event.objects.create(
        run_id=run_id,
        seq=seq,
        type=type,
        step_key=step_key,
        actor=actor,
        payload=payload,
        created_at=timezone.now(),
    )


def run_event(
    run_id, type: str, *, wake: bool = False, actor: str = "system", step_key: str = "", **payload
) -> str:
    """Append an event to a run's history without holding its lease (signals, decisions...).

    With `wake`, a waiting run becomes runnable now, in the same statement. Returns the run's
    status after the update. Call inside a transaction.
    """
    sets = "event_seq = event_seq + 1"
    params: list[Any] = []
    if wake:
        now = connection.ops.adapt_datetimefield_value(timezone.now())
        sets += (
            ", wake_at = CASE WHEN status = %s THEN %s ELSE wake_at END"
            ", status = CASE WHEN status = %s THEN %s ELSE status END"
        )
        params += [RunStatus.WAITING, now, RunStatus.WAITING, RunStatus.PENDING]
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {_TABLE} SET {sets} WHERE id = %s RETURNING event_seq, status",
            [*params, db_id(run_id)],
        )
        row = cursor.fetchone()
    if row is None:
        raise Run.DoesNotExist(f"no run with id {run_id}")
    seq, status = row
    append_event(run_id, seq, type, step_key, actor, **payload)
    if wake and status == RunStatus.PENDING:
        from runs.engine.wakeup import notify_runnable

        transaction.on_commit(notify_runnable)
    return status


def create_run(
    *, workflow: str, version: str, input: Any, key: str | None, parent_id=None, **fields
) -> Run:
    """Insert a runnable run and its first event. Call inside a transaction."""
    run = Run.objects.create(
        workflow=workflow,
        version=version,
        input=input,
        key=key,
        parent_id=parent_id,
        wake_at=timezone.now(),
        event_seq=1,
        **fields,
    )
    append_event(run.id, 1, "run.created", workflow=f"{workflow}@{version}", key=key)
    from runs.engine.wakeup import notify_runnable

    transaction.on_commit(notify_runnable)
    return run
