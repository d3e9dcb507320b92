"""Model calls as steps: the recorded request, the response as JSON, usage and its price.

Works with the official `openai` client (chat completions and responses) and the official
`anthropic` client, sync or async, by reading the response's `usage`; no SDK is imported here.
"""

from __future__ import annotations

import importlib
import json
import re
import time
from decimal import Decimal
from email.utils import parsedate_to_datetime
from typing import Any

from runs.engine.budget import Usage, shared_left
from runs.engine.prices import DEFAULT_PRICES, Price, output_limit, price_of  # noqa: F401
from runs.engine.streaming import Relay, event_piece
from runs.errors import ModelRequestRejected, OutputNotSerializable, StepMisuse

REQUEST_FIELDS = (
    "model", "messages", "input", "instructions", "system", "tools", "tool_choice",
    "max_tokens", "max_output_tokens", "max_completion_tokens", "temperature", "stream",
)  # fmt: skip

#: What an image (or a base64 document) in a prompt is reserved as: about the most a provider
#: charges for one image (Anthropic: ~1,600 tokens at 1568 px; OpenAI high detail: ~1,100).
#: Counting its base64 characters instead would make a 400 KB image 100,000 tokens.
IMAGE_TOKENS = 1_600


def cost(model: str, tokens_in: int, tokens_out: int) -> Decimal:
    """USD of uncached input and output tokens of `model`; 0 if it has no price."""
    price = price_of(model)
    if price is None:
        return Decimal(0)
    return (tokens_in * price.input + tokens_out * price.output) / Decimal(1_000_000)


def as_json(response: Any) -> dict:
    """The response as plain JSON: SDK objects are pydantic models (a raw response is parsed
    into one first)."""
    if isinstance(response, dict):
        return response
    if not hasattr(response, "model_dump") and callable(getattr(response, "parse", None)):
        response = response.parse()  # `.with_raw_response.create(...)`
    dump = getattr(response, "model_dump", None)
    if dump is None:
        # Not retryable: the call was made and paid; making it again gets the same type back.
        raise OutputNotSerializable(
            f"cannot read a model response of type {type(response).__name__}"
        )
    try:  # the SDK's parsed types warn that `parsed` is typed None on the base class
        data = dump(mode="json", exclude_none=True, warnings=False)
    except TypeError:  # a model_dump without pydantic's options
        data = dump(mode="json", exclude_none=True)
    if getattr(response, "output_parsed", None) is not None:
        # responses.parse: a property of the SDK's ParsedResponse, not a field, so a dump
        # loses it; code reading the recorded JSON finds it where the SDK object has it.
        data["output_parsed"] = plain(response.output_parsed)
    return data


def plain(value: Any) -> Any:
    """`value` as the client sends it: SDK objects (the previous response's message, its
    content blocks) become the JSON the client makes of them, nested anywhere."""
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [plain(item) for item in value]
    if callable(dump := getattr(value, "model_dump", None)):
        return plain(dump(mode="json", exclude_unset=True))
    if callable(to_dict := getattr(value, "to_dict", None)):
        return plain(to_dict())
    return value


def _usage_dict(data: dict) -> dict:
    """The usage of a response of any protocol, in the OpenAI/Anthropic field names: as given,
    or read from Gemini's `usageMetadata` (prompt tokens include cached ones, thoughts are
    output beside the candidates) or Bedrock Converse's camelCase `usage` (input beside cache
    reads and writes, as Anthropic's)."""
    gemini = data.get("usageMetadata") or data.get("usage_metadata")
    if isinstance(gemini, dict):

        def count(name: str) -> int:
            snake = re.sub(r"([A-Z])", r"_\1", name).lower()
            return int(gemini.get(name) or gemini.get(snake) or 0)

        thoughts = count("thoughtsTokenCount")
        return {
            "prompt_tokens": count("promptTokenCount") + count("toolUsePromptTokenCount"),
            "prompt_tokens_details": {"cached_tokens": count("cachedContentTokenCount")},
            "completion_tokens": count("candidatesTokenCount") + thoughts,
            "completion_tokens_details": {"reasoning_tokens": thoughts},
        }
    usage = data.get("usage") or {}
    if "inputTokens" in usage or "outputTokens" in usage:  # Bedrock Converse
        return {
            "input_tokens": usage.get("inputTokens") or 0,
            "output_tokens": usage.get("outputTokens") or 0,
            "cache_read_input_tokens": usage.get("cacheReadInputTokens") or 0,
            "cache_creation_input_tokens": usage.get("cacheWriteInputTokens") or 0,
        }
    return usage


def response_model(data: dict) -> str | None:
    """The model a response says answered it (Gemini calls it the model version)."""
    found = data.get("model") or data.get("modelVersion") or data.get("model_version")
    return found if isinstance(found, str) else None


def token_kinds(usage: dict) -> dict[str, int]:
    """`usage` of any of the three protocols as tokens per kind: fresh and cached input, cache
    writes (Anthropic's 1-hour ones apart), output and reasoning. OpenAI counts cached tokens
    inside its input tokens and reasoning tokens inside its output tokens; Anthropic reports
    cache reads and writes beside its input tokens."""
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    out_details = usage.get("completion_tokens_details") or usage.get("output_tokens_details")
    total_in = usage.get("prompt_tokens", usage.get("input_tokens")) or 0
    total_out = usage.get("completion_tokens", usage.get("output_tokens")) or 0
    cached = details.get("cached_tokens") or 0
    reasoning = (out_details or {}).get("reasoning_tokens") or 0
    read = usage.get("cache_read_input_tokens") or 0
    write = usage.get("cache_creation_input_tokens") or 0
    write_1h = (usage.get("cache_creation") or {}).get("ephemeral_1h_input_tokens") or 0
    return {
        "input": total_in - min(cached, total_in),
        "cached_input": min(cached, total_in) + read,
        "cache_write": write - min(write_1h, write),
        "cache_write_1h": min(write_1h, write),
        "output": total_out - min(reasoning, total_out),
        "reasoning": min(reasoning, total_out),
    }


def usage_of(data: dict, model: str) -> Usage:
    """Tokens and USD from `usage`, each kind of token at its own price: cache reads at the
    cached-input price, cache writes at the cache-write price (Anthropic's 1-hour writes at
    twice the input price), reasoning at the output price. Tokens in count every input token,
    cached or not. The breakdown per kind (tokens and USD of each) goes with it, for billing."""
    kinds = token_kinds(_usage_dict(data))
    tokens_in = kinds["input"] + kinds["cached_input"] + kinds["cache_write"]
    tokens_in += kinds["cache_write_1h"]
    tokens_out = kinds["output"] + kinds["reasoning"]
    answered = response_model(data)
    priced = next((m for m in (answered, model) if m and price_of(m)), None)
    price = price_of(priced) if priced else None
    rates = {
        "input": price.input,
        "cached_input": price.cached_input,
        "cache_write": price.cache_write,
        "cache_write_1h": 2 * price.input,
        "output": price.output,
        "reasoning": price.output,
    } if price else {}  # fmt: skip
    usd = {k: n * rates.get(k, Decimal(0)) / Decimal(1_000_000) for k, n in kinds.items()}
    breakdown = {
        "model": priced or answered or model,
        "priced": price is not None,
        "prices": price.source if price else None,  # the catalogue version, or the local table
        "kinds": {k: {"tokens": n, "usd": str(usd[k])} for k, n in kinds.items() if n},
    }
    return Usage(tokens_in, tokens_out, sum(usd.values(), Decimal(0)), breakdown=breakdown)


def _prompt_size(value: Any) -> tuple[int, int]:
    """(characters of text, images) in a prompt: an image or base64 document (a data: URL, a
    base64 source) counts as an image, whatever its size."""
    if isinstance(value, str):
        image = value.startswith("data:") and ";base64," in value[:100]
        return (0, 1) if image else (len(value), 0)
    if isinstance(value, dict):
        if value.get("type") == "base64" and isinstance(value.get("data"), str):
            return 0, 1
        parts = [_prompt_size(item) for item in value.values()]
        parts.append((sum(len(str(key)) + 6 for key in value), 0))  # keys and punctuation
    elif isinstance(value, list | tuple):
        parts = [_prompt_size(item) for item in value]
    else:
        return len(json.dumps(value, default=str)), 0
    return sum(p[0] for p in parts), sum(p[1] for p in parts)


def estimate(model: str, request: dict) -> Usage:
    """A budget estimate before the call: the prompt (instructions or system, messages or
    input, tools: about 4 characters a token, an image IMAGE_TOKENS) plus the most the model
    may answer (`max_tokens` and its variants; 1,024 if none is given)."""
    prompt = {k: plain(request.get(k)) for k in ("instructions", "system", "messages", "input")}
    chars, images = _prompt_size([prompt, plain(request.get("tools"))])
    tokens_in = chars // 4 + 1 + images * IMAGE_TOKENS
    tokens_out = next(
        (request[k] for k in MAX_TOKENS_FIELDS if isinstance(request.get(k), int)), 1024
    )
    if (limit := output_limit(model)) is not None:
        tokens_out = min(tokens_out, limit)  # a larger max_tokens cannot be answered
    return Usage(tokens_in, tokens_out, cost(model, tokens_in, tokens_out))


#: Where each protocol takes the most tokens the model may answer, by the client resource's
#: class: chat completions, the responses API, Anthropic's messages.
MAX_TOKENS_FIELD = {
    "Completions": "max_completion_tokens",
    "Responses": "max_output_tokens",
    "Messages": "max_tokens",
}
MAX_TOKENS_FIELDS = ("max_tokens", "max_output_tokens", "max_completion_tokens")


#: The attribute an adapter's model call declares its answer-cap field with (`ctx.llm` then
#: caps it under a budget as it caps a client method's).
CAP_FIELD = "stepguard_max_tokens_field"


def max_tokens_field(call: Any) -> str | None:
    """The request field that caps the answer of `call`: the one it declares (an adapter's
    call), or the one of a client method we know."""
    if isinstance(declared := getattr(call, CAP_FIELD, None), str):
        return declared
    resource = type(getattr(call, "__self__", None)).__name__.removeprefix("Async")
    return MAX_TOKENS_FIELD.get(resource)


def answer_cap(model: str, request: dict, run) -> int | None:
    """The most tokens the answer can have within what the tightest budget has left after the
    prompt, or None if no budget covers the run: its own (its spend and what other steps
    hold reserved) and its shared daily ones (workflow, labels, global: spent and held
    today). So a client's default `max_tokens` (64,000 for some models: $0.32 priced in full)
    never refuses a call that fits, and a call cut off in flight is booked as possibly spent
    for no more than it could have cost: never more than the model's own output limit
    (`prices.output_limit`), however much the budget has left. At least 1: a prompt that does
    not fit pauses the run at its reservation instead."""
    prompt = estimate(model, {**request, "max_tokens": 0})
    tokens_left, micros_left = [], []
    if run.budget_tokens is not None:
        used = run.tokens_in + run.tokens_out + run.reserved_tokens + run.possibly_spent_tokens
        tokens_left.append(run.budget_tokens - used)
    if run.budget_micros is not None:
        used = run.cost_micros + run.reserved_micros + run.possibly_spent_micros
        micros_left.append(run.budget_micros - used)
    shared_micros, shared_tokens = shared_left(run.workflow, run.labels)
    tokens_left += [shared_tokens] if shared_tokens is not None else []
    micros_left += [shared_micros] if shared_micros is not None else []
    caps = [left - prompt.tokens_in for left in tokens_left]
    price = price_of(model)
    if micros_left and price is not None and price.output > 0:
        left = min(micros_left) - prompt.micros
        caps.append(int(Decimal(left) / price.output))  # micro-USD / (USD per 1M tokens)
    if caps and (limit := output_limit(model)) is not None:
        caps.append(limit)  # a $10 budget left is not what one answer can cost (issue 49 §6)
    return max(1, min(caps)) if caps else None


def recorded_request(kwargs: dict) -> dict:
    return {k: plain(kwargs[k]) for k in REQUEST_FIELDS if k in kwargs}


def streams(call: Any, request: dict) -> bool:
    """Whether the call asks for a streamed answer: `stream=True`, or a `.stream()` helper."""
    return bool(request.get("stream")) or getattr(call, "__name__", "") == "stream"


def stream_call(call: Any, request: dict) -> tuple[Any, dict]:
    """The client's `.stream()` helper for `call` and its arguments: it yields typed events and
    accumulates the final response (with usage: chat completions are asked to include it)."""
    resource = getattr(call, "__self__", None)
    helper = getattr(resource, "stream", None)
    if not callable(helper):
        raise StepMisuse(
            f"ctx.llm cannot stream {getattr(call, '__qualname__', call)!r}: stream with the "
            "official openai or anthropic client's create(stream=True) or .stream()"
        )
    kwargs = {k: v for k, v in request.items() if k != "stream"}
    if type(resource).__name__.removeprefix("Async") == "Completions":
        kwargs["stream_options"] = {**(kwargs.get("stream_options") or {}), "include_usage": True}
    return helper, kwargs


def _final(stream: Any) -> Any:
    for name in ("get_final_completion", "get_final_response", "get_final_message"):
        if callable(method := getattr(stream, name, None)):
            return method()
    raise OutputNotSerializable(f"cannot read the final response of {type(stream).__name__}")


def consume(manager: Any, relay: Relay | None) -> Any:
    """Read a stream to its end, handing each piece of text or of a tool call's arguments to
    `relay`; returns the final response (a coroutine for an async client's stream)."""
    if hasattr(manager, "__aenter__"):

        async def read():
            async with manager as stream:
                async for event in stream:
                    if relay is not None and (piece := event_piece(event)):
                        relay(piece[1], piece[0], piece[2])
                final = await _final(stream)
            if relay is not None:
                relay.close()
            return final

        return read()
    with manager as stream:
        for event in stream:
            if relay is not None and (piece := event_piece(event)):
                relay(piece[1], piece[0], piece[2])
        final = _final(stream)
    if relay is not None:
        relay.close()
    return final


def without_sdk_retries(call: Any) -> Any:
    """`call` on a copy of its client with the SDK's own retries off (openai and anthropic
    default to 2): they would resend inside one step attempt, unrecorded and unchecked against
    budgets and halts, and multiply with the step's retries. The copy shares the client's
    connection pool. Anything that is not a client resource's method is returned as it is."""
    resource = getattr(call, "__self__", None)
    client = getattr(resource, "_client", None)
    if resource is None or client is None or not getattr(client, "max_retries", 0):
        return call
    if not callable(getattr(client, "with_options", None)):
        return call
    try:
        quiet = type(resource)(client.with_options(max_retries=0))
    except TypeError:  # a resource this does not know how to rebuild: leave it be
        return call
    return getattr(quiet, call.__name__, call)


#: The response type of each client method `typed=True` knows, by the client's package and the
#: resource's class: the same class on the first run and on replay.
RESPONSE_TYPES = {
    ("openai", "Completions"): ("openai.types.chat", "ChatCompletion"),
    ("openai", "Responses"): ("openai.types.responses", "Response"),
    ("anthropic", "Messages"): ("anthropic.types", "Message"),
}
#: For a `parse` method (structured output): the SDK's parsed type, generic in the format class
#: the request names, and the request field that names it.
PARSED_TYPES = {
    ("openai", "Completions"): ("openai.types.chat", "ParsedChatCompletion", "response_format"),
    ("openai", "Responses"): ("openai.types.responses", "ParsedResponse", "text_format"),
}


def response_type(call: Any, typed: bool | type, request: dict | None = None) -> type | None:
    """The class `typed` asks `ctx.llm` to return: itself, or for `True` the response type of
    the client method `call` (for `parse`, the SDK's parsed type for the request's format
    class, so `.choices[0].message.parsed` / `.output_parsed` is that class again on replay);
    None for a plain dict."""
    if typed is False or typed is None:
        return None
    if isinstance(typed, type):
        if not callable(getattr(typed, "model_validate", None)):
            raise StepMisuse(f"typed={typed.__name__} is not a pydantic model class")
        return typed
    resource = type(getattr(call, "__self__", None))
    where = (resource.__module__.split(".")[0], resource.__name__.removeprefix("Async"))
    parsed = PARSED_TYPES.get(where) if getattr(call, "__name__", "") == "parse" else None
    if parsed is not None and isinstance(fmt := (request or {}).get(parsed[2]), type):
        return getattr(importlib.import_module(parsed[0]), parsed[1])[fmt]
    known = RESPONSE_TYPES.get(where)
    if known is None:
        raise StepMisuse(
            f"typed=True does not know what {getattr(call, '__qualname__', call)!r} returns: "
            "pass the response class itself (typed=ChatCompletion)"
        )
    return getattr(importlib.import_module(known[0]), known[1])


def typed_response(cls: Any, data: dict) -> Any:
    """The recorded JSON as `cls` again. A response that no longer validates (a newer SDK that
    tightened a field) is built without validation rather than failing a replay."""
    data = {k: v for k, v in data.items() if k != "output_parsed"}  # the SDK derives it
    try:
        return cls.model_validate(data)
    except ValueError:
        return cls.model_construct(**data)


#: Statuses worth sending the same request again for: the provider was busy or broken.
RETRYABLE_STATUSES = frozenset({408, 409, 429})


def answered(exc: BaseException, model: str, data: dict | None = None) -> Usage | None:
    """The usage of the answer `exc` was raised after, if it came after one: `data` (the raw
    response JSON read before the SDK parsed it), or the completion the openai SDK attaches to
    a length or content-filter refusal of a parse. That answer was paid."""
    if data is None:
        completion = getattr(exc, "completion", None)
        if completion is None or not hasattr(completion, "model_dump"):
            return None
        data = completion.model_dump(mode="json", exclude_none=True)
    if not isinstance(data, dict) or not data.get("usage"):
        return None
    return usage_of(data, model)


def parsed_call(call: Any) -> Any | None:
    """For a client's `parse` method (structured output: the SDK validates the answer after it
    arrived), the same call through `with_raw_response`, whose raw JSON is read for its usage
    before the SDK parses it; None for any other call."""
    if getattr(call, "__name__", "") != "parse":
        return None
    raw = getattr(getattr(call, "__self__", None), "with_raw_response", None)
    return getattr(raw, "parse", None)


def rejected(exc: Exception) -> ModelRequestRejected | None:
    """The error to fail the step with if the provider refused the request itself (a 4xx
    other than 408, 409 and 429): sending it again would get the same answer. Timeouts,
    connection errors and 5xx stay retryable."""
    status = getattr(exc, "status_code", None)
    if not isinstance(status, int) or status < 400 or status >= 500:
        return None
    if status in RETRYABLE_STATUSES:
        return None
    return ModelRequestRejected(f"the model provider refused the request: {exc}")


def retry_after(exc: BaseException) -> float | None:
    """Seconds the provider asked to wait before the next attempt (`retry-after-ms`,
    `retry-after` in seconds or as an HTTP date), if the error carries a response saying so."""
    headers = getattr(getattr(exc, "response", None), "headers", None)
    if headers is None:
        return None
    try:
        if (ms := headers.get("retry-after-ms")) is not None:
            return max(float(ms) / 1000, 0.0)
        if (value := headers.get("retry-after")) is None:
            return None
        try:
            return max(float(value), 0.0)
        except ValueError:
            return max(parsedate_to_datetime(value).timestamp() - time.time(), 0.0)
    except (TypeError, ValueError, OverflowError):
        return None
