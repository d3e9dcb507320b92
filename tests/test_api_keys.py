"""API keys: scopes on every route, expiry, and an audit event for each key made or revoked
(issue 31 item 9). In-process, both engines."""

import re
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client
from django.utils import timezone

from runs.apikeys import create_key
from runs.approvals.models import ApprovalRequest
from runs.errors import OperationError
from runs.models import ApiKey, Event
from runs.sdk import start_run

pytestmark = pytest.mark.django_db


@pytest.fixture
def root(django_user_model):
    return django_user_model.objects.create_superuser("root", "root@example.com", "pw")


def bearer(text: str) -> dict:
    return {"HTTP_AUTHORIZATION": f"Bearer {text}"}


def every_operation(client: Client, key: str) -> list[tuple[str, str]]:
    """(METHOD, path template) of every route of the schema, /api/health included."""
    schema = client.get("/api/openapi.json", **bearer(key)).json()
    return sorted((method.upper(), path) for path, ops in schema["paths"].items() for method in ops)


#: What each scope may call; anything else is a 403 naming the scope, before the route runs.
START = {("POST", "/api/runs"), ("POST", "/api/runs/{run_id}/signals")}


def allowed(scope: str, method: str, path: str) -> bool:
    if path == "/api/health":
        return True  # anonymous anyway
    return {"full": True, "read": method == "GET", "start": (method, path) in START}[scope]


def test_every_route_answers_each_scope_as_the_table_says(root, client, drive):
    """Before: a key was its user, whole; there was no read-only or start-only key."""
    run = start_run("approver", {"amount": 1})
    drive()
    approval = ApprovalRequest.objects.get(run=run)
    keys = {scope: create_key(root, scope, scope=scope)[1] for scope in ("full", "read", "start")}
    operations = every_operation(client, keys["read"])
    assert len(operations) > 40 and set(operations) > START
    values = {
        "run_id": run.pk, "approval_id": approval.pk, "name": "approver", "channel_id": 1,
        "resource": "gpt-x", "label": "tenant=acme",
    }  # fmt: skip
    refused, passed = [], []
    for scope, key in keys.items():
        for method, template in operations:
            path = re.sub(r"\{(?:path:)?(\w+)\}", lambda m: str(values[m[1]]), template)
            body = "" if method == "GET" else "{}"
            response = client.generic(method, path, body, "application/json", **bearer(key))
            assert response.status_code != 500, (scope, method, path)
            scoped = response.status_code == 403 and "is scoped" in response.content.decode()
            assert scoped != allowed(scope, method, template), (scope, method, path, response)
            (passed if not scoped else refused).append((scope, method, template))
            if scoped:
                message = response.json()["error"]["message"]
                assert message.startswith(f"API key sg_{key.split('_')[1]} is scoped {scope}")
                assert f"not {method} {path}" in message
    gets = sum(1 for method, _ in operations if method == "GET")
    assert len(refused) == (len(operations) - gets) + (len(operations) - len(START) - 1)
    run.refresh_from_db()
    assert run.halted_at is None and not ApprovalRequest.objects.exclude(status="pending")


def test_a_start_key_starts_runs_and_signals_and_reads_nothing(root, client, drive):
    _, text = create_key(root, "ci", scope="start")
    started = client.post(
        "/api/runs", {"workflow": "ledger", "input": {"steps": 1}}, "application/json",
        **bearer(text),
    )  # fmt: skip
    assert started.status_code == 201
    run_id = started.json()["id"]
    signal = client.post(
        f"/api/runs/{run_id}/signals", {"name": "go"}, "application/json", **bearer(text)
    )
    assert signal.status_code == 201
    assert client.get(f"/api/runs/{run_id}", **bearer(text)).status_code == 403
    assert client.get("/metrics", **bearer(text)).status_code == 403
    _, reader = create_key(root, "grafana", scope="read")
    assert client.get("/metrics", **bearer(reader)).status_code == 200


def test_an_expired_key_is_refused_with_a_401_that_says_so(root, client):
    key, text = create_key(root, "old", expires_at=timezone.now() + timedelta(hours=1))
    assert client.get("/api/runs", **bearer(text)).status_code == 200
    ApiKey.objects.filter(pk=key.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    refused = client.get("/api/runs", **bearer(text))
    assert refused.status_code == 401
    error = refused.json()["error"]
    assert error["code"] == "api_key_expired"
    assert error["message"].startswith(f"API key sg_{key.prefix} expired at 20")
    assert client.get("/metrics", **bearer(text)).status_code == 401
    assert client.get("/api/openapi.json", **bearer(text)).status_code == 401


def test_a_key_cannot_be_made_already_expired_or_with_an_unknown_scope(root):
    with pytest.raises(OperationError, match="already passed"):
        create_key(root, expires_at=timezone.now() - timedelta(days=1))
    with pytest.raises(OperationError, match="unknown API key scope 'admin'"):
        create_key(root, scope="admin")
    with pytest.raises(CommandError, match="not an ISO date"):
        call_command("apikey", "create", "--user", "root", "--expires", "next week")
    assert not ApiKey.objects.exists()


def test_creating_and_revoking_a_key_by_cli_is_audited_with_its_scope_and_expiry(root, capsys):
    """Before: creating a key left no trace (a finding of the review)."""
    call_command(
        "apikey", "create", "--user", "root", "--name", "ci", "--scope", "read",
        "--expires", "2099-01-31",
    )  # fmt: skip
    key = ApiKey.objects.get()
    assert (key.scope, key.expires_at.isoformat()) == ("read", "2099-01-31T00:00:00+00:00")
    capsys.readouterr()
    call_command("apikey", "list")
    assert f"sg_{key.prefix}  root  read  active  expires 2099-01-31" in capsys.readouterr().out
    call_command("apikey", "revoke", key.prefix)
    described = {
        "target": f"API key sg_{key.prefix} of root", "prefix": key.prefix, "key_name": "ci",
        "owner": "root", "scope": "read", "expires_at": "2099-01-31T00:00:00+00:00",
    }  # fmt: skip
    events = Event.objects.filter(type__startswith="apikey.").order_by("id")
    assert [(e.type, e.actor, e.payload) for e in events] == [
        ("apikey.created", "cli", described),
        ("apikey.revoked", "cli", described),
    ]
    assert "apikey.created" not in str(Event.objects.filter(run__isnull=False).values("type"))


def test_the_keys_page_creates_scoped_expiring_keys_audited_and_lists_them(root):
    browser = Client()
    browser.force_login(root)
    past = browser.post(
        "/admin/runs/apikey/add/",
        {"user": root.pk, "name": "x", "scope": "read", "expires_at_0": "2001-01-01",
         "expires_at_1": "00:00:00"},
    )  # fmt: skip
    assert past.status_code == 200 and "The expiry is in the past" in past.content.decode()
    made = browser.post(
        "/admin/runs/apikey/add/",
        {"user": root.pk, "name": "deploy", "scope": "start", "expires_at_0": "2099-06-30",
         "expires_at_1": "12:00:00"},
    )  # fmt: skip
    key = made.context["key"]
    assert (key.scope, key.expires_at.date().isoformat()) == ("start", "2099-06-30")
    page = made.content.decode()
    assert "start runs and send signals" in page and "expiring 2099-06-30" in page
    listing = browser.get("/admin/runs/apikey/").content.decode()
    assert key.prefix in listing and "start runs and send signals" in listing
    assert "June 30, 2099" in listing
    event = Event.objects.get(type="apikey.created")
    assert event.actor == "root" and event.payload["scope"] == "start"
    assert event.payload["expires_at"].startswith("2099-06-30")
    assert f"API key sg_{key.prefix} of root" in browser.get("/audit").content.decode()


def test_a_start_key_repeating_a_start_learns_the_id_and_status_not_the_run(root, client):
    """Guessing an idempotency key was a way to read any run whole (its input: a card number)
    with a key docs/deploy.md says only starts runs and sends signals."""
    secret = start_run("ledger", {"steps": 1, "card": "4111-1111"}, key="secret-job-42")
    _, text = create_key(root, "ci", scope="start")
    body = {"workflow": "ledger", "key": "secret-job-42", "input": {"steps": 1}}
    again = client.post("/api/runs", body, "application/json", **bearer(text))
    assert again.status_code == 200
    assert again.json() == {"id": str(secret.pk), "workflow": "ledger", "status": "pending"}
    fresh = client.post(
        "/api/runs", {"workflow": "ledger", "input": {"steps": 1}}, "application/json",
        **bearer(text),
    )  # fmt: skip
    assert fresh.status_code == 201 and set(fresh.json()) == {"id", "workflow", "status"}
    _, full = create_key(root, "ops", scope="full")
    whole = client.post("/api/runs", body, "application/json", **bearer(full))
    assert whole.json()["input"] == {"steps": 1, "card": "4111-1111"}  # a full key reads
