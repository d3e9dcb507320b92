"""The approvals pages: the inbox, a decision, and a request's whole payload."""

from __future__ import annotations

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.shortcuts import render
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_POST

from runs import bounded
from runs.approvals.models import ApprovalRequest, ApprovalStatus
from runs.approvals.services import decide, mark_four_eyes
from runs.context_processors import pending_badge
from runs.views import do_action, json_download, viewer_required, with_context

INBOX_PAGE = 50


@viewer_required
def approvals_inbox(request):
    """Pending requests across all runs, oldest first, a page at a time; each payload is cut
    to STEPGUARD_UI_MAX_JSON bytes with a link to the whole of it; a payload that would take
    the page's payloads past STEPGUARD_UI_MAX_PAGE bytes is a link only (not even read)."""
    pending = ApprovalRequest.objects.filter(status=ApprovalStatus.PENDING).select_related("run")
    try:
        after = max(int(request.GET.get("after", 0)), 0)
    except ValueError:
        after = 0
    rows = bounded.sized(pending.defer(*RUN_VALUES), ("payload",))
    page = list(rows.filter(pk__gt=after).order_by("pk")[: INBOX_PAGE + 1])
    more = len(page) > INBOX_PAGE
    page = page[:INBOX_PAGE]
    cap = settings.STEPGUARD_UI_MAX_PAGE
    bounded.fill(page, ("payload",), cap, whole_payload, first_always=False)
    with_context(page)
    can_decide = request.user.has_perm("approvals.decide_approvalrequest")
    if can_decide:
        mark_four_eyes(page, request.user)
    return render(
        request,
        "approvals/inbox.html",
        {
            "pending": page,
            # As the layout's badge counts them: up to 999, "999+" past that (a count of
            # every pending request read 20,000 of them on each page of the inbox).
            "pending_total": pending_badge() if more else len(page),
            "next_after": page[-1].pk if more else None,
            "recent": list(
                # Decided ones: an expired request has no decision time (and sorted first on
                # PostgreSQL, for good); approvals_decided_idx serves this.
                ApprovalRequest.objects.filter(decided_at__isnull=False)
                .select_related("run", "decided_by")
                .order_by("-decided_at")[:20]
            ),
            "can_decide": can_decide,
        },
    )


RUN_VALUES = ("run__input", "run__output", "run__error")  # a card shows none of them


def whole_payload(ask: ApprovalRequest, field: str) -> str:
    return reverse("stepguard:approval-payload", args=[ask.pk])


@viewer_required
def approval_payload(request, approval_id: int):
    """An approval request's whole payload, as JSON."""
    found = ApprovalRequest.objects.filter(pk=approval_id).values_list("payload", flat=True)
    if not found:
        raise Http404(f"no approval request #{approval_id}")
    return json_download(found[0], f"approval-{approval_id}-payload.json")


@login_required
@require_POST
def decide_view(request, approval_id: int):
    decision = request.POST.get("decision", "")
    comment = request.POST.get("comment", "")
    back = request.POST.get("next") or reverse("stepguard:approvals")
    if not url_has_allowed_host_and_scheme(back, {request.get_host()}, request.is_secure()):
        back = reverse("stepguard:approvals")
    done = f"Approval {approval_id}: {decision} recorded."
    return do_action(
        request,
        lambda: decide(approval_id, decision, request.user, comment, how={"via": "dashboard"}),
        back,
        done,
    )
