"""Model calls, tools and the agent loop, against the scripted demo model on 127.0.0.1."""

import json
from datetime import timedelta
from decimal import ROUND_CEILING, Decimal

import pytest
from django.urls import reverse
from django.utils import timezone

from examples import flight_agent, outreach, research  # noqa: F401  (registers them)
from examples.models import Booking
from examples.models import Effect as DemoEffect
from runs.approvals.models import ApprovalRequest
from runs.approvals.services import decide
from runs.engine.deltas import Conversations
from runs.engine.llm import cost
from runs.errors import StepMisuse
from runs.models import Event, Run, RunStatus, Step
from runs.sdk import RetryPolicy, send_signal, start_run
from tests import agent_workflows, workflows
from tests.conftest import wait_until
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db


def only_llm_step(run) -> Step:
    return Step.objects.get(run=run, kind="llm")


def request_of(step: Step) -> dict:
    """The request a model-call step sent, whole (it is stored as a delta of the one before)."""
    return Conversations(step.run_id).expanded(step.seq, step.input)[0]


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
    assert DemoEffect.objects.filter(label="book").count() == 1
    assert Run.objects.get(pk=run.pk).output["answer"].startswith("Done.")


def test_a_rejected_booking_ends_the_demo_agent_s_run_as_rejected_not_completed(
    drive, demo_model, cast, client
):
    """Issue 47 section 4: the model was told, sent a confirmation of no booking and answered,
    and the run ended green `completed`. The booking tool's refusal ends the run now
    (`on_refusal="raise"`); a tool that tells the model is tested with agent-protocols."""
    run = start_run("flight-booking", FLIGHT, version="2")
    drive()
    decide(ApprovalRequest.objects.get(run=run).pk, "reject", cast["ada"], "too pricey")
    assert drive() == ["failed"]
    assert not Booking.objects.exists()
    run.refresh_from_db()
    assert (run.status, run.attempt, run.error["code"]) == ("failed", 1, "approval_rejected")
    assert "ada rejected 'call book_flight'" in run.error["message"]
    assert "too pricey" in run.error["message"]
    assert not Step.objects.filter(run=run, key__startswith="tool-send_confirmation").exists()
    assert not Step.objects.filter(run=run, key="think-2").exists()  # the model was not asked
    client.force_login(cast["otto"])
    page = client.get(f"/runs/{run.pk}").content.decode()
    assert "Ended by a rejection: ada rejected &#x27;call book_flight&#x27;" in page
    assert '<span id="run-status" class="badge status-failed">failed</span>' in page
    assert "Reason to retry" not in page


def test_a_spent_budget_stops_the_agent_before_its_next_turn(drive, demo_model):
    # Each draft reserves its prompt plus max_tokens (about $0.00083 at the demo price) first.
    run = start_run("outreach", {"prospects": ["a@x", "b@x", "c@x"]}, budget_usd="0.001")
    assert drive() == ["over_budget"]
    run.refresh_from_db()
    assert run.status == RunStatus.OVER_BUDGET and run.cost_micros <= 1_000
    assert DemoEffect.objects.filter(label="email").count() == 2
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


# -- issue 19: the bugs found using the agent layer as a production team would ------------------


HI = {"role": "user", "content": "hi"}


@pytest.fixture
def llm_options():
    agent_workflows.options.clear()
    yield agent_workflows.options
    agent_workflows.options.clear()


def test_a_sync_workflow_with_an_async_client_sends_each_call_once(drive, demo_model):
    # One event loop per execution: the client's pooled connection stays usable, so no call
    # goes out on a connection whose loop is closed (sent, paid, then lost).
    run = start_run("sync-with-async-client", {"turns": 4})
    assert drive() == ["completed"]
    steps = Step.objects.filter(run=run, kind="llm")
    assert demo_model.total == 4  # 7 before: 3 calls sent twice, the first copy lost
    assert [s.attempt for s in steps] == [1, 1, 1, 1]
    assert all(demo_model.calls[s.idempotency_key] == 1 for s in steps)


def test_streaming_what_cannot_stream_is_refused_before_anything_is_sent(drive, llm_options):
    llm_options.update(protocol="plain", request={"stream": True})
    run = start_run("llm-options")
    assert drive() == ["failed"]
    run.refresh_from_db()
    assert run.error["code"] == "sdk_misuse" and "cannot stream" in run.error["message"]
    assert run.attempt == 1  # not retried: it cannot work the next time either
    assert not Step.objects.filter(run=run).exists()


def test_sdk_objects_in_messages_are_sent_and_recorded_as_the_client_sends_them(drive, demo_model):
    run = start_run("sdk-objects-in-messages")
    assert drive() == ["completed"]
    steps = {s.key: s for s in Step.objects.filter(run=run)}
    sent = {body["messages"][-1]["content"]: body for body in demo_model.bodies}
    assert request_of(steps["chat-1"])["messages"] == sent["second"]["messages"]
    assert request_of(steps["chat-1"])["messages"][1]["role"] == "assistant"
    assert request_of(steps["claude-1"])["messages"] == sent["b"]["messages"]
    assert request_of(steps["claude-1"])["messages"][1]["content"][0]["type"] == "text"
    assert demo_model.total == 4 and all(s.attempt == 1 for s in steps.values())


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ('["LIS"]', "must be a JSON object"),  # valid JSON, not an object
        ('{"city": "LIS"}', "missing 'amount'"),  # the approval predicate cannot judge it
    ],
)
def test_tool_arguments_the_tool_cannot_take_go_back_to_the_model(drive, demo_model, args, error):
    run = start_run("odd-tool-calls", {"args": args})
    assert drive() == ["completed"]
    run.refresh_from_db()
    tool_result = json.loads(run.output["messages"][-2]["content"])
    assert error in tool_result["error"]
    assert run.output["answer"].startswith("Done.") and error in run.output["answer"]
    assert [s.key for s in Step.objects.filter(run=run)] == ["think-0", "think-1"]
    assert not ApprovalRequest.objects.filter(run=run).exists()


IMAGE = "data:image/png;base64," + "iVBORw0KGgo" * 37_000  # about 400 KB


@pytest.mark.parametrize(
    ("protocol", "content"),
    [
        ("chat", [{"type": "image_url", "image_url": {"url": IMAGE}}]),
        ("responses", [{"type": "input_image", "image_url": IMAGE}]),
        (
            "anthropic",
            [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                          "data": IMAGE.split(",")[1]}}],
        ),
    ],
)  # fmt: skip
def test_an_image_is_estimated_as_an_image_not_as_its_base64(
    drive, demo_model, llm_options, protocol, content
):
    # Its base64 counted as text was ~100,000 tokens: the run paused before the call.
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, *content]}]
    prompt = {"input": messages} if protocol == "responses" else {"messages": messages}
    llm_options.update(protocol=protocol, request=prompt)
    run = start_run("llm-options", budget_tokens=20_000)
    assert drive() == ["completed"]
    assert demo_model.total == 1
    assert Step.objects.get(run=run).tokens_in < 2_000


def test_the_responses_apis_instructions_count_in_the_estimate(drive, demo_model, llm_options):
    # 40,000 characters of instructions were estimated at 17 tokens: the call went out.
    request = {"instructions": "Be thorough. " * 3_000, "input": "hi", "max_output_tokens": 100}
    llm_options.update(protocol="responses", request=request)
    run = start_run("llm-options", budget_tokens=5_000)
    assert drive() == ["over_budget"]
    event = Event.objects.get(run=run, type="budget.exceeded")
    assert event.payload["estimate"] > 9_750  # the instructions alone: 39,000 characters
    assert demo_model.total == 0


def test_a_large_request_is_recorded_whole_up_to_the_output_limit(
    drive, demo_model, llm_options, settings
):
    # Over 64 KB it was recorded as its first 2,000 characters: what the model saw was lost.
    turns = [{"role": "tool" if i % 2 else "user", "content": "x" * 8_000} for i in range(12)]
    llm_options.update(request={"messages": turns})
    run = start_run("llm-options")
    assert drive() == ["completed"]
    assert Step.objects.get(run=run).input[0]["messages"] == demo_model.bodies[0]["messages"]

    settings.STEPGUARD_MAX_OUTPUT_BYTES = 50_000
    run = start_run("llm-options")
    assert drive() == ["completed"]
    recorded = Step.objects.get(run=run).input
    assert "over the 50,000 recorded" in recorded["truncated"]


def micros(usd) -> int:
    return int((Decimal(str(usd)) * 1_000_000).to_integral_value(rounding=ROUND_CEILING))


SYSTEM = "You are a careful travel agent. " * 200
CACHED_SYSTEM = {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}


@pytest.mark.parametrize(
    ("protocol", "request_options", "price"),
    [
        (
            "chat",
            {"messages": [{"role": "system", "content": SYSTEM}, HI], "prompt_cache_key": "k"},
            # gpt-4o-mini: $0.15 input, $0.075 cached input, $0.60 output per million
            lambda u: (
                (u["prompt_tokens"] - u["prompt_tokens_details"]["cached_tokens"]) * Decimal("0.15")
                + u["prompt_tokens_details"]["cached_tokens"] * Decimal("0.075")
                + u["completion_tokens"] * Decimal("0.60")
            ),
        ),
        (
            "anthropic",
            {"system": [CACHED_SYSTEM], "messages": [HI]},
            # claude-3-5-haiku: $0.80 input, $0.08 cache read, $1.00 cache write, $4.00 output
            lambda u: (
                u["input_tokens"] * Decimal("0.80")
                + u["cache_read_input_tokens"] * Decimal("0.08")
                + u["cache_creation_input_tokens"] * Decimal("1.00")
                + u["output_tokens"] * Decimal("4.00")
            ),
        ),
    ],
)
def test_cached_and_cache_write_tokens_are_priced_at_their_own_rates(
    drive, demo_model, llm_options, protocol, request_options, price
):
    llm_options.update(protocol=protocol, request=request_options)
    runs = [start_run("llm-options"), start_run("llm-options")]  # the 2nd reads the 1st's cache
    assert drive() == ["completed", "completed"]
    for run in runs:
        step = only_llm_step(run)
        usage = step.output["usage"]
        assert step.cost_micros == micros(price(usage) / 1_000_000)
    assert json.dumps(only_llm_step(runs[1]).output["usage"]) != json.dumps(
        only_llm_step(runs[0]).output["usage"]
    )  # the first wrote the cache (or read nothing), the second read it


@pytest.mark.parametrize(
    ("model", "rates"),
    [
        ("o3-mini", (1.10, 4.40)),  # was priced as o3, its prefix ($2 / $8)
        ("openai/gpt-4o", (2.50, 10.00)),  # a gateway's name for gpt-4o: was $0
        ("gpt-4o-mini-2024-07-18", (0.15, 0.60)),  # a dated snapshot
    ],
)
def test_a_model_is_priced_by_its_exact_name(drive, demo_model, llm_options, model, rates):
    llm_options.update(request={"model": model, "messages": [HI]})
    run = start_run("llm-options")
    assert drive() == ["completed"]
    step = only_llm_step(run)
    usd = Decimal(str(rates[0])) * step.tokens_in + Decimal(str(rates[1])) * step.tokens_out
    assert step.cost_micros == micros(usd / 1_000_000)
    assert not Event.objects.filter(run=run, type="model.unpriced").exists()


def test_an_unpriced_model_is_flagged_and_refused_under_a_usd_budget_if_so_set(
    drive, demo_model, llm_options, settings
):
    llm_options.update(request={"model": "my-finetune", "messages": [HI]})
    run = start_run("llm-options", budget_usd="1")
    assert drive() == ["completed"]
    assert Event.objects.get(run=run, type="model.unpriced").payload == {"model": "my-finetune"}
    assert only_llm_step(run).cost_micros == 0

    settings.STEPGUARD_REFUSE_UNPRICED_MODELS = True
    run = start_run("llm-options", budget_usd="1")
    assert drive() == ["failed"]
    run.refresh_from_db()
    assert run.error["cause"]["code"] == "unpriced_model" and run.attempt == 1
    assert demo_model.total == 1  # the refused call was never sent
    unbudgeted = start_run("llm-options")
    assert drive() == ["completed"] and only_llm_step(unbudgeted).status == "completed"


@pytest.mark.parametrize(
    ("protocol", "status"),
    [("chat", 400), ("chat", 422), ("responses", 404), ("anthropic", 401), ("anthropic", 403)],
)
def test_a_request_the_provider_refuses_is_not_sent_again(
    drive, demo_model, llm_options, protocol, status
):
    # It was retried 3 times a step, and the run 3 times: 9 requests for one bad request.
    prompt = {"input": "hi"} if protocol == "responses" else {"messages": [HI]}
    llm_options.update(protocol=protocol, request=prompt)
    demo_model.fail_next(status, times=9)
    run = start_run("llm-options")
    assert drive() == ["failed"]
    run.refresh_from_db()
    assert run.error["cause"]["code"] == "model_request_rejected"
    assert str(status) in run.error["cause"]["message"]
    assert demo_model.total == 1


@pytest.mark.parametrize(
    ("status", "headers", "delay"),
    [
        (429, {"retry-after-ms": "250"}, 0.25),
        (429, {"retry-after": "1"}, 1.0),
        (503, {"retry-after": "0"}, 0.0),
        (408, {}, 0.0),  # the policy's own backoff: none in this workflow
    ],
)
def test_a_busy_provider_is_retried_after_the_delay_it_asks_for(
    drive, demo_model, llm_options, status, headers, delay
):
    llm_options.update(request={"messages": [HI]})
    demo_model.fail_next(status, headers=headers)
    run = start_run("llm-options")
    outcomes = drive()

    def completed() -> bool:
        outcomes.extend(drive())
        return "completed" in outcomes

    wait_until(completed, timeout=10, what="the retry after the wait")
    # The provider's wait is a durable one, however short (no thread sleeps it); the policy's
    # own short backoff is slept in the thread.
    assert outcomes[0] == ("waiting" if headers else "completed")
    retrying = Event.objects.get(run=run, type="step.retrying")
    assert retrying.payload["delay_s"] == delay
    assert only_llm_step(run).attempt == 2 and demo_model.total == 2


def test_a_long_retry_after_is_a_durable_wait_that_holds_no_worker(drive, demo_model, llm_options):
    # A Retry-After of a minute was slept in the worker thread, which sat idle for that minute.
    llm_options.update(request={"messages": [HI]}, retry=RetryPolicy(max_attempts=3))
    demo_model.fail_next(429, headers={"retry-after": "60"}, times=2)
    run = start_run("llm-options", budget_usd="1")
    assert drive() == ["waiting"]  # the thread was given back at once
    run.refresh_from_db()
    step = only_llm_step(run)
    assert step.status == "waiting" and step.attempt == 1 and step.reserved_micros > 0
    assert run.wake_at == step.wake_at
    assert 55 <= (step.wake_at - timezone.now()).total_seconds() <= 60
    retrying = Event.objects.get(run=run, type="step.retrying")
    assert retrying.payload["delay_s"] == 60 and retrying.payload["attempt"] == 2
    assert drive() == []  # nothing to do until then, and nothing was sent again
    assert demo_model.total == 1

    def a_minute_passes():
        past = timezone.now() - timedelta(seconds=1)
        Run.objects.filter(pk=run.pk).update(wake_at=past)
        Step.objects.filter(pk=step.pk).update(wake_at=past)

    a_minute_passes()
    assert drive() == ["waiting"]  # the second try was refused alike
    a_minute_passes()
    assert drive() == ["completed"]
    step.refresh_from_db()
    assert (step.status, step.attempt, step.wake_at) == ("completed", 3, None)
    keys = {k for k in demo_model.calls}
    assert keys == {step.idempotency_key} and demo_model.calls[step.idempotency_key] == 3
    run.refresh_from_db()
    assert run.cost_micros == step.cost_micros > 0 and run.reserved_micros == 0


def test_a_durable_retry_delay_counts_against_the_step_s_attempts(drive, demo_model, llm_options):
    llm_options.update(request={"messages": [HI]}, retry=RetryPolicy(max_attempts=2))
    demo_model.fail_next(429, headers={"retry-after": "30"}, times=5)
    run = start_run("llm-options")
    assert drive() == ["waiting"]
    Run.objects.filter(pk=run.pk).update(wake_at=timezone.now())
    assert drive() == ["waiting"]  # woken early (the step's own time has not come): waits on
    assert demo_model.total == 1
    Step.objects.filter(run=run).update(wake_at=timezone.now())
    Run.objects.filter(pk=run.pk).update(wake_at=timezone.now())
    drive()
    # The second try was the last the policy allows: the step failed, and with it the run
    # (issue 47: not retried from the top, which started a new sequence of tries).
    failed = Event.objects.get(run=run, type="step.failed")
    assert failed.payload["attempt"] == 2 and "429" in failed.payload["error"]["message"]
    run.refresh_from_db()
    assert run.attempt == 1 and run.status == "failed" and demo_model.total == 2
    assert "step 'ask' failed after 2 attempts" in run.error["reason"]


def test_the_sdk_s_own_retries_are_turned_off_inside_a_step(drive, demo_model, llm_options):
    # OpenAI() retries twice by default: each step attempt sent up to 3 requests, unrecorded.
    llm_options.update(request={"messages": [HI]}, client={"max_retries": 2})
    demo_model.fail_next(500, times=2)
    run = start_run("llm-options")
    assert drive() == ["completed"]
    step = only_llm_step(run)
    assert step.attempt == 3 and demo_model.total == 3  # one request per recorded attempt
    assert Event.objects.filter(run=run, type="step.retrying").count() == 2


def test_usage_is_recorded_per_kind_each_at_its_price(drive, demo_model, llm_options, client, cast):
    # A bill needs more than tokens in and out: cached input, reasoning... each has its rate.
    first = {"model": "o3-mini", "messages": [HI, {"role": "user", "content": "x" * 4000}]}
    llm_options.update(request=first | {"prompt_cache_key": "k"})
    start_run("llm-options")
    run = start_run("llm-options")  # the same prefix again: read from the cache
    assert drive() == ["completed", "completed"]
    step = only_llm_step(run)
    usage = step.output["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    reasoning = usage["completion_tokens_details"]["reasoning_tokens"]
    assert cached > 0 and reasoning > 0
    kinds = step.usage["kinds"]
    assert step.usage["model"] == "o3-mini" and step.usage["priced"] is True
    assert kinds["cached_input"]["tokens"] == cached
    assert kinds["input"]["tokens"] == usage["prompt_tokens"] - cached
    assert kinds["reasoning"]["tokens"] == reasoning
    assert kinds["output"]["tokens"] == usage["completion_tokens"] - reasoning
    rates = {"input": "1.10", "cached_input": "0.55", "output": "4.40", "reasoning": "4.40"}
    for kind, rate in rates.items():
        expected = Decimal(rate) * kinds[kind]["tokens"] / 1_000_000
        assert Decimal(kinds[kind]["usd"]) == expected
    total = sum(Decimal(k["usd"]) for k in kinds.values())
    assert step.cost_micros == int((total * 1_000_000).to_integral_value(ROUND_CEILING))

    client.force_login(cast["vera"])  # a viewer
    bill = client.get(f"/api/runs/{run.pk}/usage").json()
    assert bill["models"]["o3-mini"]["calls"] == 1 and bill["unpriced"] == []
    assert bill["models"]["o3-mini"]["kinds"]["reasoning"]["tokens"] == reasoning
    assert Decimal(bill["spend"]["usd"]) == Decimal(step.cost_micros) / 1_000_000
    steps = client.get(f"/api/runs/{run.pk}/steps").json()
    assert steps[0]["usage"] == step.usage


def test_an_answer_with_no_max_tokens_is_capped_to_what_the_budget_has_left(
    drive, demo_model, llm_options
):
    # With no max_tokens, the estimate assumed 1,024 tokens while the model may answer 16k:
    # a run under budget paid past it. Now the request carries the cap the budget allows.
    llm_options.update(request={"model": "gpt-4o-mini", "messages": [HI]}, no_max_tokens=True)
    run = start_run("llm-options", budget_usd="0.0003")  # $0.0003 at $0.60/M out: ~500 tokens
    assert drive() == ["completed"]
    sent = demo_model.bodies[-1]
    step = only_llm_step(run)
    assert 400 < sent["max_completion_tokens"] < 500
    assert step.input[0]["max_completion_tokens"] == sent["max_completion_tokens"]
    unbudgeted = start_run("llm-options")
    assert drive() == ["completed"]
    assert "max_completion_tokens" not in demo_model.bodies[-1]
    assert only_llm_step(unbudgeted).status == "completed"


def test_typed_responses_are_the_client_s_own_objects_on_the_first_run_and_on_replay(
    drive, demo_model, expire_lease
):
    # The guide's code reads completion.choices[0].message.tool_calls[0]: with typed=True it
    # runs unchanged, on the first run and on the resume that replays the model's answer.
    workflows.calls.clear()
    workflows.crash_at.add("get_weather")
    run = start_run("guide-weather")
    with pytest.raises(workflows.Crash):
        drive()
    expire_lease(run.id)
    assert drive() == ["completed"]
    run.refresh_from_db()
    assert run.output.startswith("Done. Tool results: 14C at 48.85,2.35")
    assert demo_model.total == 2  # "ask" replayed as a ChatCompletion, not asked again
    assert workflows.calls["get_weather"] == 2  # the crashed call, re-sent
    ask = Step.objects.get(run=run, key="ask")
    assert ask.output["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == (
        "get_weather"
    )  # stored as JSON all the same


@pytest.mark.parametrize(
    ("protocol", "type_name"),
    [("chat", "ChatCompletion"), ("responses", "Response"), ("anthropic", "Message")],
)
def test_typed_true_returns_each_protocol_s_response_type(
    drive, demo_model, llm_options, protocol, type_name
):
    prompt = {"input": "hi"} if protocol == "responses" else {"messages": [HI]}
    llm_options.update(protocol=protocol, request=prompt | {"typed": True})
    run = start_run("llm-options")
    assert drive() == ["completed"]
    assert agent_workflows.options["returned"] == type_name
    assert only_llm_step(run).output["usage"]  # the step keeps the JSON


def test_typed_refuses_what_it_cannot_type_before_anything_is_sent(drive, demo_model, llm_options):
    llm_options.update(request={"messages": [HI], "typed": dict})
    run = start_run("llm-options")
    assert drive() == ["failed"]
    assert "not a pydantic model class" in Run.objects.get(pk=run.pk).error["message"]
    assert demo_model.total == 0


def text_of(protocol: str, response: dict) -> str:
    if protocol == "chat":
        return response["choices"][0]["message"]["content"]
    if protocol == "responses":
        return response["output"][0]["content"][0]["text"]
    return response["content"][0]["text"]


@pytest.mark.parametrize("protocol", ["chat", "responses", "anthropic"])
@pytest.mark.parametrize(("async_client", "helper"), [(False, False), (True, True)])
def test_a_streamed_answer_is_recorded_whole_and_its_deltas_are_not_replayed(
    drive, demo_model, expire_lease, protocol, async_client, helper
):
    # stream=True paid and then failed with a TypeError, and the step retried it: 3 paid calls.
    agent_workflows.deltas.clear()
    workflows.crash_at.add("after-stream")
    shape = {"protocol": protocol, "async_client": async_client, "helper": helper}
    run = start_run("llm-stream", shape)
    with pytest.raises(workflows.Crash):
        drive()
    streamed = list(agent_workflows.deltas)
    assert len(streamed) > 1  # handed over piece by piece
    step = only_llm_step(run)
    assert step.status == "completed" and "".join(streamed) == text_of(protocol, step.output)
    usage = step.output["usage"]
    assert step.tokens_out == usage.get("completion_tokens", usage.get("output_tokens")) > 1
    assert step.cost_micros > 0 and step.input[0]["stream"] is True
    expire_lease(run.id)
    assert drive() == ["completed"]  # the resume replays the final response...
    assert agent_workflows.deltas == streamed  # ...and emits no delta again
    assert demo_model.total == 1 and demo_model.bodies[0]["stream"] is True


@pytest.mark.parametrize("protocol", ["chat", "anthropic"])
@pytest.mark.django_db(transaction=True)  # its checkpoints are written from a thread of its own
def test_an_async_workflow_streams_too(drive, demo_model, protocol):
    agent_workflows.deltas.clear()
    run = start_run("llm-stream-async", {"protocol": protocol, "helper": False})
    assert drive() == ["completed"]
    output = Run.objects.get(pk=run.pk).output
    assert "".join(agent_workflows.deltas) == text_of(protocol, output)
    assert only_llm_step(run).tokens_in > 0 and demo_model.total == 1


@pytest.mark.django_db(transaction=True)  # its checkpoints are written from threads of their own
def test_gathered_model_calls_run_concurrently_and_replay_in_the_same_positions(
    drive, demo_model, expire_lease
):
    # Each ctx.llm held the workflow's one database thread for the whole call: 3 x 1 s calls
    # took 3 s. The demo model answers none until all three are in flight.
    demo_model.hold(3)
    workflows.calls.clear()
    workflows.crash_at.add("after-gather")
    run = start_run("llm-gather")
    with pytest.raises(workflows.Crash):
        drive()
    assert demo_model.max_in_flight == 3
    steps = Step.objects.filter(run=run).order_by("seq")
    assert [(s.seq, s.key) for s in steps] == [
        (0, "ask-0"), (1, "ask-1"), (2, "ask-2"), (3, "lookup-0"), (4, "lookup-1"),
    ]  # fmt: skip
    # The last step to finish waits for the run's next write to record it (one commit per
    # step), so the crash leaves it started: the resume re-sends it with its key.
    unrecorded = {s.key for s in steps if s.status == "started"}
    assert len(unrecorded) <= 1 and unrecorded <= {"lookup-0", "lookup-1"}
    # The completion writer may still record the last step after the crash, renewing the
    # lease with its fenced write: expire it again until the run is taken (a clean CI saw []).
    resumed = wait_until(lambda: (expire_lease(run.id), drive())[1], what="the run resumed")
    assert resumed == ["completed"]  # replayed in the same positions: no NonDeterminismError
    output = Run.objects.get(pk=run.pk).output
    assert [a.split(" (note")[0] for a in output["answers"]] == [
        f"[demo model] question number {i}" for i in range(3)
    ]
    # Each tool saw its own idempotency key, both as an argument and as ctx.idempotency_key.
    assert output["found"] == [f"{n}:{run.id}:lookup-{n}:{run.id}:lookup-{n}" for n in range(2)]
    assert demo_model.total == 3
    # The crash here is in-process, so the completion writer may still record the last step
    # within its window before the resume: a re-sent tool is the one the final record says.
    resent = {s.key for s in Step.objects.filter(run=run, recovered="resent")}
    assert resent <= unrecorded
    assert workflows.calls == {f"lookup-{n}": 1 + (f"lookup-{n}" in resent) for n in range(2)}


@pytest.mark.django_db(transaction=True)
def test_more_steps_at_once_than_threads_all_complete_in_order(drive):
    from runs.engine.aio.host import MAX_CONCURRENT_STEPS

    n = MAX_CONCURRENT_STEPS + 8
    run = start_run("gather-many", {"n": n})
    assert drive() == ["completed"]
    assert Run.objects.get(pk=run.pk).output == list(range(n))
    keys = list(Step.objects.filter(run=run).order_by("seq").values_list("key", flat=True))
    assert keys == [f"echo-{i}" for i in range(n)]


@pytest.mark.django_db(transaction=True)
def test_a_step_inside_an_async_step_is_refused(drive):
    run = start_run("nested-async-step")
    assert drive() == ["failed"]
    run.refresh_from_db()
    assert (run.error["step"], run.error["cause"]["code"]) == ("outer", "sdk_misuse")
    assert "a step was called inside step 'outer'" in run.error["cause"]["message"]
    assert run.attempt == 1  # not retried: it cannot work the next time either


@pytest.fixture
def tool_behaviour():
    agent_workflows.tool_behaviour.clear()
    yield agent_workflows.tool_behaviour
    agent_workflows.tool_behaviour.clear()


#: The steps of "agent-protocols": two tools at once, then a booking, then the answer.
AGENT_PROTOCOLS_STEPS = [
    "think-0", "tool-lookup_city-0", "tool-weather-0", "think-1", "tool-book_hotel-1", "think-2",
]  # fmt: skip


def step_keys(run) -> list[str]:
    return list(Step.objects.filter(run=run).order_by("seq").values_list("key", flat=True))


@pytest.mark.parametrize("protocol", ["chat", "responses", "anthropic"])
def test_the_agent_loop_speaks_each_protocol_with_parallel_calls_and_options(
    drive, demo_model, protocol, tool_behaviour
):
    run = start_run("agent-protocols", {"protocol": protocol})
    assert drive() == ["completed"]
    assert step_keys(run) == AGENT_PROTOCOLS_STEPS
    output = Run.objects.get(pk=run.pk).output
    assert output["turns"] == 3 and output["answer"].startswith("Done. Tool results:")
    assert f"{run.id}:tool-book_hotel-1" in output["answer"]  # the tool's idempotency key
    first, last = demo_model.bodies[0], demo_model.bodies[-1]
    passed = {"stop_sequences": ["<end>"]} if protocol == "anthropic" else {"temperature": 0.2}
    assert passed.items() <= first.items() and "tool_choice" in first  # options passed through
    names = {t.get("name") or t["function"]["name"] for t in first["tools"]}
    assert names == {"lookup_city", "weather", "book_hotel"}
    if protocol == "anthropic":
        assert first["tools"][0]["input_schema"] == agent_workflows.LOOKUP
        results = [b for m in last["messages"] for b in m["content"] if isinstance(b, dict)]
        assert sum(b.get("type") == "tool_result" for b in results) == 3
    elif protocol == "responses":
        assert first["tools"][0]["parameters"] == agent_workflows.LOOKUP
        assert first["instructions"].startswith("You plan trips")
        assert sum(i.get("type") == "function_call_output" for i in last["input"]) == 3
    else:
        assert sum(m["role"] == "tool" for m in last["messages"]) == 3


def test_the_responses_loop_takes_a_conversation_given_as_messages(drive, demo_model):
    """`agent_loop(protocol="responses", messages=...)` dropped the messages and paid for a
    request with an empty input; the chat spelling is the responses input now."""
    run = start_run("agent-protocols", {"protocol": "responses", "as_messages": True})
    assert drive() == ["completed"]
    assert demo_model.bodies[0]["input"] == [
        {"role": "user", "content": "Plan two nights in Lisbon."}
    ]
    assert Run.objects.get(pk=run.pk).output["turns"] == 3


@pytest.mark.parametrize(
    ("shape", "says"),
    [
        ({"both": True}, "give the conversation once"),
        ({"empty": True}, "agent_loop needs a conversation"),
    ],
)
def test_a_conversation_given_twice_or_not_at_all_is_refused_before_any_request(
    drive, demo_model, shape, says
):
    run = start_run("agent-protocols", {"protocol": "responses", **shape})
    assert drive() == ["failed"]
    assert demo_model.bodies == []  # nothing paid for
    error = Run.objects.get(pk=run.pk).error
    assert error["code"] == "sdk_misuse" and says in error["message"]


def test_arguments_that_break_the_tool_s_schema_go_back_to_the_model(
    drive, demo_model, tool_behaviour
):
    run = start_run("agent-protocols", {"protocol": "chat", "book": {"city": "Lisbon"}})
    assert drive() == ["completed"]
    assert not Step.objects.filter(run=run, key__startswith="tool-book_hotel").exists()
    told = json.loads(demo_model.bodies[-1]["messages"][-1]["content"])
    assert told == {
        "error": "the arguments for book_hotel were not accepted: 'nights' is a required property"
    }


def test_a_tool_s_own_retry_and_timeout_apply_to_its_step(drive, demo_model, tool_behaviour):
    tool_behaviour["book_failures"] = 1  # fails once, then its retry succeeds
    run = start_run("agent-protocols", {"protocol": "chat"})
    assert drive() == ["completed"]
    book = Step.objects.get(run=run, key="tool-book_hotel-1")
    assert (book.status, book.attempt) == ("completed", 2)

    tool_behaviour["book_slow"] = 2.0  # past its 0.5 s timeout, on both attempts
    run = start_run("agent-protocols", {"protocol": "chat"})
    assert drive() == ["completed"]
    book = Step.objects.get(run=run, key="tool-book_hotel-1")
    assert (book.status, book.attempt, book.error["code"]) == ("failed", 2, "tool_timeout")
    told = json.loads(demo_model.bodies[-1]["messages"][-1]["content"])
    assert told == {"error": "book_hotel took more than 0.5 s"}


def test_a_tool_with_an_invalid_schema_is_refused_where_it_is_declared():
    from runs.sdk import Tool

    with pytest.raises(StepMisuse, match="tool 'weather' has invalid parameters"):
        Tool(agent_workflows.weather, parameters={"type": "object", "required": "city"})
    with pytest.raises(StepMisuse, match="on_refusal must be 'tell' or 'raise', not 'fail'"):
        Tool(agent_workflows.weather, on_refusal="fail")


def test_a_turn_s_approvals_are_asked_together_and_each_decision_applies(
    drive, demo_model, cast, tool_behaviour
):
    # One approval at a time: the approvers saw the second only after deciding the first.
    run = start_run("agent-protocols", {"protocol": "chat", "approve": True})
    assert drive() == ["waiting"]
    asked = {a.step_key: a for a in ApprovalRequest.objects.filter(run=run)}
    assert set(asked) == {"tool-lookup_city-0.approval", "tool-weather-0.approval"}
    assert asked["tool-weather-0.approval"].payload == {
        "tool": "weather", "args": {"city": "Lisbon"},
    }  # fmt: skip
    decide(asked["tool-lookup_city-0.approval"].pk, "approve", cast["ada"], "")
    assert drive() == ["waiting"]  # the other is still pending: nothing ran yet
    assert not Step.objects.filter(run=run, key__in=["tool-lookup_city-0", "tool-weather-0"])
    decide(asked["tool-weather-0.approval"].pk, "reject", cast["ada"], "no forecasts")
    assert drive() == ["completed"]
    ran = set(Step.objects.filter(run=run, kind="tool").values_list("key", flat=True))
    assert ran == {"tool-lookup_city-0", "tool-book_hotel-1"}
    results = [
        json.loads(m["content"]) for m in demo_model.bodies[1]["messages"] if m["role"] == "tool"
    ]
    assert results[0] == {"city": "Lisbon", "hotels": 3}
    assert "no forecasts" in results[1]["refused"]


@pytest.mark.parametrize("protocol", ["chat", "responses", "anthropic"])
def test_a_streamed_agent_loop_hands_out_text_as_it_arrives_and_calls_the_same_tools(
    drive, demo_model, protocol
):
    """Issue 30 item 11: `agent_loop(stream=True, on_delta=...)` streams every turn, tool
    calls included (their arguments arrive in pieces), through the official clients' stream
    helpers; each turn records the final response, and the tools run as unstreamed."""
    agent_workflows.streamed.clear()
    run = start_run("agent-protocols", {"protocol": protocol, "stream": True})
    assert drive() == ["completed"]
    assert step_keys(run) == AGENT_PROTOCOLS_STEPS
    answer = Run.objects.get(pk=run.pk).output["answer"]
    assert answer.startswith("Done. Tool results:") and f"{run.id}:tool-book_hotel-1" in answer
    text = [d for d in agent_workflows.streamed if d.kind == "text"]
    assert "".join(text) == answer  # the tool turns said nothing
    assert len(text) > 1  # in pieces, not at the end
    # The tool calls' arguments stream too (issue 49 §4), each piece naming its call.
    calls = [d for d in agent_workflows.streamed if d.kind == "tool_call"]
    assert "".join(calls) == '{"city": "Lisbon"}' * 2 + '{"city": "Lisbon", "nights": 2}'
    assert all(d.tool is not None for d in calls)
    for step in {d.step for d in agent_workflows.streamed}:  # positions: one stream a step
        mine = [d for d in agent_workflows.streamed if d.step == step]
        assert [d.offset for d in mine] == [sum(map(len, mine[:i])) for i in range(len(mine))]
    assert all(body.get("stream") for body in demo_model.bodies)
    thinks = Step.objects.filter(run=run, kind="llm")
    assert all(step.input[0]["stream"] and step.tokens_out > 0 for step in thinks)  # usage read


@pytest.mark.django_db(transaction=True)  # its checkpoints are written from threads of their own
def test_an_async_agent_loop_runs_a_turn_s_tools_concurrently(drive, demo_model):
    import threading

    agent_workflows.meeting["barrier"] = threading.Barrier(2, timeout=10)
    run = start_run("agent-async-parallel")
    assert drive() == ["completed"]
    answer = Run.objects.get(pk=run.pk).output["answer"]
    assert '"a met b"' in answer and '"b met a"' in answer  # neither timed out alone
    keys = list(Step.objects.filter(run=run).order_by("seq").values_list("key", flat=True))
    assert keys == ["think-0", "tool-meet_a-0", "tool-meet_b-0", "think-1"]


def stored_bytes(value) -> int:
    return len(json.dumps(value, ensure_ascii=False).encode())


@pytest.mark.parametrize("protocol", ["chat", "responses"])
def test_a_long_conversation_is_stored_once_and_read_whole(
    drive, demo_model, cast, client, protocol
):
    """Each request is stored as what it adds to the one before, yet the API and the dashboard
    give back exactly what the model was sent: storage grows with the conversation, not with
    its square."""
    turns, size = 30, 4_000
    run = start_run("long-conversation", {"turns": turns, "size": size, "protocol": protocol})
    assert drive() == ["completed"]
    field = "input" if protocol == "responses" else "messages"
    steps = list(Step.objects.filter(run=run, kind="llm").order_by("seq"))
    assert len(steps) == turns == len(demo_model.bodies)
    stored = sum(stored_bytes(s.input) for s in steps)
    conversation = stored_bytes(demo_model.bodies[-1][field])  # every turn's text, once
    whole = sum(stored_bytes(body[field]) for body in demo_model.bodies)  # stored as sent
    assert stored < 1.3 * conversation and whole > 10 * stored

    client.force_login(cast["vera"])
    read = client.get(f"/api/runs/{run.pk}/steps", {"limit": 500}).json()
    requests = [s["input"][0] for s in read if s["kind"] == "llm"]
    assert [r[field] for r in requests] == [body[field] for body in demo_model.bodies]
    assert all("$hash" not in r and r["model"] == steps[0].input[0]["model"] for r in requests)
    last = steps[-1].seq
    page = client.get(reverse("stepguard:run-step-json", args=[run.pk, last, "input"])).json()
    assert page[0][field] == demo_model.bodies[-1][field]
    assert (
        demo_model.bodies[-1][field][0]["content"]
        in client.get(reverse("stepguard:run-step", args=[run.pk, last])).content.decode()
    )


def test_a_conversation_resumed_under_changed_code_is_recorded_as_sent(
    drive, demo_model, client, cast
):
    """A request is stored against the one before only if that one's stored form is what the
    code sends now: after a resume whose code changed an earlier turn, the next request is
    stored whole, and every request still reads back as the model received it."""
    run = start_run("long-conversation", {"turns": 8, "size": 500, "wait_at": 5})
    assert drive() == ["waiting"]
    agent_workflows.edited.add(2)  # the code now words turn 2 differently
    send_signal(run.pk, "go", {})
    assert drive() == ["completed"]
    steps = {s.key: s for s in Step.objects.filter(run=run, kind="llm")}
    assert "$after" not in json.dumps(steps["turn-5"].input)  # its base changed: stored whole
    assert (
        json.loads(json.dumps(steps["turn-6"].input))[0]["messages"]["$after"]
        == steps["turn-5"].seq
    )
    assert "$after" in json.dumps(steps["turn-4"].input)

    client.force_login(cast["vera"])
    read = client.get(f"/api/runs/{run.pk}/steps", {"limit": 500}).json()
    requests = [s["input"][0]["messages"] for s in read if s["kind"] == "llm"]
    assert requests == [body["messages"] for body in demo_model.bodies]
    assert "(edited)" in json.dumps(requests[5]) and "(edited)" not in json.dumps(requests[4])


def test_a_conversation_resumed_under_the_same_code_goes_on_as_deltas(drive, demo_model):
    run = start_run("long-conversation", {"turns": 8, "size": 500, "wait_at": 5})
    assert drive() == ["waiting"]
    send_signal(run.pk, "go", {})
    assert drive() == ["completed"]
    turn5 = Step.objects.get(run=run, key="turn-5")
    assert turn5.input[0]["messages"]["$keep"] == 10  # system, then 4 turns of question and answer


@pytest.mark.django_db(transaction=True)  # an async workflow writes from threads of its own
@pytest.mark.parametrize("name", ["shared-client", "shared-client-async"])
def test_a_module_level_async_client_pays_once_per_call_across_executions(drive, demo_model, name):
    """Before, each execution had an event loop of its own: the kept client's next request
    went out on a connection of a closed loop, was answered in full, and was sent again."""
    runs = [start_run(name, {"turns": 3}) for _ in range(4)]
    assert drive() == ["completed"] * 4
    steps = Step.objects.filter(run__in=runs, kind="llm")
    assert len(steps) == 12
    assert demo_model.total == 12  # one paid answer per recorded call
    assert all(demo_model.calls[s.idempotency_key] == 1 and s.attempt == 1 for s in steps)
