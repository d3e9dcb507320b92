"""What a fenced write checks and changes, as values and as SQL; no database I/O.

A `Lease` is a worker's hold on a run; a `Fence` says what one write checks (the lease, a
cancel, a halt, the budgets) and changes (event seqs, reservations, spend); each named
condition gives both its SQL and the reason a refused write was refused (store.refused);
`fence_statement` is the run-row UPDATE every write starts with, from the named pieces of
statements.py. `prep` turns model values into columns, placeholders and named parameters for
the hand-written statements of store.py.
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

from runs.engine import statements
from runs.engine.budget import NOTHING, Amount
from runs.engine.holds import holds_on
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
    sql: Callable[[Fence], tuple[str, dict[str, Any]]]
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


#: In the order a refusal is explained: a cancel first, then a hold, then the budget.
CONDITIONS = (
    _Condition(
        applies=lambda f: f.starting and not f.compensating,
        sql=lambda f: (statements.FENCE_NOT_CANCELLED, {}),
        refusal=_not_cancelled,
    ),
    _Condition(
        applies=lambda f: f.starting,
        sql=lambda f: (statements.FENCE_NOT_HELD, {}),
        refusal=_not_halted,
    ),
    _Condition(
        applies=lambda f: f.starting and not f.compensating,
        sql=lambda f: (
            statements.FENCE_IN_BUDGET,
            {
                "want_micros": f.estimate.micros + f.possibly.micros,
                "held_micros": f.held.micros,
                "want_tokens": f.estimate.tokens + f.possibly.tokens,
                "held_tokens": f.held.tokens,
            },
        ),
        refusal=_in_budget,
    ),
)


def fence_statement(lease: Lease, checks: Fence = Fence()) -> tuple[str, dict[str, Any]]:
    """The run-row UPDATE of a fenced write (statements.fence) and its named parameters."""
    sets = ""
    params: dict[str, Any] = {"events": checks.events}
    if checks.starting:
        sets += statements.FENCE_RESERVE
        params["reserve_micros"] = checks.estimate.micros
        params["reserve_tokens"] = checks.estimate.tokens
    if (spend := checks.spend) is not None:
        sets += statements.FENCE_SETTLE
        params.update(
            spent_micros=spend.micros, tokens_in=spend.tokens_in, tokens_out=spend.tokens_out,
            given_micros=spend.held.micros, given_tokens=spend.held.tokens,
        )  # fmt: skip
    if checks.possibly:
        sets += statements.FENCE_POSSIBLY
        params["possibly_micros"] = checks.possibly.micros
        params["possibly_tokens"] = checks.possibly.tokens
    if checks.progress:
        sets += statements.FENCE_PROGRESS
    if checks.run:
        columns, placeholders, values = prep(Run, dict(checks.run), "run_")
        sets += ", " + statements.assignments(columns, placeholders)
        params.update(values)
    params.update(run=db_id(lease.run_id), epoch=lease.epoch, running=RunStatus.RUNNING)
    conditions = ""
    for condition in CONDITIONS:
        if condition.applies(checks):
            more, more_params = condition.sql(checks)
            conditions += more
            params.update(more_params)
    return statements.fence(sets, conditions), params


def carrying_statement(
    pending: Completion, lease: Lease, fence_sql: str, params: dict, after: int, tail: str
) -> tuple[str, dict[str, Any]]:
    """`fence_sql` as the CTE `f`, followed by the pending completion's step update and event
    (the first of the seqs allocated: `after` more follow it), then `tail`.

    Both only while the step is still `started`: the worker's heart may have written the
    completion meanwhile (runs/engine/heart.py). Whichever of the two writes locks the run row
    second finds the step completed (read committed re-checks an updated row) and writes
    nothing but its fence; its event's seq is then left unused."""
    columns, placeholders, values = prep(Step, pending.fields, "p_")
    event_columns, event_placeholders, event_values = prep(Event, completed_event(pending), "pe_")
    sql = statements.CARRIED.format(
        fence=fence_sql,
        sets=statements.assignments(columns, placeholders),
        event_columns=", ".join(event_columns),
        event_values=", ".join(event_placeholders),
    )
    params = {
        **params, **values, **event_values, "pending_step": pending.step_id,
        "started": StepStatus.STARTED, "run": db_id(lease.run_id), "after": after,
    }  # fmt: skip
    return sql + tail, params


def db_id(run_id) -> Any:
    return Run._meta.pk.get_db_prep_value(run_id, connection)


_Column = tuple[str, str, str, str, Callable[..., Any] | None]
_COLUMNS: dict[tuple[type, str, str], _Column] = {}


#: Field types whose values go to the driver as they are; on PostgreSQL psycopg also adapts
#: datetimes, dates and ids itself (the engine's datetimes are always aware), so Django's
#: per-value preparation, a fifth of a step's Python, is skipped for them.
_NATIVE: tuple[str, ...] = (
    "CharField", "TextField", "IntegerField", "BigIntegerField", "PositiveIntegerField",
    "PositiveSmallIntegerField", "SmallIntegerField", "BooleanField",
)  # fmt: skip


_NATIVE_ON_POSTGRESQL = (*_NATIVE, "DateTimeField", "DateField", "UUIDField", "ForeignKey")


def _column(model, name: str, prefix: str) -> _Column:
    """A field's quoted column, its parameter's name (`prefix` and the field's), its
    placeholder (cast to its type, so a server-side bound parameter needs no inference), the
    same cast of NULL, and its adapter, `adapt(value, connection)` (None: the value goes as it
    is). Cached: this runs for every column of every checkpoint."""
    found = _COLUMNS.get((model, name, prefix))
    if found is None:
        f = model._meta.get_field(name)
        kind = f.get_internal_type()
        cast, native = "", _NATIVE
        if connection.vendor == "postgresql":
            native = _NATIVE_ON_POSTGRESQL
            # `text`, not `varchar(n)`: an explicit cast to varchar(n) would cut a value too
            # long silently; assigning text to the column checks its length.
            text = kind in ("CharField", "TextField")
            cast = "::" + ("text" if text else str(f.cast_db_type(connection)))
        adapt = None if kind in native else (lambda value, db, f=f: f.get_db_prep_save(value, db))
        param = f"{prefix}{name}"
        column = connection.ops.quote_name(f.column)
        found = _COLUMNS[(model, name, prefix)] = (
            column,
            param,
            f"%({param})s{cast}",
            f"NULL{cast}",
            adapt,
        )
    return found


def prep(model, values: dict, prefix: str) -> tuple[list[str], list[str], dict[str, Any]]:
    """Columns, placeholders and named parameters (`prefix` and the field's name) of `values`,
    model values, for a part of a hand-written statement."""
    db = connections[DEFAULT_DB_ALIAS]  # once, not through the proxy for every value
    columns, placeholders, params = [], [], {}
    for name, value in values.items():
        column, param, placeholder, null, adapt = _column(model, name, prefix)
        columns.append(column)
        if value is None:
            # A literal, not a parameter: a step's statement then has under 50 parameters, the
            # most psycopg caches the parsing of (it parsed the query anew for every step).
            placeholders.append(null)
            continue
        placeholders.append(placeholder)
        params[param] = value if adapt is None else adapt(value, db)
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
