"""The REST API: every route, its permission and its errors (in-process, both engines)."""

import json
from decimal import Decimal

import pytest
from django.core.management import call_command
from django.test import Client

from runs.apikeys import create_key
from runs.approvals.models import ApprovalRequest
from runs.models import ApiKey, Event, Run, RunStatus
from runs.sdk import start_run

pytestmark = pytest.mark.django_db


class Api:
    def __init__(self, client: Client, key: str | None):
        self.client, self.key = client, key

    def __call__(self, method: str, path: str, body=None, **params):
        headers = {"HTTP_AUTHORIZATION": f"Bearer {self.key}"} if self.key else {}
        url = f"/api{path}"
        if method == "get":
            return self.client.get(url, params, **headers)
        data = json.dumps(body) if body is not None else ""
        return getattr(self.client, method)(url, data, content_type="application/json", **headers)


@pytest.fixture
def as_(cast, client):
    """as_("otto") calls the API with an API key of that user."""
    keys = {}

    def _as(name: str) -> Api:
        if name not in keys:
            keys[name] = create_key(cast[name])[1]
        return Api(client, keys[name])

    return _as


def error(response) -> dict:
    return response.json()["error"]


def test_no_route_but_health_is_reachable_anonymously(client):
    assert client.get("/api/health").json()["database"] == "ok"
    for path in ("/api/runs", "/api/approvals", "/api/workers", "/api/openapi.json", "/api/docs"):
        response = client.get(path)
        assert response.status_code == 401, path
        assert error(response)["code"] == "not_authenticated"


def test_a_bad_or_revoked_key_is_refused(as_, client):
    assert Api(client, "sg_nope_nope")("get", "/runs").status_code == 401
    otto = as_("otto")
    assert otto("get", "/runs").status_code == 200
    key = ApiKey.objects.get()
    assert key.last_used_at is not None
    call_command("apikey", "revoke", key.prefix)
    assert otto("get", "/runs").status_code == 401


def test_starting_a_run_is_idempotent_by_key(as_):
    otto = as_("otto")
    body = {"workflow": "ledger", "input": {"steps": 2}, "key": "order-9"}
    first = otto("post", "/runs", body)
    again = otto("post", "/runs", {**body, "input": {"steps": 5}})
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json()["id"] == again.json()["id"] and again.json()["input"] == {"steps": 2}
    assert first.json()["status"] == "pending"


@pytest.mark.parametrize(
    ("body", "status", "code", "text"),
    [
        ({"workflow": "ghost"}, 404, "unknown_workflow", "unknown workflow 'ghost'"),
        ({"workflow": ""}, 422, "validation_error", "body.workflow"),
        ({"workflow": "ledger", "surprise": 1}, 422, "validation_error", "surprise"),
        ({"workflow": "ledger", "budget_usd": "-1"}, 422, "validation_error", "budget_usd"),
        ({"workflow": "ledger", "budget_usd": 1.5}, 422, "validation_error", "budget_usd"),
        ({"workflow": "a\x00b"}, 422, "validation_error", "body.workflow"),
    ],
)
def test_bad_starts_get_a_clear_4xx(as_, body, status, code, text):
    response = as_("otto")("post", "/runs", body)
    assert response.status_code == status, response.content
    assert error(response)["code"] == code and text in error(response)["message"]
    assert not Run.objects.exists()


def test_an_unparsable_or_oversized_body_is_refused_before_parsing(as_, client, settings):
    otto = as_("otto")
    headers = {"HTTP_AUTHORIZATION": f"Bearer {otto.key}"}
    response = client.post("/api/runs", "{not json", content_type="application/json", **headers)
    assert 400 <= response.status_code < 500
    huge = json.dumps({"workflow": "ledger", "input": "x" * (settings.STEPGUARD_API_MAX_BODY)})
    response = client.post("/api/runs", huge, content_type="application/json", **headers)
    assert response.status_code == 413 and error(response)["code"] == "payload_too_large"


@pytest.fixture
def batch() -> None:
    """Five runs of "ledger" keyed batch-0 to batch-4 (in that order) and one of "loop"."""
    for i in range(5):
        start_run("ledger", {"steps": 1}, key=f"batch-{i}")
    start_run("loop", {"queries": []})


def test_listing_runs_pages_newest_first_through_the_cursor(as_, batch):
    vera = as_("vera")
    page = vera("get", "/runs", workflow="ledger", limit=2).json()
    assert [r["key"] for r in page["items"]] == ["batch-4", "batch-3"]
    seen = [r["key"] for r in page["items"]]
    while page["next_cursor"]:
        page = vera("get", "/runs", workflow="ledger", limit=2, cursor=page["next_cursor"]).json()
        seen += [r["key"] for r in page["items"]]
    assert seen == [f"batch-{i}" for i in range(4, -1, -1)]


def test_listing_runs_filters_by_search_text_and_status(as_, batch):
    vera = as_("vera")
    assert [r["key"] for r in vera("get", "/runs", q="batch-2").json()["items"]] == ["batch-2"]
    assert vera("get", "/runs", status="completed").json()["items"] == []


def test_a_forged_cursor_is_a_400_that_names_it(as_, batch):
    bad = as_("vera")("get", "/runs", cursor="garbage")
    assert bad.status_code == 400 and "cursor" in error(bad)["message"]


def test_a_run_its_steps_and_its_events_after_a_seq(as_, drive):
    run = start_run("ledger", {"steps": 2})
    drive()
    vera = as_("vera")
    assert vera("get", f"/runs/{run.pk}").json()["status"] == "completed"
    steps = vera("get", f"/runs/{run.pk}/steps").json()
    assert [(s["key"], s["status"]) for s in steps] == [("s0", "completed"), ("s1", "completed")]
    events = vera("get", f"/runs/{run.pk}/events", after=3).json()
    assert [e["seq"] for e in events] == list(range(4, 4 + len(events)))


def test_an_unknown_run_is_a_404_and_a_malformed_id_a_422(as_):
    vera = as_("vera")
    assert vera("get", "/runs/00000000-0000-0000-0000-000000000000").status_code == 404
    assert vera("get", "/runs/not-a-uuid").status_code == 422


def test_halt_by_api_key_but_unhalt_only_from_a_persons_session(as_, cast, client):
    run = start_run("ledger", {"steps": 1})
    otto = as_("otto")
    assert (
        otto("post", f"/runs/{run.pk}/halt", {"reason": "check"}).json()["halted"]["by"] == "otto"
    )
    refused = otto("post", f"/runs/{run.pk}/unhalt", {"reason": "ok"})
    assert refused.status_code == 403 and "browser session" in error(refused)["message"]
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(cast["otto"])
    no_csrf = browser.post(f"/api/runs/{run.pk}/unhalt", {"reason": "ok"}, "application/json")
    assert no_csrf.status_code == 403
    browser.get("/admin/login/")  # sets the CSRF cookie
    token = browser.cookies["csrftoken"].value
    done = browser.post(
        f"/api/runs/{run.pk}/unhalt", {"reason": "ok"}, "application/json", HTTP_X_CSRFTOKEN=token
    )
    assert done.status_code == 200 and done.json()["halted"] is None


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("post", "/runs", {"workflow": "ledger"}),
        ("post", "/runs/{run}/halt", {"reason": "x"}),
        ("post", "/runs/{run}/cancel", {"reason": "x"}),
        ("post", "/runs/{run}/retry", {"reason": "x"}),
        ("post", "/runs/{run}/fork", {"step": "s0", "reason": "x"}),
        ("post", "/runs/{run}/signals", {"name": "go"}),
        ("put", "/runs/{run}/budget", {"usd": "1", "reason": "x"}),
        ("put", "/workflows/ledger/budget", {"usd": "1", "reason": "x"}),
        ("post", "/workflows/ledger/halt", {"reason": "x"}),
        ("put", "/global/budget", {"usd": "1", "reason": "x"}),
        ("post", "/global/halt", {"reason": "x"}),
        ("post", "/approvals/{approval}/decide", {"decision": "approve"}),
    ],
)
def test_a_viewer_can_read_but_every_action_is_refused(as_, drive, method, path, body):
    run = start_run("approver", {"amount": 1})
    drive()
    approval = ApprovalRequest.objects.get()
    vera = as_("vera")
    assert vera("get", f"/runs/{run.pk}").status_code == 200
    response = vera(method, path.format(run=run.pk, approval=approval.pk), body)
    assert response.status_code == 403, response.content
    assert "vera may not" in error(response)["message"]


@pytest.fixture
def pending_approval(drive) -> ApprovalRequest:
    """A run of "approver" waiting for someone to approve charging 40."""
    run = start_run("approver", {"amount": 40})
    drive()
    return ApprovalRequest.objects.get(run=run)


def test_the_approvals_inbox_lists_pending_requests_with_their_payload(as_, pending_approval):
    inbox = as_("vera")("get", "/approvals").json()
    assert [(a["id"], a["action"], a["status"], a["payload"]) for a in inbox] == [
        (pending_approval.pk, "charge card", "pending", {"amount": 40})
    ]


def test_an_approval_decided_by_api_names_the_approver_and_resumes_the_run(
    as_, drive, pending_approval
):
    decided = as_("ada")(
        "post", f"/approvals/{pending_approval.pk}/decide", {"decision": "approve", "comment": "ok"}
    )
    assert decided.status_code == 200 and decided.json()["decided_by"] == "ada"
    drive()
    assert Run.objects.get(pk=pending_approval.run_id).status == RunStatus.COMPLETED


def test_a_second_decision_is_a_conflict_that_names_the_first(as_, pending_approval):
    ada = as_("ada")
    ada("post", f"/approvals/{pending_approval.pk}/decide", {"decision": "approve"})
    again = ada("post", f"/approvals/{pending_approval.pk}/decide", {"decision": "reject"})
    assert again.status_code == 409 and "already approved by ada" in error(again)["message"]


def test_an_unknown_approval_is_a_404(as_):
    assert as_("vera")("get", "/approvals/999999").status_code == 404


def test_a_signal_sent_by_api_wakes_the_run_waiting_for_it(as_, drive):
    waiting = start_run("waiter", {})
    drive()
    sent = as_("otto")("post", f"/runs/{waiting.pk}/signals", {"name": "go", "payload": [1, 2]})
    assert sent.status_code == 201
    drive()
    assert Run.objects.get(pk=waiting.pk).output == [1, 2]


def test_raising_the_budget_of_a_paused_run_by_api_resumes_it(as_, drive):
    paused = start_run("metered", {"steps": 2}, budget_usd=Decimal("1"))
    drive()
    raised = as_("otto")("put", f"/runs/{paused.pk}/budget", {"usd": "5", "reason": "worth it"})
    assert raised.json()["budget"]["usd"] == "5.000000" and raised.json()["status"] == "pending"


def test_a_workflows_daily_and_default_run_budgets_are_set_by_api(as_):
    body = {"usd": "10", "run_usd": "2", "reason": "c"}
    policy = as_("otto")("put", "/workflows/metered/budget", body)
    assert (policy.json()["daily_usd"], policy.json()["run_usd"]) == ("10.000000", "2.000000")


def test_the_kill_switch_by_api_key_is_on_once_and_lifted_only_from_a_session(as_):
    otto = as_("otto")
    assert otto("post", "/global/halt", {"reason": "drill"}).json()["halted"]["by"] == "otto"
    assert [p["scope"] for p in otto("get", "/halts").json()] == ["*"]
    halt_again = otto("post", "/global/halt", {"reason": "drill"})
    assert halt_again.status_code == 409
    assert otto("post", "/global/unhalt", {"reason": "over"}).status_code == 403  # API key


@pytest.fixture
def completed_ledger(drive) -> Run:
    """A completed run of "ledger" with steps s0, s1 and s2."""
    run = start_run("ledger", {"steps": 3})
    drive()
    return run


def test_a_fork_preview_by_api_lists_the_steps_that_will_run_again(as_, completed_ledger):
    preview = as_("otto")("get", f"/runs/{completed_ledger.pk}/fork-preview", step="s1").json()
    assert [p["key"] for p in preview] == ["s1", "s2"]


def test_a_fork_by_api_names_the_run_it_came_from(as_, completed_ledger):
    body = {"step": "s1", "reason": "again"}
    fork = as_("otto")("post", f"/runs/{completed_ledger.pk}/fork", body)
    assert fork.status_code == 201 and fork.json()["forked_from_id"] == str(completed_ledger.pk)


def test_retrying_a_run_that_did_not_fail_is_a_conflict(as_, completed_ledger):
    retry = as_("otto")("post", f"/runs/{completed_ledger.pk}/retry", {"reason": "x"})
    assert retry.status_code == 409 and "only failed runs" in error(retry)["message"]


def test_the_workers_route_lists_each_worker_with_its_heartbeat(as_, drive):
    workers = as_("otto")("get", "/workers").json()
    assert workers and set(workers[0]) >= {"host", "pid", "heartbeat_at", "runs"}


def test_the_openapi_schema_documents_the_routes_with_examples(as_):
    schema = as_("vera")("get", "/openapi.json").json()
    assert {"/api/runs", "/api/approvals/{approval_id}/decide", "/api/global/halt"} <= set(
        schema["paths"]
    )
    start = schema["components"]["schemas"]["StartIn"]["properties"]
    assert start["workflow"]["examples"] == ["flight-booking"]


def test_the_apikey_command_prints_a_new_key_once_and_lists_keys_with_their_owner(cast, capsys):
    call_command("apikey", "create", "--user", "otto", "--name", "ci")
    text = capsys.readouterr().out.strip()
    assert text.startswith("sg_") and ApiKey.objects.get().digest not in text
    call_command("apikey", "list")
    assert "otto" in capsys.readouterr().out
    assert not Event.objects.filter(run__isnull=False)  # creating keys touches no run history


def test_an_ambiguous_step_is_resolved_by_api_not_decided(as_, drive, expire_lease):
    from tests import workflows

    asking = start_run("asker")
    workflows.crash_at.add("book")
    with pytest.raises(workflows.Crash):
        drive()
    expire_lease(asking.id)
    drive()
    ada = as_("ada")
    ambiguous = ApprovalRequest.objects.get(run=asking)
    wrong = ada("post", f"/approvals/{ambiguous.pk}/decide", {"decision": "approve"})
    assert wrong.status_code == 400 and "use resolve" in error(wrong)["message"]
    resolved = ada(
        "post", f"/approvals/{ambiguous.pk}/resolve", {"choice": "happened", "output": {"ok": 1}}
    )
    assert resolved.json()["resolution"] == "happened"


def test_an_approval_is_revoked_by_api_during_its_cooling_off(as_, drive):
    charging = start_run("approver", {"amount": 3, "cooling_off": 60})
    drive()
    ada = as_("ada")
    action = ApprovalRequest.objects.get(run=charging)
    ada("post", f"/approvals/{action.pk}/decide", {"decision": "approve"})
    revoked = ada("post", f"/approvals/{action.pk}/revoke", {"reason": "changed my mind"})
    assert revoked.json()["status"] == "revoked"
    assert ada("get", f"/approvals/{action.pk}").json()["status"] == "revoked"


def test_policies_are_read_back_by_api(as_):
    otto = as_("otto")
    otto("put", "/global/budget", {"tokens": 1000, "reason": "cap"})
    assert otto("get", "/global/policy").json()["daily_tokens"] == 1000
    assert otto("get", "/workflows/nothing-here/policy").json()["halted"] is None


def test_api_keys_are_created_in_the_admin_and_shown_once(client, django_user_model):
    admin = django_user_model.objects.create_superuser("root", "r@example.com", "pw")
    client.force_login(admin)
    response = client.post(
        "/admin/runs/apikey/add/", {"user": admin.pk, "name": "deploy"}, follow=True
    )
    # Shown once, on the page itself: never in a message (the messages cookie would carry it).
    key = response.context["text"]
    assert key.startswith("sg_") and key in response.content.decode()
    assert "no-store" in response["Cache-Control"]
    assert not [m for m in response.context["messages"] if key in str(m)]
    assert key not in str(response.cookies)
    assert Api(Client(), key)("get", "/runs").status_code == 200  # no session: the key alone
    assert ApiKey.objects.get().name == "deploy"
