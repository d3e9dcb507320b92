"""What every dashboard page's layout shows: pending approvals and the kill switch."""

from approvals.models import ApprovalRequest, ApprovalStatus
from runs.models import GLOBAL, Policy


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
        }
    }
