"""A finished step's completion: written within its bound, and never dropped on the way out.

A step's completion rides with the run's next write (one commit per step), but workflow code
may work for a long time between steps: the completion is then written by itself within
STEPGUARD_COMPLETION_WINDOW, and every path out of an execution writes it first.
"""

import signal

import pytest

from runs import operations
from runs.models import Event, Run, RunStatus, Step, StepStatus
from runs.sdk import start_run
from tests.conftest import wait_until
from tests.test_workers import effect_counts, wait_done
from tests.testapp.models import Effect


def effect_done(run, label: str) -> bool:
    return Effect.objects.filter(idempotency_key=f"{run.pk}:{label}").exists()


def step_status(run, key: str) -> str | None:
    return Step.objects.filter(run=run, key=key).values_list("status", flat=True).first()


def test_a_step_that_returned_is_recorded_while_the_workflow_works_between_steps(spawn_worker):
    spawn_worker()
    run = start_run("gap", {"gap": 30})
    wait_until(lambda: effect_done(run, "a"), what="step a's side effect")
    # The bound is 0.15 s; 10 s only fails if nothing writes it until the next step (30 s on).
    wait_until(
        lambda: step_status(run, "a") == StepStatus.COMPLETED,
        timeout=10,
        what=lambda: f"step a recorded as completed (it is {step_status(run, 'a')})",
    )
    assert not effect_done(run, "b")  # still between the steps


def test_sigterm_between_steps_writes_the_completion_before_handing_the_run_over(spawn_worker):
    first = spawn_worker("--grace", "0.5")
    run = start_run("gap", {"gap": 4})
    wait_until(lambda: effect_done(run, "a"), what="step a's side effect")
    first.signal(signal.SIGTERM)
    assert first.proc.wait(20) == 0
    spawn_worker()
    run = wait_done(run)
    assert run.status == RunStatus.COMPLETED
    counts = effect_counts()
    assert counts[f"{run.pk}:a"] == 1, "step a ran again after the graceful stop"
    assert Step.objects.get(run=run, key="a").attempt == 1


@pytest.mark.parametrize("where", ["in the step", "between steps"])
def test_a_run_cancelled_after_a_crash_undoes_a_step_that_may_have_run(spawn_worker, cast, where):
    worker = spawn_worker(lease=1.0)
    run = start_run("gap", {"undo": True, "step_sleep" if where == "in the step" else "gap": 30})
    wait_until(lambda: effect_done(run, "a"), what="step a's side effect")
    worker.kill()
    operations.cancel_run(run.pk, cast["otto"], "customer changed their mind")
    spawn_worker(lease=1.0)
    run = wait_done(run)
    assert run.status == RunStatus.CANCELLED
    counts = effect_counts()
    events = list(Event.objects.filter(run=run).order_by("seq").values_list("type", "payload"))
    assert counts.get(f"{run.pk}:undo:a") == 1, f"step a was not undone: {counts} {events}"
    assert counts[f"{run.pk}:a"] == 1
    assert not Step.objects.filter(run=run, status=StepStatus.STARTED).exists()
    assert not Run.objects.filter(pk=run.pk, status=RunStatus.RUNNING).exists()


def test_a_crash_during_the_undo_of_a_step_resolved_by_a_cancel_still_undoes_it(spawn_worker, cast):
    """The step in doubt is resolved at the position where the cancel stopped the code; once it
    is recorded completed, the next execution stops one position later. The undo is found by
    its key, not by counting (it was inserted again and failed on UNIQUE(run, key))."""
    worker = spawn_worker(lease=1.0)
    run = start_run("gap", {"undo": True, "step_sleep": 30, "undo_sleep": 30})
    wait_until(lambda: effect_done(run, "a"), what="step a's side effect")
    worker.kill()
    operations.cancel_run(run.pk, cast["otto"], "customer changed their mind")
    worker = spawn_worker(lease=1.0)
    wait_until(lambda: effect_done(run, "undo:a"), what="the undo's side effect")
    worker.kill()
    spawn_worker(lease=1.0)
    run = wait_done(run)
    assert run.status == RunStatus.CANCELLED, run.error
    assert effect_counts() == {f"{run.pk}:a": 1, f"{run.pk}:undo:a": 1}
    undo = Step.objects.get(run=run, key="undo:a")
    assert undo.status == StepStatus.COMPLETED
    assert undo.recovered  # re-sent with its key after the crash
    assert not Step.objects.filter(run=run, status=StepStatus.STARTED).exists()
