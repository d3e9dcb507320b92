"""The page a decision link opens (runs/approvals/links.py): no login, since the signed link
is the credential; a GET shows what the approver would decide and a POST (CSRF-protected)
decides. Nothing here is cached, indexed, or sent on as a Referer."""

from __future__ import annotations

import json

from django.conf import settings
from django.shortcuts import render
from django.urls import reverse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_http_methods

from runs.approvals.links import DECISIONS, LinkRefused, check, decide_by_link


def _private(response):
    # The link is in the URL: never sent to another site. (With "no-referrer", browsers send
    # `Origin: null` with the form, which CSRF protection rightly refuses.)
    response["Referrer-Policy"] = "same-origin"
    response["X-Robots-Tag"] = "noindex, nofollow"
    return response


def _refused(request, exc: LinkRefused):
    back = reverse("stepguard:approvals")
    context = {"message": str(exc), "back": back, "title": "Link refused"}
    return render(request, "approvals/link_refused.html", context, status=exc.status)


@never_cache
@require_http_methods(["GET", "HEAD", "POST"])
def link_page(request, signed: str):
    """Confirm (GET), then decide (POST) as the person the link was sent to."""
    if request.method == "POST":
        decision = request.POST.get("decision", "")
        try:
            approval = decide_by_link(signed, decision, request.POST.get("comment", ""))
        except LinkRefused as exc:
            return _private(_refused(request, exc))
        context = {"approval": approval, "who": approval.decided_by.get_username()}
        return _private(render(request, "approvals/link_done.html", context))
    try:
        link = check(signed)
    except LinkRefused as exc:
        return _private(_refused(request, exc))
    approval = link.approval
    shown = json.dumps(approval.payload, indent=2, sort_keys=True, ensure_ascii=False)
    cap = settings.STEPGUARD_UI_MAX_JSON
    chosen = request.GET.get("decision", "")
    context = {
        "link": link,
        "approval": approval,
        "who": link.user.get_username(),
        "payload": shown[:cap] + (" …(cut: see the dashboard)" if len(shown) > cap else ""),
        "first": chosen if chosen in DECISIONS else "",
        # Logged in to the dashboard as someone else: the link still decides as its person.
        "other": request.user.get_username()
        if request.user.is_authenticated and request.user.pk != link.user_id
        else "",
    }
    return _private(render(request, "approvals/link.html", context))
