"""The release check from the API and the dashboard, and the versions in flight (issue 53 §1)."""

import json
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from runs.apikeys import create_key
from runs.models import Run, Step, Worker
from runs.versions import in_flight
from tests.test_replaycheck import histories, old_code, outside  # noqa: F401  (a fixture)

pytestmark = pytest.mark.django_db


def api(client: Client, user, method: str, path: str, body=None):
    headers = {"HTTP_AUTHORIZATION": f"Bearer {create_key(user)[1]}"}
    if method == "get":
        return client.get(f"/api{path}", **headers)
    return client.post(
        f"/api{path}", json.dumps(body or {}), content_type="application/json", **headers
    )


@pytest.fixture
def made_by_the_old_code(drive, outside):  # noqa: F811
    url, hits = outside
    with old_code():
        histories(drive, url, waiting=1, finished=1)
    return hits


def test_the_api_check_is_for_operators_and_names_the_divergence(
    made_by_the_old_code, cast, client
):
    steps = Step.objects.count()
    calls = len(made_by_the_old_code)
    refused = api(client, cast["vera"], "post", "/replaycheck")
    assert refused.status_code == 403
    assert "needs runs.set_flow" in refused.json()["error"]["message"]
    assert client.post("/api/replaycheck", "{}", content_type="application/json").status_code == 401
    answer = api(client, cast["otto"], "post", "/replaycheck", {"workflow": "release.divergent"})
    assert answer.status_code == 200, answer.content
    report = answer.json()
    assert (report["ok"], report["checked"], report["diverging"]) == (False, 2, 2)
    first = report["versions"][0]["first_divergence"]
    assert first["says"] == "history has 'reserve' at 0, code asks for 'quote'"
    everything = api(client, cast["otto"], "post", "/replaycheck", {"runs": 100}).json()
    assert {v["workflow"]: v["diverging"] for v in everything["versions"]} == {
        "release.compatible": 0, "release.divergent": 2, "release.patched": 0,
    }  # fmt: skip
    assert (Step.objects.count(), len(made_by_the_old_code)) == (steps, calls)


@pytest.mark.parametrize(
    "body, says",
    [
        ({"runs": 5, "since": "2026-01-01T00:00:00Z"}, "give --runs or --since, not both"),
        ({"workflow": "no-such"}, "unknown workflow 'no-such'"),
        ({"runs": 0}, "greater than or equal to 1"),
        ({"extra": 1}, "extra"),
    ],
)
def test_bad_input_to_the_api_check_is_refused_by_name(cast, client, body, says):
    answer = api(client, cast["otto"], "post", "/replaycheck", body)
    assert answer.status_code in (400, 422)
    assert says in answer.json()["error"]["message"]


def test_a_since_at_any_offset_is_read_in_utc(cast, client):
    """Schemathesis found it: an offset PostgreSQL cannot store (-20:36) was a 500."""
    answer = api(client, cast["otto"], "post", "/replaycheck", {"since": "4809-01-18T03:27-20:36"})
    assert answer.status_code == 200, answer.content


def test_versions_in_flight_say_who_serves_each_and_when_it_drains(cast, client):
    now = timezone.now()
    for status in ("waiting", "waiting", "running"):
        Run.objects.create(
            workflow="trip", version="1", input={}, status=status, lease_until=now,
            wake_at=now + timedelta(hours=2) if status == "waiting" else None,
        )  # fmt: skip
    for _ in range(4):
        Run.objects.create(
            workflow="trip", version="1", input={}, status="completed", finished_at=now
        )
    Run.objects.create(workflow="trip", version="2", input={}, status="pending")
    Worker.objects.create(
        host="h", pid=1, concurrency=4, workflows=["trip@2"], started_at=now, heartbeat_at=now
    )
    Worker.objects.create(  # stopped: serves nothing any more
        host="h", pid=2, concurrency=4, workflows=["trip@1"], started_at=now, heartbeat_at=now,
        stopped_at=now,
    )  # fmt: skip
    old, new = in_flight()
    assert (old.version, old.live, old.waiting, old.served, old.newest) == ("1", 3, 2, False, False)
    assert old.drains.startswith("about ") and old.last_deadline is not None
    assert (new.version, new.live, new.workers, new.newest) == ("2", 1, 1, True)
    assert new.drains.startswith("unknown")
    rows = api(client, cast["vera"], "get", "/versions").json()
    assert [(r["version"], r["served"], r["live"]) for r in rows] == [
        ("1", False, 3),
        ("2", True, 1),
    ]
    viewer = Client()
    viewer.force_login(cast["vera"])
    page = viewer.get("/versions")
    assert page.status_code == 200
    assert "no live worker" in page.content.decode() and "Release check" in page.content.decode()
    assert "needs the operators" in page.content.decode()  # no check button for a viewer


def test_the_page_runs_the_check_for_an_operator_only(made_by_the_old_code, cast):
    viewer, operator = Client(), Client()
    viewer.force_login(cast["vera"])
    operator.force_login(cast["otto"])
    assert viewer.post("/versions/check", {"workflow": ""}).status_code == 403
    page = operator.post("/versions/check", {"workflow": ""})
    assert page.status_code == 200
    text = page.content.decode()
    assert "2 runs would diverge" in text
    assert "history has &#x27;reserve&#x27; at 0, code asks for &#x27;quote&#x27;" in text
    assert "ctx.patched" in text
    assert Client().get("/versions").status_code == 302  # to the login page
