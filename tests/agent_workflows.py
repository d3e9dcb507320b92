"""Agent workflows for tests/test_agents.py, written the way the providers' own guides write
them, each against the demo model on 127.0.0.1 with the official client libraries."""

import json
import os
from datetime import timedelta

from runs.sdk import RetryPolicy, RunContext, Tool, workflow

#: Set by a test: the request options of the workflow's next model call.
options: dict = {}


def base_url() -> str:
    return os.environ["STEPGUARD_MODEL_BASE_URL"]


def openai_client(*, asynchronous: bool = False, **options):
    from openai import AsyncOpenAI, OpenAI

    options = {"max_retries": 0} | options
    return (AsyncOpenAI if asynchronous else OpenAI)(base_url=base_url(), api_key="k", **options)


def anthropic_client(*, asynchronous: bool = False):
    from anthropic import Anthropic, AsyncAnthropic

    return (AsyncAnthropic if asynchronous else Anthropic)(
        base_url=base_url().removesuffix("/v1"), api_key="k", max_retries=0
    )


#: The text deltas the streaming workflows were handed, in order.
deltas: list[str] = []


def stream_request(protocol: str, asynchronous: bool, helper: bool):
    """The call and request of a streamed model call of `protocol` (its `.stream()` helper or
    `create(stream=True)`), on a sync or an async client."""
    if protocol == "anthropic":
        resource = anthropic_client(asynchronous=asynchronous).messages
        request = {"model": "claude-3-5-haiku-20241022", "max_tokens": 64}
        request["messages"] = [{"role": "user", "content": "stream about durable agents"}]
    elif protocol == "responses":
        resource = openai_client(asynchronous=asynchronous).responses
        request = {"model": "gpt-4.1-mini", "input": "stream about durable agents"}
    else:
        resource = openai_client(asynchronous=asynchronous).chat.completions
        request = {"model": "gpt-4o-mini", "max_tokens": 50}
        request["messages"] = [{"role": "user", "content": "stream about durable agents"}]
    if helper:
        return resource.stream, request
    return resource.create, request | {"stream": True}


@workflow("llm-stream")
def llm_stream(ctx: RunContext, input: dict):
    call, request = stream_request(input["protocol"], input["async_client"], input["helper"])
    response = ctx.llm("ask", call, on_delta=deltas.append, **request)
    from tests import workflows

    if "after-stream" in workflows.crash_at:
        workflows.crash_at.discard("after-stream")
        raise workflows.Crash("after-stream")
    return response


@workflow("llm-stream-logged")
def llm_stream_logged(ctx: RunContext, input: dict):
    """Streams like "llm-stream", in a worker process: each piece `on_delta` gets is appended
    to the file `input["log"]` with the position it came with."""
    call, request = stream_request(input["protocol"], False, False)

    def log(text: str) -> None:
        where = {k: getattr(text, k, None) for k in ("attempt", "offset", "restart", "kind")}
        with open(input["log"], "a") as out:
            out.write(json.dumps({"text": str(text), **where}) + "\n")

    return ctx.llm("ask", call, on_delta=log, **request)


@workflow("llm-stream-async")
async def llm_stream_async(ctx, input: dict):
    call, request = stream_request(input["protocol"], True, input["helper"])
    return await ctx.llm("ask", call, on_delta=deltas.append, **request)


@workflow("sync-with-async-client")
def sync_with_async_client(ctx: RunContext, input: dict):
    """A sync workflow with AsyncOpenAI: every call on the same pooled connection."""
    client = openai_client(asynchronous=True)
    answers = []
    for turn in range(input["turns"]):
        response = ctx.llm(
            f"ask-{turn}",
            client.chat.completions.create,
            model="gpt-4o-mini",
            messages=[{"role": "user", "content": f"question {turn}"}],
            max_tokens=20,
        )
        answers.append(response["choices"][0]["message"]["content"])
    return answers


@workflow("llm-options")
def llm_options(ctx: RunContext, input: dict):
    """One model call with the options a test put in `options` (protocol, request, retry)."""
    protocol = options.get("protocol", "chat")
    retry = options.get("retry", RetryPolicy(max_attempts=3, initial_interval=timedelta(0)))
    request = options.get("request", {})
    if protocol == "plain":  # a function of one's own, not a client's method
        call = lambda **request: {"choices": []}  # noqa: E731
    elif protocol == "anthropic":
        client = anthropic_client()
        call = getattr(client.messages, options.get("method", "create"))
        request = {"model": "claude-3-5-haiku-20241022", "max_tokens": 64} | request
    elif protocol == "responses":
        call = openai_client().responses.create
        request = {"model": "gpt-4.1-mini"} | request
    else:
        client = openai_client(**options.get("client", {}))
        call = getattr(client.chat.completions, options.get("method", "create"))
        defaults = {} if options.get("no_max_tokens") else {"max_tokens": 50}
        request = {"model": "gpt-4o-mini"} | defaults | request
    response = ctx.llm("ask", call, retry=retry, **request)
    options["returned"] = type(response).__name__
    return response if isinstance(response, dict) else response.model_dump(mode="json")


def book(city: str, amount: int) -> dict:
    return {"booked": city, "amount": amount}


@workflow("odd-tool-calls")
def odd_tool_calls(ctx: RunContext, input: dict):
    """The model's tool arguments are whatever the script says: a list, or no `amount`."""
    system = f"SCRIPT: book\nARGS book: {input['args']}"
    return ctx.agent_loop(
        client=openai_client(),
        model="gpt-4o-mini",
        messages=[{"role": "system", "content": system}, {"role": "user", "content": "go"}],
        tools={"book": Tool(book, requires_approval=lambda args: args["amount"] > 100)},
        max_turns=3,
    )


@workflow("sdk-objects-in-messages")
def sdk_objects_in_messages(ctx: RunContext, input):
    """Both guides' pattern: the SDK's own response objects go back into `messages`."""
    from anthropic.types import Message
    from openai.types.chat import ChatCompletion

    client, claude = openai_client(), anthropic_client()
    chat = [{"role": "user", "content": "first"}]
    first = ctx.llm("chat-0", client.chat.completions.create, model="gpt-4o-mini", messages=chat)
    chat.append(ChatCompletion.model_validate(first).choices[0].message)  # OpenAI's guide
    chat.append({"role": "user", "content": "second"})
    ctx.llm("chat-1", client.chat.completions.create, model="gpt-4o-mini", messages=chat)

    turns = [{"role": "user", "content": "a"}]
    request = {"model": "claude-3-5-haiku-20241022", "max_tokens": 64}
    reply = ctx.llm("claude-0", claude.messages.create, messages=turns, **request)
    turns.append({"role": "assistant", "content": Message.model_validate(reply).content})
    turns.append({"role": "user", "content": "b"})
    return ctx.llm("claude-1", claude.messages.create, messages=turns, **request)["content"]


def get_weather(latitude: float, longitude: float) -> str:
    from tests import workflows

    workflows.calls["get_weather"] = workflows.calls.get("get_weather", 0) + 1
    if "get_weather" in workflows.crash_at:
        workflows.crash_at.discard("get_weather")
        raise workflows.Crash("get_weather")
    return f"14C at {latitude},{longitude}"


WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current temperature for the given coordinates.",
            "parameters": {
                "type": "object",
                "properties": {"latitude": {"type": "number"}, "longitude": {"type": "number"}},
                "required": ["latitude", "longitude"],
            },
        },
    }
]


# OpenAI's function-calling guide, made durable: the statements marked "# durable" are the only
# ones changed (typed=True keeps the SDK's objects, so the rest reads as in the guide).
@workflow("guide-weather")  # durable
def guide_weather(ctx: RunContext, input):  # durable
    client = openai_client()
    messages = [
        {"role": "system", "content": "SCRIPT: get_weather\nARGS get_weather: "
         '{"latitude": 48.85, "longitude": 2.35}'},
        {"role": "user", "content": "What is the weather like in Paris today?"},
    ]  # fmt: skip
    completion = ctx.llm(
        "ask",
        client.chat.completions.create,
        typed=True,
        model="gpt-4.1",
        messages=messages,
        tools=WEATHER_TOOLS,
    )  # durable: was client.chat.completions.create(model=..., messages=..., tools=...)
    tool_call = completion.choices[0].message.tool_calls[0]
    args = json.loads(tool_call.function.arguments)
    result = ctx.tool("get_weather", get_weather, args)  # durable
    messages.append(completion.choices[0].message)
    messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": str(result)})
    completion_2 = ctx.llm(
        "answer",
        client.chat.completions.create,
        typed=True,
        model="gpt-4.1",
        messages=messages,
        tools=WEATHER_TOOLS,
    )  # durable: was client.chat.completions.create(model=..., messages=..., tools=...)
    return completion_2.choices[0].message.content


@workflow("llm-gather")
async def llm_gather(ctx, input: dict):
    """Three model calls, then two tools, each set at once with asyncio.gather."""
    import asyncio

    from tests import workflows

    client = openai_client(asynchronous=True)
    asks = [
        ctx.llm(
            f"ask-{i}",
            client.chat.completions.create,
            model="gpt-4o-mini",
            max_tokens=20,
            messages=[{"role": "user", "content": f"question number {i}"}],
        )
        for i in range(3)
    ]
    answers = await asyncio.gather(*asks)

    async def lookup(n: int, idempotency_key: str) -> str:
        workflows.calls[f"lookup-{n}"] = workflows.calls.get(f"lookup-{n}", 0) + 1
        await asyncio.sleep(0.01 * (3 - n))  # finish in the reverse order
        return f"{n}:{idempotency_key}:{ctx.idempotency_key}"

    found = await asyncio.gather(*(ctx.tool(f"lookup-{n}", lookup, {"n": n}) for n in range(2)))
    if "after-gather" in workflows.crash_at:
        workflows.crash_at.discard("after-gather")
        raise workflows.Crash("after-gather")
    return {"answers": [a["choices"][0]["message"]["content"] for a in answers], "found": found}


@workflow("gather-many")
async def gather_many(ctx, input: dict):
    """More steps at once than the workflow has database threads."""
    import asyncio

    async def echo(n: int) -> int:
        await asyncio.sleep(0.001 * (n % 5))
        return n

    return await asyncio.gather(*(ctx.step(f"echo-{n}", echo, n) for n in range(input["n"])))


@workflow("nested-async-step")
async def nested_async_step(ctx, input):
    async def outer():
        return await ctx.step("inner", lambda: 1)

    return await ctx.step("outer", outer)


LOOKUP = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
BOOK = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "nights": {"type": "integer", "minimum": 1}},
    "required": ["city", "nights"],
}
#: Set by a test: how the tools of "agent-protocols" behave (failures to raise, slowness).
tool_behaviour: dict = {}


def lookup_city(city: str) -> dict:
    return {"city": city, "hotels": 3}


def weather(city: str) -> dict:
    return {"city": city, "sky": "clear"}


def book_hotel(city: str, nights: int, idempotency_key: str) -> dict:
    import threading

    failures = tool_behaviour.get("book_failures", 0)
    if failures:
        tool_behaviour["book_failures"] = failures - 1
        raise ConnectionError("the hotel API dropped the connection")
    if tool_behaviour.get("book_slow"):
        threading.Event().wait(tool_behaviour["book_slow"])
    return {"booked": city, "nights": nights, "key": idempotency_key}


@workflow("agent-protocols")
def agent_protocols(ctx: RunContext, input: dict):
    """The same agent on each protocol: two tools at once, then a booking."""
    protocol = input["protocol"]
    system = (
        "You plan trips.\nSCRIPT: lookup_city+weather, book_hotel\n"
        'ARGS lookup_city: {"city": "Lisbon"}\nARGS weather: {"city": "Lisbon"}\n'
        f"ARGS book_hotel: {json.dumps(input.get('book', {'city': 'Lisbon', 'nights': 2}))}"
    )
    ask = "Plan two nights in Lisbon."
    retry = RetryPolicy(max_attempts=2, initial_interval=timedelta(0))
    approve = input.get("approve", False)
    tools = {
        "lookup_city": Tool(lookup_city, "Hotels in a city", LOOKUP, requires_approval=approve),
        "weather": Tool(weather, "The weather in a city", LOOKUP, requires_approval=approve),
        "book_hotel": Tool(book_hotel, "Book a hotel", BOOK, retry=retry, timeout=0.5),
    }
    if protocol == "anthropic":
        conversation = {
            "client": anthropic_client(),
            "model": "claude-3-5-haiku-20241022",
            "system": system,
            "messages": [{"role": "user", "content": ask}],
            "tool_choice": {"type": "auto"},
            "stop_sequences": ["<end>"],
        }
    elif protocol == "responses":
        conversation = {
            "client": openai_client(),
            "model": "gpt-4.1-mini",
            "instructions": system,
            "input": [{"role": "user", "content": ask}],
            "tool_choice": "auto",
            "parallel_tool_calls": True,
            "temperature": 0.2,
        }
    else:
        conversation = {
            "client": openai_client(),
            "model": "gpt-4o-mini",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": ask}],
            "tool_choice": "auto",
            "parallel_tool_calls": True,
            "temperature": 0.2,
        }
    if input.get("stream"):  # each turn streamed, its text handed out as it arrives
        conversation |= {"stream": True, "on_delta": streamed.append}
    if input.get("as_messages") and "input" in conversation:  # the chat spelling, for responses
        conversation["messages"] = conversation.pop("input")
    if input.get("both"):
        conversation |= {"messages": [{"role": "user", "content": ask}], "input": []}
    if input.get("empty"):
        conversation.pop("input", None)
        conversation.pop("messages", None)
    return ctx.agent_loop(protocol=protocol, tools=tools, **conversation)


#: The text "agent-protocols" was handed as it streamed (a test empties it).
streamed: list[str] = []


#: Set by a test: the barrier both tools of "agent-async-parallel" must meet at.
meeting: dict = {}


def meet_a() -> str:
    meeting["barrier"].wait()
    return "a met b"


def meet_b() -> str:
    meeting["barrier"].wait()
    return "b met a"


@workflow("agent-async-parallel")
async def agent_async_parallel(ctx, input):
    """Two tools in one turn that can only finish together: they must run at the same time."""
    return await ctx.agent_loop(
        client=openai_client(),
        model="gpt-4o-mini",
        messages=[{"role": "system", "content": "SCRIPT: meet_a+meet_b"}],
        tools={"meet_a": Tool(meet_a), "meet_b": Tool(meet_b)},
    )


#: Turns whose user message a test changes, as code changed under a running workflow would.
edited: set[int] = set()


def turn_text(turn: int, size: int) -> str:
    """A tool result's worth of text, different on every turn."""
    import random
    import string

    text = "".join(random.Random(turn).choices(string.ascii_letters + " ", k=size))
    return f"turn {turn}{' (edited)' if turn in edited else ''}: {text}"


@workflow("long-conversation")
def long_conversation(ctx: RunContext, input: dict):
    """A conversation that grows by a user message and an answer per turn, sent whole each
    time, as the chat completions and responses protocols want it."""
    client = openai_client()
    responses = input.get("protocol") == "responses"
    messages: list = [{"role": "system", "content": "Answer in one line."}]
    for turn in range(input["turns"]):
        if turn == input.get("wait_at"):
            ctx.wait_for_event("go", "go")
        messages.append({"role": "user", "content": turn_text(turn, input["size"])})
        if responses:
            response = ctx.llm(
                f"turn-{turn}", client.responses.create, model="gpt-4.1-mini",
                max_output_tokens=50, instructions="Answer in one line.", input=messages[1:],
            )  # fmt: skip
            answer = response["output"][0]["content"][0]["text"]
            messages.append({"role": "assistant", "content": answer})
        else:
            response = ctx.llm(
                f"turn-{turn}", client.chat.completions.create, model="gpt-4o-mini",
                max_tokens=50, messages=messages,
            )  # fmt: skip
            messages.append(response["choices"][0]["message"])
    return len(messages)


@workflow("llm-cut-off")
def llm_cut_off(ctx: RunContext, input: dict):
    """A model call whose process dies after the provider answered, before it was recorded."""
    from runs.engine.llm import CAP_FIELD
    from tests import workflows

    client = openai_client()

    def call(**request):
        answer = client.chat.completions.create(**request)
        if "answered" in workflows.crash_at:
            workflows.crash_at.discard("answered")
            raise workflows.Crash("answered")
        return answer

    messages = [{"role": "user", "content": "summarise durable execution"}]
    if (input or {}).get("uncapped"):  # no max_tokens: the budget caps the answer
        setattr(call, CAP_FIELD, "max_completion_tokens")
        return ctx.llm("ask", call, model="gpt-4o-mini", messages=messages)
    return ctx.llm("ask", call, model="gpt-4o-mini", max_tokens=100, messages=messages)


@workflow("llm-parse-fails")
def llm_parse_fails(ctx: RunContext, input: dict):
    """Structured output the model does not follow (the demo model writes prose): the SDK
    refuses each answer after it arrived, and paid for."""
    from pydantic import BaseModel

    class Plan(BaseModel):
        steps: list[str]

    messages = [{"role": "user", "content": "plan a durable agent"}]
    quick = RetryPolicy(max_attempts=3, initial_interval=timedelta(0), jitter=0.0)
    parse = openai_client().chat.completions.parse
    return ctx.llm(
        "plan", parse, model="gpt-4o-mini", messages=messages, response_format=Plan, retry=quick
    )


@workflow("llm-alias")
def llm_alias(ctx: RunContext, input: dict):
    """A gateway's model name that answers as a priced model (the gateway routes it)."""

    def gateway(**request):
        text = {"role": "assistant", "content": "routed"}
        return {
            "model": (input or {}).get("answers_as", "gpt-4o-2024-08-06"),
            "choices": [{"index": 0, "message": text, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1000, "completion_tokens": 100},
        }

    messages = [{"role": "user", "content": "route me"}]
    return ctx.llm("ask", gateway, model="acme-router", max_tokens=200, messages=messages)


@workflow("llm-parsed")
def llm_parsed(ctx: RunContext, input: dict):
    """Structured output the model follows: chat completions' and responses' parse, as JSON
    and as the SDK's parsed types (typed=True), the same on replay."""
    from pydantic import BaseModel

    class Plan(BaseModel):
        steps: list[str]

    client = openai_client()
    ask = 'plan it. ANSWER JSON: {"steps": ["checkpoint", "resume"]}'
    chat = [{"role": "user", "content": ask}]
    as_json = ctx.llm(
        "chat-json", client.chat.completions.parse, model="gpt-4o-mini", messages=chat,
        response_format=Plan,
    )  # fmt: skip
    typed = ctx.llm(
        "chat-typed", client.chat.completions.parse, model="gpt-4o-mini", messages=chat,
        response_format=Plan, typed=True,
    )  # fmt: skip
    responses_json = ctx.llm(
        "responses-json", client.responses.parse, model="gpt-4o-mini", input=ask, text_format=Plan
    )
    responses_typed = ctx.llm(
        "responses-typed", client.responses.parse, model="gpt-4o-mini", input=ask,
        text_format=Plan, typed=True,
    )  # fmt: skip
    from tests import workflows

    if "parsed" in workflows.crash_at:  # the replay below rebuilds all four from the records
        workflows.crash_at.discard("parsed")
        raise workflows.Crash("parsed")
    parsed = typed.choices[0].message.parsed
    return {
        "chat_json": as_json["choices"][0]["message"]["parsed"],
        "chat_typed": [type(parsed).__name__, parsed.steps],
        "responses_json": responses_json["output_parsed"],
        "responses_typed": [
            type(responses_typed.output_parsed).__name__,
            responses_typed.output_parsed.steps,
        ],
    }
