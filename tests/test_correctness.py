"""Regression tests for the holes found by trying the engine as a hostile user would.

Each test failed on the engine before its fix. In-process, on both engines unless marked.
"""

import json
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal

import pytest
from django.db import connection
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runs.approvals.models import ApprovalRequest
from runs.engine.fences import Lease
from runs.engine.lifecycle import execute
from runs.engine.serialization import to_json
from runs.errors import Halted, OperationError, OverBudget
from runs.models import BudgetLedger, Event, Run, RunStatus, Step, StepStatus
from runs.operations import cancel_run, fork_run, halt, set_budget, unhalt
from runs.sdk import send_signal, start_run
from tests import workflows
from tests.conftest import wait_until
from tests.testapp.models import Effect
from tests.workflows import Crash

pytestmark = pytest.mark.django_db

# -- 1. replay hands back exactly what the live run saw ------------------------------------------

_text = st.text(
    alphabet=st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=12
)
_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([1e16, -0.0, 0.0, 1.5e300, 5e-324, 1.0, 10.0**21])
    | _text
)
json_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=6),
    max_leaves=25,
)


def exact(value) -> str:
    """A rendering that tells apart what replay must keep: types, key order, -0.0, 1e16."""
    return repr(value)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(value=json_values)
def test_every_value_handed_to_workflow_code_replays_exactly_as_it_was_live(drive, value):
    workflows.seen.clear()
    live = to_json(value, what="the test value")
    run = start_run("json-echo", {"value": value})
    assert drive() == ["waiting"]
    send_signal(run.id, "go", value)
    assert drive() == ["waiting"]
    send_signal(run.id, "end")
    assert drive() == ["completed"]
    got: dict[str, list[str]] = {}
    for what, handed in workflows.seen:
        got.setdefault(what, []).append(exact(handed))
    assert got["input"] == [exact({"value": live})] * 3
    assert got["make"] == [exact(live)] * 3  # live, then two replays
    assert got["signal"] == [exact(live)] * 2  # live, then one replay
    assert exact(Run.objects.get(pk=run.pk).output) == exact(live)


def test_a_loop_over_a_dict_output_books_the_same_cities_in_the_same_order_after_a_crash(
    drive, expire_lease
):
    plan = {"Zurich": 1, "Amsterdam": 2, "Rome": 3, "Oslo": 4}
    run = start_run("city-loop", {"plan": plan})
    workflows.crash_at.add("book-Amsterdam")
    with pytest.raises(Crash):
        drive()
    expire_lease(run.id)
    assert drive() == ["completed"]
    booked = list(Effect.objects.order_by("id").values_list("idempotency_key", "label"))
    labels_by_key: dict[str, set[str]] = {}
    for key, label in booked:
        labels_by_key.setdefault(key, set()).add(label)
    assert all(len(labels) == 1 for labels in labels_by_key.values()), labels_by_key
    assert [label for _, label in booked] == [
        "book-Zurich", "book-Amsterdam", "book-Amsterdam", "book-Rome", "book-Oslo"
    ]  # fmt: skip
    assert Run.objects.get(pk=run.pk).output == list(plan)


def test_step_outputs_are_stored_as_the_json_text_the_workflow_saw(drive):
    run = start_run("json-echo", {"value": {"zurich": 1e16, "a": -0.0}})
    drive()
    with connection.cursor() as cursor:
        cursor.execute("SELECT output FROM runs_step WHERE run_id = %s AND key = 'make'",
                       [Run._meta.pk.get_db_prep_value(run.pk, connection)])  # fmt: skip
        (stored,) = cursor.fetchone()
    text = stored if isinstance(stored, str) else json.dumps(stored, separators=(",", ":"))
    assert json.loads(text) == {"zurich": 1e16, "a": -0.0}
    assert list(json.loads(text)) == ["zurich", "a"]
    assert Run.objects.get(pk=run.pk).status == RunStatus.WAITING


# -- shared helpers ---------------------------------------------------------------------------


@pytest.fixture
def clock(monkeypatch):
    """Moves the engine's clock (django.utils.timezone.now) forward or to a given instant."""
    from django.utils import timezone as tz

    real, offset = tz.now, [timedelta(0)]
    monkeypatch.setattr(tz, "now", lambda: real() + offset[0])

    class Clock:
        def set(self, when: datetime) -> None:
            offset[0] = when - real()

        def advance(self, delta: timedelta) -> None:
            offset[0] += delta

    return Clock()


def effects(label: str) -> int:
    return Effect.objects.filter(label=label).count()


def holds_on(run):
    from runs.engine.holds import holds_on

    return holds_on(run)


def status(run) -> str:
    return Run.objects.get(pk=run.pk).status


def assert_holds_balanced() -> None:
    """Reserved equals held: a run's and a ledger's reservations are exactly the holds of
    started steps (so zero when none is started)."""
    for run in Run.objects.all():
        started = list(Step.objects.filter(run=run, status=StepStatus.STARTED))
        held = (sum(s.reserved_micros for s in started), sum(s.reserved_tokens for s in started))
        assert (run.reserved_micros, run.reserved_tokens) == held, run
    for ledger in BudgetLedger.objects.all():
        held = [
            s
            for s in Step.objects.filter(status=StepStatus.STARTED, reserved_on=ledger.day)
            if ledger.scope in (getattr(s, "reserved_scopes", None) or [ledger.scope])
        ]
        assert ledger.reserved_micros == sum(s.reserved_micros for s in held), ledger
        assert ledger.reserved_tokens == sum(s.reserved_tokens for s in held), ledger


def crash_then_recover(drive, expire_lease, run, label: str) -> list[str]:
    workflows.crash_at.add(label)
    with pytest.raises(Crash):
        drive()
    expire_lease(run.id)
    return drive()


# -- 2. a cancel undoes every completed step, whatever the run caught before ----------------------


def test_a_cancel_after_a_caught_failure_runs_every_compensation_newest_first(drive, cast):
    run = start_run("catch-saga")
    assert drive() == ["waiting"]
    cancel_run(run.pk, cast["otto"], "customer gave up")
    assert drive() == ["cancelled"]
    undone = list(
        Effect.objects.filter(label__startswith="undo-").order_by("id").values_list("label")
    )
    assert undone == [("undo-charge",), ("undo-reserve",)]
    event = Event.objects.get(run=run, type="run.cancelled")
    assert event.payload["compensated"] == ["charge", "reserve"]
    assert drive() == []  # nothing left to do, nothing undone twice


# -- 3. a fork undoes only what it did, and keeps the origin's options ----------------------------


def test_a_fork_of_a_compensated_run_does_not_refund_the_origins_charge_again(drive, cast):
    origin = start_run("saga", {"fail": True}, max_attempts=1)
    assert drive() == ["failed"]
    assert (effects("undo-charge"), effects("undo-reserve")) == (1, 1)
    fork = fork_run(origin.pk, "ship", cast["otto"], "try the shipping again")
    assert fork.max_attempts == 1  # every option the user set travels with the fork
    assert drive() == ["failed"]  # ship fails again, in the fork
    assert (effects("undo-charge"), effects("undo-reserve")) == (1, 1)
    assert Event.objects.get(run=fork, type="run.failed").payload["compensated"] == []


def test_cancelling_a_fork_of_a_completed_run_refunds_nothing_it_did_not_do(drive, cast):
    origin = start_run("saga", {})
    drive()
    send_signal(origin.pk, "confirm", "ok")
    assert drive() == ["completed"]
    fork = fork_run(origin.pk, "email", cast["otto"], "resend the email")
    cancel_run(fork.pk, cast["otto"], "changed my mind")
    assert drive() == ["cancelled"]
    assert effects("undo-charge") == effects("undo-reserve") == 0


# -- 4. an unhalt or budget raise racing a pause is never lost ----------------------------------


def test_an_unhalt_that_lands_while_the_worker_pauses_is_not_lost(drive, cast, monkeypatch):
    from runs.engine import lifecycle

    run = start_run("ledger", {"steps": 3})
    workflows.hooks["s0"] = lambda: halt(run, cast["otto"], "look")
    pause = lifecycle._pause

    def unhalt_then_pause(run_, lease, stop):
        assert isinstance(stop, Halted)  # the step start was refused for the halt...
        unhalt(run, cast["otto"], "false alarm")  # ...and the unhalt commits before the pause
        return pause(run_, lease, stop)

    monkeypatch.setattr(lifecycle, "_pause", unhalt_then_pause)
    assert drive() == ["pending", "completed"]
    assert Run.objects.get(pk=run.pk).halted_at is None
    assert Event.objects.filter(run=run, type="run.unhalted", actor="otto").count() == 1
    assert Event.objects.filter(run=run, type="run.requeued").count() == 1


def test_a_budget_raised_while_the_worker_pauses_is_not_lost(drive, cast, monkeypatch):
    from runs.engine import lifecycle

    run = start_run("metered", {"steps": 3}, budget_usd=Decimal("1"))
    pause = lifecycle._pause

    def raise_budget_then_pause(run_, lease, stop):
        assert isinstance(stop, OverBudget)
        set_budget(run, cast["otto"], "more", usd=Decimal("10"))
        return pause(run_, lease, stop)

    monkeypatch.setattr(lifecycle, "_pause", raise_budget_then_pause)
    assert drive() == ["pending", "completed"]
    run.refresh_from_db()
    assert (run.cost_micros, run.budget_micros, run.status) == (3_000_000, 10_000_000, "completed")


# -- 5 and 6. shared daily budgets across UTC midnight --------------------------------------------


def _before_midnight(clock) -> date:
    now = datetime.now(UTC)
    midnight = datetime.combine(now.date() + timedelta(days=1), time(0), tzinfo=UTC)
    clock.set(midnight - timedelta(seconds=5))  # well within a lease of midnight
    return midnight.date() - timedelta(days=1)


def test_a_step_reserved_before_midnight_books_its_spend_on_that_day(drive, cast, clock):
    set_budget("workflow:metered", cast["otto"], "cap", usd=Decimal("1"))
    day = _before_midnight(clock)
    first = start_run("metered", {"steps": 1, "usd": "0.6"})
    second = start_run("metered", {"steps": 1, "usd": "0.6"})
    Run.objects.filter(pk=second.pk).update(wake_at=datetime.now(UTC) + timedelta(days=9))

    def after_midnight_another_run_spends():
        clock.advance(timedelta(seconds=10))
        Run.objects.filter(pk=second.pk).update(wake_at=datetime.now(UTC) - timedelta(days=1))
        assert drive() == ["completed"]  # runs inside the first run's step

    workflows.hooks["call-0"] = after_midnight_another_run_spends
    assert drive() == ["completed"]
    spent = dict(BudgetLedger.objects.values_list("day", "spent_micros"))
    assert spent == {day: 600_000, day + timedelta(days=1): 600_000}
    assert status(first) == status(second) == RunStatus.COMPLETED
    assert_holds_balanced()


def test_a_step_resent_the_next_day_is_checked_against_that_day(drive, expire_lease, cast, clock):
    set_budget("workflow:metered", cast["otto"], "cap", usd=Decimal("1"))
    _before_midnight(clock)
    run = start_run("metered", {"steps": 1, "usd": "0.6"})
    workflows.crash_at.add("call-0")
    with pytest.raises(Crash):
        drive()
    # The rest of the day goes to steps without estimates: the day ends over its budget.
    other = start_run("metered", {"steps": 1, "usd": "1", "estimate": False})
    assert drive() == ["completed"]
    clock.advance(timedelta(seconds=10))
    expire_lease(run.id)
    assert drive() == ["completed"]  # re-sent, and checked against today's ledger
    assert status(other) == RunStatus.COMPLETED
    assert_holds_balanced()


# -- 7. child runs get their workflow's default budget --------------------------------------------


def test_a_child_run_gets_its_workflows_default_run_budget(drive, cast):
    set_budget("workflow:metered", cast["otto"], "default", run_usd=Decimal("2"))
    parent = start_run("parent", {"n": 1, "child": "metered", "steps": 5})
    drive()
    child = Run.objects.get(parent=parent)
    assert child.budget_micros == 2_000_000
    assert child.status == RunStatus.OVER_BUDGET and child.cost_micros == 2_000_000


# -- 8. reservations never leak -----------------------------------------------------------------


@pytest.mark.parametrize("policy", ["reconcile", "resend"])
def test_a_recovered_step_gives_back_what_it_held(drive, expire_lease, cast, policy):
    set_budget("workflow:metered-ambiguous", cast["otto"], "cap", usd=Decimal("100"))
    run = start_run("metered-ambiguous", {"policy": policy}, budget_usd=Decimal("10"))
    assert crash_then_recover(drive, expire_lease, run, "paid") == ["completed"]
    run.refresh_from_db()
    assert run.reserved_micros == 0 and run.reserved_tokens == 0
    assert_holds_balanced()


@pytest.mark.parametrize("resolution", ["happened", "fail"])
def test_a_step_resolved_by_a_person_gives_back_what_it_held(drive, expire_lease, cast, resolution):
    from runs.approvals.services import resolve

    set_budget("workflow:metered-ambiguous", cast["otto"], "cap", usd=Decimal("100"))
    run = start_run("metered-ambiguous", {"policy": "ask"}, budget_usd=Decimal("10"))
    assert crash_then_recover(drive, expire_lease, run, "paid") == ["waiting"]
    request = ApprovalRequest.objects.get(run=run)
    output = {"output": "paid"} if resolution == "happened" else {}
    resolve(request.pk, resolution, cast["ada"], **output)
    assert drive() == ["completed" if resolution == "happened" else "failed"]
    assert_holds_balanced()


def test_a_run_failed_by_the_lost_worker_bound_gives_back_its_reservation(
    drive, expire_lease, cast, settings
):
    settings.STEPGUARD_MAX_RECOVERIES = 2
    set_budget("workflow:metered", cast["otto"], "cap", usd=Decimal("100"))
    run = start_run("metered", {"steps": 1}, budget_usd=Decimal("10"))
    for _ in range(2):
        workflows.crash_at.add("call-0")
        with pytest.raises(Crash):
            drive()
        expire_lease(run.id)
    assert drive() == ["failed"]
    assert Run.objects.get(pk=run.pk).error["code"] == "worker_lost"
    assert_holds_balanced()


# -- 9. a fork past an approval keeps the approval ------------------------------------------------


def test_a_fork_past_an_approval_runs_the_guarded_step(drive, cast):
    from runs.approvals.services import decide

    origin = start_run("approver", {"amount": 70})
    drive()
    decide(ApprovalRequest.objects.get(run=origin).pk, "approve", cast["ada"])
    assert drive() == ["completed"]
    fork = fork_run(origin.pk, "charge", cast["otto"], "charge again after the refund")
    assert drive() == ["completed"]
    assert Run.objects.get(pk=fork.pk).output["approved_by"] == "ada"
    assert effects("charge") == 2


# -- 10. halts are state, not text ----------------------------------------------------------------


def test_unhalting_a_workflow_does_not_lift_a_runs_own_halt_whatever_its_reason(drive, cast):
    run = start_run("waiter", {})
    drive()
    halt(run, cast["otto"], "workflow waiter halted: looks like a cascade, is not")
    halt("workflow:waiter", cast["otto"], "bad deploy")
    unhalt("workflow:waiter", cast["otto"], "deploy fixed")
    halt("all", cast["otto"], "drill")
    unhalt("all", cast["otto"], "drill over")
    run.refresh_from_db()
    assert run.status == RunStatus.HALTED and run.halted_by == "otto"
    assert [h.kind for h in holds_on(run)] == ["run"]


def test_unhalting_a_parent_does_not_lift_a_childs_own_halt(drive, cast):
    parent = start_run("parent", {"n": 2, "child": "waiter"})
    assert drive(limit=1) == ["waiting"]
    own, other = Run.objects.filter(parent=parent).order_by("key")
    halt(own, cast["otto"], "this child misbehaves")
    halt(parent, cast["otto"], "stop the tree")
    assert status(other) == RunStatus.HALTED and Run.objects.get(pk=other.pk).halted_at is None
    unhalt(parent, cast["otto"], "tree is fine")
    assert status(own) == RunStatus.HALTED
    assert status(other) == RunStatus.PENDING
    assert [h.kind for h in holds_on(Run.objects.get(pk=own.pk))] == ["run"]


def test_star_is_not_a_workflow_name(cast):
    from runs.engine import registry
    from runs.operations import Target

    with pytest.raises(OperationError, match="not a workflow name"):
        halt("workflow:*", cast["otto"], "x")
    with pytest.raises(OperationError):
        Target("workflow", "*")
    with pytest.raises(ValueError, match="'\\*'"):
        registry.register("*", "1", lambda ctx, input: None)


# -- 11. a halted run never shows pending ---------------------------------------------------------


def test_a_run_retried_after_a_failure_under_a_halt_is_halted_not_pending(drive, cast):
    run = start_run("fails-once")
    workflows.hooks["fails-once"] = lambda: halt(run, cast["otto"], "stop retrying")
    assert drive() == ["halted"]
    assert status(run) == RunStatus.HALTED
    unhalt(run, cast["otto"], "go on")
    assert drive() == ["completed"]


def test_a_failed_run_retried_by_a_person_under_a_workflow_halt_is_halted(drive, cast):
    from runs.operations import retry_run

    run = start_run("saga", {"fail": True}, max_attempts=1)
    Run.objects.filter(pk=run.pk).update(status=RunStatus.FAILED)  # failed, not compensated
    halt("workflow:saga", cast["otto"], "incident")
    retry_run(run.pk, cast["otto"], "try again")
    assert status(run) == RunStatus.HALTED
    unhalt("workflow:saga", cast["otto"], "over")
    assert status(run) == RunStatus.PENDING


def test_a_run_released_at_shutdown_under_a_halt_is_halted_not_pending(db, cast):
    from runs.engine.lifecycle import release
    from runs.engine.worker import WorkerProcess

    run = start_run("ledger", {"steps": 2})
    worker = WorkerProcess(concurrency=1)
    worker.register()
    (claimed,) = worker.claim(1)
    halt(run, cast["otto"], "incident")
    assert release(Lease(claimed.id, claimed.lease_epoch), "worker shutting down")
    assert status(run) == RunStatus.HALTED
    assert Event.objects.filter(run=run, type="run.released").exists()


# -- 12. settled item by item ---------------------------------------------------------------------


def test_removing_the_last_steps_of_a_workflow_under_a_running_run_is_detected(drive, expire_lease):
    run = start_run("tail")
    workflows.crash_at.add("c")
    with pytest.raises(Crash):
        drive()
    workflows.variant["tail"] = "short"
    expire_lease(run.id)
    assert drive() == ["failed"]
    error = Run.objects.get(pk=run.pk).error
    assert error["code"] == "non_determinism" and "'b'" in error["message"]


def test_a_completed_step_is_on_disk_when_its_commit_returns(db):
    with connection.cursor() as cursor:
        if connection.vendor == "sqlite":
            cursor.execute("PRAGMA synchronous")
            assert cursor.fetchone()[0] == 2  # FULL (NORMAL can lose the last commits)
        else:
            cursor.execute("SHOW synchronous_commit")
            assert cursor.fetchone()[0] == "on"


def test_a_run_failed_by_the_lost_worker_bound_runs_its_compensations(
    drive, expire_lease, settings
):
    settings.STEPGUARD_MAX_RECOVERIES = 2
    run = start_run("saga", {})
    for _ in range(2):  # email kills its worker every time
        workflows.crash_at.add("email")
        with pytest.raises(Crash):
            drive()
        expire_lease(run.id)
    assert drive() == ["failed"]
    assert effects("email") == 2  # not sent a third time
    assert (effects("undo-charge"), effects("undo-reserve")) == (1, 1)
    failed = Event.objects.get(run=run, type="run.failed").payload
    assert failed["compensated"] == ["charge", "reserve"]


def test_cancelling_a_parent_cancels_its_children(drive, cast):
    parent = start_run("parent", {"n": 2, "child": "waiter"})
    drive()
    assert Run.objects.filter(parent=parent, status=RunStatus.WAITING).count() == 2
    cancel_run(parent.pk, cast["otto"], "not needed")
    drive()
    assert status(parent) == RunStatus.CANCELLED
    assert set(Run.objects.filter(parent=parent).values_list("status", flat=True)) == {
        RunStatus.CANCELLED
    }


def test_a_patch_marker_does_not_pause_a_run_whose_budget_is_exactly_spent(drive):
    run = start_run("spend-then-patch", budget_usd=Decimal("1"))
    assert drive() == ["completed"]
    assert Run.objects.get(pk=run.pk).output is True


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_halting_a_parent_while_its_child_finishes_does_not_deadlock(cast, monkeypatch):
    """A finishing child locks itself, then its parent (to wake it); a halt of the parent must
    never wait for the child while holding the parent. The child's finish is held between its
    two locks until the halt either completes or is seen waiting for a lock."""
    import threading

    from django.db import connections

    from runs.engine import store
    from runs.engine.worker import WorkerProcess

    parent = start_run("parent", {"n": 1, "child": "ledger", "steps": 1})
    worker = WorkerProcess(concurrency=1)
    worker.register()
    (claimed,) = worker.claim(1)
    assert execute(claimed, Lease(claimed.id, claimed.lease_epoch)) == "waiting"

    child_locked, go_on, outcome = threading.Event(), threading.Event(), {}
    wake_parent = store.run_event

    def held_between_locks(*args, **kwargs):
        child_locked.set()
        go_on.wait(10)
        return wake_parent(*args, **kwargs)

    monkeypatch.setattr(store, "run_event", held_between_locks)

    def finish_child():
        try:
            (child,) = worker.claim(1)
            outcome["child"] = execute(child, Lease(child.id, child.lease_epoch))
        finally:
            connections.close_all()

    def halt_parent():
        try:
            halt(parent, cast["otto"], "stop the tree")
            outcome["halt"] = "done"
        except Exception as exc:  # a deadlock victim
            outcome["halt"] = repr(exc)
        finally:
            connections.close_all()

    child_thread = threading.Thread(target=finish_child)
    child_thread.start()
    assert child_locked.wait(10)
    halt_thread = threading.Thread(target=halt_parent)
    halt_thread.start()

    def halt_done_or_blocked():
        if not halt_thread.is_alive():
            return True
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                " AND datname = current_database()"
            )
            return cursor.fetchone()[0] > 0

    wait_until(halt_done_or_blocked, what="the halt to finish or wait for a lock")
    go_on.set()
    child_thread.join(20)
    halt_thread.join(20)
    assert outcome == {"child": "completed", "halt": "done"}
    assert status(parent) == RunStatus.HALTED


def test_a_transaction_step_does_not_start_once_a_shared_daily_budget_is_spent(drive, cast):
    """Found by the model-based suite: transactional steps skipped the shared budgets."""
    set_budget("workflow:txn-only", cast["otto"], "cap", usd=Decimal("1"))
    today = datetime.now(UTC).date()
    BudgetLedger.objects.create(scope="txn-only", day=today, spent_micros=1_000_000)
    start_run("txn-only")
    assert drive() == ["over_budget"]
    assert not Effect.objects.filter(label="txn").exists()


def test_a_fork_of_a_child_held_by_its_parents_workflow_halt_is_held_by_a_hold_of_its_own(
    drive, cast
):
    """Found by the model-based suite: the fork was `halted` with no hold covering it."""
    parent = start_run("parent", {"n": 1, "child": "ledger", "steps": 2})
    drive(limit=2)
    child = Run.objects.get(parent=parent)
    halt("workflow:parent", cast["otto"], "bad deploy")
    fork = fork_run(child.pk, 0, cast["otto"], "again")
    assert status(fork) == RunStatus.HALTED
    assert [(h.kind, h.by, h.reason) for h in holds_on(Run.objects.get(pk=fork.pk))] == [
        ("run", "otto", "bad deploy")
    ]
    unhalt(fork, cast["otto"], "the fork may go")
    assert status(fork) == RunStatus.PENDING
