"""RunContext, what a workflow function receives, and Engine, the execution behind it.

`Engine` assembles one execution of one run: the `Execution` (identity, lease, flags, the
gate every call passes) and the concerns built on it, each owning its own state: `Steps`,
`Waits`, `ModelCalls`, `Recorded`. `RunContext` is a façade of one-line delegations to them:
workflow code sees the public calls and the run's identity, never the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, overload

from runs.engine.calls import ModelCalls
from runs.engine.execution import Execution
from runs.engine.recorded import Recorded
from runs.engine.steps import Steps
from runs.engine.waits import Waits


class Engine:
    """One execution of one run and the concerns built on it, dependencies pointing one way:
    Execution <- Steps, Waits <- ModelCalls, Recorded. Lifecycle and the async bridge drive it;
    workflow code sees it through RunContext."""

    __slots__ = ("calls", "execution", "recorded", "steps", "waits")

    def __init__(self, execution: Execution):
        self.execution = ex = execution
        self.steps = Steps(ex)
        self.waits = Waits(ex)
        self.calls = ModelCalls(ex, self.steps, self.waits)
        self.recorded = Recorded(ex, self.steps)


P = ParamSpec("P")
R = TypeVar("R")


class _Delegate(Generic[P, R]):
    """A RunContext method that calls the method of the same name on one of the engine's
    concerns (`part`): the façade keeps the engine's signature and docstring (for type
    checkers and help()) without a copy."""

    def __init__(self, part: str, method: Callable[Concatenate[Any, P], R]):
        self.part, self.name = part, method.__name__
        self.__doc__ = method.__doc__

    @overload
    def __get__(self, ctx: None, owner: Any = None) -> _Delegate[P, R]: ...
    @overload
    def __get__(self, ctx: RunContext, owner: Any = None) -> Callable[P, R]: ...
    def __get__(self, ctx: RunContext | None, owner: Any = None) -> Any:
        return self if ctx is None else getattr(getattr(ctx._engine, self.part), self.name)


class RunContext:
    """What a workflow function receives: the only door to durable steps and waits.

    Workflow code between steps re-runs on every resume, so it must be deterministic: take the
    time, randomness and ids from `ctx.now()`, `ctx.random()` and `ctx.uuid()`.
    """

    __slots__ = (
        "_engine", "attempt", "input", "labels", "run_id", "scheduled_at", "version", "worker_id",
        "workflow",
    )  # fmt: skip

    def __init__(self, engine: Engine):
        self._engine = engine
        execution = engine.execution
        who = execution.who
        self.run_id: str = who.run_id
        self.workflow: str = who.workflow
        self.version: str = who.version
        self.input: Any = execution.input
        self.attempt: int = who.attempt
        self.labels: dict[str, str] = dict(who.labels)  # who the run is for: a copy
        self.worker_id: str = who.worker_id
        #: The tick a schedule started this run for (timezone-aware UTC), else None: the
        #: time the run is "for", the same on every replay, unlike the start's delay.
        self.scheduled_at: datetime | None = who.scheduled_at

    def __repr__(self) -> str:
        return f"<RunContext run={self.run_id} workflow={self.workflow!r}>"

    @property
    def idempotency_key(self) -> str:
        """`<run id>:<step key>` of the running step (Steps.idempotency_key)."""
        return self._engine.steps.idempotency_key

    step = _Delegate("steps", Steps.step)
    transaction = _Delegate("steps", Steps.transaction)
    llm = _Delegate("calls", ModelCalls.llm)
    tool = _Delegate("calls", ModelCalls.tool)
    agent_loop = _Delegate("calls", ModelCalls.agent_loop)
    approval = _Delegate("waits", Waits.approval)
    approvals = _Delegate("waits", Waits.approvals)
    child = _Delegate("waits", Waits.child)
    children = _Delegate("waits", Waits.children)
    sleep = _Delegate("waits", Waits.sleep)
    sleep_until = _Delegate("waits", Waits.sleep_until)
    wait_for_event = _Delegate("waits", Waits.wait_for_event)
    now = _Delegate("recorded", Recorded.now)
    random = _Delegate("recorded", Recorded.random)
    uuid = _Delegate("recorded", Recorded.uuid)
    patched = _Delegate("recorded", Recorded.patched)
    set_event = _Delegate("recorded", Recorded.set_event)


def engine_of(ctx: RunContext) -> Engine:
    """The engine behind a workflow's context, for an adapter that drives it (pydantic_ai's
    run_sync runs the agent as an async workflow of the same execution)."""
    return ctx._engine
