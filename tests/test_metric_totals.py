"""/metrics that costs nothing per scrape (issue 51): on PostgreSQL the totals over everything
stored are kept by triggers as runs start, finish, fail, resume and are pruned (runs/tally.py),
and they equal what summing the tables gives; a scrape asks the same statements whatever the
history, none of them of the steps table."""

from datetime import timedelta

import pytest
from django.db import connection
from django.db.models import Count
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from runs import retention, summary, tally
from runs.approvals.models import ApprovalRequest
from runs.models import Run, RunStatus, Step, Tally
from runs.sdk import start_run
from tests import workflows  # noqa: F401  (registers the workflows started here)
from tests.test_operations import scrape


def _samples(families) -> dict:
    return {
        (s.name, tuple(sorted(s.labels.items()))): round(s.value, 3)
        for family in families
        for s in family.samples
    }


def kept_totals() -> dict:
    kept = tally.read()
    runs, families = summary.totals(kept)
    return {
        "runs": sorted((w, st, n) for w, st, n in runs if n),
        "held": kept["held"].get(("", ""), 0),
        "approvals": {st: n for (_, st), n in kept["approvals"].items() if n},
        **_samples(families),
    }


def table_totals() -> dict:
    """The same figures summed from the tables, as off PostgreSQL."""
    runs = Run.objects.values_list("workflow", "status").order_by().distinct()
    counted = sorted((w, st, Run.objects.filter(workflow=w, status=st).count()) for w, st in runs)
    approvals = ApprovalRequest.objects.values_list("status").annotate(n=Count("id"))
    return {
        "runs": counted,
        "held": Run.objects.filter(halted_at__isnull=False).count(),
        "approvals": dict(approvals.order_by()),
        **_samples([*summary._steps(), *summary._spend()]),
    }


pytestmark = pytest.mark.postgres


def test_kept_totals_equal_the_tables_as_runs_finish_fail_resume_and_are_pruned(drive):
    done = [start_run("ledger", {"steps": 2}, key=f"done-{i}") for i in range(3)]
    failed = start_run("flaky", {"failures": 5, "attempts": 2})
    waiting = start_run("waiter", {})
    asking = start_run("approver", {"amount": 5})
    assert kept_totals()["stepguard_steps", (("outcome", "completed"),)] == 0
    drive()
    # A step priced as a model call, written while its run was still live.
    Run.objects.filter(pk=done[0].pk).update(status=RunStatus.PENDING)
    Step.objects.filter(run=done[0], key="s0").update(
        kind="llm", input=[{"model": "gpt-x"}], cost_micros=2_500_000, tokens_in=7, tokens_out=3
    )
    Run.objects.filter(pk=done[0].pk).update(status=RunStatus.COMPLETED)
    assert Run.objects.get(pk=failed.pk).status == RunStatus.FAILED

    kept = kept_totals()
    assert kept == table_totals()
    assert kept["stepguard_steps", (("outcome", "completed"),)] == 6  # the finished runs' steps
    assert kept["stepguard_steps", (("outcome", "failed"),)] == 1
    assert kept["stepguard_steps", (("outcome", "retried"),)] == 1
    assert kept["stepguard_spend_usd", (("model", "gpt-x"), ("workflow", "ledger"))] == 2.5
    assert ("waiter", "waiting", 1) in kept["runs"]
    assert kept["approvals"] == {"pending": 1}

    # A hold placed and an approval decided: counted as they change.
    Run.objects.filter(pk=waiting.pk).update(halted_at=timezone.now(), halted_by="otto")
    ApprovalRequest.objects.filter(run=asking).update(status="rejected", decided_at=timezone.now())
    assert kept_totals() == table_totals()
    assert (kept_totals()["held"], kept_totals()["approvals"]) == (1, {"rejected": 1})
    kept = kept_totals()

    tally.fold()  # one row per key again: the same totals
    assert Tally.objects.filter(folded=False).count() == 0
    assert kept_totals() == kept

    # A failed run resumed: its steps leave the totals until it finishes again.
    Run.objects.filter(pk=failed.pk).update(status=RunStatus.PENDING)
    assert kept_totals() == table_totals()
    assert kept_totals()["stepguard_steps", (("outcome", "failed"),)] == 0
    Run.objects.filter(pk=failed.pk).update(status=RunStatus.FAILED)

    # Pruned: the two oldest finished runs and their steps leave the totals.
    old = timezone.now() - timedelta(days=30)
    Run.objects.filter(pk__in=[done[1].pk, done[2].pk]).update(finished_at=old)
    assert retention.prune(finished_before=timezone.now() - timedelta(days=7)).runs == 2
    after = kept_totals()
    assert after == table_totals()
    assert after["stepguard_steps", (("outcome", "completed"),)] == 2
    assert ("ledger", "completed", 1) in after["runs"]
    assert Run.objects.filter(pk=waiting.pk).exists()


def test_a_scrape_asks_the_same_statements_whatever_the_history(client, drive, settings):
    settings.STEPGUARD_METRICS_ALLOW = ["127.0.0.1"]

    def asked() -> list[str]:
        with CaptureQueriesContext(connection) as captured:
            scrape(client)
        return [q["sql"] for q in captured]

    start_run("ledger", {"steps": 1})
    drive()
    scrape(client)  # the summary made once, as a worker would
    few = asked()
    for i in range(20):
        start_run("ledger", {"steps": 3}, key=f"more-{i}")
    drive()
    many = asked()
    assert len(many) == len(few)
    assert not [q for q in many if "runs_step" in q]
    counted = [q for q in many if "GROUP BY" in q and '"runs_run"."workflow"' in q]
    assert not counted  # runs by status are the kept totals, not a count of the runs table
    scraped = scrape(client)
    assert scraped["stepguard_steps", (("outcome", "completed"),)] == 61
    assert scraped["stepguard_runs", (("status", "completed"), ("workflow", "ledger"))] == 21


def test_the_flow_overview_counts_are_the_kept_totals_and_only_keyed_runs_are_grouped(db):
    """Issue 51: the flow page grouped every live run on every view (489,011 rows read at a
    million runs); its per-workflow counts are the kept totals now, and only the keyed runs
    running or queued are grouped, for the busiest keys."""
    import tests.flow_workflows  # noqa: F401  (registers flow.tenant: per_key=2)
    from runs.engine import flow

    for i in range(3):
        start_run("flow.tenant", {"tenant": "acme" if i else "umbrella"})
    for i in range(4):
        start_run("ledger", {"steps": 1}, key=f"queued-{i}")
    waiting = start_run("ledger", {"steps": 1}, key="waiting")
    Run.objects.filter(pk=waiting.pk).update(status=RunStatus.WAITING)

    with CaptureQueriesContext(connection) as captured:
        rows = {row["workflow"]: row for row in flow.overview()}
    grouped = [q["sql"] for q in captured if "GROUP BY" in q["sql"] and "runs_run" in q["sql"]]
    assert len(grouped) == 1 and "concurrency_key" in grouped[0]  # the keyed runs alone
    assert (rows["ledger"]["queued"], rows["ledger"]["waiting"]) == (4, 1)
    assert rows["flow.tenant"]["queued"] == 3
    assert rows["flow.tenant"]["keys"] == [
        {"key": "acme", "running": 0, "queued": 2},
        {"key": "umbrella", "running": 0, "queued": 1},
    ]
