"""A model-based test of the engine, the store and the operations layer (Hypothesis, stateful).

Two RuleBasedStateMachines drive the real engine and store on the test database.

The first (EngineModel) acts in this thread: it starts runs of the workflows in
tests/model_workflows.py; halts and unhalts runs, workflows and everything; cancels, retries
and forks runs; sets run, workflow and global budgets; decides and revokes approvals; sends
signals; moves the clock (across UTC midnight too); executes runs like a worker with one slot;
crashes an execution mid-call or right after one of its commit points and resumes it once its
lease lapses; and lets operator actions, a worker stop (SIGTERM) or another worker's takeover
after a stall land between two commit points of an execution, as if concurrent.

The second (ConcurrentModel, issue 29 item 6) reaches what the first could not: its operator
acts from a database connection and a thread of its own, right after an execution's commit
points or, on PostgreSQL, inside its transactions while it holds its locks; workflow code works
between steps (the operator may act then, or the process die); an async workflow gathers a
step that fails while a sibling is in flight (or is interrupted in flight); a workflow has a
concurrency key and runs have priorities, which forks must carry; forks of forks (and child
runs) are pruned. Its own invariants (9a-9h) are listed on the class.

After every rule both check, against the database (letters refine one numbered invariant):

1   no step starts while a hold covers its run (1b: nor once its run is being cancelled,
    compensations excepted; 1c: nor once its approval no longer stands)
2   a non-terminal run that is not executing is `halted` exactly when a hold covers it
    (2b: the holds are exactly those operators placed and did not lift)
3   reserved equals held: per run (3a) and per shared daily ledger row (3b)
4   spend: a run's cost is the sum of its steps' (4a); no step starts once a budget that
    applies to it is spent (4b); a run stays within its budget plus one step without estimate
    (4c); a ledger row's spend is that of the steps booked on it (under the budgets in force
    when they started or finished), a held step's on the day it reserved (4d)
5   one idempotency key, one logical call: unique per run (5a), one request per key at the
    service (5b), a compensation undoes only what its own run did (5c), and a transactional
    step's write is in the database exactly when its checkpoint is completed (5d); every call
    of a step function is an attempt its row records (5e: calls counted as a multiset)
6   every completed step replays to the value it had live, types and key order included
    (6b: and replay never finds the history at odds with the code, which never changes here)
7   every operator action has exactly one audit event, by the user who took it
8   a cancelled or finally failed run has undone, newest first, every compensated step it
    completed itself, and nothing else
9   (the second machine's, on ConcurrentModel; these two on both) a fork carries its origin's
    options: priority, concurrency key, budgets, attempts (9c); no more runs of a concurrency
    key run at once than its limit (9d)

Profiles: by default the first runs 25 examples of up to 40 rules, the second 12 of up to 30
(together about a minute on PostgreSQL on two cores; the first ran 50 alone before the second
came); STEPGUARD_MODEL_PROFILE=long runs 40 of up to 50 and 20 of up to 30 (CI, on
PostgreSQL: about 80 s and 25 s there, the suite's longest tests, sized so that CI stays
under its 20 minutes on two cores). Failing examples are kept under
STEPGUARD_VAR_DIR (hypothesis-model/) and replayed first on the next run. A failure prints the
rule sequence that reproduces it; shrinking one can take Hypothesis minutes.
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import threading
import traceback
from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, time, timedelta
from decimal import Decimal
from pathlib import Path
from time import monotonic, sleep
from typing import Any
from uuid import UUID

import pytest
from django.apps import apps
from django.db import DatabaseError, connection
from django.db import transaction as django_transaction
from django.db.backends.utils import CursorWrapper
from django.db.models import Count, Q
from django.utils import timezone
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from runs import partitions
from runs.approvals.models import ApprovalRequest
from runs.approvals.services import decide, revoke
from runs.engine import (
    calls,
    checkpoints,
    compensation,
    execution,
    lifecycle,
    recorded,
    steps,
    waits,
    wakeup,
)
from runs.engine.budget import forget_cached_scopes
from runs.engine.fences import Lease
from runs.engine.lifecycle import execute
from runs.engine.worker import WorkerProcess, runnable_filter
from runs.errors import DecisionError, OperationError
from runs.models import BudgetLedger, Event, Policy, Run, Step, StepKind
from runs.operations import (
    cancel_run,
    fork_run,
    halt,
    retry_run,
    set_budget,
    set_limits,
    unhalt,
)
from runs.retention import prune
from runs.sdk import send_signal, start_run
from tests.model_workflows import COMPENSABLE, COST, TRANSACTIONAL, Crash, canon, probe
from tests.testapp.models import Effect

hypothesis_settings.register_profile(
    "stepguard-model",
    max_examples=25,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
hypothesis_settings.register_profile(
    "stepguard-concurrent",
    max_examples=12,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
hypothesis_settings.register_profile(
    "stepguard-concurrent-long",
    max_examples=20,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
hypothesis_settings.register_profile(
    "stepguard-model-long",
    max_examples=40,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)

TOP_WORKFLOWS = ["model-saga", "model-metered", "model-approval", "model-parent"]
WORKFLOWS = [*TOP_WORKFLOWS, "model-child"]
TERMINAL = ("completed", "failed", "cancelled")

# -- strategies ---------------------------------------------------------------------------------

# Few characters, but ones that take every path: ASCII, two-byte and outside the BMP.
_text = st.text(alphabet="ab\u00e9\U0001f600", max_size=3)
#: What steps return: JSON whose shape (types, key order, big numbers) replay must keep.
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | _text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=5,
)
#: A run, by position among the candidates of an action (oldest first), or the run being
#: executed when the action lands between two of its commit points.
RUN = st.integers(0, 3) | st.just("self")
TARGET = (
    st.tuples(st.just("run"), RUN)
    | st.tuples(st.just("workflow"), st.sampled_from(WORKFLOWS))
    | st.just(("all",))
)
# Reasons that look like those the engine writes on the halts it cascades.
HALT_REASON = st.sampled_from(
    ["ops", "workflow model-saga halted: ", "workflow model-parent halted: ", "parent run "]
)
USD = st.sampled_from(["keep", None, "1", "2", "3", "5"])
TOKENS = st.sampled_from(["keep", None, 15, 30, 60])
RUN_USD = st.sampled_from(["keep", None, "2", "4"])
SIGNAL = st.sampled_from(["confirm", "receipt"])
#: Operator actions that may land between two commit points of an execution, as if taken
#: concurrently: on the executing run itself, or as any action could.
CONCURRENT_ACTION = st.one_of(
    st.tuples(st.just("halt"), st.just(("run", "self")), HALT_REASON),
    st.tuples(st.just("unhalt"), st.just(("run", "self"))),
    st.tuples(st.just("cancel"), st.just("self")),
    st.tuples(st.just("budget"), st.just(("run", "self")), USD, TOKENS, st.just("keep")),
    st.tuples(st.just("halt"), TARGET, HALT_REASON),
    st.tuples(st.just("unhalt"), TARGET),
    st.tuples(st.just("budget"), TARGET, USD, TOKENS, RUN_USD),
    st.tuples(st.just("decide"), st.integers(0, 3), st.sampled_from(["approve", "reject"])),
    st.tuples(st.just("revoke"), st.integers(0, 3)),
    st.tuples(st.just("signal"), RUN, SIGNAL),
    # The worker is asked to stop (SIGTERM): the run is released at its next step boundary.
    st.tuples(st.just("shutdown")),
    # The worker stalls here past its lease; another claims the run and takes it as far as it
    # goes; then this one carries on, and must find its next write refused.
    st.tuples(st.just("takeover")),
)
#: None, or a burst of actions landing before consecutive commit points, from the n-th on.
CONCURRENT = st.none() | st.tuples(
    st.integers(1, 8), st.lists(CONCURRENT_ACTION, min_size=1, max_size=3)
)
#: A crash: in the n-th step function called, or right after the n-th commit point.
CRASH = (
    st.none()
    | st.tuples(st.just("in-step"), st.integers(1, 4))
    | st.tuples(st.just("after-commit"), st.integers(1, 8))
)

# -- the second machine's strategies --------------------------------------------------------------

CONCURRENT_WORKFLOWS = ["model-between", "model-gather", "model-tenant", "model-parent"]
TARGET2 = (
    st.tuples(st.just("run"), RUN)
    | st.tuples(st.just("workflow"), st.sampled_from([*CONCURRENT_WORKFLOWS, "model-child"]))
    | st.just(("all",))
)
#: Prune the runs that ended before the n-th end, or all that ended.
UPTO = st.just("all") | st.integers(0, 5)
#: What the operator does from a connection of its own (every action of runs/operations/
#: that changes runs, the worker's stop, and prune).
OPERATOR_ACTION = st.one_of(
    st.tuples(st.just("fork"), RUN | st.just("newest"), st.integers(0, 5), st.booleans()),
    st.tuples(st.just("halt"), st.just(("run", "self")), HALT_REASON),
    st.tuples(st.just("halt"), TARGET2, HALT_REASON),
    st.tuples(st.just("unhalt"), TARGET2),
    st.tuples(st.just("cancel"), RUN),
    st.tuples(st.just("budget"), TARGET2, USD, TOKENS, RUN_USD),
    st.tuples(st.just("fork"), RUN, st.integers(0, 5), st.booleans()),
    st.tuples(st.just("retry"), RUN),
    st.tuples(st.just("limits"), st.sampled_from([None, 1, 2])),
    st.tuples(st.just("prune"), UPTO),
    st.tuples(st.just("shutdown")),
)
#: Right after the commit point, or (PostgreSQL) after the k-th statement inside it.
WHERE = st.just("after") | st.integers(1, 4)
#: commit point -> (where, action): the operator's actions during one execution.
ELSEWHERE = st.dictionaries(
    st.integers(1, 4), st.tuples(WHERE, OPERATOR_ACTION), min_size=1, max_size=3
)
#: n-th work between steps -> (an operator action then, or none; wait until the step that
#: returned is recorded; crash there).
BETWEEN = st.dictionaries(
    st.integers(1, 2),
    st.tuples(st.none() | OPERATOR_ACTION, st.sampled_from([True, True, False]), st.booleans()),
    min_size=1,
    max_size=2,
)
GATHER = st.fixed_dictionaries(
    {
        "fail": st.sampled_from([False, True, "outage"]),
        "catch": st.booleans(),
        "interrupt": st.booleans(),
    }
)
#: No run is started, nor forks made on purpose, once an example has this many runs.
MOST_RUNS = 12
#: How long a returned step may stay unrecorded while its workflow works between steps: loose
#: (the window is 20 ms here), so that only a stall as long as a lease breaks it.
RECORDED_WITHIN = 5.0

# -- the clock ----------------------------------------------------------------------------------

_real_now = timezone.now
#: Every example starts ten minutes before a UTC midnight.
START = datetime(2031, 3, 1, 23, 50, tzinfo=UTC)


class Clock:
    """`timezone.now()` for the engine: real time passing, shifted by what the rules add."""

    def reset(self) -> None:
        self.offset = START - _real_now()

    def now(self) -> datetime:
        return _real_now() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += timedelta(seconds=seconds)

    def to_next_midnight(self) -> None:
        now = self.now()
        midnight = datetime.combine(now.date() + timedelta(days=1), time(0), tzinfo=UTC)
        self.offset += midnight - now + timedelta(seconds=1)


# -- commit points --------------------------------------------------------------------------------


class Operator:
    """An operator on a database connection of its own, in a thread of its own: where the
    second machine's actions come from, at an execution's commit points or inside one of its
    transactions (the first machine's come from the executing thread itself)."""

    DEADLINE = 20.0

    def __init__(self) -> None:
        self.tasks: queue.Queue = queue.Queue()
        self.pid: int | None = None  # its backend's, on PostgreSQL
        self.thread = threading.Thread(target=self._serve, name="model-operator", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while (task := self.tasks.get()) is not None:
            fn, started, done = task
            try:
                if connection.vendor == "postgresql":
                    with connection.cursor() as cursor:
                        cursor.execute("SELECT pg_backend_pid()")
                        self.pid = cursor.fetchone()[0]
                started.set()
                fn()
            finally:
                started.set()
                done.set()
        connection.close()

    def start(self, fn) -> tuple[threading.Event, threading.Event]:
        started, done = threading.Event(), threading.Event()
        self.tasks.put((fn, started, done))
        return started, done

    def blocked(self) -> bool:
        """Whether the operator's statement waits for a lock (asked on the caller's connection:
        pg_blocking_pids reads the lock table as it is now, even inside a transaction)."""
        with connection.cursor() as cursor:
            cursor.execute("SELECT cardinality(pg_blocking_pids(%s))", [self.pid])
            return cursor.fetchone()[0] > 0

    def wait(self, started, done, *, or_blocked: bool = False) -> bool:
        """Wait until the action is done (or, with `or_blocked`, waits for a lock); False if
        neither happened within DEADLINE seconds."""
        deadline = monotonic() + self.DEADLINE
        while monotonic() < deadline:
            if done.wait(0.002):
                return True
            if or_blocked and started.is_set() and self.blocked():
                return True
        return False

    def stop(self) -> None:
        self.tasks.put(None)
        self.thread.join(self.DEADLINE)


class Instruments:
    """Counts an execution's commit points: each outermost transaction of the executor, and
    each fenced write made outside one. Before the n-th, an operator action may land (as if
    concurrent); right after it commits, the execution may crash.

    The second machine's operator acts from its own connection (`Operator`): right after the
    n-th commit point, or (PostgreSQL) inside its transaction, after its k-th statement, while
    the execution holds every lock it took so far: the execution waits until the action is done
    or waits for a lock, goes on, and at the end of that transaction waits for the action to
    finish before it does anything more. Every statement of every thread is watched for a
    deadlock."""

    def __init__(self) -> None:
        self.machine: EngineBase | None = None
        self.operator: Operator | None = None
        self.active = False
        self.count = 0
        self.crash_after: int | None = None
        self.concurrent: dict[int, tuple] = {}
        #: commit point -> (where, action) for the operator: where is "after" (it committed)
        #: or k (after the k-th statement inside it).
        self.elsewhere: dict[int, tuple] = {}
        #: The executing thread's plan for the transaction it is in (async steps write from
        #: threads of their own).
        self.local = threading.local()
        #: Statements that lost a deadlock, in any thread: (thread, statement).
        self.deadlocks: list[str] = []
        #: The shared budget scopes the engine looked up for the step it started last.
        self.shared: tuple[str, ...] = ()
        #: Whether the operator acted from elsewhere inside or right after the last commit
        #: point (so after whatever it wrote).
        self.acted = False

    def start(
        self, crash_after: int | None = None, concurrent: dict | None = None, elsewhere=None
    ) -> None:
        self.local.__dict__.clear()
        self.active, self.count = True, 0
        self.crash_after, self.concurrent = crash_after, dict(concurrent or {})
        self.elsewhere = dict(elsewhere or {})

    def stop(self) -> None:
        self.active, self.crash_after, self.concurrent, self.elsewhere = False, None, {}, {}
        self.acted = False

    def point(self) -> int | None:
        if not self.active:
            return None
        self.count += 1
        self.acted = False
        action = self.concurrent.pop(self.count, None)
        if action is not None:
            self.machine.perform(action, concurrent=True)
        planned = self.elsewhere.pop(self.count, None)
        if planned is not None:
            where, action = planned
            if where != "after" and connection.vendor == "postgresql":
                self.local.inside = [where, action]
            else:
                self.local.after = action
        return self.count

    def statement(self, db) -> None:
        """After each statement of any thread: the operator's turn, inside a transaction."""
        inside = getattr(self.local, "inside", None)
        if inside is None or not db.in_atomic_block:
            return
        inside[0] -= 1
        if inside[0] > 0:
            return
        self.local.inside = None
        self.local.acting = self.act(inside[1], or_blocked=True)

    def act(self, action: tuple, *, or_blocked: bool = False):
        self.acted = True
        started, done = self.operator.start(lambda: self.machine.perform(action, concurrent=True))
        if not self.operator.wait(started, done, or_blocked=or_blocked):
            late = f"neither done nor waiting for a lock after {Operator.DEADLINE} s"
            self.machine.errors.append(f"{action!r} from another connection: {late}")
        return started, done

    def ended(self, n: int | None) -> None:
        """The n-th commit point's transaction is over (committed or not): the operator's
        action taken inside it finishes before the execution goes on. One planned after a
        statement it did not reach (a write of one statement) lands right after it instead."""
        if n is None:
            return
        inside, self.local.inside = getattr(self.local, "inside", None), None
        if inside is not None:
            self.local.after = inside[1]
        acting, self.local.acting = getattr(self.local, "acting", None), None
        if acting is not None and not self.operator.wait(*acting):
            self.machine.errors.append(f"an operator action taken inside commit point {n} "
                                       f"never finished")  # fmt: skip

    def after(self, n: int | None) -> None:
        if n is None:
            return
        action, self.local.after = getattr(self.local, "after", None), None
        if action is not None:
            self.act(action)
        self.machine.observe_holds()
        self.machine.observe_completions()
        if self.crash_after == n:
            self.crash_after = None
            raise Crash(f"right after commit point {n}")


def _watched(instruments: Instruments, execute_with_wrappers):
    """CursorWrapper._execute_with_wrappers, for every connection of every thread: deadlocks
    are noted, and the operator may act after a statement."""

    @functools.wraps(execute_with_wrappers)
    def watched(cursor, sql, params, many, executor):
        try:
            result = execute_with_wrappers(cursor, sql, params, many, executor)
        except DatabaseError as exc:
            if "deadlock detected" in str(exc):
                thread = threading.current_thread().name
                instruments.deadlocks.append(f"{thread}: {sql[:200]}: {exc}")
            raise
        instruments.statement(cursor.db)
        return result

    return watched


class _Atomic:
    def __init__(self, instruments: Instruments, args, kwargs):
        self.instruments, self.args, self.kwargs = instruments, args, kwargs

    def __enter__(self):
        self.outer = not connection.in_atomic_block
        self.n = self.instruments.point() if self.outer else None
        self.inner = django_transaction.atomic(*self.args, **self.kwargs)
        return self.inner.__enter__()

    def __exit__(self, exc_type, exc, tb):
        try:
            suppress = self.inner.__exit__(exc_type, exc, tb)
        finally:
            self.instruments.ended(self.n)
        if self.outer and exc_type is None:
            self.instruments.after(self.n)
        return suppress


class _Transaction:
    """Stands in for `django.db.transaction` inside the executor module."""

    def __init__(self, instruments: Instruments):
        self._instruments = instruments

    def atomic(self, *args, **kwargs):
        if args and callable(args[0]):  # used as a bare decorator
            return django_transaction.atomic(*args, **kwargs)
        return _Atomic(self._instruments, args, kwargs)

    def __getattr__(self, name: str):
        return getattr(django_transaction, name)


def _counted_write(instruments: Instruments, write):
    @functools.wraps(write)
    def fenced_write(*args, **kwargs):
        outer = not connection.in_atomic_block
        n = instruments.point() if outer else None
        try:
            result = write(*args, **kwargs)
        finally:
            instruments.ended(n)
        if outer:
            instruments.after(n)
        return result

    return fenced_write


def _counted_atomic(instruments: Instruments, atomic):
    """`store.atomic(lease)`, the engine's transaction block: a commit point when outermost."""

    @contextlib.contextmanager
    def counted(lease):
        outer = not connection.in_atomic_block
        n = instruments.point() if outer else None
        try:
            with atomic(lease):
                yield
        finally:
            instruments.ended(n)
        if outer:
            instruments.after(n)

    return counted


def _noted_scopes(instruments: Instruments, scopes_for):
    @functools.wraps(scopes_for)
    def noted(workflow):
        found = scopes_for(workflow)
        instruments.shared = tuple(found)
        return found

    return noted


# -- the database between examples ---------------------------------------------------------------


def _reset_database() -> None:
    """Empty every table of the engine (users stay): one example's runs never meet another's."""
    models = [
        model
        for label in ("runs", "approvals", "testapp")
        for model in apps.get_app_config(label).get_models()
        if model._meta.object_name != "ApiKey"
    ]
    tables = [connection.ops.quote_name(m._meta.db_table) for m in models]
    with django_transaction.atomic(), connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            # The prune path's switch lets the history's rows go (SET LOCAL); foreign keys are
            # checked at commit, when every table is empty. DELETE, not TRUNCATE: a TRUNCATE
            # of every table made each example about a second longer.
            cursor.execute("SELECT set_config('stepguard.prune', 'on', true)")
        for table in tables:
            cursor.execute(f"DELETE FROM {table}")


# -- the machine ----------------------------------------------------------------------------------

#: What the test function hands the machine (fixtures cannot reach a RuleBasedStateMachine).
_ENV: dict[str, Any] = {}

#: What a fork copies of its origin (issue 29: a fork had lost its key and priority).
CARRIED = (
    "workflow", "version", "input", "priority", "concurrency_key", "max_attempts",
    "budget_micros", "budget_tokens",
)  # fmt: skip
#: Workflows with a concurrency key, and the per-key limit of their code (None: none).
LIMITED = {"model-tenant": None}
ASYNC_WORKFLOWS = frozenset({"model-gather"})

RUN_FIELDS = (
    "id", "workflow", "status", "parent_id", "halted_at", "cancel_requested_at", "error",
    "reserved_micros", "reserved_tokens", "cost_micros", "tokens_in", "tokens_out",
    "budget_micros", "budget_tokens", "forked_from_id", "forked_at_seq",
)  # fmt: skip
STEP_FIELDS = (
    "id", "run_id", "seq", "key", "status", "idempotency_key", "reserved_micros",
    "reserved_tokens", "reserved_on", "cost_micros", "tokens_in", "tokens_out", "finished_at",
)  # fmt: skip


def prunable(runs: dict, before: datetime) -> set:
    """The runs a prune up to `before` may delete (runs/retention.py): whole families (a root
    run and its descendants) that all ended before it, less every family a run that stays was
    forked from, until nothing more stays."""

    def root(run_id):
        while runs[run_id]["parent_id"] is not None:
            run_id = runs[run_id]["parent_id"]
        return run_id

    families: dict = defaultdict(set)
    for run_id in runs:
        families[root(run_id)].add(run_id)

    def ended(run_id) -> bool:
        run = runs[run_id]
        return run["status"] in TERMINAL and run["finished_at"] < before

    going = {r for r, members in families.items() if all(ended(m) for m in members)}
    while True:
        goes = set().union(*(families[r] for r in going))
        kept = {
            root(run["forked_from_id"])
            for run_id, run in runs.items()
            if run_id not in goes and run["forked_from_id"] in goes
        }
        if not kept:
            return goes
        going -= kept


@dataclass
class Snapshot:
    runs: dict[UUID, dict]
    steps: list[dict]
    halted_scopes: set[str]
    ledgers: list[dict]


def _rule(*, when: str | None = None, runs_below: int | None = None, **strategies):
    """A rule that forgets what the invariants and preconditions read of the database before
    it. With `when`, it is only drawn while the census counts some of that (no idle draws);
    with `runs_below`, only while there are fewer runs (an example's cost grows with them)."""

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(self, **kwargs):
            self._snapshot = self._census = None
            return fn(self, **kwargs)

        def may(self) -> bool:
            census = self.precondition_census()
            if when is not None and census[when] == 0:
                return False
            return runs_below is None or census["runs"] < runs_below

        decorated = rule(**strategies)(wrapper)
        if when is not None or runs_below is not None:
            decorated = precondition(may)(decorated)
        return decorated

    return decorate


class EngineBase(RuleBasedStateMachine):
    """What both machines share: the database between examples, the model of holds, budgets and
    audit events, the operator actions, executing runs, and the invariants (checked after every
    rule of either)."""

    def __init__(self) -> None:
        super().__init__()
        self.operator, self.approver = _ENV["operator"], _ENV["approver"]
        self.worker: WorkerProcess = _ENV["worker"]
        self.clock: Clock = _ENV["clock"]
        self.instruments: Instruments = _ENV["instruments"]
        _reset_database()
        forget_cached_scopes()
        probe.reset()
        probe.observer = self.on_step_start
        probe.on_call = probe.on_between = None  # the second machine's
        self.clock.reset()
        self.instruments.machine = self
        self.instruments.stop()
        self.worker.register()
        self.held_runs: set[UUID] = set()  # runs an operator halted and did not unhalt
        self.held_scopes: set[str] = set()  # workflows ("*": everything) likewise
        self.open_forks: set[UUID] = set()  # forks whose holds the model does not predict
        self.audit: list[tuple] = []  # (run id or None, event types, field, value, action)
        self.violations: dict[str, list[str]] = defaultdict(list)
        self.errors: list[str] = []
        self.labels: dict[UUID, str] = {}
        self.ceilings: dict[UUID, list] = {}  # run id -> [max USD micros, max tokens] or None
        #: step pk -> (scopes, day, micros, tokens) of the shared hold it took
        self.holds: dict[int, tuple] = {}
        #: (run id, step key) -> the shared scopes of the step's last start (its spend's)
        self.booking: dict[tuple[str, str], tuple[str, ...]] = {}
        #: step pk -> the shared scopes with a budget when the step was seen completed
        self.finished_under: dict[int, tuple[str, ...]] = {}
        self.checked_received = 0
        self.counter = 0
        #: run id -> crashes of its executions so far (a call made again after one is a re-send)
        self.crashes: Counter = Counter()
        #: Step rows of pruned runs (their spend stays on the ledgers: invariant 4d).
        self.pruned_steps: list[dict] = []
        self.current: UUID | None = None
        self.lease: Lease | None = None
        self._snapshot: Snapshot | None = None
        self._census: dict[str, int] | None = None

    # -- helpers ----------------------------------------------------------------------------

    def census(self) -> dict[str, int]:
        """How many candidates each kind of rule has now."""
        if self._census is None:
            now = timezone.now()
            runnable = runnable_filter(now)
            # Two queries (this runs before every rule): runs joined to their steps, counted
            # once each; approvals.
            counts = Run.objects.aggregate(
                runs=Count("id", distinct=True),
                live=Count("id", filter=~Q(status__in=TERMINAL), distinct=True),
                failed=Count("id", filter=Q(status="failed"), distinct=True),
                ended=Count("id", filter=Q(status__in=TERMINAL), distinct=True),
                running=Count("id", filter=Q(status="running"), distinct=True),
                runnable=Count("id", filter=runnable, distinct=True),
                resumable=Count("id", filter=runnable | Q(status="running"), distinct=True),
                steps=Count("steps"),
            )
            approvals = ApprovalRequest.objects.aggregate(
                pending=Count("id", filter=Q(status="pending")),
                approved=Count("id", filter=Q(status="approved")),
            )
            self._census = {**counts, **approvals}
        return self._census

    def precondition_census(self) -> dict[str, int]:
        """What the preconditions read: the census, as this machine's outcomes are the same on
        every replay of an example."""
        return self.census()

    def marker(self, text: str) -> str:
        self.counter += 1
        return f"{text}#{self.counter}"

    def label(self, run_id) -> str:
        run_id = UUID(str(run_id))
        if run_id not in self.labels:
            workflow = Run.objects.filter(pk=run_id).values_list("workflow", flat=True).first()
            self.labels[run_id] = f"{workflow}#{len(self.labels)}"
        return self.labels[run_id]

    def violate(self, invariant: str, message: str) -> None:
        self.violations[invariant].append(message)

    def pick(self, ref, candidates) -> UUID | None:
        ids = list(candidates.order_by("created_at").values_list("id", flat=True))
        if not ids:
            return None
        if ref == "self":
            if self.current in ids:
                return self.current
            ref = 0
        if ref == "newest":  # a fork, often: forks of forks
            ref = -1
        return ids[ref % len(ids)]

    def expect(self, run_id, types: set[str], field: str, value, action: str, actor=None):
        actor = (actor or self.operator).get_username()
        self.audit.append((run_id, frozenset(types), field, value, action, actor))

    def note_budget(self, run_id) -> None:
        row = Run.objects.filter(pk=run_id).values("budget_micros", "budget_tokens").first()
        limits = self.ceilings.setdefault(run_id, [0, 0])
        for i, value in enumerate((row["budget_micros"], row["budget_tokens"])):
            if value is None or limits[i] is None:
                limits[i] = None  # unlimited at some point: spend before a cap is not bounded
            else:
                limits[i] = max(limits[i], value)

    @staticmethod
    def target(target) -> tuple[str, str]:
        return ("all", "*") if target[0] == "all" else (f"workflow:{target[1]}", target[1])

    def ancestors(self, run: dict, runs: dict) -> list[dict]:
        chain = []
        while run is not None:
            chain.append(run)
            run = runs.get(run["parent_id"])
        return chain

    def covered_db(self, run: dict, runs: dict, scopes: set[str]) -> str | None:
        """Why a hold covers the run, per the database; None when none does."""
        for i, member in enumerate(self.ancestors(run, runs)):
            whose = "its own" if i == 0 else f"ancestor {self.label(member['id'])}'s"
            if member["halted_at"] is not None:
                return f"{whose} halted_at"
            if "*" in scopes:
                return "the global halt"
            if member["workflow"] in scopes:
                return f"{whose} workflow halt ({member['workflow']})"
        return None

    def covered_model(self, run: dict, runs: dict) -> set[str]:
        """The holds operators placed and did not lift that cover the run."""
        sources = set()
        for i, member in enumerate(self.ancestors(run, runs)):
            if member["id"] in self.held_runs:
                sources.add("run")
            if "*" in self.held_scopes:
                sources.add("all")
            if member["workflow"] in self.held_scopes:
                sources.add("own-workflow" if i == 0 else "ancestor-workflow")
        return sources

    # -- what the step functions report ---------------------------------------------------------

    def on_step_start(self, run_id: str, workflow: str, key: str, info: dict) -> None:
        try:
            self._on_step_start(UUID(run_id), key, info)
        except Exception:  # never let the check itself fail the step it watches
            self.errors.append(traceback.format_exc())

    def _on_step_start(self, run_id: UUID, key: str, info: dict) -> None:
        self.observe_holds()
        runs = {r["id"]: r for r in Run.objects.values(*RUN_FIELDS)}
        run = runs[run_id]
        scopes = set(Policy.objects.filter(halted_at__isnull=False).values_list("scope", flat=True))
        name = self.label(run_id)
        why = self.covered_db(run, runs, scopes)
        # An operator acted from elsewhere after this step's start was written (the second
        # machine): a hold, cancel or budget it placed came after the start, which stands.
        late = self.instruments.acted
        if why is not None and not late:
            self.violate("1", f"step {key!r} of {name} started while {why} held it")
        if info.get("compensation"):
            return  # undoing stays possible after a cancel and past budgets
        if info.get("resolving"):
            # A step found `started` that a cancel re-sends with its key before undoing it
            # (docs/governance.md: a cancel undoes what may have happened): only a re-send.
            recovered = Step.objects.filter(run_id=run_id, key=key).values_list(
                "recovered", flat=True
            )
            if list(recovered) != ["resent"]:
                self.violate("1b", f"step {key!r} of {name} ran fresh while its run was undone")
            return
        if info.get("transaction"):  # the engine looks no shared budget up for these: do it here
            budgeted = Q(daily_budget_micros__isnull=False) | Q(daily_budget_tokens__isnull=False)
            in_scope = Q(scope__in=[run["workflow"], "*"])
            shared = tuple(
                Policy.objects.filter(in_scope, budgeted).values_list("scope", flat=True)
            )
        else:  # the engine's own lookup (its cache may lag a budget set a moment ago elsewhere)
            shared = self.instruments.shared
        self.booking[(str(run_id), key)] = shared
        if late:
            return
        if run["cancel_requested_at"] is not None:
            self.violate("1b", f"step {key!r} of {name} started after its run was cancelled")
        if info.get("approval") is not None:
            status = ApprovalRequest.objects.get(pk=info["approval"]).status
            if status != "approved":
                self.violate("1c", f"step {key!r} of {name} started with its approval {status}")
        self.check_admission(run, key, info, shared)

    def check_admission(self, run: dict, key: str, info: dict, shared: tuple[str, ...]):
        name = self.label(run["id"])
        step = Step.objects.filter(run_id=run["id"], key=key).first()  # none yet: a transaction
        own = (step.reserved_micros, step.reserved_tokens) if step else (0, 0)
        need = (COST.micros, COST.tokens) if info.get("estimated") else (0, 0)
        checks = [
            ("run", "micro-USD", run["budget_micros"], run["cost_micros"],
             run["reserved_micros"] - own[0], need[0]),
            ("run", "tokens", run["budget_tokens"], run["tokens_in"] + run["tokens_out"],
             run["reserved_tokens"] - own[1], need[1]),
        ]  # fmt: skip
        today = timezone.now().date()
        hold = self.holds.get(step.pk) if step else None
        policies = {p.scope: p for p in Policy.objects.filter(scope__in=shared)}
        for scope in shared:
            policy = policies.get(scope)
            if policy is None:
                continue
            ledger = BudgetLedger.objects.filter(scope=scope, day=today).first()
            spent = (ledger.spent_micros, ledger.spent_tokens) if ledger else (0, 0)
            reserved = (ledger.reserved_micros, ledger.reserved_tokens) if ledger else (0, 0)
            mine = own if hold is not None and scope in hold[0] and hold[1] == today else (0, 0)
            checks += [
                (f"{scope!r} daily", "micro-USD", policy.daily_budget_micros, spent[0],
                 reserved[0] - mine[0], need[0]),
                (f"{scope!r} daily", "tokens", policy.daily_budget_tokens, spent[1],
                 reserved[1] - mine[1], need[1]),
            ]  # fmt: skip
        for budget, unit, limit, spent, others, needed in checks:
            if limit is None:
                continue
            if spent + others >= limit or spent + others + needed > limit:
                self.violate(
                    "4b",
                    f"step {key!r} of {name} started on {today} past the {budget} budget: "
                    f"{spent} {unit} spent and {others} held by other steps of {limit}, "
                    f"needing {needed}",
                )

    def observe_completions(self) -> None:
        """Note the shared budgets in force when each costed step is first seen completed."""
        done = Step.objects.filter(status="completed").filter(
            Q(cost_micros__gt=0) | Q(tokens_in__gt=0) | Q(tokens_out__gt=0)
        )
        new = done.exclude(pk__in=list(self.finished_under)).values_list("id", "run__workflow")
        if not new:
            return
        budgeted = Q(daily_budget_micros__isnull=False) | Q(daily_budget_tokens__isnull=False)
        scopes = set(Policy.objects.filter(budgeted).values_list("scope", flat=True))
        for pk, workflow in new:
            self.finished_under[pk] = tuple(s for s in (workflow, "*") if s in scopes)

    def observe_holds(self) -> None:
        """Note which shared scopes each new hold was taken against (the engine's lookup for
        the step it started last): called after every commit point of an execution."""
        started = Step.objects.filter(status="started").filter(
            Q(reserved_micros__gt=0) | Q(reserved_tokens__gt=0)
        )
        current = {
            pk: (day, micros, tokens, tuple(scopes or ()))
            for pk, day, micros, tokens, scopes in started.values_list(
                "id", "reserved_on", "reserved_micros", "reserved_tokens", "reserved_scopes"
            )
        }
        for pk in list(self.holds):
            if pk not in current:
                del self.holds[pk]
        # A hold moved to other ledgers (re-sent under a budget set since) is a new hold too,
        # even for the same amount on the same day.
        for pk, (day, micros, tokens, scopes) in current.items():
            if pk not in self.holds or self.holds[pk][1:] != (day, micros, tokens, scopes):
                self.holds[pk] = (self.instruments.shared, day, micros, tokens, scopes)

    # -- operator actions -----------------------------------------------------------------------

    def perform(self, action: tuple, concurrent: bool = False) -> None:
        kind, *args = action
        try:
            getattr(self, f"_{kind}")(*args)
        except (OperationError, DecisionError):
            pass  # refused with a reason: nothing was done
        except Exception:
            if not concurrent:
                raise
            self.errors.append(f"{action!r} between two commit points:\n{traceback.format_exc()}")

    def _halt(self, target, reason: str) -> None:
        marker = self.marker(reason)
        if target[0] == "run":
            run_id = self.pick(target[1], Run.objects.exclude(status__in=TERMINAL))
            if run_id is None:
                return
            halt(str(run_id), self.operator, marker)
            self.held_runs.add(run_id)
            self.expect(run_id, {"run.halted", "run.halt_requested"}, "reason", marker, "halt")
        else:
            spec, scope = self.target(target)
            halt(spec, self.operator, marker)
            self.held_scopes.add(scope)
            self.expect(None, {"scope.halted"}, "reason", marker, f"halt {spec}")

    def _unhalt(self, target) -> None:
        marker = self.marker("lift")
        if target[0] == "run":
            live = Run.objects.exclude(status__in=TERMINAL)
            held = live.filter(Q(halted_at__isnull=False) | Q(pk__in=self.held_runs))
            run_id = self.pick(target[1], held if held.exists() else live)
            if run_id is None:
                return
            unhalt(str(run_id), self.operator, marker)
            self.held_runs.discard(run_id)
            self.expect(run_id, {"run.unhalted"}, "reason", marker, "unhalt")
        else:
            spec, scope = self.target(target)
            unhalt(spec, self.operator, marker)
            self.held_scopes.discard(scope)
            self.expect(None, {"scope.unhalted"}, "reason", marker, f"unhalt {spec}")

    def _cancel(self, ref) -> None:
        run_id = self.pick(ref, Run.objects.exclude(status__in=TERMINAL))
        if run_id is not None:
            marker = self.marker("cancel")
            cancel_run(run_id, self.operator, marker)
            kinds = {"run.cancel_requested", "run.cancelled"}
            self.expect(run_id, kinds, "reason", marker, "cancel")

    def _retry(self, ref) -> None:
        run_id = self.pick(ref, Run.objects.filter(status="failed"))
        if run_id is not None:
            marker = self.marker("retry")
            retry_run(run_id, self.operator, marker)
            self.expect(run_id, {"run.retry_requested"}, "reason", marker, "retry")

    def _fork(self, ref, step_ref: int, by_key: bool) -> None:
        run_id = self.pick(ref, Run.objects.filter(pk__in=Step.objects.values("run_id")))
        if run_id is None:
            return
        steps = list(Step.objects.filter(run_id=run_id).order_by("seq").values_list("seq", "key"))
        seq, key = steps[step_ref % len(steps)]
        runs = {r["id"]: r for r in Run.objects.values(*RUN_FIELDS)}
        sources = self.covered_model(runs[run_id], runs)
        marker = self.marker("fork")
        fork = fork_run(run_id, key if by_key else seq, self.operator, marker)
        origin, copy = (
            Run.objects.filter(pk=pk).values(*CARRIED).get() for pk in (run_id, fork.pk)
        )
        if copy != origin:
            names = f"fork {self.label(fork.pk)} of {self.label(run_id)}"
            self.violate("9c", f"{names} has {copy}, its origin {origin}")
        # A fork of a halted run is halted: the origin's run hold (its own or an ancestor's)
        # becomes a hold of the fork's own, lifted by unhalting the fork. What should hold a
        # fork whose origin only an ancestor's workflow halt covers is left open (2b skips it;
        # 2 still wants its status to match the holds the database shows).
        if "run" in sources:
            self.held_runs.add(fork.pk)
        elif "ancestor-workflow" in sources:
            self.open_forks.add(fork.pk)
        self.note_budget(fork.pk)
        self.expect(run_id, {"run.forked"}, "reason", marker, "fork")

    def _budget(self, target, usd, tokens, run_usd) -> None:
        changes: dict[str, Any] = {}
        if usd != "keep":
            changes["usd"] = None if usd is None else Decimal(usd)
        if tokens != "keep":
            changes["tokens"] = tokens
        marker = self.marker("budget")
        if target[0] == "run":
            run_id = self.pick(target[1], Run.objects.exclude(status__in=TERMINAL))
            if run_id is None:
                return
            set_budget(str(run_id), self.operator, marker, **changes)
            self.note_budget(run_id)
            self.expect(run_id, {"budget.set"}, "reason", marker, "budget")
        else:
            if run_usd != "keep":
                changes["run_usd"] = None if run_usd is None else Decimal(run_usd)
            spec, _ = self.target(target)
            set_budget(spec, self.operator, marker, **changes)
            self.expect(None, {"budget.set"}, "reason", marker, f"budget {spec}")

    def _decide(self, ref: int, verdict: str) -> None:
        pending = list(ApprovalRequest.objects.filter(status="pending").order_by("id"))
        if pending:
            request = pending[ref % len(pending)]
            marker = self.marker(verdict)
            decide(request.pk, verdict, self.approver, marker)
            kinds = {"approval.decided"}
            self.expect(request.run_id, kinds, "comment", marker, verdict, self.approver)

    def _revoke(self, ref: int) -> None:
        granted = list(ApprovalRequest.objects.filter(status="approved").order_by("id"))
        if granted:
            request = granted[ref % len(granted)]
            marker = self.marker("revoke")
            revoke(request.pk, self.approver, marker)
            kinds = {"approval.revoked"}
            self.expect(request.run_id, kinds, "reason", marker, "revoke", self.approver)

    def _shutdown(self) -> None:
        if self.lease is not None:
            self.lease.stopping.set()

    def _takeover(self) -> None:
        """Another worker claims the executing run (its lease lapsed) and executes it, without
        faults, while this execution is stalled between two commit points."""
        if self.current is None:
            return
        saved = (self.current, self.lease, probe.crash_countdown, self.instruments.__dict__.copy())
        probe.crash_countdown = None
        try:
            past = timezone.now() - timedelta(seconds=1)
            Run.objects.filter(pk=self.current, status="running").update(lease_until=past)
            self.claim_and_execute(self.current, None, None)
        finally:
            self.current, self.lease, probe.crash_countdown = saved[:3]
            self.instruments.__dict__.update(saved[3])

    def _signal(self, ref, name: str) -> None:
        run_id = self.pick(ref, Run.objects.exclude(status__in=TERMINAL))
        if run_id is not None:
            self.counter += 1
            sent = send_signal(
                run_id, name, {"n": self.counter}, sent_by=self.operator.get_username()
            )
            self.expect(run_id, {"signal.received"}, "signal_id", sent.pk, f"signal {name}")

    def _limits(self, per_key) -> None:
        marker = self.marker("limits")
        set_limits("model-tenant", self.operator, marker, max_running_per_key=per_key)
        self.expect(None, {"limits.set"}, "reason", marker, "limits")

    def _prune(self, upto, exact: bool = False) -> None:
        """Prune the runs that ended before the `upto`-th end (or all that ended), and check
        invariant 9g: prune never fails (a fork of a fork wedged it with an IntegrityError),
        takes exactly the families that may go (`exact`: nothing else holds a lock; else at
        most those), keeps whatever a run that stays points at, and tells the true count."""
        fields = ("id", "parent_id", "forked_from_id", "status", "finished_at")
        runs = {r["id"]: r for r in Run.objects.values(*fields)}
        ends = sorted(r["finished_at"] for r in runs.values() if r["status"] in TERMINAL)
        if upto == "all" or not ends:
            before = timezone.now() + timedelta(days=1)
        else:
            before = ends[upto % len(ends)]
        may_go = prunable(runs, before)
        steps = list(Step.objects.filter(run_id__in=may_go).values(*STEP_FIELDS))
        told = Event.objects.filter(type="runs.pruned").count()
        try:
            prune(finished_before=before, actor=self.operator.get_username())
        except Exception:
            self.violate("9g", f"prune failed:\n{traceback.format_exc()}")
            return
        stayed = {r["id"]: r for r in Run.objects.values(*fields)}
        gone = set(runs) - set(stayed)
        if (gone != may_go) if exact else not gone <= may_go:
            names = lambda ids: sorted(self.label(r) for r in ids)  # noqa: E731
            self.violate("9g", f"prune took {names(gone)}, of those that may go {names(may_go)}")
        dangling = [
            f"{self.label(r['id'])} points at pruned {self.label(r[ref])}"
            for r in stayed.values()
            for ref in ("parent_id", "forked_from_id")
            if r[ref] in gone
        ]
        if dangling:
            self.violate("9g", "; ".join(dangling))
        audits = list(
            Event.objects.filter(type="runs.pruned")
            .order_by("id")
            .values_list("payload", flat=True)
        )
        if len(audits) != told + 1 or audits[-1].get("runs") != len(gone):
            self.violate("9g", f"prune of {len(gone)} runs told {audits[told:]}")
        self.pruned_steps += [s for s in steps if s["run_id"] in gone]
        self.audit = [entry for entry in self.audit if entry[0] not in gone]

    # -- executing runs ---------------------------------------------------------------------

    def check_flow(self, run: Run) -> None:
        """Invariant 9d, at each claim: a limited workflow's runs of one concurrency key run
        no more at once than its limit (the operator's, else the code's)."""
        if run.workflow not in LIMITED:
            return
        claim = Event.objects.filter(run_id=run.pk).order_by("-seq").values_list("type", flat=True)
        if claim.first() == "run.recovered":
            return  # it was running already (its worker died): no new slot is taken
        policy = Policy.objects.filter(scope=run.workflow).values("max_running_per_key").first()
        limit = (policy or {}).get("max_running_per_key") or LIMITED[run.workflow]
        if limit is None:
            return
        running = Run.objects.filter(
            workflow=run.workflow, concurrency_key=run.concurrency_key, status="running"
        ).count()
        if running > limit:
            self.violate("9d", f"{running} runs of {run.workflow} with key "
                               f"{run.concurrency_key!r} run at once (limit {limit})")  # fmt: skip

    def start_one(self, workflow: str, budget: str | None, attempts: int, payload) -> None:
        pid = f"p{len(probe.payloads)}"
        probe.payloads[pid] = payload
        usd = None if budget is None else Decimal(budget)
        run = start_run(workflow, {"payload": pid}, budget_usd=usd, max_attempts=attempts)
        self.label(run.pk)
        self.note_budget(run.pk)

    def claim_one(self, run_id) -> list[Run]:
        mine = self.worker.claims.mine
        # claim this run, not whichever is due first (SQLite)
        self.worker.claims.mine = mine & Q(pk=run_id)
        try:
            return self.worker.claim(1)
        finally:
            self.worker.claims.mine = mine

    def claim_and_execute(self, run_id, crash, concurrent, elsewhere=None) -> None:
        claimed = self.claim_one(run_id)
        if claimed:
            first, burst = concurrent or (0, [])
            burst = {first + i: a for i, a in enumerate(burst)}
            self.execute_claimed(claimed[0], crash, burst, elsewhere)

    def execute_claimed(self, run: Run, crash, concurrent: dict, elsewhere=None) -> None:
        self.check_flow(run)
        if run.workflow in ASYNC_WORKFLOWS:
            crash = None  # a crash raised on a database thread is no process dying
        crash_after = crash[1] if crash and crash[0] == "after-commit" else None
        self.instruments.start(crash_after, concurrent, elsewhere)
        probe.crash_countdown = crash[1] if crash and crash[0] == "in-step" else None
        self.current, self.lease = run.pk, Lease(run.id, run.lease_epoch)
        try:
            outcome = execute(run, self.lease)
            if outcome == "abandoned":  # a database error other than a lost connection
                self.violate("9a", f"an execution of {self.label(run.pk)} was abandoned")
        except Crash:
            # The process died there; its lease lapses (lapse_lease) and it resumes. Nothing
            # of this execution writes any more (a completion it carried dies with it).
            self.crashes[run.pk] += 1
            self.lease.lost.set()
            self.lease.pending = None
        finally:
            self.instruments.stop()
            probe.crash_countdown = None
            self.current = self.lease = None

    # -- invariants ------------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        if self._snapshot is None:
            self.observe_holds()
            runs = {r["id"]: r for r in Run.objects.order_by("created_at").values(*RUN_FIELDS)}
            for run_id in runs:
                self.label(run_id)
                if run_id not in self.ceilings:
                    self.note_budget(run_id)
            self._snapshot = Snapshot(
                runs=runs,
                steps=list(Step.objects.order_by("run_id", "seq").values(*STEP_FIELDS)),
                halted_scopes=set(
                    Policy.objects.filter(halted_at__isnull=False).values_list("scope", flat=True)
                ),
                ledgers=list(BudgetLedger.objects.values()),
            )
        return self._snapshot

    def steps_of(self, run_id) -> list[dict]:
        return [s for s in self.snapshot().steps if s["run_id"] == run_id]

    @invariant()
    def all_invariants_hold(self):
        """Each check asserts on a line of its own, so Hypothesis tells their failures apart."""
        self.no_unexpected_errors()
        self.inv1_no_step_starts_under_a_hold()
        self.inv1b_no_step_starts_after_a_cancel()
        self.inv1c_no_step_starts_without_its_approval()
        self.inv2_halted_exactly_when_held()
        self.inv2b_holds_are_those_operators_placed()
        self.inv3a_run_reserved_equals_held()
        self.inv3b_ledger_reserved_equals_held()
        self.inv4a_run_cost_is_the_sum_of_its_steps()
        self.inv4b_no_step_starts_past_a_budget()
        self.inv4c_runs_stay_within_budget()
        self.inv4d_ledger_spend_is_booked_where_it_was_held()
        self.inv5a_idempotency_keys_unique_per_run()
        self.inv5b_one_logical_call_per_idempotency_key()
        self.inv5c_compensations_undo_only_their_own_runs_effects()
        self.inv5d_a_transactional_write_commits_with_its_checkpoint()
        self.inv5e_every_call_is_an_attempt_the_database_knows()
        self.inv6_replay_hands_back_the_live_value()
        self.inv7_every_action_has_one_audit_event()
        self.inv8_compensations_complete()
        self.inv6b_replay_never_finds_the_code_changed()
        self.inv9c_forks_carry_their_options()
        self.inv9d_per_key_limits_hold()

    def inv9c_forks_carry_their_options(self):
        assert not self.violations["9c"], "invariant 9c: " + "; ".join(self.violations["9c"])

    def inv9d_per_key_limits_hold(self):
        assert not self.violations["9d"], "invariant 9d: " + "; ".join(self.violations["9d"])

    def no_unexpected_errors(self):
        assert not self.errors, "\n".join(self.errors)

    def inv1_no_step_starts_under_a_hold(self):
        assert not self.violations["1"], "invariant 1: " + "; ".join(self.violations["1"])

    def inv1b_no_step_starts_after_a_cancel(self):
        assert not self.violations["1b"], "invariant 1b: " + "; ".join(self.violations["1b"])

    def inv1c_no_step_starts_without_its_approval(self):
        assert not self.violations["1c"], "invariant 1c: " + "; ".join(self.violations["1c"])

    def inv2_halted_exactly_when_held(self):
        snap = self.snapshot()
        wrong = []
        for run in snap.runs.values():
            if run["status"] not in ("pending", "waiting", "over_budget", "halted"):
                continue  # terminal, or executing (or its worker died and its lease runs)
            why = self.covered_db(run, snap.runs, snap.halted_scopes)
            if (run["status"] == "halted") != (why is not None):
                held = f"held by {why}" if why else "held by nothing"
                wrong.append(f"{self.label(run['id'])} is {run['status']}, {held}")
        assert not wrong, "invariant 2: " + "; ".join(wrong)

    def inv2b_holds_are_those_operators_placed(self):
        snap = self.snapshot()
        wrong = []
        if snap.halted_scopes != self.held_scopes:
            wrong.append(f"halted scopes {snap.halted_scopes}, placed {self.held_scopes}")
        for run in snap.runs.values():
            lineage = {member["id"] for member in self.ancestors(run, snap.runs)}
            if run["status"] in TERMINAL or lineage & self.open_forks:
                continue
            placed = self.covered_model(run, snap.runs)
            why = self.covered_db(run, snap.runs, snap.halted_scopes)
            if bool(placed) != (why is not None):
                wrong.append(
                    f"{self.label(run['id'])} ({run['status']}): holds placed and not lifted: "
                    f"{sorted(placed) or 'none'}; held in the database by {why or 'nothing'}"
                )
        assert not wrong, "invariant 2b: " + "; ".join(wrong)

    def inv3a_run_reserved_equals_held(self):
        snap = self.snapshot()
        held: dict[UUID, list[int]] = defaultdict(lambda: [0, 0])
        for step in snap.steps:
            if step["status"] == "started":
                held[step["run_id"]][0] += step["reserved_micros"]
                held[step["run_id"]][1] += step["reserved_tokens"]
        wrong = [
            f"{self.label(run['id'])} ({run['status']}) reserves "
            f"{(run['reserved_micros'], run['reserved_tokens'])} while its started steps hold "
            f"{tuple(held[run['id']])}"
            for run in snap.runs.values()
            if [run["reserved_micros"], run["reserved_tokens"]] != held[run["id"]]
        ]
        assert not wrong, "invariant 3a: " + "; ".join(wrong)

    def inv3b_ledger_reserved_equals_held(self):
        snap = self.snapshot()
        steps = {s["id"]: s for s in snap.steps}
        expected: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
        for pk, (scopes, day, *_) in self.holds.items():
            step = steps.get(pk)
            if step is None or step["status"] != "started":
                continue
            for scope in scopes:
                expected[(scope, day)][0] += step["reserved_micros"]
                expected[(scope, day)][1] += step["reserved_tokens"]
        actual = {
            (row["scope"], row["day"]): [row["reserved_micros"], row["reserved_tokens"]]
            for row in snap.ledgers
        }
        wrong = [
            f"ledger {scope!r} {day} reserves {actual.get((scope, day), [0, 0])} while the "
            f"started steps hold {expected.get((scope, day), [0, 0])} against it"
            for scope, day in sorted(set(actual) | set(expected))
            if actual.get((scope, day), [0, 0]) != expected.get((scope, day), [0, 0])
        ]
        assert not wrong, "invariant 3b: " + "; ".join(wrong)

    def inv4a_run_cost_is_the_sum_of_its_steps(self):
        snap = self.snapshot()
        sums: dict[UUID, list[int]] = defaultdict(lambda: [0, 0, 0])
        for step in snap.steps:
            for i, name in enumerate(("cost_micros", "tokens_in", "tokens_out")):
                sums[step["run_id"]][i] += step[name]
        wrong = [
            f"{self.label(run['id'])} spent {spent} while its steps spent {sums[run['id']]}"
            for run in snap.runs.values()
            if (spent := [run["cost_micros"], run["tokens_in"], run["tokens_out"]])
            != sums[run["id"]]
        ]
        assert not wrong, "invariant 4a: " + "; ".join(wrong)

    def inv4b_no_step_starts_past_a_budget(self):
        assert not self.violations["4b"], "invariant 4b: " + "; ".join(self.violations["4b"])

    def inv4c_runs_stay_within_budget(self):
        snap = self.snapshot()
        wrong = []
        for run in snap.runs.values():
            micros, tokens = self.ceilings.get(run["id"], [None, None])
            if micros is not None and run["cost_micros"] > micros + COST.micros:
                wrong.append(f"{self.label(run['id'])} spent {run['cost_micros']} of {micros}")
            used = run["tokens_in"] + run["tokens_out"]
            if tokens is not None and used > tokens + COST.tokens:
                wrong.append(f"{self.label(run['id'])} used {used} tokens of {tokens}")
        assert not wrong, "invariant 4c: " + "; ".join(wrong)

    def inv4d_ledger_spend_is_booked_where_it_was_held(self):
        """A step's spend goes to the shared budgets in force when it started and when it
        finished (either will do where a budget was set or removed in between), on the day of
        its hold, or of its finish if it held nothing."""
        snap = self.snapshot()
        low: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
        high: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
        for step in [*snap.steps, *self.pruned_steps]:
            spent = (step["cost_micros"], step["tokens_in"] + step["tokens_out"])
            if step["status"] != "completed" or not any(spent):
                continue
            started = set(self.booking.get((str(step["run_id"]), step["key"]), ()))
            finished = set(self.finished_under.get(step["id"], started))
            day = step["reserved_on"] or step["finished_at"].astimezone(UTC).date()
            for scope in started | finished:
                for bound in (high, low) if scope in started & finished else (high,):
                    bound[(scope, day)][0] += spent[0]
                    bound[(scope, day)][1] += spent[1]
        actual = {
            (row["scope"], row["day"]): [row["spent_micros"], row["spent_tokens"]]
            for row in snap.ledgers
        }
        wrong = []
        for scope, day in sorted(set(actual) | set(high)):
            got, least, most = (b.get((scope, day), [0, 0]) for b in (actual, low, high))
            if not all(lo <= n <= hi for n, lo, hi in zip(got, least, most, strict=True)):
                booked = f"{least}" if least == most else f"from {least} to {most}"
                wrong.append(
                    f"ledger {scope!r} {day} spent {got} while the steps booked on it spent "
                    f"{booked}"
                )
        assert not wrong, "invariant 4d: " + "; ".join(wrong)

    def inv5a_idempotency_keys_unique_per_run(self):
        counts = Counter((s["run_id"], s["idempotency_key"]) for s in self.snapshot().steps)
        wrong = [
            f"{self.label(r)} has {n} steps keyed {k!r}" for (r, k), n in counts.items() if n > 1
        ]
        assert not wrong, "invariant 5a: " + "; ".join(wrong)

    def inv5b_one_logical_call_per_idempotency_key(self):
        wrong = [
            f"{key}: {sorted(map(repr, calls))}"
            for key, calls in probe.effects.items()
            if len(calls) > 1
        ]
        assert not wrong, "invariant 5b: " + "; ".join(wrong)

    def inv5e_every_call_is_an_attempt_the_database_knows(self):
        """Calls counted as a multiset: a step function called more often than its row has
        attempts was called again silently (a set per key hid that: a re-send looks the
        same as the first call)."""
        steps = Step.objects.exclude(kind=StepKind.TRANSACTION).values_list(
            "idempotency_key", "attempt"
        )
        attempts = dict(steps)
        wrong = [
            f"{key}: called {calls} times, {attempts[key]} attempts recorded"
            for key, calls in probe.calls.items()
            if key in attempts and calls > attempts[key]
        ]
        assert not wrong, "invariant 5e: " + "; ".join(wrong)

    def inv5c_compensations_undo_only_their_own_runs_effects(self):
        wrong = [f"{self.label(run_id)} undid {key!r}" for run_id, key in probe.foreign_undos]
        assert not wrong, "invariant 5c: " + "; ".join(wrong)

    def inv5d_a_transactional_write_commits_with_its_checkpoint(self):
        snap = self.snapshot()
        writes = Counter(Effect.objects.values_list("idempotency_key", flat=True))
        wrong = []
        for step in snap.steps:
            if step["key"] not in TRANSACTIONAL:
                continue
            run = snap.runs[step["run_id"]]
            if step["seq"] < (run["forked_at_seq"] or 0):
                continue  # a fork's copy: the write is its origin's
            expected = 1 if step["status"] == "completed" else 0
            found = writes.pop(step["idempotency_key"], 0)
            if found != expected:
                wrong.append(
                    f"step {step['key']!r} of {self.label(run['id'])} is {step['status']} "
                    f"with {found} writes"
                )
        wrong += [f"{n} writes under {key!r} and no checkpoint" for key, n in writes.items()]
        assert not wrong, "invariant 5d: " + "; ".join(wrong)

    def expected_value(self, run_id: str, key: str, depth: int = 0):
        idem = f"{run_id}:{key}"
        if idem in probe.live:
            return probe.live[idem]
        if idem in probe.results:
            return canon(probe.results[idem])
        run = self.snapshot().runs.get(UUID(run_id))
        if run is None or run["forked_from_id"] is None or depth > 5:
            return None
        step = next((s for s in self.steps_of(run["id"]) if s["key"] == key), None)
        if step is None or step["seq"] >= (run["forked_at_seq"] or 0):
            return None
        return self.expected_value(str(run["forked_from_id"]), key, depth + 1)

    def inv6_replay_hands_back_the_live_value(self):
        wrong = []
        for run_id, key, value in probe.received[self.checked_received :]:
            expected = self.expected_value(run_id, key)
            if expected is not None and expected != value:
                wrong.append(f"step {key!r} of {self.label(run_id)}: live {expected}, got {value}")
        self.checked_received = len(probe.received)
        assert not wrong, "invariant 6: " + "; ".join(wrong)

    def inv6b_replay_never_finds_the_code_changed(self):
        """These workflows never change: a non-determinism error is the engine's own doing."""
        wrong = []
        for run in self.snapshot().runs.values():
            error = run["error"] or {}
            for record in (error, error.get("compensation_error") or {}):
                if record.get("code") == "non_determinism":
                    wrong.append(f"{self.label(run['id'])} ({run['status']}): {record['message']}")
        assert not wrong, "invariant 6b: " + "; ".join(wrong)

    def inv7_every_action_has_one_audit_event(self):
        if not self.audit:
            return
        events = list(
            Event.objects.exclude(actor="system").values("run_id", "type", "actor", "payload")
        )
        wrong = []
        for run_id, types, field, value, action, actor in self.audit:
            found = sum(
                1
                for e in events
                if e["run_id"] == run_id
                and e["type"] in types
                and e["actor"] == actor
                and (e["payload"] or {}).get(field) == value
            )
            if found != 1:
                where = self.label(run_id) if run_id else "no run"
                wrong.append(f"{action} ({field}={value!r}) on {where} has {found} audit events")
        assert not wrong, "invariant 7: " + "; ".join(wrong)

    def inv8_compensations_complete(self):
        snap = self.snapshot()
        wrong = []
        for run in snap.runs.values():
            if run["status"] not in ("cancelled", "failed"):
                continue
            steps = self.steps_of(run["id"])
            own_from = run["forked_at_seq"] or 0
            done = [
                s["key"]
                for s in steps
                if s["key"] in COMPENSABLE and s["status"] == "completed" and s["seq"] >= own_from
            ]
            undone = [
                s["key"].removeprefix("undo:")
                for s in steps
                if s["key"].startswith("undo:") and s["status"] == "completed"
            ]
            if undone != done[::-1]:
                wrong.append(
                    f"{self.label(run['id'])} ({run['status']}) completed {done} itself "
                    f"and undid {undone}"
                )
        assert not wrong, "invariant 8: " + "; ".join(wrong)


class EngineModel(EngineBase):
    """The first machine: every operator action, crashes and faults at commit points, in this
    thread (an action between two commit points is taken as if concurrent)."""

    # -- rules ------------------------------------------------------------------------------------

    @initialize(workflows=st.lists(st.sampled_from(TOP_WORKFLOWS), min_size=1, max_size=2))
    def begin(self, workflows):
        """Every example starts with a run or two, so that most rules have one to act on."""
        for workflow in workflows:
            self.start_one(workflow, None, 1, None)

    @_rule(
        workflow=st.sampled_from(TOP_WORKFLOWS),
        budget=st.sampled_from([None, "1", "2", "3", "5"]),
        attempts=st.integers(1, 3),
        payload=JSON,
    )
    def start(self, workflow, budget, attempts, payload):
        self.start_one(workflow, budget, attempts, payload)

    @_rule(on=TARGET, reason=HALT_REASON)
    def halt(self, on, reason):
        self.perform(("halt", on, reason))

    @_rule(on=TARGET)
    def unhalt(self, on):
        self.perform(("unhalt", on))

    @_rule(when="live", ref=RUN)
    def cancel(self, ref):
        self.perform(("cancel", ref))

    @_rule(when="failed", ref=RUN)
    def retry(self, ref):
        self.perform(("retry", ref))

    @_rule(when="steps", ref=RUN, step=st.integers(0, 7), by_key=st.booleans())
    def fork(self, ref, step, by_key):
        self.perform(("fork", ref, step, by_key))

    @_rule(on=TARGET, usd=USD, tokens=TOKENS, run_usd=RUN_USD)
    def budget(self, on, usd, tokens, run_usd):
        self.perform(("budget", on, usd, tokens, run_usd))

    @_rule(when="pending", ref=st.integers(0, 3), verdict=st.sampled_from(["approve", "reject"]))
    def decide(self, ref, verdict):
        self.perform(("decide", ref, verdict))

    @_rule(when="approved", ref=st.integers(0, 3))
    def revoke(self, ref):
        self.perform(("revoke", ref))

    @_rule(when="live", ref=RUN, name=SIGNAL)
    def signal(self, ref, name):
        self.perform(("signal", ref, name))

    @_rule(by=st.sampled_from([1, 31, 61, 91, 3600, "midnight"]))
    def move_clock(self, by):
        """Past leases (30 s), sleeps and waits (30-90 s), or to just past the next UTC
        midnight, where shared daily budgets start afresh."""
        if by == "midnight":
            self.clock.to_next_midnight()
        else:
            self.clock.advance(by)

    @_rule()
    def toggle_outage(self):
        probe.outage = not probe.outage

    @_rule(when="running", ref=st.integers(0, 3))
    def lapse_lease(self, ref):
        run_id = self.pick(ref, Run.objects.filter(status="running"))
        if run_id is not None:
            past = timezone.now() - timedelta(seconds=1)
            Run.objects.filter(pk=run_id, status="running").update(lease_until=past)

    @_rule(when="resumable", ref=st.integers(0, 3), crash=CRASH, concurrent=CONCURRENT)
    def execute(self, ref, crash, concurrent):
        """Execute a runnable run; or resume one whose execution crashed (no worker holds it
        here), its lease made to lapse first."""
        resumable = Q(runnable_filter(timezone.now())) | Q(status="running")
        run_id = self.pick(ref, Run.objects.filter(resumable))
        if run_id is not None:
            past = timezone.now() - timedelta(seconds=1)
            Run.objects.filter(pk=run_id, status="running").update(lease_until=past)
            self.claim_and_execute(run_id, crash, concurrent)

    @_rule(when="runnable")
    def drive(self):
        """Claim and execute whatever is runnable, like an idle worker, without faults."""
        for _ in range(12):
            claimed = self.worker.claim(1)
            if not claimed:
                return
            self.execute_claimed(claimed[0], None, {})


class ConcurrentModel(EngineBase):
    """The second machine (issue 29, item 6): what the first never reached. Its operator acts
    from a database connection and thread of its own, at an execution's commit points or inside
    its transactions (PostgreSQL), while the execution holds its locks; workflow code works
    between steps (the operator may act there, the test waits for the returned step to be
    recorded, or the process dies); an async workflow gathers a step that fails with one still
    in flight (or interrupted in flight); a workflow has a concurrency key and a priority;
    forks of forks and child runs are pruned. Every invariant of the first machine holds, and:

    9a  no statement of any connection loses a deadlock, no execution is abandoned
    9b  a step function is called again only after its call failed, was interrupted or cut off,
        or its process died (never once the step's completion was recorded): no silent second
        call (9h: and a call made again after an interruption or a crash is marked `resent`)
    9c  a fork carries its origin's options (priority, concurrency key, budgets, attempts)
    9d  no more runs of a concurrency key run at once than its limit
    9e  a step that returned is recorded while its workflow works between steps (within
        RECORDED_WITHIN; the window is STEPGUARD_COMPLETION_WINDOW)
    9f  no finished run keeps a `started` step
    9g  prune never fails, takes exactly the families that may go (never what a run that stays
        points at: a fork of a fork), and tells the true count
    """

    def __init__(self) -> None:
        super().__init__()
        probe.on_call, probe.on_between = self.on_call, self.on_between
        self.perform(("limits", 1))  # one run per tenant at a time, until an operator says
        #: n-th work between steps of this execution -> (action, wait, crash)
        self.between_plan: dict[int, tuple] = {}
        self.between_count = 0
        #: idempotency keys whose step the test saw recorded as completed
        self.recorded: set[str] = set()
        #: idempotency key -> its run's crashes when its function was last called
        self.call_crashes: dict[str, int] = {}
        #: idempotency keys called again after an interruption or a crash (9h)
        self.resent: set[str] = set()
        #: runs the rules asked for (started, forked): what bounds an example's cost
        self.asked = 0

    def precondition_census(self) -> dict[str, int]:
        """Not the database: here what an example leaves there depends on timing (a crash in
        the completion window lands before or after the window's write; the operator's thread
        races the execution), and Hypothesis replays a failing example by its draws, so a
        precondition that read it would draw other rules on the replay and hide the failure
        (FlakyStrategyDefinition, clean-ci of 329e0e7). Every rule is drawable (one with no
        candidate does nothing), and the runs asked for, not the runs there, bound the cost."""
        return defaultdict(lambda: 1, runs=self.asked)

    # -- what the workflows report ----------------------------------------------------------

    def on_call(self, run_id: str, key: str, idem: str, ends: list[str]) -> None:
        """Invariant 9b, as a step function is called (on the engine's event loop for async
        steps: no database here)."""
        run = UUID(run_id)
        crashes, before = self.crashes[run], self.call_crashes.get(idem)
        self.call_crashes[idem] = crashes
        name = f"step {key!r} of {self.labels.get(run, run_id)}"
        if idem in self.recorded:
            self.violate("9b", f"{name} called again after its completion was recorded")
        if not ends or ends[-1] == "raised":
            return  # a first call, or a retry of a failure
        if ends[-1] in ("interrupted", "cut off") or crashes != before:
            self.resent.add(idem)  # a re-send: it may have happened
            return
        self.violate("9b", f"{name} called again after {ends} with no crash: a second call")

    def on_between(self, run_id: str, key: str) -> None:
        """Workflow code works between steps, after `key` returned: an operator action may
        land; the test may wait for `key` to be recorded (9e); the process may die."""
        self.between_count += 1
        plan = self.between_plan.pop(self.between_count, None)
        if plan is None:
            return
        action, wait, crash = plan
        if action is not None:
            self.instruments.act(action)
        if wait:
            idem, deadline = f"{run_id}:{key}", monotonic() + RECORDED_WITHIN
            done = Step.objects.filter(idempotency_key=idem, status="completed")
            while not done.exists():
                if monotonic() > deadline:
                    self.violate("9e", f"step {key!r} of {self.label(run_id)} returned and was "
                                       f"not recorded {RECORDED_WITHIN} s later")  # fmt: skip
                    break
                sleep(0.005)
            else:
                self.recorded.add(idem)
        if crash:
            raise Crash(f"working after {key}")

    # -- rules ----------------------------------------------------------------------------------

    @initialize(workflows=st.lists(st.sampled_from(CONCURRENT_WORKFLOWS), min_size=1, max_size=2))
    def begin(self, workflows):
        for workflow in workflows:
            self.start_two(workflow, "acme", 0, 2, None, {"fail": True}, None)

    @_rule(
        runs_below=MOST_RUNS,
        workflow=st.sampled_from(CONCURRENT_WORKFLOWS),
        tenant=st.sampled_from(["acme", "bolt"]),
        priority=st.sampled_from([0, 50, -5]),
        attempts=st.integers(1, 3),
        budget=st.sampled_from([None, "1", "5"]),
        gather=GATHER,
        payload=JSON,
    )
    def start(self, workflow, tenant, priority, attempts, budget, gather, payload):
        self.start_two(workflow, tenant, priority, attempts, budget, gather, payload)

    def start_two(self, workflow, tenant, priority, attempts, budget, gather, payload) -> None:
        pid = f"p{len(probe.payloads)}"
        probe.payloads[pid] = payload
        data = {"payload": pid}
        if workflow == "model-tenant":
            data["tenant"] = tenant
        if workflow == "model-gather":
            data.update(gather)
        usd = None if budget is None else Decimal(budget)
        self.asked += 1
        run = start_run(workflow, data, budget_usd=usd, max_attempts=attempts, priority=priority)
        self.label(run.pk)
        self.note_budget(run.pk)

    @_rule(action=OPERATOR_ACTION | st.just(("outage",)))
    def act(self, action):
        """An operator action while no execution runs (a prune then takes exactly what may
        go: nothing holds a lock); or the downstream services go down, or come back."""
        self.perform((*action, True) if action[0] == "prune" else action)

    def _outage(self) -> None:
        probe.outage = not probe.outage

    @_rule(
        when="steps",
        runs_below=MOST_RUNS,
        ref=RUN,
        at=st.integers(0, 5),
        again=st.integers(0, 5),
        upto=UPTO,
    )
    def fork_a_fork_and_prune(self, ref, at, again, upto):
        """The chain that wedged prune: a run forked, what is runnable run as far as it goes
        (the fork among it), the newest run with steps (the fork, often) forked in turn and
        left to run later, then a prune."""
        self.asked += 2
        self.perform(("fork", ref, at, False))
        self.run_due(3)
        self.perform(("fork", "newest", again, False))
        self.perform(("prune", upto, True))

    @_rule(when="running", ref=st.integers(0, 3))
    def lapse_lease(self, ref):
        run_id = self.pick(ref, Run.objects.filter(status="running"))
        if run_id is not None:
            past = timezone.now() - timedelta(seconds=1)
            Run.objects.filter(pk=run_id, status="running").update(lease_until=past)

    @_rule(
        when="resumable",
        ref=st.integers(0, 3),
        elsewhere=ELSEWHERE,
        between=BETWEEN,
        crash=st.one_of(
            st.none(), st.none(), st.tuples(st.just("after-commit"), st.integers(1, 6))
        ),
    )
    def execute(self, ref, elsewhere, between, crash):
        """Execute a runnable run (or resume one whose execution crashed) while the operator
        acts from elsewhere."""
        resumable = Q(runnable_filter(timezone.now())) | Q(status="running")
        run_id = self.pick(ref, Run.objects.filter(resumable))
        if run_id is None:
            return
        past = timezone.now() - timedelta(seconds=1)
        Run.objects.filter(pk=run_id, status="running").update(lease_until=past)
        self.between_plan, self.between_count = dict(between or {}), 0
        try:
            self.claim_and_execute(run_id, crash, None, elsewhere)
        finally:
            self.between_plan = {}

    @_rule(later=st.sampled_from([0, 0, 61, 3600]))
    def drive(self, later):
        """`later` seconds on (past naps, timers and leases), claim and execute what is
        runnable (up to four runs), like an idle worker."""
        self.clock.advance(later)
        self.run_due(4)

    def run_due(self, most: int) -> None:
        for _ in range(most):
            claimed = self.worker.claim(1)
            if not claimed:
                return
            self.execute_claimed(claimed[0], None, {})

    # -- invariants -------------------------------------------------------------------------------

    @invariant()
    def concurrency_invariants_hold(self):
        self.inv9a_no_deadlock()
        self.inv9b_no_silent_second_call()
        self.inv9e_a_returned_step_is_recorded_while_code_works_between_steps()
        self.inv9f_no_finished_run_keeps_a_started_step()
        self.inv9g_prune_takes_what_may_go_and_says_so()
        self.inv9h_a_call_made_again_is_a_marked_resend()

    def inv9a_no_deadlock(self):
        lost = self.instruments.deadlocks + self.violations["9a"]
        assert not lost, "invariant 9a: " + "; ".join(lost)

    def inv9b_no_silent_second_call(self):
        stuck = [f"{idem}: {ends}" for idem, ends in probe.ends.items() if "stuck" in ends]
        wrong = self.violations["9b"] + [f"a call never let go: {s}" for s in stuck]
        assert not wrong, "invariant 9b: " + "; ".join(wrong)

    def inv9e_a_returned_step_is_recorded_while_code_works_between_steps(self):
        assert not self.violations["9e"], "invariant 9e: " + "; ".join(self.violations["9e"])

    def inv9f_no_finished_run_keeps_a_started_step(self):
        snap = self.snapshot()
        wrong = [
            f"{self.label(step['run_id'])} ({run['status']}) keeps {step['key']!r} started"
            for step in snap.steps
            if step["status"] == "started"
            and (run := snap.runs[step["run_id"]])["status"] in TERMINAL
        ]
        assert not wrong, "invariant 9f: " + "; ".join(wrong)

    def inv9g_prune_takes_what_may_go_and_says_so(self):
        assert not self.violations["9g"], "invariant 9g: " + "; ".join(self.violations["9g"])

    def inv9h_a_call_made_again_is_a_marked_resend(self):
        if not self.resent:
            return
        unmarked = (
            Step.objects.filter(idempotency_key__in=self.resent, status="completed")
            .exclude(recovered="resent")
            .values_list("idempotency_key", flat=True)
        )
        wrong = [f"{idem} was called again, not marked as a re-send" for idem in unmarked]
        assert not wrong, "invariant 9h: " + "; ".join(wrong)


def _profile(machine: str = "model") -> hypothesis_settings:
    from django.conf import settings

    name = os.environ.get("STEPGUARD_MODEL_PROFILE", "")
    profile = hypothesis_settings.get_profile(
        f"stepguard-{machine}-{name}" if name else f"stepguard-{machine}"
    )
    examples = DirectoryBasedExampleDatabase(str(Path(settings.VAR_DIR) / "hypothesis-model"))
    return hypothesis_settings(profile, database=examples)


#: The modules whose writes the suite counts and breaks (every one that writes checkpoints).
ENGINE_MODULES = (
    execution, recorded, checkpoints, steps, calls, waits, compensation, lifecycle,
)  # fmt: skip


def _instrument(monkeypatch, settings, cast) -> Instruments:
    """What both machines run under: the clock, the counted commit points, the cast."""
    settings.STEPGUARD_MAX_RECOVERIES = 2  # the lost-worker bound, reachable in a few rules
    clock = Clock()
    instruments = Instruments()
    monkeypatch.setattr(timezone, "now", clock.now)
    # Live pages' doorbell: a thread with a connection of its own, which would keep the test
    # database open after the test; nothing of the engine's behaviour depends on it.
    monkeypatch.setattr(wakeup.doorbell, "ring", lambda run_id: None)
    # Commit points are counted, and faults injected, through the names the engine's modules
    # write with (the engine itself is untouched). Each name must be found somewhere: a module
    # renamed under this test would otherwise silently stop being instrumented.
    for name, wrap in (
        ("transaction", lambda _: _Transaction(instruments)),
        ("fenced_write", lambda write: _counted_write(instruments, write)),
        ("flush", lambda write: _counted_write(instruments, write)),
        ("atomic", lambda atomic: _counted_atomic(instruments, atomic)),
        ("scopes_for", lambda lookup: _noted_scopes(instruments, lookup)),
    ):
        users = [module for module in ENGINE_MODULES if hasattr(module, name)]
        assert users, f"no engine module uses {name!r}: update ENGINE_MODULES"
        for module in users:
            monkeypatch.setattr(module, name, wrap(getattr(module, name)))
    _ENV.update(
        operator=cast["otto"],
        approver=cast["ada"],
        worker=WorkerProcess(concurrency=1),
        clock=clock,
        instruments=instruments,
    )
    return instruments


@pytest.fixture(autouse=True)
def _real_months_made_again(request):
    """The model's clock runs in 2031, so its prunes drop this real month's history
    partition as a past one (partitions.drop_empty): made again for the real month (the
    clock is still the model's here: monkeypatch is undone after this), or a test after it
    on this database finds its events in the default partition."""
    yield
    if request.node.get_closest_marker("django_db"):
        partitions.ensure(since=_real_now(), now=_real_now())


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_the_engine_keeps_its_invariants_under_any_sequence_of_actions(monkeypatch, settings, cast):
    _instrument(monkeypatch, settings, cast)
    try:
        run_state_machine_as_test(EngineModel, settings=_profile())
    finally:
        probe.observer = None
        probe.reset()
        _ENV.clear()


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_the_engine_keeps_its_invariants_with_an_operator_acting_from_another_connection(
    monkeypatch, settings, cast
):
    """The second machine: ConcurrentModel."""
    instruments = _instrument(monkeypatch, settings, cast)
    # A returned step waits this long for a write to carry it before it is written by itself:
    # short, so that an example's work between steps is quick.
    settings.STEPGUARD_COMPLETION_WINDOW = 0.02
    execute_with_wrappers = CursorWrapper._execute_with_wrappers
    monkeypatch.setattr(
        CursorWrapper, "_execute_with_wrappers", _watched(instruments, execute_with_wrappers)
    )
    instruments.operator = Operator()
    try:
        run_state_machine_as_test(ConcurrentModel, settings=_profile("concurrent"))
    finally:
        instruments.operator.stop()
        probe.observer = probe.on_call = probe.on_between = None
        probe.reset()
        _ENV.clear()
