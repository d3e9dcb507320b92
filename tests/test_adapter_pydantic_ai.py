"""The Pydantic AI adapter: agents written for Pydantic AI, wrapped in StepguardAgent, against
the scripted demo model on 127.0.0.1 through Pydantic AI's own OpenAI chat model."""

import asyncio
import json
from collections import Counter
from datetime import datetime
from decimal import ROUND_CEILING, Decimal
from pathlib import Path

import pytest

from runs.approvals.models import ApprovalRequest
from runs.approvals.services import decide, revoke
from runs.engine.deltas import Conversations
from runs.models import Event, Run, RunStatus, Step
from runs.operations import set_budget
from runs.sdk import start_run
from tests import adapter_pydantic_ai_workflows as pa
from tests import workflows
from tests.conftest import wait_until

# Async workflows write their checkpoints from threads of their own.
pytestmark = pytest.mark.django_db(transaction=True)

FORECAST = {"city": "Paris", "temp": 21, "summary": "clear, 19:30"}
#: The model asks for the weather and the time in one turn, then books, then answers.
DINNER = pa.script(
    "get_weather+get_time",
    "book_table",
    args={
        "get_weather": {"city": "Paris"},
        "get_time": {"city": "Paris"},
        "book_table": {"city": "Paris", "guests": 2},
    },
    final=FORECAST,
)
PROMPT = "Plan dinner in Paris for two."


def steps_of(run) -> list[Step]:
    return list(Step.objects.filter(run=run).order_by("seq"))


def request_of(step: Step) -> dict:
    """The request a model step recorded, whole (it is stored as a delta of the one before)."""
    return Conversations(step.run_id).expanded(step.seq, step.input)[0]


def effects(directory) -> list[dict]:
    return [
        json.loads(line)
        for path in sorted(Path(directory).glob("effects-*.jsonl"))
        for line in path.read_text().splitlines()
    ]


def plain_run(**options):
    """The same agent run by Pydantic AI alone: what the durable run must give back."""
    instructions = options.pop("instructions", DINNER)

    async def run():
        pa.TENANT.set("acme")
        return await pa.planner.run(
            PROMPT, instructions=instructions, deps=pa.Deps(), model=pa.demo_model(), **options
        )

    return asyncio.run(run())


def micros(usd: Decimal) -> int:
    return int((usd * 1_000_000).to_integral_value(rounding=ROUND_CEILING))


def test_each_model_request_and_tool_call_is_a_priced_step_and_the_output_is_the_agent_s(
    drive, demo_model
):
    run = start_run("pa-planner", {"instructions": DINNER})
    assert drive() == ["completed"]
    steps = steps_of(run)
    assert [(s.key, s.kind) for s in steps] == [
        ("planner.model", "llm"),
        ("planner.tool.get_weather", "tool"),
        ("planner.tool.get_time", "tool"),
        ("planner.model#2", "llm"),
        ("planner.tool.book_table", "tool"),
        ("planner.model#3", "llm"),
    ]
    assert workflows.calls == {"get_weather": 1, "get_time": 1, "book_table": 1}
    for step in (s for s in steps if s.kind == "llm"):
        usage = step.output["response"]["usage"]
        assert (step.tokens_in, step.tokens_out) == (usage["input_tokens"], usage["output_tokens"])
        usd = (Decimal(step.tokens_in) * 1 + Decimal(step.tokens_out) * 4) / 1_000_000
        assert step.cost_micros == micros(usd) > 0  # stepguard-demo: $1 in, $4 out per 1M
        assert step.usage["model"] == "stepguard-demo" and step.usage["priced"]
        # Sent once, with the step's idempotency key as its Idempotency-Key header.
        assert demo_model.calls[step.idempotency_key] == 1
    # The tools' results reached the next request; each tool saw the workflow's context.
    results = [part["content"] for part in request_of(steps[3])["messages"][-1]["parts"]]
    assert results == [{"city": "Paris", "temp": 21, "sky": "clear"}, "19:30 in Paris for acme"]
    run.refresh_from_db()
    assert run.cost_micros == sum(s.cost_micros for s in steps)
    assert run.tokens_in == sum(s.tokens_in for s in steps) > 0

    # Pydantic AI alone, on the same model: the same structured output, the same usage, and
    # the model was sent exactly the same requests.
    durable_bodies = list(demo_model.bodies)
    plain = plain_run()
    assert run.output == {
        "output": plain.output.model_dump(),
        "requests": 3,
        "tokens": [plain.usage.input_tokens, plain.usage.output_tokens],
    }
    assert run.output["output"] == FORECAST
    assert demo_model.bodies[len(durable_bodies) :] == durable_bodies


def test_a_crashed_run_resumes_without_paying_for_a_model_request_or_running_a_tool_again(
    drive, expire_lease, demo_model, tmp_path
):
    run = start_run("pa-planner", {"instructions": DINNER, "effects": str(tmp_path)})
    workflows.crash_at.add("book_table")  # the process dies inside the third tool call
    with pytest.raises(workflows.Crash):
        drive()
    expire_lease(run.id)
    workflows.crash_at.add("after-run")  # then again once the agent has answered
    with pytest.raises(workflows.Crash):
        drive()
    expire_lease(run.id)
    assert drive() == ["completed"]

    assert Run.objects.get(pk=run.pk).output["output"] == FORECAST
    steps = {s.key: s for s in steps_of(run)}
    # Completed tools never ran again; the one in flight was re-sent with its same key.
    assert workflows.calls == {"get_weather": 1, "get_time": 1, "book_table": 2}
    booked = steps["planner.tool.book_table"]
    assert (booked.recovered, booked.attempt) == ("resent", 2)
    assert [e["key"] for e in effects(tmp_path) if e["label"] == "book_table"] == [
        booked.idempotency_key
    ] * 2
    # No model request was paid for twice: three requests in three executions.
    assert demo_model.total == 3
    # The request sent after the resume is still stored as a delta of the one before it.
    assert steps["planner.model#3"].input[0]["messages"]["$after"] == steps["planner.model#2"].seq
    assert all(demo_model.calls[s.idempotency_key] == 1 for s in steps.values() if s.kind == "llm")


@pytest.mark.slow
def test_a_worker_killed_with_sigkill_mid_run_finishes_without_repeating_a_completed_step(
    spawn_worker, demo_model, tmp_path
):
    run = start_run(
        "pa-planner", {"instructions": DINNER, "effects": str(tmp_path), "slow": "book_table"}
    )
    worker = spawn_worker("--import", "tests.adapter_pydantic_ai_workflows", lease=1.0)
    wait_until(
        lambda: any(e["label"] == "book_table" for e in effects(tmp_path)),
        what="the booking to start",
    )
    worker.kill()  # SIGKILL, inside the booking
    spawn_worker("--import", "tests.adapter_pydantic_ai_workflows", lease=1.0)
    run = wait_until(
        lambda: (r := Run.objects.get(pk=run.pk)).is_terminal and r, timeout=60, what="the run"
    )
    assert run.status == RunStatus.COMPLETED, run.error
    assert run.output["output"] == FORECAST
    assert Event.objects.filter(run=run, type="run.recovered").count() == 1

    done = effects(tmp_path)
    assert Counter(e["label"] for e in done) == {"get_weather": 1, "get_time": 1, "book_table": 2}
    for step in steps_of(run):
        if step.kind == "llm":
            assert demo_model.calls[step.idempotency_key] == 1, step.key
            continue
        mine = [e for e in done if e["key"] == step.idempotency_key]
        assert len(mine) == step.attempt and (step.attempt == 1 or step.recovered == "resent")
        # No completed step was called after it completed.
        finished = step.finished_at.timestamp()
        assert all(datetime.fromtimestamp(e["at"]).timestamp() <= finished for e in mine)


def test_a_tool_pydantic_ai_marks_for_approval_waits_durably_and_runs_only_once_approved(
    drive, demo_model, cast
):
    instructions = pa.script("charge", args={"charge": {"amount": 120}})
    run = start_run("pa-shop", {"instructions": instructions})
    assert drive() == ["waiting"]
    request = ApprovalRequest.objects.get(run=run)
    assert (request.action, request.payload["tool"]) == ("call charge", "charge")
    assert request.payload["args"] == {"amount": 120}
    assert "charge" not in workflows.calls
    assert drive() == []  # nothing to do while it waits: no worker holds the run

    decide(request.pk, "approve", cast["ada"], "ok")
    assert drive() == ["completed"]
    assert workflows.calls == {"charge": 1}
    assert [s.key for s in steps_of(run)] == [
        "shop.model", "shop.tool.charge.approval", "shop.tool.charge", "shop.model#2",
    ]  # fmt: skip
    assert Run.objects.get(pk=run.pk).output["output"] == 'Done. Tool results: {"charged":120}'
    assert demo_model.total == 2  # the first request was not sent again after the wait


def test_an_approval_revoked_before_its_call_starts_stops_the_call(drive, demo_model, cast):
    instructions = pa.script("charge", args={"charge": {"amount": 120}})
    run = start_run("pa-shop", {"instructions": instructions})
    assert drive() == ["waiting"]
    request = ApprovalRequest.objects.get(run=run)
    decide(request.pk, "approve", cast["ada"])
    workflows.hooks["charge"] = lambda: revoke(request.pk, cast["ada"], "card reported stolen")
    assert drive() == ["completed"]
    assert "charge" not in workflows.calls  # the approval no longer stood when it would start
    charge = Step.objects.get(run=run, key="shop.tool.charge")
    assert (charge.status, charge.error["code"]) == ("failed", "approval_revoked")
    assert "no longer stands" in Run.objects.get(pk=run.pk).output["output"]  # told the model


def test_an_approval_rule_of_the_adapter_holds_a_call_and_a_rejection_reaches_the_model(
    drive, demo_model, cast
):
    run = start_run("pa-planner", {"instructions": DINNER, "approve_over": 1})
    assert drive() == ["waiting"]
    request = ApprovalRequest.objects.get(run=run)
    assert request.payload["args"] == {"city": "Paris", "guests": 2}
    decide(request.pk, "reject", cast["ada"], "too many guests")
    assert drive() == ["completed"]
    assert "book_table" not in workflows.calls  # never ran
    denial = request_of(Step.objects.get(run=run, key="planner.model#3"))["messages"][-1]
    part = denial["parts"][0]
    assert (part["tool_name"], part["outcome"]) == ("book_table", "denied")
    assert "ada rejected" in part["content"] and "too many guests" in part["content"]
    assert Run.objects.get(pk=run.pk).output["output"] == FORECAST


def test_a_run_budget_stops_the_agent_before_a_request_it_cannot_afford(drive, demo_model, cast):
    # Each request reserves its prompt plus max_tokens (300 output tokens: $0.0012) first:
    # the first fits in $0.0016, the second does not once the first has been paid.
    settings = {"max_tokens": 300}
    run = start_run(
        "pa-planner", {"instructions": DINNER, "settings": settings}, budget_usd="0.0016"
    )
    assert drive() == ["over_budget"]
    run.refresh_from_db()
    assert run.status == RunStatus.OVER_BUDGET and 0 < run.cost_micros <= 1_600
    assert [s.key for s in steps_of(run)] == [
        "planner.model", "planner.tool.get_weather", "planner.tool.get_time",
    ]  # fmt: skip
    assert demo_model.total == 1

    set_budget(run, cast["otto"], "worth it", usd=Decimal("1"))
    assert drive() == ["completed"]
    assert Run.objects.get(pk=run.pk).output["output"] == FORECAST
    assert demo_model.total == 3 and workflows.calls["get_weather"] == 1


def test_cached_input_tokens_are_priced_at_the_cached_rate_and_counted_once(drive, demo_model):
    # With a prompt cache key the demo model caches each request's prefix and reports it as
    # cached tokens inside the prompt tokens, as OpenAI does: the second run reads the first's.
    input = {"instructions": DINNER, "settings": {"openai_prompt_cache_key": "dinner"}}
    runs = [start_run("pa-planner", input), start_run("pa-planner", input)]
    assert drive() == ["completed", "completed"]
    step = Step.objects.get(run=runs[1], key="planner.model")
    usage = step.output["response"]["usage"]
    cached, total, out = usage["cache_read_tokens"], usage["input_tokens"], usage["output_tokens"]
    assert 0 < cached < total
    assert (step.tokens_in, step.tokens_out) == (total, out)
    kinds = step.usage["kinds"]
    assert (kinds["input"]["tokens"], kinds["cached_input"]["tokens"]) == (total - cached, cached)
    usd = (Decimal(total - cached) * 1 + Decimal(cached) * Decimal("0.10") + out * 4) / 1_000_000
    assert step.cost_micros == micros(usd)


def test_the_sdk_does_not_retry_inside_a_step_the_step_retries_with_its_key(drive, demo_model):
    # The client would retry twice by itself, unrecorded; the step retries instead.
    demo_model.fail_next(500)
    run = start_run("pa-planner", {"instructions": DINNER, "sdk_retries": 2, "no_wait": True})
    assert drive() == ["completed"]
    first = Step.objects.get(run=run, key="planner.model")
    assert first.attempt == 2 and demo_model.calls[first.idempotency_key] == 2
    assert Event.objects.filter(run=run, type="step.retrying", step_key=first.key).count() == 1
    assert demo_model.total == 4


def test_a_refused_request_fails_the_run_at_once_without_retrying(drive, demo_model):
    demo_model.fail_next(400)
    run = start_run("pa-planner", {"instructions": DINNER, "no_wait": True})
    assert drive() == ["failed"]
    run.refresh_from_db()
    assert run.error["cause"]["code"] == "model_request_rejected" and run.attempt == 1
    assert demo_model.total == 1


def test_a_streamed_run_hands_on_each_response_and_replays_it_without_paying_again(
    drive, expire_lease, demo_model
):
    instructions = pa.script("get_weather", args={"get_weather": {"city": "Paris"}})
    run = start_run("pa-stream", {"instructions": instructions})
    pa.streamed.clear()
    workflows.crash_at.add("after-stream")
    with pytest.raises(workflows.Crash):
        drive()
    expire_lease(run.id)
    assert drive() == ["completed"]
    output = Run.objects.get(pk=run.pk).output
    answer = 'Done. Tool results: {"city":"Paris","temp":21,"sky":"clear"}'
    assert output == {"output": answer, "streamed": answer}
    assert ["".join(pieces) for pieces in pa.streamed] == [answer, answer]  # live, then replay
    assert [s.key for s in steps_of(run)] == [
        "planner.model", "planner.tool.get_weather", "planner.model#2",
    ]  # fmt: skip
    assert all(s.tokens_out > 0 for s in steps_of(run) if s.kind == "llm")
    assert demo_model.total == 2 and workflows.calls == {"get_weather": 1}
    assert all(body.get("stream") for body in demo_model.bodies)  # streamed inside each step
    assert plain_run(instructions=instructions, output_type=str).output == answer


def test_a_sync_workflow_runs_the_agent_with_run_sync(drive, expire_lease, demo_model):
    run = start_run("pa-planner-sync", {"instructions": DINNER})
    workflows.crash_at.add("book_table")
    with pytest.raises(workflows.Crash):
        drive()
    expire_lease(run.id)
    assert drive() == ["completed"]
    assert Run.objects.get(pk=run.pk).output["output"] == FORECAST
    assert workflows.calls == {"get_weather": 1, "get_time": 1, "book_table": 2}
    assert [s.kind for s in steps_of(run)] == ["llm", "tool", "tool", "llm", "tool", "llm"]
    assert demo_model.total == 3


def test_run_sync_in_an_async_workflow_is_refused_with_a_clear_error(drive, demo_model):
    run = start_run("pa-run-sync-in-async", {"instructions": DINNER})
    assert drive() == ["failed"]
    run.refresh_from_db()
    assert run.error["code"] == "sdk_misuse" and "await agent.run(...)" in run.error["message"]
    assert demo_model.total == 0


def test_an_agent_without_a_name_is_refused_before_anything_is_sent(drive, demo_model):
    """Before, its step keys came from the caller's variable name once Pydantic AI had
    inferred it, so the next execution in the process found other keys (NonDeterminismError
    after an approval)."""
    run = start_run("pa-anonymous", {})
    assert drive() == ["failed"]
    run.refresh_from_db()
    assert "give the agent one" in run.error["message"] and "name=" in run.error["message"]
    assert demo_model.total == 0


def test_a_run_budget_caps_each_model_request_to_what_it_has_left(drive, demo_model):
    """With no max_tokens, each request was estimated at 1,024 output tokens ($0.0041 at the
    demo model's price, with the prompt): a $0.003 run paused before its first request.
    Capped to what the budget has left, every request fits and the run finishes within it."""
    run = start_run("pa-planner", {"instructions": DINNER}, budget_usd="0.003")
    assert drive() == ["completed"]
    run.refresh_from_db()
    assert 0 < run.cost_micros <= 3_000 and run.reserved_micros == 0
    caps = [b.get("max_completion_tokens", b.get("max_tokens")) for b in demo_model.bodies]
    assert len(caps) == 3 and all(isinstance(c, int) and 0 < c < 750 for c in caps)
    assert Run.objects.get(pk=run.pk).output["output"] == FORECAST
