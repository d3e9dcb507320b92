"""Why a run is in its state, in one sentence, and the one action that moves it on.

The run page's header reads this instead of making the operator reconstruct it from the
history: a waiting run names what it waits for and since when, a paused one how much it needs
against what it has, a halted one which hold stops it and who placed it. Everything comes from
state (rows), never from parsing event text.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import UTC, datetime

from django.utils import timezone

from runs.engine import flow
from runs.engine.budget import to_usd
from runs.engine.holds import Hold, holds_on
from runs.models import TERMINAL_STATUSES, Event, EventType, Run, RunStatus, StepKind, StepStatus
from runs.operations import compensated, unserved_reason
from runs.templatetags.timeline import how_far, span_text

#: The one action that moves a run on: (label, permission a person needs to take it).
ACTIONS = {
    "unhalt": ("Unhalt this run", "runs.unhalt_run"),
    "unhalt-workflow": ("Unhalt the workflow", "runs.unhalt_run"),
    "lift-killswitch": ("Lift the kill switch", "runs.unhalt_run"),
    "open-parent": ("Open the halted parent run", "runs.view_run"),
    "raise-budget": ("Raise the budget", "runs.set_budget"),
    "open-budgets": ("Open the budgets", "runs.view_run"),
    "approve": ("Decide the approval", "approvals.decide_approvalrequest"),
    "retry": ("Retry the run", "runs.retry_run"),
    "fork": ("Fork from a step", "runs.fork_run"),
    "open-flow": ("Open the Flow page", "runs.view_run"),
    "open-rate-limits": ("Open the rate limits", "runs.view_run"),
}


@dataclass(frozen=True)
class State:
    """What the header says: the sentence, and the action (a key of ACTIONS) if any."""

    sentence: str
    action: str | None = None
    hold: Hold | None = None
    more_holds: tuple[Hold, ...] = ()  # the others covering it: lifting one lifts no other
    approval_id: int | None = None

    def may_act(self, user) -> bool:
        return self.action is not None and user.has_perm(ACTIONS[self.action][1])


def _when(at: datetime | None, now: datetime) -> str:
    """'04:28:24 UTC (3 minutes ago)' or '… (in 3 minutes)': the time, and how far it is."""
    if at is None:
        return "an unknown time"
    return f"{at.astimezone(UTC).strftime('%H:%M:%S UTC')} ({how_far(at, now)})"


def _amount(unit: str, value: int) -> str:
    """Exact, so that what a step needs and what is left never round to the same figure:
    at least cents ($1.00, $0.50), to the micro-dollar below ($0.00084)."""
    if unit != "micro-USD":
        return f"{value:,} tokens"
    usd = to_usd(value).normalize()
    return f"${usd:.2f}" if usd.as_tuple().exponent >= -2 else f"${usd:f}"


def explain(run: Run, now: datetime | None = None) -> State:
    """The state of `run` as a person reads it (a few indexed queries, whatever the run's size)."""
    now = now or timezone.now()
    status = run.status
    if status == RunStatus.COMPLETED:
        took = ""
        if run.started_at and run.finished_at:
            took = f" in {span_text((run.finished_at - run.started_at).total_seconds())}"
        return State(f"Completed{took}, at {_when(run.finished_at, now)}.")
    if status == RunStatus.CANCELLED:
        by = f" by {run.cancel_requested_by}" if run.cancel_requested_by else ""
        why = f": “{run.cancel_reason}”" if run.cancel_reason else ""
        return State(f"Cancelled{by} at {_when(run.finished_at, now)}{why}.")
    if status == RunStatus.FAILED:
        error = run.error or {}
        if error.get("code") in REFUSALS:
            return _refused(run, error)
        where = f" at step {error['step']}" if error.get("step") else ""
        # A failed step's own error says it better than the StepFailed wrapped around it.
        cause = error.get("cause") if isinstance(error.get("cause"), dict) else {}
        shown = cause if cause.get("type") else error
        what, message = shown.get("type", "an error"), shown.get("message", "")
        # A step's failure ends the run in the attempt it happened in: the step's own tries
        # are the ones that count (issue 47).
        n = cause.get("attempts") if isinstance(cause.get("attempts"), int) else run.attempt
        tries = f" after {n} attempt{'s' if n != 1 else ''}"
        text = f"Failed{where}{tries}: {what}{': ' if message else ''}{message}"
        if compensated(run):  # a retry refuses these
            return State(
                f"{text}. Its compensations ran: fork it from a step to try again.", "fork"
            )
        if cause.get("retryable") is False:  # the step's policy: an answer, not an outage
            return State(
                f"{text}. A retry would get the same answer ({what} is final for step "
                f"{error.get('step')}): fork it from a step, with the input or an output edited.",
                "fork",
            )
        return State(text, "retry")
    holds = holds_on(run)
    if holds:
        return replace(_halted(run, holds[0], now), more_holds=tuple(holds[1:]))
    if status == RunStatus.OVER_BUDGET:
        return _over_budget(run)
    if run.halted_at is None and run.cancel_requested_at is not None:
        asked = _when(run.cancel_requested_at, now)
        return State(f"Cancelling: {run.cancel_requested_by} asked at {asked}.")
    if status == RunStatus.RUNNING:
        step = run.steps.filter(status=StepStatus.STARTED).order_by("-seq").first()
        doing = f"running step {step.key} (attempt {step.attempt})" if step else "replaying"
        return State(
            f"Running on worker {run.worker_id}: {doing}; run attempt {run.attempt} of "
            f"{run.max_attempts}."
        )
    if status == RunStatus.WAITING:
        return _waiting(run, now)
    return _pending(run, now)


#: The errors of an approval that said no, when one ended the run (issue 47 section 4).
REFUSALS = {
    "approval_rejected": "a rejection",
    "approval_expired": "an approval that expired undecided",
    "approval_revoked": "a revoked approval",
}


def _refused(run: Run, error: dict) -> State:
    """A refusal that ended the run is its outcome, not a fault to retry: say whose, and that
    what it guarded never ran."""
    undone = " Its compensations ran." if compensated(run) else ""
    return State(
        f"Ended by {REFUSALS[error['code']]}: {error.get('message', '')}. What it guarded did "
        f"not run.{undone} To ask again, fork it from a step, with the input or an output "
        "edited.",
        "fork",
    )


def _halted(run: Run, hold: Hold, now: datetime) -> State:
    where = {
        "run": ("this run", "unhalt"),
        "ancestor": (hold.scope, "open-parent"),
        "workflow": (hold.scope, "unhalt-workflow"),
        "global": ("the kill switch", "lift-killswitch"),
    }[hold.kind]
    why = f": “{hold.reason}”" if hold.reason else ""
    text = f"by {hold.by} at {_when(hold.at, now)}, by a hold on {where[0]}{why}"
    if run.status == RunStatus.HALTED:
        return State(f"Halted {text}.", where[1], hold=hold)
    return State(f"Halt placed {text}; the run stops before its next step.", where[1], hold=hold)


def _over_budget(run: Run) -> State:
    stop = Event.objects.of(run).filter(type=EventType.BUDGET_EXCEEDED).order_by("-seq").first()
    p = stop.payload if stop else {}
    if not p:
        return State("Paused over budget.", "raise-budget")
    unit, limit, spent, need = p["unit"], p["limit"], p["spent"], p["estimate"]
    left = max(limit - spent, 0)
    action = "raise-budget" if p.get("budget") == "run" else "open-budgets"
    return State(
        f"Paused because the next step needs {_amount(unit, need)} and the {p['budget']} budget "
        f"has {_amount(unit, left)} left of {_amount(unit, limit)}.",
        action,
    )


def _waiting(run: Run, now: datetime) -> State:
    step = run.steps.filter(status=StepStatus.WAITING).order_by("-seq").first()
    if step is None:
        until = f" until {_when(run.wake_at, now)}" if run.wake_at else ""
        return State(f"Waiting{until}.")
    since = _when(step.started_at, now)
    limit = f"; gives up at {_when(step.wake_at, now)}" if step.wake_at else ""
    if step.kind == StepKind.EVENT:
        name = (step.input or {}).get("signal", step.key)
        return State(f"Waiting for signal “{name}” since {since}{limit}.")
    if step.kind == StepKind.SLEEP:
        return State(f"Sleeping until {_when(step.wake_at, now)}.")
    if step.kind == StepKind.APPROVAL:
        ask = run.approvals.filter(step_key=step.key).order_by("-pk").first()
        number = f" #{ask.pk}" if ask else ""
        action = f" to {ask.action}" if ask else ""
        expires = f"; expires at {_when(ask.expires_at, now)}" if ask and ask.expires_at else ""
        return State(
            f"Waiting for approval{number}{action}, asked of approvers at {since}{expires}.",
            "approve" if ask and ask.status == "pending" else None,
            approval_id=ask.pk if ask else None,
        )
    if step.kind == StepKind.CHILD:
        open_ = run.children.exclude(status__in=TERMINAL_STATUSES).count()
        return State(f"Waiting for {open_} child run{'s' if open_ != 1 else ''} since {since}.")
    error = step.error or {}
    again = _when(step.wake_at, now)
    if error.get("throttled"):  # a rate limit's capacity returns then (runs/engine/rates.py)
        return State(f"Step {step.key} waits for the rate limit of {error['throttled']} "
                     f"until {again}; raising or lifting the limit lets it go on at once.",
                     "open-rate-limits")  # fmt: skip
    if error.get("type"):  # a durable retry: the step's last try failed
        return State(f"Step {step.key} failed ({error['type']}: {error.get('message', '')}) "
                     f"and tries again at {again}.")  # fmt: skip
    return State(f"Waiting on step {step.key} since {since}{limit}.")


def _pending(run: Run, now: datetime) -> State:
    if run.wake_at and run.wake_at > now:
        if run.debounce_key is not None and run.lease_epoch == 0:  # still in its quiet period
            starts = _when(run.wake_at, now)
            return State(f"Debounced: starts at {starts} unless newer input comes.")
        if run.attempt > 1 and run.error:
            error = run.error
            return State(
                f"Retrying from the top at {_when(run.wake_at, now)} (attempt {run.attempt} of "
                f"{run.max_attempts}) after {error.get('type', 'an error')}: "
                f"{error.get('message', '')}"
            )
        return State(f"Queued until {_when(run.wake_at, now)}.")
    unserved = unserved_reason(run)
    if unserved:
        return State(f"Not moving: {unserved}.")
    limited = _limited(run)
    if limited:
        return State(limited, "open-flow")
    since = _when(run.wake_at or run.created_at, now)
    return State(f"Ready since {since}, for the next free worker.")


def _limited(run: Run) -> str | None:
    """Why a ready run waits on its workflow's concurrency limit (the code's or an operator's),
    if it does: idle workers are no help then, the limit is."""
    _, limits = flow.policies({run.workflow})
    limit = limits.get(run.workflow)
    if limit is None:
        return None
    counts = flow.running(run.workflow)
    total = sum(counts.values())
    if limit.total is not None and total >= limit.total:
        return (
            f"Ready, but workflow {run.workflow} allows {limit.total} running at once "
            f"({total} running now): it starts when one ends, or when the limit is raised."
        )
    mine = counts.get(run.concurrency_key, 0)
    if limit.per_key is not None and run.concurrency_key and mine >= limit.per_key:
        return (
            f"Ready, but workflow {run.workflow} allows {limit.per_key} running at once for "
            f"key {run.concurrency_key!r} ({mine} running now): it starts when one ends, or "
            "when the limit is raised."
        )
    return None
