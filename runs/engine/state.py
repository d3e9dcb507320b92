"""What the engine's concerns share: the state of one execution of a run, and the methods one
concern calls on another.

Execution (context.py) is assembled from four mixins, one module a concern (replay, steps,
model calls, waits), which call one another; each inherits this declaration, so each module
type-checks on its own against the same contract; the methods below exist at run time only
in the mixin that defines them, and a type checker refuses a mixin whose definition no longer
matches its declaration here. The concerns that own their state are collaborators instead,
reached through an attribute and declared by their own class: `history` (the replay cursor)
and `checkpoints` (the one writer), which call back into none of the mixins.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from runs.engine.budget import Reservation, Usage
from runs.engine.checkpoints import Checkpoints
from runs.engine.compensation import Compensations
from runs.engine.fences import Lease
from runs.engine.history import History
from runs.engine.host import AsyncHost
from runs.engine.records import Decision, Identity, Running
from runs.engine.retry import RetryPolicy
from runs.errors import StepguardError
from runs.models import Step


class ContextState:
    """Set by RunContext.__init__; see there for what each one means."""

    who: Identity
    input: Any
    history: History
    checkpoints: Checkpoints
    _lease: Lease
    _left_started: bool
    _cancel_requested: bool
    _give_up: StepguardError | None
    _undo: Compensations
    _answered: dict[Any, Usage]  # usage of attempts that failed after an answer, by step
    _answered_now: dict[str, Usage | None]  # the answer the attempt failing now came after
    _reserved_in_step: dict[Any, Reservation]  # by step: what it holds, model calls inside it
    # included (Steps._reserve_in_step)
    _trace: Any
    _patches: dict[str, bool]
    _usd_budget: bool
    _budgeted: bool
    _host: AsyncHost | None
    _unpriced_models: set[str]
    _last_request: tuple[int, dict, bool | None] | None

    if TYPE_CHECKING:
        # Replay (replay.py)
        def _enter(self, key: str, *, internal: bool = False) -> tuple[str, int, Step | None]: ...
        def _position(
            self, key: str, *, internal: bool = False
        ) -> tuple[str, int, Step | None]: ...
        def _admit(self, key: str, seq: int, record: Step | None) -> None: ...

        # Steps (steps.py)
        @property
        def idempotency_key(self) -> str: ...
        def step(
            self,
            key: str,
            fn: Callable,
            /,
            *args: Any,
            retry: RetryPolicy | None = None,
            reconcile: Callable[[str], Any] | None = None,
            on_ambiguous: str = "resend",
            compensate: Callable[[Any], Any] | None = None,
            approval: Decision | None = None,
            estimate: Usage | None = None,
            kind: str = ...,
            resource: str | None = None,
            **kwargs: Any,
        ) -> Any: ...
        def _run_step(
            self,
            key: str,
            fn: Callable,
            args: tuple,
            kwargs: dict,
            *,
            retry: RetryPolicy | None = None,
            reconcile: Callable[[str], Any] | None = None,
            on_ambiguous: str = "resend",
            compensate: Callable[[Any], Any] | None = None,
            approval: Decision | None = None,
            estimate: Usage | None = None,
            kind: str = ...,
            internal: bool = False,
            described: Any = None,
            model: str = "",
            resource: str | None = None,
        ) -> Any: ...
        def _running(self) -> Running | None: ...
        def _await(self, value: Any) -> Any: ...
        def _released(self, force: bool = False) -> AbstractContextManager[None]: ...

        # Waits (waits.py)
        def approval(
            self,
            key: str,
            *,
            action: str,
            summary: str = "",
            payload: Any = None,
            timeout: float | timedelta | None = None,
        ) -> Decision: ...
        def _sleep(self, seconds: float) -> None: ...
