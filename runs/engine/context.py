"""RunContext, what a workflow function receives, and Execution, the engine behind it.

`Execution` is one execution of one run, assembled from the engine's concerns, one module each
(replay, steps, model calls, waits, checkpoints, compensation); it holds the state they share.
`RunContext` is a façade of one-line delegations to it: workflow code sees the public calls
and the run's identity, never the engine's private methods and state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, overload

from runs.engine.budget import Reservation, Usage
from runs.engine.calls import ModelCalls
from runs.engine.checkpoints import Checkpoints
from runs.engine.compensation import Compensations
from runs.engine.fences import Lease
from runs.engine.history import History
from runs.engine.host import AsyncHost
from runs.engine.records import Identity
from runs.engine.replay import Replay
from runs.engine.steps import Steps
from runs.engine.waits import Waits
from runs.errors import StepguardError
from runs.models import Run, Step, StepStatus


class Execution(Steps, ModelCalls, Waits, Replay):
    """One execution of one run: the engine's concerns and the state they share."""

    def __init__(
        self,
        run: Run,
        history: dict[int, Step],
        lease: Lease,
        *,
        trace: Any = None,
        give_up: StepguardError | None = None,
    ):
        #: Who this execution is (run, workflow, attempt, labels, worker), read once here.
        self.who = Identity.of(run)
        self.input: Any = run.input
        #: The replay cursor: which position each call takes, what is recorded there.
        self.history = History(
            history,
            attempt=run.attempt,
            failed_step=(run.error or {}).get("step") if run.error else None,
        )
        self._lease = lease
        self._cancel_requested = run.cancel_requested_at is not None
        #: Set past the poison-run bound: the first step not yet completed fails the run
        #: instead of being re-sent, so the compensations run without the step that kept
        #: killing workers.
        self._give_up = give_up
        self._undo = Compensations()  # the undo list, the steps in doubt, whether undoing
        #: The one writer of the execution's step rows and events, fenced by its lease.
        self.checkpoints = Checkpoints(lease, self.who, self._undo, give_up=give_up)
        self._answered: dict[Any, Usage] = {}
        self._answered_now: dict[str, Usage | None] = {}  # by idempotency key, from ctx.llm
        #: By step: what it holds, the model calls made inside it included
        #: (Steps._reserve_in_step).
        self._reserved_in_step: dict[Any, Reservation] = {}
        self._trace = trace  # the OpenTelemetry context steps descend from (runs/tracing.py)
        self._patches: dict[str, bool] = {}
        self._usd_budget = run.budget_micros is not None
        self._budgeted = self._usd_budget or run.budget_tokens is not None
        #: An async workflow's event loop, turnstile and context (bridge.run_async sets it).
        self._host: AsyncHost | None = None
        self._unpriced_models: set[str] = set()
        #: The run's last model call: (seq, its whole request, whether its stored form is known
        #: to expand to that request, None until checked); the next request is stored against it.
        self._last_request: tuple[int, dict, bool | None] | None = None
        lease.workflow = run.workflow
        #: Whether a step may be left `started` when the run ends (found so, or cut off in
        #: flight): the run's end then marks it (lifecycle._finish).
        self._left_started = any(s.status == StepStatus.STARTED for s in history.values())


P = ParamSpec("P")
R = TypeVar("R")


class _Delegate(Generic[P, R]):
    """A RunContext method that calls the Execution's method of the same name: the façade
    keeps the engine's signature and docstring (for type checkers and help()) without a copy."""

    def __init__(self, method: Callable[Concatenate[Any, P], R]):
        self.name = method.__name__
        self.__doc__ = method.__doc__

    @overload
    def __get__(self, ctx: None, owner: Any = None) -> _Delegate[P, R]: ...
    @overload
    def __get__(self, ctx: RunContext, owner: Any = None) -> Callable[P, R]: ...
    def __get__(self, ctx: RunContext | None, owner: Any = None) -> Any:
        return self if ctx is None else getattr(ctx._execution, self.name)


class RunContext:
    """What a workflow function receives: the only door to durable steps and waits.

    Workflow code between steps re-runs on every resume, so it must be deterministic: take the
    time, randomness and ids from `ctx.now()`, `ctx.random()` and `ctx.uuid()`.
    """

    __slots__ = (
        "_execution", "attempt", "input", "labels", "run_id", "version", "worker_id", "workflow",
    )  # fmt: skip

    def __init__(self, execution: Execution):
        self._execution = execution
        who = execution.who
        self.run_id: str = who.run_id
        self.workflow: str = who.workflow
        self.version: str = who.version
        self.input: Any = execution.input
        self.attempt: int = who.attempt
        self.labels: dict[str, str] = dict(who.labels)  # who the run is for: a copy
        self.worker_id: str = who.worker_id

    def __repr__(self) -> str:
        return f"<RunContext run={self.run_id} workflow={self.workflow!r}>"

    @property
    def idempotency_key(self) -> str:
        """`<run id>:<step key>` of the running step (Execution.idempotency_key)."""
        return self._execution.idempotency_key

    step = _Delegate(Execution.step)
    transaction = _Delegate(Execution.transaction)
    llm = _Delegate(Execution.llm)
    tool = _Delegate(Execution.tool)
    agent_loop = _Delegate(Execution.agent_loop)
    approval = _Delegate(Execution.approval)
    approvals = _Delegate(Execution.approvals)
    child = _Delegate(Execution.child)
    children = _Delegate(Execution.children)
    sleep = _Delegate(Execution.sleep)
    sleep_until = _Delegate(Execution.sleep_until)
    wait_for_event = _Delegate(Execution.wait_for_event)
    now = _Delegate(Execution.now)
    random = _Delegate(Execution.random)
    uuid = _Delegate(Execution.uuid)
    patched = _Delegate(Execution.patched)
