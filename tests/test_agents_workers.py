"""Agents under SIGKILL, with real worker processes and the demo model on 127.0.0.1."""

import random
import time

import pytest

from examples import research  # noqa: F401  (registers research here too)
from runs.models import Run, RunStatus, Step, StepStatus, Worker
from runs.sdk import start_run
from tests.conftest import wait_until

pytestmark = pytest.mark.postgres


def finished(run) -> Run:
    return wait_until(
        lambda: (r := Run.objects.get(pk=run.pk)).is_terminal and r, timeout=120, what="the run"
    )


def completed(run) -> int:
    return Step.objects.filter(run=run, status=StepStatus.COMPLETED).count()


@pytest.mark.slow
def test_research_killed_10_times_writes_the_same_report_and_pays_no_call_twice(
    spawn_worker, demo_model
):
    topic = {"topic": "durable execution", "delay": 0.02}
    worker = spawn_worker(lease=1.0)
    baseline = finished(start_run("research", topic))
    assert baseline.status == RunStatus.COMPLETED
    assert Step.objects.filter(run=baseline).count() >= 39

    run = start_run("research", topic)
    rng = random.Random(7)
    for _ in range(10):
        wid = Worker.objects.get(pid=worker.pid).id
        wait_until(lambda w=wid: Run.objects.filter(pk=run.pk, worker=w).exists(), what="claim")
        target = completed(run) + rng.randint(1, 4)
        wait_until(
            lambda t=target: completed(run) >= t or Run.objects.get(pk=run.pk).is_terminal,
            what="progress",
        )
        time.sleep(rng.uniform(0, 0.02))
        worker.kill()
        worker = spawn_worker(lease=1.0)
    run = finished(run)
    assert run.status == RunStatus.COMPLETED
    assert run.output["report"] == baseline.output["report"]
    assert run.output["sources"] == baseline.output["sources"]
    for step in Step.objects.filter(run=run, kind="llm"):
        paid = demo_model.calls[step.idempotency_key]
        if step.recovered == "resent":
            assert paid >= 1  # in flight at a kill: sent again, with the same key
        else:
            assert paid == 1, (step.key, paid)
