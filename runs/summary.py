"""The /metrics figures over everything stored that no scrape should sum: runs by workflow
and status, steps by outcome and duration, spend by workflow and model (on PostgreSQL kept as
they change by triggers, runs/tally.py, and read in one small statement per scrape), and the
runnable backlog past the per-scrape cap and notification deliveries (the summary).

The summary is made by one worker of all, every STEPGUARD_METRICS_SUMMARY_SECONDS: it takes
the period's turn with a conditional UPDATE of its Chore row, folds the totals' rows appended
since the last turn (runs/tally.py), and, when Django's cache is shared (Redis: CACHES in
controlplane/settings.py), puts the summary there, where every web process's scrape reads it.
With a cache of its own per process (the embedded engine's LocMemCache) a worker's copy would
reach no web process, so the scrape makes the summary itself, at most once a period. Neither
reads the steps table on PostgreSQL; elsewhere (SQLite, small by design) the totals are summed
from the tables with the summary.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.conf import settings
from django.core.cache import cache
from django.db import close_old_connections
from django.db.models import (
    Case,
    CharField,
    Count,
    DurationField,
    ExpressionWrapper,
    F,
    Q,
    Sum,
    Value,
    When,
)
from django.db.models.fields.json import KT
from prometheus_client.core import GaugeHistogramMetricFamily, GaugeMetricFamily

from runs import tally
from runs.engine.chores import Chore as WorkerChore
from runs.engine.chores import ChoreContext, my_turn
from runs.engine.worker import WAKEABLE
from runs.models import (
    TERMINAL_STATUSES,
    NotificationDelivery,
    Recovery,
    Run,
    RunStatus,
    Step,
    StepStatus,
)

log = logging.getLogger("stepguard.metrics")

KEY = "stepguard:metrics-summary:2"  # :2: no totals in it (an older copy had them)
CHORE = "metrics-summary"
BUCKETS = tally.BUCKETS


def cache_shared() -> bool:
    """Whether what one process puts in Django's cache every other process reads."""
    backend = settings.CACHES.get("default", {}).get("BACKEND", "")
    return not backend.endswith(("LocMemCache", "DummyCache"))


def compute(now: datetime) -> dict:
    """The summary: the runnable backlog and the deliveries (index and small-table reads); off
    PostgreSQL also the totals, summed from the tables (see the module's docstring)."""
    runnable = Run.objects.filter(
        Q(status__in=WAKEABLE, wake_at__lte=now) | Q(status=RunStatus.RUNNING, lease_until__lt=now)
    ).count()
    found = {"at": now, "runnable": runnable, "families": list(_notifications())}
    if not tally.kept():
        by_status = Run.objects.values_list("workflow", "status").annotate(n=Count("id"))
        found["runs"] = list(by_status.order_by())
        found["families"] += [*_steps(), *_spend()]
    return found


def totals(kept: dict | None) -> tuple[list[tuple[str, str, int]] | None, list]:
    """From the kept totals (tally.read(), PostgreSQL): runs by (workflow, status, n), and the
    steps' families. (None, []) where they are not kept (None): the summary carries them."""
    if kept is None:
        return None, []
    runs = [(workflow, status, n) for (workflow, status), n in kept["runs"].items()]
    steps = {outcome: kept["steps"].get(("", outcome), 0) for outcome in OUTCOMES}
    durations: dict[str, dict] = {}
    for (kind, bucket), n in kept["duration"].items():
        durations.setdefault(kind, {})[bucket] = n
    hist = _histogram()
    for kind, counts in sorted(durations.items()):
        buckets = [(str(b), counts.get(str(i), 0)) for i, b in enumerate(BUCKETS)]
        took = kept["duration_us"].get((kind, ""), 0) / 1_000_000
        hist.add_metric([kind], [*buckets, ("+Inf", counts.get("+Inf", 0))], took)
    keys = {*kept["usd_micros"], *kept["tokens_in"], *kept["tokens_out"]}
    spend = [
        (workflow, model, kept["usd_micros"].get((workflow, model), 0),
         kept["tokens_in"].get((workflow, model), 0), kept["tokens_out"].get((workflow, model), 0))
        for workflow, model in sorted(keys)
    ]  # fmt: skip
    return runs, [_outcomes(steps), hist, *_spend_families(spend)]


def read(now: datetime) -> dict:
    """The summary as last kept, or, with a cache of this process's own, made now (and kept
    for the period). With a shared cache and no worker's copy yet: none ("at" None)."""
    period = settings.STEPGUARD_METRICS_SUMMARY_SECONDS
    found = cache.get(KEY) if period > 0 else None
    if found is not None:
        return found
    if cache_shared() and period > 0:
        return {"at": None, "runs": [], "runnable": 0, "families": []}
    found = compute(now)
    if period > 0:
        cache.set(KEY, found, period)
    return found


def keep(context: ChoreContext) -> None:
    """One look of a worker's summary chore: if it is our turn, fold the totals and share the
    summary. It stays in the cache for three periods, so a late turn leaves no gap."""
    try:
        period = _period()
        if (now := my_turn(CHORE, context.worker, period)) is not None:
            if tally.kept():
                tally.fold()
            if cache_shared() and settings.STEPGUARD_METRICS_SUMMARY_SECONDS > 0:
                cache.set(KEY, compute(now), 3 * period)
    except Exception:
        log.exception("metrics summary: not kept; next look in a period")
        close_old_connections()


def _period() -> float:
    """The summary's period; the totals are folded every minute even with no summary kept."""
    period = settings.STEPGUARD_METRICS_SUMMARY_SECONDS
    return period if period > 0 else 60.0


def chore() -> WorkerChore | None:
    """Workers fold the kept totals (PostgreSQL) and, with a shared cache and a period, keep
    the summary: one of all per period."""
    shares = settings.STEPGUARD_METRICS_SUMMARY_SECONDS > 0 and cache_shared()
    if not (shares or tally.kept()):
        return None
    return WorkerChore("keeping the metrics summary", _period(), keep)


OUTCOMES = ("completed", "failed", "retried", "resent", "reconciled")


def _outcomes(counts: dict) -> GaugeMetricFamily:
    steps = GaugeMetricFamily(
        "stepguard_steps",
        "Steps of the finished runs stored, by outcome (retried: extra attempts; resent, "
        "reconciled: steps found in flight after a crash).",
        labels=["outcome"],
    )
    for outcome in OUTCOMES:
        steps.add_metric([outcome], counts.get(outcome) or 0)
    return steps


def _histogram() -> GaugeHistogramMetricFamily:
    return GaugeHistogramMetricFamily(
        "stepguard_step_duration_seconds",
        "Durations of the completed steps of the finished runs stored, by kind.",
        labels=["kind"],
    )


def _steps():
    """The step families summed from the tables (off PostgreSQL): what runs/tally.py keeps."""
    finished = Step.objects.filter(run__status__in=TERMINAL_STATUSES)
    yield _outcomes(
        finished.aggregate(
            completed=Count("id", filter=Q(status=StepStatus.COMPLETED)),
            failed=Count("id", filter=Q(status=StepStatus.FAILED)),
            retried=Sum(F("attempt") - 1, filter=Q(attempt__gt=1)),
            resent=Count("id", filter=Q(recovered=Recovery.RESENT)),
            reconciled=Count("id", filter=Q(recovered=Recovery.RECONCILED)),
        )
    )
    took = ExpressionWrapper(F("finished_at") - F("started_at"), output_field=DurationField())
    done = finished.filter(
        status=StepStatus.COMPLETED, started_at__isnull=False, finished_at__isnull=False
    ).annotate(took=took)
    counts = {f"le{i}": Count("id", filter=Q(took__lte=timedelta(seconds=b)))
              for i, b in enumerate(BUCKETS)}  # fmt: skip
    rows = done.values("kind").annotate(n=Count("id"), total=Sum("took"), **counts)
    hist = _histogram()
    for row in rows.order_by("kind"):
        buckets = [(str(b), row[f"le{i}"]) for i, b in enumerate(BUCKETS)]
        total = row["total"].total_seconds() if row["total"] else 0.0
        hist.add_metric([row["kind"]], [*buckets, ("+Inf", row["n"])], total)
    yield hist


def _spend():
    llm = When(kind="llm", then=KT("input__0__model"))
    model = Case(llm, default=Value(""), output_field=CharField())
    rows = (
        Step.objects.filter(run__status__in=TERMINAL_STATUSES)
        .filter(Q(cost_micros__gt=0) | Q(tokens_in__gt=0) | Q(tokens_out__gt=0))
        .annotate(model=model)
        .values_list("run__workflow", "model")
        .annotate(usd=Sum("cost_micros"), tin=Sum("tokens_in"), tout=Sum("tokens_out"))
        .order_by()
    )
    return _spend_families(rows)


def _spend_families(rows) -> list[GaugeMetricFamily]:
    usd = GaugeMetricFamily("stepguard_spend_usd",
                            "USD spent by the steps of the finished runs stored, by workflow "
                            "and model.", labels=["workflow", "model"])  # fmt: skip
    tokens = GaugeMetricFamily("stepguard_tokens",
                               "Tokens used by the steps of the finished runs stored, by "
                               "workflow and model.",
                               labels=["workflow", "model", "direction"])  # fmt: skip
    for workflow, model, micros, tin, tout in rows:
        labels = [workflow, model or ""]
        usd.add_metric(labels, (micros or 0) / 1_000_000)
        tokens.add_metric([*labels, "in"], tin or 0)
        tokens.add_metric([*labels, "out"], tout or 0)
    return [usd, tokens]


def _notifications():
    deliveries = GaugeMetricFamily(
        "stepguard_notification_deliveries",
        "Notification deliveries stored, by channel kind and result "
        "(delivered, failed after its retries, or under way).",
        labels=["kind", "result"],
    )
    result = Case(
        When(run__status=RunStatus.COMPLETED, then=Value("delivered")),
        When(run__status__in=[RunStatus.FAILED, RunStatus.CANCELLED], then=Value("failed")),
        default=Value("pending"),
        output_field=CharField(),
    )
    rows = (
        NotificationDelivery.objects.annotate(result=result)
        .values("channel__kind", "result")
        .annotate(n=Count("id"))
        .order_by()
    )
    for row in rows:
        deliveries.add_metric([row["channel__kind"], row["result"]], row["n"])
    yield deliveries
