"""Bulk halt, cancel and retry (issue 52): one operation (runs.operations.bulk) behind the runs
list's form, `POST /api/runs/bulk` and `manage.py bulk`, each run acted on as alone (its
permission, its checks, its audit event) and each one's outcome reported."""

import json
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.test import Client

from runs.apikeys import create_key
from runs.models import Event, Run, RunStatus
from runs.sdk import start_run

pytestmark = pytest.mark.django_db


@pytest.fixture
def api(cast, client):
    """api("otto", body) posts to /api/runs/bulk with an API key of that user."""
    keys: dict[str, str] = {}

    def _post(name: str, body: dict):
        if name not in keys:
            keys[name] = create_key(cast[name])[1]
        return client.post(
            "/api/runs/bulk", json.dumps(body), content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer {keys[name]}",
        )  # fmt: skip

    return _post


@pytest.fixture
def runs() -> tuple[list[Run], list[Run]]:
    """Two runs of "ledger" and three of "loop", none started by a worker yet."""
    ledger = [start_run("ledger", {"steps": 1}, key=f"ledger-{i}") for i in range(2)]
    loop = [start_run("loop", {"queries": []}, key=f"loop-{i}") for i in range(3)]
    return ledger, loop


def command(*args) -> str:
    out = StringIO()
    call_command("bulk", *args, stdout=out, stderr=StringIO())
    return out.getvalue()


# --- API ---------------------------------------------------------------------------------------


def test_the_api_cancels_runs_by_filter_and_says_what_became_of_each(api, runs):
    _, loop = runs
    answer = api("otto", {"action": "cancel", "reason": "stale", "filter": {"workflow": "loop"}})
    assert answer.status_code == 200, answer.content
    body = answer.json()
    assert (body["action"], body["matched"], body["done"], body["refused"]) == ("cancel", 3, 3, 0)
    assert [r["run_id"] for r in body["runs"]] == [str(r.pk) for r in loop]  # oldest first
    assert all(r["ok"] and r["code"] == "" for r in body["runs"])
    assert set(Run.objects.filter(workflow="loop").values_list("status", flat=True)) == {
        RunStatus.CANCELLED
    }
    assert not Run.objects.filter(workflow="ledger", status=RunStatus.CANCELLED).exists()
    cancelled = Event.objects.filter(run__workflow="loop", type="run.cancelled")
    assert cancelled.count() == 3 and {e.actor for e in cancelled} == {"otto"}


def test_the_api_reports_each_refused_run_with_its_reason_and_does_the_others(api, runs):
    ledger, _ = runs
    api("otto", {"action": "cancel", "reason": "done", "ids": [str(ledger[0].pk)]})
    answer = api("otto", {"action": "retry", "reason": "again", "ids": [str(r.pk) for r in ledger]})
    assert answer.status_code == 200, answer.content
    body = answer.json()
    assert (body["matched"], body["done"], body["refused"]) == (2, 0, 2)
    assert all(r["code"] == "conflict" and "only failed runs are retried" in r["message"]
               for r in body["runs"]), body  # fmt: skip
    halted = api("otto", {"action": "halt", "reason": "look", "ids": [str(r.pk) for r in ledger]})
    assert [(r["run_id"], r["ok"]) for r in halted.json()["runs"]] == [
        (str(ledger[0].pk), False),  # it has ended: refused, with why
        (str(ledger[1].pk), True),  # done all the same
    ]
    assert halted.json()["runs"][0]["message"]
    assert Run.objects.get(pk=ledger[1].pk).halted_by == "otto"


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"action": "explode", "reason": "x", "ids": []}, 400, "no bulk action 'explode'"),
        ({"action": "halt", "reason": "x"}, 400, "name the runs"),
        ({"action": "halt", "reason": "x", "ids": [], "filter": {}}, 400, "name the runs"),
        ({"action": "halt", "reason": "x", "filter": {"colour": "red"}}, 400, "no filter 'colour'"),
        ({"action": "halt", "reason": "x", "filter": {"since": "yesterday"}}, 400, "since"),
        ({"action": "halt", "reason": "x", "filter": {"workflow": "none"}}, 400, "no runs"),
        ({"action": "halt", "reason": " ", "filter": {"workflow": "loop"}}, 400, "needs a reason"),
        ({"action": "halt", "reason": "x", "ids": ["not-a-uuid"]}, 422, "ids"),
        ({"action": "halt", "reason": "x", "ids": [], "extra": 1}, 422, "extra"),
    ],
)
def test_bad_input_is_a_4xx_that_names_the_problem_and_touches_nothing(
    api, runs, body, status, says
):
    answer = api("otto", body)
    assert answer.status_code == status, answer.content
    assert says in answer.json()["error"]["message"]
    assert not Run.objects.exclude(halted_at=None).exists()


def test_the_api_needs_the_single_run_actions_permission_before_it_counts(api, runs):
    """A viewer (no runs.halt_run) is refused before anything is matched: the refusal says the
    permission, not how many runs a filter matches."""
    answer = api("vera", {"action": "halt", "reason": "x", "filter": {"workflow": "none"}})
    assert answer.status_code == 403
    assert "runs.halt_run" in answer.json()["error"]["message"]
    _, loop = runs
    refused = api("vera", {"action": "cancel", "reason": "x", "ids": [str(loop[0].pk)]})
    assert refused.status_code == 403 and Run.objects.get(pk=loop[0].pk).status != "cancelled"


def test_a_read_scoped_key_may_not_bulk_cancel(cast, client, runs):
    _, loop = runs
    key = create_key(cast["otto"], scope="read")[1]
    answer = client.post(
        "/api/runs/bulk", json.dumps({"action": "cancel", "reason": "x", "ids": [str(loop[0].pk)]}),
        content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {key}",
    )  # fmt: skip
    assert answer.status_code == 403
    assert Run.objects.get(pk=loop[0].pk).status == RunStatus.PENDING


# --- the command ---------------------------------------------------------------------------------


def test_the_command_halts_runs_by_id_prefix_and_prints_each(cast, runs):
    ledger, _ = runs
    out = command("halt", "--ids", str(ledger[0].pk)[:8], str(ledger[1].pk),
                  "--user", "otto", "--reason", "incident 42")  # fmt: skip
    assert f"run {ledger[0].pk}: done" in out and "halt: 2 of 2 runs" in out
    assert all(Run.objects.get(pk=r.pk).halted_by == "otto" for r in ledger)


def test_the_command_by_filter_wants_yes_above_ten_runs(cast):
    many = [start_run("loop", {"queries": []}, key=f"m-{i}") for i in range(11)]
    args = ["cancel", "--filter", "workflow=loop", "--filter", "status=pending"]
    args += ["--user", "otto", "--reason", "stale"]
    with pytest.raises(CommandError, match="11 runs match: run it again with --yes"):
        command(*args)
    assert not Run.objects.filter(status=RunStatus.CANCELLED).exists()
    assert "cancel: 11 of 11 runs" in command(*args, "--yes")
    assert Run.objects.filter(pk__in=[r.pk for r in many], status=RunStatus.CANCELLED).count() == 11


def test_the_command_exits_non_zero_naming_the_refused_runs(cast, runs):
    ledger, _ = runs
    out = StringIO()
    with pytest.raises(CommandError, match="1 of 1 runs refused"):
        call_command("bulk", "retry", "--ids", str(ledger[0].pk), "--user", "otto",
                     "--reason", "x", stdout=out)  # fmt: skip
    assert f"run {ledger[0].pk}: refused: " in out.getvalue()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--filter", "colour=red"], "no filter 'colour'"),
        (["--filter", "workflow"], "write NAME=VALUE"),
        (["--filter", "workflow=none"], "no runs are selected"),
    ],
)
def test_the_command_refuses_bad_input_by_name(cast, runs, args, says):
    with pytest.raises(CommandError, match=says):
        command("halt", *args, "--user", "otto", "--reason", "x")


def test_the_command_needs_the_permission(cast, runs):
    _, loop = runs
    with pytest.raises(CommandError, match=r"needs runs\.cancel_run"):
        command("cancel", "--ids", str(loop[0].pk), "--user", "vera", "--reason", "x")


# --- the page -----------------------------------------------------------------------------------


def test_the_page_the_api_and_the_command_refuse_a_run_with_the_same_reason(cast, api, runs):
    """One operation behind all three: a retry of a run that has not failed is refused with the
    same words on the runs list, in the API's answer and in the command's output."""
    ledger, _ = runs
    run_id = str(ledger[0].pk)
    said = api("otto", {"action": "retry", "reason": "x", "ids": [run_id]}).json()["runs"][0]
    browser = Client()
    browser.force_login(cast["otto"])
    page = browser.post("/runs/bulk", {"action": "retry", "scope": "selected", "reason": "x",
                                       "run": [run_id]}, follow=True).content.decode()  # fmt: skip
    assert "retry: 0 of 1 runs" in page
    assert f"1 refused: {run_id[:8]}: {said['message']}".replace("'", "&#x27;") in page
    out = StringIO()
    with pytest.raises(CommandError):
        call_command("bulk", "retry", "--ids", run_id, "--user", "otto", "--reason", "x",
                     stdout=out)  # fmt: skip
    assert f"run {run_id}: refused: {said['message']}" in out.getvalue()
