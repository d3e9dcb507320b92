"""What users switching from Temporal or DBOS expect, with real worker processes: a step
deadline (sync and async), ..."""

import pytest

import tests.peer_workflows  # noqa: F401  (registers the peers.* workflows in this process)
from runs.models import Run, RunStatus, Step
from runs.sdk import start_run
from tests.conftest import wait_until
from tests.testapp.models import Effect

PEERS = ("--import", "tests.peer_workflows")


def wait_status(run, *statuses, timeout: float = 30.0) -> Run:
    return wait_until(
        lambda: (r := Run.objects.get(pk=run.pk)).status in statuses and r,
        timeout=timeout,
        what=lambda: f"run {run.pk} to be {statuses}: {Run.objects.get(pk=run.pk).status}",
    )


@pytest.mark.postgres
def test_a_sync_step_that_never_returns_fails_at_its_deadline_and_frees_its_worker(spawn_worker):
    hung = start_run("peers.hung-sync", {"timeout": 0.5})
    spawn_worker(*PEERS, "--concurrency", "1")
    failed = wait_status(hung, RunStatus.FAILED)
    step = Step.objects.get(run=hung, key="call")
    # Two attempts, each abandoned at its deadline, both sent with the step's one key.
    assert (step.status, step.attempt, step.error["code"]) == ("failed", 2, "step_timeout")
    assert "took more than 0.5 s" in failed.error["message"]
    assert Effect.objects.filter(label="hung").values("idempotency_key").distinct().count() == 1
    assert Effect.objects.filter(label="hung").count() == 2
    # The worker's one slot is free again: the threads left hanging hold no run.
    assert wait_status(start_run("peers.quick"), RunStatus.COMPLETED).output == "done"


@pytest.mark.postgres
def test_a_late_first_attempt_is_discarded_and_the_retry_answers(spawn_worker):
    run = start_run("peers.slow-once", {"timeout": 0.5, "sleep": 3})
    spawn_worker(*PEERS)
    assert wait_status(run, RunStatus.COMPLETED).output == "on time"
    step = Step.objects.get(run=run, key="call")
    assert (step.status, step.attempt, step.output) == ("completed", 2, "on time")


@pytest.mark.postgres
def test_an_async_step_is_cancelled_at_its_deadline(spawn_worker, tmp_path):
    marker = tmp_path / "cancelled"
    run = start_run("peers.hung-async", {"timeout": 0.5, "marker": str(marker)})
    spawn_worker(*PEERS)
    wait_status(run, RunStatus.FAILED)
    step = Step.objects.get(run=run, key="call")
    assert (step.status, step.attempt, step.error["code"]) == ("failed", 1, "step_timeout")
    wait_until(marker.exists, what="the step's coroutine to see its cancel")
    assert marker.read_text() == "cancelled"


@pytest.mark.postgres
def test_a_scheduled_run_is_handed_the_time_it_was_scheduled_for(spawn_worker):
    from datetime import datetime

    from runs import schedules
    from runs.engine.records import scheduled_tick

    schedules.save("every-second", workflow="peers.when", cron="* * * * * *")
    spawn_worker(*PEERS)
    run = wait_until(
        lambda: Run.objects.filter(workflow="peers.when", status=RunStatus.COMPLETED).first(),
        what="a scheduled run to complete",
    )
    schedules.set_paused("every-second", True)
    tick = scheduled_tick(run.key)
    assert tick is not None and datetime.fromisoformat(run.output["scheduled_at"]) == tick
    late = datetime.fromisoformat(run.output["now"]) - tick
    assert late.total_seconds() >= 0  # ctx.now() is when it ran; scheduled_at, what it is for
    print(f"ctx.now() was {late.total_seconds():.3f} s after ctx.scheduled_at")
