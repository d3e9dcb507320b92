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

from runs.adapters.openai_agents.adapter import durable

__all__ = ["durable"]
