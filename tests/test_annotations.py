"""Annotations (issue 53 §3): operators and approvers mark a run or a step good, bad or with a
note, through the API, the dashboard and the CLI; runs are filtered and exported by them."""

import csv
import io
import json
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.db import IntegrityError, transaction

from runs.apikeys import create_key
from runs.models import Annotation, Event, EventType
from runs.sdk import start_run
from tests.test_api import Api, error

pytestmark = pytest.mark.django_db


@pytest.fixture
def as_(cast, client):
    """as_("otto") calls the API with an API key of that user."""
    keys = {}

    def _as(name: str) -> Api:
        if name not in keys:
            keys[name] = create_key(cast[name])[1]
        return Api(client, keys[name])

    return _as


@pytest.fixture
def two_runs(drive):
    good = start_run("ledger", {"steps": 2}, key="ann-good", labels={"tenant": "acme"})
    bad = start_run("ledger", {"steps": 2}, key="ann-bad")
    drive()
    return good, bad


def test_an_operator_marks_a_run_and_a_step_and_it_is_in_the_runs_history(as_, two_runs):
    _, bad = two_runs
    otto = as_("otto")
    made = otto("post", f"/runs/{bad.pk}/annotations", {"verdict": "bad", "note": "wrong total"})
    assert made.status_code == 201, made.content
    body = made.json()
    assert (body["verdict"], body["note"], body["by"], body["step_key"]) == (
        "bad", "wrong total", "otto", None,
    )  # fmt: skip
    step = otto("post", f"/runs/{bad.pk}/annotations", {"verdict": "good", "step": "s1"})
    assert step.status_code == 201
    assert (step.json()["step_seq"], step.json()["step_key"]) == (1, "s1")
    by_seq = otto("post", f"/runs/{bad.pk}/annotations", {"verdict": "note", "step": 0,
                                                            "note": "slow"})  # fmt: skip
    assert by_seq.json()["step_key"] == "s0"
    listed = as_("vera")("get", f"/runs/{bad.pk}/annotations").json()
    assert [a["verdict"] for a in listed] == ["note", "good", "bad"]  # newest first
    events = Event.objects.filter(run=bad, type=EventType.RUN_ANNOTATED).order_by("seq")
    assert [(e.actor, e.step_key, e.payload["verdict"]) for e in events] == [
        ("otto", "", "bad"), ("otto", "s1", "good"), ("otto", "s0", "note"),
    ]  # fmt: skip


def test_a_viewer_reads_annotations_but_may_not_add_one_and_an_approver_may(as_, two_runs):
    good, _ = two_runs
    refused = as_("vera")("post", f"/runs/{good.pk}/annotations", {"verdict": "good"})
    assert refused.status_code == 403
    assert "runs.annotate_run" in error(refused)["message"]
    assert (
        as_("ada")("post", f"/runs/{good.pk}/annotations", {"verdict": "good"}).status_code == 201
    )
    assert Annotation.objects.filter(run=good).count() == 1


def test_bad_annotations_are_refused_with_a_message_naming_the_problem(as_, two_runs):
    good, _ = two_runs
    otto = as_("otto")
    path = f"/runs/{good.pk}/annotations"
    assert otto("post", path, {"verdict": "great"}).status_code == 422
    empty = otto("post", path, {"verdict": "note"})
    assert empty.status_code == 400 and "needs the note's text" in error(empty)["message"]
    missing = otto("post", path, {"verdict": "bad", "step": "nope"})
    assert missing.status_code == 404 and "no step 'nope'" in error(missing)["message"]
    unknown = otto("post", "/runs/00000000-0000-0000-0000-000000000000/annotations",
                   {"verdict": "bad"})  # fmt: skip
    assert unknown.status_code == 404
    assert Annotation.objects.count() == 0


def test_the_database_refuses_an_empty_note_and_half_a_step(two_runs):
    good, _ = two_runs
    for fields in ({"verdict": "note", "note": ""}, {"verdict": "bad", "step_seq": 1},
                   {"verdict": "meh"}):  # fmt: skip
        with pytest.raises(IntegrityError), transaction.atomic():
            Annotation.objects.create(run=good, by_name="x", **fields)


def test_runs_are_filtered_and_annotations_exported_by_verdict(as_, two_runs, client, cast):
    good, bad = two_runs
    otto = as_("otto")
    otto("post", f"/runs/{good.pk}/annotations", {"verdict": "good"})
    otto("post", f"/runs/{bad.pk}/annotations", {"verdict": "bad", "note": 'a, "quoted" note'})
    otto("post", f"/runs/{bad.pk}/annotations", {"verdict": "bad", "step": "s0"})
    vera = as_("vera")
    marked_bad = vera("get", "/runs", annotation="bad").json()["items"]
    assert [r["id"] for r in marked_bad] == [str(bad.pk)]  # once, though marked twice
    assert len(vera("get", "/runs", annotation="any").json()["items"]) == 2
    assert vera("get", "/runs", annotation="meh").status_code == 422
    exported = vera("get", "/annotations", verdict="bad").json()
    assert [(a["run_id"], a["step_key"]) for a in exported] == [(str(bad.pk), "s0"),
                                                               (str(bad.pk), None)]  # fmt: skip
    assert vera("get", "/annotations", workflow="ledger").json()[-1]["labels"] == {"tenant": "acme"}
    # The dashboard: the runs list's filter, and the CSV its export link gives.
    client.force_login(cast["vera"])
    page = client.get("/", {"annotation": "bad"}).content.decode()
    assert f"run-{bad.pk}" in page and f"run-{good.pk}" not in page
    response = client.get("/annotations.csv", {"verdict": "bad"})
    assert response["Content-Type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert [r["note"] for r in rows] == ["", 'a, "quoted" note']
    assert client.get("/annotations.csv", {"verdict": "meh"}).status_code == 400


def test_the_dashboard_form_marks_a_run_and_a_step(client, cast, two_runs):
    good, _ = two_runs
    client.force_login(cast["otto"])
    page = client.get(f"/runs/{good.pk}").content.decode()
    assert 'id="annotations"' in page and "Save annotation" in page
    response = client.post(f"/runs/{good.pk}/annotate", {"verdict": "bad", "note": "loops"})
    assert response.status_code == 302
    client.post(f"/runs/{good.pk}/annotate", {"verdict": "good", "step": "1"})
    page = client.get(f"/runs/{good.pk}").content.decode()
    assert "loops" in page and "by otto" in page
    panel = client.get(f"/runs/{good.pk}/steps/1").content.decode()
    assert 'data-verdict="good"' in panel and "Mark this step" in panel
    client.force_login(cast["vera"])
    assert "Save annotation" not in client.get(f"/runs/{good.pk}").content.decode()
    assert client.post(f"/runs/{good.pk}/annotate", {"verdict": "bad"}).status_code == 403
    assert Annotation.objects.filter(run=good).count() == 2


def test_the_cli_annotates_and_exports(two_runs, cast):
    good, bad = two_runs
    out = StringIO()
    call_command("annotate", str(bad.pk)[:8], "--user", "otto", "--bad", "--note", "no",
                 "--step", "s1", stdout=out)  # fmt: skip
    assert "step s1 (1) marked bad by otto" in out.getvalue()
    with pytest.raises(CommandError, match="may not annotate runs"):
        call_command("annotate", str(bad.pk), "--user", "vera", "--good", stdout=StringIO())
    with pytest.raises(CommandError, match="needs the note's text"):
        call_command("annotate", str(bad.pk), "--user", "otto", "--note-only", stdout=StringIO())
    out = StringIO()
    call_command("annotations", "--verdict", "bad", "--format", "json", stdout=out)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(a["run_id"], a["step_key"], a["by"]) for a in lines] == [(str(bad.pk), "s1", "otto")]
    out = StringIO()
    call_command("annotations", "--run", str(good.pk), stdout=out)
    assert out.getvalue().splitlines() == [",".join(
        ["id", "run_id", "workflow", "run_status", "labels", "step_seq", "step_key", "verdict",
         "note", "by", "created_at"])]  # fmt: skip
