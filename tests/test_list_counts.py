"""The runs list's status counts follow its filters (issue 53 §3), and what they and the list
ask of PostgreSQL stays an index range however large the history (issue 51; the times at a
million runs are bench/ui.py's)."""

import re

import pytest
from django.db import connection

from runs import queries
from runs.models import Run, RunStatus
from runs.sdk import start_run
from tests import workflows  # noqa: F401  (registers "ledger")


@pytest.fixture
def tenants(db):
    """acme: 3 completed, 1 failed; globex: 2 completed; one engine run (a delivery) failed."""
    shapes = [("acme", "completed")] * 3 + [("acme", "failed"), ("globex", "completed")] * 1
    shapes += [("globex", "completed")]
    for i, (tenant, status) in enumerate(shapes):
        run = start_run("ledger", {"steps": 1}, key=f"t-{i}", labels={"tenant": tenant})
        Run.objects.filter(pk=run.pk).update(status=status)
    delivery = start_run("ledger", {"steps": 1}, key="delivery")
    Run.objects.filter(pk=delivery.pk).update(workflow="stepguard.notify", status="failed")


def counts(page: str) -> dict[str, str]:
    shown = re.search(r'<p class="muted" id="runs-counts".*?</p>', page, re.S).group(0)
    return dict(re.findall(r">(\w+)</a>: (\d+)", shown))


def test_the_status_counts_follow_the_lists_filters(client, cast, tenants):
    client.force_login(cast["otto"])
    everything = counts(client.get("/").content.decode())
    assert (everything["completed"], everything["failed"]) == ("5", "1")  # no engine run
    acme = client.get("/", {"label": "tenant=acme"}).content.decode()
    assert (counts(acme)["completed"], counts(acme)["failed"]) == ("3", "1")
    # Each status's link keeps the other filters, as its count does.
    assert 'href="?label=tenant%3Dacme&amp;status=failed"' in acme
    globex = counts(client.get("/", {"label": "tenant=globex"}).content.decode())
    assert (globex["completed"], globex["failed"]) == ("2", "0")
    # A status filter picks one of the counts: the others still say what choosing them shows.
    chosen = counts(client.get("/", {"label": "tenant=acme", "status": "failed"}).content.decode())
    assert (chosen["completed"], chosen["failed"]) == ("3", "1")
    engine = counts(client.get("/", {"engine": "1"}).content.decode())
    assert engine["failed"] == "2"  # the engine's own runs count where they are shown
    nothing = counts(client.get("/", {"workflow": "nope"}).content.decode())
    assert set(nothing.values()) == {"0"}
    refused = client.get("/", {"label": "no label"})  # a bad filter: said, and nothing counted
    assert set(counts(refused.content.decode()).values()) == {"0"}


def test_the_counts_cost_one_statement_whatever_the_filters(
    client, cast, tenants, django_assert_max_num_queries
):
    """Every status counted in one statement (a LIMIT per status), filters or not."""
    client.force_login(cast["otto"])
    plain = queries.runs_matching({"label": "tenant=acme", "workflow": "ledger"})
    with django_assert_max_num_queries(1):
        assert queries.capped_counts(plain, RunStatus.values, 10)["completed"] == 3


def _plan(runs) -> str:
    return runs.order_by().values("status")[: queries.EXACT_UP_TO + 1].explain()


@pytest.fixture
def aged(transactional_db):
    """20,000 runs whose statuses follow age: the oldest finished (completed, one in 40 failed,
    all of them tenant t-0's), the newest 2,000 waiting; 40 tenants; vacuumed and analysed, as
    autovacuum leaves a table (an index-only scan needs the visibility map)."""
    runs = [
        Run(workflow=f"w-{i % 7}", version="1", key=f"a-{i}",
            labels={"tenant": f"t-{i % 40}", "team": f"x-{i % 40}"},
            status=("waiting" if i >= 18_000 else "failed" if i % 40 == 0 else "completed"))
        for i in range(20_000)
    ]  # fmt: skip
    Run.objects.bulk_create(runs, batch_size=2_000)
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE runs_run")


@pytest.mark.postgres
def test_a_status_count_and_a_label_and_status_pair_are_index_ranges(aged):
    """The capped count of a status, as the list asks it (the engine's runs left out), reads
    the partial status index, not the table; a tenant and a status read the tenant's index
    by status (labels.INDEXED), as does the list's page, also when they match nothing (t-7
    never failed); another label and a status read the GIN index over both."""
    listed = queries.runs_matching({}).filter(status="failed")
    assert "runs_run_listed_status_idx" in _plan(listed)
    for tenant in ("t-0", "t-7"):
        pair = queries.runs_matching({"label": f"tenant={tenant}"}).filter(status="failed")
        assert "runs_run_tenant_status_idx" in _plan(pair), tenant
        team = queries.runs_matching({"label": f"team=x-{tenant[2:]}"}).filter(status="failed")
        assert "runs_run_labels_status_gin_idx" in _plan(team), tenant
    for status in ("failed", "completed"):
        page = queries.runs_matching({"label": "tenant=t-7", "status": status})
        assert "runs_run_tenant_status_idx" in queries.newest_first(page)[:51].explain()
    tenant = queries.newest_first(queries.runs_matching({"label": "tenant=t-7"}))
    assert "runs_run_tenant_created_idx" in tenant[:51].explain()
    page = queries.newest_first(queries.runs_matching({"status": "failed"}))[:51]
    assert "runs_run_listed_status_idx" in page.explain()
    with connection.cursor() as cursor:
        indexes = connection.introspection.get_constraints(cursor, "runs_run")
    assert "runs_run_labels_gin_idx" not in indexes  # the pair's index serves a label alone


@pytest.fixture
def due_and_halted(transactional_db):
    """20,000 runs: 5,000 due (pending, no worker serves them), 2,000 halted by their own
    hold, the rest finished; vacuumed and analysed."""
    from datetime import timedelta

    from django.utils import timezone

    past = timezone.now() - timedelta(hours=1)

    def shaped(i: int) -> dict:
        if i < 5_000:
            return {"status": "pending", "wake_at": past}
        if i < 7_000:
            return {"status": "halted", "halted_at": past, "halted_by": "ops"}
        return {"status": "completed"}

    Run.objects.bulk_create(
        [Run(workflow="w", version="1", key=f"d-{i}", **shaped(i)) for i in range(20_000)],
        batch_size=2_000,
    )
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE runs_run")


@pytest.mark.postgres
def test_the_held_runs_sweep_of_an_idle_poll_reads_only_runs_a_hold_can_cover(due_and_halted):
    """With runs' own holds in force, the sweep asks for the due runs that are halted or
    children: a partial index of exactly those, not the due runs ANDed with the halted ones."""
    from django.test.utils import CaptureQueriesContext
    from django.utils import timezone

    from runs.engine import unheld

    with CaptureQueriesContext(connection) as asked:
        unheld.park_held(timezone.now())
    sweep = next(q["sql"] for q in asked if "LIMIT 50" in q["sql"])
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN {sweep}")
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "runs_run_due_holdable_idx" in plan, plan
    assert "runs_run_wake_idx" not in plan, plan


@pytest.fixture
def churned(transactional_db):
    """20,000 runs of 40 teams but one (a label no btree index orders: labels.INDEXED):
    t-old's 500 runs are among the oldest, all completed (a team that left); vacuumed and
    analysed."""
    runs = [
        Run(workflow="w", version="1", key=f"c-{i}", status="completed",
            labels={"team": "t-old" if i < 1_000 and i % 2 else f"t-{i % 40}"})
        for i in range(20_000)
    ]  # fmt: skip
    Run.objects.bulk_create(runs, batch_size=2_000)
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE runs_run")


def _pages(filters: dict, probe: bool, size: int = 50) -> list[list[str]]:
    """Every page of the list of `filters`, as run keys, following the markers."""
    pages, after = [], None
    while True:
        rows, after = queries.page(queries.runs_matching(filters), size, after, probe=probe)
        pages.append([run.key for run in rows])
        if after is None:
            return pages


@pytest.mark.postgres
def test_a_probed_page_is_the_walked_page_found_through_the_filters_index(
    churned, monkeypatch, django_assert_max_num_queries
):
    """A team whose runs are all old: a probed page gathers its matches through the labels'
    index, unordered, and orders them itself (the planner would walk the newest-first index
    past every newer run), and shows what the walk shows, page after page; with more matches
    than PROBE_UP_TO it walks, with the same result."""
    old = {"label": "team=t-old", "status": "completed"}
    walked = _pages(old, probe=False)
    assert [len(p) for p in walked] == [50] * 10
    assert walked[0][0] == "c-999" and walked[-1][-1] == "c-1"  # newest first, every page
    assert _pages(old, probe=True) == walked
    with django_assert_max_num_queries(2) as captured:
        queries.page(queries.runs_matching(old), 50, probe=True)
    probe_sql = captured.captured_queries[0]["sql"]
    assert "MATERIALIZED" in probe_sql
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN {probe_sql}")
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "runs_run_labels_status_gin_idx" in plan
    monkeypatch.setattr(queries, "PROBE_UP_TO", 100)  # 500 matches: too many, it walks
    assert _pages(old, probe=True) == walked
    # What the list probes: a search; a label's runs may be many (a tenant's are indexed).
    assert queries.probed({"q": "c-9"}) and not queries.probed({"label": "team=t-old"})
    search = {"q": "c-99"}
    assert _pages(search, probe=True) == _pages(search, probe=False)
    busy = {"label": "team=t-3"}
    assert _pages(busy, probe=True) == _pages(busy, probe=False)


@pytest.mark.postgres
def test_probed_status_counts_are_the_capped_counts(churned, monkeypatch):
    """The counts of a label's or a search's few matches, counted whole through the filter's
    index, are the per-status counts; past PROBE_UP_TO the capped counts are made as before."""
    for filters in ({"label": "team=t-old"}, {"q": "c-99"}, {"label": "team=t-nobody"}):
        runs = queries.runs_matching(filters)
        probed = queries.status_counts(runs, probe=True)
        assert probed == queries.status_counts(runs), filters
        assert all(exact for _, exact in probed.values())
    assert queries.status_counts(queries.runs_matching({"label": "team=t-old"}), probe=True)[
        "completed"
    ] == (500, True)
    monkeypatch.setattr(queries, "PROBE_UP_TO", 100)
    wide = queries.status_counts(queries.runs_matching({"label": "team=t-old"}), probe=True)
    assert wide["completed"][0] >= 500
