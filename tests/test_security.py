"""The attacks of the security review, kept as regression tests (in-process, both engines).

Each test failed on the server before its fix. The real-browser XSS sweep is
`tests/test_browser.py::test_no_attacker_controlled_field_runs_a_script`.
"""

import asyncio
import base64
import json
import logging
import re
import socket
import time
import uuid
from decimal import Decimal
from urllib.parse import urlsplit

import pytest
from channels.generic.websocket import AsyncWebsocketConsumer
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import Group
from django.test import Client, override_settings

from controlplane.wsorigin import SameOrigin
from runs import consumers
from runs.apikeys import create_key
from runs.approvals.models import ApprovalRequest
from runs.engine.budget import to_micros
from runs.models import ApiKey, Event, Policy, Run, Step
from runs.sdk import start_run
from runs.security import LOGIN_AT, SEEN_AT
from tests.conftest import run_coroutine
from tests.test_api import Api, error
from tests.test_live import communicator, run_async

pytestmark = pytest.mark.django_db


@pytest.fixture
def root(django_user_model):
    return django_user_model.objects.create_superuser("root", "root@example.com", "pw")


def api(user) -> Api:
    return Api(Client(), create_key(user)[1])


# -- 1. bounded responses --------------------------------------------------------------------------


def big_run(steps: int, size: int) -> Run:
    run = start_run("ledger", {"steps": 0})
    Step.objects.bulk_create(
        Step(run=run, seq=i, key=f"s{i}", status="completed", idempotency_key=f"{run.pk}:s{i}",
             input={"i": i}, output="x" * size, started_at=run.created_at,
             finished_at=run.created_at)
        for i in range(steps)
    )  # fmt: skip
    return run


def test_the_step_list_is_paged_and_a_page_never_passes_the_byte_cap(root, settings):
    """Before: one request returned every step, 100 MB for a 500-step run."""
    settings.STEPGUARD_API_MAX_RESPONSE = 1_000_000
    run = big_run(steps=30, size=200_000)
    client, seen, after, pages = api(root), [], -1, 0
    while True:
        response = client("get", f"/runs/{run.pk}/steps", after=after)
        assert response.status_code == 200
        page = response.json()
        if not page:
            break
        pages += 1
        assert len(response.content) < 1_000_000 + 250_000  # the cap, plus the step that passed it
        seen += [s["seq"] for s in page]
        after = page[-1]["seq"]
    assert seen == list(range(30)) and pages >= 6
    assert len(client("get", f"/runs/{run.pk}/steps", limit=3).json()) == 3


def test_the_dashboard_cuts_a_big_value_and_links_to_the_whole_of_it(root):
    run = big_run(steps=1, size=300_000)
    browser = Client()
    browser.force_login(root)
    body = browser.get(f"/runs/{run.pk}/steps/0")
    assert body.status_code == 200 and len(body.content) < 80_000
    assert "Download the whole output" in body.content.decode()
    whole = browser.get(f"/runs/{run.pk}/steps/0/output.json")
    assert json.loads(whole.content) == "x" * 300_000
    assert whole["Content-Disposition"].startswith("attachment")
    assert browser.get(f"/runs/{run.pk}/steps/0/secret.json").status_code == 404
    assert Client().get(f"/runs/{run.pk}/steps/0/output.json").status_code == 302  # login first


def test_the_approvals_inbox_cuts_payloads_and_pages(root):
    run = start_run("ledger", {"steps": 0})
    ApprovalRequest.objects.bulk_create(
        ApprovalRequest(run=run, step_key=f"a{i}", action="pay", summary=f"#{i}",
                        payload={"blob": "y" * (500_000 if i < 3 else 10)})
        for i in range(60)
    )  # fmt: skip
    browser = Client()
    browser.force_login(root)
    page = browser.get("/approvals")
    assert page.status_code == 200
    assert len(page.content) < 500_000, "before: 20 requests of 1 MB made 45 MB of HTML"
    text = page.content.decode()
    assert text.count("Download the whole payload") == 3
    assert "Next 50 of 60 pending" in text
    first = ApprovalRequest.objects.order_by("pk").first()
    whole = browser.get(f"/approvals/{first.pk}/payload.json")
    assert json.loads(whole.content) == {"blob": "y" * 500_000}
    second = browser.get("/approvals", {"after": page.context["next_after"]})
    assert second.context["pending"][0].summary == "#50" and len(second.context["pending"]) == 10


# -- 2. the body limit applies while the body streams --------------------------------------------


def raw_request(server: str, head: str, body_chunks=(), limit_seconds: float = 10) -> bytes:
    """Send a request over a plain socket, chunk by chunk; return whatever the server answered."""
    host, port = urlsplit(server).hostname, urlsplit(server).port
    with socket.create_connection((host, port), timeout=limit_seconds) as sock:
        sock.sendall(head.encode())
        try:
            for chunk in body_chunks:
                sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed: what we want
        answer = b""
        try:
            while data := sock.recv(65536):
                answer += data
        except (ConnectionResetError, TimeoutError):
            pass
        return answer


@pytest.mark.django_db(transaction=True)
def test_an_oversized_body_is_refused_before_it_is_received(server):
    """Before: a 300 MB POST to /login/ was spooled to disk before the 413."""
    declared = raw_request(
        server,
        "POST /login/ HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        "Content-Type: application/x-www-form-urlencoded\r\n"
        "Content-Length: 300000000\r\nConnection: close\r\n\r\n",
    )
    assert declared.startswith(b"HTTP/1.1 413"), declared[:200]

    # No length: counted as it arrives. 2 MiB sent of an endless body, and the answer is there.
    chunk = b"a" * 65536
    streamed = raw_request(
        server,
        "POST /api/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n",
        (f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n" for _ in range(32)),
    )
    assert streamed.startswith(b"HTTP/1.1 413"), streamed[:200]
    assert b'"payload_too_large"' in streamed


# -- 3. the live feed ends with the session --------------------------------------------------------


async def closed_within(comm, seconds: float) -> int | None:
    """The close code the consumer sends within `seconds` (ignoring data frames), or None."""
    deadline = asyncio.get_running_loop().time() + seconds
    while (left := deadline - asyncio.get_running_loop().time()) > 0:
        try:
            message = await comm.receive_output(timeout=left)
        except TimeoutError:
            return None
        if message["type"] == "websocket.close":
            return message.get("code")
    return None


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("how", ["logout", "deactivated", "permission lost"])
def test_an_open_feed_closes_within_seconds_when_the_session_no_longer_stands(
    how, cast, monkeypatch
):
    monkeypatch.setattr(consumers, "RECHECK_SECONDS", 0.2)
    run = start_run("ledger", {"steps": 1})
    vera = cast["vera"]

    def revoke(comm):
        if how == "logout":
            comm.scope["session"].delete()
        elif how == "deactivated":
            type(vera).objects.filter(pk=vera.pk).update(is_active=False)
        else:
            vera.groups.remove(Group.objects.get(name="viewer"))

    async def go():
        comm = communicator(run, vera, after=0)
        connected, _ = await comm.connect(timeout=10)
        assert connected
        assert "live" in await comm.receive_from(timeout=5)  # open while allowed
        from channels.db import database_sync_to_async

        await database_sync_to_async(revoke)(comm)
        return await closed_within(comm, 5)

    assert run_async(go) == 4401


@pytest.mark.django_db(transaction=True)
def test_open_feeds_per_user_are_capped(cast, settings):
    settings.STEPGUARD_LIVE_MAX_SOCKETS = 2
    run = start_run("ledger", {"steps": 1})

    async def go():
        comms = [communicator(run, cast["vera"], after=0) for _ in range(3)]
        results = [(await c.connect(timeout=10))[0] for c in comms]
        await comms[0].disconnect()
        again = communicator(run, cast["vera"], after=0)
        results.append((await again.connect(timeout=10))[0])
        for c in (comms[1], again):
            await c.disconnect()
        return results

    assert run_async(go) == [True, True, False, True]


@pytest.mark.django_db(transaction=True)
def test_a_feed_with_non_ascii_digits_in_rows_connects(cast):
    """Before: `rows=²` passed str.isdigit and broke int(): a server error."""
    run = start_run("ledger", {"steps": 1})

    async def go():
        comm = communicator(run, cast["vera"], after=0, query="&rows=%C2%B2,1")
        connected, _ = await comm.connect(timeout=10)
        await comm.disconnect()
        return connected

    assert run_async(go) is True


class Accept(AsyncWebsocketConsumer):
    async def connect(self):
        await self.accept()


@pytest.mark.parametrize(
    ("origin", "allowed"),
    [
        ("http://127.0.0.1:8000", True),
        ("http://127.0.0.1:9999", False),  # another port of the same host: accepted before
        ("https://127.0.0.1", False),  # the other scheme: accepted before
        ("https://127.0.0.1:8000", False),
        ("http://evil.example", False),
        ("null", False),
        ("https://ops.example.com", True),  # in CSRF_TRUSTED_ORIGINS
    ],
)
def test_a_websocket_origin_must_match_scheme_host_and_port(origin, allowed, settings):
    settings.CSRF_TRUSTED_ORIGINS = ["https://ops.example.com"]

    async def go():
        comm = WebsocketCommunicator(
            SameOrigin(Accept.as_asgi()),
            "/ws/",
            headers=[(b"host", b"127.0.0.1:8000"), (b"origin", origin.encode())],
        )
        connected, _ = await comm.connect(timeout=10)
        if connected:
            await comm.disconnect()
        return connected

    assert run_coroutine(go()) is allowed


# -- 4. four eyes on approvals -------------------------------------------------------------------


def test_who_starts_a_run_is_recorded_and_may_not_approve_it(root, cast, drive):
    starter = api(root)
    response = starter("post", "/runs", {"workflow": "approver", "input": {"amount": 40},
                                         "budget_usd": "5"})  # fmt: skip
    assert response.status_code == 201
    run = Run.objects.get(pk=response.json()["id"])
    created = Event.objects.get(run=run, type="run.created")
    key = ApiKey.objects.get(user=root)
    assert created.actor == "root"
    assert created.payload["api_key"] == key.prefix
    assert created.payload["budget"] == {"usd": "5.000000", "tokens": None, "given": True}
    assert run.started_by == root

    drive()
    approval = ApprovalRequest.objects.get(run=run)
    refused = starter("post", f"/approvals/{approval.pk}/decide", {"decision": "approve"})
    assert refused.status_code == 403
    assert "another person must" in error(refused)["message"]
    approval.refresh_from_db()
    assert approval.status == "pending"
    assert api(cast["ada"])("post", f"/approvals/{approval.pk}/decide",
                            {"decision": "approve"}).status_code == 200  # fmt: skip


def test_four_eyes_covers_the_children_and_can_be_turned_off(root, settings, drive):
    parent = start_run("ledger", {"steps": 0}, started_by=root)
    child = start_run("approver", {"amount": 1})
    Run.objects.filter(pk=child.pk).update(parent=parent)
    drive()
    approval = ApprovalRequest.objects.get(run=child)
    path = f"/approvals/{approval.pk}/decide"
    assert api(root)("post", path, {"decision": "approve"}).status_code == 403
    settings.STEPGUARD_FOUR_EYES = False
    assert api(root)("post", path, {"decision": "approve"}).status_code == 200


def test_api_keys_may_be_barred_from_deciding(cast, settings, drive):
    settings.STEPGUARD_API_KEYS_DECIDE = False
    start_run("approver", {"amount": 1})
    drive()
    approval = ApprovalRequest.objects.get()
    refused = api(cast["ada"])("post", f"/approvals/{approval.pk}/decide", {"decision": "approve"})
    assert refused.status_code == 403 and "STEPGUARD_API_KEYS_DECIDE" in error(refused)["message"]
    browser = Client()
    browser.force_login(cast["ada"])
    assert browser.post(
        f"/approvals/{approval.pk}/decide", {"decision": "approve"}
    ).status_code in (
        200,
        302,
    )
    approval.refresh_from_db()
    assert approval.status == "approved"


# -- 5. API keys are minted for oneself ----------------------------------------------------------


def test_only_a_superuser_mints_api_keys_for_someone_else(root, django_user_model):
    from django.contrib.auth.models import Permission

    clerk = django_user_model.objects.create_user("clerk", password="x", is_staff=True)
    clerk.user_permissions.add(Permission.objects.get(codename="add_apikey"))
    browser = Client()
    browser.force_login(clerk)
    for_root = browser.post("/admin/runs/apikey/add/", {"user": root.pk, "name": "mine now"})
    assert for_root.status_code == 200  # the form again, with the error
    assert not ApiKey.objects.filter(user=root).exists()
    own = browser.post("/admin/runs/apikey/add/", {"user": clerk.pk, "name": "mine"})
    assert own.status_code == 200 and own.context["key"].user == clerk


def test_revoking_another_person_s_api_key_takes_its_own_permission_and_is_audited(
    root, django_user_model
):
    """A staff user with only add and view permissions on keys saw every key and revoked the
    superuser's, unaudited (issue 31, item 7)."""
    from django.contrib.auth.models import Permission
    from django.core.management import call_command
    from django.core.management.base import CommandError

    from runs.apikeys import revoke_key
    from runs.errors import Forbidden

    def staff(name: str, *codenames: str):
        person = django_user_model.objects.create_user(name, password="x", is_staff=True)
        person.user_permissions.add(*Permission.objects.filter(codename__in=codenames))
        browser = Client()
        browser.force_login(person)
        return person, browser

    clerk, as_clerk = staff("clerk", "add_apikey", "view_apikey", "delete_apikey")
    roots, root_text = create_key(root, "deploy")
    clerks, _ = create_key(clerk, "laptop")

    listed = as_clerk.get("/admin/runs/apikey/").content.decode()
    assert clerks.prefix in listed and roots.prefix not in listed
    assert as_clerk.get(f"/admin/runs/apikey/{roots.pk}/change/").status_code == 302  # absent
    revoke = {"action": "revoke", "_selected_action": [roots.pk, clerks.pk], "index": 0}
    as_clerk.post("/admin/runs/apikey/", revoke)
    roots.refresh_from_db()
    clerks.refresh_from_db()
    assert roots.revoked_at is None and clerks.revoked_at is not None  # their own only
    deleting = as_clerk.post(f"/admin/runs/apikey/{roots.pk}/delete/", {"post": "yes"})
    assert deleting.status_code == 403 and ApiKey.objects.filter(pk=roots.pk).exists()
    refusal = "clerk may not revoke another person's API key (needs runs.revoke_others_apikey)"
    with pytest.raises(Forbidden, match=re.escape(refusal)):
        revoke_key(roots.prefix, clerk)
    assert Api(Client(), root_text)("get", "/runs").status_code == 200

    _, as_keeper = staff("keeper", "view_apikey", "revoke_others_apikey")
    listed = as_keeper.get("/admin/runs/apikey/").content.decode()
    assert clerks.prefix in listed and roots.prefix in listed
    as_keeper.post("/admin/runs/apikey/", {**revoke, "_selected_action": [roots.pk]})
    assert Api(Client(), root_text)("get", "/runs").status_code == 401

    # The CLI: as a named person, checked the same way; without one, the shell's authority.
    spare, _ = create_key(root, "spare")
    with pytest.raises(CommandError, match=re.escape(refusal)):
        call_command("apikey", "revoke", spare.prefix, "--user", "clerk")
    call_command("apikey", "revoke", spare.prefix)

    audit = Event.objects.filter(type="apikey.revoked").order_by("id")
    assert [(e.actor, e.payload["prefix"], e.payload["owner"]) for e in audit] == [
        ("clerk", clerks.prefix, "clerk"),
        ("keeper", roots.prefix, "root"),
        ("cli", spare.prefix, "root"),
    ]
    assert audit[1].payload == {
        "target": f"API key sg_{roots.prefix} of root", "prefix": roots.prefix,
        "key_name": "deploy", "owner": "root", "scope": "full", "expires_at": None,
    }  # fmt: skip
    page = Client()
    page.force_login(root)
    assert f"API key sg_{roots.prefix} of root" in page.get("/audit").content.decode()


# -- 7. bad input is a 4xx in the documented shape, never a 500 -----------------------------------


YEAR_1 = "0001-01-01T00:00:00+14:00"


@pytest.mark.parametrize(
    "params",
    [
        {"created_after": YEAR_1},
        {"created_before": YEAR_1},
        {"cursor": base64.urlsafe_b64encode(f"{YEAR_1}|{uuid.UUID(int=0)}".encode()).decode()},
    ],
)
def test_dates_out_of_range_are_named_not_a_server_error(root, params):
    response = api(root)("get", "/runs", **params)
    assert response.status_code in (400, 422)
    assert error(response)["code"] in ("operation_error", "validation_error")


def test_the_dashboard_names_a_date_out_of_range(root):
    browser = Client()
    browser.force_login(root)
    page = browser.get("/", {"since": "0001-01-01T00:00:00+14:00"})
    assert page.status_code == 200 and "since" in page.content.decode()
    assert "is out of range" in page.content.decode()


@override_settings(DEBUG=True)
def test_an_unexpected_api_error_answers_the_documented_shape_without_a_traceback(
    root, monkeypatch
):
    def broken(run_id):
        raise RuntimeError("a bug with a secret in its message")

    monkeypatch.setattr("runs.api.runs.run_or_404", broken)
    response = api(root)("get", f"/runs/{start_run('ledger', {'steps': 0}).pk}")
    assert response.status_code == 500
    assert response.json() == {
        "error": {
            "code": "server_error",
            "message": "the server failed to answer; the error was logged",
        }
    }


# -- 8. hardening ----------------------------------------------------------------------------------


def test_logins_are_throttled_with_a_clear_message_and_an_audit_event(django_user_model):
    django_user_model.objects.create_user("mallory-target", password="the-right-one")
    browser = Client()
    for _ in range(4):
        failed = browser.post("/login/", {"username": "mallory-target", "password": "guess"})
        assert failed.status_code == 200  # the form again
    fifth = browser.post("/login/", {"username": "mallory-target", "password": "guess"})
    assert fifth.status_code == 429
    locked = browser.post("/login/", {"username": "mallory-target", "password": "the-right-one"})
    assert locked.status_code == 429
    assert "too many failed attempts" in locked.content.decode()
    assert Event.objects.filter(type="login.locked_out", run=None).exists()
    admin = Client().post(
        "/admin/login/", {"username": "mallory-target", "password": "the-right-one"}
    )
    assert admin.status_code == 429


def test_bad_api_keys_are_throttled(root):
    good = create_key(root)[1]
    answers = [Api(Client(), "sg_abcd1234_wrong")("get", "/runs").status_code for _ in range(6)]
    assert answers[:4] == [401] * 4 and answers[-1] == 429  # AXES_FAILURE_LIMIT is 5
    locked = Api(Client(), "sg_abcd1234_wrong")("get", "/runs")
    assert locked.status_code == 429 and error(locked)["code"] == "locked_out"
    assert "try again in 15 minutes" in error(locked)["message"]
    # A good key from the same address still works (tests/test_security_leftovers.py).
    assert Api(Client(), good)("get", "/runs").status_code == 200


def test_pages_send_a_csp_without_inline_scripts_and_a_permissions_policy(root):
    browser = Client()
    browser.force_login(root)
    response = browser.get("/")
    csp = response["Content-Security-Policy"]
    script = next(d for d in csp.split(";") if d.strip().startswith("script-src"))
    assert "'self'" in script and "unsafe-inline" not in script and "unsafe-eval" not in csp
    assert "frame-ancestors 'none'" in csp
    assert "camera=()" in response["Permissions-Policy"]


@pytest.mark.parametrize("field", [SEEN_AT, LOGIN_AT])
def test_a_session_ends_when_idle_or_too_old(root, field, settings):
    browser = Client()
    browser.force_login(root)
    assert browser.get("/").status_code == 200
    session = browser.session
    old = settings.STEPGUARD_SESSION_IDLE_SECONDS if field == SEEN_AT else (
        settings.STEPGUARD_SESSION_MAX_SECONDS
    )  # fmt: skip
    session[SEEN_AT] = time.time() - (old + 1 if field == SEEN_AT else 10)
    session[LOGIN_AT] = time.time() - (old + 1 if field == LOGIN_AT else 10)
    session.save()
    response = browser.get("/")
    assert response.status_code == 302 and response["Location"].startswith("/login/")
    assert browser.get("/").status_code == 302  # logged out for good


def test_budgets_take_ascii_digits_only(root):
    with pytest.raises(ValueError, match="0-9"):
        to_micros("٣")
    run = start_run("ledger", {"steps": 0})
    response = api(root)("put", f"/runs/{run.pk}/budget", {"usd": "٣", "reason": "x"})
    assert response.status_code == 422
    assert Run.objects.get(pk=run.pk).budget_micros is None
    assert to_micros(Decimal("3")) == 3_000_000


def test_policies_only_for_workflows_that_exist(root):
    client = api(root)
    for method, path, body in (
        ("post", "/workflows/no-such-flow/halt", {"reason": "typo"}),
        ("put", "/workflows/no-such-flow/budget", {"reason": "typo", "usd": "1"}),
    ):
        response = client(method, path, body)
        assert response.status_code == 404, response.content
    assert not Policy.objects.filter(scope="workflow:no-such-flow").exists()
    assert client("post", "/workflows/ledger/halt", {"reason": "real"}).status_code == 200


def test_no_log_line_carries_an_authorization_header(root, caplog, monkeypatch):
    secret = create_key(root)[1]
    client = Api(Client(), secret)
    monkeypatch.setattr("runs.api.runs.run_or_404", lambda run_id: 1 / 0)
    with caplog.at_level(logging.DEBUG):
        client("get", "/runs/00000000-0000-0000-0000-000000000000")  # a 500
        client("get", "/runs", limit=0)  # a 422
        client("post", "/runs", {"workflow": "nope"})  # a 404
        Api(Client(), secret + "x")("get", "/runs")  # a 401
    assert caplog.records, "nothing was logged: the test tests nothing"
    # Split as check_key does: the random part may itself hold "_" (it is urlsafe base64).
    assert secret.split("_", 2)[2] not in caplog.text
    assert secret not in caplog.text


def test_the_audit_page_shows_system_actions_when_asked(root):
    start_run("ledger", {"steps": 0}, key="made-by-code")
    browser = Client()
    browser.force_login(root)
    assert "run.created" not in browser.get("/audit").content.decode()
    assert "run.created" in browser.get("/audit", {"system": "1"}).content.decode()


# -- NUL characters (issue 31 item 8) -----------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "data"),
    [
        ("get", "/", {"workflow": "a\x00b"}),
        ("get", "/", {"status": "failed", "q\x00": "x"}),
        ("get", "/runs/count", {"key": "\x00"}),
        ("get", "/audit", {"actor": "otto\x00"}),
        ("get", "/approvals", {"after": "\x00"}),
        ("post", "/halts/halt", {"workflow": "pay\x00", "reason": "r", "confirm": "halt"}),
        ("post", "/flow/schedules", {"name": "n\x00", "workflow": "w", "cron": "* * * * *"}),
        ("post", "/runs/bulk", {"action": "cancel", "scope": "filter", "workflow": "\x00"}),
        ("get", "/api/runs", {"workflow": "\x00"}),
    ],
)
def test_a_nul_character_in_a_parameter_is_a_400_not_a_500(client, cast, method, path, data):
    """PostgreSQL refuses text holding NUL: each of these answered 500 there."""
    client.force_login(cast["otto"])
    response = getattr(client, method)(path, data)
    assert response.status_code == 400
    assert b"NUL" in response.content
