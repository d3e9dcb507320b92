"""Executing one claimed run: replay from checkpoints, write new ones, fenced by lease_epoch.

A worker runs the workflow function from the top. Each step takes the next `seq`; a completed
checkpoint hands back its stored output and the function never runs. Every write goes through
`store.fence`, one UPDATE of the run row that checks the lease epoch, allocates event sequence
numbers and row-locks the run for the rest of the transaction, so a worker whose lease was
taken over can never write again.

Waits (timers, signals, approvals, child runs) are steps too: a `waiting` row, the run set
`waiting` with a wake-up time, the lease given up, all in one transaction, then `Suspended` is
raised to unwind the workflow. Whatever satisfies the wait wakes the run through its row.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import random
import time
import traceback
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from typing import Any, NoReturn
from uuid import UUID

from django.conf import settings
from django.db import DatabaseError, connection, transaction
from django.db.models import Case, DateTimeField, F, Q, Value, When
from django.db.models.functions import Cast
from django.utils import timezone

from approvals.models import ApprovalKind, ApprovalRequest, ApprovalStatus, Resolution
from runs.engine import holds, registry
from runs.engine import llm as llm_engine
from runs.engine.budget import (
    Metered,
    Usage,
    default_run_budget,
    next_day_start,
    release_holds,
    release_shared,
    reserve_shared,
    scopes_for,
    settle_shared,
)
from runs.engine.outage import is_disconnect
from runs.engine.serialization import INPUT_LIMIT, describe_input, to_json
from runs.engine.store import (
    Lease,
    Spend,
    append_event,
    create_run,
    fence,
    fenced_write,
    run_event,
)
from runs.errors import (
    REPLAYED,
    ApprovalExpired,
    ApprovalRejected,
    ApprovalRevoked,
    Cancelled,
    ChildFailed,
    ControlFlow,
    Halted,
    LeaseLost,
    NonDeterminismError,
    OperatorFailed,
    OutputNotSerializable,
    OverBudget,
    Released,
    StepFailed,
    StepguardError,
    StepMisuse,
    Suspended,
    UnpricedModel,
    WaitTimeout,
    WorkerLost,
)
from runs.models import (
    GLOBAL,
    TERMINAL_STATUSES,
    Policy,
    Recovery,
    Run,
    RunStatus,
    Signal,
    Step,
    StepKind,
    StepStatus,
)

__all__ = ["NOT_FOUND", "Decision", "Lease", "RetryPolicy", "RunContext", "execute", "release"]

log = logging.getLogger("stepguard.executor")

MAX_KEY_LENGTH = 200
#: The longest a step sleeps for a provider's Retry-After while holding its worker thread.
MAX_RETRY_AFTER = 300.0
#: What replay reads of each checkpoint; the rest (input, timestamps) loads only if needed.
REPLAY_FIELDS = (
    "id",
    "seq",
    "key",
    "status",
    "output",
    "error",
    "attempt",
    "run_attempt",
    "wake_at",
    "reserved_micros",
    "reserved_tokens",
    "reserved_on",
    "reserved_scopes",
    "inherited",
)


class _NotFound:
    def __repr__(self) -> str:
        return "NOT_FOUND"


#: Returned by a `reconcile` function that found no trace of the step's side effect.
NOT_FOUND: Any = _NotFound()


@dataclass(frozen=True)
class RetryPolicy:
    """How often a step is re-attempted in place when its function raises.

    Delays grow as `initial_interval * backoff ** (n - 1)`, capped at `max_interval`, each
    spread by +/- `jitter` (a fraction). `max_attempts` counts the first call and is bounded.
    """

    max_attempts: int = 3
    initial_interval: timedelta = timedelta(seconds=1)
    backoff: float = 2.0
    max_interval: timedelta = timedelta(seconds=30)
    jitter: float = 0.2
    retry_on: tuple[type[BaseException], ...] = (Exception,)
    non_retryable: tuple[type[BaseException], ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.max_attempts <= 100:
            raise ValueError("RetryPolicy.max_attempts must be between 1 and 100")
        if self.initial_interval < timedelta(0) or self.max_interval < timedelta(0):
            raise ValueError("RetryPolicy intervals cannot be negative")
        if self.backoff < 1 or not 0 <= self.jitter < 1:
            raise ValueError("RetryPolicy needs backoff >= 1 and 0 <= jitter < 1")

    def retries(self, exc: BaseException) -> bool:
        if isinstance(exc, StepguardError) and not exc.retryable:
            return False
        return isinstance(exc, self.retry_on) and not isinstance(exc, self.non_retryable)

    def delay(self, failures: int) -> float:
        base = self.initial_interval.total_seconds() * self.backoff ** (failures - 1)
        base = min(base, self.max_interval.total_seconds())
        return max(0.0, base * (1 + random.uniform(-self.jitter, self.jitter)))


DEFAULT_RETRY = RetryPolicy()


@dataclass(frozen=True)
class Decision:
    """A granted approval, as `ctx.approval(...)` returns it (and replays it)."""

    approval_id: int
    decided_by: str
    decided_at: datetime
    comment: str

    def as_json(self) -> dict:
        return {
            "approval_id": self.approval_id,
            "decided_by": self.decided_by,
            "decided_at": self.decided_at.isoformat(),
            "comment": self.comment,
        }

    @classmethod
    def from_json(cls, data: dict) -> Decision:
        return cls(
            data["approval_id"],
            data["decided_by"],
            datetime.fromisoformat(data["decided_at"]),
            data["comment"],
        )


def error_record(exc: BaseException) -> dict:
    if isinstance(exc, StepguardError):
        record = exc.as_record()
    else:
        record = {"code": "exception", "type": type(exc).__name__, "message": str(exc)}
    record["traceback"] = "".join(traceback.format_exception(exc, limit=15))[-4000:]
    return record


def _signature_names(fn: Callable) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def _accepts(fn: Callable, name: str) -> bool:
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters or any(p.kind == p.VAR_KEYWORD for p in parameters.values())


def _brief(exc: BaseException) -> dict:
    return {"type": type(exc).__name__, "message": str(exc)[:500]}


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, OutputNotSerializable):
        return False
    return not (isinstance(exc, StepguardError) and not exc.retryable)


def _as_timedelta(value: float | timedelta, what: str) -> timedelta:
    delta = value if isinstance(value, timedelta) else timedelta(seconds=value)
    if delta < timedelta(0):
        raise StepMisuse(f"{what} cannot be negative")
    return delta


@dataclass(frozen=True)
class _Held:
    """What a running step holds against budgets: its estimate, the shared budgets and the
    day it was reserved against. Released from exactly those when the step finishes."""

    reserved: tuple[int, int] = (0, 0)
    shared: list[str] = field(default_factory=list)
    day: date | None = None

    @classmethod
    def of(cls, record: Step | None) -> _Held:
        """What a recorded step (found `started` after a crash) still holds."""
        if record is None or not (record.reserved_micros or record.reserved_tokens):
            return cls()
        reserved = (record.reserved_micros, record.reserved_tokens)
        return cls(reserved, list(record.reserved_scopes or []), record.reserved_on)


@dataclass
class _Child:
    key: str
    seq: int
    record: Step | None
    workflow: str
    input: Any


class RunContext:
    """What a workflow function receives: the only door to durable steps and waits.

    Workflow code between steps re-runs on every resume, so it must be deterministic: take the
    time, randomness and ids from `ctx.now()`, `ctx.random()` and `ctx.uuid()`.
    """

    def __init__(self, run: Run, history: dict[int, Step], lease: Lease):
        self.run_id: str = str(run.id)
        self.workflow: str = run.workflow
        self.version: str = run.version
        self.input: Any = run.input
        self.attempt: int = run.attempt
        self._history = history
        self._lease = lease
        self._seq = 0
        self._occurrences: dict[str, int] = {}
        self._in_step: str | None = None
        self._idempotency_key: str | None = None
        self._cancel_requested = run.cancel_requested_at is not None
        self._forked_from = run.forked_from_id
        #: Set past the poison-run bound: the first step not yet completed fails the run
        #: instead of being re-sent, so the compensations run without the step that kept
        #: killing workers.
        self._give_up: StepguardError | None = None
        self._compensations: list[tuple[str, Callable, Any]] = []
        self._compensating = False
        self._patches: dict[str, bool] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: asyncio.Runner | None = None  # a sync workflow's event loop, see _await
        self._usd_budget = run.budget_micros is not None
        self._unpriced_models: set[str] = set()
        lease.workflow = run.workflow
        self._last_seq = max(history, default=-1)

    # -- steps --------------------------------------------------------------------------------

    @property
    def idempotency_key(self) -> str:
        """`<run id>:<step key>`, stable across every retry and resume of the running step.

        Hand it to the downstream service (an `Idempotency-Key` header, a unique column) so a
        call re-sent after a crash is recognised there instead of repeated.
        """
        if self._idempotency_key is None:
            raise StepMisuse("ctx.idempotency_key is only defined while a step's function runs")
        return self._idempotency_key

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
        kind: str = StepKind.CALL,
        **kwargs: Any,
    ) -> Any:
        """Run `fn(*args, **kwargs)` once for this run and checkpoint its JSON output.

        On replay a completed step returns its recorded output without calling `fn`. A key
        used again in the same execution becomes `key#2`, `key#3`... A step found `started`
        (its worker died mid-call) is re-sent with the same idempotency key; with `reconcile`,
        `reconcile(idempotency_key)` is asked first and returns the outcome it found or
        `NOT_FOUND`; with `on_ambiguous="ask"` a person decides. `compensate(output)` undoes
        the step if the run is cancelled or finally fails. With `approval=decision`, the step
        starts only if that approval still stands, checked in the transaction that starts it.
        The keyword options are never passed to `fn`.
        """
        if on_ambiguous not in ("resend", "ask"):
            raise StepMisuse("on_ambiguous must be 'resend' or 'ask'")
        return self._run_step(
            key, fn, args, kwargs, retry=retry, reconcile=reconcile, on_ambiguous=on_ambiguous,
            compensate=compensate, approval=approval, estimate=estimate, kind=kind,
        )  # fmt: skip

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
        kind: str = StepKind.CALL,
        internal: bool = False,
        input_limit: int = INPUT_LIMIT,
    ) -> Any:
        key, seq, record = self._enter(key, internal=internal)
        if record is not None and record.status == StepStatus.COMPLETED:
            # A step copied from the run this one was forked from did its side effect there:
            # this run undoes only what it did itself.
            return self._remember(key, None if record.inherited else compensate, record.output)
        idem = f"{self.run_id}:{key}"
        ambiguous = record is not None and record.status == StepStatus.STARTED
        if ambiguous and (reconcile is not None or on_ambiguous == "ask"):
            found = (
                self._reconcile(record, reconcile, idem)
                if reconcile is not None
                else self._ask(record, idem)
            )
            if found is not NOT_FOUND:
                return self._remember(key, compensate, found)
        if record is None:
            attempt, payload = 1, {"attempt": 1}
            fields: dict[str, Any] = {
                "seq": seq,
                "key": key,
                "kind": kind,
                "status": StepStatus.STARTED,
                "input": describe_input(args, kwargs, limit=input_limit),
                "idempotency_key": idem,
                "run_attempt": self.attempt,
                "started_at": timezone.now(),
            }
        else:
            attempt = record.attempt + 1
            payload = {"attempt": attempt}
            fields = {
                "status": StepStatus.STARTED,
                "attempt": attempt,
                "run_attempt": self.attempt,
                "error": None,
                "finished_at": None,
            }
            if ambiguous:
                fields["recovered"] = payload["recovered"] = Recovery.RESENT
        # An estimate is held against the budgets while the step runs; a step re-sent after a
        # crash still holds what its first attempt reserved. A hold made on an earlier day (or
        # against other shared budgets) moves to today's ledgers: the old day's spend is no
        # reason to refuse the step today.
        want = (estimate.micros, estimate.tokens) if estimate else (0, 0)
        old = _Held.of(record)
        held = old.reserved
        delta = (max(want[0] - held[0], 0), max(want[1] - held[1], 0))
        reserved = (held[0] + delta[0], held[1] + delta[1])
        shared = [] if self._compensating else scopes_for(self.workflow)
        today = timezone.now().date()
        moving = (
            any(held) and bool(old.shared or shared) and (old.day != today or old.shared != shared)
        )
        if any(reserved):
            fields["reserved_micros"], fields["reserved_tokens"] = reserved
            fields["reserved_on"], fields["reserved_scopes"] = today, shared
        try:
            if approval is None and not shared and not moving:
                step_pk = fenced_write(
                    self._lease,
                    ("step.started", key, payload),
                    insert_step=fields if record is None else None,
                    update_step=None if record is None else (record.pk, fields),
                    estimate=delta,
                    held=held,
                    # Without its started row a crashed step is not ambiguous: it would be
                    # re-sent, skipping the reconcile or the question it was promised.
                    durable=reconcile is not None or on_ambiguous == "ask",
                    **self._start,
                )
            else:
                with transaction.atomic():
                    event_seq = fence(self._lease, estimate=delta, held=held, **self._start)
                    if moving and old.shared:
                        release_shared(old.shared, held, old.day)
                    if shared:
                        if moving:
                            reserve_shared(shared, reserved, (0, 0), today)
                        else:
                            reserve_shared(shared, delta, held, today)
                    self._check_approval(approval)
                    if record is None:
                        step_pk = Step.objects.create(run_id=self._lease.run_id, **fields).pk
                    else:
                        step_pk = record.pk
                        Step.objects.filter(pk=step_pk).update(**fields)
                    append_event(self._lease.run_id, event_seq, "step.started", key, **payload)
        except ApprovalRevoked as exc:
            step_pk = record.pk if record is not None else None
            self._record_failure(step_pk, seq, key, idem, kind, 1, exc, old)
        policy = retry or DEFAULT_RETRY
        held_now = _Held(reserved, shared, today) if any(reserved) else _Held()
        output = self._call(
            step_pk, key, idem, fn, args, kwargs, policy, attempt, held_now, approval
        )
        return self._remember(key, compensate, output)

    def transaction(
        self, key: str, fn: Callable, /, *args: Any, retry: RetryPolicy | None = None, **kwargs: Any
    ) -> Any:
        """Run `fn` inside the database transaction that writes its checkpoint.

        A business write made through the ORM in `fn` and the step's checkpoint commit
        together or not at all: exactly once for writes to Stepguard's own database. There is
        no `started` row, so a crash inside leaves nothing to reconcile.
        """
        key, seq, record = self._enter(key)
        if record is not None and record.status == StepStatus.COMPLETED:
            return record.output
        policy = retry or DEFAULT_RETRY
        idem = f"{self.run_id}:{key}"
        tries = 0
        while True:
            tries += 1
            try:
                with transaction.atomic():
                    event_seq = fence(self._lease, progress=True, **self._start)
                    if shared := scopes_for(self.workflow):
                        # Like any step: none starts once a shared daily budget is spent.
                        reserve_shared(shared, (0, 0), (0, 0), timezone.now().date())
                    value = self._invoke(key, idem, fn, args, kwargs)
                    output = to_json(value, what=f"the output of step {key!r}")
                    now = timezone.now()
                    fields = {
                        "status": StepStatus.COMPLETED,
                        "output": output,
                        "error": None,
                        "attempt": tries,
                        "run_attempt": self.attempt,
                        "started_at": now,
                        "finished_at": now,
                    }
                    if record is None:
                        Step.objects.create(
                            run_id=self._lease.run_id,
                            seq=seq,
                            key=key,
                            kind=StepKind.TRANSACTION,
                            input=describe_input(args, kwargs),
                            idempotency_key=idem,
                            **fields,
                        )
                    else:
                        Step.objects.filter(pk=record.pk).update(**fields)
                    append_event(
                        self._lease.run_id, event_seq, "step.completed", key, attempt=tries
                    )
                return output
            except ControlFlow:
                raise
            except Exception as exc:
                if _retryable(exc) and policy.retries(exc) and tries < policy.max_attempts:
                    self._note_retry(key, tries, exc, policy)
                    continue
                step_pk = record.pk if record is not None else None
                self._record_failure(step_pk, seq, key, idem, StepKind.TRANSACTION, tries, exc)

    def now(self) -> datetime:
        """The current time, recorded once: replay sees the same instant."""
        return datetime.fromisoformat(self.step("now", lambda: timezone.now().isoformat()))

    def random(self) -> float:
        """A random float in [0, 1), recorded once."""
        return self.step("random", random.random)

    def uuid(self) -> UUID:
        """A random UUID, recorded once."""
        import uuid

        return UUID(self.step("uuid", lambda: str(uuid.uuid4())))

    def patched(self, change_id: str) -> bool:
        """True where new code may take its new path; False for a run that recorded the old one.

        Wrap a change to a running workflow: `if ctx.patched("use-v2-search"): new() else:
        old()`. A run whose history already holds a different step at this position replays
        the old path; any other run records a marker and takes the new path from here on.
        """
        if change_id in self._patches:
            return self._patches[change_id]
        key = f"patch:{change_id}"
        seq = self._seq
        record = self._history.get(seq)
        if record is not None and record.key != key:
            self._patches[change_id] = False
            return False
        self._seq += 1
        if record is None:
            with transaction.atomic():
                # A marker spends nothing: halts and cancels stop it, a spent budget does not.
                event_seq = fence(self._lease, starting=True, compensating=True)
                if self._cancel_requested and not self._compensating:
                    raise Cancelled("cancel requested")
                self._new_step(
                    seq, key, StepKind.CALL, StepStatus.COMPLETED, finished_at=timezone.now()
                )
                append_event(self._lease.run_id, event_seq, "step.completed", key, patch=change_id)
        self._patches[change_id] = True
        return True

    # -- agents ---------------------------------------------------------------------------------

    def llm(
        self,
        key: str,
        call: Callable,
        /,
        *,
        estimate: Usage | bool = True,
        retry: RetryPolicy | None = None,
        **request: Any,
    ) -> dict:
        """Call a model once for this run: `call(**request)`, e.g.
        `ctx.llm("think-0", client.chat.completions.create, model=..., messages=...)`.

        Works with the official openai (chat completions, responses) and anthropic clients,
        sync or async. Returns the response as JSON (a dict, the same on replay). Records the
        request on the step and the tokens and USD of `usage` on the step and the run. The
        call carries the step's idempotency key as an `Idempotency-Key` header. By default
        the prompt plus `max_tokens` is reserved against the budgets first (`estimate=False`
        to skip, or a Usage of your own).
        """
        llm_engine.refuse_streaming(call, request)
        model = str(request.get("model", ""))
        guess = llm_engine.estimate(model, request) if estimate is True else (estimate or None)

        def invoke(recorded):
            if llm_engine.price_of(model) is None:
                self._unpriced(key, model)
            kwargs = request
            if _accepts(call, "extra_headers"):  # the SDKs' create() methods do
                headers = {"Idempotency-Key": self.idempotency_key}
                headers |= request.get("extra_headers") or {}
                kwargs = {**request, "extra_headers": headers}
            try:
                response = self._await(call(**kwargs))
            except Exception as exc:
                if (refused := llm_engine.rejected(exc)) is not None:
                    raise refused from exc
                raise
            data = llm_engine.as_json(response)
            return Metered(data, llm_engine.usage_of(data, model))

        recorded = llm_engine.recorded_request(request)
        return self._run_step(
            key, invoke, (recorded,), {}, retry=retry, estimate=guess, kind=StepKind.LLM,
            input_limit=settings.STEPGUARD_MAX_OUTPUT_BYTES,
        )  # fmt: skip

    def _unpriced(self, key: str, model: str) -> None:
        """A model with no price spends nothing in USD, so a USD budget can never stop it: say
        so on the timeline (once an execution), or refuse it under a USD budget if told to."""
        if settings.STEPGUARD_REFUSE_UNPRICED_MODELS and self._under_usd_budget():
            raise UnpricedModel(
                f"model {model!r} has no price (STEPGUARD_MODEL_PRICES) and this run has a USD "
                "budget it could never trip (STEPGUARD_REFUSE_UNPRICED_MODELS)"
            )
        if model not in self._unpriced_models:
            self._unpriced_models.add(model)
            log.warning("run %s: model %r has no price; its calls count as $0", self.run_id, model)
            fenced_write(self._lease, ("model.unpriced", key, {"model": model}))

    def _under_usd_budget(self) -> bool:
        if self._usd_budget:
            return True
        scopes = scopes_for(self.workflow)
        return Policy.objects.filter(scope__in=scopes, daily_budget_micros__isnull=False).exists()

    def tool(
        self,
        key: str,
        fn: Callable,
        args: dict | None = None,
        *,
        requires_approval: bool | Callable[[dict], bool] = False,
        action: str | None = None,
        summary: str = "",
        approval_timeout: float | timedelta | None = None,
        retry: RetryPolicy | None = None,
        compensate: Callable[[Any], Any] | None = None,
    ) -> Any:
        """Call a tool once for this run: `fn(**args)`, with its approval policy.

        `requires_approval` is True, False, or a predicate on the arguments (e.g. amount over
        100); when it holds, a person approves first (`<key>.approval`) and the tool starts
        only if that approval still stands. A tool whose function takes `idempotency_key`
        receives the step's. Raises ApprovalRejected when refused.
        """
        args = dict(args or {})
        name = getattr(fn, "__name__", "tool")
        needed = requires_approval(args) if callable(requires_approval) else requires_approval
        decision = None
        if needed:
            decision = self.approval(
                f"{key}.approval",
                action=(action or f"call {name}")[:200],
                summary=summary,
                payload={"tool": name, "args": args},
                timeout=approval_timeout,
            )
        if "idempotency_key" in _signature_names(fn):

            def call(**kwargs):
                return fn(**kwargs, idempotency_key=self.idempotency_key)

        else:
            call = fn
        return self._run_step(
            key, call, (), args, retry=retry, approval=decision, compensate=compensate,
            kind=StepKind.TOOL,
        )  # fmt: skip

    def agent_loop(self, **options: Any) -> dict:
        """A durable tool-calling loop; see runs.engine.agent.agent_loop."""
        from runs.engine.agent import agent_loop

        return agent_loop(self, **options)

    # -- waits --------------------------------------------------------------------------------

    def sleep(self, key: str, duration: float | timedelta) -> None:
        """Wait `duration` (seconds or a timedelta) without holding a worker.

        The deadline is fixed when the step is first reached, so a resume after a crash waits
        only for what is left of it.
        """
        delta = _as_timedelta(duration, "a sleep")
        self._timer(key, lambda now: now + delta)

    def sleep_until(self, key: str, when: datetime) -> None:
        """Wait until `when` (a timezone-aware datetime) without holding a worker."""
        if timezone.is_naive(when):
            raise StepMisuse("ctx.sleep_until needs a timezone-aware datetime")
        self._timer(key, lambda now: when)

    def wait_for_event(self, key: str, name: str, *, timeout: float | timedelta | None = None):
        """Return the payload of the next signal `name` sent to this run.

        A signal sent before the run gets here is kept and delivered; each signal is consumed
        by one wait. After `timeout` (from when the wait was first reached) raises WaitTimeout.
        """
        delta = None if timeout is None else _as_timedelta(timeout, "a timeout")
        key, seq, record = self._enter(key)
        if record is not None and record.status == StepStatus.COMPLETED:
            return record.output
        timed_out = False
        with transaction.atomic():
            event_seq, now = self._wait_fence()
            if record is None:
                record = self._new_step(
                    seq, key, StepKind.EVENT, StepStatus.WAITING,
                    input={"signal": name}, wake_at=None if delta is None else now + delta,
                )  # fmt: skip
            signal = (
                Signal.objects.filter(
                    run_id=self._lease.run_id, name=name, consumed_at__isnull=True
                )
                .order_by("id")
                .first()
            )
            if signal is not None:
                Signal.objects.filter(pk=signal.pk).update(consumed_by=key, consumed_at=now)
                self._settle(record, event_seq, now, output=signal.payload, signal_id=signal.pk)
                return signal.payload
            if record.wake_at is not None and record.wake_at <= now:
                error = WaitTimeout(
                    f"no signal {name!r} arrived before {record.wake_at:%Y-%m-%d %H:%M:%S}"
                )
                self._settle(record, event_seq, now, error=error)
                timed_out = True
            else:
                append_event(
                    self._lease.run_id, event_seq, "signal.waiting", key, name=name,
                    timeout_at=record.wake_at.isoformat() if record.wake_at else None,
                )  # fmt: skip
                self._suspend(record.wake_at)
        if timed_out:
            raise error
        raise Suspended(f"waiting for signal {name!r}")

    def approval(
        self,
        key: str,
        *,
        action: str,
        summary: str = "",
        payload: Any = None,
        timeout: float | timedelta | None = None,
    ) -> Decision:
        """Ask a person to approve `action` and wait for the decision without holding a worker.

        Returns the Decision when approved; raises ApprovalRejected or, after `timeout`,
        ApprovalExpired. Pass the decision to the guarded step (`ctx.step(..., approval=d)`)
        so it re-checks, as it starts, that the approval was not revoked since.
        """
        delta = None if timeout is None else _as_timedelta(timeout, "a timeout")
        key, seq, record = self._enter(key)
        if record is not None and record.status == StepStatus.COMPLETED:
            return Decision.from_json(record.output)
        if not action or len(action) > 200:
            raise StepMisuse("an approval needs an action of 1 to 200 characters")
        data = to_json(payload, what=f"the payload of approval {key!r}")
        error: StepguardError | None = None
        with transaction.atomic():
            event_seq, now = self._wait_fence()
            if record is None:
                expires = None if delta is None else now + delta
                record = self._new_step(
                    seq, key, StepKind.APPROVAL, StepStatus.WAITING,
                    input={"action": action, "summary": summary}, wake_at=expires,
                )  # fmt: skip
                request = ApprovalRequest.objects.create(
                    run_id=self._lease.run_id,
                    step_key=key,
                    action=action,
                    summary=summary,
                    payload=data,
                    expires_at=expires,
                )
                append_event(
                    self._lease.run_id, event_seq, "approval.requested", key,
                    approval_id=request.pk, action=action,
                    expires_at=expires.isoformat() if expires else None,
                )  # fmt: skip
                self._suspend(expires)
            else:
                request = ApprovalRequest.objects.select_related("decided_by").get(
                    run_id=self._lease.run_id, step_key=key
                )
                outcome = self._approval_outcome(request, now)
                if isinstance(outcome, Decision):
                    self._settle(record, event_seq, now, output=outcome.as_json())
                    return outcome
                if outcome is None:
                    append_event(
                        self._lease.run_id, event_seq, "approval.waiting", key,
                        approval_id=request.pk,
                    )  # fmt: skip
                    self._suspend(request.expires_at)
                else:
                    error = outcome
                    self._settle(record, event_seq, now, error=error)
        if error is not None:
            raise error
        raise Suspended(f"waiting for approval of {action!r}")

    @staticmethod
    def _approval_outcome(request: ApprovalRequest, now: datetime):
        """The decision, the error to raise, or None while it is still pending."""
        if request.status == ApprovalStatus.PENDING:
            if request.expires_at is None or request.expires_at > now:
                return None
            ApprovalRequest.objects.filter(pk=request.pk, status=ApprovalStatus.PENDING).update(
                status=ApprovalStatus.EXPIRED
            )
            request.status = ApprovalStatus.EXPIRED
        who = request.decided_by.get_username() if request.decided_by else "nobody"
        action = request.action
        if request.status == ApprovalStatus.APPROVED:
            return Decision(request.pk, who, request.decided_at, request.comment)
        if request.status == ApprovalStatus.EXPIRED:
            return ApprovalExpired(f"approval #{request.pk} for {action!r} expired undecided")
        if request.status == ApprovalStatus.REVOKED:
            return ApprovalRevoked(f"approval #{request.pk} for {action!r} was revoked by {who}")
        note = f": {request.comment}" if request.comment else ""
        return ApprovalRejected(f"{who} rejected {action!r} (approval #{request.pk}){note}")

    def child(self, key: str, workflow: str, input: Any = None) -> Any:
        """Start a child run (at most once: its identity is this run plus `key`) and wait for
        its result without holding a worker. Raises ChildFailed if it fails or is cancelled."""
        return self.children([(key, workflow, input)])[0]

    def children(self, specs: Iterable[tuple[str, str, Any]]) -> list[Any]:
        """Start several child runs at once and wait for all (fan-out, fan-in).

        `specs` are `(key, workflow, input)`; results come back in the same order. The first
        failed child (in that order) raises ChildFailed.
        """
        entries = []
        for key, workflow, child_input in specs:  # every position first, as on replay
            key, seq, record = self._position(key)
            entries.append(_Child(key, seq, record, workflow, child_input))
        for e in entries:
            self._admit(e.key, e.seq, e.record)
        if all(e.record is not None and e.record.status == StepStatus.COMPLETED for e in entries):
            return [e.record.output for e in entries]
        plans = {}
        for e in entries:
            if e.record is None:
                definition = registry.get(e.workflow)
                plans[e.key] = (definition, to_json(e.input, what=f"the input of child {e.key!r}"))
        failure: ChildFailed | None = None
        with transaction.atomic():
            event_seq, now = self._wait_fence()
            events: list[tuple[str, str, dict]] = []
            for e in entries:
                if e.key in plans:
                    definition, data = plans[e.key]
                    child = create_run(
                        workflow=definition.name,
                        version=definition.version,
                        input=data,
                        key=f"{self.run_id}:{e.key}",
                        parent_id=self._lease.run_id,
                        **default_run_budget(definition.name),
                    )
                    e.record = self._new_step(
                        e.seq, e.key, StepKind.CHILD, StepStatus.WAITING,
                        input={"workflow": definition.ref, "run_id": str(child.id)},
                    )  # fmt: skip
                    events.append(("child.started", e.key, {"child": str(child.id)}))
            keys = {
                f"{self.run_id}:{e.key}": e
                for e in entries
                if e.record.status != StepStatus.COMPLETED
            }
            waiting = False
            for child in Run.objects.filter(key__in=keys).only(
                "id", "key", "status", "output", "error"
            ):
                e = keys[child.key]
                if child.status == RunStatus.COMPLETED:
                    Step.objects.filter(pk=e.record.pk).update(
                        status=StepStatus.COMPLETED, output=child.output, finished_at=now
                    )
                    e.record.status, e.record.output = StepStatus.COMPLETED, child.output
                    events.append(("step.completed", e.key, {"child": str(child.id)}))
                elif child.status in (RunStatus.FAILED, RunStatus.CANCELLED):
                    message = (child.error or {}).get("message", child.status)
                    error = ChildFailed(f"child run {child.id} ({e.key}) {child.status}: {message}")
                    Step.objects.filter(pk=e.record.pk).update(
                        status=StepStatus.FAILED,
                        error={**error.as_record(), "child": str(child.id)},
                        run_attempt=self.attempt,
                        finished_at=now,
                    )
                    e.record.status = StepStatus.FAILED
                    events.append(
                        ("step.failed", e.key, {"child": str(child.id), "error": _brief(error)})
                    )
                else:
                    waiting = True
            failed = [e for e in entries if e.record.status == StepStatus.FAILED]
            if failed:
                failure = ChildFailed(Step.objects.get(pk=failed[0].record.pk).error["message"])
            elif waiting:
                pending = sum(1 for e in entries if e.record.status == StepStatus.WAITING)
                events.append(("children.waiting", "", {"pending": pending}))
            self._append_events(event_seq, events)  # needs the lease: before _suspend
            if waiting and not failed:
                self._suspend(None)
        if failure is not None:
            raise failure
        if waiting:
            raise Suspended("waiting for child runs")
        return [e.record.output for e in entries]

    # -- internals ----------------------------------------------------------------------------

    @property
    def _start(self) -> dict:
        # Compensations run after a cancel was requested; every other step is refused then.
        # Halts and budgets stop both.
        return {"starting": True, "compensating": self._compensating}

    def _enter(self, key: str, *, internal: bool = False) -> tuple[str, int, Step | None]:
        key, seq, record = self._position(key, internal=internal)
        self._admit(key, seq, record)
        return key, seq, record

    def _position(self, key: str, *, internal: bool = False) -> tuple[str, int, Step | None]:
        """Take the next position in the call sequence for `key` (with its repeat suffix)."""
        if self._in_step is not None:
            raise StepMisuse(
                f"step {key!r} was called inside step {self._in_step!r}; steps do not nest"
            )
        limit = 255 if internal else MAX_KEY_LENGTH
        if not isinstance(key, str) or not key or len(key) > limit or ("#" in key and not internal):
            raise StepMisuse(
                f"invalid step key {key!r}: use a non-empty string of at most {MAX_KEY_LENGTH} "
                "characters without '#' ('#' marks repeats: search, search#2, ...)"
            )
        count = self._occurrences.get(key, 0) + 1
        self._occurrences[key] = count
        if count > 1:
            key = f"{key}#{count}"
        seq = self._seq
        self._seq += 1
        return key, seq, self._history.get(seq)

    def _admit(self, key: str, seq: int, record: Step | None) -> None:
        """Decide whether the step at this position may go on; raise what replay must raise."""
        if record is not None and record.key == key:
            if record.status == StepStatus.COMPLETED:
                return
            # A failure replays as itself, so code that caught it takes the same branch again,
            # even under a cancel: replay must reach every completed step after it, or their
            # compensations would never be known. Only the failure that ended an earlier run
            # attempt (the last recorded step) is attempted afresh when the run is retried.
            if record.status == StepStatus.FAILED and (
                record.run_attempt == self.attempt or seq != self._last_seq
            ):
                self._raise_recorded(key, record.error or {})
        if self._give_up is not None and not self._compensating:
            if record is not None and record.key != key:
                raise NonDeterminismError(seq=seq, recorded=record.key, requested=key)
            raise self._give_up
        if self._cancel_requested and not self._compensating:
            # Before the determinism check: after a cancel, the positions past this one hold
            # the compensations, not the steps the code would take next.
            raise Cancelled("cancel requested")
        if record is not None and record.key != key:
            raise NonDeterminismError(seq=seq, recorded=record.key, requested=key)
        if self._lease.lost.is_set():
            raise LeaseLost(f"run {self.run_id}: lease lost")
        if self._lease.stopping.is_set():
            raise Released("worker shutting down")

    def _check_all_replayed(self) -> None:
        """A run that returns before the positions its history holds took another path than
        it recorded (steps removed from the end of the code): that is a changed workflow too."""
        if self._seq <= self._last_seq:
            recorded = self._history[min(k for k in self._history if k >= self._seq)]
            raise NonDeterminismError(
                seq=recorded.seq, recorded=recorded.key, requested="(the workflow returned)"
            )

    @staticmethod
    def _raise_recorded(key: str, error: dict) -> NoReturn:
        cls = REPLAYED.get(error.get("code"))
        if cls is not None:
            raise cls(error.get("message", ""))
        raise StepFailed(key, error, retryable=error.get("retryable", True))

    def _new_step(self, seq: int, key: str, kind: str, status: str, **fields) -> Step:
        return Step.objects.create(
            run_id=self._lease.run_id,
            seq=seq,
            key=key,
            kind=kind,
            status=status,
            idempotency_key=f"{self.run_id}:{key}",
            run_attempt=self.attempt,
            started_at=timezone.now(),
            **fields,
        )

    def _remember(self, key: str, compensate: Callable | None, output: Any) -> Any:
        if compensate is not None:
            self._compensations.append((key, compensate, output))
        return output

    def _compensate(self) -> list[str]:
        """Run the compensations of completed steps, newest first, each one a step itself."""
        self._compensating = True
        done = []
        for key, undo, output in reversed(self._compensations):
            self._run_step(f"undo:{key}", undo, (output,), {}, internal=True)
            done.append(key)
        return done

    def _check_approval(self, decision: Decision | None) -> None:
        if decision is None:
            return
        approval_id = decision.approval_id if isinstance(decision, Decision) else int(decision)
        stands = ApprovalRequest.objects.filter(
            pk=approval_id, run_id__in=self._fork_lineage(), status=ApprovalStatus.APPROVED
        ).exists()
        if not stands:
            raise ApprovalRevoked(
                f"approval #{approval_id} no longer stands; the step did not start"
            )

    def _fork_lineage(self) -> list:
        """This run and the runs it was forked from: a fork replays their approvals."""
        chain, origin = [self._lease.run_id], self._forked_from
        while origin is not None:
            chain.append(origin)
            origin = Run.objects.filter(pk=origin).values_list("forked_from_id", flat=True)[0]
        return chain

    def _invoke(self, key: str, idem: str, fn: Callable, args: tuple, kwargs: dict) -> Any:
        self._in_step, self._idempotency_key = key, idem
        try:
            return self._await(fn(*args, **kwargs))
        finally:
            self._in_step = self._idempotency_key = None

    def _await(self, value: Any) -> Any:
        """Run an `async def` step (or an async client's call) to completion: on the
        workflow's event loop for an async workflow; otherwise on one loop kept for the whole
        execution, because an async client's pooled connection belongs to the loop that opened
        it (on a fresh loop per call, a call goes out on the old connection and its answer is
        lost with the closed loop: sent, paid, then sent again)."""
        if not inspect.isawaitable(value):
            return value

        async def wait():
            return await value

        if self._loop is not None:
            return asyncio.run_coroutine_threadsafe(wait(), self._loop).result()
        if self._runner is None:
            self._runner = asyncio.Runner()
        return self._runner.run(wait())

    def _close_loop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            runner.close()

    def _write(
        self, step_pk: int, key: str, event: str, payload: dict, *, progress=False, **fields
    ):
        fenced_write(
            self._lease, (event, key, payload), update_step=(step_pk, fields), progress=progress
        )

    def _call(
        self, step_pk, key, idem, fn, args, kwargs, policy: RetryPolicy, attempt, held, approval
    ):
        tries = 0
        while True:
            tries += 1
            try:
                value = self._invoke(key, idem, fn, args, kwargs)
                usage = None
                if isinstance(value, Metered):
                    value, usage = value.value, value.usage
                output = to_json(value, what=f"the output of step {key!r}")
            except ControlFlow:
                raise
            except Exception as exc:
                if _retryable(exc) and policy.retries(exc) and tries < policy.max_attempts:
                    # A provider's Retry-After wins over the policy's backoff.
                    delay = llm_engine.retry_after(exc)
                    delay = policy.delay(tries) if delay is None else min(delay, MAX_RETRY_AFTER)
                    attempt += 1
                    payload = {"attempt": attempt, "delay_s": round(delay, 3), "error": _brief(exc)}
                    self._sleep(delay)
                    try:
                        # A retry is a new start: the halt, the cancel, the budget and the
                        # approval are checked again, in the statement that records it.
                        self._restart(step_pk, key, payload, attempt, held, approval)
                    except ApprovalRevoked as revoked:
                        self._record_failure(step_pk, None, key, idem, None, attempt, revoked, held)
                    continue
                self._record_failure(step_pk, None, key, idem, None, attempt, exc, held)
            else:
                fields = {"status": StepStatus.COMPLETED, "output": output}
                self._settle_step(step_pk, key, {"attempt": attempt}, fields, usage, held)
                return output

    def _restart(self, step_pk, key, payload, attempt: int, held, approval) -> None:
        fields = {"attempt": attempt}
        if approval is None:
            fenced_write(
                self._lease, ("step.retrying", key, payload), update_step=(step_pk, fields),
                held=held.reserved, **self._start,
            )  # fmt: skip
            return
        with transaction.atomic():
            event_seq = fence(self._lease, held=held.reserved, **self._start)
            self._check_approval(approval)
            Step.objects.filter(pk=step_pk).update(**fields)
            append_event(self._lease.run_id, event_seq, "step.retrying", key, **payload)

    def _settle_step(self, step_pk, key, payload, fields, usage: Usage | None, held) -> None:
        """Finish a step: its row, its event and, if it spent or held anything, the budgets."""
        fields["finished_at"] = timezone.now()
        event = "step.completed" if fields["status"] == StepStatus.COMPLETED else "step.failed"
        # A step finished is progress (the poison-run count restarts), except the
        # compensations of a run being given up: they must not make it look healthy again.
        progress = self._give_up is None
        if usage is None and not any(held.reserved):
            fenced_write(
                self._lease, (event, key, payload), update_step=(step_pk, fields), progress=progress
            )
            return
        usage = usage or Usage()
        spend = Spend(usage.micros, usage.tokens_in, usage.tokens_out, *held.reserved)
        fields |= {
            "tokens_in": usage.tokens_in,
            "tokens_out": usage.tokens_out,
            "cost_micros": usage.micros,
            "reserved_micros": 0,
            "reserved_tokens": 0,
            "reserved_scopes": [],
        }
        if usage.tokens or usage.micros:
            payload = {**payload, "tokens": usage.tokens, "usd": str(usage.usd)}
        with transaction.atomic():
            fenced_write(
                self._lease, (event, key, payload), update_step=(step_pk, fields),
                progress=progress, spend=spend,
            )  # fmt: skip
            warnings = settle_shared(
                scopes_for(self.workflow), usage, held.shared, held.reserved, held.day
            )
            ratio = settings.STEPGUARD_BUDGET_WARN_AT
            near = Q(budget_micros__isnull=False, cost_micros__gte=F("budget_micros") * ratio) | Q(
                budget_tokens__isnull=False,
                tokens_in__gte=F("budget_tokens") * ratio - F("tokens_out"),
            )
            if Run.objects.filter(near, pk=self._lease.run_id, budget_warned=False).update(
                budget_warned=True
            ):
                warnings.append("run")
            if warnings:
                first = fence(self._lease, len(warnings))
                for offset, label in enumerate(warnings):
                    append_event(
                        self._lease.run_id, first + offset, "budget.warning", key,
                        budget=label, threshold=ratio,
                    )  # fmt: skip

    def _record_failure(
        self, step_pk, seq, key, idem, kind, attempt, exc: Exception, held=None
    ) -> NoReturn:
        error = {**error_record(exc), "retryable": _retryable(exc)}
        fields = {
            "status": StepStatus.FAILED,
            "error": error,
            "attempt": attempt,
            "run_attempt": self.attempt,
        }
        payload = {"attempt": attempt, "error": _brief(exc)}
        if step_pk is not None:
            self._settle_step(step_pk, key, payload, fields, None, held or _Held())
        else:
            now = timezone.now()
            insert = {"seq": seq, "key": key, "kind": kind, "idempotency_key": idem}
            insert |= {"started_at": now, "finished_at": now}
            fenced_write(
                self._lease, ("step.failed", key, payload), insert_step={**insert, **fields}
            )
        if isinstance(exc, StepguardError) and exc.code in REPLAYED:
            raise exc
        raise StepFailed(key, error, retryable=error["retryable"]) from exc

    def _note_retry(self, key: str, tries: int, exc: Exception, policy: RetryPolicy) -> None:
        delay = policy.delay(tries)
        with transaction.atomic():
            event_seq = fence(self._lease)
            append_event(
                self._lease.run_id,
                event_seq,
                "step.retrying",
                key,
                attempt=tries + 1,
                delay_s=round(delay, 3),
                error=_brief(exc),
            )
        self._sleep(delay)

    def _reconcile(self, record: Step, reconcile: Callable[[str], Any], idem: str) -> Any:
        # An exception here propagates unrecorded: the step stays `started` (still ambiguous),
        # so the next attempt of the run asks reconcile again rather than blindly re-sending.
        found = self._invoke(record.key, idem, reconcile, (idem,), {})
        if found is NOT_FOUND:
            return NOT_FOUND
        output = to_json(found, what=f"the reconciled output of step {record.key!r}")
        self._settle_step(
            record.pk,
            record.key,
            {"attempt": record.attempt, "recovered": Recovery.RECONCILED},
            {"status": StepStatus.COMPLETED, "output": output, "recovered": Recovery.RECONCILED},
            None,
            _Held.of(record),
        )
        return output

    def _ask(self, record: Step, idem: str) -> Any:
        """The third ambiguous-outcome policy: a person says what happened."""
        label = f"{record.key}@attempt-{record.attempt}"
        request = (
            ApprovalRequest.objects.select_related("decided_by")
            .filter(run_id=self._lease.run_id, step_key=label)
            .first()
        )
        if request is not None and request.status != ApprovalStatus.PENDING:
            # Decided: the step leaves `started` like any other, giving back what it held.
            if request.resolution == Resolution.RESEND:
                return NOT_FOUND
            held = _Held.of(record)
            if request.resolution == Resolution.HAPPENED:
                self._settle_step(
                    record.pk,
                    record.key,
                    {"recovered": Recovery.CONFIRMED, "approval_id": request.pk},
                    {
                        "status": StepStatus.COMPLETED,
                        "output": request.resolution_output,
                        "recovered": Recovery.CONFIRMED,
                    },
                    None,
                    held,
                )
                return request.resolution_output
            who = request.decided_by.get_username() if request.decided_by else "an operator"
            failure = OperatorFailed(f"{who} failed the run at ambiguous step {record.key!r}")
            self._record_failure(
                record.pk, None, record.key, idem, None, record.attempt, failure, held
            )
        with transaction.atomic():
            event_seq, _ = self._wait_fence()
            if request is None:
                request = ApprovalRequest.objects.create(
                    run_id=self._lease.run_id,
                    step_key=label,
                    kind=ApprovalKind.AMBIGUOUS,
                    action=f"resolve step {record.key}"[:200],
                    summary=(
                        "The worker running this step died mid-call: the side effect may or may "
                        "not have happened. Say whether it happened (and what it returned), "
                        "re-send it with the same idempotency key, or fail the run."
                    ),
                    payload={
                        "idempotency_key": idem,
                        "input": record.input,
                        "attempt": record.attempt,
                    },
                )
                append_event(
                    self._lease.run_id, event_seq, "approval.requested", record.key,
                    approval_id=request.pk, kind=ApprovalKind.AMBIGUOUS,
                )  # fmt: skip
            else:
                append_event(
                    self._lease.run_id, event_seq, "approval.waiting", record.key,
                    approval_id=request.pk,
                )  # fmt: skip
            self._suspend(None)
        raise Suspended(f"waiting for a person to resolve step {record.key!r}")

    def _append_events(self, first_seq: int, events: list[tuple[str, str, dict]]) -> None:
        """Write several events; the fence already reserved `first_seq` for the first one."""
        seqs = [first_seq]
        if len(events) > 1:
            more = fence(self._lease, len(events) - 1)
            seqs += range(more, more + len(events) - 1)
        for seq, (type, key, payload) in zip(seqs, events, strict=False):
            append_event(self._lease.run_id, seq, type, key, **payload)

    def _wait_fence(self) -> tuple[int, datetime]:
        return fence(self._lease, progress=True, **self._start), timezone.now()

    def _settle(self, record: Step, event_seq: int, now, *, output=None, error=None, **payload):
        """Finish a waiting step (inside the caller's transaction)."""
        if error is None:
            Step.objects.filter(pk=record.pk).update(
                status=StepStatus.COMPLETED, output=output, finished_at=now
            )
            append_event(self._lease.run_id, event_seq, "step.completed", record.key, **payload)
        else:
            Step.objects.filter(pk=record.pk).update(
                status=StepStatus.FAILED,
                error={**error.as_record(), "retryable": error.retryable},
                run_attempt=self.attempt,
                finished_at=now,
            )
            append_event(
                self._lease.run_id, event_seq, "step.failed", record.key, error=_brief(error)
            )

    def _suspend(self, wake_at: datetime | None) -> None:
        """Give the run up until `wake_at` (or until something wakes it), inside the caller's
        transaction: the run row is already locked by the fence."""
        Run.objects.filter(pk=self._lease.run_id).update(
            status=RunStatus.WAITING, wake_at=wake_at, worker=None, lease_until=None
        )

    def _timer(self, key: str, deadline: Callable[[datetime], datetime]) -> None:
        key, seq, record = self._enter(key)
        if record is not None and record.status == StepStatus.COMPLETED:
            return
        with transaction.atomic():
            event_seq, now = self._wait_fence()
            if record is None:
                when = deadline(now)
                record = self._new_step(
                    seq, key, StepKind.SLEEP, StepStatus.WAITING,
                    input={"until": when.isoformat()}, wake_at=when,
                )  # fmt: skip
            if record.wake_at <= now:
                Step.objects.filter(pk=record.pk).update(
                    status=StepStatus.COMPLETED, finished_at=now
                )
                append_event(
                    self._lease.run_id,
                    event_seq,
                    "timer.fired",
                    key,
                    wake_at=record.wake_at.isoformat(),
                )
                return
            append_event(
                self._lease.run_id, event_seq, "timer.set", key, wake_at=record.wake_at.isoformat()
            )
            self._suspend(record.wake_at)
        raise Suspended(f"sleeping until {record.wake_at.isoformat()}")

    def _sleep(self, seconds: float) -> None:
        """A retry delay that a lost lease or a shutdown cuts short."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if self._lease.lost.wait(min(left, 0.1)):
                raise LeaseLost(f"run {self.run_id}: lease lost during a retry delay")
            if self._lease.stopping.is_set():
                raise Released("worker shutting down during a retry delay")


def _finish(lease: Lease, event: str, payload: dict, *, parent_id=None, **fields) -> None:
    with transaction.atomic():
        if fields.get("status") in TERMINAL_STATUSES:
            release_holds(lease.run_id)
            fields |= {"reserved_micros": 0, "reserved_tokens": 0}
        event_seq = fence(lease, progress=True)
        Run.objects.filter(pk=lease.run_id).update(**fields)
        append_event(lease.run_id, event_seq, event, **payload)
        if parent_id is not None and fields.get("status") in TERMINAL_STATUSES:
            run_event(
                parent_id,
                "child.finished",
                wake=True,
                child=str(lease.run_id),
                status=fields["status"],
            )


def _give_back(
    lease: Lease,
    event: str,
    payload: dict,
    *,
    status: str,
    wake_at: datetime | None,
    over: OverBudget | None = None,
    **fields,
) -> str:
    """Give the run up without ending it (paused, released, retrying); return its new status.

    Where it goes is decided in the one statement that writes it, against the holds and
    budgets as they are then, not as the worker saw them: a hold covering the run makes it
    `halted` whatever the caller asked; an over-budget pause whose limit was changed since the
    refusal makes it `pending` (the next start re-checks). The rows those decisions read are
    share-locked first, so an unhalt or a budget raise committed at the same moment is either
    seen here or sees the paused run and resumes it: never lost.
    """
    with transaction.atomic():
        event_seq = fence(lease, progress=True)
        run = Run.objects.only("id", "parent_id", "workflow").get(pk=lease.run_id)
        holds.lock_holds(run)

        def moment(value: datetime | None):
            return Cast(Value(value), output_field=DateTimeField())  # a typed NULL too

        status_cases = [When(holds.covered(), then=Value(RunStatus.HALTED))]
        wake_cases = [When(holds.covered(), then=moment(None))]
        if over is not None:
            still = _still_over(run, over)
            status_cases.append(When(still, then=Value(RunStatus.OVER_BUDGET)))
            wake = None if over.budget == "run" else next_day_start()
            wake_cases.append(When(still, then=moment(wake)))
        Run.objects.filter(pk=lease.run_id).update(
            status=Case(*status_cases, default=Value(status)),
            wake_at=Case(*wake_cases, default=moment(wake_at)),
            worker=None,
            lease_until=None,
            **fields,
        )
        outcome = Run.objects.filter(pk=lease.run_id).values_list("status", flat=True)[0]
        if outcome == RunStatus.HALTED and event in ("run.halted", "budget.exceeded"):
            hold = holds.holds_on(run)[0]
            event, payload = (
                "run.halted",
                {"scope": hold.scope, "by": hold.by, "reason": hold.reason},
            )
        elif outcome == RunStatus.PENDING and event in ("run.halted", "budget.exceeded"):
            lifted = "hold was lifted" if event == "run.halted" else "budget was changed"
            event, payload = "run.requeued", {"reason": f"the {lifted} as the run paused"}
        elif outcome == RunStatus.HALTED:
            payload = {**payload, "halted": [h.as_json() for h in holds.holds_on(run)]}
        append_event(lease.run_id, event_seq, event, **payload)
    if outcome == RunStatus.PENDING:
        from runs.engine.wakeup import notify_runnable

        transaction.on_commit(notify_runnable)
    return outcome


def _still_over(run: Run, stop: OverBudget) -> Q:
    """The condition under which an over-budget pause still stands: the limit that refused
    the step is unchanged (a run's own in the statement; a shared one under its row lock)."""
    if stop.budget == "run":
        column = "budget_micros" if stop.unit == "micro-USD" else "budget_tokens"
        return Q(**{column: stop.limit})
    scope = GLOBAL if stop.budget == "global daily" else run.workflow
    column = "daily_budget_micros" if stop.unit == "micro-USD" else "daily_budget_tokens"
    current = Policy.objects.filter(scope=scope).values_list(column, flat=True).first()
    return Q(pk=run.pk) if current == stop.limit else ~Q(pk=run.pk)


def release(lease: Lease, reason: str) -> bool:
    """Give the run back to the queue now (SIGTERM), bumping the epoch so we cannot write again.
    A run a hold covers goes to `halted` instead of `pending`."""
    try:
        _give_back(
            lease,
            "run.released",
            {"reason": reason},
            status=RunStatus.PENDING,
            wake_at=timezone.now(),
            lease_epoch=F("lease_epoch") + 1,
        )
    except (LeaseLost, Cancelled):
        return False
    return True


def execute(run: Run, lease: Lease) -> str:
    """Run one claimed run until it completes, fails, waits, is cancelled or released.

    Returns what happened: completed, failed, retrying, waiting, cancelled, released, lost,
    disconnected (the database connection broke: the caller may wait for it and execute the
    run again under the same lease) or abandoned (any other database error: lease recovery
    resumes it). Costs one query to load every checkpoint, then at most two transactions per
    new step.
    """
    try:
        checkpoints = Step.objects.filter(run_id=run.id).order_by("seq").only(*REPLAY_FIELDS)
        history = {s.seq: s for s in checkpoints}
    except DatabaseError as exc:
        return _database_error(run, exc, "loading checkpoints")
    ctx = RunContext(run, history, lease)
    if run.recoveries >= settings.STEPGUARD_MAX_RECOVERIES:
        started = next((s.key for s in history.values() if s.status == StepStatus.STARTED), None)
        ctx._give_up = WorkerLost(
            f"its worker was lost {run.recoveries} times in a row without progress"
            + (f", each time during step {started!r}" if started else "")
            + " (STEPGUARD_MAX_RECOVERIES)"
        )
    try:
        definition = registry.get(run.workflow, run.version)
        if inspect.iscoroutinefunction(definition.fn):
            result = _run_async(definition.fn, ctx, run.input)
        else:
            result = _run_sync(definition.fn, ctx, run.input)
        ctx._check_all_replayed()
        output = to_json(result, what=f"the result of workflow {run.workflow!r}")
    except Suspended:
        return "waiting"
    except LeaseLost:
        log.warning("run %s: lease lost; another worker owns it now, stopping here", run.id)
        return "lost"
    except Released:
        return "released" if release(lease, "worker shutting down") else "lost"
    except Cancelled:
        return _cancelled(run, ctx, lease)
    except (Halted, OverBudget) as stop:
        return _pause(run, lease, stop)
    except DatabaseError as exc:
        return _database_error(run, exc, "writing a checkpoint")
    except Exception as exc:
        return _fail(run, ctx, lease, exc)
    try:
        _finish(
            lease,
            "run.completed",
            {},
            parent_id=run.parent_id,
            status=RunStatus.COMPLETED,
            output=output,
            error=None,
            finished_at=timezone.now(),
            worker=None,
            lease_until=None,
        )
    except LeaseLost:
        return "lost"
    return "completed"


def _database_error(run: Run, exc: DatabaseError, doing: str) -> str:
    """A checkpoint read or write failed, so nothing of it is recorded. A broken connection
    (the server restarting) is the caller's to wait out; anything else is logged in full and
    left to lease recovery, which resumes the run through the normal claim path."""
    if is_disconnect(exc):
        log.debug("run %s: connection lost %s: %s", run.id, doing, exc)
        return "disconnected"
    log.exception("run %s: database error %s, abandoning the run to lease recovery", run.id, doing)
    return "abandoned"


class AsyncRunContext:
    """What an `async def` workflow receives: the same calls as RunContext, awaited.

    The checkpoint writes run on one database thread of their own while the workflow's event
    loop stays free for async steps (AsyncOpenAI, AsyncAnthropic, async tools), so both kinds
    of workflow share one engine and one set of semantics.
    """

    def __init__(self, ctx: RunContext, loop: asyncio.AbstractEventLoop, db: ThreadPoolExecutor):
        self._ctx, self._loop, self._db = ctx, loop, db
        self.run_id, self.workflow, self.version = ctx.run_id, ctx.workflow, ctx.version
        self.input, self.attempt = ctx.input, ctx.attempt

    @property
    def idempotency_key(self) -> str:
        return self._ctx.idempotency_key


def _bridge(name: str):
    async def method(self, *args, **kwargs):
        call = functools.partial(getattr(self._ctx, name), *args, **kwargs)
        return await self._loop.run_in_executor(self._db, call)

    method.__name__ = name
    method.__doc__ = getattr(RunContext, name).__doc__
    return method


for _name in (
    "step", "transaction", "now", "random", "uuid", "patched", "sleep", "sleep_until",
    "wait_for_event", "approval", "child", "children", "llm", "tool", "agent_loop",
):  # fmt: skip
    setattr(AsyncRunContext, _name, _bridge(_name))


def _run_async(fn: Callable, ctx: RunContext, input: Any) -> Any:
    db = ThreadPoolExecutor(1, thread_name_prefix="stepguard-db")

    async def main():
        ctx._loop = asyncio.get_running_loop()
        return await fn(AsyncRunContext(ctx, ctx._loop, db), input)

    try:
        return asyncio.run(main())
    finally:
        ctx._loop = None
        db.submit(lambda: connection.close()).result()  # the database thread's own connection
        db.shutdown()


def _run_sync(fn: Callable, ctx: RunContext, input: Any) -> Any:
    try:
        return fn(ctx, input)
    finally:
        ctx._close_loop()  # the loop its async steps ran on, if any


def _run_compensations(ctx: RunContext) -> tuple[list[str], dict | None]:
    """Returns the undone step keys and, if an undo failed, its error. Control flow passes."""
    try:
        return ctx._compensate(), None
    except Exception as exc:
        return [], error_record(exc)
    finally:
        ctx._close_loop()


def _pause(run: Run, lease: Lease, stop: Halted | OverBudget) -> str:
    """Park a run that must not take its next step: halted by a hold, or over budget.

    It holds no worker; only an unhalt or a changed budget makes it runnable again (and if
    either landed while we were pausing, `_give_back` sees it and requeues the run)."""
    try:
        if isinstance(stop, Halted):
            payload = {"scope": stop.scope, "by": stop.by, "reason": stop.reason}
            # `pending` unless a hold still covers the run when the pause is written.
            return _give_back(
                lease, "run.halted", payload, status=RunStatus.PENDING, wake_at=timezone.now()
            )
        payload = {
            "budget": stop.budget,
            "unit": stop.unit,
            "limit": stop.limit,
            "spent": stop.spent,
            "estimate": stop.estimate,
        }
        outcome = _give_back(
            lease, "budget.exceeded", payload, status=RunStatus.PENDING,
            wake_at=timezone.now(), over=stop,
        )  # fmt: skip
        if outcome == RunStatus.OVER_BUDGET:
            log.warning("run %s paused: %s", run.id, stop)
        return outcome
    except LeaseLost:
        return "lost"


def _cancelled(run: Run, ctx: RunContext, lease: Lease) -> str:
    ctx._cancel_requested = True
    try:
        undone, failure = _run_compensations(ctx)
        who = Run.objects.filter(pk=run.pk).values("cancel_requested_by", "cancel_reason").first()
        if failure is not None:
            _finish(
                lease,
                "run.failed",
                {"reason": "a compensation failed after a cancel", "error": failure["message"]},
                parent_id=run.parent_id,
                status=RunStatus.FAILED,
                error={**failure, "reason": "a compensation failed after a cancel"},
                finished_at=timezone.now(),
                worker=None,
                lease_until=None,
            )
            return "failed"
        _finish(
            lease,
            "run.cancelled",
            {
                "by": who["cancel_requested_by"],
                "reason": who["cancel_reason"],
                "compensated": undone,
            },
            parent_id=run.parent_id,
            status=RunStatus.CANCELLED,
            finished_at=timezone.now(),
            worker=None,
            lease_until=None,
        )
    except LeaseLost:
        return "lost"
    except Released:
        return "released" if release(lease, "worker shutting down") else "lost"
    except (Halted, OverBudget) as stop:
        return _pause(run, lease, stop)
    return "cancelled"


def _fail(run: Run, ctx: RunContext, lease: Lease, exc: Exception) -> str:
    error = error_record(exc)
    retryable = getattr(exc, "retryable", True)
    try:
        if retryable and run.attempt < run.max_attempts:
            base = settings.STEPGUARD_RUN_RETRY_BASE_SECONDS * 2 ** (run.attempt - 1)
            delay = min(base, 300) * random.uniform(0.8, 1.2)
            wake_at = timezone.now() + timedelta(seconds=delay)
            outcome = _give_back(
                lease,
                "run.retrying",
                {"attempt": run.attempt + 1, "wake_at": wake_at.isoformat(), "error": _brief(exc)},
                status=RunStatus.PENDING,
                wake_at=wake_at,
                attempt=F("attempt") + 1,
                error=error,
            )
            if outcome == RunStatus.HALTED:
                return "halted"
            log.info(
                "run %s: attempt %s failed (%s); retrying in %.1fs", run.id, run.attempt, exc, delay
            )
            return "retrying"
        reason = "not retryable" if not retryable else f"{run.max_attempts} attempts used"
        # After a non-determinism error the recorded positions no longer match the code, so
        # compensating would itself misfire: leave that to a person.
        if isinstance(exc, NonDeterminismError):
            undone, failure = [], None
        else:
            undone, failure = _run_compensations(ctx)
        if failure is not None:
            error["compensation_error"] = failure
        _finish(
            lease,
            "run.failed",
            {"error": _brief(exc), "reason": reason, "compensated": undone},
            parent_id=run.parent_id,
            status=RunStatus.FAILED,
            error={**error, "reason": reason},
            finished_at=timezone.now(),
            worker=None,
            lease_until=None,
        )
    except LeaseLost:
        return "lost"
    except Released:
        return "released" if release(lease, "worker shutting down") else "lost"
    except Cancelled:
        return _cancelled(run, ctx, lease)
    except (Halted, OverBudget) as stop:
        return _pause(run, lease, stop)
    log.warning("run %s failed (%s): %s", run.id, reason, exc)
    return "failed"
