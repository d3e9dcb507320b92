"""The versions page: the workflow versions in flight, and the release check run from it
against the code this web server imports (runs.versions, runs.replaycheck)."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import HttpResponse
from django.shortcuts import render
from django.urls import reverse
from django.views.decorators.http import require_POST

from runs.engine import registry
from runs.errors import StepguardError
from runs.replaycheck import CHECK_PERMISSION, check
from runs.versions import in_flight
from runs.views.common import viewer_required


@viewer_required
def versions_page(request) -> HttpResponse:
    """Runs per workflow version, whether a live worker serves each, when each drains."""
    return _page(request)


@login_required
@require_POST
def versions_check(request) -> HttpResponse:
    """Run the release check (optionally one workflow's) and show its report on the page."""
    if not request.user.has_perm(CHECK_PERMISSION):
        message = f"You may not run the release check (needs {CHECK_PERMISSION})."
        back = reverse("stepguard:versions")
        return render(
            request, "stepguard/refused.html", {"message": message, "back": back}, status=403
        )
    workflow = request.POST.get("workflow", "").strip() or None
    registry.load_configured()
    try:
        report, error = check(workflow=workflow), ""
    except StepguardError as exc:
        report, error = None, str(exc)
    return _page(request, report=report, error=error, workflow=workflow or "")


def _page(request, **extra) -> HttpResponse:
    versions = in_flight()
    context = {
        "versions": versions,
        "may_check": request.user.has_perm(CHECK_PERMISSION),
        "check_permission": CHECK_PERMISSION,
        "workflows": sorted({v.workflow for v in versions}),
        **extra,
    }
    return render(request, "runs/versions.html", context)
