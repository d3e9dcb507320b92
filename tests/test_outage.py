"""A database connection lost under a running run: carry on at once, write-ahead rows that stay.

The full picture (a PostgreSQL server restarted under three workers) is `tests/test_chaos.py`;
these are the same behaviours one at a time, in-process, on the project's PostgreSQL.
"""

import logging
import time

import psycopg
import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext, override_settings

from runs.engine.fences import Lease
from runs.engine.outage import Outage, is_disconnect
from runs.engine.worker import WorkerProcess
from runs.models import Event, RunStatus, Step
from runs.sdk import start_run
from tests import workflows
from tests.conftest import database_url


def terminate_own_connection() -> None:
    """What a restart does to a worker's connection: the server ends it (SQLSTATE 57P01)."""
    pid = connection.connection.info.backend_pid
    with psycopg.connect(database_url(), autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", [pid])


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_run_whose_connection_breaks_mid_step_carries_on_at_once(caplog):
    """Before, the executor abandoned the run to lease expiry (30 s by default)."""
    run = start_run("ledger", {"steps": 3})
    worker = WorkerProcess(concurrency=1)
    worker.register()
    (claimed,) = worker.claim(1)
    lease = Lease(claimed.id, claimed.lease_epoch)
    worker.active[claimed.id] = lease
    workflows.hooks["s1"] = terminate_own_connection  # after s1's effect, before its checkpoint

    with caplog.at_level(logging.INFO, logger="stepguard"):
        worker._execute(claimed, lease)

    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED
    assert run.output == 0 + 1 + 2
    s1 = Step.objects.get(run=run, key="s1")
    # s1 had returned when the write carrying its completion broke: the carry-on writes that
    # completion first (it used to be dropped, and s1 re-sent: a second side effect).
    assert (s1.attempt, s1.recovered) == (1, "")
    assert workflows.calls == {"s0": 1, "s1": 1, "s2": 1}
    assert "carrying on under the same lease" in caplog.text
    assert "abandoning" not in caplog.text and "Traceback" not in caplog.text
    # No claim by anyone in between: the same lease went on.
    assert not Event.objects.filter(run=run, type="run.recovered").exists()


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_lost_lease_is_not_carried_on(expire_lease):
    """If another worker took the run while the connection was down, this one lets go."""
    run = start_run("ledger", {"steps": 2})
    worker, other = WorkerProcess(concurrency=1), WorkerProcess(concurrency=1)
    worker.register()
    other.register()
    (claimed,) = worker.claim(1)
    lease = Lease(claimed.id, claimed.lease_epoch)

    def taken_over():
        expire_lease(run.id)
        assert other.claim(1)  # the takeover, committed
        terminate_own_connection()

    workflows.hooks["s0"] = taken_over
    worker._execute(claimed, lease)
    run.refresh_from_db()
    assert run.status == RunStatus.RUNNING and run.worker_id == other.id
    assert lease.lost.is_set()


@override_settings(STEPGUARD_DURABLE_START=False)
@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)  # outside a test transaction: the one-statement path
def test_reconciled_and_asked_steps_write_their_started_row_durably(drive):
    """Opting out of durable starts never covers a step whose recovery needs its started row."""
    start_run("ledger", {"steps": 3, "reconcile": [1]})
    start_run("ledger", {"steps": 3})
    starts = []

    def record(execute, sql, params, many, context):
        values = params.values() if isinstance(params, dict) else params or ()  # named or not
        if "step.started" in map(str, values):
            starts.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        assert drive() == ["completed", "completed"]
    assert len(starts) == 6
    lazy = ["synchronous_commit" in sql for sql in starts]
    # s0 and s2 opted out; s1 reconciles (and so completes at once). In the second run s1 and
    # s2 carry the completion of the step before, which is always durable.
    assert lazy == [True, False, True, True, False, False]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_started_rows_are_durable_by_default(drive):
    start_run("ledger", {"steps": 2})
    with CaptureQueriesContext(connection) as queries:
        assert drive() == ["completed"]
    assert not any("synchronous_commit" in q["sql"] for q in queries.captured_queries)


def test_an_outage_is_said_in_two_lines(caplog):
    outage = Outage()
    with caplog.at_level(logging.DEBUG, logger="stepguard.database"):
        for _ in range(50):
            outage.failed(
                RuntimeError("connection refused\nmore detail"), "claiming runs", time.monotonic()
            )
        outage.ok()
        outage.ok()
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.levelno > logging.DEBUG]
    assert said[0] == (
        "ERROR",
        "database unreachable (claiming runs: connection refused); retrying until it answers",
    )
    assert said[1][0] == "WARNING" and said[1][1].startswith("database back after ")
    assert len(said) == 2


@pytest.mark.postgres
@pytest.mark.django_db
def test_only_connection_failures_are_waited_out():
    from django.db import DataError, OperationalError

    def raised(*statements):
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                for sql in statements:
                    cursor.execute(sql)
        except Exception as exc:
            return exc
        raise AssertionError(f"{statements} did not fail")

    cancelled = raised("SET LOCAL statement_timeout = 1", "SELECT pg_sleep(1)")
    assert isinstance(cancelled, OperationalError) and not is_disconnect(cancelled)
    assert not is_disconnect(raised("SELECT 1/0"))
    assert not is_disconnect(DataError("bad value"))
