"""MCP tools as durable steps: an MCP server's tools offered to `ctx.agent_loop`.

`mcp_tools(ctx, "crm", server)` lists the server's tools in a step (`mcp:crm:tools`) and returns
them as the `dict[str, Tool]` that `ctx.agent_loop(tools=...)` takes. The list is recorded: a
resumed or replayed run offers the model the tools it was offered the first time, whatever the
server lists now, so its conversation (and its step keys) stay the same. Each call the model asks
for is the loop's `tool-<name>-<turn>` step, so a finished call is never sent again after a
crash; the step's idempotency key goes to the server in the request's `_meta`
(`stepguard.dev/idempotency-key`) so a server can recognise a call re-sent after a crash *during*
it. A tool the server answers with `isError` fails its step without a retry (the server has
answered; sending it again would repeat whatever it did) and the model is told the error, as for
any tool.

The MCP client SDK is async: each listing and each call opens a session of its own (`mcp.Client`,
a subprocess for a stdio server, an HTTP session for a URL) on the worker's event loop and closes
it when the step ends. That costs a process start (stdio) or a handshake (HTTP) per call, and buys
calls that depend on nothing held across steps, executions or worker processes: a resumed run
simply opens a new session. It works the same in a sync and an `async def` workflow (there,
`await mcp_tools(...)`); a turn's parallel calls run concurrently in an async workflow.

Needs the `mcp` package (`stepguard[mcp]`; the OpenAI Agents SDK depends on it too).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, cast, overload

from mcp import Client, StdioServerParameters
from mcp_types import RequestParamsMeta

from runs.engine.agent import Tool
from runs.engine.aio.bridge import AsyncRunContext
from runs.engine.context import RunContext
from runs.engine.retry import RetryPolicy
from runs.sdk import StepguardError, StepMisuse

#: The `_meta` key of a tool call's request holding its step's idempotency key.
IDEMPOTENCY_META_KEY = "stepguard.dev/idempotency-key"

Server = StdioServerParameters | str
Approve = Iterable[str] | Callable[[str, dict], bool] | None


class MCPToolError(StepguardError):
    """The server answered the call with an error (`isError`): the model is told, the call is
    not sent again."""

    code = "mcp_tool_error"
    retryable = False


@overload
def mcp_tools(
    ctx: RunContext, name: str, server: Server, *, approve: Approve = None,
    prefix: str = "", retry: RetryPolicy | None = None, timeout: float | None = None,
) -> dict[str, Tool]: ...  # fmt: skip


@overload
def mcp_tools(
    ctx: AsyncRunContext, name: str, server: Server, *, approve: Approve = None,
    prefix: str = "", retry: RetryPolicy | None = None, timeout: float | None = None,
) -> Coroutine[Any, Any, dict[str, Tool]]: ...  # fmt: skip


def mcp_tools(
    ctx: RunContext | AsyncRunContext,
    name: str,
    server: Server,
    *,
    approve: Approve = None,
    prefix: str = "",
    retry: RetryPolicy | None = None,
    timeout: float | None = None,
) -> dict[str, Tool] | Coroutine[Any, Any, dict[str, Tool]]:
    """The tools of the MCP `server` (a `StdioServerParameters`, or the URL of a streamable
    HTTP server), listed once per run in the step `mcp:<name>:tools`.

    `name` names the server in that step's key: keep it stable, as a step key. `approve` says
    which calls wait for a person in the approvals inbox: a set of tool names, or a function
    of (tool name, arguments) returning True for the calls that need approval. `prefix` goes
    before each tool's name as the model sees it (two servers with tools of the same name);
    the server is called with its own name. `retry` and `timeout` apply to every call's step,
    as `Tool`'s do. In an `async def` workflow, await it.
    """
    if not name or not isinstance(name, str):
        raise StepMisuse("mcp_tools needs a name for the server: it is part of a step key")
    if not isinstance(server, StdioServerParameters | str):
        raise StepMisuse(
            "an MCP server is a StdioServerParameters or the URL of a streamable HTTP server, "
            f"not {type(server).__name__}"
        )
    if approve is not None and not callable(approve):
        approve = frozenset(approve)
    key = f"mcp:{name}:tools"
    build = functools.partial(
        _tools, server, approve=approve, prefix=prefix, retry=retry, timeout=timeout
    )

    async def list_tools() -> list[dict]:
        return await _list_tools(server)

    if isinstance(ctx, AsyncRunContext):
        bridge = ctx

        async def listed() -> dict[str, Tool]:
            return build(await bridge.step(key, list_tools))

        return listed()
    return build(ctx.step(key, list_tools))


async def _list_tools(server: Server) -> list[dict]:
    """Every tool the server lists (all pages), as JSON for the step's record."""
    tools: list[dict] = []
    async with _client(server) as client:
        cursor = None
        while True:
            page = await client.list_tools(cursor=cursor)
            tools.extend(
                {
                    "name": tool.name,
                    "description": tool.description or tool.title or "",
                    "input_schema": tool.input_schema,
                }
                for tool in page.tools
            )
            cursor = page.next_cursor
            if cursor is None:
                return tools


def _tools(
    server: Server,
    listed: list[dict],
    *,
    approve: frozenset[str] | Callable[[str, dict], bool] | None,
    prefix: str,
    retry: RetryPolicy | None,
    timeout: float | None,
) -> dict[str, Tool]:
    tools = {}
    for spec in listed:
        tool_name = spec["name"]
        needed: bool | Callable[[dict], bool]
        if approve is None:
            needed = False
        elif callable(approve):
            needed = functools.partial(approve, tool_name)
        else:
            needed = tool_name in approve
        tools[prefix + tool_name] = Tool(
            _caller(server, tool_name, prefix + tool_name),
            spec["description"],
            spec["input_schema"] or {"type": "object", "properties": {}},
            requires_approval=needed,
            retry=retry,
            timeout=timeout,
        )
    return tools


def _caller(server: Server, tool_name: str, shown_as: str) -> Callable:
    """The function of one tool's step: one call on a session of its own."""

    async def call(idempotency_key: str, **arguments: Any) -> Any:
        async with _client(server) as client:
            meta = cast(RequestParamsMeta, {IDEMPOTENCY_META_KEY: idempotency_key})
            result = await client.call_tool(tool_name, arguments, meta=meta)
        if result.is_error:
            raise MCPToolError(_text(result.content) or f"{tool_name} failed")
        if result.structured_content is not None:
            return result.structured_content
        if all(block.type == "text" for block in result.content):
            return _text(result.content)
        return [block.model_dump(mode="json", by_alias=True) for block in result.content]

    call.__name__ = call.__qualname__ = shown_as  # the step's span, the approval's action
    return call


def _client(server: Server) -> Client:
    # No response cache: a listing is recorded in its step, and a cached answer would hide
    # from the record what the server said at the time.
    return Client(server, cache=None)


def _text(content: list) -> str:
    return "\n".join(block.text for block in content if block.type == "text")
