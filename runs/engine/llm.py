"""Model calls as steps: the recorded request, the response as JSON, usage and its price.

Works with the official `openai` client (chat completions and responses) and the official
`anthropic` client, sync or async, by reading the response's `usage`; no SDK is imported here.
"""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

from django.conf import settings

from runs.engine.budget import Usage

#: USD per million tokens (input, output). Override or extend with STEPGUARD_MODEL_PRICES,
#: a JSON object {"model-name": [input, output]}; a model matches its longest listed prefix.
DEFAULT_PRICES: dict[str, tuple[str, str]] = {
    "gpt-4.1": ("2.00", "8.00"),
    "gpt-4.1-mini": ("0.40", "1.60"),
    "gpt-4.1-nano": ("0.10", "0.40"),
    "gpt-4o": ("2.50", "10.00"),
    "gpt-4o-mini": ("0.15", "0.60"),
    "o3": ("2.00", "8.00"),
    "o4-mini": ("1.10", "4.40"),
    "claude-opus-4": ("15.00", "75.00"),
    "claude-sonnet-4": ("3.00", "15.00"),
    "claude-3-7-sonnet": ("3.00", "15.00"),
    "claude-3-5-sonnet": ("3.00", "15.00"),
    "claude-3-5-haiku": ("0.80", "4.00"),
    "claude-haiku-4": ("1.00", "5.00"),
    # The scripted demo model served on 127.0.0.1 (examples/model_server.py): priced like a
    # small real model so the budget demos have something to stop.
    "stepguard-demo": ("1.00", "4.00"),
}

REQUEST_FIELDS = (
    "model", "messages", "input", "instructions", "system", "tools", "tool_choice",
    "max_tokens", "max_output_tokens", "max_completion_tokens", "temperature",
)  # fmt: skip


def prices() -> dict[str, tuple[Decimal, Decimal]]:
    table = {**DEFAULT_PRICES, **settings.STEPGUARD_MODEL_PRICES}
    return {model: (Decimal(str(p[0])), Decimal(str(p[1]))) for model, p in table.items()}


def price_of(model: str) -> tuple[Decimal, Decimal] | None:
    table = prices()
    matches = [name for name in table if model == name or model.startswith(f"{name}-")]
    return table[max(matches, key=len)] if matches else None


def cost(model: str, tokens_in: int, tokens_out: int) -> Decimal:
    price = price_of(model)
    if price is None:
        return Decimal(0)
    return (tokens_in * price[0] + tokens_out * price[1]) / Decimal(1_000_000)


def as_json(response: Any) -> dict:
    """The response as plain JSON: SDK objects are pydantic models."""
    if isinstance(response, dict):
        return response
    dump = getattr(response, "model_dump", None)
    if dump is None:
        raise TypeError(f"cannot read a model response of type {type(response).__name__}")
    return dump(mode="json", exclude_none=True)


def usage_of(data: dict, model: str) -> Usage:
    """Tokens and USD from `usage`: chat completions (prompt/completion tokens), the responses
    API and Anthropic (input/output tokens; Anthropic's cache reads and writes count as input)."""
    usage = data.get("usage") or {}
    tokens_in = usage.get("prompt_tokens", usage.get("input_tokens")) or 0
    tokens_in += (usage.get("cache_creation_input_tokens") or 0) + (
        usage.get("cache_read_input_tokens") or 0
    )
    tokens_out = usage.get("completion_tokens", usage.get("output_tokens")) or 0
    model = data.get("model") or model
    return Usage(tokens_in, tokens_out, cost(model, tokens_in, tokens_out))


def estimate(model: str, request: dict) -> Usage:
    """A budget estimate before the call: the prompt (about 4 characters a token) plus the
    most the model may answer (`max_tokens` and its variants; 1,024 if none is given)."""
    prompt = json.dumps({k: request.get(k) for k in ("messages", "input", "system", "tools")})
    tokens_in = len(prompt) // 4 + 1
    tokens_out = next(
        (request[k] for k in ("max_tokens", "max_output_tokens", "max_completion_tokens")
         if isinstance(request.get(k), int)),
        1024,
    )  # fmt: skip
    return Usage(tokens_in, tokens_out, cost(model, tokens_in, tokens_out))


def recorded_request(kwargs: dict) -> dict:
    return {k: kwargs[k] for k in REQUEST_FIELDS if k in kwargs}
