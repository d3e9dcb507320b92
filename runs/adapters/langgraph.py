"""LangGraph: each node execution of a graph becomes a checkpointed Stepguard step.

```python
from runs.adapters.langgraph import durable


@workflow("research")
def research(ctx: RunContext, input: dict) -> dict:
    state = durable(graph, ctx).invoke(input)  # was: graph.invoke(input)
    return {"report": state["report"]}
```

`durable(graph, ctx)` is a copy of the compiled graph whose nodes run as steps: a node's
returned update (or Command) is recorded as JSON, LangChain messages included, and handed back
from the record on replay, so a run resumed after a crash skips the nodes that finished and
re-sends, with the same idempotency key, the one in flight (`idempotency_key()` inside a node).

- **Replay.** The graph runs from the top on every execution: Stepguard, not a LangGraph
  checkpointer, holds the progress (a checkpointer compiled in is not used). Routing functions
  on conditional edges run again, so they must be deterministic: route on what nodes returned,
  not on a model call made in the router.
- **Parallel branches.** Nodes of one superstep (edges fanning out, `Send`) take positions in
  LangGraph's task order: one after another on the workflow's thread in a sync workflow,
  concurrently in an `async def` one (`await durable(graph, ctx).ainvoke(input)`). A `Send`'s
  step is keyed `node[i]`, so a replay never hands one branch another's record. In an async
  workflow, an interrupt while other branches are in flight re-sends them on resume.
- **Nodes with steps of their own.** Steps do not nest, so a node that calls `ctx.llm`,
  `ctx.tool` or waits is marked `@with_ctx`, takes `(state, ctx)` and is not a step itself.
- **Human in the loop.** `interrupt(value)` in a node records `value` as the node step's
  output, waits durably (holding no worker) for an approval in the inbox showing `value`, or
  for a signal named after the node with `interrupts="signal"`, and runs the node again (as
  `<node>.resume`) with the answer, as LangGraph would with `Command(resume=...)`. Static
  breakpoints (`interrupt_before`/`interrupt_after`) need a LangGraph checkpointer and are
  refused.
- **Subgraphs.** A compiled graph added as a node has its own nodes as steps (`sub/node`);
  one invoked inside a node's function is part of that node's step.
- **Chat models.** A LangChain chat model called inside a node (`invoke`, `ainvoke`, `stream`,
  `astream`, with tools bound or structured output; ChatOpenAI, ChatAnthropic and any chat
  model built on their clients) is metered as a model call of the node's step: each call
  carries `Idempotency-Key: <step's key>:<n>` (the same when the node is re-sent after a
  crash), is checked against the run's budgets before it is sent (the run pauses instead of
  overspending), is sent with the SDK's own retries off (the step retries, so a 400 is sent
  once), and its tokens and USD, priced from the model the response names, are recorded on
  the node's step, which shows as an `llm` step. Its answer is part of the node's recorded
  update, replayed as LangChain messages. A graph streamed with `stream_mode="messages"` or
  `astream_events` streams the node's `invoke`, metered as if it were not streamed: the
  adapter asks the client for the streamed answer's usage itself. A node marked `@with_ctx` is
  not a step: call `ctx.llm` there.
- **Not replayed.** What a node streams (`stream_mode="custom"`, model tokens) is emitted
  by the execution that runs it only. A node's update must be JSON, messages, `Command`,
  `Send` or `Overwrite`; anything else fails the step with OutputNotSerializable naming the
  node and where in its update the value sits.
"""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("langgraph") is None:
    raise ImportError(
        "runs.adapters.langgraph needs its framework, an extra of Stepguard: "
        "pip install 'stepguard[langgraph]'"
    )

import asyncio
import concurrent.futures
import contextvars
import functools
import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from typing import Any, TypeVar

from langchain_core.messages import BaseMessage, message_to_dict, messages_from_dict
from langchain_core.runnables import RunnableConfig
from langchain_core.runnables.config import var_child_runnable_config

# LangGraph internals, read in 1.2 (pyproject pins <2): the runner's task submitter (a sync
# graph's nodes run on the workflow's thread), the task scratchpad (the answers interrupt()
# returns), the Send marker of a task's path, and the node runnable and its default.
from langgraph._internal._constants import (
    CONF,
    CONFIG_KEY_RUNNER_SUBMIT,
    CONFIG_KEY_SCRATCHPAD,
    PUSH,
)
from langgraph._internal._runnable import RunnableCallable
from langgraph.errors import GraphInterrupt
from langgraph.pregel import Pregel
from langgraph.pregel._read import DEFAULT_BOUND, PregelNode
from langgraph.types import Command, Overwrite, Send

from runs.adapters import chat_models
from runs.engine.aio.bridge import AsyncRunContext, in_turn
from runs.engine.context import RunContext
from runs.engine.records import CURRENT_STEP, Decision
from runs.engine.retry import RetryPolicy
from runs.engine.waits import Ask
from runs.errors import OutputNotSerializable, StepMisuse
from runs.models import Run

__all__ = ["durable", "idempotency_key", "with_ctx"]

F = TypeVar("F", bound=Callable)

#: Marks what the adapter encoded in a recorded update (a message, a Command...), so that a
#: replay rebuilds it; a user's own dict with this key is wrapped so it is never mistaken.
MARK = "__stepguard__"
_WITH_CTX = "__stepguard_with_ctx__"
_INTERRUPTS = ("signal", "approval")


def durable(
    graph: Pregel,
    ctx: RunContext | AsyncRunContext,
    *,
    retry: RetryPolicy | None = None,
    interrupts: str = "approval",
) -> Pregel:
    """A copy of compiled `graph` whose node executions are steps of the run `ctx` belongs to.

    Call it in the workflow, where `graph.invoke(...)` was: `durable(graph, ctx).invoke(input)`
    in a sync workflow, `await durable(graph, ctx).ainvoke(input)` in an `async def` one
    (`stream`/`astream` work too). Each node execution is a step keyed by the node's name
    (`prefix/name` inside a subgraph added as a node, `name[i]` for the i-th `Send` of a
    superstep; a node that runs again gets `#2`, `#3`). Nodes of one superstep take their
    positions in LangGraph's own task order: one after another in a sync workflow, together in
    an async one.

    `retry` is the steps' RetryPolicy; a node's LangGraph `retry_policy` is translated into
    one instead of retrying around the step. `interrupts` says what `interrupt(value)` in a
    node waits for: `"approval"` (the default: a person answers in the approvals inbox) an
    approval request showing `value`, answered with `{"approved": True, "by": user, "comment":
    text}` or `{"approved": False, "reason": text}`; `"signal"` a signal named after the node's
    step key, whose payload `interrupt()` returns (a program answers). The graph's
    checkpointer is not used (the run's steps are the checkpoints); static breakpoints are
    refused.
    """
    if interrupts not in _INTERRUPTS:
        raise StepMisuse(f"interrupts must be one of {_INTERRUPTS}, not {interrupts!r}")
    return _Durable(ctx, retry, interrupts).wrap(graph, "")


def with_ctx(fn: F) -> F:
    """Mark a node function that makes its own steps: `def plan(state, ctx)`.

    Under `durable()` the node is not a step (steps do not nest): it is called with the run
    context as `ctx` (an AsyncRunContext in an async workflow, so write it `async def` there)
    and its `ctx.llm`, `ctx.tool` and waits are the steps. Its return value is not recorded:
    on replay it is computed again from its steps' records. It waits with `ctx.approval` or
    `ctx.wait_for_event`, not `interrupt()`, and it runs only under `durable()`.
    """
    setattr(fn, _WITH_CTX, True)
    return fn


def idempotency_key() -> str:
    """The idempotency key of the node step running now (`<run id>:<step key>`), the same
    when the step is re-sent after a crash: hand it to the service a node calls."""
    running = CURRENT_STEP.get()
    if running is None:
        raise StepMisuse("idempotency_key() is only defined inside a node run by durable()")
    return running.idempotency_key


class _Durable:
    """One graph execution's wrapped nodes, and what they share: the run context, the count of
    each node's visits, and the signal that ended the execution (a wait, a lost lease)."""

    def __init__(self, ctx: RunContext | AsyncRunContext, retry, interrupts: str):
        self.ctx, self.retry, self.interrupts = ctx, retry, interrupts
        self.asynchronous = isinstance(ctx, AsyncRunContext)
        self.visits: dict[str, int] = {}
        self.stopped: BaseException | None = None

    def wrap(self, graph: Pregel, prefix: str) -> Pregel:
        if graph.interrupt_before_nodes or graph.interrupt_after_nodes:
            raise StepMisuse(
                "static breakpoints (interrupt_before/interrupt_after) need LangGraph's "
                "checkpointer; call interrupt() in the node instead, a durable wait under "
                "Stepguard"
            )
        nodes = {}
        for name, node in graph.nodes.items():
            if node.bound is DEFAULT_BOUND:
                nodes[name] = node
            elif isinstance(node.bound, Pregel):  # a subgraph: each of its nodes is a step
                nodes[name] = node.copy({"bound": self.wrap(node.bound, f"{prefix}{name}/")})
            else:
                policy = self.retry or _translated(node.retry_policy or graph.retry_policy)
                bound = self._node(f"{prefix}{name}", node, policy)
                nodes[name] = node.copy({"bound": bound, "retry_policy": None})
        update: dict[str, Any] = {"nodes": nodes, "checkpointer": None, "retry_policy": ()}
        if not self.asynchronous:
            # Sync steps run one at a time on the workflow's thread (and its database
            # connection): the tasks of a superstep run there, in LangGraph's task order.
            config = graph.config or {}
            conf = {**config.get(CONF, {}), CONFIG_KEY_RUNNER_SUBMIT: lambda: _inline}
            update["config"] = {**config, CONF: conf}
        return graph.copy(update)

    def _node(self, name: str, node: PregelNode, policy: RetryPolicy | None) -> RunnableCallable:
        bound = node.bound
        fn = getattr(bound, "func", None) or getattr(bound, "afunc", None)
        takes_ctx = getattr(fn, _WITH_CTX, False)

        def run(state: Any, config: RunnableConfig) -> Any:
            label = self._enter(name, config, sync=True)
            if getattr(bound, "func", True) is None:
                raise StepMisuse(
                    f"node {label!r} is async def: run the graph with "
                    "`await durable(graph, ctx).ainvoke(...)` in an async workflow"
                )
            with self._stopping():
                if not takes_ctx:
                    return self._step(label, bound, state, config, policy)
                with _no_interrupt(label):
                    return self._named(label, bound.invoke(state, config, ctx=self.ctx))

        async def arun(state: Any, config: RunnableConfig) -> Any:
            label = self._enter(name, config, sync=False)
            if takes_ctx and getattr(bound, "func", None) is not None:
                raise StepMisuse(
                    f"node {label!r} takes the context of an async workflow: make it async def "
                    "and await its ctx calls"
                )
            with self._stopping():
                if not takes_ctx:
                    return await self._astep(label, bound, state, config, policy)
                with _no_interrupt(label):
                    update = await bound.ainvoke(state, config, ctx=self.ctx)
                return self._named(label, update)

        return RunnableCallable(run, arun, name=name, trace=False)

    def _enter(self, name: str, config: RunnableConfig, *, sync: bool) -> str:
        """The node's label (its step key before any `#n`), counting its visit; refuses a
        graph run the wrong way for the workflow, and any node after the run was stopped."""
        if self.stopped is not None:
            raise self.stopped
        if sync == self.asynchronous:
            raise StepMisuse(
                "an async workflow runs the graph with `await durable(graph, ctx).ainvoke(...)`"
                if sync
                else "a sync workflow runs the graph with `durable(graph, ctx).invoke(...)`"
            )
        path = (config.get("metadata") or {}).get("langgraph_path") or ()
        label = name.replace("#", "_")
        if len(path) > 1 and path[0] == PUSH and isinstance(path[1], int):
            label += f"[{path[1]}]"  # the i-th Send of this superstep
        self.visits[label] = self.visits.get(label, 0) + 1
        return label

    @contextmanager
    def _stopping(self) -> Iterator[None]:
        """Remember a signal that ends this execution (a wait, a halt, a lost lease): the
        other nodes of the superstep raise it too instead of taking steps after it."""
        try:
            yield
        except BaseException as exc:
            if not isinstance(exc, Exception | asyncio.CancelledError):
                self.stopped = exc
            raise

    def _step(self, label: str, bound, state, config, policy) -> Any:
        answers: list[Any] = []
        key = label
        while True:
            output = self.ctx.step(
                key, lambda: self._call(label, bound, state, config, answers), retry=policy
            )
            if not _interrupted(output):
                return decode(output)
            answers.append(self._answer(self._wait(label, output["value"])))
            key = f"{label}.resume"

    async def _astep(self, label: str, bound, state, config, policy) -> Any:
        answers: list[Any] = []
        key = label
        while True:
            # The run's budget as it stands, for the chat models the node may call: read
            # before the step, as an async node's event loop cannot query the database.
            run = await in_turn(self.ctx, Run.objects.get, pk=self.ctx.run_id)
            call = functools.partial(self._acall, label, bound, state, config, answers, run)
            output = await self.ctx.step(key, call, retry=policy)
            if not _interrupted(output):
                return decode(output)
            answers.append(self._answer(await self._wait(label, output["value"])))
            key = f"{label}.resume"

    def _call(self, label: str, bound, state, config, answers: list) -> Any:
        config = _answering(config, answers)
        token = var_child_runnable_config.set(config)  # what interrupt() reads
        try:
            with chat_models.metering(self.ctx) as meter:
                update = bound.invoke(state, config)
        except GraphInterrupt as exc:
            return meter.metered(self._interrupt(label, exc))
        except StepMisuse as exc:
            raise _nested(label, exc) from None
        finally:
            var_child_runnable_config.reset(token)
        return meter.metered(encode(self._named(label, update), label))

    async def _acall(self, label: str, bound, state, config, answers: list, run) -> Any:
        config = _answering(config, answers)
        token = var_child_runnable_config.set(config)
        try:
            with chat_models.metering(self.ctx, run) as meter:
                update = await bound.ainvoke(state, config)
        except GraphInterrupt as exc:
            return meter.metered(self._interrupt(label, exc))
        except StepMisuse as exc:
            raise _nested(label, exc) from None
        finally:
            var_child_runnable_config.reset(token)
        return meter.metered(encode(self._named(label, update), label))

    def _interrupt(self, label: str, exc: GraphInterrupt) -> dict:
        """The step's record of a node that asked a person: what it asked. The node runs
        again, as a new step, once the answer is in."""
        value = exc.args[0][0].value if exc.args and exc.args[0] else None
        return {MARK: "interrupt", "value": encode(value, label)}

    def _wait(self, label: str, value: Any) -> Any:
        """The durable wait for a person's answer to `value` (awaited in an async workflow)."""
        key = f"{label}.interrupt"
        if self.interrupts == "signal":
            return self.ctx.wait_for_event(key, label)
        summary = value if isinstance(value, str) else ""
        ask = Ask(key, f"resume {label}"[:200], summary, {"node": label, "value": value})
        return self.ctx.approvals([ask])

    def _answer(self, waited: Any) -> Any:
        """What `interrupt()` returns: a signal's payload, or the approval's outcome."""
        if self.interrupts == "signal":
            return waited
        outcome = waited[0]
        if isinstance(outcome, Decision):
            return {"approved": True, "by": outcome.decided_by, "comment": outcome.comment}
        return {"approved": False, "reason": str(outcome)}

    def _named(self, label: str, update: Any) -> Any:
        """`update` with an id for each message that has none: `<step's idempotency key>:<n>`,
        or `<run id>:<node>@<visit>:<n>` from a node that took the context. LangGraph's reducer
        would give them random ones, different on every replay, and a recorded RemoveMessage
        naming one would no longer find it."""
        running = CURRENT_STEP.get()
        base = (
            running.idempotency_key
            if running
            else f"{self.ctx.run_id}:{label}@{self.visits[label]}"
        )
        return _named(update, (f"{base}:{n}" for n in itertools.count()))


def _inline(
    fn: Callable,
    *args: Any,
    __name__: str | None = None,
    __cancel_on_exit__: bool = False,
    __reraise_on_exit__: bool = True,
    __next_tick__: bool = False,
    **kwargs: Any,
) -> concurrent.futures.Future:
    """LangGraph's task submitter, run in the calling thread: a done future, in task order."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    try:
        future.set_result(contextvars.copy_context().run(fn, *args, **kwargs))
    except BaseException as exc:  # LangGraph raises it from the future, in task order
        future.set_exception(exc)
    return future


def _answering(config: RunnableConfig, answers: list) -> RunnableConfig:
    """The task's config with the answers so far to the node's interrupts: `interrupt()`
    returns the i-th answer to its i-th call, and raises past the last one."""
    conf = config.get(CONF, {})
    pad = conf.get(CONFIG_KEY_SCRATCHPAD)
    if pad is None:
        return config
    fresh = replace(
        pad,
        resume=list(answers),
        interrupt_counter=itertools.count().__next__,
        get_null_resume=lambda consume=False: None,
    )
    return {**config, CONF: {**conf, CONFIG_KEY_SCRATCHPAD: fresh}}


@contextmanager
def _no_interrupt(label: str) -> Iterator[None]:
    try:
        yield
    except GraphInterrupt:
        raise StepMisuse(
            f"node {label!r} takes the run context: it waits with ctx.wait_for_event or "
            "ctx.approval, not interrupt()"
        ) from None


def _nested(label: str, exc: StepMisuse) -> StepMisuse:
    if "do not nest" not in str(exc):
        return exc
    return StepMisuse(
        f"{exc}: node {label!r} is a step; a node that makes its own steps takes the run "
        "context instead: decorate it with @with_ctx (def node(state, ctx))"
    )


def _interrupted(output: Any) -> bool:
    return isinstance(output, dict) and output.get(MARK) == "interrupt"


def _translated(policies) -> RetryPolicy | None:
    """A LangGraph RetryPolicy as the step's: retrying around the step as well would multiply
    the attempts. A `retry_on` predicate cannot be carried over: any exception is retried."""
    if not policies:
        return None
    p = policies[0]
    kinds = p.retry_on if isinstance(p.retry_on, tuple | list) else (p.retry_on,)
    return RetryPolicy(
        max_attempts=p.max_attempts,
        initial_interval=timedelta(seconds=p.initial_interval),
        backoff=max(1.0, p.backoff_factor),
        max_interval=timedelta(seconds=p.max_interval),
        jitter=0.2 if p.jitter else 0.0,
        retry_on=tuple(kinds) if all(isinstance(k, type) for k in kinds) else (Exception,),
    )


def _named(value: Any, ids: Iterator[str]) -> Any:
    if isinstance(value, BaseMessage):
        return value if value.id is not None else value.model_copy(update={"id": next(ids)})
    if isinstance(value, dict):
        return {k: _named(v, ids) for k, v in value.items()}
    if isinstance(value, list) or type(value) is tuple:
        return type(value)(_named(v, ids) for v in value)
    if isinstance(value, Command):
        return replace(value, update=_named(value.update, ids))
    return value


def encode(value: Any, node: str) -> Any:
    """A node's update as JSON: messages, Commands, Sends and Overwrites tagged for `decode`.

    Raises OutputNotSerializable naming the node and where in its update the value is."""
    return _encode(value, node, "update")


def _encode(value: Any, node: str, where: str) -> Any:
    if value is None or isinstance(value, str | int | float):
        return value
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise _unrecordable(node, where, "a dict whose keys are not all strings")
        out = {k: _encode(v, node, f"{where}[{k!r}]") for k, v in value.items()}
        return {MARK: "dict", "value": out} if MARK in value else out
    if isinstance(value, list | tuple):
        return [_encode(v, node, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, BaseMessage):
        return {MARK: "message", "value": message_to_dict(value)}
    if isinstance(value, Send):
        return {MARK: "send", "node": value.node, "arg": _encode(value.arg, node, where)}
    if isinstance(value, Overwrite):
        return {MARK: "overwrite", "value": _encode(value.value, node, where)}
    if isinstance(value, Command):
        fields = ("update", "goto", "resume")
        out = {f: _encode(getattr(value, f), node, f"{where}.{f}") for f in fields}
        return {MARK: "command", "graph": value.graph, **out}
    raise _unrecordable(node, where, f"a {type(value).__module__}.{type(value).__qualname__}")


def decode(value: Any) -> Any:
    """What `encode` recorded, rebuilt: the same objects live and on every replay."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    kind = value.get(MARK)
    if kind is None:
        return {k: decode(v) for k, v in value.items()}
    if kind == "dict":
        return {k: decode(v) for k, v in value["value"].items()}
    if kind == "message":
        return messages_from_dict([value["value"]])[0]
    if kind == "send":
        return Send(value["node"], decode(value["arg"]))
    if kind == "overwrite":
        return Overwrite(decode(value["value"]))
    if kind == "command":
        goto = decode(value["goto"])
        return Command(
            graph=value["graph"],
            update=decode(value["update"]),
            goto=goto,
            resume=decode(value["resume"]),
        )
    raise ValueError(f"unknown recorded value {kind!r}")


def _unrecordable(node: str, where: str, what: str) -> OutputNotSerializable:
    return OutputNotSerializable(
        f"node {node!r} returned {what} at {where}, which cannot be recorded: a node's update "
        "is stored as JSON (dicts, lists, strings, numbers, LangChain messages, Command, "
        "Send); convert it, or mark the node @with_ctx to keep it out of a step"
    )
