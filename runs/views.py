"""Dashboard pages: function views rendering server-side templates (htmx for actions).

Every page needs a login and the view permission; every action goes through the same operation
the CLI and the API call, so a viewer who posts anyway is refused by the server.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from datetime import date, timedelta
from decimal import Decimal
from typing import Any
from urllib.parse import urlencode
from uuid import UUID

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required, permission_required
from django.core.exceptions import PermissionDenied
from django.db.models import Count, Q, QuerySet, Sum
from django.db.models.fields.json import KT
from django.http import Http404, HttpResponse, HttpResponseRedirect
from django.shortcuts import render
from django.template.defaultfilters import pluralize
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils import timezone
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_POST

from runs import annotations, bounded, charts, notifications, operations, queries, views_trace
from runs import labels as run_labels
from runs.approvals.models import ApprovalStatus
from runs.approvals.services import mark_four_eyes
from runs.conversation import conversation, last_answer
from runs.engine import budget, flow, rates, registry
from runs.engine.budget import to_micros, to_usd
from runs.engine.deltas import Conversations
from runs.errors import Forbidden, OperationError, StepguardError, UnknownWorkflow
from runs.explain import explain
from runs.models import (
    GLOBAL,
    NOTIFIABLE,
    RENAMED_EVENTS,
    Annotation,
    BudgetLedger,
    Event,
    EventType,
    NotificationChannel,
    Overlap,
    Policy,
    RateLimit,
    Run,
    RunStatus,
    Schedule,
    SpendDay,
    Step,
    StepKind,
    StepStatus,
    Worker,
)
from runs.queries import RUN_FILTERS, BadFilter
from runs.sdk import start_run

log = logging.getLogger("stepguard.dashboard")
PAGE = 50
STEP_CHUNK, EVENT_CHUNK = 200, 500
# Steps worth forking from: those whose re-execution the operator must think about.
FORK_KINDS, FORK_CHOICES = (StepKind.CALL, StepKind.LLM, StepKind.TOOL), 100


def viewer_required(view):
    """A login, then the view permission (403 without it): Django's own decorators."""
    return login_required(permission_required("runs.view_run", raise_exception=True)(view))


def budget_percent(run: Run) -> int | None:
    if run.budget_micros:
        return round(100 * run.cost_micros / run.budget_micros)
    return None


def run_id_from(text: str) -> UUID | None:
    """The run a whole id or the start of one (the 8 characters pages show) names; None if no
    run's id starts so. BadFilter when several do."""
    try:
        return UUID(text)
    except ValueError:
        pass
    found = list(Run.objects.filter(queries.id_prefix(text)).values_list("pk", flat=True)[:2])
    if len(found) > 1:
        raise BadFilter(f"more than one run's id starts with {text!r}: give more of it")
    return found[0] if found else None


def filtered_runs(params) -> tuple[QuerySet, dict]:
    """Runs matching the list's URL filters (the same for the page and for bulk actions;
    the engine's own runs only if asked for: `queries.runs_matching`)."""
    chosen = {k: params.get(k, "").strip() for k in RUN_FILTERS}
    chosen["engine"] = "1" if params.get("engine", "").strip() == "1" else ""
    matching = dict(chosen)
    if chosen["parent"]:  # the short id the pages show is taken
        parent = run_id_from(chosen["parent"])
        if parent is None:
            raise BadFilter(f"parent: no run's id starts with {chosen['parent']!r}")
        matching["parent"] = str(parent)
    return queries.runs_matching(matching), chosen


def list_counts(params) -> dict[str, tuple[int, bool]]:
    """The runs list's count per status, under its other filters (a status filter picks one
    of them, so it is left out: each status says how many runs choosing it would show)."""
    try:
        counted, _ = filtered_runs({**params.dict(), "status": ""})
    except BadFilter:
        return dict.fromkeys(RunStatus.values, (0, True))
    return queries.status_counts(counted)


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
        page, marker = queries.page(runs.defer(*LIST_DEFERRED), PAGE, request.GET.get("before"))
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


# Bulk actions: what each does to one run. Above CONFIRM_ABOVE runs the operator types the count.
BULK_ACTIONS = {
    "halt": operations.halt,
    "cancel": operations.cancel_run,
    "retry": operations.retry_run,
}
BULK_PERMISSIONS = {
    "halt": ("runs.halt_run", "halt runs"),
    "cancel": ("runs.cancel_run", "cancel runs"),
    "retry": ("runs.retry_run", "retry runs"),
}
CONFIRM_ABOVE, BULK_MAX = 10, 1000


@viewer_required
@require_POST
def bulk_view(request):
    """Halt, cancel or retry the selected runs, or every run matching the list's filter."""
    action, reason = request.POST.get("action", ""), request.POST.get("reason", "").strip()
    back = reverse("stepguard:runs")
    if action not in BULK_ACTIONS:
        messages.error(request, f"no bulk action {action!r} (halt, cancel or retry)")
        return HttpResponseRedirect(back)
    permission, verb = BULK_PERMISSIONS[action]
    try:  # before anything is counted: who may not act learns nothing about what matches
        operations.require(request.user, permission, verb)
    except Forbidden as exc:
        raise PermissionDenied(str(exc)) from None
    if request.POST.get("scope") == "filter":
        try:
            runs, filters = filtered_runs(request.POST)
        except BadFilter as exc:
            messages.error(request, str(exc))
            return HttpResponseRedirect(back)
        query = {k: v for k, v in filters.items() if v}
        back += f"?{urlencode(query)}" if query else ""
    else:
        try:
            ids = [UUID(v) for v in request.POST.getlist("run")]
        except ValueError:
            messages.error(request, "a selected run is not a run id")
            return HttpResponseRedirect(back)
        runs = Run.objects.filter(pk__in=ids)
    ids = list(runs.order_by("created_at").values_list("pk", flat=True)[: BULK_MAX + 1])
    if not ids:
        messages.error(request, "no runs are selected")
        return HttpResponseRedirect(back)
    if len(ids) > BULK_MAX:
        messages.error(request, f"more than {BULK_MAX} runs match: narrow the filter")
        return HttpResponseRedirect(back)
    if not reason:
        messages.error(request, f"a bulk {action} needs a reason")
        return HttpResponseRedirect(back)
    if len(ids) > CONFIRM_ABOVE and request.POST.get("confirm", "").strip() != str(len(ids)):
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
    done, refused = 0, []
    for run_id in ids:
        try:
            BULK_ACTIONS[action](str(run_id), request.user, reason)
            done += 1
        except Forbidden as exc:
            raise PermissionDenied(str(exc)) from None
        except StepguardError as exc:
            refused.append(f"{str(run_id)[:8]}: {exc}")
        except Exception as exc:  # a database error on one run: report it, go on with the rest
            log.exception("bulk %s of run %s failed", action, run_id)
            refused.append(f"{str(run_id)[:8]}: {exc.__class__.__name__}")
    messages.success(request, f"{action}: {done} of {len(ids)} runs")
    if refused:
        shown = "; ".join(refused[:5]) + (
            f"; and {len(refused) - 5} more" if len(refused) > 5 else ""
        )
        messages.error(request, f"{len(refused)} refused: {shown}")
    return HttpResponseRedirect(back)


def _run_or_404(run_id: UUID) -> Run:
    try:
        return operations.find_run(run_id)
    except StepguardError as exc:
        raise Http404(str(exc)) from None


def timeline_rows(steps: QuerySet) -> QuerySet:
    """Step rows as the timeline draws them: without input, output and error (a model call's
    may be a whole conversation), which load when a row opens; a child step's run id kept."""
    return steps.defer("input", "output", "error").annotate(
        child_run=KT("input__run_id"), child_workflow=KT("input__workflow")
    )


def _earlier(queryset, before: int | None, chunk: int) -> tuple[list, bool]:
    """The `chunk` rows just before `before` (all if None), in order, and whether more exist."""
    if before is not None:
        queryset = queryset.filter(seq__lt=before)
    rows = list(queryset.order_by("-seq")[: chunk + 1])
    return rows[:chunk][::-1], len(rows) > chunk


def _before(request) -> int | None:
    try:
        return int(request.GET["before"])
    except (KeyError, ValueError):
        return None


def family_cost(run: Run) -> int:
    """What the run's descendants spent, level by level (trees are a few levels deep)."""
    total, level = 0, [run.pk]
    for _ in range(20):
        rows = list(Run.objects.filter(parent_id__in=level).values_list("pk", "cost_micros"))
        if not rows:
            break
        total += sum(cost for _, cost in rows)
        level = [pk for pk, _ in rows]
    return total


def pending_approvals(run: Run) -> list:
    """The run's pending approvals, with their context."""
    return with_context(list(run.approvals.filter(status=ApprovalStatus.PENDING).order_by("pk")))


def with_context(asks: list) -> list:
    """Approval requests with what a person needs to decide: the arguments as JSON (cut to
    STEPGUARD_UI_MAX_JSON), and what the model said in the last model call before the ask.
    Three queries for any number of requests."""
    runs = {ask.run_id for ask in asks}
    asked_at = {
        (run_id, key): seq
        for run_id, key, seq in Step.objects.filter(
            run_id__in=runs, key__in={ask.step_key for ask in asks}
        ).values_list("run_id", "key", "seq")
    }
    calls: dict = {}
    for run_id, seq in Step.objects.filter(
        run_id__in=runs, kind=StepKind.LLM, status=StepStatus.COMPLETED
    ).values_list("run_id", "seq"):
        calls.setdefault(run_id, []).append(seq)
    before = {}
    for ask in asks:
        at = asked_at.get((ask.run_id, ask.step_key))
        earlier = [seq for seq in calls.get(ask.run_id, []) if at is not None and seq < at]
        if earlier:
            before[ask.pk] = (ask.run_id, max(earlier))
    said = {}
    if before:
        match = Q()
        for run_id, seq in before.values():
            match |= Q(run_id=run_id, seq=seq)
        said = {
            (run_id, seq): output
            for run_id, seq, output in Step.objects.filter(match).values_list(
                "run_id", "seq", "output"
            )
        }
    for ask in asks:
        url = reverse("stepguard:approval-payload", args=[ask.pk])
        left_out = getattr(ask, "cut_fields", {}).get("payload")  # runs.bounded.fill
        if left_out is not None:
            ask.shown = {"name": "payload", "value": None, "cut": "", "size": left_out, "url": url}
        else:
            ask.shown = shown("payload", ask.payload, url)
        output = said.get(before.get(ask.pk))
        ask.model_said = last_answer(output)[:2000] if output else ""
    return asks


def header_context(request, run: Run) -> dict:
    """The run header: what the run got and produced, why it is in its state and the one action
    that moves it on. Rendered with the page and again whenever the live feed says it changed."""
    state = explain(run)
    children_cost = family_cost(run)
    user = request.user
    hold = state.hold
    return {
        "run": run,
        "state": state,
        "may_act": state.may_act(user),
        "hold_workflow": hold.scope.removeprefix("workflow ") if hold else "",
        "hold_parent": hold.scope.removeprefix("parent run ") if hold else "",
        "step_count": run.steps.count(),
        "children": list(run.children.order_by("created_at")[:100]),
        **fork_context(run),
        "children_usd": to_usd(children_cost),
        "total_usd": to_usd(run.cost_micros + children_cost),
        "percent": budget_percent(run),
        "usd": to_usd(run.cost_micros),
        "spend_chart": charts.spend_over_time(run),
        "budget_usd": to_usd(run.budget_micros),
        "input": shown("input", run.input, reverse("stepguard:run-json", args=[run.pk, "input"])),
        "output": shown(
            "output", run.output, reverse("stepguard:run-json", args=[run.pk, "output"])
        )
        if run.status == RunStatus.COMPLETED
        else None,
        "approvals": mark_four_eyes(pending_approvals(run), user)
        if user.has_perm("approvals.decide_approvalrequest")
        else pending_approvals(run),
        "held": hold is not None,
        "can_operate": user.has_perm("runs.halt_run"),
        "can_cancel": user.has_perm("runs.cancel_run"),
        "can_budget": user.has_perm("runs.set_budget"),
        "can_retry": user.has_perm("runs.retry_run"),
        "can_decide": user.has_perm("approvals.decide_approvalrequest"),
    }


def fork_context(run: Run) -> dict:
    """The run's forks, and for a fork where it came from: the origin's step it was forked
    at and what was edited ("the input", "the output of step K")."""
    context: dict = {"forks": list(run.forks.order_by("created_at")[:100])}
    if run.forked_from_id is not None:
        context["fork_step"] = (
            Step.objects.filter(run_id=run.forked_from_id, seq=run.forked_at_seq)
            .values_list("key", flat=True)
            .first()
        )
        payload = (
            Event.objects.of(run)
            .filter(type=EventType.RUN_FORKED_FROM)
            .values_list("payload", flat=True)
            .first()
        )
        context["fork_edited"] = (payload or {}).get("edited", [])
        context["fork_asks_again"] = (payload or {}).get("asks_again", {})
    return context


def fork_asks_again(fork: Run) -> dict[str, str]:
    """The copied approvals a fork asks again, with why (its `run.forked_from` event)."""
    payload = (
        Event.objects.of(fork)
        .filter(type=EventType.RUN_FORKED_FROM)
        .values_list("payload", flat=True)
        .first()
    )
    return (payload or {}).get("asks_again", {})


@viewer_required
def run_detail(request, run_id: UUID):
    """A run's header, actions and timeline. Long runs show their latest steps and events;
    earlier ones load in chunks, so a 5,000-step run renders as fast as a short one."""
    # Events first, then the run and its steps: anything that changes after the event cursor
    # (`last_seq`) comes down the live feed, so the status and rows shown are never older
    # than the cursor. (Read the other way round, a run that halted in between showed
    # "running" for good: its last event was already behind the cursor.)
    events, earlier_events = _earlier(Event.objects.filter(run_id=run_id), None, EVENT_CHUNK)
    run = _run_or_404(run_id)
    chosen, match = queries.step_filter(request.GET)
    steps, earlier_steps = _earlier(timeline_rows(run.steps.filter(match)), None, STEP_CHUNK)
    header = header_context(request, run)
    return render(
        request,
        "runs/detail.html",
        {
            **header,
            "steps": steps,
            "earlier_steps": earlier_steps,
            "shown_from": steps[0].seq if steps else 0,
            "filters": chosen,
            "filter_query": urlencode({k: v for k, v in chosen.items() if v}),
            "statuses": StepStatus.values,
            "kinds": StepKind.values,
            "events": events,
            "earlier_events": earlier_events,
            # The live feed resumes from here: nothing is lost between render and connect.
            "last_seq": events[-1].seq if events else 0,
            "last_step": steps[-1].seq if steps else -1,
            "shown_rows": ",".join(str(s.seq) for s in steps),
            "span": _span(run),
            "can_fork": request.user.has_perm("runs.fork_run"),
            "annotations": annotations.of_run(run.pk),
            "can_annotate": request.user.has_perm("runs.annotate_run"),
            "run_id": run.pk,
            "trace": views_trace.trace_of(run) if header["children"] else None,
            # The latest ones: a run is usually forked near where it went wrong.
            "fork_points": list(
                run.steps.filter(kind__in=FORK_KINDS)
                .order_by("-seq")
                .only("run_id", "seq", "key", "kind")[:FORK_CHOICES]
            )[::-1],
        },
    )


def _span(run: Run) -> dict:
    """The run's wall-clock span, for the waterfall's axis (epoch ms; `end` empty while live)."""
    first = run.steps.order_by("seq").values_list("started_at", flat=True).first()
    start = run.started_at or first or run.created_at
    end = run.finished_at if run.is_terminal else None
    return {"start": start, "end": end}


@viewer_required
def run_header(request, run_id: UUID):
    """The header again, for the live feed: the page asks for it when the run's events move."""
    run = _run_or_404(run_id)
    context = {**header_context(request, run), "span": _span(run)}
    # The run's span too: it ends with the run ("-> now" went on ticking after it finished).
    header = render_to_string("runs/detail.html#run-header", context, request)
    return HttpResponse(header + render_to_string("runs/detail.html#run-span", context, request))


@viewer_required
def run_json(request, run_id: UUID, part: str):
    """A run's whole input or output, as JSON (a download)."""
    if part not in ("input", "output"):
        raise Http404(f"a run has no {part!r}")
    run = _run_or_404(run_id)
    return json_download(getattr(run, part), f"run-{run_id}-{part}.json")


@viewer_required
def earlier_steps(request, run_id: UUID):
    """The chunk of timeline rows before `before`, for the "earlier steps" button."""
    run = _run_or_404(run_id)
    chosen, match = queries.step_filter(request.GET)
    steps, more = _earlier(timeline_rows(run.steps.filter(match)), _before(request), STEP_CHUNK)
    return render(
        request,
        "runs/detail.html#earlier-steps",
        {
            "run": run,
            "steps": steps,
            "earlier_steps": more,
            "filter_query": urlencode({k: v for k, v in chosen.items() if v}),
        },
    )


@viewer_required
def earlier_events(request, run_id: UUID):
    """The chunk of history before `before`, for the "earlier events" button."""
    run = _run_or_404(run_id)
    events, more = _earlier(Event.objects.of(run), _before(request), EVENT_CHUNK)
    return render(
        request,
        "runs/detail.html#earlier-events",
        {"run": run, "events": events, "earlier_events": more},
    )


@viewer_required
def step_body(request, run_id: UUID, seq: int):
    """A step's details for the side panel, loaded when its row is opened (rows stay light):
    every attempt, a model call as a conversation, and the raw input, output and error. A
    value too big to show in a page is cut, with a link to the whole of it."""
    step = Step.objects.filter(run_id=run_id, seq=seq).first()
    if step is None:
        raise Http404(f"run {run_id} has no step {seq}")
    step.input = Conversations(run_id).expanded(seq, step.input)
    step.annotated = list(
        Annotation.objects.filter(run_id=run_id, step_seq=seq).order_by("-created_at", "-id")
    )
    parts = [
        shown(
            name, getattr(step, name), reverse("stepguard:run-step-json", args=[run_id, seq, name])
        )
        for name in STEP_PARTS
        if getattr(step, name) is not None or name == "input"
    ]
    sent = step.input
    if isinstance(sent, list) and sent and isinstance(sent[0], dict):
        sent = sent[0]  # a long conversation's request, stored as a delta and expanded
    turns = conversation(sent, step.output) if step.kind == StepKind.LLM else []
    return render(
        request,
        "runs/detail.html#step-body",
        {
            "s": step,
            "parts": parts,
            "turns": turns,
            "model": sent.get("model", "") if isinstance(sent, dict) and turns else "",
            "attempts": attempts(step) if step.kind in ATTEMPTED else None,
            "step_annotations": step.annotated,
            "can_annotate": request.user.has_perm("runs.annotate_run"),
        },
    )


#: Kinds whose function is called, maybe several times; waits are not attempted.
ATTEMPTED = (StepKind.CALL, StepKind.LLM, StepKind.TOOL, StepKind.TRANSACTION)
ATTEMPT_EVENTS = (
    EventType.STEP_STARTED,
    EventType.STEP_RETRYING,
    EventType.STEP_FAILED,
    EventType.STEP_COMPLETED,
)


def attempts(step: Step) -> list[dict]:
    """Every attempt of a step, from its events: when it began and ended, on which worker, and
    how it ended (the error of each failed one; the step row keeps only the last)."""
    found: list[dict] = []
    current: dict | None = None
    events = Event.objects.filter(run_id=step.run_id, step_key=step.key, type__in=ATTEMPT_EVENTS)
    for e in events.order_by("seq"):
        p = e.payload
        if e.type == EventType.STEP_STARTED:
            current = {"n": p.get("attempt", 1), "start": e.created_at, "worker": p.get("worker")}
            continue
        if current is None:  # an attempt that began before history was kept, or a transaction
            current = {"n": p.get("attempt", 1), "start": None, "worker": p.get("worker")}
        end = e.created_at
        if e.type == EventType.STEP_RETRYING and p.get("delay_s"):
            end -= timedelta(seconds=p["delay_s"])  # written after the backoff's sleep
        current |= {"end": end, "worker": p.get("worker") or current["worker"]}
        if e.type == EventType.STEP_COMPLETED:
            found.append({**current, "outcome": "completed"})
            current = None
        elif e.type == EventType.STEP_FAILED:
            found.append({**current, "outcome": "failed", "error": p.get("error")})
            current = None
        elif p.get("error"):  # retrying: the next attempt starts after the delay
            found.append({**current, "outcome": "failed, tried again", "error": p["error"]})
            current = {"n": p.get("attempt", current["n"] + 1), "start": e.created_at,
                       "worker": p.get("worker")}  # fmt: skip
        # else: a durable retry woken early goes back to waiting; the same attempt waits on
    if current is not None and step.status in (StepStatus.STARTED, StepStatus.WAITING):
        found.append({**current, "outcome": step.status})
    return found


STEP_PARTS = ("input", "output", "error")


def shown(name: str, value, whole_url: str) -> dict:
    """How a JSON value appears in a page: as a tree, or cut to STEPGUARD_UI_MAX_JSON bytes."""
    text = json.dumps(value, ensure_ascii=False)
    size = len(text.encode())
    limit = settings.STEPGUARD_UI_MAX_JSON
    cut = text.encode()[:limit].decode(errors="ignore") if size > limit else None
    return {"name": name, "value": value, "cut": cut, "size": size, "url": whole_url}


@viewer_required
def step_json(request, run_id: UUID, seq: int, part: str):
    """One whole value of a step, as JSON (a download, never rendered in a page)."""
    if part not in STEP_PARTS:
        raise Http404(f"a step has no {part!r}")
    step = Step.objects.filter(run_id=run_id, seq=seq).only(part).first()
    if step is None:
        raise Http404(f"run {run_id} has no step {seq}")
    value = getattr(step, part)
    if part == "input":
        value = Conversations(run_id).expanded(seq, value)
    return json_download(value, f"run-{run_id}-step-{seq}-{part}.json")


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


DONE = {"halt": "halted", "unhalt": "unhalted", "cancel": "asked to cancel", "retry": "retried"}


@login_required
@require_POST
def run_action(request, run_id: UUID, action: str):
    """halt, unhalt, cancel, retry: one form post each, with a reason."""
    reason = request.POST.get("reason", "")
    actions = {
        "halt": operations.halt,
        "unhalt": operations.unhalt,
        "cancel": operations.cancel_run,
        "retry": operations.retry_run,
    }
    if action not in actions:
        raise Http404(f"no action {action!r}")
    back = reverse("stepguard:run", args=[run_id])
    done = f"Run {str(run_id)[:8]} {DONE[action]}."
    return do_action(
        request, lambda: actions[action](str(run_id), request.user, reason), back, done
    )


#: Runs of a worker its row names (the rest are counted).
HELD_SHOWN = 20


@viewer_required
def workers_page(request):
    """Workers with their last heartbeat and the runs each holds."""

    workers = list(Worker.objects.order_by("-heartbeat_at")[:200])
    holding = dict(
        Run.objects.filter(worker__in=workers)
        .values_list("worker_id")
        .annotate(n=Count("id"))
        .order_by()
    )
    rows = [
        {
            "worker": w,
            # The newest HELD_SHOWN of its runs, and how many it holds: a list of every one
            # (40,000 on one worker of the bench's fill) took 15 s to render.
            "runs": list(
                Run.objects.filter(worker=w).only("id", "workflow", "worker_id")[:HELD_SHOWN]
            )
            if holding.get(w.pk)
            else [],
            "held": holding.get(w.pk, 0),
        }
        for w in workers
    ]
    silent_since = timezone.now() - timedelta(seconds=settings.STEPGUARD_LEASE_SECONDS)
    return render(request, "runs/workers.html", {"rows": rows, "silent_since": silent_since})


@viewer_required
def audit_page(request):
    """Every operator action (events with a person as actor), filterable by actor, action, run;
    with `system=1`, the system's own events too (lockouts, runs created by code, recoveries)."""
    system = request.GET.get("system") == "1"
    events = Event.objects.select_related("run").order_by("-created_at")
    # Not the events of a pruned run, which on PostgreSQL stay until their month's partition
    # is dropped (runs/partitions.py): a run's actions leave the log with the run.
    events = events.filter(Q(run_id__isnull=True) | Q(run__created_at__isnull=False))
    if not system:
        events = events.exclude(actor="system")
    actor, action, run = (request.GET.get(k, "").strip() for k in ("actor", "action", "run"))
    if actor:
        events = events.filter(actor=actor)
    if action:  # a bookmark of a renamed type still finds its events
        events = events.filter(type=RENAMED_EVENTS.get(action, action))
    if run:
        try:
            run_id = run_id_from(run)  # the short id the pages show is taken
        except BadFilter as exc:
            messages.error(request, str(exc))
            run_id = None
        events = events.filter(run_id=run_id) if run_id else events.none()
    # A page shows a few small fields of each payload: payloads past STEPGUARD_UI_MAX_PAGE in
    # all (a signal's data) are not read; the runs' values never are.
    page = list(bounded.sized(events.defer(*RUN_VALUES), ("payload",))[:300])
    bounded.fill(
        page,
        ("payload",),
        settings.STEPGUARD_UI_MAX_PAGE,
        lambda e, f: "",
        first_always=False,
        marker=lambda size, url: {},
    )
    return render(
        request,
        "runs/audit.html",
        {"events": page,
         "filters": {"actor": actor, "action": action, "run": run, "system": system}},
    )  # fmt: skip


RUN_VALUES = ("run__input", "run__output", "run__error")


def scope_rows(*, labels: bool = False) -> list[dict]:
    """Everything and each workflow, with its policy (halt, budgets); with `labels`, then
    each label value that has a budget (`label:tenant=acme`: budgets only, never halted)."""
    policies = {p.scope: p for p in Policy.objects.all()}
    by_label = sorted(s for s in policies if s.startswith(run_labels.SCOPE_PREFIX))
    workflows = sorted(set(queries.workflow_names()) | (policies.keys() - {GLOBAL, *by_label}))
    rows = [
        {"scope": name, "label": "everything" if name == GLOBAL else name,
         "policy": policies.get(name)}
        for name in [GLOBAL, *workflows]
    ]  # fmt: skip
    for scope in by_label if labels else ():
        value = scope.removeprefix(run_labels.SCOPE_PREFIX)
        rows.append(
            {"scope": scope, "label": f"label {value}", "label_value": value,
             "policy": policies[scope]}
        )  # fmt: skip
    return rows


@viewer_required
def halts_page(request):
    """The kill switch and the workflow-wide halts."""
    scopes = scope_rows()
    return render(
        request,
        "runs/halts.html",
        {
            "scopes": scopes[1:],
            "global_halt": (g := scopes[0]["policy"]) and g.halted_at and g,
            "can_operate": request.user.has_perm("runs.halt_run"),
            "can_unhalt": request.user.has_perm("runs.unhalt_run"),
        },
    )


def _spent_per_label(day: date, labels: list[str]) -> dict[str, int]:
    """Micro-USD spent on `day` by the runs carrying each label: one statement over the day's
    spend rows, however many label budgets the page lists."""
    if not labels:
        return {}
    sums = {f"l{i}": Sum("micros", filter=run_labels.carrying(t)) for i, t in enumerate(labels)}
    found = SpendDay.objects.filter(day=day).aggregate(**sums)
    return {t: found[f"l{i}"] or 0 for i, t in enumerate(labels)}


@viewer_required
def budgets_page(request):
    """Shared daily budgets with what was spent today, and the runs a budget has stopped.

    Today's spend is read from the day's spend rows (SpendDay), not from the ledgers: a ledger
    only counts a scope while it has a daily budget, so a page reading them said $0 for
    workflows that spent money."""
    today = timezone.now().date()
    spent = dict(
        SpendDay.objects.filter(day=today)
        .values_list("workflow")
        .annotate(total=Sum("micros"))
        .order_by()
    )
    held = {row.scope: row for row in BudgetLedger.objects.filter(day=today)}
    scopes = scope_rows(labels=True)
    labelled = _spent_per_label(today, [r["label_value"] for r in scopes if "label_value" in r])
    for row in scopes:
        row["ledger"] = ledger = held.get(row["scope"])
        policy = row["policy"]
        if ledger is not None and policy is not None and policy.daily_budget_micros is not None:
            row["spent"] = ledger.spent_micros  # what the daily budget is enforced against
        elif row["scope"] == GLOBAL:
            row["spent"] = sum(spent.values())
        elif "label_value" in row:
            row["spent"] = labelled[row["label_value"]]
        else:
            row["spent"] = spent.get(row["scope"], 0)
    return render(
        request,
        "runs/budgets.html",
        {
            "scopes": scopes,
            "stopped": list(
                Run.objects.filter(status=RunStatus.OVER_BUDGET).order_by("-created_at")[:100]
            ),
            "can_budget": request.user.has_perm("runs.set_budget"),
            "daily": charts.spend_per_day(),
            "days": charts.DAYS,
        },
    )


@viewer_required
def nav_part(request):
    """The nav (approvals badge, kill switch) or the kill-switch banner, for the live feed."""
    part = "killswitch-banner" if request.GET.get("part") == "banner" else "nav-live"
    return render(request, f"stepguard/base.html#{part}")


@login_required
@require_POST
def budget_scope(request):
    """A workflow's (`workflow` field) or everything's shared daily budget and run default,
    or a label value's (`label`: `tenant=acme`) daily budget, in USD; an empty field removes
    that limit."""
    post = request.POST
    target = f"workflow:{post['workflow']}" if post.get("workflow") else "all"
    if post.get("label"):
        target = f"{run_labels.SCOPE_PREFIX}{post['label']}"
    # Amounts are checked by set_budget (to_micros), which names a bad one.
    fields = ("usd",) if post.get("label") else ("usd", "run_usd")
    amounts = {f: post.get(f, "").strip() or None for f in fields}
    reason = request.POST.get("reason", "")

    def set_it():
        for name, value in amounts.items():
            plain_usd(value, "the daily budget" if name == "usd" else "the run budget")
        operations.set_budget(target, request.user, reason, **amounts)

    return do_action(request, set_it, reverse("stepguard:budgets"), "Budgets set.")


def plain_usd(text: str | None, what: str) -> None:
    """Refuse what is no plain decimal amount (runs.engine.budget.plain_usd, as the CLI and
    the API do): `1e3` became $1,000 and a 7th decimal was rounded without a word."""
    if text:
        try:
            budget.plain_usd(text, what)
        except ValueError as exc:
            raise OperationError(str(exc)) from None


@login_required
@require_POST
def halt_scope(request, action: str):
    """Halt or unhalt a workflow (`workflow` field) or everything (no field)."""
    target = f"workflow:{request.POST['workflow']}" if request.POST.get("workflow") else "all"
    reason = request.POST.get("reason", "")
    act = {"halt": operations.halt, "unhalt": operations.unhalt}.get(action)
    if act is None:
        raise Http404(f"no action {action!r}")
    typed = request.POST.get("confirm", "").strip().lower()
    if target == "all" and action == "halt" and typed != KILL_SWITCH_CONFIRM:
        messages.error(
            request, f"the kill switch halts every run: type “{KILL_SWITCH_CONFIRM}” to confirm"
        )
        return HttpResponseRedirect(reverse("stepguard:halts"))
    back = request.POST.get("next") or reverse("stepguard:halts")
    if not url_has_allowed_host_and_scheme(back, {request.get_host()}, request.is_secure()):
        back = reverse("stepguard:halts")
    label = "Everything" if target == "all" else f"Workflow {request.POST['workflow']}"
    done = f"{label} {'halted' if action == 'halt' else 'unhalted'}."
    return do_action(request, lambda: act(target, request.user, reason), back, done)


#: What an operator types to turn the kill switch on from the dashboard.
KILL_SWITCH_CONFIRM = "halt everything"


@login_required
@require_POST
def budget_view(request, run_id: UUID):
    """Set a run's budget in USD (empty removes it). Lowering one asks first, saying what the
    lower amount will do (it stops a run that has spent it at its next step)."""
    usd = request.POST.get("usd", "").strip() or None  # checked by set_budget
    back = reverse("stepguard:run", args=[run_id])
    reason = request.POST.get("reason", "")
    if usd and request.POST.get("lower") != "1":
        lowered = _lowered_budget(run_id, usd)
        if lowered is not None:
            return render(request, "runs/budget_confirm.html", {**lowered, "reason": reason})

    def set_it():
        plain_usd(usd, "the budget")
        operations.set_budget(str(run_id), request.user, reason, usd=usd)

    done = f"Budget of run {str(run_id)[:8]} set to {f'${usd}' if usd else 'none'}."
    return do_action(request, set_it, back, done)


def _lowered_budget(run_id: UUID, usd: str) -> dict | None:
    """What the confirmation of a lower budget shows, or None if `usd` lowers nothing (no
    budget yet, as much or more, or not an amount: set_budget says why)."""
    run = Run.objects.filter(pk=run_id).only("status", "budget_micros", "cost_micros").first()
    try:
        new = to_micros(usd)
    except ValueError:
        return None
    if run is None or run.budget_micros is None or new >= run.budget_micros:
        return None
    return {
        "run": run, "usd": usd, "new": new, "stops": new <= run.cost_micros,
    }  # fmt: skip


# Kinds that act on the world (or spend) when they run again; waits only wait.
SIDE_EFFECTS = {StepKind.CALL, StepKind.LLM, StepKind.TOOL, StepKind.TRANSACTION, StepKind.CHILD}


@viewer_required
def fork_preview_view(request, run_id: UUID):
    """What forking from `step` would run again, shown before the operator confirms."""
    chosen = request.GET.get("step", "")
    context = {"chosen": chosen, "side_effects": SIDE_EFFECTS, "again": [], "reused": 0}
    try:
        listed = operations.fork_preview(str(run_id), chosen)
        context["again"] = [s for s in listed if s["asked_again"] is None]
        seq = context["again"][0]["seq"]
        kept = Step.objects.filter(run_id=run_id, seq__lt=seq)
        context["reused"] = kept.count()
        effects = [s for s in context["again"] if s["kind"] in SIDE_EFFECTS]
        context["effects"], context["more_effects"] = effects[:100], max(len(effects) - 100, 0)
        context["approvals"] = fork_approvals(kept, listed)
        run = Run.objects.only("input").get(pk=run_id)
        context["edit_input"] = _editable(run.input)
        editable = kept.exclude(kind=StepKind.APPROVAL)  # a recorded decision is not edited
        latest = list(editable.order_by("-seq")[:FORK_EDITABLE])[::-1]
        context["edit_steps"] = [_edit_row(s) for s in latest]
        context["edit_hidden"] = editable.count() - len(latest)
    except StepguardError as exc:
        context["problem"] = str(exc)
    return render(request, "runs/detail.html#fork-preview", context)


def fork_approvals(kept, listed: list[dict]) -> list[dict]:
    """The approvals a fork copies, as the preview says them: asked again (and why), or
    standing unless an edit of the input or of a step before it asks them again."""
    asked = {s["key"]: s["asked_again"] for s in listed if s["asked_again"]}
    # The latest, nearest the fork point, as the editable steps are.
    approvals = list(kept.filter(kind=StepKind.APPROVAL).order_by("-seq")[:FORK_EDITABLE])[::-1]
    rows = []
    for step in approvals:
        earlier = kept.filter(seq__lt=step.seq)
        before = list(earlier.order_by("-seq").values_list("key", flat=True)[:5])[::-1]
        decision = step.output if isinstance(step.output, dict) else {}
        rows.append({
            "key": step.key, "seq": step.seq, "why": asked.get(step.key),
            "approval_id": decision.get("approval_id"), "by": decision.get("decided_by"),
            "before": before, "more": earlier.count() - len(before) if len(before) == 5 else 0,
        })  # fmt: skip
    return rows


#: The copied steps whose outputs the fork form offers to edit: the latest before the fork
#: point (a run is forked near where it went wrong); the API edits any.
FORK_EDITABLE = 20
#: A value longer than this (as indented JSON) is not offered for editing in the browser.
EDITABLE_CHARS = 20_000


def _editable(value) -> str | None:
    text = json.dumps(value, indent=2, ensure_ascii=False, default=str)
    return text if len(text) <= EDITABLE_CHARS else None


def _edit_row(step: Step) -> dict:
    """A copied step as the fork form offers it: a model call's answer as its text, any
    other output as JSON."""
    text = answer_text(step.output) if step.kind == StepKind.LLM else None
    return {"key": step.key, "kind": step.kind, "seq": step.seq, "text": text,
            "json": None if text is not None else _editable(step.output)}  # fmt: skip


TEXTS = ("output_text",)


def _answer_blocks(output) -> list[dict] | None:
    """The one text block holding what the model said, in whichever protocol's response the
    step recorded (chat completions, Anthropic messages, OpenAI responses), as a one-item
    list of (container, field); None when there is not exactly one."""
    if not isinstance(output, dict):
        return None
    choices = output.get("choices")
    if isinstance(choices, list):
        message = choices[0].get("message") if choices and isinstance(choices[0], dict) else None
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            return [message]
        return None
    blocks: list = []
    if output.get("type") == "message" and isinstance(output.get("content"), list):
        blocks = [b for b in output["content"] if isinstance(b, dict) and b.get("type") == "text"]
    elif isinstance(output.get("output"), list):
        for item in output["output"]:
            if isinstance(item, dict) and item.get("type") == "message":
                said = item.get("content") or []
                blocks += [b for b in said if isinstance(b, dict) and b.get("type") in TEXTS]
    return blocks if len(blocks) == 1 and isinstance(blocks[0].get("text"), str) else None


def answer_text(output) -> str | None:
    """What a model call said, as the text an operator edits (None: edit its JSON)."""
    found = _answer_blocks(output)
    if found is None:
        return None
    return found[0]["content"] if "content" in found[0] else found[0]["text"]


def with_answer(output, text: str):
    """`output` (a model call's recorded response) saying `text` instead."""
    copy = json.loads(json.dumps(output))
    (block,) = _answer_blocks(copy) or [None]
    if block is None:
        raise OperationError("this model call's answer cannot be edited as text: edit its JSON")
    block["content" if "content" in block else "text"] = text
    return copy


def _json_field(text: str, what: str):
    try:
        return json.loads(text)
    except ValueError as exc:
        raise OperationError(f"{what} is not JSON: {exc}") from None


def fork_form_edits(post, run_id) -> dict:
    """The fork form's edits as fork_run's `input` and `outputs`: each field as typed (a
    field left as shown is no edit; fork_run records only what changed)."""
    edits: dict = {}
    if "input" in post:
        edits["input"] = _json_field(post["input"], "The input")
    outputs = {}
    for name, value in post.items():
        kind, _, key = name.partition(":")
        if kind == "output" and key:
            outputs[key] = _json_field(value, f"The output of step {key}")
        elif kind == "text" and key:
            step = Step.objects.filter(run_id=run_id, key=key).only("output").first()
            if step is None:
                raise OperationError(f"run {run_id} has no step {key!r}")
            said = value.replace("\r\n", "\n")  # a textarea sends CRLF line ends
            if said != answer_text(step.output):
                outputs[key] = with_answer(step.output, said)
    if outputs:
        edits["outputs"] = outputs
    return edits


@login_required
@require_POST
def fork_view(request, run_id: UUID):
    """Fork from the chosen step (after the page listed what will run again)."""
    step = request.POST.get("step", "")
    reason = request.POST.get("reason", "")
    created = {}

    def fork():
        edits = fork_form_edits(request.POST, run_id)
        created["run"] = operations.fork_run(str(run_id), step, request.user, reason, **edits)

    response = do_action(request, fork, reverse("stepguard:run", args=[run_id]))
    if "run" in created:
        messages.success(request, f"Forked run {str(run_id)[:8]} from step {step}.")
        for key, why in fork_asks_again(created["run"]).items():
            messages.warning(request, f"The fork asks approval {key} again: {why}.")
    if "run" in created:
        return HttpResponseRedirect(reverse("stepguard:run", args=[created["run"].pk]))
    return response


def _channel_row(channel: NotificationChannel, user) -> dict:
    """What the page reads of a channel, its target as this person may see it (a viewer reads
    a webhook's scheme and host: a Slack webhook's URL is its secret)."""
    return {
        "pk": channel.pk,
        "kind": channel.kind,
        "target": notifications.shown_target(channel, user),
        "events": channel.events,
        "workflow": channel.workflow,
        "secret": bool(channel.secret),
        "created_by": channel.created_by,
        "created_at": channel.created_at,
        "paused_at": channel.paused_at,
        "paused_by": channel.paused_by,
        "pause_reason": channel.pause_reason,
    }


@login_required
@permission_required("runs.view_notificationchannel", raise_exception=True)
def notifications_page(request):
    """Notification channels, and recent deliveries with their attempts and errors."""
    failed = request.GET.get("failed") == "1"
    return render(
        request,
        "runs/notifications.html",
        {
            "channels": [
                _channel_row(c, request.user)
                for c in NotificationChannel.objects.filter(removed_at__isnull=True)
            ],
            "deliveries": notifications.deliveries(failing=failed, limit=100),
            "failed_only": failed,
            "event_types": [t.value for t in NOTIFIABLE],
            "can_add": request.user.has_perm("runs.add_notificationchannel"),
            "can_remove": request.user.has_perm("runs.delete_notificationchannel"),
        },
    )


@login_required
@require_POST
def notifications_add(request):
    """Add a channel from the form: kind, target, event types (checkboxes), workflow, secret."""
    post = request.POST
    return do_action(
        request,
        lambda: notifications.add_channel(
            request.user,
            post.get("kind", ""),
            post.get("target", ""),
            post.getlist("events"),
            workflow=post.get("workflow", ""),
            secret=post.get("secret", ""),
        ),
        reverse("stepguard:notifications"),
        lambda channel: (
            f"Channel {channel.pk} added: {channel.kind} of {', '.join(channel.events)}."
        ),
    )


@login_required
@require_POST
def notifications_remove(request, channel_id: int):
    return do_action(
        request,
        lambda: notifications.remove_channel(request.user, channel_id),
        reverse("stepguard:notifications"),
        f"Channel {channel_id} removed.",
    )


@login_required
@require_POST
def notifications_channel(request, channel_id: int, action: str):
    """Pause, resume or test a channel."""
    reason = request.POST.get("reason", "")
    actions = {
        "pause": (
            lambda: notifications.pause_channel(request.user, channel_id, reason),
            f"Channel {channel_id} paused: nothing is sent on it until it is resumed.",
        ),
        "resume": (
            lambda: notifications.resume_channel(request.user, channel_id),
            f"Channel {channel_id} resumed: its events are sent from now on.",
        ),
        "test": (
            lambda: notifications.send_test(request.user, channel_id),
            f"Test sent to channel {channel_id}: its delivery is the newest below.",
        ),
    }
    if action not in actions:
        raise Http404(f"no action {action!r}")
    perform, done = actions[action]
    return do_action(request, perform, reverse("stepguard:notifications"), done)


# -- flow control ----------------------------------------------------------------------------------


@login_required
@permission_required("runs.view_run", raise_exception=True)
def flow_page(request):
    """Limits with each workflow's load, rate limits with what counts now, and schedules."""
    now = timezone.now()
    rate_limits = [
        {"resource": r.resource, "requests": r.requests, "tokens": r.tokens,
         "window_seconds": r.window_seconds,
         **{f"used_{k}": v for k, v in rates.usage(r.resource, now).items()}}
        for r in RateLimit.objects.order_by("resource")
    ]  # fmt: skip
    found = list(Schedule.objects.order_by("name"))
    for s in found:
        s.actions = ["resume" if s.paused else "pause", "remove"]
    return render(
        request,
        "runs/flow.html",
        {
            "workflows": every_workflow(flow.overview()),
            "rate_limits": rate_limits,
            "schedules": found,
            "registered": registered_workflows(),
            "can_set": request.user.has_perm("runs.set_flow"),
            # What a refused schedule form held, typed again (flow_schedule).
            "schedule_form": request.session.pop(SCHEDULE_FORM, None) or {"timezone": "UTC"},
            "catchup_choices": CATCHUP_CHOICES,
            "overlap_choices": Overlap.choices,
        },
    )


#: The session key under which a refused schedule form keeps what was typed.
SCHEDULE_FORM = "stepguard-schedule-form"
CATCHUP_CHOICES = [
    ("skip", "skip missed ticks"),
    ("last", "run the last missed tick"),
    ("all", "run every missed tick"),
]


def every_workflow(shown: list[dict]) -> list[dict]:
    """The Flow page's workflows: those with runs in flight or a limit (flow.overview), and
    every other registered one with nothing in flight, so a limit can be set before the
    first run (the page listed only the first kind)."""
    listed = {w["workflow"] for w in shown}
    idle = {"max_running": None, "max_running_per_key": None}
    for name in registered_workflows():
        if name not in listed:
            found = registry.get(name)
            code = {"max_running": found.concurrency, "max_running_per_key": found.per_key}
            shown.append({"workflow": name, "running": 0, "queued": 0, "waiting": 0,
                          "code_limits": code, "operator_limits": idle, "keys": []})  # fmt: skip
    return sorted(shown, key=lambda w: w["workflow"])


def _positive(value: str, what: str) -> int | None:
    if not value.strip():
        return None
    try:
        return int(value)
    except ValueError:
        raise OperationError(f"{what} must be a whole number, not {value!r}") from None


@login_required
@require_POST
def flow_limits(request):
    """A workflow's limits from its row's form; an empty field goes back to the code's."""
    post = request.POST
    return do_action(
        request,
        lambda: operations.set_limits(
            post.get("workflow", ""),
            request.user,
            post.get("reason", ""),
            max_running=_positive(post.get("max_running", ""), "at most running"),
            max_running_per_key=_positive(post.get("max_running_per_key", ""), "per key"),
        ),
        reverse("stepguard:flow") + "#workflows",
        f"Limits of {post.get('workflow', '')} saved.",
    )


@login_required
@require_POST
def flow_rate(request):
    """Set a rate limit, or remove it (`remove=1`)."""
    post = request.POST

    def act():
        resource, reason = post.get("resource", "").strip(), post.get("reason", "")
        if post.get("remove"):
            return operations.set_rate_limit(resource, request.user, reason)
        requests = _positive(post.get("requests", ""), "calls per window")
        tokens = _positive(post.get("tokens", ""), "tokens per window")
        if requests is None and tokens is None:
            raise OperationError("give calls per window, tokens per window or both")
        return operations.set_rate_limit(
            resource, request.user, reason, requests=requests, tokens=tokens,
            window_seconds=_positive(post.get("window_seconds", ""), "the window") or 60,
        )  # fmt: skip

    def done(limit) -> str:
        resource = post.get("resource", "").strip()
        if limit is None:
            return f"Rate limit of {resource} removed."
        parts = [f"{n} {what}" for n, what in ((limit.requests, "calls"), (limit.tokens, "tokens"))
                 if n is not None]  # fmt: skip
        return f"Rate limit of {resource} set: {' and '.join(parts)} per {limit.window_seconds} s."

    return do_action(request, act, reverse("stepguard:flow") + "#rate-limits", done)


@login_required
@require_POST
def flow_schedule(request):
    """Add (or replace) a schedule from the form."""
    post = request.POST

    def act():
        text = post.get("input", "").strip()
        try:
            data = json.loads(text) if text else None
        except json.JSONDecodeError as exc:
            raise OperationError(f"the input is not JSON: {exc}") from None
        return operations.save_schedule(
            request.user, post.get("name", "").strip(), workflow=post.get("workflow", ""),
            cron=post.get("cron", ""), timezone_name=post.get("timezone", "UTC").strip() or "UTC",
            input=data, catchup=post.get("catchup", "skip"),
            overlap=post.get("overlap", "skip"),
        )  # fmt: skip

    saved: dict = {}

    def saving():
        saved["schedule"] = act()
        return saved["schedule"]

    response = do_action(
        request, saving, reverse("stepguard:flow") + "#schedules",
        lambda schedule: f"Schedule {schedule.name} saved: {schedule.workflow} at "
        f"{schedule.cron} ({schedule.timezone}).",
    )  # fmt: skip
    if "schedule" not in saved:  # refused: the form opens again with what was typed
        fields = ("name", "workflow", "cron", "timezone", "catchup", "overlap", "input")
        request.session[SCHEDULE_FORM] = {name: post.get(name, "")[:100_000] for name in fields}
    return response


@login_required
@require_POST
def flow_schedule_action(request, name: str, action: str):
    actions = {
        "pause": lambda: operations.pause_schedule(request.user, name, True),
        "resume": lambda: operations.pause_schedule(request.user, name, False),
        "remove": lambda: operations.remove_schedule(request.user, name),
    }
    if action not in actions:
        raise Http404(f"no action {action!r}")
    done = {"pause": "paused", "resume": "resumed", "remove": "removed"}[action]
    return do_action(
        request, actions[action], reverse("stepguard:flow") + "#schedules",
        f"Schedule {name} {done}.",
    )  # fmt: skip
