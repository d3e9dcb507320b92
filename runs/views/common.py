"""What the dashboard's pages share: the viewer's permission check, the one way an action is
taken and confirmed, a JSON download, a run or a 404.

Every page needs a login and the view permission; every action goes through the same operation
the CLI and the API call, so a viewer who posts anyway is refused by the server.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any
from uuid import UUID

from django.contrib import messages
from django.contrib.auth.decorators import login_required, permission_required
from django.http import Http404, HttpResponse, HttpResponseRedirect
from django.shortcuts import render

from runs import operations
from runs.engine import budget
from runs.errors import Forbidden, OperationError, StepguardError
from runs.models import Run


def viewer_required(view):
    """A login, then the view permission (403 without it): Django's own decorators."""
    return login_required(permission_required("runs.view_run", raise_exception=True)(view))


def budget_percent(run: Run) -> int | None:
    if run.budget_micros:
        return round(100 * run.cost_micros / run.budget_micros)
    return None


def _run_or_404(run_id: UUID) -> Run:
    try:
        return operations.find_run(run_id)
    except StepguardError as exc:
        raise Http404(str(exc)) from None


def json_download(value, filename: str) -> HttpResponse:
    response = HttpResponse(
        json.dumps(value, ensure_ascii=False, indent=2), content_type="application/json"
    )
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    return response


def do_action(request, action, back: str, done: str | Callable[[Any], str] = ""):
    """Do `action`; say what went wrong, or (`done`, or `done` of what the action returned)
    what it did: no action goes unconfirmed."""
    try:
        result = action()
    except Forbidden as exc:  # a 403 that says why, on a page with the way back (not a bare one)
        return render(
            request, "stepguard/refused.html", {"message": str(exc), "back": back}, status=403
        )
    except StepguardError as exc:
        messages.error(request, str(exc))
    else:
        said = done(result) if callable(done) else done
        if said:
            messages.success(request, said)
    return HttpResponseRedirect(back)


def plain_usd(text: str | None, what: str) -> None:
    """Refuse what is no plain decimal amount (runs.engine.budget.plain_usd, as the CLI and
    the API do): `1e3` became $1,000 and a 7th decimal was rounded without a word."""
    if text:
        try:
            budget.plain_usd(text, what)
        except ValueError as exc:
            raise OperationError(str(exc)) from None
