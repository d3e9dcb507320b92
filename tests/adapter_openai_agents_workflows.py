"""Workflows for tests/test_adapter_openai_agents.py: agents written with the OpenAI Agents SDK
as its own guides write them (`build`), made durable by wrapping the agent where it is run, and
pointed at the scripted demo model on 127.0.0.1."""

import json
import os
import time
from pathlib import Path

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

from runs import sdk
from runs.adapters.openai_agents import durable
from runs.sdk import RunContext, workflow
from tests import workflows

# The SDK exports traces to OpenAI's servers by default: never from the tests or their workers.
set_tracing_disabled(True)

#: Set by a test: called inside the tool of that name, as if from elsewhere (a halt).
hooks: dict = {}
#: The text deltas the streamed workflow was handed, in order (in-process tests).
deltas: list[str] = []

SCRIPT_ARGS = {"lookup": {"city": "Lisbon"}, "weather": {"city": "Lisbon"}}


def model(protocol: str):
    """The demo model through the SDK's own model classes (a client per execution: an async
    client's connections belong to the event loop that opened them)."""
    client = AsyncOpenAI(
        base_url=os.environ["STEPGUARD_MODEL_BASE_URL"], api_key="k", max_retries=0
    )
    if protocol == "chat":
        return OpenAIChatCompletionsModel("stepguard-demo", client)
    return OpenAIResponsesModel("stepguard-demo", client)


def build(input: dict, ctx=None, name: str = "planner") -> Agent:
    """The agent, with no Stepguard in it: each tool call appends a line to a file in
    `input["effects"]` (with the step's idempotency key when run durably)."""
    effects = Path(input["effects"])

    def effect(tool: str, **args) -> None:
        key = ctx.idempotency_key if ctx is not None else None
        if ctx is not None:  # the same, with no context at hand
            assert sdk.idempotency_key() == key
        line = {"tool": tool, "args": args, "key": key, "pid": os.getpid()}
        with (effects / f"effects-{os.getpid()}.jsonl").open("a") as out:
            out.write(json.dumps(line) + "\n")
        if tool in hooks:
            hooks.pop(tool)()
        if tool in workflows.crash_at:
            workflows.crash_at.discard(tool)
            raise workflows.Crash(tool)
        time.sleep(input.get("slow", {}).get(tool, 0))
        if tool in input.get("fail", []):
            raise RuntimeError(f"{tool} is down")

    @function_tool
    def lookup(city: str) -> dict:
        """Find hotels in a city."""
        effect("lookup", city=city)
        return {"city": city, "hotels": 3}

    @function_tool
    async def weather(city: str) -> str:
        """The forecast for a city."""
        effect("weather", city=city)
        return f"sunny in {city}"

    approval = input.get("approval", True)

    @function_tool(needs_approval=over_two_nights if approval == "over-2-nights" else approval)
    def book(city: str, nights: int) -> dict:
        """Book a hotel and charge the card."""
        effect("book", city=city, nights=nights)
        return {"booked": city, "nights": nights}

    arguments = SCRIPT_ARGS | {"book": {"city": "Lisbon", "nights": input.get("nights", 3)}}
    script = "\n".join(
        [f"SCRIPT: {input['script']}"]
        + [f"ARGS {tool}: {json.dumps(args)}" for tool, args in arguments.items()]
    )
    return Agent(
        name=name,
        instructions=script,
        model=model(input.get("protocol", "responses")),
        model_settings=ModelSettings(max_tokens=input.get("max_tokens")),
        tools=[lookup, weather, book],
    )


async def over_two_nights(context, args: dict, call_id: str) -> bool:
    return args["nights"] > 2


QUESTION = "Plan two nights in Lisbon"


@workflow("oa-agent")
async def oa_agent(ctx, input: dict):
    agent = durable(build(input, ctx), ctx, approval_timeout=input.get("approval_timeout"))
    result = await Runner.run(agent, QUESTION)
    return result.final_output


@workflow("oa-run-config-model")
async def oa_run_config_model(ctx, input: dict):
    """A RunConfig's model overrides every agent's, the durable one's too."""
    from agents import RunConfig

    config = RunConfig(model=model("responses"))
    result = await Runner.run(durable(build(input, ctx), ctx), QUESTION, run_config=config)
    return result.final_output


@workflow("oa-agent-sync")
def oa_agent_sync(ctx: RunContext, input: dict):
    result = Runner.run_sync(durable(build(input, ctx), ctx), QUESTION)
    return result.final_output


@workflow("oa-agent-streamed")
async def oa_agent_streamed(ctx, input: dict):
    result = Runner.run_streamed(durable(build(input, ctx), ctx), QUESTION)
    async for event in result.stream_events():
        if event.type == "raw_response_event" and event.data.type == "response.output_text.delta":
            deltas.append(event.data.delta)
    return result.final_output


#: What the specialist's handoff callback was handed, in order (in-process tests).
handed_off: list[str] = []


def triage(input: dict, ctx=None) -> Agent:
    """A triage agent that hands off to a specialist with tools: the agent itself, or the SDK's
    `handoff(...)` of it with a callback."""
    from agents import handoff

    specialist = build({**input, "script": "lookup"}, ctx, name="specialist")
    if input.get("handoff_object"):
        specialist = handoff(specialist, on_handoff=lambda context: handed_off.append("now"))
    return Agent(
        name="triage",
        instructions="SCRIPT: transfer_to_specialist",
        model=model(input.get("protocol", "responses")),
        handoffs=[specialist],
    )


@workflow("oa-handoff")
async def oa_handoff(ctx, input: dict):
    result = await Runner.run(durable(triage(input, ctx), ctx), QUESTION)
    return {"output": result.final_output, "last_agent": result.last_agent.name}


@workflow("oa-refused")
async def oa_refused(ctx, input: dict):
    """What durable() refuses, each refusal's message."""
    from agents import LocalShellTool

    agent = build(input, ctx)
    cases = {
        "local": agent.clone(tools=[LocalShellTool(executor=lambda request: "")]),
        "agent-tool": agent.clone(tools=[build(input, ctx, name="sub").as_tool("sub", "a sub")]),
    }
    refused = {}
    for case, bad in cases.items():
        try:
            durable(bad, ctx)
        except Exception as exc:
            refused[case] = f"{type(exc).__name__}: {exc}"
    # A sub-agent that is durable itself may be a tool: its calls are steps of their own.
    durable(agent.clone(tools=[durable(build(input, ctx), ctx).as_tool("sub", "a sub")]), ctx)
    return refused
