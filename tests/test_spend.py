"""What a run spent: every answered attempt recorded, and model calls cut off in flight booked as
possibly spent, against the scripted demo model on 127.0.0.1."""

from decimal import Decimal

import pytest

from runs.engine.llm import cost, price_of, usage_of
from runs.models import Event, Run, Step
from runs.sdk import start_run
from tests import agent_workflows, workflows  # noqa: F401  (registers the workflows)

pytestmark = pytest.mark.django_db


def only_llm_step(run) -> Step:
    return Step.objects.get(run=run, kind="llm")


def test_a_model_call_cut_off_in_flight_is_booked_as_possibly_spent(
    drive, demo_model, expire_lease, client, cast
):
    """Killed after the provider answered, before the answer was recorded: the call is sent
    again and paid again. Its first attempt's estimate is booked as possibly spent, held
    against the budget and shown apart, so recorded + possibly spent covers the bill."""
    run = start_run("llm-cut-off", budget_usd=Decimal("0.01"))
    workflows.crash_at.add("answered")
    with pytest.raises(workflows.Crash):
        drive()
    cut = only_llm_step(run)
    assert cut.status == "started" and cut.reserved_micros > 0
    estimate = (cut.reserved_micros, cut.reserved_tokens)
    expire_lease(run.id)
    assert drive() == ["completed"]
    assert demo_model.total == 2  # the stub, like most providers, charges a re-send again
    step = only_llm_step(run)
    run.refresh_from_db()
    assert step.recovered == "resent"
    assert (step.possibly_spent_micros, step.possibly_spent_tokens) == estimate
    assert (run.possibly_spent_micros, run.possibly_spent_tokens) == estimate
    assert run.cost_micros == step.cost_micros  # recorded: the one answer that was recorded
    billed = 2 * step.cost_micros  # both answers were the same size
    assert run.cost_micros <= billed <= run.cost_micros + run.possibly_spent_micros
    started = Event.objects.get(run=run, type="step.started", payload__attempt=2)
    assert started.payload["possibly_spent"]["tokens"] == estimate[1]

    client.force_login(cast["vera"])  # a viewer
    bill = client.get(f"/api/runs/{run.pk}/usage").json()
    assert bill["possibly_spent"]["steps"] == ["ask"]
    assert Decimal(bill["possibly_spent"]["usd"]) == Decimal(estimate[0]) / 1_000_000
    page = client.get(f"/runs/{run.pk}").content.decode()
    assert "possibly spent" in page


def test_possibly_spent_counts_against_the_budget(drive, demo_model, expire_lease):
    """A budget that fits one call's estimate but not two pauses the re-send of a call cut off
    in flight: the first attempt may have been paid."""
    run = start_run("llm-cut-off", budget_tokens=300)  # the estimate is about 130 tokens
    workflows.crash_at.add("answered")
    with pytest.raises(workflows.Crash):
        drive()
    estimate = only_llm_step(run).reserved_tokens
    assert 100 < estimate < 150
    expire_lease(run.id)
    assert drive() == ["completed"]  # 2 x ~130 fits in 300
    run2 = start_run("llm-cut-off", budget_tokens=estimate + 5)
    workflows.crash_at.add("answered")
    with pytest.raises(workflows.Crash):
        drive()
    expire_lease(run2.id)
    assert drive() == ["over_budget"]
    assert demo_model.total == 3  # the second run's re-send was not made


def test_a_call_without_max_tokens_cut_off_in_flight_is_booked_for_no_more_than_it_could_cost(
    drive, demo_model, expire_lease
):
    """Issue 49 §6: with $10 of budget left and no `max_tokens`, the budget capped the answer at
    16,666,658 tokens (a request a real provider refuses), and a call cut off in flight was
    booked as possibly spent for the whole $10, for an answer of 12 micro-USD. The model's
    output limit caps both now (gpt-4o-mini: 16,384 tokens, about 1 cent)."""
    run = start_run("llm-cut-off", {"uncapped": True}, budget_usd=Decimal("10"))
    workflows.crash_at.add("answered")
    with pytest.raises(workflows.Crash):
        drive()
    expire_lease(run.id)
    assert drive() == ["completed"]
    step = only_llm_step(run)
    assert step.recovered == "resent" and demo_model.total == 2
    assert demo_model.bodies[-1]["max_completion_tokens"] == 16_384  # gpt-4o-mini's own limit
    price = price_of("gpt-4o-mini")
    prompt = step.possibly_spent_tokens - 16_384
    assert 0 < prompt < 100
    assert abs(step.possibly_spent_micros - cost("gpt-4o-mini", prompt, 16_384) * 10**6) <= 1
    assert step.possibly_spent_micros < 16_500 * price.output  # about 1 cent, not $10
    run.refresh_from_db()
    assert run.cost_micros <= 2 * step.cost_micros <= run.cost_micros + run.possibly_spent_micros


def test_every_answered_attempt_is_recorded_even_when_its_parse_fails(drive, demo_model):
    """The SDK's structured-output parse fails after each answer: 3 step attempts, 3 answers
    paid (9 before issue 47, in 3 run attempts). Before, the run recorded 0 tokens and $0."""
    run = start_run("llm-parse-fails")
    assert drive() == ["failed"]
    assert demo_model.total == 3
    step = only_llm_step(run)
    run.refresh_from_db()
    assert step.status == "failed"
    assert step.tokens_out > 0 and step.tokens_in % 3 == 0 and step.tokens_out % 3 == 0
    assert (run.tokens_in, run.tokens_out, run.cost_micros) == (
        step.tokens_in, step.tokens_out, step.cost_micros,
    )  # fmt: skip
    one = cost("gpt-4o-mini", step.tokens_in // 3, step.tokens_out // 3)
    assert step.cost_micros >= 3 * int(one * 1_000_000)


@pytest.mark.parametrize(
    ("model", "usd_in", "usd_out"),
    [
        ("gpt-5", "1.25", "10.00"),
        ("gpt-5-mini-2025-08-07", "0.25", "2.00"),
        ("gpt-5.1", "1.25", "10.00"),
        ("claude-opus-4-5-20251101", "5.00", "25.00"),
        ("gemini-2.5-pro", "1.25", "10.00"),
        ("gemini-2.5-flash", "0.30", "2.50"),
    ],
)
def test_the_models_people_use_now_are_priced(model, usd_in, usd_out):
    price = price_of(model)
    assert price is not None
    assert (price.input, price.output) == (Decimal(usd_in), Decimal(usd_out))


def test_a_call_is_priced_as_the_model_that_answered():
    """A gateway that routes gpt-4o to gpt-5 bills gpt-5."""
    usage = {"prompt_tokens": 1_000_000, "completion_tokens": 0}
    assert usage_of({"model": "gpt-5", "usage": usage}, "gpt-4o").usd == Decimal("1.25")
    assert usage_of({"model": "gpt-5", "usage": usage}, "gpt-4o").breakdown["model"] == "gpt-5"
    # An answering model with no price falls back to the request's.
    assert usage_of({"model": "acme-x", "usage": usage}, "gpt-4o").usd == Decimal("2.50")


def test_gemini_and_bedrock_usage_shapes_are_read():
    gemini = {
        "modelVersion": "gemini-2.5-flash",
        "usageMetadata": {
            "promptTokenCount": 1000,
            "cachedContentTokenCount": 400,
            "candidatesTokenCount": 200,
            "thoughtsTokenCount": 50,
        },
    }
    usage = usage_of(gemini, "")
    assert (usage.tokens_in, usage.tokens_out) == (1000, 250)
    kinds = usage.breakdown["kinds"]
    assert kinds["cached_input"]["tokens"] == 400 and kinds["reasoning"]["tokens"] == 50
    assert usage.breakdown["model"] == "gemini-2.5-flash"
    expected = (600 * Decimal("0.30") + 400 * Decimal("0.03") + 250 * Decimal("2.50")) / 10**6
    assert usage.usd == expected
    # The google-genai SDK's model_dump() spells the same fields in snake case.
    snake = {"model_version": "gemini-2.5-flash", "usage_metadata": {
        "prompt_token_count": 1000, "cached_content_token_count": 400,
        "candidates_token_count": 200, "thoughts_token_count": 50,
    }}  # fmt: skip
    assert usage_of(snake, "") == usage
    bedrock = {
        "usage": {
            "inputTokens": 100,
            "outputTokens": 20,
            "cacheReadInputTokens": 1000,
            "cacheWriteInputTokens": 10,
        }
    }
    usage = usage_of(bedrock, "claude-sonnet-4-5")
    assert (usage.tokens_in, usage.tokens_out) == (1110, 20)
    assert usage.usd > 0


def test_an_alias_that_answers_as_a_priced_model_is_priced_and_not_flagged(drive):
    run = start_run("llm-alias")
    assert drive() == ["completed"]
    step = only_llm_step(run)
    assert step.usage["model"] == "gpt-4o-2024-08-06" and step.usage["priced"] is True
    assert step.cost_micros == 1000 * 2.50 + 100 * 10.00  # micro-USD
    assert not Event.objects.filter(run=run, type="model.unpriced").exists()
    unpriced = start_run("llm-alias", {"answers_as": "acme-x"})
    assert drive() == ["completed"]
    event = Event.objects.get(run=unpriced, type="model.unpriced")
    assert event.payload == {"model": "acme-x"}


def test_structured_output_comes_back_parsed_on_the_first_run_and_on_replay(
    drive, demo_model, expire_lease
):
    """responses.parse kept no output_parsed in the recorded JSON, and typed=True with parse
    gave a plain ChatCompletion whose parsed was a dict (issue 30 item 8)."""
    run = start_run("llm-parsed")
    workflows.crash_at.add("parsed")
    with pytest.raises(workflows.Crash):
        drive()
    assert demo_model.total == 4
    expire_lease(run.id)
    assert drive() == ["completed"]
    assert demo_model.total == 4  # replayed, not asked again
    plan = {"steps": ["checkpoint", "resume"]}
    assert Run.objects.get(pk=run.pk).output == {
        "chat_json": plan,
        "chat_typed": ["Plan", plan["steps"]],
        "responses_json": plan,
        "responses_typed": ["Plan", plan["steps"]],
    }
