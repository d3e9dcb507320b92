"""What every dashboard page's layout shows: pending approvals and the kill switch."""

from approvals.models import ApprovalRequest, ApprovalStatus
from runs.models import GLOBAL, Policy


def nav(request) -> dict:
    if not getattr(request, "user", None) or not request.user.is_authenticated:
        return {}
    return {
        "nav": {
            "pending": ApprovalRequest.objects.filter(status=ApprovalStatus.PENDING).count(),
            "killswitch": Policy.objects.filter(scope=GLOBAL, halted_at__isnull=False).exists(),
        }
    }
