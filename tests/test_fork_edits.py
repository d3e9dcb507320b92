"""Rerun from a step, with edits (issue 34 item 1): a fork with a replaced input or replaced
step outputs, by operations, the API, the CLI and as the run page shows it."""

import pytest
from django.core.management import CommandError, call_command

from runs.apikeys import create_key
from runs.models import Event, EventType, Run, RunStatus, Step
from runs.operations import OperationError, fork_run
from runs.sdk import start_run
from tests.test_api import Api, error
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db


def created(run) -> dict:
    return Event.objects.get(run=run, type=EventType.RUN_CREATED).payload


def test_a_replaced_output_is_what_the_fork_replays_and_the_edit_is_recorded(drive, cast):
    origin = start_run("ledger", {"steps": 4})
    drive()
    assert Run.objects.get(pk=origin.pk).output == 0 + 1 + 2 + 3
    fork = fork_run(origin.pk, "s2", cast["otto"], "what if s1 said 100", outputs={"s1": 100})
    assert drive() == ["completed"]
    fork.refresh_from_db()
    assert fork.output == 0 + 100 + 2 + 3  # the workflow read the replaced output
    assert Step.objects.get(run=fork, key="s1").output == 100
    assert Step.objects.get(run=origin, key="s1").output == 1  # the origin is unchanged
    assert Effect.objects.filter(label="s1").count() == 1  # s1 was not performed again
    assert created(fork)["edited"] == {"outputs": {"s1": {"old": 1, "new": 100}}}
    forked = Event.objects.get(run=fork, type=EventType.RUN_FORKED_FROM).payload
    assert forked["edited"] == ["the output of step s1"]


def test_a_replaced_input_and_large_edits_recorded_by_digest(drive, cast):
    origin = start_run("ledger", {"steps": 2})
    drive()
    big = {"steps": 3, "note": "x" * 5000}
    fork = fork_run(origin.pk, "s0", cast["otto"], "one more step", input=big)
    assert drive() == ["completed"]
    fork.refresh_from_db()
    assert (fork.input, fork.output) == (big, 0 + 1 + 2)
    edit = created(fork)["edited"]["input"]
    assert set(edit) == {"old_sha256", "old_chars", "new_sha256", "new_chars"}
    assert edit["new_chars"] > 5000 and len(edit["new_sha256"]) == 64
    same = fork_run(origin.pk, "s0", cast["otto"], "no change", input={"steps": 2})
    assert "edited" not in created(same)  # the same value is no edit


@pytest.mark.parametrize(
    ("outputs", "says"),
    [
        ({"nope": 1}, "outputs names step 'nope', which is not a step before the fork point"),
        ({"s2": 1}, "steps whose output can be edited: 's0', 's1'"),  # the fork point itself
        ({"s0": float("nan")}, "the output of step 's0' is not a JSON value"),
    ],
)
def test_bad_edits_are_refused_naming_the_problem_and_nothing_is_created(
    drive, cast, outputs, says
):
    origin = start_run("ledger", {"steps": 3})
    drive()
    with pytest.raises(OperationError, match=says.replace("(", r"\(").replace(")", r"\)")):
        fork_run(origin.pk, "s2", cast["otto"], "edit", outputs=outputs)
    assert not Run.objects.filter(forked_from=origin).exists()


def test_a_copied_step_whose_output_was_replaced_registers_no_compensation(drive, cast):
    origin = start_run("saga", {"fail": True})
    drive()
    assert Run.objects.get(pk=origin.pk).status == RunStatus.FAILED
    assert Effect.objects.filter(label="undo-charge").count() == 1  # the origin's own undo
    fork = fork_run(origin.pk, "email", cast["otto"], "edited charge", outputs={"charge": "c2"})
    drive()
    assert Run.objects.get(pk=fork.pk).status == RunStatus.FAILED  # ship fails again
    assert Effect.objects.filter(label="undo-charge").count() == 1  # the fork undid nothing
    assert Effect.objects.filter(label="undo-reserve").count() == 1


def test_fork_with_edits_by_api_and_bad_input_is_a_400_naming_it(drive, cast, client):
    origin = start_run("ledger", {"steps": 3})
    drive()
    api = Api(client, create_key(cast["otto"])[1])
    body = {"step": "s2", "reason": "edit", "input": {"steps": 3}, "outputs": {"s0": 10}}
    response = api("post", f"/runs/{origin.pk}/fork", body)
    assert response.status_code == 201, response.content
    fork = Run.objects.get(pk=response.json()["id"])
    assert created(fork)["edited"] == {"outputs": {"s0": {"old": 0, "new": 10}}}  # same input
    drive()
    assert Run.objects.get(pk=fork.pk).output == 10 + 1 + 2

    response = api("post", f"/runs/{origin.pk}/fork", {**body, "outputs": {"s9": 1}})
    assert response.status_code == 400
    assert "outputs names step 's9'" in error(response)["message"]
    response = api("post", f"/runs/{origin.pk}/fork", {"step": "s1", "reason": "r", "input": None})
    assert response.status_code == 201  # null is a value: the input replaced by null
    assert Run.objects.get(pk=response.json()["id"]).input is None


def test_the_fork_command_takes_edits(drive, cast, capsys):
    origin = start_run("ledger", {"steps": 3})
    drive()
    call_command(
        "fork", str(origin.pk), "--from-step", "s2", "--user", "otto", "--reason", "r",
        "--output", "s1=7", "--input", '{"steps": 3}', "--yes",
    )  # fmt: skip
    fork = Run.objects.get(forked_from=origin)
    assert Step.objects.get(run=fork, key="s1").output == 7
    with pytest.raises(CommandError, match="--output s1 is not JSON"):
        call_command(
            "fork", str(origin.pk), "--from-step", "s2", "--user", "otto", "--reason", "r",
            "--output", "s1={", "--yes",
        )  # fmt: skip


def test_the_run_pages_link_fork_and_origin_and_say_what_was_edited(drive, cast, client):
    origin = start_run("ledger", {"steps": 3})
    drive()
    fork = fork_run(origin.pk, "s2", cast["otto"], "edit", input={"steps": 3}, outputs={"s1": 5})
    plain = fork_run(origin.pk, "s1", cast["otto"], "again")
    client.force_login(cast["vera"])
    page = client.get(f"/runs/{fork.pk}").content.decode()
    assert "at step <code>s2</code> (#2), with the output of step s1 edited" in page
    assert f'href="/runs/{origin.pk}"' in page
    assert (
        "edited"
        not in client.get(f"/runs/{plain.pk}").content.decode().split("Forked from")[1][:400]
    )
    origin_page = client.get(f"/runs/{origin.pk}").content.decode()
    assert 'id="run-forks"' in origin_page
    assert f'href="/runs/{fork.pk}"' in origin_page and f'href="/runs/{plain.pk}"' in origin_page


@pytest.mark.django_db(transaction=True)  # an async run checkpoints from a thread of its own
def test_the_dashboard_fork_form_offers_edits_and_checks_them_before_forking(
    drive, cast, client, demo_model
):
    origin = start_run("llm-async", {})
    assert drive() == ["completed"]
    said = Run.objects.get(pk=origin.pk).output[1]
    client.force_login(cast["otto"])
    preview = client.get(f"/runs/{origin.pk}/fork-preview", {"step": "after"}).content.decode()
    assert 'name="input"' in preview and 'name="output:fetch"' in preview
    assert f'name="text:ask" rows="4">{said}</textarea>' in preview  # the answer as its text
    assert "after" in preview  # the side-effect preview stays

    form = {"step": "after", "reason": "kinder answer", "input": "{}", "output:fetch": "7",
            "text:ask": "A kinder answer.\r\nOn two lines."}  # fmt: skip
    response = client.post(f"/runs/{origin.pk}/fork", {**form, "output:fetch": "{7"})
    assert response.status_code == 302 and not Run.objects.filter(forked_from=origin).exists()
    page = client.get(response["Location"]).content.decode()
    assert "The output of step fetch is not JSON" in page

    response = client.post(f"/runs/{origin.pk}/fork", form)
    fork = Run.objects.get(forked_from=origin)
    assert response["Location"] == f"/runs/{fork.pk}"
    assert set(created(fork)["edited"]["outputs"]) == {"fetch", "ask"}  # the input was kept
    assert drive() == ["completed"]
    assert Run.objects.get(pk=fork.pk).output == [7, "A kinder answer.\nOn two lines."]
    page = client.get(f"/runs/{fork.pk}").content.decode()
    assert "with the output of step fetch and the output of step ask edited" in page
