"""Model calls, tools and the agent loop, against the scripted demo model on 127.0.0.1."""

import json

import pytest

from approvals.models import ApprovalRequest
from approvals.services import decide
from examples import flight_agent, outreach, research  # noqa: F401  (registers them)
from examples.models import Booking, Effect
from runs.engine.llm import cost
from runs.models import Run, RunStatus, Step
from runs.sdk import start_run
from tests import workflows

pytestmark = pytest.mark.django_db


def only_llm_step(run) -> Step:
    return Step.objects.get(run=run, kind="llm")


@pytest.mark.parametrize(
    ("workflow", "model", "usage_in", "usage_out"),
    [
        ("llm-chat", "gpt-4o-mini", "prompt_tokens", "completion_tokens"),
        ("llm-responses", "gpt-4.1-mini", "input_tokens", "output_tokens"),
        ("llm-anthropic", "claude-3-5-haiku-20241022", "input_tokens", "output_tokens"),
    ],
)
def test_cost_is_captured_exactly_from_the_response_usage(
    drive, demo_model, workflow, model, usage_in, usage_out
):
    run = start_run(workflow, {"prompt": "How do durable workflows survive crashes?"})
    assert drive() == ["completed"]
    step = only_llm_step(run)
    usage = step.output["usage"]
    assert (step.tokens_in, step.tokens_out) == (usage[usage_in], usage[usage_out])
    expected = cost(model, usage[usage_in], usage[usage_out])
    assert step.cost_micros == int(
        (expected * 1_000_000).to_integral_value(rounding="ROUND_CEILING")
    )
    assert step.cost_micros > 0
    run.refresh_from_db()
    assert (run.tokens_in, run.tokens_out, run.cost_micros) == (
        step.tokens_in, step.tokens_out, step.cost_micros,
    )  # fmt: skip
    request = step.input[0]
    assert request["model"] == model and "How do durable" in json.dumps(request)
    assert demo_model.calls[step.idempotency_key] == 1  # sent with its idempotency key


@pytest.mark.django_db(transaction=True)  # its checkpoints are written from a thread of its own
def test_an_async_workflow_runs_async_steps_and_async_clients(drive, expire_lease, demo_model):
    run = start_run("llm-async")
    workflows.crash_at.add("after-async")
    with pytest.raises(workflows.Crash):
        drive()
    expire_lease(run.id)
    assert drive() == ["completed"]
    output = Run.objects.get(pk=run.pk).output
    assert output[0] == 42 and output[1].startswith("[demo model]")
    assert workflows.calls["async-tool"] == 1  # memoized on the resume
    assert demo_model.total == 1


FLIGHT = {"from": "LIS", "to": "BER", "date": "2026-12-24", "passenger": "Ada"}


def test_a_guarded_tool_never_runs_without_approval(drive, demo_model, cast):
    run = start_run("flight-booking", FLIGHT, version="2")
    assert drive() == ["waiting"]
    request = ApprovalRequest.objects.get(run=run)
    assert request.payload["tool"] == "book_flight"
    assert request.payload["args"]["flight"]["flight"] == "FR1213"
    assert not Booking.objects.exists()

    decide(request.pk, "approve", cast["ada"], "fine")
    assert drive() == ["completed"]
    assert Booking.objects.count() == 1
    keys = [s.key for s in Step.objects.filter(run=run).order_by("seq")]
    assert keys == [
        "think-0", "tool-search_flights-0", "think-1", "tool-book_flight-1.approval",
        "tool-book_flight-1", "think-2", "tool-send_confirmation-2", "think-3",
    ]  # fmt: skip
    assert Step.objects.get(run=run, key="tool-send_confirmation-2").attempt == 2  # failed once
    assert Effect.objects.filter(label="book").count() == 1
    assert Run.objects.get(pk=run.pk).output["answer"].startswith("Done.")


def test_a_rejected_tool_call_is_reported_to_the_model(drive, demo_model, cast):
    run = start_run("flight-booking", FLIGHT, version="2")
    drive()
    decide(ApprovalRequest.objects.get(run=run).pk, "reject", cast["ada"], "too pricey")
    assert drive() == ["completed"]
    assert not Booking.objects.exists()
    next_turn = Step.objects.get(run=run, key="think-2").input[0]["messages"]
    refusal = json.loads(next_turn[-1]["content"])
    assert next_turn[-1]["role"] == "tool" and "ada rejected" in refusal["refused"]
    assert "too pricey" in Run.objects.get(pk=run.pk).output["answer"]


def test_a_spent_budget_stops_the_agent_before_its_next_turn(drive, demo_model):
    # Each draft reserves its prompt plus max_tokens (about $0.00083 at the demo price) first.
    run = start_run("outreach", {"prospects": ["a@x", "b@x", "c@x"]}, budget_usd="0.001")
    assert drive() == ["over_budget"]
    run.refresh_from_db()
    assert run.status == RunStatus.OVER_BUDGET and run.cost_micros <= 1_000
    assert Effect.objects.filter(label="email").count() == 2
    assert Step.objects.filter(run=run, kind="llm").count() == 2


def test_a_tool_approval_predicate_on_the_arguments(drive, cast):
    run = start_run("payer", {"amounts": [50, 150]})
    assert drive() == ["waiting"]
    assert Effect.objects.filter(label="pay-50").count() == 1  # under the threshold: no approval
    request = ApprovalRequest.objects.get(run=run)
    assert request.payload == {"tool": "pay", "args": {"amount": 150}}
    assert not Effect.objects.filter(label="pay-150").exists()
    decide(request.pk, "approve", cast["ada"])
    drive()
    assert Run.objects.get(pk=run.pk).output == [{"paid": 50}, {"paid": 150}]


def test_the_agent_loop_is_bounded(drive, demo_model):
    run = start_run("chatty")
    assert drive() == ["failed"]
    run.refresh_from_db()
    assert run.error["code"] == "agent_loop_exhausted" and "2 turns" in run.error["message"]
    assert demo_model.total == 2
