"""Approval requests over REST: the inbox, one request, and decisions."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal
from uuid import UUID

from django.conf import settings
from django.db.models import Q
from django.urls import reverse
from ninja import Field, Query, Router, Schema

from runs import bounded
from runs.api import ERRORS_422, TEXT, In, viewer
from runs.approvals.models import ApprovalRequest, ApprovalStatus
from runs.approvals.services import decide, resolve, revoke
from runs.errors import Forbidden, NotFound

router = Router(tags=["approvals"])


class ApprovalOut(Schema):
    id: int
    run_id: UUID
    step_key: str
    kind: str
    action: str
    summary: str
    payload: Any
    status: str
    resolution: str
    decided_by: str | None
    decided_at: datetime | None
    comment: str
    expires_at: datetime | None
    created_at: datetime

    @staticmethod
    def of(request: ApprovalRequest) -> dict:
        data = {f.attname: getattr(request, f.attname) for f in ApprovalRequest._meta.fields}
        data["decided_by"] = request.decided_by.get_username() if request.decided_by else None
        return data


class DecideIn(In):
    decision: Literal["approve", "reject"]
    comment: str = Field("", max_length=2000, pattern=TEXT)


class ResolveIn(In):
    choice: Literal["happened", "resend", "fail"]
    output: Any = Field(None, description="with 'happened': the step's result to record")
    comment: str = Field("", max_length=2000, pattern=TEXT)


class RevokeIn(In):
    reason: str = Field(min_length=1, max_length=2000, pattern=TEXT)


def _get(approval_id: int) -> ApprovalRequest:
    if not 1 <= approval_id <= 2**62:
        raise NotFound(f"no approval request #{approval_id}")
    found = ApprovalRequest.objects.select_related("decided_by").filter(pk=approval_id).first()
    if found is None:
        raise NotFound(f"no approval request #{approval_id}")
    return found


@router.get("", response={200: list[ApprovalOut], **ERRORS_422})
def list_approvals(
    request,
    status: str | None = Query(None, max_length=20, pattern=TEXT),
    limit: int = Query(100, ge=1, le=500),
):
    """Pending requests first (oldest first), then decided ones (newest first). Payloads come
    whole while the list's stay under about STEPGUARD_API_MAX_RESPONSE bytes; past that a
    payload is `{"cut": true, "bytes": N, "whole": "<the request's URL>"}`."""
    viewer(request)
    requests = bounded.sized(ApprovalRequest.objects.select_related("decided_by"), PAYLOAD)
    if status:
        requests = requests.filter(status=status)
    waiting = Q(status=ApprovalStatus.PENDING)
    pending = list(requests.filter(waiting).order_by("created_at")[:limit])
    rest = list(requests.exclude(waiting).order_by("-created_at")[: limit - len(pending)])
    cap = settings.STEPGUARD_API_MAX_RESPONSE
    bounded.fill(pending + rest, PAYLOAD, cap, whole_approval, as_text=True)
    return bounded.relay([_shaped(r) for r in pending + rest])


def _shaped(request: ApprovalRequest) -> dict:
    """ApprovalOut's fields, checked by it, with the payload's stored text left as it is."""
    data = ApprovalOut.of(request)
    payload = data.pop("payload")
    shaped = ApprovalOut.model_validate({**data, "payload": None}).model_dump()
    return {**shaped, "payload": payload}


PAYLOAD = ("payload",)


def whole_approval(approval: ApprovalRequest, field: str) -> str:
    return reverse("stepguard:api:get_approval", kwargs={"approval_id": approval.pk})


@router.get("/{approval_id}", response={200: ApprovalOut, **ERRORS_422})
def get_approval(request, approval_id: int):
    viewer(request)
    return ApprovalOut.of(_get(approval_id))


def person_deciding(request) -> None:
    """With STEPGUARD_API_KEYS_DECIDE off, decisions take a person at the dashboard or the API
    with a session: a leaked or automated key cannot approve what an agent asks for."""
    key = getattr(request, "api_key", None)
    if key is not None and not settings.STEPGUARD_API_KEYS_DECIDE:
        raise Forbidden(
            f"API keys may not decide approvals here (key {key.prefix}; STEPGUARD_API_KEYS_DECIDE)"
        )


@router.post("/{approval_id}/decide", response={200: ApprovalOut, **ERRORS_422})
def decide_approval(request, approval_id: int, body: DecideIn):
    """Approve or reject. The first decision wins; a second one is a 409 naming the first."""
    _get(approval_id)
    person_deciding(request)
    return ApprovalOut.of(
        decide(approval_id, body.decision, request.user, body.comment, how={"via": "api"})
    )


@router.post("/{approval_id}/resolve", response={200: ApprovalOut, **ERRORS_422})
def resolve_approval(request, approval_id: int, body: ResolveIn):
    """For a step whose outcome is unknown: it happened (with output), resend, or fail."""
    _get(approval_id)
    person_deciding(request)
    return ApprovalOut.of(
        resolve(approval_id, body.choice, request.user, body.comment, body.output)
    )


@router.post("/{approval_id}/revoke", response={200: ApprovalOut, **ERRORS_422})
def revoke_approval(request, approval_id: int, body: RevokeIn):
    """Withdraw a granted approval: a guarded step that has not started yet will not."""
    _get(approval_id)
    return ApprovalOut.of(revoke(approval_id, request.user, body.reason))
