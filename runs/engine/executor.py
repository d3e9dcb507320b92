"""Executing one claimed run: replay from checkpoints, write new ones, fenced by lease_epoch.

A worker runs the workflow function from the top. Each step takes the next `seq`; a completed
checkpoint hands back its stored output and the function never runs. Every write goes through
`_fence`, one UPDATE of the run row that checks the lease epoch, allocates event sequence
numbers and row-locks the run for the rest of the transaction, so a worker whose lease was
taken over can never write again.
"""

from __future__ import annotations

import logging
import random
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from uuid import UUID

from django.conf import settings
from django.db import DatabaseError, connection, transaction
from django.db.models import F
from django.utils import timezone

from runs.engine import registry
from runs.engine.serialization import describe_input, to_json
from runs.errors import (
    ControlFlow,
    LeaseLost,
    NonDeterminismError,
    OutputNotSerializable,
    Released,
    StepFailed,
    StepguardError,
    StepMisuse,
)
from runs.models import Event, Recovery, Run, RunStatus, Step, StepKind, StepStatus

log = logging.getLogger("stepguard.executor")

MAX_KEY_LENGTH = 200


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


@dataclass
class Lease:
    """A worker's hold on one run; `lost` is set by the heartbeat or a refused write."""

    run_id: UUID
    epoch: int
    stopping: threading.Event = field(default_factory=threading.Event)
    lost: threading.Event = field(default_factory=threading.Event)


def error_record(exc: BaseException) -> dict:
    if isinstance(exc, StepguardError):
        record = exc.as_record()
    else:
        record = {"code": "exception", "type": type(exc).__name__, "message": str(exc)}
    record["traceback"] = "".join(traceback.format_exception(exc, limit=15))[-4000:]
    return record


def _fence_sql(progress: bool) -> str:
    extra = ", recoveries = 0" if progress else ""
    return (
        f"UPDATE {Run._meta.db_table} SET event_seq = event_seq + %s{extra} "
        "WHERE id = %s AND lease_epoch = %s AND status = %s RETURNING event_seq"
    )


_FENCE = _fence_sql(False)
_FENCE_PROGRESS = _fence_sql(True)


def fence(lease: Lease, events: int = 1, *, progress: bool = False) -> int:
    """Check we still own the run and reserve `events` event seqs; return the first.

    Must run inside a transaction: the UPDATE row-locks the run until commit, so a concurrent
    claim (which bumps the epoch) is ordered before or after this whole write, never inside it.
    """
    pk = Run._meta.pk.get_db_prep_value(lease.run_id, connection)
    with connection.cursor() as cursor:
        cursor.execute(
            _FENCE_PROGRESS if progress else _FENCE, [events, pk, lease.epoch, RunStatus.RUNNING]
        )
        row = cursor.fetchone()
    if row is None:
        lease.lost.set()
        raise LeaseLost(f"run {lease.run_id}: lease epoch {lease.epoch} is no longer current")
    return row[0] - events + 1


def append_event(run_id, seq: int, type: str, step_key: str = "", **payload) -> Event:
    return Event.objects.create(
        run_id=run_id,
        seq=seq,
        type=type,
        step_key=step_key,
        payload=payload,
        created_at=timezone.now(),
    )


class RunContext:
    """What a workflow function receives: the only door to durable steps.

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

    # -- public API -------------------------------------------------------------------------

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
        kind: str = StepKind.CALL,
        **kwargs: Any,
    ) -> Any:
        """Run `fn(*args, **kwargs)` once for this run and checkpoint its JSON output.

        On replay a completed step returns its recorded output without calling `fn`. A key
        used again in the same execution becomes `key#2`, `key#3`... A step found `started`
        (its worker died mid-call) is re-sent with the same idempotency key, or, if
        `reconcile` is given, `reconcile(idempotency_key)` is asked first: it returns the
        outcome it found, or `NOT_FOUND` to have the call sent again. `retry`, `reconcile`
        and `kind` are options of the step, never passed to `fn`.
        """
        key, seq, record = self._enter(key)
        if record is not None and record.status == StepStatus.COMPLETED:
            return record.output
        policy = retry or DEFAULT_RETRY
        idem = f"{self.run_id}:{key}"
        ambiguous = record is not None and record.status == StepStatus.STARTED
        if ambiguous and reconcile is not None:
            found = self._reconcile(record, reconcile, idem)
            if found is not NOT_FOUND:
                return found
        if record is None:
            with transaction.atomic():
                event_seq = fence(self._lease)
                now = timezone.now()
                record = Step.objects.create(
                    run_id=self._lease.run_id,
                    seq=seq,
                    key=key,
                    kind=kind,
                    status=StepStatus.STARTED,
                    input=describe_input(args, kwargs),
                    idempotency_key=idem,
                    run_attempt=self.attempt,
                    started_at=now,
                )
                append_event(self._lease.run_id, event_seq, "step.started", key, attempt=1)
            attempt = 1
        else:
            attempt = record.attempt + 1
            fields: dict[str, Any] = {
                "status": StepStatus.STARTED,
                "attempt": attempt,
                "run_attempt": self.attempt,
                "error": None,
                "finished_at": None,
            }
            payload: dict[str, Any] = {"attempt": attempt}
            if ambiguous:
                fields["recovered"] = Recovery.RESENT
                payload["recovered"] = Recovery.RESENT
            self._write(record.pk, key, "step.started", payload, **fields)
        return self._call(record.pk, key, idem, fn, args, kwargs, policy, attempt)

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
                    event_seq = fence(self._lease, progress=True)
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
                retry_it = not isinstance(exc, OutputNotSerializable) and policy.retries(exc)
                if retry_it and tries < policy.max_attempts:
                    self._note_retry(key, tries, exc, policy)
                    continue
                step_pk = record.pk if record is not None else None
                self._record_failure(step_pk, seq, key, idem, StepKind.TRANSACTION, tries, exc)

    def now(self):
        """The current time, recorded once: replay sees the same instant."""
        from datetime import datetime

        return datetime.fromisoformat(self.step("now", lambda: timezone.now().isoformat()))

    def random(self) -> float:
        """A random float in [0, 1), recorded once."""
        return self.step("random", random.random)

    def uuid(self) -> UUID:
        """A random UUID, recorded once."""
        import uuid

        return UUID(self.step("uuid", lambda: str(uuid.uuid4())))

    # -- internals --------------------------------------------------------------------------

    def _enter(self, key: str) -> tuple[str, int, Step | None]:
        if self._in_step is not None:
            raise StepMisuse(
                f"step {key!r} was called inside step {self._in_step!r}; steps do not nest"
            )
        if not isinstance(key, str) or not key or "#" in key or len(key) > MAX_KEY_LENGTH:
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
        record = self._history.get(seq)
        if record is not None:
            if record.key != key:
                raise NonDeterminismError(seq=seq, recorded=record.key, requested=key)
            if record.status == StepStatus.FAILED and record.run_attempt == self.attempt:
                error = record.error or {}
                raise StepFailed(key, error, retryable=error.get("retryable", True))
            if record.status == StepStatus.COMPLETED:
                return key, seq, record
        if self._lease.lost.is_set():
            raise LeaseLost(f"run {self.run_id}: lease lost")
        if self._lease.stopping.is_set():
            raise Released("worker shutting down")
        return key, seq, record

    def _invoke(self, key: str, idem: str, fn: Callable, args: tuple, kwargs: dict) -> Any:
        self._in_step, self._idempotency_key = key, idem
        try:
            return fn(*args, **kwargs)
        finally:
            self._in_step = self._idempotency_key = None

    def _write(
        self, step_pk: int, key: str, event: str, payload: dict, *, progress=False, **fields
    ):
        with transaction.atomic():
            event_seq = fence(self._lease, progress=progress)
            Step.objects.filter(pk=step_pk).update(**fields)
            append_event(self._lease.run_id, event_seq, event, key, **payload)

    def _call(self, step_pk, key, idem, fn, args, kwargs, policy: RetryPolicy, attempt: int):
        tries = 0
        while True:
            tries += 1
            try:
                value = self._invoke(key, idem, fn, args, kwargs)
                output = to_json(value, what=f"the output of step {key!r}")
            except ControlFlow:
                raise
            except Exception as exc:
                retry_it = not isinstance(exc, OutputNotSerializable) and policy.retries(exc)
                if retry_it and tries < policy.max_attempts:
                    delay = policy.delay(tries)
                    attempt += 1
                    self._write(
                        step_pk,
                        key,
                        "step.retrying",
                        {"attempt": attempt, "delay_s": round(delay, 3), "error": _brief(exc)},
                        attempt=attempt,
                    )
                    self._sleep(delay)
                    continue
                self._record_failure(step_pk, None, key, idem, None, attempt, exc)
            else:
                self._write(
                    step_pk,
                    key,
                    "step.completed",
                    {"attempt": attempt},
                    progress=True,
                    status=StepStatus.COMPLETED,
                    output=output,
                    finished_at=timezone.now(),
                )
                return output

    def _record_failure(self, step_pk, seq, key, idem, kind, attempt, exc: Exception):
        retryable = not isinstance(exc, OutputNotSerializable) and not (
            isinstance(exc, StepguardError) and not exc.retryable
        )
        error = {**error_record(exc), "retryable": retryable}
        fields = {
            "status": StepStatus.FAILED,
            "error": error,
            "attempt": attempt,
            "run_attempt": self.attempt,
            "finished_at": timezone.now(),
        }
        payload = {"attempt": attempt, "error": _brief(exc)}
        if step_pk is not None:
            self._write(step_pk, key, "step.failed", payload, **fields)
        else:
            with transaction.atomic():
                event_seq = fence(self._lease)
                Step.objects.create(
                    run_id=self._lease.run_id,
                    seq=seq,
                    key=key,
                    kind=kind,
                    idempotency_key=idem,
                    started_at=fields["finished_at"],
                    **fields,
                )
                append_event(self._lease.run_id, event_seq, "step.failed", key, **payload)
        raise StepFailed(key, error, retryable=retryable) from exc

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
        self._write(
            record.pk,
            record.key,
            "step.completed",
            {"attempt": record.attempt, "recovered": Recovery.RECONCILED},
            progress=True,
            status=StepStatus.COMPLETED,
            output=output,
            recovered=Recovery.RECONCILED,
            finished_at=timezone.now(),
        )
        return output

    def _sleep(self, seconds: float) -> None:
        if self._lease.lost.wait(seconds):
            raise LeaseLost(f"run {self.run_id}: lease lost during a retry delay")


def _brief(exc: BaseException) -> dict:
    return {"type": type(exc).__name__, "message": str(exc)[:500]}


def _finish(lease: Lease, event: str, payload: dict, **fields) -> None:
    with transaction.atomic():
        event_seq = fence(lease, progress=True)
        Run.objects.filter(pk=lease.run_id).update(**fields)
        append_event(lease.run_id, event_seq, event, **payload)


def release(lease: Lease, reason: str) -> bool:
    """Give the run back to the queue now (SIGTERM), bumping the epoch so we cannot write again."""
    from runs.engine.wakeup import notify_runnable

    try:
        _finish(
            lease,
            "run.released",
            {"reason": reason},
            status=RunStatus.PENDING,
            worker=None,
            lease_until=None,
            wake_at=timezone.now(),
            lease_epoch=F("lease_epoch") + 1,
        )
    except LeaseLost:
        return False
    transaction.on_commit(notify_runnable)
    return True


def execute(run: Run, lease: Lease) -> str:
    """Run one claimed run until it completes, fails, suspends or is released.

    Returns what happened: completed, failed, retrying, released, lost or abandoned. Costs one
    query to load every checkpoint, then at most two transactions per new step.
    """
    history = {s.seq: s for s in Step.objects.filter(run_id=run.id).order_by("seq")}
    ctx = RunContext(run, history, lease)
    try:
        definition = registry.get(run.workflow, run.version)
        result = definition.fn(ctx, run.input)
        output = to_json(result, what=f"the result of workflow {run.workflow!r}")
    except LeaseLost:
        log.warning("run %s: lease lost; another worker owns it now, stopping here", run.id)
        return "lost"
    except Released:
        return "released" if release(lease, "worker shutting down") else "lost"
    except DatabaseError:
        # Our own checkpoint write failed (database down?): nothing is recorded, the lease will
        # expire and any live worker resumes the run through the normal claim path.
        log.exception("run %s: database error, abandoning the run to lease recovery", run.id)
        return "abandoned"
    except Exception as exc:
        return _fail(run, lease, exc)
    try:
        _finish(
            lease,
            "run.completed",
            {},
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


def _fail(run: Run, lease: Lease, exc: Exception) -> str:
    error = error_record(exc)
    retryable = getattr(exc, "retryable", True)
    try:
        if retryable and run.attempt < run.max_attempts:
            base = settings.STEPGUARD_RUN_RETRY_BASE_SECONDS * 2 ** (run.attempt - 1)
            delay = min(base, 300) * random.uniform(0.8, 1.2)
            wake_at = timezone.now() + timedelta(seconds=delay)
            _finish(
                lease,
                "run.retrying",
                {"attempt": run.attempt + 1, "wake_at": wake_at.isoformat(), "error": _brief(exc)},
                status=RunStatus.PENDING,
                attempt=F("attempt") + 1,
                error=error,
                worker=None,
                lease_until=None,
                wake_at=wake_at,
            )
            log.info(
                "run %s: attempt %s failed (%s); retrying in %.1fs", run.id, run.attempt, exc, delay
            )
            return "retrying"
        reason = "not retryable" if not retryable else f"{run.max_attempts} attempts used"
        _finish(
            lease,
            "run.failed",
            {"error": _brief(exc), "reason": reason},
            status=RunStatus.FAILED,
            error={**error, "reason": reason},
            finished_at=timezone.now(),
            worker=None,
            lease_until=None,
        )
    except LeaseLost:
        return "lost"
    log.warning("run %s failed (%s): %s", run.id, reason, exc)
    return "failed"
