"""A fork with edits must not change what an approval approved (issue 47 §1).

Before: an operator who may fork but not approve forked a run whose payment `{to: vendor,
amount: 1}` had been approved, with `input: {to: otto, amount: 99999}` (or the output of the
step that planned the payment, or the arguments of a tool that needs approval) and the fork paid
99999 under the copied decision, with no new approval request; editing the approval step's own
output forged who decided and pointed it at another approval of the lineage, past a revoked one.
Now an approval stands for a fork only if nothing before it was edited, the code asks for the
same thing (a hash of what the approver saw) and it was not revoked; else the fork asks again,
under four eyes. Recorded decisions are not editable.
"""

import json

import pytest
from django.contrib.auth.models import Group
from django.core.management import call_command

from runs.apikeys import create_key
from runs.approvals.models import ApprovalRequest
from runs.approvals.services import decide, revoke
from runs.errors import Forbidden
from runs.models import Event, EventType, Run, RunStatus, Step
from runs.operations import OperationError, fork_preview, fork_run
from runs.sdk import start_run
from tests import workflows
from tests.test_api import Api, error
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db

BIG = {"to": "otto", "amount": 99999}
#: The issue's three shapes of edit that change what was approved: (workflow, extra input,
#: the fork's edits, what the new approval asks for).
SHAPES = {
    "input": ("payout", {}, {"input": BIG}, BIG),
    "upstream output": ("payout", {"plan": True}, {"outputs": {"plan": BIG}}, BIG),
    "tool approval": ("tool-payout", {}, {"input": BIG}, {"tool": "make_payment", "args": BIG}),
}


def paid(amount: int, to: str) -> int:
    return Effect.objects.filter(label=f"paid {amount} to {to}").count()


def approved_payout(drive, cast, workflow: str = "payout", **extra) -> Run:
    """A run that paid 1 to the vendor, approved by ada."""
    run = start_run(workflow, {"to": "vendor", "amount": 1, **extra})
    assert drive() == ["waiting"]
    decide(ApprovalRequest.objects.get(run=run).pk, "approve", cast["ada"])
    assert drive() == ["completed"]
    assert paid(1, "vendor") == 1
    return run


def asked(run) -> list[ApprovalRequest]:
    return list(ApprovalRequest.objects.filter(run=run))


@pytest.fixture
def api(client, cast):
    return Api(client, create_key(cast["otto"])[1])


@pytest.mark.parametrize("shape", SHAPES)
def test_a_fork_whose_edits_change_the_approved_payment_asks_again_by_api(drive, cast, api, shape):
    workflow, extra, edits, sees = SHAPES[shape]
    origin = approved_payout(drive, cast, workflow, **extra)
    response = api("post", f"/runs/{origin.pk}/fork", {"step": "pay", "reason": "r", **edits})
    assert response.status_code == 201, response.content
    fork = Run.objects.get(pk=response.json()["id"])
    drive()
    assert paid(99999, "otto") == 0  # before: 1, under the copied decision
    (request,) = asked(fork)  # before: none
    assert (request.status, request.payload) == ("pending", sees)
    assert Run.objects.get(pk=fork.pk).status == RunStatus.WAITING
    decide(request.pk, "approve", cast["ada"])  # a person who saw 99999 says yes
    assert drive() == ["completed"]
    assert paid(99999, "otto") == 1


def test_the_forker_who_edited_may_not_approve_what_the_fork_asks(drive, cast, api):
    both = cast["ada"]
    both.groups.add(Group.objects.get(name="operator"))  # ada may fork, and approve
    origin = approved_payout(drive, cast)
    fork = fork_run(origin.pk, "pay", both, "pay me", input=BIG)
    drive()
    (request,) = asked(fork)
    with pytest.raises(Forbidden, match=f"forked run {fork.pk}"):
        decide(request.pk, "approve", both)


def test_an_approval_nothing_before_was_edited_for_still_stands(drive, cast, api):
    """An edit after the approval, or none, leaves it standing: the fork asks nobody."""
    origin = approved_payout(drive, cast, plan=True)
    fork = fork_run(origin.pk, "pay", cast["otto"], "again, as approved")
    assert drive() == ["completed"]
    assert asked(fork) == [] and paid(1, "vendor") == 2
    assert Run.objects.get(pk=fork.pk).output["approved_by"] == "ada"


def test_a_recorded_decision_is_not_editable_by_api(drive, cast, api):
    """The issue: the copied decision re-pointed and its `decided_by` forged."""
    origin = approved_payout(drive, cast)
    decision = Step.objects.get(run=origin, key="ok").output
    for forged in (
        {**decision, "decided_by": "ceo"},
        {**decision, "approval_id": decision["approval_id"] + 1},
    ):
        body = {"step": "pay", "reason": "r", "input": BIG, "outputs": {"ok": forged}}
        response = api("post", f"/runs/{origin.pk}/fork", body)
        assert response.status_code == 400, response.content  # before: 201, paid 99999 as "ceo"
        assert (
            "step 'ok' is an approval: its recorded decision cannot be edited"
            in (error(response)["message"])
        )
    assert not Run.objects.filter(forked_from=origin).exists()


def test_a_revoked_approval_is_neither_bypassed_by_an_edit_nor_reused(drive, cast, api):
    """A fork of a fork whose own approval was revoked: pointing the decision at the
    origin's (still approved, same lineage) is refused, and a plain fork asks again."""
    origin = approved_payout(drive, cast)
    again = fork_run(origin.pk, "ok", cast["otto"], "ask again")
    drive()
    (second,) = asked(again)
    decide(second.pk, "approve", cast["ada"])
    assert drive() == ["completed"]
    revoke(second.pk, cast["ada"], "that was a mistake")
    first = Step.objects.get(run=origin, key="ok").output
    body = {"step": "pay", "reason": "r", "input": BIG, "outputs": {"ok": first}}
    response = api("post", f"/runs/{again.pk}/fork", body)
    assert response.status_code == 400  # before: 201, and it paid 99999
    assert paid(99999, "otto") == 0

    response = api("post", f"/runs/{again.pk}/fork", {"step": "pay", "reason": "r"})
    fork = Run.objects.get(pk=response.json()["id"])
    assert drive() == ["waiting"]  # before: failed, "approval #.. no longer stands"
    (request,) = asked(fork)
    assert request.payload == {"to": "vendor", "amount": 1}
    forked = Event.objects.get(run=fork, type=EventType.RUN_FORKED_FROM).payload
    assert forked["asks_again"] == {"ok": f"approval #{second.pk} was revoked"}


def test_an_approval_revoked_after_the_fork_was_made_is_asked_again(drive, cast):
    origin = approved_payout(drive, cast)
    fork = fork_run(origin.pk, "pay", cast["otto"], "again")
    revoke(ApprovalRequest.objects.get(run=origin).pk, cast["ada"], "no more")
    assert drive() == ["waiting"]
    (request,) = asked(fork)
    assert request.status == "pending" and paid(1, "vendor") == 1
    asks = Event.objects.get(run=fork, type=EventType.APPROVAL_REQUESTED).payload
    assert "was revoked" in asks["asked_again"]


def test_an_approval_stands_only_for_what_the_code_asks_now(drive, cast):
    """No edit, but the code asks to approve something else than was approved (its hash
    differs): the fork asks again."""
    origin = approved_payout(drive, cast)
    fork = fork_run(origin.pk, "pay", cast["otto"], "again")
    workflows.variant["payout"] = "double"
    assert drive() == ["waiting"]
    (request,) = asked(fork)
    assert request.payload == {"to": "vendor", "amount": 2}
    assert (
        "asks to approve something else"
        in (Event.objects.get(run=fork, type=EventType.APPROVAL_REQUESTED).payload["asked_again"])
    )


def test_the_preview_says_which_approvals_the_fork_asks_again(drive, cast, api, capsys):
    origin = approved_payout(drive, cast, plan=True)
    said = {s["key"]: s for s in fork_preview(origin.pk, "pay")}
    assert "ok" not in said  # nothing edited: the approval stands
    said = {s["key"]: s for s in fork_preview(origin.pk, "pay", outputs={"plan": BIG})}
    assert said["ok"]["asked_again"] == "the output of step 'plan' (#0) is edited"
    body = {"step": "pay", "input": BIG}
    response = api("post", f"/runs/{origin.pk}/fork-preview", body)
    assert response.status_code == 200, response.content
    assert response.json()[0] == {
        "seq": 1, "key": "ok", "kind": "approval", "asked_again": "the input is edited",
    }  # fmt: skip
    call_command(
        "fork", str(origin.pk), "--from-step", "pay", "--user", "otto", "--reason", "r",
        "--output", f"plan={json.dumps(BIG)}",
    )  # fmt: skip
    assert "asks approval again: #1 ok: the output of step 'plan' (#0) is edited" in (
        capsys.readouterr().out
    )
    revoke(ApprovalRequest.objects.get(run=origin).pk, cast["ada"], "no")
    listed = api("get", f"/runs/{origin.pk}/fork-preview", step="pay").json()
    assert [(s["key"], s["asked_again"]) for s in listed] == [
        ("ok", f"approval #{ApprovalRequest.objects.get(run=origin).pk} was revoked"),
        ("pay", None),
    ]


# -- the dashboard's fork form -------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_a_fork_by_the_dashboard_form_whose_edits_change_the_payment_asks_again(
    drive, cast, client, shape
):
    workflow, extra, edits, sees = SHAPES[shape]
    origin = approved_payout(drive, cast, workflow, **extra)
    form = {"step": "pay", "reason": "r"}
    if "input" in edits:
        form["input"] = json.dumps(edits["input"])
    form.update({f"output:{k}": json.dumps(v) for k, v in edits.get("outputs", {}).items()})
    client.force_login(cast["otto"])
    response = client.post(f"/runs/{origin.pk}/fork", form)
    fork = Run.objects.get(forked_from=origin)
    assert response["Location"] == f"/runs/{fork.pk}"
    drive()
    assert paid(99999, "otto") == 0
    (request,) = asked(fork)
    assert request.payload == sees
    page = client.get(response["Location"]).content.decode()
    approval = "pay.approval" if workflow == "tool-payout" else "ok"
    assert f"It asks approval <code>{approval}</code> again" in page


def test_the_dashboard_form_offers_no_recorded_decision_and_refuses_one(drive, cast, client):
    origin = approved_payout(drive, cast)
    client.force_login(cast["otto"])
    preview = client.get(f"/runs/{origin.pk}/fork-preview", {"step": "pay"}).content.decode()
    assert 'name="output:ok"' not in preview  # before: offered, with the decision's JSON
    assert "asked again if the input is edited" in preview
    decision = Step.objects.get(run=origin, key="ok").output
    forged = json.dumps({**decision, "decided_by": "ceo"})
    form = {"step": "pay", "reason": "r", "output:ok": forged}
    response = client.post(f"/runs/{origin.pk}/fork", form)
    assert not Run.objects.filter(forked_from=origin).exists()
    page = client.get(response["Location"]).content.decode()
    assert "its recorded decision cannot be edited" in page


def test_the_dashboard_preview_and_form_with_a_revoked_approval(drive, cast, client):
    origin = approved_payout(drive, cast)
    approval = ApprovalRequest.objects.get(run=origin)
    revoke(approval.pk, cast["ada"], "no")
    client.force_login(cast["otto"])
    preview = client.get(f"/runs/{origin.pk}/fork-preview", {"step": "pay"}).content.decode()
    assert f"approval #{approval.pk} was revoked" in preview
    client.post(f"/runs/{origin.pk}/fork", {"step": "pay", "reason": "r"})
    fork = Run.objects.get(forked_from=origin)
    assert drive() == ["waiting"]
    assert [r.status for r in asked(fork)] == ["pending"]


# -- what else a fork checks -----------------------------------------------------------------


def test_the_engines_own_runs_are_not_forked(drive, cast, api):
    from runs.notifications import WORKFLOW

    run = start_run(WORKFLOW, {"channel": 1, "event": 1}, engine=True)
    Step.objects.create(
        run=run,
        seq=0,
        key="send",
        kind="call",
        status="started",
        idempotency_key="k",
        started_at=run.created_at,
    )
    response = api("post", f"/runs/{run.pk}/fork", {"step": 0, "reason": "r"})
    assert response.status_code == 400  # before: 201, a delivery of any input
    assert "is Stepguard's own" in error(response)["message"]
    with pytest.raises(OperationError, match="is Stepguard's own"):
        fork_run(run.pk, 0, cast["otto"], "r")


@pytest.mark.parametrize(
    ("edits", "says"),
    [
        ({"input": {"to": "a\x00b"}}, "the input holds a NUL character"),
        ({"input": {"to": "\ud800"}}, "the input is not valid Unicode"),
        ({"outputs": {"s0": "\x00"}}, "the output of step 's0' holds a NUL character"),
        ({"outputs": {"s0": "x" * 5000}}, "over the 4096-byte limit a step's output has"),
    ],
)
def test_edits_that_cannot_be_stored_are_a_400(drive, cast, api, edits, says, settings):
    settings.STEPGUARD_MAX_OUTPUT_BYTES = 4096  # under the API's cap on a request's body
    origin = start_run("ledger", {"steps": 2})
    drive()
    with pytest.raises(OperationError, match=says):
        fork_run(origin.pk, "s1", cast["otto"], "r", **edits)
    response = api("post", f"/runs/{origin.pk}/fork", {"step": "s1", "reason": "r", **edits})
    assert response.status_code == 400, response.content  # before: 500 (or 201 over the cap)
    assert not Run.objects.filter(forked_from=origin).exists()


def test_approvals_asked_together_each_stand_or_are_asked_again(drive, cast):
    """`ctx.approvals` (an agent's parallel tool calls): a copied decision revoked after the
    fork was made is asked again on its own; the other stands."""
    payments = [{"to": "a", "amount": 1}, {"to": "b", "amount": 2}]
    origin = start_run("batch-payout", {"payments": payments})
    assert drive() == ["waiting"]
    for request in asked(origin):
        decide(request.pk, "approve", cast["ada"])
    assert drive() == ["completed"]
    fork = fork_run(origin.pk, "pay-a", cast["otto"], "again")
    revoke(ApprovalRequest.objects.get(run=origin, step_key="ok-b").pk, cast["ada"], "no")
    assert drive() == ["waiting"]
    (request,) = asked(fork)
    assert (request.step_key, request.payload) == ("ok-b", {"to": "b", "amount": 2})
    decide(request.pk, "approve", cast["ada"])
    assert drive() == ["completed"]
    assert (paid(1, "a"), paid(2, "b")) == (2, 2)

    more = {"payments": [payments[0], {"to": "b", "amount": 3}]}
    edited = fork_run(origin.pk, "pay-a", cast["otto"], "more", input=more)
    forked = Event.objects.get(run=edited, type=EventType.RUN_FORKED_FROM).payload
    assert forked["asks_again"] == {"ok-a": "the input is edited", "ok-b": "the input is edited"}
    assert drive() == ["waiting"]
    assert [r.payload["amount"] for r in asked(edited)] == [1, 3]


def test_requests_made_before_the_upgrade_get_the_digest_the_engine_gives(drive, cast):
    """Migration 0003 gives each request its digest from what it recorded: the one the
    engine computes, so a fork of a run approved before the upgrade finds it standing."""
    from importlib import import_module

    from django.apps import apps

    origin = approved_payout(drive, cast)
    request = ApprovalRequest.objects.get(run=origin)
    assert len(request.sha256) == 64
    ApprovalRequest.objects.update(sha256="")
    import_module("runs.approvals.migrations.0003_forks_approval_sha256").backfill(apps, None)
    assert ApprovalRequest.objects.get(pk=request.pk).sha256 == request.sha256
    fork = fork_run(origin.pk, "pay", cast["otto"], "again")
    assert drive() == ["completed"] and asked(fork) == []
