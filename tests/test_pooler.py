"""Behind PgBouncer in transaction mode (Debian's 1.18, its defaults): the engine works as is.

Before, with default settings, prepared statements were run on whatever server connection a
transaction landed on: `prepared statement "_pg3_0" does not exist` or `already exists`, and
`bind message supplies 34 parameters, but prepared statement "_pg3_1" requires 45` (another
client's statement of the same name), checkpoints abandoned, runs failed by the recovery
bound; and every NOTIFY was dropped, silently.
"""

import pytest
from django.db.models import Count

from runs.models import Run, RunStatus, Step
from runs.sdk import start_run
from tests.conftest import wait_until
from tests.testapp.models import Effect

pytestmark = pytest.mark.postgres


def test_workers_behind_a_transaction_pooler_run_every_step_once(pgbouncer, spawn_worker):
    workers = [spawn_worker(env={"DATABASE_URL": pgbouncer}) for _ in range(2)]
    runs = [start_run("ledger", {"steps": 6}) for _ in range(30)]
    wait_until(
        lambda: not Run.objects.exclude(status__in=["completed", "failed"]).exists(),
        timeout=120,
        what="30 runs through the pooler to end",
    )
    assert set(
        Run.objects.filter(pk__in=[r.pk for r in runs]).values_list("status", flat=True)
    ) == {RunStatus.COMPLETED}
    assert Step.objects.filter(run__in=runs, status="completed").count() == 30 * 6
    calls = Effect.objects.values("idempotency_key").annotate(n=Count("id"))
    assert len(calls) == 30 * 6 and {c["n"] for c in calls} == {1}
    logs = "".join(w.output() for w in workers)
    for error in ("does not exist", "already exists", "bind message", "abandoning", "Traceback"):
        assert error not in logs, logs[-5000:]
    assert "connected through a connection pooler" in logs
    assert "drops LISTEN" in logs  # said, not silent: no DATABASE_DIRECT_URL here


def test_with_a_direct_url_the_listener_wakes_workers_at_once(pgbouncer, spawn_worker):
    from tests.conftest import database_url

    worker = spawn_worker(
        "--poll-interval",
        "30",
        env={"DATABASE_URL": pgbouncer, "DATABASE_DIRECT_URL": database_url()},
    )
    run = start_run("ledger", {"steps": 1})
    # A 30 s poll: only the NOTIFY through the direct connection wakes it this soon.
    wait_until(
        lambda: Run.objects.get(pk=run.pk).status == RunStatus.COMPLETED,
        timeout=15,
        what="the run to be claimed on its NOTIFY, not the 30 s poll",
    )
    assert "drops LISTEN" not in worker.output()
