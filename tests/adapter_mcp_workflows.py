"""Workflows for tests/test_adapter_mcp.py: an agent loop whose tools come from the MCP server
of tests/mcp_server.py, against the demo model on 127.0.0.1."""

import json
import sys
from pathlib import Path

from mcp import StdioServerParameters

from runs.adapters.mcp import mcp_tools
from runs.sdk import RunContext, Tool, workflow
from tests import workflows
from tests.agent_workflows import openai_client

SERVER = str(Path(__file__).with_name("mcp_server.py"))
#: Set by a test: more arguments for the server (`--extra`: a newer server, one tool more).
server_args: list[str] = []

SYSTEM = (
    "You handle orders.\nSCRIPT: {script}\n"
    'ARGS send_note: {{"to": "ada", "text": "order A1 is late"}}\n'
    'ARGS refund: {{"order": "A1", "amount": 30}}\n'
    'ARGS lookup: {{"order": "{order}"}}'
)


def pause() -> str:
    """A local tool next to the server's: the process dies here once if a test says so."""
    if "mcp-pause" in workflows.crash_at:
        workflows.crash_at.discard("mcp-pause")
        raise workflows.Crash("mcp-pause")
    return "paused"


def server_of(input: dict):
    if "url" in input:
        return input["url"]
    return StdioServerParameters(
        command=sys.executable, args=[SERVER, input["calls"], *server_args]
    )


def conversation(input: dict) -> dict:
    system = SYSTEM.format(
        script=input.get("script", "send_note, pause, refund, lookup"),
        order=input.get("order", "missing"),
    )
    return {
        "client": openai_client(),
        "model": "gpt-4o-mini",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "Order A1 is late: tell Ada and refund it."},
        ],
    }


def approve_of(input: dict):
    if input.get("approve_over") is not None:  # a policy on the tool and its arguments
        limit = input["approve_over"]
        return lambda tool, args: tool == "refund" and args["amount"] > limit
    return set(input.get("approve", []))


@workflow("mcp-agent")
def mcp_agent(ctx: RunContext, input: dict):
    tools = mcp_tools(ctx, "shop", server_of(input), approve=approve_of(input))
    tools["pause"] = Tool(pause, "Wait a moment")
    return ctx.agent_loop(tools=tools, **conversation(input))


@workflow("mcp-agent-async")
async def mcp_agent_async(ctx, input: dict):
    tools = await mcp_tools(ctx, "shop", server_of(input), approve=approve_of(input))
    return await ctx.agent_loop(tools=tools, **conversation(input))


def server_calls(path: str) -> list[dict]:
    """What the server did: one line per call of a tool with a side effect."""
    file = Path(path)
    return [json.loads(line) for line in file.read_text().splitlines()] if file.exists() else []


@workflow("mcp-oa-agent")
async def mcp_oa_agent(ctx, input: dict):
    """The same server through the OpenAI Agents SDK (agent.mcp_servers) and its adapter."""
    from agents import Agent, Runner, function_tool
    from agents.mcp import MCPServerStdio

    from runs.adapters.openai_agents import durable
    from tests.adapter_openai_agents_workflows import model

    params = {"command": sys.executable, "args": [SERVER, input["calls"], *server_args]}
    approval = {"always": {"tool_names": ["refund"]}}
    async with MCPServerStdio(
        params, name="shop", require_approval=approval, use_structured_content=True
    ) as server:
        agent = Agent(
            name="support",
            instructions=conversation(input)["messages"][0]["content"],
            model=model("chat"),
            tools=[function_tool(pause)],
            mcp_servers=[server],
        )
        result = await Runner.run(durable(agent, ctx), "Order A1 is late: tell Ada, refund it.")
    return result.final_output
