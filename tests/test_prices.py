"""Prices that follow the installed SDKs: every chat model name the official `openai` and
`anthropic` packages list is priced by the catalogue, or explicitly known to be unpriced (and
then goes through the one unpriced check: flagged, or refused)."""

import re
import typing
from decimal import Decimal

import pytest

from runs.engine.llm import price_of, usage_of
from runs.engine.prices import output_limit
from tests import adapter_openai_agents_workflows as oa  # noqa: F401 (its workflows)
from tests import adapter_pydantic_ai_workflows as pa

#: Not chat models (audio, realtime, image, search): priced by other units than tokens.
NOT_CHAT = re.compile(r"audio|realtime|image|search")

#: Listed by the SDKs, unknown to the catalogue: unpriced until it knows them, flagged on the
#: timeline (refused under STEPGUARD_REFUSE_UNPRICED_MODELS); STEPGUARD_MODEL_PRICES prices
#: them locally.
KNOWN_UNPRICED = {
    "claude-mythos-5", "claude-mythos-5-1", "claude-mythos-preview",
    # Responses-only vertical models (openai.types.shared.responses_model).
    "gpt-6-astra-healthcare", "gpt-6.1-sol-healthcare", "gpt-6.2-astra-healthcare",
    "gpt-6.2-astra-law", "gpt-6.2-sol-healthcare", "gpt-daybreak-blue-latest",
    "gpt-daybreak-red-latest",
}  # fmt: skip


def literal_names(annotation) -> list[str]:
    names: list[str] = []
    for arg in typing.get_args(annotation):
        names += [arg] if isinstance(arg, str) else literal_names(arg)
    return names


def sdk_chat_models() -> list[str]:
    from anthropic.types.model import Model
    from openai.types.shared.chat_model import ChatModel
    from openai.types.shared.responses_model import ResponsesModel

    names = literal_names(ChatModel) + literal_names(ResponsesModel) + literal_names(Model)
    return sorted({n for n in names if not NOT_CHAT.search(n)})


def test_every_chat_model_the_installed_sdks_list_is_priced_or_known_unpriced():
    names = sdk_chat_models()
    assert len(names) >= 100
    unpriced = sorted(n for n in names if price_of(n) is None)
    assert set(unpriced) <= KNOWN_UNPRICED, f"{len(unpriced)} of {len(names)}: {unpriced}"


def test_the_catalogue_is_the_installed_packages_and_never_fetched():
    from genai_prices import data_snapshot

    assert price_of("gpt-4o") is not None
    assert data_snapshot.get_snapshot().from_auto_update is False


@pytest.mark.parametrize(
    ("model", "rates"),
    [
        ("gpt-4o-2024-05-13", ("5", "15")),  # was stripped to gpt-4o: billed at half its price
        ("gpt-4o-2024-08-06", ("2.5", "10")),
        ("gpt-5.6-luna", ("0.2", "1.2")),  # the Agents SDK's default model: was $0
        ("chatgpt-4o-latest", ("5", "15")),
        ("openai/gpt-4o", ("2.5", "10")),  # OpenRouter's spellings
        ("anthropic/claude-sonnet-4.5", ("3", "15")),
        ("claude-sonnet-4-5@20250929", ("3", "15")),  # Vertex's
        ("us.anthropic.claude-sonnet-4-5-20250929-v1:0", ("3.3", "16.5")),  # Bedrock's (regional)
    ],
)
def test_snapshots_and_gateway_spellings_are_priced_by_the_catalogue(model, rates):
    price = price_of(model)
    assert price is not None, model
    assert (price.input, price.output) == tuple(Decimal(r) for r in rates)


def test_a_local_price_wins_and_each_call_records_what_priced_it(settings):
    from genai_prices import __version__

    usage = {"model": "gpt-4o", "usage": {"prompt_tokens": 1000, "completion_tokens": 1000}}
    assert usage_of(usage, "gpt-4o").breakdown["prices"] == f"genai-prices {__version__}"
    settings.STEPGUARD_MODEL_PRICES = {"gpt-4o": ["1", "2"]}  # a negotiated price
    local = usage_of(usage, "gpt-4o")
    assert local.usd == Decimal("0.003") and local.breakdown["prices"] == "STEPGUARD_MODEL_PRICES"
    unknown = usage_of({**usage, "model": "my-finetune"}, "my-finetune")
    assert unknown.breakdown["priced"] is False and unknown.breakdown["prices"] is None


def _adapter_run(adapter: str, tmp_path):
    from runs.sdk import start_run

    if adapter == "openai-agents":
        input = {"protocol": "responses", "script": "lookup", "effects": str(tmp_path)}
        return start_run("oa-agent", input, budget_usd="1")
    forecast = {"city": "Paris", "temp": 21, "summary": "clear"}
    dinner = pa.script("get_weather", args={"get_weather": {"city": "Paris"}}, final=forecast)
    return start_run("pa-planner", {"instructions": dinner}, budget_usd="1")


@pytest.mark.django_db(transaction=True)  # the adapters' async workflows: threads of their own
@pytest.mark.parametrize("adapter", ["openai-agents", "pydantic-ai"])
def test_an_unpriced_model_is_flagged_or_refused_by_the_adapters_as_by_ctx_llm(
    drive, demo_model, settings, monkeypatch, tmp_path, adapter
):
    """The demo model unpriced: the adapters make the one check ctx.llm makes (LangChain's:
    tests/test_adapter_langgraph.py, the plain clients': tests/test_agents.py)."""
    from runs.engine import prices
    from runs.models import Event

    monkeypatch.delitem(prices.DEFAULT_PRICES, "stepguard-demo")
    run = _adapter_run(adapter, tmp_path)
    assert drive() == ["completed"]
    assert Event.objects.filter(run=run, type="model.unpriced").count() == 1
    sent = demo_model.total

    settings.STEPGUARD_REFUSE_UNPRICED_MODELS = True
    run = _adapter_run(adapter, tmp_path)
    assert drive() == ["failed"]
    run.refresh_from_db()
    assert run.error["cause"]["code"] == "unpriced_model", run.error
    assert demo_model.total == sent  # the refused call was never sent


@pytest.mark.parametrize(
    ("model", "limit"),
    [
        ("gpt-4o-mini", 16_384),
        ("gpt-4o-2024-08-06", 16_384),
        ("openai/gpt-4.1", 32_768),
        ("o3", 100_000),
        ("gpt-5-mini-2025-08-07", 128_000),
        ("claude-sonnet-4-5-20250929", 64_000),
        ("us.anthropic.claude-sonnet-4-5-20250929-v1:0", 64_000),
        ("claude-opus-4-1", 32_000),
        ("claude-3-5-haiku-latest", 8_192),
        ("gpt-4o-nonesuch", None),  # no limit known, no context window in the catalogue
        ("stepguard-demo", None),
    ],
)
def test_a_models_output_limit_bounds_what_one_answer_can_cost(model, limit):
    assert output_limit(model) == limit


def test_a_model_not_in_the_table_is_bounded_by_its_context_window():
    """The catalogue gives context windows only: an answer cannot be longer."""
    assert output_limit("claude-opus-4-6") == 1_000_000
    assert output_limit("gpt-5-pro") == 400_000
