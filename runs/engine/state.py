"""What the engine's concerns share: the state of one execution of a run, and the methods one
concern calls on another.

RunContext (context.py) is assembled from mixins, one module a concern. Each mixin inherits
this declaration, so each module type-checks on its own against the same contract; the
methods below exist at run time only in the mixin that defines them, and a type checker
refuses a mixin whose definition no longer matches its declaration here.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, NoReturn

from runs.engine.budget import Amount, Reservation, Usage
from runs.engine.compensation import Compensations
from runs.engine.fences import Fence, Lease
from runs.engine.history import History
from runs.engine.host import AsyncHost
from runs.engine.records import Decision, Running
from runs.engine.retry import RetryPolicy
from runs.errors import StepguardError
from runs.models import Step


class ContextState:
    """Set by RunContext.__init__; see there for what each one means."""

    run_id: str
    workflow: str
    version: str
    input: Any
    attempt: int
    labels: dict[str, str]
    worker_id: str
    history: History
    _lease: Lease
    _left_started: bool
    _cancel_requested: bool
    _forked_from: Any
    _give_up: StepguardError | None
    _undo: Compensations
    _answered: dict[Any, Usage]  # usage of attempts that failed after an answer, by step
    _answered_now: dict[str, Usage | None]  # the answer the attempt failing now came after
    _reserved_in_step: dict[Any, Reservation]  # by step: what it holds, model calls inside it
    # included (Steps._reserve_in_step)
    _recovering: bool
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
        def _fork_lineage(self) -> list: ...

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
        def _check_approval(self, decision: Decision | None) -> None: ...

        # Checkpoints (checkpoints.py)
        @property
        def _start_fence(self) -> Fence: ...
        def _new_step(self, seq: int, key: str, kind: str, status: str, **fields: Any) -> Step: ...
        def _event(self, event_seq: int, type_: str, key: str = "", **payload: Any) -> None: ...
        def _end_step(
            self, step_pk: Any, now: datetime, *, output: Any = None, error: Any = None
        ) -> None: ...
        def _close_wait(
            self,
            record: Step,
            now: datetime,
            *,
            output: Any = None,
            error: StepguardError | None = None,
        ) -> tuple[str, str, dict]: ...
        def _park_step(self, step_pk: Any, until: datetime, error: dict) -> None: ...
        def _book_attempt(self, step_pk: Any, usage: Usage) -> None: ...
        def _add_reservation(self, step_pk: Any, amount: Amount) -> Reservation: ...
        def _begin_transaction(self) -> int: ...
        def _record_transaction(
            self,
            event_seq: int,
            record: Step | None,
            seq: int,
            key: str,
            fields: dict,
            input_: Any,
        ) -> None: ...
        def _write_start(
            self,
            event: tuple[str, str, dict],
            checks: Fence,
            *,
            insert: dict | None = None,
            update: tuple[Any, dict] | None = None,
            approval: Any = None,
            take_shared: Callable[[], None] | None = None,
        ) -> Any: ...
        def _restart(
            self, step_pk: Any, key: str, payload: Any, attempt: int, held: Any, approval: Any
        ) -> None: ...
        def _finish_step(
            self,
            step_pk: Any,
            key: str,
            payload: Any,
            fields: Any,
            usage: Usage | None,
            held: Reservation | None,
            *,
            defer: bool = False,
            earlier: Usage | None = None,
        ) -> None: ...
        def _record_failure(
            self,
            step_pk: Any,
            seq: int | None,
            key: str,
            idem: str | None,
            kind: str | None,
            attempt: int,
            exc: BaseException,
            held: Reservation | None = None,
        ) -> NoReturn: ...
        def _note_retry(self, key: str, tries: int, exc: Exception, delay: float) -> None: ...
        def _append_events(self, first_seq: int, events: list[tuple[str, str, dict]]) -> None: ...
        def _enter_wait(self) -> tuple[int, datetime]: ...
        def _finish_wait(
            self,
            record: Step,
            event_seq: int,
            now: datetime,
            *,
            output: Any = None,
            error: Any = None,
            **payload: Any,
        ) -> None: ...
        def _suspend(self, wake_at: datetime | None) -> None: ...

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
