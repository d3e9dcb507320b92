"""One lock order (docs/architecture.md): a worker's write and an operator's action on the same
rows, the worker held between its locks while the operator acts, on PostgreSQL.

Before, a worker pausing a run locked its row and its ancestors, then the policies; an unhalt
of the kill switch locked the policy, then the runs it resumed: a deadlock, whose victim was
either the worker (the run showed `running` for a whole lease, and its last step ran again) or
the operator (`unhalt("all")` failed and the kill switch stayed on). And a durable wait entered
while a workflow halt committed left the run `waiting` under the hold.
"""

import threading

import pytest
from django.db import connection, connections

from runs.engine.executor import Lease, execute
from runs.engine.worker import WorkerProcess
from runs.models import Run, RunStatus
from runs.operations import halt, unhalt
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

    def hold_after(execute_, sql, params, many, context):
        result = execute_(sql, params, many, context)
        if not held.is_set() and after_statement(sql):
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
