"""The runs list: its filters, counts and rows, and the start form above it."""

from __future__ import annotations

import json
from decimal import Decimal
from urllib.parse import urlencode

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.db.models import Count
from django.db.models.fields.json import KT
from django.http import Http404, HttpResponse, HttpResponseRedirect
from django.shortcuts import render
from django.template.defaultfilters import pluralize
from django.urls import reverse
from django.views.decorators.http import require_POST

from runs import labels as run_labels
from runs import operations, queries
from runs.engine import registry
from runs.engine.budget import to_micros, to_usd
from runs.errors import OperationError, UnknownWorkflow
from runs.models import Run, RunStatus, Step, StepKind, StepStatus
from runs.operations.bulk import ACTIONS as BULK_ACTIONS
from runs.queries import RUN_FILTERS, BadFilter, filtered_runs
from runs.sdk import start_run
from runs.views.common import budget_percent, do_action, plain_usd, viewer_required

PAGE = 50


def list_counts(params) -> dict[str, tuple[int, bool]]:
    """The runs list's count per status, under its other filters (a status filter picks one
    of them, so it is left out: each status says how many runs choosing it would show)."""
    try:
        counted, _ = filtered_runs({**params.dict(), "status": ""})
    except BadFilter:
        return dict.fromkeys(RunStatus.values, (0, True))
    return queries.status_counts(counted, probe=queries.probed(params))


@viewer_required
def runs_list(request):
    """Runs, newest first, filtered by URL parameters, paged by keyset (created_at, id)."""
    try:
        runs, filters = filtered_runs(request.GET)
    except BadFilter as exc:
        messages.error(request, str(exc))
        runs = Run.objects.none()
        filters = {k: request.GET.get(k, "") for k in (*RUN_FILTERS, "engine")}
    try:
        # The list shows no input, output or error: never read them (50 runs with 0.9 MB
        # inputs and outputs: 0.42 s for 51 KB of HTML, 0.07 s without reading them).
        page, marker = queries.page(
            runs.defer(*LIST_DEFERRED),
            PAGE,
            request.GET.get("before"),
            probe=queries.probed(filters),
        )
    except BadFilter as exc:
        raise Http404(str(exc)) from None
    counts = list_counts(request.GET)
    total = sum(n for n, _ in counts.values())
    all_exact = all(exact for _, exact in counts.values())
    rows = list_rows(page)
    query = {k: v for k, v in filters.items() if v}
    older = urlencode({**query, "before": marker}) if marker else None
    return render(
        request,
        "runs/list.html",
        {
            "rows": rows,
            "counts": [
                (s, n if exact else queries.about(n), exact) for s, (n, exact) in counts.items()
            ],
            "filters": filters,
            "filter_query": urlencode(query),
            # Each status's link keeps the other filters, as its count does.
            "counts_query": urlencode({k: v for k, v in query.items() if k != "status"}),
            # Unfiltered, the counts say how many runs a bulk action would touch; filtered, the
            # page asks /runs/count after it renders (a substring search counts by a scan).
            "total": total if all_exact else queries.about(total),
            "total_exact": all_exact,
            "exact_up_to": f"{queries.EXACT_UP_TO:,}",
            "older_query": older,
            "statuses": RunStatus.values,
            "annotation_choices": ANNOTATION_CHOICES,
            "can_operate": request.user.has_perm("runs.halt_run"),
            "bulk_actions": BULK_ACTIONS,
            "can_start": request.user.has_perm("runs.add_run"),
            "registered": start_choices() if request.user.has_perm("runs.add_run") else [],
            # What a refused Start form held, typed again for the person (start_view).
            "start_form": request.session.pop(START_FORM, None),
        },
    )


LIST_DEFERRED = ("input", "output", "error")


ANNOTATION_CHOICES = [
    ("bad", "marked bad"), ("good", "marked good"), ("note", "with a note"), ("any", "annotated"),
]  # fmt: skip


WAIT_WORDS = {
    StepKind.EVENT: "signal",
    StepKind.SLEEP: "timer",
    StepKind.APPROVAL: "approval",
    StepKind.CHILD: "child runs",
}


def list_rows(page: list[Run]) -> list[dict]:
    """The runs list's rows: what each waiting run waits for and how many children each has,
    in two queries for the page, whatever its size."""
    waiting = [r.pk for r in page if r.status == RunStatus.WAITING]
    waits = {  # the signal's name, not the whole input (a model call's is a conversation)
        run_id: (kind, signal, throttled)
        for run_id, kind, signal, throttled in Step.objects.filter(
            run_id__in=waiting, status=StepStatus.WAITING
        ).values_list("run_id", "kind", KT("input__signal"), KT("error__throttled"))
    }
    kids = dict(
        Run.objects.filter(parent_id__in=[r.pk for r in page])
        .values_list("parent_id")
        .annotate(n=Count("id"))
    )
    rows = []
    for r in page:
        kind, signal, throttled = waits.get(r.pk, (None, None, None))
        what = WAIT_WORDS.get(kind, "a retry" if kind else "")
        if kind == StepKind.EVENT:
            what = f"signal “{signal}”"
        elif throttled:
            what = f"rate limit of {throttled}"
        rows.append(
            {
                "run": r,
                "percent": budget_percent(r),
                "usd": to_usd(r.cost_micros),
                "waits_for": what,
                "children": kids.get(r.pk, 0),
            }
        )
    return rows


def registered_workflows() -> list[str]:
    registry.load_configured()
    return sorted({d.name for d in registry.all_workflows() if not registry.builtin(d.name)})


def start_choices() -> list[tuple[str, str]]:
    """The Start form's workflows: (value, label) for each name, which starts the version a
    start by name gets (the one registered last, as start_run), then each other version by
    itself (`name@version`)."""
    registry.load_configured()
    versions: dict[str, list[str]] = {}
    for d in registry.all_workflows():
        if not registry.builtin(d.name):
            versions.setdefault(d.name, []).append(d.version)
    choices = []
    for name in sorted(versions):
        default = registry.get(name).version
        choices.append((name, f"{name} (default, @{default})" if len(versions[name]) > 1 else name))
        choices += [(f"{name}@{v}", f"{name}@{v}") for v in sorted(versions[name]) if v != default]
    return choices


#: The session key under which a refused Start form keeps what was typed, for the list to show.
START_FORM = "stepguard-start-form"


@login_required
@require_POST
def start_view(request):
    """Start a run from the runs list's form: a registered workflow, JSON input, a key and a
    budget, checked here as the API checks them (the page checks the JSON before it posts)."""
    post = request.POST
    created = {}

    def start():
        operations.require(request.user, "runs.add_run", "start runs")
        workflow, _, version = post.get("workflow", "").partition("@")
        if workflow not in registered_workflows():
            raise OperationError(f"no workflow named {workflow!r} is registered")
        if version:
            try:
                registry.get(workflow, version)
            except UnknownWorkflow:
                raise OperationError(f"{workflow} has no version {version!r} here") from None
        text = post.get("input", "").strip()
        try:
            data = json.loads(text) if text else None
        except json.JSONDecodeError as exc:
            raise OperationError(f"the input is not JSON: {exc}") from None
        usd = post.get("budget_usd", "").strip()
        try:  # checked as every amount is: ASCII digits, finite, in range; and more than 0
            if usd and to_micros(usd) <= 0:
                raise ValueError
        except ValueError:
            raise OperationError(f"the budget {usd!r} is not an amount over 0 USD") from None
        plain_usd(usd, "the budget")
        budget = Decimal(usd) if usd else None
        labels = run_labels.parse(post.get("labels", ""))
        created["run"] = start_run(
            workflow, data, key=post.get("key", "").strip() or None, budget_usd=budget,
            version=version or None, started_by=request.user, labels=labels,
        )  # fmt: skip

    response = do_action(
        request, start, reverse("stepguard:runs"),
        lambda _: f"Started {created['run'].workflow} run {str(created['run'].pk)[:8]}.",
    )  # fmt: skip
    if "run" in created:
        return HttpResponseRedirect(reverse("stepguard:run", args=[created["run"].pk]))
    # Refused: the form opens again with what was typed, beside the message saying why.
    fields = ("workflow", "input", "key", "budget_usd", "labels")
    request.session[START_FORM] = {name: post.get(name, "")[:100_000] for name in fields}
    return response


@viewer_required
def runs_count(request):
    """How many runs match the list's filter: text for the bulk action's label."""
    try:
        runs, _ = filtered_runs(request.GET)
    except BadFilter as exc:
        return HttpResponse(str(exc), content_type="text/plain", status=400)
    n = queries.count_up_to(runs, queries.EXACT_UP_TO)  # bulk takes ≤1,000
    if n > queries.EXACT_UP_TO:
        return HttpResponse(f"more than {queries.EXACT_UP_TO:,} runs", content_type="text/plain")
    return HttpResponse(f"{n} run{pluralize(n)}", content_type="text/plain")
