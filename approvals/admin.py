from django.contrib import admin

from approvals.models import ApprovalRequest
from runs.admin import HistoryAdmin


@admin.register(ApprovalRequest)
class ApprovalRequestAdmin(HistoryAdmin, admin.ModelAdmin):
    """Read-only here: decisions go through approvals.services (permission, event, wake-up)."""

    list_display = ("id", "action", "kind", "status", "run", "created_at", "decided_by")
    list_filter = ("status", "kind")
