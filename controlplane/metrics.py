"""GET /metrics: Prometheus text format, every figure read from the database.

The database is the one place that knows about every worker on every host, so a figure read
from it is right however many processes there are, and nothing is lost when one dies. Most are
gauges of what is stored now (prune makes them drop): graph them with `delta()`/`deriv()`, not
`rate()`. Runs by workflow and status and the totals over the finished runs' steps (outcomes,
durations, spend) are kept by triggers as they change (PostgreSQL, runs/tally.py): one small
statement reads them. What alerts watch (runnable runs, approvals, halts, workers, the replica)
is read on every scrape through indexes, the backlog counted up to CAP runs. What is left
(the backlog past CAP, deliveries) is the summary one worker makes every
STEPGUARD_METRICS_SUMMARY_SECONDS (60 s) into Django's shared cache (runs/summary.py; the
embedded engine, whose cache is per process, makes it at most once a period). So a scrape asks
the same statements whatever the history. Scrape every 15 to 60 s.

Readable with an API key (`Authorization: Bearer sg_...`) or a logged-in session of a person
who may read runs (`runs.view_run`, as on every read-only page; 403 without it), or from an
address in STEPGUARD_METRICS_ALLOW (e.g. the Prometheus server), without either.
"""

from __future__ import annotations

import ipaddress
from datetime import timedelta

from django.conf import settings
from django.db.models import (
    Count,
    Min,
)
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils import timezone
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from runs import queries, replica, security, summary, tally
from runs.apikeys import check_key
from runs.approvals.models import ApprovalRequest, ApprovalStatus
from runs.engine.worker import WAKEABLE
from runs.health import LIVE_LEASES
from runs.models import (
    GLOBAL,
    TERMINAL_STATUSES,
    ApiKeyScope,
    Event,
    EventType,
    Policy,
    Run,
    RunStatus,
    Worker,
)

SUMMARY_KEY = summary.KEY
#: The statuses of runs not finished, named (an IN the status index serves, not a NOT IN).
LIVE_STATUSES = [s for s in RunStatus.values if s not in TERMINAL_STATUSES]
#: What a scrape counts one by one before it takes the summary's figure.
CAP = queries.EXACT_UP_TO


def _age(since, now) -> float:
    return 0.0 if since is None else max(0.0, (now - since).total_seconds())


class DatabaseCollector:
    """A prometheus-client collector that asks the database on each scrape."""

    def collect(self):
        now = timezone.now()
        kept = tally.read() if tally.kept() else None  # kept as they change: one statement
        runs, families = summary.totals(kept)
        totals = self._summary(now)
        yield from self._runs(now, totals, runs)
        yield from families
        yield from totals["families"]
        yield from self._workers(now)
        yield from self._approvals_and_halts(now, kept)
        yield from self._replica()

    def _summary(self, now) -> dict:
        """What no scrape reads the tables for (runs/summary.py): the runnable backlog past
        the cap and the deliveries (off PostgreSQL, also the totals), from Django's cache,
        where a worker keeps them when the cache is shared (Redis); made here, at most once
        a period, when the cache is this process's own (the embedded engine)."""
        found = summary.read(now)
        age = GaugeMetricFamily(
            "stepguard_metrics_summary_age_seconds",
            "How old the summary (runnable runs past 1,000, deliveries) is (-1: no worker "
            "has made it yet).",
            value=-1 if found["at"] is None else _age(found["at"], now),
        )
        return {**found, "families": [*found["families"], age]}

    def _replica(self):
        if not replica.configured():
            return
        lag = replica.lag()
        yield GaugeMetricFamily(
            "stepguard_replica_up", "Whether the read replica answered.", value=int(lag.usable)
        )
        if lag.usable:
            yield GaugeMetricFamily(
                "stepguard_replica_lag_seconds",
                "How far the read replica's replay is behind the primary (0: caught up).",
                value=lag.seconds,
            )

    def _runs(self, now, summary, kept):
        """Runs by workflow and status: on PostgreSQL the kept totals (`kept`: exact, as of
        the last commit); elsewhere counted on each scrape up to CAP per status, beyond which
        the summary's figure (at most a period old). The runnable ones are counted up to CAP
        through the wake-up indexes (past it, the summary's): what an alert on stuck or
        piling-up runs needs."""
        runs = GaugeMetricFamily(
            "stepguard_runs", "Runs stored, by workflow and status.", labels=["workflow", "status"]
        )
        for workflow, status, n in self._run_rows(summary) if kept is None else kept:
            runs.add_metric([workflow, status], n)
        yield runs
        due = Run.objects.filter(status__in=WAKEABLE, wake_at__lte=now)
        lapsed = Run.objects.filter(status=RunStatus.RUNNING, lease_until__lt=now)
        runnable = sum(queries.count_up_to(q, CAP) for q in (due, lapsed))
        if runnable > CAP:
            runnable = max(summary["runnable"], runnable)
        oldest = min(
            (t for t in (due.aggregate(t=Min("wake_at"))["t"],
                         lapsed.aggregate(t=Min("lease_until"))["t"]) if t),
            default=None,
        )  # fmt: skip
        yield GaugeMetricFamily("stepguard_runnable_runs",
                                "Runs waiting for a worker (due, or whose worker died).",
                                value=runnable)  # fmt: skip
        yield GaugeMetricFamily(
            "stepguard_oldest_runnable_age_seconds",
            "How long the runnable run that waited longest has waited (0: none waits).",
            value=_age(oldest, now),
        )
        lost = Event.objects.filter(type=EventType.RUN_RECOVERED).count()
        yield GaugeMetricFamily(
            "stepguard_lease_losses",
            "Runs taken over after their worker's lease lapsed (run.recovered events stored).",
            value=lost,
        )

    def _run_rows(self, summary) -> list:
        capped = queries.capped_counts(Run.objects.all(), LIVE_STATUSES, CAP)
        exact = [status for status, n in capped.items() if n <= CAP]
        counted = (
            Run.objects.filter(status__in=exact)
            .values_list("workflow", "status")
            .annotate(n=Count("id"))
            .order_by()
        )
        return [*counted, *((w, st, n) for w, st, n in summary["runs"] if st not in exact)]

    def _workers(self, now):
        beat = timedelta(seconds=LIVE_LEASES * settings.STEPGUARD_LEASE_SECONDS)
        running = Worker.objects.filter(stopped_at__isnull=True)
        live = running.filter(heartbeat_at__gte=now - beat).count()
        yield GaugeMetricFamily("stepguard_workers_live", "Workers heartbeating.", value=live)
        beats = GaugeMetricFamily(
            "stepguard_worker_last_heartbeat_timestamp_seconds",
            "Last heartbeat of each worker not stopped that beat in the last day.",
            labels=["worker", "host"],
        )
        recent = running.filter(heartbeat_at__gte=now - timedelta(days=1))
        for worker_id, host, at in recent.values_list("id", "host", "heartbeat_at"):
            beats.add_metric([str(worker_id), host], at.timestamp())
        yield beats

    def _approvals_and_halts(self, now, kept):
        pending = ApprovalRequest.objects.filter(status=ApprovalStatus.PENDING)
        if kept is not None:  # the kept totals, not a count of every pending request
            n = kept["approvals"].get(("", ApprovalStatus.PENDING), 0)
            oldest = pending.aggregate(t=Min("created_at"))["t"]  # approvals_pending_idx
        else:
            found = pending.aggregate(n=Count("id"), t=Min("created_at"))
            n, oldest = found["n"], found["t"]
        yield GaugeMetricFamily("stepguard_approvals_pending", "Approval requests pending.",
                                value=n)  # fmt: skip
        yield GaugeMetricFamily(
            "stepguard_oldest_pending_approval_age_seconds",
            "How long the oldest pending approval request has waited (0: none).",
            value=_age(oldest, now),
        )
        halts = GaugeMetricFamily("stepguard_halts", "Holds in force, by scope.",
                                  labels=["scope"])  # fmt: skip
        policies = Policy.objects.filter(halted_at__isnull=False)
        halts.add_metric(["global"], policies.filter(scope=GLOBAL).count())
        halts.add_metric(["workflow"], policies.exclude(scope=GLOBAL).count())
        held = kept["held"].get(("", ""), 0) if kept is not None else None
        if held is None:
            held = Run.objects.filter(halted_at__isnull=False).count()
        halts.add_metric(["run"], held)
        yield halts


registry = CollectorRegistry(auto_describe=False)
registry.register(DatabaseCollector())


def _allowed_address(request: HttpRequest) -> bool:
    try:
        address = ipaddress.ip_address(request.META.get("REMOTE_ADDR", ""))
    except ValueError:
        return False
    return any(address in ipaddress.ip_network(net, strict=False)
               for net in settings.STEPGUARD_METRICS_ALLOW)  # fmt: skip


READ_PERMISSION = "runs.view_run"  # what every read-only dashboard page requires


def _reader(request: HttpRequest):
    """True from an allowed address; else the person the session or API key names, or None
    (False: a key whose scope reads nothing)."""
    if _allowed_address(request):
        return True
    if request.user.is_authenticated:
        return request.user
    header = request.headers.get("Authorization", "")
    if not header.startswith("Bearer "):
        return None
    key = check_key(header.removeprefix("Bearer "))
    if key is None:  # only wrong keys are throttled (runs.rest.ApiKeyAuth says why)
        if security.api_key_allowed(request):
            security.bad_api_key(request)
        return None
    return False if key.scope == ApiKeyScope.START else key.user  # start keys read nothing


def metrics(request: HttpRequest) -> HttpResponse:
    """GET /metrics."""
    reader = _reader(request)
    if reader is None:
        return JsonResponse(
            {"error": {"code": "not_authenticated",
                       "message": "send an API key (Authorization: Bearer sg_...) or log in"}},
            status=401,
        )  # fmt: skip
    if reader is False:
        return JsonResponse(
            {"error": {"code": "forbidden",
                       "message": "this API key is scoped start: it may only start runs and "
                                  "send signals, not read metrics"}},
            status=403,
        )  # fmt: skip
    if reader is not True and not reader.has_perm(READ_PERMISSION):
        return JsonResponse(
            {"error": {"code": "permission_denied",
                       "message": f"{reader.get_username()} may not read metrics: "
                                  f"{READ_PERMISSION} is missing"}},
            status=403,
        )  # fmt: skip
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)
