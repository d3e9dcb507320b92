"""What every dashboard page's layout shows: pending approvals, the kill switch, and where the
Django admin is (if the project has one)."""

from django.urls import NoReverseMatch, reverse

from runs.approvals.models import ApprovalRequest, ApprovalStatus
from runs.models import GLOBAL, Policy


def admin_url() -> str:
    """The admin's index, or "" in a project that mounts no admin."""
    try:
        return reverse("admin:index")
    except NoReverseMatch:
        return ""


def nav(request) -> dict:
    if not getattr(request, "user", None) or not request.user.is_authenticated:
        return {}
    kill = Policy.objects.filter(scope=GLOBAL, halted_at__isnull=False).first()
    return {
        "nav": {
            "pending": ApprovalRequest.objects.filter(status=ApprovalStatus.PENDING).count(),
            "killswitch": kill is not None,
            "killswitch_by": kill.halted_by if kill else "",
            "killswitch_reason": kill.halt_reason if kill else "",
            "admin": admin_url() if request.user.is_staff else "",
            "replica": getattr(request, "replica_lag", None),
        }
    }
