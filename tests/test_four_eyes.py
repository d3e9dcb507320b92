"""Four eyes: nobody who shaped what an approval approves may decide it.

Before, the rule looked only at who started the run and its parents: a fork had no starter, a
debounced start that replaced another person's input left the run counted as theirs, and a
schedule's runs were started as its author, whoever resumed it, even once the author was
deactivated.
"""

from datetime import UTC, datetime, timedelta

import pytest
from django.contrib.auth.models import Group
from django.utils import timezone

from runs import schedules
from runs.approvals.models import ApprovalRequest
from runs.approvals.services import decide
from runs.errors import Forbidden
from runs.models import Run, Schedule
from runs.operations import fork_run, pause_schedule, save_schedule
from runs.sdk import start_run
from tests import workflows


@pytest.fixture
def both(django_user_model, cast):
    """An operator who is also an approver."""
    user = django_user_model.objects.create_user("olga", password="x")
    user.groups.add(Group.objects.get(name="operator"), Group.objects.get(name="approver"))
    return user


def pending_approval(run) -> ApprovalRequest:
    return ApprovalRequest.objects.get(run=run, status="pending")


def test_who_started_a_run_may_not_approve_a_fork_of_it(drive, both, cast):
    """The issue's bypass: refused on the run, they forked it and approved the fork."""
    run = start_run("approver", {"amount": 5}, started_by=both)
    drive()
    with pytest.raises(Forbidden, match="started run"):
        decide(pending_approval(run).pk, "approve", both)
    decide(pending_approval(run).pk, "reject", cast["ada"])
    drive()
    fork = fork_run(run.pk, "ok", both, "ask again")
    drive()
    assert Run.objects.get(pk=fork.pk).started_by is None
    with pytest.raises(Forbidden, match=f"started run {run.pk}"):
        decide(pending_approval(fork).pk, "approve", both)
    decide(pending_approval(fork).pk, "approve", cast["ada"])
    drive()
    assert workflows.calls.get("charge") == 1


def test_who_forks_a_run_may_not_approve_what_the_fork_asks(drive, both, cast):
    run = start_run("approver", {"amount": 5}, started_by=cast["otto"])
    drive()
    decide(pending_approval(run).pk, "reject", cast["ada"])
    drive()
    fork = fork_run(run.pk, "ok", both, "ask again")
    drive()
    with pytest.raises(Forbidden, match=f"forked run {fork.pk}"):
        decide(pending_approval(fork).pk, "approve", both)


def test_who_replaces_a_debounced_runs_input_may_not_approve_it(drive, both, cast):
    first = start_run("debounced-payer", {"account": "acme", "amount": 5}, started_by=cast["otto"])
    replaced = start_run("debounced-payer", {"account": "acme", "amount": 99999}, started_by=both)
    assert replaced.pk == first.pk and not replaced.was_created
    Run.objects.filter(pk=first.pk).update(wake_at=timezone.now())  # the quiet period is over
    drive()
    with pytest.raises(Forbidden, match=r"gave run \S+ its input"):
        decide(pending_approval(first).pk, "approve", both)
    decide(pending_approval(first).pk, "approve", cast["ada"])


def scheduled_run(name: str) -> Run | None:
    """Fire the schedules' 03:00 tick (as a worker would at 03:00:30)."""
    tick = datetime(2026, 12, 2, 3, tzinfo=UTC)
    Schedule.objects.update(next_fire_at=tick)
    schedules.fire_due({"approver"}, now=tick + timedelta(seconds=30))
    return Run.objects.filter(workflow="approver").order_by("-created_at").first()


def test_who_resumes_someone_elses_schedule_may_not_approve_its_runs(drive, both, cast):
    save_schedule(cast["otto"], "nightly", workflow="approver", cron="0 3 * * *",
                  input={"amount": 7})  # fmt: skip
    pause_schedule(both, "nightly", True)
    pause_schedule(both, "nightly", False)
    run = scheduled_run("nightly")
    drive()
    with pytest.raises(Forbidden, match="schedule"):
        decide(pending_approval(run).pk, "approve", both)
    decide(pending_approval(run).pk, "approve", cast["ada"])


def test_a_deactivated_authors_schedule_stops_firing(cast):
    save_schedule(cast["otto"], "nightly", workflow="approver", cron="0 3 * * *",
                  input={"amount": 7})  # fmt: skip
    cast["otto"].is_active = False
    cast["otto"].save()
    assert scheduled_run("nightly") is None


def test_a_deleted_authors_schedule_stops_firing_and_the_others_go_on(cast):
    """A schedule keeps the ids of who shaped it: a deleted one must neither fire in nobody's
    name nor fail the firing of every schedule beside it."""
    save_schedule(cast["otto"], "nightly", workflow="approver", cron="0 3 * * *",
                  input={"amount": 7})  # fmt: skip
    schedules.save("plain", workflow="approver", cron="0 3 * * *", input={"amount": 1})
    cast["otto"].delete()
    run = scheduled_run("nightly")  # fires the 03:00 tick of both
    assert run is not None and run.input == {"amount": 1}
    assert Run.objects.count() == 1


def test_the_engines_own_workflows_cannot_be_scheduled(cast):
    with pytest.raises(schedules.ScheduleError, match="Stepguard's own"):
        save_schedule(cast["otto"], "spam", workflow="stepguard.notify", cron="* * * * *",
                      input={"channel": 1, "event": 1})  # fmt: skip


def test_pages_offer_the_starter_no_approve_button_but_say_another_approver_must(
    client, drive, both, cast
):
    """Issue 34 item 3: the inbox and the run page show the person who shaped the run "Waiting
    for another approver" and why, instead of buttons that would only be refused; an approver
    who did not shape it gets the buttons."""
    run = start_run("approver", {"amount": 5}, started_by=both)
    drive()
    request = pending_approval(run)
    client.force_login(both)
    for page in ("/approvals", f"/runs/{run.pk}"):
        text = client.get(page).content.decode()
        assert "Waiting for another approver." in text, page
        assert f"olga started run {run.pk} and may not also decide approval #{request.pk}" in text
        assert 'value="approve"' not in text, page
    client.force_login(cast["ada"])
    for page in ("/approvals", f"/runs/{run.pk}"):
        text = client.get(page).content.decode()
        assert 'value="approve"' in text and "Waiting for another approver" not in text, page


def test_a_refused_decision_says_why_on_a_page_with_the_way_back(client, drive, both):
    """Issue 34 item 3: a refusal was a bare 403 page."""
    run = start_run("approver", {"amount": 5}, started_by=both)
    drive()
    request = pending_approval(run)
    client.force_login(both)
    back = f"/runs/{run.pk}"
    response = client.post(f"/approvals/{request.pk}/decide", {"decision": "approve", "next": back})
    assert response.status_code == 403
    page = response.content.decode()
    assert f"olga started run {run.pk} and may not also decide approval #{request.pk}" in page
    assert f'<a href="{back}">Back to where you were</a>' in page and "Log out" in page
