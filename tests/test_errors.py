"""Whatever escapes workflow code lands on the run: its type, its message, its traceback, and
the run's retry policy. Before, text a database column cannot hold (NUL, a lone surrogate) and
exceptions that are not `Exception`s (`sys.exit()`) escaped the executor: the run showed
`running` on a healthy worker until its lease lapsed, again and again, and the step before it
ran again each time."""

import pytest

from runs.models import Event, EventType, Run, RunStatus, Step
from runs.sdk import start_run
from tests import workflows


@pytest.mark.parametrize(
    ("kind", "type_", "message"),
    [
        ("text", "ValueError", "bad \\x00 byte and a lone \\ud800 surrogate"),
        ("exit", "SystemExit", "3"),
        ("broken-str", "Unprintable", "<unprintable Unprintable>"),
    ],
)
def test_an_error_escaping_workflow_code_is_recorded_on_the_run(drive, kind, type_, message):
    run = start_run("raises-odd", kind)
    assert drive() == ["retrying", "retrying", "failed"]  # the run's retry policy: 3 attempts
    run = Run.objects.get(pk=run.pk)
    assert run.status == RunStatus.FAILED and run.attempt == 3
    assert (run.error["type"], run.error["message"]) == (type_, message)
    assert type_ in run.error["traceback"]
    for retrying in Event.objects.filter(run=run, type=EventType.RUN_RETRYING):
        assert retrying.payload["error"] == {"type": type_, "message": message}
    assert workflows.calls == {"before": 1}
    assert not Event.objects.filter(run=run, type=EventType.RUN_RECOVERED).exists()


def test_sys_exit_inside_a_step_fails_the_step_and_the_run(drive):
    run = start_run("raises-odd", "exit-in-step")
    assert drive() == ["failed"]  # a step's failure: not retried from the top
    step = Step.objects.get(run=run, key="quits")
    assert step.status == "failed"
    assert step.error["type"] == "SystemExit"
    assert step.error["message"] == "the step called sys.exit"
    run = Run.objects.get(pk=run.pk)
    assert run.error["type"] == "StepFailed"


# An async workflow's checkpoints are written from threads of their own: they must see rows
# committed, not the test's transaction.
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("catch", [False, True])
def test_a_gathered_sibling_in_flight_when_the_workflow_leaves_is_not_called_again(drive, catch):
    """Before, teardown cancelled `slow`, the cancellation counted as a retryable failure, and
    `slow` was called again (attempt 2), whether or not the workflow caught the error."""
    run = start_run("gather-fails", {"catch": catch})
    drive()
    slow = Step.objects.get(run=run, key="slow")
    assert workflows.calls["slow"] == 1
    assert (slow.status, slow.attempt) == ("completed", 1)


@pytest.mark.django_db(transaction=True)
def test_a_run_retry_runs_a_gathered_step_that_failed_again_though_it_is_not_last(drive, cast):
    """Before, every attempt replayed the recorded failure of `fails` (it is not the last
    recorded step: `slow` is), so a run retry never called it again. A step's failure ends
    the run (issue 47); a person's retry runs it again."""
    from runs.operations import retry_run

    run = start_run("gather-fails", {})
    assert drive() == ["failed"]
    assert Run.objects.get(pk=run.pk).error["step"] == "fails"
    retry_run(run.pk, cast["otto"], "the service is back")
    assert drive() == ["failed"]
    assert workflows.calls["fails"] == 2  # once per run attempt
    assert workflows.calls["slow"] == 1  # completed in the first; replayed after
