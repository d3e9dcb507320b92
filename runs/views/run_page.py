"""The run page: its header (status, budget, approvals, forks), its timeline and events, and the
actions taken from it (halt, unhalt, cancel, retry, a new budget)."""

from __future__ import annotations

from urllib.parse import urlencode
from uuid import UUID

from django.contrib.auth.decorators import login_required
from django.db.models import Q, QuerySet
from django.db.models.fields.json import KT
from django.http import Http404, HttpResponse
from django.shortcuts import render
from django.template.loader import render_to_string
from django.urls import reverse
from django.views.decorators.http import require_POST

from runs import annotations, charts, operations, queries
from runs.approvals.models import ApprovalStatus
from runs.approvals.services import mark_four_eyes
from runs.conversation import last_answer
from runs.engine.budget import to_micros, to_usd
from runs.explain import explain
from runs.models import Event, EventType, Run, RunStatus, Step, StepKind, StepStatus
from runs.views.common import (
    _run_or_404,
    budget_percent,
    do_action,
    json_download,
    plain_usd,
    viewer_required,
)
from runs.views.steps import shown
from runs.views.trace import trace_of

STEP_CHUNK, EVENT_CHUNK = 200, 500
# Steps worth forking from: those whose re-execution the operator must think about.
FORK_KINDS, FORK_CHOICES = (StepKind.CALL, StepKind.LLM, StepKind.TOOL), 100


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
            "trace": trace_of(run) if header["children"] else None,
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
