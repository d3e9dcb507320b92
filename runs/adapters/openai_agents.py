"""The OpenAI Agents SDK (`openai-agents` 0.24) on Stepguard: an agent's model calls and tool
calls become checkpointed steps, under the run's budgets, approvals and halts, by wrapping the
agent where it is run:

    from runs.adapters.openai_agents import durable

    @workflow("support")
    async def support(ctx, input):
        agent = Agent(name="support", instructions=..., model=..., tools=[lookup, refund])
        result = await Runner.run(durable(agent, ctx), input["question"])
        return result.final_output

- Each model turn is an `llm` step `model:<agent name>`: estimated against the budgets before it
  starts, sent with the step's `Idempotency-Key` header and without the SDK's own retries (the
  step retries, recorded), priced from its usage, recorded as JSON and rebuilt into the SDK's
  `ModelResponse` on replay (and live: both read the same record).
- Each function tool call is a `tool` step `tool:<tool name>`. A tool's own error handling is
  kept: an error the SDK reports to the model is the step's recorded output (give the tool
  `failure_error_function=None` to have the step's RetryPolicy retry it instead).
- A tool with `needs_approval` (True or a policy on its arguments) waits for a person instead of
  interrupting the run: the approvals a turn needs (`approve:<tool name>`) are asked together,
  before any of the turn's tools starts, in one durable wait; a refusal goes back to the model as
  the tool's output, and an approved tool starts only if its approval still stands.
- An agent's MCP servers (`mcp_servers`) are listed once per run, in a step each
  (`mcp:<server name>:tools`), so a resumed run offers the tools it was offered first; each of
  their calls is a `tool:<tool name>` step like a function tool's (approvals from the server's
  `require_approval` included), sent with the step's idempotency key in the request's `_meta`
  (`stepguard.dev/idempotency-key`). Connect the servers in the workflow, as the SDK says
  (`async with MCPServerStdio(...)`).
- Handoffs lead to durable copies of their agents. Hosted tools (web search, file search...) run
  inside the model call; tools that run on this machine outside a function (computer, shell,
  apply_patch, custom tools) are refused, as is an agent used as a tool unless that agent is
  durable itself (`durable(sub, ctx).as_tool(...)`).
- `Runner.run_streamed` streams each live model call's events and replays a recorded one as its
  final `response.completed` event only. `Runner.run_sync` works in a sync workflow.
"""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("agents") is None:
    raise ImportError(
        "runs.adapters.openai_agents needs its framework, an extra of Stepguard: "
        "pip install 'stepguard[openai-agents]'"
    )

import asyncio
import copy
import inspect
import json
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from typing import Any

from agents import (
    Agent,
    ApplyPatchTool,
    ComputerTool,
    CustomTool,
    FunctionTool,
    Handoff,
    LocalShellTool,
    Model,
    ModelProvider,
    ModelResponse,
    MultiProvider,
    ShellTool,
)
from agents.mcp import MCPServer

# Private to the SDK, pinned by the `openai-agents>=0.24,<0.25` extra: the switch that turns the
# provider client's own retries off, and the tool invocation that applies a tool's timeout and
# says whether its output is an error the SDK wrote.
from agents.models._retry_runtime import provider_managed_retries_disabled
from agents.tool import (
    _DEFAULT_FAILURE_HANDLED_ATTR,
    DEFAULT_APPROVAL_REJECTION_MESSAGE,
    _invoke_function_tool_with_metadata,
)
from agents.usage import deserialize_usage
from django.db import connection
from mcp.types import CallToolResult
from mcp.types import Tool as MCPTool
from openai.types.responses import (
    Response,
    ResponseCompletedEvent,
    ResponseOutputItem,
    ResponseUsage,
)
from pydantic import TypeAdapter, ValidationError
from pydantic_core import to_jsonable_python

from runs.engine import sdk_types
from runs.engine.aio.bridge import AsyncRunContext
from runs.engine.context import RunContext
from runs.engine.llm import CAP_FIELD
from runs.models import StepKind
from runs.sdk import ApprovalRevoked, Ask, StepguardError, StepMisuse

__all__ = ["durable"]

#: runs.adapters.mcp's `_meta` key, not imported: that module needs mcp 2, the SDK mcp 1 or 2.
IDEMPOTENCY_META_KEY = "stepguard.dev/idempotency-key"

#: Tools that act on this machine outside a function the adapter can make a step of.
LOCAL_TOOLS = (ComputerTool, CustomTool, ShellTool, ApplyPatchTool, LocalShellTool)

_OUTPUT_ITEM: TypeAdapter = TypeAdapter(ResponseOutputItem)


def durable(
    agent: Agent,
    ctx: RunContext | AsyncRunContext,
    *,
    model_provider: ModelProvider | None = None,
    approval_timeout: float | timedelta | None = None,
) -> Agent:
    """A copy of `agent` (and of the agents it hands off to) whose model calls and tool calls
    are steps of this run; pass it to `Runner.run`, `Runner.run_sync` or `Runner.run_streamed`.

    Call it in the workflow, on each execution: it does no I/O. An agent whose model is a name
    (or None) gets it from `model_provider` (default: the SDK's MultiProvider) when it first
    calls it, because the copy's model is what the SDK uses: a `RunConfig(model=...)` would
    bypass it, and its tool calls are then refused. `approval_timeout` bounds each approval
    wait; an expired one is reported to the model as a refusal.
    """
    return _Adapter(ctx, model_provider, approval_timeout).agent(agent)


def _key(kind: str, name: str) -> str:
    return f"{kind}:{name.replace('#', '_')}"[:200]  # '#' marks a key's repeats


class _Adapter:
    """What one `durable()` call shares: the run's context, the copies made so far (handoffs
    may form cycles) and the function calls of the model turns, by call id."""

    def __init__(self, ctx, provider: ModelProvider | None, approval_timeout) -> None:
        if not isinstance(ctx, RunContext | AsyncRunContext):
            raise StepMisuse("durable() takes the workflow's ctx, the RunContext it was given")
        self.ctx, self.asynchronous = ctx, isinstance(ctx, AsyncRunContext)
        self.provider, self.approval_timeout = provider, approval_timeout
        self.agents: dict[int, Agent] = {}
        self.servers: dict[int, DurableMCPServer] = {}
        self.turns: dict[str, _Turn] = {}
        # A sync workflow's context takes one call at a time, in the order they were asked for:
        # the SDK starts a turn's tool calls in the model's order, and the lock is first-come.
        self._one_at_a_time = asyncio.Lock()

    def agent(self, agent: Agent) -> Agent:
        if self.durable(agent):
            return agent
        if (done := self.agents.get(id(agent))) is not None:
            return done
        tools = [self.tool(agent.name, tool) for tool in agent.tools]
        model = DurableModel(self, agent)
        servers = [self.server(server) for server in agent.mcp_servers]
        clone = agent.clone(
            model=model, model_settings=agent.model_settings, tools=tools, mcp_servers=servers
        )
        if servers:
            listed = clone.get_mcp_tools

            async def get_mcp_tools(run_context) -> list:
                """The servers' tools (listed in steps) as durable function tools."""
                found = await listed(run_context)
                model._gated |= {
                    t.name: t
                    for t in found
                    if isinstance(t, FunctionTool) and t.needs_approval is not False
                }
                return [self.tool(agent.name, t) for t in found]

            clone.get_mcp_tools = get_mcp_tools  # type: ignore[method-assign]
        self.agents[id(agent)] = clone
        clone.handoffs = [self.handoff(item) for item in agent.handoffs]
        return clone

    def durable(self, agent: Agent) -> bool:
        """Whether `agent` is a durable copy already, made for this execution: one made for
        an earlier execution would write to a context that is gone."""
        model = agent.model
        if not isinstance(model, DurableModel):
            return False
        if model._adapter.ctx is not self.ctx:
            raise StepMisuse(
                f"agent {agent.name!r} was made durable in another execution: call durable() "
                "on the agent itself, in the workflow, each time it runs"
            )
        return True

    def handoff(self, item: Agent | Handoff) -> Agent | Handoff:
        if isinstance(item, Agent):
            return self.agent(item)
        invoke = item.on_invoke_handoff

        async def on_invoke_handoff(context, arguments):
            return self.agent(await invoke(context, arguments))

        wrapped = copy.copy(item)
        wrapped.on_invoke_handoff = on_invoke_handoff
        return wrapped

    def tool(self, agent_name: str, tool: Any) -> Any:
        if isinstance(tool, LOCAL_TOOLS):
            raise StepMisuse(
                f"agent {agent_name!r}: {type(tool).__name__} {getattr(tool, 'name', '')!r} "
                "acts on this machine outside any step; offer it as a function tool"
            )
        if not isinstance(tool, FunctionTool):
            return tool  # hosted by the provider: it runs inside the model call's step
        if tool._is_agent_tool:
            inner = tool._agent_instance
            if inner is not None and self.durable(inner):
                return tool  # its own model and tool calls are steps
            raise StepMisuse(
                f"agent {agent_name!r}: tool {tool.name!r} runs an agent inside one tool call, "
                "its model calls unmetered: make that agent durable first, "
                "durable(agent, ctx).as_tool(...)"
            )
        key = _key("tool", tool.name)

        async def on_invoke_tool(context, arguments: str) -> Any:
            turn = self.turns.get(context.tool_call_id)
            if turn is None:
                raise StepMisuse(
                    f"tool {tool.name!r} was called by a model that is not the durable agent's "
                    "(a RunConfig(model=...) overrides it): give the model to the agent"
                )
            decision = await turn.decision(context.tool_call_id, context)
            if isinstance(decision, StepguardError):
                return f"{DEFAULT_APPROVAL_REJECTION_MESSAGE} {decision}"

            async def invoke(_arguments):
                result = await _invoke_function_tool_with_metadata(
                    function_tool=tool, context=context, arguments=arguments
                )
                recorded = {"output": _jsonable(result.output)}
                return recorded | ({"sdk_error": True} if result.is_sdk_generated_error else {})

            try:
                recorded = await self.call(
                    "step", key, self.portable(invoke), _arguments(arguments),
                    kind=StepKind.TOOL, approval=decision,
                )  # fmt: skip
            except ApprovalRevoked as revoked:
                return f"{DEFAULT_APPROVAL_REJECTION_MESSAGE} {revoked}"
            if recorded.get("sdk_error"):  # as live: an error the SDK wrote skips the schema
                setattr(context, _DEFAULT_FAILURE_HANDLED_ATTR, True)
            return recorded["output"]

        wrapped = copy.copy(tool)  # the SDK's own copy, which keeps the tool's error policy
        wrapped.on_invoke_tool = on_invoke_tool
        wrapped.needs_approval = False  # asked by the turn, durably, instead
        wrapped.timeout_seconds = None  # applied inside the step, by the tool's invocation
        return wrapped

    def server(self, server: MCPServer) -> MCPServer:
        """One durable stand-in per server for this execution (agents may share servers)."""
        if isinstance(server, DurableMCPServer):
            return server
        if (done := self.servers.get(id(server))) is None:
            done = self.servers[id(server)] = DurableMCPServer(self, server)
        return done

    async def call(self, method: str, /, *args: Any, **kwargs: Any) -> Any:
        """A call of the run's context from the SDK's event loop. In a sync workflow that loop
        runs in the workflow's own thread (`Runner.run_sync`), so the checkpoint is written
        from a thread of its own (with its own database connection) while the loop waits."""
        bound = getattr(self.ctx, method)
        if self.asynchronous:
            return await bound(*args, **kwargs)

        def hop():
            try:
                return bound(*args, **kwargs)
            finally:
                connection.close()

        async with self._one_at_a_time:  # else two threads race for the next step position
            return await asyncio.to_thread(hop)

    def portable(self, fn: Callable) -> Callable:
        """`fn`, an async function, as a step's function: an async workflow's engine awaits it
        on the workflow's loop, the SDK's; in a sync workflow the step's thread sends it to the
        SDK's loop (with the step's context: `ctx.idempotency_key` works inside)."""
        if self.asynchronous:
            return fn
        loop = asyncio.get_running_loop()

        def run(*args: Any, **kwargs: Any) -> Any:
            return asyncio.run_coroutine_threadsafe(fn(*args, **kwargs), loop).result()

        return run

    def turn(self, response: ModelResponse, gated: dict[str, FunctionTool]) -> None:
        calls = [item for item in response.output if getattr(item, "type", "") == "function_call"]
        turn = _Turn(
            self, [(c.call_id, gated[c.name], c.arguments) for c in calls if c.name in gated]
        )
        for call in calls:
            self.turns[call.call_id] = turn


class DurableMCPServer(MCPServer):
    """An agent's MCP server whose tool list is recorded in a step, and whose calls carry their
    step's idempotency key in `_meta`. The calls are steps already: the SDK's tool for each
    listed tool is wrapped like any function tool (`_Adapter.tool`), and calls this from inside
    its step. Everything else is the server's own."""

    def __init__(self, adapter: _Adapter, server: MCPServer) -> None:
        # The base class's __init__ is not called: its settings are the wrapped server's.
        self._adapter, self._server = adapter, server
        self._listed: list[MCPTool] | None = None
        self._listing = asyncio.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)

    @property
    def name(self) -> str:
        return self._server.name

    async def connect(self) -> None:
        await self._server.connect()

    async def cleanup(self) -> None:
        await self._server.cleanup()

    async def list_tools(self, run_context=None, agent=None) -> list[MCPTool]:
        """The tools the server listed the first time this run asked (one step per run)."""
        async with self._listing:
            if self._listed is None:

                async def fetch() -> list[dict]:
                    tools = await self._server.list_tools(run_context, agent)
                    return [t.model_dump(mode="json", by_alias=True) for t in tools]

                recorded = await self._adapter.call(
                    "step", _key("mcp", f"{self.name}:tools"), self._adapter.portable(fetch)
                )
                self._listed = [MCPTool.model_validate(t) for t in recorded]
            return list(self._listed)

    async def call_tool(
        self, tool_name: str, arguments: dict[str, Any] | None, meta: dict[str, Any] | None = None
    ) -> CallToolResult:
        """Called inside the tool's step: the step's idempotency key goes in `_meta`."""
        try:
            key = self._adapter.ctx.idempotency_key
        except StepMisuse:
            raise StepMisuse(
                f"MCP tool {tool_name!r} was called outside its step: call it through the "
                "durable agent"
            ) from None
        meta = {**(meta or {}), IDEMPOTENCY_META_KEY: key}
        return await self._server.call_tool(tool_name, arguments, meta=meta)

    async def list_prompts(self):
        return await self._server.list_prompts()

    async def get_prompt(self, name: str, arguments: dict[str, Any] | None = None):
        return await self._server.get_prompt(name, arguments)

    @property
    def cached_tools(self) -> list[MCPTool] | None:
        return self._listed


class _Turn:
    """One model turn's function calls. The approvals they need are asked together, once,
    before any of them starts: a wait with a sibling tool in flight would suspend the run under
    it, and that tool would be sent again when the run resumes."""

    def __init__(self, adapter: _Adapter, gated: list[tuple[str, FunctionTool, str]]) -> None:
        self._adapter, self._gated = adapter, gated
        self._asked: asyncio.Future | None = None

    async def decision(self, call_id: str, context) -> Any:
        """The call's Decision, its refusal (an ApprovalRejected...), or None if not asked."""
        if not self._gated:
            return None
        if self._asked is None:
            self._asked = asyncio.ensure_future(self._ask(context))
        return (await asyncio.shield(self._asked)).get(call_id)

    async def _ask(self, context) -> dict[str, Any]:
        asks, ids = [], []
        for call_id, tool, arguments in self._gated:
            args = _arguments(arguments)
            if await _needs_approval(tool, context, args, call_id):
                asks.append(
                    Ask(
                        _key("approve", tool.name),
                        action=f"call {tool.name}"[:200],
                        summary=tool.description or "",
                        payload={"tool": tool.name, "args": args},
                        timeout=self._adapter.approval_timeout,
                    )
                )
                ids.append(call_id)
        if not asks:
            return {}
        return dict(zip(ids, await self._adapter.call("approvals", asks), strict=True))


async def _needs_approval(tool: FunctionTool, context, args: Any, call_id: str) -> bool:
    policy = tool.needs_approval
    if not callable(policy):
        return bool(policy)
    if not isinstance(args, dict):
        return True  # arguments the policy cannot read: a person looks, as in the SDK
    answer = policy(context, args, call_id)
    return bool(await answer if inspect.isawaitable(answer) else answer)


class DurableModel(Model):
    """The agent's model, each call a step of the run (see the module's docstring)."""

    def __init__(self, adapter: _Adapter, agent: Agent) -> None:
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


def _recorded(output: list, usage: Any, model: str, response_id, request_id) -> dict:
    """A model response as the step stores it: its output items as the API's JSON, and its
    usage in the responses API's shape, which Stepguard prices."""
    # Every count the responses API's usage requires, 0 unless the provider said otherwise:
    # a provider that omits one (cache writes, often) must not fail the run when the usage is
    # validated again for the SDK (run_streamed's final event).
    details = {"input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0}}
    details["output_tokens_details"] = {"reasoning_tokens": 0}
    for name in details:
        if (value := getattr(usage, name, None)) is not None:
            details[name] |= value.model_dump(mode="json", exclude_none=True)
    return {
        "model": model,
        "output": [_dump(item) for item in output],
        "usage": {
            "requests": getattr(usage, "requests", 1) or 1,
            **{
                k: getattr(usage, k, 0) or 0
                for k in ("input_tokens", "output_tokens", "total_tokens")
            },
            **details,
        },
        "response_id": response_id,
        "request_id": request_id,
    }


def _dump(item: Any) -> Any:
    if hasattr(item, "model_dump"):
        return item.model_dump(mode="json", by_alias=True, exclude_unset=True)
    return item


def _item(data: Any) -> Any:
    """A recorded output item as the SDK's own type again (a dict if it is none it knows)."""
    try:
        return _OUTPUT_ITEM.validate_python(data)
    except ValidationError:
        return data


def _arguments(text: str) -> Any:
    try:
        return json.loads(text or "{}")
    except ValueError:
        return text


def _jsonable(value: Any) -> Any:
    """A tool's output as JSON (pydantic models, dataclasses, the SDK's ToolOutputText...);
    what JSON cannot hold becomes its str(), which is what the SDK sends the model."""
    try:
        return to_jsonable_python(value)
    except Exception:  # pydantic raises serialization errors of its own
        return str(value)
