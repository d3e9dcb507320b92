"""Workflows for tests/test_adapter_langgraph.py: graphs written as LangGraph's own docs write
them, run durably by changing the one line that invokes them."""

import asyncio
import contextlib
import json
import operator
import os
import time
from typing import Annotated, Any, TypedDict

from langchain_core.messages import AIMessage, RemoveMessage, ToolMessage
from langchain_core.messages import convert_to_openai_messages as to_openai
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.types import Command, Send, interrupt
from langgraph.types import RetryPolicy as GraphRetryPolicy

from runs.adapters.langgraph import MARK, durable, idempotency_key, with_ctx
from runs.sdk import RunContext, StepMisuse, workflow
from tests import workflows
from tests.testapp.models import Effect


def touch(label: str, delay: float = 0.0) -> None:
    """A node's side effect: counted here (in-process tests) and written as a row keyed by its
    step's idempotency key (worker tests; no row when the graph runs plain, outside a run)."""
    workflows.calls[label] = workflows.calls.get(label, 0) + 1
    with contextlib.suppress(StepMisuse):
        Effect.objects.create(idempotency_key=idempotency_key(), label=label, pid=os.getpid())
    if delay:
        time.sleep(delay)
    if label in workflows.crash_at:
        workflows.crash_at.discard(label)
        raise workflows.Crash(label)


def openai_client(*, asynchronous: bool = False):
    from openai import AsyncOpenAI, OpenAI

    client = AsyncOpenAI if asynchronous else OpenAI
    return client(base_url=os.environ["STEPGUARD_MODEL_BASE_URL"], api_key="k", max_retries=0)


# A graph with two branches in one superstep, a Send fan-out, a join and a loop.


class Flow(TypedDict, total=False):
    topics: list[str]
    notes: Annotated[list[str], operator.add]
    drafts: int
    log: Annotated[list[str], operator.add]


def audience(state: Flow) -> dict:
    touch("audience")
    return {"log": ["audience"]}


def outline(state: Flow) -> dict:
    touch("outline")
    return {"log": ["outline"]}


def fan_out(state: Flow) -> list[Send]:
    n = len(state["topics"])
    return [
        Send("research", {"topic": t, "delay": 0.05 * (n - i)})
        for i, t in enumerate(state["topics"])
    ]


def research(state: dict) -> dict:
    touch(f"research:{state['topic']}")
    return {"notes": [f"notes on {state['topic']}"], "log": [f"research {state['topic']}"]}


async def research_async(state: dict) -> dict:
    """The first topic sleeps longest: the branches finish in the reverse of their order."""
    await asyncio.sleep(state["delay"])
    await asyncio.to_thread(touch, f"research:{state['topic']}")
    return {"notes": [f"notes on {state['topic']}"], "log": [f"research {state['topic']}"]}


def draft(state: Flow) -> dict:
    n = state.get("drafts", 0) + 1
    touch(f"draft:{n}")
    return {"drafts": n, "log": [f"draft {n}"]}


def publish(state: Flow) -> dict:
    touch("publish")
    return {"log": ["publish"]}


def flow_graph(asynchronous: bool = False):
    builder = StateGraph(Flow)
    builder.add_node("audience", audience)
    builder.add_node("outline", outline)
    builder.add_node("research", research_async if asynchronous else research)
    builder.add_node("draft", draft)
    builder.add_node("publish", publish)
    builder.add_edge(START, "audience")
    builder.add_edge(START, "outline")
    builder.add_conditional_edges("outline", fan_out, ["research"])
    builder.add_edge(["research", "audience"], "draft")
    builder.add_conditional_edges(
        "draft", lambda state: "draft" if state["drafts"] < 3 else "publish"
    )
    builder.add_edge("publish", END)
    return builder.compile()


FLOW = flow_graph()
FLOW_ASYNC = flow_graph(asynchronous=True)


@workflow("lg-flow")
def lg_flow(ctx: RunContext, input: dict):
    return durable(FLOW, ctx).invoke(input)


@workflow("lg-flow-async")
async def lg_flow_async(ctx, input: dict):
    return await durable(FLOW_ASYNC, ctx).ainvoke(input)


# A tool-calling agent on MessagesState: the model node makes its own ctx.llm steps.

SCRIPT = "SCRIPT: search+weather, book"


def search(city: str = "Lisbon") -> dict:
    return {"hotels": [f"{city} Palace"]}


def weather(city: str = "Lisbon") -> dict:
    return {"forecast": f"sun in {city}"}


def book(hotel: str = "Lisbon Palace") -> dict:
    return {"booked": hotel}


TOOLS = {"search": search, "weather": weather, "book": book}
SCHEMAS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in TOOLS
]


class Chat(MessagesState):
    delay: float


def as_message(response: dict) -> AIMessage:
    message = response["choices"][0]["message"]
    calls = [
        {
            "name": c["function"]["name"],
            "args": json.loads(c["function"]["arguments"]),
            "id": c["id"],
        }
        for c in message.get("tool_calls") or []
    ]
    return AIMessage(message.get("content") or "", tool_calls=calls)


def request(state: Chat) -> dict:
    return {
        "model": "gpt-4o-mini",
        "max_tokens": 200,
        "messages": [{"role": "system", "content": SCRIPT}, *to_openai(state["messages"])],
        "tools": SCHEMAS,
    }


@with_ctx
def agent(state: Chat, ctx: RunContext) -> dict:
    response = ctx.llm("think", openai_client().chat.completions.create, **request(state))
    return {"messages": [as_message(response)]}


@with_ctx
async def agent_async(state: Chat, ctx) -> dict:
    client = openai_client(asynchronous=True)
    response = await ctx.llm("think", client.chat.completions.create, **request(state))
    return {"messages": [as_message(response)]}


def tools(state: Chat) -> dict:
    results = []
    for call in state["messages"][-1].tool_calls:
        touch(f"tool:{call['name']}", state.get("delay", 0.0))
        output = json.dumps(TOOLS[call["name"]](**call["args"]))
        results.append(ToolMessage(output, tool_call_id=call["id"], name=call["name"]))
    return {"messages": results}


def tidy(state: Chat) -> dict:
    """Drops the tool results by id, as summarizing agents do: the ids must be the ones the
    recorded tool messages had, on every replay."""
    touch("tidy")
    return {"messages": [RemoveMessage(id=m.id) for m in state["messages"] if m.type == "tool"]}


def finish(state: Chat) -> dict:
    touch("finish")
    return {"messages": [AIMessage(f"Filed after {len(state['messages'])} messages.")]}


def assistant_graph(asynchronous: bool = False):
    builder = StateGraph(Chat)
    builder.add_node("agent", agent_async if asynchronous else agent)
    builder.add_node("tools", tools)
    builder.add_node("tidy", tidy)
    builder.add_node("finish", finish)
    builder.add_edge(START, "agent")
    builder.add_conditional_edges(
        "agent", lambda state: "tools" if state["messages"][-1].tool_calls else "tidy"
    )
    builder.add_edge("tools", "agent")
    builder.add_edge("tidy", "finish")
    builder.add_edge("finish", END)
    return builder.compile()


ASSISTANT = assistant_graph()
ASSISTANT_ASYNC = assistant_graph(asynchronous=True)


def chat_input(input: dict) -> dict:
    return {"messages": [("user", input["request"])], "delay": input.get("delay", 0.0)}


def transcript(state: dict) -> dict:
    messages = state["messages"]
    return {
        "answer": messages[-1].content,
        "transcript": [[m.type, m.content, len(getattr(m, "tool_calls", []))] for m in messages],
    }


@workflow("lg-assistant")
def lg_assistant(ctx: RunContext, input: dict):
    return transcript(durable(ASSISTANT, ctx).invoke(chat_input(input)))


@workflow("lg-assistant-async")
async def lg_assistant_async(ctx, input: dict):
    return transcript(await durable(ASSISTANT_ASYNC, ctx).ainvoke(chat_input(input)))


# Human in the loop: interrupt() twice in one node.


class Review(TypedDict, total=False):
    topic: str
    draft: str
    title: Any
    verdict: Any


def write(state: Review) -> dict:
    touch("write")
    return {"draft": f"a draft about {state['topic']}"}


def review(state: Review) -> dict:
    touch("review")
    title = interrupt({"question": "Which title?", "draft": state["draft"]})
    verdict = interrupt("Publish it?")
    return {"title": title, "verdict": verdict}


def ship(state: Review) -> dict:
    touch("ship")
    return {}


def review_graph():
    builder = StateGraph(Review)
    builder.add_node("write", write)
    builder.add_node("review", review)
    builder.add_node("ship", ship)
    builder.add_edge(START, "write")
    builder.add_edge("write", "review")
    builder.add_edge("review", "ship")
    builder.add_edge("ship", END)
    return builder.compile()


REVIEW = review_graph()


@workflow("lg-review")
def lg_review(ctx: RunContext, input: dict):
    options = {"interrupts": input["interrupts"]} if "interrupts" in input else {}
    return durable(REVIEW, ctx, **options).invoke(input)


# A node routing with a Command, a subgraph added as a node, a flaky node with a retry policy.


class Routes(TypedDict, total=False):
    log: Annotated[list[str], operator.add]
    meta: dict


def route(state: Routes) -> Command:
    touch("route")
    sends = [Send("worker", {"log": [f"job {i}"]}) for i in range(2)]
    # A key of the adapter's own in a node's dict is kept apart from its markers.
    return Command(goto=[*sends, "sub"], update={"meta": {MARK: "mine", "n": 2}})


def worker(state: Routes) -> dict:
    touch(f"worker:{state['log'][0]}")
    return {"log": [f"did {state['log'][0]}"]}


def inner(state: Routes) -> dict:
    touch("inner")
    return {"log": ["inner"]}


class Unavailable(Exception):
    pass


def flaky(state: Routes) -> dict:
    touch("flaky")
    if workflows.calls["flaky"] < 3:
        raise Unavailable("try again")
    return {"log": ["flaky"]}


def routes_graph():
    sub = StateGraph(Routes)
    sub.add_node("inner", inner)
    retry = GraphRetryPolicy(initial_interval=0.01, jitter=False, retry_on=Unavailable)
    sub.add_node("flaky", flaky, retry_policy=retry)
    sub.add_edge(START, "inner")
    sub.add_edge("inner", "flaky")
    builder = StateGraph(Routes)
    builder.add_node("route", route, destinations=("worker", "sub"))
    builder.add_node("worker", worker)
    builder.add_node("sub", sub.compile())
    builder.add_edge(START, "route")
    return builder.compile()


ROUTES = routes_graph()


@workflow("lg-routes")
def lg_routes(ctx: RunContext, input: dict):
    return durable(ROUTES, ctx).invoke({})


# Nodes that cannot be steps as written.


@workflow("lg-misuse")
def lg_misuse(ctx: RunContext, input: dict):
    def tag(state: dict) -> dict:
        if input["case"] == "set":
            return {"tags": {"durable", "agents"}}
        ctx.step("lookup", lambda: 1)  # a step inside the node's step
        return {}

    builder = StateGraph(dict)
    builder.add_node("tag", tag)
    builder.add_edge(START, "tag")
    return durable(builder.compile(), ctx).invoke({})


# LangGraph's getting-started chatbot: a node that calls a LangChain chat model, as written in
# LangChain's docs (the model built once, at module level, SDK retries left at their default).


def chat_model(provider: str, model: str | None = None, **options: Any):
    base = os.environ["STEPGUARD_MODEL_BASE_URL"]
    if provider == "anthropic":
        from langchain_anthropic import ChatAnthropic

        return ChatAnthropic(
            model=model or "claude-3-5-haiku-latest", base_url=base.removesuffix("/v1"),
            api_key="k", **options,
        )  # fmt: skip
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=model or "gpt-4o-mini", base_url=base, api_key="k", **options)


_shared: dict[tuple[str, str], Any] = {}


def shared_model(provider: str, model: str | None = None):
    """One chat model per provider, model and model server for the whole process, as a
    module-level `llm = ChatOpenAI(...)` is: its client outlives every execution."""
    key = (provider, model or "", os.environ["STEPGUARD_MODEL_BASE_URL"])
    if key not in _shared:
        _shared[key] = chat_model(provider, model)
    return _shared[key]


def chatbot_graph(provider: str, how: str, model: str | None = None):
    def chatbot(state: MessagesState) -> dict:
        llm = shared_model(provider, model)
        if how == "stream":
            chunks = list(llm.stream(state["messages"]))
            reply = chunks[0]
            for chunk in chunks[1:]:
                reply = reply + chunk
            return {"messages": [AIMessage(reply.text, id=reply.id)]}
        if how == "tools":
            llm = llm.bind_tools([search_tool])
        reply = llm.invoke(state["messages"])
        touch("chatbot")  # after the answer came: a crash here re-sends the call
        if "chatbot-error" in workflows.crash_at:  # the node fails after a paid answer
            workflows.crash_at.discard("chatbot-error")
            raise RuntimeError("the node failed after its model call was answered")
        return {"messages": [reply]}

    async def achatbot(state: MessagesState) -> dict:
        llm = shared_model(provider, model)
        if how == "stream":
            text = "".join([c.text async for c in llm.astream(state["messages"])])
            return {"messages": [AIMessage(text)]}
        reply = await llm.ainvoke(state["messages"])
        if "chatbot" in workflows.crash_at:  # after the answer came, as the sync node's touch
            workflows.crash_at.discard("chatbot")
            raise workflows.Crash("chatbot")
        return {"messages": [reply]}

    graph = StateGraph(MessagesState)
    graph.add_node("chatbot", achatbot if how in ("ainvoke", "stream-async") else chatbot)
    graph.add_edge(START, "chatbot")
    graph.add_edge("chatbot", END)
    return graph.compile()


def search_tool(query: str) -> str:
    """Search the web for `query`."""
    return query


def chatbot_input(input: dict) -> dict:
    return {"messages": [("user", input.get("question", "Plan a weekend in Lisbon"))]}


@workflow("lg-chatbot")
def lg_chatbot(ctx: RunContext, input: dict) -> dict:
    graph = chatbot_graph(
        input.get("provider", "openai"), input.get("how", "invoke"), input.get("model")
    )
    state = durable(graph, ctx).invoke(chatbot_input(input))
    return {"answer": state["messages"][-1].text}


@workflow("lg-chatbot-async")
async def lg_chatbot_async(ctx, input: dict) -> dict:
    how = "stream-async" if input.get("how") == "stream" else "ainvoke"
    graph = chatbot_graph(input.get("provider", "openai"), how, input.get("model"))
    state = await durable(graph, ctx).ainvoke(chatbot_input(input))
    return {"answer": state["messages"][-1].text}


# The same chatbot served to a chat UI: the graph streamed, the node calling `invoke` as written
# (LangGraph's callbacks then stream the model's answer token by token), `turns` model calls in
# a row so a budget spent by the first can stop the next.


def turns_graph(provider: str, turns: int, asynchronous: bool = False, **options: Any):
    model = chat_model(provider, **options) if options else shared_model(provider)

    def chatbot(state: MessagesState) -> dict:
        return {"messages": [model.invoke(state["messages"])]}

    async def achatbot(state: MessagesState) -> dict:
        return {"messages": [await model.ainvoke(state["messages"])]}

    def more(state: MessagesState) -> str:
        answers = sum(1 for m in state["messages"] if m.type == "ai")
        return "chatbot" if answers < turns else END

    graph = StateGraph(MessagesState)
    graph.add_node("chatbot", achatbot if asynchronous else chatbot)
    graph.add_edge(START, "chatbot")
    graph.add_conditional_edges("chatbot", more)
    return graph.compile()


@workflow("lg-chatbot-streamed")
def lg_chatbot_streamed(ctx: RunContext, input: dict) -> dict:
    options = input.get("options") or {}
    graph = turns_graph(input.get("provider", "openai"), input.get("turns", 1), **options)
    tokens = []
    for chunk, _meta in durable(graph, ctx).stream(chatbot_input(input), stream_mode="messages"):
        tokens.append(chunk.text)
    return {"answer": "".join(tokens)}


@workflow("lg-chatbot-streamed-async")
async def lg_chatbot_streamed_async(ctx, input: dict) -> dict:
    graph = turns_graph(input.get("provider", "openai"), input.get("turns", 1), asynchronous=True)
    graph = durable(graph, ctx)
    tokens = []
    if input.get("how") == "events":
        async for event in graph.astream_events(chatbot_input(input), version="v2"):
            if event["event"] == "on_chat_model_stream":
                tokens.append(event["data"]["chunk"].text)
    else:
        async for chunk, _meta in graph.astream(chatbot_input(input), stream_mode="messages"):
            tokens.append(chunk.text)
    return {"answer": "".join(tokens)}
