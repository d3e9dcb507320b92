"""History that scales (issue 35 item 4): what the runs list and /metrics ask of the database
does not grow with the whole history. The times at a million runs are bench/ui.py's; these tests
hold the shapes that make them: capped counts, the indexes the searches use, a cached summary."""

import os
import re
import subprocess
import sys

import pytest
from django.core.cache import cache
from django.db import connection, transaction

from controlplane import metrics
from runs import queries, summary
from runs.models import Run, RunStatus
from runs.sdk import start_run
from tests import workflows  # noqa: F401  (registers "ledger")
from tests.conftest import ROOT, own_cluster
from tests.test_operations import scrape


@pytest.fixture
def few_runs(db):
    """Five completed runs and one pending (marked, not executed: counting is the point)."""
    done = [start_run("ledger", {"steps": 1}, key=f"order-{i}") for i in range(5)]
    Run.objects.filter(pk__in=[r.pk for r in done]).update(status=RunStatus.COMPLETED)
    start_run("ledger", {"steps": 1}, key="order-pending")


def test_status_counts_are_exact_up_to_the_cap_and_estimated_above_it(
    client, cast, few_runs, monkeypatch
):
    client.force_login(cast["otto"])
    otto = client
    counts = otto.get("/").content.decode()
    assert re.search(r"completed</a>: 5 ", counts) and re.search(r"pending</a>: 1 ", counts)
    assert "all 6 runs (no filter)" in counts

    monkeypatch.setattr(queries, "EXACT_UP_TO", 3)
    page = otto.get("/").content.decode()
    assert re.search(r"pending</a>: 1 ", page)  # under the cap: still counted
    if connection.vendor == "postgresql":  # above it, the planner's estimate, said to be one
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE runs_run")
        page = otto.get("/").content.decode()
        assert re.search(r"completed</a>: <abbr title=\"estimated[^\"]*\">≈5</abbr>", page), page
        assert "all ≈6 runs (no filter)" in page
    else:  # SQLite, the embedded engine, counts them all
        assert re.search(r"completed</a>: 5 ", page)
    assert otto.get("/runs/count", {"workflow": "ledger"}).content.decode() == "more than 3 runs"
    assert otto.get("/runs/count", {"status": "pending"}).content.decode() == "1 run"


@pytest.mark.postgres
def test_key_and_short_id_search_and_a_workflow_status_pair_are_index_probes(few_runs):
    """Forced off sequential scans, the plans name the indexes: a search by part of a key or
    a short id reads the key's trigrams and the primary key's range instead of every key; a
    workflow and status have an index of their own."""

    def plan(filters) -> str:
        return queries.runs_matching(filters).order_by().values("pk").explain()

    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        assert "runs_run_key_trgm_idx" in plan({"q": "der-3"})
        short = plan({"q": "0a1b2c3d"})  # a short id, or a key part
        assert "runs_run_key_trgm_idx" in short
        # The id's range is an index condition (the primary key's, or on a near-empty table
        # any index holding the id, as the planner likes), not a filter over every row.
        assert re.search(r"Index Cond: \(\(id >= '0a1b2c3d-", short), short
    # Which of two indexes a near-empty table's plan takes is the planner's whim; that the pair
    # has an index of its own is what matters (bench/ui.py times it at a million runs).
    with connection.cursor() as cursor:
        indexes = connection.introspection.get_constraints(cursor, "runs_run")
    assert indexes["runs_run_wf_status_created_idx"]["columns"] == [
        "workflow",
        "status",
        "created_at",
    ]
    assert [r.key for r in queries.runs_matching({"q": "DER-3"})] == ["order-3"]


def test_metrics_runs_by_status_are_current_and_the_backlog_past_the_cap_is_the_summarys(
    client, few_runs, settings, django_assert_max_num_queries, monkeypatch
):
    """On PostgreSQL runs by status are kept totals, current at each scrape (elsewhere the
    finished ones are the summary's, a period old); the runnable backlog past the cap is the
    summary's everywhere."""
    settings.STEPGUARD_METRICS_ALLOW = ["127.0.0.1"]
    settings.STEPGUARD_METRICS_SUMMARY_SECONDS = 60
    cache.delete(summary.KEY)
    completed = ("stepguard_runs", (("status", "completed"), ("workflow", "ledger")))
    pending = ("stepguard_runs", (("status", "pending"), ("workflow", "ledger")))
    first = scrape(client)
    assert (first[completed], first[pending]) == (5, 1)

    Run.objects.filter(key="order-0").update(status=RunStatus.FAILED)
    start_run("ledger", {"steps": 1}, key="order-later")
    with django_assert_max_num_queries(13):  # no whole-table query is asked
        second = scrape(client)
    assert second[pending] == 2  # read on every scrape: what an alert on stuck runs needs
    kept = connection.vendor == "postgresql"
    assert second[completed] == (4 if kept else 5)  # else as of the summary
    cache.delete(summary.KEY)
    third = scrape(client)
    assert third[completed] == 4
    assert third[("stepguard_runs", (("status", "failed"), ("workflow", "ledger")))] == 1

    # Past the per-scrape cap, the runnable backlog (and off PostgreSQL a status's count) is
    # the summary's.
    monkeypatch.setattr(metrics, "CAP", 2)
    start_run("ledger", {"steps": 1}, key="order-latest")
    capped = scrape(client)
    assert capped[pending] == (3 if kept else 2)
    assert capped[("stepguard_runnable_runs", ())] == 3  # what was counted: more than the cap
    cache.delete(summary.KEY)
    assert scrape(client)[pending] == 3


@pytest.mark.postgres
def test_a_role_that_may_not_create_pg_trgm_migrates_and_the_warning_says_how_to_build_the_index():
    """`migrate` by a role without CREATE on the database: the migration says what is missing
    and goes on (search still works, reading every key); the statement its warning names,
    run after an administrator's CREATE EXTENSION, builds the index the search uses."""
    with own_cluster(copy=False) as cluster:
        cluster.psql("CREATE ROLE narrow LOGIN", dbname="postgres")
        cluster.psql("CREATE DATABASE narrow", dbname="postgres")
        cluster.psql(
            "GRANT CREATE ON SCHEMA public TO narrow", dbname="narrow"
        )  # no CREATE ON DATABASE
        env = {
            **os.environ,
            "DATABASE_URL": f"postgres://narrow@127.0.0.1:{cluster.port}/narrow",
            "DJANGO_SETTINGS_MODULE": "tests.settings",
        }
        env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)

        def manage(*argv: str) -> subprocess.CompletedProcess:
            return subprocess.run(
                [sys.executable, "manage.py", *argv], cwd=ROOT, env=env, capture_output=True,
                text=True, timeout=300,
            )  # fmt: skip

        migrated = manage("migrate", "--no-input")
        assert migrated.returncode == 0, migrated.stdout + migrated.stderr
        warning = re.search(r"pg_trgm is not available .*?run this .*?: (CREATE INDEX .*?;)",
                            migrated.stderr, re.S)  # fmt: skip
        assert warning, migrated.stderr
        # btree_gin likewise (the label and status index): said, and migrate went on.
        assert "btree_gin is not available" in migrated.stderr
        index = "SELECT count(*) FROM pg_indexes WHERE indexname = 'runs_run_key_trgm_idx'"
        assert cluster.psql(index, dbname="narrow") == "0"
        assert cluster.psql("SELECT count(*) FROM runs_run", dbname="narrow") == "0"

        cluster.psql("CREATE EXTENSION pg_trgm", dbname="narrow")  # the administrator
        subprocess.run(
            [
                str(cluster.bin / "psql"),
                "-X",
                "-v",
                "ON_ERROR_STOP=1",
                f"postgres://narrow@127.0.0.1:{cluster.port}/narrow",
                "-c",
                warning.group(1),
            ],
            check=True,
            capture_output=True,
            text=True,
        )  # fmt: skip  (the role that migrates runs the statement as the warning wrote it)
        assert cluster.psql(index, dbname="narrow") == "1"
        shown = manage("showmigrations", "runs")
        assert "[ ] " not in shown.stdout, shown.stdout  # nothing was migrated back


def test_the_workflow_names_the_policy_pages_list_are_every_workflow_with_runs(db):
    names = ["zeta", "alpha", "ledger", "alpha", "Alpha-2", "zeta"]
    for i, name in enumerate(names):
        run = start_run("ledger", {"steps": 1}, key=f"k-{i}")
        Run.objects.filter(pk=run.pk).update(workflow=name)
    assert sorted(queries.workflow_names()) == sorted(set(names))


def test_with_a_shared_cache_a_scrape_never_reads_the_steps_a_worker_keeps_the_summary(
    client, few_runs, settings, monkeypatch
):
    """Issue 51: what no scrape reads the tables for comes from one worker per period, through
    Django's cache (Redis in production; the test's own cache stands in, shared in-process)."""
    from django.test.utils import CaptureQueriesContext

    from runs import summary
    from runs.engine.chores import ChoreContext

    settings.STEPGUARD_METRICS_ALLOW = ["127.0.0.1"]
    settings.STEPGUARD_METRICS_SUMMARY_SECONDS = 60
    monkeypatch.setattr(summary, "cache_shared", lambda: True)
    cache.delete(summary.KEY)
    completed = ("stepguard_runs", (("status", "completed"), ("workflow", "ledger")))
    with CaptureQueriesContext(connection) as asked:
        before = scrape(client)
    assert not [q for q in asked if "runs_step" in q["sql"]]
    assert before[("stepguard_metrics_summary_age_seconds", ())] == -1  # no worker yet
    kept = connection.vendor == "postgresql"
    assert (completed in before) is kept  # elsewhere finished runs are the summary's

    summary.keep(ChoreContext(worker="w-1", workflows=frozenset()))
    # The period's turn is taken: the second worker computes nothing.
    summary.keep(ChoreContext(worker="w-2", workflows=frozenset()))
    with CaptureQueriesContext(connection) as asked:
        after = scrape(client)
    assert not [q for q in asked if "runs_step" in q["sql"]]
    assert after[completed] == 5
    assert 0 <= after[("stepguard_metrics_summary_age_seconds", ())] < 60
    assert ("stepguard_steps", (("outcome", "completed"),)) in after
