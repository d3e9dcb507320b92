"""The few writes everything else is built from: fenced writes, run events, new runs.

Every write to a run's history first updates the run row: that row lock orders it against
claims, wake-ups and operator actions on the same run, on PostgreSQL and on SQLite alike.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Iterable
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import Any, NoReturn

from django.conf import settings
from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from runs import tracing
from runs.engine import statements
from runs.engine.cursors import hot_cursor
from runs.engine.fences import (
    CONDITIONS,
    Completion,
    Fence,
    Lease,
    carrying_statement,
    completed_event,
    db_id,
    event_fields,
    fence_statement,
    prep,
    step_defaults,
)
from runs.engine.holds import covered, lock_covering
from runs.engine.outage import is_disconnect
from runs.engine.wakeup import doorbell, notify_runnable
from runs.errors import LeaseLost, StepMisuse
from runs.logcontext import event_written
from runs.models import Event, EventType, Run, RunShaper, RunStatus, Shaped, Step, StepStatus

log = logging.getLogger("stepguard.executor")


def fence(lease: Lease, checks: Fence = Fence()) -> int:
    """Check we still own the run and reserve `checks.events` event seqs; return the first.

    Must run inside a transaction: the UPDATE row-locks the run until commit, so a concurrent
    claim (which bumps the epoch) or operator action is ordered before or after this whole
    write, never inside it. What else it checks and changes is `checks` (see Fence). A pending
    completion is written by the same statement (PostgreSQL) or transaction, its event first.
    """
    with lease.lock:
        return _fence(lease, checks)


def _fence(lease: Lease, checks: Fence) -> int:
    _own_transaction(lease)
    pending = lease.pending
    total = _with_pending(lease, checks)
    sql, params = fence_statement(lease, total)
    if pending is not None and connection.vendor == "postgresql":
        tail = "SELECT event_seq FROM f"
        sql, params = carrying_statement(pending, lease, sql, params, checks.events, tail)
    with hot_cursor() as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
    if row is None or row[0] is None:
        refused(lease, checks)
    first = row[0] - total.events + 1
    if pending is not None:
        if connection.vendor != "postgresql":
            # Only a step still `started`: the heart may have written it (carrying_statement).
            if Step.objects.filter(pk=pending.step_id, status=StepStatus.STARTED).update(
                **pending.fields
            ):
                Event.objects.create(
                    run_id=lease.run_id, seq=first, **completed_event(pending)
                )  # the doorbell rings for the write that carried it
        else:
            event_written(lease.run_id, EventType.STEP_COMPLETED, pending.key)
        _carried(lease, pending)
        lease.pending = None
        first += 1
    return first


def complete_later(lease: Lease, completion: Completion) -> None:
    """Let a finished step's checkpoint ride with the run's next write: one commit per step.

    A crash before that write re-sends the step with its same idempotency key, exactly as a
    crash during the step does. Every write of the execution carries it (the next step's
    start, a wait, the run's end, a pause, a release), and when the workflow works between
    steps for longer than STEPGUARD_COMPLETION_WINDOW the completion writer writes it by
    itself: that window is all a crash can re-send.
    """
    with lease.lock:
        flush(lease)  # never two: a completion always has a write after it (the next start)
        lease.pending = completion
        lease.pending_at = time.monotonic()
    # Inside a transaction (a test's) no other connection could see the rows to update.
    if connection.in_atomic_block:
        return
    # A worker's heart (a process of its own, runs/engine/heart.py) gets it before control
    # goes back to workflow code, which may hold the GIL for seconds; without one (an
    # execution in a test or a bench), this process's completion writer thread.
    if lease.heart is None or not lease.heart.completion(lease, completion):
        completion_writer.watch(lease)


def flush(lease: Lease, lock_wait: float | None = None) -> None:
    """Write the pending completion now, by itself: before a transaction step, whose
    transaction holds business writes for as long as its function runs; by the heart.

    A write of the fence alone carrying it (`carrying_statement`): like every write of a
    completion, it changes nothing if the step is no longer `started` (the heart wrote it).
    With `lock_wait`, it waits at most that long for the run row."""
    with lease.lock:
        if lease.pending is None:
            return
        bound = nullcontext() if lock_wait is None else _bounded_lock_wait(lock_wait)
        with atomic(lease), bound:
            fence(lease, Fence(events=0))
        transaction.on_commit(lambda: doorbell.ring(lease.run_id), robust=True)


def _carried(lease: Lease, pending: Completion) -> None:
    """Tell the worker's heart, once this commits, that this execution wrote `pending`."""
    if (heart := lease.heart) is not None:
        transaction.on_commit(lambda: heart.carried(pending.step_id), robust=True)


def flush_unrecorded(lease: Lease) -> None:
    """`flush`, unless the write that carried the completion committed though its connection
    broke before the answer (the step row already says so): then it is only forgotten."""
    pending = lease.pending
    if pending is None:
        return
    if Step.objects.filter(pk=pending.step_id, status=StepStatus.STARTED).exists():
        flush(lease)
    else:
        lease.pending = None


class CompletionWriter:
    """Writes the completions that no write of their execution carried in time.

    One thread per process looks at the leases with a completion pending ten times a window
    and writes those older than STEPGUARD_COMPLETION_WINDOW, each in a write of its own under
    the lease's lock. It never waits for a lease's lock (its execution is writing, and carries
    the completion), and waits for the run row at most STEPGUARD_COMPLETION_WINDOW: an
    execution thread that holds the row in a transaction of its own gets it then.
    """

    def __init__(self):
        self._cond = threading.Condition()
        self._leases: dict[int, Lease] = {}
        self._thread: threading.Thread | None = None
        self._stopped = False

    def watch(self, lease: Lease) -> None:
        with self._cond:
            if id(lease) in self._leases or self._stopped:
                return
            self._leases[id(lease)] = lease
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._loop, name="stepguard-completions", daemon=True
                )
                self._thread.start()
                atexit.register(self.stop)
            elif len(self._leases) == 1:
                self._cond.notify()

    def stop(self) -> None:
        """At exit: end the thread before the interpreter finalizes, so no daemon thread wakes
        into a dying interpreter (a worker aborted once with "exception not rethrown")."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(1.0)

    def _loop(self) -> None:
        while True:
            window = settings.STEPGUARD_COMPLETION_WINDOW
            with self._cond:
                while not self._leases and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                self._cond.wait(window / 10)
                leases = list(self._leases.values())
            now = time.monotonic()
            for lease in leases:
                if lease.pending is None or lease.lost.is_set():
                    with self._cond:
                        if lease.pending is None or lease.lost.is_set():
                            self._leases.pop(id(lease), None)
                elif now - lease.pending_at >= window:
                    self.write(lease)

    def write(self, lease: Lease, *, wait: float = 0.0) -> None:
        """Write `lease`'s pending completion now, if its execution is not writing (waiting
        up to `wait` seconds for it to finish a write)."""
        if not (lease.lock.acquire(timeout=wait) if wait else lease.lock.acquire(False)):
            return
        try:
            if lease.pending is None or lease.lost.is_set():
                return
            with atomic(lease), _bounded_lock_wait(settings.STEPGUARD_COMPLETION_WINDOW):
                flush_unrecorded(lease)
        except LeaseLost:
            pass
        except DatabaseError as exc:
            if is_disconnect(exc):
                # Left to the execution's carry-on after the outage (which the outage handling
                # tells, once): not asked again every tick while the database is down.
                with self._cond:
                    self._leases.pop(id(lease), None)
            # Otherwise a lock held past the window: tried again at the next look.
            log.debug("run %s: a completion not written yet: %s", lease.run_id, exc)
            connection.close_if_unusable_or_obsolete()
        finally:
            lease.lock.release()


completion_writer = CompletionWriter()


@contextmanager
def _bounded_lock_wait(seconds: float):
    """Wait at most `seconds` for a row or table lock inside the block: transaction-local on
    PostgreSQL, restored afterwards on SQLite (where it belongs to the connection)."""
    millis = max(1, int(seconds * 1000))
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT set_config('lock_timeout', %(timeout)s, true)", {"timeout": f"{millis}ms"}
            )
        yield
        return
    with connection.cursor() as cursor:  # SQLite
        cursor.execute("PRAGMA busy_timeout")
        before = int(cursor.fetchone()[0])
        cursor.execute(f"PRAGMA busy_timeout = {millis}")
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"PRAGMA busy_timeout = {before}")


@contextmanager
def atomic(lease: Lease):
    """`transaction.atomic()` for writes that may carry the pending completion: if the block
    fails, its writes roll back, the completion among them, so it is pending again."""
    with lease.lock:
        pending = lease.pending
        lease.depth += 1
        try:
            with transaction.atomic():
                yield
        except BaseException:
            lease.pending = pending
            raise
        finally:
            lease.depth -= 1


def _own_transaction(lease: Lease) -> None:
    """Refuse a checkpoint write inside a transaction the engine does not own.

    A step's checkpoint must commit when the engine says so: inside workflow code's own
    `transaction.atomic()` its rows (and the completion before it) would be rolled back with
    that block after the step's side effect happened. The test suite's per-test transaction is
    not the workflow's, and is allowed.
    """
    if lease.depth or not connection.in_atomic_block:
        return
    if all(getattr(block, "_from_testcase", False) for block in connection.atomic_blocks):
        return
    raise StepMisuse(
        "a step inside transaction.atomic(): a step's checkpoint commits on its own; "
        "use ctx.transaction for database writes that must commit with a step"
    )


def _with_pending(lease: Lease, checks: Fence) -> Fence:
    """The fence of a write that also carries the pending completion: one more event, and the
    completion's progress."""
    if lease.pending is None:
        return checks
    return replace(
        checks, events=checks.events + 1, progress=checks.progress or lease.pending.progress
    )


def refused(lease: Lease, checks: Fence = Fence()) -> NoReturn:
    """Raise the reason a fenced write was refused: the run is no longer ours, or the first
    of CONDITIONS that the run row breaks."""
    run = Run.objects.filter(pk=lease.run_id).first()
    if run is None or run.lease_epoch != lease.epoch or run.status != RunStatus.RUNNING:
        lease.lost.set()
        raise LeaseLost(f"run {lease.run_id}: lease epoch {lease.epoch} is no longer current")
    for condition in CONDITIONS:
        if condition.applies(checks) and (reason := condition.refusal(run, checks)) is not None:
            raise reason
    lease.lost.set()
    raise LeaseLost(f"run {lease.run_id}: write refused")


def append_event(
    run_id, seq: int, type: str, step_key: str = "", actor: str = "system", /, **payload
):
    # After the commit, or a page woken early finds nothing and waits for its next poll.
    transaction.on_commit(lambda: doorbell.ring(run_id), robust=True)
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
    run_id,
    type: str,
    /,
    *,
    wake: bool = False,
    actor: str = "system",
    step_key: str = "",
    **payload,
) -> str:
    """Append an event to a run's history without holding its lease (signals, decisions...).

    With `wake`, a waiting run becomes runnable now, in the same statement. Returns the run's
    status after the update. Call inside a transaction.
    """
    params: dict[str, Any] = {"run": db_id(run_id)}
    if wake:
        now = connection.ops.adapt_datetimefield_value(timezone.now())
        params.update(waiting=RunStatus.WAITING, now=now, pending=RunStatus.PENDING)
    with connection.cursor() as cursor:
        cursor.execute(statements.RUN_EVENT_WAKING if wake else statements.RUN_EVENT, params)
        row = cursor.fetchone()
    if row is None:
        raise Run.DoesNotExist(f"no run with id {run_id}")
    seq, status = row
    append_event(run_id, seq, type, step_key, actor, **payload)
    if wake and status == RunStatus.PENDING:
        transaction.on_commit(notify_runnable)
    return status


def create_run(
    *,
    workflow: str,
    version: str,
    input: Any,
    key: str | None,
    parent_id=None,
    actor: str = "system",
    created: dict | None = None,
    shapers: Iterable[tuple[Any, str]] = (),
    **fields,
) -> Run:
    """Insert a runnable run and its first event (by `actor`, with `created` in its payload),
    and the people who shaped it (`shapers`: (user id, Shaped); its starter is one). Call
    inside a transaction.

    Whether it starts `halted` is decided after locking the rows whose holds would cover it
    (`holds.lock_covering`): a caller that holds run rows already locks them first, in the
    lock order."""
    lock_covering(workflow, parent_id)
    fields.setdefault("max_attempts", settings.STEPGUARD_RUN_MAX_ATTEMPTS)
    fields.setdefault("trace_context", tracing.carrier_for_new_run(workflow))
    fields.setdefault("wake_at", timezone.now())  # a debounced run: when its quiet period ends
    run = Run.objects.create(
        workflow=workflow,
        version=version,
        input=input,
        key=key,
        parent_id=parent_id,
        event_seq=1,
        **fields,
    )
    append_event(
        run.id, 1, EventType.RUN_CREATED, "", actor, workflow=f"{workflow}@{version}", key=key,
        **(created or {}),
    )  # fmt: skip
    starter = fields.get("started_by")
    shaped = [*([(starter.pk, Shaped.STARTED)] if starter is not None else []), *shapers]
    record_shapers(run.pk, shaped)
    # A run created under a hold (its workflow's, its parent's, the kill switch) is halted
    # from the start: its status says what stops it.
    Run.objects.filter(covered(), pk=run.pk, status=RunStatus.PENDING).update(
        status=RunStatus.HALTED
    )

    transaction.on_commit(notify_runnable)
    return run


def fenced_write(
    lease: Lease,
    event: tuple[str, str, dict],
    checks: Fence = Fence(),
    *,
    insert_step: dict | None = None,
    update_step: tuple[int, dict] | None = None,
) -> int | None:
    """One fenced checkpoint write: insert or update a step and append its event, atomically.

    On PostgreSQL this is a single statement (data-modifying CTEs: fence, step, event), one
    round trip and one commit, carrying the pending completion if there is one; elsewhere the
    same statements in a transaction. Returns the step's id. Raises like `fence` when the run
    is no longer ours to write.
    """
    with lease.lock:
        return _fenced_write(lease, event, checks, insert_step, update_step)


def _fenced_write(
    lease: Lease,
    event: tuple[str, str, dict],
    checks: Fence,
    insert_step: dict | None,
    update_step: tuple[int, dict] | None,
) -> int | None:
    type_, key, payload = event
    _own_transaction(lease)
    if update_step is not None and lease.pending and lease.pending.step_id == update_step[0]:
        flush(lease)  # one statement must not update the same step row twice
    if connection.vendor != "postgresql":
        return _fenced_write_plain(lease, event, checks, insert_step, update_step)
    pending = lease.pending
    sql, params = fence_statement(lease, _with_pending(lease, checks))
    if pending is not None:  # its event takes the seq before this write's
        sql, params = carrying_statement(pending, lease, sql, params, 1, "")
    else:
        sql = statements.NOT_CARRIED.format(fence=sql)
    sql += _step_cte(params, insert_step, update_step)
    event_columns, event_placeholders, event_values = prep(
        Event, event_fields(key, type_, payload), "e_"
    )
    sql += statements.EVENT_APPENDED.format(
        columns=", ".join(event_columns), values=", ".join(event_placeholders)
    )
    params.update(event_values)
    asynchronous = (
        checks.starting
        and not checks.durable
        and not settings.STEPGUARD_DURABLE_START
        and pending is None
        and not connection.in_atomic_block
    )
    if asynchronous:
        # Opted out of (STEPGUARD_DURABLE_START=0): the write-ahead row then only marks a step
        # in flight, and a crash of the database server itself in the next ~0.2 s loses it,
        # so the step is re-sent as if it never started. A step that must be reconciled or
        # asked about (`durable`) never takes that risk, nor a write that carries a completion
        # or belongs to a larger transaction. Completions always commit durably.
        sql += statements.ANSWER_ASYNCHRONOUS
    else:
        sql += statements.ANSWER
    with hot_cursor() as cursor:
        cursor.execute(sql, params)
        seq, step_id, _ = cursor.fetchone()
    if seq is None:
        refused(lease, checks)
    if pending is not None:
        event_written(lease.run_id, EventType.STEP_COMPLETED, pending.key)
        _carried(lease, pending)
    event_written(lease.run_id, type_, key)
    lease.pending = None
    transaction.on_commit(lambda: doorbell.ring(lease.run_id), robust=True)
    return step_id


def _fenced_write_plain(
    lease: Lease,
    event: tuple[str, str, dict],
    checks: Fence,
    insert_step: dict | None,
    update_step: tuple[int, dict] | None,
) -> int | None:
    """`_fenced_write` as a transaction of separate statements (SQLite)."""
    type_, key, payload = event
    with atomic(lease):
        seq = fence(lease, checks)
        step_id = None
        if insert_step is not None:
            step_id = Step.objects.create(run_id=lease.run_id, **insert_step).pk
        elif update_step is not None:
            step_id = update_step[0]
            Step.objects.filter(pk=step_id).update(**update_step[1])
        append_event(lease.run_id, seq, type_, key, **payload)
    return step_id


def _step_cte(params: dict, insert_step: dict | None, update_step: tuple[int, dict] | None) -> str:
    """The step row's part of the fenced statement (`s`, its id), written only if the fence
    (`f`) passed; its parameters are added to `params`."""
    if insert_step is not None:
        columns, placeholders, values = prep(Step, {**step_defaults(), **insert_step}, "s_")
        params.update(values)
        return statements.STEP_INSERTED.format(
            columns=", ".join(columns), values=", ".join(placeholders)
        )
    if update_step is not None:
        columns, placeholders, values = prep(Step, update_step[1], "s_")
        params.update(values, step=update_step[0])
        return statements.STEP_UPDATED.format(sets=statements.assignments(columns, placeholders))
    return statements.NO_STEP


def record_shapers(run_id, shapers: Iterable[tuple[Any, str]]) -> None:
    """Record who shaped a run (the first way each person did is kept)."""
    wanted = [(user, how) for user, how in shapers if user]
    if not wanted:
        return
    # A schedule keeps the ids of who shaped it; one may have been deleted since.
    from django.contrib.auth import get_user_model

    users = get_user_model().objects.filter(pk__in={user for user, _ in wanted})
    known = set(users.values_list("pk", flat=True))
    rows = [RunShaper(run_id=run_id, user_id=u, how=how) for u, how in wanted if u in known]
    RunShaper.objects.bulk_create(rows, ignore_conflicts=True)


def wake_parent(run_id, status: str, parent_id=None) -> None:
    """Tell a child's parent (if any; looked up unless given) that the child ended. Inside the
    child's transaction: the lock order is child row, then parent row, as everywhere else."""
    if parent_id is None:
        parent_id = Run.objects.filter(pk=run_id).values_list("parent_id", flat=True).first()
    if parent_id is not None:
        run_event(parent_id, EventType.CHILD_FINISHED, wake=True, child=str(run_id), status=status)
