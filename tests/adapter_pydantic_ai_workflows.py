"""Workflows for tests/test_adapter_pydantic_ai.py: Pydantic AI agents written as its docs
write them, at module level, made durable by wrapping them in StepguardAgent inside a workflow.
They run against the scripted demo model on 127.0.0.1, which calls the tools a `SCRIPT:` line
of the instructions names, in that order (`a+b`: both in one turn)."""

import json
import os
import time
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_ai import Agent, RunContext
from pydantic_ai.capabilities import AbstractCapability

from runs import sdk
from runs.adapters.pydantic_ai import StepguardAgent
from runs.sdk import RetryPolicy, workflow
from tests import workflows


class Forecast(BaseModel):
    city: str
    temp: int
    summary: str


@dataclass
class Deps:
    """What the tools get: the workflow's context (for its idempotency key), where to write
    the effects a test counts, and a tool to hold up (to be killed inside)."""

    stepguard: Any = None
    effects: str | None = None
    slow: str | None = None


def script(*tools: str, final: dict | None = None, args: dict | None = None) -> str:
    """Instructions that make the demo model call `tools` in order, then answer (with the
    structured output `final`, if given)."""
    order = [*tools, "final_result"] if final is not None else list(tools)
    lines = ["You plan dinners.", f"SCRIPT: {', '.join(order)}"]
    for name, value in {**(args or {}), **({"final_result": final} if final else {})}.items():
        lines.append(f"ARGS {name}: {json.dumps(value)}")
    return "\n".join(lines)


def effect(deps: Deps, label: str, value: Any) -> Any:
    """A side effect: counted in this process, written to a file (for worker processes) under
    the step's idempotency key, held up or crashed where a test asks."""
    key = deps.stepguard.idempotency_key if deps.stepguard is not None else "plain"
    if deps.stepguard is not None:  # the same, with no context at hand
        assert sdk.idempotency_key() == key
    workflows.calls[label] = workflows.calls.get(label, 0) + 1
    if deps.effects:
        line = {"label": label, "key": key, "pid": os.getpid(), "at": time.time()}
        with (Path(deps.effects) / f"effects-{os.getpid()}.jsonl").open("a") as ledger:
            ledger.write(json.dumps(line) + "\n")
    if deps.slow == label:
        time.sleep(1.5)
    if label in workflows.crash_at:
        workflows.crash_at.discard(label)
        raise workflows.Crash(label)
    return value


#: What an application keeps in a context variable (a tenant, a request id): the workflow sets
#: it, and its tools still see it when they run inside their steps.
TENANT: ContextVar[str] = ContextVar("tenant", default="unknown")

#: A trip planner: a structured answer from three tools.
planner = Agent(name="planner", deps_type=Deps, output_type=Forecast)


@planner.tool
async def get_weather(ctx: RunContext[Deps], city: str) -> dict:
    """Today's weather in a city."""
    return effect(ctx.deps, "get_weather", {"city": city, "temp": 21, "sky": "clear"})


@planner.tool
async def get_time(ctx: RunContext[Deps], city: str) -> str:
    """The local time in a city."""
    return effect(ctx.deps, "get_time", f"19:30 in {city} for {TENANT.get()}")


@planner.tool
def book_table(ctx: RunContext[Deps], city: str, guests: int) -> dict:
    """Book a restaurant table (a sync tool: Pydantic AI runs it on a thread)."""
    return effect(ctx.deps, "book_table", {"booked": city, "guests": guests})


#: A shop whose charge tool Pydantic AI itself marks as needing approval.
shop = Agent(name="shop", deps_type=Deps)


@shop.tool(requires_approval=True)
async def charge(ctx: RunContext[Deps], amount: int) -> dict:
    """Charge the customer's card."""
    return effect(ctx.deps, "charge", {"charged": amount})


def demo_model(*, sdk_retries: int = 0):
    """Pydantic AI's OpenAI chat model on the demo model. Built inside the workflow: its async
    client belongs to the event loop of one execution."""
    from openai import AsyncOpenAI
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    client = AsyncOpenAI(
        base_url=os.environ["STEPGUARD_MODEL_BASE_URL"], api_key="k", max_retries=sdk_retries
    )
    return OpenAIChatModel("stepguard-demo", provider=OpenAIProvider(openai_client=client))


def plan_options(ctx, input: dict) -> dict:
    deps = Deps(ctx, input.get("effects"), input.get("slow"))
    return {
        "instructions": input["instructions"],
        "deps": deps,
        "model": demo_model(sdk_retries=input.get("sdk_retries", 0)),
        "model_settings": input.get("settings"),
    }


def result_of(result) -> dict:
    output = result.output
    return {
        "output": output.model_dump() if isinstance(output, BaseModel) else output,
        "requests": result.usage.requests,
        "tokens": [result.usage.input_tokens, result.usage.output_tokens],
    }


#: The model steps' retry policy when a test asks for retries without waiting.
NO_WAIT = RetryPolicy(max_attempts=3, initial_interval=timedelta(0))


@workflow("pa-planner")
async def pa_planner(ctx, input: dict):
    agent = StepguardAgent(
        planner,
        ctx,
        requires_approval=approval_rules(input),
        model_retry=NO_WAIT if input.get("no_wait") else None,
    )
    TENANT.set("acme")
    result = await agent.run("Plan dinner in Paris for two.", **plan_options(ctx, input))
    if "after-run" in workflows.crash_at:
        workflows.crash_at.discard("after-run")
        raise workflows.Crash("after-run")
    return result_of(result)


def approval_rules(input: dict) -> dict:
    """`{"book_table": n}`: a table for more than n guests needs a person's approval."""
    limit = input.get("approve_over")
    return {} if limit is None else {"book_table": lambda args: args["guests"] > limit}


@workflow("pa-planner-sync")
def pa_planner_sync(ctx, input: dict):
    """The same agent from a sync workflow."""
    agent = StepguardAgent(planner, ctx)
    result = agent.run_sync("Plan dinner in Paris for two.", **plan_options(ctx, input))
    if "after-run" in workflows.crash_at:
        workflows.crash_at.discard("after-run")
        raise workflows.Crash("after-run")
    return result_of(result)


#: The text pieces the streaming workflow was handed, in order, per execution.
streamed: list[list[str]] = []


@workflow("pa-stream")
async def pa_stream(ctx, input: dict):
    agent = StepguardAgent(planner, ctx)
    pieces: list[str] = []
    streamed.append(pieces)
    options = plan_options(ctx, input)
    async with agent.run_stream("Plan dinner in Paris.", output_type=str, **options) as result:
        async for piece in result.stream_text(delta=True):
            pieces.append(piece)
        output = await result.get_output()
    if "after-stream" in workflows.crash_at:
        workflows.crash_at.discard("after-stream")
        raise workflows.Crash("after-stream")
    return {"output": output, "streamed": "".join(pieces)}


@dataclass
class LastMoment(AbstractCapability[Any]):
    """Runs `workflows.hooks[<tool>]` just before that tool's call starts: what someone
    elsewhere does at that moment (revoke an approval)."""

    async def before_tool_execute(self, ctx, *, call, tool_def, args):
        if (hook := workflows.hooks.pop(call.tool_name, None)) is not None:
            hook()
        return args


@workflow("pa-shop")
async def pa_shop(ctx, input: dict):
    agent = StepguardAgent(shop, ctx)
    options = plan_options(ctx, input)
    result = await agent.run("Charge the customer.", capabilities=[LastMoment()], **options)
    return result_of(result)


@workflow("pa-run-sync-in-async")
async def pa_run_sync_in_async(ctx, input: dict):
    return StepguardAgent(planner, ctx).run_sync("Plan dinner.", **plan_options(ctx, input))


#: An agent with no name: Pydantic AI would name it after a variable on its first run.
anonymous = Agent(deps_type=Deps)


@workflow("pa-anonymous")
def pa_anonymous(ctx, input: dict):
    return result_of(StepguardAgent(anonymous, ctx).run_sync("Hello."))
