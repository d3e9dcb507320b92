"""The agent's model, each call an `llm` step of the run (see the package's docstring)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from agents import Agent, FunctionTool, Model, ModelProvider, ModelResponse, MultiProvider

# Private to the SDK, pinned by the `openai-agents>=0.24,<0.25` extra: the switch that turns the
# provider client's own retries off.
from agents.models._retry_runtime import provider_managed_retries_disabled
from agents.usage import deserialize_usage
from openai.types.responses import Response, ResponseCompletedEvent, ResponseUsage

from runs.adapters.openai_agents.records import _item, _key, _recorded
from runs.engine import sdk_types
from runs.engine.llm import CAP_FIELD


class Adapter(Protocol):
    """What a model needs of the `durable()` call that made it (adapter._Adapter): the run's
    context, the provider of a model given by name, and the way to call the context."""

    ctx: Any
    provider: ModelProvider | None

    async def call(self, method: str, /, *args: Any, **kwargs: Any) -> Any: ...

    def portable(self, fn: Callable) -> Callable: ...

    def turn(self, response: ModelResponse, gated: dict[str, FunctionTool]) -> None: ...


class DurableModel(Model):
    """The agent's model, each call a step of the run (see the package's docstring)."""

    def __init__(self, adapter: Adapter, agent: Agent) -> None:
        self._adapter, self._key = adapter, _key("model", agent.name)
        self._model = agent.model if isinstance(agent.model, Model) else None
        self._name = agent.model if isinstance(agent.model, str) else None
        self._gated = {
            t.name: t
            for t in agent.tools
            if isinstance(t, FunctionTool) and t.needs_approval is not False
        }

    @property
    def inner(self) -> Model:
        if self._model is None:  # at the first call: on the event loop its client will use
            provider = self._adapter.provider or MultiProvider()
            self._model = provider.get_model(self._name)
        return self._model

    @property
    def model_name(self) -> str:
        name = getattr(self.inner, "model", None)
        return name if isinstance(name, str) else self._name or ""

    async def get_response(
        self, system_instructions, input, model_settings, tools, output_schema, handoffs,
        tracing, **options: Any,
    ) -> ModelResponse:  # fmt: skip
        async def call(*, extra_headers: dict | None = None, **_request: Any) -> dict:
            settings = _capped(_with_headers(model_settings, extra_headers), _request)
            await sdk_types.abuild_for(self.inner)  # before sending: see runs/engine/sdk_types
            with provider_managed_retries_disabled(True):
                response = await self.inner.get_response(
                    system_instructions, input, settings, tools, output_schema, handoffs,
                    tracing, **options,
                )  # fmt: skip
            return _recorded(response.output, response.usage, self.model_name,
                             response.response_id, response.request_id)  # fmt: skip

        request = _request(self.model_name, system_instructions, input, model_settings, tools,
                           handoffs)  # fmt: skip
        data = await self._adapter.call("llm", self._key, self._model_call(call), **request)
        return self._answered(data)

    def _model_call(self, call: Callable) -> Callable:
        """`call` as the step's function, declaring where its answer is capped: under a
        budget, `ctx.llm` caps it to what the budget has left (and estimates from the cap)."""
        portable = self._adapter.portable(call)
        setattr(portable, CAP_FIELD, "max_output_tokens")
        return portable

    def _answered(self, data: dict) -> ModelResponse:
        """The recorded response as the SDK's; its function calls are the turn's."""
        response = ModelResponse(
            output=[_item(item) for item in data["output"]],
            usage=deserialize_usage(data["usage"]),
            response_id=data.get("response_id"),
            request_id=data.get("request_id"),
        )
        self._adapter.turn(response, self._gated)
        return response

    async def stream_response(
        self, system_instructions, input, model_settings, tools, output_schema, handoffs,
        tracing, **options: Any,
    ) -> AsyncIterator[Any]:  # fmt: skip
        """A live call's events as they arrive, but its `response.completed` event rebuilt from
        the record, as a replayed call's only event is: both runs read the same response."""
        events: asyncio.Queue = asyncio.Queue()

        async def call(*, extra_headers: dict | None = None, **_request: Any) -> dict:
            settings = _capped(_with_headers(model_settings, extra_headers), _request)
            if settings.include_usage is None:  # chat completions stream usage only if asked
                settings = settings.resolve({"include_usage": True})
            await sdk_types.abuild_for(self.inner)
            final = None
            with provider_managed_retries_disabled(True):
                async for event in self.inner.stream_response(
                    system_instructions, input, settings, tools, output_schema, handoffs,
                    tracing, **options,
                ):  # fmt: skip
                    if isinstance(event, ResponseCompletedEvent):
                        final = event.response
                    else:
                        events.put_nowait(event)
            if final is None:
                raise RuntimeError(f"{self.model_name} streamed no response.completed event")
            return _recorded(final.output, final.usage, self.model_name, final.id, None)

        request = _request(self.model_name, system_instructions, input, model_settings, tools,
                           handoffs)  # fmt: skip
        step = asyncio.ensure_future(
            self._adapter.call("llm", self._key, self._model_call(call), **request)
        )
        while True:
            getter = asyncio.ensure_future(events.get())
            await asyncio.wait({getter, step}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                break
            yield getter.result()
        data = step.result()
        response = self._answered(data)
        usage = {k: v for k, v in data["usage"].items() if k != "requests"}
        yield ResponseCompletedEvent.model_construct(
            type="response.completed",
            sequence_number=0,
            response=Response.model_construct(
                id=data.get("response_id") or "",
                object="response",
                created_at=0,
                model=self.model_name,
                status="completed",
                output=response.output,
                parallel_tool_calls=False,
                tool_choice="auto",
                tools=[],
                usage=ResponseUsage.model_validate(usage),
            ),
        )

    async def close(self) -> None:
        if self._model is not None:
            await self._model.close()

    async def _cleanup_on_run_end(self, owner: object) -> None:
        if self._model is not None:
            await self._model._cleanup_on_run_end(owner)


def _with_headers(settings, headers: dict | None):
    """The settings with the step's Idempotency-Key header over the agent's own headers."""
    return settings.resolve(
        {"extra_headers": {**(settings.extra_headers or {}), **(headers or {})}}
    )


def _capped(settings, request: dict):
    """The settings with the answer cap the step's request carries (set by the budget)."""
    cap = request.get("max_output_tokens")
    if not isinstance(cap, int) or settings.max_tokens:
        return settings
    return settings.resolve({"max_tokens": cap})


def _request(model: str, instructions, input, settings, tools, handoffs) -> dict:
    """The request as the step records it and the budgets estimate it: the responses API's
    fields (the SDK speaks them to every model)."""
    specs = [_spec(t) for t in tools] + [
        {"type": "function", "name": h.tool_name, "description": h.tool_description,
         "parameters": h.input_json_schema}
        for h in handoffs
    ]  # fmt: skip
    request: dict[str, Any] = {"model": model, "input": input, "tools": specs}
    if instructions:
        request["instructions"] = instructions
    if settings.max_tokens:
        request["max_output_tokens"] = settings.max_tokens
    return request


def _spec(tool: Any) -> dict:
    if isinstance(tool, FunctionTool):
        return {"type": "function", "name": tool.name, "description": tool.description,
                "parameters": tool.params_json_schema}  # fmt: skip
    return {"type": getattr(tool, "type", type(tool).__name__), "name": getattr(tool, "name", "")}
