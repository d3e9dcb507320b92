"""The dashboard pages: login, runs, a run, the approvals inbox, and permission-gated actions."""

import pytest
from django.test import Client

from approvals.models import ApprovalRequest
from runs.models import Run, RunStatus
from runs.sdk import start_run
from tests import workflows  # noqa: F401  (registers "metered")

pytestmark = pytest.mark.django_db


@pytest.fixture
def browser_as(cast):
    def _as(name: str) -> Client:
        client = Client()
        client.force_login(cast[name])
        return client

    return _as


def test_every_page_needs_a_login(client):
    run = start_run("ledger", {"steps": 1})
    for path in ("/", f"/runs/{run.pk}", "/approvals"):
        response = client.get(path)
        assert response.status_code == 302 and response["Location"].startswith("/login/")
    assert client.post(f"/runs/{run.pk}/halt", {"reason": "x"}).status_code == 302


def test_the_runs_list_filters_and_shows_spend_against_budget(browser_as, drive):
    start_run("ledger", {"steps": 1}, key="alpha", budget_usd="4")
    start_run("loop", {"queries": []}, key="beta")
    drive()
    page = browser_as("vera").get("/", {"workflow": "ledger"}).content.decode()
    assert "alpha" in page and "beta" not in page
    assert "<title>Runs · Stepguard</title>" in page
    assert "completed</a>: 2" in page
    assert "0%" in page  # a budget badge


def test_a_run_page_shows_its_timeline_and_history(browser_as, drive):
    run = start_run("ledger", {"steps": 2})
    drive()
    page = browser_as("vera").get(f"/runs/{run.pk}").content.decode()
    assert f"{run.pk}:s1" in page and "step.completed" in page
    assert f"<title>Run {str(run.pk)[:8]} (ledger) · Stepguard</title>" in page


def test_a_viewer_sees_no_action_buttons_and_is_refused_if_it_posts(browser_as, drive):
    run = start_run("approver", {"amount": 5})
    drive()
    vera = browser_as("vera")
    page = vera.get(f"/runs/{run.pk}").content.decode()
    assert "Halt</button>" not in page and "Approve</button>" not in page
    assert vera.post(f"/runs/{run.pk}/halt", {"reason": "x"}).status_code == 403
    approval = ApprovalRequest.objects.get(run=run)
    assert vera.post(f"/approvals/{approval.pk}/decide", {"decision": "approve"}).status_code == 403
    assert Run.objects.get(pk=run.pk).halted_at is None
    assert ApprovalRequest.objects.get(pk=approval.pk).status == "pending"


def test_an_approver_decides_from_the_inbox_and_an_operator_halts(browser_as, drive):
    run = start_run("approver", {"amount": 5})
    drive()
    approval = ApprovalRequest.objects.get(run=run)
    ada = browser_as("ada")
    inbox = ada.get("/approvals").content.decode()
    assert "charge card" in inbox and 'value="approve"' in inbox
    ada.post(f"/approvals/{approval.pk}/decide", {"decision": "approve", "comment": "ok"})
    assert ApprovalRequest.objects.get(pk=approval.pk).status == "approved"
    again = ada.post(f"/approvals/{approval.pk}/decide", {"decision": "reject"}, follow=True)
    assert "already approved by ada" in again.content.decode()
    otto = browser_as("otto")
    other = start_run("ledger", {"steps": 1})
    otto.post(f"/runs/{other.pk}/halt", {"reason": "look first"})
    assert Run.objects.get(pk=other.pk).status == RunStatus.HALTED


def test_actions_need_the_csrf_token(cast):
    client = Client(enforce_csrf_checks=True)
    client.force_login(cast["otto"])
    run = start_run("ledger", {"steps": 1})
    assert client.post(f"/runs/{run.pk}/halt", {"reason": "x"}).status_code == 403
    assert Run.objects.get(pk=run.pk).halted_at is None


def test_workers_audit_and_halts_pages(browser_as, drive, cast):
    run = start_run("ledger", {"steps": 1})
    drive()
    otto = browser_as("otto")
    assert "No worker" not in otto.get("/workers").content.decode()
    otto.post("/halts/halt", {"reason": "incident 7"})
    halts = otto.get("/halts").content.decode()
    assert "Kill switch ON" in halts and "incident 7" in halts
    otto.post("/halts/unhalt", {"reason": "over"})
    otto.post("/halts/halt", {"workflow": "ledger", "reason": "freeze ledger"})
    audit = otto.get("/audit", {"actor": "otto"}).content.decode()
    assert audit.count("<tr><td><time") == 3 and "freeze ledger" in audit
    assert (
        browser_as("vera").post("/halts/unhalt", {"workflow": "ledger", "reason": "x"}).status_code
        == 403
    )
    assert run  # the run itself is untouched by these pages


def test_budget_and_fork_from_the_run_page(browser_as, drive):
    run = start_run("metered", {"steps": 2}, budget_usd="1")
    drive()
    otto = browser_as("otto")
    page = otto.get(f"/runs/{run.pk}").content.decode()
    assert "Set budget" in page and "Fork from a step" in page
    otto.post(f"/runs/{run.pk}/budget", {"usd": "5", "reason": "raise"})
    assert Run.objects.get(pk=run.pk).status == RunStatus.PENDING
    bad = otto.post(f"/runs/{run.pk}/budget", {"usd": "lots", "reason": "x"}, follow=True)
    assert "is not an amount of USD" in bad.content.decode()
    drive()
    response = otto.post(f"/runs/{run.pk}/fork", {"step": "call#2", "reason": "again"})
    fork = Run.objects.get(forked_from=run)
    assert response["Location"] == f"/runs/{fork.pk}"
