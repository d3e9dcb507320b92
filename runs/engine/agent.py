"""A durable agent loop, one step per call: `think-<i>` for each model turn and
`tool-<name>-<i>` for each tool call, so a crash resumes mid-conversation without paying for
the turns already taken or repeating a tool's side effect.

The loop speaks the three protocols of the official clients: OpenAI's chat completions and
responses API, and Anthropic's messages. Each `Protocol` says how to offer tools, where a
turn's tool calls and answer are in the response, and how the conversation goes on.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from runs.engine import step_deadline
from runs.engine.llm import MAX_TOKENS_FIELDS
from runs.engine.retry import RetryPolicy
from runs.engine.waits import Ask
from runs.errors import (
    ApprovalExpired,
    ApprovalRejected,
    ApprovalRevoked,
    StepFailed,
    StepguardError,
    StepMisuse,
    StepTimeout,
)


class AgentLoopExhausted(StepguardError):
    code = "agent_loop_exhausted"
    retryable = False


class ToolTimeout(StepTimeout):
    """A tool ran past its timeout: retried like any failure (with the same idempotency key:
    the late call may still finish, and the service recognises the retry by it)."""

    code = "tool_timeout"
    retryable = True


@dataclass
class Tool:
    """A function the model may call, with its JSON-schema parameters and policies.

    `requires_approval`: True, False, or a predicate on the call's arguments. A function that
    takes `idempotency_key` receives the step's, stable across retries and resumes. The model's
    arguments are checked against `parameters` before anything runs. `retry` is the tool step's
    RetryPolicy; `timeout` (seconds) bounds each attempt. `on_refusal`: "tell" reports a
    rejected, expired or revoked approval to the model as the tool's result; "raise" ends the
    loop with that error (the run fails with it unless the workflow catches it), for a tool
    whose refusal is the run's outcome (a booking that was the point of the run).
    """

    fn: Callable
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})
    requires_approval: bool | Callable[[dict], bool] = False
    retry: RetryPolicy | None = None
    timeout: float | None = None
    on_refusal: str = "tell"

    def __post_init__(self) -> None:
        if self.on_refusal not in ("tell", "raise"):
            raise StepMisuse(
                f"tool {self.name!r}: on_refusal must be 'tell' or 'raise', not {self.on_refusal!r}"
            )
        try:
            jsonschema.validators.validator_for(self.parameters).check_schema(self.parameters)
        except jsonschema.SchemaError as exc:
            raise StepMisuse(f"tool {self.name!r} has invalid parameters: {exc.message}") from exc
        if self.timeout is not None and self.timeout <= 0:
            raise StepMisuse(f"tool {self.name!r}: a timeout must be positive")

    @property
    def name(self) -> str:
        return getattr(self.fn, "__name__", "tool")

    def spec(self, name: str) -> dict:
        """The chat completions shape; the other protocols reshape it."""
        return {
            "type": "function",
            "function": {
                "name": name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    def problem(self, args: Any) -> str | None:
        """What is wrong with the model's arguments, in words the model can act on."""
        if not isinstance(args, dict):
            return f"must be a JSON object, not {json.dumps(args)[:200]}"
        error = jsonschema.exceptions.best_match(
            jsonschema.validators.validator_for(self.parameters)(self.parameters).iter_errors(args)
        )
        if error is None:
            return None
        where = "/".join(str(p) for p in error.absolute_path)
        return f"{where + ': ' if where else ''}{error.message}"

    def callable(self) -> Callable:
        """The function with its timeout, if it has one."""
        if self.timeout is None:
            return self.fn
        return with_timeout(self.fn, self.timeout)


def with_timeout(fn: Callable, seconds: float) -> Callable:
    """`fn` bounded to `seconds` an attempt: an async function is cancelled; a sync one is left
    to finish on a daemon thread of its own while the step fails with ToolTimeout (Python
    cannot stop a thread; runs/engine/step_deadline.py), so give such a tool an idempotency
    key."""

    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def bounded_async(*args, **kwargs):
            try:
                return await asyncio.wait_for(fn(*args, **kwargs), seconds)
            except TimeoutError:
                raise ToolTimeout(f"{fn.__name__} took more than {seconds:g} s") from None

        return bounded_async

    @functools.wraps(fn)
    def bounded(*args, **kwargs):
        deadline = time.monotonic() + seconds
        try:
            return step_deadline.call_by(fn, args, kwargs, deadline, fn.__name__, seconds)
        except ToolTimeout:
            raise
        except StepTimeout:
            raise ToolTimeout(f"{fn.__name__} took more than {seconds:g} s") from None

    return bounded


@dataclass(frozen=True)
class Call:
    id: str
    name: str
    arguments: Any  # what the model wrote: a JSON string, or (Anthropic) an object


class Protocol:
    """Chat completions: tools as functions, calls in `message.tool_calls`, results as `tool`
    messages."""

    max_tokens_field = "max_tokens"

    def method(self, client: Any) -> Callable:
        return client.chat.completions.create

    def request(self, conversation: list, specs: list[dict]) -> dict:
        return {"messages": conversation} | ({"tools": specs} if specs else {})

    def tools(self, specs: list[dict]) -> list[dict]:
        return specs

    def read(self, response: dict) -> tuple[list[Call], str | None, list]:
        """The turn's tool calls, its text, and what goes back into the conversation."""
        message = response["choices"][0]["message"]
        calls = [
            Call(c["id"], c["function"]["name"], c["function"].get("arguments") or "{}")
            for c in message.get("tool_calls") or []
        ]
        said = {"role": "assistant", "content": message.get("content")}
        if message.get("tool_calls"):
            said["tool_calls"] = message["tool_calls"]
        return calls, message.get("content"), [said]

    def results(self, answered: list[tuple[Call, Any]]) -> list:
        return [
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)}
            for call, result in answered
        ]


class Responses(Protocol):
    """The responses API: `function_call` output items, `function_call_output` input items."""

    max_tokens_field = "max_output_tokens"

    def method(self, client: Any) -> Callable:
        return client.responses.create

    def request(self, conversation: list, specs: list[dict]) -> dict:
        return {"input": conversation} | ({"tools": specs} if specs else {})

    def tools(self, specs: list[dict]) -> list[dict]:
        return [{"type": "function", **spec["function"]} for spec in specs]

    def read(self, response: dict) -> tuple[list[Call], str | None, list]:
        output = response.get("output") or []
        calls = [
            Call(item["call_id"], item["name"], item.get("arguments") or "{}")
            for item in output
            if item.get("type") == "function_call"
        ]
        text = "".join(
            part.get("text", "")
            for item in output
            if item.get("type") == "message"
            for part in item.get("content") or []
            if part.get("type") == "output_text"
        )
        return calls, text or None, list(output)

    def results(self, answered: list[tuple[Call, Any]]) -> list:
        return [
            {"type": "function_call_output", "call_id": call.id, "output": json.dumps(result)}
            for call, result in answered
        ]


class Messages(Protocol):
    """Anthropic's messages: `tool_use` content blocks, `tool_result` blocks in a user turn."""

    max_tokens_field = "max_tokens"

    def method(self, client: Any) -> Callable:
        return client.messages.create

    def request(self, conversation: list, specs: list[dict]) -> dict:
        return {"messages": conversation} | ({"tools": specs} if specs else {})

    def tools(self, specs: list[dict]) -> list[dict]:
        return [
            {
                "name": spec["function"]["name"],
                "description": spec["function"]["description"],
                "input_schema": spec["function"]["parameters"],
            }
            for spec in specs
        ]

    def read(self, response: dict) -> tuple[list[Call], str | None, list]:
        content = response.get("content") or []
        calls = [
            Call(block["id"], block["name"], block.get("input", {}))
            for block in content
            if block.get("type") == "tool_use"
        ]
        text = "".join(b.get("text", "") for b in content if b.get("type") == "text")
        return calls, text or None, [{"role": "assistant", "content": content}]

    def results(self, answered: list[tuple[Call, Any]]) -> list:
        blocks = [
            {"type": "tool_result", "tool_use_id": call.id, "content": json.dumps(result)}
            for call, result in answered
        ]
        return [{"role": "user", "content": blocks}] if blocks else []


PROTOCOLS = {"chat": Protocol(), "responses": Responses(), "anthropic": Messages()}


def protocol_for(client: Any, protocol: str | None) -> Protocol:
    if protocol is None:
        protocol = "anthropic" if type(client).__module__.startswith("anthropic") else "chat"
    if protocol not in PROTOCOLS:
        raise StepMisuse(f"protocol must be one of {sorted(PROTOCOLS)}, not {protocol!r}")
    return PROTOCOLS[protocol]


def agent_loop(
    ctx,
    *,
    client: Any,
    model: str,
    messages: list | None = None,
    tools: dict[str, Tool] | None = None,
    max_turns: int = 12,
    max_tokens: int | None = 512,
    protocol: str | None = None,
    input: list | None = None,
    **options: Any,
) -> dict:
    """Run the model and its tool calls until it answers.

    `protocol` is "chat" (the default for an OpenAI client), "responses" or "anthropic" (the
    default for an Anthropic client). The conversation is `messages` (chat, anthropic) or
    `input` (responses). Other keyword options go into every request as they are
    (`temperature`, `tool_choice`, `parallel_tool_calls`, `system`, `instructions`,
    `max_completion_tokens`...).

    Each turn is an `llm` step (its estimate reserved against the budgets first, so a spent
    budget pauses the run before the turn); each tool call a `tool` step, waiting for
    approval where its policy says so. A refused or failed tool call, and arguments that do
    not match the tool's parameters, are reported back to the model as the tool's result.
    Returns {"answer", "turns", "messages"}; raises AgentLoopExhausted after `max_turns`
    turns without an answer. `stream=True` with `on_delta=` streams each turn as `ctx.llm`
    does (text handed out as it arrives, the final response recorded).
    """
    speaks = protocol_for(client, protocol)
    tools = tools or {}
    if input is not None and messages is not None:
        raise StepMisuse("give the conversation once: messages= or input=, not both")
    # Either spelling for any protocol: the responses API takes chat messages as its input
    # (messages= with protocol="responses" was dropped, and an empty request paid for).
    conversation = list(input if input is not None else messages or [])
    if not conversation:
        raise StepMisuse(
            "agent_loop needs a conversation: messages=[...] (or input=[...] for responses)"
        )
    specs = speaks.tools([tool.spec(name) for name, tool in tools.items()])
    limit = {}
    if max_tokens is not None and not any(k in options for k in MAX_TOKENS_FIELDS):
        limit = {speaks.max_tokens_field: max_tokens}
    for turn in range(max_turns):
        request = {"model": model, **speaks.request(conversation, specs), **limit, **options}
        response = ctx.llm(f"think-{turn}", speaks.method(client), **request)
        calls, text, said = speaks.read(response)
        conversation.extend(said)
        if not calls:
            return {"answer": text, "turns": turn + 1, "messages": conversation}
        conversation.extend(speaks.results(_tool_turn(ctx, tools, calls, turn)))
    raise AgentLoopExhausted(f"the model gave no final answer in {max_turns} turns")


@dataclass
class _Pending:
    """A tool call of this turn that passed its checks: its step key and arguments, whether
    a person must approve it, and then their decision."""

    call: Call
    tool: Tool
    key: str
    args: dict
    needed: bool
    decision: Any = None


def _tool_turn(ctx, tools: dict[str, Tool], calls: list[Call], turn: int) -> list[tuple]:
    """Answer a turn's tool calls: arguments checked first, the approvals they need asked
    together (one wait for the approvers, not one per call), then the tools run, concurrently
    in an async workflow. Every answer goes back to the model, errors included."""
    answers: dict[int, Any] = {}
    ready: dict[int, _Pending] = {}
    for i, call in enumerate(calls):
        checked = _check(tools, call, turn)
        if isinstance(checked, _Pending):
            ready[i] = checked
        else:
            answers[i] = checked
    asking = [p for p in ready.values() if p.needed]
    if asking:
        asks = [
            Ask(
                f"{p.key}.approval",
                action=f"call {p.call.name}"[:200],
                payload={"tool": p.call.name, "args": p.args},
            )
            for p in asking
        ]
        for pending, decision in zip(asking, ctx.waits.approvals(asks), strict=True):
            pending.decision = decision
    for pending in ready.values():
        if isinstance(pending.decision, StepguardError) and pending.tool.on_refusal == "raise":
            raise pending.decision  # before any tool of the turn runs: the run ends here
    jobs, order = [], []
    for i, pending in ready.items():
        if isinstance(pending.decision, StepguardError):  # rejected, revoked, expired
            answers[i] = {"refused": str(pending.decision)}
            continue
        jobs.append(functools.partial(_run_tool, ctx, pending))
        order.append(i)
    for i, answer in zip(order, ctx.concurrently(jobs), strict=True):
        answers[i] = answer
    return [(call, answers[i]) for i, call in enumerate(calls)]


def _check(tools: dict[str, Tool], call: Call, turn: int) -> _Pending | dict:
    tool = tools.get(call.name)
    if tool is None:
        return {"error": f"there is no tool named {call.name!r}"}
    args = call.arguments
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return {"error": f"the arguments for {call.name} are not JSON"}
    if (problem := tool.problem(args)) is not None:
        return {"error": f"the arguments for {call.name} were not accepted: {problem}"}
    # The model wrote these arguments: a predicate that cannot judge them (a missing field) is
    # the model's mistake to correct, not a reason to fail the run.
    needed = tool.requires_approval
    if callable(needed):
        try:
            needed = bool(needed(args))
        except Exception as exc:
            return {"error": f"the arguments for {call.name} were not accepted: {_describe(exc)}"}
    return _Pending(call, tool, f"tool-{call.name}-{turn}", args, bool(needed))


def _run_tool(ctx, pending: _Pending) -> Any:
    try:
        return ctx.tool(
            pending.key, pending.tool.callable(), pending.args, retry=pending.tool.retry,
            requires_approval=pending.needed, approved=pending.decision,
        )  # fmt: skip
    except (ApprovalRejected, ApprovalExpired, ApprovalRevoked) as refused:
        if pending.tool.on_refusal == "raise":
            raise
        return {"refused": str(refused)}
    except StepFailed as failed:
        return {"error": failed.error.get("message", str(failed))}


def _describe(exc: Exception) -> str:
    if isinstance(exc, KeyError):
        return f"missing {exc}"
    return f"{type(exc).__name__}: {exc}"
