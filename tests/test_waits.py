"""Durable waits, approvals, child runs, compensation and versions, executed in-process."""

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from runs.approvals.models import ApprovalKind, ApprovalRequest
from runs.approvals.services import decide, resolve, revoke
from runs.models import Event, Run, RunStatus, Step, StepStatus, Worker
from runs.operations import cancel_run, unserved_reason
from runs.sdk import DecisionError, OperationError, send_signal, start_run
from tests import versioned_v1, versioned_v2, workflows  # noqa: F401  (registers both versions)
from tests.conftest import wait_until
from tests.testapp.models import Effect
from tests.workflows import Crash

pytestmark = pytest.mark.django_db


def status(run) -> str:
    return Run.objects.get(pk=run.pk).status


def effects(label: str) -> int:
    return Effect.objects.filter(label=label).count()


def test_a_sleeping_run_holds_no_worker_and_wakes_when_due(drive):
    run = start_run("sleeper", {"seconds": 3})  # long enough to be not yet due on a busy host
    assert drive() == ["waiting"]
    waiting = Run.objects.get(pk=run.pk)
    assert waiting.status == RunStatus.WAITING and waiting.worker_id is None
    assert waiting.lease_until is None and waiting.wake_at is not None
    assert drive() == []  # not due yet: nothing to claim
    wait_until(lambda: drive() == ["completed"], what="the timer")
    assert (effects("before"), effects("after")) == (1, 1)
    types = list(Event.objects.filter(run=run).values_list("type", flat=True))
    assert types.index("timer.set") < types.index("run.woken") < types.index("timer.fired")


def test_a_signal_sent_before_the_wait_is_kept_and_delivered(drive):
    run = start_run("waiter", {})
    send_signal(run.id, "go", {"seat": "12A"}, sent_by="gate-agent")
    assert drive() == ["completed"]
    assert Run.objects.get(pk=run.pk).output == {"seat": "12A"}


def test_a_signal_wakes_a_waiting_run(drive):
    run = start_run("waiter", {})
    assert drive() == ["waiting"]
    send_signal(run.id, "go", "now")
    assert status(run) == RunStatus.PENDING
    assert drive() == ["completed"]
    assert Run.objects.get(pk=run.pk).output == "now"
    assert effects("after") == 1


def test_two_signals_feed_two_waits_in_order_each_consumed_once(drive):
    run = start_run("two-waits")
    send_signal(run.id, "item", 1)
    send_signal(run.id, "item", 2)
    send_signal(run.id, "item", 3)
    drive()
    assert Run.objects.get(pk=run.pk).output == [1, 2]
    consumed = dict(run.signals.values_list("payload", "consumed_by"))
    assert consumed == {1: "first", 2: "second", 3: ""}


def test_a_wait_times_out_with_wait_timeout(drive):
    run = start_run("waiter", {"timeout": 0.2})
    outcomes = drive()
    assert outcomes[0] == "waiting", outcomes
    # Timed out 0.2 s later: on a loaded machine the same drive may already have taken it again.
    wait_until(lambda: outcomes[-1] == "completed" or drive() == ["completed"],
               what="the timeout")  # fmt: skip
    assert Run.objects.get(pk=run.pk).output == "timed out"
    assert Step.objects.get(run=run, key="wait").error["code"] == "wait_timeout"


def test_signals_to_unknown_or_finished_runs_are_refused(drive):
    with pytest.raises(OperationError, match="no run with id"):
        send_signal("not-a-run", "go")
    run = start_run("ledger", {"steps": 1})
    drive()
    with pytest.raises(OperationError, match="is completed"):
        send_signal(run.id, "go")


def test_an_approved_action_runs_once_with_the_decision(drive, alice):
    run = start_run("approver", {"amount": 120})
    assert drive() == ["waiting"]
    request = ApprovalRequest.objects.get(run=run)
    assert (request.action, request.payload, request.status) == (
        "charge card",
        {"amount": 120},
        "pending",
    )
    assert effects("charge") == 0

    decide(request.pk, "approve", "alice", "within policy")
    assert drive() == ["completed"]
    assert Run.objects.get(pk=run.pk).output == {"approved_by": "alice", "comment": "within policy"}
    assert effects("charge") == 1
    decided = Event.objects.get(run=run, type="approval.decided")
    assert (decided.actor, decided.payload["decision"]) == ("alice", "approved")


def test_a_rejected_action_never_runs_and_the_workflow_hears_why(drive, alice):
    run = start_run("approver", {"amount": 900})
    drive()
    decide(ApprovalRequest.objects.get(run=run).pk, "reject", alice, "too much")
    drive()
    approval_id = ApprovalRequest.objects.get(run=run).pk
    expected = f"refused: alice rejected 'charge card' (approval #{approval_id}): too much"
    assert Run.objects.get(pk=run.pk).output == expected
    assert effects("charge") == 0


def test_an_undecided_approval_expires(drive, alice):
    run = start_run("approver", {"amount": 5, "timeout": 0.2})
    drive()
    wait_until(lambda: drive() == ["completed"], what="the expiry")
    assert Run.objects.get(pk=run.pk).output.startswith("refused: approval #")
    request = ApprovalRequest.objects.get(run=run)
    assert request.status == "expired"
    with pytest.raises(DecisionError, match="already expired"):
        decide(request.pk, "approve", alice)
    assert effects("charge") == 0


def test_deciding_twice_is_a_clear_error_and_the_first_decision_stands(drive, alice):
    start_run("approver", {"amount": 5})
    drive()
    request = ApprovalRequest.objects.get()
    decide(request.pk, "reject", alice, "no")
    with pytest.raises(DecisionError, match=r"already rejected by alice at \d{4}-"):
        decide(request.pk, "approve", alice)
    request.refresh_from_db()
    assert request.status == "rejected" and request.comment == "no"


def test_deciding_needs_the_permission(drive, django_user_model):
    django_user_model.objects.create_user("bob", password="x")
    start_run("approver", {"amount": 5})
    drive()
    with pytest.raises(OperationError, match="bob may not decide approvals"):
        decide(ApprovalRequest.objects.get().pk, "approve", "bob")
    assert ApprovalRequest.objects.get().status == "pending"


def test_an_approval_revoked_before_the_guarded_step_starts_stops_the_step(drive, alice):
    run = start_run("approver", {"amount": 50, "cooling_off": 0.3})
    drive()
    request = ApprovalRequest.objects.get(run=run)
    decide(request.pk, "approve", alice)
    assert drive() == ["waiting"]  # approved, now in its cooling-off sleep
    revoke(request.pk, alice, "customer called to cancel")
    wait_until(lambda: drive() == ["failed"], what="the run to resume")
    run.refresh_from_db()
    assert run.error["code"] == "approval_revoked" and run.attempt == 1
    assert Step.objects.get(run=run, key="charge").status == StepStatus.FAILED
    assert effects("charge") == 0


@pytest.mark.parametrize("choice", ["happened", "resend", "fail"])
def test_an_ambiguous_step_can_be_resolved_by_a_person(drive, expire_lease, alice, choice):
    run = start_run("asker")
    workflows.crash_at.add("book")
    with pytest.raises(Crash):
        drive()
    expire_lease(run.id)
    assert drive() == ["waiting"]
    request = ApprovalRequest.objects.get(run=run)
    assert request.kind == ApprovalKind.AMBIGUOUS
    assert request.payload["idempotency_key"] == f"{run.id}:book"
    assert (
        request.payload["input"] == ["<RunContext>", "book", {"ref": "B1"}]
        or request.payload["input"]
    )

    resolve(request.pk, choice, alice, output={"ref": "B1-confirmed"})
    drive()
    run.refresh_from_db()
    book = Step.objects.get(run=run, key="book")
    if choice == "happened":
        assert run.output == {"ref": "B1-confirmed"} and book.recovered == "confirmed"
        assert effects("book") == 1
    elif choice == "resend":
        assert run.output == {"ref": "B1"} and book.recovered == "resent"
        assert effects("book") == 2
    else:
        assert run.status == RunStatus.FAILED and run.error["code"] == "operator_failed"
        assert effects("book") == 1


def test_children_run_once_and_the_parent_gets_their_results(drive):
    run = start_run("parent", {"n": 3})
    drive()
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED
    assert run.output == [1, 1, 1]  # ledger with 2 steps sums 0 + 1
    children = Run.objects.filter(parent=run)
    assert children.count() == 3 and {c.key for c in children} == {
        f"{run.id}:c{i}" for i in range(3)
    }
    assert effects("after") == 1


def test_a_failed_child_raises_child_failed_in_the_parent(drive):
    run = start_run("parent", {"n": 2, "child": "bad-output"})
    drive()
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED
    assert run.output.startswith("child failed: child run ")
    assert "cannot be stored as JSON" in run.output


def test_cancel_runs_compensations_newest_first_once_each(drive, alice):
    run = start_run("saga", {})
    assert drive() == ["waiting"]
    cancel_run(run.id, alice, "customer changed plans")
    assert drive() == ["cancelled"]
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELLED
    undo = list(
        Step.objects.filter(run=run, key__startswith="undo:")
        .order_by("seq")
        .values_list("key", flat=True)
    )
    assert undo == ["undo:charge", "undo:reserve"]
    assert (effects("undo-charge"), effects("undo-reserve")) == (1, 1)
    ended = Event.objects.get(run=run, type="run.cancelled")
    assert ended.payload == {
        "by": "alice",
        "reason": "customer changed plans",
        "compensated": ["charge", "reserve"],
    }
    with pytest.raises(OperationError, match="already cancelled"):
        cancel_run(run.id, alice, "again")


def test_a_final_failure_runs_the_compensations(drive):
    run = start_run("saga", {"fail": True}, max_attempts=1)
    assert drive() == ["failed"]
    assert (effects("undo-charge"), effects("undo-reserve")) == (1, 1)
    assert Event.objects.get(run=run, type="run.failed").payload["compensated"] == [
        "charge",
        "reserve",
    ]


def test_cancelling_a_run_that_never_started_ends_it_at_once(alice):
    run = start_run("ledger", {"steps": 1})
    assert cancel_run(run.id, alice, "not needed").status == RunStatus.CANCELLED


def test_patched_keeps_old_runs_on_the_old_path_and_new_runs_on_the_new(drive, expire_lease):
    old = start_run("patchy")
    workflows.crash_at.add("b")
    with pytest.raises(Crash):
        drive()
    workflows.variant["patched"] = True  # the deploy with the change
    expire_lease(old.id)
    new = start_run("patchy")
    drive()
    assert Run.objects.get(pk=old.pk).output == ["a", "b"]
    assert Run.objects.get(pk=new.pk).output == ["a", "b2"]
    assert Run.objects.get(pk=old.pk).status == Run.objects.get(pk=new.pk).status == "completed"


def test_runs_are_pinned_to_their_version(drive):
    v1 = start_run("versioned", version="1")
    v2 = start_run("versioned")  # the newest registered version
    assert (v1.version, v2.version) == ("1", "2")
    drive()
    for run in (v1, v2):
        send_signal(run.id, "go")
    drive()
    assert Run.objects.get(pk=v1.pk).output == "v1-b"
    assert Run.objects.get(pk=v2.pk).output == "v2-b"


def test_a_run_no_live_worker_can_serve_says_why():
    run = start_run("versioned", version="1")
    now = timezone.now()
    Worker.objects.create(
        host="h", pid=1, concurrency=1, workflows=["versioned@2"], started_at=now, heartbeat_at=now
    )
    assert (
        unserved_reason(run) == "no live worker serves versioned@1 (live workers serve versioned@2)"
    )
    Worker.objects.create(
        host="h", pid=2, concurrency=1, workflows=["versioned@1"], started_at=now, heartbeat_at=now
    )
    assert unserved_reason(run) is None


def test_the_cli_signals_decides_and_cancels(drive, alice):
    waiting = start_run("waiter", {})
    asking = start_run("approver", {"amount": 1})
    saga = start_run("saga", {})
    drive()
    call_command("signal", str(waiting.id), "go", "--payload", '{"x": 1}')
    approval = ApprovalRequest.objects.get(run=asking)
    call_command("approve", str(approval.pk), "--user", "alice", "--comment", "ok")
    with pytest.raises(CommandError, match="already approved by alice"):
        call_command("reject", str(approval.pk), "--user", "alice")
    call_command("cancel", str(saga.id), "--user", "alice", "--reason", "test")
    with pytest.raises(CommandError, match="--payload is not valid JSON"):
        call_command("signal", str(waiting.id), "go", "--payload", "{x")
    drive()
    assert Run.objects.get(pk=waiting.pk).output == {"x": 1}
    assert Run.objects.get(pk=asking.pk).status == RunStatus.COMPLETED
    assert Run.objects.get(pk=saga.pk).status == RunStatus.CANCELLED


def test_compensations_run_for_repeated_keys_too(drive, alice):
    run = start_run("undo-loop")
    drive()
    cancel_run(run.id, alice, "stop")
    assert drive() == ["cancelled"]
    keys = Step.objects.filter(run=run, key__startswith="undo:").order_by("seq")
    assert list(keys.values_list("key", flat=True)) == ["undo:hold#3", "undo:hold#2", "undo:hold"]
    assert [effects(f"undo-hold-{i}") for i in range(3)] == [1, 1, 1]


def test_cancelling_a_child_that_never_ran_wakes_its_parent(drive, alice):
    parent = start_run("parent", {"n": 1})
    assert drive(limit=1) == ["waiting"]  # the parent started its child and waits
    child = Run.objects.get(parent=parent)
    cancel_run(child.id, alice, "not needed")
    assert status(parent) == RunStatus.PENDING
    drive()
    assert Run.objects.get(pk=parent.pk).output.startswith("child failed: child run ")


def test_a_caught_child_failure_replays_in_step(drive):
    run = start_run("fan-then-nap")
    drive()
    wait_until(lambda: status(run) == RunStatus.WAITING and drive() == ["completed"], what="nap")
    assert Run.objects.get(pk=run.pk).output == "napped"


def test_a_retried_run_replays_caught_failures_and_retries_only_the_last_one(drive, cast):
    from runs.operations import retry_run

    run = start_run("fallback")
    assert drive() == ["failed"]  # the last step's failure, uncaught, ends the run at once
    retry_run(run.pk, cast["otto"], "it was transient")
    drive()
    run.refresh_from_db()
    assert (run.status, run.output, run.attempt) == (RunStatus.COMPLETED, "done", 2)
    assert workflows.calls == {"primary": 1, "last": 2}


def test_patched_twice_with_one_id_gives_the_same_answer(drive):
    run = start_run("double-patch")
    assert drive() == ["completed"]
    assert Run.objects.get(pk=run.pk).output == [True, True, 1]
