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
    took = (step.finished_at - step.started_at).total_seconds()
    print(f"a call that never returns, 0.5 s deadline: its last attempt ended after {took:.2f} s")
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


# -- publishing progress: ctx.set_event, get_event ------------------------------------------------


@pytest.mark.postgres
def test_a_published_value_survives_a_worker_kill_and_is_set_once(spawn_worker, tmp_path):
    from runs.sdk import get_event

    marker = tmp_path / "in-slow"
    run = start_run("peers.progress", {"marker": str(marker), "seconds": 60})
    assert get_event(run.pk, "stage") is None  # not yet set, nothing waited for
    worker = spawn_worker(*PEERS, lease=1.0)
    assert get_event(run.pk, "stage", timeout=30) == {"step": 1, "of": 2}
    wait_until(marker.exists, what="the slow step to start")
    first = Step.objects.get(run=run, key="set_event:stage")
    worker.kill()
    # While no worker runs, a client still reads what was published.
    assert get_event(run.pk, "stage") == {"step": 1, "of": 2}
    Run.objects.filter(pk=run.pk).update(input={"marker": str(marker), "seconds": 0})
    spawn_worker(*PEERS, lease=1.0)
    assert get_event(run.pk, "result", timeout=60) == "all done"
    assert wait_status(run, RunStatus.COMPLETED).output == "finished"
    assert get_event(run.pk, "stage") == {"step": 2, "of": 2}
    # The first set was not written again by the resumed execution: replayed, not re-run.
    again = Step.objects.get(run=run, key="set_event:stage")
    assert (again.attempt, again.finished_at) == (1, first.finished_at)
    keys = list(Step.objects.filter(run=run).order_by("seq").values_list("key", flat=True))
    assert keys == ["set_event:stage", "slow", "set_event:stage#2", "set_event:result"]


@pytest.mark.postgres
def test_an_async_workflow_publishes_too(spawn_worker):
    from runs.sdk import get_event

    run = start_run("peers.progress-async", {})
    spawn_worker(*PEERS)
    assert get_event(run.pk, "stage", timeout=30) == "async"


def test_get_event_gives_up_on_a_finished_run_at_once(drive):
    from runs.sdk import get_event

    run = start_run("peers.publish", {})
    assert drive() == ["completed"]
    assert get_event(run.pk, "stage") == "sync"
    # Never set, and the run has ended: the default at once, not after the timeout.
    assert get_event(run.pk, "nothing", timeout=60, default="none") == "none"


def test_the_api_reads_a_published_value_with_the_run_view_permission(client, cast, drive):
    run = start_run("peers.publish", {})
    url = f"/api/runs/{run.pk}/events/stage"
    assert client.get(url).status_code == 401
    client.force_login(cast["vera"])
    missing = client.get(url)
    assert missing.status_code == 404
    assert "has not set event 'stage'" in missing.json()["error"]["message"]
    assert drive() == ["completed"]
    found = client.get(url + "?wait=5").json()
    assert (found["name"], found["value"]) == ("stage", "sync")
    assert client.get(url + "?wait=31").status_code == 422
    from django.contrib.auth.models import User

    nobody = User.objects.create_user("nobody", password="x")
    client.force_login(nobody)
    assert client.get(url).status_code == 403


# -- signals to finished runs ----------------------------------------------------------------------


def test_a_signal_to_a_finished_run_says_why_and_may_be_ignored(drive, client, cast):
    from runs.models import Signal
    from runs.sdk import Conflict, send_signal

    run = start_run("peers.publish", {})
    assert drive() == ["completed"]
    why = r"no wait_for_event will ever consume signal 'go'.*if_finished='ignore'.*signal_with_st"
    with pytest.raises(Conflict, match=why):
        send_signal(run.pk, "go", 1)
    assert send_signal(run.pk, "go", 1, if_finished="ignore") is None
    client.force_login(cast["otto"])
    url = f"/api/runs/{run.pk}/signals"
    refused = client.post(url, {"name": "go"}, content_type="application/json")
    assert refused.status_code == 409 and "completed" in refused.json()["error"]["message"]
    ignored = client.post(url, {"name": "go", "if_finished": "ignore"}, "application/json")
    assert (ignored.status_code, ignored.json()["id"]) == (200, None)
    assert not Signal.objects.exists()


def test_signal_with_start_starts_the_run_that_receives_it(drive):
    import tests.workflows  # noqa: F401  (the waiter)
    from runs.sdk import Conflict, signal_with_start

    signal = signal_with_start("waiter", "go", "boarding", key="trip-7", input={})
    assert Run.objects.get(pk=signal.run_id).key == "trip-7"
    again = signal_with_start("waiter", "go", "late", key="trip-7", input={})  # the same run
    assert again.run_id == signal.run_id
    assert "completed" in drive()
    assert Run.objects.get(pk=signal.run_id).output == "boarding"
    with pytest.raises(Conflict, match="is completed"):
        signal_with_start("waiter", "go", "again", key="trip-7", input={})


@pytest.fixture
def silent_server():
    """A TCP server on 127.0.0.1 that accepts connections and never answers (a hung model
    provider); yields its base URL."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(listener.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
    listener.close()
    for conn in held:
        conn.close()


@pytest.mark.postgres
@pytest.mark.parametrize("is_async", [False, True])
def test_a_model_call_that_never_answers_ends_at_its_timeout(spawn_worker, silent_server, is_async):
    run = start_run("peers.llm-hang", {"url": silent_server, "timeout": 1.0, "async": is_async})
    spawn_worker(*PEERS)
    wait_status(run, RunStatus.FAILED)
    step = Step.objects.get(run=run, key="ask")
    # The step's deadline or the client's own (it was handed the same timeout), whichever
    # came first: either way the attempt ended, and the run with it.
    assert step.error["type"] in ("StepTimeout", "APITimeoutError"), step.error
    assert (step.finished_at - step.started_at).total_seconds() < 10
