"""The Trends page: cost and latency per day, per workflow, per label value or per model
(runs/trends.py draws the charts)."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required, permission_required
from django.shortcuts import render

from runs import labels as run_labels
from runs import trends

DAYS = {"7": 7, "14": 14, "30": 30}


@login_required
@permission_required("runs.view_run", raise_exception=True)
def trends_page(request):
    """`by` (workflow, label or model), `label` (the label's name, for by=label) and `days`
    (7, 14 or 30); a value outside those is refused with a message, the defaults shown."""
    problems = []
    by = request.GET.get("by", "workflow")
    if by not in trends.BY:
        problems.append(f"by {by!r} is not one of {', '.join(trends.BY)}: by workflow shown")
        by = "workflow"
    days = DAYS.get(request.GET.get("days", "14"))
    if days is None:
        problems.append(f"days {request.GET.get('days')!r} is not 7, 14 or 30: 14 shown")
        days = 14
    label = request.GET.get("label", "tenant").strip() or "tenant"
    try:
        run_labels.pair(f"{label}=x")
    except run_labels.BadLabel as exc:
        problems.append(f"{exc}: tenant shown")
        label = "tenant"
    window = trends.window(days)
    rows = [
        {
            "name": s.name,
            "total": s.total,
            "cost": trends.cost_chart(s.name, window, s.cost),
            "latency": trends.latency_chart(
                s.name, window, s.latency, s.queued if by != "model" else None
            ),
            "runs": sum(len(v) for v in s.latency.values()),
        }
        for s in trends.collect(by, window, label)
    ]
    return render(
        request,
        "runs/trends.html",
        {
            "rows": rows,
            "by": by,
            "label": label,
            "days": days,
            "choices": trends.BY,
            "day_choices": list(DAYS),
            "problems": problems,
            "first": window[0],
            "last": window[-1],
        },
    )
