"""Versions in flight: the live runs of each workflow version, whether a live worker serves
it, and when it drains. What a deployment watches while old code is still needed: a version
no live worker serves strands its runs; a version drained can lose its workers."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import Count, Max, Min, Q
from django.utils import timezone

from runs.models import TERMINAL_STATUSES, Run, RunStatus, Worker

#: The pace a version's runs finish at is measured over this window.
PACE_WINDOW = timedelta(hours=24)


@dataclass
class Version:
    workflow: str
    version: str
    live: int
    waiting: int
    no_deadline: int  # waiting on a signal, an approval or a child: no time it must end by
    oldest: datetime | None
    last_deadline: datetime | None
    finished_recently: int  # in PACE_WINDOW
    workers: int  # live workers that serve it
    newest: bool  # the version this workflow's most recent run started on

    @property
    def served(self) -> bool:
        return self.workers > 0

    @property
    def drains(self) -> str:
        """When its live runs will be done, as far as the data says."""
        if not self.live:
            return "drained"
        if not self.finished_recently:
            return "unknown: none of its runs finished in the last day"
        hours = self.live * PACE_WINDOW.total_seconds() / 3600 / self.finished_recently
        at = timezone.now() + timedelta(hours=hours)
        return f"about {at:%Y-%m-%d %H:%M} UTC at the last day's pace"

    def as_json(self) -> dict[str, Any]:
        return {
            "workflow": self.workflow,
            "version": self.version,
            "live": self.live,
            "waiting": self.waiting,
            "waiting_without_deadline": self.no_deadline,
            "oldest_live": self.oldest,
            "last_deadline": self.last_deadline,
            "finished_last_day": self.finished_recently,
            "workers": self.workers,
            "served": self.served,
            "newest": self.newest,
            "drains": self.drains,
        }


def in_flight(*, engine: bool = False) -> list[Version]:
    """Every workflow version with live runs or runs finished in the last day, by workflow
    and version. One grouped query over the runs, one per workflow for its newest version,
    one over the workers; Stepguard's own
    workflows (stepguard.*) only with `engine`."""
    now = timezone.now()
    since = now - PACE_WINDOW
    runs = Run.objects.all() if engine else Run.objects.exclude(workflow__startswith="stepguard.")
    live = ~Q(status__in=TERMINAL_STATUSES)
    waiting = Q(status=RunStatus.WAITING)
    rows = (
        runs.filter(live | Q(finished_at__gte=since))
        .values("workflow", "version")
        .annotate(
            live=Count("id", filter=live),
            waiting=Count("id", filter=waiting),
            no_deadline=Count("id", filter=waiting & Q(wake_at__isnull=True)),
            oldest=Min("created_at", filter=live),
            last_deadline=Max("wake_at", filter=waiting),
            finished=Count("id", filter=Q(finished_at__gte=since)),
        )
        .order_by("workflow", "version")
    )
    rows = list(rows)
    names = {r["workflow"] for r in rows}
    newest = {name: _newest_version(runs, name) for name in names}
    serving = _served_by_live_workers(now)
    return [
        Version(
            workflow=r["workflow"],
            version=r["version"],
            live=r["live"],
            waiting=r["waiting"],
            no_deadline=r["no_deadline"],
            oldest=r["oldest"],
            last_deadline=r["last_deadline"],
            finished_recently=r["finished"],
            workers=serving.get(f"{r['workflow']}@{r['version']}", 0),
            newest=newest.get(r["workflow"]) == r["version"],
        )
        for r in rows
    ]


def _served_by_live_workers(now: datetime) -> dict[str, int]:
    """How many live workers (running, heard from within a lease) serve each name@version."""
    silent_since = now - timedelta(seconds=settings.STEPGUARD_LEASE_SECONDS)
    counts: dict[str, int] = {}
    for workflows in Worker.objects.filter(
        stopped_at__isnull=True, heartbeat_at__gte=silent_since
    ).values_list("workflows", flat=True):
        for ref in set(workflows or ()):
            counts[ref] = counts.get(ref, 0) + 1
    return counts


def _newest_version(runs, name: str) -> str | None:
    """The version of the workflow's most recent run: one query per workflow."""
    return (
        runs.filter(workflow=name).order_by("-created_at").values_list("version", flat=True)
    ).first()
