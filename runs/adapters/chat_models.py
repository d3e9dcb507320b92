"""LangChain chat models called inside a step, metered as that step's model calls.

Steps do not nest, so a LangChain chat model called inside a step (a LangGraph node run by
`runs.adapters.langgraph.durable`) cannot be a step of its own. Under `metering(ctx)` every
call a chat model makes is governed as `ctx.llm` governs its step: it carries an
Idempotency-Key derived from the step's (the same when the step is re-sent after a crash),
its estimate is checked against the run's budget first (and its answer capped to what the
budget has left), the SDK's own retries are off (the step's retry policy is the only one), a
request the provider refused fails the step without a retry, and the tokens and USD of its
usage are recorded on the step, which becomes an `llm` step. Outside `metering` a chat model
behaves exactly as LangChain's.

LangChain has no hook that may change a request, so the chat model's two generation entry
points and its two streaming ones are wrapped, once, when this module is imported.
"""

from __future__ import annotations

import contextvars
import copy
import functools
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import BaseMessage, convert_to_openai_messages

from runs.engine import llm as llm_engine
from runs.engine.budget import Amount, Metered, Usage
from runs.engine.context import engine_of
from runs.engine.fences import over_budget
from runs.engine.records import CURRENT_STEP
from runs.errors import ControlFlow
from runs.models import Run, StepKind

__all__ = ["metering"]


@dataclass
class Meter:
    """The model calls one execution of a step made: counted for their keys, summed for the
    step's record."""

    run_id: Any
    #: The run as read before the step (an async workflow's event loop cannot read it).
    run: Run | None = None
    calls: int = 0
    usage: Usage = field(default_factory=Usage)
    models: list[str] = field(default_factory=list)
    #: The execution's model calls: their one unpriced check (ModelCalls.refuse_unpriced).
    model_calls: Any = None
    #: Usages of calls answered unpriced, to flag on the timeline (ModelCalls.flag_unpriced).
    unpriced: list[tuple[str, Usage]] = field(default_factory=list)

    def key(self) -> str:
        running = CURRENT_STEP.get()
        if running is None:  # pragma: no cover - metering is only entered inside a step
            raise RuntimeError("a metered chat model call outside a step")
        self.calls += 1
        return f"{running.idempotency_key}:{self.calls}"

    def add(self, usage: Usage, model: str = "") -> None:
        if usage.breakdown is not None and not usage.breakdown["priced"]:
            self.unpriced.append((model, usage))
        breakdowns = [b for b in (self.usage.breakdown, usage.breakdown) if b]
        self.usage = Usage(
            self.usage.tokens_in + usage.tokens_in,
            self.usage.tokens_out + usage.tokens_out,
            self.usage.usd + usage.usd,
            breakdown=breakdowns[-1] if len(breakdowns) == 1 else _merged(breakdowns),
        )

    def metered(self, value: Any) -> Any:
        """The step's output, with what its model calls spent if it made any."""
        if not self.calls:
            return value
        return Metered(value, self.usage, kind=StepKind.LLM)

    def check(self, model: str, request: dict) -> tuple[int | None, Amount]:
        """The answer cap the run's budget leaves (None when the run has no budget) and the
        call's estimate. Without a step row to reserve it on (`reserve`), a call whose
        estimate, on top of what this step's calls already spent, would overspend the run is
        refused here (OverBudget: the run pauses)."""
        run = copy.copy(self.run) if self.run is not None else Run.objects.get(pk=self.run_id)
        # This step's earlier calls are not on the run row yet: they land with the step.
        run.tokens_in += self.usage.tokens_in
        run.tokens_out += self.usage.tokens_out
        run.cost_micros += self.usage.micros
        cap = llm_engine.answer_cap(model, request, run)
        if cap is not None:
            request = {**request, "max_tokens": min(cap, request.get("max_tokens") or cap)}
        guess = llm_engine.estimate(model, request)
        estimate = Amount(guess.micros, guess.tokens)
        running = CURRENT_STEP.get()
        unreserved = running is None or running.reserve is None
        if unreserved and (refusal := over_budget(run, estimate)) is not None:
            raise refusal
        return (request.get("max_tokens") if cap is not None else None), estimate


def _reserve(estimate: Amount, meter: Meter | None = None, model: str = "") -> None:
    """Hold the call's estimate on the step before it is sent (Steps._reserve_in_step): a
    call cut off in flight by a crash is booked as possibly spent when the step is re-sent.
    First the one unpriced check every path makes (ModelCalls.refuse_unpriced)."""
    if meter is not None and meter.model_calls is not None:
        meter.model_calls.refuse_unpriced(model)
    running = CURRENT_STEP.get()
    if running is not None and running.reserve is not None and estimate:
        running.reserve(estimate)


def _paid(meter: Meter) -> None:
    """Tell the step what its calls were paid so far: booked if the node fails after all
    (its usage reaches the step's record only through a node that returns)."""
    running = CURRENT_STEP.get()
    if running is not None and running.answered is not None:
        running.answered(meter.usage)
    if running is not None:
        _flag_unpriced(meter, running.key)


def _flag_unpriced(meter: Meter, key: str) -> None:
    """Flag the calls answered unpriced on the timeline, as every path does."""
    while meter.unpriced and meter.model_calls is not None:
        model, usage = meter.unpriced.pop(0)
        meter.model_calls.flag_unpriced(key, usage, model)


async def _apaid(meter: Meter) -> None:
    """`_paid` from the event loop: the timeline is written on the step's thread."""
    running = CURRENT_STEP.get()
    if running is not None and running.answered is not None:
        running.answered(meter.usage)
    if running is not None and running.thread is not None and meter.unpriced:
        await running.thread.run(functools.partial(_flag_unpriced, meter, running.key))


async def _areserve(estimate: Amount, meter: Meter | None = None, model: str = "") -> None:
    """The same from the event loop, which may not touch the database: on the step's
    thread, which waits for this call meanwhile."""
    running = CURRENT_STEP.get()
    if running is not None and running.thread is not None and meter and meter.model_calls:
        await running.thread.run(functools.partial(meter.model_calls.refuse_unpriced, model))
    if running is not None and running.reserve is not None and estimate:
        reserve, thread = running.reserve, running.thread
        assert thread is not None  # every step with a row has one
        await thread.run(functools.partial(reserve, estimate))


_METER: contextvars.ContextVar[Meter | None] = contextvars.ContextVar(
    "stepguard_chat_meter", default=None
)


@contextmanager
def metering(ctx: Any, run: Run | None = None) -> Iterator[Meter]:
    """Meter the chat-model calls made in this block (inside the step `ctx` is running),
    against `run` as read before the step if given (async), else as read before each call."""
    meter = Meter(run_id=ctx.run_id, run=run, model_calls=engine_of(ctx).calls)
    token = _METER.set(meter)
    try:
        yield meter
    finally:
        _METER.reset(token)


def _model_name(model: BaseChatModel) -> str:
    return str(getattr(model, "model_name", None) or getattr(model, "model", None) or "")


def _request(model: BaseChatModel, messages: list[BaseMessage], kwargs: dict) -> dict:
    request: dict[str, Any] = {
        "model": _model_name(model),
        "messages": convert_to_openai_messages(messages),
    }
    if kwargs.get("tools"):
        request["tools"] = kwargs["tools"]
    limit = kwargs.get("max_tokens") or getattr(model, "max_tokens", None)
    if isinstance(limit, int):
        request["max_tokens"] = limit
    return request


def _quiet(model: BaseChatModel) -> BaseChatModel:
    """A copy of `model` whose client does not retry (openai and anthropic retry twice by
    default, unrecorded, inside one attempt of the step). The copy shares the connections."""
    if getattr(model, "root_client", None) is not None or getattr(model, "root_async_client", None):
        update: dict[str, Any] = {"max_retries": 0}
        if (root := getattr(model, "root_client", None)) is not None:
            root = root.with_options(max_retries=0)
            update |= {"root_client": root, "client": root.chat.completions}
        if (root := getattr(model, "root_async_client", None)) is not None:
            root = root.with_options(max_retries=0)
            update |= {"root_async_client": root, "async_client": root.chat.completions}
        return model.model_copy(update=update)
    if "max_retries" in type(model).model_fields:
        copy = model.model_copy(update={"max_retries": 0})
        for cached in ("_client_params", "_client", "_async_client"):  # built from max_retries
            copy.__dict__.pop(cached, None)
        return copy
    return model


def _usage(model: str, message: Any) -> Usage:
    """What a LangChain message's `usage_metadata` cost, priced from the model its response
    names. LangChain counts cache reads and writes inside the input tokens, for both
    providers: they are split out to be priced at their own rates."""
    meta = getattr(message, "usage_metadata", None) or {}
    response = getattr(message, "response_metadata", None) or {}
    if not meta.get("input_tokens") and (started := _started(response)):
        meta = {**meta, **started}
    details = meta.get("input_token_details") or {}
    read, write = details.get("cache_read") or 0, details.get("cache_creation") or 0
    usage = {
        "input_tokens": max((meta.get("input_tokens") or 0) - read - write, 0),
        "cache_read_input_tokens": read,
        "cache_creation_input_tokens": write,
        "output_tokens": meta.get("output_tokens") or 0,
        "output_tokens_details": {
            "reasoning_tokens": (meta.get("output_token_details") or {}).get("reasoning") or 0
        },
    }
    answered_as = response.get("model_name") or response.get("model") or model
    return llm_engine.usage_of({"model": answered_as, "usage": usage}, model)


def _started(response: dict) -> dict:
    """The input tokens of a streamed Anthropic answer as its `message_start` counted them
    (`_with_started_usage`), in `usage_metadata`'s terms: for a provider whose `message_delta`
    carries the output tokens only, LangChain's usage of the answer has no input tokens."""
    usage = response.get("message_start_usage")
    if not isinstance(usage, dict) or not usage.get("input_tokens"):
        return {}
    read = usage.get("cache_read_input_tokens") or 0
    write = usage.get("cache_creation_input_tokens") or 0
    return {
        "input_tokens": usage["input_tokens"] + read + write,
        "input_token_details": {"cache_read": read, "cache_creation": write},
    }


def _merged(breakdowns: list[dict]) -> dict:
    """One breakdown for a step's several calls: tokens and USD summed per kind."""
    kinds: dict[str, dict] = {}
    for b in breakdowns:
        for kind, v in (b.get("kinds") or {}).items():
            seen = kinds.setdefault(kind, {"tokens": 0, "usd": "0"})
            seen["tokens"] += v["tokens"]
            seen["usd"] = str(Decimal(seen["usd"]) + Decimal(v["usd"]))
    priced = all(b.get("priced") for b in breakdowns)
    return {"model": breakdowns[-1].get("model"), "priced": priced, "kinds": kinds}


def _prepared(
    meter: Meter, model: BaseChatModel, messages: list, kwargs: dict
) -> tuple[dict, Amount]:
    """The call's keyword arguments with its idempotency key and the budget's answer cap, and
    its estimate, to reserve before it is sent."""
    name = _model_name(model)
    cap, estimate = meter.check(name, _request(model, messages, kwargs))
    headers = {"Idempotency-Key": meter.key(), **(kwargs.get("extra_headers") or {})}
    return {**kwargs, "extra_headers": headers} | ({"max_tokens": cap} if cap else {}), estimate


async def _aprepared(
    meter: Meter, model: BaseChatModel, messages: list, kwargs: dict
) -> tuple[dict, Amount]:
    """`_prepared` from the event loop, which may not touch the database (the budget's answer
    cap reads the shared daily budgets): on the step's thread, which waits for this call."""
    running = CURRENT_STEP.get()
    if running is None or running.thread is None:
        return _prepared(meter, model, messages, kwargs)
    return await running.thread.run(functools.partial(_prepared, meter, model, messages, kwargs))


def _streamed(model: BaseChatModel, kwargs: dict) -> dict:
    """Ask for the usage of a streamed answer (ChatOpenAI leaves it out by default), whatever
    the call or the model's constructor said: an answer without it would be recorded free."""
    if "stream_usage" in type(model).model_fields:
        kwargs = {**kwargs, "stream_usage": True}
    return _including_usage(kwargs)


def _including_usage(kwargs: dict) -> dict:
    """A call's own `stream_options` (OpenAI's), asking for the usage too."""
    if isinstance(options := kwargs.get("stream_options"), dict):
        return {**kwargs, "stream_options": {**options, "include_usage": True}}
    return kwargs


def _counting(model: BaseChatModel) -> BaseChatModel:
    """A copy of `model` that asks for the usage of its answer if it streams it. `invoke`
    streams whenever a callback handler wants the tokens (LangGraph's `stream_mode="messages"`,
    `astream_events`), and `stream_usage` cannot be passed to a call that does not stream
    (ChatOpenAI would send it to the API), so the copy's own setting says it."""
    fields = type(model).model_fields
    update: dict[str, Any] = {}
    if "stream_usage" in fields and model.stream_usage is not True:  # type: ignore[attr-defined]
        update["stream_usage"] = True
    extra = getattr(model, "model_kwargs", None)
    if "model_kwargs" in fields and isinstance(extra, dict) and "stream_options" in extra:
        options = {**extra["stream_options"], "include_usage": True}
        update["model_kwargs"] = {**extra, "stream_options": options}
    return model.model_copy(update=update) if update else model


def _refused(exc: Exception) -> None:
    if (refusal := llm_engine.rejected(exc)) is not None:
        raise refusal from exc


def _metered_generate(generate: Callable) -> Callable:
    """`invoke` and friends, metered inside a durable node."""

    @functools.wraps(generate)
    def _generate_with_cache(self, messages, stop=None, run_manager=None, **kwargs):
        meter = _METER.get()
        if meter is None:
            return generate(self, messages, stop, run_manager, **kwargs)
        kwargs, estimate = _prepared(meter, self, messages, _including_usage(kwargs))
        _reserve(estimate, meter, _model_name(self))
        try:
            result = generate(_counting(_quiet(self)), messages, stop, run_manager, **kwargs)
        except Exception as exc:
            _refused(exc)
            raise
        for generation in result.generations:
            meter.add(_usage(_model_name(self), generation.message), _model_name(self))
        _paid(meter)
        return result

    return _generate_with_cache


def _metered_agenerate(agenerate: Callable) -> Callable:
    """`ainvoke` and friends, metered inside a durable node."""

    @functools.wraps(agenerate)
    async def _agenerate_with_cache(self, messages, stop=None, run_manager=None, **kwargs):
        meter = _METER.get()
        if meter is None:
            return await agenerate(self, messages, stop, run_manager, **kwargs)
        try:
            kwargs, estimate = await _aprepared(meter, self, messages, _including_usage(kwargs))
            await _areserve(estimate, meter, _model_name(self))
        except ControlFlow as signal:  # a budget's refusal, a lost lease...
            raise _Carried(signal) from None
        try:
            result = await agenerate(_counting(_quiet(self)), messages, stop, run_manager, **kwargs)
        except Exception as exc:
            _refused(exc)
            raise
        for generation in result.generations:
            meter.add(_usage(_model_name(self), generation.message), _model_name(self))
        await _apaid(meter)
        return result

    return _agenerate_with_cache


class _Carried(Exception):
    """A signal that stops workflow code (OverBudget...) on its way through LangChain's
    `agenerate`, which gathers its calls with `return_exceptions=True` and then takes an
    exception that is no `Exception` for an answer (AttributeError: no `generations`)."""


def _carrying(agenerate: Callable) -> Callable:
    """`agenerate`, raising the signal `_Carried` brought through it."""

    @functools.wraps(agenerate)
    async def _agenerate(self, *args, **kwargs):
        try:
            return await agenerate(self, *args, **kwargs)
        except _Carried as carried:
            raise carried.args[0] from None

    return _agenerate


def _metered_stream(stream: Callable) -> Callable:
    """`stream`, metered from its chunks inside a durable node."""

    @functools.wraps(stream)
    def _stream(self, input, config=None, *, stop=None, **kwargs) -> Iterator:
        meter = _METER.get()
        if meter is None:
            yield from stream(self, input, config, stop=stop, **kwargs)
            return
        messages = self._convert_input(input).to_messages()
        kwargs, estimate = _prepared(meter, self, messages, _streamed(self, kwargs))
        _reserve(estimate, meter, _model_name(self))
        chunks = stream(_quiet(self), input, config, stop=stop, **kwargs)
        last = None
        while True:
            hidden = _METER.set(None)  # a stream that falls back to invoke is not metered twice
            try:
                chunk = next(chunks)
            except StopIteration:
                break
            except Exception as exc:
                _refused(exc)
                raise
            finally:
                _METER.reset(hidden)
            last = chunk if last is None else last + chunk
            yield chunk
        if last is not None:
            meter.add(_usage(_model_name(self), last), _model_name(self))
            _paid(meter)

    return _stream


def _metered_astream(astream: Callable) -> Callable:
    """`astream`, metered from its chunks inside a durable node."""

    @functools.wraps(astream)
    async def _astream(self, input, config=None, *, stop=None, **kwargs) -> AsyncIterator:
        meter = _METER.get()
        if meter is None:
            async for chunk in astream(self, input, config, stop=stop, **kwargs):
                yield chunk
            return
        messages = self._convert_input(input).to_messages()
        kwargs, estimate = await _aprepared(meter, self, messages, _streamed(self, kwargs))
        await _areserve(estimate, meter, _model_name(self))
        chunks = astream(_quiet(self), input, config, stop=stop, **kwargs)
        last = None
        while True:
            hidden = _METER.set(None)
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                break
            except Exception as exc:
                _refused(exc)
                raise
            finally:
                _METER.reset(hidden)
            last = chunk if last is None else last + chunk
            yield chunk
        if last is not None:
            meter.add(_usage(_model_name(self), last), _model_name(self))
            await _apaid(meter)

    return _astream


def _with_started_usage(make: Callable) -> Callable:
    """ChatAnthropic's chunk of a streamed answer's `message_start`, keeping the usage that
    event counts as the chunk's `response_metadata["message_start_usage"]`. LangChain reads
    the usage from `message_delta` alone, which carries the input tokens only where the
    provider repeats them there (Anthropic's API now; not Bedrock, Vertex or the API
    before): without them the answer's input would be recorded free."""

    @functools.wraps(make)
    def _make_message_chunk_from_anthropic_event(self, event, *args, **kwargs):
        chunk, block = make(self, event, *args, **kwargs)
        usage = getattr(getattr(event, "message", None), "usage", None)
        if event.type == "message_start" and chunk is not None and usage is not None:
            chunk.response_metadata["message_start_usage"] = usage.model_dump(exclude_none=True)
        return chunk, block

    return _make_message_chunk_from_anthropic_event


def _install() -> None:
    for name, metered in (
        ("_generate_with_cache", _metered_generate),
        ("_agenerate_with_cache", _metered_agenerate),
        ("stream", _metered_stream),
        ("astream", _metered_astream),
        ("agenerate", _carrying),
    ):
        setattr(BaseChatModel, name, metered(getattr(BaseChatModel, name)))
    try:
        from langchain_anthropic import ChatAnthropic
    except ImportError:  # pragma: no cover - an extra of the app's
        return
    name = "_make_message_chunk_from_anthropic_event"
    setattr(ChatAnthropic, name, _with_started_usage(getattr(ChatAnthropic, name)))


if not getattr(BaseChatModel, "_stepguard_metered", False):
    _install()
    BaseChatModel._stepguard_metered = True  # type: ignore[attr-defined]
