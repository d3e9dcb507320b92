from django.contrib import admin

from runs.admin import HistoryAdmin
from runs.approvals.models import ApprovalRequest


@admin.register(ApprovalRequest)
class ApprovalRequestAdmin(HistoryAdmin, admin.ModelAdmin):
    """Read-only here: decisions go through runs.approvals.services (permission, event, wake-up)."""

    list_display = ("id", "action", "kind", "status", "run", "created_at", "decided_by")
    list_filter = ("status", "kind")
