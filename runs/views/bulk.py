"""The runs list's bulk action: halt, cancel or retry the selected runs or those matching the
list's filter, through runs.operations.bulk (as `POST /api/runs/bulk` and `manage.py bulk` do).
Above bulk.CONFIRM_ABOVE runs the operator types the count."""

from __future__ import annotations

from urllib.parse import urlencode

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.http import HttpResponseRedirect
from django.shortcuts import render
from django.urls import reverse
from django.views.decorators.http import require_POST

from runs.errors import Forbidden, OperationError
from runs.operations import bulk
from runs.queries import BadFilter, filtered_runs
from runs.views.common import viewer_required


@viewer_required
@require_POST
def bulk_view(request):
    """Halt, cancel or retry the selected runs, or every run matching the list's filter."""
    action, reason = request.POST.get("action", ""), request.POST.get("reason", "").strip()
    back = reverse("stepguard:runs")
    try:  # before anything is counted: who may not act learns nothing about what matches
        user = bulk.allowed(action, request.user)
    except Forbidden as exc:
        raise PermissionDenied(str(exc)) from None
    except OperationError as exc:
        messages.error(request, str(exc))
        return HttpResponseRedirect(back)
    if request.POST.get("scope") == "filter":
        try:
            _, filters = filtered_runs(request.POST)
        except BadFilter as exc:
            messages.error(request, str(exc))
            return HttpResponseRedirect(back)
        query = {k: v for k, v in filters.items() if v}
        back += f"?{urlencode(query)}" if query else ""
        chosen: dict = {"filters": filters}
    else:
        chosen = {"ids": request.POST.getlist("run")}
    try:
        ids = bulk.select(**chosen)
        if not reason:
            raise OperationError(f"a bulk {action} needs a reason")
    except OperationError as exc:
        messages.error(request, str(exc))
        return HttpResponseRedirect(back)
    if len(ids) > bulk.CONFIRM_ABOVE and request.POST.get("confirm", "").strip() != str(len(ids)):
        # Counted now, so a confirmation typed for a count that has since changed is refused.
        return render(
            request,
            "runs/bulk_confirm.html",
            {
                "action": action,
                "count": len(ids),
                "fields": [(k, v) for k, vs in request.POST.lists() for v in vs
                           if k not in ("csrfmiddlewaretoken", "confirm")],
                "retyped": "confirm" in request.POST,
            },
        )  # fmt: skip
    result = bulk.apply(action, ids, user, reason)
    messages.success(request, f"{action}: {result.done} of {len(ids)} runs")
    if refused := [f"{str(o.run_id)[:8]}: {o.message}" for o in result.refused]:
        shown = "; ".join(refused[:5]) + (
            f"; and {len(refused) - 5} more" if len(refused) > 5 else ""
        )
        messages.error(request, f"{len(refused)} refused: {shown}")
    return HttpResponseRedirect(back)
