"""A durable agent loop, one step per call: `think-<i>` for each model turn and
`tool-<name>-<i>` for each tool call, so a crash resumes mid-conversation without paying for
the turns already taken or repeating a tool's side effect."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from runs.errors import (
    ApprovalExpired,
    ApprovalRejected,
    ApprovalRevoked,
    StepFailed,
    StepguardError,
)


class AgentLoopExhausted(StepguardError):
    code = "agent_loop_exhausted"
    retryable = False


@dataclass
class Tool:
    """A function the model may call, with its JSON-schema parameters and approval policy.

    `requires_approval`: True, False, or a predicate on the call's arguments. A function that
    takes `idempotency_key` receives the step's, stable across retries and resumes.
    """

    fn: Callable
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})
    requires_approval: bool | Callable[[dict], bool] = False

    def spec(self, name: str) -> dict:
        return {
            "type": "function",
            "function": {
                "name": name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


def agent_loop(
    ctx,
    *,
    client: Any,
    model: str,
    messages: list[dict],
    tools: dict[str, Tool] | None = None,
    max_turns: int = 12,
    max_tokens: int = 512,
) -> dict:
    """Run the model (chat completions protocol) and its tool calls until it answers.

    Each turn is an `llm` step (its estimate reserved against the budgets first, so a spent
    budget pauses the run before the turn); each tool call a `tool` step, waiting for
    approval where its policy says so. A refused or failed tool call is reported back to the
    model as the tool's result. Returns {"answer", "turns", "messages"}; raises
    AgentLoopExhausted after `max_turns` turns without an answer.
    """
    tools = tools or {}
    messages = list(messages)
    specs = [tool.spec(name) for name, tool in tools.items()]
    for turn in range(max_turns):
        request = {"model": model, "messages": messages, "max_tokens": max_tokens}
        if specs:
            request["tools"] = specs
        response = ctx.llm(f"think-{turn}", client.chat.completions.create, **request)
        message = response["choices"][0]["message"]
        calls = message.get("tool_calls") or []
        messages.append(
            {"role": "assistant", "content": message.get("content")}
            | ({"tool_calls": calls} if calls else {})
        )
        if not calls:
            return {"answer": message.get("content"), "turns": turn + 1, "messages": messages}
        for call in calls:
            name = call["function"]["name"]
            result = _call_tool(ctx, tools, name, call["function"].get("arguments") or "{}", turn)
            messages.append(
                {"role": "tool", "tool_call_id": call["id"], "content": json.dumps(result)}
            )
    raise AgentLoopExhausted(f"the model gave no final answer in {max_turns} turns")


def _call_tool(ctx, tools: dict[str, Tool], name: str, arguments: str, turn: int) -> Any:
    tool = tools.get(name)
    if tool is None:
        return {"error": f"there is no tool named {name!r}"}
    try:
        args = json.loads(arguments)
    except ValueError:
        return {"error": f"the arguments for {name} are not JSON"}
    if not isinstance(args, dict):
        return {"error": f"the arguments for {name} must be a JSON object, not {arguments[:200]}"}
    # The model wrote these arguments: a predicate that cannot judge them (a missing field) is
    # the model's mistake to correct, not a reason to fail the run.
    needed = tool.requires_approval
    if callable(needed):
        try:
            needed = bool(needed(args))
        except Exception as exc:
            return {"error": f"the arguments for {name} were not accepted: {_describe(exc)}"}
    try:
        return ctx.tool(f"tool-{name}-{turn}", tool.fn, args, requires_approval=needed)
    except (ApprovalRejected, ApprovalExpired, ApprovalRevoked) as refused:
        return {"refused": str(refused)}
    except StepFailed as failed:
        return {"error": failed.error.get("message", str(failed))}


def _describe(exc: Exception) -> str:
    if isinstance(exc, KeyError):
        return f"missing {exc}"
    return f"{type(exc).__name__}: {exc}"
