"""Step semantics, executed in-process on the test database (both engines)."""

import math
import time
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from runs.approvals.models import ApprovalRequest
from runs.engine import budget, flow, registry
from runs.engine.budget import forget_cached_scopes, shared_budget_scopes
from runs.engine.context import Engine, RunContext, engine_of
from runs.engine.execution import Execution
from runs.engine.fences import Lease
from runs.errors import ApprovalRevoked, StepMisuse
from runs.models import Event, EventType, Run, RunStatus, Step, StepStatus
from runs.sdk import OutputNotSerializable, UnknownWorkflow, start_run
from tests import workflows
from tests.testapp.models import Effect
from tests.workflows import Crash

pytestmark = pytest.mark.django_db


def steps_of(run) -> dict[str, Step]:
    return {s.key: s for s in Step.objects.filter(run=run)}


def test_a_completed_step_is_never_called_again_on_replay(drive, expire_lease):
    run = start_run("ledger", {"steps": 5})
    workflows.crash_at.add("s3")
    with pytest.raises(Crash):
        drive()
    assert workflows.calls == {"s0": 1, "s1": 1, "s2": 1, "s3": 1}

    expire_lease(run.id)
    assert drive() == ["completed"]

    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED and run.output == sum(range(5))
    assert workflows.calls == {"s0": 1, "s1": 1, "s2": 1, "s3": 2, "s4": 1}


def test_a_step_in_flight_at_a_crash_is_resent_with_the_same_idempotency_key(drive, expire_lease):
    run = start_run("ledger", {"steps": 3})
    workflows.crash_at.add("s1")
    with pytest.raises(Crash):
        drive()
    assert Step.objects.get(run=run, key="s1").status == StepStatus.STARTED
    expire_lease(run.id)
    drive()

    s1 = steps_of(run)["s1"]
    assert s1.status == StepStatus.COMPLETED
    assert (s1.attempt, s1.recovered) == (2, "resent")
    assert s1.idempotency_key == f"{run.id}:s1"
    keys = list(Effect.objects.filter(label="s1").values_list("idempotency_key", flat=True))
    assert keys == [s1.idempotency_key, s1.idempotency_key]
    assert Event.objects.filter(run=run, type="run.recovered").count() == 1
    assert (
        Event.objects.get(run=run, type="step.started", step_key="s1", payload__attempt=2).payload[
            "recovered"
        ]
        == "resent"
    )


def test_a_step_with_reconcile_records_what_it_finds_instead_of_calling_again(drive, expire_lease):
    run = start_run("ledger", {"steps": 3, "reconcile": [1]})
    workflows.crash_at.add("s1")
    with pytest.raises(Crash):
        drive()
    expire_lease(run.id)
    drive()

    s1 = steps_of(run)["s1"]
    assert (s1.status, s1.attempt, s1.recovered) == ("completed", 1, "reconciled")
    assert s1.output == {"found": "s1"}
    assert workflows.calls["s1"] == 1
    assert Effect.objects.filter(label="s1").count() == 1
    assert Run.objects.get(pk=run.pk).status == RunStatus.COMPLETED


def test_reconcile_that_finds_nothing_sends_the_call_again(drive, expire_lease):
    run = start_run("ledger", {"steps": 2, "reconcile": [0]})
    workflows.crash_at.add("s0")
    with pytest.raises(Crash):
        drive()
    Effect.objects.all().delete()  # the call never reached the service
    expire_lease(run.id)
    drive()
    s0 = steps_of(run)["s0"]
    assert (s0.status, s0.attempt, s0.recovered) == ("completed", 2, "resent")
    assert workflows.calls["s0"] == 2


def test_a_key_repeated_in_one_execution_gets_an_occurrence_suffix(drive):
    run = start_run("loop", {"queries": ["lisbon", "berlin", "oslo"]})
    drive()
    run.refresh_from_db()
    assert run.output == ["results for lisbon", "results for berlin", "results for oslo"]
    assert [s.key for s in Step.objects.filter(run=run).order_by("seq")] == [
        "search",
        "search#2",
        "search#3",
    ]


def test_changed_code_under_a_running_run_stops_it_with_a_non_determinism_error(
    drive, expire_lease
):
    run = start_run("shapes", {})
    workflows.crash_at.add("b")
    with pytest.raises(Crash):
        drive()
    workflows.variant["second"] = "c"  # a deploy renamed the second step
    expire_lease(run.id)
    assert drive() == ["failed"]

    run.refresh_from_db()
    assert run.status == RunStatus.FAILED and run.attempt == 1  # not retried
    assert run.error["code"] == "non_determinism"
    assert "'b'" in run.error["message"] and "'c'" in run.error["message"]
    assert steps_of(run)["a"].output == "a"  # nothing recorded was touched or handed over
    assert "c" not in steps_of(run)
    assert workflows.calls.get("c") is None


@pytest.mark.parametrize(
    ("name", "needle"), [("bad-output", "object"), ("nul-output", "NUL character")]
)
def test_output_that_cannot_be_stored_fails_the_step_clearly_and_is_not_retried(
    drive, name, needle
):
    run = start_run(name)
    assert drive() == ["failed"]
    run.refresh_from_db()
    step = steps_of(run)["make"]
    assert step.status == StepStatus.FAILED and step.attempt == 1
    assert step.error["type"] == "OutputNotSerializable"
    assert "'make'" in step.error["message"] and needle in step.error["message"]
    assert run.status == RunStatus.FAILED and run.attempt == 1
    assert run.error["code"] == "step_failed" and "'make'" in run.error["message"]


def test_a_failing_step_is_retried_by_its_policy_and_the_attempts_are_recorded(drive):
    run = start_run("flaky", {"failures": 2, "attempts": 3})
    drive()
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED and run.output == 3
    step = steps_of(run)["call"]
    assert (step.attempt, step.recovered) == (3, "")
    retries = Event.objects.filter(run=run, type="step.retrying").order_by("seq")
    assert [e.payload["error"]["message"] for e in retries] == ["failure 1", "failure 2"]


def test_retries_are_bounded_and_a_step_they_gave_up_on_ends_the_run(drive, settings):
    """The run is not retried from the top on a step's failure (issue 47: 2 step attempts in
    each of 3 run attempts, 6 calls, before): the step's policy had its say."""
    run = start_run("flaky", {"failures": 100, "attempts": 2})
    outcomes = drive()
    assert outcomes == ["failed"]
    run.refresh_from_db()
    assert run.status == RunStatus.FAILED and (run.attempt, run.max_attempts) == (1, 3)
    assert "step 'call' failed after 2 attempts" in run.error["reason"]
    assert workflows.calls["flaky"] == 2


def bank_calls() -> dict[str, int]:
    labels = Effect.objects.values_list("label", flat=True)
    return {label: list(labels).count(label) for label in set(labels)}


@pytest.mark.parametrize(
    ("input", "step", "error", "calls"),
    [
        ({"amount": 500, "to": "B"}, "withdraw", "InsufficientFunds", {"withdraw": 1}),
        (
            {"amount": 50, "to": "nowhere"}, "deposit", "NoSuchAccount",
            {"withdraw": 1, "deposit": 1, "refund": 1},
        ),
    ],
)  # fmt: skip
def test_a_step_error_its_policy_calls_final_reaches_the_bank_once_and_ends_the_run_at_once(
    drive, input, step, error, calls
):
    """Issue 47 section 5: the transfer sample's over-balance withdrawal and invalid-account
    deposit reached the bank 3 times per run (once per run attempt, each retried from the
    top), and the failure became final after two run-level backoffs."""
    run = start_run("transfer", input)
    outcomes = drive()
    assert bank_calls() == calls  # compensated once: the withdrawal is refunded
    assert outcomes == ["failed"]
    run.refresh_from_db()
    assert (run.status, run.attempt) == (RunStatus.FAILED, 1)
    assert not Event.objects.filter(run=run, type=EventType.RUN_RETRYING).exists()
    assert run.error["step"] == step and run.error["cause"]["type"] == error
    assert run.error["cause"]["retryable"] is False  # the policy's word reached the record
    assert steps_of(run)[step].error["retryable"] is False
    assert run.error["final"] is True
    assert f"step {step!r}" in run.error["reason"] and "final" in run.error["reason"]


def test_a_step_its_policy_gave_up_on_ends_the_run_too_and_an_operator_may_retry_it(drive, cast):
    """An outage the step's policy retried 3 times and gave up on: the run is not retried from
    the top (9 calls before); a person who knows the bank is back retries it explicitly."""
    from runs.operations import retry_run

    run = start_run("transfer", {"amount": 50, "to": "B", "down": True})
    outcomes = drive()
    assert bank_calls() == {"withdraw": 3}  # the step's 3 attempts, in 1 run attempt
    assert outcomes == ["failed"]
    run.refresh_from_db()
    assert run.attempt == 1 and run.error["cause"]["retryable"] is True
    assert run.error["final"] is False and "3 attempts" in run.error["reason"]
    retry_run(run.pk, cast["otto"], "the bank is back")
    assert drive() == ["failed"]  # still down: the operator's retry sent it again, 3 times
    assert bank_calls() == {"withdraw": 6}
    assert Run.objects.get(pk=run.pk).attempt == 2


def test_an_error_the_workflow_raises_itself_is_retried_from_the_top_without_resending_a_final_step(
    drive,
):
    """Run-level attempts are for the workflow's own errors: a workflow that wraps a step's
    final failure in an error of its own is retried, and the step's recorded answer replays."""
    run = start_run("transfer", {"amount": 500, "to": "B", "wrap": True})
    assert drive() == ["retrying", "retrying", "failed"]
    assert bank_calls() == {"withdraw": 1}
    run.refresh_from_db()
    assert run.attempt == 3 and run.error["type"] == "RuntimeError"
    assert "final" not in run.error


def test_a_caught_step_failure_replays_as_the_same_failure(drive, expire_lease):
    run = start_run("catches", {})
    workflows.crash_at.add("after")
    with pytest.raises(Crash):
        drive()
    expire_lease(run.id)
    drive()
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED
    assert run.output == "told the model: no such flight"
    assert workflows.calls["boom"] == 1


def test_now_random_and_uuid_are_recorded_once(drive, expire_lease):
    run = start_run("deterministic")
    workflows.crash_at.add("last")
    with pytest.raises(Crash):
        drive()
    first = {
        s.key: s.output for s in Step.objects.filter(run=run, key__in=["now", "random", "uuid"])
    }
    expire_lease(run.id)
    drive()
    run.refresh_from_db()
    assert run.output == {
        "now": first["now"],
        "random": first["random"],
        "uuid": first["uuid"],
    }


def test_idempotency_key_outside_a_step_and_nested_steps_are_clear_errors(drive):
    outside = start_run("misuse", "outside")
    nested = start_run("misuse", "nested")
    drive()
    outside.refresh_from_db()
    nested.refresh_from_db()
    assert outside.status == nested.status == RunStatus.FAILED
    assert "only defined while a step's function runs" in outside.error["message"]
    assert "steps do not nest" in nested.error["message"]


def test_starting_twice_with_one_key_returns_the_same_run():
    first = start_run("ledger", {"steps": 1}, key="order-17")
    second = start_run("ledger", {"steps": 99}, key="order-17")
    assert (first.was_created, second.was_created) == (True, False)
    assert second.id == first.id and second.input == {"steps": 1}
    assert Run.objects.filter(key="order-17").count() == 1


def test_start_run_rejects_unknown_workflows_and_non_json_input():
    with pytest.raises(UnknownWorkflow, match="'ghost'"):
        start_run("ghost")
    with pytest.raises(OutputNotSerializable, match="input of workflow 'ledger'"):
        start_run("ledger", {"steps": object()})
    assert not Run.objects.exists()


def business_statements(queries) -> list[str]:
    """First word of each statement, without the savepoints of the test's own transaction."""
    words = [q["sql"].split()[0].upper() for q in queries.captured_queries]
    return [w for w in words if w not in ("SAVEPOINT", "RELEASE")]


def replay_statements(drive, expire_lease, settings, steps: int) -> list[str]:
    # Eager completions while the history is made: every step is recorded completed before
    # the crash, so the replay measured below replays all of them and sends none again.
    settings.STEPGUARD_EAGER_COMPLETIONS = True
    run = start_run("many", {"steps": steps, "crash": True})
    with pytest.raises(Crash):
        drive()
    settings.STEPGUARD_EAGER_COMPLETIONS = False
    assert Step.objects.filter(run=run, status="completed").count() == steps
    Run.objects.filter(pk=run.pk).update(input={"steps": steps})
    expire_lease(run.id)
    with CaptureQueriesContext(connection) as queries:
        assert drive() == ["completed"]
    return business_statements(queries)


def test_replaying_1000_completed_steps_costs_a_constant_number_of_queries(
    drive, expire_lease, settings
):
    few = replay_statements(drive, expire_lease, settings, 10)
    many = replay_statements(drive, expire_lease, settings, 1000)
    assert many == few
    # claim (halts, stale halted runs, candidates, update, event, fetch) + load all
    # checkpoints + finish (fence, run, event) + the empty claim that ends drive(); on SQLite,
    # one more for the limited workflows' claim when the process registered any (test_flow
    # imports tests.flow_workflows, which declare limits).
    names = {d.name for d in registry.all_workflows()}
    limited = connection.vendor == "sqlite" and any(
        limit != flow.Limit(None, None) for limit in flow.code_limits(names).values()
    )
    assert len(many) <= 15 + limited, many


def held_context(run) -> RunContext:
    """The context a worker holding `run` hands its workflow (the test is that worker)."""
    execution = Execution(Run.objects.get(pk=run.pk), {}, Lease(run.id, run.lease_epoch))
    return RunContext(Engine(execution))


def two_new_steps():
    """A run held by this test, its context, and the statements two new steps cost it."""
    run = start_run("many", {"steps": 2})
    Run.objects.filter(pk=run.pk).update(
        status=RunStatus.RUNNING, lease_until=run.created_at + timedelta(hours=1)
    )
    ctx = held_context(run)
    shared_budget_scopes()  # cached for a second: steps do not look budgets up each time
    # ... and held for the whole measure: on a busy host two steps may take more than a second,
    # and the count would then include a look-up no step made (13 for 12 on a loaded SQLite).
    budget._scopes["at"] = math.inf
    try:
        with CaptureQueriesContext(connection) as queries:
            assert ctx.step("one", int, 1) == 1
            assert ctx.step("two", int, 2) == 2
    finally:
        forget_cached_scopes()
    return run, ctx, queries


def history(run) -> list[tuple[str, str]]:
    return list(Event.objects.filter(run=run).order_by("seq").values_list("type", "step_key"))


def test_a_step_costs_one_write_and_its_completion_rides_with_the_next(drive):
    run, ctx, queries = two_new_steps()
    if connection.vendor == "postgresql":
        # fence + steps + events as data-modifying CTEs: one statement per step.
        assert business_statements(queries) == ["WITH", "WITH"]
    else:
        # one's start: fence, step, event. two's start: one fence for both, one's completion
        # (row, event), two's start (row, event): a single transaction.
        assert business_statements(queries) == [
            *("UPDATE", "INSERT", "INSERT"),
            *("UPDATE", "UPDATE", "INSERT", "INSERT", "INSERT"),
        ]
    assert {k: s.status for k, s in steps_of(run).items()} == {
        "one": "completed",
        "two": "started",  # its completion waits for the run's next write
    }
    assert history(run)[1:] == [
        ("step.started", "one"),
        ("step.completed", "one"),
        ("step.started", "two"),
    ]
    pending = engine_of(ctx).execution.lease.pending
    assert pending is not None and pending.key == "two"


def test_eager_completions_write_each_step_completed_at_once(drive, settings):
    settings.STEPGUARD_EAGER_COMPLETIONS = True
    run, ctx, queries = two_new_steps()
    assert len(business_statements(queries)) == (4 if connection.vendor == "postgresql" else 12)
    assert {s.status for s in steps_of(run).values()} == {"completed"}
    assert engine_of(ctx).execution.lease.pending is None


def test_a_crash_before_the_next_write_resends_the_finished_step_with_its_key(drive, expire_lease):
    run = start_run("many", {"steps": 3, "crash": True})
    with pytest.raises(Crash):  # after s2 returned, before the run's end was written
        drive()
    steps = steps_of(run)
    assert [steps[k].status for k in ("s0", "s1", "s2")] == ["completed", "completed", "started"]

    Run.objects.filter(pk=run.pk).update(input={"steps": 3})
    expire_lease(run.id)
    assert drive() == ["completed"]
    steps = steps_of(run)
    # Exactly what a crash during s2 would have done: s2 again, under its same key.
    assert (steps["s2"].attempt, steps["s2"].recovered) == (2, "resent")
    assert steps["s2"].idempotency_key == f"{run.id}:s2"
    assert [steps[k].attempt for k in ("s0", "s1")] == [1, 1]


def test_a_refused_start_rolls_back_to_a_pending_completion_and_the_failure_carries_it(drive):
    """The approval-gated step is refused inside its transaction: the completion before it,
    rolled back with that transaction, is written with the refusal's record instead."""
    run, ctx, _ = two_new_steps()
    request = ApprovalRequest.objects.create(run=run, step_key="ask", action="pay")
    with pytest.raises(ApprovalRevoked, match="no longer stands"):
        ctx.step("three", int, 3, approval=request.pk)
    assert {k: s.status for k, s in steps_of(run).items()} == {
        "one": "completed",
        "two": "completed",
        "three": "failed",
    }
    assert [t for t, k in history(run) if k == "two"] == ["step.started", "step.completed"]
    assert engine_of(ctx).execution.lease.pending is None


def test_a_transaction_step_records_the_step_before_it_first(drive):
    run, ctx, _ = two_new_steps()

    def dies():
        raise Crash("the process dies inside the business transaction")

    with pytest.raises(Crash):
        ctx.transaction("write", dies)
    # Written before the business transaction began, so its rollback did not take it.
    assert steps_of(run)["two"].status == "completed"


def test_a_transaction_step_commits_its_writes_and_its_row_together(drive):
    """The first run of a transaction step writes its completed row with the function's own
    writes, in one transaction (a refactoring once made every first run fail before it
    committed: the row's columns were given twice)."""
    run, ctx, _ = two_new_steps()
    calls = []

    def write():
        calls.append(1)
        return {"written": True}

    assert ctx.transaction("write", write) == {"written": True}
    step = steps_of(run)["write"]
    assert (step.status, step.kind, step.output, step.attempt) == (
        "completed",
        "transaction",
        {"written": True},
        1,
    )
    assert step.run_attempt == run.attempt and step.started_at and step.finished_at
    assert [t for t, k in history(run) if k == "write"] == ["step.completed"] and calls == [1]


def test_a_carried_completion_is_dated_when_the_step_finished(drive):
    run, _, _ = two_new_steps()
    one = steps_of(run)["one"]
    completed = Event.objects.get(run=run, type="step.completed", step_key="one")
    started_two = Event.objects.get(run=run, type="step.started", step_key="two")
    assert completed.created_at == one.finished_at <= started_two.created_at


def test_a_step_inside_the_workflows_own_transaction_is_refused(drive):
    run, ctx, _ = two_new_steps()
    with pytest.raises(StepMisuse, match=r"use ctx\.transaction"), transaction.atomic():
        ctx.step("three", int, 3)
    # Refused before anything was written: "two" is still pending, and is carried next.
    assert ctx.step("four", int, 4) == 4
    assert steps_of(run)["two"].status == "completed" and "three" not in steps_of(run)


def test_a_recovering_run_completes_each_step_at_once(drive, expire_lease):
    run = start_run("many", {"steps": 2, "crash": True})
    with pytest.raises(Crash):
        drive()
    expire_lease(run.id)
    with pytest.raises(Crash):  # dies again right after the last step, as before
        drive()
    # This time the re-sent s1 was recorded before the crash: it is not sent a third time.
    assert steps_of(run)["s1"].status == "completed" and steps_of(run)["s1"].attempt == 2


def prepared_after_eight_steps() -> int:
    connection.close()  # a new connection: no statement prepared on it yet
    run = start_run("many", {"steps": 8})
    Run.objects.filter(pk=run.pk).update(
        status=RunStatus.RUNNING, lease_until=run.created_at + timedelta(hours=1)
    )
    ctx = held_context(run)
    for i in range(8):
        ctx.step(f"s{i}", int, i)
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE 'WITH%'")
        return cursor.fetchone()[0]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_on_postgresql_the_step_statement_is_prepared_unless_switched_off(settings):
    assert prepared_after_eight_steps() == 1  # from its 5th use, planned once
    settings.STEPGUARD_PREPARED_STATEMENTS = False  # DB_PREPARED_STATEMENTS=0
    assert prepared_after_eight_steps() == 0


def test_a_run_that_kills_its_worker_every_time_is_failed_after_a_bounded_number(
    drive, expire_lease, settings
):
    settings.STEPGUARD_MAX_RECOVERIES = 3
    run = start_run("ledger", {"steps": 2})
    for _ in range(3):  # the first execution and two recoveries all die inside s0
        workflows.crash_at.add("s0")
        with pytest.raises(Crash):
            drive()
        expire_lease(run.id)
    # The fourth execution fails the run at s0 instead of sending s0 again.
    assert drive() == ["failed"]

    run.refresh_from_db()
    assert run.status == RunStatus.FAILED and run.error["code"] == "worker_lost"
    assert "3 times in a row without progress" in run.error["message"]
    assert "during step 's0'" in run.error["message"]
    assert workflows.calls == {"s0": 3}
    assert Event.objects.filter(run=run).last().type == "run.failed"


def test_progress_resets_the_lost_worker_count(drive, expire_lease, settings):
    settings.STEPGUARD_MAX_RECOVERIES = 2
    run = start_run("ledger", {"steps": 4})
    for key in ("s0", "s1", "s2", "s3"):  # one crash per step: progress between each
        workflows.crash_at.add(key)
        with pytest.raises(Crash):
            drive()
        expire_lease(run.id)
    assert drive() == ["completed"]
    assert Run.objects.get(pk=run.pk).output == sum(range(4))


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_on_postgresql_each_step_is_one_statement_and_one_commit():
    run, _, queries = two_new_steps()
    # Outside any transaction: each statement commits by itself.
    assert business_statements(queries) == ["WITH", "WITH"]
    assert history(run)[1:] == [
        ("step.started", "one"),
        ("step.completed", "one"),
        ("step.started", "two"),
    ]


@pytest.mark.parametrize(
    ("workflow", "data"),
    [("flaky", {"failures": 1, "attempts": 2}), ("fails-once", None)],
    ids=["retried in place", "run retried"],
)
def test_a_retried_steps_times_are_its_last_attempts(drive, workflow, data):
    """Issue 34 item 4: after a retry the step read 13 min 9 s with a full-width bar, the
    time of all its attempts; each attempt's start is in its step.started or step.retrying
    event."""
    workflows.hooks[workflow] = lambda: time.sleep(1.5)  # a slow first attempt, which fails
    run = start_run(workflow, data)
    while drive():
        pass
    step = Step.objects.get(run=run, key="call")
    assert (step.status, step.attempt) == ("completed", 2)
    assert (step.finished_at - step.started_at).total_seconds() < 1.5
