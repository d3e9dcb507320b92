"""Halts, budgets, operator actions, permissions and the audit trail (in-process)."""

from decimal import Decimal

import pytest
from django.core.management import CommandError, call_command
from django.db import DatabaseError, transaction

from runs.approvals.models import ApprovalRequest
from runs.approvals.services import decide
from runs.engine.holds import holds_on
from runs.models import GLOBAL, BudgetLedger, Event, Policy, Run, RunStatus, Step
from runs.operations import (
    OperationError,
    cancel_run,
    fork_preview,
    fork_run,
    halt,
    retry_run,
    set_budget,
    unhalt,
)
from runs.sdk import send_signal, start_run
from tests import workflows
from tests.conftest import wait_until
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db


def status(run) -> str:
    return Run.objects.get(pk=run.pk).status


def effects(label: str) -> int:
    return Effect.objects.filter(label=label).count()


def test_a_halt_stops_a_running_run_at_its_next_step_and_only_unhalt_resumes_it(
    drive, expire_lease, cast
):
    run = start_run("ledger", {"steps": 6})
    workflows.hooks["s2"] = lambda: halt(run, cast["otto"], "runaway loop")
    assert drive() == ["halted"]
    steps = {s.key: s.status for s in Step.objects.filter(run=run)}
    # The step executing when the halt landed finished and was checkpointed; nothing after it.
    assert steps == {"s0": "completed", "s1": "completed", "s2": "completed"}
    run.refresh_from_db()
    assert (run.status, run.halted_by, run.halt_reason) == ("halted", "otto", "runaway loop")
    assert run.worker_id is None and run.lease_until is None

    # Restarts, recovery and a repeated start with its key do not clear it.
    assert drive() == []
    Run.objects.filter(pk=run.pk).update(key="k1")
    assert start_run("ledger", {"steps": 6}, key="k1").status == RunStatus.HALTED

    unhalt(run, cast["otto"], "loop fixed")
    assert drive() == ["completed"]
    assert [effects(f"s{i}") for i in range(6)] == [1] * 6


def test_halting_a_parent_halts_its_children(drive, cast):
    parent = start_run("parent", {"n": 2})
    assert drive(limit=1) == ["waiting"]
    halt(parent, cast["otto"], "stop the whole tree")
    assert Run.objects.filter(parent=parent, status=RunStatus.HALTED).count() == 2
    assert drive() == []
    unhalt(parent, cast["otto"], "go on")
    drive()
    assert status(parent) == RunStatus.COMPLETED


def test_workflow_and_global_halts_stop_matching_runs_including_waiting_ones(drive, cast):
    waiting = start_run("waiter", {})
    sleeping = start_run("sleeper", {"seconds": 0.2})
    drive()
    assert status(waiting) == status(sleeping) == RunStatus.WAITING
    halt("workflow:waiter", cast["otto"], "bad deploy of waiter")
    assert status(waiting) == RunStatus.HALTED and status(sleeping) == RunStatus.WAITING
    send_signal(waiting.id, "go", 1)  # a halted run's waits do not wake it
    assert status(waiting) == RunStatus.HALTED

    halt("all", cast["otto"], "incident 42")
    fresh = start_run("ledger", {"steps": 1})
    assert status(sleeping) == RunStatus.HALTED
    wait_until(lambda: Run.objects.get(pk=sleeping.pk).wake_at is not None, what="x")
    assert drive() == []  # not even the due timer or a new run

    unhalt("all", cast["otto"], "incident over")
    drive()
    assert status(sleeping) in (RunStatus.WAITING, RunStatus.COMPLETED)
    assert status(fresh) == RunStatus.COMPLETED
    assert status(waiting) == RunStatus.HALTED  # its own workflow halt still stands
    unhalt("workflow:waiter", cast["otto"], "fixed")
    drive()
    assert Run.objects.get(pk=waiting.pk).output == 1


def test_an_approved_step_does_not_start_after_a_later_halt(drive, cast):
    run = start_run("approver", {"amount": 70, "cooling_off": 0.2})
    drive()
    decide(ApprovalRequest.objects.get(run=run).pk, "approve", cast["ada"])
    assert drive() == ["waiting"]
    halt(run, cast["otto"], "fraud suspected")
    wait_until(lambda: drive() == [] and effects("charge") == 0, what="the wake time")
    assert status(run) == RunStatus.HALTED
    unhalt(run, cast["otto"], "cleared")
    seen: list = []
    wait_until(
        lambda: seen.append(drive()) or seen[-1] == ["completed"],
        what=lambda: (  # one clean CI timed out here: say what the run and the claims were
            f"the run to finish: {status(run)}, "
            f"claims gave {seen[-5:]}, events "
            f"{list(Event.objects.filter(run=run).values_list('type', flat=True))[-6:]}"
        ),
    )
    assert effects("charge") == 1


def test_a_run_pauses_before_the_step_that_would_exceed_its_budget(drive, cast):
    run = start_run("metered", {"steps": 5}, budget_usd=Decimal("3.5"))
    assert drive() == ["over_budget"]
    run.refresh_from_db()
    assert run.cost_micros == 3_000_000 and run.reserved_micros == 0  # never past 3.5
    assert [effects(f"call-{i}") for i in range(5)] == [1, 1, 1, 0, 0]
    exceeded = Event.objects.get(run=run, type="budget.exceeded").payload
    assert exceeded == {
        "budget": "run",
        "unit": "micro-USD",
        "limit": 3_500_000,
        "spent": 3_000_000,
        "estimate": 1_000_000,
    }
    assert Event.objects.filter(run=run, type="budget.warning", payload__budget="run").count() == 1

    set_budget(run, cast["otto"], "worth it", usd=Decimal("10"))
    assert status(run) == RunStatus.PENDING
    assert drive() == ["completed"]
    run.refresh_from_db()
    assert (run.cost_micros, run.tokens_in, run.tokens_out) == (5_000_000, 500, 250)
    step = Step.objects.filter(run=run, key="call#5").get()
    assert (step.cost_micros, step.tokens_in, step.tokens_out) == (1_000_000, 100, 50)


def test_without_an_estimate_a_step_starts_until_the_budget_is_spent(drive):
    run = start_run("metered", {"steps": 5, "estimate": False}, budget_usd=Decimal("2.5"))
    assert drive() == ["over_budget"]
    assert Run.objects.get(pk=run.pk).cost_micros == 3_000_000  # the third step crossed it
    assert effects("call-3") == 0


def test_a_token_budget_works_the_same_way(drive):
    run = start_run("metered", {"steps": 4}, budget_tokens=400)
    assert drive() == ["over_budget"]
    assert Run.objects.get(pk=run.pk).tokens_in == 200


def test_a_shared_workflow_budget_caps_all_its_runs_together(drive, cast):
    set_budget("workflow:metered", cast["otto"], "daily cap", usd=Decimal("4"))
    runs = [start_run("metered", {"steps": 3}) for _ in range(3)]
    drive()
    assert sum(Run.objects.get(pk=r.pk).cost_micros for r in runs) == 4_000_000
    ledger = BudgetLedger.objects.get(scope="metered")
    assert (ledger.spent_micros, ledger.reserved_micros) == (4_000_000, 0)
    paused = Run.objects.filter(status=RunStatus.OVER_BUDGET)
    assert paused.count() == 2
    assert Event.objects.filter(
        type="budget.exceeded", payload__budget="workflow 'metered' daily"
    ).exists()


def test_workflow_default_run_budget_applies_to_new_runs(cast):
    set_budget("workflow:metered", cast["otto"], "default", run_usd=Decimal("2"))
    assert start_run("metered", {"steps": 1}).budget_micros == 2_000_000
    assert start_run("ledger", {"steps": 1}).budget_micros is None


@pytest.mark.parametrize(
    ("action", "message"),
    [
        (lambda run, u: unhalt(run, u, "x"), "vera may not lift halts (needs runs.unhalt_run)"),
        (lambda run, u: halt(run, u, "x"), "vera may not halt runs"),
        (lambda run, u: set_budget(run, u, "x", usd=1), "vera may not set budgets"),
        (lambda run, u: cancel_run(run.pk, u, "x"), "vera may not cancel runs"),
        (lambda run, u: retry_run(run.pk, u, "x"), "vera may not retry runs"),
        (
            lambda run, u: decide(ApprovalRequest.objects.get().pk, "approve", u),
            "vera may not decide approvals",
        ),
    ],
)
def test_a_viewer_cannot_act_and_is_told_why(drive, cast, action, message):
    run = start_run("approver", {"amount": 1})
    drive()
    with pytest.raises(OperationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        action(run, cast["vera"])


def test_a_cancelled_runs_approval_is_expired_and_cannot_be_approved(drive, cast):
    """Issue 31 item 4: it stayed pending forever, in the inbox, and could still be approved."""
    run = start_run("approver", {"amount": 70})
    assert drive() == ["waiting"]
    request = ApprovalRequest.objects.get(run=run)
    cancel_run(run.pk, cast["otto"], "not needed")
    assert drive() == ["cancelled"]
    request.refresh_from_db()
    assert request.status == "expired" and request.decided_by is None
    with pytest.raises(OperationError, match=f"approval #{request.pk} was already expired"):
        decide(request.pk, "approve", cast["ada"])


def test_an_approval_left_pending_on_a_finished_run_cannot_be_decided(drive, cast):
    """A request left pending by an older version (before runs expired theirs as they ended)."""
    run = start_run("approver", {"amount": 70})
    drive()
    cancel_run(run.pk, cast["otto"], "not needed")
    drive()
    ApprovalRequest.objects.filter(run=run).update(status="pending")
    with pytest.raises(OperationError, match=f"its run {run.pk} is cancelled"):
        decide(ApprovalRequest.objects.get(run=run).pk, "reject", cast["ada"])
    assert ApprovalRequest.objects.get(run=run).status == "pending"


def test_an_approver_cannot_unhalt_and_an_operator_cannot_decide(drive, cast):
    run = start_run("approver", {"amount": 1})
    drive()
    halt(run, cast["otto"], "check")
    with pytest.raises(OperationError, match="ada may not lift halts"):
        unhalt(run, cast["ada"], "me")
    with pytest.raises(OperationError, match="otto may not decide approvals"):
        decide(ApprovalRequest.objects.get().pk, "approve", cast["otto"])


def test_lifting_a_halt_needs_a_reason(cast):
    run = start_run("ledger", {"steps": 1})
    halt(run, cast["otto"], "check")
    with pytest.raises(OperationError, match="needs a reason"):
        unhalt(run, cast["otto"], " ")
    assert status(run) == RunStatus.HALTED


def test_fork_from_a_step_reuses_what_came_before_and_runs_the_rest(drive, cast):
    origin = start_run("ledger", {"steps": 10})
    drive()
    before = list(Step.objects.filter(run=origin).values())
    assert [s["key"] for s in fork_preview(origin.pk, "s6")] == ["s6", "s7", "s8", "s9"]
    fork = fork_run(origin.pk, "s6", cast["otto"], "replay the tail with the new prompt")
    drive()
    fork.refresh_from_db()
    assert (fork.status, fork.output, fork.forked_from_id, fork.forked_at_seq) == (
        "completed", 45, origin.pk, 6,
    )  # fmt: skip
    assert [effects(f"s{i}") for i in range(10)] == [1] * 6 + [2] * 4
    assert list(Step.objects.filter(run=origin).values()) == before  # origin unchanged
    assert list(origin.forks.all()) == [fork]
    assert Event.objects.get(run=origin, type="run.forked").payload["fork"] == str(fork.pk)


def test_retry_reruns_a_failed_run_from_its_failure(drive, cast):
    run = start_run("flaky", {"failures": 1, "attempts": 1}, max_attempts=1)
    assert drive() == ["failed"]
    retried = retry_run(run.pk, cast["otto"], "upstream fixed")
    assert (retried.status, retried.attempt, retried.max_attempts) == ("pending", 2, 2)
    drive()
    run.refresh_from_db()
    assert (run.status, run.output) == (RunStatus.COMPLETED, 2)
    assert Event.objects.get(run=run, type="run.retry_requested").actor == "otto"


def test_only_failed_runs_can_be_retried(cast):
    with pytest.raises(OperationError, match="only failed runs"):
        retry_run(start_run("ledger", {"steps": 1}).pk, cast["otto"], "no")


def test_events_cannot_be_edited():
    run = start_run("ledger", {"steps": 1})
    with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
        Event.objects.filter(run=run).update(type="forged")


def test_the_audit_trail_lists_every_operator_action_with_its_actor(drive, cast):
    run = start_run("approver", {"amount": 5})
    drive()
    decide(ApprovalRequest.objects.get(run=run).pk, "approve", cast["ada"], "ok")
    halt(run, cast["otto"], "pause")
    set_budget(run, cast["otto"], "cap", usd=Decimal("9"))
    unhalt(run, cast["otto"], "resume")
    halt("workflow:ledger", cast["otto"], "freeze ledger")
    set_budget("all", cast["otto"], "global cap", usd=Decimal("100"))
    cancel_run(run.pk, cast["otto"], "not needed")
    actions = list(
        Event.objects.exclude(actor="system").order_by("created_at").values_list("actor", "type")
    )
    assert actions == [
        ("ada", "approval.decided"),
        ("otto", "run.halted"),
        ("otto", "budget.set"),
        ("otto", "run.unhalted"),
        ("otto", "scope.halted"),
        ("otto", "budget.set"),
        ("otto", "run.cancel_requested"),
    ]
    reasons = Event.objects.exclude(actor="system").exclude(type="approval.decided")
    assert all(e.payload.get("reason") for e in reasons)


def test_the_halt_command_halts_a_run_as_the_named_user(cast):
    run = start_run("ledger", {"steps": 3})
    call_command("halt", "--run", str(run.pk), "--user", "otto", "--reason", "look")
    assert status(run) == RunStatus.HALTED
    assert Run.objects.get(pk=run.pk).halted_by == "otto"


def test_the_unhalt_command_checks_the_named_users_permission(drive, cast):
    run = start_run("ledger", {"steps": 3})
    call_command("halt", "--run", str(run.pk), "--user", "otto", "--reason", "look")
    with pytest.raises(CommandError, match="vera may not lift halts"):
        call_command("unhalt", "--run", str(run.pk), "--user", "vera", "--reason", "x")
    assert status(run) == RunStatus.HALTED
    call_command("unhalt", "--run", str(run.pk), "--user", "otto", "--reason", "ok")
    assert drive() == ["completed"]


def test_the_budget_command_sets_a_workflow_budget_and_names_a_bad_amount(cast):
    call_command("budget", "--workflow", "ledger", "--usd", "5", "--user", "otto", "--reason", "c")
    assert Policy.objects.get(scope="ledger").daily_budget_micros == 5_000_000
    with pytest.raises(CommandError, match="not an amount of USD"):
        call_command("budget", "--all", "--usd", "lots", "--user", "otto", "--reason", "c")
    assert not Policy.objects.filter(scope=GLOBAL).exclude(daily_budget_micros=None).exists()


def test_the_fork_command_forks_a_run_from_a_step(drive, cast):
    run = start_run("ledger", {"steps": 3})
    drive()
    call_command(
        "fork", str(run.pk), "--from-step", "s1", "--user", "otto", "--reason", "r", "--yes"
    )
    assert Run.objects.filter(forked_from=run).count() == 1


def test_a_step_retry_is_a_new_start_and_a_halt_stops_it(drive, cast):
    run = start_run("halt-then-fail")
    workflows.hooks["call"] = lambda: halt(run, cast["otto"], "stop retrying")
    assert drive() == ["halted"]
    assert workflows.calls["call"] == 1


def test_a_step_resent_after_a_crash_is_not_blocked_by_its_own_reservation(
    drive, expire_lease, cast
):
    set_budget("workflow:metered", cast["otto"], "cap", usd=Decimal("1"))
    run = start_run("metered", {"steps": 1}, budget_usd=Decimal("1"))
    workflows.crash_at.add("call-0")
    with pytest.raises(workflows.Crash):
        drive()
    expire_lease(run.id)
    assert drive() == ["completed"]
    run.refresh_from_db()
    assert (run.cost_micros, run.reserved_micros) == (1_000_000, 0)
    ledger = BudgetLedger.objects.get(scope="metered")
    assert (ledger.spent_micros, ledger.reserved_micros) == (1_000_000, 0)


def test_a_cancelled_run_gives_back_what_its_interrupted_step_held(drive, expire_lease, cast):
    set_budget("workflow:metered", cast["otto"], "cap", usd=Decimal("10"))
    run = start_run("metered", {"steps": 2, "usd": "3"})
    workflows.crash_at.add("call-0")
    with pytest.raises(workflows.Crash):
        drive()
    assert BudgetLedger.objects.get(scope="metered").reserved_micros == 3_000_000
    cancel_run(run.pk, cast["otto"], "never mind")
    expire_lease(run.id)
    assert drive() == ["cancelled"]
    assert BudgetLedger.objects.get(scope="metered").reserved_micros == 0
    assert Run.objects.get(pk=run.pk).reserved_micros == 0


def test_cancelling_a_run_paused_over_budget_ends_it(drive, cast):
    run = start_run("metered", {"steps": 3}, budget_usd=Decimal("1"))
    assert drive() == ["over_budget"]
    cancel_run(run.pk, cast["otto"], "too expensive")
    assert drive() == ["cancelled"]


def test_a_workflow_halt_stops_its_runs_children_of_other_workflows(drive, cast):
    parent = start_run("parent", {"n": 1})
    assert drive(limit=1) == ["waiting"]
    halt("workflow:parent", cast["otto"], "freeze")
    child = Run.objects.get(parent=parent)
    # Held by its parent's workflow halt, as state: it has no hold of its own.
    assert child.status == RunStatus.HALTED and child.halted_at is None
    assert [(h.scope, h.by) for h in holds_on(child)] == [("workflow parent", "otto")]
    assert drive() == []
    unhalt("workflow:parent", cast["otto"], "thaw")
    drive()
    assert status(parent) == RunStatus.COMPLETED


def test_an_explicit_zero_budget_is_kept(cast):
    set_budget("all", cast["otto"], "default", run_usd=Decimal("5"))
    assert start_run("ledger", {"steps": 1}, budget_usd=Decimal("0")).budget_micros == 0


def test_a_fork_of_a_halted_run_is_halted(drive, cast):
    run = start_run("ledger", {"steps": 3})
    workflows.hooks["s1"] = lambda: halt(run, cast["otto"], "look first")
    drive()
    fork = fork_run(run.pk, "s1", cast["otto"], "try again")
    assert (fork.status, fork.halted_by) == (RunStatus.HALTED, "otto")


def test_the_held_runs_sweep_reads_nothing_while_nothing_is_held():
    """An idle poll must cost what it touches, not what the table holds (issue 35): with no
    hold anywhere the sweep is one statement over the policies and the held runs' partial
    index; a hold anywhere adds the sweep itself."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    from django.utils import timezone

    from runs.engine.worker import WorkerProcess

    Run.objects.bulk_create(
        Run(workflow="nobody.serves", version="1", wake_at=timezone.now()) for _ in range(30)
    )
    worker = WorkerProcess(concurrency=1)
    with CaptureQueriesContext(connection) as nothing_held:
        assert worker.claim(1) == []
    Run.objects.create(workflow="nobody.serves", version="1", status=RunStatus.HALTED,
                       halted_at=timezone.now())  # fmt: skip
    with CaptureQueriesContext(connection) as one_held:
        assert worker.claim(1) == []
    assert len(one_held) == len(nothing_held) + 1
    if connection.vendor == "postgresql":
        from runs.engine.worker import HELD_SCOPES

        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SET LOCAL enable_seqscan = off")
            cursor.execute(f"EXPLAIN {HELD_SCOPES}")
            plan = "\n".join(row[0] for row in cursor.fetchall())
        assert "runs_run_halted_idx" in plan, plan
