"""What every dashboard page's layout shows: pending approvals, the kill switch, and where the
Django admin is (if the project has one)."""

from django.urls import NoReverseMatch, reverse

from runs.approvals.models import ApprovalRequest, ApprovalStatus
from runs.models import GLOBAL, Policy

#: The badge counts pending requests up to this many ("999+" past it): a count of every one
#: read 20,000 index entries on every page of a history with that many waiting.
BADGE_UP_TO = 999


def pending_badge() -> int | str:
    """How many approval requests are pending, as the layout's badge says it."""
    pending = ApprovalRequest.objects.filter(status=ApprovalStatus.PENDING)
    n = pending.order_by().values("pk")[: BADGE_UP_TO + 1].count()
    return f"{BADGE_UP_TO}+" if n > BADGE_UP_TO else n


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
            "pending": pending_badge(),
            "killswitch": kill is not None,
            "killswitch_by": kill.halted_by if kill else "",
            "killswitch_reason": kill.halt_reason if kill else "",
            "admin": admin_url() if request.user.is_staff else "",
            "replica": getattr(request, "replica_lag", None),
        }
    }
