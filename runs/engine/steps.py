"""Steps: call a function once per run, in a transaction, or reconcile and ask after a crash."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import CancelledError
from contextlib import nullcontext
from dataclasses import replace
from datetime import timedelta
from decimal import Decimal
from typing import Any, NoReturn

from django.conf import settings
from django.utils import timezone

from runs import tracing
from runs.approvals.models import ApprovalKind, ApprovalRequest, ApprovalStatus, Resolution
from runs.approvals.services import request_approval
from runs.engine import rates
from runs.engine.aio.threads import StepThread
from runs.engine.budget import Amount, Metered, Reservation, Usage, scopes_for, to_usd
from runs.engine.execution import Execution
from runs.engine.llm import retry_after
from runs.engine.outcomes import Completed, Failed, Position
from runs.engine.records import CURRENT_STEP, NOT_FOUND, Decision, Running, brief
from runs.engine.retry import DEFAULT_RETRY, RetryPolicy
from runs.engine.serialization import describe_input, to_json
from runs.engine.step_deadline import call_by, seconds_of
from runs.engine.step_starts import (
    StartReservation,
    StepCall,
    StepOptions,
    may_have_run,
    possibly_spent,
    start_row,
)
from runs.engine.store import flush
from runs.errors import (
    ApprovalRevoked,
    Cancelled,
    ControlFlow,
    OperatorFailed,
    StepMisuse,
    Suspended,
)
from runs.models import EventType, Recovery, Step, StepKind, StepStatus


class Steps:
    """`ctx.step` and `ctx.transaction`, their retry loop, and the ambiguous-outcome policies."""

    def __init__(self, ex: Execution):
        self.ex = ex
        self.checkpoints = ex.checkpoints
        #: By step: the usage of attempts that failed after the provider answered (paid).
        self._answered: dict[Any, Usage] = {}
        #: By idempotency key: the answer the attempt failing now came after (ModelCalls
        #: records it; the step's retry loop books it).
        self.answered_now: dict[str, Usage | None] = {}
        #: By step: what it holds, the model calls made inside it included (_reserve_in_step).
        self._reserved_in_step: dict[Any, Reservation] = {}

    @property
    def idempotency_key(self) -> str:
        """`<run id>:<step key>`, stable across every retry and resume of the running step.

        Hand it to the downstream service (an `Idempotency-Key` header, a unique column) so a
        call re-sent after a crash is recognised there instead of repeated.
        """
        running = self.ex.running()
        key = running.idempotency_key if running is not None else None
        if key is None:
            raise StepMisuse("ctx.idempotency_key is only defined while a step's function runs")
        return key

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
        resource: str | None = None,
        timeout: float | timedelta | None = None,
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
        With `resource="name"`, each call first waits for that resource's rate limit (taking
        `estimate`'s tokens), durably: the run is released until capacity returns. With
        `timeout` (seconds or a timedelta), an attempt that takes longer fails with
        StepTimeout and is retried per `retry`: an async `fn` is cancelled, a sync one is
        abandoned on its thread, its late result discarded (runs/engine/step_deadline.py).
        The keyword options are never passed to `fn`.
        """
        if on_ambiguous not in ("resend", "ask"):
            raise StepMisuse("on_ambiguous must be 'resend' or 'ask'")
        return self.run_step(
            key, fn, args, kwargs, retry=retry, reconcile=reconcile, on_ambiguous=on_ambiguous,
            compensate=compensate, approval=approval, estimate=estimate, kind=kind,
            resource=resource, timeout=timeout,
        )  # fmt: skip

    def run_step(
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
        described: Any = None,
        model: str = "",
        resource: str | None = None,
        timeout: float | timedelta | None = None,
    ) -> Any:
        seconds = seconds_of(timeout, f"step {key!r}")
        key, seq, record = self.ex.position(key, internal=internal)
        options = StepOptions(
            retry=retry, reconcile=reconcile, on_ambiguous=on_ambiguous, compensate=compensate,
            approval=approval, estimate=estimate, kind=kind, described=described, model=model,
            resource=resource, timeout=seconds,
        )  # fmt: skip
        in_doubt = (
            record is not None
            and record.key == key
            and may_have_run(record)
            and compensate is not None
            and on_ambiguous == "resend"
            and not self.ex.undo.running
        )
        if in_doubt:
            # If a cancel refuses the re-send, the cancel resolves it (reconciles or re-sends
            # it with its key, as a compensation) and then undoes it: it may have happened.
            self.ex.undo.in_doubt[key] = lambda: self._at(
                key, seq, record, fn, args, kwargs, options
            )
        try:
            self.ex.admit(key, seq, record)
            output = self._at(key, seq, record, fn, args, kwargs, options)
        except Cancelled:
            raise
        except BaseException:
            self.ex.undo.in_doubt.pop(key, None)
            raise
        self.ex.undo.in_doubt.pop(key, None)
        return output

    def _at(
        self, key: str, seq: int, record: Step | None, fn: Callable, args: tuple, kwargs: dict,
        options: StepOptions,
    ) -> Any:  # fmt: skip
        """The step at position `seq` (its `record`, if any): replayed, resolved or run."""
        o = options
        if record is not None and record.status == StepStatus.COMPLETED:
            # A step copied from the run this one was forked from did its side effect there:
            # this run undoes only what it did itself.
            undo = None if record.inherited else o.compensate
            return self.ex.undo.remember(key, undo, record.output)
        at = Position(self.ex.who.run_id, seq, key)
        idem = at.idempotency_key
        tries = 0  # the tries of this retry sequence so far: a durable retry delay goes on with it
        if record is not None:
            found = self._recover(record, at, o)
            if found is not NOT_FOUND:
                return self.ex.undo.remember(key, o.compensate, found)
            if record.status == StepStatus.WAITING:
                tries = (record.error or {}).get("tries", record.attempt)
                if record.wake_at is not None and record.wake_at > timezone.now():
                    self._retry_later(record.pk, key, record.wake_at)  # woken early: not yet
        input = o.described
        if input is None and record is None:
            input = describe_input(args, kwargs)
        attempt, fields, payload = start_row(record, at, o.kind, input, self.ex.who)
        rate = None
        if o.resource and not self.ex.undo.running:
            tokens = o.estimate.tokens_in + o.estimate.tokens_out if o.estimate else 0
            rate = rates.Grant(o.resource, tokens)
        possibly = possibly_spent(record, o.kind, self.ex.undo.running, fields, payload)
        who = self.ex.who
        shared = [] if self.ex.undo.running else scopes_for(who.workflow, who.labels)
        reservation = StartReservation.of(record, o.estimate, shared, timezone.now().date())
        fields |= reservation.columns()
        ending = rate.ended_on_error() if rate is not None else nullcontext()
        with ending, tracing.step(self.ex.trace, key, o.kind, attempt, o.model):
            if rate is not None:
                self._take_rate(rate, record, at, o.kind, fields, tries)
            step_pk = self._start(record, at, fields, payload, reservation, possibly, o)
            call = StepCall(
                step_pk, seq, key, idem, fn, args, kwargs,
                policy=o.retry or DEFAULT_RETRY,
                held=reservation.to_release(),
                approval=o.approval,
                # A step whose crash would cost a reconcile, a question or an approved side
                # effect writes its completion at once; any other rides with the run's next write.
                defer=o.approval is None and not o.durable,
                rate=rate,
                timeout=o.timeout,
            )  # fmt: skip
            output = self._call(call, attempt, tries)
        return self.ex.undo.remember(key, o.compensate, output)

    def _recover(self, record: Step, at: Position, options: StepOptions) -> Any:
        """A step an earlier execution left unfinished: the outcome its ambiguous-outcome policy
        found (reconcile or a person), or NOT_FOUND when it is to start again."""
        if record.tokens_in or record.tokens_out or record.cost_micros:
            # Attempts of an earlier execution that failed after an answer (_book_answered).
            spent = to_usd(record.cost_micros) or Decimal(0)
            self._answered[record.pk] = Usage(record.tokens_in, record.tokens_out, spent)
        if not may_have_run(record) or not options.durable:
            return NOT_FOUND
        reconcile, idem = options.reconcile, at.idempotency_key
        found = (
            self._reconcile(record, reconcile, idem)
            if reconcile is not None
            else self._ask(record, idem)
        )
        if found is NOT_FOUND and self.ex.undo.running:
            # A cancel resolving it: it never happened, nothing to undo.
            gone = Cancelled("the run was cancelled before this step happened")
            failed = Failed(gone, record.attempt)
            self.checkpoints.fail_step(record.pk, at.key, failed, held=Reservation.of(record))
        return found

    def _start(
        self, record: Step | None, at: Position, fields: dict, payload: dict,
        reservation: StartReservation, possibly: Amount, options: StepOptions,
    ) -> Any:  # fmt: skip
        """Write a step's start (a first start, a re-send, a resumed wait) and return its row's
        id. The fence checks the halt, the cancel and the run's budget in the same statement
        as the row; only what the fence cannot say (the approval, the shared daily ledgers)
        needs the transaction around it, where it is checked after the run row is locked."""
        starting = replace(
            self.checkpoints.start_fence,
            estimate=reservation.delta,
            held=reservation.held,
            possibly=possibly,
        )
        shared = reservation.shared or reservation.moving
        try:
            return self.checkpoints.write_start(
                (EventType.STEP_STARTED, at.key, payload),
                replace(starting, durable=options.durable),
                insert=fields if record is None else None,
                update=None if record is None else (record.pk, fields),
                approval=options.approval,
                take_shared=reservation.take_shared if shared else None,
            )
        except ApprovalRevoked as exc:
            if record is None:
                self.checkpoints.fail_unstarted(at, options.kind, Failed(exc, 1))
            self.checkpoints.fail_step(record.pk, at.key, Failed(exc, 1), held=reservation.old)

    def _book_answered(self, step_pk: Any, usage: Usage | None) -> None:
        """An attempt that failed after the provider answered (the SDK's parse of structured
        output, a length refusal) was paid: its usage goes on the run and the step's row now,
        in their own fenced write, and stays on the row when a later attempt succeeds."""
        if usage is None or not (usage.tokens or usage.micros) or step_pk is None:
            return
        self.checkpoints.book_attempt(step_pk, usage)
        earlier = self._answered.get(step_pk, Usage())
        self._answered[step_pk] = Usage(
            earlier.tokens_in + usage.tokens_in,
            earlier.tokens_out + usage.tokens_out,
            earlier.usd + usage.usd,
        )

    def transaction(
        self, key: str, fn: Callable, /, *args: Any, retry: RetryPolicy | None = None, **kwargs: Any
    ) -> Any:
        """Run `fn` inside the database transaction that writes its checkpoint.

        A business write made through the ORM in `fn` and the step's checkpoint commit
        together or not at all: exactly once for writes to Stepguard's own database. There is
        no `started` row, so a crash inside leaves nothing to reconcile.
        """
        key, seq, record = self.ex.enter(key)
        if record is not None and record.status == StepStatus.COMPLETED:
            return record.output
        policy = retry or DEFAULT_RETRY
        at = Position(self.ex.who.run_id, seq, key)
        idem = at.idempotency_key
        flush(self.ex.lease)  # the step before is recorded whatever this transaction does
        tries = 0
        while True:
            tries += 1
            try:
                with self.checkpoints.transaction_step(record, at) as completed:
                    value = self._invoke(key, idem, seq, fn, args, kwargs)
                    output = to_json(value, what=f"the output of step {key!r}")
                    completed(output, tries, describe_input(args, kwargs))
                return output
            except ControlFlow:
                raise
            except Exception as exc:
                if (delay := policy.next_delay(exc, tries)) is not None:
                    self.checkpoints.note_retry(key, tries, exc, delay)
                    self.ex.sleep(delay)
                    continue
                failed = Failed(exc, tries, policy)
                if record is None:
                    self.checkpoints.fail_unstarted(at, StepKind.TRANSACTION, failed)
                self.checkpoints.fail_step(record.pk, key, failed)

    def _invoke(
        self,
        key: str,
        idem: str,
        seq: int,
        fn: Callable,
        args: tuple,
        kwargs: dict,
        release=False,
        step_pk: Any = None,
        timeout: float | None = None,
    ) -> Any:
        """Call a step's function. With `release`, an async workflow's other steps may use the
        run's context meanwhile (the function touches only its own arguments). A step with a
        row (`step_pk`) lets model calls made inside it reserve their estimates. With
        `timeout`, the attempt ends with StepTimeout at its deadline (step_deadline.py)."""
        reserve = answered = None
        if step_pk is not None:
            reserve = functools.partial(self._reserve_in_step, step_pk)
            answered = functools.partial(self.answered_now.__setitem__, idem)
        deadline = None if timeout is None else time.monotonic() + timeout
        running = Running(
            key, idem, seq, id(self.ex), reserve, StepThread(), answered, deadline, timeout
        )
        token = CURRENT_STEP.set(running)

        def call() -> Any:
            if deadline is None:
                return self.ex.wait_for(fn(*args, **kwargs))
            return self.ex.wait_for(call_by(fn, args, kwargs, deadline, key, timeout or 0.0))

        try:
            if release:
                with self.ex.released():
                    return call()
            return call()
        finally:
            CURRENT_STEP.reset(token)

    def _reserve_in_step(self, step_pk: Any, amount: Amount) -> None:
        """A model call made inside a running step (a LangChain chat model in a LangGraph
        node: runs/adapters/chat_models.py) reserves its estimate before it is sent, as
        ctx.llm's start does: a halt, a cancel or a budget it does not fit refuses it, and it
        stays on the step's row until the step ends, so a crash with the call in flight books
        it as possibly spent when the step is re-sent. On the step's thread."""
        self._reserved_in_step[step_pk] = self.checkpoints.add_reservation(step_pk, amount)

    def _call(self, call: StepCall, attempt: int, tries: int = 0) -> Any:
        """Run a started step's function, retrying it in place or durably per its policy, and
        record how it ended; `attempt` and `tries` count on from where the step was."""
        step_pk, key, idem, held, rate = call.step_pk, call.key, call.idem, call.held, call.rate
        while True:
            tries += 1
            try:
                try:
                    value = self._invoke(
                        key, idem, call.seq, call.fn, call.args, call.kwargs, release=True,
                        step_pk=step_pk, timeout=call.timeout,
                    )  # fmt: skip
                finally:
                    if rate is not None:
                        rate.finish()
                    # What model calls inside it reserved is held by the step from now on.
                    held = self._reserved_in_step.pop(step_pk, held)
                usage, kind = None, None
                if isinstance(value, Metered):
                    value, usage, kind = value.value, value.usage, value.kind
                output = to_json(value, what=f"the output of step {key!r}")
            except ControlFlow:
                raise
            except (CancelledError, asyncio.CancelledError):
                # Cancelled in flight: no attempt and no failure. The step stays `started`,
                # re-sent with its key (marked `resent`) next time.
                self.ex.left_started = True
                raise
            except (Exception, SystemExit) as exc:  # sys.exit() in a step is its failure
                self._book_answered(step_pk, self.answered_now.pop(idem, None))
                if (delay := call.policy.next_delay(exc, tries)) is not None:
                    payload: dict[str, Any] = {"attempt": attempt + 1, "delay_s": round(delay, 3)}
                    payload |= {"error": brief(exc), "worker": self.ex.who.worker_id}
                    if (
                        delay >= settings.STEPGUARD_DURABLE_RETRY_SECONDS
                        or retry_after(exc) is not None  # a provider's 429 or 503: never slept
                    ):
                        # Resumed, the step takes its rate grant as any start does.
                        self._retry_later(step_pk, key, None, delay, payload, tries)
                    attempt += 1
                    self.ex.sleep(delay)
                    if rate is not None:  # a retry slept here is another call: a grant too
                        now = timezone.now()
                        until = rate.take(now)
                        if until is not None:
                            payload["throttled"] = rate.resource
                            wait = (until - now).total_seconds()
                            self._retry_later(step_pk, key, None, wait, payload, tries)
                    try:
                        # A retry is a new start: the halt, the cancel, the budget and the
                        # approval are checked again, in the statement that records it.
                        self.checkpoints.restart(
                            step_pk, key, payload, attempt, held, call.approval
                        )
                    except ApprovalRevoked as revoked:
                        revoked_ = Failed(revoked, attempt)
                        self.checkpoints.fail_step(step_pk, key, revoked_, held=held)
                    continue
                failed = Failed(exc, attempt, call.policy)
                self.checkpoints.fail_step(step_pk, key, failed, held=held)
            else:
                self.answered_now.pop(idem, None)  # its usage is the step's own: Metered
                self.checkpoints.finish_step(
                    step_pk, key, Completed(output=output, attempt=attempt, kind=kind),
                    usage=usage, held=held, defer=call.defer,
                    earlier=self._answered.pop(step_pk, None),
                )  # fmt: skip
                return output

    def _take_rate(self, rate: rates.Grant, record, at: Position, kind, fields, tries) -> None:
        """Take a grant of `resource`'s rate limit for this call, or wait for one durably: the
        step is `waiting` until capacity returns (not yet started: no attempt is used up),
        and the run holds no worker meanwhile."""
        until = rate.take(timezone.now())
        if until is None:
            return
        resource = rate.resource
        with self.checkpoints.parking() as w:
            error = {**((record.error or {}) if record else {}), "tries": tries}
            error["throttled"] = resource
            if record is None:
                w.new_step(at, kind, input=fields["input"], attempt=0, wake_at=until, error=error)
            else:
                w.park(record.pk, until, error)
            w.event(EventType.STEP_THROTTLED, at.key, resource=resource, until=until.isoformat())
            w.suspend(until)
        raise Suspended(f"step {at.key!r} waits for {resource}'s rate limit until {until}")

    def _retry_later(self, step_pk, key, until, delay=0.0, payload=None, tries=0) -> NoReturn:
        """Wait for a step's next try as a timer, holding no worker thread: a provider's
        Retry-After of a minute costs no thread for a minute. The step is `waiting` until
        then, keeping what it holds against the budgets; the run resumes there and tries it
        again with the same idempotency key, counting on from `tries`."""
        with self.checkpoints.parking() as w:
            if until is None:
                until = w.now + timedelta(seconds=delay)
                w.park(step_pk, until, {**(payload or {}).get("error", {}), "tries": tries})
            w.event(EventType.STEP_RETRYING, key, **(payload or {}), until=until.isoformat())
            w.suspend(until)
        raise Suspended(f"step {key!r} tries again at {until.isoformat()}")

    def _reconcile(self, record: Step, reconcile: Callable[[str], Any], idem: str) -> Any:
        # An exception here propagates unrecorded: the step stays `started` (still ambiguous),
        # so the next attempt of the run asks reconcile again rather than blindly re-sending.
        found = self._invoke(record.key, idem, record.seq, reconcile, (idem,), {})
        if found is NOT_FOUND:
            return NOT_FOUND
        output = to_json(found, what=f"the reconciled output of step {record.key!r}")
        reconciled = Completed(output=output, attempt=record.attempt, recovered=Recovery.RECONCILED)
        self.checkpoints.finish_step(record.pk, record.key, reconciled, held=Reservation.of(record))
        return output

    def _ask(self, record: Step, idem: str) -> Any:
        """The third ambiguous-outcome policy: a person says what happened."""
        label = f"{record.key}@attempt-{record.attempt}"
        request = (
            ApprovalRequest.objects.select_related("decided_by")
            .filter(run_id=self.ex.lease.run_id, step_key=label)
            .first()
        )
        if request is not None and request.status != ApprovalStatus.PENDING:
            # Decided: the step leaves `started` like any other, giving back what it held.
            if request.resolution == Resolution.RESEND:
                return NOT_FOUND
            held = Reservation.of(record)
            if request.resolution == Resolution.HAPPENED:
                confirmed = Completed(
                    output=request.resolution_output, recovered=Recovery.CONFIRMED,
                    approval_id=request.pk,
                )  # fmt: skip
                self.checkpoints.finish_step(record.pk, record.key, confirmed, held=held)
                return request.resolution_output
            who = request.decided_by.get_username() if request.decided_by else "an operator"
            failure = OperatorFailed(f"{who} failed the run at ambiguous step {record.key!r}")
            failed = Failed(failure, record.attempt)
            self.checkpoints.fail_step(record.pk, record.key, failed, held=held)
        with self.checkpoints.parking() as w:
            if request is None:
                request = request_approval(
                    self.ex.lease.run_id, label, kind=ApprovalKind.AMBIGUOUS,
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
                )  # fmt: skip
                w.event(
                    EventType.APPROVAL_REQUESTED, record.key,
                    approval_id=request.pk, kind=ApprovalKind.AMBIGUOUS,
                )  # fmt: skip
            else:
                w.event(EventType.APPROVAL_WAITING, record.key, approval_id=request.pk)
            w.suspend(None)
        raise Suspended(f"waiting for a person to resolve step {record.key!r}")
