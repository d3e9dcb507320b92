"""Durable waits with real worker processes: no worker held, SIGKILL, restarts, versions."""

import signal
import subprocess

import pytest

from runs.approvals.models import ApprovalRequest
from runs.approvals.services import decide
from runs.models import Run, RunStatus, Step, StepStatus
from runs.operations import cancel_run
from runs.sdk import send_signal, start_run
from tests import versioned_v1, versioned_v2  # noqa: F401  (registers both versions here)
from tests.conftest import wait_until
from tests.test_commands import run_manage
from tests.testapp.models import Effect


def wait_status(run, *statuses, timeout: float = 30.0) -> Run:
    return wait_until(
        lambda: (r := Run.objects.get(pk=run.pk)).status in statuses and r,
        timeout=timeout,
        what=f"run {run.pk} to be {'/'.join(statuses)}",
    )


def effects(label: str) -> int:
    return Effect.objects.filter(label=label).count()


def test_a_worker_with_one_slot_completes_another_run_while_the_first_sleeps(spawn_worker):
    sleeping = start_run("sleeper", {"seconds": 3600})
    spawn_worker("--concurrency", "1")
    wait_status(sleeping, RunStatus.WAITING)
    other = start_run("ledger", {"steps": 3})
    assert wait_status(other, RunStatus.COMPLETED).output == 3
    assert Run.objects.get(pk=sleeping.pk).status == RunStatus.WAITING


@pytest.mark.postgres
def test_a_sleep_an_event_wait_and_an_approval_wait_survive_sigkill(spawn_worker, alice):
    sleeping = start_run("sleeper", {"seconds": 4})
    listening = start_run("waiter", {})
    asking = start_run("approver", {"amount": 30})
    worker = spawn_worker(lease=1.0)
    for run in (sleeping, listening, asking):
        wait_status(run, RunStatus.WAITING)
    worker.kill()

    # While no worker runs: the signal and the decision are stored, nothing is lost.
    send_signal(listening.id, "go", "boarding")
    decide(ApprovalRequest.objects.get(run=asking).pk, "approve", alice)
    spawn_worker(lease=1.0)
    assert wait_status(listening, RunStatus.COMPLETED).output == "boarding"
    assert wait_status(asking, RunStatus.COMPLETED).output["approved_by"] == "alice"
    assert wait_status(sleeping, RunStatus.COMPLETED).output == "after"
    assert (effects("before"), effects("after"), effects("charge")) == (1, 2, 1)


@pytest.mark.postgres
def test_a_child_killed_mid_way_resumes_and_the_parent_gets_its_result_once(spawn_worker):
    parent = start_run("parent", {"n": 1, "steps": 6, "sleep": 0.2})
    worker = spawn_worker(lease=1.0)
    child = wait_until(lambda: Run.objects.filter(parent=parent).first(), what="the child")
    wait_until(
        lambda: Step.objects.filter(run=child, status=StepStatus.COMPLETED).count() >= 3,
        what="child progress",
    )
    worker.kill()
    assert Run.objects.get(pk=child.pk).status == RunStatus.RUNNING  # killed mid-way
    spawn_worker(lease=1.0)
    parent = wait_status(parent, RunStatus.COMPLETED)
    assert parent.output == [sum(range(6))]
    assert Run.objects.get(pk=child.pk).status == RunStatus.COMPLETED
    assert effects("after") == 1
    assert Step.objects.filter(run=parent, key="c0", status=StepStatus.COMPLETED).count() == 1


@pytest.mark.postgres
def test_a_fan_out_of_20_children_fans_back_in(spawn_worker):
    parent = start_run("parent", {"n": 20})
    spawn_worker("--concurrency", "4")
    spawn_worker("--concurrency", "4")
    parent = wait_status(parent, RunStatus.COMPLETED, timeout=60)
    assert parent.output == [1] * 20
    assert Run.objects.filter(parent=parent, status=RunStatus.COMPLETED).count() == 20
    assert effects("after") == 1


@pytest.mark.postgres
def test_a_cancel_compensates_each_step_once_despite_a_sigkill_mid_compensation(
    spawn_worker, alice
):
    run = start_run("saga", {"undo_sleep": 1.5, "idempotent_undo": True})
    worker = spawn_worker(lease=1.0)
    wait_status(run, RunStatus.WAITING)
    cancel_run(run.id, alice, "order withdrawn")
    wait_until(
        lambda: Step.objects.filter(run=run, key="undo:charge", status="completed").exists(),
        what="the first compensation",
    )
    wait_until(lambda: effects("undo-reserve") == 1, what="the second compensation to start")
    worker.kill()  # inside undo:reserve, after its effect reached the service
    spawn_worker(lease=1.0)
    run = wait_status(run, RunStatus.CANCELLED)
    undo = {s.key: s for s in Step.objects.filter(run=run, key__startswith="undo:")}
    assert undo["undo:charge"].attempt == 1  # completed before the kill: never run again
    assert undo["undo:reserve"].attempt == 2 and undo["undo:reserve"].recovered == "resent"
    assert (effects("undo-charge"), effects("undo-reserve")) == (1, 1)  # deduped by key


@pytest.mark.postgres
def test_runs_stay_on_their_version_and_a_worker_without_it_leaves_them_waiting(spawn_worker):
    both = spawn_worker("--import", "tests.versioned_v1", "--import", "tests.versioned_v2")
    old = start_run("versioned", version="1")
    wait_status(old, RunStatus.WAITING)
    new = start_run("versioned")
    wait_status(new, RunStatus.WAITING)
    both.signal(signal.SIGTERM)
    assert both.proc.wait(10) == 0, both.output()

    spawn_worker("--import", "tests.versioned_v2")
    send_signal(old.id, "go")
    send_signal(new.id, "go")
    assert wait_status(new, RunStatus.COMPLETED).output == "v2-b"
    assert Run.objects.get(pk=old.pk).status == RunStatus.PENDING
    shown = run_manage("showrun", str(old.id), stdout=subprocess.PIPE).communicate(timeout=30)[0]
    assert "waiting: no live worker serves versioned@1 (live workers serve versioned@2)" in shown

    spawn_worker("--import", "tests.versioned_v1")
    assert wait_status(old, RunStatus.COMPLETED).output == "v1-b"
    assert effects("v1-a") == effects("v1-b") == 1


def test_a_timer_fires_at_its_due_time_not_at_the_next_slow_poll(spawn_worker):
    run = start_run("sleeper", {"seconds": 1.5})
    spawn_worker("--poll-interval", "30")
    run = wait_status(run, RunStatus.COMPLETED, timeout=20)
    nap = Step.objects.get(run=run, key="nap")
    fired = run.events.get(type="timer.fired")
    # The worker woke for the timer itself, not at its next 30 s poll (typically well under
    # 1 s late; the bound leaves room for a loaded machine).
    assert 0 <= (fired.created_at - nap.wake_at).total_seconds() < 5
