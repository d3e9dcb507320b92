"""Operator actions on runs, shared by the CLI, the dashboard and the API.

Each action resolves the acting user, checks the matching permission, locks the run row, and
records an event with the actor, so the same action taken anywhere is the same function with
the same check and the same audit entry.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from itertools import chain
from typing import Any, ParamSpec, TypeVar

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import OperationalError, connection, transaction
from django.db.models import Case, Q, Value, When
from django.utils import timezone

from runs import forks, schedules
from runs import labels as run_labels
from runs.engine import holds, registry
from runs.engine.budget import count_the_day, forget_cached_scopes, to_micros
from runs.engine.store import append_event, create_run, run_event, wake_parent
from runs.engine.wakeup import notify_runnable
from runs.errors import Conflict, Forbidden, NotFound, OperationError
from runs.models import (
    GLOBAL,
    Event,
    EventType,
    Policy,
    RateLimit,
    Run,
    RunStatus,
    Schedule,
    Shaped,
    Step,
    StepKind,
    StepStatus,
    Worker,
)

log = logging.getLogger("stepguard.operations")

#: How often an operator action that lost a deadlock is tried again before the error stands.
DEADLOCK_TRIES = 3


def _deadlocked(exc: OperationalError) -> bool:
    return getattr(exc.__cause__, "sqlstate", None) == "40P01"


P = ParamSpec("P")
R = TypeVar("R")


def retried_on_deadlock(action: Callable[P, R]) -> Callable[P, R]:
    """An operator action chosen as a deadlock's victim is run again (its transaction rolled
    back whole), so a person never sees a 500, nor a kill switch that stayed on, because a
    worker happened to lock the same rows. Every path takes the documented lock order
    (docs/architecture.md); this is the second line. Not inside a caller's transaction: that
    one is aborted, and only its owner can try again."""

    @functools.wraps(action)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        attempt = 1
        while True:
            try:
                return action(*args, **kwargs)
            except OperationalError as exc:
                if not _deadlocked(exc) or attempt == DEADLOCK_TRIES or connection.in_atomic_block:
                    raise
                log.warning("%s lost a deadlock (try %s); trying again", action.__name__, attempt)
                attempt += 1

    return run


def in_utc(when: datetime, what: str) -> datetime:
    """A filter's date and time, made aware and in UTC; OperationError if it cannot be stored
    (year 1 at +14:00 is before the first representable instant, and would overflow later)."""
    try:
        if timezone.is_naive(when):
            when = timezone.make_aware(when)
        return when.astimezone(UTC)
    except (OverflowError, ValueError):
        raise OperationError(f"{what} {when.isoformat()!r} is out of range") from None


def resolve_user(user: AbstractBaseUser | str):
    """A User from a User or a username; inactive or unknown users are refused."""
    if isinstance(user, str):
        found = get_user_model().objects.filter(username=user).first()
        if found is None:
            raise NotFound(f"no user named {user!r}")
        user = found
    if not user.is_active:
        raise OperationError(f"user {user.get_username()!r} is inactive")
    return user


def require(user, permission: str, action: str):
    user = resolve_user(user)
    if not user.has_perm(permission):
        raise Forbidden(f"{user.get_username()} may not {action} (needs {permission})")
    return user


def lock_run(run_id) -> Run:
    """The run, row-locked until the end of the caller's transaction (SQLite: the whole DB)."""
    try:
        run = Run.objects.select_for_update().filter(pk=run_id).first()
    except (ValidationError, ValueError):
        run = None
    if run is None:
        raise NotFound(f"no run with id {run_id}")
    return run


@retried_on_deadlock
def cancel_run(run_id, user, reason: str) -> Run:
    """Cancel a run and its unfinished descendants: each stops at its next step boundary (or
    wait), the compensations of its completed steps run newest first, and it ends `cancelled`.
    """
    user = require(user, "runs.cancel_run", "cancel runs")
    reason = needs_reason(reason, "a cancel")
    actor = user.get_username()
    with transaction.atomic():
        holds.serialise_hold_changes()  # it may requeue a run paused over budget
        root = find_run(run_id)
        # Children first, deepest first (the order a finishing child locks: itself, then its
        # parent), so they stop spending and undo their own steps; the parent is woken by them.
        for member in holds.descendants(root.pk):
            _request_cancel(lock_run(member), actor, f"parent run {root.pk} cancelled: {reason}")
        run = lock_run(root.pk)
        if run.is_terminal:
            raise Conflict(f"run {run.pk} is already {run.status}")
        if run.cancel_requested_at is not None:
            raise Conflict(
                f"run {run.pk} is already being cancelled (by {run.cancel_requested_by})"
            )
        _request_cancel(run, actor, reason)
    run.refresh_from_db()
    return run


def _request_cancel(run: Run, actor: str, reason: str) -> None:
    """Record a cancel on a locked run (unless it ended or is being cancelled already)."""
    if run.is_terminal or run.cancel_requested_at is not None:
        return
    now = timezone.now()
    fields = {"cancel_requested_at": now, "cancel_requested_by": actor, "cancel_reason": reason}
    never_ran = (
        run.status in (RunStatus.PENDING, RunStatus.HALTED)
        and not Step.objects.filter(run=run).exists()
    )
    if never_ran:
        # Nothing to stop or undo, and perhaps no worker that serves it: end it here.
        Run.objects.filter(pk=run.pk).update(
            status=RunStatus.CANCELLED, finished_at=now, event_seq=run.event_seq + 1, **fields
        )
        append_event(run.pk, run.event_seq + 1, EventType.RUN_CANCELLED, "", actor, reason=reason)
        wake_parent(run.pk, RunStatus.CANCELLED)
        return
    if run.status == RunStatus.OVER_BUDGET:
        # A run paused over budget wakes too: cancelling is how its compensations run (a hold
        # still stops them: the run goes to `halted` if one covers it).
        fields |= {"status": _requeued(), "wake_at": now}
        transaction.on_commit(notify_runnable)
    Run.objects.filter(pk=run.pk).update(**fields)
    run_event(run.pk, EventType.RUN_CANCEL_REQUESTED, wake=True, actor=actor, reason=reason)


def _requeued() -> Case:
    """The status of a run made runnable again: `halted` if a hold covers it (checked in the
    statement that writes it), else `pending`."""
    return Case(
        When(holds.covered(), then=Value(RunStatus.HALTED)), default=Value(RunStatus.PENDING)
    )


def unserved_reason(run: Run) -> str | None:
    """Why a runnable run is not moving, when the cause is that no live worker has its code."""
    if run.status not in (RunStatus.PENDING, RunStatus.WAITING):
        return None
    cutoff = timezone.now() - timedelta(seconds=3 * settings.STEPGUARD_LEASE_SECONDS)
    live = Worker.objects.filter(heartbeat_at__gte=cutoff, stopped_at__isnull=True)
    served = set(chain.from_iterable(live.values_list("workflows", flat=True)))
    ref = f"{run.workflow}@{run.version}"
    if ref in served:
        return None
    others = sorted(r for r in served if r.startswith(f"{run.workflow}@"))
    note = f" (live workers serve {', '.join(others)})" if others else ""
    return f"no live worker serves {ref}{note}"


# -- halts, budgets, retry, fork ---------------------------------------------------------------

PARKABLE = (RunStatus.PENDING, RunStatus.WAITING, RunStatus.OVER_BUDGET)


@dataclass(frozen=True)
class Target:
    """What an operator action applies to: one run, one workflow, the runs of one label value
    (`tenant=acme`: budgets only), or everything."""

    kind: str  # "run" | "workflow" | "label" | "all"
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind == "workflow" and (not self.value or "*" in self.value):
            raise OperationError(
                f"{self.value!r} is not a workflow name ('*' stands for everything: use 'all')"
            )
        if self.kind == "workflow" and self.value.startswith(run_labels.SCOPE_PREFIX):
            raise OperationError(
                f"{self.value!r} is not a workflow name ('label:' names a label's budget)"
            )
        if self.kind == "label":
            object.__setattr__(self, "value", "=".join(run_labels.pair(self.value)))

    @property
    def label(self) -> str:
        names = {"run": "run", "workflow": "workflow", "label": "label"}
        return f"{names[self.kind]} {self.value}" if self.kind in names else "everything"

    @property
    def scope(self) -> str:
        if self.kind == "label":
            return run_labels.scope(*run_labels.pair(self.value))
        return GLOBAL if self.kind == "all" else self.value

    def only_for_budgets(self, action: str) -> None:
        """A label value has a shared daily budget and nothing else: no halt, no limits."""
        if self.kind == "label":
            raise OperationError(
                f"{action} apply to a run, a workflow or everything; a label has a daily budget"
            )


def parse_target(target) -> Target:
    """A Target from `Target`, a Run, a run id, "run:<id>", "workflow:<name>",
    "label:<name>=<value>" or "all"."""
    if isinstance(target, Target):
        return target
    if isinstance(target, Run):
        return Target("run", str(target.pk))
    text = str(target)
    if text in ("all", GLOBAL):
        return Target("all")
    if text.startswith("workflow:") and len(text) > len("workflow:"):
        return Target("workflow", text.removeprefix("workflow:"))
    if text.startswith(run_labels.SCOPE_PREFIX):
        return Target("label", text.removeprefix(run_labels.SCOPE_PREFIX))
    return Target("run", text.removeprefix("run:"))


def needs_reason(reason: str, action: str) -> str:
    if not reason or not reason.strip():
        raise OperationError(f"{action} needs a reason")
    return reason.strip()


def audit(actor: str, type: str, **payload) -> None:
    """An operator action on a workflow or on everything: an event of no single run."""
    Event.objects.create(
        run=None, seq=0, type=type, actor=actor, payload=payload, created_at=timezone.now()
    )


def known_scope(target: Target) -> None:
    """Policy rows only for workflows that exist (registered here, with runs, or with a policy
    already): a typo must not create a halt or a budget that covers nothing, and nobody may
    fill the table with made-up names."""
    if target.kind != "workflow":
        return
    registry.load_configured()
    name = target.value
    if any(d.name == name for d in registry.all_workflows()):
        return
    if Run.objects.filter(workflow=name).exists() or Policy.objects.filter(scope=target.scope):
        return
    raise NotFound(f"no workflow named {name!r}: it is not registered and has no runs")


def _in_scope(target: Target) -> Q:
    if target.kind == "label":
        return run_labels.carrying(target.value)
    return Q() if target.kind == "all" else Q(workflow=target.value)


@retried_on_deadlock
def halt(target, user, reason: str) -> Target:
    """Place a hold on a run (and so its descendants), a workflow, or everything (the kill
    switch).

    Waiting and pending runs it covers stop at once; running ones at their next step boundary
    (a step already executing finishes and is checkpointed). Only `unhalt` of this same hold
    lifts it, and lifting it lifts no other hold.
    """
    user = require(user, "runs.halt_run", "halt runs")
    reason = needs_reason(reason, "a halt")
    target, actor, now = parse_target(target), user.get_username(), timezone.now()
    target.only_for_budgets("halts")
    if target.kind != "run":
        known_scope(target)
        # Its own commit first: a worker pausing or entering a wait share-locks the row that
        # exists, so the halt below is ordered against it (lock order, docs/architecture.md).
        Policy.objects.get_or_create(scope=target.scope)
    with transaction.atomic():
        holds.serialise_hold_changes()
        if target.kind == "run":
            root = find_run(target.value)
            # Descendants before the run itself: the order a finishing child locks (itself,
            # then its parent), so a halt and a child's end never deadlock.
            family = holds.descendants(root.pk)
            for member in family:
                _park(member, actor, reason, f"parent run {root.pk}")
            run = lock_run(root.pk)
            if run.is_terminal:
                raise Conflict(f"run {run.pk} is already {run.status}")
            if run.halted_at is not None:
                raise Conflict(f"run {run.pk} is already halted by {run.halted_by}")
            Run.objects.filter(pk=run.pk).update(halted_at=now, halted_by=actor, halt_reason=reason)
            _park(run.pk, actor, reason, "run", audit=True)
            _park_late_children(root.pk, family, actor, reason)
            return target
        known_scope(target)
        policy = Policy.objects.select_for_update().get(scope=target.scope)
        if policy.halted_at is not None:
            raise Conflict(f"{target.label} is already halted by {policy.halted_by}")
        Policy.objects.filter(pk=policy.pk).update(
            halted_at=now, halted_by=actor, halt_reason=reason
        )
        audit(actor, EventType.SCOPE_HALTED, target=target.label, reason=reason)
        # Every run the hold now covers: the workflow's runs and their descendants.
        parkable = Run.objects.filter(holds.covered(), status__in=PARKABLE)
        for run_id in parkable.values_list("id", flat=True):
            _park(run_id, actor, reason, target.label)
    return target


def _park_late_children(root_id, family: list, actor: str, reason: str) -> None:
    """Park the children the run's execution started while the halt waited for the run's lock
    (found by the model machine: they stayed `pending` under a halted parent). That execution
    held the run's row, so they are visible now. Those another transaction has locked are
    skipped, never waited for while this holds their parent (a finishing child locks itself,
    then its parent): they are being claimed or are ending, and stop at their next step."""
    late = set(holds.descendants(root_id)) - set(family)
    if not late:
        return
    free = Run.objects.filter(pk__in=late, status__in=PARKABLE).select_for_update(skip_locked=True)
    for member in free.values_list("id", flat=True):
        _park(member, actor, reason, f"parent run {root_id}")


def find_run(run_id) -> Run:
    """The run, or NotFound naming the id (also for an id that is not a UUID at all)."""
    try:
        run = Run.objects.filter(pk=run_id).first()
    except (ValidationError, ValueError):
        run = None
    if run is None:
        raise NotFound(f"no run with id {run_id}")
    return run


def _park(run_id, actor: str, reason: str, scope: str, *, audit: bool = False) -> None:
    """Stop a covered run that holds no worker now; a running one stops at its next step.
    With `audit`, the run records the action even if it is running."""
    parked = Run.objects.filter(pk=run_id, status__in=PARKABLE).update(status=RunStatus.HALTED)
    if parked or audit:
        run_event(
            run_id,
            EventType.RUN_HALTED if parked else EventType.RUN_HALT_REQUESTED,
            actor=actor,
            reason=reason,
            scope=scope,
        )


@retried_on_deadlock
def unhalt(target, user, reason: str) -> Target:
    """Lift one hold. A person's act with a reason: no worker, retry or restart path does this.

    Runs resume only where no other hold still covers them (a child's own halt, the run's
    workflow halt, the kill switch stay in force).
    """
    user = require(user, "runs.unhalt_run", "lift halts")
    reason = needs_reason(reason, "an unhalt")
    target, actor = parse_target(target), user.get_username()
    target.only_for_budgets("halts")
    with transaction.atomic():
        # One hold change at a time: two unhalts at once would each see the other's hold
        # still in force and leave the runs both covered `halted`, with no hold left.
        holds.serialise_hold_changes()
        if target.kind == "run":
            root = find_run(target.value)
            members = holds.descendants(root.pk)
            # Lock the halted descendants first, deepest first, as halt does.
            list(
                Run.objects.select_for_update()
                .filter(pk__in=members, status=RunStatus.HALTED)
                .values_list("id", flat=True)
            )
            run = lock_run(root.pk)
            if run.halted_at is None:
                others = ", ".join(h.scope for h in holds.holds_on(run))
                hint = f" (it is held by {others}: lift that instead)" if others else ""
                raise Conflict(f"run {run.pk} is not halted by a hold of its own{hint}")
            Run.objects.filter(pk=run.pk).update(halted_at=None, halted_by="", halt_reason="")
            run.halted_at = None  # the hold just lifted is not among those still in force
            resumed = _resume(run.pk)
            left = [h.scope for h in holds.holds_on(run)]
            run_event(
                run.pk, EventType.RUN_UNHALTED, actor=actor, reason=reason, scope="run",
                resumed=resumed, still_held_by=left,
            )  # fmt: skip
            for member in members:
                if _resume(member):
                    run_event(
                        member, EventType.RUN_UNHALTED, actor=actor, reason=reason,
                        scope=f"parent run {run.pk}", resumed=True,
                    )  # fmt: skip
            return target
        policy = Policy.objects.select_for_update().filter(scope=target.scope).first()
        if policy is None or policy.halted_at is None:
            raise Conflict(f"{target.label} is not halted")
        Policy.objects.filter(pk=policy.pk).update(halted_at=None, halted_by="", halt_reason="")
        audit(actor, EventType.SCOPE_UNHALTED, target=target.label, reason=reason)
        for run_id in Run.objects.filter(status=RunStatus.HALTED).values_list("id", flat=True):
            if _resume(run_id):
                run_event(
                    run_id, EventType.RUN_UNHALTED, actor=actor, reason=reason, scope=target.label,
                    resumed=True,
                )  # fmt: skip
    return target


def _resume(run_id) -> bool:
    """Make a halted run runnable if no hold covers it any more (checked in the statement)."""
    resumed = Run.objects.filter(holds.uncovered(), pk=run_id, status=RunStatus.HALTED).update(
        status=RunStatus.PENDING, wake_at=timezone.now()
    )
    if resumed:
        transaction.on_commit(notify_runnable)
    return bool(resumed)


KEEP: Any = object()


@retried_on_deadlock
def set_budget(
    target,
    user,
    reason: str,
    *,
    usd: Decimal | None = KEEP,
    tokens: int | None = KEEP,
    run_usd: Decimal | None = KEEP,
    run_tokens: int | None = KEEP,
) -> dict:
    """Set budgets. A run's `usd`/`tokens` are its own limits; a workflow's or everything's
    are shared daily limits, and `run_usd`/`run_tokens` the default budget of each new run.
    None removes a limit. Runs paused over budget in the target resume and re-check."""
    user = require(user, "runs.set_budget", "set budgets")
    reason = needs_reason(reason, "a budget change")
    target, actor = parse_target(target), user.get_username()

    def micros(value):
        if value in (KEEP, None):
            return value
        try:
            return to_micros(value)
        except ValueError as exc:
            raise OperationError(str(exc)) from None

    def count(value):
        if value in (KEEP, None):
            return value
        if not isinstance(value, int) or value < 0:
            raise OperationError("a token budget is a non-negative integer")
        return value

    if target.kind in ("run", "label") and (run_usd is not KEEP or run_tokens is not KEEP):
        raise OperationError("run defaults are set on a workflow or on everything")
    with transaction.atomic():
        holds.serialise_hold_changes()  # it requeues runs paused over budget, perhaps held
        if target.kind == "run":
            run = lock_run(target.value)
            changes = {"budget_micros": micros(usd), "budget_tokens": count(tokens)}
            changes = {k: v for k, v in changes.items() if v is not KEEP}
            before = {k: getattr(run, k) for k in changes}
            Run.objects.filter(pk=run.pk).update(**changes, budget_warned=False)
            run_event(
                run.pk, EventType.BUDGET_SET, actor=actor, reason=reason, before=before,
                after=changes,
            )  # fmt: skip
            affected = Run.objects.filter(pk=run.pk)
        else:
            known_scope(target)
            policy, _ = Policy.objects.select_for_update().get_or_create(scope=target.scope)
            changes = {
                "daily_budget_micros": micros(usd),
                "daily_budget_tokens": count(tokens),
                "run_budget_micros": micros(run_usd),
                "run_budget_tokens": count(run_tokens),
            }
            changes = {k: v for k, v in changes.items() if v is not KEEP}
            before = {k: getattr(policy, k) for k in changes}
            Policy.objects.filter(pk=policy.pk).update(**changes)
            audit(
                actor,
                EventType.BUDGET_SET,
                target=target.label,
                reason=reason,
                before=before,
                after=changes,
            )
            affected = Run.objects.filter(_in_scope(target))
        for run_id in affected.filter(status=RunStatus.OVER_BUDGET).values_list("id", flat=True):
            Run.objects.filter(pk=run_id, status=RunStatus.OVER_BUDGET).update(
                status=_requeued(), wake_at=timezone.now()
            )
            run_event(run_id, EventType.RUN_RESUMED, actor=actor, reason="budget raised")
            transaction.on_commit(notify_runnable)
        if target.kind != "run" and any(
            changes.get(k) is not None for k in ("daily_budget_micros", "daily_budget_tokens")
        ):
            count_the_day(target.scope)  # the day's spend so far counts, whenever it is set
    forget_cached_scopes()
    return changes


def compensated(run: Run) -> bool:
    """Whether the run's compensations ran: it is forked from a step then, never retried."""
    return run.steps.filter(key__startswith="undo:").exists()


@retried_on_deadlock
def retry_run(run_id, user, reason: str) -> Run:
    """Run a failed run again from the top: completed steps stay memoized, the failed one runs."""
    user = require(user, "runs.retry_run", "retry runs")
    reason = needs_reason(reason, "a retry")
    with transaction.atomic():
        # The rows whose holds cover the run, in the lock order (policies, the run, its
        # ancestors), before the statement that decides `halted` or `pending`.
        chain = holds.lineage(find_run(run_id))
        holds.lock_policies(chain)
        run = lock_run(run_id)
        holds.lock_ancestors(chain)
        if run.status != RunStatus.FAILED:
            raise Conflict(f"run {run.pk} is {run.status}; only failed runs are retried")
        if compensated(run):
            raise OperationError(f"run {run.pk} was compensated; fork it from a step instead")
        Run.objects.filter(pk=run.pk).update(
            status=_requeued(),  # halted if a hold covers it: a retry lifts no halt
            attempt=run.attempt + 1,
            max_attempts=max(run.max_attempts, run.attempt + 1),
            recoveries=0,
            finished_at=None,
            wake_at=timezone.now(),
        )
        run_event(run.pk, EventType.RUN_RETRY_REQUESTED, actor=user.get_username(), reason=reason)
        transaction.on_commit(notify_runnable)
    run.refresh_from_db()
    return run


def _fork_point(run: Run, step) -> int:
    if isinstance(step, int):
        seq = step
    else:
        seq = run.steps.filter(key=step).values_list("seq", flat=True).first()
        if seq is None:
            raise OperationError(f"run {run.pk} has no step {step!r}")
    if seq < 0 or not run.steps.filter(seq=seq).exists():
        raise OperationError(f"run {run.pk} has no step at position {seq}")
    return seq


def fork_preview(run_id, step, *, input: Any = KEEP, outputs: dict | None = None) -> list[dict]:
    """What a fork from `step` with these edits runs again, so a person sees it before
    confirming: the copied approvals it asks again (`asked_again` says why), then the recorded
    steps from the fork point on (if the code takes the same path)."""
    run = find_run(run_id)
    seq = _fork_point(run, step)
    kept = list(run.steps.filter(seq__lt=seq, status=StepStatus.COMPLETED).order_by("seq"))
    again = forks.asked_again(run, kept, fork_edits(run, seq, kept, input, outputs))
    asks = [
        {"seq": s.seq, "key": s.key, "kind": s.kind, "asked_again": again[s.key]}
        for s in kept
        if s.key in again
    ]
    rest = run.steps.filter(seq__gte=seq).order_by("seq").values("seq", "key", "kind")
    return asks + [{**s, "asked_again": None} for s in rest]


#: An edited value whose old and new JSON together are longer is recorded by digest.
EDIT_INLINE_CHARS = 4096


def _edit(old: Any, new: Any, what: str) -> dict | None:
    """What an edit replaced, for the fork's `run.created` event: both values, or (when they
    are large) their SHA-256 digests and sizes; None when nothing changed."""
    new_text = forks.stored_text(new, what)
    old_text = json.dumps(old, sort_keys=True, ensure_ascii=False, default=str)
    if new_text == old_text:
        return None
    if len(old_text) + len(new_text) <= EDIT_INLINE_CHARS:
        return {"old": old, "new": new}
    digest = lambda text: hashlib.sha256(text.encode()).hexdigest()  # noqa: E731
    return {
        "old_sha256": digest(old_text), "old_chars": len(old_text),
        "new_sha256": digest(new_text), "new_chars": len(new_text),
    }  # fmt: skip


def fork_edits(origin: Run, seq: int, kept: list[Step], input: Any, outputs: dict | None):
    """Check a fork's edits against the origin before anything is written: `input` (KEEP: the
    origin's) and `outputs` ({step key: replacement output} for steps before the fork point).
    Returns what the fork's run.created event records (empty: nothing edited)."""
    edited: dict[str, Any] = {}
    if input is not KEEP:
        change = _edit(origin.input, input, "the input")
        if change is not None:
            edited["input"] = change
    if outputs is None:
        return edited
    if not isinstance(outputs, dict):
        raise OperationError("outputs is an object: {step key: replacement output}")
    by_key = {s.key: s for s in kept}
    for key, value in outputs.items():
        if key not in by_key:
            editable = [k for k, s in by_key.items() if s.kind != StepKind.APPROVAL]
            allowed = ", ".join(map(repr, editable)) or "none: the fork point is the first"
            raise OperationError(
                f"outputs names step {key!r}, which is not a step before the fork point at"
                f" position {seq} (steps whose output can be edited: {allowed})"
            )
        change = _edit(by_key[key].output, value, f"the output of step {key!r}")
        if change is not None:
            forks.refuse_decision_edit(by_key[key])
            edited.setdefault("outputs", {})[key] = change
    return edited


def fork_summary(edited: dict) -> list[str]:
    """What a fork edited, as the run page says it: "the input", "the output of step K"."""
    said = ["the input"] if "input" in edited else []
    return said + [f"the output of step {key}" for key in edited.get("outputs", {})]


@retried_on_deadlock
def fork_run(
    run_id, step, user, reason: str, *, input: Any = KEEP, outputs: dict | None = None
) -> Run:
    """A new run of the same workflow, version and input that reuses the recorded outputs of
    the steps before `step` (a key or a position) and runs the rest anew.

    `input` replaces the run's input and `outputs` ({step key: output}) the recorded outputs
    of steps before the fork point: the fork replays them as if the steps had returned them
    (edit what a model said, and go on from there). The edits are checked before anything is
    written and recorded, old and new, in the fork's `run.created` event. A copied approval
    that does not stand for the fork (runs/forks.py) is not copied: the fork asks again.
    The engine's own runs (`stepguard.*`) are not forked, as they are not started, by hand."""
    user = require(user, "runs.fork_run", "fork runs")
    reason = needs_reason(reason, "a fork")
    actor = user.get_username()
    with transaction.atomic():
        # The holds the fork inherits or is covered by are read under lock, in the lock order.
        chain = holds.lineage(find_run(run_id))
        holds.lock_policies(chain)
        origin = lock_run(run_id)
        if registry.builtin(origin.workflow):  # it could send any event to any channel
            raise OperationError(
                f"workflow {origin.workflow!r} is Stepguard's own: its runs are not forked by hand"
            )
        holds.lock_ancestors(chain)
        seq = _fork_point(origin, step)
        kept = _completed_before(origin, seq)
        edited = fork_edits(origin, seq, kept, input, outputs)
        again = forks.asked_again(origin, kept, edited)
        fork = create_run(
            workflow=origin.workflow,
            version=origin.version,
            input=input if "input" in edited else origin.input,
            key=None,
            created={"edited": edited} if edited else None,
            forked_from=origin,
            forked_at_seq=seq,
            **_origin_options(origin),
            **_held_as(_inherited_hold(origin)),
            # The forker chose what the fork does again; the origin's shapers are found
            # through `forked_from` (runs.approvals.services.four_eyes).
            shapers=[(user.pk, Shaped.FORKED)],
        )
        replaced = outputs or {}
        # A replaced output is the step's recorded output on every replay of the fork; the
        # copy is inherited, so it registers no compensation (the fork did not perform it).
        Step.objects.bulk_create(
            [_copy_step(s, fork, replaced.get(s.key, s.output)) for s in kept if s.key not in again]
        )
        at = kept[-1].key if kept else None
        run_event(
            fork.pk,
            EventType.RUN_FORKED_FROM,
            actor=actor,
            origin=str(origin.pk),
            at_seq=seq,
            reason=reason,
            **({"edited": fork_summary(edited)} if edited else {}),
            **({"asks_again": again} if again else {}),
        )
        run_event(
            origin.pk,
            EventType.RUN_FORKED,
            actor=actor,
            fork=str(fork.pk),
            seq=seq,
            after_step=at,
            reason=reason,
        )
    return fork


def _completed_before(origin: Run, seq: int) -> list[Step]:
    """The origin's steps before the fork point, which the fork keeps: all of them completed,
    else OperationError naming the others."""
    kept = list(origin.steps.filter(seq__lt=seq).order_by("seq"))
    unfinished = [s.key for s in kept if s.status != StepStatus.COMPLETED]
    if unfinished:
        raise OperationError(f"steps before the fork point are not completed: {unfinished}")
    return kept


def _origin_options(origin: Run) -> dict[str, Any]:
    """Every option a user set on the origin, with the budgets it had: the fork's too."""
    return {
        "max_attempts": origin.max_attempts,
        "budget_micros": origin.budget_micros,
        "budget_tokens": origin.budget_tokens,
        "priority": origin.priority,
        "concurrency_key": origin.concurrency_key,
        "labels": origin.labels,
    }


def _inherited_hold(origin: Run) -> holds.Hold | None:
    """The hold a fork of `origin` takes as its own, if any.

    Forking is no way around a halt: a hold on the origin or its ancestors holds the fork too
    (workflow and global holds cover it anyway). A fork has no parent, so a hold that covers
    the origin through its ancestors (their own, or their workflow's) would not cover the
    fork: it becomes the fork's own hold. Its own workflow's hold and the kill switch cover it
    anyway (create_run parks it)."""
    inherited = ("run", "ancestor")
    return next(
        (
            h
            for h in holds.holds_on(origin)
            if h.kind in inherited
            or (h.kind == "workflow" and h.scope != f"workflow {origin.workflow}")
        ),
        None,
    )


def _held_as(own: holds.Hold | None) -> dict[str, Any]:
    """A new run's fields for the hold `own` of its own (halted from the start), or none."""
    return {
        "halted_at": own.at if own else None,
        "halted_by": own.by if own else "",
        "halt_reason": own.reason if own else "",
        "status": RunStatus.HALTED if own else RunStatus.PENDING,
    }


def _copy_step(step: Step, fork: Run, output: Any) -> Step:
    return Step(
        run=fork,
        seq=step.seq,
        key=step.key,
        kind=step.kind,
        status=StepStatus.COMPLETED,
        input=step.input,
        output=output,
        idempotency_key=f"{fork.pk}:{step.key}",
        attempt=step.attempt,
        inherited=True,
        started_at=step.started_at,
        finished_at=step.finished_at,
    )


# -- flow control (docs/flow-control.md) -----------------------------------------------------------


@retried_on_deadlock
def set_limits(workflow: str, user, reason: str, *, max_running=KEEP, max_running_per_key=KEEP):
    """An operator's concurrency limits of a workflow, over the code's; None returns to the
    code's. Applies from the next claim on; running runs finish."""
    user = require(user, "runs.set_flow", "set concurrency limits")
    reason = needs_reason(reason, "a limit change")
    target = Target("workflow", workflow)
    known_scope(target)
    changes = {"max_running": max_running, "max_running_per_key": max_running_per_key}
    changes = {k: v for k, v in changes.items() if v is not KEEP}
    if not changes:
        raise OperationError("give max_running, max_running_per_key or both")
    for name, value in changes.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise OperationError(f"{name} is a positive integer or null")
        if value is not None and not 1 <= value <= 100_000:
            raise OperationError(f"{name} must be between 1 and 100000 (null: the code's)")
    with transaction.atomic():
        policy, _ = Policy.objects.select_for_update().get_or_create(scope=workflow)
        before = {k: getattr(policy, k) for k in changes}
        Policy.objects.filter(pk=policy.pk).update(**changes)
        audit(user.get_username(), EventType.LIMITS_SET, workflow=workflow, reason=reason,
              before=before, after=changes)  # fmt: skip
    return Policy.objects.get(pk=policy.pk)


def save_schedule(user, name: str, **fields) -> Schedule:
    """Create or replace schedule `name` (runs.schedules.save's fields); audited."""
    user = require(user, "runs.set_flow", "manage schedules")
    require(user, "runs.add_run", "start runs on a schedule")
    with transaction.atomic():
        existed = Schedule.objects.filter(name=name).exists()
        schedule = schedules.save(name, **fields, created_by=user, shaped_by=[user.pk])
        audit(user.get_username(), EventType.SCHEDULE_CHANGED, schedule=name,
              change="replaced" if existed else "added", cron=schedule.cron,
              workflow=schedule.workflow)  # fmt: skip
    return schedule


def pause_schedule(user, name: str, paused: bool) -> Schedule:
    user = require(user, "runs.set_flow", "pause or resume schedules")
    with transaction.atomic():
        if not Schedule.objects.filter(name=name).exists():
            raise NotFound(f"no schedule named {name!r}")
        schedule = schedules.set_paused(name, paused, by=user)
        audit(user.get_username(), EventType.SCHEDULE_CHANGED, schedule=name,
              change="paused" if paused else "resumed")  # fmt: skip
    return schedule


def remove_schedule(user, name: str) -> None:
    """Delete a schedule; the runs it started stay."""
    user = require(user, "runs.set_flow", "remove schedules")
    with transaction.atomic():
        if not Schedule.objects.filter(name=name).delete()[0]:
            raise NotFound(f"no schedule named {name!r}")
        audit(user.get_username(), EventType.SCHEDULE_CHANGED, schedule=name, change="removed")


def set_rate_limit(
    resource: str, user, reason: str, *, requests=None, tokens=None, window_seconds: int = 60
) -> RateLimit | None:
    """At most `requests` calls and `tokens` tokens of `resource` (a model's name, or what a
    step declares with `resource=`) in any `window_seconds`, across all workers. Neither
    given: the limit is removed. Applies to the next call."""
    user = require(user, "runs.set_flow", "set rate limits")
    reason = needs_reason(reason, "a rate limit change")
    if not resource or len(resource) > 200 or "\x00" in resource:
        raise OperationError("a resource name is 1 to 200 characters")
    for name, value in (("requests", requests), ("tokens", tokens)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise OperationError(f"{name} is a positive integer or null")
    if isinstance(window_seconds, bool) or not isinstance(window_seconds, int):
        raise OperationError("window_seconds is an integer")
    if not 1 <= window_seconds <= 86400:
        raise OperationError("window_seconds must be between 1 and 86400")
    with transaction.atomic():
        before = RateLimit.objects.select_for_update().filter(resource=resource).first()
        was = None if before is None else {"requests": before.requests, "tokens": before.tokens,
                                           "window_seconds": before.window_seconds}  # fmt: skip
        if requests is None and tokens is None:
            if before is None:
                raise NotFound(f"no rate limit on {resource!r}")
            before.delete()
            limit = None
        else:
            limit, _ = RateLimit.objects.update_or_create(
                resource=resource,
                defaults={"requests": requests, "tokens": tokens, "window_seconds": window_seconds},
            )
        after = None if limit is None else {"requests": requests, "tokens": tokens,
                                            "window_seconds": window_seconds}  # fmt: skip
        audit(user.get_username(), EventType.RATE_LIMIT_SET, resource=resource, reason=reason,
              before=was, after=after)  # fmt: skip
    _wake_throttled(resource)
    return limit


def _wake_throttled(resource: str) -> None:
    """The runs waiting for `resource`'s capacity look again now, under the limit as it is
    (a raised or removed one lets them through; they waited out the old window before). One
    that still finds none waits again, until its new time. After the limit's own transaction:
    no run row is locked while the limit's is."""
    now = timezone.now()
    with transaction.atomic():
        throttled = Step.objects.filter(status=StepStatus.WAITING, error__throttled=resource)
        runs = list(throttled.values_list("run_id", flat=True).distinct())
        if not runs:
            return
        throttled.update(wake_at=now)
        Run.objects.filter(pk__in=runs, status=RunStatus.WAITING).update(wake_at=now)
        transaction.on_commit(notify_runnable)
