"""The LangGraph adapter: each node execution is a step, against the real engine, the scripted
demo model on 127.0.0.1 and, in one test, real worker processes killed with SIGKILL."""

import pytest
from django.db.models import Count

from runs.adapters.langgraph import MARK
from runs.approvals.models import ApprovalRequest
from runs.approvals.services import decide
from runs.models import Event, Run, RunStatus, Step
from runs.sdk import send_signal, start_run
from tests import adapter_langgraph_workflows as lg
from tests import workflows
from tests.conftest import wait_until
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db

TOPICS = {"topics": ["alpha", "beta", "gamma"]}
FLOW_KEYS = [
    "audience", "outline", "research[0]", "research[1]", "research[2]",
    "draft", "draft#2", "draft#3", "publish",
]  # fmt: skip
CHAT = {"request": "Find me a hotel in Lisbon and book it"}


def keys(run) -> list[str]:
    return list(Step.objects.filter(run=run).order_by("seq").values_list("key", flat=True))


def step(run, key: str) -> Step:
    return Step.objects.get(run=run, key=key)


def plain_flow() -> dict:
    """What the graph returns run plainly, outside Stepguard (its side effects not counted)."""
    state = lg.FLOW.invoke(TOPICS)
    workflows.calls.clear()
    return state


def test_each_node_execution_is_a_step_and_the_state_is_the_plain_graphs(drive):
    expected = plain_flow()
    run = start_run("lg-flow", TOPICS)
    assert drive() == ["completed"]
    # Two branches of one superstep, a Send fan-out (each Send its own key) and a loop.
    assert keys(run) == FLOW_KEYS
    assert step(run, "research[1]").output == {
        "notes": ["notes on beta"], "log": ["research beta"],
    }  # fmt: skip
    assert step(run, "draft#3").output == {"drafts": 3, "log": ["draft 3"]}
    assert Run.objects.get(pk=run.pk).output == expected
    assert expected["drafts"] == 3 and len(expected["notes"]) == 3
    assert set(workflows.calls.values()) == {1}  # every node execution ran once


def test_a_graph_resumed_after_a_crash_runs_no_finished_node_again(drive, expire_lease):
    expected = plain_flow()
    run = start_run("lg-flow", TOPICS)
    workflows.crash_at.add("research:beta")  # the process dies inside the second branch
    with pytest.raises(workflows.Crash):
        drive()
    expire_lease(run.id)
    assert drive() == ["completed"]
    assert keys(run) == FLOW_KEYS
    assert workflows.calls.pop("research:beta") == 2  # in flight at the crash: sent again
    assert set(workflows.calls.values()) == {1}
    again = step(run, "research[1]")
    assert again.recovered == "resent"
    assert Effect.objects.filter(idempotency_key=again.idempotency_key).count() == 2
    assert Run.objects.get(pk=run.pk).output == expected


@pytest.mark.django_db(transaction=True)  # an async workflow's checkpoints: a thread of their own
def test_async_branches_run_together_and_keep_their_keys_when_finishing_out_of_order(
    drive, expire_lease
):
    expected = plain_flow()
    run = start_run("lg-flow-async", TOPICS)
    workflows.crash_at.add("draft:2")
    with pytest.raises(workflows.Crash):
        drive()
    expire_lease(run.id)
    assert drive() == ["completed"]
    assert keys(run) == FLOW_KEYS  # positions in the order the branches started
    first, last = step(run, "research[0]"), step(run, "research[2]")
    assert Effect.objects.filter(idempotency_key=last.idempotency_key).count() == 1
    assert last.finished_at < first.finished_at  # gamma slept least: it finished first
    assert last.started_at < first.finished_at  # while alpha was still in flight
    assert step(run, "research[0]").output["notes"] == ["notes on alpha"]
    assert workflows.calls.pop("draft:2") == 2
    assert set(workflows.calls.values()) == {1}
    assert Run.objects.get(pk=run.pk).output == expected


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("name", ["lg-assistant", "lg-assistant-async"])
def test_a_messages_graph_records_its_messages_and_replays_them_after_a_crash(
    drive, expire_lease, demo_model, name
):
    run = start_run(name, CHAT)
    workflows.crash_at.add("finish")  # after `tidy` removed the tool results by their ids
    with pytest.raises(workflows.Crash):
        drive()
    expire_lease(run.id)
    assert drive() == ["completed"]
    assert keys(run) == ["think", "tools", "think#2", "tools#2", "think#3", "tidy", "finish"]
    for llm in Step.objects.filter(run=run, kind="llm"):
        assert demo_model.calls[llm.idempotency_key] == 1  # no model call paid twice
    assert workflows.calls.pop("finish") == 2
    assert workflows.calls == {"tool:search": 1, "tool:weather": 1, "tool:book": 1, "tidy": 1}

    recorded = step(run, "tools").output["messages"]
    assert [m[MARK] for m in recorded] == ["message", "message"]
    assert [m["value"]["type"] for m in recorded] == ["tool", "tool"]
    assert recorded[0]["value"]["data"]["id"] == f"{run.id}:tools:0"  # the step's key, and 0
    removed = step(run, "tidy").output["messages"]
    assert [m["value"]["data"]["id"] for m in removed] == [
        m["value"]["data"]["id"]
        for key in ("tools", "tools#2")
        for m in step(run, key).output["messages"]
    ]
    output = Run.objects.get(pk=run.pk).output
    assert [m[0] for m in output["transcript"]] == ["human", "ai", "ai", "ai", "ai"]
    assert [m[2] for m in output["transcript"]] == [0, 2, 1, 0, 0]  # tool calls kept
    assert output["transcript"][3][1].startswith("Done. Tool results:")
    assert output["answer"] == "Filed after 4 messages."


def test_interrupt_waits_for_a_signal_named_after_the_node(drive):
    run = start_run("lg-review", {"topic": "durable agents", "interrupts": "signal"})
    assert drive() == ["waiting"]
    assert Run.objects.get(pk=run.pk).worker_id is None  # the wait holds no worker
    asked = step(run, "review").output
    assert asked == {
        MARK: "interrupt",
        "value": {"question": "Which title?", "draft": "a draft about durable agents"},
    }
    send_signal(run.id, "review", "Durable agents, explained")
    send_signal(run.id, "review", {"publish": True})
    assert drive() == ["completed"]
    assert keys(run) == [
        "write", "review", "review.interrupt", "review.resume", "review.interrupt#2",
        "review.resume#2", "ship",
    ]  # fmt: skip
    assert step(run, "review.resume").output == {MARK: "interrupt", "value": "Publish it?"}
    output = Run.objects.get(pk=run.pk).output
    assert output["title"] == "Durable agents, explained"
    assert output["verdict"] == {"publish": True}
    # The node runs again for each answer (as in LangGraph); what finished before does not.
    assert workflows.calls == {"write": 1, "review": 3, "ship": 1}


def test_interrupt_asks_a_person_in_the_inbox_by_default(drive, cast):
    run = start_run("lg-review", {"topic": "durable agents"})
    assert drive() == ["waiting"]
    first = ApprovalRequest.objects.get(run=run)
    assert first.action == "resume review"
    assert first.payload["value"]["question"] == "Which title?"
    decide(first.pk, "approve", cast["ada"], "Durable agents")
    assert drive() == ["waiting"]
    second = ApprovalRequest.objects.exclude(pk=first.pk).get(run=run)
    assert second.summary == "Publish it?"
    decide(second.pk, "reject", cast["ada"], "not yet")
    assert drive() == ["completed"]
    output = Run.objects.get(pk=run.pk).output
    assert output["title"] == {"approved": True, "by": "ada", "comment": "Durable agents"}
    refusal = f"ada rejected 'resume review' (approval #{second.pk}): not yet"
    assert output["verdict"] == {"approved": False, "reason": refusal}
    assert workflows.calls["ship"] == 1


def test_commands_sends_and_a_subgraphs_nodes_are_steps_that_replay(drive, expire_lease):
    expected = lg.ROUTES.invoke({})
    workflows.calls.clear()
    run = start_run("lg-routes")
    workflows.crash_at.add("inner")
    with pytest.raises(workflows.Crash):
        drive()
    expire_lease(run.id)
    assert drive() == ["completed"]
    assert keys(run) == ["route", "worker[0]", "worker[1]", "sub/inner", "sub/flaky"]
    assert step(run, "route").output["goto"][0] == {
        MARK: "send", "node": "worker", "arg": {"log": ["job 0"]},
    }  # fmt: skip
    assert Run.objects.get(pk=run.pk).output == expected
    assert expected["meta"] == {MARK: "mine", "n": 2}
    # LangGraph's retry policy became the step's: 3 attempts in one step, not 3 steps of 3.
    assert step(run, "sub/flaky").attempt == 3 and workflows.calls.pop("flaky") == 3
    assert workflows.calls == {"route": 1, "worker:job 0": 1, "worker:job 1": 1, "inner": 2}


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("set", "node 'tag' returned a builtins.set at update['tags'], which cannot be recorded"),
        ("nested", "node 'tag' is a step; a node that makes its own steps takes the run context"),
    ],
)
def test_a_node_that_cannot_be_a_step_fails_the_run_naming_the_node(drive, case, says):
    run = start_run("lg-misuse", {"case": case}, max_attempts=1)
    assert drive() == ["failed"]
    assert says in Run.objects.get(pk=run.pk).error["message"]
    assert step(run, "tag").attempt == 1  # not retried: the same code fails the same way


def test_an_async_node_calling_a_chat_model_completes_in_a_real_worker(spawn_worker, demo_model):
    """Its answer cap reads the budgets, on the step's thread: from the event loop a worker
    (which does not allow async-unsafe ORM calls, as the tests' process does) failed every
    `ainvoke` run with SynchronousOnlyOperation."""
    spawn_worker("--import", "tests.adapter_langgraph_workflows")
    run = start_run("lg-chatbot-async", {"provider": "openai"})
    run = wait_until(
        lambda: (r := Run.objects.get(pk=run.pk)).is_terminal and r, timeout=60, what="the run"
    )
    assert run.status == RunStatus.COMPLETED, run.error
    assert demo_model.total == 1


def test_a_worker_killed_mid_graph_resumes_it_without_repeating_a_finished_node(
    spawn_worker, demo_model
):
    slow = CHAT | {"delay": 0.4}
    worker = spawn_worker("--import", "tests.adapter_langgraph_workflows", lease=1.0)
    run = start_run("lg-assistant", slow)
    wait_until(lambda: Effect.objects.filter(label="tool:search").exists(), what="the first tool")
    worker.kill()  # SIGKILL, inside the tools node's step
    spawn_worker("--import", "tests.adapter_langgraph_workflows", lease=1.0)
    run = wait_until(
        lambda: (r := Run.objects.get(pk=run.pk)).is_terminal and r, timeout=60, what="the run"
    )
    assert run.status == RunStatus.COMPLETED, run.error
    assert run.output["answer"] == "Filed after 4 messages."
    assert step(run, "tools").recovered == "resent"  # killed inside it
    assert Effect.objects.filter(label="tool:search").count() == 2  # that one tool, again
    effects = dict(
        Effect.objects.values("idempotency_key")
        .annotate(n=Count("id"))
        .values_list("idempotency_key", "n")
    )
    tool_effects = {"tools": 2, "tools#2": 1, "tidy": 1, "finish": 1}  # search+weather, book
    for done in Step.objects.filter(run=run):
        if done.kind == "llm":
            sent, once = demo_model.calls[done.idempotency_key], 1
        else:
            sent, once = effects.get(done.idempotency_key, 0), tool_effects[done.key]
        if done.recovered == "resent":
            assert sent >= once, done.key  # in flight at the kill: maybe sent again, same key
        else:
            assert sent == once, done.key  # finished before or after: never again


# LangChain chat models inside nodes: metered, keyed and governed as model calls.


@pytest.mark.django_db(transaction=True)  # async workflows' checkpoints: threads of their own
@pytest.mark.parametrize("provider", ["openai", "anthropic"])
@pytest.mark.parametrize(
    ("name", "how"),
    [
        ("lg-chatbot", "invoke"),
        ("lg-chatbot", "tools"),
        ("lg-chatbot", "stream"),
        ("lg-chatbot-async", "invoke"),
        ("lg-chatbot-async", "stream"),
    ],
)
def test_a_chat_model_in_a_node_is_an_llm_step_keyed_and_priced(
    drive, demo_model, provider, name, how
):
    runs = [start_run(name, {"provider": provider, "how": how}) for _ in range(2)]
    assert drive() == ["completed", "completed"]  # a model shared by both executions
    for run in runs:
        node = step(run, "chatbot")
        assert node.kind == "llm"
        key = f"{node.idempotency_key}:1"
        assert demo_model.calls[key] == 1  # sent once, with the node step's key
        assert node.tokens_in > 0 and node.tokens_out > 0
        assert node.cost_micros > 0  # gpt-4o-mini / claude-3-5-haiku are priced
        assert node.usage["model"]
        run.refresh_from_db()
        assert (run.tokens_in, run.cost_micros) == (node.tokens_in, node.cost_micros)
        assert (run.reserved_micros, run.reserved_tokens) == (0, 0)  # the call's hold given back
        assert (node.reserved_micros, node.reserved_tokens) == (0, 0)
        assert run.output["answer"].startswith("[demo model]") or how == "tools"
    assert demo_model.total == 2


@pytest.mark.django_db(transaction=True)  # async workflows' checkpoints: threads of their own
@pytest.mark.parametrize("provider", ["openai", "anthropic"])
@pytest.mark.parametrize("name", ["lg-chatbot", "lg-chatbot-async"])
def test_an_unpriced_chat_model_is_flagged_and_refused_under_a_usd_budget_if_so_set(
    drive, demo_model, settings, provider, name
):
    """The one unpriced check of every path (ctx.llm's): flagged on the timeline, and under
    STEPGUARD_REFUSE_UNPRICED_MODELS refused before a request is sent."""
    unpriced = {"provider": provider, "model": "my-finetune"}
    run = start_run(name, unpriced, budget_usd="1")
    assert drive() == ["completed"]
    assert Event.objects.get(run=run, type="model.unpriced").payload == {"model": "my-finetune"}
    assert step(run, "chatbot").cost_micros == 0 and demo_model.total == 1

    settings.STEPGUARD_REFUSE_UNPRICED_MODELS = True
    run = start_run(name, unpriced, budget_usd="1")
    assert drive() == ["failed"]
    run.refresh_from_db()
    assert run.error["cause"]["code"] == "unpriced_model", run.error
    assert demo_model.total == 1  # the refused call was never sent
    assert step(run, "chatbot").attempt == 1  # nor tried again


def test_a_chat_model_call_refused_by_the_provider_is_sent_once(drive, demo_model):
    """LangChain's client retries twice by default, and the node's step three times: a 400 is
    the provider's final answer, sent once and the run failed naming it."""
    run = start_run("lg-chatbot", {"provider": "openai"})
    demo_model.fail_next(400, times=5)
    assert drive() == ["failed"]
    assert demo_model.total == 1
    run.refresh_from_db()
    assert "refused the request" in run.error["message"]


def test_a_server_error_is_retried_by_the_step_with_the_same_key(drive, demo_model):
    run = start_run("lg-chatbot", {"provider": "anthropic"})
    demo_model.fail_next(500, times=1)
    assert drive() == ["completed"]
    node = step(run, "chatbot")
    assert node.attempt == 2
    assert demo_model.total == 2
    assert demo_model.calls[f"{node.idempotency_key}:1"] == 2  # the same key both times


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("name", ["lg-chatbot", "lg-chatbot-async"])
def test_a_budget_pauses_the_run_before_the_chat_model_call_that_would_overspend(
    drive, demo_model, name
):
    """In an async node too: LangChain's `agenerate` took the refusal, which is no
    `Exception`, for an answer (AttributeError: no `generations`), and the step failed."""
    run = start_run(name, {"provider": "openai"}, budget_tokens=5)
    assert drive() == ["over_budget"]
    assert demo_model.total == 0  # nothing sent, nothing paid
    run.refresh_from_db()
    assert run.status == RunStatus.OVER_BUDGET


def test_a_budget_caps_the_answer_of_a_chat_model_call(drive, demo_model):
    run = start_run("lg-chatbot", {"provider": "anthropic"}, budget_tokens=400)
    assert drive() == ["completed"]
    sent = demo_model.bodies[-1]
    assert 0 < sent["max_tokens"] < 400  # what the budget left after the prompt
    run.refresh_from_db()
    assert run.tokens_in + run.tokens_out <= 400


@pytest.mark.django_db(transaction=True)  # async workflows' checkpoints: threads of their own
@pytest.mark.parametrize("name", ["lg-chatbot", "lg-chatbot-async"])
def test_a_chat_model_call_replays_from_the_node_record_after_a_crash(
    drive, expire_lease, demo_model, name
):
    """The call's estimate is held on the node's step before it is sent; cut off by a crash
    after the provider answered, it is booked as possibly spent when the node is re-sent, so
    recorded plus possibly spent covers the bill (before, $0 was booked for the lost answer
    and bench/requests_per_call.py found the bill over what was recorded)."""
    run = start_run(name, {"provider": "openai", "how": "tools"})
    workflows.crash_at.add("chatbot")  # in the node, after its model call was answered
    with pytest.raises(workflows.Crash):
        drive()
    cut = step(run, "chatbot")
    assert cut.status == "started" and cut.reserved_tokens > 0
    estimate = (cut.reserved_micros, cut.reserved_tokens)
    run.refresh_from_db()
    assert (run.reserved_micros, run.reserved_tokens) == estimate
    expire_lease(run.id)
    assert drive() == ["completed"]
    node = step(run, "chatbot")
    assert node.recovered == "resent"
    # Re-sent with the key it was first sent with: the provider can answer it from its
    # record instead of charging again.
    assert demo_model.calls == {f"{node.idempotency_key}:1": 2}
    run.refresh_from_db()
    assert (node.possibly_spent_micros, node.possibly_spent_tokens) == estimate
    assert (run.possibly_spent_micros, run.possibly_spent_tokens) == estimate
    assert (run.reserved_micros, run.reserved_tokens) == (0, 0)
    assert (node.reserved_micros, node.reserved_tokens) == (0, 0)
    billed = 2 * node.cost_micros  # both answers alike
    assert run.cost_micros <= billed <= run.cost_micros + run.possibly_spent_micros


def test_a_node_that_fails_after_a_paid_answer_books_it_and_its_retry(drive, demo_model):
    """The node raised after its chat model answered: the step retries the node, and both
    answers are on the step and the run (before, the failed attempt's was lost with it)."""
    once = start_run("lg-chatbot", {"provider": "openai"})
    assert drive() == ["completed"]
    paid = step(once, "chatbot").cost_micros  # what one answer costs
    run = start_run("lg-chatbot", {"provider": "openai"})
    workflows.crash_at.add("chatbot-error")
    assert drive() == ["completed"]
    node = step(run, "chatbot")
    assert node.attempt == 2
    assert demo_model.calls[f"{node.idempotency_key}:1"] == 2  # the step's key, both times
    run.refresh_from_db()
    assert paid > 0 and node.cost_micros == 2 * paid
    assert (run.cost_micros, run.tokens_in) == (node.cost_micros, node.tokens_in)
    assert (run.reserved_micros, run.reserved_tokens) == (0, 0)


def test_a_tenants_daily_budget_caps_a_chat_model_calls_answer_instead_of_refusing_it(
    drive, demo_model, cast
):
    """ChatAnthropic's default `max_tokens` (4,096 for this model, 64,000 for claude-haiku-4-5:
    a $0.32 estimate) priced in full did not fit a small tenant budget, which refused a call
    that costs a fraction of a cent: the run paused, nothing sent. The answer is capped by
    what the tightest budget (here the tenant's, the run has none of its own) has left, so
    the call fits, is sent, and costs what it costs."""
    from decimal import Decimal

    from runs.operations import set_budget

    set_budget("label:tenant=acme", cast["otto"], "acme's cap", usd=Decimal("0.01"))
    run = start_run("lg-chatbot", {"provider": "anthropic"}, labels={"tenant": "acme"})
    assert drive() == ["completed"]
    sent = demo_model.bodies[-1]
    assert 0 < sent["max_tokens"] < 4096  # $0.01 of output at $4 per million: 2,500 at most
    run.refresh_from_db()
    assert 0 < run.cost_micros < 10_000


def test_a_capped_call_cut_off_in_flight_is_possibly_spent_for_no_more_than_the_budget_left(
    drive, expire_lease, demo_model, cast
):
    """Cut off after the provider answered, the call is booked as possibly spent: its hold,
    which the cap bounds by what the tenant's budget had left ($0.01), not the client's
    default `max_tokens` priced in full ($0.0164 here; $0.32 for claude-haiku-4-5, about
    2,400 times a short answer). Before, the call was not even sent: the run paused."""
    from decimal import Decimal

    from runs.operations import set_budget

    set_budget("label:tenant=acme", cast["otto"], "acme's cap", usd=Decimal("0.01"))
    run = start_run("lg-chatbot", {"provider": "anthropic"}, labels={"tenant": "acme"})
    workflows.crash_at.add("chatbot")  # in the node, after its model call was answered
    with pytest.raises(workflows.Crash):
        drive()
    cut = step(run, "chatbot")
    assert cut.status == "started" and 0 < cut.reserved_micros <= 10_000
    expire_lease(run.id)
    # The budget fits one such call, not two: the re-send books the first as possibly spent,
    # and pauses (docs/governance.md, *Possibly spent*).
    assert drive() == ["over_budget"]
    node = step(run, "chatbot")
    assert node.recovered == "resent"
    assert node.possibly_spent_micros == cut.reserved_micros


# A streamed graph (a chat UI's): LangGraph's callbacks make the node's `invoke` stream.

STREAMED = [
    ("lg-chatbot-streamed", "messages"),
    ("lg-chatbot-streamed-async", "messages"),
    ("lg-chatbot-streamed-async", "events"),
]


def invoked(provider: str, drive) -> tuple[int, int, int]:
    """What the same call costs through `invoke`, not streamed: tokens in and out, µ$."""
    run = start_run("lg-chatbot", {"provider": provider})
    assert drive() == ["completed"]
    node = step(run, "chatbot")
    return node.tokens_in, node.tokens_out, node.cost_micros


@pytest.mark.django_db(transaction=True)  # async workflows' checkpoints: threads of their own
@pytest.mark.parametrize("provider", ["openai", "anthropic", "anthropic-output-only"])
@pytest.mark.parametrize(("name", "how"), STREAMED)
def test_a_streamed_graphs_chat_model_call_is_metered_as_its_invoke(
    drive, demo_model, provider, name, how
):
    """With `stream_mode="messages"` or `astream_events`, LangChain streams the node's `invoke`:
    ChatOpenAI left the usage out of the stream (0 tokens, $0 recorded, the provider billed),
    and ChatAnthropic read it from `message_delta` only, which carries no input tokens where
    the provider sends them in `message_start` only (Bedrock, Vertex, the API before 2025)."""
    if provider == "anthropic-output-only":
        demo_model.anthropic_delta_usage = "output"
    model = provider.removesuffix("-output-only")
    paid = invoked(model, drive)
    run = start_run(name, {"provider": model, "how": how})
    assert drive() == ["completed"]
    node = step(run, "chatbot")
    assert demo_model.bodies[-1]["stream"] is True  # the answer was streamed
    assert (node.tokens_in, node.tokens_out, node.cost_micros) == paid
    assert node.kind == "llm"
    run.refresh_from_db()
    assert run.output["answer"].startswith("[demo model]")  # the tokens reached the caller
    assert (run.tokens_in, run.tokens_out, run.cost_micros) == paid
    assert (run.reserved_micros, run.reserved_tokens) == (0, 0)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("provider", ["openai", "anthropic"])
@pytest.mark.parametrize(("name", "how"), STREAMED)
def test_a_streamed_graph_pauses_on_its_budget_as_an_invoked_one(
    drive, demo_model, provider, name, how
):
    """A budget of one call's cost: the second call of the graph is refused before it is sent
    (before, nothing was recorded and all three calls were sent and paid)."""
    from decimal import Decimal

    paid = invoked(provider, drive)[2]
    budget = Decimal(paid) / 1_000_000
    run = start_run(name, {"provider": provider, "how": how, "turns": 3}, budget_usd=budget)
    assert drive() == ["over_budget"]
    assert demo_model.total == 2  # the invoked call and the first streamed one
    run.refresh_from_db()
    assert 0 < run.cost_micros == step(run, "chatbot").cost_micros <= paid  # its answer capped


def test_a_streamed_answer_is_metered_whatever_the_models_constructor_says(drive, demo_model):
    """`ChatOpenAI(stream_usage=False)`: the adapter asks for the usage all the same."""
    paid = invoked("openai", drive)
    options = {"stream_usage": False}
    run = start_run("lg-chatbot-streamed", {"provider": "openai", "options": options})
    assert drive() == ["completed"]
    assert demo_model.bodies[-1]["stream_options"] == {"include_usage": True}
    node = step(run, "chatbot")
    assert (node.tokens_in, node.tokens_out, node.cost_micros) == paid
