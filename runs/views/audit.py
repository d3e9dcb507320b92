"""The audit page: who did what, to which run, when; filtered by person, action or run."""

from __future__ import annotations

from django.conf import settings
from django.contrib import messages
from django.db.models import Q
from django.shortcuts import render

from runs import bounded
from runs.models import RENAMED_EVENTS, Event
from runs.queries import BadFilter, run_id_from
from runs.views.common import viewer_required

RUN_VALUES = ("run__input", "run__output", "run__error")


@viewer_required
def audit_page(request):
    """Every operator action (events with a person as actor), filterable by actor, action, run;
    with `system=1`, the system's own events too (lockouts, runs created by code, recoveries)."""
    system = request.GET.get("system") == "1"
    events = Event.objects.select_related("run").order_by("-created_at")
    # Not the events of a pruned run, which on PostgreSQL stay until their month's partition
    # is dropped (runs/partitions.py): a run's actions leave the log with the run.
    events = events.filter(Q(run_id__isnull=True) | Q(run__created_at__isnull=False))
    if not system:
        events = events.exclude(actor="system")
    actor, action, run = (request.GET.get(k, "").strip() for k in ("actor", "action", "run"))
    if actor:
        events = events.filter(actor=actor)
    if action:  # a bookmark of a renamed type still finds its events
        events = events.filter(type=RENAMED_EVENTS.get(action, action))
    if run:
        try:
            run_id = run_id_from(run)  # the short id the pages show is taken
        except BadFilter as exc:
            messages.error(request, str(exc))
            run_id = None
        events = events.filter(run_id=run_id) if run_id else events.none()
    # A page shows a few small fields of each payload: payloads past STEPGUARD_UI_MAX_PAGE in
    # all (a signal's data) are not read; the runs' values never are.
    page = list(bounded.sized(events.defer(*RUN_VALUES), ("payload",))[:300])
    bounded.fill(
        page,
        ("payload",),
        settings.STEPGUARD_UI_MAX_PAGE,
        lambda e, f: "",
        first_always=False,
        marker=lambda size, url: {},
    )
    return render(
        request,
        "runs/audit.html",
        {"events": page,
         "filters": {"actor": actor, "action": action, "run": run, "system": system}},
    )  # fmt: skip
