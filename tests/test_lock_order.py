"""One lock order (docs/architecture.md): a worker's write and an operator's action on the same
rows, the worker held between its locks while the operator acts, on PostgreSQL.

Before, a worker pausing a run locked its row and its ancestors, then the policies; an unhalt
of the kill switch locked the policy, then the runs it resumed: a deadlock, whose victim was
either the worker (the run showed `running` for a whole lease, and its last step ran again) or
the operator (`unhalt("all")` failed and the kill switch stayed on). And a durable wait entered
while a workflow halt committed left the run `waiting` under the hold.
"""

import logging
import threading
from datetime import timedelta
from decimal import Decimal

import pytest
from django.db import connection, connections
from django.utils import timezone

from runs.engine.fences import Lease
from runs.engine.lifecycle import execute
from runs.engine.worker import WorkerProcess
from runs.models import Event, Run, RunStatus, Step
from runs.operations import cancel_run, halt, set_budget, unhalt
from runs.sdk import start_run
from tests import workflows
from tests.conftest import wait_until

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def status(run) -> str:
    return Run.objects.get(pk=run.pk).status


def blocked_on_a_lock() -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND datname = current_database()"
        )
        return cursor.fetchone()[0] > 0


def race(worker_runs, after_statement, operator_acts) -> dict:
    """Run `worker_runs()` in a thread until it has executed a statement matching
    `after_statement(sql)`; hold it there while `operator_acts()` runs in another thread, until
    that is done or waits for a lock; then let the worker go on. Returns both outcomes."""
    held, go_on, outcome = threading.Event(), threading.Event(), {}
    reached = threading.Event()

    def hold_after(execute_, sql, params, many, context):
        result = execute_(sql, params, many, context)
        if not held.is_set() and after_statement(sql):
            reached.set()
            held.set()
            go_on.wait(20)
        return result

    def worker():
        try:
            with connection.execute_wrapper(hold_after):
                outcome["worker"] = str(worker_runs())
        except Exception as exc:
            outcome["worker"] = repr(exc)
        finally:
            held.set()
            connections.close_all()

    def operator():
        try:
            operator_acts()
            outcome["operator"] = "done"
        except Exception as exc:
            outcome["operator"] = repr(exc)
        finally:
            connections.close_all()

    worker_thread = threading.Thread(target=worker)
    worker_thread.start()
    assert held.wait(20), "the worker never reached the statement to hold it after"
    operator_thread = threading.Thread(target=operator)
    operator_thread.start()
    wait_until(
        lambda: not operator_thread.is_alive() or blocked_on_a_lock(),
        what="the operator's action to finish or wait for a lock",
    )
    go_on.set()
    worker_thread.join(30)
    operator_thread.join(30)
    # `held` is also set when the worker ends: without this, a statement it never ran would
    # make the race a sequence (the operator acting after the worker), and the test pointless.
    assert reached.is_set(), f"the worker never ran the statement to hold it after: {outcome}"
    return outcome


def test_a_pause_under_the_kill_switch_and_its_unhalt_never_deadlock(cast):
    parent = start_run("parent", {"n": 1, "child": "ledger", "steps": 2})
    claimer = WorkerProcess(concurrency=1)
    claimer.register()
    (claimed,) = claimer.claim(1)
    assert execute(claimed, Lease(claimed.id, claimed.lease_epoch)) == "waiting"
    (child,) = claimer.claim(1)
    # Inside the child's first step, the kill switch goes on: its next step start is refused
    # and the worker pauses it, locking its ancestors.
    workflows.hooks["s0"] = lambda: halt("all", cast["otto"], "incident")

    outcome = race(
        lambda: execute(child, Lease(child.id, child.lease_epoch)),
        lambda sql: "FOR SHARE" in sql and "FROM runs_run" in sql,  # its ancestors
        lambda: unhalt("all", cast["otto"], "all clear"),
    )
    assert outcome == {"worker": "halted", "operator": "done"}
    assert status(child) == RunStatus.PENDING  # resumed by the unhalt, nothing covers it
    assert status(parent) == RunStatus.PENDING


def test_a_wait_entered_while_its_workflow_is_halted_ends_halted_not_waiting(cast):
    run = start_run("sleeper", {"seconds": 60})
    claimer = WorkerProcess(concurrency=1)
    claimer.register()
    (claimed,) = claimer.claim(1)

    outcome = race(
        lambda: execute(claimed, Lease(claimed.id, claimed.lease_epoch)),
        # The wait's step row: written after the fence that locked the run row.
        lambda sql: sql.startswith('INSERT INTO "runs_step"'),
        lambda: halt("workflow:sleeper", cast["otto"], "bad deploy"),
    )
    assert outcome == {"worker": "waiting", "operator": "done"}
    assert status(run) == RunStatus.HALTED


# -- every (worker write, operator action) pair that can meet on the same rows ------------------

#: Where a worker's pause or durable wait is held: after it share-locked the policies that
#: cover its run (its first lock), or its ancestors (its last: by then its fence locked its own
#: row too). Named by statement, not by position, so a path that took them in another order
#: would be held between its locks all the same.
POINTS = {
    "policies": lambda sql: "FROM runs_policy" in sql and "FOR SHARE" in sql,
    "ancestors": lambda sql: "FROM runs_run" in sql and "FOR SHARE" in sql,
}


@pytest.fixture
def no_deadlock(caplog):
    """After the test: no operator action lost a deadlock, not even one retried away (the lock
    order means none happens at all), and no worker abandoned a run to a database error."""
    with caplog.at_level(logging.WARNING, logger="stepguard"):
        yield
    lost = [r.getMessage() for r in caplog.records if "deadlock" in r.getMessage().lower()]
    lost += [r.getMessage() for r in caplog.records if "database error" in r.getMessage()]
    assert not lost, lost


def events(run, type: str) -> list[dict]:
    return list(Event.objects.filter(run_id=run.pk, type=type).values_list("payload", flat=True))


def claimed_child(parent_input: dict, budget: Decimal | None = None, cast=None):
    """A parent waiting for its one child, and the child claimed by a worker (not executed)."""
    parent = start_run("parent", parent_input)
    worker = WorkerProcess(concurrency=1)
    worker.register()
    (claimed,) = worker.claim(1)
    assert execute(claimed, Lease(claimed.id, claimed.lease_epoch)) == "waiting"
    if budget is not None:
        child = Run.objects.get(parent=parent)
        set_budget(str(child.pk), cast["otto"], "a small budget", usd=budget)
    (child,) = worker.claim(1)
    return parent, child, worker


def drive_all(worker: WorkerProcess) -> list[str]:
    outcomes = []
    while claimed := worker.claim(1):
        outcomes.append(execute(claimed[0], Lease(claimed[0].id, claimed[0].lease_epoch)))
    return outcomes


@pytest.mark.parametrize("point", list(POINTS))
@pytest.mark.parametrize("stop", ["kill switch", "over budget"])
def test_a_pause_and_a_halt_of_the_workflow_never_deadlock(cast, no_deadlock, point, stop):
    """A child pauses (the kill switch went on in its first step, or its budget is spent)
    while an operator halts its parent's workflow: the halt locks that policy to update it, then
    parks the runs it covers (the waiting parent among them). The run ends `halted`, held by
    every hold placed, and only lifting all of them resumes it."""
    budget = Decimal("1") if stop == "over budget" else None
    parent, child, worker = claimed_child(
        {"n": 1, "child": "metered", "steps": 2}, budget=budget, cast=cast
    )
    if stop == "kill switch":
        workflows.hooks["call-0"] = lambda: halt("all", cast["otto"], "incident")

    outcome = race(
        lambda: execute(child, Lease(child.id, child.lease_epoch)),
        POINTS[point],
        lambda: halt("workflow:parent", cast["otto"], "bad deploy"),
    )
    # The halt waited for the pause: the pause saw the holds committed before it.
    paused = "halted" if stop == "kill switch" else "over_budget"
    assert outcome == {"worker": paused, "operator": "done"}
    assert status(child) == RunStatus.HALTED
    assert status(parent) == RunStatus.HALTED
    assert workflows.calls == {"call-0": 1}
    if stop == "kill switch":
        unhalt("all", cast["otto"], "all clear")
        assert status(child) == RunStatus.HALTED  # its parent's workflow still holds it
    unhalt("workflow:parent", cast["otto"], "fixed")
    assert status(child) == RunStatus.PENDING
    if stop == "over budget":
        set_budget(str(child.pk), cast["otto"], "more", usd=Decimal("5"))
    drive_all(worker)
    assert (status(child), status(parent)) == (RunStatus.COMPLETED, RunStatus.COMPLETED)
    assert workflows.calls == {"call-0": 1, "call-1": 1, "after": 1}


@pytest.mark.parametrize("point", list(POINTS))
@pytest.mark.parametrize("target", ["run", "workflow"])
def test_a_pause_over_budget_and_a_budget_raise_never_deadlock_nor_lose_the_raise(
    cast, no_deadlock, point, target
):
    """A child pauses over its own budget, or its workflow's daily one, while an operator
    raises that budget: set_budget locks the run row (a run's budget) or the policy (a
    workflow's) to update it, then requeues the runs paused over budget. Whichever commits
    first, the raise is not lost: the run ends runnable, and finishes."""
    if target == "workflow":
        set_budget("workflow:metered", cast["otto"], "a daily cap", usd=Decimal("1"))
    budget = Decimal("1") if target == "run" else None
    parent, child, worker = claimed_child(
        {"n": 1, "child": "metered", "steps": 2}, budget=budget, cast=cast
    )
    spec = str(child.pk) if target == "run" else "workflow:metered"

    outcome = race(
        lambda: execute(child, Lease(child.id, child.lease_epoch)),
        POINTS[point],
        lambda: set_budget(spec, cast["otto"], "more", usd=Decimal("10")),
    )
    # A run's budget raised before the pause locked the run row is seen by the pause itself
    # (requeued at once); otherwise the raise finds the run paused and requeues it.
    assert outcome["operator"] == "done"
    assert outcome["worker"] in ("over_budget", "pending")
    if target == "workflow" or point != "policies":
        assert outcome["worker"] == "over_budget"
    assert status(child) == RunStatus.PENDING
    assert drive_all(worker) == ["completed", "completed"]
    assert workflows.calls == {"call-0": 1, "call-1": 1, "after": 1}
    assert status(parent) == RunStatus.COMPLETED


@pytest.mark.parametrize("point", [*POINTS, "wait row"])
@pytest.mark.parametrize("whom", ["the run", "its parent"])
def test_a_durable_wait_and_a_cancel_never_deadlock_and_the_run_ends_cancelled(
    cast, no_deadlock, point, whom
):
    """A child enters a durable wait (share-locks the policies, fences its row, share-locks its
    parent, writes the waiting step, suspends) while an operator cancels it, or its parent (a
    cancel locks the descendants, deepest first, then the root). The cancel is never lost on a
    run that has just gone to sleep for a minute: it is woken, and ends cancelled."""
    parent, child, worker = claimed_child({"n": 1, "child": "two-waits"})
    target = child if whom == "the run" else parent
    at = POINTS.get(point, lambda sql: sql.startswith('INSERT INTO "runs_step"'))

    outcome = race(
        lambda: execute(child, Lease(child.id, child.lease_epoch)),
        at,
        lambda: cancel_run(target.pk, cast["otto"], "not needed"),
    )
    # Cancelled before the wait's fence took the row: the fence refuses the wait.
    assert outcome["operator"] == "done"
    assert outcome["worker"] in ("waiting", "cancelled")
    if point != "policies":
        assert outcome["worker"] == "waiting"
    assert status(child) in (RunStatus.PENDING, RunStatus.CANCELLED)  # woken, if it slept
    drive_all(worker)
    assert status(child) == RunStatus.CANCELLED
    assert status(parent) == (RunStatus.CANCELLED if whom == "its parent" else RunStatus.COMPLETED)
    assert not Step.objects.filter(run=child).exclude(key="first").exists()  # never got past


#: Where a finishing child is held: after its own row's final write, after it woke its parent.
FINISH_POINTS = {
    "own row": lambda sql: sql.startswith("WITH f AS (UPDATE runs_run") and "finished_at" in sql,
    "parent row": lambda sql: (
        sql.startswith("UPDATE runs_run SET event_seq = event_seq + 1,") and "wake_at" in sql
    ),
}


@pytest.mark.parametrize("point", list(FINISH_POINTS))
@pytest.mark.parametrize("hold", ["run", "workflow"])
def test_a_finishing_child_and_a_halt_of_its_parent_never_deadlock(cast, no_deadlock, point, hold):
    """A child finishes (its row, then its parent's, to wake it) while an operator halts the
    parent (the run: descendants first, then the parent; or the parent's workflow: the policy,
    then the runs it covers). The child completes, the parent ends halted (woken and parked),
    and resumes only when the hold is lifted."""
    parent, child, worker = claimed_child({"n": 1, "child": "ledger", "steps": 1})
    spec = str(parent.pk) if hold == "run" else "workflow:parent"

    outcome = race(
        lambda: execute(child, Lease(child.id, child.lease_epoch)),
        FINISH_POINTS[point],
        lambda: halt(spec, cast["otto"], "stop the tree"),
    )
    assert outcome == {"worker": "completed", "operator": "done"}
    assert status(child) == RunStatus.COMPLETED
    assert status(parent) == RunStatus.HALTED
    assert [p["status"] for p in events(parent, "child.finished")] == ["completed"]
    assert drive_all(worker) == []
    unhalt(spec, cast["otto"], "go on")
    assert drive_all(worker) == ["completed"]
    assert workflows.calls == {"s0": 1, "after": 1}


def test_children_started_while_a_halt_of_their_parent_waits_end_halted(cast, no_deadlock):
    """The parent's execution starts its children inside its transaction, holding its row,
    while an operator halts it: the halt parks the descendants it sees, then waits for the
    parent's row, and once it has it, parks the children it could not see before. Found by the
    model machine (ConcurrentModel, invariant 2): they stayed `pending` under a halted parent."""
    parent = start_run("parent", {"n": 2, "child": "ledger", "steps": 1})
    worker = WorkerProcess(concurrency=1)
    worker.register()
    (claimed,) = worker.claim(1)

    outcome = race(
        lambda: execute(claimed, Lease(claimed.id, claimed.lease_epoch)),
        lambda sql: sql.startswith("INSERT INTO") and "runs_run" in sql.split("(", 1)[0],
        lambda: halt(str(parent.pk), cast["otto"], "stop the tree"),
    )
    assert outcome == {"worker": "waiting", "operator": "done"}
    children = Run.objects.filter(parent=parent)
    assert sorted(children.values_list("status", flat=True)) == ["halted", "halted"]
    assert status(parent) == RunStatus.HALTED
    assert drive_all(worker) == []
    unhalt(str(parent.pk), cast["otto"], "go on")
    while drive_all(worker):
        pass
    assert {r.status for r in Run.objects.all()} == {RunStatus.COMPLETED}


# -- two workers on the day's spend row ---------------------------------------------------------


def test_a_resent_model_call_and_a_finishing_priced_call_of_one_workflow_never_deadlock(
    cast, demo_model, no_deadlock
):
    """Two workers, two runs of one workflow under its shared daily budget, booking on the same
    day's spend row (runs_spendday). One finishes a priced model call: its step row, then the
    budget's ledger row. The other re-sends a model call cut off in flight: the ledger row,
    then the possibly spent on its step row. The day's row is booked at commit (a deferred
    trigger, docs/architecture.md's lock order, step 4), so it is the last lock either takes:
    the re-send goes through while the finishing worker is held between its two writes.
    Booked as each step row was written, each waited for the other: a deadlock."""
    from runs.models import SpendDay
    from tests import agent_workflows  # noqa: F401  (registers llm-cut-off)

    set_budget("workflow:llm-cut-off", cast["otto"], "a shared cap", usd=Decimal("100"))
    worker = WorkerProcess(concurrency=1)
    worker.register()
    cut = start_run("llm-cut-off")
    (claimed,) = worker.claim(1)
    workflows.crash_at.add("answered")
    with pytest.raises(workflows.Crash):
        execute(claimed, Lease(claimed.id, claimed.lease_epoch))
    finishing = start_run("llm-cut-off")
    (claimed,) = worker.claim(1)
    assert claimed.pk == finishing.pk  # the cut-off run's lease has not lapsed yet
    Run.objects.filter(pk=cut.pk).update(lease_until=timezone.now() - timedelta(seconds=1))
    (resent,) = worker.claim(1)
    assert resent.pk == cut.pk

    resending: list[str] = []
    outcome = race(
        lambda: execute(claimed, Lease(claimed.id, claimed.lease_epoch)),
        # Its finish: the fenced statement that writes the step's cost, before the ledgers.
        lambda sql: sql.lstrip().startswith("WITH") and "cost_micros" in sql and "runs_step" in sql,
        lambda: resending.append(str(execute(resent, Lease(resent.id, resent.lease_epoch)))),
    )
    assert outcome == {"worker": "completed", "operator": "done"}
    assert resending == ["completed"]
    runs = Run.objects.filter(pk__in=[cut.pk, finishing.pk])
    assert set(runs.values_list("status", flat=True)) == {RunStatus.COMPLETED}
    day = SpendDay.objects.get(workflow="llm-cut-off")
    assert day.runs == 2
    assert day.micros == sum(runs.values_list("cost_micros", flat=True)) > 0
    assert day.possibly_micros == Run.objects.get(pk=cut.pk).possibly_spent_micros > 0


def test_a_label_budget_raised_as_a_run_pauses_on_it_is_never_lost(cast, no_deadlock):
    """A run pauses over its tenant's daily budget while an operator raises that budget. The
    worker is held after it read the label's limit to decide the pause (the last moment it
    could miss the raise). Before, the pause share-locked the global and workflow policies but
    not the label's: the raise committed, found the run still running, and the pause then
    wrote `over_budget` under the raised budget, until UTC midnight. Now the pause locks the
    label's policy too: the raise waits for it, and finds the run paused, which it resumes."""
    set_budget("label:tenant=acme", cast["otto"], "acme's cap", usd=Decimal("1.5"))
    run = start_run("metered", {"steps": 2}, labels={"tenant": "acme"})
    worker = WorkerProcess(concurrency=1)
    worker.register()
    (claimed,) = worker.claim(1)

    outcome = race(
        lambda: execute(claimed, Lease(claimed.id, claimed.lease_epoch)),
        # `_still_over`: the limit that refused the step, read again inside the pause.
        lambda sql: 'FROM "runs_policy"' in sql and "daily_budget" in sql and "LIMIT 1" in sql,
        lambda: set_budget("label:tenant=acme", cast["otto"], "more", usd=Decimal("10")),
    )
    assert outcome == {"worker": "over_budget", "operator": "done"}
    assert status(run) == RunStatus.PENDING  # resumed by the raise, not stuck until midnight
    assert drive_all(worker) == ["completed"]
