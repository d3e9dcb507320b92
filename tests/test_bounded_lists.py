"""Every list is bounded in bytes, whatever its rows hold (issue 31 item 4, first half): the API's
runs, events and approvals, and the approvals inbox and runs list pages. In-process, both
engines."""

import json

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from runs.apikeys import create_key
from runs.approvals.models import ApprovalRequest
from runs.models import Event, Run
from runs.sdk import start_run

pytestmark = pytest.mark.django_db

CAP = 1_000_000
BLOB = "y" * 300_000  # about 0.3 MB of JSON each: a page of 30 would be 9 MB


@pytest.fixture
def root(django_user_model):
    return django_user_model.objects.create_superuser("root", "root@example.com", "pw")


@pytest.fixture
def api(root):
    headers = {"HTTP_AUTHORIZATION": f"Bearer {create_key(root)[1]}"}
    client = Client()

    def get(path: str, **params):
        response = client.get(path, params, **headers)
        assert response.status_code == 200, response.content[:300]
        return response

    return get


def cut_and_whole(items: list, field: str) -> tuple[list, list]:
    cut = [i for i in items if isinstance(i[field], dict) and i[field].get("cut") is True]
    whole = [i for i in items if i not in cut]
    return cut, whole


def test_the_approvals_list_carries_payloads_up_to_the_cap_and_links_the_rest(api, settings):
    """Before: 61 pending approvals of 0.9 MB made GET /api/approvals?limit=500 64 MiB."""
    settings.STEPGUARD_API_MAX_RESPONSE = CAP
    run = start_run("ledger", {"steps": 0})
    ApprovalRequest.objects.bulk_create(
        ApprovalRequest(run=run, step_key=f"a{i}", action="pay", payload={"blob": BLOB})
        for i in range(30)
    )
    response = api("/api/approvals", limit=500)
    assert len(response.content) < CAP + 30 * 1000
    items = response.json()
    assert len(items) == 30  # every row asked for: only values are left out
    cut, whole = cut_and_whole(items, "payload")
    assert len(whole) == 3 and all(i["payload"] == {"blob": BLOB} for i in whole)
    first = cut[0]["payload"]
    assert first["bytes"] >= 300_000 and first["whole"] == f"/api/approvals/{cut[0]['id']}"
    assert api(first["whole"]).json()["payload"] == {"blob": BLOB}


def test_the_runs_list_carries_values_up_to_the_cap_and_still_pages(api, settings):
    """Before: /api/runs?limit=200 of runs with big inputs and outputs was 56.7 MiB."""
    settings.STEPGUARD_API_MAX_RESPONSE = CAP
    for i in range(12):
        run = start_run("ledger", {"steps": 0, "blob": BLOB}, key=f"big-{i}")
        Run.objects.filter(pk=run.pk).update(output={"blob": BLOB})
    page = api("/api/runs", limit=10)
    assert len(page.content) < CAP + 10 * 2000
    body = page.json()
    assert [r["key"] for r in body["items"]] == [f"big-{i}" for i in range(11, 1, -1)]
    values = [v for r in body["items"] for v in (r["input"], r["output"])]
    left_out = [v for v in values if isinstance(v, dict) and v.get("cut") is True]
    assert len(values) - len(left_out) == 3  # 3 x 0.3 MB fit under 1 MB
    newest = body["items"][0]
    assert newest["input"] == {"steps": 0, "blob": BLOB} and newest["error"] is None
    last = body["items"][-1]
    assert last["output"]["whole"] == f"/api/runs/{last['id']}"
    assert api(last["output"]["whole"]).json()["output"] == {"blob": BLOB}
    rest = api("/api/runs", limit=10, cursor=body["next_cursor"]).json()["items"]
    assert [r["key"] for r in rest] == ["big-1", "big-0"]
    assert rest[0]["input"]["blob"] == BLOB  # a new page, a new budget


def test_the_events_list_carries_payloads_up_to_the_cap_and_links_each_event(api, settings):
    settings.STEPGUARD_API_MAX_RESPONSE = CAP
    run = start_run("ledger", {"steps": 0})
    Event.objects.bulk_create(
        Event(run=run, seq=100 + i, type="signal.received", payload={"blob": BLOB},
              created_at=run.created_at)
        for i in range(8)
    )  # fmt: skip
    response = api(f"/api/runs/{run.pk}/events", limit=1000)
    assert len(response.content) < CAP + 8 * 1000
    events = [e for e in response.json() if e["seq"] >= 100]
    assert len(events) == 8
    cut, whole = cut_and_whole(events, "payload")
    assert len(whole) in (2, 3) and len(cut) == 8 - len(whole)  # run.created came first
    link = cut[-1]["payload"]["whole"]
    assert link == f"/api/runs/{run.pk}/events?after=106&limit=1"
    [one] = api(link).json()
    assert one["seq"] == 107 and one["payload"] == {"blob": BLOB}


def test_the_inbox_page_reads_and_shows_at_most_the_page_cap_of_payloads(root):
    """Before: 61 pending approvals of 0.9 MB made a 5.2 MiB inbox (50 previews of 64 KiB)."""
    run = start_run("ledger", {"steps": 0})
    ApprovalRequest.objects.bulk_create(
        ApprovalRequest(run=run, step_key=f"a{i}", action="pay", payload={"blob": "z" * 900_000})
        for i in range(61)
    )
    browser = Client()
    browser.force_login(root)
    page = browser.get("/approvals")
    assert page.status_code == 200
    assert len(page.content) < 400_000
    text = page.content.decode()
    assert text.count("Download the whole payload") == 50
    assert text.count("Not shown: this page already shows as much as it may.") == 49
    first = ApprovalRequest.objects.order_by("pk").first()
    whole = browser.get(f"/approvals/{first.pk}/payload.json")
    assert json.loads(whole.content) == {"blob": "z" * 900_000}


def test_the_runs_list_page_never_reads_inputs_outputs_or_errors(root):
    for _ in range(3):
        start_run("ledger", {"steps": 0, "blob": BLOB})
    browser = Client()
    browser.force_login(root)
    with CaptureQueriesContext(connection) as queries:
        assert browser.get("/").status_code == 200
    listing = [q["sql"] for q in queries.captured_queries if 'FROM "runs_run"' in q["sql"]]
    assert listing and not [q for q in listing if '"runs_run"."input"' in q]


def test_the_audit_page_reads_no_run_values_and_payloads_up_to_the_page_cap(root, settings):
    settings.STEPGUARD_UI_MAX_PAGE = CAP
    run = start_run("ledger", {"steps": 0, "blob": BLOB})
    Event.objects.bulk_create(
        Event(run=run, seq=100 + i, type="signal.received", actor="root",
              payload={"blob": BLOB, "reason": f"r{i}"}, created_at=run.created_at)
        for i in range(8)
    )  # fmt: skip
    browser = Client()
    browser.force_login(root)
    with CaptureQueriesContext(connection) as queries:
        page = browser.get("/audit")
    assert page.status_code == 200 and page.content.decode().count("signal.received") >= 8
    assert len(page.context["events"]) == 8
    assert not [q for q in queries.captured_queries if '"runs_run"."input"' in q["sql"]]
    shown = [e for e in page.context["events"] if e.payload]
    assert len(shown) == 3 and not page.context["events"][0].cut_fields


def test_the_schedules_list_carries_inputs_up_to_the_cap_and_links_each_schedule(
    api, root, settings
):
    from runs.engine import registry
    from runs.schedules import save

    settings.STEPGUARD_API_MAX_RESPONSE = CAP
    registry.load_configured()
    for i in range(6):
        save(f"big-{i}", workflow="ledger", cron="0 3 * * *", input={"blob": BLOB}, created_by=root)
    items = api("/api/flow/schedules").json()
    assert [s["name"] for s in items] == [f"big-{i}" for i in range(6)]
    cut, whole = cut_and_whole(items, "input")
    assert len(whole) == 3 and cut[0]["input"]["whole"] == "/api/flow/schedules/big-3"
    assert api(cut[0]["input"]["whole"]).json()["input"] == {"blob": BLOB}


def test_the_approvals_list_relays_stored_payloads_without_parsing_them(api, root):
    """GET /api/approvals?limit=500 parsed every payload to print it again: 42,000 small
    objects a payload took 2.6 s a request. The stored JSON's text is written out as it is
    (the same values, strings with quotes, non-ASCII and numbers intact), and
    the other fields are shaped by the schema as before."""
    run = start_run("ledger", {"steps": 0})
    tricky = {
        "to": 'vendor "A"\\b', "é": "ü", "n": [1, 1.5, -0.0, 10**20],
        "nested": {"list": [{"k": None}, True, False]}, "mark": "\\u0000deadbeef:0",
    }  # fmt: skip
    made = ApprovalRequest.objects.create(run=run, step_key="a", action="pay", payload=tricky)
    ApprovalRequest.objects.create(run=run, step_key="b", action="pay", payload=None)
    response = api("/api/approvals", limit=500)
    assert response["Content-Type"].startswith("application/json")
    items = response.json()
    assert [i["payload"] for i in items] == [tricky, None]
    first = items[0]
    assert first["id"] == made.pk and first["run_id"] == str(run.pk)
    assert first["created_at"].endswith("Z") and first["decided_by"] is None
    with connection.cursor() as cursor:  # the text stored is the text sent
        cursor.execute(
            "SELECT CAST(payload AS text) FROM approvals_approvalrequest WHERE id = %s", [made.pk]
        )
        stored = cursor.fetchone()[0]
    assert stored in response.content.decode()


@pytest.mark.postgres
def test_the_inbox_and_the_api_read_decided_approvals_newest_first_from_an_index():
    """The inbox's recent decisions and the API's list after the pending ones sorted every
    decided request (78 ms at 100,000, linear in the history): each is an index range now,
    read in order and stopped at its limit, with no sort."""
    decided = ApprovalRequest.objects.filter(decided_at__isnull=False).order_by("-decided_at")
    done = ApprovalRequest.objects.exclude(status="pending").order_by("-created_at")
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")  # a small table: as a large one plans
        cursor.execute("SET LOCAL enable_sort = off")
        for query, index in (
            (decided[:20], "approvals_decided_idx"),
            (done[:500], "approvals_done_idx"),
        ):
            sql, params = query.query.sql_with_params()
            cursor.execute(f"EXPLAIN {sql}", params)
            plan = "\n".join(row[0] for row in cursor.fetchall())
            assert index in plan and "Sort" not in plan, plan
