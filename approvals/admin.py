from django.contrib import admin

from approvals.models import ApprovalRequest


@admin.register(ApprovalRequest)
class ApprovalRequestAdmin(admin.ModelAdmin):
    """Read-only here: decisions go through approvals.services (permission, event, wake-up)."""

    list_display = ("id", "action", "kind", "status", "run", "created_at", "decided_by")
    list_filter = ("status", "kind")

    def get_readonly_fields(self, request, obj=None):
        return [f.name for f in ApprovalRequest._meta.fields]

    def has_add_permission(self, request):
        return False
