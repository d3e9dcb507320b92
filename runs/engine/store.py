"""The few writes everything else is built from: fenced writes, run events, new runs.

Every write to a run's history first updates the run row: that row lock orders it against
claims, wake-ups and operator actions on the same run, on PostgreSQL and on SQLite alike.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any, NoReturn
from uuid import UUID

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, DatabaseError, connection, connections, transaction
from django.utils import timezone

from runs import tracing
from runs.engine.budget import NOTHING, Amount
from runs.engine.holds import covered, covered_sql, holds_on
from runs.engine.outage import is_disconnect
from runs.engine.wakeup import doorbell, notify_runnable
from runs.errors import Cancelled, Halted, LeaseLost, OverBudget, StepMisuse
from runs.logcontext import event_written
from runs.models import Event, EventType, Run, RunShaper, RunStatus, Shaped, Step, StepStatus

log = logging.getLogger("stepguard.executor")


@dataclass(frozen=True)
class Completion:
    """A finished step whose checkpoint travels with the run's next write (`complete_later`)."""

    step_id: int
    key: str
    payload: dict
    fields: dict
    progress: bool


@dataclass
class Lease:
    """A worker's hold on one run; `lost` is set by the heartbeat or a refused write.

    `pending` is the completion of the step that just finished, not yet written: the next
    fenced write of this execution carries it (see `complete_later`), or the completion
    writer does after STEPGUARD_COMPLETION_WINDOW. `lock` is held by whichever thread writes
    for the lease (the execution's for each write and engine transaction, the completion
    writer's for its write), so a completion is taken by exactly one write.
    """

    run_id: UUID
    epoch: int
    workflow: str = ""
    stopping: threading.Event = field(default_factory=threading.Event)
    lost: threading.Event = field(default_factory=threading.Event)
    pending: Completion | None = None
    pending_at: float = 0.0  # time.monotonic() when `pending` was set
    depth: int = 0  # how many of the engine's own `atomic` blocks are open
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)


_TABLE = Run._meta.db_table
_STEP = f'"{Step._meta.db_table}"'
_EVENT = f'"{Event._meta.db_table}"'


@dataclass(frozen=True)
class Spend:
    """What a finishing step adds to its run: usage, and the estimate it held, given back."""

    micros: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    held: Amount = NOTHING


@dataclass(frozen=True)
class Fence:
    """What a fenced write checks and changes on the run row, besides the lease (always).

    A `starting` write (a step about to run) is refused once the run is cancelled, covered by
    a hold, or its estimate does not fit the run's budget, which must not be spent already (not
    counting what the step holds from an attempt before a crash). Compensations are exempt from
    the cancel and the budgets, undoing must stay possible; halts stop everything. Writes that
    finish work already done are refused only for a lost lease.
    """

    events: int = 1  # event seqs to allocate
    starting: bool = False
    compensating: bool = False
    estimate: Amount = NOTHING  # reserved against the run's budget from now on
    held: Amount = NOTHING  # already reserved by this step before a crash
    possibly: Amount = NOTHING  # estimates of interrupted model calls: maybe paid, held for good
    spend: Spend | None = None  # a finishing step's usage, and its reservation given back
    progress: bool = False  # a step finished: the poison-run count starts again
    durable: bool = False  # True: a durable start even with STEPGUARD_DURABLE_START=0
    run: tuple[tuple[str, Any], ...] = ()  # more columns of the run row to set: (field, value)


@dataclass(frozen=True)
class _Condition:
    """One condition of a fenced write: its SQL, and the same condition read from the row, to
    say why a write was refused (so the explanation can never disagree with the check)."""

    applies: Callable[[Fence], bool]
    sql: Callable[[Fence], tuple[str, list]]
    refusal: Callable[[Run, Fence], BaseException | None]


def _not_cancelled(run: Run, f: Fence) -> BaseException | None:
    return Cancelled("cancel requested") if run.cancel_requested_at is not None else None


def _not_halted(run: Run, f: Fence) -> BaseException | None:
    found = holds_on(run)
    return Halted(found[0].scope, found[0].by, found[0].reason) if found else None


def _in_budget(run: Run, f: Fence) -> BaseException | None:
    for unit, limit, spent, reserved, held, estimate in (
        ("micro-USD", run.budget_micros, run.cost_micros + run.possibly_spent_micros,
         run.reserved_micros, f.held.micros, f.estimate.micros + f.possibly.micros),
        ("tokens", run.budget_tokens,
         run.tokens_in + run.tokens_out + run.possibly_spent_tokens, run.reserved_tokens,
         f.held.tokens, f.estimate.tokens + f.possibly.tokens),
    ):  # fmt: skip
        others = spent + reserved - held  # committed by everything but this step
        if limit is not None and (others + held + estimate > limit or others >= limit):
            return OverBudget("run", unit, limit, others, held + estimate)
    return None


def over_budget(run: Run, estimate: Amount) -> OverBudget | None:
    """The refusal a step that may spend `estimate` would meet on `run`'s own budget, if any:
    the same rule the fenced write enforces, for a call made inside a running step."""
    refusal = _in_budget(run, Fence(estimate=estimate))
    return refusal if isinstance(refusal, OverBudget) else None


_SPENT = {
    "micros": "cost_micros + reserved_micros + possibly_spent_micros",
    "tokens": "tokens_in + tokens_out + reserved_tokens + possibly_spent_tokens",
}
_LIMIT = {"micros": "budget_micros", "tokens": "budget_tokens"}

#: In the order a refusal is explained: a cancel first, then a hold, then the budget.
CONDITIONS = (
    _Condition(
        applies=lambda f: f.starting and not f.compensating,
        sql=lambda f: (" AND cancel_requested_at IS NULL", []),
        refusal=_not_cancelled,
    ),
    _Condition(
        applies=lambda f: f.starting,
        sql=lambda f: (f" AND NOT {covered_sql(_TABLE)}", []),
        refusal=_not_halted,
    ),
    _Condition(
        applies=lambda f: f.starting and not f.compensating,
        sql=lambda f: (
            "".join(
                f" AND ({_LIMIT[u]} IS NULL OR ({_SPENT[u]} + %s <= {_LIMIT[u]}"
                f" AND {_SPENT[u]} - %s < {_LIMIT[u]}))"
                for u in ("micros", "tokens")
            ),
            [
                f.estimate.micros + f.possibly.micros,
                f.held.micros,
                f.estimate.tokens + f.possibly.tokens,
                f.held.tokens,
            ],
        ),
        refusal=_in_budget,
    ),
)

_POSSIBLY = (
    ", possibly_spent_micros = possibly_spent_micros + %s"
    ", possibly_spent_tokens = possibly_spent_tokens + %s"
)
_RESERVE = ", reserved_micros = reserved_micros + %s, reserved_tokens = reserved_tokens + %s"
_SETTLE = (
    ", cost_micros = cost_micros + %s, tokens_in = tokens_in + %s, tokens_out = tokens_out + %s"
    ", reserved_micros = CASE WHEN reserved_micros > %s THEN reserved_micros - %s ELSE 0 END"
    ", reserved_tokens = CASE WHEN reserved_tokens > %s THEN reserved_tokens - %s ELSE 0 END"
)


def fence_statement(lease: Lease, checks: Fence = Fence()) -> tuple[str, list[Any]]:
    sets = "event_seq = event_seq + %s"
    params: list[Any] = [checks.events]
    if checks.starting:
        sets += _RESERVE
        params += [checks.estimate.micros, checks.estimate.tokens]
    if (spend := checks.spend) is not None:
        sets += _SETTLE
        params += [
            spend.micros, spend.tokens_in, spend.tokens_out,
            spend.held.micros, spend.held.micros, spend.held.tokens, spend.held.tokens,
        ]  # fmt: skip
    if checks.possibly:
        sets += _POSSIBLY
        params += [checks.possibly.micros, checks.possibly.tokens]
    if checks.progress:
        sets += ", recoveries = 0"
    if checks.run:
        columns, placeholders, values = _prep(Run, dict(checks.run))
        sets += "".join(f", {c} = {p}" for c, p in zip(columns, placeholders, strict=True))
        params += values
    sql = f"UPDATE {_TABLE} SET {sets} WHERE id = %s AND lease_epoch = %s AND status = %s"
    params += [db_id(lease.run_id), lease.epoch, RunStatus.RUNNING]
    for condition in CONDITIONS:
        if condition.applies(checks):
            more, more_params = condition.sql(checks)
            sql += more
            params += more_params
    return sql + " RETURNING event_seq", params


def db_id(run_id) -> Any:
    return Run._meta.pk.get_db_prep_value(run_id, connection)


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
        sql, params = _carrying(pending, lease, sql, params, checks.events, tail)
    with hot_cursor() as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
    if row is None or row[0] is None:
        refused(lease, checks)
    first = row[0] - total.events + 1
    if pending is not None:
        if connection.vendor != "postgresql":
            Step.objects.filter(pk=pending.step_id).update(**pending.fields)
            Event.objects.create(
                run_id=lease.run_id, seq=first, **_completed_event(pending)
            )  # the doorbell rings for the write that carried it
        else:
            event_written(lease.run_id, EventType.STEP_COMPLETED, pending.key)
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
    if not connection.in_atomic_block:
        completion_writer.watch(lease)


def flush(lease: Lease) -> None:
    """Write the pending completion now, by itself: before a transaction step, whose
    transaction holds business writes for as long as its function runs."""
    with lease.lock:
        completion, lease.pending = lease.pending, None
        if completion is None:
            return
        event = (EventType.STEP_COMPLETED, completion.key, completion.payload)
        update = (completion.step_id, completion.fields)
        try:
            fenced_write(lease, event, Fence(progress=completion.progress), update_step=update)
        except BaseException:
            lease.pending = completion
            raise


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
            cursor.execute("SELECT set_config('lock_timeout', %s, true)", [f"{millis}ms"])
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


def _carrying(
    pending: Completion, lease: Lease, fence_sql: str, params: list, after: int, tail: str
) -> tuple[str, list]:
    """`fence_sql` as the CTE `f`, followed by the pending completion's step update and event
    (the first of the seqs allocated: `after` more follow it), then `tail`."""
    columns, placeholders, values = _prep(Step, pending.fields)
    sets = ", ".join(f"{c} = {p}" for c, p in zip(columns, placeholders, strict=True))
    event_columns, event_placeholders, event_values = _prep(Event, _completed_event(pending))
    sql = (
        f"WITH f AS ({fence_sql})"
        f", p AS (UPDATE {_STEP} SET {sets} WHERE id = %s AND EXISTS (SELECT 1 FROM f))"
        f", pe AS (INSERT INTO {_EVENT} (run_id, seq, {', '.join(event_columns)})"
        f" SELECT %s::uuid, f.event_seq - %s, {', '.join(event_placeholders)} FROM f) "
    )
    params = [*params, *values, pending.step_id, db_id(lease.run_id), after, *event_values]
    return sql + tail, params


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
    inside a transaction."""
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


_COLUMNS: dict[tuple[type, str], tuple[str, str, Callable[..., Any] | None]] = {}

#: Field types whose values go to the driver as they are; on PostgreSQL psycopg also adapts
#: datetimes, dates and ids itself (the engine's datetimes are always aware), so Django's
#: per-value preparation, a fifth of a step's Python, is skipped for them.
_NATIVE: tuple[str, ...] = (
    "CharField", "TextField", "IntegerField", "BigIntegerField", "PositiveIntegerField",
    "PositiveSmallIntegerField", "SmallIntegerField", "BooleanField",
)  # fmt: skip
_NATIVE_ON_POSTGRESQL = (*_NATIVE, "DateTimeField", "DateField", "UUIDField", "ForeignKey")


def _column(model, name: str) -> tuple[str, str, Callable[..., Any] | None]:
    """A field's quoted column, its placeholder (cast to its type, so a server-side bound
    parameter needs no inference) and its adapter, `adapt(value, connection)` (None: the
    value goes as it is). Cached: this runs for every column of every checkpoint."""
    found = _COLUMNS.get((model, name))
    if found is None:
        f = model._meta.get_field(name)
        kind = f.get_internal_type()
        placeholder, native = "%s", _NATIVE
        if connection.vendor == "postgresql":
            native = _NATIVE_ON_POSTGRESQL
            # `text`, not `varchar(n)`: an explicit cast to varchar(n) would cut a value too
            # long silently; assigning text to the column checks its length.
            cast = "text" if kind in ("CharField", "TextField") else f.cast_db_type(connection)
            placeholder = f"%s::{cast}"
        adapt = None if kind in native else (lambda value, db, f=f: f.get_db_prep_save(value, db))
        found = _COLUMNS[(model, name)] = (connection.ops.quote_name(f.column), placeholder, adapt)
    return found


def _prep(model, values: dict) -> tuple[list[str], list[str], list[Any]]:
    db = connections[DEFAULT_DB_ALIAS]  # once, not through the proxy for every value
    columns, placeholders, params = [], [], []
    for name, value in values.items():
        column, placeholder, adapt = _column(model, name)
        columns.append(column)
        if value is None:
            # A literal, not a parameter: a step's statement then has under 50 parameters, the
            # most psycopg caches the parsing of (it parsed the query anew for every step).
            placeholders.append(placeholder.replace("%s", "NULL", 1))
            continue
        placeholders.append(placeholder)
        params.append(value if adapt is None else adapt(value, db))
    return columns, placeholders, params


@cache
def _step_defaults() -> dict[str, Any]:
    """Every column of a new step row (no column has a database default); read-only."""
    return {
        f.name: f.get_default()
        for f in Step._meta.concrete_fields
        if not f.primary_key and f.name != "run"
    }


def _completed_event(pending: Completion) -> dict[str, Any]:
    """The carried completion's event, dated when the step finished, not when it was written."""
    event = _event_fields(pending.key, EventType.STEP_COMPLETED, pending.payload)
    return event | {"created_at": pending.fields.get("finished_at", event["created_at"])}


def _event_fields(key: str, type_: str, payload: dict) -> dict[str, Any]:
    return {
        "step_key": key, "type": type_, "actor": "system", "payload": payload,
        "created_at": timezone.now(),
    }  # fmt: skip


@contextmanager
def hot_cursor():
    """A cursor for the statements every step sends: on PostgreSQL it binds parameters on the
    server, so psycopg prepares each statement after a few uses and the server plans it once
    per connection instead of every time (Django's own cursors bind on the client and are
    never prepared). With prepared statements switched off (`DB_PREPARED_STATEMENTS=0`, for
    a pooler that cannot keep them), and while Django logs queries (DEBUG, tests capturing
    them: psycopg keeps no text of a prepared statement to log), it is Django's own cursor."""
    if (
        connection.vendor != "postgresql"
        or not settings.STEPGUARD_PREPARED_STATEMENTS
        or connection.queries_logged
        or getattr(connection, "stepguard_pooled", False)  # behind a pooler: runs/engine/pooling.py
    ):
        with connection.cursor() as cursor:
            yield cursor
        return
    from django.db.backends.postgresql.base import ServerBindingCursor

    connection.close_if_health_check_failed()
    connection.ensure_connection()
    # Django's wrapper around it keeps query logging, execute wrappers and its error classes.
    raw = ServerBindingCursor(connection.connection)  # type: ignore[call-arg]
    with connection._prepare_cursor(raw) as cursor:  # type: ignore[attr-defined]
        yield cursor


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
    run_id = db_id(lease.run_id)
    pending = lease.pending
    sql, params = fence_statement(lease, _with_pending(lease, checks))
    if pending is not None:  # its event takes the seq before this write's
        sql, params = _carrying(pending, lease, sql, params, 1, "")
    else:
        sql = f"WITH f AS ({sql}) "
    step_sql, step_params = _step_cte(run_id, insert_step, update_step)
    sql += step_sql
    params += step_params
    event_columns, event_placeholders, event_values = _prep(
        Event, _event_fields(key, type_, payload)
    )
    sql += (
        f", e AS (INSERT INTO {_EVENT} (run_id, seq, {', '.join(event_columns)}) "
        f"SELECT %s::uuid, f.event_seq, {', '.join(event_placeholders)} FROM f)"
    )
    params += [run_id, *event_values]
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
        sql += ", c AS (SELECT set_config('synchronous_commit', 'off', true) AS v)"
        sql += " SELECT (SELECT event_seq FROM f), (SELECT id FROM s), (SELECT v FROM c)"
    else:
        sql += " SELECT (SELECT event_seq FROM f), (SELECT id FROM s), NULL"
    with hot_cursor() as cursor:
        cursor.execute(sql, params)
        seq, step_id, _ = cursor.fetchone()
    if seq is None:
        refused(lease, checks)
    if pending is not None:
        event_written(lease.run_id, EventType.STEP_COMPLETED, pending.key)
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


def _step_cte(
    run_id: Any, insert_step: dict | None, update_step: tuple[int, dict] | None
) -> tuple[str, list]:
    """The step row's part of the fenced statement (`s`, its id), written only if the fence
    (`f`) passed."""
    if insert_step is not None:
        columns, placeholders, values = _prep(Step, {**_step_defaults(), **insert_step})
        sql = (
            f", s AS (INSERT INTO {_STEP} (run_id, {', '.join(columns)}) "
            f"SELECT %s::uuid, {', '.join(placeholders)} FROM f RETURNING id)"
        )
        return sql, [run_id, *values]
    if update_step is not None:
        columns, placeholders, values = _prep(Step, update_step[1])
        sets = ", ".join(f"{c} = {p}" for c, p in zip(columns, placeholders, strict=True))
        sql = (
            f", s AS (UPDATE {_STEP} SET {sets} "
            "WHERE id = %s AND EXISTS (SELECT 1 FROM f) RETURNING id)"
        )
        return sql, [*values, update_step[0]]
    return ", s AS (SELECT NULL::bigint AS id)", []


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
