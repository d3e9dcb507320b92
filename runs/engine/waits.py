"""Durable waits: timers, signals, approvals and child runs, holding no worker."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, cast

from django.utils import timezone

from runs.approvals.models import ApprovalRequest, ApprovalStatus, approved_digest
from runs.approvals.services import request_approval
from runs.engine import registry
from runs.engine.budget import default_run_budget
from runs.engine.checkpoints import Parking
from runs.engine.execution import Execution
from runs.engine.outcomes import Position
from runs.engine.records import Decision, as_timedelta
from runs.engine.serialization import to_json
from runs.engine.store import create_run
from runs.errors import (
    ApprovalExpired,
    ApprovalRejected,
    ApprovalRevoked,
    ChildFailed,
    StepguardError,
    StepMisuse,
    Suspended,
    WaitTimeout,
)
from runs.models import EventType, Run, RunStatus, Signal, Step, StepKind, StepStatus


@dataclass(frozen=True)
class Ask:
    """One approval of `ctx.approvals`: what `ctx.approval` takes, with its step key."""

    key: str
    action: str
    summary: str = ""
    payload: Any = None
    timeout: float | timedelta | None = None


@dataclass
class Child:
    position: Position
    record: Step | None
    workflow: str
    input: Any

    @property
    def key(self) -> str:
        return self.position.key

    @property
    def step(self) -> Step:
        """Its checkpoint: children() writes every missing one before reading them."""
        assert self.record is not None
        return self.record


class Waits:
    """A wait is a `waiting` step row, the run set waiting with a wake-up time and the lease given
    up in one transaction; `Suspended` then unwinds the workflow."""

    def __init__(self, ex: Execution):
        self.ex = ex
        self.checkpoints = ex.checkpoints

    def sleep(self, key: str, duration: float | timedelta) -> None:
        """Wait `duration` (seconds or a timedelta) without holding a worker.

        The deadline is fixed when the step is first reached, so a resume after a crash waits
        only for what is left of it.
        """
        delta = as_timedelta(duration, "a sleep")
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
        delta = None if timeout is None else as_timedelta(timeout, "a timeout")
        key, seq, record = self.ex.enter(key)
        if record is not None and record.status == StepStatus.COMPLETED:
            return record.output
        timed_out = False
        with self.checkpoints.parking() as w:
            if record is None:
                record = w.new_step(
                    self._at(seq, key), StepKind.EVENT,
                    input={"signal": name}, wake_at=None if delta is None else w.now + delta,
                )  # fmt: skip
            signal = (
                Signal.objects.filter(
                    run_id=self.ex.lease.run_id, name=name, consumed_at__isnull=True
                )
                .order_by("id")
                .first()
            )
            if signal is not None:
                Signal.objects.filter(pk=signal.pk).update(consumed_by=key, consumed_at=w.now)
                w.complete(record, signal.payload, signal_id=signal.pk)
                return signal.payload
            if record.wake_at is not None and record.wake_at <= w.now:
                error = WaitTimeout(
                    f"no signal {name!r} arrived before {record.wake_at:%Y-%m-%d %H:%M:%S}"
                )
                w.fail(record, error)
                timed_out = True
            else:
                w.event(
                    EventType.SIGNAL_WAITING, key, name=name,
                    timeout_at=record.wake_at.isoformat() if record.wake_at else None,
                )  # fmt: skip
                w.suspend(record.wake_at)
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
        ask = Ask(key, action, summary, payload, timeout)
        key, seq, record = self.ex.enter(key)
        done = record is not None and record.status == StepStatus.COMPLETED
        if done and not self._to_check(seq, cast(Step, record)):
            return Decision.from_json(cast(Step, record).output)
        data, digest = self._asked(ask, key)
        again = ""
        if done:  # a copied decision, checked for this fork
            decision, again = self._inherited(cast(Step, record), digest)
            if decision is not None:
                return decision
        error: StepguardError | None = None
        with self.checkpoints.parking() as w:
            if record is None or again:
                request = self._ask(w, ask, seq, key, data, digest, record, again)
                w.suspend(request.expires_at)
            else:
                request = ApprovalRequest.objects.select_related("decided_by").get(
                    run_id=self.ex.lease.run_id, step_key=key
                )
                outcome = self._approval_outcome(request, w.now)
                if isinstance(outcome, Decision):
                    w.complete(record, outcome.as_json())
                    return outcome
                if outcome is None:
                    w.event(EventType.APPROVAL_WAITING, key, approval_id=request.pk)
                    w.suspend(request.expires_at)
                else:
                    error = outcome
                    w.fail(record, error)
        if error is not None:
            raise error
        raise Suspended(f"waiting for approval of {action!r}")

    def approvals(self, asks: Iterable[Ask]) -> list[Decision | StepguardError]:
        """Ask for several approvals at once and wait for every decision without holding a
        worker: the approvers see them together (an agent's parallel tool calls), and the run
        resumes once none is pending. Returns, in order, each one's Decision or the error its
        rejection, revocation or expiry is (ApprovalRejected...), for the caller to act on."""
        asks = list(asks)
        entries = [self.ex.position(ask.key) for ask in asks]  # every position first, as on replay
        outcomes: list[Decision | StepguardError | None] = [None] * len(asks)
        again: dict[int, str] = {}  # copied approvals that do not stand for this fork: why
        for i, (key, seq, record) in enumerate(entries):
            try:
                self.ex.admit(key, seq, record)
            except (ApprovalRejected, ApprovalExpired, ApprovalRevoked) as refused:
                outcomes[i] = refused
            if record is not None and record.status == StepStatus.COMPLETED:
                if not self._to_check(seq, record):
                    outcomes[i] = Decision.from_json(record.output)
                else:
                    outcomes[i], again[i] = self._inherited(record, self._asked(asks[i], key)[1])
        open_ = [i for i, outcome in enumerate(outcomes) if outcome is None]
        if not open_:
            return cast("list[Decision | StepguardError]", outcomes)
        asked = {i: self._asked(asks[i], entries[i][0]) for i in open_}
        with self.checkpoints.parking(events=len(open_)) as w:  # one event each
            waits: list[datetime | None] = []
            for i in open_:
                ask, (key, seq, record) = asks[i], entries[i]
                if record is None or again.get(i):
                    request = self._ask(w, ask, seq, key, *asked[i], record, again.get(i))
                    waits.append(request.expires_at)
                    continue
                request = ApprovalRequest.objects.select_related("decided_by").get(
                    run_id=self.ex.lease.run_id, step_key=key
                )
                outcome = self._approval_outcome(request, w.now)
                if outcome is None:
                    w.event(EventType.APPROVAL_WAITING, key, approval_id=request.pk)
                    waits.append(request.expires_at)
                    continue
                outcomes[i] = outcome
                if isinstance(outcome, Decision):
                    w.complete(record, outcome.as_json())
                else:
                    w.fail(record, outcome)
            if waits:
                deadlines = [d for d in waits if d is not None]
                w.suspend(min(deadlines) if len(deadlines) == len(waits) else None)
        if waits:
            raise Suspended(f"waiting for {len(waits)} approvals")
        return cast("list[Decision | StepguardError]", outcomes)  # each one settled above

    def _asked(self, ask: Ask, key: str) -> tuple[Any, str]:
        """What an approval asks, checked: its payload as JSON, and the digest of all the
        approver sees (the action the approval will stand for)."""
        if not ask.action or len(ask.action) > 200:
            raise StepMisuse("an approval needs an action of 1 to 200 characters")
        if ask.timeout is not None:
            as_timedelta(ask.timeout, "a timeout")  # refused before anything is written
        data = to_json(ask.payload, what=f"the payload of approval {key!r}")
        return data, approved_digest(self.ex.who.workflow, key, ask.action, ask.summary, data)

    def _at(self, seq: int, key: str) -> Position:
        return Position(self.ex.who.run_id, seq, key)

    def _to_check(self, seq: int, record: Step) -> bool:
        """A decision a fork copied is checked until the fork has gone on from it."""
        return record.inherited and not self.ex.history.went_past(seq)

    def _inherited(self, record: Step, digest: str) -> tuple[Decision | None, str]:
        """Whether an approval a fork copied stands for it: the decision names an approval
        of the fork's lineage that is still approved and approved what the code asks now
        (`digest`). The decision, or None and why not (the fork asks again)."""
        output = record.output if isinstance(record.output, dict) else {}
        approval_id = output.get("approval_id")
        request = (
            ApprovalRequest.objects.filter(
                pk=approval_id, run_id__in=self.checkpoints.fork_lineage
            ).first()
            if isinstance(approval_id, int)
            else None
        )
        if request is None:
            return None, "its recorded decision names no approval of this run's lineage"
        if request.status != ApprovalStatus.APPROVED:
            return None, f"approval #{request.pk} was {request.status}"
        if request.sha256 != digest:
            return None, f"the code asks to approve something else than approval #{request.pk}"
        return Decision.from_json({**output, "sha256": request.sha256}), ""

    def _ask(
        self, w: Parking, ask: Ask, seq: int, key: str, data: Any, digest: str,
        record: Step | None, again: str | None,
    ) -> ApprovalRequest:  # fmt: skip
        """Ask for a new approval inside the wait `w`: its waiting step (a new row, or the row
        of a copied decision that does not stand for this fork, `again` says why, turned back
        into a wait), the request and its event."""
        expires = None if ask.timeout is None else w.now + as_timedelta(ask.timeout, "a timeout")
        asked = {"action": ask.action, "summary": ask.summary, "sha256": digest}
        if record is None:
            w.new_step(self._at(seq, key), StepKind.APPROVAL, input=asked, wake_at=expires)
        else:
            w.reopen(record.pk, input=asked, wake_at=expires)
        request = request_approval(
            self.ex.lease.run_id, key, action=ask.action, summary=ask.summary,
            payload=data, sha256=digest, expires_at=expires,
        )  # fmt: skip
        payload = {
            "approval_id": request.pk, "action": ask.action,
            "expires_at": expires.isoformat() if expires else None,
        }  # fmt: skip
        if again:
            payload["asked_again"] = again
        w.event(EventType.APPROVAL_REQUESTED, key, **payload)
        return request

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
            decided = request.decided_at or now
            return Decision(request.pk, who, decided, request.comment, request.sha256)
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
            key, seq, record = self.ex.position(key)
            entries.append(Child(self._at(seq, key), record, workflow, child_input))
        for e in entries:
            self.ex.admit(e.key, e.position.seq, e.record)
        if all(e.record is not None and e.record.status == StepStatus.COMPLETED for e in entries):
            return [e.step.output for e in entries]
        plans = {}
        for e in entries:
            if e.record is None:
                definition = registry.get(e.workflow)
                plans[e.key] = (definition, to_json(e.input, what=f"the input of child {e.key!r}"))
        failure: ChildFailed | None = None
        children = tuple(d.name for d, _ in plans.values())
        with self.checkpoints.parking(events=max(1, len(plans)), children=children) as w:
            self._start_children(w, entries, plans)
            waiting = self._record_ended_children(w, entries)
            failed = [e for e in entries if e.step.status == StepStatus.FAILED]
            if failed:
                failure = ChildFailed(
                    (Step.objects.get(pk=failed[0].step.pk).error or {})["message"]
                )
            elif waiting:
                pending = sum(1 for e in entries if e.step.status == StepStatus.WAITING)
                w.event(EventType.CHILDREN_WAITING, "", pending=pending)
            if waiting and not failed:
                w.suspend(None)
        if failure is not None:
            raise failure
        if waiting:
            raise Suspended("waiting for child runs")
        return [e.step.output for e in entries]

    def _start_children(self, w: Parking, entries: list[Child], plans: dict) -> None:
        """Create the child runs not started yet, each with its waiting step and its event."""
        for e in entries:
            if e.key not in plans:
                continue
            definition, data = plans[e.key]
            child = create_run(
                workflow=definition.name,
                version=definition.version,
                input=data,
                key=e.position.idempotency_key,  # at most one child there
                parent_id=self.ex.lease.run_id,
                priority=definition.priority,
                concurrency_key=definition.key_for(data),
                labels=self.ex.who.labels,  # the tenant a parent works for, its children work for
                **default_run_budget(definition.name),
            )
            e.record = w.new_step(
                e.position, StepKind.CHILD,
                input={"workflow": definition.ref, "run_id": str(child.id)},
            )  # fmt: skip
            w.event(EventType.CHILD_STARTED, e.key, child=str(child.id))

    def _record_ended_children(self, w: Parking, entries: list[Child]) -> bool:
        """Record each child that has ended on its step (completed or failed) inside the wait
        `w`; whether any is still running."""
        keys = {
            e.position.idempotency_key: e for e in entries if e.step.status != StepStatus.COMPLETED
        }
        waiting = False
        for child in Run.objects.filter(key__in=keys).only(
            "id", "key", "status", "output", "error"
        ):
            e = keys[child.key or ""]  # filtered on key above
            if child.status == RunStatus.COMPLETED:
                w.complete(e.step, child.output, child=str(child.id))
                e.step.status, e.step.output = StepStatus.COMPLETED, child.output
            elif child.status in (RunStatus.FAILED, RunStatus.CANCELLED):
                message = (child.error or {}).get("message", child.status)
                error = ChildFailed(f"child run {child.id} ({e.key}) {child.status}: {message}")
                record = {**error.as_record(), "child": str(child.id)}  # final: no retryable
                w.fail(e.step, error, record=record, child=str(child.id))
                e.step.status = StepStatus.FAILED
            else:
                waiting = True
        return waiting

    def _timer(self, key: str, deadline: Callable[[datetime], datetime]) -> None:
        key, seq, record = self.ex.enter(key)
        if record is not None and record.status == StepStatus.COMPLETED:
            return
        with self.checkpoints.parking() as w:
            if record is None:
                when = deadline(w.now)
                record = w.new_step(
                    self._at(seq, key), StepKind.SLEEP, input={"until": when.isoformat()},
                    wake_at=when,
                )  # fmt: skip
            wake_at = record.wake_at
            assert wake_at is not None  # a sleep's row is written with its deadline
            if wake_at <= w.now:
                w.complete(record, event=EventType.TIMER_FIRED, wake_at=wake_at.isoformat())
                return
            w.event(EventType.TIMER_SET, key, wake_at=wake_at.isoformat())
            w.suspend(wake_at)
        raise Suspended(f"sleeping until {wake_at.isoformat()}")
