"""Per-tenant labels: a run says who it is for when it starts (SDK, API, CLI, Start form); its
children and forks keep it; its spend is queryable and budgeted per label value per day; the
runs list filters by it. One tenant's daily budget stops that tenant's runs, not another's."""

from datetime import timedelta
from decimal import Decimal
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from runs.engine.fences import Lease
from runs.engine.lifecycle import execute
from runs.engine.worker import WorkerProcess
from runs.errors import OperationError
from runs.labels import BadLabel
from runs.models import BudgetLedger, Event, Policy, Run, RunStatus
from runs.operations import fork_run, halt, set_budget
from runs.sdk import InvalidInput, start_run
from tests import workflows

pytestmark = pytest.mark.django_db


def command(*args) -> str:
    out = StringIO()
    call_command(*args, stdout=out, stderr=StringIO())
    return out.getvalue()


# --- what a label is ----------------------------------------------------------------------------


def test_a_run_keeps_its_labels_and_workflow_code_sees_them(drive):
    run = start_run("labelled", labels={"tenant": "acme", "user": 42})
    assert Run.objects.get(pk=run.pk).labels == {"tenant": "acme", "user": "42"}
    created = Event.objects.get(run=run, type="run.created")
    assert created.payload["labels"] == {"tenant": "acme", "user": "42"}
    assert drive() == ["completed"]
    assert Run.objects.get(pk=run.pk).output == {"tenant": "acme", "user": "42"}


@pytest.mark.parametrize(
    ("labels", "message"),
    [
        ({"Tenant": "acme"}, "'Tenant' is not a label name"),
        ({"tenant": ""}, "label 'tenant': a value has 1 to 100 characters"),
        ({"tenant": "x" * 101}, "label 'tenant': a value has 1 to 100 characters"),
        ({"tenant": "a,b"}, "no comma"),
        ({"tenant": "a\nb"}, "no control characters"),
        ({"tenant": ["acme"]}, "a value is text, not list"),
        ({f"l{i}": "x" for i in range(11)}, "at most 10 labels, not 11"),
        (["tenant=acme"], "labels are name: value pairs, not list"),
    ],
)
def test_a_bad_label_is_refused_with_what_is_wrong_and_nothing_is_stored(labels, message):
    with pytest.raises(InvalidInput, match=message):
        start_run("labelled", labels=labels)
    assert not Run.objects.exists()


# --- children and forks -------------------------------------------------------------------------


def test_children_and_forks_work_for_the_tenant_their_parent_works_for(drive, cast):
    parent = start_run("parent", {"n": 2, "steps": 1}, labels={"tenant": "acme"})
    assert drive()[-1] == "completed"
    children = Run.objects.filter(parent=parent)
    assert children.count() == 2
    assert all(child.labels == {"tenant": "acme"} for child in children)
    fork = fork_run(str(parent.pk), "after", cast["otto"], "again")
    assert fork.labels == {"tenant": "acme"}


# --- budgets per label value --------------------------------------------------------------------


def test_a_tenants_daily_budget_stops_its_runs_and_not_another_tenants(drive, cast):
    set_budget("label:tenant=acme", cast["otto"], "acme's cap", usd=Decimal("4"))
    assert Policy.objects.get(scope="label:tenant=acme").daily_budget_micros == 4_000_000
    acme = [start_run("metered", {"steps": 3}, labels={"tenant": "acme"}) for _ in range(2)]
    globex = start_run("metered", {"steps": 3}, labels={"tenant": "globex"})
    drive()
    assert Run.objects.get(pk=globex.pk).status == RunStatus.COMPLETED
    assert sum(Run.objects.get(pk=r.pk).cost_micros for r in acme) == 4_000_000
    ledger = BudgetLedger.objects.get(scope="label:tenant=acme")
    assert (ledger.spent_micros, ledger.reserved_micros) == (4_000_000, 0)
    assert not BudgetLedger.objects.filter(scope="label:tenant=globex").exists()
    paused = Run.objects.get(status=RunStatus.OVER_BUDGET)
    exceeded = Event.objects.get(run=paused, type="budget.exceeded")
    assert exceeded.payload["budget"] == "label 'tenant=acme' daily"

    # Raising the tenant's budget resumes its paused run, which then finishes.
    set_budget("label:tenant=acme", cast["otto"], "more", usd=Decimal("10"))
    assert Run.objects.get(pk=paused.pk).status == RunStatus.PENDING
    assert drive() == ["completed"]


def test_a_label_budget_is_daily_only_and_a_label_cannot_be_halted(cast):
    with pytest.raises(OperationError, match="run defaults are set on a workflow or on everyth"):
        set_budget("label:tenant=acme", cast["otto"], "x", run_usd=Decimal("1"))
    with pytest.raises(OperationError, match="halts apply to a run, a workflow or everything"):
        halt("label:tenant=acme", cast["otto"], "x")
    with pytest.raises(BadLabel, match="is not a label: write name=value"):
        set_budget("label:acme", cast["otto"], "x", usd=Decimal("1"))
    assert not Policy.objects.exists()


def test_the_budget_command_takes_a_label(cast):
    out = command(
        "budget", "--label", "tenant=acme", "--usd", "2.50", "--user", "otto", "--reason", "cap"
    )
    assert out.startswith("label tenant=acme: budget set")
    assert Policy.objects.get(scope="label:tenant=acme").daily_budget_micros == 2_500_000
    with pytest.raises(CommandError, match="not a label name"):
        command("budget", "--label", "Tenant=x", "--usd", "1", "--user", "otto", "--reason", "x")


# --- spend per label value per day --------------------------------------------------------------


def test_spend_is_queryable_per_label_value_per_day(drive, client, cast):
    start_run("metered", {"steps": 2}, labels={"tenant": "acme"})
    start_run("metered", {"steps": 1, "usd": "0.5"}, labels={"tenant": "acme", "user": "7"})
    start_run("metered", {"steps": 3}, labels={"tenant": "globex"})
    start_run("metered", {"steps": 1})
    assert drive() == ["completed"] * 4
    client.force_login(cast["vera"])  # a viewer
    rows = client.get("/api/spend", {"label": "tenant"}).json()
    today = timezone.now().date().isoformat()
    assert [(r["day"], r["value"], Decimal(r["usd"]), r["runs"]) for r in rows] == [
        (today, None, Decimal(1), 1),
        (today, "acme", Decimal("2.5"), 2),
        (today, "globex", Decimal(3), 1),
    ]
    assert rows[1]["tokens"] == 3 * 150
    by_user = client.get("/api/spend", {"label": "user"}).json()
    assert [(r["value"], Decimal(r["usd"])) for r in by_user] == [
        (None, Decimal(6)),
        ("7", Decimal("0.5")),
    ]
    yesterday = (timezone.now() - timedelta(days=1)).date().isoformat()
    assert client.get("/api/spend", {"label": "tenant", "until": yesterday}).json() == []
    bad = client.get("/api/spend", {"label": "Tenant"})
    assert bad.status_code == 400 and "not a label name" in bad.json()["error"]["message"]
    backwards = client.get("/api/spend", {"label": "tenant", "since": today, "until": yesterday})
    assert backwards.status_code == 400 and "before since" in backwards.json()["error"]["message"]

    out = command("spend", "--label", "tenant")
    assert "acme" in out and "2.5" in out and "(no label)" in out


def test_every_write_of_a_steps_spend_is_booked_on_its_day_once_per_run(drive):
    """The spend rows the reports read (SpendDay) are kept by the database, whatever writes a
    step's cost: the engine, a raw update, a copied-in step; a run counts once a day; the rows
    outlive the runs retention deletes; and migration 0023's backfill rebuilds them alike."""
    import importlib

    from django.db import connection
    from django.db.models import F

    from runs.models import SpendDay, SpendRun, Step
    from runs.retention import prune

    def rows():
        found = [
            (r.day, r.workflow, r.labels, r.micros, r.tokens, r.possibly_micros, r.runs)
            for r in SpendDay.objects.all()
        ]
        return sorted(found, key=lambda row: (row[0], row[1], sorted(row[2].items())))

    start_run("metered", {"steps": 2}, labels={"tenant": "acme"})
    start_run("metered", {"steps": 1, "usd": "0.5"}, labels={"tenant": "acme"})
    start_run("metered", {"steps": 1})
    assert drive() == ["completed"] * 3
    today = timezone.now().date()
    acme = (today, "metered", {"tenant": "acme"})
    assert rows() == [
        (today, "metered", {}, 1_000_000, 150, 0, 1),
        (*acme, 2_500_000, 3 * 150, 0, 2),
    ]
    # Any write of a cost is booked, where it happens: here a raw update, and a step that
    # finished yesterday, which lands on yesterday's row and counts its run there.
    step = Step.objects.filter(run__labels__tenant="acme", cost_micros=500_000).get()
    Step.objects.filter(pk=step.pk).update(
        cost_micros=F("cost_micros") + 7, possibly_spent_micros=F("possibly_spent_micros") + 3
    )
    yesterday = timezone.now() - timedelta(days=1)
    Step.objects.create(
        run=step.run, seq=99, key="late", status="completed", idempotency_key="late",
        cost_micros=11, tokens_in=1, started_at=yesterday, finished_at=yesterday,
    )  # fmt: skip
    booked = rows()
    assert booked == [
        (yesterday.date(), "metered", {"tenant": "acme"}, 11, 1, 0, 1),
        (today, "metered", {}, 1_000_000, 150, 0, 1),
        (*acme, 2_500_007, 3 * 150, 3, 2),
    ]

    # The backfill of migration 0023 finds the same rows from the steps alone.
    migration = importlib.import_module("runs.migrations.0023_spend_days")
    day = {
        "postgresql": "(COALESCE(s.finished_at, s.started_at) AT TIME ZONE 'UTC')::date",
        "sqlite": "date(COALESCE(s.finished_at, s.started_at))",
    }[connection.vendor]
    SpendDay.objects.all().delete()
    SpendRun.objects.all().delete()
    with connection.cursor() as cursor:
        for statement in migration._backfill(day):
            cursor.execute(statement)
    assert rows() == booked

    # Retention deletes the runs; what they spent stays reported.
    prune(finished_before=timezone.now() + timedelta(seconds=1))
    assert not Run.objects.exists() and not SpendRun.objects.exists()
    assert rows() == booked


def test_the_longest_label_set_a_run_may_carry_still_books_its_spend(drive):
    """Ten labels of 100 four-byte characters (4 kB of jsonb) are more than a btree entry
    holds (2,704 bytes): the day's spend row is keyed by their md5 on PostgreSQL, so the run's
    priced steps still complete and count."""
    from runs.labels import MAX_LABELS, MAX_VALUE
    from runs.models import SpendDay

    def value(i: int) -> str:  # CJK Extension B: four bytes each, none repeated (incompressible)
        return "".join(chr(0x20000 + (i * MAX_VALUE + j) * 37 % 42_000) for j in range(MAX_VALUE))

    labels = {f"k{i}": value(i) for i in range(MAX_LABELS)}
    run = start_run("metered", {"steps": 2}, labels=labels)
    assert drive() == ["completed"]
    row = SpendDay.objects.get()
    assert (row.labels, row.micros, row.runs) == (labels, Run.objects.get(pk=run.pk).cost_micros, 1)


# --- the surfaces -------------------------------------------------------------------------------


def test_the_api_starts_lists_and_filters_runs_by_label(client, cast):
    client.force_login(cast["otto"])
    made = client.post(
        "/api/runs",
        {"workflow": "labelled", "labels": {"tenant": "acme"}},
        content_type="application/json",
    )
    assert made.status_code == 201 and made.json()["labels"] == {"tenant": "acme"}
    client.post("/api/runs", {"workflow": "labelled"}, content_type="application/json")
    refused = client.post(
        "/api/runs",
        {"workflow": "labelled", "labels": {"tenant": "a,b"}},
        content_type="application/json",
    )
    assert refused.status_code == 400 and "no comma" in refused.json()["error"]["message"]
    assert Run.objects.count() == 2
    listed = client.get("/api/runs", {"label": "tenant=acme"}).json()["items"]
    assert [r["id"] for r in listed] == [made.json()["id"]]
    assert client.get("/api/runs", {"label": "tenant=globex"}).json()["items"] == []
    bad = client.get("/api/runs", {"label": "tenant"})
    assert bad.status_code == 400 and "write name=value" in bad.json()["error"]["message"]


def test_the_cli_starts_a_run_with_labels():
    out = command("startrun", "labelled", "--label", "tenant=acme", "--label", "user=7")
    assert Run.objects.get(pk=out.strip()).labels == {"tenant": "acme", "user": "7"}
    with pytest.raises(CommandError, match="label 'tenant' is given twice"):
        command("startrun", "labelled", "--label", "tenant=a", "--label", "tenant=b")


def test_the_dashboard_starts_filters_and_shows_runs_by_label(client, cast):
    client.force_login(cast["otto"])
    response = client.post(
        "/runs/start", {"workflow": "labelled", "input": "{}", "labels": "tenant=acme, user=7"}
    )
    run = Run.objects.get()
    assert response.status_code == 302 and run.labels == {"tenant": "acme", "user": "7"}
    start_run("labelled", labels={"tenant": "globex"})
    page = client.get(f"/runs/{run.pk}").content.decode()
    assert 'id="run-labels"' in page and "tenant=acme" in page
    assert "?label=tenant%3Dacme" in page  # the label links to the runs that carry it
    listed = client.get("/", {"label": "tenant=acme"}).content.decode()
    assert str(run.pk)[:8] in listed
    assert Run.objects.get(labels__tenant="globex").pk.hex[:8] not in listed.replace("-", "")
    refused = client.post(
        "/runs/start", {"workflow": "labelled", "input": "{}", "labels": "tenant"}, follow=True
    )
    assert "write name=value" in refused.content.decode()
    assert Run.objects.count() == 2


def test_the_budgets_page_sets_and_shows_a_label_budget(client, cast, drive):
    client.force_login(cast["otto"])
    response = client.post(
        "/halts/budget", {"label": "tenant=acme", "usd": "3", "reason": "acme's cap"}
    )
    assert response.status_code == 302
    assert Policy.objects.get(scope="label:tenant=acme").daily_budget_micros == 3_000_000
    start_run("metered", {"steps": 1}, labels={"tenant": "acme"})
    drive()
    page = client.get("/budgets").content.decode()
    assert "label tenant=acme" in page
    assert '<input type="hidden" name="label" value="tenant=acme">' in page
    halts = client.get("/halts").content.decode()
    assert "tenant=acme" not in halts  # a label is never halted: no row there


def test_the_api_sets_and_reads_a_label_budget(client, cast):
    client.force_login(cast["otto"])
    put = client.put(
        "/api/labels/tenant=acme/budget",
        {"usd": "5", "tokens": 100000, "reason": "acme's cap"},
        content_type="application/json",
    )
    assert put.status_code == 200, put.content
    assert put.json()["scope"] == "label:tenant=acme"
    assert Decimal(put.json()["daily_usd"]) == 5 and put.json()["daily_tokens"] == 100000
    read = client.get("/api/labels/tenant=acme/policy").json()
    assert Decimal(read["daily_usd"]) == 5
    defaults = client.put(
        "/api/labels/tenant=acme/budget",
        {"run_usd": "1", "reason": "x"},
        content_type="application/json",
    )
    assert defaults.status_code == 400
    assert "run defaults are set on a workflow" in defaults.json()["error"]["message"]
    bad = client.put(
        "/api/labels/acme/budget", {"usd": "5", "reason": "x"}, content_type="application/json"
    )
    assert bad.status_code == 400 and "write name=value" in bad.json()["error"]["message"]


def test_a_workflow_target_cannot_reach_a_labels_budget(cast, client):
    """`workflow:label:tenant=acme` would have set, or halted, the label's policy row."""
    from runs.engine import registry

    set_budget("label:tenant=acme", cast["otto"], "cap", usd=Decimal("4"))
    with pytest.raises(OperationError, match="'label:' names a label's budget"):
        halt("workflow:label:tenant=acme", cast["otto"], "x")
    client.force_login(cast["otto"])
    put = client.put(
        "/api/workflows/label:tenant=acme/budget",
        {"run_usd": "1", "reason": "x"},
        content_type="application/json",
    )
    assert put.status_code == 400
    policy = Policy.objects.get(scope="label:tenant=acme")
    assert policy.halted_at is None and policy.run_budget_micros is None
    with pytest.raises(ValueError, match="starts with 'label:'"):
        registry.register("label:tenant=acme", "1", lambda ctx, input: None)


def test_the_budgets_page_sums_every_labels_spend_in_one_statement(
    drive, django_assert_num_queries
):
    from runs.views.budgets import _spent_per_label

    for tenant in ("acme", "acme", "bolt"):
        start_run("metered", {"steps": 1}, labels={"tenant": tenant})
    drive()
    one = Run.objects.filter(labels__tenant="bolt").get().cost_micros
    assert one > 0
    today = timezone.now().date()
    with django_assert_num_queries(1):
        spent = _spent_per_label(today, ["tenant=acme", "tenant=bolt", "tenant=none"])
    assert spent == {"tenant=acme": 2 * one, "tenant=bolt": one, "tenant=none": 0}


@pytest.mark.parametrize("scope", ["label:tenant=acme", "workflow:metered", "all"])
def test_a_daily_budget_set_mid_day_counts_what_was_spent_before_it(drive, client, cast, scope):
    """A tenant (or workflow, or everything) spent $3 today before its $2 daily budget was set:
    it is over at once, and the next run is refused before its first step. Before, the budget
    counted from its first use (the ledger began at 0): the new run went through, spending
    $1 more than a budget already at 150%, and the page showed 50% instead of 150%."""
    start_run("metered", {"steps": 3}, labels={"tenant": "acme"})
    assert drive() == ["completed"]
    set_budget(scope, cast["otto"], "a cap set mid-day", usd=Decimal("2"))
    late = start_run("metered", {"steps": 1}, labels={"tenant": "acme"})
    assert drive() == ["over_budget"]
    assert Run.objects.get(pk=late.pk).cost_micros == 0
    ledger_scope = {"workflow:metered": "metered", "all": "*"}.get(scope, scope)
    assert BudgetLedger.objects.get(scope=ledger_scope).spent_micros == 3_000_000
    client.force_login(cast["vera"])
    page = client.get("/budgets").content.decode()
    assert ">150%</span>" in page  # the figure enforced is the day's spend the page shows


def test_runs_paused_by_other_runs_reservations_resume_when_those_are_released(drive, cast):
    """Six runs of one tenant each estimate $1 for a call that costs $0.10, under a $1.50
    daily budget. While the first one's call is in flight (its $1 held), the five others are
    refused: their estimate does not fit beside it. When it finishes, its hold is released and
    $0.10 booked: the five fit again and are resumed, and all six complete ($0.60). Before,
    five of six stayed `over_budget` until UTC midnight, with $0.10 spent and nothing held."""
    set_budget("label:tenant=acme", cast["otto"], "acme's cap", usd=Decimal("1.5"))
    tenant = {"tenant": "acme"}
    spec = {"steps": 1, "usd": "0.1", "estimate_usd": "1"}
    first = start_run("metered", spec, labels=tenant)
    others = [start_run("metered", spec, labels=tenant) for _ in range(5)]
    beside = WorkerProcess(concurrency=5)
    beside.register()
    refused = []

    def in_flight():
        for claimed in beside.claim(5):
            refused.append(execute(claimed, Lease(claimed.id, claimed.lease_epoch)))

    workflows.hooks["call-0"] = in_flight
    assert drive(limit=1) == ["completed"]
    assert refused == ["over_budget"] * 5
    statuses = [Run.objects.get(pk=r.pk).status for r in others]
    assert statuses == [RunStatus.PENDING] * 5, statuses
    assert sorted(drive()) == ["completed"] * 5
    ledger = BudgetLedger.objects.get(scope="label:tenant=acme")
    assert (ledger.spent_micros, ledger.reserved_micros) == (600_000, 0)
    assert Run.objects.get(pk=first.pk).status == RunStatus.COMPLETED
