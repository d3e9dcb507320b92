"""Checkpoints: the only code that writes step rows and their events, each write fenced.

Within an execution every step row and every event goes through `Checkpoints`; what ends a
run (`book_possibly_spent`, `fail_in_doubt`, `release_reservations`) writes the rows of the
steps it leaves behind through the functions at the bottom of this module. Run-level events
written outside an execution (claims, operator actions) go through `store.append_event`.
`tests/test_engine_units.py` holds this: no other engine module writes a step row.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import datetime
from functools import cached_property
from typing import Any, NoReturn

from django.conf import settings
from django.db.models import F, Q, Sum
from django.utils import timezone

from runs.approvals.models import ApprovalRequest, ApprovalStatus
from runs.engine import holds
from runs.engine.budget import (
    NOTHING,
    Amount,
    Reservation,
    Usage,
    book_shared,
    release_shared,
    reserve_shared,
    scopes_for,
)
from runs.engine.budget_room import resume_fitting
from runs.engine.compensation import Compensations
from runs.engine.fences import Completion, Fence, Lease, Spend
from runs.engine.outcomes import Completed, Failed, Position
from runs.engine.records import INTERRUPTED, Decision, Identity, brief
from runs.engine.store import append_event, atomic, complete_later, fence, fenced_write
from runs.errors import REPLAYED, ApprovalRevoked, Cancelled, StepFailed, StepguardError
from runs.models import EventType, Run, RunStatus, Step, StepKind, StepStatus


class Checkpoints:
    """Start, finish, fail, wait and suspend: every write goes through the store's fence, so a
    worker whose lease was taken over can never write again.

    One per execution, owning the lease it fences with; it reads the execution's identity and
    modes (given once) and the undo list (shared with the steps that fill it), and calls back
    into nothing: what a write needs to know is given to it.
    """

    def __init__(
        self, lease: Lease, who: Identity, undo: Compensations, *, give_up: StepguardError | None
    ):
        self._lease = lease
        self.who = who
        self._undo = undo
        #: Past the poison-run bound: the steps it still finishes are no progress.
        self._give_up = give_up

    @property
    def start_fence(self) -> Fence:
        # Compensations run after a cancel was requested; every other step is refused then.
        # Halts and budgets stop both.
        return Fence(starting=True, compensating=self._undo.running)

    def _new_step(self, at: Position, kind: str, status: str, **fields) -> Step:
        """A step row at `at`; `fields` may give its own attempt and times (a transaction
        step's completion does)."""
        fields = {"run_attempt": self.who.attempt, "started_at": timezone.now(), **fields}
        return Step.objects.create(
            run_id=self._lease.run_id,
            seq=at.seq,
            key=at.key,
            kind=kind,
            status=status,
            idempotency_key=at.idempotency_key,
            **fields,
        )

    def _event(self, event_seq: int, type_: str, key: str = "", **payload: Any) -> None:
        """One event of this run, at the seq its fence reserved (inside that transaction)."""
        append_event(self._lease.run_id, event_seq, type_, key, **payload)

    def _end_step(self, step_pk: Any, now: datetime, *, output=None, error=None) -> None:
        """A waiting step ends (inside the caller's transaction): completed with `output`, or
        failed with `error` (its record)."""
        if error is None:
            Step.objects.filter(pk=step_pk).update(
                status=StepStatus.COMPLETED, output=output, finished_at=now
            )
        else:
            Step.objects.filter(pk=step_pk).update(
                status=StepStatus.FAILED, error=error, run_attempt=self.who.attempt, finished_at=now
            )

    def book_attempt(self, step_pk: Any, usage: Usage) -> None:
        """An attempt that failed after the provider answered was paid: its usage goes on the
        run and the step's row, in their own fenced write."""
        spend = Spend(usage.micros, usage.tokens_in, usage.tokens_out, NOTHING)
        with atomic(self._lease):
            fence(self._lease, Fence(spend=spend))
            Step.objects.filter(pk=step_pk).update(
                tokens_in=F("tokens_in") + usage.tokens_in,
                tokens_out=F("tokens_out") + usage.tokens_out,
                cost_micros=F("cost_micros") + usage.micros,
            )

    def add_reservation(self, step_pk: Any, amount: Amount) -> Reservation:
        """More held by a running step (a model call made inside it: the step is an `llm`
        step from now on), checked as a start is:
        the halt, the cancel, the run's budget and the shared daily ones (OverBudget pauses
        the run), on the run, the ledgers and the step's row in one commit. What the step
        holds now: on the ledgers and the day of what it held already, else today's."""
        with atomic(self._lease):
            fence(self._lease, replace(self.start_fence, estimate=amount, events=0))
            rows = Step.objects.filter(pk=step_pk)
            micros, tokens, scopes, day = rows.values_list(
                "reserved_micros", "reserved_tokens", "reserved_scopes", "reserved_on"
            ).get()
            if not (micros or tokens) or day is None:
                scopes, day = scopes_for(self.who.workflow, self.who.labels), timezone.now().date()
            if scopes:
                reserve_shared(list(scopes), amount, NOTHING, day)
            held = Amount(micros, tokens) + amount
            rows.update(
                reserved_micros=held.micros, reserved_tokens=held.tokens,
                reserved_scopes=list(scopes), reserved_on=day,
                kind=StepKind.LLM,  # it made a model call: maybe paid if cut off
            )  # fmt: skip
        return Reservation(held, list(scopes), day)

    @contextmanager
    def transaction_step(
        self, record: Step | None, at: Position
    ) -> Iterator[Callable[[Any, int, Any], None]]:
        """A transaction step's unit of work: its fence, then the function's own writes, then
        its completion (what the block calls: `completed(output, tries, input)`), all in one
        transaction. Like any step, none starts once a shared daily budget is spent."""
        with atomic(self._lease):
            event_seq = fence(self._lease, replace(self.start_fence, progress=True))
            if shared := scopes_for(self.who.workflow, self.who.labels):
                reserve_shared(shared, NOTHING, NOTHING, timezone.now().date())

            def completed(output: Any, tries: int, input_: Any) -> None:
                now = timezone.now()
                fields = {
                    "status": StepStatus.COMPLETED, "output": output, "error": None,
                    "attempt": tries, "run_attempt": self.who.attempt,
                    "started_at": now, "finished_at": now,
                }  # fmt: skip
                if record is None:
                    self._new_step(at, StepKind.TRANSACTION, input=input_, **fields)
                else:
                    Step.objects.filter(pk=record.pk).update(**fields)
                self._event(event_seq, EventType.STEP_COMPLETED, at.key, attempt=tries)

            yield completed

    def restart(self, step_pk, key, payload, attempt: int, held, approval) -> None:
        """An in-place retry's start: the next attempt on the step's row, checked as any start
        is (`write_start`) against what the step already reserves."""
        # A step's times are its last attempt's: a retry's duration is not all of them.
        fields = {"attempt": attempt, "started_at": timezone.now()}
        self.write_start(
            (EventType.STEP_RETRYING, key, payload),
            replace(self.start_fence, held=held.reserved),
            update=(step_pk, fields),
            approval=approval,
        )

    def write_start(
        self,
        event: tuple[str, str, dict],
        checks: Fence,
        *,
        insert: dict | None = None,
        update: tuple[Any, dict] | None = None,
        approval: Any = None,
        take_shared: Callable[[], None] | None = None,
    ) -> Any:
        """Every start of a step (first, resumed, re-sent, retried in place) is written here:
        its row (`insert`, or `update` of the row by id) and its event, fenced by `checks`
        (the lease, the halt, the cancel, the run's budget) in one statement. What the fence
        cannot say (the approval, the shared daily ledgers: `take_shared`) needs a transaction
        around it, where it is checked after the run row is locked. The row's id."""
        if approval is None and take_shared is None:
            return fenced_write(self._lease, event, checks, insert_step=insert, update_step=update)
        type_, key, payload = event
        with atomic(self._lease):
            event_seq = fence(self._lease, checks)
            if take_shared is not None:
                take_shared()
            self.check_approval(approval)
            if insert is not None:
                step_pk = Step.objects.create(run_id=self._lease.run_id, **insert).pk
            else:
                assert update is not None
                step_pk = update[0]
                Step.objects.filter(pk=step_pk).update(**update[1])
            self._event(event_seq, type_, key, **payload)
        return step_pk

    def finish_step(
        self, step_pk: Any, key: str, outcome: Completed, *, usage: Usage | None = None,
        held: Reservation | None = None, defer: bool = False, earlier: Usage | None = None,
    ) -> None:  # fmt: skip
        """Finish a started step with its outcome: its row, its event and, if it spent or
        held anything (`usage`, `held`), the budgets.

        With `defer`, a completion that touches no budget rides with the run's next write
        (`complete_later`) unless STEPGUARD_EAGER_COMPLETIONS asks for it now.
        """
        fields, payload = outcome.columns(), outcome.payload()
        self._finish(step_pk, key, payload, fields, usage, held or Reservation(), defer, earlier)

    def _finish(
        self, step_pk, key, payload, fields, usage: Usage | None, held, defer=False,
        earlier: Usage | None = None,
    ) -> None:  # fmt: skip
        fields["finished_at"] = timezone.now()
        event = (
            EventType.STEP_COMPLETED
            if fields["status"] == StepStatus.COMPLETED
            else EventType.STEP_FAILED
        )
        # A step finished is progress (the poison-run count restarts), except the
        # compensations of a run being given up: they must not make it look healthy again.
        progress = self._give_up is None
        if usage is None and not held.reserved and earlier is None:
            if (
                defer
                and event == EventType.STEP_COMPLETED
                and not self._undo.running
                and not self.who.recovering
                and not settings.STEPGUARD_EAGER_COMPLETIONS
            ):
                complete_later(self._lease, Completion(step_pk, key, payload, fields, progress))
                return
            fenced_write(
                self._lease, (event, key, payload), Fence(progress=progress),
                update_step=(step_pk, fields),
            )  # fmt: skip
            return
        if usage is not None:
            # `earlier`: attempts that failed after an answer, already on the run and the row
            # (Steps._book_answered): the row keeps showing every answered attempt.
            before = earlier or Usage()
            fields |= {
                "tokens_in": usage.tokens_in + before.tokens_in,
                "tokens_out": usage.tokens_out + before.tokens_out,
                "cost_micros": usage.micros + before.micros,
            }
        usage = usage or Usage()
        spend = Spend(usage.micros, usage.tokens_in, usage.tokens_out, held.reserved)
        fields |= {
            "reserved_micros": 0,
            "reserved_tokens": 0,
            "reserved_scopes": [],
        }
        if usage.breakdown is not None:
            fields["usage"] = usage.breakdown
        if usage.tokens or usage.micros:
            payload = {**payload, "tokens": usage.tokens, "usd": str(usage.usd)}
        with atomic(self._lease):
            fenced_write(
                self._lease, (event, key, payload), Fence(progress=progress, spend=spend),
                update_step=(step_pk, fields),
            )  # fmt: skip
            scopes = scopes_for(self.who.workflow, self.who.labels)
            warnings = book_shared(scopes, usage, held.shared, held.reserved, held.day)
            if held.reserved and held.shared:
                resume_fitting(held.shared, held.day)  # after the spend: room is what is left
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
                first = fence(self._lease, Fence(events=len(warnings)))
                for offset, label in enumerate(warnings):
                    self._event(
                        first + offset, EventType.BUDGET_WARNING, key, budget=label, threshold=ratio
                    )

    def fail_step(
        self, step_pk: Any, key: str, failed: Failed, *, held: Reservation | None = None
    ) -> NoReturn:
        """Record a started step's final failure, giving back what it held, and raise it."""
        self._finish(
            step_pk, key, failed.payload(self.who.worker_id), self._failed_columns(failed),
            None, held or Reservation(),
        )  # fmt: skip
        self._raise(key, failed)

    def fail_unstarted(self, at: Position, kind: str, failed: Failed) -> NoReturn:
        """Record the final failure of a step with no row yet (a transaction step, a start
        refused by a revoked approval) on a new row at `at`, and raise it."""
        now = timezone.now()
        insert = {"seq": at.seq, "key": at.key, "kind": kind}
        insert |= {"idempotency_key": at.idempotency_key, "started_at": now, "finished_at": now}
        fenced_write(
            self._lease, (EventType.STEP_FAILED, at.key, failed.payload(self.who.worker_id)),
            insert_step={**insert, **self._failed_columns(failed)},
        )  # fmt: skip
        self._raise(at.key, failed)

    def _failed_columns(self, failed: Failed) -> dict[str, Any]:
        return {
            "status": StepStatus.FAILED, "error": failed.record, "attempt": failed.attempt,
            "run_attempt": self.who.attempt,
        }  # fmt: skip

    @staticmethod
    def _raise(key: str, failed: Failed) -> NoReturn:
        exc = failed.error
        if isinstance(exc, StepguardError) and exc.code in REPLAYED:
            raise exc
        record = failed.record
        raise StepFailed(key, record, retryable=record["retryable"]) from exc

    def note_retry(self, key: str, tries: int, exc: Exception, delay: float) -> None:
        """A transaction step's failed try, recorded before its wait (it has no step row)."""
        with atomic(self._lease):
            event_seq = fence(self._lease)
            self._event(
                event_seq, EventType.STEP_RETRYING, key,
                attempt=tries + 1, delay_s=round(delay, 3), error=brief(exc),
            )  # fmt: skip

    @contextmanager
    def parking(self, *, events: int = 1, children: tuple[str, ...] = ()) -> Iterator[Parking]:
        """A durable wait's unit of work: one transaction that fences first, in the lock order
        a pause takes (docs/architecture.md), then writes the wait's rows as the block asks
        (`Parking`), its events in the order queued, and gives the run up last, if the block
        suspends it (the fence needs the lease that `suspend` clears).

        A halt placed meanwhile is either seen by the fence, which refuses the wait, or waits
        for it and finds the run waiting, which it parks. `events`: how many the wait will
        write, reserved by the fence (more are reserved again before they are written);
        `children`: the workflows of child runs the wait creates, whose policies cover them
        too (create_run locks them again)."""
        with atomic(self._lease):
            chain = holds.chain_of(self._lease.run_id)
            holds.lock_policies(chain, children)
            first = fence(self._lease, replace(self.start_fence, progress=True, events=events))
            holds.lock_ancestors(chain)
            parking = Parking(self, timezone.now())
            yield parking
            queued = parking.events
            seqs = list(range(first, first + min(events, len(queued))))
            if len(queued) > events:
                more = fence(self._lease, Fence(events=len(queued) - events))
                seqs += range(more, more + len(queued) - events)
            for seq, (type_, key, payload) in zip(seqs, queued, strict=True):
                self._event(seq, type_, key, **payload)
            if parking.wake is not None:
                (wake_at,) = parking.wake
                Run.objects.filter(pk=self._lease.run_id).update(
                    status=RunStatus.WAITING, wake_at=wake_at, worker=None, lease_until=None
                )

    def note(self, type_: str, key: str, **payload: Any) -> None:
        """An event of the execution's own (a model with no price): one fenced write."""
        fenced_write(self._lease, (type_, key, payload))

    def mark_patch(self, seq: int, key: str, change_id: str, *, cancelled: bool) -> None:
        """A patch marker at `seq`: a completed step row and its event. It spends nothing:
        halts and cancels (`cancelled`) stop it, a spent budget does not."""
        with atomic(self._lease):
            event_seq = fence(self._lease, Fence(starting=True, compensating=True))
            if cancelled:
                raise Cancelled("cancel requested")
            now = timezone.now()
            at = Position(self.who.run_id, seq, key)
            self._new_step(at, StepKind.CALL, StepStatus.COMPLETED, finished_at=now)
            self._event(event_seq, EventType.STEP_COMPLETED, key, patch=change_id)

    def check_approval(self, decision: Decision | int | None) -> None:
        """A step started under `approval=` starts only if that approval still stands: checked
        in the start's transaction, after the run row is locked."""
        if decision is None:
            return
        approval_id = decision.approval_id if isinstance(decision, Decision) else int(decision)
        stands = ApprovalRequest.objects.filter(
            pk=approval_id, run_id__in=self.fork_lineage, status=ApprovalStatus.APPROVED
        )
        if isinstance(decision, Decision) and decision.sha256:  # it approved what it says
            stands = stands.filter(sha256=decision.sha256)
        if not stands.exists():
            raise ApprovalRevoked(
                f"approval #{approval_id} no longer stands; the step did not start"
            )

    @cached_property
    def fork_lineage(self) -> list:
        """This run and the runs it was forked from: a fork replays their approvals. Read
        once an execution (a run's origin never changes), one query per ancestor."""
        chain, origin = [self._lease.run_id], self.who.forked_from
        while origin is not None:
            chain.append(origin)
            origin = Run.objects.filter(pk=origin).values_list("forked_from_id", flat=True)[0]
        return chain


class Parking:
    """What a durable wait writes, inside its unit of work (`Checkpoints.parking`): its step
    rows at once (the block reads them back), its events queued in order, and whether it
    gives the run up (`suspend`), done last. The seqs, the fence and the lease are not its
    caller's business."""

    def __init__(self, checkpoints: Checkpoints, now: datetime):
        self._checkpoints = checkpoints
        #: When the wait was entered, after the fence: its deadlines count from here.
        self.now = now
        self.events: list[tuple[str, str, dict]] = []
        #: `(wake_at,)` once the wait gives the run up.
        self.wake: tuple[datetime | None] | None = None

    def new_step(self, at: Position, kind: str, **fields) -> Step:
        """The wait's own row, `waiting`."""
        return self._checkpoints._new_step(at, kind, StepStatus.WAITING, **fields)

    def reopen(self, step_pk: Any, **fields) -> None:
        """A step a fork copied, turned back into a wait of the fork's own (a decision that
        does not stand for it, asked again)."""
        Step.objects.filter(pk=step_pk).update(
            status=StepStatus.WAITING, inherited=False, output=None, error=None,
            run_attempt=self._checkpoints.who.attempt, started_at=self.now, finished_at=None,
            **fields,
        )  # fmt: skip

    def park(self, step_pk: Any, until: datetime, error: dict) -> None:
        """A started step waits until `until` for its next try, keeping what it holds against
        the budgets."""
        Step.objects.filter(pk=step_pk).update(
            status=StepStatus.WAITING, wake_at=until, error=error
        )

    def event(self, type_: str, key: str = "", **payload: Any) -> None:
        self.events.append((type_, key, payload))

    def complete(
        self, step: Step, output: Any = None, *, event: str = EventType.STEP_COMPLETED, **payload
    ) -> None:
        """The waiting step ends with `output`, and its event says so."""
        self._checkpoints._end_step(step.pk, self.now, output=output)
        self.event(event, step.key, **payload)

    def fail(
        self, step: Step, error: StepguardError, *, record: dict | None = None, **payload
    ) -> None:
        """The waiting step fails with `error`: on its row, `record` if given, else the error
        and whether it is retryable."""
        if record is None:
            record = {**error.as_record(), "retryable": error.retryable}
        self._checkpoints._end_step(step.pk, self.now, error=record)
        self.event(EventType.STEP_FAILED, step.key, **payload, error=brief(error))

    def suspend(self, wake_at: datetime | None) -> None:
        """Give the run up until `wake_at` (or until something wakes it), once everything else
        of the wait is written."""
        self.wake = (wake_at,)


# What ends a run writes the rows of the steps it leaves behind: inside the transaction that
# ends the run, after its fence.


def book_possibly_spent(run_id) -> Amount:
    """Model calls a run ends without coming back to (started, then the run was cancelled or
    failed another way) may have been paid: their estimates are booked as possibly spent."""
    left = Step.objects.filter(run_id=run_id, status=StepStatus.STARTED, kind=StepKind.LLM).filter(
        Q(reserved_micros__gt=0) | Q(reserved_tokens__gt=0)
    )
    total = left.aggregate(micros=Sum("reserved_micros"), tokens=Sum("reserved_tokens"))
    if not total["micros"] and not total["tokens"]:
        return NOTHING
    left.update(
        possibly_spent_micros=F("possibly_spent_micros") + F("reserved_micros"),
        possibly_spent_tokens=F("possibly_spent_tokens") + F("reserved_tokens"),
    )
    return Amount(total["micros"] or 0, total["tokens"] or 0)


def fail_in_doubt(run_id, status: str, at: datetime) -> None:
    """A step the run never came back to (a crash left it `started`, then the run ended
    another way): a finished run keeps no step that looks in flight."""
    Step.objects.filter(run_id=run_id, status=StepStatus.STARTED).update(
        status=StepStatus.FAILED,
        error={
            "type": INTERRUPTED,
            "message": f"the run ended ({status}) while this step's outcome was unknown: it "
            "may or may not have happened",
            "retryable": False,
        },
        finished_at=at,
    )


def release_reservations(run_id, *, zero_run: bool = True) -> None:
    """A run ended: give back what its unfinished steps still hold (a step in flight when its
    worker died and never re-sent), from the ledgers and the day each was reserved against,
    and zero the run's reservation (unless the caller's own write does)."""
    holding = Step.objects.filter(run_id=run_id, status=StepStatus.STARTED).filter(
        Q(reserved_micros__gt=0) | Q(reserved_tokens__gt=0)
    )
    held = list(
        holding.values_list("reserved_micros", "reserved_tokens", "reserved_on", "reserved_scopes")
    )
    if held:
        holding.update(reserved_micros=0, reserved_tokens=0, reserved_scopes=[])
    for micros, tokens, day, scopes in held:
        if scopes and day:
            release_shared(list(scopes), Amount(micros, tokens), day)
            resume_fitting(list(scopes), day)
    if zero_run:
        Run.objects.filter(pk=run_id).update(reserved_micros=0, reserved_tokens=0)
