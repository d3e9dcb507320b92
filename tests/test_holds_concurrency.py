"""A run is `halted` exactly when a hold covers it, whatever operators, starts, retries, forks,
children and workers do at the same time (issue 47 §2; DESIGN.md, *Authority*).

A model-based test with real concurrency, beside tests/test_model.py: THREADS operator
threads, each on a database connection of its own, act together in rounds (a barrier lets
them go at once) against a real worker process. Each picks an action at random: start a run
(one that fails at its end, or a parent of two child runs), retry a failed run, fork a run,
place or lift a hold on a run, a workflow or everything. After every round, with no operator
action in flight, one statement reads every run that is not executing a step against the
holds (`holds.covered_sql`): a run is `halted` exactly when a hold covers it.

What it proves: the locks. The worker here runs with the sweep that resumes halted runs no
hold covers switched off (STEPGUARD_HOLD_SWEEP_SECONDS=0, runs/engine/unheld.py), so a run
stranded by a race stays stranded and is counted; a covered run left `pending` (which a claim
would park, being due) is counted too, at once. On the code before the holds' locks both
appeared within the first rounds (the default profile on a busy two-core machine, 126 rounds:
47 of 109 runs stranded, the first in round 1, and 28 covered runs left pending); without the
lock hold changes take, 14 and 11 in 110 rounds; without the locks a start takes, 5 and 3.

Profiles: ROUNDS rounds within SECONDS seconds, whichever comes first (at least MIN_ROUNDS):
by default 200 in 25 s, STEPGUARD_MODEL_PROFILE=long (CI) 3000 in 60 s; SQLite, whose writers
are serial anyway, half the rounds. A failure prints the seed, the rounds and what was done.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import traceback
from collections import Counter
from time import monotonic

import pytest
from django.db import connection, connections

from runs.engine.holds import RUN_TABLE, covered_sql
from runs.errors import OperationError
from runs.models import GLOBAL, Event, EventType, Policy, Run, RunStatus
from runs.operations import fork_run, halt, retry_run, unhalt
from runs.sdk import start_run
from tests.conftest import wait_until

THREADS = 4
#: Rounds, and the seconds they may take: whichever comes first ends the test (on a busy
#: machine a round takes longer; the report says how many ran). At least MIN_ROUNDS run.
ROUNDS = {"default": 200, "long": 3000}
SECONDS = {"default": 25.0, "long": 60.0}
MIN_ROUNDS = 50
#: Workflows whose holds operators place and lift (children of `parent` are `hold-churn` runs).
WORKFLOWS = ("hold-churn", "parent")
LIVE = 24  # no start while this many runs are not ended: a halt of everything parks them all
RECENT = 30  # actions pick among the newest runs: the ones workers are busy with
NOT_EXECUTING = (RunStatus.PENDING, RunStatus.WAITING, RunStatus.HALTED, RunStatus.OVER_BUDGET)

CHECK = (
    f"SELECT r.id, r.status, {covered_sql('r')} FROM {RUN_TABLE} r"
    f" WHERE r.status IN ({', '.join(['%s'] * len(NOT_EXECUTING))})"
)


def budget() -> tuple[int, float]:
    """The profile's rounds and seconds (SQLite: half the rounds; its writers are serial)."""
    name = "long" if os.environ.get("STEPGUARD_MODEL_PROFILE") == "long" else "default"
    rounds = ROUNDS[name] if connection.vendor == "postgresql" else ROUNDS[name] // 2
    return rounds, SECONDS[name]


def live() -> int:
    return Run.objects.filter(status__in=(*NOT_EXECUTING, RunStatus.RUNNING)).count()


def recent(**filters) -> list:
    return list(
        Run.objects.filter(**filters).order_by("-created_at").values_list("id", flat=True)[:RECENT]
    )


class Operator:
    """One operator thread's actions; each returns what it did, as counted at the end."""

    def __init__(self, user, rnd: random.Random):
        self.user, self.rnd = user, rnd

    def act(self) -> str:
        actions = (
            (self.start, 3),
            (self.start_parent, 1),
            (self.retry, 2),
            (self.fork, 1),
            (self.halt, 3),
            (self.unhalt, 4),
        )
        action = self.rnd.choices([a for a, _ in actions], [w for _, w in actions])[0]
        try:
            return action()
        except OperationError as exc:  # a race lost to another operator: refused, clearly
            return f"{action.__name__} refused ({type(exc).__name__})"

    def start(self) -> str:
        if live() >= LIVE:
            return "start: enough live"
        fail = self.rnd.random() < 0.5
        start_run("hold-churn", {"steps": 2, "sleep": 0.002, "fail": fail}, max_attempts=1)
        return "start"

    def start_parent(self) -> str:
        if live() >= LIVE:
            return "start parent: enough live"
        start_run("parent", {"n": 2, "child": "hold-churn", "steps": 1, "sleep": 0.002})
        return "start parent"

    def retry(self) -> str:
        failed = recent(status=RunStatus.FAILED, workflow="hold-churn")
        if not failed:
            return "retry: none failed"
        retry_run(self.rnd.choice(failed), self.user, "model: retry")
        return "retry"

    def fork(self) -> str:
        ended = recent(status__in=(RunStatus.COMPLETED, RunStatus.FAILED), workflow="hold-churn")
        if not ended:
            return "fork: none ended"
        fork_run(self.rnd.choice(ended), 1, self.user, "model: fork")
        return "fork"

    def halt(self) -> str:
        target = self._target(recent(status__in=(*NOT_EXECUTING, RunStatus.RUNNING)))
        halt(target, self.user, "model: halt")
        return f"halt {target.split(':')[0]}"

    def unhalt(self) -> str:
        held = [
            "all" if scope == GLOBAL else f"workflow:{scope}"
            for scope in Policy.objects.filter(halted_at__isnull=False).values_list(
                "scope", flat=True
            )
        ] + [f"run:{pk}" for pk in recent(halted_at__isnull=False)]
        if not held:
            return "unhalt: nothing held"
        target = self.rnd.choice(held)
        unhalt(target, self.user, "model: unhalt")
        return f"unhalt {target.split(':')[0]}"

    def _target(self, runs: list) -> str:
        choices = ["all", *(f"workflow:{w}" for w in WORKFLOWS)]
        choices += [f"run:{pk}" for pk in self.rnd.sample(runs, min(len(runs), 3))]
        return self.rnd.choice(choices)


class Rounds:
    """THREADS threads that act together once per round, the main thread checking between."""

    def __init__(self, user, seed: int):
        self.go = threading.Barrier(THREADS + 1)
        self.done = threading.Barrier(THREADS + 1)
        self.stop = False
        self.did: Counter[str] = Counter()
        self.errors: list[str] = []
        self.threads = [
            threading.Thread(
                target=self._loop, args=(Operator(user, random.Random(seed + i)),), daemon=True
            )
            for i in range(THREADS)
        ]
        for thread in self.threads:
            thread.start()

    def _loop(self, operator: Operator) -> None:
        try:
            while True:
                self.go.wait(timeout=120)
                if self.stop:
                    return
                try:
                    self.did[operator.act()] += 1
                except Exception:
                    self.errors.append(traceback.format_exc())
                self.done.wait(timeout=120)
        finally:
            connections.close_all()

    def round(self) -> None:
        self.go.wait(timeout=120)
        self.done.wait(timeout=120)

    def close(self) -> None:
        self.stop = True
        with contextlib.suppress(threading.BrokenBarrierError):
            self.go.wait(timeout=10)
        for thread in self.threads:
            thread.join(10)


def off_holds() -> tuple[set, set]:
    """The runs not executing whose status is at odds with the holds: `halted` with no hold
    covering them (stranded), and covered but not `halted`."""
    with connection.cursor() as cursor:
        cursor.execute(CHECK, list(NOT_EXECUTING))
        rows = cursor.fetchall()
    stranded = {pk for pk, status, covered in rows if status == RunStatus.HALTED and not covered}
    unparked = {pk for pk, status, covered in rows if status != RunStatus.HALTED and covered}
    return stranded, unparked


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_a_run_is_halted_exactly_when_a_hold_covers_it_whatever_operators_do_at_once(
    spawn_worker, cast
):
    env = {"STEPGUARD_HOLD_SWEEP_SECONDS": "0"}  # prove the locks, not the net
    spawn_worker("--concurrency", "4", lease=5.0, env=env)
    (most, seconds), seed = budget(), random.randrange(1 << 30)
    stranded: dict = {}  # run id -> the round it was first seen in
    unparked: dict = {}
    operators = Rounds(cast["otto"], seed)
    started = monotonic()
    total = 0
    try:
        for n in range(most):
            if n >= MIN_ROUNDS and monotonic() - started > seconds:
                break
            total = n + 1
            operators.round()
            assert not operators.errors, operators.errors[0]
            now_stranded, now_unparked = off_holds()
            for pk in now_stranded:
                stranded.setdefault(pk, n)
            for pk in now_unparked:
                unparked.setdefault(pk, n)
    finally:
        operators.close()
    runs = Run.objects.count()
    report = (
        f"{total} rounds of {THREADS} operators in {monotonic() - started:.1f} s (seed {seed}),"
        f" {runs} runs; did: {dict(sorted(operators.did.items()))}"
    )
    print(report)
    assert not stranded and not unparked, (
        f"{len(stranded)} of {runs} runs left halted with no hold covering them (first in"
        f" round {min(stranded.values(), default=None)}); {len(unparked)} covered but not"
        f" halted (first in round {min(unparked.values(), default=None)}). {report}"
    )


@pytest.mark.django_db
def test_an_unhalted_run_lists_only_the_holds_still_in_force(cast):
    run = start_run("hold-churn", {"steps": 1})
    halt(run, cast["otto"], "its own")
    halt("workflow:hold-churn", cast["otto"], "the workflow's")
    unhalt(run, cast["otto"], "fixed")
    event = Event.objects.filter(run=run, type=EventType.RUN_UNHALTED).get()
    assert event.payload["still_held_by"] == ["workflow hold-churn"]
    assert event.payload["resumed"] is False
    assert Run.objects.get(pk=run.pk).status == RunStatus.HALTED


@pytest.mark.django_db(transaction=True)
def test_a_halted_run_no_hold_covers_is_resumed_by_the_workers_within_seconds(spawn_worker, cast):
    stranded, held = (start_run("hold-churn", {"steps": 1}) for _ in range(2))
    halt(held, cast["otto"], "stays")
    # As a write that decided `halted` without the holds' locks would have left it.
    Run.objects.filter(pk=stranded.pk).update(status=RunStatus.HALTED)
    spawn_worker(env={"STEPGUARD_HOLD_SWEEP_SECONDS": "0.2"})
    wait_until(
        lambda: Run.objects.get(pk=stranded.pk).status == RunStatus.COMPLETED,
        what="the stranded run to be resumed and to complete",
    )
    swept = Event.objects.filter(run=stranded, type=EventType.RUN_REQUEUED).get()
    assert swept.payload["swept"] is True
    assert Run.objects.get(pk=held.pk).status == RunStatus.HALTED
    assert not Event.objects.filter(run=held, type=EventType.RUN_REQUEUED).exists()
