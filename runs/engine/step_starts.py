"""Step starts: the row, the event and the budget reservation of one start of a step, worked out
before its write, so that a first start, a re-send after a crash and a resumed wait differ
only in these values and share one write (Steps._start)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from typing import Any

from django.utils import timezone

from runs.engine import rates
from runs.engine.budget import (
    NOTHING,
    Amount,
    Reservation,
    Usage,
    release_shared,
    reserve_shared,
    to_usd,
)
from runs.engine.outcomes import Position
from runs.engine.records import INTERRUPTED, Decision, Identity
from runs.engine.retry import RetryPolicy
from runs.models import Recovery, Step, StepKind, StepStatus


def may_have_run(record: Step) -> bool:
    """A step whose outcome is unknown: `started` when its worker died, or marked so when its
    run ended before coming back to it (lifecycle._finish), and retried since."""
    if record.status == StepStatus.STARTED:
        return True
    return record.status == StepStatus.FAILED and (record.error or {}).get("type") == INTERRUPTED


@dataclass(frozen=True, slots=True)
class StepCall:
    """A started step's call: what `Steps._call` runs, retries and records, fixed once the
    step's start is written (its attempt and tries are what change between tries)."""

    step_pk: Any
    seq: int
    key: str
    idem: str
    fn: Callable
    args: tuple
    kwargs: dict
    policy: RetryPolicy
    held: Reservation
    approval: Decision | None
    defer: bool = False  # the completion rides with the run's next write (complete_later)
    rate: rates.Grant | None = None  # the rate grant this call took, finished when it returns
    timeout: float | None = None  # seconds an attempt may take (runs/engine/step_deadline.py)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepOptions:
    """How `ctx.step` (or a metered call built on it) asked for a step to run: one value from
    the step's position to its recovery, its start and its call, re-used as is when a cancel
    resolves a step in doubt."""

    retry: RetryPolicy | None = None
    reconcile: Callable[[str], Any] | None = None
    on_ambiguous: str = "resend"
    compensate: Callable[[Any], Any] | None = None
    approval: Decision | None = None
    estimate: Usage | None = None
    kind: str = StepKind.CALL
    described: Any = None
    model: str = ""
    resource: str | None = None
    timeout: float | None = None

    @property
    def durable(self) -> bool:
        """A crash of this step would cost a reconcile or a question, which only its `started`
        row promises: without the row it would be re-sent."""
        return self.reconcile is not None or self.on_ambiguous == "ask"


def start_row(
    record: Step | None, at: Position, kind: str, input: Any, who: Identity
) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """The attempt, the row's columns and the `step.started` payload of a start: a new row for
    a step never started, the next attempt on the row an earlier execution left (a re-send of
    one that may have run says so)."""
    if record is None:
        fields: dict[str, Any] = {
            "seq": at.seq,
            "key": at.key,
            "kind": kind,
            "status": StepStatus.STARTED,
            "input": input,
            "idempotency_key": at.idempotency_key,
            "run_attempt": who.attempt,
            "started_at": timezone.now(),
        }
        return 1, fields, {"attempt": 1, "worker": who.worker_id}
    attempt = record.attempt + 1
    payload: dict[str, Any] = {"attempt": attempt, "worker": who.worker_id}
    fields = {
        "status": StepStatus.STARTED,
        "attempt": attempt,
        "run_attempt": who.attempt,
        "error": None,
        "started_at": timezone.now(),  # its times are this attempt's (the events keep each)
        "finished_at": None,
        "wake_at": None,
    }
    if may_have_run(record):
        fields["recovered"] = payload["recovered"] = Recovery.RESENT
    return attempt, fields, payload


def possibly_spent(
    record: Step | None, kind: str, compensating: bool, fields: dict, payload: dict
) -> Amount:
    """A model call re-sent after its first attempt was cut off (a crash, a lost lease, a
    cancelled task) may have been answered and paid with nothing recorded: its estimate is
    booked as possibly spent, on the step and the run, for good. It counts against the
    budgets from the write that re-sends it, and is shown apart from what was recorded."""
    if record is None or record.status != StepStatus.STARTED:
        return NOTHING
    if StepKind.LLM not in (kind, record.kind):  # a node that called a chat model is one
        return NOTHING
    if compensating:
        return NOTHING
    possibly = Amount(record.reserved_micros, record.reserved_tokens)
    if possibly:
        fields["possibly_spent_micros"] = record.possibly_spent_micros + possibly.micros
        fields["possibly_spent_tokens"] = record.possibly_spent_tokens + possibly.tokens
        payload["possibly_spent"] = {
            "usd": str(to_usd(possibly.micros)),
            "tokens": possibly.tokens,
        }
    return possibly


@dataclass(frozen=True, slots=True)
class StartReservation:
    """What a starting step reserves against the budgets while it runs: its estimate, less
    what an earlier attempt (re-sent after a crash) still holds. A reservation made on an
    earlier day, or against other shared budgets, moves to today's ledgers: the old day's
    spend is no reason to refuse the step today. (Not a hold: holds are halts, engine.holds.)"""

    old: Reservation  # what the step's row held before this start
    delta: Amount  # reserved from now on, beyond what it held
    shared: list[str]
    today: date

    @classmethod
    def of(cls, record: Step | None, estimate: Usage | None, shared: list[str], today: date):
        want = Amount(estimate.micros, estimate.tokens) if estimate else NOTHING
        old = Reservation.of(record)
        return cls(old, want.beyond(old.reserved), shared, today)

    @property
    def held(self) -> Amount:
        return self.old.reserved

    @property
    def reserved(self) -> Amount:
        return self.held + self.delta

    @property
    def moving(self) -> bool:
        old = self.old
        return (
            bool(self.held)
            and bool(old.shared or self.shared)
            and (old.day != self.today or old.shared != self.shared)
        )

    def columns(self) -> dict[str, Any]:
        """The row's record of the reservation, which a re-send after a crash starts from."""
        if not self.reserved:
            return {}
        return {
            "reserved_micros": self.reserved.micros,
            "reserved_tokens": self.reserved.tokens,
            "reserved_on": self.today,
            "reserved_scopes": self.shared,
        }

    def to_release(self) -> Reservation:
        """What the step gives back when it finishes."""
        return (
            Reservation(self.reserved, self.shared, self.today) if self.reserved else Reservation()
        )

    def take_shared(self) -> None:
        """Reserve on the shared daily ledgers, inside the start's transaction, after its fence
        locked the run row (lock order: run rows, then ledgers)."""
        old = self.old
        if self.moving and old.shared:
            release_shared(old.shared, self.held, old.day)
        if self.shared:
            if self.moving:
                reserve_shared(self.shared, self.reserved, NOTHING, self.today)
            else:
                reserve_shared(self.shared, self.delta, self.held, self.today)
