"""Annotations on the dashboard: the form on a run page and in a step's panel, and the CSV
export the runs list links to. Both call runs.annotations, as the API and the CLI do."""

from __future__ import annotations

from uuid import UUID

from django.contrib.auth.decorators import login_required
from django.http import HttpResponse
from django.urls import reverse
from django.views.decorators.http import require_POST

from runs import annotations
from runs.errors import StepguardError
from runs.views.common import do_action, viewer_required

EXPORT_LIMIT = 50_000


@login_required
@require_POST
def annotate_view(request, run_id: UUID):
    """Mark the run, or the step named by `step`, good, bad or with a note."""
    back = reverse("stepguard:run", args=[run_id]) + "#annotations"
    step = request.POST.get("step") or None

    def act():
        return annotations.annotate(
            run_id,
            request.user,
            verdict=request.POST.get("verdict", ""),
            note=request.POST.get("note", ""),
            step=step,
        )

    def done(made) -> str:
        where = f"step {made.step_key}" if made.step_key else "the run"
        return f"Marked {where}: {made.verdict}"

    return do_action(request, act, back, done)


@viewer_required
def export_view(request):
    """Every annotation matching the filters (verdict, workflow, run, by, since, until) as a
    CSV download, newest first."""
    try:
        rows = annotations.matching(request.GET)[:EXPORT_LIMIT]
        body = annotations.to_csv(rows)
    except StepguardError as exc:
        return HttpResponse(str(exc), status=400, content_type="text/plain; charset=utf-8")
    response = HttpResponse(body, content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = 'attachment; filename="annotations.csv"'
    return response
