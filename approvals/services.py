"""Deciding approval requests. The first decision wins; every decision is an event.

Lock order everywhere is the run row, then the request row: a worker settling a wait takes
them in that order too, so a decision racing an expiry never deadlocks.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from approvals.models import ApprovalKind, ApprovalRequest, ApprovalStatus, Resolution
from runs.engine.serialization import to_json
from runs.engine.store import run_event
from runs.errors import Conflict, DecisionError, Forbidden, NotFound
from runs.models import EventType, Run, RunShaper, Shaped
from runs.operations import lock_run, needs_reason, require

DECIDE = "approvals.decide_approvalrequest"


def _request(approval_id) -> ApprovalRequest:
    try:
        request = ApprovalRequest.objects.filter(pk=int(approval_id)).first()
    except (TypeError, ValueError):
        request = None
    if request is None:
        raise NotFound(f"no approval request #{approval_id}")
    return request


def _already(request: ApprovalRequest) -> Conflict:
    request.refresh_from_db()
    if request.status == ApprovalStatus.PENDING:
        return Conflict(f"approval #{request.pk} expired at {request.expires_at:%Y-%m-%d %H:%M:%S}")
    who = request.decided_by.get_username() if request.decided_by else "nobody"
    when = f" at {request.decided_at:%Y-%m-%d %H:%M:%S}" if request.decided_at else ""
    return Conflict(f"approval #{request.pk} was already {request.status} by {who}{when}")


_SHAPED = {
    Shaped.STARTED: "started run {run}",
    Shaped.FORKED: "forked run {run}",
    Shaped.DEBOUNCED: "gave run {run} its input",
    Shaped.SCHEDULED: "authored or resumed the schedule that started run {run}",
}


def four_eyes(request: ApprovalRequest, user) -> None:
    """Nobody who shaped what an approval approves may decide it: an approval is a second
    person's yes. Shaping a run counts for the run itself, every run below it and every fork of
    it (RunShaper: who started, forked, debounced or scheduled it). STEPGUARD_FOUR_EYES=0
    turns the rule off."""
    if not settings.STEPGUARD_FOUR_EYES:
        return
    lineage, frontier = {request.run_id}, [request.run_id]
    while frontier:  # parents and fork origins, level by level (trees are shallow)
        up = Run.objects.filter(pk__in=frontier).values_list("parent_id", "forked_from_id")
        frontier = [r for pair in up for r in pair if r is not None and r not in lineage]
        lineage.update(frontier)
    shaped = RunShaper.objects.filter(run_id__in=lineage, user=user).order_by("created_at").first()
    if shaped is not None:
        did = _SHAPED.get(shaped.how, "shaped run {run}").format(run=shaped.run_id)
        raise Forbidden(
            f"{user.get_username()} {did} and may not also decide approval #{request.pk}: "
            "another person must (STEPGUARD_FOUR_EYES)"
        )


def _decide(request, user, status: str, comment: str, event: str, **fields) -> ApprovalRequest:
    four_eyes(request, user)
    now = timezone.now()
    with transaction.atomic():
        lock_run(request.run_id)
        open_ = ApprovalRequest.objects.filter(pk=request.pk, status=ApprovalStatus.PENDING)
        open_ = open_.exclude(expires_at__lte=now)
        if not open_.update(
            status=status, decided_by=user, decided_at=now, comment=comment, **fields
        ):
            raise _already(request)
        run_event(
            request.run_id, event, wake=True, actor=user.get_username(), step_key=request.step_key,
            approval_id=request.pk, decision=fields.get("resolution") or status, comment=comment,
        )  # fmt: skip
    request.refresh_from_db()
    return request


def decide(approval_id, decision: str, user, comment: str = "") -> ApprovalRequest:
    """Approve or reject a pending action. Deciding a decided request is a DecisionError."""
    if decision not in ("approve", "reject"):
        raise DecisionError(f"a decision is 'approve' or 'reject', not {decision!r}")
    user = require(user, DECIDE, "decide approvals")
    request = _request(approval_id)
    if request.kind != ApprovalKind.ACTION:
        raise DecisionError(f"approval #{request.pk} asks what happened to a step: use resolve")
    status = ApprovalStatus.APPROVED if decision == "approve" else ApprovalStatus.REJECTED
    return _decide(request, user, status, comment, EventType.APPROVAL_DECIDED)


def resolve(approval_id, choice: str, user, comment: str = "", output: Any = None):
    """Say what happened to a step whose outcome is unknown: happened (recording `output`),
    resend (with the same idempotency key), or fail (the run)."""
    if choice not in Resolution.values or not choice:
        raise DecisionError("a resolution is 'happened', 'resend' or 'fail'")
    user = require(user, DECIDE, "resolve ambiguous steps")
    request = _request(approval_id)
    if request.kind != ApprovalKind.AMBIGUOUS:
        raise DecisionError(f"approval #{request.pk} is an action to approve or reject")
    data = to_json(output, what="the recorded output") if choice == Resolution.HAPPENED else None
    status = ApprovalStatus.REJECTED if choice == Resolution.FAIL else ApprovalStatus.APPROVED
    return _decide(
        request,
        user,
        status,
        comment,
        EventType.APPROVAL_RESOLVED,
        resolution=choice,
        resolution_output=data,
    )


def revoke(approval_id, user, reason: str) -> ApprovalRequest:
    """Withdraw a granted approval: a step guarded by it that has not started yet won't."""
    user = require(user, DECIDE, "revoke approvals")
    reason = needs_reason(reason, "a revoke")
    request = _request(approval_id)
    with transaction.atomic():
        lock_run(request.run_id)
        granted = ApprovalRequest.objects.filter(pk=request.pk, status=ApprovalStatus.APPROVED)
        if not granted.update(status=ApprovalStatus.REVOKED):
            request.refresh_from_db()
            raise Conflict(f"approval #{request.pk} is {request.status}, not approved")
        run_event(
            request.run_id, EventType.APPROVAL_REVOKED, actor=user.get_username(),
            step_key=request.step_key, approval_id=request.pk, reason=reason,
        )  # fmt: skip
    request.refresh_from_db()
    return request
