"""The OpenAI Agents SDK adapter (runs/adapters/openai_agents/): agents written for the SDK,
run by it against the demo model on 127.0.0.1, each model call and tool call a step."""

import asyncio
from collections import Counter
from decimal import Decimal

import pytest

from runs.approvals.models import ApprovalRequest
from runs.approvals.services import decide
from runs.engine.deltas import Conversations
from runs.engine.llm import estimate, usage_of
from runs.models import Run, RunStatus, Step
from runs.operations import halt, set_budget, unhalt
from runs.sdk import start_run
from tests import adapter_openai_agents_workflows as oa
from tests import workflows
from tests.conftest import wait_until
from tests.workflows import file_effects

# Checkpoints are written from threads of their own (the async bridge, or a sync workflow's
# hop off the SDK's event loop): each needs to see the others' commits.
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _reset():
    oa.hooks.clear()
    oa.deltas.clear()
    oa.handed_off.clear()


def keys(run) -> list[tuple[str, str]]:
    return list(Step.objects.filter(run=run).order_by("seq").values_list("key", "kind"))


def effects(directory, tool: str | None = None) -> list[dict]:
    return [e for e in file_effects(str(directory)) if tool is None or e["tool"] == tool]


def request_of(step: Step) -> dict:
    return Conversations(step.run_id).expanded(step.seq, step.input)[0]


def sdk_output(tmp_path, input: dict, build=oa.build) -> str:
    """What the SDK itself answers with the same agent, run without Stepguard."""
    from agents import Runner

    (tmp_path / "plain").mkdir(exist_ok=True)
    plain = {**input, "effects": str(tmp_path / "plain")}
    return asyncio.run(Runner.run(build(plain), oa.QUESTION)).final_output


@pytest.mark.parametrize("protocol", ["responses", "chat"])
def test_each_model_call_and_tool_call_is_a_priced_step_and_the_answer_is_the_sdk_s(
    drive, demo_model, tmp_path, protocol
):
    input = {"protocol": protocol, "script": "lookup, weather", "effects": str(tmp_path)}
    run = start_run("oa-agent", input)
    assert drive() == ["completed"]
    assert keys(run) == [
        ("model:planner", "llm"), ("tool:lookup", "tool"), ("model:planner#2", "llm"),
        ("tool:weather", "tool"), ("model:planner#3", "llm"),
    ]  # fmt: skip
    run.refresh_from_db()
    assert run.output.startswith("Done. Tool results:") and "sunny in Lisbon" in run.output

    llm = Step.objects.filter(run=run, kind="llm").order_by("seq")
    for step in llm:
        assert demo_model.calls[step.idempotency_key] == 1  # its Idempotency-Key header
        priced = usage_of(step.output, "stepguard-demo")
        assert step.tokens_in == priced.tokens_in > 0 and step.tokens_out == priced.tokens_out
        assert step.cost_micros == priced.micros > 0
        assert step.usage["model"] == "stepguard-demo" and step.usage["priced"]
    assert run.cost_micros == sum(s.cost_micros for s in llm)
    assert run.tokens_in == sum(s.tokens_in for s in llm)
    assert demo_model.total == 3
    # The request is recorded as the SDK sent it: instructions, the conversation, the tools.
    request = request_of(llm[1])
    assert request["instructions"].startswith("SCRIPT: lookup, weather")
    assert {t["name"] for t in request["tools"]} == {"lookup", "weather", "book"}
    assert any(item.get("type") == "function_call_output" for item in request["input"])
    tools = {e["tool"]: e["key"] for e in effects(tmp_path)}
    assert tools == {"lookup": f"{run.pk}:tool:lookup", "weather": f"{run.pk}:tool:weather"}
    assert run.output == sdk_output(tmp_path, input)


@pytest.mark.parametrize("workflow", ["oa-agent", "oa-agent-sync"])
def test_a_crash_mid_tool_resumes_without_paying_or_running_a_completed_call_again(
    drive, expire_lease, demo_model, tmp_path, workflow
):
    input = {"script": "lookup, weather", "effects": str(tmp_path)}
    run = start_run(workflow, input)
    workflows.crash_at.add("weather")  # the process dies inside the tool, after its effect
    with pytest.raises(workflows.Crash):
        drive()
    expire_lease(run.id)
    assert drive() == ["completed"]
    assert [e["tool"] for e in effects(tmp_path)] == ["lookup", "weather", "weather"]
    resent = Step.objects.get(run=run, key="tool:weather")
    assert resent.recovered == "resent"  # in flight at the crash: sent again, same key
    assert {e["key"] for e in effects(tmp_path, "weather")} == {resent.idempotency_key}
    for step in Step.objects.filter(run=run, kind="llm"):
        assert demo_model.calls[step.idempotency_key] == 1, step.key
    assert demo_model.total == 3
    assert Run.objects.get(pk=run.pk).output == sdk_output(tmp_path, input)


def test_a_sync_workflow_runs_a_turn_s_parallel_tool_calls_in_the_model_s_order(
    drive, demo_model, tmp_path
):
    input = {"protocol": "chat", "script": "lookup+weather", "effects": str(tmp_path)}
    run = start_run("oa-agent-sync", input)
    assert drive() == ["completed"]
    # Parallel tool calls of one turn: a step each, in the order the model listed them.
    assert keys(run) == [
        ("model:planner", "llm"), ("tool:lookup", "tool"), ("tool:weather", "tool"),
        ("model:planner#2", "llm"),
    ]  # fmt: skip
    assert Run.objects.get(pk=run.pk).output == sdk_output(tmp_path, input)
    assert all(s.cost_micros > 0 for s in Step.objects.filter(run=run, kind="llm"))


def test_a_tool_error_the_sdk_reports_to_the_model_is_the_step_s_output(
    drive, expire_lease, demo_model, tmp_path
):
    input = {"script": "weather, lookup", "effects": str(tmp_path), "fail": ["weather"]}
    run = start_run("oa-agent", input)
    workflows.crash_at.add("lookup")  # replayed after the crash: the same error, not a retry
    with pytest.raises(workflows.Crash):
        drive()
    expire_lease(run.id)
    assert drive() == ["completed"]
    step = Step.objects.get(run=run, key="tool:weather")
    assert (step.status, step.attempt, step.output["sdk_error"]) == ("completed", 1, True)
    assert step.output["output"].startswith("An error occurred while running the tool")
    assert len(effects(tmp_path, "weather")) == 1
    assert Run.objects.get(pk=run.pk).output == sdk_output(tmp_path, input)


@pytest.mark.parametrize("workflow", ["oa-agent", "oa-agent-sync"])
def test_a_tool_the_sdk_marks_needs_approval_waits_durably_and_runs_only_once_approved(
    drive, demo_model, tmp_path, cast, workflow
):
    # The model calls lookup and book in one turn: the approval is asked before either runs,
    # so no tool is in flight while the run waits (it would be sent again on the resume).
    input = {"script": "lookup+book", "effects": str(tmp_path)}
    run = start_run(workflow, input)
    assert drive() == ["waiting"]
    request = ApprovalRequest.objects.get(run=run)
    assert (request.step_key, request.action) == ("approve:book", "call book")
    assert request.payload == {"tool": "book", "args": {"city": "Lisbon", "nights": 3}}
    assert keys(run) == [("model:planner", "llm"), ("approve:book", "approval")]
    assert effects(tmp_path) == []
    assert drive() == []  # nothing to do until a person decides: no worker held

    decide(request.pk, "approve", cast["ada"], "ok")
    assert drive() == ["completed"]
    assert keys(run) == [
        ("model:planner", "llm"), ("approve:book", "approval"), ("tool:lookup", "tool"),
        ("tool:book", "tool"), ("model:planner#2", "llm"),
    ]  # fmt: skip
    assert sorted(e["tool"] for e in effects(tmp_path)) == ["book", "lookup"]  # run together
    assert "'booked': 'Lisbon'" in Run.objects.get(pk=run.pk).output
    assert demo_model.total == 2


def test_a_refused_tool_call_never_runs_and_the_model_is_told_why(
    drive, demo_model, tmp_path, cast
):
    run = start_run("oa-agent", {"script": "book", "effects": str(tmp_path)})
    assert drive() == ["waiting"]
    decide(ApprovalRequest.objects.get(run=run).pk, "reject", cast["ada"], "too pricey")
    assert drive() == ["completed"]
    assert effects(tmp_path) == []
    assert not Step.objects.filter(run=run, kind="tool").exists()
    told = request_of(Step.objects.get(run=run, key="model:planner#2"))["input"][-1]
    assert told["type"] == "function_call_output"
    assert "not approved" in told["output"] and "too pricey" in told["output"]


def test_the_sdk_s_approval_policy_is_asked_of_each_call_s_arguments(
    drive, demo_model, tmp_path, cast
):
    input = {"script": "book", "effects": str(tmp_path), "approval": "over-2-nights"}
    run = start_run("oa-agent", input)
    assert drive() == ["waiting"]  # 3 nights: a person decides
    decide(ApprovalRequest.objects.get(run=run).pk, "approve", cast["ada"])
    assert drive() == ["completed"]
    assert len(effects(tmp_path, "book")) == 1

    run = start_run("oa-agent", input | {"nights": 2})
    assert drive() == ["completed"]  # 2 nights: no one is asked
    assert not ApprovalRequest.objects.filter(run=run).exists()
    assert len(effects(tmp_path, "book")) == 2


def test_an_approval_nobody_gives_in_time_is_a_refusal(drive, demo_model, tmp_path):
    input = {"script": "book", "effects": str(tmp_path), "approval_timeout": 0.2}
    run = start_run("oa-agent", input)
    outcomes = drive()
    assert outcomes[0] == "waiting", outcomes  # it waits, durably, holding no worker
    # Expired 0.2 s later: on a loaded machine the same drive may already have taken it again.
    wait_until(lambda: outcomes[-1] == "completed" or drive() == ["completed"],
               what="the approval to expire")  # fmt: skip
    assert effects(tmp_path) == []
    told = request_of(Step.objects.get(run=run, key="model:planner#2"))["input"][-1]
    assert "not approved" in told["output"] and "expired" in told["output"]


def test_a_run_config_model_that_bypasses_the_durable_agent_is_refused(drive, demo_model, tmp_path):
    run = start_run("oa-run-config-model", {"script": "lookup", "effects": str(tmp_path)},
                    max_attempts=1)  # fmt: skip
    assert drive() == ["failed"]
    run.refresh_from_db()
    assert "RunConfig(model=...)" in run.error["message"], run.error
    assert effects(tmp_path) == [] and not Step.objects.filter(run=run).exists()


def test_a_run_budget_caps_each_model_call_and_stops_the_agent_before_one_it_cannot_afford(
    drive, demo_model, tmp_path, cast
):
    input = {"script": "lookup, weather", "effects": str(tmp_path)}
    reference = start_run("oa-agent", input)
    drive()
    first = Step.objects.get(run=reference, key="model:planner")
    # The first call's prompt plus 1,024 tokens of answer: with no cap, each call was
    # estimated at 1,024 output tokens and the run paused after its first call, at a fraction
    # of its budget spent. Capped to what the budget has left, both calls fit.
    room = estimate("stepguard-demo", request_of(first)).micros
    run = start_run("oa-agent", input, budget_usd=Decimal(room) / 1_000_000)
    assert drive() == ["completed"]
    run.refresh_from_db()
    assert run.cost_micros <= room and run.reserved_micros == 0
    caps = [body.get("max_output_tokens") for body in demo_model.bodies[-2:]]
    assert all(isinstance(cap, int) and 0 < cap < 1024 for cap in caps)

    # A budget the second call's prompt does not fit once the first is paid: the run stops
    # before it, with nothing sent.
    prompt = estimate("stepguard-demo", {**request_of(first), "max_output_tokens": 0}).micros
    tight = first.cost_micros + prompt + 10
    run = start_run("oa-agent", input, budget_usd=Decimal(tight) / 1_000_000)
    assert drive() == ["over_budget"]
    run.refresh_from_db()
    assert keys(run) == [("model:planner", "llm"), ("tool:lookup", "tool")]
    assert run.cost_micros <= tight and run.reserved_micros == 0
    sent = sum(demo_model.calls[s.idempotency_key] for s in Step.objects.filter(run=run))
    assert sent == 1  # the second call was never sent

    set_budget(run, cast["otto"], "worth it", usd=Decimal("1"))
    assert drive() == ["completed"]
    for step in Step.objects.filter(run=run, kind="llm"):
        assert demo_model.calls[step.idempotency_key] == 1
    assert [e["tool"] for e in effects(tmp_path)].count("lookup") == 3  # one per run


def test_a_halt_stops_the_agent_at_its_next_call_and_unhalt_goes_on(
    drive, demo_model, tmp_path, cast
):
    run = start_run("oa-agent", {"script": "lookup, weather", "effects": str(tmp_path)})
    oa.hooks["lookup"] = lambda: halt(run, cast["otto"], "runaway agent")
    assert drive() == ["halted"]
    # The tool running when the halt landed finished and was checkpointed; no call after it.
    assert keys(run) == [("model:planner", "llm"), ("tool:lookup", "tool")]
    assert demo_model.total == 1
    unhalt(run, cast["otto"], "fine")
    assert drive() == ["completed"]
    assert [e["tool"] for e in effects(tmp_path)] == ["lookup", "weather"]
    assert demo_model.total == 3


@pytest.mark.parametrize("handoff_object", [False, True])
def test_handoffs_lead_to_durable_agents(drive, demo_model, tmp_path, handoff_object):
    input = {"effects": str(tmp_path), "handoff_object": handoff_object}
    run = start_run("oa-handoff", input)
    assert drive() == ["completed"]
    assert keys(run) == [
        ("model:triage", "llm"), ("model:specialist", "llm"), ("tool:lookup", "tool"),
        ("model:specialist#2", "llm"),
    ]  # fmt: skip
    output = Run.objects.get(pk=run.pk).output
    assert output["last_agent"] == "specialist"
    assert oa.handed_off == (["now"] if handoff_object else [])
    assert output["output"] == sdk_output(tmp_path, input, build=oa.triage)


def test_a_streamed_run_streams_live_calls_and_replays_recorded_ones_whole(
    drive, expire_lease, demo_model, tmp_path
):
    input = {"protocol": "chat", "script": "lookup, weather", "effects": str(tmp_path)}
    run = start_run("oa-agent-streamed", input)
    workflows.crash_at.add("weather")
    with pytest.raises(workflows.Crash):
        drive()
    assert oa.deltas == []  # the first two turns called tools: no text
    expire_lease(run.id)
    assert drive() == ["completed"]
    run.refresh_from_db()
    assert "".join(oa.deltas) == run.output  # the last turn's text, streamed as it came
    for step in Step.objects.filter(run=run, kind="llm"):
        assert demo_model.calls[step.idempotency_key] == 1
        assert step.cost_micros > 0 and step.tokens_out > 0
    assert demo_model.total == 3
    assert run.output == sdk_output(tmp_path, input)


def test_the_step_retries_a_failed_model_call_not_the_sdk(drive, demo_model, tmp_path):
    demo_model.fail_next(500)
    run = start_run("oa-agent", {"script": "lookup", "effects": str(tmp_path)})
    assert drive() == ["completed"]
    first = Step.objects.get(run=run, key="model:planner")
    assert first.attempt == 2  # the step's own retry, recorded, with the same key
    assert demo_model.calls[first.idempotency_key] == 2


def test_what_would_run_outside_a_step_is_refused(drive, demo_model, tmp_path):
    run = start_run("oa-refused", {"script": "lookup", "effects": str(tmp_path)})
    assert drive() == ["completed"]
    refused = Run.objects.get(pk=run.pk).output
    assert refused["local"].startswith("StepMisuse: agent 'planner': LocalShellTool")
    assert "durable(agent, ctx).as_tool(...)" in refused["agent-tool"]
    assert demo_model.total == 0


@pytest.mark.slow
def test_a_worker_killed_mid_run_completes_it_with_no_completed_call_repeated(
    spawn_worker, demo_model, tmp_path
):
    input = {"script": "lookup, weather", "effects": str(tmp_path)}
    workers = [
        spawn_worker("--import", "tests.adapter_openai_agents_workflows", lease=1.0, wait=False)
        for _ in range(2)
    ]
    for worker in workers:
        worker.wait_registered()
    run = start_run("oa-agent", input | {"slow": {"weather": 1.0}})
    started = wait_until(lambda: effects(tmp_path, "weather"), what="the weather tool to start")
    victim = next(w for w in workers if w.pid == started[0]["pid"])
    victim.kill()  # SIGKILL, inside the tool: its step is in flight; the other worker takes over
    run = wait_until(
        lambda: (r := Run.objects.get(pk=run.pk)).is_terminal and r, timeout=30, what="the run"
    )
    assert run.status == RunStatus.COMPLETED, run.error
    ran = Counter(e["key"] for e in effects(tmp_path))
    for step in Step.objects.filter(run=run):
        times = ran[step.idempotency_key]
        if step.kind == "llm":
            times = demo_model.calls[step.idempotency_key]
        assert times == (2 if step.recovered == "resent" else 1), (step.key, times)
    assert Step.objects.get(run=run, key="tool:weather").recovered == "resent"
    assert len({e["pid"] for e in effects(tmp_path, "weather")}) == 2  # each worker ran it
    assert run.output == sdk_output(tmp_path, input)


def test_usage_without_cache_write_tokens_is_recorded_and_valid_for_the_sdk():
    """Before, a provider's usage that left `cache_write_tokens` out (None in the SDK's
    usage) failed `Runner.run_streamed`: the final event's usage no longer validated."""
    from agents.usage import Usage
    from openai.types.responses import ResponseUsage
    from openai.types.responses.response_usage import InputTokensDetails

    from runs.adapters.openai_agents.records import _recorded

    details = InputTokensDetails.model_construct(cached_tokens=3, cache_write_tokens=None)
    usage = Usage(requests=1, input_tokens=10, output_tokens=5, total_tokens=15)
    usage.input_tokens_details = details
    recorded = _recorded([], usage, "gpt-4o", "resp_1", None)
    fields = {k: v for k, v in recorded["usage"].items() if k != "requests"}
    valid = ResponseUsage.model_validate(fields)
    assert valid.input_tokens_details.cached_tokens == 3
    assert valid.input_tokens_details.cache_write_tokens == 0
