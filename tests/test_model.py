"""A model-based test of the engine, the store and the operations layer (Hypothesis, stateful).

A RuleBasedStateMachine drives the real engine and store in this thread, on the test database:
it starts runs of the workflows in tests/model_workflows.py; halts and unhalts runs, workflows
and everything; cancels, retries and forks runs; sets run, workflow and global budgets; decides
and revokes approvals; sends signals; moves the clock (across UTC midnight too); executes runs
like a worker with one slot; crashes an execution mid-call or right after one of its commit
points and resumes it once its lease lapses; and lets operator actions, a worker stop (SIGTERM)
or another worker's takeover after a stall land between two commit points of an execution, as
if concurrent.

After every rule it checks, against the database (letters refine one numbered invariant):

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

Profiles: by default 50 examples of up to 40 rules (well under a minute on either database);
STEPGUARD_MODEL_PROFILE=long runs 100 of up to 50 (CI, on PostgreSQL: about 3 minutes of
its 20). Failing examples are
kept under STEPGUARD_VAR_DIR (hypothesis-model/) and replayed first on the next run. A failure
prints the rule sequence that reproduces it; shrinking one can take Hypothesis minutes.
"""

from __future__ import annotations

import contextlib
import functools
import os
import traceback
from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, time, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
from django.apps import apps
from django.db import connection
from django.db import transaction as django_transaction
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

from approvals.models import ApprovalRequest
from approvals.services import decide, revoke
from runs.engine import calls, checkpoints, compensation, lifecycle, replay, steps, waits, wakeup
from runs.engine.budget import forget_cached_scopes
from runs.engine.executor import Lease, execute
from runs.engine.worker import WorkerProcess, runnable_filter
from runs.errors import DecisionError, OperationError
from runs.models import BudgetLedger, Event, Policy, Run, Step, StepKind
from runs.operations import cancel_run, fork_run, halt, retry_run, set_budget, unhalt
from runs.sdk import send_signal, start_run
from tests.model_workflows import COMPENSABLE, COST, TRANSACTIONAL, Crash, canon, probe
from tests.testapp.models import Effect

hypothesis_settings.register_profile(
    "stepguard-model",
    max_examples=50,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
hypothesis_settings.register_profile(
    "stepguard-model-long",
    max_examples=100,
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


class Instruments:
    """Counts an execution's commit points: each outermost transaction of the executor, and
    each fenced write made outside one. Before the n-th, an operator action may land (as if
    concurrent); right after it commits, the execution may crash."""

    def __init__(self) -> None:
        self.machine: EngineModel | None = None
        self.active = False
        self.count = 0
        self.crash_after: int | None = None
        self.concurrent: dict[int, tuple] = {}
        #: The shared budget scopes the engine looked up for the step it started last.
        self.shared: tuple[str, ...] = ()

    def start(self, crash_after: int | None = None, concurrent: dict | None = None) -> None:
        self.active, self.count = True, 0
        self.crash_after, self.concurrent = crash_after, dict(concurrent or {})

    def stop(self) -> None:
        self.active, self.crash_after, self.concurrent = False, None, {}

    def point(self) -> int | None:
        if not self.active:
            return None
        self.count += 1
        action = self.concurrent.pop(self.count, None)
        if action is not None:
            self.machine.perform(action, concurrent=True)
        return self.count

    def after(self, n: int | None) -> None:
        if n is None:
            return
        self.machine.observe_holds()
        self.machine.observe_completions()
        if self.crash_after == n:
            self.crash_after = None
            raise Crash(f"right after commit point {n}")


class _Atomic:
    def __init__(self, instruments: Instruments, args, kwargs):
        self.instruments, self.args, self.kwargs = instruments, args, kwargs

    def __enter__(self):
        self.outer = not connection.in_atomic_block
        self.n = self.instruments.point() if self.outer else None
        self.inner = django_transaction.atomic(*self.args, **self.kwargs)
        return self.inner.__enter__()

    def __exit__(self, exc_type, exc, tb):
        suppress = self.inner.__exit__(exc_type, exc, tb)
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
        result = write(*args, **kwargs)
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
        with atomic(lease):
            yield
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
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(f"TRUNCATE {', '.join(tables)} CASCADE")
        return
    with django_transaction.atomic(), connection.cursor() as cursor:
        for table in tables:
            cursor.execute(f"DELETE FROM {table}")


# -- the machine ----------------------------------------------------------------------------------

#: What the test function hands the machine (fixtures cannot reach a RuleBasedStateMachine).
_ENV: dict[str, Any] = {}

RUN_FIELDS = (
    "id", "workflow", "status", "parent_id", "halted_at", "cancel_requested_at", "error",
    "reserved_micros", "reserved_tokens", "cost_micros", "tokens_in", "tokens_out",
    "budget_micros", "budget_tokens", "forked_from_id", "forked_at_seq",
)  # fmt: skip
STEP_FIELDS = (
    "id", "run_id", "seq", "key", "status", "idempotency_key", "reserved_micros",
    "reserved_tokens", "reserved_on", "cost_micros", "tokens_in", "tokens_out", "finished_at",
)  # fmt: skip


@dataclass
class Snapshot:
    runs: dict[UUID, dict]
    steps: list[dict]
    halted_scopes: set[str]
    ledgers: list[dict]


def _rule(*, when: str | None = None, **strategies):
    """A rule that forgets what the invariants and preconditions read of the database before
    it. With `when`, it is only drawn while the census counts some of that (no idle draws)."""

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(self, **kwargs):
            self._snapshot = self._census = None
            return fn(self, **kwargs)

        decorated = rule(**strategies)(wrapper)
        if when is not None:
            decorated = precondition(lambda self: self.census()[when] > 0)(decorated)
        return decorated

    return decorate


class EngineModel(RuleBasedStateMachine):
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
        self.current: UUID | None = None
        self.lease: Lease | None = None
        self._snapshot: Snapshot | None = None
        self._census: dict[str, int] | None = None

    # -- helpers ----------------------------------------------------------------------------

    def census(self) -> dict[str, int]:
        """How many candidates each kind of rule has now."""
        if self._census is None:
            runs = Run.objects.order_by()
            statuses = dict(runs.values_list("status").annotate(n=Count("id")))
            approvals = ApprovalRequest.objects.order_by().values_list("status")
            decisions = dict(approvals.annotate(n=Count("id")))
            self._census = {
                "live": sum(n for status, n in statuses.items() if status not in TERMINAL),
                "failed": statuses.get("failed", 0),
                "running": statuses.get("running", 0),
                "runnable": runs.filter(runnable_filter(timezone.now())).count(),
                "resumable": runs.filter(
                    Q(runnable_filter(timezone.now())) | Q(status="running")
                ).count(),
                "steps": Step.objects.count(),
                "pending": decisions.get("pending", 0),
                "approved": decisions.get("approved", 0),
            }
        return self._census

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
        if why is not None:
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

    def start_one(self, workflow: str, budget: str | None, attempts: int, payload) -> None:
        pid = f"p{len(probe.payloads)}"
        probe.payloads[pid] = payload
        usd = None if budget is None else Decimal(budget)
        run = start_run(workflow, {"payload": pid}, budget_usd=usd, max_attempts=attempts)
        self.label(run.pk)
        self.note_budget(run.pk)

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

    def claim_and_execute(self, run_id, crash, concurrent) -> None:
        mine = getattr(self.worker, "_mine", None)
        if mine is not None:  # claim this run, not whichever is due first
            self.worker._mine = mine & Q(pk=run_id)
        try:
            claimed = self.worker.claim(1)
        finally:
            if mine is not None:
                self.worker._mine = mine
        if claimed:
            first, burst = concurrent or (0, [])
            self.execute_claimed(claimed[0], crash, {first + i: a for i, a in enumerate(burst)})

    @_rule(when="runnable")
    def drive(self):
        """Claim and execute whatever is runnable, like an idle worker, without faults."""
        for _ in range(12):
            claimed = self.worker.claim(1)
            if not claimed:
                return
            self.execute_claimed(claimed[0], None, {})

    def execute_claimed(self, run: Run, crash, concurrent: dict) -> None:
        crash_after = crash[1] if crash and crash[0] == "after-commit" else None
        self.instruments.start(crash_after, concurrent)
        probe.crash_countdown = crash[1] if crash and crash[0] == "in-step" else None
        self.current, self.lease = run.pk, Lease(run.id, run.lease_epoch)
        try:
            execute(run, self.lease)
        except Crash:
            pass  # the process died there; its lease lapses (lapse_lease) and it resumes
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
        for step in snap.steps:
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


def _profile() -> hypothesis_settings:
    from django.conf import settings

    name = os.environ.get("STEPGUARD_MODEL_PROFILE", "")
    profile = hypothesis_settings.get_profile(
        f"stepguard-model-{name}" if name else "stepguard-model"
    )
    examples = DirectoryBasedExampleDatabase(str(Path(settings.VAR_DIR) / "hypothesis-model"))
    return hypothesis_settings(profile, database=examples)


#: The modules whose writes the suite counts and breaks (every one that writes checkpoints).
ENGINE_MODULES = (replay, checkpoints, steps, calls, waits, compensation, lifecycle)


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_the_engine_keeps_its_invariants_under_any_sequence_of_actions(monkeypatch, settings, cast):
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
    try:
        run_state_machine_as_test(EngineModel, settings=_profile())
    finally:
        probe.observer = None
        probe.reset()
        _ENV.clear()
