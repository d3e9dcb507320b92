from django.contrib import admin

from runs.admin import HistoryAdmin
from runs.approvals.models import ApprovalLink, ApprovalRequest


@admin.register(ApprovalRequest)
class ApprovalRequestAdmin(HistoryAdmin, admin.ModelAdmin):
    """Read-only here: decisions go through runs.approvals.services (permission, event, wake-up)."""

    list_display = ("id", "action", "kind", "status", "run", "created_at", "decided_by")
    list_filter = ("status", "kind")


@admin.register(ApprovalLink)
class ApprovalLinkAdmin(HistoryAdmin, admin.ModelAdmin):
    """Who was sent which decision link, and whether it was used or revoked (read-only: revoke
    with `manage.py revokelinks`, which asks for a reason). The token is never stored."""

    list_display = ("id", "approval", "user", "sent_via", "expires_at", "used_at", "decision")
    list_filter = ("sent_via", "decision")
    exclude = ("token_sha256",)
