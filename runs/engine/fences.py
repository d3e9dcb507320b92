"""What a fenced write checks and changes, as values and as SQL; no database I/O.

A `Lease` is a worker's hold on a run; a `Fence` says what one write checks (the lease, a
cancel, a halt, the budgets) and changes (event seqs, reservations, spend); each named
condition gives both its SQL and the reason a refused write was refused (store.refused);
`fence_statement` is the run-row UPDATE every write starts with. `prep` turns model values
into columns, placeholders and parameters for the hand-written statements of store.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any
from uuid import UUID

from django.db import DEFAULT_DB_ALIAS, connection, connections
from django.utils import timezone

from runs.engine.budget import NOTHING, Amount
from runs.engine.holds import covered_sql, holds_on
from runs.errors import Cancelled, Halted, OverBudget
from runs.models import Event, EventType, Run, RunStatus, Step, StepStatus


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
    fenced write of this execution carries it (see `complete_later`), or the worker's heart
    (or, without one, the completion writer) does after STEPGUARD_COMPLETION_WINDOW. `lock`
    is held by whichever thread writes for the lease (the execution's for each write and
    engine transaction, the completion writer's for its write), so a completion is taken by
    exactly one write of this process; the heart's and this process's writes of it are
    exclusive in the database (carrying_statement).
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
    #: The worker's heart (runs/engine/heart.Heart), which renews this lease and writes its
    #: pending completion from a process of its own; None in an execution without one.
    heart: Any = field(default=None, repr=False, compare=False)


RUN_TABLE = Run._meta.db_table


STEP_TABLE = f'"{Step._meta.db_table}"'


EVENT_TABLE = f'"{Event._meta.db_table}"'


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
        sql=lambda f: (f" AND NOT {covered_sql(RUN_TABLE)}", []),
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
        columns, placeholders, values = prep(Run, dict(checks.run))
        sets += "".join(f", {c} = {p}" for c, p in zip(columns, placeholders, strict=True))
        params += values
    sql = f"UPDATE {RUN_TABLE} SET {sets} WHERE id = %s AND lease_epoch = %s AND status = %s"
    params += [db_id(lease.run_id), lease.epoch, RunStatus.RUNNING]
    for condition in CONDITIONS:
        if condition.applies(checks):
            more, more_params = condition.sql(checks)
            sql += more
            params += more_params
    return sql + " RETURNING event_seq, created_at", params


def carrying_statement(
    pending: Completion, lease: Lease, fence_sql: str, params: list, after: int, tail: str
) -> tuple[str, list]:
    """`fence_sql` as the CTE `f`, followed by the pending completion's step update and event
    (the first of the seqs allocated: `after` more follow it), then `tail`.

    Both only while the step is still `started`: the worker's heart may have written the
    completion meanwhile (runs/engine/heart.py). Whichever of the two writes locks the run row
    second finds the step completed (read committed re-checks an updated row) and writes
    nothing but its fence; its event's seq is then left unused."""
    columns, placeholders, values = prep(Step, pending.fields)
    sets = ", ".join(f"{c} = {p}" for c, p in zip(columns, placeholders, strict=True))
    event_columns, event_placeholders, event_values = prep(Event, completed_event(pending))
    sql = (
        f"WITH f AS ({fence_sql})"
        f", p AS (UPDATE {STEP_TABLE} SET {sets} WHERE id = %s AND status = %s"
        " AND EXISTS (SELECT 1 FROM f) RETURNING id)"
        f", pe AS (INSERT INTO {EVENT_TABLE}"
        f" (run_id, run_created_at, seq, {', '.join(event_columns)})"
        f" SELECT %s::uuid, f.created_at, f.event_seq - %s, {', '.join(event_placeholders)}"
        " FROM f WHERE EXISTS (SELECT 1 FROM p)) "
    )
    params = [
        *params, *values, pending.step_id, StepStatus.STARTED, db_id(lease.run_id), after,
        *event_values,
    ]  # fmt: skip
    return sql + tail, params


def db_id(run_id) -> Any:
    return Run._meta.pk.get_db_prep_value(run_id, connection)


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


def prep(model, values: dict) -> tuple[list[str], list[str], list[Any]]:
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
def step_defaults() -> dict[str, Any]:
    """Every column of a new step row (no column has a database default); read-only."""
    return {
        f.name: f.get_default()
        for f in Step._meta.concrete_fields
        if not f.primary_key and f.name != "run"
    }


def completed_event(pending: Completion) -> dict[str, Any]:
    """The carried completion's event, dated when the step finished, not when it was written."""
    event = event_fields(pending.key, EventType.STEP_COMPLETED, pending.payload)
    return event | {"created_at": pending.fields.get("finished_at", event["created_at"])}


def event_fields(key: str, type_: str, payload: dict) -> dict[str, Any]:
    return {
        "step_key": key, "type": type_, "actor": "system", "payload": payload,
        "created_at": timezone.now(),
    }  # fmt: skip
