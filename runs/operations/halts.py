"""Halts: a run, a workflow, a label or everything (the kill switch), parked where it is and
resumed where it was."""

from __future__ import annotations

from dataclasses import dataclass

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from runs import labels as run_labels
from runs.engine import holds, registry
from runs.engine.store import run_event
from runs.engine.wakeup import notify_runnable
from runs.errors import Conflict, NotFound, OperationError
from runs.models import GLOBAL, EventType, Policy, Run, RunStatus
from runs.operations.common import (
    audit,
    find_run,
    lock_run,
    needs_reason,
    require,
    retried_on_deadlock,
)

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


def in_scope(target: Target) -> Q:
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
