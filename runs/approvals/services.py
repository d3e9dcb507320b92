"""Deciding approval requests. The first decision wins; every decision is an event.

Lock order everywhere is the run row, then the request row: a worker settling a wait takes
them in that order too, so a decision racing an expiry never deadlocks.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from runs.approvals.models import ApprovalKind, ApprovalRequest, ApprovalStatus, Resolution
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


def request_approval(
    run_id,
    step_key: str,
    *,
    action: str,
    summary: str = "",
    payload: Any = None,
    kind: str = ApprovalKind.ACTION,
    sha256: str = "",
    expires_at: datetime | None = None,
) -> ApprovalRequest:
    """Ask a person: the one place an approval request is made, by a run's execution inside
    the unit of work that parks the run (Checkpoints.parking), whose fence has locked the
    run row first: the lock order every decision takes."""
    return ApprovalRequest.objects.create(
        run_id=run_id, step_key=step_key, kind=kind, action=action, summary=summary,
        payload=payload, sha256=sha256, expires_at=expires_at,
    )  # fmt: skip


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
    refusal = four_eyes_refusals([request], user).get(request.pk)
    if refusal is not None:
        raise Forbidden(refusal)


def four_eyes_refusals(requests: list[ApprovalRequest], user) -> dict[int, str]:
    """Why `user` may not decide each of `requests` they may not decide, by request id. A
    query per level of the runs' family trees and one for the shapers, for any number of
    requests (the inbox shows a page of them)."""
    if not settings.STEPGUARD_FOUR_EYES or not requests:
        return {}
    lineages = _lineages(requests)
    first: dict = {}  # run id -> (when, how) of this user's first shaping of it
    runs = set().union(*lineages.values())
    shapers = RunShaper.objects.filter(run_id__in=runs, user=user).order_by("created_at")
    for run_id, how, when in shapers.values_list("run_id", "how", "created_at"):
        first.setdefault(run_id, (when, how, run_id))
    refusals = {}
    for request in requests:
        lineage = lineages[request.pk]
        shaped = min((first[r] for r in lineage if r in first), default=None)
        if shaped is not None:
            _, how, run_id = shaped
            did = _SHAPED.get(how, "shaped run {run}").format(run=run_id)
            refusals[request.pk] = (
                f"{user.get_username()} {did} and may not also decide approval #{request.pk}: "
                "another person must (STEPGUARD_FOUR_EYES)"
            )
    return refusals


def _lineages(requests: list[ApprovalRequest]) -> dict[int, set]:
    """Each request's run and every run above it (parents, fork origins), by request id: a
    query per level of the family trees (they are shallow)."""
    ups: dict = {}  # run id -> its parent and fork origin
    frontier = {request.run_id for request in requests}
    while frontier:
        rows = Run.objects.filter(pk__in=frontier).values_list("id", "parent_id", "forked_from_id")
        for run_id, *above in rows:
            ups[run_id] = [r for r in above if r is not None]
        frontier = {r for above in ups.values() for r in above if r not in ups}
    lineages = {}
    for request in requests:
        lineage, todo = set(), [request.run_id]
        while todo:
            run_id = todo.pop()
            if run_id not in lineage:
                lineage.add(run_id)
                todo += ups.get(run_id, [])
        lineages[request.pk] = lineage
    return lineages


def barred(request: ApprovalRequest) -> set:
    """The ids of everyone four eyes bars from deciding `request`, in two queries or so (the
    approvers a notification gives decision links to are those not barred)."""
    if not settings.STEPGUARD_FOUR_EYES:
        return set()
    runs = _lineages([request])[request.pk]
    return set(RunShaper.objects.filter(run_id__in=runs).values_list("user_id", flat=True))


def mark_four_eyes(requests: list[ApprovalRequest], user) -> list[ApprovalRequest]:
    """Set `four_eyes` on each request `user` may not decide (why, as the refusal says), so a
    page offers them no Approve/Reject but says another person must decide."""
    refusals = four_eyes_refusals(requests, user)
    for request in requests:
        request.four_eyes = refusals.get(request.pk, "")  # type: ignore[attr-defined]
    return requests


def _decide(
    request, user, status: str, comment: str, event: str, how: dict | None = None, **fields
) -> ApprovalRequest:
    """`how`: how the decision was made (`via`: dashboard, api, cli, link...), for the event."""
    four_eyes(request, user)
    now = timezone.now()
    with transaction.atomic():
        run = lock_run(request.run_id)
        open_ = ApprovalRequest.objects.filter(pk=request.pk, status=ApprovalStatus.PENDING)
        open_ = open_.exclude(expires_at__lte=now)
        if run.is_terminal and open_.exists():  # it would act on nothing (or on a retry)
            raise Conflict(
                f"approval #{request.pk} cannot be decided: its run {run.pk} is {run.status}"
            )
        if not open_.update(
            status=status, decided_by=user, decided_at=now, comment=comment, **fields
        ):
            raise _already(request)
        run_event(
            request.run_id, event, wake=True, actor=user.get_username(), step_key=request.step_key,
            approval_id=request.pk, decision=fields.get("resolution") or status, comment=comment,
            **(how or {}),
        )  # fmt: skip
    request.refresh_from_db()
    return request


def decide(
    approval_id, decision: str, user, comment: str = "", *, how: dict | None = None
) -> ApprovalRequest:
    """Approve or reject a pending action. Deciding a decided request is a DecisionError.
    `how` goes into the decision's event: how it was made (`{"via": "link", ...}`)."""
    if decision not in ("approve", "reject"):
        raise DecisionError(f"a decision is 'approve' or 'reject', not {decision!r}")
    user = require(user, DECIDE, "decide approvals")
    request = _request(approval_id)
    if request.kind != ApprovalKind.ACTION:
        raise DecisionError(f"approval #{request.pk} asks what happened to a step: use resolve")
    status = ApprovalStatus.APPROVED if decision == "approve" else ApprovalStatus.REJECTED
    return _decide(request, user, status, comment, EventType.APPROVAL_DECIDED, how)


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
