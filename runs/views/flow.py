"""The flow page: concurrency limits, rate limits and schedules, set from their forms."""

from __future__ import annotations

import json

from django.contrib.auth.decorators import login_required, permission_required
from django.http import Http404
from django.shortcuts import render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_POST

from runs import operations
from runs.engine import flow, rates, registry
from runs.errors import OperationError
from runs.models import Overlap, RateLimit, Schedule
from runs.views.common import do_action
from runs.views.listing import registered_workflows


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
