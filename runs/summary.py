"""The /metrics totals over everything stored: runs by workflow and status, the runnable
backlog, steps by outcome and duration, spend by workflow and model, notification deliveries.

They read whole tables (at a million runs with two steps each, a second), so no scrape computes
them when the cache is shared (Redis: CACHES in controlplane/settings.py): one worker of all,
every STEPGUARD_METRICS_SUMMARY_SECONDS, takes the period's turn with a conditional UPDATE of
its Chore row, computes them and puts them in Django's cache, where every web process's scrape
reads them. With a cache of its own per process (the embedded engine's LocMemCache) a worker's
copy would reach no web process, so the scrape computes them itself, at most once a period.
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

from runs.engine.chores import Chore as WorkerChore
from runs.engine.chores import ChoreContext, my_turn
from runs.engine.worker import WAKEABLE
from runs.models import (
    NotificationDelivery,
    Recovery,
    Run,
    RunStatus,
    Step,
    StepStatus,
)

log = logging.getLogger("stepguard.metrics")

KEY = "stepguard:metrics-summary"
CHORE = "metrics-summary"
#: Step durations are those of the steps that finished in this window before the summary.
WINDOW = timedelta(hours=1)
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


def cache_shared() -> bool:
    """Whether what one process puts in Django's cache every other process reads."""
    backend = settings.CACHES.get("default", {}).get("BACKEND", "")
    return not backend.endswith(("LocMemCache", "DummyCache"))


def compute(now: datetime) -> dict:
    """The totals, read from the tables (whole-table reads: see the module's docstring)."""
    by_status = Run.objects.values_list("workflow", "status").annotate(n=Count("id"))
    runnable = Run.objects.filter(
        Q(status__in=WAKEABLE, wake_at__lte=now) | Q(status=RunStatus.RUNNING, lease_until__lt=now)
    ).count()
    return {
        "at": now,
        "runs": list(by_status.order_by()),
        "runnable": runnable,
        "families": [*_steps(now), *_spend(), *_notifications()],
    }


def read(now: datetime) -> dict:
    """The totals as last kept, or, with a cache of this process's own, computed now (and
    kept for the period). With a shared cache and no worker's copy yet: none ("at" None)."""
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
    """One look of a worker's summary chore: compute and share the totals if it is our turn.
    They stay in the cache for three periods, so a late turn leaves no gap."""
    try:
        period = settings.STEPGUARD_METRICS_SUMMARY_SECONDS
        if (now := my_turn(CHORE, context.worker, period)) is not None:
            cache.set(KEY, compute(now), 3 * period)
    except Exception:
        log.exception("metrics summary: not kept; next look in a period")
        close_old_connections()


def chore() -> WorkerChore | None:
    """With a shared cache and a period, workers keep the totals (one of all per period)."""
    period = settings.STEPGUARD_METRICS_SUMMARY_SECONDS
    if period <= 0 or not cache_shared():
        return None
    return WorkerChore("keeping the metrics summary", period, keep)


def _steps(now):
    outcomes = Step.objects.aggregate(
        completed=Count("id", filter=Q(status=StepStatus.COMPLETED)),
        failed=Count("id", filter=Q(status=StepStatus.FAILED)),
        retried=Sum(F("attempt") - 1, filter=Q(attempt__gt=1)),
        resent=Count("id", filter=Q(recovered=Recovery.RESENT)),
        reconciled=Count("id", filter=Q(recovered=Recovery.RECONCILED)),
    )
    steps = GaugeMetricFamily(
        "stepguard_steps",
        "Steps stored, by outcome (retried: extra attempts; resent, reconciled: steps "
        "found in flight after a crash).",
        labels=["outcome"],
    )
    for outcome, n in outcomes.items():
        steps.add_metric([outcome], n or 0)
    yield steps

    took = ExpressionWrapper(F("finished_at") - F("started_at"), output_field=DurationField())
    recent = Step.objects.filter(
        status=StepStatus.COMPLETED, finished_at__gte=now - WINDOW
    ).annotate(took=took)
    counts = {f"le{i}": Count("id", filter=Q(took__lte=timedelta(seconds=b)))
              for i, b in enumerate(BUCKETS)}  # fmt: skip
    rows = recent.values("kind").annotate(n=Count("id"), total=Sum("took"), **counts)
    hist = GaugeHistogramMetricFamily(
        "stepguard_step_duration_seconds",
        f"Durations of the steps completed in the last {WINDOW}, by kind.",
        labels=["kind"],
    )
    for row in rows.order_by():
        buckets = [(str(b), row[f"le{i}"]) for i, b in enumerate(BUCKETS)]
        total = row["total"].total_seconds() if row["total"] else 0.0
        hist.add_metric([row["kind"]], [*buckets, ("+Inf", row["n"])], total)
    yield hist


def _spend():
    llm = When(kind="llm", then=KT("input__0__model"))
    model = Case(llm, default=Value(""), output_field=CharField())
    rows = (
        Step.objects.filter(Q(cost_micros__gt=0) | Q(tokens_in__gt=0) | Q(tokens_out__gt=0))
        .annotate(model=model)
        .values("run__workflow", "model")
        .annotate(usd=Sum("cost_micros"), tin=Sum("tokens_in"), tout=Sum("tokens_out"))
        .order_by()
    )
    usd = GaugeMetricFamily("stepguard_spend_usd",
                            "USD spent by the steps stored, by workflow and model.",
                            labels=["workflow", "model"])  # fmt: skip
    tokens = GaugeMetricFamily("stepguard_tokens",
                               "Tokens used by the steps stored, by workflow and model.",
                               labels=["workflow", "model", "direction"])  # fmt: skip
    for row in rows:
        labels = [row["run__workflow"], row["model"] or ""]
        usd.add_metric(labels, (row["usd"] or 0) / 1_000_000)
        tokens.add_metric([*labels, "in"], row["tin"] or 0)
        tokens.add_metric([*labels, "out"], row["tout"] or 0)
    yield usd
    yield tokens


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
