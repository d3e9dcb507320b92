"""Pydantic AI agents as durable Stepguard runs: a checkpointed step per model request and per
tool call, without rewriting the agent.

    from pydantic_ai import Agent
    from runs.adapters.pydantic_ai import StepguardAgent

    support = Agent("openai:gpt-4o", output_type=Answer, tools=[lookup_order, refund])

    @workflow("support")
    async def support_run(ctx, input):
        agent = StepguardAgent(support, ctx, requires_approval={"refund": True})
        result = await agent.run(input["question"])
        return result.output.model_dump()

Every model request is an `llm` step (`<key>.model`, then `#2`, `#3`...): its estimate is held
against the run's budgets before it is sent, it carries the step's idempotency key as an
`Idempotency-Key` header, and its tokens and USD are priced from the response's usage. Every
tool call is a `tool` step (`<key>.tool.<name>`). A finished step is handed back from the record
on replay, as Pydantic AI's own types, so a resumed run pays for no model call and runs no tool a
second time. Tools Pydantic AI marks as needing approval (`requires_approval=True`, or a tool that
raises `ApprovalRequired`), and those named in `requires_approval=`, wait for a person as durable
Stepguard approvals. A sync workflow calls `agent.run_sync(...)`.
"""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("pydantic_ai") is None:
    raise ImportError(
        "runs.adapters.pydantic_ai needs its framework, an extra of Stepguard: "
        "pip install 'stepguard[pydantic-ai]'"
    )

import asyncio
import contextvars
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from pydantic import TypeAdapter, ValidationError
from pydantic_ai import messages as pa_messages
from pydantic_ai.agent import AbstractAgent, WrapperAgent
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.exceptions import ApprovalRequired, CallDeferred, ModelRetry, ToolFailed
from pydantic_ai.messages import (
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelResponse,
    ToolCallPart,
    ToolReturn,
)
from pydantic_ai.models import CompletedStreamedResponse, Model, ModelRequestParameters
from pydantic_ai.models.wrapper import WrapperModel
from pydantic_ai.output import OutputDataT
from pydantic_ai.settings import ModelSettings
from pydantic_ai.tools import (
    AgentDepsT,
    DeferredToolRequests,
    DeferredToolResults,
    RunContext,
    ToolApproved,
    ToolDenied,
)
from pydantic_ai.toolsets import AbstractToolset, ToolsetTool, WrapperToolset
from pydantic_ai.usage import RequestUsage
from pydantic_core import to_jsonable_python

from runs.engine import sdk_types
from runs.engine.aio.bridge import AsyncRunContext, run_async
from runs.engine.context import engine_of
from runs.engine.llm import CAP_FIELD
from runs.sdk import ApprovalRevoked, Ask, Decision, RetryPolicy, StepMisuse

__all__ = ["StepguardAgent"]

#: What a tool is allowed to do before its approval: True, False, or a predicate on its arguments.
ApprovalRule = bool | Callable[[dict], bool]

# The Pydantic AI run id of a replayed run is derived from the Stepguard run, so its messages
# (and the conversation id derived from it) are the same on every execution.
_CONVERSATIONS = uuid.UUID("6f1c2a4e-5d0b-4c1e-9a53-3b8e7d2f0c11")

#: Fields of Pydantic AI's messages that change between executions without changing what the
#: model is sent: left out of the recorded request, so a resumed run's next request is still
#: stored as a delta of the one before it.
_VOLATILE = frozenset({"timestamp", "run_id", "conversation_id", "instructions"})


class StepguardAgent(WrapperAgent[AgentDepsT, OutputDataT]):
    """`agent` run inside a Stepguard workflow, each model request and tool call a step.

    Create it inside the workflow function with the workflow's `ctx` and use it as the agent:
    `await StepguardAgent(agent, ctx).run(...)`, `run_stream`, `iter`, `run_stream_events`; in
    a sync workflow, `run_sync`. `key` prefixes its step keys (default: the agent's name, else
    "agent"). `requires_approval` maps tool names to True or a predicate on the call's
    arguments: such a call waits for a person (`<key>.tool.<name>.approval`) before its step
    starts, as a tool Pydantic AI itself marks `requires_approval=True` does; a rejection is
    reported to the model as a denied call. `model_retry` and `tool_retry` are the steps'
    RetryPolicy (Pydantic AI's SDK clients are told not to retry on their own inside a step).

    Code outside the steps runs again on every resume and must be deterministic: instructions,
    history processors, output validators and output functions, tool discovery (an MCP server's
    tool list). Run several agents of one workflow one after another (or as child runs), not
    gathered: their steps must reach the same positions on replay.
    """

    def __init__(
        self,
        wrapped: AbstractAgent[AgentDepsT, OutputDataT],
        ctx: Any,
        *,
        key: str | None = None,
        requires_approval: Mapping[str, ApprovalRule] | None = None,
        approval_timeout: float | timedelta | None = None,
        model_retry: RetryPolicy | None = None,
        tool_retry: RetryPolicy | None = None,
    ):
        super().__init__(wrapped)
        self.ctx = ctx
        name = key or wrapped.name
        if not name:
            # Pydantic AI names an unnamed agent after the caller's variable on its first
            # run and keeps that name: keys taken from it would change between executions.
            raise StepMisuse(
                "a StepguardAgent keys its steps by the agent's name: give the agent one "
                "(Agent(..., name='support')) or pass key='support'"
            )
        self.key = name
        if "#" in self.key:
            raise StepMisuse(f"a step key cannot contain '#': {self.key!r}")
        self.requires_approval = dict(requires_approval or {})
        self.approval_timeout = approval_timeout
        self.model_retry = model_retry
        self.tool_retry = tool_retry
        self._bridged: AsyncRunContext | None = None  # a sync workflow's, during run_sync
        self._runs = 0

    def _infer_name(self, function_frame: Any) -> None:
        """Never: a name taken from a variable would rename the wrapped agent (and its step
        keys) for the process's next executions."""

    def _async_context(self) -> AsyncRunContext:
        if self._bridged is not None:
            return self._bridged
        if isinstance(self.ctx, AsyncRunContext):
            return self.ctx
        raise StepMisuse(
            "a StepguardAgent in a sync workflow runs with agent.run_sync(...); "
            "in an async def workflow, await agent.run(...)"
        )

    @asynccontextmanager
    async def iter(  # type: ignore[override]  (every overload of the wrapped agent's, forwarded)
        self,
        user_prompt: Any = None,
        *,
        capabilities: Sequence[Any] | None = None,
        **options: Any,
    ) -> AsyncIterator[Any]:
        """The wrapped agent's `iter`, with this run's steps. `run`, `run_stream` and
        `run_stream_events` go through here."""
        steps = _Steps(agent=self, actx=self._async_context(), run_id=self._run_id(options))
        async with self.wrapped.iter(
            user_prompt, capabilities=[*(capabilities or ()), steps], **options
        ) as run:
            yield run

    def run_sync(self, user_prompt: Any = None, **options: Any) -> Any:  # type: ignore[override]
        """Run the agent from a sync workflow: its model requests and tool calls are the same
        steps as in an async workflow, run on an event loop of their own until it returns."""
        if isinstance(self.ctx, AsyncRunContext) or self._bridged is not None:
            raise StepMisuse("in an async def workflow, await agent.run(...) instead of run_sync")

        async def run(actx: AsyncRunContext, _input: Any) -> Any:
            self._bridged = actx
            try:
                return await self.run(user_prompt, **options)
            finally:
                self._bridged = None

        return run_async(run, engine_of(self.ctx), None)

    def run_stream_sync(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        raise StepMisuse(
            "stream a StepguardAgent with `async with agent.run_stream(...)` in an async def "
            "workflow; a sync workflow calls agent.run_sync(...)"
        )

    def _run_id(self, options: dict) -> str:
        """A run id stable across executions: the Stepguard run, the key and how many runs this
        agent made before (skipping one the message history already holds)."""
        conversation = options.get("conversation")
        history = options.get("message_history") or getattr(conversation, "messages", None) or ()
        taken = {getattr(message, "run_id", None) for message in history}
        while (run_id := f"{self._async_context().run_id}:{self.key}:{self._runs}") in taken:
            self._runs += 1
        self._runs += 1
        return run_id


@dataclass(kw_only=True)
class _Steps(AbstractCapability[Any]):
    """One agent run's link to the workflow: wraps the model and the toolset that serve it,
    turns Pydantic AI's approval requests into Stepguard approvals, and keeps the decisions
    until the approved calls start."""

    agent: StepguardAgent
    actx: AsyncRunContext
    run_id: str
    decisions: dict[str, Decision] = field(default_factory=dict)

    def get_default_run_id(self) -> str | None:
        return self.run_id

    def get_default_conversation_id(self, run_id: str) -> str | None:
        return str(uuid.uuid5(_CONVERSATIONS, run_id))

    def get_wrapper_model(self, model: Model) -> Model | None:
        return _CheckpointedModel(model, self)

    def get_wrapper_toolset(self, toolset: AbstractToolset[Any]) -> AbstractToolset[Any] | None:
        return _CheckpointedToolset(toolset, steps=self)

    async def handle_deferred_tool_calls(
        self, ctx: RunContext[Any], *, requests: DeferredToolRequests
    ) -> DeferredToolResults | None:
        """A turn's calls that need approval are asked together and wait durably, holding no
        worker; a rejected or expired one goes back to the model as a denied call."""
        if not requests.approvals:
            return None
        asks = [
            Ask(
                f"{self.agent.key}.tool.{call.tool_name}.approval",
                action=f"call {call.tool_name}"[:200],
                payload=_approval_payload(call, requests.metadata.get(call.tool_call_id)),
                timeout=self.agent.approval_timeout,
            )
            for call in requests.approvals
        ]
        results = DeferredToolResults()
        for call, decision in zip(requests.approvals, await self.actx.approvals(asks), strict=True):
            if isinstance(decision, Decision):
                self.decisions[call.tool_call_id] = decision
                results.approvals[call.tool_call_id] = ToolApproved()
                results.answered_by[call.tool_call_id] = decision.decided_by
            else:
                results.approvals[call.tool_call_id] = ToolDenied(str(decision))
        return results

    async def model_call(
        self,
        model: Model,
        messages: list[ModelMessage],
        settings: ModelSettings | None,
        parameters: ModelRequestParameters,
        *,
        stream: bool = False,
        run_context: RunContext[Any] | None = None,
    ) -> ModelResponse:
        """One model request as an `llm` step. Streamed, the stream is read to its end inside
        the step and the final response recorded."""
        settings = dict(settings or {})
        ignored = getattr(_unwrapped(model), "unsupported_settings", frozenset())

        async def send(headers: dict[str, str], cap: int | None) -> dict:
            sent: dict[str, Any] = dict(settings)
            if cap is not None and not sent.get("max_tokens"):
                sent["max_tokens"] = cap  # what the run's budget has left (ctx.llm's cap)
            if "extra_headers" not in ignored:
                sent["extra_headers"] = {**settings.get("extra_headers", {}), **headers}
            if "max_retries" not in ignored:
                sent.setdefault("max_retries", 0)  # the step retries, recorded and checked
            await sdk_types.abuild_for(_unwrapped(model))  # before sending: runs/engine/sdk_types
            if stream:
                async with model.request_stream(messages, sent, parameters, run_context) as live:
                    async for _event in live:
                        pass
                    response = live.get()
            else:
                response = await model.request(messages, sent, parameters)
            return {
                "model": response.model_name or model.model_name,
                "usage": _provider_usage(response.usage),
                "response": ModelMessagesTypeAdapter.dump_python([response], mode="json")[0],
            }

        carried = _carried(send)

        async def call(*, extra_headers: dict[str, str] | None = None, **_recorded: Any) -> dict:
            cap = _recorded.get("max_tokens")
            return await carried(extra_headers or {}, cap if isinstance(cap, int) else None)

        setattr(call, CAP_FIELD, "max_tokens")  # under a budget, ctx.llm caps the answer

        data = await self.actx.llm(
            f"{self.agent.key}.model",
            call,
            retry=self.agent.model_retry,
            **_recorded_request(model, messages, settings, parameters),
        )
        return ModelMessagesTypeAdapter.validate_python([data["response"]])[0]

    async def tool_call(
        self,
        toolset: AbstractToolset[Any],
        name: str,
        args: dict[str, Any],
        ctx: RunContext[Any],
        tool: ToolsetTool[Any],
    ) -> Any:
        """One tool call as a `tool` step; what the tool raised to steer the agent (a retry, a
        deferral, a failure) is recorded like a return, so a replay steers it the same way."""
        record = _jsonable(args)
        rule = self.agent.requires_approval.get(name, False)
        if not ctx.tool_call_approved and (rule(record) if callable(rule) else rule):
            raise ApprovalRequired  # Pydantic AI defers the call; handle_deferred_tool_calls asks
        decision = self.decisions.get(ctx.tool_call_id or "") if ctx.tool_call_approved else None
        carried = _carried(lambda: _outcome(toolset.call_tool(name, args, ctx, tool)))

        async def call(**_recorded: Any) -> dict:
            return await carried()

        try:
            outcome = await self.actx.tool(
                f"{self.agent.key}.tool.{name}",
                call,
                record,
                approved=decision,
                retry=self.agent.tool_retry,
            )
        except ApprovalRevoked as revoked:  # withdrawn before the call started: it never ran
            return ToolDenied(str(revoked))
        return _replayed(outcome)


class _CheckpointedModel(WrapperModel):
    """The model serving a request, with each request a step of the run."""

    def __init__(self, wrapped: Model, steps: _Steps):
        super().__init__(wrapped)
        self._steps = steps

    async def request(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
    ) -> ModelResponse:
        return await self._steps.model_call(
            self.wrapped, messages, model_settings, model_request_parameters
        )

    @asynccontextmanager
    async def request_stream(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
        run_context: RunContext[Any] | None = None,
    ) -> AsyncIterator[CompletedStreamedResponse]:
        """The response is streamed inside the step and handed on whole, one event per part:
        the same events live and on replay, each after its model request has completed."""
        response = await self._steps.model_call(
            self.wrapped,
            messages,
            model_settings,
            model_request_parameters,
            stream=True,
            run_context=run_context,
        )
        yield CompletedStreamedResponse(
            response, model_request_parameters=model_request_parameters, replay_events=True
        )

    def _start_request_deadline(self, model_settings: ModelSettings | None, *, stream: bool):
        # The first streamed event arrives only once the step has read the whole stream, so a
        # first-event deadline cannot apply out here; the whole request's still does.
        return super()._start_request_deadline(model_settings, stream=False)


@dataclass
class _CheckpointedToolset(WrapperToolset[Any]):
    """The agent's tools, with each call a step of the run."""

    steps: _Steps = field(kw_only=True)

    async def call_tool(
        self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any], tool: ToolsetTool[Any]
    ) -> Any:
        return await self.steps.tool_call(self.wrapped, name, tool_args, ctx, tool)


def _carried(work: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """`work` run inside the agent's own context when the step calls it. A step's function is
    started from Stepguard's checkpoint thread, in a context of its own: the call must still
    see what Pydantic AI set for the run (its run context, deadlines, tracing), and the step's
    own values (its idempotency key) on top."""
    caller = contextvars.copy_context()

    async def run(*args: Any) -> Any:
        context = caller.copy()
        for var, value in contextvars.copy_context().items():
            context.run(var.set, value)
        return await asyncio.get_running_loop().create_task(work(*args), context=context)

    return run


async def _outcome(call: Awaitable[Any]) -> dict:
    """A tool call's result as JSON, or the signal it raised to Pydantic AI."""
    try:
        value = await call
    except ModelRetry as exc:
        return {"raised": "model_retry", "message": exc.message}
    except ValidationError as exc:  # Pydantic AI asks the model to retry with the errors too
        return {"raised": "model_retry", "message": str(exc)}
    except ToolFailed as exc:
        return {"raised": "tool_failed", "message": exc.message}
    except ApprovalRequired as exc:
        return {"raised": "approval_required", "metadata": _jsonable(exc.metadata)}
    except CallDeferred as exc:
        return {"raised": "call_deferred", "metadata": _jsonable(exc.metadata), "kind": exc.kind}
    if isinstance(value, ToolReturn):
        return {"tool_return": _TOOL_RETURN.dump_python(value, mode="json")}
    return {"value": pa_messages.tool_return_content_ta.dump_python(value, mode="json")}


def _replayed(outcome: dict) -> Any:
    """What the tool call returned or raised, rebuilt from its record (images and documents
    as Pydantic AI's own types): the same live and on replay."""
    raised = outcome.get("raised")
    if raised == "model_retry":
        raise ModelRetry(outcome["message"])
    if raised == "tool_failed":
        raise ToolFailed(outcome["message"])
    if raised == "approval_required":
        raise ApprovalRequired(outcome["metadata"])
    if raised == "call_deferred":
        raise CallDeferred(outcome["metadata"], kind=outcome["kind"])
    if "tool_return" in outcome:
        return _TOOL_RETURN.validate_python(outcome["tool_return"])
    return pa_messages.tool_return_content_ta.validate_python(outcome["value"])


_TOOL_RETURN = TypeAdapter(ToolReturn)


def _approval_payload(call: ToolCallPart, metadata: dict | None) -> dict:
    """What the approver sees: the tool, the model's arguments, and what the tool said when it
    asked for approval (ApprovalRequired's metadata)."""
    payload = {"tool": call.tool_name, "args": _jsonable(call.args_as_dict())}
    payload["tool_call_id"] = call.tool_call_id
    if metadata:
        payload["metadata"] = _jsonable(metadata)
    return payload


def _recorded_request(
    model: Model,
    messages: list[ModelMessage],
    settings: dict,
    parameters: ModelRequestParameters,
) -> dict:
    """The request as the step records it and reserves it against the budgets: the model, the
    instructions, the conversation and the tools (Pydantic AI's own JSON of them)."""
    conversation = ModelMessagesTypeAdapter.dump_python(messages, mode="json", exclude_none=True)
    instructions = next(
        (m.instructions for m in reversed(messages) if getattr(m, "instructions", None)), None
    )
    tools = [
        {"name": t.name, "description": t.description, "parameters": t.parameters_json_schema}
        for t in [*parameters.function_tools, *parameters.output_tools]
    ]
    request: dict[str, Any] = {"model": model.model_name}
    if instructions:
        request["instructions"] = instructions
    request["messages"] = _lean(conversation)
    if tools:
        request["tools"] = _jsonable(tools)
    for name in ("max_tokens", "temperature"):
        if settings.get(name) is not None:
            request[name] = settings[name]
    return request


def _lean(messages: list[dict]) -> list[dict]:
    """The messages without their volatile fields (only the messages' and parts' own: what a
    tool returned is recorded as it is)."""

    def kept(fields: dict) -> dict:
        return {k: v for k, v in fields.items() if k not in _VOLATILE}

    return [
        {k: [kept(p) for p in v] if k == "parts" else v for k, v in kept(m).items()}
        for m in messages
    ]


def _provider_usage(usage: RequestUsage) -> dict:
    """Pydantic AI's usage in the shape Stepguard prices: its input tokens include cache reads
    and writes (as OpenAI's do), so they are split out beside them (as Anthropic reports them)
    to be priced at their own rates, not twice."""
    read, write = usage.cache_read_tokens, usage.cache_write_tokens
    return {
        "input_tokens": max(usage.input_tokens - read - write, 0),
        "cache_read_input_tokens": read,
        "cache_creation_input_tokens": write,
        "cache_creation": {"ephemeral_1h_input_tokens": usage.cache_write_1h_tokens},
        "output_tokens": usage.output_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.output_reasoning_tokens},
    }


def _unwrapped(model: Model) -> Model:
    while isinstance(model, WrapperModel):
        model = model.wrapped
    return model


def _jsonable(value: Any) -> Any:
    """Tool arguments and metadata as JSON (models, dataclasses, dates, bytes...)."""
    return to_jsonable_python(value, bytes_mode="base64", fallback=repr)
