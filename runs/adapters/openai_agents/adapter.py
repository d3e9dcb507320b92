"""`durable()`: an agent's copy whose model calls and tool calls are steps, its handoffs,
its MCP servers, and the approvals of a model turn's tool calls."""

from __future__ import annotations

import asyncio
import copy
import inspect
from collections.abc import Callable
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
    ModelProvider,
    ModelResponse,
    ShellTool,
)
from agents.mcp import MCPServer

# Private to the SDK, pinned by the `openai-agents>=0.24,<0.25` extra: the tool invocation that
# applies a tool's timeout and says whether its output is an error the SDK wrote.
from agents.tool import (
    _DEFAULT_FAILURE_HANDLED_ATTR,
    DEFAULT_APPROVAL_REJECTION_MESSAGE,
    _invoke_function_tool_with_metadata,
)
from django.db import connection
from mcp.types import CallToolResult
from mcp.types import Tool as MCPTool

from runs.adapters.openai_agents.model import DurableModel
from runs.adapters.openai_agents.records import _arguments, _jsonable, _key
from runs.engine.aio.bridge import AsyncRunContext
from runs.engine.context import RunContext
from runs.models import StepKind
from runs.sdk import ApprovalRevoked, Ask, StepguardError, StepMisuse

#: runs.adapters.mcp's `_meta` key, not imported: that module needs mcp 2, the SDK mcp 1 or 2.
IDEMPOTENCY_META_KEY = "stepguard.dev/idempotency-key"


#: Tools that act on this machine outside a function the adapter can make a step of.
LOCAL_TOOLS = (ComputerTool, CustomTool, ShellTool, ApplyPatchTool, LocalShellTool)


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
