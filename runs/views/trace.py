"""The run page's trace tree: a run's steps with each child run (a subagent) under the step
that started it, opened in place to its own steps and children, level by level, with what
each spent and how long it waited in the queue apart from how long it ran.

Rendered on the server; a child's level loads when it is opened (htmx), so a page with many
children costs two queries per level shown, not per child.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from uuid import UUID

from django.contrib.auth.decorators import login_required, permission_required
from django.http import Http404
from django.shortcuts import render

from runs.models import Run, RunStatus, Step, StepKind
from runs.templatetags.timeline import span_text

#: Steps shown per level: a run with more shows its first ones and says how many it left out.
LEVEL_STEPS = 200


def seconds(span: timedelta | None) -> str:
    """A duration as the timeline writes it (850 ms, 3.2 s, 4 min 10 s); "" when unknown."""
    return "" if span is None else span_text(span.total_seconds())


def _between(start: datetime | None, end: datetime | None) -> timedelta | None:
    return end - start if start and end else None


def child_summary(child: Run) -> dict:
    """A child run as the tree shows it: queue delay (created to first claimed) apart from
    execution (claimed to ended; still running: so far)."""
    ended = child.finished_at
    return {
        "run": child,
        "queued": seconds(_between(child.created_at, child.started_at)),
        "ran": seconds(_between(child.started_at, ended)),
        "running": child.started_at is not None and ended is None,
        "waiting": child.started_at is None and child.status not in (RunStatus.CANCELLED,),
    }


def trace_of(run: Run) -> dict:
    """One level of the tree: the run's steps in order, each child step with its child run;
    children no step names (none today) come last. Two queries."""
    steps = list(
        Step.objects.filter(run=run)
        .order_by("seq")
        .only("run_id", "seq", "key", "kind", "status", "cost_micros", "started_at", "finished_at")
        [: LEVEL_STEPS + 1]
    )  # fmt: skip
    more = len(steps) > LEVEL_STEPS
    children = {
        c.key: c
        for c in Run.objects.filter(parent=run).only(
            "id",
            "key",
            "workflow",
            "version",
            "status",
            "cost_micros",
            "created_at",
            "started_at",
            "finished_at",
        )
    }
    rows = []
    for step in steps[:LEVEL_STEPS]:
        child = children.pop(f"{run.pk}:{step.key}", None) if step.kind == StepKind.CHILD else None
        rows.append(
            {
                "step": step,
                "took": seconds(_between(step.started_at, step.finished_at)),
                "child": child_summary(child) if child else None,
            }
        )
    return {
        "run": run,
        "rows": rows,
        "more": more,
        "others": [child_summary(c) for c in children.values()],
    }


@login_required
@permission_required("runs.view_run", raise_exception=True)
def trace_part(request, run_id: UUID):
    """A child run's level of the tree, loaded when its entry is opened."""
    run = Run.objects.filter(pk=run_id).first()
    if run is None:
        raise Http404(f"no run with id {run_id}")
    return render(request, "runs/trace.html#trace-level", {"trace": trace_of(run)})
