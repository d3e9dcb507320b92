"""Small spend charts as inline SVG: a run's spend over time, and spend per workflow per day.

Drawn on the server (no chart library, no script: the pages' CSP allows none inline), each
with a text alternative that says what the chart shows, so a screen reader reads the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, timedelta

from django.db.models import Sum
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString

from runs import trends
from runs.engine.budget import to_usd
from runs.models import Run, SpendDay, Step

WIDTH, HEIGHT = 240, 48
DAYS = 14


def _usd(micros: int) -> str:
    return f"${to_usd(micros).normalize():f}"


def spend_over_time(run: Run) -> SafeString | None:
    """The run's recorded spend summed as its steps finished (a rising step line), or None
    when it spent nothing (no query then)."""
    if not run.cost_micros:
        return None
    rows = list(
        Step.objects.filter(run=run, cost_micros__gt=0, finished_at__isnull=False)
        .order_by("finished_at", "seq")
        .values_list("finished_at", "cost_micros")
    )
    if not rows:
        return None
    start = min(run.started_at or run.created_at, rows[0][0])
    end = max(run.finished_at or rows[-1][0], rows[-1][0])
    span = max((end - start).total_seconds(), 0.001)
    total = sum(micros for _, micros in rows)
    x = lambda when: round((when - start).total_seconds() / span * WIDTH, 1)  # noqa: E731
    y = lambda spent: round(HEIGHT - spent / total * (HEIGHT - 2) - 1, 1)  # noqa: E731
    path, spent = [f"M0 {HEIGHT - 1}"], 0
    for when, micros in rows:
        path.append(f"H{x(when)}")
        spent += micros
        path.append(f"V{y(spent)}")
    path.append(f"H{WIDTH}")
    said = (
        f"Spend over time: {_usd(total)} in {len(rows)} call{'s' if len(rows) != 1 else ''} "
        f"over {span:.1f} s"
    )
    return format_html(
        '<svg class="chart spark" viewBox="0 0 {} {}" width="{}" height="{}" role="img" '
        'aria-label="{}"><title>{}</title><path d="{}"/></svg>',
        WIDTH, HEIGHT, WIDTH, HEIGHT, said, said, " ".join(path),
    )  # fmt: skip


@dataclass(frozen=True)
class DailySpend:
    workflow: str
    total_micros: int
    chart: SafeString


def spend_per_day(today: date | None = None, limit: int = 12) -> list[DailySpend]:
    """Each workflow's recorded spend per UTC day over the last DAYS days (by when its steps
    finished, as the page's "today" is), the biggest spenders first, as small bar charts."""
    today = today or timezone.now().date()
    first = today - timedelta(days=DAYS - 1)
    rows = (
        SpendDay.objects.filter(day__gte=first, micros__gt=0)
        .values_list("workflow", "day")
        .annotate(total=Sum("micros"))
        .order_by()
    )
    by_workflow: dict[str, dict[date, int]] = {}
    for workflow, day, micros in rows:
        by_workflow.setdefault(workflow, {})[day] = micros
    ranked = sorted(by_workflow.items(), key=lambda item: (-sum(item[1].values()), item[0]))
    return [
        DailySpend(workflow, sum(days.values()), _bars(workflow, days, first))
        for workflow, days in ranked[:limit]
    ]


def _bars(workflow: str, days: dict[date, int], first: date) -> SafeString:
    """A workflow's spend per day with both axes labelled (runs/trends.py draws it): the
    small axis-less bars it replaced gave no scale to read a value against (issue 53)."""
    return trends.cost_chart(workflow, [first + timedelta(days=i) for i in range(DAYS)], days)


__all__ = ["DailySpend", "spend_over_time", "spend_per_day"]
