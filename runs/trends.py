"""Cost and latency over time: per workflow, per value of one label (a tenant) and per model,
per UTC day, drawn as server-side SVG charts with both axes labelled and every value in a
tooltip and in the chart's text alternative.

Where the numbers come from, and what each costs:
- cost per workflow and per label: SpendDay (one row per workflow, label set and day: the
  trigger-kept table the budgets page reads), so it does not grow with steps;
- latency per workflow and per label: runs that ended in the window (execution from a worker
  taking the run to its end; queue delay from its creation to that), at most MAX_ROWS of them,
  newest first;
- cost and latency per model: model-call steps that ended in the window (their recorded model
  and USD), at most MAX_ROWS. Both are a scan of the window's rows (no index of their own:
  one would tax every step's write for a page read now and then).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from datetime import date, datetime, time, timedelta

from django.db.models import Sum
from django.db.models.fields.json import KT
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe

from runs.engine.budget import to_usd
from runs.models import Run, SpendDay, Step, StepKind

BY = ("workflow", "label", "model")
MAX_ROWS = 50_000
SERIES = 8  # the biggest spenders; the rest are summed as "others"
NONE = "(no label)"


@dataclass
class Series:
    name: str
    cost: dict[date, int] = field(default_factory=dict)  # micro-USD
    latency: dict[date, list[float]] = field(default_factory=dict)  # seconds
    queued: dict[date, list[float]] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.cost.values())


def window(days: int, today: date | None = None) -> list[date]:
    today = today or timezone.now().date()
    return [today - timedelta(days=days - 1 - i) for i in range(days)]


def _start(day: date) -> datetime:
    return datetime.combine(day, time.min, tzinfo=timezone.get_fixed_timezone(0))


def collect(by: str, days: list[date], label: str = "tenant") -> list[Series]:
    """The series of one breakdown over `days`, biggest spenders first."""
    found: dict[str, Series] = {}

    def series(name: str | None) -> Series:
        name = name or NONE
        return found.setdefault(name, Series(name))

    first, since = days[0], _start(days[0])
    if by == "model":
        steps = (
            Step.objects.filter(kind=StepKind.LLM, finished_at__gte=since)
            .annotate(model=KT("usage__model"))
            .order_by("-finished_at")
            .values_list("model", "started_at", "finished_at", "cost_micros")[:MAX_ROWS]
        )
        for model, started, finished, micros in steps:
            s, day = series(model or "(unknown model)"), finished.date()
            s.cost[day] = s.cost.get(day, 0) + micros
            s.latency.setdefault(day, []).append((finished - started).total_seconds())
    else:
        spend = (
            SpendDay.objects.filter(day__gte=first)
            .values_list("workflow", "labels", "day")
            .annotate(total=Sum("micros"))
            .order_by()
        )
        for workflow, labels, day, micros in spend:
            s = series(workflow if by == "workflow" else (labels or {}).get(label))
            s.cost[day] = s.cost.get(day, 0) + micros
        runs = (
            Run.objects.filter(finished_at__gte=since, started_at__isnull=False)
            .exclude(workflow__startswith="stepguard.")
            .order_by("-finished_at")
            .values_list("workflow", "labels", "created_at", "started_at", "finished_at")
        )[:MAX_ROWS]
        for workflow, labels, created, started, finished in runs:
            s = series(workflow if by == "workflow" else (labels or {}).get(label))
            day = finished.date()
            s.latency.setdefault(day, []).append((finished - started).total_seconds())
            s.queued.setdefault(day, []).append(max((started - created).total_seconds(), 0))
    ranked = sorted(found.values(), key=lambda s: (-s.total, -len(s.latency), s.name))
    if len(ranked) > SERIES:
        rest = Series("others")
        for s in ranked[SERIES:]:
            for day, micros in s.cost.items():
                rest.cost[day] = rest.cost.get(day, 0) + micros
            for src, dst in ((s.latency, rest.latency), (s.queued, rest.queued)):
                for day, values in src.items():
                    dst.setdefault(day, []).extend(values)
        ranked = [*ranked[:SERIES], rest]
    return ranked


def percentile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


# -- drawing -----------------------------------------------------------------------------------

W, H = 480, 170
LEFT, RIGHT, TOP, BOTTOM = 64, 10, 12, 30


def nice(top: float) -> float:
    """A round number at or above `top` for the y axis (1, 2, 2.5 or 5 times a power of 10)."""
    if top <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(top))
    return next(s * power for s in (1, 2, 2.5, 5, 10) if s * power >= top * (1 - 1e-9))


def usd_text(value: float) -> str:
    if value == 0:
        return "$0"
    if value < 0.01:  # a model call costs fractions of a cent: micro-dollars, zeros dropped
        return "$" + f"{value:.6f}".rstrip("0").rstrip(".")
    return f"${value:,.2f}"


def seconds_text(value: float) -> str:
    if value < 1:
        return f"{round(value * 1000)} ms"
    if value < 120:
        return f"{value:.1f} s"
    return f"{value / 60:.1f} min"


def _frame(days: list[date], top: float, fmt) -> list[str]:
    """Axes, gridlines and their labels: y at 0, half and the top; x at every day, labelled
    at the first, the middle and the last."""
    plot_w, plot_h = W - LEFT - RIGHT, H - TOP - BOTTOM
    parts = []
    for frac in (0, 0.5, 1):
        y = round(TOP + plot_h * (1 - frac), 1)
        parts.append(
            format_html(
                '<line class="grid" x1="{}" x2="{}" y1="{}" y2="{}"/>'
                '<text class="y" x="{}" y="{}">{}</text>',
                LEFT,
                W - RIGHT,
                y,
                y,
                LEFT - 6,
                y + 4,
                fmt(top * frac),
            )
        )
    step = plot_w / len(days)
    marked = {0, len(days) // 2, len(days) - 1}
    for i, day in enumerate(days):
        x = round(LEFT + step * (i + 0.5), 1)
        parts.append(
            format_html(
                '<line class="tick" x1="{}" x2="{}" y1="{}" y2="{}"/>',
                x,
                x,
                TOP + plot_h,
                TOP + plot_h + 4,
            )
        )
        if i in marked:
            parts.append(
                format_html(
                    '<text class="x" x="{}" y="{}">{}</text>', x, H - 10, day.strftime("%b %d")
                )
            )
    parts.append(
        format_html(
            '<line class="axis" x1="{}" x2="{}" y1="{}" y2="{}"/>'
            '<line class="axis" x1="{}" x2="{}" y1="{}" y2="{}"/>',
            LEFT,
            LEFT,
            TOP,
            TOP + plot_h,
            LEFT,
            W - RIGHT,
            TOP + plot_h,
            TOP + plot_h,
        )
    )
    return parts


def _svg(kind: str, said: str, parts: list) -> SafeString:
    return format_html(
        '<svg class="chart axes {}" viewBox="0 0 {} {}" width="{}" height="{}" role="img" '
        'aria-label="{}"><title>{}</title>{}</svg>',
        kind,
        W,
        H,
        W,
        H,
        said,
        said,
        mark_safe("".join(str(p) for p in parts)),
    )


def cost_chart(name: str, days: list[date], cost: dict[date, int]) -> SafeString:
    """USD per day as bars, with a labelled y axis in dollars and dates along x."""
    values = [float(to_usd(cost.get(d, 0)) or 0) for d in days]
    top = nice(max(values, default=0))
    plot_w, plot_h = W - LEFT - RIGHT, H - TOP - BOTTOM
    step = plot_w / len(days)
    bars = []
    for i, (day, value) in enumerate(zip(days, values, strict=True)):
        h = round(value / top * plot_h, 1)
        bars.append(
            (
                round(LEFT + step * i + 1, 1),
                round(TOP + plot_h - h, 1),
                round(max(step - 2, 1), 1),
                h,
                f"{day.isoformat()}: {usd_text(value)}",
            )
        )
    total = sum(values)
    busiest = max(range(len(days)), key=lambda i: values[i])
    said = f"{name}: cost per day, {usd_text(total)} in {len(days)} days" + (
        f", most on {days[busiest].isoformat()} ({usd_text(values[busiest])})" if total else ""
    )
    rects = format_html_join(
        "", '<rect class="col" x="{}" y="{}" width="{}" height="{}"><title>{}</title></rect>', bars
    )
    return _svg("cost", said, [*_frame(days, top, usd_text), rects])


def latency_chart(
    name: str, days: list[date], latency: dict[date, list[float]], queued: dict | None = None
) -> SafeString | None:
    """Median and 95th percentile per day as two lines (and the median queue delay, when
    known, as a third), with a labelled y axis in seconds; None without a finished run."""
    if not latency:
        return None
    lines = {"p50": {}, "p95": {}}
    for day, values in latency.items():
        lines["p50"][day] = statistics.median(values)
        lines["p95"][day] = percentile(sorted(values), 0.95)
    if queued:
        lines["queued p50"] = {day: statistics.median(v) for day, v in queued.items()}
    top = nice(max(v for line in lines.values() for v in line.values()))
    plot_w, plot_h = W - LEFT - RIGHT, H - TOP - BOTTOM
    step = plot_w / len(days)
    parts = _frame(days, top, seconds_text)
    for cls, points in lines.items():
        xy = [
            (
                round(LEFT + step * (i + 0.5), 1),
                round(TOP + plot_h * (1 - points[d] / top), 1),
                f"{d.isoformat()} {cls}: {seconds_text(points[d])}",
            )
            for i, d in enumerate(days)
            if d in points
        ]
        path = " ".join(f"{'M' if j == 0 else 'L'}{x} {y}" for j, (x, y, _) in enumerate(xy))
        css = cls.replace(" ", "-")
        parts.append(format_html('<path class="line {}" d="{}"/>', css, path))
        parts.append(
            format_html_join(
                "",
                '<circle class="dot ' + css + '" cx="{}" cy="{}" r="3"><title>{}</title></circle>',
                xy,
            )
        )
    legend_x = LEFT + 8
    for j, cls in enumerate(lines):
        parts.append(
            format_html(
                '<text class="legend {}" x="{}" y="{}">{}</text>',
                cls.replace(" ", "-"),
                legend_x + j * 90,
                TOP + 10,
                cls,
            )
        )
    last = max(lines["p50"])
    said = (
        f"{name}: time per run per day, median {seconds_text(lines['p50'][last])} and 95th "
        f"percentile {seconds_text(lines['p95'][last])} on {last.isoformat()}"
    )
    return _svg("latency", said, parts)


__all__ = ["BY", "collect", "cost_chart", "latency_chart", "window"]
