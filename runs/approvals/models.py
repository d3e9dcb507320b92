"""Approval requests: a person decides whether a run may take a side-effecting action.

A request is created by `ctx.approval(...)` (or by an ambiguous step whose policy is to ask),
and decided once: the first decision wins, by a conditional UPDATE on `status = 'pending'`.
"""

import hashlib
import json
from typing import Any

from django.conf import settings
from django.db import models
from django.db.models import Q

from runs.fields import ExactJSONField


def approved_digest(workflow: str, step_key: str, action: str, summary: str, payload: Any) -> str:
    """The SHA-256 of the canonical JSON of what an approver sees: the action an approval
    stands for. A fork reuses an approval only if its code asks for the same digest."""
    seen = {
        "workflow": workflow, "step": step_key, "action": action, "summary": summary,
        "payload": payload,
    }  # fmt: skip
    text = json.dumps(seen, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


class ApprovalStatus(models.TextChoices):
    PENDING = "pending"
    APPROVED = "approved"
    REJECTED = "rejected"
    EXPIRED = "expired"
    REVOKED = "revoked"


class ApprovalKind(models.TextChoices):
    ACTION = "action", "approve an action"
    AMBIGUOUS = "ambiguous", "resolve a step whose outcome is unknown"


class Resolution(models.TextChoices):
    """What a person said about an ambiguous step."""

    NONE = "", "-"
    HAPPENED = "happened", "it happened (record this output)"
    RESEND = "resend", "re-send it with the same idempotency key"
    FAIL = "fail", "fail the run"


class ApprovalRequest(models.Model):
    # Indexed by the unique (run, step_key) constraint, which leads with run.
    run = models.ForeignKey(
        "runs.Run", on_delete=models.CASCADE, related_name="approvals", db_index=False
    )
    step_key = models.CharField(max_length=255)
    kind = models.CharField(max_length=20, choices=ApprovalKind, default=ApprovalKind.ACTION)
    action = models.CharField(max_length=200)
    summary = models.TextField(blank=True, default="")
    payload = models.JSONField(null=True, blank=True)
    #: approved_digest() of what the approver sees ("" for an ambiguous step's question).
    sha256 = models.CharField(max_length=64, blank=True, default="")
    status = models.CharField(max_length=20, choices=ApprovalStatus, default=ApprovalStatus.PENDING)
    resolution = models.CharField(max_length=20, choices=Resolution, default="", blank=True)
    resolution_output = ExactJSONField(null=True, blank=True)
    decided_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    decided_at = models.DateTimeField(null=True, blank=True)
    comment = models.TextField(blank=True, default="")
    expires_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["created_at"]
        permissions = [("decide_approvalrequest", "Can approve or reject pending actions")]
        constraints = [
            models.UniqueConstraint(
                fields=["run", "step_key"], name="approvals_request_step_unique"
            ),
            models.CheckConstraint(
                condition=Q(status__in=ApprovalStatus.values), name="approvals_request_status_valid"
            ),
            models.CheckConstraint(
                condition=Q(status__in=["pending", "expired"]) | Q(decided_at__isnull=False),
                name="approvals_request_decided_has_time",
            ),
            models.CheckConstraint(
                condition=Q(kind="action", resolution="") | Q(kind="ambiguous"),
                name="approvals_request_resolution_only_ambiguous",
            ),
        ]
        indexes = [
            # The inbox: pending requests, oldest first.
            models.Index(
                fields=["created_at"], condition=Q(status="pending"), name="approvals_pending_idx"
            ),
            # The inbox's pages of pending requests, in id order (`after=<id>`): an index range
            # of the pending ones, where the primary key's walked every decided request first
            # (100,601 rows read, 462 ms, at 100,000 approvals on a loaded host).
            models.Index(
                fields=["id"], condition=Q(status="pending"), name="approvals_pending_id_idx"
            ),
            # The inbox's recent decisions, newest first (sorting every decided request took
            # 78 ms at 100,000, linear in the history).
            models.Index(
                fields=["-decided_at"],
                condition=Q(decided_at__isnull=False),
                name="approvals_decided_idx",
            ),
            # GET /api/approvals after the pending ones: the rest, newest first.
            models.Index(
                fields=["-created_at"], condition=~Q(status="pending"), name="approvals_done_idx"
            ),
        ]

    def __str__(self) -> str:
        return f"#{self.pk} {self.action} ({self.status})"


class ApprovalLink(models.Model):
    """A decision link sent to one approver about one approval (runs/approvals/links.py).

    The URL carries a token whose SHA-256 is stored here (the token itself never is); the row
    says whose it is, what it approves (the request's digest when it was sent), until when it
    works, and whether it was used or revoked. Single use is this row's conditional UPDATE on
    `used_at IS NULL`, not anything in the process that serves the link.
    """

    approval = models.ForeignKey(ApprovalRequest, on_delete=models.CASCADE, related_name="links")
    # Revoking every link of a person reads by user: the foreign key's index serves it.
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    token_sha256 = models.CharField(max_length=64)
    #: The request's sha256 when the link was made: a link stands for that action only.
    action_sha256 = models.CharField(max_length=64, blank=True, default="")
    #: How the link was sent: "email" or "webhook".
    sent_via = models.CharField(max_length=20)
    created_at = models.DateTimeField()
    expires_at = models.DateTimeField()
    used_at = models.DateTimeField(null=True, blank=True)
    decision = models.CharField(max_length=20, blank=True, default="")
    revoked_at = models.DateTimeField(null=True, blank=True)
    revoked_by = models.CharField(max_length=150, blank=True, default="")
    revoke_reason = models.CharField(max_length=500, blank=True, default="")

    class Meta:
        constraints = [
            # Serves the lookup of a followed link, and makes a token one row.
            models.UniqueConstraint(fields=["token_sha256"], name="approvals_link_token_unique"),
            models.CheckConstraint(
                condition=Q(used_at__isnull=True, decision="")
                | Q(used_at__isnull=False, decision__in=["approve", "reject"]),
                name="approvals_link_used_has_decision",
            ),
        ]

    def __str__(self) -> str:
        return f"link #{self.pk} to {self.user_id} for approval #{self.approval_id}"
